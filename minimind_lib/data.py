"""Datasets and batches, built in notebook 02_data: a jsonl file or memmap -> {"input_ids",
"labels"} samples (cut at seq_len, counted in ``stats``) -> ``pad_collate`` batches; notebook
07_pretrain's run datasets (`memmap_dataset`)."""

from __future__ import annotations

import functools
import hashlib
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset, Subset

from .corpus import (PAYLOAD, JsonlReader, check_choice, read_memmap_meta, tokenize_samples,
                     tokenize_to_memmap,
                     tokenizer_fingerprint)
# the label of a position whose next token is not trained (PyTorch CE ignore_index)
from .model import IGNORE_INDEX
from .tokenizer import check_vocab

# what a pretrain dataset does with a document longer than seq_len
LONG_DOCS = ("truncate", "chunk")
# a run's: documents split into rows, conversations (and pairs) cut
LONG_DOCS_BY_KIND = {"pretrain": "chunk", "sft": "truncate", "dpo": "truncate"}


def make_sample(ids: np.ndarray, mask: np.ndarray | None, seq_len: int) -> dict[str, torch.Tensor]:
    """{"input_ids", "labels"} from raw ids (+ optional trained-token mask), truncated to seq_len.
    """
    input_ids = torch.from_numpy(np.asarray(ids[:seq_len], dtype=np.int64))
    labels = input_ids.clone()
    if mask is not None:
        labels[torch.from_numpy(np.asarray(mask[:seq_len]) == 0)] = IGNORE_INDEX
    return {"input_ids": input_ids, "labels": labels}


@dataclass
class DataStats:
    """What a dataset read, skipped and truncated (nothing is dropped without being counted here).
    """
    n_samples: int = 0  # samples (rows) the dataset serves
    n_skipped: int = 0  # input lines skipped with on_error="skip"
    n_blank: int = 0  # blank input lines (hold no sample)
    n_truncated: int = 0  # documents longer than seq_len, cut to seq_len (long_docs="truncate")
    truncated_tokens: int = 0  # tokens cut off by truncation
    n_tokens: int = 0  # tokens served, after truncation (chunk overlaps counted in each row)
    n_documents: int = 0  # documents (input records) behind the samples
    n_chunked: int = 0  # documents longer than seq_len split into several rows (long_docs="chunk")
    n_trained_tokens: int | None = None  # SFT: tokens with a label (after truncation)
    n_no_target: int = 0  # SFT: samples whose assistant tokens were all cut off by truncation
    no_target_examples: list[int] = field(default_factory=list)  # the first 5 of them (indices)
    # SFT: calls to a tool the system turn does not declare (kept, trained)
    n_undeclared_tool_calls: int = 0
    n_late_system_turns: int = 0  # SFT: conversations with a later system turn (kept: MiniMind-3's)
    skipped_examples: list[str] = field(default_factory=list)

    def summary(self) -> str:
        """One line for logs and notebooks."""
        if self.n_chunked:
            s = (
                f"{self.n_samples} samples from {self.n_documents} documents ({self.n_chunked} "
                "long ones split "
                f"into rows, no token cut), {self.n_tokens} tokens; skipped {self.n_skipped} lines"
            )
        else:
            s = (f"{self.n_samples} samples, {self.n_tokens} tokens; truncated {self.n_truncated} "
                 "samples "
                 f"({self.truncated_tokens} tokens cut); skipped {self.n_skipped} lines")
        if self.n_trained_tokens is not None:
            s += (f"; {self.n_trained_tokens} trained tokens; {self.n_no_target} samples left with "
                  "nothing to train")
        return s

    def to_dict(self) -> dict:
        """The stats as a JSON-ready dict."""
        return asdict(self)


class _TokenDataset(Dataset):
    """Documents as flat token ids + offsets (+ the SFT mask) from a jsonl file or a memmap, cut
    into rows: a longer document is truncated ("truncate", MiniMind's way, counted; a pretraining
    text keeps its eos) or, pretraining only, chunked ("chunk", runs' default) into rows of seq_len
    tokens overlapping by one: each target is trained once."""
    def __init__(self, source, tokenizer, seq_len: int, *, on_error: str = "raise",
                 max_samples: int | None = None,
                 vocab_size: int | None = None, lazy: bool = False, long_docs: str = "truncate"):
        if int(seq_len) < 2:
            raise ValueError(f"seq_len={seq_len} is too short: a sample needs at least 2 tokens "
                             "(one prediction)")
        check_choice("long_docs", long_docs, LONG_DOCS)
        if long_docs == "chunk" and self.kind != "pretrain":
            raise ValueError(f"long_docs='chunk' is for pretraining text; a {self.kind} sample is "
                             "one conversation "
                             f"and is truncated, never split")
        self.seq_len, self.long_docs, self.tokenizer, self.lazy = (
            int(seq_len),
            long_docs,
            tokenizer,
            lazy,
        )
        self._rows = self._tokens = self._mask = self._pid = self.prefix = None
        # a memmap's ids are checked against it too
        if vocab_size is not None and tokenizer is not None:
            check_vocab(tokenizer, vocab_size)
        # same memmap
        source = source.prefix if isinstance(source, _TokenDataset) and source.prefix else source
        if (
            isinstance(source, (str, os.PathLike))
            and Path(f"{source}.json").is_file()
            and not str(source).endswith(".jsonl")
        ):
            self._open_memmap(str(source), tokenizer, vocab_size)
        else:
            self._read_jsonl(Path(source), tokenizer, on_error, max_samples)

    def _open_memmap(self, prefix: str, tokenizer, vocab_size: int | None) -> None:
        self.prefix, self.meta = prefix, read_memmap_meta(prefix)
        if self.meta["kind"] != self.kind:
            raise ValueError(f"{prefix}: memmap holds {self.meta['kind']!r} samples, not "
                             f"{self.kind!r}")
        if tokenizer is not None and self.meta["tokenizer"]["fingerprint"] != tokenizer_fingerprint(
            tokenizer
        ):
            raise ValueError(f"{prefix}: memmap was tokenized with another tokenizer; rebuild it "
                             "with tokenize_to_memmap")
        if vocab_size is not None and self.meta["max_token_id"] >= vocab_size:
            raise ValueError(f"{prefix}: holds token id {self.meta['max_token_id']} >= model "
                             f"vocab_size={vocab_size}")
        # small (8 bytes per sample): read once; tokens stay on disk
        self.offsets = np.load(prefix + ".idx.npy")
        if len(self.offsets) != self.meta["n_samples"] + 1:
            raise ValueError(f"{prefix}.idx.npy has {len(self.offsets)} offsets, meta says "
                             f"{self.meta['n_samples']} samples")
        counted = ("n_skipped", "n_blank", "n_undeclared_tool_calls", "n_late_system_turns")
        self.read_counts = {k: self.meta.get(k, 0) for k in counted}
        self.read_counts["skipped_examples"] = self.meta["skipped_examples"]

    def _read_jsonl(self, path: Path, tokenizer, on_error: str, max_samples: int | None) -> None:
        if tokenizer is None:
            raise ValueError("a tokenizer is needed to read a jsonl file")
        if not path.is_file():
            raise FileNotFoundError(f"{path} is neither a jsonl file nor a memmap prefix "
                                    f"(no {path}.json); build a memmap with tokenize_to_memmap")
        reader, self.path = JsonlReader(path, on_error=on_error, kind=self.kind,
                                        max_samples=max_samples), path
        key = PAYLOAD.get(self.kind)  # dpo: the whole record
        self.records = [record if key is None else record[key] for record in reader]
        self.offsets = None
        # small files: tokenized at once, in memory (lazy: in __getitem__, MiniMind's way)
        if not self.lazy:
            self._tokens, lengths, self._mask = tokenize_samples(self.kind, self.records, tokenizer)
            self.offsets, self.records = np.concatenate([[0], np.cumsum(lengths)]), None
        self.read_counts = reader.counts()

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_tokens": None, "_mask": None,
                "_pid": None} if self.prefix else self.__dict__

    def n_documents(self) -> int:
        """How many documents (records) the dataset holds."""
        if self.lazy:
            return len(self.records)
        return len(self.offsets) - 1

    def raw(self, index: int) -> tuple[np.ndarray, np.ndarray | None]:
        """The untruncated token ids of document `index` and its trained-token mask (None: all
        trained)."""
        if self.lazy:
            ids, _, mask = tokenize_samples(self.kind, [self.records[index]], self.tokenizer)
            return ids, mask
        # each process maps the files itself
        if self.prefix and (self._tokens is None or self._pid != os.getpid()):
            def mapped(ext: str, dtype) -> np.ndarray:  # np.memmap refuses an empty file
                if self.meta["n_tokens"]:
                    return np.memmap(self.prefix + ext, dtype=dtype, mode="r")
                return np.zeros(0, dtype)
            self._tokens, self._pid = mapped(".bin", np.uint16), os.getpid()
            if self.kind != "pretrain":
                self._mask = mapped(".mask.bin", np.uint8)
            else:
                self._mask = None
        a, b = int(self.offsets[index]), int(self.offsets[index + 1])
        return self._tokens[a:b], (self._mask[a:b] if self._mask is not None else None)

    def raw_lengths(self) -> np.ndarray:
        """Untruncated length of every document (int64); a lazy dataset tokenizes everything once
        for it."""
        if self.offsets is None:
            self.offsets = np.cumsum([0] + [len(self.raw(i)[0]) for i in range(len(self.records))])
        return np.diff(self.offsets).astype(np.int64)

    def _row_index(self) -> np.ndarray:
        """Chunk mode: (document, start) of every row; rows start every seq_len - 1 tokens (one
        token overlap)."""
        if self._rows is None:
            raw, stride = self.raw_lengths(), self.seq_len - 1
            # a row of n tokens trains n - 1 targets, so a document of L tokens needs ceil((L - 1) /
            # stride) rows
            n_rows = np.maximum(1, -(-(raw - 1) // stride)).astype(np.int64)
            k = np.arange(int(n_rows.sum()),
                          dtype=np.int64) - np.repeat(np.cumsum(n_rows) - n_rows, n_rows)
            self._rows = np.stack([np.repeat(np.arange(len(raw), dtype=np.int64), n_rows),
                                   k * stride], axis=1)
        return self._rows

    def __len__(self) -> int:
        if self.long_docs == "chunk":
            return len(self._row_index())
        return self.n_documents()

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if index < 0:
            index = index + len(self)
        else:
            index = index
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} out of range for a dataset of {len(self)} samples")
        if self.long_docs == "chunk":
            doc, start = (int(v) for v in self._row_index()[index])
            return make_sample(self.raw(doc)[0][start:start + self.seq_len], None, self.seq_len)
        ids, mask = self.raw(index)
        # MiniMind's cut: bos + text[:seq_len - 2] + eos
        if self.kind == "pretrain" and len(ids) > self.seq_len:
            ids = np.concatenate([ids[:self.seq_len - 1], ids[-1:]])
        return make_sample(ids, mask, self.seq_len)

    @functools.cached_property
    def lengths(self) -> np.ndarray:
        """Per-sample token lengths after truncation or chunking (what token-budget batching needs).
        """
        raw, rows = self.raw_lengths(), None
        if self.long_docs == "chunk":
            rows = self._row_index()
        return np.minimum(raw if rows is None else raw[rows[:, 0]] - rows[:, 1], self.seq_len)

    @functools.cached_property
    def stats(self) -> DataStats:
        """Counts of documents, samples, skipped lines, truncated or chunked documents and tokens.
        """
        raw, chunk = self.raw_lengths(), self.long_docs == "chunk"
        over = raw > self.seq_len
        if chunk:
            n_tokens = int(self.lengths.sum())
        else:
            n_tokens = int(np.minimum(raw, self.seq_len).sum())
        n_over, over_tokens = int(over.sum()), int((raw[over] - self.seq_len).sum())
        stats = DataStats(n_samples=len(self), n_documents=len(raw), n_tokens=n_tokens,
                          n_truncated=0 if chunk else n_over, n_chunked=n_over if chunk else 0,
                          truncated_tokens=0 if chunk else over_tokens, **self.read_counts)
        if self.kind != "pretrain":
            stats.n_trained_tokens = int(self.trained_counts.sum())
            stats.n_no_target = int((self.trained_counts == 0).sum())
            stats.no_target_examples = np.flatnonzero(self.trained_counts == 0)[:5].tolist()
        return stats

    @functools.cached_property
    def trained_counts(self) -> np.ndarray | None:
        """SFT: each sample's trained tokens after truncation (position 0 is never a target after
        the shift); None for pretraining text, all trained."""
        if self.kind == "pretrain":
            return None
        masks = (self.raw(i)[1][1:self.seq_len] for i in range(self.n_documents()))
        return np.fromiter((np.count_nonzero(m) for m in masks), np.int64, self.n_documents())


class PretrainDataset(_TokenDataset):
    """MiniMind pretrain samples: [bos] + tokens + [eos], labels = input_ids. `source`: a jsonl path
    (tokenized at once; lazy=True: in __getitem__, like MiniMind), a memmap prefix or a
    memmap-backed dataset (at this seq_len)."""
    kind = "pretrain"


class SFTDataset(_TokenDataset):
    """MiniMind SFT samples: the chat template's ids; labels = ids on assistant replies +
    <|im_end|>\\n, else -100."""
    kind = "sft"


class PairDataset(_TokenDataset):
    """MiniMind's preference pairs (notebook 10_lora_dpo): sample i is pair i, its chosen
    conversation as an SFT sample with the rejected one's beside it (rejected_ids, rejected_labels);
    a pair's length is its longer side's."""
    kind = "dpo"

    def __len__(self) -> int:
        return self.n_documents() // 2

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} pairs")
        chosen = make_sample(*self.raw(2 * index), self.seq_len)
        rejected = make_sample(*self.raw(2 * index + 1), self.seq_len)
        return dict(chosen, rejected_ids=rejected["input_ids"], rejected_labels=rejected["labels"])

    def check_replies(self, where: Any) -> None:
        """ValueError naming the first pair with a reply cut away entirely at seq_len."""
        cut = self.stats.no_target_examples
        if cut:
            side = ("chosen", "rejected")[cut[0] % 2]
            raise ValueError(f"{where}: pair {cut[0] // 2 + 1} (counting from 1): its {side} reply "
                             f"lies beyond seq_len={self.seq_len}, so none of it would be scored "
                             f"({self.stats.n_no_target} such replies in all): raise --seq-len or "
                             f"remove those pairs")

    @functools.cached_property
    def lengths(self) -> np.ndarray:
        """Each pair's longer side, cut to seq_len (what token-budget batching counts)."""
        return np.minimum(self.raw_lengths().reshape(-1, 2).max(1), self.seq_len)


class MemmapDataset(_TokenDataset):
    """The samples of `tokenize_to_memmap` files, of either kind, without a tokenizer: np.memmap,
    mapped per process."""
    def __init__(self, prefix: str | os.PathLike, seq_len: int, long_docs: str = "truncate"):
        self.kind = read_memmap_meta(str(prefix))["kind"]
        super().__init__(str(prefix), None, seq_len, long_docs=long_docs)


def pad_collate(samples: Sequence[dict], pad_id: int = 0, seq_len: int | None = None,
                fixed: bool = False, multiple: int = 1) -> dict[str, torch.Tensor]:
    """(B, T) input_ids, labels (-100 on pads) and attention_mask of samples cut to seq_len, each
    row padded to seq_len (fixed=True, MiniMind's way) or to the longest row of the batch (dynamic
    padding), rounded up to a multiple of `multiple` (a compiled model then sees a few row lengths,
    not one per batch)."""
    if not samples:
        raise ValueError("pad_collate got an empty list of samples")
    if fixed and seq_len is None:
        raise ValueError("pad_collate(fixed=True) needs seq_len")
    rows = [(s["input_ids"][:seq_len], s.get("labels", s["input_ids"])[:seq_len]) for s in samples]
    if fixed:
        length = seq_len
    else:
        length = round_up(max(len(ids) for ids, _ in rows), multiple, seq_len)
    input_ids = torch.full((len(rows), length), int(pad_id), dtype=torch.long)
    labels = torch.full((len(rows), length), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), length), dtype=torch.long)
    for r, (ids, lab) in enumerate(rows):
        input_ids[r, :len(ids)], labels[r, :len(ids)] = torch.as_tensor(ids), torch.as_tensor(lab)
        attention_mask[r, :len(ids)] = 1
    return {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}


def pair_collate(samples: Sequence[dict], pad_id: int = 0,
                 multiple: int = 1) -> dict[str, torch.Tensor]:
    """A batch of preference pairs (PairDataset's): the chosen rows, then the rejected rows
    (MiniMind's layout)."""
    rejected = [{"input_ids": s["rejected_ids"], "labels": s["rejected_labels"]} for s in samples]
    return pad_collate([*samples, *rejected], pad_id=pad_id, multiple=multiple)


def round_up(length: int, multiple: int, limit: int | None = None) -> int:
    """`length` rounded up to a multiple of `multiple`, at most `limit` (when given, and not below
    length)."""
    rounded = -(-length // multiple) * multiple
    if limit is None:
        return rounded
    return max(length, min(rounded, limit))


def padding_fraction(batch_lengths: Iterable[Sequence[int]], seq_len: int | None = None) -> float:
    """Share of padding in batches of sample lengths, each padded to seq_len (if given) or to its
    longest row."""
    batch_lengths = [list(b) for b in batch_lengths if len(b)]
    real = sum(sum(b) for b in batch_lengths)
    padded = 0
    for b in batch_lengths:
        padded += len(b) * (seq_len or max(b))
    return 1.0 - real / padded if padded else 0.0


def trained_tokens(labels: torch.Tensor) -> int:
    """Trained (predicted) tokens of a (B, T) label tensor: the shifted labels that are not
    IGNORE_INDEX."""
    return int((labels[:, 1:] != IGNORE_INDEX).sum())


def memmap_dataset(path: Path, tok: Any, kind: str, seq_len: int, cache_dir: Path,
                   max_samples: int | None = None,
                   progress: bool = False, on_error: str = "raise"):
    """(dataset, MemmapInfo): `path` tokenized once into the memmap cache (reused while file and
    tokenizer agree)."""
    digest = hashlib.sha1(str(Path(path).resolve()).encode()).hexdigest()[:8]
    # a hash of the path: two data.jsonl never collide
    prefix = Path(cache_dir) / f"{Path(path).stem}.{kind}.{digest}"
    info = tokenize_to_memmap(path, tok, prefix, kind=kind, max_samples=max_samples,
                              progress=progress, on_error=on_error)
    cls = {"pretrain": PretrainDataset, "sft": SFTDataset, "dpo": PairDataset}[kind]
    ds = cls(str(prefix), tok, seq_len, vocab_size=tok.vocab_size,
             long_docs=LONG_DOCS_BY_KIND[kind])
    if len(ds) == 0 or ds.stats.n_trained_tokens == 0:
        what = "trained (assistant) tokens within seq_len"
        if len(ds) == 0:
            what = "samples"
        raise ValueError(f"{path}: no {what} to train on")
    return ds, info


def holdout_indices(n: int, seed: int,
                    trains: Sequence[bool] | None = None) -> tuple[list[int], list[int]]:
    """(train, held out) indices of n samples, each sorted: a fixed 5% drawn by seed (SFT's
    validation set) among the samples that train something (trains[i]; None: all do)."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    held = [i for i in order if trains is None or trains[i]][:max(1, n // 20)]
    return sorted(set(order) - set(held)), sorted(held)


def holdout_split(ds: Any, seed: int) -> tuple[Subset, Subset]:
    """(train, held out): holdout_indices of a dataset, as Subsets with their lengths and stats."""
    trains = None if ds.trained_counts is None else ds.trained_counts > 0
    parts = tuple(Subset(ds, part) for part in holdout_indices(len(ds), seed, trains))
    for part in parts:
        part.lengths, part.stats = ds.lengths[part.indices], ds.stats
    return parts
