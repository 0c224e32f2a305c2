"""Benchmark: exact token-weighted gradient accumulation vs one big batch, and what accumulation costs in memory.

`python -m benchmarks accumulation --json` prints grad_max_rel_err (k token-weighted micro-batches vs
one batch of the same samples), naive_grad_max_rel_err (MiniMind's per-micro-batch mean / k), and the peak
memory of one optimizer step without (peak_bytes_accum1) and with (peak_bytes_accumK) accumulation, on
samples of data/pretrain.jsonl (varied lengths). Notebook 04 builds the same comparison in its own cells.
"""

from __future__ import annotations

import argparse
import copy
from typing import Sequence

import torch
from torch import nn

from minimind_lib.data import pad_collate, trained_tokens
from minimind_lib.device import get_device, synchronize
from minimind_lib.memory import MemoryMeter
from minimind_lib.model import MiniMindConfig, MiniMindForCausalLM
from minimind_lib.paths import DATA_DIR
from minimind_lib.cli import POSITIVE
from minimind_lib.profiles import PROFILES, get_profile
from minimind_lib.tokenizer import load_tokenizer
from minimind_lib.train import TrainConfig, accumulate_step, build_optimizer, resolve_amp

from .throughput import load_samples


def split(samples: Sequence[dict], k: int) -> list[dict]:
    """k collated micro-batches of consecutive samples (each padded to its own longest row)."""
    if len(samples) % k:
        raise ValueError(f"{len(samples)} samples do not split into k={k} equal micro-batches")
    m = len(samples) // k
    return [pad_collate(samples[i * m:(i + 1) * m]) for i in range(k)]


def gradients(model: nn.Module, micro_batches: Sequence[dict], *, normalization: str = "token",
              device: torch.device | str | None = None) -> torch.Tensor:
    """The flattened gradient of one optimizer step's loss over `micro_batches` (fp32, no AMP)."""
    model.zero_grad(set_to_none=True)
    accumulate_step(model, micro_batches, device=device, normalization=normalization)
    flat = torch.cat([p.grad.detach().flatten().float() for p in model.parameters() if p.grad is not None])
    model.zero_grad(set_to_none=True)
    return flat


def max_rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|: the worst element's error relative to the reference's scale."""
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def measure_step_peak(model: nn.Module, micro_batches: Sequence[dict], *, device: torch.device | str,
                      amp: str = "off", warmup: bool = True) -> int:
    """Peak bytes of one full optimizer step (forward, backward over all micro-batches, AdamW update).

    Runs on a deep copy of `model` so the caller's weights stay untouched. With `warmup`, one step runs
    first so AdamW's states exist, as in every step of a real run but the first.
    """
    device = torch.device(device)
    model = copy.deepcopy(model).to(device)
    opt = build_optimizer(model, TrainConfig(lr=1e-6, progress=False), device)
    settings = resolve_amp(amp, device, model.config.hidden_size)
    scaler = torch.amp.GradScaler(device.type) if settings.use_scaler else None

    def step() -> None:
        accumulate_step(model, micro_batches, amp_dtype=settings.dtype, scaler=scaler, device=device)
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad(set_to_none=True)

    if warmup:
        step()
    synchronize(device)
    meter = MemoryMeter(device)
    with meter.track(model, opt):
        meter.reset_peak()
        step()
    synchronize(device)
    peak = meter.peak()
    del model, opt
    return int(peak)


def main(argv: list[str]) -> dict:
    """Run the benchmark; return its JSON-ready result."""
    ap = argparse.ArgumentParser(prog="python -m benchmarks accumulation")
    ap.add_argument("--profile", default=None, choices=sorted(PROFILES), help="default: the selected profile")
    ap.add_argument("--device", default=None, help="cpu | cuda | mps (default: the best available)")
    ap.add_argument("--batch", type=POSITIVE, default=None, help="rows of the big batch (default: profile.batch_size x k)")
    ap.add_argument("--k", type=POSITIVE, default=None, help="micro-batches (default: profile.accum_steps)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    profile = get_profile(args.profile)
    device = get_device(args.device)
    k = profile.accum_steps if args.k is None else args.k
    batch = profile.batch_size * k if args.batch is None else args.batch
    if batch % k:
        raise ValueError(f"--batch {batch} is not a multiple of --k {k}")
    torch.manual_seed(args.seed)
    config = MiniMindConfig.preset(profile.model)
    model = MiniMindForCausalLM(config).to(device)
    # drawn from a pool of 8 x batch documents, so that lengths vary (a run of long documents would all be cut)
    samples, info = load_samples(DATA_DIR / "pretrain.jsonl", load_tokenizer(), profile.seq_len, batch,
                                 max_samples=max(8 * batch, 256), seed=args.seed)
    big = [pad_collate(samples)]
    micro = split(samples, k)

    g_big = gradients(model, big, device=device)
    g_tok = gradients(model, micro, device=device)
    g_naive = gradients(model, micro, device=device, normalization="naive")
    tokens_per_micro = [trained_tokens(mb["labels"]) for mb in micro]

    peak1 = measure_step_peak(model, big, device=device)
    peakk = measure_step_peak(model, micro, device=device)
    lengths = [len(s["input_ids"]) for s in samples]
    return {
        "grad_max_rel_err": max_rel_err(g_tok, g_big),
        "naive_grad_max_rel_err": max_rel_err(g_naive, g_big),
        "peak_bytes_accum1": peak1,
        "peak_bytes_accumK": peakk,
        "peak_ratio_accumK_vs_1": peakk / peak1,
        "k": k,
        "batch_rows": batch,
        "micro_batch_rows": batch // k,
        "tokens_per_micro_batch": tokens_per_micro,
        "sample_len_min": min(lengths),
        "sample_len_max": max(lengths),
        "data": info["data"],
        "device": device.type,
        "profile": profile.name,
        "config": config.to_dict(),
    }
