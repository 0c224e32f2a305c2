"""The course's one training loop: exact token-weighted gradient accumulation, AMP, clipping, AdamW, warmup+cosine.

Every later notebook and the CLI train through `fit`. The pieces are small functions so that a notebook can
show each one on its own:

- `step_token_count`  the number of trained tokens of an optimizer step (the one place DDP all-reduces),
- `accumulate_step`   forward+backward over the micro-batches of one step, loss = sum of token losses / tokens,
- `resolve_amp`       which autocast dtype (and whether a GradScaler) a device should use,
- `build_optimizer`   AdamW, fused where supported, weight decay only on 2-D weights,
- `lr_at`             linear warmup then cosine decay to `min_lr`,
- `fit`               the loop: metrics per optimizer step in a pandas DataFrame, NaN handling, checkpoints, resume,
- `evaluate`          token-weighted validation loss and perplexity.
"""

from __future__ import annotations

import contextlib
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import torch
from torch import nn

from .model import is_right_padded

IGNORE_INDEX = -100
AMP_MODES = ("auto", "bf16", "fp16", "off")
NORMALIZATIONS = ("token", "naive")


# --------------------------------------------------------------------------------------------- config


@dataclass
class TrainConfig:
    """Hyper-parameters of one training run (everything `fit` needs besides model, data and device)."""

    lr: float = 1e-3  # peak learning rate
    min_lr: float | None = None  # floor of the cosine decay; None: lr / 10
    warmup_steps: int = 10  # linear warmup, in optimizer steps
    max_steps: int = 100  # optimizer steps of the run (the cosine reaches min_lr here)
    accum_steps: int = 1  # micro-batches per optimizer step (ignored when a controller splits the step)
    weight_decay: float = 0.1  # applied to 2-D weights only (matmuls, embeddings), never to norms/biases
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    grad_clip: float | None = 1.0  # max global grad norm; None or 0: measure the norm, do not clip
    amp: str = "auto"  # "auto" | "bf16" | "fp16" | "off" (see resolve_amp)
    normalization: str = "token"  # "token": exact (sum / tokens of the step); "naive": mean per micro-batch / k
    seed: int = 1337
    log_every: int = 1  # progress-bar refresh, in optimizer steps
    eval_every: int = 0  # validation every N optimizer steps (0: only at the end, if val_batches is given)
    ckpt_every: int = 0  # training-state checkpoint every N optimizer steps (0: never)
    ckpt_dir: str | None = None  # checkpoints go to ckpt_dir/last.pt (every ckpt_every steps and at the end)
    max_bad_steps: int = 3  # NaN/inf steps in a row before rolling back to the last checkpoint
    lr_backoff: float = 0.5  # LR multiplier applied at each rollback
    max_rollbacks: int = 3  # rollbacks before giving up with an error
    progress: bool = True  # tqdm progress bar

    # Fields that change the optimisation itself: resuming with a different value is an error.
    RESUME_FIELDS = ("lr", "min_lr", "warmup_steps", "max_steps", "accum_steps", "weight_decay", "betas",
                     "eps", "grad_clip", "amp", "normalization", "seed")

    def __post_init__(self) -> None:
        if self.amp not in AMP_MODES:
            raise ValueError(f"TrainConfig.amp={self.amp!r}; choose one of {AMP_MODES}")
        if self.normalization not in NORMALIZATIONS:
            raise ValueError(f"TrainConfig.normalization={self.normalization!r}; choose one of {NORMALIZATIONS}")
        for name in ("max_steps", "accum_steps", "max_bad_steps"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"TrainConfig.{name}={getattr(self, name)!r} must be >= 1")
        for name in ("warmup_steps", "log_every", "eval_every", "ckpt_every"):
            if int(getattr(self, name)) < 0:
                raise ValueError(f"TrainConfig.{name}={getattr(self, name)!r} must be >= 0")
        if self.lr <= 0:
            raise ValueError(f"TrainConfig.lr={self.lr!r} must be > 0")
        self.betas = tuple(float(b) for b in self.betas)
        if self.min_lr is None:
            self.min_lr = self.lr / 10

    @classmethod
    def from_profile(cls, profile: Any, **overrides: Any) -> "TrainConfig":
        """A config sized by a course profile (lr, steps, accumulation, eval cadence), with overrides."""
        steps = overrides.pop("max_steps", profile.train_steps)
        base = dict(lr=profile.lr, max_steps=steps, accum_steps=profile.accum_steps,
                    warmup_steps=max(1, steps // 10), eval_every=profile.eval_every)
        base.update(overrides)
        return cls(**base)

    def to_dict(self) -> dict:
        """The config as plain types (stored in checkpoints, compared on resume)."""
        d = asdict(self)
        d["betas"] = list(d["betas"])
        return d


# --------------------------------------------------------------------------------------------- AMP


@dataclass(frozen=True)
class AmpSettings:
    """What autocast does on this device: the dtype (None: fp32, no autocast), whether a GradScaler, and why."""

    dtype: torch.dtype | None
    use_scaler: bool
    reason: str

    @property
    def name(self) -> str:
        """'bf16', 'fp16' or 'fp32'."""
        return {torch.bfloat16: "bf16", torch.float16: "fp16", None: "fp32"}[self.dtype]


def resolve_amp(amp: str, device: torch.device | str) -> AmpSettings:
    """Decide autocast dtype and GradScaler for `amp` ("auto"|"bf16"|"fp16"|"off") on `device`.

    auto: CUDA with bf16 tensor cores -> bf16 (no scaler: bf16 has fp32's exponent range);
          older CUDA -> fp16 + GradScaler (fp16 gradients underflow without loss scaling);
          CPU with native bf16 (AVX512-BF16/AMX) -> bf16; CPU without -> fp32, because autocast there
          emulates bf16 and is slower than fp32 (notebook 05 measures it);
          MPS -> fp32: autocast op coverage on MPS still varies with the macOS/torch version, and the
          course's models are small enough that fp32 fits; pass amp="bf16" to opt in.
    """
    from .device import bf16_native, bf16_supported

    device = torch.device(device)
    if amp not in AMP_MODES:
        raise ValueError(f"amp={amp!r}; choose one of {AMP_MODES}")
    if amp == "off":
        return AmpSettings(None, False, "amp='off': fp32")
    if amp == "bf16":
        if not bf16_supported(device):
            raise ValueError(f"amp='bf16' requested but {device} does not support bf16 (try amp='fp16' or 'auto')")
        return AmpSettings(torch.bfloat16, False, "amp='bf16' requested")
    if amp == "fp16":
        # The scaler is what makes fp16 training safe; it works on CPU and MPS too in torch.amp.
        return AmpSettings(torch.float16, True, "amp='fp16' requested: fp16 autocast + GradScaler")
    if device.type == "cuda":
        if bf16_native(device):
            return AmpSettings(torch.bfloat16, False, "auto: CUDA with native bf16 -> bf16 autocast")
        return AmpSettings(torch.float16, True, "auto: CUDA without native bf16 -> fp16 autocast + GradScaler")
    if device.type == "cpu":
        if bf16_native(device):
            return AmpSettings(torch.bfloat16, False, "auto: CPU with native bf16 instructions -> bf16 autocast")
        return AmpSettings(None, False, "auto: CPU without native bf16 -> fp32 (emulated bf16 is slower)")
    return AmpSettings(None, False, f"auto: {device.type} -> fp32 (autocast coverage varies; opt in with amp='bf16')")


def make_scaler(amp: AmpSettings, device: torch.device | str) -> torch.amp.GradScaler | None:
    """A torch.amp.GradScaler when the AMP settings need one, else None."""
    if not amp.use_scaler:
        return None
    return torch.amp.GradScaler(torch.device(device).type)


# --------------------------------------------------------------------------------------------- optimizer, schedule


def build_optimizer(model: nn.Module, cfg: TrainConfig, device: torch.device | str) -> torch.optim.AdamW:
    """AdamW with weight decay only on 2-D weights (not norms/biases), fused on CUDA and CPU."""
    decay, no_decay = [], []
    for _, p in model.named_parameters():  # named_parameters de-duplicates tied weights
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    # fused=True runs the whole update in one kernel per parameter group instead of a loop of small ops;
    # PyTorch has it on CUDA and CPU (measured by `bench throughput --levers`: the CPU step takes ~0.2x the time).
    extra = {"fused": True} if torch.device(device).type in ("cuda", "cpu") else {}
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, **extra)


def lr_at(step: int, *, lr: float, min_lr: float, warmup_steps: int, max_steps: int) -> float:
    """Learning rate at 0-based optimizer step `step`: linear warmup to `lr`, cosine decay to `min_lr`."""
    if warmup_steps > 0 and step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if step >= max_steps:
        return min_lr
    span = max(1, max_steps - warmup_steps)
    progress = (step - warmup_steps) / span
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (lr - min_lr)


# --------------------------------------------------------------------------------------------- accumulation


def batch_token_count(labels: torch.Tensor) -> int:
    """Trained tokens of one collated batch: shifted labels that are not -100."""
    return int((labels[:, 1:] != IGNORE_INDEX).sum())


def world_size() -> int:
    """Number of data-parallel processes (1 unless torch.distributed is initialised)."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def all_reduce_sum(value: float | int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Sum a number over all ranks (a tensor on `device`: NCCL needs CUDA tensors, gloo takes CPU ones)."""
    import torch.distributed as dist

    t = torch.tensor(value, device=device, dtype=dtype)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def step_token_count(micro_batches: Sequence[dict], device: torch.device | str | None = None) -> int:
    """Trained tokens of a whole optimizer step, counted up front from the labels (no device sync).

    This is the single place a data-parallel run all-reduces the count: under torch.distributed every rank
    gets the global number of tokens of the step, so that each divides its token-loss sum by the same total.
    """
    n = sum(batch_token_count(mb["labels"]) for mb in micro_batches)
    if world_size() > 1:
        n = int(all_reduce_sum(n, torch.device(device or "cpu"), torch.long))
    return n


def _lm_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of shifted fp32 token losses (the model's `lm_loss(..., reduction='sum')`)."""
    from .model import lm_loss

    return lm_loss(logits, labels, reduction="sum")


def _forward_logits(model: nn.Module, mb: dict) -> torch.Tensor:
    """Run the model on one collated micro-batch and return its logits."""
    kwargs = {}
    if mb.get("attention_mask") is not None:
        kwargs["attention_mask"] = mb["attention_mask"]
    if mb.get("position_ids") is not None:
        kwargs["position_ids"] = mb["position_ids"]
    out = model(mb["input_ids"], **kwargs)
    return out.logits if hasattr(out, "logits") else out


def _to_device(mb: dict, device: torch.device) -> dict:
    """Move the tensors of a micro-batch to `device` (non_blocking: overlaps with compute from pinned memory).

    A right-padded (B, T) attention_mask is left out: the model would drop it anyway (causal attention is exact
    for every real token, model.build_attention_mask), and checking it here, on the CPU, spares the GPU a sync."""
    mask = mb.get("attention_mask")
    if torch.is_tensor(mask) and mask.dim() == 2 and mask.device.type == "cpu" and is_right_padded(mask):
        mb = {k: v for k, v in mb.items() if k != "attention_mask"}
    return {k: (v.to(device, non_blocking=True) if torch.is_tensor(v) else v) for k, v in mb.items()}


def accumulate_step(model: nn.Module, micro_batches: Sequence[dict], *, amp_dtype: torch.dtype | None = None,
                    scaler: torch.amp.GradScaler | None = None, device: torch.device | str | None = None,
                    n_tokens_total: int | None = None, normalization: str = "token") -> dict:
    """Forward+backward over the micro-batches of one optimizer step; gradients accumulate in .grad.

    normalization="token" (exact): every micro-batch contributes lm_loss(reduction="sum") / n_tokens_total,
    so the accumulated gradient is that of the mean token loss over the whole step, whatever the lengths.
    normalization="naive" (MiniMind's loop): mean loss of each micro-batch / k, which over-weights the tokens of
    short micro-batches. Does not step the optimizer. Returns loss_sum, n_tokens, loss, micro_batches, rows.
    Under torch.distributed (a DDP-wrapped model) the token count and the logged loss sum are all-reduced,
    gradients sync only on the last micro-batch (no_sync), and the result equals one process on all the data.
    """
    if normalization not in NORMALIZATIONS:
        raise ValueError(f"normalization={normalization!r}; choose one of {NORMALIZATIONS}")
    if not micro_batches:
        raise ValueError("accumulate_step got no micro-batches")
    device = torch.device(device) if device is not None else next(model.parameters()).device
    world = world_size()
    if n_tokens_total is None:
        n_tokens_total = step_token_count(micro_batches, device)
    if n_tokens_total <= 0:
        raise ValueError("accumulate_step: the step has no trained tokens (every shifted label is -100)")
    k = len(micro_batches)
    loss_sum = torch.zeros((), device=device, dtype=torch.float32)
    rows = padded = 0
    for i, mb in enumerate(micro_batches):
        mb = _to_device(mb, device)
        # Under DDP, all-reduce the gradients once per step: skip the sync on all but the last micro-batch.
        sync = model.no_sync() if (world > 1 and i < k - 1 and hasattr(model, "no_sync")) else contextlib.nullcontext()
        with sync:
            with torch.autocast(device_type=device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                logits = _forward_logits(model, mb)
            # lm_loss computes in fp32 outside autocast's low precision (MiniMind does CE in fp32 too).
            token_loss_sum = _lm_loss_sum(logits, mb["labels"])
            if normalization == "token":
                # DDP averages gradients over ranks; x world undoes that, so the sum is over all ranks' tokens.
                loss = token_loss_sum * (world / n_tokens_total)
            else:
                n_mb = batch_token_count(mb["labels"])
                loss = token_loss_sum / max(n_mb, 1) / k
            (scaler.scale(loss) if scaler is not None else loss).backward()
        loss_sum += token_loss_sum.detach().float()
        rows += mb["input_ids"].shape[0]
        padded += mb["input_ids"].numel()
    if world > 1:  # the logged loss is the step's global token mean
        loss_sum = all_reduce_sum(float(loss_sum), device, torch.float64)
    loss_sum_f = float(loss_sum)  # one device sync per step
    return {"loss_sum": loss_sum_f, "n_tokens": int(n_tokens_total), "loss": loss_sum_f / n_tokens_total,
            "micro_batches": k, "rows": rows, "padded_tokens": padded}


# --------------------------------------------------------------------------------------------- evaluation


@torch.no_grad()
def evaluate(model: nn.Module, batches: Iterable[dict], *, device: torch.device | str | None = None,
             amp_dtype: torch.dtype | None = None, max_batches: int | None = None) -> dict:
    """Token-weighted validation loss (sum of token losses / tokens) and its perplexity exp(loss)."""
    device = torch.device(device) if device is not None else next(model.parameters()).device
    was_training = model.training
    model.eval()
    total, n = 0.0, 0
    try:
        for i, mb in enumerate(batches):
            if max_batches is not None and i >= max_batches:
                break
            mb = _to_device(mb, device)
            with torch.autocast(device_type=device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                logits = _forward_logits(model, mb)
            total += float(_lm_loss_sum(logits, mb["labels"]))
            n += batch_token_count(mb["labels"])
    finally:
        model.train(was_training)
    if n == 0:
        raise ValueError("evaluate: the batches have no trained tokens")
    loss = total / n
    return {"loss": loss, "ppl": math.exp(min(loss, 50.0)), "tokens": n}


# --------------------------------------------------------------------------------------------- data stream


class DataStream:
    """Endless iteration over a re-iterable source (list, DataLoader), epoch by epoch, with a resumable position.

    The position is (epoch, offset): items drawn from the current epoch. Resuming re-creates the epoch's
    iterator (calling `set_epoch` on the source's sampler when there is one, as DistributedSampler and the
    token-budget sampler expect) and skips `offset` items, so the data order must be deterministic per epoch.
    """

    def __init__(self, source: Iterable) -> None:
        self.source = source
        # An iterator (a generator) cannot be restarted; a list or DataLoader can. Checked without calling
        # iter(), which would start a DataLoader's workers and draw from the RNG.
        self.restartable = not hasattr(source, "__next__")
        self.epoch = 0
        self.offset = 0
        self._it = None

    def _set_epoch(self) -> None:
        for obj in (self.source, getattr(self.source, "sampler", None), getattr(self.source, "batch_sampler", None)):
            if obj is not None and hasattr(obj, "set_epoch"):
                obj.set_epoch(self.epoch)

    def _start_epoch(self) -> None:
        self._set_epoch()
        self._it = iter(self.source)

    def next(self) -> Any:
        """The next item; starts a new epoch when the current one ends (StopIteration for a spent generator)."""
        if self._it is None:
            self._start_epoch()
        try:
            item = next(self._it)
        except StopIteration:
            if not self.restartable:
                raise
            if self.offset == 0:
                raise ValueError("the training data is empty: an epoch yielded no batches") from None
            self.epoch += 1
            self.offset = 0
            self._start_epoch()
            item = next(self._it)
        self.offset += 1
        return item

    def state_dict(self) -> dict:
        """Position as plain ints (stored in checkpoints)."""
        return {"epoch": int(self.epoch), "offset": int(self.offset)}

    def load_state_dict(self, state: dict) -> None:
        """Move to a stored position: same epoch, skip `offset` items."""
        self.epoch, target = int(state["epoch"]), int(state["offset"])
        self._start_epoch()
        self.offset = 0
        for _ in range(target):
            next(self._it)
            self.offset += 1


# --------------------------------------------------------------------------------------------- RNG


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (CPU and all GPUs)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


# --------------------------------------------------------------------------------------------- memory meter glue


def _default_meter(device: torch.device):
    """A MemoryMeter on CUDA (free: the allocator counts anyway); on CPU only when the caller passes one."""
    if device.type != "cuda":
        return None
    try:
        from .memory import MemoryMeter
    except ImportError:
        return None
    return MemoryMeter(device)


def _meter_track(meter, model: nn.Module, optimizer: torch.optim.Optimizer):
    """The meter's measuring context for one step (CPU: live-tensor tracking; CUDA: the allocator's counters)."""
    if meter is None or not hasattr(meter, "track"):
        return contextlib.nullcontext()
    return meter.track(model, optimizer)


def _meter_peak(meter) -> float:
    """Peak bytes since the meter's last reset_peak() (NaN without a meter)."""
    return float("nan") if meter is None else float(meter.peak())


# --------------------------------------------------------------------------------------------- the loop


def _accepts(fn: Callable, name: str) -> bool:
    """Whether `fn` takes a keyword argument `name` (the controller may clear grads itself on OOM retries)."""
    import inspect

    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def _params_finite(model: nn.Module) -> bool:
    """True when every parameter is finite (a NaN checkpoint must never be written)."""
    return all(bool(torch.isfinite(p).all()) for p in model.parameters())


def _optimizer_step(stats: dict, optimizer, scaler, params, cfg: TrainConfig, events: list, state: dict):
    """Unscale, clip, step (or skip a non-finite step), zero the grads; return (grad_norm, skipped)."""
    loss = stats["loss_sum"] / max(stats["n_tokens"], 1)
    if not math.isfinite(loss):
        # A NaN/inf loss poisons every gradient: drop the step and keep the scaler out of it.
        optimizer.zero_grad(set_to_none=True)
        events.append("nonfinite_loss_skipped")
        return float("nan"), True
    if scaler is not None:
        scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
    max_norm = cfg.grad_clip if cfg.grad_clip else float("inf")
    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
    skipped = False
    if scaler is not None:
        scale_before = scaler.get_scale()
        scaler.step(optimizer)  # skips the update itself when the grads hold inf/NaN
        scaler.update()
        if not math.isfinite(grad_norm):
            state["scaler_skips"] += 1  # the usual fp16 overflow: the scaler lowers its scale, not a bad step
            events.append(f"scaler_skip(scale {scale_before:g}->{scaler.get_scale():g})")
    elif math.isfinite(grad_norm):
        optimizer.step()
    else:
        skipped = True
        events.append("nonfinite_grad_skipped")
    optimizer.zero_grad(set_to_none=True)
    return grad_norm, skipped


def fit(model: nn.Module, train_batches_or_loader: Iterable, cfg: TrainConfig, *, device: torch.device | str,
        val_batches: Iterable[dict] | None = None, controller: Any = None, meter: Any = None,
        callbacks: Sequence[Callable[[int, dict], Any]] | None = None,
        resume_from: str | Path | None = None, is_main_process: bool = True) -> "pd.DataFrame":
    """Train `model` for cfg.max_steps optimizer steps; return one metrics row per optimizer step.

    Without a controller, `train_batches_or_loader` yields collated micro-batches ({"input_ids", "labels",
    "attention_mask"}) and every cfg.accum_steps of them make one optimizer step. With a controller, it yields
    the list of dataset samples of each step, and `controller.run_step(samples, accumulate_fn)` splits them
    into micro-batches (and recovers from OOM); its events go into the frame's `event` column.
    Each callback is called as cb(step, row) after the step; returning "stop" ends training early.
    Columns: step, loss, lr, grad_norm, tokens, tokens_per_s, peak_memory_bytes, wall_time, step_time,
    skipped, event, scale, val_loss, val_ppl (plus any scalar stats the controller returns).
    """
    import pandas as pd
    from tqdm.auto import tqdm

    from .checkpoint import load_training_state, save_training_state, set_rng_state

    device = torch.device(device)
    model.to(device)
    model.train()
    amp = resolve_amp(cfg.amp, device)
    scaler = make_scaler(amp, device)
    optimizer = build_optimizer(model, cfg, device)
    if meter is None:  # a controller measures with its own meter (its budget); else a free one on CUDA
        meter = getattr(controller, "meter", None) if controller is not None else _default_meter(device)
    stream = DataStream(train_batches_or_loader)
    callbacks = list(callbacks or [])
    ckpt_path = Path(cfg.ckpt_dir) / "last.pt" if cfg.ckpt_dir else None

    state = {"step": 0, "lr_scale": 1.0, "bad_in_row": 0, "bad_steps": 0, "rollbacks": 0, "scaler_skips": 0,
             "data_exhausted": False, "dropped_micro_batches": 0}

    def restore(path: Path, check_config: bool) -> None:
        info = load_training_state(path, model, optimizer=optimizer, scaler=scaler, controller=controller,
                                   cfg=cfg if check_config else None, map_location=device, restore_rng=False)
        state["step"] = info["step"]
        state["lr_scale"] = info["extra"].get("lr_scale", 1.0)
        state["bad_steps"] = info["extra"].get("bad_steps", 0)
        stream.load_state_dict(info["data"])
        # RNG last: re-creating the data iterator above may draw from it (a shuffling DataLoader does).
        set_rng_state(info["rng"])

    def save() -> str:
        if ckpt_path is None:
            return ""
        if not _params_finite(model):
            return "ckpt_skipped_nonfinite"
        if not is_main_process:  # data parallel: rank 0 writes, every rank reads (resume, NaN rollback)
            return "ckpt"
        save_training_state(ckpt_path, model, optimizer, cfg=cfg, step=state["step"], scaler=scaler,
                            data_state=stream.state_dict(), controller=controller,
                            extra={"lr_scale": state["lr_scale"], "bad_steps": state["bad_steps"]})
        return "ckpt"

    if resume_from is not None:
        restore(Path(resume_from), check_config=True)
    else:
        seed_everything(cfg.seed)

    def accumulate_fn(micro_batches: Sequence[dict], *, forward_model: nn.Module | None = None,
                      n_tokens_total: int | None = None) -> dict:
        # forward_model: e.g. the DistributedDataParallel wrapper of `model` (minimind_lib.distributed);
        # n_tokens_total: the step's trained tokens all-reduced over the ranks (None: count these micro-batches).
        return accumulate_step(forward_model if forward_model is not None else model, micro_batches,
                               amp_dtype=amp.dtype, scaler=scaler, device=device,
                               n_tokens_total=n_tokens_total, normalization=cfg.normalization)

    rows: list[dict] = []
    t_start = time.perf_counter()
    bar = tqdm(total=cfg.max_steps, initial=state["step"], disable=not cfg.progress, desc="train")
    params = [p for p in model.parameters() if p.requires_grad]
    stop = False
    try:
        while state["step"] < cfg.max_steps and not stop:
            step = state["step"]
            lr = lr_at(step, lr=cfg.lr, min_lr=cfg.min_lr, warmup_steps=cfg.warmup_steps,
                       max_steps=cfg.max_steps) * state["lr_scale"]
            for g in optimizer.param_groups:
                g["lr"] = lr
            events: list[str] = []
            t0 = time.perf_counter()
            with _meter_track(meter, model, optimizer):
                if meter is not None:
                    meter.reset_peak()
                micro: list = []
                try:
                    if controller is None:
                        while len(micro) < cfg.accum_steps:
                            micro.append(stream.next())
                        stats = accumulate_fn(micro)
                    else:
                        kw = {"zero_grad": model} if _accepts(controller.run_step, "zero_grad") else {}
                        stats = dict(controller.run_step(stream.next(), accumulate_fn, **kw))
                        events += [str(e) for e in stats.pop("events", []) or []]
                except StopIteration:  # a spent generator: stop, and say what was left over
                    state["data_exhausted"] = True
                    state["dropped_micro_batches"] = len(micro)
                    break
                grad_norm, skipped = _optimizer_step(stats, optimizer, scaler, params, cfg, events, state)
            step_time = time.perf_counter() - t0
            loss = stats["loss_sum"] / max(stats["n_tokens"], 1)
            peak = _meter_peak(meter)
            row = {"step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm, "tokens": stats["n_tokens"],
                   "tokens_per_s": stats["n_tokens"] / step_time if step_time > 0 else float("nan"),
                   "peak_memory_bytes": peak, "step_time": step_time, "skipped": skipped,
                   "scale": scaler.get_scale() if scaler is not None else float("nan"),
                   "val_loss": float("nan"), "val_ppl": float("nan")}
            for key, value in stats.items():  # controller extras: micro_batch_size, accum, seq_len, ...
                if key not in row and key not in ("loss_sum", "n_tokens") and isinstance(value, (int, float, str)):
                    row[key] = value

            if skipped:
                state["bad_in_row"] += 1
                state["bad_steps"] += 1
                if state["bad_in_row"] >= cfg.max_bad_steps:
                    if state["rollbacks"] >= cfg.max_rollbacks:
                        raise RuntimeError(
                            f"training diverged: {state['bad_in_row']} non-finite steps in a row at step {step} "
                            f"after {state['rollbacks']} rollbacks (lr scale {state['lr_scale']:g})")
                    state["rollbacks"] += 1
                    new_scale = state["lr_scale"] * cfg.lr_backoff
                    if ckpt_path is not None and ckpt_path.exists():
                        bad_total = state["bad_steps"]
                        restore(ckpt_path, check_config=False)
                        state["bad_steps"] = bad_total
                        events.append(f"rollback_to_step_{state['step']}")
                    else:
                        events.append("no_checkpoint_to_roll_back_to")
                        state["step"] += 1
                    state["lr_scale"] = new_scale
                    events.append(f"lr_scale={new_scale:g}")
                    state["bad_in_row"] = 0
                else:
                    state["step"] += 1
            else:
                state["bad_in_row"] = 0
                state["step"] += 1

            done_steps = state["step"]
            if not skipped and val_batches is not None and (
                    (cfg.eval_every and done_steps % cfg.eval_every == 0) or done_steps == cfg.max_steps):
                ev = evaluate(model, val_batches, device=device, amp_dtype=amp.dtype)
                row["val_loss"], row["val_ppl"] = ev["loss"], ev["ppl"]
            if not skipped and cfg.ckpt_every and done_steps % cfg.ckpt_every == 0:
                tag = save()
                if tag:
                    events.append(tag)
            row["wall_time"] = time.perf_counter() - t_start
            row["event"] = ";".join(events)
            rows.append(row)
            bar.update(max(0, done_steps - bar.n))
            if cfg.progress and (cfg.log_every <= 1 or step % cfg.log_every == 0):
                bar.set_postfix(loss=f"{loss:.3f}", lr=f"{lr:.2e}")
            for cb in callbacks:
                if cb(step, row) == "stop":
                    stop = True
        if ckpt_path is not None and rows and "ckpt" not in rows[-1]["event"].split(";"):
            tag = save()  # the final state, so a later run (or notebook) can resume or load it
            rows[-1]["event"] = ";".join(e for e in (rows[-1]["event"], tag) if e)
    finally:
        bar.close()
    df = pd.DataFrame(rows)
    df.attrs.update({"amp": amp.name, "amp_reason": amp.reason, "bad_steps": state["bad_steps"],
                     "rollbacks": state["rollbacks"], "scaler_skips": state["scaler_skips"],
                     "final_lr_scale": state["lr_scale"], "data_exhausted": state["data_exhausted"],
                     "dropped_micro_batches": state["dropped_micro_batches"]})
    if state["data_exhausted"]:
        import warnings

        warnings.warn(f"training data ran out after {state['step']} of {cfg.max_steps} steps; "
                      f"{state['dropped_micro_batches']} micro-batch(es) of an incomplete step were not trained",
                      stacklevel=2)
    return df
