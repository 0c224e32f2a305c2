"""The figures, tables and progress bars of a training run, for notebooks 07_pretrain and 08_sft.

Harness only: each chapter computes what its run measured (with minimind_lib); this module draws it, lays it out
as a table, shows a progress bar, and takes the samples a run is read by. Nothing here is a mechanism the course
builds.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import math
import os
import re
import time
import unicodedata
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import torch
from IPython.display import display
from matplotlib.font_manager import FontProperties, findfont
from matplotlib.ft2font import FT2Font
from matplotlib.ticker import EngFormatter, MaxNLocator
from tqdm.notebook import tqdm

from minimind_lib import pipeline
from minimind_lib.generate import generate


class ProgressBar:
    """fit's callback: a bar of the run's optimizer steps. A widget's saved text is written when it is displayed,
    so the bar is displayed through a handle that `close` refreshes: the saved notebook shows where it ended."""

    def __init__(self, total: int, desc: str):
        self.bar = tqdm(total=total, desc=desc, display=False)
        self.view = display(self.bar.container, display_id=True)

    def __call__(self, step: int, row: dict) -> None:
        self.bar.update(max(0, step + 1 - self.bar.n))
        self.bar.set_postfix(loss=f"{row['loss']:.3f}")

    def close(self) -> None:
        self.bar.close()
        if self.view is not None:  # None outside Jupyter (a plain Python run of the cells)
            self.view.update(self.bar.container)


class SampleTaker:
    """fit's callback: every `every` optimizer steps, each prompt continued greedily (temperature 0) and sampled
    (temperature 0.8 from the 40 most likely tokens). Each prompt has its own seed (`seed + its index`), the same at
    every sample point, so two points differ only by the weights (with one seed for both prompts, a model that has
    not yet learned to read its prompt draws the same tokens after either)."""

    def __init__(self, model: torch.nn.Module, tok, prompts: tuple, every: int, seed: int):
        self.model, self.tok, self.prompts, self.every, self.seed, self.rows = model, tok, prompts, every, seed, []

    def __call__(self, step: int, row: dict) -> None:
        done = step + (0 if row.get("skipped") else 1)  # optimizer steps finished
        if row.get("skipped") or done % self.every:
            return
        for k, prompt in enumerate(self.prompts):
            for decoding, kw in (("greedy", {"temperature": 0.0}),
                                 ("sampled", {"temperature": 0.8, "top_k": 40, "seed": self.seed + k})):
                text = generate(self.model, self.tok, prompt, max_new_tokens=24, **kw)
                self.rows.append({"step": done, "prompt": prompt, "decoding": decoding, "text": text})


def plot_pretrain(metrics: pd.DataFrame, title: str, memory_checks: bool) -> None:
    """Four views of a pretraining run's metrics: loss against tokens seen, throughput, the controller's split
    (and the peak memory of each step, on a GPU), and the learning rate."""
    trained, val = metrics[metrics["step"] >= 0], metrics.dropna(subset=["val_loss"])
    fig, ax = plt.subplots(2, 2, figsize=(11, 7))
    ax[0, 0].plot(trained["tokens_seen"], trained["loss"], label="train loss", alpha=0.7)
    ax[0, 0].plot(val["tokens_seen"], val["val_loss"], "o-", label="validation loss")
    ax[0, 0].axhline(math.log(6400), color="grey", ls=":", label="ln 6400")
    ax[0, 0].set(xlabel="tokens seen", ylabel="loss (nats/token)", title="loss")
    ax[0, 0].xaxis.set_major_formatter(EngFormatter())  # 1.2M, not 1200000: the ticks do not overlap
    ax[0, 0].xaxis.set_major_locator(MaxNLocator(5))
    ax[0, 0].legend()
    ax[0, 1].plot(trained["step"], trained["tokens_per_s"])
    ax[0, 1].set(xlabel="optimizer step", ylabel="trained tokens / s", title="throughput (this run)")
    ax[1, 0].plot(trained["step"], trained["accum_steps"], drawstyle="steps-post", label="micro-batches per step")
    unchanged = " (unchanged: no OOM" + (")" if memory_checks else ", no memory meter on CPU)")
    ax[1, 0].set(xlabel="optimizer step", ylabel="micro-batches", ylim=(0, trained["accum_steps"].max() + 1),
                 title="the controller's split" + (unchanged if trained["accum_steps"].nunique() == 1 else ""))
    ax[1, 0].yaxis.set_major_locator(MaxNLocator(integer=True))  # micro-batches are whole numbers
    if trained["peak_memory_bytes"].notna().any():
        mem = ax[1, 0].twinx()
        mem.plot(trained["step"], trained["peak_memory_bytes"] / 2**30, color="tab:red", label="peak memory")
        mem.set_ylabel("peak memory (GiB)")
    ax[1, 1].plot(trained["step"], trained["lr"])
    ax[1, 1].set(xlabel="optimizer step", ylabel="learning rate", title="warmup + cosine")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    plt.show()


def plot_sft(metrics: pd.DataFrame, title: str) -> None:
    """An SFT run's loss (assistant tokens, and the held-out conversations) and its learning rate."""
    trained, val = metrics[metrics["step"] >= 0], metrics.dropna(subset=["val_loss"])
    fig, ax = plt.subplots(1, 2, figsize=(11, 3.8))
    ax[0].plot(trained["tokens_seen"], trained["loss"], alpha=0.7, label="train loss (assistant tokens)")
    ax[0].plot(val["tokens_seen"], val["val_loss"], "o-", label="held-out conversations")
    ax[0].set(xlabel="trained tokens seen", ylabel="loss (nats/token)", title="SFT loss")
    ax[0].xaxis.set_major_formatter(EngFormatter())
    ax[0].xaxis.set_major_locator(MaxNLocator(5))
    ax[0].legend()
    ax[1].plot(trained["step"], trained["lr"])
    ax[1].set(xlabel="optimizer step", ylabel="learning rate", title="warmup + cosine")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    plt.show()


def pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def ladder_text(ladder: dict, choice: dict) -> str:
    """The ladder as text: bits per byte per language, top-1 and top-5 per scorer (rows of ev.text_ladder; "model",
    the trained one, shown as "trained"), then each model's two-choice share with its 95% interval over pairs."""
    columns = {"bits/byte English": ("language: English", "bits_per_byte"),
               "bits/byte Chinese": ("language: Chinese", "bits_per_byte"), "bits/byte all": ("all", "bits_per_byte"),
               "top-1": ("all", "top1"), "top-5": ("all", "top5")}
    table = pd.DataFrame({name: {col: f"{rows[group][key]:.3f}" if key == "bits_per_byte" else pct(rows[group][key])
                                 for col, (group, key) in columns.items() if group in rows}
                          for name, rows in ladder.items()}).T.rename(index={"model": "trained"})
    lines = [table.to_string()]
    for name, c in choice.items():
        low, high = c["interval95"]
        name = "trained" if name == "model" else name
        lines.append(f"two-choice, {name}: {pct(c['share'])} of {c['pairs']} pairs ({c['both_right']} right both "
                     f"ways; 95% interval {pct(low)} to {pct(high)}; chance 50%): {c['verdict']}")
    return "\n".join(lines)


def _padded(text: str, width: int) -> str:
    # pad to a width in terminal columns: a Chinese character takes two, so str.ljust would misalign its rows
    return text + " " * max(0, width - sum(1 + (unicodedata.east_asian_width(ch) in "WF") for ch in text))


def sample_table(samples: list[dict], corpus: Path) -> pd.DataFrame:
    """Print each sample, then measure them by a rule fixed before looking: the share of spaces and punctuation
    (the most frequent tokens, learned first), the distinct characters, and how many of its Latin words (runs of
    letters) occur as words in the training text `corpus`."""
    with open(corpus, encoding="utf-8") as f:
        known_words = {w.lower() for line in f for w in re.findall(r"[A-Za-z]+", json.loads(line)["text"])}
    rows = []
    for s in samples:
        print(f"step {s['step']:4d} {s['decoding']:7s} | {_padded(repr(s['prompt']), 16)} -> {s['text'][:60]!r}")
        text, words = s["text"], re.findall(r"[A-Za-z]+", s["text"])
        punct = sum(ch.isspace() or unicodedata.category(ch).startswith("P") for ch in text)
        rows.append({"step": s["step"], "decoding": s["decoding"], "prompt": s["prompt"].strip(), "chars": len(text),
                     "space+punct share": round(punct / max(len(text), 1), 2), "distinct chars": len(set(text)),
                     "latin words": len(words), "in corpus": sum(w.lower() in known_words for w in words)})
    table = pd.DataFrame(rows)
    with pd.option_context("display.unicode.east_asian_width", True):  # columns padded by display width
        print(table.to_string(index=False))
    return table


# ----------------------------------------------------------------------------------- notebook 08
def pretrained_run(profile, device: torch.device) -> tuple[Path, bool]:
    """(07's run directory, whether it is a small start): when 07 has not been run here, a small start (a quarter of
    07's steps) is made now, and said so.
    Prints where the run came from: `make prepare-workshop` (its provenance.json, checked against model.pth's
    SHA-256), this call, or notebook 07 (or the command line) on this machine."""
    run = pipeline.run_dir_for(profile.name, "pretrain")
    small_start = not ((run / "model.pth").is_file() and (run / "config.json").is_file())
    if small_start:
        plan = pipeline.plan_run(profile, "pretrain")
        plan["steps"] = max(1, plan["steps"] // 4)
        print(f"no pretrained run in {os.path.relpath(run)} (notebook 07 was not run, or did not finish): a small "
              f"start of {plan['steps']} steps (a quarter of 07's) now with pipeline.pretrain, eager; SFT below "
              "starts from a weaker model than 07's run would give")
        pipeline.pretrain(out=run, profile=profile, device=device, overwrite=True, progress=False, compile=False,
                          **pipeline.plan_kwargs(plan))
    summary = json.loads((run / "summary.json").read_text())
    written = dt.datetime.fromtimestamp((run / "model.pth").stat().st_mtime, dt.timezone.utc)
    prepared = json.loads((run / "provenance.json").read_text()) if (run / "provenance.json").is_file() else {}
    if prepared.get("model_sha256") == hashlib.sha256((run / "model.pth").read_bytes()).hexdigest():
        origin = f"{prepared['made_by']}, started {prepared['started_utc']}: {prepared['command']}"
    elif small_start:
        origin = "this notebook, just now (pipeline.pretrain, called by the cell above)"
    else:
        origin = "notebook 07 (or `python -m minimind_lib pretrain --out` this folder) on this machine"
    print(f"run {run.relative_to(run.parents[2])}, made by {origin}")
    print(f"profile {summary['profile']}, {summary['steps']} steps, {summary['tokens']:,} tokens on "
          f"{summary['device']}, model.pth written {written:%Y-%m-%d %H:%M} UTC; validation loss "
          f"{summary['initial_val_loss']:.3f} -> {summary['final_val_loss']:.3f}")
    assert summary["profile"] == profile.name, (summary["profile"], profile.name)
    return run, small_start


def answers_table(prompts: list[str], before: dict, after: dict) -> None:
    """The greedy answers to each prompt before and after SFT, side by side (cut to 50 characters)."""
    with pd.option_context("display.unicode.east_asian_width", True):  # Chinese rows padded by display width
        print(pd.DataFrame({"prompt": prompts, "before SFT": [before[p][:50] for p in prompts],
                            "after SFT": [after[p][:50] for p in prompts]}).to_string(index=False))


def _token_label(tok, token_id: int, font: FT2Font) -> str:
    # the token's text, \n and the like escaped; a character the font cannot draw (Chinese, on a font without it) by name
    text = repr(tok.decode([int(token_id)]))[1:-1]
    return "".join(ch if ch.isascii() or font.get_char_index(ord(ch))
                   else f"<{unicodedata.name(ch, 'U+%04X' % ord(ch)).lower()}>" for ch in text)


def plot_first_token(logits: torch.Tensor, tok, title: str, temperatures=(0.5, 1.0, 1.5), top: int = 12) -> None:
    """One next-token distribution at several temperatures: its most likely tokens, and how many tokens it takes to
    hold 0.9 of the probability (the nucleus top-p 0.9 samples from)."""
    font = FT2Font(findfont(FontProperties()))  # the figure's font: a character it has no glyph for would be a box
    likely = logits.argsort(descending=True)[:top]  # the same order at every temperature
    fig, ax = plt.subplots(1, 2, figsize=(12, 3.8))
    for j, temperature in enumerate(temperatures):
        probs = (logits / temperature).softmax(-1).sort(descending=True).values.cpu()
        cum = probs.cumsum(0)
        kept = int((cum - probs < 0.9).sum())  # the top-p 0.9 nucleus, as keep_top_p keeps it
        ax[0].bar(np.arange(top) + (j - 1) * 0.27, probs[:top], width=0.27, label=f"temperature {temperature}")
        ax[1].plot(np.arange(1, len(cum) + 1), cum, label=f"temperature {temperature}: top-p 0.9 keeps {kept:,} tokens")
    ax[0].set_xticks(range(top), [_token_label(tok, i, font) for i in likely], rotation=90, fontsize=8)
    ax[0].set(ylabel="probability", title=f"the {top} most likely first tokens")
    ax[0].legend(fontsize=8)
    ax[1].axhline(0.9, color="k", lw=0.8, ls="--")
    ax[1].set(xscale="log", xlabel="tokens, most likely first", ylabel="cumulative probability",
              title="how many tokens hold 0.9 of the probability")
    ax[1].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    plt.show()


def time_generation(generate_fn, repeats: int = 5) -> dict:
    """Seconds of `generate_fn(use_cache)` with and without the cache, `repeats` times, interleaved (so a change
    in the machine's load affects both alike): {True: [...], False: [...]}."""
    seconds = {True: [], False: []}
    for _ in range(repeats):
        for use_cache in (True, False):
            t0 = time.perf_counter()
            generate_fn(use_cache)
            seconds[use_cache].append(time.perf_counter() - t0)
    return seconds


def plot_cache(positions: dict, seconds: dict, title: str) -> None:
    """Positions per forward call with and without the cache (counted), and the seconds of each repeat."""
    fig, ax = plt.subplots(1, 2, figsize=(11, 3.6))
    ax[0].plot(positions[False], label="without the cache: the whole sequence")
    ax[0].plot(positions[True], label="with the cache: prefill, then 1")
    ax[0].set(xlabel="generation step", ylabel="positions processed", title="positions per forward call (counted)",
              yscale="log")
    ax[0].legend(fontsize=8)
    for x, use_cache in enumerate((True, False)):
        ax[1].plot([x] * len(seconds[use_cache]), seconds[use_cache], "o", alpha=0.6)
        ax[1].hlines(np.median(seconds[use_cache]), x - 0.2, x + 0.2, color="k")
    ax[1].set_xticks([0, 1], ["with the cache", "without"])
    ax[1].set(xlim=(-0.6, 1.6), ylabel="seconds", title=f"measured: {len(seconds[True])} repeats, median line")
    ax[1].set_ylim(bottom=0)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    plt.show()
