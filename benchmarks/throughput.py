"""Training throughput, model FLOPs utilisation, and ours vs MiniMind's recipe on the same batches.

    python -m benchmarks throughput --json [--config NAME] [--seq N] [--batch B] [--steps S] [--repeats R]
                                    [--baseline] [--ablation] [--compile] [--strategy budget|pack] [--levers]

What is timed: whole optimizer steps (host-to-device copies, forward, backward, clipping, optimizer) over
samples read from data/pretrain.jsonl and tokenized beforehand (both recipes get ready-made CPU batches, as a
DataLoader with workers would hand them over; the `dataloader_workers` lever measures the loader itself).

Ours: each optimizer step's samples are cut into token-budget micro-batches (rows x longest row <= max_tokens,
sorted by length, padded to the longest row, no attention mask: right padding under a causal mask is exact) or
packed rows (--strategy pack: block-causal mask, per-document positions); exact token-weighted accumulation
(train.accumulate_step); AMP from train.resolve_amp; AdamW with the library's parameter groups, fused where this
torch has a fused kernel for the device (CUDA and, since torch 2.4, CPU).
Baseline (--baseline): benchmarks.baseline, MiniMind's recipe on the same samples and the same number of
optimizer steps (pad to max length, per-micro-batch mean / accumulation_steps, fp16 autocast + GradScaler on CUDA
and fp32 on CPU, torch's default AdamW). The two are timed back to back, `--repeats` times, alternating which goes
first; ``ratio_useful_tokens_per_s`` is the median of the per-repeat (paired) ratios, all of which are reported
(``ratio_useful_tokens_per_s_runs``, with their min and max), tokens/s are medians. ``--ablation`` goes from the
recipe to ours one change at a time (our loop, then token budgets, then our dtype, then fused AdamW), each paired
ratio against the previous rung: what padding, dtype and optimizer each contribute.

Useful tokens are trained tokens, ``(labels[:, 1:] != -100).sum()``: both recipes train exactly the same ones.

FLOPs (PaLM appendix B, Chowdhery et al. 2022): per trained token, fwd + bwd,

    model_flops_per_token = 6 * N + 12 * L * d * T

N = every parameter, counted once (the tied embedding/lm_head matrix once). For a tied model that is exactly
the set of weights that take part in a matmul per token: the embedding lookup costs no FLOPs, but the same
matrix as the 6400-way lm_head costs 2 * V * d per token forward, which is N's V * d share. (Norm gains are
elementwise and add < 0.1 %.) L = layers, d = hidden size (query heads x head_dim), T = row length; the
12 * L * d * T term is QK^T and AV (4 * d * T forward per layer, x3 with backward), counted for the full
T x T square as PaLM does (causal masking halves the work a kernel must do; this is the standard convention).
``model_flops_per_token`` is reported at T = --seq. ``achieved_flops_per_s`` sums, per micro-batch, trained
tokens x (6N + 12 L d T_mb) with T_mb that micro-batch's row length, divided by the median step time: padding
is never counted as useful work. ``matmul_peak_flops_per_s`` is measured in the same process by a large square
matmul in the training dtype (bf16 on a bf16 GPU, fp32 on a CPU without native bf16): GPUs reach ~80% of their spec
in such a matmul, so ``fraction_of_matmul_peak`` reads higher than the usual MFU. ``mfu`` is the usual one, against
``spec_peak_flops_per_s``, the datasheet's dense peak of known GPUs (SPEC_PEAK_FLOPS; null on a CPU or an unknown GPU).
Packed rows (--strategy pack) are masked per document with batching.document_mask ("auto": FlexAttention on CUDA,
the dense block mask elsewhere; ``doc_attention`` says which).
"""

from __future__ import annotations

import argparse
import copy
import functools
import gc
import importlib.util
import math
import os
import re
import shutil
import statistics
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader

from minimind_lib.batching import TokenBudgetBatchSampler, collate_packed, document_mask, pack_sequences
from minimind_lib.data import IGNORE_INDEX, PretrainDataset, pad_collate, round_up, trained_tokens
from minimind_lib.device import device_name, get_device, synchronize, total_memory_bytes
from minimind_lib.memory import MemoryMeter, plan_micro_batches
from minimind_lib.model import MiniMindConfig, MiniMindForCausalLM, chunked_lm_loss, count_parameters, lm_loss
from minimind_lib.paths import DATA_DIR
from minimind_lib.profiles import PROFILES, get_profile
from minimind_lib.tokenizer import load_tokenizer
from minimind_lib.train import (TrainConfig, accumulate_step, build_optimizer, forward_logits, lr_at, optimizer_step,
                                resolve_amp)

from .baseline import BaselineRecipe, minimind_rows
STRATEGIES = ("budget", "pack")
LEVERS = ("fused_adamw", "sdpa_backend", "chunked_cross_entropy", "activation_checkpointing", "torch_compile",
          "pinned_memory", "dataloader_workers")
FLOPS_FORMULA = "6*N + 12*L*d*T (PaLM); N = all parameters counted once (tied embedding = lm_head matmul)"
# Datasheet dense (no sparsity) tensor-core peaks, FLOP/s, in the dtype named (bf16 with fp32 accumulation; T4: fp16,
# it has no bf16), matched as whole words of torch.cuda.get_device_name, the first match wins (so "H100 PCIe" before
# "H100", "RTX 5070 Ti" before "RTX 5070", and "L4" is not "L40S"). GeForce cards and the A10G accumulate fp32 at half
# the fp16-accumulate rate: their figure is that half (RTX 50: SMs x boost clock x 512, the whitepaper's 209.5 for a
# 5090).
SPEC_PEAK_FLOPS = (("H100 PCIe", 756e12, "bf16"), ("H100 NVL", 835e12, "bf16"), ("H100", 989e12, "bf16"),
                   ("H200 NVL", 835e12, "bf16"), ("H200", 989e12, "bf16"), ("A100", 312e12, "bf16"),
                   ("L40S", 362e12, "bf16"), ("L4", 121e12, "bf16"), ("A10G", 70e12, "bf16"), ("A10", 125e12, "bf16"),
                   ("RTX 5090", 209.5e12, "bf16"), ("RTX 5080", 112.6e12, "bf16"), ("RTX 5070 Ti", 87.9e12, "bf16"),
                   ("RTX 5070", 61.7e12, "bf16"), ("RTX 5060 Ti", 47.4e12, "bf16"), ("RTX 4090", 165e12, "bf16"),
                   ("RTX 3090", 71e12, "bf16"), ("T4", 65e12, "fp16"))


# --------------------------------------------------------------------------------------------- arguments


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """The benchmark's arguments; defaults come from the profile."""
    p = argparse.ArgumentParser(prog="python -m benchmarks throughput", description=__doc__.splitlines()[0])
    p.add_argument("--profile", default=None, choices=sorted(PROFILES), help="default: MINIMIND_PROFILE or auto")
    p.add_argument("--config", default=None, help="model preset (default: the profile's)")
    p.add_argument("--seq", type=int, default=None, help="max row length in tokens (default: profile.seq_len)")
    p.add_argument("--batch", type=int, default=None, help="baseline rows per micro-batch (default: profile.batch_size)")
    p.add_argument("--accum", type=int, default=None, help="micro-batches per optimizer step (default: profile.accum_steps)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="our micro-batch budget, rows x longest row (default: batch x seq, the baseline's size)")
    p.add_argument("--steps", type=int, default=3, help="optimizer steps per timed repeat")
    p.add_argument("--repeats", type=int, default=5,
                   help="timed repeats (alternating recipes): every paired ratio is reported, with median, min, max")
    p.add_argument("--strategy", default="budget", choices=STRATEGIES, help="our batching: token budget or packing")
    p.add_argument("--baseline", action="store_true", help="also time MiniMind's recipe on the same samples")
    p.add_argument("--ablation", action="store_true",
                   help="time the recipe-to-ours ladder instead: padding, dtype and optimizer separated (run_ablation)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile our model's trunk, rows bucketed (default: the profile's; eager if unavailable)")
    p.add_argument("--loss-chunk", type=int, default=None,
                   help="our chunked linear + cross-entropy, positions per chunk (default: the profile's; 0: off)")
    p.add_argument("--fused", default="auto", choices=("auto", "on", "off"),
                   help="our AdamW: auto = fused where this torch supports it on the device")
    p.add_argument("--levers", action="store_true", help="measure the speed/memory levers instead (see run_levers)")
    p.add_argument("--lever-repeats", type=int, default=5, help="alternating repeats per lever measurement")
    p.add_argument("--only", nargs="*", default=None, metavar="LEVER", help=f"with --levers: only these of {list(LEVERS)}")
    p.add_argument("--data", default=None, help="pretrain jsonl (default: data/pretrain.jsonl)")
    p.add_argument("--max-samples", type=int, default=None, help="lines read from the jsonl (default: profile.max_samples)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--device", default=None, help="cpu / cuda / mps (default: best available)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-memory", action="store_true", help="skip the (untimed) peak-memory step")
    args = p.parse_args(list(argv))
    for name in ("seq", "batch", "accum", "max_tokens", "steps", "repeats", "lever_repeats", "max_samples", "threads"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')}={value} must be >= 1")
    unknown = sorted(set(args.only or ()) - set(LEVERS))
    if unknown:
        raise ValueError(f"--only: unknown lever(s) {unknown}; choose from {list(LEVERS)}")
    if args.seq is not None and args.seq < 2:
        raise ValueError(f"--seq={args.seq} must be >= 2 (a row needs one prediction)")
    return args


# --------------------------------------------------------------------------------------------- data


def load_samples(path: str | Path, tokenizer, seq_len: int, n: int, *, max_samples: int | None = None,
                 seed: int = 0) -> tuple[list[dict], dict]:
    """`n` pretrain samples ({"input_ids", "labels"}, cut to seq_len): a seeded draw from the file's first max_samples.

    If the file has fewer samples than needed, it is cycled (a fresh permutation per pass); the returned info
    names the file and says how many distinct samples there were and how many passes it took. (The benchmarks'
    one sample loader: accumulation uses it too.)
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"pretrain data not found: {path} (build it with data/build_corpus.py or pass --data)")
    ds = PretrainDataset(path, tokenizer, seq_len, max_samples=max_samples)
    if len(ds) == 0:
        raise ValueError(f"{path}: no samples")
    rng = np.random.default_rng(seed)
    order: list[int] = []
    passes = 0
    while len(order) < n:
        order.extend(rng.permutation(len(ds)).tolist())
        passes += 1
    info = {"data": str(path), "distinct_samples": len(ds), "passes": passes,
            "truncated_in_file": int(ds.stats.n_truncated)}
    return [ds[i] for i in order[:n]], info


def micro_batch_tokens(micro_batches: Sequence[dict]) -> int:
    """Trained tokens of a step's collated micro-batches: data.trained_tokens of each (MiniMind rows: loss_mask)."""
    return sum(int(mb["loss_mask"].sum()) if "loss_mask" in mb else trained_tokens(mb["labels"])
               for mb in micro_batches)


def ours_micro_batches(samples: Sequence[dict], seq_len: int, max_tokens: int, strategy: str, pad_id: int,
                       pad_multiple: int | None = None) -> list[dict]:
    """Our micro-batches of one optimizer step's samples: token-budget groups or packed rows."""
    if strategy == "budget":  # each row counted at its length rounded up to pad_multiple, as it is padded
        lengths = [round_up(int(s["input_ids"].numel()), pad_multiple or 1, seq_len) for s in samples]
        sampler = TokenBudgetBatchSampler(lengths, max_tokens, shuffle=False, seq_len=seq_len)
        out = []
        for idx in sampler.batches():
            mb = pad_collate([samples[i] for i in idx], pad_id, seq_len, multiple=pad_multiple or 1)
            # Right padding + causal attention: no real token can see a pad, and pads carry label -100, so the
            # padding mask changes nothing we train on; without it SDPA keeps its fast is_causal kernels.
            mb.pop("attention_mask")
            out.append(mb)
        return out
    if strategy == "pack":
        packed, _ = pack_sequences(list(samples), seq_len, pad_id=pad_id)
        rows_per_mb = max(1, max_tokens // seq_len)
        n = packed["input_ids"].shape[0]
        out = []
        for start in range(0, n, rows_per_mb):
            rows = [{k: v[i] for k, v in packed.items()} for i in range(start, min(n, start + rows_per_mb))]
            out.append(collate_packed(rows, block_mask="auto"))  # the mask is made on the device (document_mask)
        return out
    raise ValueError(f"strategy={strategy!r}; choose one of {STRATEGIES}")


def baseline_micro_batches(samples: Sequence[dict], seq_len: int, batch: int, pad_id: int) -> list[dict]:
    """MiniMind's micro-batches of one optimizer step: consecutive `batch` samples padded to seq_len."""
    return [minimind_rows(samples[i:i + batch], seq_len, pad_id) for i in range(0, len(samples), batch)]


# --------------------------------------------------------------------------------------------- FLOPs


def model_flops_per_token(config, n_params: int, seq_len: int) -> int:
    """6N + 12 L d T: training FLOPs per token at row length T (see the module docstring)."""
    return 6 * n_params + 12 * config.num_hidden_layers * config.hidden_size * seq_len


def useful_flops(micro_batches: Sequence[dict], config, n_params: int) -> float:
    """Sum over micro-batches of trained tokens x model_flops_per_token(row length of that micro-batch)."""
    total = 0.0
    for mb in micro_batches:
        t = (mb["X"] if "loss_mask" in mb else mb["input_ids"]).shape[1]
        total += micro_batch_tokens([mb]) * model_flops_per_token(config, n_params, t)
    return total


def doc_attention(device: torch.device) -> str:
    """The kernel that masks packed rows here: what batching.document_mask("auto") builds on this device."""
    return "dense" if torch.is_tensor(document_mask(torch.zeros(1, 8, dtype=torch.long, device=device))) else "flex"


def spec_peak(name: str) -> tuple[float | None, str | None]:
    """(FLOP/s, dtype) of a device named `name` from SPEC_PEAK_FLOPS, or (None, None) for a CPU or an unknown GPU."""
    found = (row for row in SPEC_PEAK_FLOPS if re.search(rf"\b{re.escape(row[0])}\b", name))
    return next(((flops, dtype) for _, flops, dtype in found), (None, None))


def ratio_stats(name: str, ratios: Sequence[float]) -> dict:
    """Every paired ratio of a comparison, with their median, min and max (a median of two is only their mean)."""
    return {name: statistics.median(ratios), f"{name}_runs": [float(r) for r in ratios], f"{name}_min": min(ratios),
            f"{name}_max": max(ratios)}


def measure_matmul_peak(device: torch.device, dtype: torch.dtype, n: int | None = None, iters: int | None = None) -> float:
    """FLOP/s of the best of several large square matmuls (2 n^3 FLOPs each) in `dtype` on `device`."""
    n = n or (8192 if device.type == "cuda" else 1024)
    iters = iters or (20 if device.type == "cuda" else 3)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(2):
        a @ b
    best = math.inf
    for _ in range(3):
        synchronize(device)
        t0 = time.perf_counter()
        for _ in range(iters):
            a @ b
        synchronize(device)
        best = min(best, (time.perf_counter() - t0) / iters)
    del a, b
    return 2 * n**3 / best


# --------------------------------------------------------------------------------------------- our recipe


def fused_adamw_supported(device: torch.device) -> bool:
    """Whether torch.optim.AdamW(fused=True) runs on this device in this torch."""
    try:
        p = nn.Parameter(torch.zeros(2, device=device))
        p.grad = torch.zeros_like(p)
        torch.optim.AdamW([p], fused=True).step()
        return True
    except (RuntimeError, ValueError, TypeError):
        return False


def make_optimizer(model: nn.Module, cfg, device: torch.device, fused: str = "auto") -> tuple[torch.optim.Optimizer, str]:
    """train.build_optimizer's AdamW (same groups and hyper-parameters), with the fused kernel where supported."""
    opt = build_optimizer(model, cfg, device)
    want = fused == "on" or (fused == "auto" and fused_adamw_supported(device))
    is_fused = bool(opt.defaults.get("fused"))
    if want and not is_fused:
        if not fused_adamw_supported(device):
            raise ValueError(f"--fused on: torch {torch.__version__} has no fused AdamW on {device.type}")
        groups = [{k: v for k, v in g.items() if k != "fused"} for g in opt.param_groups]
        opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, fused=True)
    elif fused == "off" and is_fused:
        groups = [{k: v for k, v in g.items() if k != "fused"} for g in opt.param_groups]
        opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps)
    impl = "fused" if opt.defaults.get("fused") else ("foreach" if opt.defaults.get("foreach") else "default")
    return opt, impl


class OursRecipe:
    """The library's recipe for one model: exact token-weighted accumulation, resolve_amp, AdamW, clipping."""

    def __init__(self, model: nn.Module, device: torch.device, lr: float, total_steps: int, fused: str = "auto",
                 amp: str = "auto", loss_chunk: int = 0):
        self.model, self.device = model, device
        self.cfg = TrainConfig(lr=lr, max_steps=max(1, total_steps), warmup_steps=1, progress=False, amp=amp,
                               loss_chunk=loss_chunk)
        self.amp = resolve_amp(self.cfg.amp, device, model.config.hidden_size)
        self.scaler = torch.amp.GradScaler(device.type) if self.amp.use_scaler else None
        self.optimizer, self.optimizer_impl = make_optimizer(model, self.cfg, device, fused)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.step = 0

    def train_step(self, micro_batches: Sequence[dict]) -> dict:
        """One optimizer step over the micro-batches (what train.fit does per step between its log points: nothing is
        read back from the device; a fused AdamW skips a NaN/inf step on the device, another reads the verdict)."""
        lr = lr_at(self.step, lr=self.cfg.lr, min_lr=self.cfg.min_lr, warmup_steps=self.cfg.warmup_steps,
                   max_steps=self.cfg.max_steps)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        stats = accumulate_step(self.model, micro_batches, amp_dtype=self.amp.dtype, scaler=self.scaler,
                                device=self.device, sync=False, loss_chunk=self.cfg.loss_chunk)
        optimizer_step(self.optimizer, self.params, self.cfg.grad_clip, self.scaler, stats["loss_sum"])
        self.step += 1
        return stats


def try_compile(model: nn.Module, device: torch.device, dynamic: bool | None = None) -> tuple[nn.Module, str]:
    """torch.compile(model) if a backend can run here, else the model itself and 'compile unavailable: <reason>'.

    dynamic=True compiles once for symbolic shapes (token-budget batches change shape every micro-batch);
    None lets torch decide (static first, dynamic after a recompile).
    """
    if not hasattr(torch, "compile"):
        return model, "compile unavailable: this torch has no torch.compile"
    if device.type == "cuda" and importlib.util.find_spec("triton") is None:
        return model, "compile unavailable: triton is not installed (inductor needs it on CUDA)"
    if device.type == "cpu" and not (shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")):
        return model, "compile unavailable: no C++ compiler on PATH (inductor needs one on CPU)"
    try:
        return torch.compile(model, dynamic=dynamic), "compiled"
    except Exception as exc:  # noqa: BLE001 - any backend failure means: run eager, and say why
        return model, f"compile unavailable: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"


# --------------------------------------------------------------------------------------------- memory


def peak_memory_of(fn: Callable[[], object], device: torch.device, *tracked) -> int:
    """Peak bytes while fn() runs: CUDA allocator peak, or MemoryMeter's live-tensor peak on CPU (untimed)."""
    gc.collect()
    meter = MemoryMeter(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        meter.reset_peak()
        fn()
        torch.cuda.synchronize(device)
        return int(meter.peak())
    if device.type != "cpu":
        fn()
        return -1  # no allocator counters on this device type
    with meter.track(*tracked):
        meter.reset_peak()
        fn()
    return int(meter.peak())


# --------------------------------------------------------------------------------------------- setup


def _setup(args: argparse.Namespace):
    """Profile, device, config, tokenizer, samples grouped per step, and both recipes' micro-batches."""
    profile = get_profile(args.profile)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = get_device(args.device)
    preset = args.config or profile.model
    config = MiniMindConfig.preset(preset)
    seq = args.seq or profile.seq_len
    if seq > config.max_position_embeddings:
        raise ValueError(f"--seq={seq} exceeds max_position_embeddings={config.max_position_embeddings} of preset {preset!r}")
    batch = args.batch or profile.batch_size
    accum = args.accum or profile.accum_steps
    max_tokens = args.max_tokens or batch * seq
    if max_tokens < seq:
        raise ValueError(f"--max-tokens={max_tokens} is smaller than --seq={seq}: a full-length row would not fit")
    tok = load_tokenizer()
    per_step = batch * accum
    data = Path(args.data) if args.data else DATA_DIR / "pretrain.jsonl"
    max_samples = args.max_samples if args.max_samples is not None else profile.max_samples
    samples, data_info = load_samples(data, tok, seq, per_step * args.steps, max_samples=max_samples, seed=args.seed)
    groups = [samples[i * per_step:(i + 1) * per_step] for i in range(args.steps)]
    speed = speed_settings(args, profile, device, seq)
    ours = [ours_micro_batches(g, seq, max_tokens, args.strategy, tok.pad_token_id, speed["row_multiple"])
            for g in groups]
    base = [baseline_micro_batches(g, seq, batch, tok.pad_token_id) for g in groups]
    for i, (o, b) in enumerate(zip(ours, base)):
        n_o, n_b = micro_batch_tokens(o), micro_batch_tokens(b)
        if args.strategy == "budget" and n_o != n_b:  # same samples, same shift: must train the same tokens
            raise RuntimeError(f"step {i}: ours trains {n_o} tokens, the baseline {n_b}; the batching lost tokens")
    return dict(profile=profile, device=device, preset=preset, config=config, seq=seq, batch=batch, accum=accum,
                max_tokens=max_tokens, tok=tok, groups=groups, ours=ours, base=base, data_info=data_info, **speed)


def speed_settings(args: argparse.Namespace, profile, device: torch.device, seq: int) -> dict:
    """compile, loss_chunk and row_multiple of our recipe: the flags, else the profile's. Compiled, rows are padded
    to the profile's row_multiple (a few shapes); eager, to 8 on CUDA (tensor cores), not at all on a CPU."""
    compiled = profile.compile if args.compile is None else args.compile
    eager_multiple = 8 if device.type == "cuda" else None  # tensor cores like multiples of 8; a CPU does not care
    return {"compile": compiled, "loss_chunk": profile.loss_chunk if args.loss_chunk is None else args.loss_chunk,
            "row_multiple": profile.row_multiple if compiled else eager_multiple}


def _new_model(config, device: torch.device, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return MiniMindForCausalLM(config).to(device).train()


def _timed(fn: Callable[[], object], device: torch.device) -> float:
    synchronize(device)
    t0 = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - t0


# --------------------------------------------------------------------------------------------- the benchmark


def run_throughput(args: argparse.Namespace) -> dict:
    """Time our recipe (and with --baseline MiniMind's) on the same samples; tokens/s, FLOPs, memory."""
    s = _setup(args)
    device, config = s["device"], s["config"]
    profile = s["profile"]
    model = _new_model(config, device, args.seed)
    n_params = count_parameters(model)["total"]
    base_model = copy.deepcopy(model) if args.baseline else None  # same initial weights for both recipes

    total_steps = args.steps * (args.repeats + 1)
    ours = OursRecipe(model, device, profile.lr, total_steps, args.fused, loss_chunk=s["loss_chunk"])
    compile_status, trunk = "off", model.model
    if s["compile"]:  # the trunk, as pipeline.pretrain compiles it (the chunked loss stays eager)
        model.model, compile_status = try_compile(trunk, device)

    def run_ours() -> None:
        for mbs in s["ours"]:
            ours.train_step(mbs)

    baseline = None
    if args.baseline:
        baseline = BaselineRecipe(base_model, device, lr=profile.lr, accumulation_steps=s["accum"],
                                  total_steps=total_steps * s["accum"])

    def run_base() -> None:
        for mbs in s["base"]:
            baseline.train_step(mbs)

    # Warm-up (untimed): allocator, kernel choice, and compilation. A compiled model sees every step's
    # shapes here, so no (re)compilation lands in the timed repeats; a compile failure falls back to eager.
    t0 = time.perf_counter()
    try:
        if compile_status == "compiled":
            run_ours()
        else:
            ours.train_step(s["ours"][0])
    except Exception as exc:  # noqa: BLE001
        if compile_status != "compiled":
            raise
        compile_status = f"compile unavailable: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        model.model = trunk
        ours.optimizer.zero_grad(set_to_none=True)
        ours.train_step(s["ours"][0])
    warmup_s = time.perf_counter() - t0
    if baseline is not None:
        baseline.train_step(s["base"][0])

    times_ours, times_base = [], []
    for r in range(args.repeats):
        order = [("ours", run_ours), ("base", run_base)] if baseline is not None else [("ours", run_ours)]
        if r % 2 == 1:
            order.reverse()  # alternate who goes first, so drift on a shared machine hits both alike
        for name, fn in order:
            (times_ours if name == "ours" else times_base).append(_timed(fn, device))

    tokens = sum(micro_batch_tokens(m) for m in s["ours"])
    padded = sum(mb["input_ids"].numel() for m in s["ours"] for mb in m)
    t_ours = statistics.median(times_ours)
    flops = sum(useful_flops(m, config, n_params) for m in s["ours"])
    amp_dtype = ours.amp.dtype or torch.float32
    peak_mm = measure_matmul_peak(device, amp_dtype)
    spec, spec_dtype = spec_peak(device_name(device))  # (None, None) on a CPU
    result = {
        "benchmark": "throughput",
        "device": device.type,
        "device_name": device_name(device),
        "profile": profile.name,
        "torch": torch.__version__,
        "config": {"preset": s["preset"], **config.to_dict()},
        "n_params": n_params,
        "seq": s["seq"], "batch": s["batch"], "accum": s["accum"], "max_tokens": s["max_tokens"],
        "steps": args.steps, "repeats": args.repeats, "strategy": args.strategy,
        "threads": torch.get_num_threads() if device.type == "cpu" else None,
        "amp": ours.amp.name, "optimizer": f"AdamW ({ours.optimizer_impl})", "compile": compile_status,
        "loss_chunk": s["loss_chunk"], "row_multiple": s["row_multiple"],
        "warmup_seconds": round(warmup_s, 3),
        "tokens_per_s": tokens / t_ours,
        "trained_tokens_per_repeat": tokens,
        "processed_tokens_per_s": padded / t_ours,
        "padding_fraction": 1 - sum(int((mb["labels"] != IGNORE_INDEX).sum()) for m in s["ours"] for mb in m) / padded,
        "micro_batches_per_step": sum(len(m) for m in s["ours"]) / len(s["ours"]),
        "model_flops_per_token": model_flops_per_token(config, n_params, s["seq"]),
        "flops_formula": FLOPS_FORMULA,
        "achieved_flops_per_s": flops / t_ours,
        "matmul_peak_flops_per_s": peak_mm,
        "matmul_dtype": str(amp_dtype).replace("torch.", ""),
        "fraction_of_matmul_peak": flops / t_ours / peak_mm,
        "spec_peak_flops_per_s": spec, "spec_peak_dtype": spec_dtype,
        "mfu": flops / t_ours / spec if spec else None,
        "doc_attention": doc_attention(device) if args.strategy == "pack" else None,
        "seconds_per_repeat": [round(t, 4) for t in times_ours],
        **s["data_info"],
    }
    if baseline is not None:
        t_base = statistics.median(times_base)
        base_tokens = sum(micro_batch_tokens(m) for m in s["base"])
        base_flops = sum(useful_flops(m, config, n_params) for m in s["base"])
        # Each repeat times the two recipes back to back, so its ratio sees the same machine load; the
        # median of those paired ratios is the headline (robust to load drift between repeats).
        paired = [(tokens / to) / (base_tokens / tb) for to, tb in zip(times_ours, times_base)]
        result.update({
            "ours_tokens_per_s": tokens / t_ours,
            "baseline_tokens_per_s": base_tokens / t_base,
            **ratio_stats("ratio_useful_tokens_per_s", paired),
            "ratio_of_median_tokens_per_s": (tokens / t_ours) / (base_tokens / t_base),
            "baseline_trained_tokens_per_repeat": base_tokens,
            "baseline_padding_fraction": 1 - base_tokens / sum(mb["X"].numel() for m in s["base"] for mb in m),
            "baseline_amp": baseline.amp_name,
            "baseline_optimizer": "AdamW (torch default)",
            "baseline_achieved_flops_per_s": base_flops / t_base,
            "baseline_fraction_of_matmul_peak": base_flops / t_base / peak_mm,
            "baseline_mfu": base_flops / t_base / spec if spec else None,
            "baseline_seconds_per_repeat": [round(t, 4) for t in times_base],
        })
    if not args.no_memory:
        result["peak_memory_bytes"] = peak_memory_of(lambda: ours.train_step(s["ours"][0]), device,
                                                     model, ours.optimizer, s["ours"][0])
        if baseline is not None:
            result["baseline_peak_memory_bytes"] = peak_memory_of(lambda: baseline.train_step(s["base"][0]), device,
                                                                  base_model, baseline.optimizer, s["base"][0])
    else:
        result["peak_memory_bytes"] = None
    return result


# --------------------------------------------------------------------------------------------- levers


def enable_activation_checkpointing(model: nn.Module, n_layers: int | None = None) -> int:
    """Recompute the first `n_layers` blocks' activations in backward (all if None); returns how many.

    The block's forward is wrapped on the instance, so parameter names (and checkpoints) do not change.
    """
    layers = model.model.layers
    n = len(layers) if n_layers is None else max(0, min(int(n_layers), len(layers)))
    for layer in list(layers)[:n]:
        if getattr(layer, "_checkpointed", False):
            continue
        inner = layer.forward

        def forward(*a, _inner=inner, **kw):
            return checkpoint(_inner, *a, use_reentrant=False, **kw)

        layer.forward = forward
        layer._checkpointed = True
    return n


def _alternate(fns: dict[str, Callable[[], object]], device: torch.device, repeats: int) -> dict[str, float]:
    """Median seconds of each fn, timed in rotating order `repeats` times after one warm-up each."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    names = list(fns)
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            times[name].append(_timed(fns[name], device))
    return {k: statistics.median(v) for k, v in times.items()}


def _fwd_bwd(model: nn.Module, mb: dict, amp_dtype, device: torch.device, loss_fn=None) -> Callable[[], None]:
    """A closure: forward + sum-loss + backward on one micro-batch, grads dropped afterwards."""
    mb = {k: v.to(device) if torch.is_tensor(v) else v for k, v in mb.items()}

    def run() -> None:
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            if loss_fn is None:  # forward_logits: a packed micro-batch's document mask is made on the device
                loss = lm_loss(forward_logits(model, mb, amp_dtype), mb["labels"], reduction="sum")
            else:
                loss = loss_fn(model, mb)
        loss.backward()
        model.zero_grad(set_to_none=True)

    return run


def measure_dataloader(dataset, collate_fn, batch_size: int, num_workers: int = 0, epochs: int = 1,
                       max_batches: int | None = None) -> dict:
    """Samples/s of iterating a DataLoader `epochs` times, worker start-up included (as a training run pays it)."""
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=True, collate_fn=collate_fn, num_workers=num_workers,
                        pin_memory=torch.cuda.is_available(), generator=torch.Generator().manual_seed(0))
    # HF tokenizers warns (and disables itself) in a forked worker if TOKENIZERS_PARALLELISM is unset
    old = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    n_samples, t0 = 0, time.perf_counter()
    try:
        for _ in range(epochs):
            for k, batch in enumerate(loader):
                n_samples += batch["input_ids"].shape[0]
                if max_batches is not None and k + 1 >= max_batches:
                    break
    finally:
        if old is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = old
    seconds = time.perf_counter() - t0
    return {"num_workers": num_workers, "samples": n_samples, "seconds": seconds,
            "samples_per_s": n_samples / seconds if seconds > 0 else float("nan")}


def run_levers(args: argparse.Namespace) -> dict:
    """Each lever as a ratio measured in this process (alternating repeats), with peak memory where it matters."""
    s = _setup(args)
    device, config, profile = s["device"], s["config"], s["profile"]
    amp = resolve_amp("auto", device, config.hidden_size)
    dt = amp.dtype
    reps = args.lever_repeats
    model = _new_model(config, device, args.seed)
    big = max(s["ours"][0], key=lambda mb: mb["input_ids"].numel())  # our largest micro-batch of step 0
    full = s["base"][0][0]  # a MiniMind row batch (batch x seq)
    full_mb = {"input_ids": torch.cat([full["X"], full["Y"][:, -1:]], 1)}
    full_mb["labels"] = full_mb["input_ids"].masked_fill(
        torch.cat([torch.ones_like(full["loss_mask"][:, :1]), full["loss_mask"]], 1) == 0, IGNORE_INDEX)
    levers: dict[str, dict] = {}

    def want(name: str) -> bool:
        return not args.only or name in args.only

    # 1. fused AdamW: optimizer.step() alone, and its share of a training step.
    if want("fused_adamw"):
        params = [p for p in model.parameters()]
        for p in params:
            p.grad = torch.randn_like(p) * 1e-3
        impls = {"default": {}, "foreach": {"foreach": True}}
        if fused_adamw_supported(device):
            impls["fused"] = {"fused": True}
        opts = {k: torch.optim.AdamW(params, lr=1e-4, **kw) for k, kw in impls.items()}
        fns = {k: (lambda o=o: o.step()) for k, o in opts.items()}
        fns["fwd_bwd"] = _fwd_bwd(copy.deepcopy(model), big, dt, device)  # a copy: its zero_grad must not touch ours
        t = _alternate(fns, device, reps)
        step_t = t.pop("fwd_bwd")
        model.zero_grad(set_to_none=True)
        del opts, fns
        levers["fused_adamw"] = {
            "seconds_ratio_vs_default": {k: v / t["default"] for k, v in t.items()},
            "default_step_share_of_one_micro_batch_fwd_bwd": t["default"] / step_t,
            "fused_available": "fused" in t,
            "note": "optimizer.step() time relative to torch's default AdamW (MiniMind's); the share says how much "
                    "of one micro-batch's forward+backward the default step costs (paid once per optimizer step)",
        }

    # 2. SDPA backend, and the padding mask that would force the masked (slower) path.
    if want("sdpa_backend"):
        backends = {"default": None, "math": [SDPBackend.MATH]}
        if device.type == "cuda":
            backends.update({"flash": [SDPBackend.FLASH_ATTENTION], "efficient": [SDPBackend.EFFICIENT_ATTENTION],
                             "cudnn": [SDPBackend.CUDNN_ATTENTION]})
        else:
            backends["flash"] = [SDPBackend.FLASH_ATTENTION]
        fns = {}
        base_fn = _fwd_bwd(model, big, dt, device)
        for name, kinds in backends.items():
            def run(kinds=kinds):
                with (sdpa_kernel(kinds) if kinds else nullcontext()):
                    base_fn()
            try:
                run()
                fns[name] = run
            except RuntimeError as exc:
                levers.setdefault("sdpa_backend_unavailable", {})[name] = str(exc).splitlines()[0][:160]
        # MiniMind-style "causal AND key is not padding" as an explicit (B, 1, T, T) mask. (A 2-D mask of
        # right-padded rows would measure nothing: model.build_attention_mask drops it for the is_causal path.)
        masked = {k: v for k, v in big.items() if k != "block_mask"}  # packed rows: this mask instead
        T = big["input_ids"].shape[1]
        real = big["labels"] != IGNORE_INDEX
        real[:, 0] = True
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        masked["attention_mask"] = causal[None, None] & real[:, None, None, :]
        fns["default_with_padding_mask"] = _fwd_bwd(model, masked, dt, device)
        t = _alternate(fns, device, reps)
        levers["sdpa_backend"] = {
            "seconds_ratio_vs_default": {k: v / t["default"] for k, v in t.items()},
            "micro_batch_shape": list(big["input_ids"].shape),
            "note": "forward+backward of one micro-batch under each SDPA backend; with_padding_mask passes causal AND "
                    "key-padding as an explicit (B,1,T,T) mask, which our right-padded batches do not need "
                    "(it forces an explicit-mask kernel)",
        }

    # 3. chunked linear + cross-entropy (model.chunked_lm_loss): peak memory and time, full logits vs chunks.
    if want("chunked_cross_entropy"):
        def chunked_loss(m, mb, chunk=s["loss_chunk"] or max(256, s["seq"] * 4)):
            h, _ = m.model(mb["input_ids"])
            return chunked_lm_loss(h, m.lm_head.weight, mb["labels"], chunk)

        with torch.no_grad():
            dev_mb = {k: v.to(device) for k, v in full_mb.items()}
            with torch.autocast(device.type, dtype=dt, enabled=dt is not None):
                ref = float(lm_loss(model(dev_mb["input_ids"]).logits, dev_mb["labels"], reduction="sum"))
                got = float(chunked_loss(model, dev_mb))
        fn_full = _fwd_bwd(model, full_mb, dt, device)
        fn_chunk = _fwd_bwd(model, full_mb, dt, device, loss_fn=chunked_loss)
        t = _alternate({"full_logits": fn_full, "chunked": fn_chunk}, device, reps)
        mem_full = peak_memory_of(fn_full, device, model, full_mb)
        mem_chunk = peak_memory_of(fn_chunk, device, model, full_mb)
        levers["chunked_cross_entropy"] = {
            "seconds_ratio_chunked_vs_full": t["chunked"] / t["full_logits"],
            "peak_memory_bytes_full": mem_full, "peak_memory_bytes_chunked": mem_chunk,
            "peak_memory_ratio_chunked_vs_full": mem_chunk / mem_full if mem_full > 0 else None,
            "loss_rel_diff": abs(got - ref) / max(abs(ref), 1e-12),
            "micro_batch_shape": list(full_mb["input_ids"].shape),
            "loss_chunk": s["loss_chunk"] or max(256, s["seq"] * 4),
            "note": "forward+backward of a MiniMind-size micro-batch (batch x seq); chunked = the head and the loss "
                    "loss_chunk positions at a time, their gradients made in the forward (model.chunked_lm_loss)",
        }

    # 4. activation checkpointing: time and peak memory for 0, half, all blocks recomputed.
    if want("activation_checkpointing"):
        L = config.num_hidden_layers
        ks = sorted({0, L // 2, L})
        copies = {}
        for k in ks:
            copies[k] = copy.deepcopy(model)
            enable_activation_checkpointing(copies[k], k)
        fns = {k: _fwd_bwd(m, full_mb, dt, device) for k, m in copies.items()}
        t = _alternate(fns, device, reps)  # alternated, so machine load hits every point alike
        mem = {k: peak_memory_of(fns[k], device, copies[k], full_mb) for k in ks}
        curve = [{"checkpointed_layers": k, "seconds_ratio": t[k] / t[0], "peak_memory_bytes": mem[k],
                  "peak_memory_ratio": mem[k] / mem[0] if mem[0] > 0 else None} for k in ks]
        del copies, fns
        levers["activation_checkpointing"] = {"curve": curve, "note": "ratios vs no checkpointing, same micro-batch"}

    # 5. torch.compile (only with --compile: compiling is slow on a small CPU).
    if want("torch_compile"):
        if args.compile:
            m = copy.deepcopy(model)
            compiled, status = try_compile(m, device)
            entry = {"status": status}
            if status == "compiled":
                try:
                    t_c = time.perf_counter()
                    _fwd_bwd(compiled, full_mb, dt, device)()
                    entry["compile_seconds"] = time.perf_counter() - t_c
                    t = _alternate({"eager": _fwd_bwd(model, full_mb, dt, device),
                                    "compiled": _fwd_bwd(compiled, full_mb, dt, device)}, device, reps)
                    entry["seconds_ratio_compiled_vs_eager"] = t["compiled"] / t["eager"]
                except Exception as exc:  # noqa: BLE001
                    entry["status"] = f"compile unavailable: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            levers["torch_compile"] = entry
        else:
            levers["torch_compile"] = {"status": "not measured (pass --compile)"}

    # 6. pinned memory + non_blocking host-to-device copies (only a thing with a GPU).
    if want("pinned_memory"):
        if device.type == "cuda":
            host = {k: v.clone() for k, v in full_mb.items()}
            pinned = {k: v.pin_memory() for k, v in full_mb.items()}
            t = _alternate({"pageable": lambda: [v.to(device) for v in host.values()],
                            "pinned_non_blocking": lambda: [v.to(device, non_blocking=True) for v in pinned.values()]},
                           device, max(reps, 10))
            levers["pinned_memory"] = {"seconds_ratio_pinned_vs_pageable": t["pinned_non_blocking"] / t["pageable"],
                                       "pageable_copy_share_of_fwd_bwd":
                                       t["pageable"] / _alternate({"x": _fwd_bwd(model, full_mb, dt, device)},
                                                                  device, 1)["x"]}
        else:
            levers["pinned_memory"] = {"status": f"not applicable on {device.type}: pinning only speeds host-to-GPU copies"}

    # 7. DataLoader workers: MiniMind-style lazy tokenization in __getitem__, 0 vs 2 workers, vs training speed.
    if want("dataloader_workers"):
        data = Path(args.data) if args.data else DATA_DIR / "pretrain.jsonl"
        lazy = PretrainDataset(data, s["tok"], s["seq"], max_samples=min(2000, args.max_samples or 2000), lazy=True)
        collate = functools.partial(pad_collate, pad_id=s["tok"].pad_token_id, seq_len=s["seq"], fixed=True)
        n_batches = max(2, min(20, len(lazy) // s["batch"]))
        loader = {w: measure_dataloader(lazy, collate, s["batch"], num_workers=w, epochs=1, max_batches=n_batches)
                  for w in (0, 2)}
        train_samples_per_s = s["batch"] / _alternate({"x": _fwd_bwd(model, full_mb, dt, device)}, device, 1)["x"]
        levers["dataloader_workers"] = {
            "samples_per_s": {f"workers_{w}": r["samples_per_s"] for w, r in loader.items()},
            "training_samples_per_s_fwd_bwd": train_samples_per_s,
            "note": "lazy (tokenize-in-__getitem__) loader throughput incl. worker start-up, vs how fast one "
                    "forward+backward consumes samples; the loader only matters if it is slower than training",
        }

    return {"benchmark": "throughput-levers", "device": device.type, "device_name": device_name(device),
            "profile": profile.name, "torch": torch.__version__, "config": {"preset": s["preset"], **config.to_dict()},
            "seq": s["seq"], "batch": s["batch"], "amp": amp.name,
            "threads": torch.get_num_threads() if device.type == "cpu" else None,
            "lever_repeats": reps, "levers": levers}


# --------------------------------------------------------------------------------------------- ablation

ABLATION = (  # (lever, what changes at this rung), from MiniMind's recipe to ours, one change at a time
    ("loop", "the library's loop (token-weighted accumulation, parameter groups), the recipe's rows, dtype, AdamW"),
    ("padding", "token-budget micro-batches (or packed rows) instead of rows padded to seq"),
    ("dtype", "train.resolve_amp's autocast instead of the recipe's (fp16 + GradScaler on CUDA, fp32 on CPU)"),
    ("optimizer", "fused AdamW (also skips a NaN/inf step on the device) instead of torch's default"),
    ("chunked_loss", "the head and the loss loss_chunk positions at a time (model.chunked_lm_loss): no whole logits"),
    ("micro_batch", "the step's rows in the fewest micro-batches memory.plan_micro_batches fits in 60% of the device"),
    ("compile", "torch.compile of the trunk, rows padded to a multiple of row_multiple (a few shapes)"))


def ablation_rungs(s: dict, args: argparse.Namespace, model: nn.Module) -> dict:
    """Each rung's recipe and batches: MiniMind's, then ours one change at a time (ABLATION), from the same weights.
    The recipe's rows (and the `loop` rung's) are each step's samples in order; ours are the same samples, all the
    repeat's sorted into token-budget micro-batches (as the run's sampler sorts a megabatch), accum to a step."""
    device, profile, batch, pad, seq = s["device"], s["profile"], s["batch"], s["tok"].pad_token_id, s["seq"]
    recipe_amp = "fp16" if device.type == "cuda" else "off"  # MiniMind: torch.cuda.amp.autocast() on CUDA only
    chunk = s["loss_chunk"] or profile.loss_chunk or 1024
    eager_multiple, multiple = (8 if device.type == "cuda" else None), profile.row_multiple
    amp = resolve_amp("auto", device, s["config"].hidden_size).name
    rows, k = plan_micro_batches(s["config"], seq, batch * s["accum"], int(0.6 * total_memory_bytes(device)),
                                 {"fp32": "off"}.get(amp, amp), chunk)
    fixed = [[{k: v for k, v in pad_collate(g[i:i + batch], pad, seq, fixed=True).items() if k != "attention_mask"}
              for i in range(0, len(g), batch)] for g in s["groups"]]
    pool = [sample for g in s["groups"] for sample in g]  # ours: sorted across the repeat, as the run's sampler

    def steps_of(max_tokens: int, per_step: int, pad_multiple: int | None) -> list[list[dict]]:
        micro = ours_micro_batches(pool, seq, max_tokens, args.strategy, pad, pad_multiple)
        return [micro[i:i + per_step] for i in range(0, len(micro), per_step)]
    budget = steps_of(s["max_tokens"], s["accum"], eager_multiple)
    planned, bucketed = steps_of(rows * seq, k, eager_multiple), steps_of(rows * seq, k, multiple)
    total = args.steps * (args.repeats + 1)
    rungs = {"recipe": (BaselineRecipe(copy.deepcopy(model), device, lr=profile.lr, accumulation_steps=s["accum"],
                                       total_steps=total * s["accum"]), s["base"])}
    for lever, amp_mode, fused, loss_chunk, batches in (
            ("loop", recipe_amp, "off", 0, fixed), ("padding", recipe_amp, "off", 0, budget),
            ("dtype", "auto", "off", 0, budget), ("optimizer", "auto", args.fused, 0, budget),
            ("chunked_loss", "auto", args.fused, chunk, budget), ("micro_batch", "auto", args.fused, chunk, planned),
            ("compile", "auto", args.fused, chunk, bucketed)):
        rungs[lever] = (OursRecipe(copy.deepcopy(model), device, profile.lr, total, fused, amp_mode, loss_chunk),
                        batches)
    return {"rungs": rungs, "loss_chunk": chunk, "planned_rows_accum": [rows, k], "row_multiple": multiple}


def run_ablation(args: argparse.Namespace) -> dict:
    """The recipe, then ours one lever at a time, timed in rotating order on the same samples from the same weights;
    each lever's paired ratios (its rung's useful tokens/s over the previous rung's), and ours over the recipe.
    The compile rung's warm-up (compilation, every step's shapes once) is timed apart and never in a repeat."""
    s = _setup(args)
    device, config, profile, batch = s["device"], s["config"], s["profile"], s["batch"]
    model = _new_model(config, device, args.seed)
    ladder = ablation_rungs(s, args, model)
    rungs = ladder["rungs"]
    compiled = rungs["compile"][0].model
    trunk = compiled.model
    compiled.model, compile_status = try_compile(trunk, device)
    tokens = {name: sum(micro_batch_tokens(m) for m in batches) for name, (_, batches) in rungs.items()}
    run = {name: (lambda r=r, batches=batches: [r.train_step(mbs) for mbs in batches]) for name, (r, batches) in rungs.items()}
    peak = {name: peak_memory_of(lambda r=r, b=b: r.train_step(b[0]), device, r.model, r.optimizer, b[0])
            if name != "compile" and not args.no_memory else None for name, (r, b) in rungs.items()}
    warmup = {}
    for name, (r, batches) in rungs.items():  # warm-up, untimed: one step, or (compile) every step's shapes
        t0 = time.perf_counter()
        try:
            run[name]() if name == "compile" else r.train_step(batches[0])
        except Exception as exc:  # noqa: BLE001 - a backend that cannot compile here: the rung runs eager, said so
            compile_status = f"compile unavailable: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            compiled.model = trunk
            r.optimizer.zero_grad(set_to_none=True)
            r.train_step(batches[0])
        warmup[name] = time.perf_counter() - t0
    times: dict[str, list[float]] = {name: [] for name in rungs}
    names = list(rungs)
    for rep in range(args.repeats):
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            times[name].append(_timed(run[name], device))
    speed = {name: [tokens[name] / t for t in ts] for name, ts in times.items()}
    levers = {lever: {"changes": what, **ratio_stats("ratio", [a / b for a, b in zip(speed[lever], speed[prev])])}
              for (lever, what), prev in zip(ABLATION, names)}
    return {"benchmark": "throughput-ablation", "device": device.type, "device_name": device_name(device),
            "profile": profile.name, "torch": torch.__version__, "config": {"preset": s["preset"], **config.to_dict()},
            "seq": s["seq"], "batch": batch, "accum": s["accum"], "steps": args.steps, "repeats": args.repeats,
            "strategy": args.strategy, "rungs": names, "amp": {n: r.amp.name if hasattr(r, "amp") else r.amp_name
                                                               for n, (r, _) in rungs.items()},
            "optimizer": {n: getattr(r, "optimizer_impl", "default") for n, (r, _) in rungs.items()},
            "loss_chunk": ladder["loss_chunk"], "micro_batch_rows_and_accum": ladder["planned_rows_accum"],
            "micro_batches_per_step": {n: sum(map(len, b)) / len(b) for n, (_, b) in rungs.items()},
            "padding_fraction": {n: 1 - tokens[n] / sum((mb["X"] if "X" in mb else mb["input_ids"]).numel()
                                                        for m in b for mb in m) for n, (_, b) in rungs.items()},
            "row_multiple": ladder["row_multiple"], "compile": compile_status,
            "compile_warmup_seconds": round(warmup["compile"], 3), "peak_memory_bytes": peak,
            "trained_tokens_per_repeat": tokens, "levers": levers,
            "product_of_median_ratios": math.prod(v["ratio"] for v in levers.values()),
            **ratio_stats("ratio_ours_vs_recipe", [a / b for a, b in zip(speed["compile"], speed["recipe"])]),
            **ratio_stats("ratio_eager_ours_vs_recipe", [a / b for a, b in zip(speed["micro_batch"],
                                                                               speed["recipe"])]),
            "note": "each lever's ratio is its rung's useful tokens/s over the previous rung's, paired within a "
                    "repeat (rotating order); their product is ours over the recipe up to the spread of the runs; "
                    "compile_warmup_seconds: the compile rung's untimed first pass (compilation included)"}


def main(argv: Sequence[str]) -> dict:
    """Parse arguments and run the throughput benchmark (or the levers with --levers, the ladder with --ablation)."""
    args = parse_args(argv)
    return run_levers(args) if args.levers else run_ablation(args) if args.ablation else run_throughput(args)
