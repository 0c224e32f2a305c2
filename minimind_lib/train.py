"""The training loop of notebooks 04_gradient_accumulation and 05_mixed_precision, in their order
(the section comments name their sections). `fit` adds validation, resumable checkpoints, NaN
rollbacks, callbacks and controllers.

No host sync in the hot loop: a GPU runs ahead of Python until a value is read back (float(),
.item(), if tensor:), which waits for every queued kernel. A step keeps its loss, grad norm and
NaN/inf verdict on the device (fused AdamW skips a NaN step there), and `fit` reads them every
cfg.log_every steps and before a validation, a checkpoint and the end, where it counts NaN steps for
a rollback."""

import contextlib
import inspect
import math
import time
import warnings

from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import pandas as pd
import torch
import torch.distributed as dist
from torch import nn
from tqdm.auto import tqdm

from .batching import document_mask
from .checkpoint import (DataStream, load_training_state, nonfinite_parameters,
                         save_training_state, seed_everything,
                         set_rng_state)
from .data import trained_tokens
from .device import AMP_MODES, CPU_BF16_MIN_HIDDEN, AmpSettings, resolve_amp  # noqa: F401 (05)
from .loggers import SendRows
from .memory import MemoryMeter
from .checks import require
from .config import NORMALIZATIONS, TrainConfig  # noqa: F401 (train.TrainConfig too)
from .model import chunked_lm_loss, is_right_padded, lm_loss

# 1. A plain step (notebook 04, section 1)
# ----------------------------------------------------------------------
def _to_device(batch: dict, device: torch.device) -> dict:
    """Move a batch's tensors to `device`, minus a right-padded (B, T) attention_mask (the model
    would drop it); packed rows get their document mask on the device, made from their CPU doc_ids
    (a repeat is reused)."""
    mask = batch.get("attention_mask")
    # no sync
    if (
        torch.is_tensor(mask)
        and mask.dim() == 2
        and mask.device.type == "cpu"
        and is_right_padded(mask)
    ):
        batch = {k: v for k, v in batch.items() if k != "attention_mask"}
    if isinstance(batch.get("block_mask"), str) and batch["doc_ids"].device.type == "cpu":
        mask = document_mask(batch["doc_ids"], batch["block_mask"], device)
        batch = {**batch, "attention_mask": mask, "block_mask": None}
    moved = dict(batch)
    for k, v in batch.items():
        if torch.is_tensor(v):
            moved[k] = v.to(device, non_blocking=True)
    return moved


def forward_logits(model: nn.Module, batch: dict, amp_dtype: torch.dtype | None = None,
                   with_aux: bool = False) -> torch.Tensor | tuple[torch.Tensor,
                                                                   torch.Tensor | None]:
    """The logits for one collated batch (with its attention_mask, position_ids), under autocast to
    amp_dtype if set; with_aux: (logits, the MoE load-balancing loss or None)."""
    kwargs = {k: batch[k] for k in ("attention_mask", "position_ids") if batch.get(k) is not None}
    # packed rows: their mask made here, on the device (06, batching)
    if isinstance(batch.get("block_mask"), str):
        kwargs["attention_mask"] = document_mask(batch["doc_ids"], batch["block_mask"])
    # notebook 05
    with torch.autocast(batch["input_ids"].device.type, dtype=amp_dtype,
                        enabled=amp_dtype is not None):
        out = model(batch["input_ids"], **kwargs)
    logits = out.logits if hasattr(out, "logits") else out
    if with_aux:
        return (logits, getattr(out, "aux_loss", None))
    return logits


def forward_loss(model: nn.Module, batch: dict, amp_dtype: torch.dtype | None = None,
                 loss_chunk: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(summed fp32 token loss, MoE aux loss or None) of one collated batch: through the (B, T, V)
    logits, or with loss_chunk > 0 from the hidden states through model.chunked_lm_loss, loss_chunk
    positions at a time."""
    if not loss_chunk:
        logits, aux = forward_logits(model, batch, amp_dtype, with_aux=True)
        return lm_loss(logits, batch["labels"], reduction="sum"), aux
    require(hasattr(model, "lm_head"),
            f"loss_chunk={loss_chunk}: needs the model, not a {type(model).__name__}")
    device_type = batch["input_ids"].device.type
    with torch.autocast(device_type, dtype=amp_dtype, enabled=amp_dtype is not None):
        hidden, _ = forward_logits(model.model, batch, amp_dtype)  # the trunk: hidden states
        loss_sum = chunked_lm_loss(hidden, model.lm_head.weight, batch["labels"], loss_chunk)
    aux = [layer.mlp.aux_loss for layer in model.model.layers
           if getattr(layer.mlp, "aux_loss", None) is not None]
    if not aux:
        return loss_sum, None
    return loss_sum, sum(aux)


# 2. The schedule (04, section 2)
# --------------------------------------------------------------------------------
def lr_at(step: int, *, lr: float, min_lr: float, warmup_steps: int, max_steps: int) -> float:
    """Learning rate at 0-based optimizer step `step`: linear warmup to `lr`, cosine decay to
    `min_lr`."""
    if warmup_steps > 0 and step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if step >= max_steps:
        return min_lr
    progress = (step - warmup_steps) / max(1, max_steps - warmup_steps)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (lr - min_lr)


# 3. Clip and update (04, section 3; the scaler's lines: 05)
# ----------------------------------------------------
def optimizer_step(optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor],
                   grad_clip: float | None,
                   scaler: torch.amp.GradScaler | None = None,
                   loss_sum: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Clip the grad norm to `grad_clip`, step unless a gradient (or `loss_sum`) is inf/NaN, zero
    the grads; (norm, finite), device tensors: a fused AdamW (or a GradScaler's) skips on the
    device, others read `finite` first."""
    if scaler is not None:
        scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
    grad_norm = torch.nn.utils.clip_grad_norm_(params, grad_clip or float("inf"))
    finite = torch.isfinite(grad_norm) & torch.isfinite(torch.as_tensor(0.0 if loss_sum is None
                                                                        else loss_sum))
    if scaler is not None:
        scaler.step(optimizer)  # skipped inside when the gradients hold inf/NaN
        # halves the scale after an overflow, doubles it after growth_interval good steps
        scaler.update()
    elif optimizer.defaults.get("fused"):
        # The one private use: a fused AdamW's step reads optimizer.grad_scale and .found_inf, the
        # attributes GradScaler.step sets on it; found_inf = 1 makes the kernel leave weights and
        # states as they are, so a NaN step is skipped on the device, with no host sync.
        optimizer.grad_scale, optimizer.found_inf = None, (~finite).float()
        optimizer.step()
        del optimizer.grad_scale, optimizer.found_inf
    elif finite:  # a host sync: other optimizers have no on-device skip
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm, finite


# 4. Exact token-weighted accumulation (04, section 4; data parallel: 09)
# ---------------------------------------
def world_size() -> int:
    """Number of data-parallel processes (1 unless torch.distributed is initialised)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return 1


def all_reduce_sum(value: float | int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Sum a number over all ranks (a tensor on `device`: NCCL needs CUDA tensors, gloo takes CPU
    ones)."""
    t = torch.tensor(value, device=device, dtype=dtype)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def step_token_count(micro_batches: Sequence[dict],
                     device: torch.device | str | None = None) -> int:
    """Trained tokens of a whole optimizer step, from the labels, up front (all-reduced under data
    parallelism)."""
    n = sum(trained_tokens(mb["labels"]) for mb in micro_batches)
    if world_size() > 1:  # every rank must divide by the same, global, count
        n = int(all_reduce_sum(n, torch.device(device or "cpu"), torch.long))
    return n


class NextToken:
    """What a step minimizes (the objective fit and accumulate_step take): the next-token loss
    summed over a micro-batch's trained tokens, and their count; a step's loss is the sum over its
    micro-batches / their total count. Notebook 10's dpo.DPO has the same two methods, per pair."""

    def count(self, batch: dict) -> int:
        return trained_tokens(batch["labels"])

    def __init__(self, loss_chunk: int = 0) -> None:
        self.loss_chunk = loss_chunk  # > 0: forward_loss's chunked head and loss

    def loss_sum(self, model: nn.Module, batch: dict, amp_dtype: torch.dtype | None) -> tuple:
        """(the summed loss, fp32; the MoE load-balancing loss or None)."""
        return forward_loss(model, batch, amp_dtype, self.loss_chunk)


def _step_counts(objective: Any, micro_batches: Sequence[dict], n_tokens_total: int | None,
                 device: torch.device) -> tuple[list[int], int, dict]:
    """Each micro-batch's trained count (from the CPU's batches: no device read), the step's (under
    DDP every rank divides by the step's global count) and the step's sizes."""
    counts = [objective.count(mb) for mb in micro_batches]
    if n_tokens_total is None:
        n_tokens_total = sum(counts)
        if world_size() > 1:
            n_tokens_total = step_token_count(micro_batches, device)
    stats = {"micro_batches": len(micro_batches),
             "rows": sum(len(mb["input_ids"]) for mb in micro_batches),
             "padded_tokens": sum(mb["input_ids"].numel() for mb in micro_batches),
             "empty_micro_batches": 0}
    return counts, n_tokens_total, stats


def accumulate_step(model: nn.Module, micro_batches: Sequence[dict], *,
                    amp_dtype: torch.dtype | None = None, device: torch.device | str | None = None,
                    scaler: torch.amp.GradScaler | None = None, n_tokens_total: int | None = None,
                    normalization: str = "token", sync: bool = True, loss_chunk: int = 0,
                    objective: Any = None) -> dict:
    """Forward+backward over the micro-batches of one optimizer step; gradients add up in .grad (no
    update). Returns loss_sum, n_tokens, loss (their ratio), micro_batches, rows, padded_tokens,
    empty_micro_batches (labels all -100: not run; under DDP run, adding 0, as the gradient sync
    needs every rank's backward) and, for a MoE model, aux_loss (trained, not in `loss`).
    sync=False (fit's loop): loss_sum and aux_loss stay device tensors, no `loss`. loss_chunk > 0:
    the head and the loss loss_chunk positions at a time. objective: what is summed and counted
    (default NextToken(loss_chunk); notebook 10's DPO counts pairs)."""
    require(normalization in NORMALIZATIONS,
            f"normalization={normalization!r}; choose one of {NORMALIZATIONS}")
    require(len(micro_batches) > 0, "accumulate_step got no micro-batches")
    device = torch.device(device or next(model.parameters()).device)
    world, k = world_size(), len(micro_batches)
    objective = objective or NextToken(loss_chunk)
    counts, n_tokens_total, stats = _step_counts(objective, micro_batches, n_tokens_total, device)
    if n_tokens_total <= 0:  # every label -100: nothing to learn; the caller skips the step
        return {**stats, "loss_sum": 0.0, "n_tokens": 0, "loss": math.nan, "empty_micro_batches": k}
    sums, has_aux = torch.zeros(2, device=device, dtype=torch.float32), False  # loss_sum, aux
    for i, (mb, n_i) in enumerate(zip(micro_batches, counts)):
        if world == 1 and n_i == 0:
            stats["empty_micro_batches"] += 1
            continue
        mb = _to_device(mb, device)
        sync_grads = contextlib.nullcontext()  # DDP: all-reduce the grads once, at the last
        if world > 1 and i < k - 1 and hasattr(model, "no_sync"):
            sync_grads = model.no_sync()
        with sync_grads:
            token_loss_sum, aux = objective.loss_sum(model, mb, amp_dtype)  # fp32
            # token: exact, / the step's tokens (x world: DDP averages over the ranks), a MoE aux
            # weighed by the micro-batch's share of them; naive (MiniMind's loop): mean loss / k
            if normalization == "token":
                loss = token_loss_sum * (world / n_tokens_total)
                share = n_i / n_tokens_total
                aux_weight = share * world
            else:
                loss = token_loss_sum / max(n_i, 1) / k
                share = aux_weight = 1 / k
            if aux is not None:
                loss, has_aux = loss + aux * aux_weight, True
                sums[1] += aux.detach().float() * share
            if scaler is not None:
                loss = scaler.scale(loss)
            loss.backward()
        sums[0] += token_loss_sum.detach().float()
    if world > 1:
        sums = sums.double()
        dist.all_reduce(sums, op=dist.ReduceOp.SUM)
    loss_sum, aux_loss = sums  # sync=False: 0-d device tensors, unread
    if sync:
        loss_sum, aux_loss = sums.tolist()
    stats.update(loss_sum=loss_sum, n_tokens=int(n_tokens_total))
    if sync:
        stats["loss"] = loss_sum / n_tokens_total
    if has_aux:
        stats["aux_loss"] = aux_loss
    return stats


# 5. AdamW's parameter groups (04, section 5)
# --------------------------------------------------------------------
def build_optimizer(model: nn.Module, cfg: TrainConfig,
                    device: torch.device | str) -> torch.optim.AdamW:
    """AdamW with weight decay only on 2-D weights (not norms), fused on CUDA, MPS and CPU (one
    kernel, which also skips a NaN/inf step on the device: optimizer_step)."""
    # named_parameters: the tied weight once
    params = [p for _, p in model.named_parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    extra = {"fused": True} if torch.device(device).type in ("cuda", "mps", "cpu") else {}
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, **extra)


# 6. Autocast and the GradScaler (notebook 05): device.resolve_amp, imported above ----------------


# 7. Validation (04, section 6)
# ---------------------------------------------------------------------------------
@torch.no_grad()
def evaluate(model: nn.Module, batches: Iterable[dict], *, device: torch.device | str | None = None,
             amp_dtype: torch.dtype | None = None, objective: Any = None) -> dict:
    """Token-weighted validation loss (sum of token losses / tokens) and its perplexity exp(loss);
    another objective's (DPO: the mean loss of the pairs)."""
    objective = objective or NextToken()
    if device is not None:
        device = torch.device(device)
    else:
        device = next(model.parameters()).device
    was_training, total, n = model.training, 0.0, 0
    model.eval()
    try:
        for mb in batches:
            mb = _to_device(mb, device)
            total += float(objective.loss_sum(model, mb, amp_dtype)[0])
            n += objective.count(mb)
    finally:
        model.train(was_training)
    if n == 0:
        raise ValueError("evaluate: the batches have no trained tokens")
    return {"loss": total / n, "ppl": math.exp(min(total / n, 50.0)), "tokens": n}


# 8. The loop (04, section 6): fit = start, then per step: train; at log points read, count bad
# steps, evaluate, save
class _Run:
    """One `fit` call: model, optimizer, scaler, data position and counters, and the steps of its
    loop."""
    def __init__(self, model: nn.Module, data: Iterable, cfg: TrainConfig, device: torch.device,
                 controller: Any,
                 meter: Any, is_main_process: bool, callbacks: Sequence[Callable] = (),
                 objective: Any = None) -> None:
        self.model, self.cfg, self.device, self.controller = (
            model.to(device).train(),
            cfg,
            device,
            controller,
        )
        # cb(step, row) after each step, before its checkpoint (see save)
        self.callbacks = list(callbacks)
        self.objective = objective  # what a step minimizes (None: the next-token loss)
        self.amp = resolve_amp(cfg.amp, device, getattr(getattr(model, "config", None),
                                                        "hidden_size", None))
        self.stream, self.is_main_process = DataStream(data), is_main_process
        self.optimizer = build_optimizer(model, cfg, device)
        if self.amp.use_scaler:
            self.scaler = torch.amp.GradScaler(device.type)
        else:
            self.scaler = None
        if cfg.ckpt_dir:
            self.ckpt_path = Path(cfg.ckpt_dir) / "last.pt"
        else:
            self.ckpt_path = None
        # a controller's: its budget
        if meter is not None:
            self.meter = meter
        else:
            self.meter = getattr(controller, "meter", None)
        if self.meter is None and controller is None and device.type == "cuda":
            self.meter = MemoryMeter(device)  # a free one, for the peak memory of each step
        takes_zero_grad = (
            controller is not None
            and "zero_grad" in inspect.signature(controller.run_step).parameters
        )
        # it clears an OOM's partial grads
        self.controller_kw = {"zero_grad": self.model} if takes_zero_grad else {}
        self.step = self.bad_in_row = self.bad_steps = self.rollbacks = self.scaler_skips = 0
        self.lr_scale, self.data_exhausted, self.dropped_micro_batches, self.window_start = (
            1.0,
            False,
            0,
            None,
        )

    def accumulate_fn(self, micro_batches: Sequence[dict], *,
                      forward_model: nn.Module | None = None,
                      n_tokens_total: int | None = None) -> dict:
        """accumulate_step with the run's AMP, unsynced (what a controller calls; forward_model:
        e.g. DDP's wrapper)."""
        return accumulate_step(forward_model if forward_model is not None else self.model,
                               micro_batches,
                               amp_dtype=self.amp.dtype, scaler=self.scaler, device=self.device,
                               n_tokens_total=n_tokens_total, normalization=self.cfg.normalization,
                               sync=False, loss_chunk=self.cfg.loss_chunk,
                               objective=self.objective)

    def save(self, row: dict) -> None:
        """last.pt (rank 0; never NaN weights) with the callbacks' checkpoint_extra(); tag `row`;
        after_checkpoint()."""
        tag = "ckpt_skipped_nonfinite" if nonfinite_parameters(self.model) else "ckpt"
        row["event"] = ";".join(e for e in (row["event"], tag) if e)
        # data parallel: rank 0 writes, every rank reads (resume, rollback)
        if tag == "ckpt" and self.is_main_process:
            extra = {k: v for cb in self.callbacks if hasattr(cb, "checkpoint_extra")
                     for k, v in cb.checkpoint_extra().items()}
            save_training_state(self.ckpt_path, self.model, self.optimizer, cfg=self.cfg,
                                step=self.step,
                                scaler=self.scaler, data_state=self.stream.state_dict(),
                                controller=self.controller,
                                extra={"lr_scale": self.lr_scale, "bad_steps": self.bad_steps,
                                       **extra})
            for cb in self.callbacks:
                getattr(cb, "after_checkpoint", lambda: None)()

    def restore(self, path: str | Path, resume: bool) -> None:
        """Load a training state; resuming a run also checks its config and takes its counters (a
        rollback does not)."""
        info = load_training_state(path, self.model, optimizer=self.optimizer, scaler=self.scaler,
                                   controller=self.controller, cfg=self.cfg if resume else None,
                                   map_location=self.device)
        self.step = info["step"]
        if resume:
            self.lr_scale, self.bad_steps = info["extra"].get("lr_scale",
                                                              1.0), info["extra"].get("bad_steps",
                                                                                      0)
        self.stream.load_state_dict(info["data"])
        # last: re-creating the data iterator may draw from the RNG (a shuffling loader)
        set_rng_state(info["rng"])

    # One optimizer step, in 04's and 05's order: lr, data, forward+backward, clip and update, then
    # its metrics row.
    def next_items(self) -> list | None:
        """The step's data: cfg.accum_steps micro-batches or one item for the controller (None: a
        spent generator)."""
        start = self.stream.offset
        try:
            return [self.stream.next() for _ in range(self.cfg.accum_steps
                                                      if self.controller is None else 1)]
        except StopIteration:
            self.data_exhausted, self.dropped_micro_batches = True, self.stream.offset - start
            return None

    def forward_backward(self, items: list) -> dict:
        """The step's gradients, accumulated (a controller splits its item, retrying after an OOM);
        its stats."""
        if self.controller is None:
            return self.accumulate_fn(items)
        return dict(self.controller.run_step(items[0], self.accumulate_fn, **self.controller_kw))

    def update(self, loss_sum: Any, n_tokens: int) -> tuple:
        """Clip and step, skipped on the device after a NaN/inf (section 3); (grad norm, finite,
        scale), unread."""
        if not n_tokens:  # every label -100: AdamW would still move the weights (momentum, decay)
            self.optimizer.zero_grad(set_to_none=True)
            return math.nan, False, math.nan
        params = [p for p in self.model.parameters() if p.requires_grad]
        grad_norm, finite = optimizer_step(self.optimizer, params, self.cfg.grad_clip, self.scaler,
                                           loss_sum)
        if self.scaler is None:
            return grad_norm, finite, math.nan
        # a private use: get_scale() would read the scale to the host (a sync every step);
        # _get_scale_async is the device tensor it reads, kept unread here until a log step
        return grad_norm, finite, self.scaler._get_scale_async().clone()

    def train_step(self) -> dict | None:
        """One optimizer step (its pieces above); its metrics row, the device's values still unread
        (None: no data)."""
        cfg, self.window_start = self.cfg, self.window_start or time.perf_counter()
        lr = self.lr_scale * lr_at(self.step, lr=cfg.lr, min_lr=cfg.min_lr,
                                   warmup_steps=cfg.warmup_steps,
                                   max_steps=cfg.max_steps)  # lowered by NaN rollbacks
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        tracked = contextlib.nullcontext()
        if hasattr(self.meter, "track"):
            tracked = self.meter.track(self.model, self.optimizer)
        with tracked:
            if self.meter is not None:
                self.meter.reset_peak()
            items = self.next_items()
            if items is None:
                return None
            stats = self.forward_backward(items)
            grad_norm, finite, scale = self.update(stats["loss_sum"], stats["n_tokens"])
        row = {"step": self.step, "loss": math.nan, "lr": lr, "grad_norm": grad_norm,
               "tokens": stats["n_tokens"],
               "applied": False, "tokens_per_s": math.nan,
               "peak_memory_bytes": math.nan,
               "peak_reserved_bytes": float(getattr(self.meter, "peak_reserved",
                                                    lambda: math.nan)()),
               "step_time": math.nan, "skipped": True, "val_loss": math.nan, "val_ppl": math.nan,
               "scale": scale,
               "events": [str(e) for e in stats.pop("events", [])]}
        if self.meter is not None:
            row["peak_memory_bytes"] = float(self.meter.peak())
        # controller extras: micro_batch_size, seq_len, ...
        row.update({key: value for key, value in stats.items()
                    if key not in row and key != "n_tokens" and isinstance(value, (int, float, str,
                                                                                   torch.Tensor))})
        self.step += 1  # a rollback rewinds it
        return {**row, "finite": finite}

    def read(self, rows: list[dict], t_start: float) -> None:
        """The rows' device values in one host sync, and what each step did: loss, grad norm,
        skipped (NaN/inf: not applied) or a GradScaler skip, with its events; the window's time
        shared out over its steps."""
        keys = [(r, k) for r in rows for k, v in r.items() if torch.is_tensor(v)]
        if keys:  # one stacked read, in float32 (MPS has no float64)
            values = torch.stack([r[k].detach().float() for r, k in keys]).tolist()
            for (r, k), value in zip(keys, values):
                r[k] = value
        now = time.perf_counter()
        for i, r in enumerate(rows):
            r["step_time"] = (now - self.window_start) / len(rows)
            r["tokens_per_s"] = r["tokens"] / r["step_time"] if r["step_time"] > 0 else math.nan
            r["wall_time"] = self.window_start - t_start + (i + 1) * r["step_time"]
            n, finite = r["tokens"], r.pop("finite")
            # it moved
            loss_sum = r.pop("loss_sum")
            r["loss"], r["applied"] = math.nan, bool(n) and bool(finite)
            if n:
                r["loss"] = loss_sum / n
            r["skipped"] = not r["applied"]
            # every label -100: nothing to learn (AdamW would still have moved the weights)
            if not n:
                r["events"].append("no_trained_tokens_skipped")
            # a NaN/inf loss poisons every gradient: the step was dropped
            elif not math.isfinite(r["loss"]):
                r["grad_norm"] = math.nan
                r["events"].append("nonfinite_loss_skipped")
            # the usual fp16 overflow: the scaler lowered its scale
            elif not finite and self.scaler is not None:
                self.scaler_skips, r["skipped"] = self.scaler_skips + 1, False
                # an overflow multiplied the scale by it
                before = r["scale"] / self.scaler.get_backoff_factor()
                r["events"].append(f"scaler_skip(scale {before:g}->{r['scale']:g})")
            elif not finite:
                r["events"].append("nonfinite_grad_skipped")
        self.window_start = None

    def roll_back(self, row: dict) -> None:
        """Back to last.pt at a lower LR (the steps since are undone), or an error after
        cfg.max_rollbacks."""
        if self.rollbacks >= self.cfg.max_rollbacks:
            raise RuntimeError(f"training diverged: {self.bad_in_row} non-finite steps in a row at "
                               "step "
                               f"{row['step']} after {self.rollbacks} rollbacks (lr scale "
                               f"{self.lr_scale:g})")
        self.rollbacks, self.bad_in_row, self.lr_scale = (
            self.rollbacks + 1,
            0,
            self.lr_scale * self.cfg.lr_backoff,
        )
        if self.ckpt_path is not None and self.ckpt_path.exists():
            self.restore(self.ckpt_path, resume=False)
            row["events"].append(f"rollback_to_step_{self.step}")
        else:
            row["events"].append("no_checkpoint_to_roll_back_to")
        row["events"].append(f"lr_scale={self.lr_scale:g}")

    def log(self, rows: list[dict], val_batches: Iterable[dict] | None, t_start: float) -> bool:
        """Read the rows, then per step: NaN steps (a rollback at the last row), validation,
        callbacks, checkpoint."""
        self.read(rows, t_start)
        cfg, stop, rollback = self.cfg, False, False
        for row in rows:
            # a step without trained tokens is skipped: no divergence
            bad = row["skipped"] and row["tokens"] > 0
            self.bad_in_row, self.bad_steps = (
                self.bad_in_row + 1 if bad else 0,
                self.bad_steps + int(bad),
            )
            rollback = rollback or self.bad_in_row >= cfg.max_bad_steps
            if rollback and row is rows[-1]:
                self.roll_back(row)
            done, good = row["step"] + 1, not row["skipped"] and not rollback
            if good and val_batches is not None and ((cfg.eval_every and done % cfg.eval_every == 0)
                                                     or done == cfg.max_steps):
                ev = evaluate(self.model, val_batches, device=self.device, amp_dtype=self.amp.dtype,
                              objective=self.objective)
                row["val_loss"], row["val_ppl"] = ev["loss"], ev["ppl"]
            row["event"] = ";".join(row.pop("events"))
            # every callback runs
            stop = "stop" in [cb(row["step"], row) for cb in self.callbacks] or stop
            if (
                good
                and self.ckpt_path is not None
                and cfg.ckpt_every
                and done % cfg.ckpt_every == 0
            ):
                self.save(row)
        return stop

    def due(self, step: int) -> bool:
        """If fit reads the device after `step`: every cfg.log_every steps, before a validation,
        checkpoint, end."""
        cfg, done = self.cfg, step + 1
        return done >= cfg.max_steps or any(n and done % n == 0 for n in (max(cfg.log_every, 1),
                                                                          cfg.eval_every,
                                                                          cfg.ckpt_every))


def fit(model: nn.Module, train_batches_or_loader: Iterable, cfg: TrainConfig, *,
        device: torch.device | str,
        val_batches: Iterable[dict] | None = None, controller: Any = None, meter: Any = None,
        callbacks: Sequence[Callable[[int, dict], Any]] | None = None,
        resume_from: str | Path | None = None, is_main_process: bool = True,
        loggers: Sequence[Any] = (), objective: Any = None) -> pd.DataFrame:
    """Train `model` for cfg.max_steps optimizer steps: a DataFrame, one metrics row per step
    (attrs: run counters). The data yields cfg.accum_steps collated micro-batches per step, or, with
    a controller, each step's samples for `controller.run_step(item, accumulate_fn[,
    zero_grad=model])` to split. cb(step, row) for each step at the next log point, before its
    checkpoint (cb.checkpoint_extra() goes into it; then cb.after_checkpoint()); "stop" ends.
    loggers (loggers.py: TensorBoard, wandb) get each row after the callbacks, at its checkpoint."""
    # objective: what a step minimizes and validation reports (default NextToken(); 10: dpo.DPO)
    run = _Run(model, train_batches_or_loader, cfg, torch.device(device), controller, meter,
               is_main_process,
               [*(callbacks or ()), SendRows(loggers, buffered=cfg.ckpt_dir is not None)],
               objective)
    if resume_from is not None:
        run.restore(Path(resume_from), resume=True)
    else:
        seed_everything(cfg.seed)
    rows, pending, stop, t_start = [], [], False, time.perf_counter()
    with tqdm(total=cfg.max_steps, initial=run.step, disable=not cfg.progress, desc="train") as bar:
        while run.step < cfg.max_steps and not stop:
            row = run.train_step()
            if row is not None:  # None: the data ran out
                pending.append(row)
            if pending and (row is None or run.due(row["step"])):
                stop = run.log(pending, val_batches, t_start)
                rows += pending
                bar.update(max(0, run.step - bar.n))
                bar.set_postfix(loss=f"{rows[-1]['loss']:.3f}", lr=f"{rows[-1]['lr']:.2e}")
                pending = []
            if row is None:
                break
        # before the final save: last.pt must not claim progress
        if rows and not any(r["applied"] for r in rows):
            why = sorted({e.split("(")[0] for r in rows for e in r["event"].split(";")
                          if "skip" in e})
            raise RuntimeError(f"no optimizer step was applied: all {len(rows)} step(s) were "
                               f"skipped ({', '.join(why)}"
                               "); nothing was trained (check the data's labels, lower the lr, or "
                               "try amp='off')")
        if run.ckpt_path is not None and rows and "ckpt" not in rows[-1]["event"].split(";"):
            # the final state, so a later run (or notebook) can resume or load it
            run.save(rows[-1])
    df = pd.DataFrame(rows)
    df.attrs.update({"amp": run.amp.name, "amp_reason": run.amp.reason, "bad_steps": run.bad_steps,
                     "rollbacks": run.rollbacks, "scaler_skips": run.scaler_skips,
                     "final_lr_scale": run.lr_scale,
                     "data_exhausted": run.data_exhausted,
                     "dropped_micro_batches": run.dropped_micro_batches})
    if run.data_exhausted:
        warnings.warn(f"training data ran out after {run.step} of {cfg.max_steps} steps; "
                      f"{run.dropped_micro_batches} "
                      f"micro-batch(es) of an incomplete step were not trained", stacklevel=2)
    return df
