"""Data parallelism with torchrun + DistributedDataParallel (NCCL or gloo), built in notebook
09_beyond_one_gpu: a sampler deals each global step's micro-batches to the ranks, and
`DDPController` all-reduces the step's trained-token count before any backward, so every rank
divides by the same N (train.accumulate_step multiplies by world_size)."""

import dataclasses
import os
from datetime import timedelta
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .batching import TokenBudgetBatchSampler, TokenBudgetSteps
from .checks import require
from .data import IGNORE_INDEX, pad_collate, trained_tokens
from .device import get_device
from .memory import MemoryMeter
from .train import all_reduce_sum, fit, world_size

@dataclasses.dataclass(frozen=True)
class DistInfo:
    """Where this process sits in the job: rank, world size, local rank, its device and the backend.
    """
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    backend: str | None = None  # "nccl" | "gloo" | None (one process, no process group)
    is_main = property(lambda self: self.rank == 0,
                       doc="True on rank 0: the one rank that logs and writes.")
    distributed = property(lambda self: self.world_size > 1 and dist.is_initialized(),
                           doc="True when a process group of more than one rank is running.")


def env_ranks(env: dict | None = None) -> tuple[int, int, int]:
    """(rank, world_size, local_rank) from torchrun's environment; (0, 1, 0) when not launched by
    torchrun."""
    env, names = os.environ if env is None else env, ("RANK", "WORLD_SIZE", "LOCAL_RANK")
    bad = [name for name in names if env.get(name) and not env[name].lstrip("-").isdigit()]
    if bad:
        raise ValueError(f"environment variable {bad[0]}={env[bad[0]]!r} is not an integer "
                         "(torchrun sets it)")
    found = {name: int(env[name]) for name in names if env.get(name)}
    rank, world, local = (found.get(name) for name in names)
    if world is None and rank not in (None, 0):
        raise ValueError(f"RANK={rank} is set but WORLD_SIZE is not: launch with torchrun "
                         "--nproc_per_node=N")
    if world is not None and rank is None:
        raise ValueError(f"WORLD_SIZE={world} is set but RANK is not: launch with torchrun "
                         "--nproc_per_node=N")
    if world is not None and not 0 <= rank < world:
        raise ValueError(f"RANK={rank} is outside 0..{world - 1} (WORLD_SIZE={world})")
    if world is None:
        return (0, 1, 0)
    return (rank, world, rank if local is None else local)


def setup(backend: str | None = None, device: torch.device | str | None = None,
          timeout_s: float = 1800.0) -> DistInfo:
    """Start the process group from torchrun's env (NCCL on CUDA, gloo on CPU); one-process info
    without torchrun."""
    rank, world, local = env_ranks()
    if world == 1:
        return DistInfo(device=torch.device(device or get_device()))
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(name)]
    if missing:
        raise ValueError(f"WORLD_SIZE={world} but {missing[0]} is not set: launch with torchrun, "
                         "or set it yourself")
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"backend={backend!r}; choose 'nccl' (CUDA) or 'gloo' (CPU)")
    if backend == "nccl" and local >= torch.cuda.device_count():
        raise ValueError(f"LOCAL_RANK={local} but {torch.cuda.device_count()} CUDA device(s) are "
                         "visible: NCCL needs "
                         f"one GPU per rank (--nproc_per_node <= the GPU count)")
    if backend == "nccl":
        device = torch.device("cuda", local)
    else:
        device = torch.device(device or "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # timeout_s must outlast rank 0's validation, which the others wait through
    if not dist.is_initialized():
        dist.init_process_group(backend, rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout_s))
    return DistInfo(rank, world, local, device, backend)


def teardown() -> None:
    """Destroy the process group if one is running (safe to call twice or without one)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def barrier() -> None:
    """Wait for every rank (nothing to wait for in one process)."""
    if world_size() > 1:
        dist.barrier()


def assign_to_ranks(costs: Sequence[float], n_ranks: int) -> list[list[int]]:
    """Deal items to ranks by cost: largest first, each to the least-loaded rank (ties: fewer items,
    lower rank)."""
    if n_ranks < 1:
        raise ValueError(f"n_ranks must be >= 1, got {n_ranks}")
    loads, owned = [0.0] * n_ranks, [[] for _ in range(n_ranks)]
    for pos in sorted(range(len(costs)), key=lambda i: (-float(costs[i]), i)):
        r = min(range(n_ranks), key=lambda k: (loads[k], len(owned[k]), k))
        owned[r].append(pos)
        loads[r] += float(costs[pos])
    return [sorted(o) for o in owned]


class DistributedTokenBudgetSampler(TokenBudgetSteps):
    """Global steps of `accum_steps` token-budget micro-batches (TokenBudgetSteps of indices), each
    dealt to the ranks: yields this rank's share per step (index lists or `dataset` samples, maybe
    none); all ranks yield as many steps, each sample on one rank."""
    def __init__(self, lengths: Sequence[int] | np.ndarray, max_tokens: int, accum_steps: int, *,
                 num_replicas: int = 1, rank: int = 0, seed: int = 0, seq_len: int | None = None,
                 dataset: Sequence | None = None, **sampler_kwargs: Any) -> None:
        require(0 <= int(rank) < int(num_replicas),
                f"rank={rank} is outside 0..{int(num_replicas) - 1} (num_replicas={num_replicas})")
        # the steps do not depend on the number of ranks: one sampler, the same seed on every rank
        base = TokenBudgetBatchSampler(lengths, max_tokens, seed=seed, seq_len=seq_len,
                                       **sampler_kwargs)
        super().__init__(range(len(base.raw_lengths)), base, accum_steps)
        self.base, self.samples = base, dataset
        self.num_replicas, self.rank = int(num_replicas), int(rank)

    def global_steps(self) -> list[list[list[int]]]:
        """The epoch's optimizer steps, each a list of micro-batches, as one process would run
        them."""
        return list(super().__iter__())

    def split_step(self, step: Sequence[Sequence[int]]) -> list[list[int]]:
        """This rank's micro-batches of one global step, balanced by padded tokens (rows x longest
        row)."""
        costs = [len(b) * int(self.base.lengths[list(b)].max()) for b in step]
        return [list(step[i]) for i in assign_to_ranks(costs, self.num_replicas)[self.rank]]

    def __iter__(self) -> Iterator[list[list[Any]]]:
        for step in self.global_steps():
            share = self.split_step(step)
            if self.samples is not None:
                share = [[self.samples[i] for i in mb] for mb in share]
            yield share


def distributed_step_source(dataset: Sequence, max_tokens: int, accum_steps: int, *,
                            seq_len: int | None = None,
                            seed: int = 0,
                            info: DistInfo | None = None) -> DistributedTokenBudgetSampler:
    """This rank's steps of samples of `dataset` (which has `.lengths`): what the pipeline hands to
    fit_distributed."""
    info = info or DistInfo()
    return DistributedTokenBudgetSampler(dataset.lengths, max_tokens, accum_steps, seed=seed,
                                         seq_len=seq_len,
                                         num_replicas=info.world_size, rank=info.rank,
                                         dataset=dataset)


def wrap_ddp(model: nn.Module, info: DistInfo) -> nn.Module:
    """DistributedDataParallel around `model` (the model itself in one process)."""
    if not info.distributed:
        return model
    ddp = DistributedDataParallel(model, device_ids=[info.device.index]
                                  if info.device.type == "cuda" else None)
    # No per-forward buffer broadcast: a collective needing as many forwards on every rank, and ours
    # run as many as
    # they were dealt; the RoPE tables agree anyway. (An attribute before torch 2.13, then
    # forward_sync_buffers.)
    ddp.broadcast_buffers = False
    return ddp


class DDPController:
    """train.fit's controller under DDP: the global token count, then no_sync accumulation on the
    DDP model."""
    def __init__(self, model: nn.Module, ddp_model: nn.Module, info: DistInfo, cfg: Any, *,
                 pad_id: int = 0,
                 grad_callback: Callable | None = None) -> None:
        if cfg.normalization != "token":
            raise ValueError(f"TrainConfig.normalization={cfg.normalization!r}: data-parallel "
                             "training here is "
                             f"exact token-weighted ('token') only")
        self.model, self.ddp_model, self.info, self.pad_id = model, ddp_model, info, pad_id
        self.grad_callback, self.meter, self.step = grad_callback, None, 0

    def run_step(self, rank_micro_samples: Sequence[Sequence[Any]],
                 accumulate_fn: Callable) -> dict:
        """Forward+backward of this rank's share of one step; returns the global loss_sum and token
        count."""
        micro = [pad_collate(list(s), self.pad_id) for s in rank_micro_samples if len(s)]
        n_local = n_global = sum(trained_tokens(mb["labels"]) for mb in micro)
        # every rank divides by the same N: the whole step's tokens, on all ranks
        if self.info.distributed:
            # NCCL: CUDA tensors
            if self.info.backend == "nccl":
                comm = self.info.device
            else:
                comm = torch.device("cpu")
            n_global = int(all_reduce_sum(n_local, comm, torch.long))
        # A rank dealt nothing runs one micro-batch that trains nothing (labels -100), to join the
        # all-reduce.
        empty = {"input_ids": torch.full((1, 2), self.pad_id), "labels": torch.full((1, 2),
                                                                                    IGNORE_INDEX)}
        stats = accumulate_fn(micro or [empty], forward_model=self.ddp_model,
                              n_tokens_total=n_global)
        if self.grad_callback is not None:  # e.g. to compare gradients with one process
            self.grad_callback(self.step, self.model)
        self.step += 1
        return {"loss_sum": float(stats["loss_sum"]), "n_tokens": n_global, "rank_tokens": n_local,
                "rank_micro_batches": len(micro), "world_size": self.info.world_size, "events": [],
                # a MoE model's global aux loss
                **{k: stats[k] for k in ("aux_loss",) if k in stats}}

    def state_dict(self) -> dict:
        """The global step only: valid when resuming with any number of ranks."""
        return {"step": self.step, "world_size": self.info.world_size}

    def load_state_dict(self, state: dict) -> None:
        """Restore the global step (the saved world_size is informational)."""
        if "step" not in state:
            raise ValueError(f"DDP controller state has no key 'step' (keys: {sorted(state)})")
        self.step = int(state["step"])


def fit_distributed(model: nn.Module, step_source: Any, cfg: Any, *, info: DistInfo | None = None,
                    pad_id: int = 0,
                    val_batches: Any = None, resume_from: Any = None,
                    callbacks: Sequence[Callable] | None = None,
                    grad_callback: Callable | None = None,
                    comm_hook: tuple[Any, Callable] | None = None,
                    loggers: Sequence[Any] = ()) -> Any:
    """train.fit under DDP on this rank's steps (distributed_step_source); rank 0 alone logs,
    validates and writes; every rank returns the same global losses. comm_hook=(state, hook)
    replaces DDP's all-reduce (to count it)."""
    info = info or setup()
    ddp_model = wrap_ddp(model.to(info.device), info)
    if comm_hook is not None and ddp_model is not model:
        ddp_model.register_comm_hook(*comm_hook)
    controller = DDPController(model, ddp_model, info, cfg, pad_id=pad_id,
                               grad_callback=grad_callback)
    # fit's peak memory column
    if info.device.type == "cuda":
        controller.meter = MemoryMeter(info.device)
    else:
        controller.meter = None
    if info.is_main:
        run_cfg = cfg
    else:
        run_cfg = dataclasses.replace(cfg, progress=False)
    df = fit(model, step_source, run_cfg, device=info.device, val_batches=val_batches
             if info.is_main else None,
             controller=controller, callbacks=callbacks, resume_from=resume_from,
             is_main_process=info.is_main, loggers=loggers if info.is_main else ())
    df.attrs.update({"world_size": info.world_size, "backend": info.backend or "none",
                     "rank": info.rank})
    return df

