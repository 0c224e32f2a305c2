"""The launches, tables and figures of notebook 09_beyond_one_gpu (harness only).

The mechanisms (the split, the global token count, no_sync, one rank's memory) are written in the chapter and
checked there; the job each rank runs is ddp_demo.py. This module starts the ranks and lays out what they measured.
"""

from __future__ import annotations

import os
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from IPython.display import display

import ddp_demo


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def launch_ranks(job_file: Path, nproc: int, log_dir: Path, timeout_s: float = 800) -> ddp_demo.LaunchResult:
    """`torchrun --nproc_per_node=nproc ddp_demo.py job_file`, the ranks on the CPU with gloo (CUDA_VISIBLE_DEVICES
    empty: even on a machine with one GPU, which two ranks cannot share). Raises with rank 0's output when a rank
    failed, and when a process the launch started is still running."""
    script = Path(ddp_demo.__file__)
    print(f"torchrun --nproc_per_node={nproc}", script.name, Path(job_file).name)
    res = ddp_demo.launch([str(script), str(job_file)], nproc=nproc, launcher="torchrun", timeout_s=timeout_s,
                          log_dir=log_dir, env={"CUDA_VISIBLE_DEVICES": ""})
    print(f"{nproc} ranks: exit codes {res.returncodes} in {res.seconds:.0f} s" + (" (TIMED OUT)" if res.timed_out
                                                                                    else ""))
    if not res.ok:
        raise RuntimeError("the 2-process run failed; its output:\n" + res.outputs[0][-4000:])
    left = [pid for pid in res.pids if _running(pid)]
    if left:
        raise RuntimeError(f"processes left running: {left}")
    return res


def loss_table(ref: dict, ranks: list[dict], title: str) -> pd.DataFrame:
    """Per step: the tokens of all ranks and of each, the micro-batches of each, the bytes all-reduced, and the loss
    of one process against each rank's; shown as a table and a figure."""
    cmp = pd.DataFrame({"step": ref["steps"], "tokens (all ranks)": ranks[0]["tokens"],
                        **{f"rank {r} tokens": ranks[r]["rank_tokens"] for r in range(len(ranks))},
                        **{f"rank {r} micro-batches": ranks[r]["rank_micro_batches"] for r in range(len(ranks))},
                        "MiB all-reduced (rank 0)": np.array(ranks[0]["allreduce_bytes"]) / 2**20,
                        "loss, 1 process": ref["losses"],
                        **{f"loss, rank {r} of {len(ranks)}": ranks[r]["losses"] for r in range(len(ranks))}})
    losses = cmp[[f"loss, rank {r} of {len(ranks)}" for r in range(len(ranks))]]
    cmp["max |difference|"] = losses.sub(cmp["loss, 1 process"], axis=0).abs().max(axis=1)
    display(cmp)
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    ax.plot(cmp["step"], cmp["loss, 1 process"], "o-", lw=3, alpha=0.4, label="1 process")
    ax.plot(cmp["step"], cmp[f"loss, rank 0 of {len(ranks)}"], "x--", label=f"{len(ranks)} ranks (gloo), rank 0")
    ax.set(xlabel="optimizer step", ylabel="training loss")
    ax.legend()
    ax.grid(alpha=0.3)
    ax.set_title(f"DDP with {len(ranks)} ranks = 1 process on the same data\n" + title.replace("; ", "\n"), fontsize=9)
    plt.tight_layout()
    plt.show()
    return cmp


def memory_tables(plan: dict, name: str, components: tuple) -> pd.DataFrame:
    """Print GiB per rank for every model and setup (one GPU, DDP, FSDP2 on each number of ranks), then model
    `name`'s components; returns the first table (GiB). plan[model][world][setup][component] = bytes."""
    worlds = sorted(next(iter(plan.values())))
    total = lambda parts: sum(parts.values())  # noqa: E731
    wide = pd.DataFrame({m: {"one GPU": total(p[1]["one GPU"]), "DDP (any N)": total(p[1]["DDP"]),
                             **{f"FSDP2 on {w}": total(p[w]["FSDP2"]) for w in worlds}}
                         for m, p in plan.items()}).T / 2**30
    print("GiB per rank as a micro-batch's backward starts: micro-batches of 2 x 512 with gradient accumulation, "
          "bf16 autocast, fp32 AdamW")
    print(wide.round(2).to_string())
    parts = pd.DataFrame({"one GPU": plan[name][1]["one GPU"], "DDP (any N)": plan[name][1]["DDP"],
                          **{f"FSDP2 on {w}": plan[name][w]["FSDP2"] for w in worlds}}).loc[list(components)] / 2**30
    parts.loc["total"] = parts.sum()
    print(f"\n{name}: GiB per rank by component")
    print(parts.round(2).to_string())
    return wide


def plot_memory(wide: pd.DataFrame, card_gib: float, card_name: str, title: str) -> None:
    """GiB per rank against the number of ranks: FSDP2's line, DDP's level and one GPU's point for every model,
    against the card's memory."""
    worlds = [int(c.rsplit(" ", 1)[1]) for c in wide.columns if c.startswith("FSDP2 on ")]
    fig, ax = plt.subplots(figsize=(8, 3.6))
    for name in wide.index:
        line, = ax.plot(worlds, wide.loc[name, [f"FSDP2 on {w}" for w in worlds]], "o-", label=f"{name}: FSDP2")
        ax.axhline(wide.loc[name, "DDP (any N)"], color=line.get_color(), ls=":", lw=1)
        ax.plot([1], [wide.loc[name, "one GPU"]], "s", ms=9, mfc="none", color=line.get_color())
    ax.axhline(card_gib, color="red", lw=2, label=card_name)
    ax.plot([], [], "k:", lw=1, label="DDP, every rank")
    ax.plot([], [], "ks", mfc="none", label="one GPU, no DDP")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(worlds, worlds)
    ax.set(xlabel="ranks (GPUs)", ylabel="GiB per rank")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    ax.set_title("Training memory per GPU, micro-batches 2x512 with accumulation, bf16 + fp32 AdamW (arithmetic, "
                 f"not measured)\ncomputed on {title}", fontsize=8)
    plt.tight_layout()
    plt.show()


def comm_table(measured: list[list[dict]], title: str) -> pd.DataFrame:
    """The measure job's rows (one list per rank), averaged over the ranks per token budget: compute, step,
    exposed communication and the bare all-reduce (each the median of its repeats on a rank), shown as a table and a
    figure (symlog: logarithmic above 1 ms, linear below, so an exposed time of 0 is drawn at 0)."""
    m = pd.DataFrame([row for rows in measured for row in rows]).groupby("max_tokens").mean()
    m["allreduce / compute"] = m["allreduce_s"] / m["compute_s"]
    display(m[["tokens_per_rank", "compute_s", "step_s", "exposed_comm_s", "allreduce_s", "allreduce / compute"]]
            .round(4))
    x = np.arange(len(m))
    fig, ax = plt.subplots(figsize=(6.4, 3.4))
    ax.bar(x - 0.2, m["compute_s"] * 1e3, 0.4, label="compute: fwd+bwd, no_sync")
    ax.bar(x + 0.2, m["allreduce_s"] * 1e3, 0.4, label="bare all-reduce of the gradient")
    ax.plot(x, m["exposed_comm_s"] * 1e3, "kD", label="exposed comm (step - compute; 0 = hidden)")
    ax.set_xticks(x, [f"{int(t)} tokens/rank" for t in m["tokens_per_rank"]])
    ax.set_yscale("symlog", linthresh=1.0)
    ax.set_ylim(0, m["compute_s"].max() * 1e3 * 40)  # headroom above the bars for the legend
    ax.set_ylabel("ms per step (median, mean of ranks)\nsymlog: linear below 1 ms")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, axis="y", which="both")
    ax.set_title("DDP, 2 ranks (gloo): communication vs compute\n" + title.replace("; ", "\n"), fontsize=9)
    plt.tight_layout()
    plt.show()
    return m
