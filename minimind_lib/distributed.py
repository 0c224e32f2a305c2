"""Data-parallel training with PyTorch's own engine: torchrun + DistributedDataParallel (NCCL on CUDA, gloo on CPU).

What this module adds to the one-GPU loop of train.py, and why each piece is there:

- `setup` / `teardown`: read torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT) and start the
  process group: NCCL on CUDA (one GPU per rank: cuda:LOCAL_RANK), gloo on CPU. Without torchrun it is a
  one-process "group" of size 1 and every helper below degrades to the single-process behaviour.
- `DistributedTokenBudgetSampler`: the *global* optimizer steps are defined once, independently of the number of
  ranks (token-budget micro-batches from `TokenBudgetBatchSampler`, `batches_per_step` of them per step); each step's
  micro-batches are then dealt to the ranks, balancing padded tokens. Every sample is on exactly one rank per epoch
  and nothing is repeated. Every rank runs the same number of steps; a rank dealt no micro-batch in a step (a
  step with fewer micro-batches than ranks, e.g. the last of an epoch) runs one *empty* micro-batch whose labels are
  all -100: it contributes 0 to the loss and the gradient but takes part in the all-reduce. The global token
  all-reduce makes this exact. The checkpointed position (epoch, global steps served) is the same for any number
  of ranks, so a run can resume on a different number of GPUs.
- `DDPController`: plugs into `train.fit(..., controller=...)`. Per step: collate this rank's micro-batches, count
  their trained tokens, **all-reduce (SUM) the count** so every rank divides its token-loss sum by the global
  number of tokens of the step, and run the micro-batches through `train.accumulate_step` on the DDP model, which
  uses `no_sync()` on all but the last (one gradient all-reduce per optimizer step instead of one per
  micro-batch) and all-reduces the logged loss sum.
- Gradient arithmetic: rank r's loss is world_size * sum_r / N_global (train.accumulate_step under
  torch.distributed) and DDP *averages* the rank gradients (divides by world_size), so the result is
  sum over ranks of sum_r / N_global: exactly the single-process gradient on the union of the data.
  `wrap_ddp` registers a comm hook with DDP's own averaging arithmetic that also times each bucket's all-reduce.
- `fit_distributed`: train.fit with the controller, logging (progress bar) and checkpoint writes on rank 0 only,
  validation on rank 0 only, resume from a checkpoint written with any number of ranks.
- `measure_comm_compute`: time of fwd+bwd without communication vs the same step with it, and of a bare
  all-reduce of the gradient's size.
- `launch`: run a command under N local processes (torchrun or plain env vars) with a time limit, always killing
  every process it started; `python -m minimind_lib.distributed run-job JOB.json` is the worker the tests and
  notebook 09 launch.
- `sharded_memory`: the per-rank memory arithmetic of DDP vs FSDP2 (`torch.distributed.fsdp.fully_shard`).

Not handled here: OOM recovery under DDP (the AdaptiveBatchController's retry would need every rank to retry
together). fp16 + GradScaler works: fit hands its accumulate_fn (with its scaler) the DDP-wrapped model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

IGNORE_INDEX = -100


# --------------------------------------------------------------------------------------------- process group


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits in the job: rank, world size, local rank, its device and the backend."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    backend: str | None = None  # "nccl" | "gloo" | None (single process, no process group)

    @property
    def is_main(self) -> bool:
        """True on rank 0: the one rank that logs and writes checkpoints."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        """True when a process group with more than one rank is running."""
        return self.world_size > 1 and dist.is_available() and dist.is_initialized()


def _env_int(env: dict, name: str) -> int | None:
    """An integer environment variable, or None if unset; a clear error if it is not an integer."""
    raw = env.get(name)
    if raw is None or raw == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer (torchrun sets it)") from None


def env_ranks(env: dict | None = None) -> tuple[int, int, int]:
    """(rank, world_size, local_rank) from torchrun's environment; (0, 1, 0) when not launched by torchrun."""
    env = os.environ if env is None else env
    world = _env_int(env, "WORLD_SIZE")
    rank = _env_int(env, "RANK")
    local = _env_int(env, "LOCAL_RANK")
    if world is None:
        if rank not in (None, 0):
            raise ValueError(f"RANK={rank} is set but WORLD_SIZE is not: launch with torchrun --nproc_per_node=N")
        return 0, 1, 0
    if world < 1:
        raise ValueError(f"WORLD_SIZE={world} must be >= 1")
    if rank is None:
        raise ValueError(f"WORLD_SIZE={world} is set but RANK is not: launch with torchrun --nproc_per_node=N")
    if not 0 <= rank < world:
        raise ValueError(f"RANK={rank} is outside 0..{world - 1} (WORLD_SIZE={world})")
    return rank, world, rank if local is None else local


def setup(backend: str | None = None, device: torch.device | str | None = None,
          timeout_s: float = 1800.0) -> DistInfo:
    """Start the process group from torchrun's env (NCCL on CUDA, gloo on CPU); single-process info without it.

    timeout_s bounds how long a collective waits for the other ranks (rank 0's validation pass runs while the
    others wait in the next step's token all-reduce, so it must exceed the longest evaluation).
    """
    from .device import get_device

    if dist.is_available() and dist.is_initialized():  # already set up (e.g. by the caller): describe it
        rank, world = dist.get_rank(), dist.get_world_size()
        _, _, local = env_ranks()
        be = dist.get_backend()
        dev = torch.device(device) if device is not None else (
            torch.device("cuda", local) if be == "nccl" else torch.device("cpu"))
        return DistInfo(rank, world, local, dev, be)
    rank, world, local = env_ranks()
    if world == 1:
        dev = torch.device(device) if device is not None else get_device()
        return DistInfo(0, 1, 0, dev, None)
    if not dist.is_available():
        raise RuntimeError("torch.distributed is not available in this build of torch")
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        if not os.environ.get(name):
            raise ValueError(f"WORLD_SIZE={world} but {name} is not set: launch with torchrun, or set it yourself")
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"backend={backend!r}; choose 'nccl' (CUDA) or 'gloo' (CPU)")
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise ValueError("backend='nccl' needs CUDA; use backend='gloo' on CPU")
        if local >= torch.cuda.device_count():
            raise ValueError(f"LOCAL_RANK={local} but only {torch.cuda.device_count()} CUDA device(s) are visible: "
                             f"NCCL needs one GPU per rank (use --nproc_per_node <= the GPU count)")
        dev = torch.device("cuda", local)
        torch.cuda.set_device(dev)
    else:
        dev = torch.device(device) if device is not None else torch.device("cpu")
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))
    return DistInfo(rank, world, local, dev, backend)


def teardown() -> None:
    """Destroy the process group if one is running (safe to call twice or without one)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def get_rank() -> int:
    """This process's rank (0 without a process group)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def get_world_size() -> int:
    """Number of ranks (1 without a process group)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def is_main_process() -> bool:
    """True on rank 0 (and in a single process): where logging and checkpoint writes happen."""
    return get_rank() == 0


def barrier() -> None:
    """Wait for every rank (no-op without a process group)."""
    if get_world_size() > 1:
        dist.barrier()


def main_print(*args: Any, **kwargs: Any) -> None:
    """print() on rank 0 only."""
    if is_main_process():
        print(*args, **kwargs, flush=True)


def _comm_device(info: DistInfo | None) -> torch.device:
    """Where small collective tensors live: the rank's GPU under NCCL, the CPU under gloo."""
    if info is not None and info.backend == "nccl":
        return info.device
    return torch.device("cpu")


def all_reduce_sum(value: float | int, info: DistInfo | None = None, dtype: torch.dtype = torch.float64) -> float:
    """Sum of a Python number over all ranks (the number itself in a single process)."""
    if get_world_size() == 1:
        return value
    t = torch.tensor([value], dtype=dtype, device=_comm_device(info))
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    out = t.item()
    return int(out) if dtype in (torch.int64, torch.int32) else float(out)


# --------------------------------------------------------------------------------------------- sampler


def assign_to_ranks(costs: Sequence[float], world_size: int) -> list[list[int]]:
    """Deal items to ranks balancing total cost (longest first to the least-loaded rank); positions per rank.

    Deterministic: ties go to the rank with fewer items, then the lower rank. Each rank's positions are returned
    in their original order. Every position is on exactly one rank.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    loads = [0.0] * world_size
    owned: list[list[int]] = [[] for _ in range(world_size)]
    for pos in sorted(range(len(costs)), key=lambda i: (-float(costs[i]), i)):
        r = min(range(world_size), key=lambda k: (loads[k], len(owned[k]), k))
        owned[r].append(pos)
        loads[r] += float(costs[pos])
    return [sorted(o) for o in owned]


class DistributedTokenBudgetSampler:
    """Token-budget micro-batches grouped into global optimizer steps, each step dealt across the ranks.

    The global steps do not depend on the number of ranks: `TokenBudgetBatchSampler` (same seed) builds the
    epoch's micro-batches, and every `batches_per_step` consecutive ones form one optimizer step (the last step
    of an epoch may be shorter; nothing is dropped or repeated). `iter()` yields, per step, the list of this
    rank's micro-batches (lists of dataset indices), possibly empty; every rank yields the same number of steps.
    With world_size=1 it is exactly the single-process run on the same data.
    """

    def __init__(self, lengths: Sequence[int] | np.ndarray, max_tokens: int, batches_per_step: int, *,
                 num_replicas: int | None = None, rank: int | None = None, max_batch_size: int | None = None,
                 shuffle: bool = True, seed: int = 0, megabatch_mult: int = 50,
                 max_len: int | None = None) -> None:
        from .batching import TokenBudgetBatchSampler

        if int(batches_per_step) < 1:
            raise ValueError(f"batches_per_step must be >= 1, got {batches_per_step}")
        self.num_replicas = get_world_size() if num_replicas is None else int(num_replicas)
        self.rank = get_rank() if rank is None else int(rank)
        if self.num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {self.num_replicas}")
        if not 0 <= self.rank < self.num_replicas:
            raise ValueError(f"rank={self.rank} is outside 0..{self.num_replicas - 1}")
        self.batches_per_step = int(batches_per_step)
        self.base = TokenBudgetBatchSampler(lengths, max_tokens, max_batch_size=max_batch_size, shuffle=shuffle,
                                            seed=seed, megabatch_mult=megabatch_mult,
                                            seq_len=max_len)
        self.seed = int(seed)
        self.epoch = 0
        self._steps_served = 0
        self._resume_from = 0

    def global_steps(self, epoch: int | None = None) -> list[list[list[int]]]:
        """The epoch's optimizer steps, each a list of micro-batches (index lists), as one process would run them."""
        batches = self.base.batches(self.epoch if epoch is None else int(epoch))
        k = self.batches_per_step
        return [batches[i:i + k] for i in range(0, len(batches), k)]

    def split_step(self, step_batches: Sequence[Sequence[int]], rank: int | None = None) -> list[list[int]]:
        """This rank's micro-batches of one global step (balanced by padded tokens = rows x longest row)."""
        rank = self.rank if rank is None else int(rank)
        costs = [len(b) * int(self.base.lengths[list(b)].max()) for b in step_batches]
        owned = assign_to_ranks(costs, self.num_replicas)[rank]
        return [list(step_batches[i]) for i in owned]

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch the next iteration serves (resets a pending mid-epoch resume of another epoch)."""
        if int(epoch) != self.epoch:
            self._steps_served = 0
            self._resume_from = 0
        self.epoch = int(epoch)

    def __iter__(self) -> Iterator[list[list[int]]]:
        steps = self.global_steps()
        start, self._resume_from = self._resume_from, 0
        self._steps_served = start
        for step in steps[start:]:
            self._steps_served += 1
            yield self.split_step(step)

    def __len__(self) -> int:
        """Optimizer steps per epoch (the same on every rank)."""
        return math.ceil(len(self.base.batches(self.epoch)) / self.batches_per_step)

    @property
    def stats(self) -> dict:
        """The base sampler's counts (samples kept/truncated/rejected, padding) plus steps and ranks."""
        return {**self.base.stats, "n_steps": len(self), "batches_per_step": self.batches_per_step,
                "num_replicas": self.num_replicas}

    def state_dict(self) -> dict:
        """Global position (epoch, global steps served): the same on every rank, valid for any world size."""
        return {"epoch": self.epoch, "steps_served": self._steps_served, "seed": self.seed,
                "batches_per_step": self.batches_per_step}

    def load_state_dict(self, state: dict) -> None:
        """Resume at a global position saved with any number of ranks."""
        for key in ("epoch", "steps_served"):
            if key not in state:
                raise ValueError(f"sampler state has no key {key!r} (keys: {sorted(state)})")
        if "seed" in state and int(state["seed"]) != self.seed:
            raise ValueError(f"sampler state was saved with seed={state['seed']}, this sampler has seed={self.seed}")
        if "batches_per_step" in state and int(state["batches_per_step"]) != self.batches_per_step:
            raise ValueError(f"sampler state was saved with batches_per_step={state['batches_per_step']}, this "
                             f"sampler has {self.batches_per_step}: the global steps would differ")
        self.epoch = int(state["epoch"])
        served, n = int(state["steps_served"]), len(self)
        if not 0 <= served <= n:
            raise ValueError(f"steps_served={served} is outside 0..{n} for epoch {self.epoch}")
        self._steps_served = self._resume_from = served


class RankStepSource:
    """Re-iterable source for fit(): per step, this rank's micro-batches as lists of dataset samples."""

    def __init__(self, dataset: Sequence, sampler: DistributedTokenBudgetSampler) -> None:
        self.dataset = dataset
        self.step_sampler = sampler  # not named `sampler`: DataStream would call set_epoch on it twice

    def set_epoch(self, epoch: int) -> None:
        """Forward the epoch to the sampler (train.DataStream calls this at each epoch start)."""
        self.step_sampler.set_epoch(epoch)

    def __iter__(self) -> Iterator[list[list[Any]]]:
        for micro in self.step_sampler:
            yield [[self.dataset[i] for i in mb] for mb in micro]

    def __len__(self) -> int:
        return len(self.step_sampler)


def distributed_step_source(dataset: Sequence, max_tokens: int, batches_per_step: int, *, max_len: int | None = None,
                            seed: int = 0, info: DistInfo | None = None) -> RankStepSource:
    """This rank's step source over `dataset` (needs `.lengths`): what the pipeline hands to fit_distributed."""
    info = info or DistInfo(get_rank(), get_world_size())
    sampler = DistributedTokenBudgetSampler(dataset.lengths, max_tokens, batches_per_step,
                                            num_replicas=info.world_size, rank=info.rank, seed=seed, max_len=max_len)
    return RankStepSource(dataset, sampler)


# --------------------------------------------------------------------------------------------- DDP + comm hook


@dataclass
class CommTimer:
    """Wall time of every gradient-bucket all-reduce (launch to completion), and the bytes it moved."""

    durations: list[float] = field(default_factory=list)
    nbytes: int = 0

    def reset(self) -> None:
        """Forget what was recorded."""
        self.durations.clear()
        self.nbytes = 0

    def total(self) -> float:
        """Seconds summed over the recorded all-reduces."""
        return float(sum(self.durations))


def timed_allreduce_hook(state, bucket):  # no annotations: DDP checks them, and ours would be strings
    """DDP comm hook (state: CommTimer | None, bucket: dist.GradBucket) -> Future: DDP's average, timed.

    The arithmetic is DDP's default (divide by world_size, all-reduce SUM); train.accumulate_step multiplies each
    rank's loss by world_size under torch.distributed, so the average of the rank gradients is their sum.
    """
    buf = bucket.buffer().div_(dist.get_world_size())
    t0 = time.perf_counter()
    fut = dist.all_reduce(buf, op=dist.ReduceOp.SUM, async_op=True).get_future()

    def done(f: torch.futures.Future) -> torch.Tensor:
        if state is not None:  # on CUDA this is when the host learns of completion: use the profiler for kernels
            state.durations.append(time.perf_counter() - t0)
            state.nbytes += buf.numel() * buf.element_size()
        return f.value()[0]

    return fut.then(done)


def wrap_ddp(model: nn.Module, info: DistInfo, timer: CommTimer | None = None, **ddp_kwargs: Any) -> nn.Module:
    """DistributedDataParallel around `model` with the timed averaging hook; the model itself when world_size is 1.

    broadcast_buffers=False: MiniMind's only buffers are the RoPE tables, identical on every rank, and DDP's
    per-forward buffer broadcast is a collective that would need the same number of synced forwards on every
    rank (ours may differ: a rank runs as many micro-batches as it was dealt).
    """
    if not info.distributed:
        return model
    from torch.nn.parallel import DistributedDataParallel as DDP

    # torch >= 2.13 renamed the per-forward switch (the init-time sync it keeps is harmless: RoPE tables agree).
    if "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters:
        ddp_kwargs.setdefault("forward_sync_buffers", False)
    else:
        ddp_kwargs.setdefault("broadcast_buffers", False)
    if info.device.type == "cuda":
        ddp_kwargs.setdefault("device_ids", [info.device.index])
    ddp = DDP(model, **ddp_kwargs)
    ddp.register_comm_hook(timer, timed_allreduce_hook)
    return ddp


def empty_micro_batch(pad_id: int = 0, length: int = 2) -> dict:
    """A micro-batch that trains nothing (labels all -100): lets a rank with no data join the step's all-reduce."""
    return {"input_ids": torch.full((1, length), pad_id, dtype=torch.long),
            "labels": torch.full((1, length), IGNORE_INDEX, dtype=torch.long),
            "attention_mask": torch.ones((1, length), dtype=torch.long)}


def _sync_device(device: torch.device) -> None:
    """Wait for queued GPU work so that wall-clock times mean something."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class DDPController:
    """train.fit controller for data parallelism: global token count, no_sync accumulation, global loss.

    `run_step(rank_micro_samples, accumulate_fn)` receives this rank's micro-batches of the step (lists of
    samples, from RankStepSource). N_global, the trained tokens of the whole step on all ranks, is all-reduced
    *before* any backward and passed to train.accumulate_step, which gives every micro-batch the loss
    world_size * lm_loss(sum) / N_global, runs no_sync() on all but the rank's last micro-batch (DDP's gradient
    all-reduce runs once, in that last backward) and all-reduces the logged loss sum. DDP's average then makes
    the gradient that of the union of the data. Every rank calls accumulate_step exactly once per step (a rank
    with no data runs one empty micro-batch), so the collectives line up.
    """

    def __init__(self, model: nn.Module, ddp_model: nn.Module, info: DistInfo, cfg: Any, *,
                 collate_fn: Callable[[list], dict] | None = None, pad_id: int = 0, timer: CommTimer | None = None,
                 grad_callback: Callable[[int, nn.Module], Any] | None = None) -> None:
        from .data import pad_collate

        if getattr(cfg, "normalization", "token") != "token":
            raise ValueError(f"TrainConfig.normalization={cfg.normalization!r}: data-parallel training here is "
                             f"exact token-weighted ('token') only")
        self.model, self.ddp_model, self.info, self.cfg = model, ddp_model, info, cfg
        self.collate_fn = collate_fn or (lambda samples: pad_collate(samples, pad_id=pad_id))
        self.pad_id = pad_id
        self.timer = timer
        self.grad_callback = grad_callback
        self.meter = None
        self.step = 0
        self.samples_seen = 0  # global, over all ranks
        self.tokens_seen = 0  # global trained tokens

    def _accumulate(self, accumulate_fn: Callable, micro: list[dict], n_global: int) -> dict:
        """Forward+backward of the rank's micro-batches through the DDP model, with fit's AMP and GradScaler."""
        return accumulate_fn(micro, forward_model=self.ddp_model, n_tokens_total=n_global)

    def run_step(self, rank_micro_samples: Sequence[Sequence[Any]], accumulate_fn: Callable) -> dict:
        """Forward+backward of this rank's share of one optimizer step; returns global loss_sum and n_tokens."""
        from .train import batch_token_count

        micro = [self.collate_fn(list(s)) for s in rank_micro_samples if len(s)]
        n_samples = sum(len(s) for s in rank_micro_samples)
        n_local = sum(batch_token_count(mb["labels"]) for mb in micro)
        # The one extra collective of data parallelism: every rank must divide by the same, global, count.
        n_global = int(all_reduce_sum(n_local, self.info, dtype=torch.int64))
        if n_global <= 0:
            raise ValueError(f"step {self.step}: no trained tokens on any rank (every shifted label is -100)")
        k_real = len(micro)
        if not micro:
            micro = [empty_micro_batch(self.pad_id)]
        if self.timer is not None:
            self.timer.reset()
        t0 = time.perf_counter()
        stats = self._accumulate(accumulate_fn, micro, n_global)  # its loss_sum is all-reduced (global) under DDP
        _sync_device(self.info.device)
        compute_s = time.perf_counter() - t0
        if self.grad_callback is not None:
            self.grad_callback(self.step, self.model)
        loss_sum_global = float(stats["loss_sum"])
        samples_global = int(all_reduce_sum(n_samples, self.info, dtype=torch.int64))
        self.step += 1
        self.samples_seen += samples_global
        self.tokens_seen += n_global
        return {"loss_sum": loss_sum_global, "n_tokens": n_global, "rank_tokens": n_local,
                "rank_micro_batches": k_real, "world_size": self.info.world_size, "rank_step_s": compute_s,
                "comm_s": self.timer.total() if self.timer is not None else float("nan"), "events": []}

    def state_dict(self) -> dict:
        """Global counters only (no per-rank state): valid when resuming with any number of ranks."""
        return {"step": self.step, "samples_seen": self.samples_seen, "tokens_seen": self.tokens_seen,
                "world_size": self.info.world_size}

    def load_state_dict(self, state: dict) -> None:
        """Restore the global counters (the saved world_size is informational)."""
        if "step" not in state:
            raise ValueError(f"DDP controller state has no key 'step' (keys: {sorted(state)})")
        self.step = int(state["step"])
        self.samples_seen = int(state.get("samples_seen", 0))
        self.tokens_seen = int(state.get("tokens_seen", 0))


def fit_distributed(model: nn.Module, step_source: Any, cfg: Any, *, info: DistInfo | None = None,
                    val_batches: Any = None, collate_fn: Callable[[list], dict] | None = None, pad_id: int = 0,
                    resume_from: str | Path | None = None, callbacks: Sequence[Callable] | None = None,
                    grad_callback: Callable[[int, nn.Module], Any] | None = None,
                    ddp_kwargs: dict | None = None) -> "pd.DataFrame":
    """train.fit under DDP: `step_source` yields this rank's micro-batches of samples per step (RankStepSource).

    Rank 0 alone shows progress, evaluates `val_batches` and writes checkpoints (cfg.ckpt_dir); every rank
    returns the same per-step losses (global, all-reduced). Resuming reads a checkpoint written with any
    number of ranks: its data position counts global steps. With world_size 1 this is plain fit().
    """
    from .train import fit

    info = info or setup()
    model.to(info.device)
    timer = CommTimer()
    ddp_model = wrap_ddp(model, info, timer, **(ddp_kwargs or {}))
    controller = DDPController(model, ddp_model, info, cfg, collate_fn=collate_fn, pad_id=pad_id, timer=timer,
                               grad_callback=grad_callback)
    if info.device.type == "cuda":
        from .memory import MemoryMeter

        controller.meter = MemoryMeter(info.device)
    run_cfg = cfg if info.is_main else dataclasses.replace(cfg, progress=False)
    df = fit(model, step_source, run_cfg, device=info.device, val_batches=val_batches if info.is_main else None,
             controller=controller, callbacks=callbacks, resume_from=resume_from, is_main_process=info.is_main)
    df.attrs.update({"world_size": info.world_size, "backend": info.backend or "none", "rank": info.rank})
    return df


# --------------------------------------------------------------------------------------------- measurement


def measure_comm_compute(model: nn.Module, ddp_model: nn.Module, micro_batches: Sequence[dict], info: DistInfo,
                         timer: CommTimer | None = None, reps: int = 3, warmup: int = 1) -> dict:
    """Median seconds of one step's fwd+bwd with no communication, of the same step with DDP's all-reduce,
    and of a bare all-reduce of the gradient's size; the exposed comm time is step - compute.

    Every rank runs the same micro-batches (a fixed per-rank load); a barrier starts each repetition together.
    """
    from .train import accumulate_step, batch_token_count

    n_tok = max(1, sum(batch_token_count(mb["labels"]) for mb in micro_batches))  # the same on every rank
    dev = info.device

    def one_step(sync: bool) -> float:
        barrier()
        _sync_device(dev)
        t0 = time.perf_counter()
        # accumulate_step runs no_sync() on all but the last micro-batch; the outer no_sync() covers that one too
        ctx = contextlib.nullcontext() if sync or ddp_model is model else ddp_model.no_sync()
        with ctx:
            accumulate_step(ddp_model, micro_batches, device=dev, n_tokens_total=n_tok * info.world_size)
        _sync_device(dev)
        dt = time.perf_counter() - t0
        model.zero_grad(set_to_none=True)
        return dt

    n_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    flat = torch.zeros(n_params, dtype=torch.float32, device=dev)

    def bare_allreduce() -> float:
        barrier()
        _sync_device(dev)
        t0 = time.perf_counter()
        if info.distributed:
            dist.all_reduce(flat)
        _sync_device(dev)
        return time.perf_counter() - t0

    for _ in range(warmup):
        one_step(False), one_step(True), bare_allreduce()
    compute, full, bare, hook = [], [], [], []
    for _ in range(reps):
        compute.append(one_step(False))
        if timer is not None:
            timer.reset()
        full.append(one_step(True))
        hook.append(timer.total() if timer is not None else float("nan"))
        bare.append(bare_allreduce())
    med = lambda xs: float(np.median(xs))  # noqa: E731
    return {"compute_s": med(compute), "step_s": med(full), "exposed_comm_s": max(0.0, med(full) - med(compute)),
            "allreduce_s": med(bare), "hook_allreduce_s": med(hook), "n_params": n_params,
            "grad_bytes": n_params * 4, "tokens_per_rank": n_tok, "micro_batches": len(micro_batches),
            "world_size": info.world_size, "rank": info.rank, "backend": info.backend or "none"}


# --------------------------------------------------------------------------------------------- memory arithmetic


def layer_param_counts(config: Any) -> dict:
    """Parameters of the tied embedding, of one transformer block, and in total, for a MiniMindConfig."""
    C, F, V, L = config.hidden_size, config.intermediate_size, config.vocab_size, config.num_hidden_layers
    kv = config.num_key_value_heads * config.head_dim
    block = 2 * C * C + 2 * C * kv + 3 * C * F + 2 * C
    return {"embedding": V * C, "block": block, "total": V * C + L * block + C}


def sharded_memory(config: Any, world_size: int, *, batch: int, seq: int, amp: str = "bf16") -> dict:
    """Per-rank training memory of DDP (full replica) vs FSDP2 (fully_shard per block) for `world_size` ranks.

    Model state with fp32 master weights and AdamW: 4 (weights) + 4 (grads) + 8 (exp_avg, exp_avg_sq) = 16 bytes
    per parameter. DDP keeps all of it on every rank, plus its gradient buckets (another 4 bytes per parameter
    unless gradient_as_bucket_view=True). FSDP2 keeps 16/W bytes per parameter, plus the all-gathered,
    unsharded parameters and gradients of the block being computed and of the one prefetched next
    (~2 units x 4+4 bytes per parameter, +2 under AMP; the embedding is gathered as one unit too). Activations do
    not shrink with W: each rank still runs its own micro-batch (estimate_memory's count). Returns bytes.
    """
    from .memory import estimate_memory

    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    est = estimate_memory(config, batch=batch, seq=seq, amp=amp)
    counts = layer_param_counts(config)
    P = est["n_params"]
    state = est["params_bytes"] + est["grads_bytes"] + est["optimizer_bytes"]  # 16 P
    act = est["activations_bytes"] + est["head_bytes"] + est["buffers_bytes"]
    ddp_buckets = 4 * P
    amp_copies = est["amp_weight_copies_bytes"]  # DDP + autocast: a low-precision copy of every weight
    unit = max(counts["block"], counts["embedding"])
    # current + prefetched unit: unsharded fp32 params and grads (+ their low-precision copy under AMP; FSDP2's
    # MixedPrecisionPolicy casts at all-gather time, so only gathered units have one)
    gathered = 2 * unit * (4 + 4 + (2 if amp != "off" else 0))
    ddp = state + ddp_buckets + amp_copies + act
    fsdp = state / world_size + gathered + act
    return {"n_params": P, "world_size": world_size, "model_state_bytes": state, "activation_bytes": act,
            "ddp_per_rank_bytes": int(ddp), "fsdp_per_rank_bytes": int(fsdp),
            "fsdp_state_per_rank_bytes": int(state / world_size), "fsdp_gathered_bytes": int(gathered)}


# --------------------------------------------------------------------------------------------- launching


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on `host` (for MASTER_PORT)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass
class LaunchResult:
    """What a launch did: exit codes, the seconds it took, and every process's output."""

    returncodes: list[int]
    seconds: float
    outputs: list[str]
    timed_out: bool = False
    pids: list[int] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when every process exited with 0 in time."""
        return not self.timed_out and all(rc == 0 for rc in self.returncodes)


def _kill_group(proc: subprocess.Popen) -> None:
    """Stop the process group `proc` leads (it was started in a new session): SIGTERM, then SIGKILL.

    The group is killed even when its leader has already exited: torchrun's workers are in the same group and
    must not outlive a launcher that died.
    """
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5.0)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)  # whatever is left of the group
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5.0)


def launch(args: Sequence[str], nproc: int = 2, *, timeout_s: float = 120.0, launcher: str = "torchrun",
           module: bool = True, env: dict | None = None, log_dir: str | Path | None = None,
           threads: int = 1) -> LaunchResult:
    """Run `python -m <args...>` (module=True) or `python <args...>` as `nproc` local ranks on 127.0.0.1.

    launcher="torchrun": one `python -m torch.distributed.run --nproc_per_node=N` process (what a learner types);
    launcher="env": N plain processes with RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT set (what torchrun
    sets; one Python start-up less). Each process is started in its own session and its whole process group is
    killed on timeout, on error and on KeyboardInterrupt, so no rank outlives the call.
    """
    if launcher not in ("torchrun", "env"):
        raise ValueError(f"launcher={launcher!r}; choose 'torchrun' or 'env'")
    if int(nproc) < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    import tempfile

    log_dir = Path(log_dir) if log_dir is not None else Path(tempfile.mkdtemp(prefix="minimind_ddp_"))
    log_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    base_env = {**os.environ, **(env or {}), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
    target = (["-m"] if module else []) + list(args)
    if launcher == "torchrun":
        cmds = [[sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--nnodes=1",
                 "--master_addr=127.0.0.1", f"--master_port={port}", *target]]
        envs = [base_env]
    else:
        cmds = [[sys.executable, *target] for _ in range(nproc)]
        envs = [{**base_env, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(nproc),
                 "LOCAL_WORLD_SIZE": str(nproc)} for r in range(nproc)]
    procs: list[subprocess.Popen] = []
    logs = [log_dir / f"launch_{i}.log" for i in range(len(cmds))]
    t0 = time.perf_counter()
    timed_out = False
    try:
        for cmd, e, log in zip(cmds, envs, logs):
            with open(log, "wb") as fh:
                procs.append(subprocess.Popen(cmd, env=e, stdout=fh, stderr=subprocess.STDOUT,
                                              start_new_session=True))
        deadline = t0 + timeout_s
        while any(p.poll() is None for p in procs):
            if time.perf_counter() > deadline:
                timed_out = True
                break
            if any(p.poll() not in (None, 0) for p in procs):
                time.sleep(2.0)  # one rank failed: give the others a moment to report, then stop them
                break
            time.sleep(0.1)
    finally:
        for p in procs:
            _kill_group(p)
    outputs = [log.read_text(errors="replace") if log.exists() else "" for log in logs]
    rcs = [p.returncode if p.returncode is not None else -9 for p in procs]
    return LaunchResult(rcs, time.perf_counter() - t0, outputs, timed_out, [p.pid for p in procs])


# --------------------------------------------------------------------------------------------- the worker job


def synthetic_samples(n: int, *, min_len: int = 4, max_len: int = 48, vocab: int = 6400, seed: int = 0,
                      masked_frac: float = 0.3) -> list[dict]:
    """Deterministic variable-length samples; in `masked_frac` of them a prefix is -100 (SFT-like masks)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        T = int(rng.integers(min_len, max_len + 1))
        ids = torch.from_numpy(rng.integers(3, vocab, size=T)).long()
        labels = ids.clone()
        if rng.random() < masked_frac and T > 1:  # a 1-token sample has no label to mask
            labels[: int(rng.integers(1, T))] = IGNORE_INDEX
        out.append({"input_ids": ids, "labels": labels})
    return out


def load_samples(spec: dict) -> list[dict]:
    """The job's samples: spec['synthetic'] (kwargs of synthetic_samples) or spec['samples'] (a torch file)."""
    if "synthetic" in spec:
        return synthetic_samples(**spec["synthetic"])
    path = Path(spec["samples"])
    if not path.is_file():
        raise FileNotFoundError(f"job samples file not found: {path}")
    data = torch.load(path, weights_only=True)
    ids, labels = data["input_ids"], data.get("labels") or data["input_ids"]
    return [{"input_ids": a.long(), "labels": b.long()} for a, b in zip(ids, labels)]


def save_samples(samples: Sequence[dict], path: str | Path) -> Path:
    """Write samples for a job (a weights_only-loadable torch file of input_ids / labels tensors)."""
    from .checkpoint import atomic_save

    return atomic_save({"input_ids": [s["input_ids"] for s in samples],
                        "labels": [s.get("labels", s["input_ids"]) for s in samples]}, path)


def build_job(spec: dict, info: DistInfo) -> tuple[nn.Module, list[dict], DistributedTokenBudgetSampler, Any]:
    """Model (seeded), samples, this rank's sampler and the TrainConfig of a job spec."""
    from .model import MiniMindConfig, MiniMindForCausalLM
    from .train import TrainConfig

    samples = load_samples(spec)
    torch.manual_seed(int(spec.get("model_seed", 0)))
    model = MiniMindForCausalLM(MiniMindConfig.preset(spec.get("model", "smoke"), **spec.get("model_overrides", {})))
    sampler = DistributedTokenBudgetSampler([int(s["input_ids"].numel()) for s in samples],
                                            int(spec.get("max_tokens", 256)), int(spec.get("batches_per_step", 4)),
                                            num_replicas=info.world_size, rank=info.rank,
                                            max_batch_size=spec.get("max_batch_size"),
                                            seed=int(spec.get("sampler_seed", 0)), max_len=spec.get("max_len"))
    train = {"progress": False, "amp": "off", "warmup_steps": 1, "max_steps": 4, "lr": 1e-3, **spec.get("train", {})}
    return model, samples, sampler, TrainConfig(**train)


def run_job(spec: dict, info: DistInfo | None = None) -> dict:
    """Run one job spec on this rank (train, capture gradients, measure); write rank results to spec['out'].

    Spec keys: synthetic | samples, model, model_overrides, model_seed, max_tokens, max_batch_size,
    batches_per_step, sampler_seed, train (TrainConfig fields), resume_from, capture_grads (steps),
    measure ({"budgets": [max_tokens...], "reps": 3}), skip_train, out (a folder), threads. Every periodic
    checkpoint (train.ckpt_every) is also copied to out/ckpt_step{N}.pt by rank 0. Returns the rank's result.
    """
    info = info or setup()
    torch.set_num_threads(int(spec.get("threads", 1)))
    out_dir = Path(spec["out"])
    out_dir.mkdir(parents=True, exist_ok=True)
    model, samples, sampler, cfg = build_job(spec, info)
    capture = {int(s) for s in spec.get("capture_grads", [])}
    grads: dict[int, dict[str, torch.Tensor]] = {}

    def grab(step: int, m: nn.Module) -> None:
        if step in capture:
            grads[step] = {n: p.grad.detach().cpu().clone() for n, p in m.named_parameters() if p.grad is not None}

    snapshots: list[str] = []

    def snapshot(step: int, row: dict) -> None:
        # fit keeps one last.pt (and rewrites it at the end); keep a copy of each periodic one to resume from
        if info.is_main and cfg.ckpt_dir and "ckpt" in str(row.get("event", "")).split(";"):
            dst = out_dir / f"ckpt_step{step + 1}.pt"
            shutil.copyfile(Path(cfg.ckpt_dir) / "last.pt", dst)
            snapshots.append(dst.name)

    result: dict[str, Any] = {"rank": info.rank, "world_size": info.world_size, "backend": info.backend or "none"}
    if not spec.get("skip_train"):
        df = fit_distributed(model, RankStepSource(samples, sampler), cfg, info=info, grad_callback=grab,
                             resume_from=spec.get("resume_from"), callbacks=[snapshot])
        if df.empty:
            raise ValueError(f"job trained no step: resume_from={spec.get('resume_from')} is already at "
                             f"max_steps={cfg.max_steps}?")
        result.update({"steps": df["step"].tolist(), "losses": df["loss"].tolist(), "tokens": df["tokens"].tolist(),
                       "rank_tokens": df["rank_tokens"].tolist(), "comm_s": df["comm_s"].tolist(),
                       "rank_step_s": df["rank_step_s"].tolist(), "grads": grads,
                       "sampler_stats": {k: v for k, v in sampler.stats.items() if isinstance(v, (int, float))},
                       "snapshots": snapshots})
    if spec.get("measure"):
        from .data import pad_collate

        m = spec["measure"]
        timer = CommTimer()
        ddp = wrap_ddp(model.to(info.device), info, timer)
        rows = []
        for budget in m.get("budgets", [256]):
            rows_per_mb = max(1, int(budget) // int(m.get("seq", 32)))
            mbs = [pad_collate(synthetic_samples(rows_per_mb, min_len=m.get("seq", 32), max_len=m.get("seq", 32),
                                                 vocab=model.config.vocab_size, seed=100 + j))
                   for j in range(int(m.get("micro_batches", 2)))]
            rows.append({"max_tokens": int(budget),
                         **measure_comm_compute(model, ddp, [{k: v.to(info.device) for k, v in mb.items()}
                                                             for mb in mbs], info, timer, reps=int(m.get("reps", 3)))})
        result["measure"] = rows
    torch.save(result, out_dir / f"result_rank{info.rank}.pt")
    return result


def _cli(argv: list[str] | None = None) -> int:
    """`python -m minimind_lib.distributed run-job JOB.json` (under torchrun or alone)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m minimind_lib.distributed")
    sub = parser.add_subparsers(dest="command", required=True)
    job = sub.add_parser("run-job", help="run a JSON job spec on every rank (tests, notebook 09)")
    job.add_argument("spec", help="path of the JSON job spec")
    args = parser.parse_args(argv)
    spec_path = Path(args.spec)
    if not spec_path.is_file():
        print(f"error: job spec not found: {spec_path}", file=sys.stderr)
        return 2
    specs = json.loads(spec_path.read_text())
    info = setup()
    try:
        for spec in specs if isinstance(specs, list) else [specs]:  # several phases share one process group
            run_job(spec, info)
            barrier()
    finally:
        teardown()
    return 0


if __name__ == "__main__":
    sys.exit(_cli())
