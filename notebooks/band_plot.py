"""The band figure of notebooks 07_pretrain, 08_sft and 10_lora_dpo: a run's validation losses over its profile's
reference band.

Plotting only (the band, the verdict and the doctor are minimind_lib.evaluate's); one copy for the chapters.
"""

from typing import Any

import matplotlib.pyplot as plt
import pandas as pd
from matplotlib.ticker import EngFormatter


def draw_band(band: dict, ref: dict, val_points: pd.DataFrame, seed: int, title: str, ylabel: str,
              xlabel: str = "tokens seen") -> Any:
    """The band's seeds (lowest to highest, the 95% prediction interval, the median) and this run's points."""
    made, n = ref.get("made_by", band["made_by"]), len(ref.get("seeds", band["seeds"]))
    fig, ax = plt.subplots(figsize=(8, 4.2))
    ax.fill_between(ref["tokens"], ref["quantiles"]["0.0"], ref["quantiles"]["1.0"], color="tab:blue", alpha=0.35,
                    label=f"lowest to highest of the {n} seeds")
    ax.fill_between(ref["tokens"], ref["lower"], ref["upper"], color="tab:blue", alpha=0.15,
                    label=f"95% prediction interval ({n} seeds)")
    ax.plot(ref["tokens"], ref["quantiles"]["0.5"], "k--", lw=1, label="the seeds' median")
    ax.plot(val_points["tokens_seen"], val_points["val_loss"], "o-", color="tab:orange", label=f"this run (seed {seed})")
    ax.set(xlabel=xlabel, ylabel=ylabel)
    ax.xaxis.set_major_formatter(EngFormatter())
    ax.legend()
    ax.set_title(f"{title}\nband: {made['device']} {ref['dtype']}, {made['cpu']}, {made['threads']} threads, {n} seeds",
                 fontsize=9)
    fig.tight_layout()
    return fig


def print_verdict(verdict: dict) -> None:
    """The verdict's summary, then the doctor's findings and what the run changed against the band's runs."""
    print(verdict["summary"])
    for finding in verdict["findings"]:
        print(f"  {finding['cause']}: {finding['evidence']}")
    for note in verdict["notes"]:
        print(f"  this run differs from the band's runs in {note}")
