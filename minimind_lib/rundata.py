"""The data of a run: steps 1-3 of notebook 07_pretrain's run, which pipeline.py assembles. 1. the
data set, memmap-cached, and its validation batches (with no validation file, SFT, LoRA and DPO hold
out 5%), 2. the optimizer steps of token-budget batches, 3. notebook 06's adaptive batch controller.
A stage reads its KIND of data: pretraining text, conversations (sft, lora) or preference pairs
(dpo, notebook 10_lora_dpo), batched by its COLLATE."""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from . import distributed as D
from .batching import AdaptiveBatchController, TokenBudgetBatchSampler, TokenBudgetSteps
from .checkpoint import RunError
from .checks import require
from .corpus import JsonlReader
from .data import holdout_split, memmap_dataset, pad_collate, pair_collate, trained_tokens
from .device import total_memory_bytes
from .memory import MemoryMeter

KIND = {"pretrain": "pretrain", "sft": "sft", "lora": "sft", "dpo": "dpo"}  # each stage's data
COLLATE = {"pretrain": pad_collate, "sft": pad_collate, "lora": pad_collate, "dpo": pair_collate}
CHECK_EVERY = 10  # optimizer steps between the controller's memory checks (CUDA, MPS)


def validation_batches(ds: Any, max_tokens: int, seq_len: int, pad_id: int, n_batches: int,
                       collate: Callable = pad_collate) -> list[dict]:
    """The first n_batches token-budget batches of a validation set, unshuffled (the same at every
    evaluation)."""
    sampler = TokenBudgetBatchSampler(ds.lengths, max_tokens, shuffle=False, seq_len=seq_len)
    return [collate([ds[i] for i in b], pad_id=pad_id) for b in sampler.batches()[:n_batches]]


def train_steps(ds: Any, s: Any, dinfo: Any = None):
    """The optimizer steps: the token-budget sampler's next accum_steps micro-batches each (dealt to
    ranks under DDP)."""
    if dinfo is not None:
        return D.distributed_step_source(ds, s.max_tokens, s.accum_steps, seq_len=s.seq_len,
                                         seed=s.seed, info=dinfo)
    sampler = TokenBudgetBatchSampler(ds.lengths, s.max_tokens, seed=s.seed, seq_len=s.seq_len)
    return TokenBudgetSteps(ds, sampler, s.accum_steps)


def make_controller(device: torch.device, max_tokens: int, seq_len: int, pad_id: int,
                    collate: Callable = pad_collate,
                    row_multiple: int = 1) -> AdaptiveBatchController:
    """Notebook 06's controller: on CUDA and MPS its memory checks read MemoryMeter.peak_in_use
    (what an OOM depends on) against the device's memory, elsewhere OOM recovery only (a CPU's RAM
    has no limit a process sees coming); rows padded to a multiple of row_multiple (a compiled
    model's few shapes)."""
    if device.type in ("cuda", "mps"):
        meter = MemoryMeter(device)
    else:
        meter = None
    if meter is not None:  # the checks' threshold only; the allocator keeps its limit
        meter.budget_bytes = total_memory_bytes(device)
    return AdaptiveBatchController(max_tokens=max_tokens, seq_len=seq_len, meter=meter,
                                   check_every=CHECK_EVERY, pin_memory=device.type == "cuda",
                                   collate_fn=partial(collate, pad_id=pad_id,
                                                      multiple=row_multiple),
                                   row_multiple=row_multiple)


def datasets(s: Any, tok: Any, dinfo: Any,
             log: Callable[[str], None]) -> tuple[Any, list | None, int | None]:
    """1. (training set, validation batches, the held-out count) of resolved RunSettings `s`; under
    DDP rank 0 fills the cache first."""
    main = dinfo is None or dinfo.is_main
    if s.cache_dir is not None:
        cache = Path(s.cache_dir)
    else:
        cache = Path(s.out).parent / "cache"
    file = next((p for p in (cache, *cache.parents) if p.exists() and not p.is_dir()), None)
    if file is not None:
        raise RunError(f"cache directory {cache}: {file} is a file, not a directory (pass --cache "
                       f"DIR)")
    if not main:  # data parallel: rank 0 tokenizes into the cache, the other ranks then open it
        D.barrier()
    progress, kind = s.progress and main, KIND[s.stage]
    ds, info = memmap_dataset(s.data, tok, kind, s.seq_len, cache, s.max_samples, progress,
                              s.on_error)
    if kind == "dpo":
        ds.check_replies(s.data)
    skipped = f"; skipped {info.n_skipped} bad line(s), e.g. {info.skipped_examples[:3]}"
    log(f"{s.stage}: {s.data.name}: {ds.stats.summary()} "
        f"({'cache reused' if info.reused else f'tokenized in {info.seconds:.1f} s'})"
        + (skipped if info.n_skipped else ""))
    val_ds, n_held_out = None, None
    if s.val_data is not None:
        val_ds, _ = memmap_dataset(Path(s.val_data), tok, kind, s.seq_len, cache, None, progress,
                                   s.on_error)
        if kind == "dpo":
            val_ds.check_replies(s.val_data)
    elif kind != "pretrain":  # no validation file: hold out a fixed 5% of the conversations (pairs)
        check_holdout(ds, s)
        ds, val_ds = holdout_split(ds, s.seed)
        n_held_out = len(val_ds)
    val = None
    if val_ds is not None:
        val = validation_batches(val_ds, s.max_tokens, s.seq_len, tok.pad_token_id, s.val_batches,
                                 COLLATE[s.stage])
    require(val is None or any(trained_tokens(b["labels"]) for b in val),
            f"{s.val_data or s.data}: its first {s.val_batches} validation batch(es) hold no "
            f"trained token within seq_len={s.seq_len} (their answers start later): raise "
            f"--seq-len or --val-batches", RunError)
    if dinfo is not None and main:
        D.barrier()  # the caches are complete: the other ranks may open them
    return ds, val, n_held_out


def check_holdout(ds: Any, s: Any) -> None:
    """Refuse, before anything is written, an SFT file with too few conversations that train a
    token within seq_len to hold 5% of them out and still train: name the rows, why, what to do."""
    trains, n_held = ds.trained_counts > 0, max(1, len(ds) // 20)
    if int(trains.sum()) > n_held:
        return
    idle = np.flatnonzero(~trains)
    reader = JsonlReader(s.data, on_error=s.on_error, kind=KIND[s.stage], max_samples=s.max_samples)
    lines = [reader.n_lines for _ in reader]  # record i's line in the file
    start = int(np.flatnonzero(ds.raw(int(idle[0]))[1])[0])  # its first answer's token, uncut
    shown = ", ".join(str(lines[i]) for i in idle[:5]) + " ..." * (len(idle) > 5)
    raise RunError(f"{s.data}: only {int(trains.sum())} of {len(ds)} conversations train a token "
                   f"within seq_len={s.seq_len}; SFT holds out {n_held} that do for its validation "
                   f"loss and needs more to train on. The others (lines {shown}) answer past it "
                   f"(line {lines[idle[0]]}: from token {start}): raise --seq-len (to {start + 1} "
                   f"or more), or pass --val-data FILE with conversations to hold out")
