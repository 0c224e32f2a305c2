"""MiniMind's published pretraining recipe, re-implemented faithfully: the baseline our loop is measured against.

What MiniMind2's ``trainer/train_pretrain.py`` and ``dataset/lm_dataset.py`` do (github.com/jingyaogong/minimind,
MiniMind2 era; defaults batch_size=32, accumulation_steps=8, max_seq_len=512, lr=5e-4, grad_clip=1.0):

- data: every sample is tokenized and padded (right) to ``max_length`` (``padding='max_length', truncation=True``);
  ``X = ids[:-1]``, ``Y = ids[1:]``, ``loss_mask = (ids != pad)[1:]``. No packing, no length grouping.
- precision: ``ctx = nullcontext() if device_type == "cpu" else torch.cuda.amp.autocast()``, i.e. fp32 on CPU and
  fp16 autocast on CUDA (``torch.cuda.amp.autocast()`` defaults to float16), with
  ``torch.cuda.amp.GradScaler(enabled=args.dtype in ['float16', 'bfloat16'])`` (on by default on CUDA; a CPU-only
  torch disables it).
- loss per micro-batch: ``CrossEntropyLoss(reduction='none')`` over every position, times ``loss_mask``,
  ``.sum() / loss_mask.sum()`` (the micro-batch's own mean), then ``/ accumulation_steps``; ``scaler.scale(loss).backward()``.
- every ``accumulation_steps`` micro-batches: ``scaler.unscale_``, ``clip_grad_norm_(model.parameters(), 1.0)``,
  ``scaler.step``, ``scaler.update``, ``zero_grad(set_to_none=True)``.
- optimizer: ``optim.AdamW(model.parameters(), lr=lr)``: torch's default implementation (not fused; the for-loop
  kernel on CPU, foreach on CUDA), default weight decay 0.01 on every parameter.
- lr: ``get_lr(step, total, lr) = lr / 10 + 0.5 * lr * (1 + cos(pi * step / total))``, set every micro-batch.
- the model is called as ``model(X)`` without an attention mask: causal SDPA; right padding never reaches a real
  token under a causal mask, so this is exact for the real tokens.

The model itself is the library's MiniMindForCausalLM (the same architecture and parameter names as MiniMind's).
Here samples come from our datasets (``[bos] + tokens + [eos]`` truncated to seq_len, MiniMind's pretrain format),
so ``loss_mask`` is taken from our labels (``labels != -100``), which is ``ids != pad`` for pretraining rows.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.nn as nn

from minimind_lib.data import IGNORE_INDEX


def get_lr(current_step: int, total_steps: int, lr: float) -> float:
    """MiniMind's schedule: cosine from 1.1 * lr down to lr / 10, no warmup."""
    return lr / 10 + 0.5 * lr * (1 + math.cos(math.pi * current_step / total_steps))


def minimind_rows(samples: Sequence[dict], max_length: int, pad_id: int = 0) -> dict[str, torch.Tensor]:
    """MiniMind's PretrainDataset rows for a list of samples: X, Y, loss_mask of shape (B, max_length - 1).

    Each sample ({"input_ids", "labels"} 1-D) is padded right to max_length (longer ones are cut, as
    ``truncation=True`` does); X = ids[:-1], Y = ids[1:], loss_mask = 1 where Y is a trained token.
    """
    if not samples:
        raise ValueError("minimind_rows got no samples")
    if max_length < 2:
        raise ValueError(f"max_length={max_length} is too short: MiniMind's rows need at least 2 tokens")
    b = len(samples)
    ids = torch.full((b, max_length), int(pad_id), dtype=torch.long)
    trained = torch.zeros((b, max_length), dtype=torch.bool)
    for r, s in enumerate(samples):
        x = s["input_ids"][:max_length]
        y = s.get("labels", s["input_ids"])[:max_length]
        ids[r, : len(x)] = x
        trained[r, : len(x)] = y != IGNORE_INDEX
    return {"X": ids[:, :-1].contiguous(), "Y": ids[:, 1:].contiguous(), "loss_mask": trained[:, 1:].long()}


@dataclass
class BaselineRecipe:
    """MiniMind's training state for one model: optimizer, autocast context factory, scaler, accumulation."""

    model: nn.Module
    device: torch.device
    lr: float = 5e-4
    accumulation_steps: int = 8
    grad_clip: float = 1.0
    total_steps: int = 1000  # micro-batches of the run, for get_lr
    optimizer: torch.optim.Optimizer = field(init=False)
    scaler: torch.amp.GradScaler = field(init=False)
    step: int = field(init=False, default=0)  # micro-batches seen (MiniMind's loop variable)

    def __post_init__(self) -> None:
        self.device = torch.device(self.device)
        # optim.AdamW(model.parameters(), lr=...): torch's default implementation, no fused kernel.
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=self.lr)
        # torch.cuda.amp.GradScaler(enabled=True) for the default dtype; it turns itself off without CUDA.
        self.scaler = torch.amp.GradScaler("cuda", enabled=self.device.type == "cuda")
        self.loss_fct = nn.CrossEntropyLoss(reduction="none")

    @property
    def amp_name(self) -> str:
        """'fp16' on CUDA (torch.cuda.amp.autocast's default dtype), 'fp32' elsewhere (nullcontext)."""
        return "fp16" if self.device.type == "cuda" else "fp32"

    def ctx(self):
        """nullcontext() on CPU, torch.cuda.amp.autocast() (float16) on CUDA, as MiniMind."""
        if self.device.type == "cpu":
            return nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=torch.float16)

    def micro_step(self, rows: dict[str, torch.Tensor]) -> torch.Tensor:
        """One iteration of MiniMind's loop: lr, forward, masked mean loss / accumulation_steps, backward, maybe step."""
        X = rows["X"].to(self.device)  # MiniMind's .to(args.device): blocking copies
        Y = rows["Y"].to(self.device)
        loss_mask = rows["loss_mask"].to(self.device)
        lr = get_lr(self.step, self.total_steps, self.lr)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        with self.ctx():
            res = self.model(X)
            logits = res.logits if hasattr(res, "logits") else res
            loss = self.loss_fct(logits.view(-1, logits.size(-1)), Y.view(-1)).view(Y.size())
            loss = (loss * loss_mask).sum() / loss_mask.sum()
            loss = loss / self.accumulation_steps
        self.scaler.scale(loss).backward()
        self.step += 1
        if self.step % self.accumulation_steps == 0:
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
            self.scaler.step(self.optimizer)
            self.scaler.update()
            self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    def train_step(self, micro_batches: Sequence[dict[str, torch.Tensor]]) -> dict:
        """One optimizer step: exactly accumulation_steps micro-batches of MiniMind rows; returns loss and tokens."""
        if len(micro_batches) != self.accumulation_steps:
            raise ValueError(
                f"a MiniMind optimizer step takes accumulation_steps={self.accumulation_steps} micro-batches, "
                f"got {len(micro_batches)}"
            )
        losses = [self.micro_step(mb) for mb in micro_batches]
        loss = torch.stack(losses).sum()  # unread, as MiniMind reads it only every log_interval steps (so does ours)
        return {"loss": loss, "n_tokens": sum(int(mb["loss_mask"].sum()) for mb in micro_batches)}  # trained tokens
