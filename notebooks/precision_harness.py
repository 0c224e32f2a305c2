"""The harness of notebook 05_mixed_precision: what it records around a forward pass, and its figures.

Autocast, the loss scaler and the loop are written in the chapter's cells; this module only records dtypes and saved
tensors with PyTorch's hooks, measures a step's peak memory, and draws.
"""

from typing import Callable

import matplotlib.pyplot as plt
import pandas as pd
import torch

from minimind_lib.memory import MemoryMeter
from minimind_lib.model import MiniMindForCausalLM, lm_loss

KINDS = ("Embedding", "Linear", "RMSNorm", "Attention", "FeedForward", "MiniMindBlock")


def autocast_dtypes(model: torch.nn.Module, batch: dict, dtype: torch.dtype | None, device: torch.device) -> dict:
    """The output dtype of each module type of `model` under autocast(dtype) (None: no autocast), by forward hooks,
    then the logits', the loss's, the weights' and the gradients' dtypes."""
    seen = {}

    def record(module, inputs, output):  # a forward hook: returns None, so the output is unchanged
        seen.setdefault(type(module).__name__, (output[0] if isinstance(output, tuple) else output).dtype)

    hooks = [m.register_forward_hook(record) for m in model.modules() if type(m).__name__ in KINDS]
    try:
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            logits = model(batch["input_ids"].to(device)).logits
        loss = lm_loss(logits, batch["labels"].to(device))
        loss.backward()
    finally:
        for hook in hooks:
            hook.remove()
    seen.update({"logits": logits.dtype, "loss (lm_loss)": loss.dtype, "weights": model.lm_head.weight.dtype,
                 "gradients": model.lm_head.weight.grad.dtype})
    model.zero_grad(set_to_none=True)
    return {k: str(v).replace("torch.", "") for k, v in seen.items()}


def saved_for_backward(config, batch: dict, amp_dtype: torch.dtype | None, device: torch.device) -> tuple[int, int]:
    """Bytes of the distinct storages a forward pass saves for backward (saved_tensors_hooks sees each): those of
    activations, and those of 16-bit copies of the weights that autocast made for its matmuls. The weights and
    buffers themselves are left out."""
    torch.manual_seed(0)
    model = MiniMindForCausalLM(config).to(device)
    weights = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    weight_shapes = {tuple(p.shape) for p in model.parameters()}
    seen = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            seen[storage.data_ptr()] = (storage.nbytes(), tuple(t.shape) in weight_shapes and t.dtype != torch.float32)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            logits = model(batch["input_ids"].to(device)).logits
        lm_loss(logits, batch["labels"].to(device))
    return (sum(n for n, copy in seen.values() if not copy), sum(n for n, copy in seen.values() if copy))


def step_peak(model: torch.nn.Module, step: Callable[[], object], optimizer: torch.optim.Optimizer,
              device: torch.device) -> int:
    """Peak bytes of one call of `step` (a whole optimizer step of `model`), counted by MemoryMeter."""
    meter = MemoryMeter(device)
    with meter.track(model, optimizer):
        meter.reset_peak()
        step()
    return meter.peak()


def scale_figure(trace: pd.DataFrame, title: str) -> None:
    """The loss scale step by step, the skipped (overflowing) steps in red."""
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot(trace["step"], trace["scale"], marker="o")
    ax.scatter(trace.loc[trace.skipped, "step"], trace.loc[trace.skipped, "scale"], color="red", zorder=3,
               label="overflow: step skipped, scale halved")
    ax.set_yscale("log", base=2)
    ax.set(xlabel="step", ylabel="loss scale")
    ax.legend(fontsize=8)
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_title(f"GradScaler from init_scale=2^30, growth_interval=3 (fp16 autocast)\n{title}", fontsize=9)
    plt.show()


def loss_figure(runs: dict[str, pd.DataFrame], title: str) -> None:
    """Each run's loss (left) and each 16-bit run's loss minus the fp32 run's (right)."""
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for name, df in runs.items():
        ax.plot(df["step"], df["loss"], label=name, alpha=0.8)
        if name != "fp32":
            ax2.plot(df["step"], df["loss"] - runs["fp32"]["loss"], marker="o", label=f"{name} - fp32")
    ax.set(xlabel="optimizer step", ylabel="train loss", title="Loss curves")
    ax2.axhline(0, color="gray", lw=0.8)
    ax2.set(xlabel="optimizer step", ylabel="loss - fp32 loss", title="Difference to the fp32 run")
    for a in (ax, ax2):
        a.legend(fontsize=8)
        a.xaxis.get_major_locator().set_params(integer=True)
    fig.suptitle(title, fontsize=9)
    plt.tight_layout(rect=(0, 0, 1, 0.94))
    plt.show()


def width_figure(xover: pd.DataFrame, rule: str, title: str) -> None:
    """bf16/fp32 step-time ratio against the hidden size: the median of the paired ratios, bars from min to max."""
    fig, ax = plt.subplots(figsize=(7, 3.5))
    err = [xover["median"] - xover["min"], xover["max"] - xover["median"]]
    ax.errorbar(xover.index, xover["median"], yerr=err, marker="o", capsize=3, label="median, min-max of the pairs")
    ax.axhline(1, color="gray", lw=0.8, label="as fast as fp32")
    ax.plot([], [], " ", label=rule)
    ax.set(xlabel="hidden size", ylabel="bf16 step time / fp32 step time")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    ax.set_title(f"bf16 autocast vs fp32 against model width, {int(xover['n'].iloc[0])} paired repeats\n{title}",
                 fontsize=9)
    plt.show()
