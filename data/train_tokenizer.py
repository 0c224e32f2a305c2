"""Rebuild the committed tokenizer (minimind_lib/assets/tokenizer) from data/ (notebook 01_tokenizer explains it).

It trains MiniMind's 6400-token byte-level BPE on every pretrain text and every message of every conversation:

    .venv/bin/python data/train_tokenizer.py            # retrain into minimind_lib/assets/tokenizer
    .venv/bin/python data/train_tokenizer.py --check    # retrain into a temporary folder; exit 1 if it differs
    .venv/bin/python data/train_tokenizer.py --data data/pretrain.jsonl --out /tmp/tok --vocab-size 1000

Training is deterministic: the same data give a byte-identical tokenizer.json. It prints one JSON line of facts.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from minimind_lib.corpus import read_jsonl
from minimind_lib.paths import DATA_DIR
from minimind_lib.tokenizer import CONFIG_FILE, DEFAULT_DIR, DEFAULT_VOCAB_SIZE, TOKENIZER_FILE, Tokenizer

DEFAULT_FILES = [DATA_DIR / "pretrain.jsonl", DATA_DIR / "sft.jsonl"]


def jsonl_texts(paths: Sequence[str | Path], max_samples: int | None = None, stats: dict | None = None) -> Iterator[str]:
    """The training texts of MiniMind jsonl files: each {"text"}, and each message content of {"conversations"}.

    Reads at most max_samples records per file; counts lines, texts, chars and blank lines into stats.
    """
    stats = {} if stats is None else stats
    for key in ("lines", "texts", "chars", "blank_lines"):
        stats.setdefault(key, 0)
    for path in paths:
        reader = read_jsonl(path, max_samples=max_samples)  # errors name file and line
        for record in reader:
            where = f"{path}:{reader.n_lines}"
            if isinstance(record, dict) and isinstance(record.get("text"), str):
                texts = [record["text"]]
            elif isinstance(record, dict) and isinstance(record.get("conversations"), list):
                texts = []
                for j, message in enumerate(record["conversations"]):
                    if not isinstance(message, dict) or not isinstance(message.get("content"), str):
                        raise ValueError(f"{where}: conversations[{j}] needs a string 'content', got {message!r:.80}")
                    texts.append(message["content"])
            else:
                keys = sorted(record) if isinstance(record, dict) else type(record).__name__
                raise ValueError(f"{where}: expected a 'text' string or a 'conversations' list, got {keys}")
            stats["lines"] += 1
            stats["texts"] += len(texts)
            stats["chars"] += sum(map(len, texts))
            yield from texts
        stats["blank_lines"] += reader.n_blank


def train(paths: Sequence[str | Path], vocab_size: int = DEFAULT_VOCAB_SIZE,
          max_samples: int | None = None) -> tuple[Tokenizer, dict]:
    """Train on jsonl files; returns the tokenizer and stats (files, lines, texts, chars, train_seconds, vocab_size)."""
    stats: dict = {"files": [str(p) for p in paths], "max_samples": max_samples}
    texts = list(jsonl_texts(paths, max_samples, stats))  # read first, so that the timing is training only
    t0 = time.perf_counter()
    tok = Tokenizer.train(texts, vocab_size=vocab_size)
    stats["train_seconds"] = round(time.perf_counter() - t0, 3)
    stats["vocab_size"] = tok.vocab_size
    return tok, stats


def main(argv: list[str] | None = None) -> int:
    """Train, save (or --check against the committed asset) and print the facts as JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", nargs="+", default=DEFAULT_FILES, help="jsonl files ({'text'} or {'conversations'})")
    parser.add_argument("--out", default=DEFAULT_DIR, help="output directory (tokenizer.json + tokenizer_config.json)")
    parser.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE)
    parser.add_argument("--max-samples", type=int, default=None, help="read at most this many records per file")
    parser.add_argument("--check", action="store_true", help="compare with --out instead of writing it")
    args = parser.parse_args(argv)
    try:
        tok, stats = train(args.data, args.vocab_size, args.max_samples)
        if not args.check:
            print(json.dumps({"out": str(tok.save(args.out)), **stats}, ensure_ascii=False))
            return 0
        with tempfile.TemporaryDirectory() as tmp:
            tok.save(tmp)
            same = {name: (Path(tmp) / name).read_bytes() == (Path(args.out) / name).read_bytes()
                    for name in (TOKENIZER_FILE, CONFIG_FILE)}
        print(json.dumps({"compared_with": str(args.out), "identical": same, **stats}, ensure_ascii=False))
        return 0 if all(same.values()) else 1
    except (ValueError, FileNotFoundError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
