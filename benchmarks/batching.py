"""Benchmark: padding and useful tokens/s of four batching strategies, and OOM recovery, on data/.

`python -m benchmarks batching --json` measures, in one process on the same samples and the same
model (same initial weights for every strategy):

* padding_fraction_{fixed,longest,token_budget,packed}: over a whole epoch of the dataset, from lengths;
  fixed = MiniMind's pad-to-max-length, longest = random batches padded to their longest row,
  token_budget = TokenBudgetBatchSampler, packed = pack_sequences (stream, block-causal mask).
* useful_tokens_per_s_*: trained tokens (shifted labels != -100) per second of forward+backward+AdamW step,
  every strategy with the same padded-token budget per micro-batch (profile.max_tokens = batch_size x
  seq_len), timed round-robin (one batch of each strategy in turn) so machine load hits all alike.
* oom_events_recovered / samples_lost: the AdaptiveBatchController training under a MemoryMeter budget set
  between the peaks of the full and the quarter micro-batch; samples_lost adds the samples the sampler's
  epoch missed and those the controller lost (both must be 0).

Notebook 06 builds these strategies in its own cells. Times are compared only as ratios of the same run.
"""

from __future__ import annotations

import argparse
import copy
import math
import time
from dataclasses import replace
from typing import Any, Iterator, Sequence

import numpy as np
import torch

from minimind_lib.batching import (
    AdaptiveBatchController,
    TokenBudgetBatchSampler,
    collate_packed,
    pack_sequences,
)
from minimind_lib.data import PretrainDataset, SFTDataset, pad_collate, padding_fraction, trained_tokens
from minimind_lib.device import describe, get_device, synchronize
from minimind_lib.memory import MemoryMeter
from minimind_lib.model import MiniMindConfig, MiniMindForCausalLM
from minimind_lib.paths import DATA_DIR
from minimind_lib.cli import POSITIVE
from minimind_lib.profiles import PROFILES, get_profile
from minimind_lib.tokenizer import load_tokenizer
from minimind_lib.train import TrainConfig, accumulate_step, build_optimizer, evaluate, fit, lr_at, resolve_amp


class StepSamples:
    """Steps of `samples_per_step` samples, shuffled by seed + epoch (the last may be short) for fit(controller=...).

    The fixed-sample-count steps the OOM benchmark trains with; the course itself uses TokenBudgetSteps.
    """
    def __init__(self, dataset: Sequence, samples_per_step: int, shuffle: bool = True, seed: int = 0) -> None:
        if int(samples_per_step) < 1 or len(dataset) == 0:
            raise ValueError(f"StepSamples needs samples_per_step >= 1 (got {samples_per_step}) and a non-empty "
                             f"dataset (got {len(dataset)} samples)")
        self.dataset, self.samples_per_step, self.shuffle, self.seed = dataset, int(samples_per_step), shuffle, seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch's order."""
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return math.ceil(len(self.dataset) / self.samples_per_step)

    def __iter__(self) -> Iterator[list]:
        n, k = len(self.dataset), self.samples_per_step
        order = np.random.default_rng([self.seed, self.epoch]).permutation(n) if self.shuffle else np.arange(n)
        return ([self.dataset[int(i)] for i in order[s:s + k]] for s in range(0, n, k))


STRATEGIES = ("fixed", "longest", "token_budget", "packed")


# --------------------------------------------------------------------------------------------- data


def load_dataset(kind: str, profile, tokenizer=None):
    """PretrainDataset or SFTDataset of data/ at profile.seq_len (profile.max_samples caps the samples read)."""
    tokenizer = tokenizer or load_tokenizer()
    if kind == "pretrain":
        return PretrainDataset(DATA_DIR / "pretrain.jsonl", tokenizer, profile.seq_len, max_samples=profile.max_samples)
    if kind == "sft":
        return SFTDataset(DATA_DIR / "sft.jsonl", tokenizer, profile.seq_len, max_samples=profile.max_samples)
    raise ValueError(f"kind must be 'pretrain' or 'sft', got {kind!r}")


def epoch_padding(lengths: np.ndarray, profile, seed: int = 0, samples: Sequence[dict] | None = None) -> dict:
    """Padding fraction of one whole epoch under each strategy (and the sampler/packing counts)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    n, bs, T = len(lengths), profile.batch_size, profile.seq_len
    perm = np.random.default_rng(seed).permutation(n)
    batches = [lengths[c].tolist() for c in np.array_split(perm, range(bs, n, bs))]
    sampler = TokenBudgetBatchSampler(lengths, profile.max_tokens, seed=seed, seq_len=T)
    served = sorted(i for b in sampler for i in b)
    out = {
        "fixed": padding_fraction(batches, seq_len=T),
        "longest": padding_fraction(batches),
        "token_budget": sampler.stats["padding_fraction"],
        "sampler_stats": sampler.stats,
        "sampler_samples_missed": n - len(set(served)) + (len(served) - len(set(served))),
    }
    if samples is not None:
        _, pstats = pack_sequences([samples[i] for i in perm], T)
        out["packed"] = pstats.padding_fraction
        out["pack_stats"] = pstats.to_dict()
    return out


def strategy_batches(dataset, profile, n_batches: int, seed: int = 0) -> dict[str, list[dict]]:
    """The first n_batches collated micro-batches of each strategy's (seeded) epoch, same padded budget each."""
    n, bs, T = len(dataset), profile.batch_size, profile.seq_len
    perm = np.random.default_rng(seed).permutation(n)
    chunks = [perm[i : i + bs] for i in range(0, n, bs)][:n_batches]
    out: dict[str, list[dict]] = {
        "fixed": [pad_collate([dataset[int(i)] for i in c], seq_len=T, fixed=True) for c in chunks],
        "longest": [pad_collate([dataset[int(i)] for i in c], seq_len=T) for c in chunks],
    }
    sampler = TokenBudgetBatchSampler(dataset.lengths, profile.max_tokens, seed=seed, seq_len=T)
    out["token_budget"] = [pad_collate([dataset[i] for i in b], seq_len=T) for b in sampler.batches()[:n_batches]]
    rows_per_batch = max(1, profile.max_tokens // T)
    need = n_batches * rows_per_batch * T  # enough documents to fill n_batches packed micro-batches
    docs, total = [], 0
    for i in perm.tolist():
        docs.append(dataset[i])
        total += int(docs[-1]["input_ids"].numel())
        if total >= need:
            break
    rows, _ = pack_sequences(docs, T)
    row_list = [{k: v[r] for k, v in rows.items()} for r in range(rows["input_ids"].shape[0])]
    packed = [row_list[i : i + rows_per_batch] for i in range(0, len(row_list), rows_per_batch)][:n_batches]
    out["packed"] = [collate_packed(p, block_mask=True) for p in packed]
    out["packed_nomask"] = [collate_packed(p, block_mask=False) for p in packed]
    return out


# --------------------------------------------------------------------------------------------- timing


def time_strategies(model: torch.nn.Module, batches: dict[str, list[dict]], device: torch.device,
                    lr: float = 1e-3, warmup: int = 1) -> dict[str, dict]:
    """Useful tokens/s of forward+backward+AdamW per strategy, round-robin, from identical initial weights."""
    amp = resolve_amp("auto", device, model.config.hidden_size)
    runs = {}
    for name in batches:
        m = copy.deepcopy(model).to(device).train()
        runs[name] = {"model": m, "opt": build_optimizer(m, TrainConfig(lr=lr), device), "time": 0.0,
                      "useful": 0, "padded": 0, "real": 0, "batches": 0, "losses": [], "tokens": [], "times": []}
    n = min(len(b) for b in batches.values())
    for k in range(n):
        for name, blist in batches.items():
            r, batch = runs[name], blist[k]
            synchronize(device)
            t0 = time.perf_counter()
            stats = accumulate_step(r["model"], [batch], amp_dtype=amp.dtype, device=device)
            r["opt"].step()
            r["opt"].zero_grad(set_to_none=True)
            synchronize(device)
            dt = time.perf_counter() - t0
            r["losses"].append(stats["loss"])
            r["tokens"].append(trained_tokens(batch["labels"]))
            r["times"].append(dt)
            if k >= warmup:  # the first batch pays one-off allocation costs
                r["time"] += dt
                r["useful"] += trained_tokens(batch["labels"])
                r["padded"] += batch["input_ids"].numel()
                real = batch["doc_ids"] >= 0 if "doc_ids" in batch else batch["attention_mask"]
                r["real"] += int(real.sum())
                r["batches"] += 1
    out = {}
    for name, r in runs.items():
        out[name] = {
            "useful_tokens_per_s": r["useful"] / r["time"] if r["time"] > 0 else float("nan"),
            "useful_tokens": r["useful"], "padded_tokens": r["padded"], "seconds": r["time"],
            "batches": r["batches"], "padding_fraction": 1 - r["real"] / max(1, r["padded"]),
            "losses": r["losses"], "tokens_per_batch": r["tokens"], "seconds_per_batch": r["times"],
        }
    return out


def memory_per_step(model: torch.nn.Module, batches: list[dict], device: torch.device) -> list[int]:
    """Peak bytes (MemoryMeter: CPU live tensors / CUDA allocator) of forward+backward of each batch."""
    m = copy.deepcopy(model).to(device).train()
    meter = MemoryMeter(device)
    peaks = []
    for batch in batches:
        with meter.track(m):
            meter.reset_peak()
            accumulate_step(m, [batch], device=device)
        m.zero_grad(set_to_none=True)
        peaks.append(int(meter.peak()))
    return peaks


# --------------------------------------------------------------------------------------------- OOM recovery


def controller_under_budget(model: torch.nn.Module, dataset, profile, device: torch.device, steps: int = 4,
                            samples_per_step: int | None = None, seed: int = 0, check_every: int = 2) -> dict:
    """Train with AdaptiveBatchController under a budget between the peaks of full and quarter micro-batches.

    Returns the metrics frame of fit, the controller, the budget and the free-run peaks; the controller's
    recorded sample ids of successful attempts prove no sample was lost or repeated.
    """
    mbs = profile.batch_size
    samples_per_step = samples_per_step or mbs * 2
    indexed = _Indexed(dataset)

    def collate(b):
        return {**pad_collate(b), "sid": [s["sid"] for s in b]}

    class Recording(AdaptiveBatchController):
        def run_step(self, step_samples, accumulate_fn, zero_grad=None):
            def recorded(micro):
                out = accumulate_fn(micro)
                self.recorded.extend(i for mb in micro for i in mb["sid"])
                return out

            return super().run_step(step_samples, recorded, zero_grad)

    def run(micro, budget, n_steps):
        m = copy.deepcopy(model).to(device)
        meter = MemoryMeter(device, budget_bytes=budget)
        ctl = Recording(micro, meter=meter, zero_grad=m, check_every=check_every, collate_fn=collate)
        ctl.recorded = []
        # fp32 (amp off) on every device: the check that a recovered step equals a free one compares losses to
        # 1e-4, which bf16's rounding of micro-batches of different sizes would not meet
        cfg = TrainConfig(max_steps=n_steps, lr=profile.lr, warmup_steps=1, progress=False, seed=seed, amp="off")
        try:
            df = fit(m, StepSamples(indexed, samples_per_step, seed=seed), cfg, device=device, controller=ctl)
        finally:
            meter.set_budget(None)  # on CUDA the fraction is process-wide: lift it again
        return df, ctl

    free_full, _ = run(mbs, None, 2)
    free_quarter, _ = run(max(1, mbs // 4), None, 2)
    budget = int((free_full["peak_memory_bytes"].max() + free_quarter["peak_memory_bytes"].max()) / 2)
    df, ctl = run(mbs, budget, steps)
    expected = StepSamples(indexed, samples_per_step, seed=seed)
    fed = [s["sid"] for k, st in enumerate(expected) if k < steps for s in st]
    return {
        "frame": df, "controller": ctl, "budget_bytes": budget,
        "free_peak_full": int(free_full["peak_memory_bytes"].max()),
        "free_peak_quarter": int(free_quarter["peak_memory_bytes"].max()),
        "free_losses": list(free_full["loss"]),
        "recorded_ok": sorted(ctl.recorded) == sorted(fed),
        "samples_lost": len(set(fed) - set(ctl.recorded)) + (len(ctl.recorded) - len(set(ctl.recorded))),
    }


class _Indexed:
    """A dataset view whose samples carry their index as "sid" (to prove no sample is lost or repeated)."""

    def __init__(self, dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> dict:
        return {**self.dataset[i], "sid": int(i)}


# --------------------------------------------------------------------------------------------- the benchmark


def measure(kind: str, profile, model, device, n_batches: int, seed: int = 0, tokenizer=None) -> dict:
    """Padding fractions and useful tokens/s of every strategy on one dataset kind."""
    ds = load_dataset(kind, profile, tokenizer)
    samples = [ds[i] for i in range(len(ds))]
    pad = epoch_padding(ds.lengths, profile, seed=seed, samples=samples)
    timing = time_strategies(model, strategy_batches(ds, profile, n_batches + 1, seed=seed), device, lr=profile.lr)
    res = {f"padding_fraction_{s}": float(pad[s]) for s in STRATEGIES}
    res.update({f"useful_tokens_per_s_{s}": float(t["useful_tokens_per_s"]) for s, t in timing.items()})
    fixed = res["useful_tokens_per_s_fixed"]
    res.update({
        "speedup_token_budget_vs_fixed": res["useful_tokens_per_s_token_budget"] / fixed,
        "speedup_packed_vs_fixed": res["useful_tokens_per_s_packed"] / fixed,
        "speedup_longest_vs_fixed": res["useful_tokens_per_s_longest"] / fixed,
        "n_samples": len(ds), "dataset_truncated": int(ds.stats.n_truncated),
        "sampler_samples_missed": int(pad["sampler_samples_missed"]),
        "pack_split_docs": int(pad["pack_stats"]["n_split"]),
        "timed_batches_per_strategy": int(timing["fixed"]["batches"]),
    })
    return res


def main(argv: list[str] | None = None) -> dict:
    """Run the batching benchmark and return its JSON-ready result."""
    p = argparse.ArgumentParser(prog="python -m benchmarks batching", description=__doc__.splitlines()[0])
    p.add_argument("--profile", default=None, choices=sorted(PROFILES), help="default: MINIMIND_PROFILE / auto")
    p.add_argument("--data", default="pretrain", choices=["pretrain", "sft", "both"])
    p.add_argument("--batches", type=POSITIVE, default=None, help="timed micro-batches per strategy")
    p.add_argument("--oom-steps", type=POSITIVE, default=4, help="optimizer steps under the tight budget")
    p.add_argument("--threads", type=POSITIVE, default=None, help="torch CPU threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-samples", type=POSITIVE, default=None, help="cap on samples read (default: the profile's)")
    args = p.parse_args(argv or [])

    profile = get_profile(args.profile)
    if args.max_samples is not None:
        profile = replace(profile, max_samples=args.max_samples)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = get_device()
    n_batches = {"smoke": 3, "cpu": 10}.get(profile.name, 20) if args.batches is None else args.batches
    torch.manual_seed(args.seed)
    config = MiniMindConfig.preset(profile.model)
    model = MiniMindForCausalLM(config)
    tok = load_tokenizer()
    t0 = time.perf_counter()

    kinds = ["pretrain", "sft"] if args.data == "both" else [args.data]
    result: dict[str, Any] = {}
    for kind in kinds:
        res = measure(kind, profile, model, device, n_batches, seed=args.seed, tokenizer=tok)
        if kind == kinds[0]:
            result.update(res)
        else:
            result.update({f"{kind}_{k}": v for k, v in res.items()})

    ds = load_dataset(kinds[0], profile, tok)
    oom = controller_under_budget(model, ds, profile, device, steps=args.oom_steps, seed=args.seed)
    ctl = oom["controller"]
    result.update({
        "oom_events_recovered": int(ctl.stats["oom_events_recovered"]),
        "samples_lost": int(oom["samples_lost"] + ctl.stats["samples_lost"] + result["sampler_samples_missed"]),
        "oom_budget_bytes": oom["budget_bytes"],
        "oom_final_micro_batch": int(ctl.micro_batch_size),
        "oom_events": [str(e) for e in ctl.events],
        "data": kinds[0] if len(kinds) == 1 else "pretrain+sft",
        "device": device.type,
        "device_name": describe(profile, device),
        "profile": profile.name,
        "config": {**config.to_dict(), "seq_len": profile.seq_len, "batch_size": profile.batch_size,
                   "max_tokens": profile.max_tokens, "threads": torch.get_num_threads()},
        "targets": {
            "token_budget_padding_le_5pct": result["padding_fraction_token_budget"] <= 0.05,
            "budget_or_packed_ge_2x_fixed": max(result["speedup_token_budget_vs_fixed"],
                                                result["speedup_packed_vs_fixed"]) >= 2.0,
            "samples_lost_eq_0": False,
        },
        "wall_s": time.perf_counter() - t0,
    })
    result["targets"]["samples_lost_eq_0"] = result["samples_lost"] == 0
    return result
