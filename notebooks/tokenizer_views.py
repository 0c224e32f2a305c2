"""Notebook 01's harness: reading texts from the data files, and pictures and tables of tokens.

Nothing here is BPE: the notebook's own functions (`get_stats`, `merge`, `train`, `encode`) are passed in where a
picture needs them, so what is drawn is what the learner's code does.
"""

import html
from collections import Counter
from collections.abc import Callable, Iterator

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from IPython.display import HTML, display

from minimind_lib.corpus import read_jsonl


def texts_of(path, max_samples: int | None = None) -> Iterator[str]:
    """The texts of a MiniMind jsonl file: each pretrain text, and each message of each conversation."""
    for record in read_jsonl(path, max_samples=max_samples):
        yield from [record["text"]] if "text" in record else [m["content"] for m in record["conversations"]]


def first_texts(path, max_bytes: int) -> list[str]:
    """Texts from the start of a file (its first 1000 records), skipping those that would pass max_bytes in all."""
    picked, size = [], 0
    for text in texts_of(path, max_samples=1000):
        if size + len(text.encode("utf-8")) <= max_bytes:
            picked.append(text)
            size += len(text.encode("utf-8"))
    return picked


def replay(words: list[list[int]], merges: dict, get_stats: Callable, merge: Callable) -> tuple[list, list]:
    """Retrace training with the notebook's get_stats and merge: for each merge, the count of its pair and how many
    pairs had that same count (above 1: the tie-break decided); asserts that train chose the pair the rule names."""
    counts, ties = [], []
    for pair, new_id in merges.items():
        stats = get_stats(words)
        assert pair == min(stats, key=lambda p: (-stats[p], p)), f"train chose {pair}, not the most frequent pair"
        counts.append(stats[pair])
        ties.append(sum(n == stats[pair] for n in stats.values()))
        words = [merge(ids, pair, new_id) for ids in words]
    return counts, ties


def spell(vocab: list[bytes], token_id: int) -> str:
    """A token's text for printing: · for a space, \\n for a newline, \\x.. for a byte that is part of a character."""
    return vocab[token_id].decode("utf-8", errors="backslashreplace").replace(" ", "·").replace("\n", "\\n")


def print_first_merges(merges: dict, vocab: list[bytes], counts: list, ties: list, k: int = 25) -> None:
    """The first k merges, each with the count of its pair when chosen and the number of pairs tied at that count."""
    for i, ((a, b), new_id) in enumerate(list(merges.items())[:k]):
        print(f"{i:3d}: {spell(vocab, a):>9} + {spell(vocab, b):<9} -> {new_id} {spell(vocab, new_id):14} "
              f"count={counts[i]:4d} tied_pairs={ties[i]}")
    print(f"... {sum(t > 1 for t in ties)} of {len(ties)} merges were decided by the tie-break")


def draw_merges(line: str, held_out: list[str], merges: dict, vocab: list[bytes], encode: Callable, counts: list,
                title: str) -> None:
    """Top: one line encoded with the first k merges, a box per token. Bottom: the held-out slice's token count as
    merges are added, beside the count of each merged pair."""
    first = lambda k: dict(list(merges.items())[:k])  # noqa: E731  (a dict keeps the order merges were learned in)
    n = len(merges)
    stages = [0, n // 20, n // 5, n]
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(11, 5.2), gridspec_kw={"height_ratios": [1.4, 1]})
    colors = plt.cm.Pastel1.colors
    for row, k in enumerate(stages):
        ids, x, y = encode(line, first(k)), 0.0, -row
        for j, t in enumerate(ids):
            s = spell(vocab, t)
            ax.add_patch(plt.Rectangle((x, y - 0.35), len(s), 0.7, color=colors[j % len(colors)], ec="grey", lw=0.5))
            ax.text(x + len(s) / 2, y, s, ha="center", va="center", family="monospace", fontsize=9)
            x += len(s) + 0.25
        ax.text(-1, y, f"{k} merges: {len(ids)} tokens", ha="right", va="center", fontsize=9)
    ax.set_xlim(-0.45 * len(line), 1.3 * len(line) + 2)
    ax.set_ylim(-len(stages) + 0.4, 0.6)
    ax.axis("off")
    ax.set_title(f"One held-out line, tokenized with the first k merges of your BPE\n{title}", fontsize=10)
    steps = list(range(0, n + 1, max(1, n // 10)))
    ax2.plot(steps, [sum(len(encode(t, first(k))) for t in held_out) for k in steps], marker=".",
             label="tokens for the held-out slice")
    ax2.set(xlabel="number of merges", ylabel="tokens")
    ax2.grid(alpha=0.3)
    ax2.legend(loc="upper center")
    ax2b = ax2.twinx()
    ax2b.plot(counts, color="C1", alpha=0.7)
    ax2b.set_ylabel("count of the merged pair", color="C1")
    plt.tight_layout()
    plt.show()


def show_tokens(tok, text: str) -> None:
    """The tokens of text as coloured boxes (HTML, so that any script displays)."""
    ids = tok.encode(text)
    pieces = [html.escape(tok.token_bytes(i).decode("utf-8", errors="backslashreplace")) for i in ids]
    colours = ["#fde2e4", "#e2ecf9", "#e4f5e1", "#fff2cc"]
    spans = "".join(f'<span style="background:{colours[k % 4]};padding:1px 2px;margin:1px;border:1px solid #bbb;'
                    f'font-family:monospace;white-space:pre">{p}</span>' for k, p in enumerate(pieces))
    display(HTML(f"<div>{len(text)} characters, {len(ids)} tokens: {spans}</div>"))


def language(text: str) -> str:
    """The script of a text: chinese if most non-space characters are CJK, english if most are ASCII letters."""
    chars = [c for c in text if not c.isspace()] or [" "]
    cjk = sum("\u4e00" <= c <= "\u9fff" or "\u3400" <= c <= "\u4dbf" for c in chars) / len(chars)
    latin = sum(c.isascii() and c.isalpha() for c in chars) / len(chars)
    if cjk > 0.5:
        return "chinese"
    return "english" if latin > 0.5 else "other"


def per_language(texts: list[str], ids: list[list[int]]) -> pd.DataFrame:
    """Texts, characters, UTF-8 bytes and tokens per script, with characters and bytes per token."""
    rows: dict[str, Counter] = {}
    for text, tokens in zip(texts, ids):
        row = rows.setdefault(language(text), Counter())
        row.update(texts=1, chars=len(text), bytes=len(text.encode("utf-8")), tokens=len(tokens))
    table = pd.DataFrame(rows).T
    table["chars/token"] = table["chars"] / table["tokens"]
    table["bytes/token"] = table["bytes"] / table["tokens"]
    return table


def zipf_plot(val_ids: list[list[int]], train_ids: list[list[int]], vocab_size: int, title: str) -> None:
    """Token frequency by rank (log-log) for validation text and a training sample; prints the top 500's share."""
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name, ids in (("validation text", val_ids), ("first 1000 lines of each training file", train_ids)):
        freq = np.array(sorted(Counter(i for row in ids for i in row).values(), reverse=True))
        ax.loglog(np.arange(1, len(freq) + 1), freq, label=f"{name} ({len(freq) / vocab_size:.0%} of ids used)")
        cover = np.cumsum(freq) / freq.sum()
        print(f"{name}: {freq.sum():,} tokens, {len(freq)} of {vocab_size} ids used; the top 500 ids cover "
              f"{cover[min(499, len(cover) - 1)]:.1%} of the tokens")
    ax.set(xlabel="rank of token id", ylabel="occurrences")
    ax.legend()
    ax.grid(alpha=0.3, which="both")
    ax.set_title(f"Token frequency by rank (Zipf plot)\n{title}", fontsize=9)
    plt.tight_layout()
    plt.show()
