"""The data pipeline: MiniMind's jsonl files -> validated records -> token ids + labels -> padded batches.

Three layers, each usable on its own:

1. ``read_jsonl`` streams and validates MiniMind's two formats
   (pretrain ``{"text": ...}``, SFT ``{"conversations": [{"role", "content"}, ...]}``),
   with errors that name the file and the 1-based line.
2. ``PretrainDataset`` / ``SFTDataset`` turn records into ``{"input_ids", "labels"}`` (1-D LongTensors,
   labels aligned with input_ids, -100 where nothing is trained). They are backed by memory (small files),
   by lazy tokenization in ``__getitem__`` (MiniMind's way) or by a ``MemmapDataset``, which
   ``tokenize_to_memmap`` writes once for files larger than RAM.
3. Collators pad a list of samples into ``(B, T)`` tensors: ``pad_to_max_length`` (MiniMind's way)
   and ``pad_to_longest`` (dynamic padding). ``dataset.lengths`` is what token-budget samplers and
   packing (minimind_lib.batching) build on.

Nothing is dropped silently: skipped lines and truncated samples are counted in ``dataset.stats``.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import hashlib
import itertools
import json
import os
import time
import warnings
from array import array
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

from .fileio import atomic_write_bytes
from .tokenizer import ROLES, check_vocab  # the chat roles; refuses a tokenizer/model vocab mismatch

IGNORE_INDEX = -100  # the label of a position whose next token is not trained (PyTorch CE ignore_index)
KINDS = ("pretrain", "sft")
ON_ERROR = ("raise", "skip")
LONG_DOCS = ("truncate", "chunk")  # what a pretrain dataset does with a document longer than seq_len
MEMMAP_FORMAT_VERSION = 1
MAX_UINT16_VOCAB = 65535  # uint16 stores ids 0..65535, so a vocab of at most 65536 entries; we keep one margin id
_MAX_EXAMPLES = 5  # how many skipped-line messages to keep for reports


class DataFormatError(ValueError):
    """A jsonl line that is not valid JSON or does not match the expected schema (message names file:line)."""


# ----------------------------------------------------------------------------------------------------------
# 1. Reading and validating jsonl
# ----------------------------------------------------------------------------------------------------------


def _check_choice(name: str, value: str, choices: Sequence[str]) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not valid; choose one of {list(choices)}")


def _check_unicode(text: str, key: str) -> None:
    # JSON may spell lone surrogates ("\\ud800"), which have no UTF-8 bytes and so no tokens
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"key {key!r} holds a lone surrogate {text[e.start]!r} at index {e.start} (not valid Unicode)") from None


def validate_record(record: Any, kind: str) -> None:
    """Raise ValueError (message naming the key and value) unless `record` is a valid `kind` sample."""
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    if kind == "pretrain":
        if "text" not in record:
            raise ValueError(f"missing key 'text' (pretrain lines look like {{\"text\": \"...\"}}); keys: {sorted(record)}")
        text = record["text"]
        if not isinstance(text, str):
            raise ValueError(f"key 'text' must be a string, got {type(text).__name__}")
        if not text.strip():
            raise ValueError(f"key 'text' is empty ({text!r})")
        _check_unicode(text, "text")
        return
    if kind == "sft":
        if "conversations" not in record:
            raise ValueError(
                "missing key 'conversations' (SFT lines look like "
                "{\"conversations\": [{\"role\": \"user\", \"content\": \"...\"}, ...]}); "
                f"keys: {sorted(record)}"
            )
        conv = record["conversations"]
        if not isinstance(conv, list) or not conv:
            raise ValueError(f"key 'conversations' must be a non-empty list, got {conv!r:.80}")
        has_assistant = False
        for t, turn in enumerate(conv):
            if not isinstance(turn, dict):
                raise ValueError(f"conversations[{t}] must be an object, got {turn!r:.80}")
            for key in ("role", "content"):
                if key not in turn:
                    raise ValueError(f"conversations[{t}] is missing key {key!r}; keys: {sorted(turn)}")
            role, content = turn["role"], turn["content"]
            if role not in ROLES:
                raise ValueError(f"conversations[{t}]['role'] = {role!r} is not one of {list(ROLES)}")
            if not isinstance(content, str):
                raise ValueError(f"conversations[{t}]['content'] must be a string, got {type(content).__name__}")
            if role == "system" and t != 0:
                raise ValueError(f"conversations[{t}] is a 'system' turn; only the first turn may be one")
            _check_unicode(content, f"conversations[{t}]['content']")
            if role == "assistant":
                if not content.strip():
                    raise ValueError(f"conversations[{t}]['content'] is empty: an assistant turn with nothing to train on")
                has_assistant = True
        if not has_assistant:
            raise ValueError("conversations has no 'assistant' turn, so nothing would be trained")
        return
    _check_choice("kind", kind, KINDS)


def _parse_line(raw: bytes | str, kind: str | None) -> Any:
    """Parse one jsonl line and validate it; raises ValueError with a message that lacks only the location."""
    if isinstance(raw, bytes):
        raw = raw.rstrip(b"\r\n")  # so an error's column is on this line, not "column 1" of the next
    try:
        record = json.loads(raw)
    except UnicodeDecodeError as e:
        raise ValueError(f"not valid UTF-8 ({e.reason} at byte {e.start})") from None
    except json.JSONDecodeError as e:
        shown = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
        raise ValueError(f"malformed JSON ({e.msg} at column {e.colno}): {shown.strip()[:80]!r}") from None
    if kind is not None:
        validate_record(record, kind)
    return record


class JsonlReader:
    """An iterable over the records of a jsonl file, counting what it skipped (see `read_jsonl`)."""

    def __init__(self, path: str | os.PathLike, on_error: str = "raise", kind: str | None = None,
                 max_samples: int | None = None, warn: bool = True):
        _check_choice("on_error", on_error, ON_ERROR)
        if kind is not None:
            _check_choice("kind", kind, KINDS)
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"jsonl file not found: {self.path}")
        self.on_error, self.kind, self.max_samples, self.warn = on_error, kind, max_samples, warn
        self.n_lines = 0  # lines read (including blank and skipped ones)
        self.n_records = 0  # records yielded
        self.n_blank = 0  # whitespace-only lines (ignored: they hold no sample)
        self.n_skipped = 0  # malformed or invalid lines skipped with on_error="skip"
        self.skipped_examples: list[str] = []  # the first few "file:line: reason" messages

    def __iter__(self) -> Iterator[Any]:
        with open(self.path, "rb") as f:
            for lineno, raw in enumerate(f, start=1):
                if self.max_samples is not None and self.n_records >= self.max_samples:
                    break
                self.n_lines = lineno
                if not raw.strip():
                    self.n_blank += 1
                    continue
                try:
                    record = _parse_line(raw, self.kind)
                except ValueError as e:
                    message = f"{self.path}:{lineno}: {e}"
                    if self.on_error == "raise":
                        raise DataFormatError(message + "  (pass on_error='skip' to skip and count such lines)") from None
                    self.n_skipped += 1
                    if len(self.skipped_examples) < _MAX_EXAMPLES:
                        self.skipped_examples.append(message)
                    continue
                self.n_records += 1
                yield record
        if self.n_skipped and self.warn:
            warnings.warn(self.report(), stacklevel=2)

    def report(self) -> str:
        """One line saying what was read and skipped."""
        s = f"{self.path}: read {self.n_records} records from {self.n_lines} lines, skipped {self.n_skipped}"
        if self.skipped_examples:
            s += f" (first: {self.skipped_examples[0]})"
        return s


def read_jsonl(path: str | os.PathLike, on_error: str = "raise", kind: str | None = None,
               max_samples: int | None = None) -> JsonlReader:
    """Iterate the records of a jsonl file; on_error='raise' stops at the first bad line (file:line in the message),
    'skip' skips and counts them (reader.n_skipped, reader.skipped_examples, and a warning at the end).
    With kind='pretrain'|'sft' each record is also validated against MiniMind's schema."""
    return JsonlReader(path, on_error=on_error, kind=kind, max_samples=max_samples)


# ----------------------------------------------------------------------------------------------------------
# 2. Tokenizing one sample
# ----------------------------------------------------------------------------------------------------------


def _encode_batch(tokenizer, texts: list[str]) -> list[list[int]]:
    """Token ids of each text, without special tokens; uses the tokenizer's (Rust-parallel) batch encoder if any."""
    if hasattr(tokenizer, "encode_batch"):
        return [list(x) for x in tokenizer.encode_batch(texts)]
    return [tokenizer.encode(t, add_special_tokens=False) for t in texts]


def encode_pretrain(tokenizer, text: str) -> np.ndarray:
    """A pretrain sample, MiniMind style: [bos] + tokens(text) + [eos], untruncated, as int64."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    return np.asarray([tokenizer.bos_token_id, *ids, tokenizer.eos_token_id], dtype=np.int64)


@functools.lru_cache(maxsize=8)
def _assistant_header(tokenizer) -> tuple[int, ...]:
    # the ids of "assistant\n" as they usually appear after <|im_start|>; a fast path for assistant_mask
    return tuple(tokenizer.encode("assistant\n", add_special_tokens=False))


def assistant_mask(tokenizer, ids: Sequence[int]) -> np.ndarray:
    """uint8 mask over a chat-template token sequence: 1 on every assistant turn's content and its <|im_end|>.

    The header ``<|im_start|>assistant\\n`` and the ``\\n`` after ``<|im_end|>`` are not trained (MiniMind's
    ``generate_labels`` does train that ``\\n``; it is never generated because generation stops at <|im_end|>).
    Special tokens are atomic, so we anchor on them and decode only the few role tokens after <|im_start|>."""
    ids = [int(i) for i in ids]
    n, bos, eos = len(ids), tokenizer.bos_token_id, tokenizer.eos_token_id
    mask = np.zeros(n, dtype=np.uint8)
    header = _assistant_header(tokenizer)
    i = 0
    while i < n:
        if ids[i] != bos:
            i += 1
            continue
        if tuple(ids[i + 1:i + 1 + len(header)]) == header:
            role, start = "assistant", i + 1 + len(header)
        else:  # slow path: decode the header token by token until its "\n"
            j, text = i + 1, ""
            while j < n and "\n" not in text and ids[j] not in (bos, eos):
                j += 1
                text = tokenizer.decode(ids[i + 1:j])
            role = text.split("\n", 1)[0]
            # if the last header token also carries content (e.g. "\n\n" merged), that token is trained
            start = j if text.endswith("\n") and text.count("\n") == 1 else j - 1
        end = start
        while end < n and ids[end] not in (bos, eos):
            end += 1
        if role == "assistant":
            mask[start:min(end + 1, n)] = 1  # content + <|im_end|> (end is its index when present)
        i = end if end < n and ids[end] == bos else end + 1
    return mask


def encode_sft(tokenizer, conversations: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    """An SFT sample: the chat template's token ids (int64) and its assistant mask (uint8), untruncated."""
    messages = [{"role": t["role"], "content": t["content"]} for t in conversations]
    # tokenize=True: the template's structure comes from ids, so "<|im_end|>" typed inside content stays text
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=True)
    if isinstance(ids, str):  # a tokenizer whose template only renders text
        ids = tokenizer.encode(ids, add_special_tokens=False)
    ids = np.asarray(ids, dtype=np.int64)
    return ids, assistant_mask(tokenizer, ids)


def make_sample(ids: np.ndarray, mask: np.ndarray | None, seq_len: int) -> dict[str, torch.Tensor]:
    """{"input_ids", "labels"} from raw ids (+ optional trained-token mask), truncated to seq_len."""
    ids = np.asarray(ids[:seq_len], dtype=np.int64)
    input_ids = torch.from_numpy(ids)
    labels = input_ids.clone()
    if mask is not None:
        labels[torch.from_numpy(np.asarray(mask[:seq_len]) == 0)] = IGNORE_INDEX
    return {"input_ids": input_ids, "labels": labels}


# ----------------------------------------------------------------------------------------------------------
# 3. Datasets
# ----------------------------------------------------------------------------------------------------------


@dataclass
class DataStats:
    """What a dataset read, skipped and truncated (nothing is dropped without being counted here)."""

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
    skipped_examples: list[str] = field(default_factory=list)

    def summary(self) -> str:
        """One line for logs and notebooks."""
        if self.n_chunked:
            s = (f"{self.n_samples} samples from {self.n_documents} documents ({self.n_chunked} long ones split "
                 f"into rows, no token cut), {self.n_tokens} tokens; skipped {self.n_skipped} lines")
        else:
            s = (f"{self.n_samples} samples, {self.n_tokens} tokens; truncated {self.n_truncated} samples "
                 f"({self.truncated_tokens} tokens cut); skipped {self.n_skipped} lines")
        if self.n_trained_tokens is not None:
            s += f"; {self.n_trained_tokens} trained tokens; {self.n_no_target} samples left with nothing to train"
        return s

    def to_dict(self) -> dict:
        """The stats as a JSON-ready dict."""
        return asdict(self)


class _TokenDataset(Dataset):
    """Shared logic: raw (untruncated) documents come from a backend; cutting into rows, labels and stats happen here.

    A document longer than seq_len is either truncated (``long_docs="truncate"``, MiniMind's way: the rest is
    lost, and counted) or chunked (``"chunk"``, pretraining only): split into rows of seq_len tokens that
    overlap by one token, so every next-token target of the document is trained exactly once.
    """

    kind: str = "pretrain"

    def __init__(self, seq_len: int, long_docs: str = "truncate"):
        if int(seq_len) < 2:
            raise ValueError(f"seq_len={seq_len} is too short: a sample needs at least 2 tokens (one prediction)")
        self.seq_len = int(seq_len)
        self._lengths: np.ndarray | None = None
        self._stats: DataStats | None = None
        self._rows: np.ndarray | None = None  # chunk mode: (n_rows, 2) of (document, start token)
        self._set_long_docs(long_docs)

    def _set_long_docs(self, long_docs: str) -> None:
        _check_choice("long_docs", long_docs, LONG_DOCS)
        if long_docs == "chunk" and self.kind != "pretrain":
            raise ValueError(f"long_docs='chunk' is for pretraining text; a {self.kind} sample is one conversation "
                             f"and is truncated, never split")
        self.long_docs = long_docs

    # backends implement these three
    def n_documents(self) -> int:
        """How many documents (records) the backend holds."""
        raise NotImplementedError

    def raw(self, index: int) -> tuple[np.ndarray, np.ndarray | None]:
        """The untruncated token ids of document `index` and its trained-token mask (None: all trained)."""
        raise NotImplementedError

    def raw_lengths(self) -> np.ndarray:
        """Untruncated length of every document (int64)."""
        raise NotImplementedError

    def _row_index(self) -> np.ndarray:
        """Chunk mode: (document, start) of every row; rows start every seq_len - 1 tokens (one token overlap)."""
        if self._rows is None:
            raw = self.raw_lengths()
            stride = self.seq_len - 1
            # a row of n tokens trains n - 1 targets, so a document of L tokens needs ceil((L - 1) / stride) rows
            n_rows = np.maximum(1, -(-(raw - 1) // stride)).astype(np.int64)
            docs = np.repeat(np.arange(len(raw), dtype=np.int64), n_rows)
            first_row = np.cumsum(n_rows) - n_rows
            k = np.arange(int(n_rows.sum()), dtype=np.int64) - np.repeat(first_row, n_rows)
            self._rows = np.stack([docs, k * stride], axis=1)
        return self._rows

    def __len__(self) -> int:
        return len(self._row_index()) if self.long_docs == "chunk" else self.n_documents()

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} out of range for a dataset of {len(self)} samples")
        if self.long_docs == "chunk":
            doc, start = (int(v) for v in self._row_index()[index])
            ids, _ = self.raw(doc)
            return make_sample(ids[start:start + self.seq_len], None, self.seq_len)
        ids, mask = self.raw(index)
        return make_sample(ids, mask, self.seq_len)

    @property
    def lengths(self) -> np.ndarray:
        """Per-sample token lengths after truncation or chunking (what token-budget batching needs)."""
        if self._lengths is None:
            raw = self.raw_lengths()
            if self.long_docs == "chunk":
                rows = self._row_index()
                self._lengths = np.minimum(raw[rows[:, 0]] - rows[:, 1], self.seq_len).astype(np.int64)
            else:
                self._lengths = np.minimum(raw, self.seq_len).astype(np.int64)
        return self._lengths

    def _extra_stats(self, stats: DataStats) -> None:
        """Fill reader counts and SFT counts (backends override)."""

    @property
    def stats(self) -> DataStats:
        """Counts of documents, samples, skipped lines, truncated or chunked documents and tokens."""
        if self._stats is None:
            raw = self.raw_lengths()
            over = raw > self.seq_len
            chunk = self.long_docs == "chunk"
            self._stats = DataStats(
                n_samples=len(self), n_documents=int(len(raw)), n_tokens=int(self.lengths.sum()),
                n_truncated=0 if chunk else int(over.sum()),
                truncated_tokens=0 if chunk else int((raw[over] - self.seq_len).sum()),
                n_chunked=int(over.sum()) if chunk else 0,
            )
            self._extra_stats(self._stats)
        return self._stats

    def _sft_counts(self, stats: DataStats) -> None:
        # trained tokens after truncation (labels that survive the cut); a pass over the masks, done once
        trained, no_target = 0, 0
        for i in range(self.n_documents()):
            _, mask = self.raw(i)
            k = int(np.count_nonzero(mask[:self.seq_len][1:]))  # position 0 is never a target after the shift
            trained += k
            no_target += k == 0
        stats.n_trained_tokens, stats.n_no_target = trained, no_target


class MemmapDataset(_TokenDataset):
    """Samples read from `tokenize_to_memmap` files with np.memmap: constant memory, opened lazily per process."""

    def __init__(self, prefix: str | os.PathLike, seq_len: int, long_docs: str = "truncate"):
        super().__init__(seq_len)
        self.prefix = str(prefix)
        meta_path = Path(self.prefix + ".json")
        if not meta_path.is_file():
            raise FileNotFoundError(f"memmap metadata not found: {meta_path} (build it with tokenize_to_memmap)")
        self.meta = json.loads(meta_path.read_text())
        if self.meta.get("format") != "minimind-memmap" or self.meta.get("version") != MEMMAP_FORMAT_VERSION:
            raise ValueError(f"{meta_path}: not a minimind memmap of version {MEMMAP_FORMAT_VERSION}; rebuild it")
        self.kind = self.meta["kind"]
        self._set_long_docs(long_docs)
        # the index is small (8 bytes per sample); read it once, the tokens stay on disk
        self.offsets = np.load(self.prefix + ".idx.npy")
        if len(self.offsets) != self.meta["n_samples"] + 1:
            raise ValueError(f"{self.prefix}.idx.npy has {len(self.offsets)} offsets, meta says {self.meta['n_samples']} samples")
        self._tokens: np.memmap | None = None
        self._mask: np.memmap | None = None
        self._pid: int | None = None

    def _open(self) -> None:
        # opened on first use in each process, so DataLoader workers get their own handles
        self._tokens = np.memmap(self.prefix + ".bin", dtype=np.uint16, mode="r") if self.meta["n_tokens"] else np.zeros(0, np.uint16)
        if self.kind == "sft":
            self._mask = np.memmap(self.prefix + ".mask.bin", dtype=np.uint8, mode="r") if self.meta["n_tokens"] else np.zeros(0, np.uint8)
        self._pid = os.getpid()

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_tokens"] = state["_mask"] = state["_pid"] = None  # never pickle a mapping; reopen in the worker
        return state

    def n_documents(self) -> int:
        return len(self.offsets) - 1

    def raw(self, index: int) -> tuple[np.ndarray, np.ndarray | None]:
        if self._tokens is None or self._pid != os.getpid():
            self._open()
        a, b = int(self.offsets[index]), int(self.offsets[index + 1])
        return self._tokens[a:b], (self._mask[a:b] if self._mask is not None else None)

    def raw_lengths(self) -> np.ndarray:
        return np.diff(self.offsets).astype(np.int64)

    def _extra_stats(self, stats: DataStats) -> None:
        stats.n_skipped = int(self.meta.get("n_skipped", 0))
        stats.n_blank = int(self.meta.get("n_blank", 0))
        stats.skipped_examples = list(self.meta.get("skipped_examples", []))
        if self.kind == "sft":
            self._sft_counts(stats)


def _is_memmap_prefix(source: Any) -> bool:
    return isinstance(source, (str, os.PathLike)) and Path(str(source) + ".json").is_file() \
        and not str(source).endswith(".jsonl")


class _JsonlBacked(_TokenDataset):
    """Common constructor for PretrainDataset and SFTDataset: memmap, eager (in memory) or lazy backends."""

    def __init__(self, source, tokenizer, seq_len: int, *, on_error: str = "raise", max_samples: int | None = None,
                 vocab_size: int | None = None, lazy: bool = False, long_docs: str = "truncate"):
        super().__init__(seq_len, long_docs)
        self.tokenizer, self.lazy = tokenizer, lazy
        if vocab_size is not None:
            if tokenizer is None:
                raise ValueError("vocab_size was given but no tokenizer to check it against")
            check_vocab(tokenizer, vocab_size)
        self.memmap: MemmapDataset | None = None
        self.reader: JsonlReader | None = None
        if isinstance(source, MemmapDataset) or _is_memmap_prefix(source):
            mm = source if isinstance(source, MemmapDataset) else MemmapDataset(source, seq_len)
            if mm.kind != self.kind:
                raise ValueError(f"{mm.prefix}: memmap holds {mm.kind!r} samples, not {self.kind!r}")
            if tokenizer is not None and mm.meta["tokenizer"]["fingerprint"] != tokenizer_fingerprint(tokenizer):
                raise ValueError(f"{mm.prefix}: memmap was tokenized with another tokenizer; rebuild it with tokenize_to_memmap")
            if vocab_size is not None and mm.meta["max_token_id"] >= vocab_size:
                raise ValueError(f"{mm.prefix}: holds token id {mm.meta['max_token_id']} >= model vocab_size={vocab_size}")
            self.memmap = mm  # only its raw samples are used: truncation to self.seq_len happens here
            return
        if tokenizer is None:
            raise ValueError("a tokenizer is needed to read a jsonl file")
        self.path = Path(source)
        if not self.path.is_file():
            raise FileNotFoundError(f"{self.path} is neither a jsonl file nor a memmap prefix "
                                    f"(no {self.path}.json); build a memmap with tokenize_to_memmap")
        self.reader = JsonlReader(self.path, on_error=on_error, kind=self.kind, max_samples=max_samples)
        self.records = [self._payload(r) for r in self.reader]  # small files only: use a memmap for big ones
        if not lazy:
            self._samples = self._encode_all(self.records)

    # kind-specific hooks
    def _payload(self, record: dict) -> Any:
        raise NotImplementedError

    def _encode_all(self, payloads: list) -> list:
        raise NotImplementedError

    def _encode_one(self, payload) -> tuple[np.ndarray, np.ndarray | None]:
        raise NotImplementedError

    def n_documents(self) -> int:
        return self.memmap.n_documents() if self.memmap is not None else len(self.records)

    def raw(self, index: int) -> tuple[np.ndarray, np.ndarray | None]:
        if self.memmap is not None:
            ids, mask = self.memmap.raw(index)
            return ids, (mask if self.kind == "sft" else None)
        if self.lazy:
            return self._encode_one(self.records[index])  # MiniMind's way: tokenize on every access
        return self._samples[index]

    def raw_lengths(self) -> np.ndarray:
        if self.memmap is not None:
            return self.memmap.raw_lengths()
        if self.lazy:  # must tokenize everything once; cached by `lengths`/`stats`
            if not hasattr(self, "_lazy_raw_lengths"):
                self._lazy_raw_lengths = np.asarray([len(self._encode_one(p)[0]) for p in self.records], np.int64)
            return self._lazy_raw_lengths
        return np.asarray([len(s[0]) for s in self._samples], dtype=np.int64)

    def _extra_stats(self, stats: DataStats) -> None:
        if self.memmap is not None:
            self.memmap._extra_stats(stats)
            return
        stats.n_skipped, stats.n_blank = self.reader.n_skipped, self.reader.n_blank
        stats.skipped_examples = list(self.reader.skipped_examples)
        if self.kind == "sft":
            self._sft_counts(stats)


class PretrainDataset(_JsonlBacked):
    """MiniMind pretrain samples: input_ids = ([bos] + tokens + [eos])[:seq_len], labels = input_ids.

    `source` is a jsonl path (tokenized once in memory; lazy=True tokenizes in __getitem__ like MiniMind),
    a memmap prefix or a MemmapDataset (for files larger than RAM). A longer document is truncated
    (``long_docs="truncate"``, MiniMind's way: a plain cut, no fake <|im_end|>, counted in `stats`) or
    chunked (``"chunk"``): rows of seq_len tokens overlapping by one, so no target is lost; only the first
    row starts with <|im_start|> and only the last ends with <|im_end|>."""

    kind = "pretrain"

    def _payload(self, record: dict) -> str:
        return record["text"]

    def _encode_one(self, text: str) -> tuple[np.ndarray, None]:
        return encode_pretrain(self.tokenizer, text), None

    def _encode_all(self, texts: list[str]) -> list:
        bos, eos = self.tokenizer.bos_token_id, self.tokenizer.eos_token_id
        out = []
        for start in range(0, len(texts), 4096):
            for ids in _encode_batch(self.tokenizer, texts[start:start + 4096]):
                out.append((np.asarray([bos, *ids, eos], dtype=np.int64), None))
        return out


class SFTDataset(_JsonlBacked):
    """MiniMind SFT samples: the chat template's ids; labels = ids on assistant content + <|im_end|>, else -100."""

    kind = "sft"

    def _payload(self, record: dict) -> list[dict]:
        return record["conversations"]

    def _encode_one(self, conversations: list[dict]) -> tuple[np.ndarray, np.ndarray]:
        return encode_sft(self.tokenizer, conversations)

    def _encode_all(self, convs: list) -> list:
        return [encode_sft(self.tokenizer, c) for c in convs]


# ----------------------------------------------------------------------------------------------------------
# 4. Tokenize once into a memmap
# ----------------------------------------------------------------------------------------------------------


@dataclass
class MemmapInfo:
    """What tokenize_to_memmap wrote (or found fresh and reused)."""

    prefix: str
    kind: str
    n_samples: int
    n_tokens: int
    n_skipped: int
    n_blank: int
    reused: bool  # True: an up-to-date cache was found and nothing was tokenized
    seconds: float
    num_workers: int
    skipped_examples: list[str] = field(default_factory=list)

    @property
    def files(self) -> list[str]:
        """The files of this memmap."""
        ext = [".bin", ".idx.npy", ".json"] + ([".mask.bin"] if self.kind == "sft" else [])
        return [self.prefix + e for e in ext]


_PROBE_TEXT = "Hello, world! 你好，世界。 The quick brown fox 123 \n\t émoji 🙂"
_PROBE_CHAT = [{"role": "system", "content": "s"}, {"role": "user", "content": "u?"}, {"role": "assistant", "content": "a."}]


def tokenizer_fingerprint(tokenizer) -> str:
    """A short hash that changes when the tokenizer (vocab, merges, special ids or chat template) changes."""
    h = hashlib.sha256()
    backend = tokenizer if hasattr(tokenizer, "to_str") else None
    for attr in ("backend", "backend_tokenizer", "_tokenizer", "tokenizer", "_tok", "hf"):
        if backend is None and hasattr(getattr(tokenizer, attr, None), "to_str"):
            backend = getattr(tokenizer, attr)
    if backend is not None:
        h.update(backend.to_str().encode())
    h.update(json.dumps([int(tokenizer.vocab_size), tokenizer.bos_token_id, tokenizer.eos_token_id,
                         tokenizer.pad_token_id, list(tokenizer.encode(_PROBE_TEXT, add_special_tokens=False))]).encode())
    try:
        h.update(tokenizer.apply_chat_template(_PROBE_CHAT, tokenize=False).encode())
    except Exception:  # a tokenizer without a chat template is fine for pretrain data
        pass
    return h.hexdigest()[:16]


# worker-process state: the tokenizer is sent once per worker (initializer), not once per chunk
_W: dict[str, Any] = {}


def _init_worker(tokenizer) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process per core already; no nested Rust threads
    torch.set_num_threads(1)
    _W["tok"] = tokenizer


def _tokenize_chunk(path: str, start_line: int, lines: list[bytes], kind: str, on_error: str, tokenizer=None) -> dict:
    """Parse, validate and tokenize a chunk of lines; errors come back as data so the parent can name file:line."""
    tok = tokenizer if tokenizer is not None else _W["tok"]
    payloads, errors, n_blank = [], [], 0
    for k, raw in enumerate(lines):
        if not raw.strip():
            n_blank += 1
            continue
        try:
            rec = _parse_line(raw, kind)
        except ValueError as e:
            errors.append(f"{path}:{start_line + k}: {e}")
            if on_error == "raise":
                break
            continue
        payloads.append(rec["text"] if kind == "pretrain" else rec["conversations"])
    if kind == "pretrain":
        bos, eos = tok.bos_token_id, tok.eos_token_id
        seqs = [[bos, *ids, eos] for ids in _encode_batch(tok, payloads)]
        masks = None
    else:
        pairs = [encode_sft(tok, c) for c in payloads]
        seqs = [p[0] for p in pairs]
        masks = np.concatenate([p[1] for p in pairs]) if pairs else np.zeros(0, np.uint8)
    lengths = np.asarray([len(s) for s in seqs], dtype=np.int64)
    flat = np.fromiter(itertools.chain.from_iterable(seqs), dtype=np.int64, count=int(lengths.sum()))
    return {"ids": flat, "lengths": lengths, "mask": masks, "errors": errors, "n_blank": n_blank}


def _line_chunks(f, chunk_size: int) -> Iterator[tuple[int, list[bytes], int]]:
    """(first line number, lines, bytes) chunks of a binary file, streaming."""
    buf, nbytes, start = [], 0, 1
    for lineno, line in enumerate(f, start=1):
        buf.append(line)
        nbytes += len(line)
        if len(buf) >= chunk_size:
            yield start, buf, nbytes
            buf, nbytes, start = [], 0, lineno + 1
    if buf:
        yield start, buf, nbytes


@contextlib.contextmanager
def _tokenizers_parallelism_off():
    # HF tokenizers warns (and disables itself) in a forked child if the parent already used its thread pool and
    # TOKENIZERS_PARALLELISM is unset; setting it while the workers fork avoids both the warning and any deadlock
    old = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = old


def _source_info(path: Path) -> dict:
    st = path.stat()
    return {"path": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _cache_key(source: dict, tokenizer, kind: str, max_samples: int | None, on_error: str) -> dict:
    return {"format": "minimind-memmap", "version": MEMMAP_FORMAT_VERSION, "kind": kind, "source": source,
            "tokenizer": {"fingerprint": tokenizer_fingerprint(tokenizer), "vocab_size": int(tokenizer.vocab_size)},
            "max_samples": max_samples, "on_error": on_error}


def memmap_is_fresh(out_prefix: str | os.PathLike, jsonl_path: str | os.PathLike, tokenizer, kind: str = "pretrain",
                    max_samples: int | None = None, on_error: str = "raise") -> tuple[bool, str]:
    """(fresh, reason): whether the memmap at out_prefix matches this source file, tokenizer and settings."""
    prefix = str(out_prefix)
    meta_path = Path(prefix + ".json")
    if not meta_path.is_file():
        return False, "no cache yet"
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        return False, f"unreadable metadata ({e})"
    want = _cache_key(_source_info(Path(jsonl_path)), tokenizer, kind, max_samples, on_error)
    for key, value in want.items():
        if meta.get(key) != value:
            return False, f"{key} changed (cache: {meta.get(key)!r:.120}, now: {value!r:.120})"
    sizes = {".bin": 2 * meta["n_tokens"], ".idx.npy": None}
    if kind == "sft":
        sizes[".mask.bin"] = meta["n_tokens"]
    for ext, size in sizes.items():
        p = Path(prefix + ext)
        if not p.is_file() or (size is not None and p.stat().st_size != size):
            return False, f"{p.name} missing or of the wrong size"
    return True, "up to date"


def default_num_workers() -> int:
    """Worker processes for tokenize_to_memmap: one per core (at most 8). Processes also parallelize the Python
    side (JSON, validation, chat template, SFT mask), which the tokenizer's own Rust threads cannot; on the
    course's 2-core machine the two were within measurement noise for plain text (notebook 02 measures it)."""
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(n, 8))


def tokenize_to_memmap(jsonl_path: str | os.PathLike, tokenizer, out_prefix: str | os.PathLike,
                       num_workers: int | None = None, kind: str = "pretrain", chunk_size: int = 512,
                       on_error: str = "raise", max_samples: int | None = None, force: bool = False,
                       progress: bool = True) -> MemmapInfo:
    """Tokenize a jsonl file once into `<prefix>.bin` (uint16 ids), `<prefix>.idx.npy` (int64 offsets, n+1),
    `<prefix>.mask.bin` (SFT: uint8 trained-token mask) and `<prefix>.json` (metadata, written last, atomically).

    Streams the file (constant memory, a bounded number of chunks in flight), in `num_workers` processes
    (0 = in this process, with the tokenizer's own batch encoder), with a tqdm progress bar over bytes.
    An existing cache is reused only if the source file (size, mtime), tokenizer and settings are unchanged."""
    _check_choice("kind", kind, KINDS)
    _check_choice("on_error", on_error, ON_ERROR)
    jsonl_path = Path(jsonl_path)
    if not jsonl_path.is_file():
        raise FileNotFoundError(f"jsonl file not found: {jsonl_path}")
    if int(tokenizer.vocab_size) > MAX_UINT16_VOCAB:
        raise ValueError(f"tokenizer vocab_size={tokenizer.vocab_size} does not fit uint16 token files "
                         f"(max {MAX_UINT16_VOCAB}); this memmap format is for small vocabularies like MiniMind's 6400")
    prefix = str(out_prefix)
    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    num_workers = default_num_workers() if num_workers is None else int(num_workers)
    t0 = time.perf_counter()
    fresh, _ = memmap_is_fresh(prefix, jsonl_path, tokenizer, kind, max_samples, on_error)
    if fresh and not force:
        meta = json.loads(Path(prefix + ".json").read_text())
        return MemmapInfo(prefix, kind, meta["n_samples"], meta["n_tokens"], meta["n_skipped"], meta["n_blank"],
                          True, time.perf_counter() - t0, num_workers, meta.get("skipped_examples", []))

    source = _source_info(jsonl_path)
    key = _cache_key(source, tokenizer, kind, max_samples, on_error)
    suffix = f".tmp-{os.getpid()}"
    tmp_bin, tmp_mask = prefix + ".bin" + suffix, prefix + ".mask.bin" + suffix
    offsets = array("q", [0])
    counts = {"n_samples": 0, "n_tokens": 0, "n_skipped": 0, "n_blank": 0, "max_token_id": -1}
    examples: list[str] = []
    from tqdm.auto import tqdm

    bar = tqdm(total=source["size"], unit="B", unit_scale=True, desc=f"tokenize {jsonl_path.name}",
               disable=not progress)
    pool = None
    done = False
    try:
        with open(jsonl_path, "rb") as f, open(tmp_bin, "wb") as fbin, \
                (open(tmp_mask, "wb") if kind == "sft" else contextlib.nullcontext()) as fmask:

            def consume(res: dict, nbytes: int) -> bool:
                """Write one chunk's result; False when max_samples is reached."""
                nonlocal done
                if res["errors"]:
                    if on_error == "raise":
                        raise DataFormatError(res["errors"][0] + "  (pass on_error='skip' to skip and count such lines)")
                    counts["n_skipped"] += len(res["errors"])
                    examples.extend(res["errors"][:_MAX_EXAMPLES - len(examples)])
                counts["n_blank"] += res["n_blank"]
                lengths, ids, mask = res["lengths"], res["ids"], res["mask"]
                if max_samples is not None and counts["n_samples"] + len(lengths) >= max_samples:
                    keep = max_samples - counts["n_samples"]
                    lengths = lengths[:keep]
                    ids, mask = ids[:int(lengths.sum())], (mask[:int(lengths.sum())] if mask is not None else None)
                    done = True
                if ids.size:
                    counts["max_token_id"] = max(counts["max_token_id"], int(ids.max()))
                fbin.write(ids.astype(np.uint16).tobytes())
                if fmask is not None:
                    fmask.write(mask.astype(np.uint8).tobytes())
                for n in lengths.tolist():
                    offsets.append(offsets[-1] + n)
                counts["n_samples"] += len(lengths)
                counts["n_tokens"] += int(lengths.sum())
                bar.update(nbytes)
                return not done

            chunks = _line_chunks(f, chunk_size)
            if num_workers == 0:
                for start, lines, nbytes in chunks:
                    if not consume(_tokenize_chunk(str(jsonl_path), start, lines, kind, on_error, tokenizer), nbytes):
                        break
            else:
                import multiprocessing as mp

                with _tokenizers_parallelism_off():
                    pool = mp.get_context().Pool(num_workers, initializer=_init_worker, initargs=(tokenizer,))
                # bounded in flight: Pool.imap would read the whole file ahead into memory
                pending: collections.deque = collections.deque()
                for start, lines, nbytes in chunks:
                    pending.append((pool.apply_async(_tokenize_chunk, (str(jsonl_path), start, lines, kind, on_error)), nbytes))
                    if len(pending) >= 2 * num_workers:
                        res, nb = pending.popleft()
                        if not consume(res.get(), nb):
                            break
                while pending and not done:
                    res, nb = pending.popleft()
                    consume(res.get(), nb)
            for fh in (fbin, fmask):
                if fh is not None:
                    fh.flush()
                    os.fsync(fh.fileno())
        if counts["max_token_id"] > MAX_UINT16_VOCAB:
            raise ValueError(f"token id {counts['max_token_id']} does not fit uint16")
        os.replace(tmp_bin, prefix + ".bin")
        if kind == "sft":
            os.replace(tmp_mask, prefix + ".mask.bin")
        with open(prefix + ".idx.npy" + suffix, "wb") as fidx:
            np.save(fidx, np.frombuffer(offsets, dtype=np.int64))
            fidx.flush()
            os.fsync(fidx.fileno())
        os.replace(prefix + ".idx.npy" + suffix, prefix + ".idx.npy")
        seconds = time.perf_counter() - t0
        meta = {**key, **counts, "skipped_examples": examples, "seconds": round(seconds, 3), "num_workers": num_workers,
                "chunk_size": chunk_size, "dtype": "uint16", "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        atomic_write_bytes(prefix + ".json", json.dumps(meta, indent=1, ensure_ascii=False).encode())
    finally:
        bar.close()
        if pool is not None:
            pool.terminate()
            pool.join()
        for tmp in (tmp_bin, tmp_mask, prefix + ".idx.npy" + suffix):
            with contextlib.suppress(FileNotFoundError):
                os.remove(tmp)
    if counts["n_skipped"]:
        warnings.warn(f"{jsonl_path}: skipped {counts['n_skipped']} lines (on_error='skip'); first: {examples[0]}",
                      stacklevel=2)
    return MemmapInfo(prefix, kind, counts["n_samples"], counts["n_tokens"], counts["n_skipped"], counts["n_blank"],
                      False, seconds, num_workers, examples)


# ----------------------------------------------------------------------------------------------------------
# 5. Collators
# ----------------------------------------------------------------------------------------------------------


def _pad(batch: Sequence[dict], length: int, pad_id: int) -> dict[str, torch.Tensor]:
    if not batch:
        raise ValueError("cannot collate an empty batch")
    b = len(batch)
    input_ids = torch.full((b, length), int(pad_id), dtype=torch.long)
    labels = torch.full((b, length), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros((b, length), dtype=torch.long)
    for r, sample in enumerate(batch):
        n = len(sample["input_ids"])
        if n > length:
            raise ValueError(f"sample {r} has {n} tokens, more than the padded length {length}; truncate it first")
        input_ids[r, :n] = sample["input_ids"]
        labels[r, :n] = sample["labels"]
        attention_mask[r, :n] = 1
    return {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}


def pad_to_max_length(batch: Sequence[dict], max_length: int, pad_id: int = 0) -> dict[str, torch.Tensor]:
    """MiniMind's way: every row padded (right) to max_length; pads get label -100 and attention_mask 0."""
    return _pad(batch, int(max_length), pad_id)


def pad_to_longest(batch: Sequence[dict], pad_id: int = 0, pad_to_multiple_of: int | None = None) -> dict[str, torch.Tensor]:
    """Dynamic padding: rows padded only to the batch's longest row (optionally rounded up to a multiple)."""
    longest = max((len(s["input_ids"]) for s in batch), default=0)
    if pad_to_multiple_of:
        longest = -(-longest // pad_to_multiple_of) * pad_to_multiple_of
    return _pad(batch, longest, pad_id)


def make_collator(strategy: str, pad_id: int = 0, max_length: int | None = None) -> Any:
    """A picklable collate_fn (for DataLoader workers): strategy 'max_length' (needs max_length) or 'longest'."""
    if strategy == "max_length":
        if max_length is None:
            raise ValueError("strategy='max_length' needs max_length")
        return functools.partial(pad_to_max_length, max_length=max_length, pad_id=pad_id)
    if strategy == "longest":
        return functools.partial(pad_to_longest, pad_id=pad_id)
    raise ValueError(f"strategy={strategy!r} is not valid; choose 'max_length' or 'longest'")


def padding_fraction(batch_lengths: Sequence[Sequence[int]], seq_len: int | None = None) -> float:
    """Share of padding in batches of sample lengths, each padded to seq_len (if given) or to its longest row."""
    real = sum(sum(b) for b in batch_lengths)
    padded = sum(len(b) * (seq_len if seq_len is not None else max(b)) for b in batch_lengths if len(b))
    return 1.0 - real / padded if padded else 0.0


def trained_tokens(labels: torch.Tensor) -> int:
    """Trained (predicted) tokens of a (B, T) label tensor: the shifted labels that are not IGNORE_INDEX."""
    return int((labels[:, 1:] != IGNORE_INDEX).sum())


def pad_collate(samples: Sequence[dict], pad_id: int = 0, seq_len: int | None = None,
                fixed: bool = False) -> dict[str, torch.Tensor]:
    """Pad samples into (B, T) input_ids, labels (-100 on pads) and attention_mask.

    Rows longer than seq_len are cut to seq_len; fixed=True pads every row to seq_len (MiniMind's way),
    else to the longest row of the batch (dynamic padding)."""
    if not samples:
        raise ValueError("pad_collate got an empty list of samples")
    if fixed and seq_len is None:
        raise ValueError("pad_collate(fixed=True) needs seq_len")
    rows = [(s["input_ids"][:seq_len], s.get("labels", s["input_ids"])[:seq_len]) for s in samples]
    length = seq_len if fixed else max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), length), int(pad_id), dtype=torch.long)
    labels = torch.full((len(rows), length), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), length), dtype=torch.long)
    for r, (ids, lab) in enumerate(rows):
        input_ids[r, :len(ids)] = torch.as_tensor(ids)
        labels[r, :len(ids)] = torch.as_tensor(lab)
        attention_mask[r, :len(ids)] = 1
    return {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}


def padding_fraction_of(lengths: Iterable[int], batch_size: int, max_length: int | None = None) -> float:
    """Padding fraction of consecutive batches of `lengths` without building tensors (max_length=None: pad to longest)."""
    lengths = np.asarray(list(lengths), dtype=np.int64)
    real = padded = 0
    for s in range(0, len(lengths), batch_size):
        b = lengths[s:s + batch_size]
        real += int(b.sum())
        padded += len(b) * (int(max_length) if max_length is not None else int(b.max()))
    return 1.0 - real / max(1, padded)


# ----------------------------------------------------------------------------------------------------------
# 6. DataLoader measurements (the notebook's guidance comes from these, on the machine that runs it)
# ----------------------------------------------------------------------------------------------------------


def measure_dataloader(dataset, collate_fn, batch_size: int, num_workers: int = 0, persistent_workers: bool = False,
                       pin_memory: bool | None = None, epochs: int = 2, max_batches: int | None = None) -> dict:
    """Samples/s of iterating a DataLoader `epochs` times (worker start-up included, as a training run pays it)."""
    from torch.utils.data import DataLoader

    if pin_memory is None:
        pin_memory = torch.cuda.is_available()  # pinning only speeds up host->GPU copies; on CPU it is wasted work
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=True, collate_fn=collate_fn, num_workers=num_workers,
                        persistent_workers=persistent_workers and num_workers > 0, pin_memory=pin_memory,
                        generator=torch.Generator().manual_seed(0))
    n_samples, t0 = 0, time.perf_counter()
    # workers fork when an epoch's iterator starts; see _tokenizers_parallelism_off for why the variable is set
    with _tokenizers_parallelism_off() if num_workers > 0 else contextlib.nullcontext():
        for _ in range(epochs):
            for k, batch in enumerate(loader):
                n_samples += batch["input_ids"].shape[0]
                if max_batches is not None and k + 1 >= max_batches:
                    break
    seconds = time.perf_counter() - t0
    del loader  # shuts persistent workers down
    return {"num_workers": num_workers, "persistent_workers": persistent_workers and num_workers > 0,
            "pin_memory": pin_memory, "epochs": epochs, "samples": n_samples, "seconds": seconds,
            "samples_per_s": n_samples / seconds if seconds > 0 else float("nan")}
