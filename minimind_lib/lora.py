"""LoRA, built in notebook 10_lora_dpo: a frozen linear layer plus a trainable low-rank update,
(alpha / rank) B A x, put beside MiniMind's layers (by default MiniMind's rule: every square Linear,
q_proj and o_proj), merged back into the weights, and read and written in MiniMind's file
(model/model_lora.py: `<layer>.lora.A.weight` [rank, in], `<layer>.lora.B.weight` [out, rank]; its
layers compute W x + B A x, so a file's B carries the alpha / rank scale)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .checks import require


class LoRA(nn.Module):
    """The update (alpha / rank) B A x; A drawn N(0, 0.02), B zero (MiniMind's): it starts at 0."""

    def __init__(self, in_features: int, out_features: int, rank: int, alpha: float) -> None:
        super().__init__()
        require(isinstance(rank, int) and rank >= 1, f"rank={rank!r}: must be an integer >= 1")
        require(alpha > 0, f"alpha={alpha!r}: must be > 0")
        self.A = nn.Linear(in_features, rank, bias=False)
        self.B = nn.Linear(rank, out_features, bias=False)
        nn.init.normal_(self.A.weight, std=0.02)
        nn.init.zeros_(self.B.weight)
        self.scale = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.B(self.A(x)) * self.scale


class LoRALinear(nn.Module):
    """A Linear's frozen weight with a LoRA beside it, W x + (alpha / rank) B A x; its keys
    `weight`, `lora.A.weight`, `lora.B.weight` are those of MiniMind's LoRA layers."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float) -> None:
        super().__init__()
        require(base.bias is None, "LoRA goes beside a Linear without bias (MiniMind's have none)")
        self.weight = base.weight.requires_grad_(False)
        self.lora = LoRA(base.in_features, base.out_features, rank, alpha).to(base.weight.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight) + self.lora(x)


def lora_targets(model: nn.Module, targets: tuple[str, ...] | None = None) -> list[str]:
    """The names of the blocks' Linears that get a LoRA: those named in `targets` (such as
    ("q_proj", "v_proj")), or by MiniMind's rule (None): every square one, in == out."""
    names = []
    for name, m in model.named_modules():
        if name.startswith("model.layers.") and isinstance(m, nn.Linear):
            named = targets is not None and name.split(".")[-1] in targets
            if named or (targets is None and m.in_features == m.out_features):
                names.append(name)
    require(bool(names), f"targets={targets!r}: no Linear of the model's blocks is named so")
    return names


def apply_lora(model: nn.Module, rank: int = 8, alpha: float | None = None,
               targets: tuple[str, ...] | None = None) -> nn.Module:
    """Freeze every weight and put a LoRA beside each target Linear (alpha None: the rank, a scale
    of 1, MiniMind's)."""
    model.requires_grad_(False)
    for name in lora_targets(model, targets):
        parent, child = name.rsplit(".", 1)
        holder = model.get_submodule(parent)
        layer = LoRALinear(getattr(holder, child), rank, float(rank if alpha is None else alpha))
        setattr(holder, child, layer)
    return model


def lora_layers(model: nn.Module) -> dict[str, LoRALinear]:
    """The model's LoRA layers by name ({}: none)."""
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}


@torch.no_grad()
def merge_lora(model: nn.Module) -> nn.Module:
    """Fold each LoRA into its weight, W + (alpha / rank) B A, and put a plain Linear back."""
    for name, m in lora_layers(model).items():
        parent, child = name.rsplit(".", 1)
        out_features, in_features = m.weight.shape
        merged = nn.Linear(in_features, out_features, bias=False, device=m.weight.device)
        merged.weight.copy_(m.weight + m.lora.scale * (m.lora.B.weight @ m.lora.A.weight))
        setattr(model.get_submodule(parent), child, merged)
    return model.requires_grad_(True)


def lora_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters in MiniMind's file layout, `<layer>.lora.A.weight` and `<layer>.lora.B.weight`,
    B scaled by alpha / rank (MiniMind's layers add B A x unscaled); fp32, on the CPU."""
    state = {}
    for name, m in lora_layers(model).items():
        state[f"{name}.lora.A.weight"] = m.lora.A.weight.detach().float().cpu()
        state[f"{name}.lora.B.weight"] = (m.lora.B.weight * m.lora.scale).detach().float().cpu()
    return state


@torch.no_grad()
def load_lora(model: nn.Module, state: dict, where: str = "LoRA file") -> None:
    """Load adapters in MiniMind's layout (a `module.` prefix stripped) into a model's LoRA layers;
    ValueError naming the first key one has and the other lacks, or a shape that differs."""
    state = {k.removeprefix("module."): v for k, v in state.items()}
    layers = lora_layers(model)
    require(bool(layers), "the model has no LoRA layers: apply_lora(model, rank) first")
    expected = {f"{name}.lora.{half}.weight": m for name, m in layers.items() for half in "AB"}
    differ = sorted(set(expected) ^ set(state))  # keys in one and not the other
    if differ:
        what = "has no key" if differ[0] in expected else "has a key no LoRA layer here has:"
        raise ValueError(f"{where} {what} {differ[0]!r} ({len(differ)} keys differ: another rank "
                         f"or other layers?)")
    for key, m in expected.items():
        half = key.split(".")[-2]  # "A" or "B"
        param, value = getattr(m.lora, half).weight, state[key]
        if torch.is_tensor(value):
            shape = list(value.shape)
        else:
            shape = type(value).__name__
        require(shape == list(param.shape), f"{where}: {key} is {shape}, this model's LoRA layer "
                                            f"has shape {list(param.shape)} (another rank?)")
        param.copy_(value / (m.lora.scale if half == "B" else 1.0))
