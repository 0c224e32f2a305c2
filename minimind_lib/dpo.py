"""DPO, built in notebook 10_lora_dpo: the summed log-probability of each reply's trained tokens
(08's SFT mask), a frozen reference model, the loss of MiniMind's train_dpo.py,
-log sigmoid(beta ((pi_c - pi_r) - (ref_c - ref_r))), and the implicit rewards beta (pi - ref) it
implies. `DPO` is the objective `train.fit` takes for a DPO run."""

from __future__ import annotations

import math
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from .checks import require
from .model import IGNORE_INDEX
from .train import forward_logits


def sequence_logps(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per row, the summed log-probability (fp32) of its trained tokens: logits[:, t] scores
    labels[:, t + 1], a label of -100 is not scored (a sum, as MiniMind's: not a mean)."""
    targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
    token_nll = F.cross_entropy(logits.float().transpose(1, 2), targets, ignore_index=IGNORE_INDEX,
                                reduction="none")
    return -token_nll.sum(-1)


def dpo_loss(pi_chosen: torch.Tensor, pi_rejected: torch.Tensor, ref_chosen: torch.Tensor,
             ref_rejected: torch.Tensor, beta: float) -> torch.Tensor:
    """Each pair's loss: -log sigmoid(beta x the policy's log-ratio margin over the reference's)."""
    return -F.logsigmoid(beta * ((pi_chosen - pi_rejected) - (ref_chosen - ref_rejected)))


class DPO:
    """The objective of a DPO run for train.fit: the loss summed over a micro-batch's pairs (the
    rows of pair_collate: chosen, then rejected), counted in pairs; the reference frozen (None: the
    loss without one, a reference of zeros)."""

    def __init__(self, reference: nn.Module | None, beta: float = 0.1) -> None:
        finite = isinstance(beta, (int, float)) and math.isfinite(beta)
        require(finite and beta > 0, f"beta={beta!r}: must be a finite number > 0")
        self.reference, self.beta = reference, float(beta)
        if reference is not None:
            reference.eval().requires_grad_(False)

    def count(self, batch: dict) -> int:
        return len(batch["input_ids"]) // 2

    def loss_sum(self, model: nn.Module, batch: dict, amp_dtype: torch.dtype | None) -> tuple:
        """(the summed loss of the batch's pairs, the policy's MoE loss or None)."""
        logits, aux = forward_logits(model, batch, amp_dtype, with_aux=True)
        pi = sequence_logps(logits, batch["labels"])
        with torch.no_grad():
            ref = torch.zeros_like(pi)
            if self.reference is not None:
                ref_logits = forward_logits(self.reference, batch, amp_dtype)
                ref = sequence_logps(ref_logits, batch["labels"])
        return dpo_loss(*pi.chunk(2), *ref.chunk(2), self.beta).sum(), aux


@torch.no_grad()
def pair_logps(model: nn.Module, batches: Iterable[dict],
               amp_dtype: torch.dtype | None = None) -> torch.Tensor:
    """(pairs, 2): the summed log-probability of each pair's chosen and rejected reply (CPU)."""
    model.eval()
    device, out = next(model.parameters()).device, []
    for batch in batches:
        batch = {k: v.to(device) for k, v in batch.items()}
        logps = sequence_logps(forward_logits(model, batch, amp_dtype), batch["labels"])
        out.append(torch.stack(logps.chunk(2), dim=1).cpu())
    return torch.cat(out)


def preference_report(policy: torch.Tensor, reference: torch.Tensor, beta: float) -> dict:
    """What pair_logps of a policy and of its reference say: the mean DPO loss, the implicit rewards
    beta (pi - ref) of chosen and rejected, their margin, the share of pairs whose chosen reward is
    the higher (reward accuracy) and whose chosen reply is the more likely (log-prob accuracy)."""
    rewards = beta * (policy - reference)
    margin = rewards[:, 0] - rewards[:, 1]
    return {"pairs": len(policy), "loss": float(-F.logsigmoid(margin).mean()),
            "chosen_reward": float(rewards[:, 0].mean()),
            "rejected_reward": float(rewards[:, 1].mean()),
            "margin": float(margin.mean()), "reward_accuracy": float((margin > 0).float().mean()),
            "logp_accuracy": float((policy[:, 0] > policy[:, 1]).float().mean())}
