"""The harness of notebook 04_gradient_accumulation: its figures and the memory meter's loop around one step.

Nothing here is what the chapter teaches: the schedule, clipping, the optimizer step, accumulation, AdamW's groups and
the loop are written in the chapter's cells and passed in. This module only draws and measures around them.
"""

import copy
from typing import Callable

import matplotlib.pyplot as plt
import pandas as pd
import torch
from matplotlib.ticker import NullLocator

from minimind_lib.data import pad_collate
from minimind_lib.memory import MemoryMeter
from minimind_lib.train import TrainConfig


def schedules(curves: dict[str, list[float]], title: str) -> None:
    """Learning-rate schedules against the optimizer step, on a log axis (5e-4 beside the course's peak)."""
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for (label, values), style in zip(curves.items(), ("-", "-", "--")):
        ax.plot(range(len(values)), values, style, label=label)
    ax.set_yscale("log")
    ax.set(xlabel="optimizer step", ylabel="learning rate (log scale)")
    ax.legend(fontsize=8)
    ax.set_title(f"Learning-rate schedules over {len(values)} steps\n{title}", fontsize=9)
    plt.show()


def grad_norms(run: pd.DataFrame, max_norm: float, what: str, title: str) -> None:
    """A run's global gradient norm before clipping, step by step, against the clipping threshold."""
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot(run["step"], run["grad_norm"], marker=".", label="global grad norm before clipping")
    ax.axhline(max_norm, color="red", lw=1, label=f"max_norm = {max_norm:g}")
    ax.set_yscale("log")
    ax.set(xlabel="optimizer step", ylabel="grad norm")
    ax.legend(fontsize=8)
    ax.set_title(f"Gradient norm, {what}\n{title}", fontsize=9)
    plt.show()


def three_runs(big: pd.DataFrame, exact: pd.DataFrame, naive: pd.DataFrame, big_name: str, micro_name: str,
               title: str) -> None:
    """Loss of one big batch, k exact and k naive micro-batches (left), and each one's distance to the big batch."""
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax.plot(big["step"], big["loss"], lw=4, alpha=0.4, label=big_name)
    ax.plot(exact["step"], exact["loss"], "--", label=f"{micro_name}, exact")
    ax.plot(naive["step"], naive["loss"], ":", label=f"{micro_name}, naive")
    ax.set(xlabel="optimizer step", ylabel="train loss (mean over the step's tokens)", title="Loss")
    ax.legend(fontsize=8)
    for run, name in ((exact, "exact"), (naive, "naive")):
        ax2.plot(big["step"][1:], (run["loss"] - big["loss"]).abs()[1:].clip(lower=1e-9), label=f"|{name} - big batch|")
    ax2.set_yscale("log")
    ax2.set(xlabel="optimizer step", ylabel="loss difference (floored at 1e-9)",
            title="Distance to the big batch (step 0 not drawn)")
    ax2.xaxis.get_major_locator().set_params(integer=True)
    ax2.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    plt.tight_layout(rect=(0, 0, 1, 0.94))  # the suptitle above the panels' titles, never over them
    plt.show()


def peak_mib(model: torch.nn.Module, micro_batches: list, accumulate_step: Callable, optimizer_step: Callable,
             build_optimizer: Callable, device: torch.device) -> float:
    """MiB at the peak of one steady-state optimizer step (the chapter's functions) of a copy of `model`.

    AdamW's two states exist before the step, as at every step after a run's first: one step on zero gradients
    makes them. MemoryMeter counts live tensor bytes on a CPU and reads the allocator's peak on CUDA."""
    model = copy.deepcopy(model)
    optimizer = build_optimizer(model, TrainConfig(lr=1e-6))
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    meter = MemoryMeter(device)
    with meter.track(model, optimizer):
        meter.reset_peak()
        accumulate_step(model, micro_batches)
        optimizer_step(optimizer, list(model.parameters()), 1.0)
    return meter.peak() / 2**20


def memory_table(model: torch.nn.Module, full_rows: list, micro_rows: int, step_fns: tuple, estimate_mib: Callable,
                 collate: Callable) -> pd.DataFrame:
    """Peak MiB of one step at effective batches of 1, 2, 4 and 8 micro-batches of full-length rows, trained as one
    batch and as micro-batches of `micro_rows`, beside `estimate_mib(rows, k)` of each."""
    table = {}
    for rows in sorted({micro_rows * m for m in (1, 2, 4, 8)} & set(range(len(full_rows) + 1))):
        chunks = [full_rows[i:i + micro_rows] for i in range(0, rows, micro_rows)]
        table[rows] = {"one batch MiB": peak_mib(model, [collate(full_rows[:rows])], *step_fns),
                       f"{micro_rows}-row micro-batches MiB": peak_mib(model, [collate(c) for c in chunks], *step_fns),
                       "estimate, one batch MiB": estimate_mib(rows, 1),
                       f"estimate, {micro_rows}-row micro-batches MiB": estimate_mib(micro_rows, rows // micro_rows)}
    return pd.DataFrame(table).T.rename_axis("effective batch (rows)")


def memory_figure(mem: pd.DataFrame, measured: list[str], title: str) -> None:
    """Measured peaks (solid) and their estimates (dashed) against the effective batch."""
    ax = mem[measured].plot(marker="o", figsize=(7, 4))
    mem[[f"estimate, {c}" for c in measured]].plot(ax=ax, ls="--", color=["tab:blue", "tab:orange"], alpha=0.7)
    ax.set_ylabel("peak memory of one step (MiB)")
    ax.set_ylim(bottom=0)
    ax.set_title(f"Peak memory vs effective batch, measured (solid) and estimated (dashed)\n{title}", fontsize=9)
    plt.show()


def lr_sweep_figure(sweep: pd.DataFrame, lrs: list[float], ranges: dict, rules: dict[str, float], steps: int,
                    title: str) -> None:
    """Left: mean validation loss against lr for each k (bars: the seeds' min-max). Right: each k's best lr, the
    interval of lrs the seeds cannot separate from it, and the rules drawn through the first k's best."""
    ks, seeds = sorted(sweep["k"].unique()), sorted(sweep["seed"].unique())
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.6))
    for j, k in enumerate(ks):  # each k's points shifted a little sideways, so the bars do not hide each other
        by_lr = sweep[sweep.k == k].groupby("lr")["val loss"]
        mean, low, high = by_lr.mean(), by_lr.min(), by_lr.max()
        shift = 2 ** (0.05 * (j - (len(ks) - 1) / 2))
        ax.errorbar(mean.index * shift, mean, yerr=[mean - low, high - mean], marker="o", capsize=3, label=f"k={k}")
    ax.set_xscale("log")
    ax.set_xticks(lrs, [f"{lr:.3g}" for lr in lrs], fontsize=8)
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set(xlabel="peak learning rate", ylabel=f"validation loss after {steps} steps")
    ax.set_title(f"Mean of {len(seeds)} seeds; bars: their min-max", fontsize=9)
    ax.legend(fontsize=8)
    top = max(lrs) * 2
    for k, (best, low, high) in ranges.items():
        ax2.vlines(k, max(low, min(lrs) / 2), min(high, top), lw=10, alpha=0.25, color="tab:green")
    ax2.plot([], [], lw=10, alpha=0.25, color="tab:green", label="lrs no seed pair separates from the best")
    ax2.plot(ks, [ranges[k][0] for k in ks], "x-", color="black", ms=8, label="best lr (mean of seeds)")
    for (name, power), style in zip(rules.items(), (":", "--", "-", "-.")):
        if power != 0:
            ax2.plot(ks, [ranges[ks[0]][0] * (k / ks[0]) ** power for k in ks], style, color="gray", lw=1, label=name)
    ax2.set_xscale("log", base=2)
    ax2.set_yscale("log")
    ax2.set_xticks(ks, [str(k) for k in ks])
    ax2.set_yticks(lrs, [f"{lr:.3g}" for lr in lrs], fontsize=8)
    ax2.xaxis.set_minor_locator(NullLocator())
    ax2.yaxis.set_minor_locator(NullLocator())
    ax2.set_ylim(min(lrs) / 1.5, max(lrs) * 1.5)
    ax2.set(xlabel="k (micro-batches per optimizer step)", ylabel="learning rate")
    ax2.set_title("Best lr against k; rules through the first k's best", fontsize=9)
    ax2.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.suptitle(title, fontsize=9)
    plt.tight_layout(rect=(0, 0, 1, 0.94))  # the suptitle above the panels' titles, never over them
    plt.show()


def sorted_steps(samples: list, step_rows: int, micro_rows: int) -> tuple[list, list]:
    """`samples` cut into optimizer steps of `step_rows`, each step's samples sorted by length (as token budgets group
    them, notebook 06): the steps' micro-batches of `micro_rows` one after the other, and each step as one batch."""
    steps = [sorted(samples[i:i + step_rows], key=lambda s: len(s["input_ids"]))
             for i in range(0, len(samples), step_rows)]
    micro = [pad_collate(step[j:j + micro_rows]) for step in steps for j in range(0, len(step), micro_rows)]
    return micro, [pad_collate(step) for step in steps]
