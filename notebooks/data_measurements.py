"""Notebook 02's harness: timing loops, memory readings, tables and pictures of the data the notebook builds.

Nothing here is a mechanism the notebook teaches: its own functions (the collator, the sample reader) are passed in
where a measurement needs them. Times are returned per repeat, the settings measured in turns, so the notebook
compares them only as ratios taken in the same repeat (notebooks/verdict.py).
"""

import functools
import itertools
import os
import tempfile
import time
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import torch
from IPython.display import HTML

from minimind_lib import corpus as C
from minimind_lib.data import pad_collate
from minimind_lib.model import MiniMindConfig, MiniMindForCausalLM


def show_mask(tok, input_ids: torch.Tensor, labels: torch.Tensor, title: str) -> HTML:
    """The tokens of a sample, trained ones green and ignored ones (label -100) grey."""
    spans = []
    for i, label in zip(input_ids.tolist(), labels.tolist()):
        text = tok.decode([i]).replace("\n", "\\n")
        colour = "#b7e4c7" if label != -100 else "#e9ecef"
        spans.append(f"<span title='id {i}, label {label}' style='background:{colour};padding:1px 2px;margin:1px;"
                     f"border-radius:3px;font-family:monospace;display:inline-block'>{text}</span>")
    legend = ("<div style='margin-top:6px;font-size:90%'><span style='background:#b7e4c7;padding:1px 4px'>trained"
              "</span> <span style='background:#e9ecef;padding:1px 4px'>ignored (label -100)</span> · "
              + title + "</div>")
    return HTML("<div style='line-height:2'>" + "".join(spans) + "</div>" + legend)


def truncation_plot(raw_lengths: np.ndarray, seq_lens: list[int], seq_len: int, title: str) -> list[float]:
    """The share of a file's next-token targets that truncation trains at each seq_len (drawn and returned)."""
    kept = [int((np.minimum(raw_lengths, s) - 1).sum()) / int((raw_lengths - 1).sum()) for s in seq_lens]
    fig, ax = plt.subplots(figsize=(6.5, 3.2))
    ax.plot(seq_lens, kept, "o-", label="truncate (MiniMind)")
    ax.axhline(1.0, color="tab:green", ls="--", label="chunk: every target kept")
    ax.axvline(seq_len, color="r", ls=":", label=f"this profile's seq_len {seq_len}")
    ax.set_xscale("log", base=2)
    ax.set_xticks(seq_lens, [str(s) for s in seq_lens])
    ax.set(xlabel="seq_len", ylabel="share of next-token targets trained", ylim=(0, 1.05))
    ax.set_title(f"data/pretrain.jsonl ({len(raw_lengths)} documents) · {title}", fontsize=9)
    ax.legend(fontsize=8)
    plt.tight_layout()
    plt.show()
    return kept


def tokenize_seconds(tok, sources: dict, max_samples: int | None, repeats: int = 3, workers: int = 2) -> dict:
    """Seconds of C.tokenize_to_memmap per kind of file, in this process (num_workers=0) and with `workers`
    processes, in turns, `repeats` times: {(kind, num_workers): [seconds of each repeat]}."""
    seconds, tokens = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for kind, src in sources.items():
            for _ in range(repeats):
                for nw in (0, workers):  # in turns: load on the machine hits both alike
                    info = C.tokenize_to_memmap(src, tok, f"{tmp}/{kind}{nw}", kind=kind, num_workers=nw,
                                                max_samples=max_samples, force=True, progress=False)
                    seconds.setdefault((kind, nw), []).append(info.seconds)
                    tokens.setdefault(kind, set()).add(info.n_tokens)
    assert all(len(n) == 1 for n in tokens.values()), "the same tokens whatever the workers"
    return seconds


def rss_mib(field: str) -> float:
    """A line of /proc/self/status (RssAnon, RssFile), in MiB."""
    with open("/proc/self/status") as f:
        return next((int(line.split()[1]) for line in f if line.startswith(field + ":")), 0) / 1024


def memory_while_reading(path: Path, offsets: np.ndarray, read_sample) -> tuple[float, float]:
    """Growth of anonymous and file-backed memory (MiB) while every sample of a token file is read once."""
    tokens = np.memmap(path, dtype=np.uint16, mode="r")
    base_anon, base_file, peak_anon = rss_mib("RssAnon"), rss_mib("RssFile"), 0.0
    for i in range(len(offsets) - 1):
        torch.from_numpy(read_sample(tokens, offsets, i).astype(np.int64))  # what a dataset hands to a batch
        if i % 2000 == 0:
            peak_anon = max(peak_anon, rss_mib("RssAnon") - base_anon)
    grown = (max(peak_anon, rss_mib("RssAnon") - base_anon), rss_mib("RssFile") - base_file)
    del tokens
    return grown


def memory_growth(tokens: np.ndarray, offsets: np.ndarray, folder: Path, read_sample, title: str,
                  copies=(1, 4, 16)) -> pd.DataFrame | None:
    """Memory growth while reading token files of 1, 4 and 16 copies of `tokens` (drawn and returned); None where
    /proc/self/status does not exist (Linux only)."""
    if not Path("/proc/self/status").exists():
        return None
    rows, n = [], int(offsets[-1])
    for k in copies:
        path = folder / f"tokens_x{k}.bin"
        with open(path, "wb") as f:
            for _ in range(k):
                f.write(np.asarray(tokens).tobytes())
        all_offsets = np.concatenate([offsets[:-1] + c * n for c in range(k)] + [[k * n]])
        anon, file_backed = memory_while_reading(path, all_offsets, read_sample)
        rows.append({"file MiB": os.path.getsize(path) / 2**20, "samples read": len(all_offsets) - 1,
                     "anonymous growth MiB": anon, "file-backed growth MiB": file_backed})
        path.unlink()
    growth = pd.DataFrame(rows)
    fig, ax = plt.subplots(figsize=(6.5, 3.2))
    ax.plot(growth["file MiB"], growth["anonymous growth MiB"], "o-", label="anonymous (this process only)")
    ax.plot(growth["file MiB"], growth["file-backed growth MiB"], "s--", label="file-backed (page cache, droppable)")
    ax.set(xlabel="token file size (MiB)", ylabel="growth while reading (MiB)")
    ax.set_title(f"Memory while reading every sample of a memmap once\n{title}", fontsize=9)
    ax.legend(fontsize=8)
    plt.tight_layout()
    plt.show()
    return growth


def read_seconds(dataset, order) -> tuple[float, int]:
    """Seconds to read the samples at `order`, and the tokens read."""
    start = time.perf_counter()
    n_tokens = sum(len(dataset[int(i)]["input_ids"]) for i in order)
    return time.perf_counter() - start, n_tokens


def length_histograms(datasets: dict, seq_len: int, title: str) -> None:
    """The sample lengths of each dataset (dataset.lengths, read from the offsets index)."""
    fig, axes = plt.subplots(1, len(datasets), figsize=(10, 3.4))
    for ax, (name, ds) in zip(axes, datasets.items()):
        ax.hist(ds.lengths, bins=40, color="#4c72b0")
        ax.axvline(ds.lengths.mean(), c="k", ls="--", label=f"mean {ds.lengths.mean():.0f}")
        ax.axvline(seq_len, c="r", ls=":", label=f"seq_len {seq_len}")
        ax.set_title(f"{name}: {len(ds.lengths)} samples, {ds.stats.n_truncated} truncated", fontsize=9)
        ax.set_xlabel("tokens per sample (after truncation)")
        ax.legend(fontsize=8)
    axes[0].set_ylabel("samples")
    fig.suptitle(f"Sample lengths · {title}", fontsize=9)
    plt.tight_layout()
    plt.show()


def padding_table(datasets: dict, batch_size: int, seq_len: int, collate, padding_fraction, trained_tokens,
                  seed: int = 0) -> pd.DataFrame:
    """Padding of shuffled batches, as a DataLoader builds them, padded by `collate` (the notebook's pad_batch) to
    seq_len or to the longest row; asserts that `padding_fraction` of the lengths predicts the tensors' padding."""
    rows = []
    for name, ds in datasets.items():
        order = np.random.default_rng(seed).permutation(len(ds))
        batches = [[ds[int(i)] for i in order[s:s + batch_size]] for s in range(0, len(order), batch_size)]
        for padding, fixed in (("fixed (seq_len)", True), ("longest", False)):
            padded = [collate(b, fixed=fixed) for b in batches]
            real = sum(int(b["attention_mask"].sum()) for b in padded)
            cells = sum(b["attention_mask"].numel() for b in padded)
            frac = padding_fraction([[len(s["input_ids"]) for s in b] for b in batches], seq_len if fixed else None)
            assert abs(frac - (1 - real / cells)) < 1e-12  # lengths alone predict the padding of the tensors
            rows.append({"data": name, "padding": padding, "padding_fraction": frac,
                         "trained_fraction": sum(trained_tokens(b["labels"]) for b in padded) / cells,
                         "padded_tokens": cells})
    return pd.DataFrame(rows)


def padding_plot(pads: pd.DataFrame, batch_size: int, seq_len: int, title: str) -> None:
    """The padding fraction of each dataset, padded to seq_len and to the longest row."""
    fig, ax = plt.subplots(figsize=(6.5, 3.2))
    pads.pivot(index="data", columns="padding", values="padding_fraction").plot.bar(ax=ax, rot=0)
    ax.set(ylabel="padding fraction", ylim=(0, 1))
    ax.set_title(f"Padding fraction, batch_size={batch_size}, seq_len={seq_len}\n{title}", fontsize=9)
    plt.tight_layout()
    plt.show()


def training_step(config: MiniMindConfig, lr: float, seed: int = 0):
    """A real training step of a fresh model (forward, backward, AdamW), as a function of a batch."""
    torch.manual_seed(seed)
    model = MiniMindForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)

    def step(batch: dict) -> None:
        out = model(batch["input_ids"], labels=batch["labels"], attention_mask=batch["attention_mask"])
        optimizer.zero_grad(set_to_none=True)
        out.loss.backward()
        optimizer.step()
    return step


def seconds_per_batch(batches, step, n: int) -> float:
    """Seconds per batch of `n` rounds of: take the next batch, run `step` on it. The first batch is taken (and
    stepped) before the clock starts, so starting the worker processes is not counted."""
    it = iter(batches)
    step(next(it))
    start = time.perf_counter()
    for _ in range(n):
        step(next(it))
    return (time.perf_counter() - start) / n


def loader_beside_a_step(datasets: dict, loop_on: str, pad_id: int, batch_size: int, config: MiniMindConfig,
                         lr: float, n_batches: int, workers: int = 2, repeats: int = 3) -> dict:
    """Seconds per batch, per repeat, the settings in turns: each dataset's loader alone (num_workers=0), the
    training step alone (on batches made beforehand), and the loop that takes a batch of dataset `loop_on` and
    trains on it, its loader with 0 and with `workers` worker processes.
    Keys: (dataset, "loader alone"), "step alone", ("loop", 0), ("loop", workers)."""
    collate = functools.partial(pad_collate, pad_id=pad_id)  # a partial pickles, so workers can use it
    step, seconds = training_step(config, lr), {}

    def loader(ds, num_workers: int) -> torch.utils.data.DataLoader:  # the same shuffled batches for every setting
        subset = torch.utils.data.Subset(ds, range(min(len(ds), (n_batches + 1) * batch_size)))
        return torch.utils.data.DataLoader(subset, batch_size=batch_size, shuffle=True, collate_fn=collate,
                                           num_workers=num_workers, generator=torch.Generator().manual_seed(0))
    with C.tokenizers_parallelism_off():  # workers fork: the tokenizer's threads must be off while they do
        for _ in range(repeats):
            for name, ds in datasets.items():
                seconds.setdefault((name, "loader alone"), []).append(
                    seconds_per_batch(loader(ds, 0), lambda batch: None, n_batches))
            made = list(itertools.islice(loader(datasets[loop_on], 0), n_batches + 1))
            seconds.setdefault("step alone", []).append(seconds_per_batch(made, step, n_batches))
            for nw in (0, workers):
                seconds.setdefault(("loop", nw), []).append(
                    seconds_per_batch(loader(datasets[loop_on], nw), step, n_batches))
    return seconds
