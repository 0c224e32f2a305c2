"""MiniMind's jsonl files, built in notebook 02_data: read and validated line by line
(``read_jsonl``), encoded (``encode_pretrain``, ``encode_sft``) and tokenized once, in worker
processes, into uint16 memmap files (``tokenize_to_memmap``), rebuilt only when the source file, the
tokenizer or the settings change. Notebook 10_lora_dpo adds MiniMind's preference pairs (kind
"dpo"), each stored as two SFT samples: its chosen conversation, then its rejected one."""

from __future__ import annotations

import collections
import contextlib
import hashlib
import itertools
import json
import multiprocessing
import os
import time
import unittest.mock
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import torch
# a text bar: an executed notebook keeps its final state, not a widget's first
from tqdm import tqdm

from .checks import require
from .fileio import atomic_open, atomic_write_text, file_fingerprint
from .tokenizer import PIECE_CHARS, ROLES, check_text, check_turn_extras

KINDS = ("pretrain", "sft", "dpo")  # dpo: MiniMind's pairs, {"chosen": [...], "rejected": [...]}
PAYLOAD = {"pretrain": "text", "sft": "conversations"}  # the key of a record that holds its sample
ON_ERROR = ("raise", "skip")
# 2: SFT masks train the "\n" after <|im_end|> (MiniMind-3's tokens); older caches rebuild
MEMMAP_FORMAT_VERSION = 2
# uint16 stores ids 0..65535, so a vocab of at most 65536 entries; we keep one margin id
MAX_UINT16_VOCAB = 65535


class DataFormatError(ValueError):
    """A jsonl line that is not valid JSON or does not match the expected schema (message names
    file:line)."""


def check_choice(name: str, value: str, choices: Sequence[str]) -> None:
    """Raise ValueError naming the argument and the valid choices unless `value` is one of them."""
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not valid; choose one of {list(choices)}")


def _check_text(text: Any, where: str, allow_blank: bool = False) -> None:
    if not isinstance(text, str):
        raise ValueError(f"{where} must be a string, got {type(text).__name__}")
    if not allow_blank and not text.strip():
        raise ValueError(f"{where} is empty ({text!r}): nothing to train on")
    # JSON may spell lone surrogates ("\\ud800"): no UTF-8 bytes, so no tokens
    check_text(text, where)


def validate_record(record: Any, kind: str) -> list[str]:
    """Raise ValueError (naming the key and value) unless `record` is a valid `kind` sample (see
    data/README.md); the names its tool calls use that the system turn's tools do not declare
    (MiniMind-3's data has such calls: kept)."""
    check_choice("kind", kind, KINDS)
    require(isinstance(record, dict), f"expected a JSON object, got {type(record).__name__}")
    if kind == "dpo":
        return validate_pair(record)
    example = '{"conversations": [{"role": "user", "content": "..."}, ...]}'
    if kind == "pretrain":
        example = '{"text": "..."}'
    require(PAYLOAD[kind] in record, f"missing key {PAYLOAD[kind]!r} ({kind} lines look like "
            f"{example}); keys: {sorted(record)}")
    if kind == "pretrain":
        _check_text(record["text"], "key 'text'")
        return []
    conv = record["conversations"]
    require(isinstance(conv, list) and len(conv) > 0,
            f"key 'conversations' must be a non-empty list, got {conv!r:.80}")
    pending, called = 0, []  # tool calls not yet answered by a tool turn; the names called
    for t, turn in enumerate(conv):
        require(isinstance(turn, dict), f"conversations[{t}] must be an object, got {turn!r:.80}")
        missing = [key for key in ("role", "content") if key not in turn]
        require(not missing, f"conversations[{t}] is missing key {', '.join(map(repr, missing))}; "
                f"keys: {sorted(turn)}")
        require(turn["role"] in ROLES,
                f"conversations[{t}]['role'] = {turn['role']!r} is not one of {list(ROLES)}")
        for key in ("tools", "functions"):
            if turn.get(key) is not None and (t or turn["role"] != "system"):
                raise ValueError(f"conversations[{t}][{key!r}] is only allowed on the first turn, "
                                 "a system turn")
        calls = json_field(turn.get("tool_calls"), f"conversations[{t}]['tool_calls']")
        blank_ok = turn["role"] != "assistant" or bool(calls)  # a turn may only call tools
        if turn["content"] is not None or not blank_ok:
            _check_text(turn["content"], f"conversations[{t}]['content']", allow_blank=blank_ok)
        check_turn_extras(dict(turn, tool_calls=calls), f"conversations[{t}]")
        for k, call in enumerate(calls or []):
            json_field((call.get("function") or call)["arguments"],
                       f"conversations[{t}]['tool_calls'][{k}]['arguments']")
            called.append((call.get("function") or call)["name"])
        if pending and turn["role"] != "tool" or turn["role"] == "tool" and not pending:
            raise ValueError(f"conversations[{t}]: each tool call gets its own 'tool' turn right "
                             "after the assistant "
                             f"turn that makes it; {pending} call(s) unanswered before this "
                             f"{turn['role']!r} turn")
        problem = order_problem([earlier["role"] for earlier in conv[:t]], turn["role"])
        require(not problem, f"conversations[{t}] ({turn['role']!r}): {problem}")
        if turn["role"] == "assistant":
            pending = len(calls or [])
        else:
            pending = pending - (turn["role"] == "tool")
    if pending:
        raise ValueError(f"conversations ends with {pending} tool call(s) that no 'tool' turn "
                         "answers")
    declared = {tool["function"]["name"] for tool in tools_of(conv)}  # raises on bad tools
    if not any(turn["role"] == "assistant" for turn in conv):
        raise ValueError("conversations has no 'assistant' turn, so nothing would be trained")
    return [name for name in called if name not in declared]


def validate_pair(record: dict) -> list[str]:
    """A preference pair (notebook 10): two conversations that share every turn but the last, each
    ending with a non-empty assistant reply, the replies different; else ValueError saying why."""
    for side in ("chosen", "rejected"):
        if side not in record:
            raise ValueError(f"missing key {side!r} (dpo lines look like {{\"chosen\": [turns], "
                             f"\"rejected\": [turns]}}); keys: {sorted(record)}")
        try:
            validate_record({"conversations": record[side]}, "sft")
        except ValueError as e:
            raise ValueError(f"key {side!r}: {e}") from None
        if record[side][-1]["role"] != "assistant":
            raise ValueError(f"key {side!r}: the last turn is a {record[side][-1]['role']!r} turn, "
                             f"not the reply")
    if record["chosen"] == record["rejected"]:
        raise ValueError("'chosen' equals 'rejected': a pair must prefer one reply to another")
    if record["chosen"][:-1] != record["rejected"][:-1]:
        raise ValueError("'chosen' and 'rejected' differ before their last turn: a pair answers "
                         "one conversation")
    return []


def order_problem(before: list[str], role: str) -> str:
    """Why a `role` turn cannot follow turns of the roles `before`, or "" (a tool turn: the
    pending-call rule; a later system turn: kept, as MiniMind-3's template renders it, counted by
    JsonlReader)."""
    if role == "assistant" and "user" not in before:
        return "an answer needs a 'user' turn before it"
    if before and role == before[-1] and role in ("user", "assistant"):
        return f"two {role!r} turns in a row: merge them, or put the other role's turn between"
    return ""


def _parse_line(raw: bytes, kind: str | None) -> tuple[Any, list[str]]:
    """Parse and validate one jsonl line: (record, undeclared tool names); a ValueError's message
    lacks the location."""
    raw = raw.rstrip(b"\r\n")  # so an error's column is on this line, not "column 1" of the next
    try:
        record = json.loads(raw)
    except UnicodeDecodeError as e:
        raise ValueError(f"not valid UTF-8 ({e.reason} at byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"malformed JSON ({e.msg} at column {e.colno}): "
                         f"{raw.decode('utf-8', 'replace')[:80]!r}") from None
    if kind is None:
        return record, []
    return record, validate_record(record, kind)


class JsonlReader:
    """A jsonl file's records; a bad line raises (file:line), or with on_error='skip' is skipped,
    counted, warned of."""
    def __init__(self, path: str | os.PathLike, on_error: str = "raise", kind: str | None = None,
                 max_samples: int | None = None):
        check_choice("on_error", on_error, ON_ERROR)
        check_choice("kind", kind, (*KINDS, None))
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"jsonl file not found: {path}")
        self.path, self.on_error, self.kind, self.max_samples = path, on_error, kind, max_samples
        # blank lines hold no sample
        self.n_lines = self.n_records = self.n_blank = self.n_skipped = self.n_bytes = 0
        # the first 5 "file:line: reason" messages, for reports
        self.skipped_examples: list[str] = []
        # kept and trained as written, but counted
        self.n_undeclared_tool_calls, self.undeclared_example = 0, ""
        self.n_late_system_turns, self.late_system_example = 0, ""  # a system turn after the first

    def __iter__(self) -> Iterator[Any]:
        with open(self.path, "rb") as f:
            for lineno, raw in enumerate(f, start=1):
                if self.max_samples is not None and self.n_records >= self.max_samples:
                    break
                self.n_lines, self.n_bytes = lineno, self.n_bytes + len(raw)
                if not raw.strip():
                    self.n_blank += 1
                    continue
                try:
                    record, undeclared = _parse_line(raw, self.kind)
                except ValueError as e:
                    message = f"{self.path}:{lineno}: {e}"
                    if self.on_error == "raise":
                        hint = "on_error='skip' (CLI: --on-error skip) skips and counts such lines"
                        raise DataFormatError(f"{message}  ({hint})") from None
                    self.n_skipped += 1
                    self.skipped_examples += [message][:5 - len(self.skipped_examples)]
                    continue
                self.n_records += 1
                if undeclared:
                    self.n_undeclared_tool_calls += len(undeclared)
                    self.undeclared_example = (
                        self.undeclared_example or f"{self.path}:{lineno}: {undeclared[0]!r}"
                    )
                turns = record["conversations"][1:] if self.kind == "sft" else []
                if any(turn["role"] == "system" for turn in turns):
                    self.n_late_system_turns += 1
                    self.late_system_example = self.late_system_example or f"{self.path}:{lineno}"
                yield record
        if self.n_skipped or self.n_undeclared_tool_calls or self.n_late_system_turns:
            warnings.warn(self.report(), stacklevel=2)

    def report(self) -> str:
        """One line saying what was read and skipped."""
        s = (f"{self.path}: read {self.n_records} records from {self.n_lines} lines, "
             f"skipped {self.n_skipped} lines")
        s += f" (first: {self.skipped_examples[0]})" if self.skipped_examples else ""
        calls = (f"; {self.n_undeclared_tool_calls} tool call(s) to a tool the system turn does "
                 f"not declare, kept (first: {self.undeclared_example})")
        late = (f"; {self.n_late_system_turns} conversation(s) with a 'system' turn after the "
                f"first, kept as MiniMind-3's template renders it (first: "
                f"{self.late_system_example})")
        s += calls if self.n_undeclared_tool_calls else ""
        return s + (late if self.n_late_system_turns else "")

    def counts(self) -> dict:
        """What a dataset's stats report about the reading: skipped and blank lines."""
        return {"n_skipped": self.n_skipped, "n_blank": self.n_blank,
                "skipped_examples": list(self.skipped_examples),
                "n_undeclared_tool_calls": self.n_undeclared_tool_calls,
                "n_late_system_turns": self.n_late_system_turns}


# read_jsonl(path, on_error="raise", kind=None, max_samples=None): the name callers use
read_jsonl = JsonlReader


def encode_pretrain(tokenizer, text: str) -> np.ndarray:
    """A pretrain sample, MiniMind style: [bos] + tokens(text) + [eos], untruncated, as int64."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    return np.asarray([tokenizer.bos_token_id, *ids, tokenizer.eos_token_id], dtype=np.int64)


def _read_role(tokenizer, ids: list[int], i: int, header: list[int]) -> tuple[str, int]:
    """The role named after the <|im_start|> at ids[i], and the index where that turn's content
    starts."""
    if ids[i + 1:i + 1 + len(header)] == header:  # the usual ids of "assistant\n": a fast path
        return "assistant", i + 1 + len(header)
    j, text = i + 1, ""  # slow path: decode the header token by token until its "\n"
    while j < len(ids) and "\n" not in text and ids[j] not in (tokenizer.bos_token_id,
                                                               tokenizer.eos_token_id):
        j += 1
        text = tokenizer.decode(ids[i + 1:j])
    # if the last header token also carries content (e.g. "\n\n" merged), that token is trained
    return text.split("\n", 1)[0], (j if text.endswith("\n") and text.count("\n") == 1 else j - 1)


def assistant_mask(tokenizer, ids: Sequence[int]) -> np.ndarray:
    """uint8 mask of MiniMind-3's trained tokens: 1 from each ``<|im_start|>assistant\\n`` to its
    ``<|im_end|>\\n``."""
    ids, header = [int(i) for i in ids], list(tokenizer.encode("assistant\n",
                                                               add_special_tokens=False))
    newline = list(tokenizer.encode("\n", add_special_tokens=False))
    n, bos, eos = len(ids), tokenizer.bos_token_id, tokenizer.eos_token_id
    mask = np.zeros(n, dtype=np.uint8)
    for i in [k for k, t in enumerate(ids) if t == bos]:  # every turn starts at an <|im_start|>
        role, start = _read_role(tokenizer, ids, i, header)
        # the turn's <|im_end|> (or next start)
        end = next((k for k in range(start, n) if ids[k] in (bos, eos)), n)
        if role == "assistant":  # content + <|im_end|> + the "\\n" after it (where present)
            stop = end + (end < n and ids[end] == eos)
            mask[start:stop + len(newline) * (stop > end and ids[stop:stop
                                                                 + len(newline)] == newline)] = 1
    return mask


def json_field(value: Any, where: str) -> Any:
    """A tools / tool_calls / arguments value: JSON text (MiniMind-3's files) parsed, "" read as
    absent; else as is."""
    try:
        if isinstance(value, str):
            if value.strip():
                return json.loads(value)
            return None
        return value
    except json.JSONDecodeError as e:
        raise ValueError(
            f"{where} is not valid JSON ({e.msg} at column {e.colno}): {value!r:.60}"
        ) from None


def tools_of(conv: list[dict]) -> list:
    """The tools of a conversation's system turn ("tools", or MiniMind's older "functions"): a list
    or its JSON text."""
    key = "tools" if conv[0].get("tools") is not None else "functions"
    if conv[0]["role"] == "system":
        tools = json_field(conv[0].get(key), f"conversations[0][{key!r}]")
    else:
        tools = None
    if not isinstance(tools, (list, type(None))):
        raise ValueError(f"conversations[0][{key!r}] must be a list (or its JSON text), got "
                         f"{tools!r:.60}")
    for k, tool in enumerate(tools or []):
        if not (isinstance(tool, dict) and isinstance(tool.get("function"), dict)
                and isinstance(tool["function"].get("name"), str)):
            raise ValueError(f"conversations[0][{key!r}][{k}] must be "
                             f"{{'type': 'function', 'function': "
                             f"{{'name': str, ...}}}}, got {tool!r:.60}")
    return tools or []


def encode_sft(tokenizer, conversations: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    """An SFT sample: the chat template's ids (int64) and assistant mask (uint8), untruncated."""
    messages = []
    for t in conversations:
        keys = ("role", "content", "reasoning_content", "tool_calls")
        message = {k: t[k] for k in keys if k in t and (k == "content" or t[k] is not None)}
        if "tool_calls" in message:
            message["tool_calls"] = json_field(message["tool_calls"], "tool_calls")
        messages.append(message)
    tools = tools_of(conversations) or None
    # tokenize=True: the template's structure comes from ids, so "<|im_end|>" typed inside content
    # stays text
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=True,
                                        tools=tools)
    if isinstance(ids, str):  # a tokenizer whose template only renders text
        ids = tokenizer.encode(ids, add_special_tokens=False)
    ids = np.asarray(ids, dtype=np.int64)
    return ids, assistant_mask(tokenizer, ids)


# worker-process state: the tokenizer is sent once per worker, not once per chunk
_WORKER: dict[str, Any] = {}


def _init_worker(tokenizer) -> None:
    # one process per core already; no nested Rust threads
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    torch.set_num_threads(1)
    _WORKER["tok"] = tokenizer


def tokenize_samples(kind: str, payloads: list, tokenizer=None) -> tuple[np.ndarray, np.ndarray,
                                                                         np.ndarray | None]:
    """Flat int64 ids, per-sample lengths and (SFT) uint8 trained-token mask of the samples
    `payloads`."""
    tok = tokenizer if tokenizer is not None else _WORKER["tok"]
    if kind == "pretrain":
        bos, eos = [tok.bos_token_id], [tok.eos_token_id]
        encoded = encode_texts(tok, payloads)
        seqs, masks = [np.concatenate([bos, ids, eos], dtype=np.int64) for ids in encoded], None
    else:
        convs = payloads
        if kind == "dpo":  # a pair's chosen conversation, then its rejected one: two samples
            convs = [c for pair in payloads for c in (pair["chosen"], pair["rejected"])]
        if convs:
            seqs, masks = zip(*[encode_sft(tok, c) for c in convs])
        else:
            seqs, masks = ([], [])
    lengths = np.asarray([len(s) for s in seqs], dtype=np.int64)
    flat = np.concatenate([np.zeros(0, np.int64), *seqs], dtype=np.int64)
    if masks is not None:
        mask = np.concatenate([np.zeros(0, np.uint8), *masks])
    else:
        mask = None
    return flat, lengths, mask


def encode_texts(tok: Any, texts: list[str]) -> list:
    """Token ids of each text: a batch in parallel in the Rust encoder; a text over PIECE_CHARS
    piece by piece (Tokenizer.pieces: the same ids) into an int64 array, a few bytes a token."""
    if not hasattr(tok, "pieces"):  # a transformers tokenizer
        return [tok.encode(text, add_special_tokens=False) for text in texts]
    long = {i for i, text in enumerate(texts) if len(text) > PIECE_CHARS}
    short = iter(tok.encode_batch([text for i, text in enumerate(texts) if i not in long]))
    ids = []
    for i, text in enumerate(texts):
        if i in long:
            ids.append(encode_long(tok, text))
        else:
            ids.append(next(short))
    return ids


def encode_long(tok: Any, text: str, group: int = 4) -> np.ndarray:
    """The ids of a long text, `group` pieces at a time (in parallel), each kept as int64."""
    pieces = tok.pieces(text)
    batches = (tok.encode_batch(pieces[k:k + group]) for k in range(0, len(pieces), group))
    return np.concatenate([np.asarray(ids, np.int64) for batch in batches for ids in batch])


def tokenizers_parallelism_off() -> contextlib.AbstractContextManager:
    """Set TOKENIZERS_PARALLELISM=false while processes fork (HF tokenizers would warn and could
    deadlock)."""
    # restored on exit
    return unittest.mock.patch.dict(os.environ, {"TOKENIZERS_PARALLELISM": "false"})


def tokenize_reader(reader: JsonlReader, tokenizer, chunk_size: int,
                    num_workers: int) -> Iterator[tuple]:
    """tokenize_samples of the reader's samples, chunk by chunk in file order, here or in
    `num_workers` processes."""
    key = PAYLOAD.get(reader.kind)  # dpo: the whole record
    payloads = (record if key is None else record[key] for record in reader)
    chunks = iter(lambda: list(itertools.islice(payloads, chunk_size)), [])
    if num_workers == 0:
        yield from (tokenize_samples(reader.kind, c, tokenizer) for c in chunks)
        return
    with tokenizers_parallelism_off():
        pool = multiprocessing.get_context().Pool(num_workers, initializer=_init_worker,
                                                  initargs=(tokenizer,))
    # a bounded number of chunks in flight: Pool.imap would read the whole file ahead into memory
    try:
        pending: collections.deque = collections.deque()
        for chunk in chunks:
            pending.append(pool.apply_async(tokenize_samples, (reader.kind, chunk)))
            if len(pending) >= 2 * num_workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()
    finally:  # also when the consumer stops early (an error): no worker outlives the call
        pool.terminate()
        pool.join()


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
        masked = self.kind != "pretrain"  # sft, dpo: a trained-token mask beside the ids
        return [self.prefix + e for e in [".bin", ".idx.npy", ".json"] + [".mask.bin"] * masked]


_PROBE_TEXT = "Hello, world! 你好，世界。 The quick brown fox 123 \n\t émoji 🙂"
_PROBE_CHAT = [{"role": "system", "content": "s"}, {"role": "user", "content": "u?"},
               {"role": "assistant", "content": "a."}]


def tokenizer_fingerprint(tokenizer) -> str:
    """A short hash that changes when the tokenizer (vocab, merges, special ids or chat template)
    changes."""
    candidates = [tokenizer] + [getattr(tokenizer, a, None) for a in ("backend",
                                                                      "backend_tokenizer",
                                                                      "_tokenizer", "hf")]
    backend = next((c for c in candidates if hasattr(c, "to_str")), None)
    h = hashlib.sha256()
    if backend is not None:
        h.update(backend.to_str().encode())
    h.update(
        json.dumps(
            [
                int(tokenizer.vocab_size),
                tokenizer.bos_token_id,
                tokenizer.eos_token_id,
                tokenizer.pad_token_id,
                list(tokenizer.encode(_PROBE_TEXT, add_special_tokens=False)),
            ]
        ).encode()
    )
    # a tokenizer without a chat template is fine for pretrain data
    with contextlib.suppress(Exception):
        h.update(tokenizer.apply_chat_template(_PROBE_CHAT, tokenize=False).encode())
    return h.hexdigest()[:16]


def _cache_key(jsonl_path: str | os.PathLike, tokenizer, kind: str, max_samples: int | None,
               on_error: str) -> dict:
    """What a cache was built from; a cache whose key differs from the current one is stale and
    rebuilt."""
    # the resume check's hash:
    return {"format": "minimind-memmap", "version": MEMMAP_FORMAT_VERSION, "kind": kind,
            # they agree
            "source": {"path": str(Path(jsonl_path).resolve()), **file_fingerprint(jsonl_path)},
            "tokenizer": {"fingerprint": tokenizer_fingerprint(tokenizer),
                          "vocab_size": int(tokenizer.vocab_size)},
            "max_samples": max_samples, "on_error": on_error}


def memmap_is_fresh(out_prefix: str | os.PathLike, jsonl_path: str | os.PathLike, tokenizer,
                    kind: str = "pretrain",
                    max_samples: int | None = None, on_error: str = "raise") -> tuple[bool, str]:
    """(fresh, reason): whether the memmap at out_prefix matches this source file, tokenizer and
    settings."""
    try:
        meta = read_memmap_meta(str(out_prefix))
    # no cache yet, unreadable, or of another format (JSONDecodeError: ValueError)
    except (OSError, ValueError) as e:
        return False, str(e)
    for key, value in _cache_key(jsonl_path, tokenizer, kind, max_samples, on_error).items():
        if meta.get(key) != value:
            return False, f"{key} changed (cache: {meta.get(key)!r:.120}, now: {value!r:.120})"
    sizes = {".bin": 2 * meta["n_tokens"], ".idx.npy": None}
    if kind != "pretrain":  # sft, dpo: the mask, a byte per token
        sizes[".mask.bin"] = meta["n_tokens"]
    for ext, size in sizes.items():
        p = Path(f"{out_prefix}{ext}")
        if not p.is_file() or (size is not None and p.stat().st_size != size):
            return False, f"{p.name} missing or of the wrong size"
    return True, "up to date"


def default_num_workers(n_bytes: int, kind: str = "pretrain", cores: int | None = None) -> int:
    """Tokenizer processes (notebook 02): none for pretraining text (the Rust encoder already uses
    the cores); for SFT (Python template and mask) one per core, at most 8, from 2 cores and 256
    KiB, where processes fork (as measured)."""
    n = cores or os.cpu_count() or 1
    if not cores and hasattr(os, "sched_getaffinity"):
        n = len(os.sched_getaffinity(0))
    fork = multiprocessing.get_start_method() == "fork"
    if kind != "pretrain" and n >= 2 and n_bytes >= 2**18 and fork:
        return min(n, 8)
    return 0


def tokenize_to_memmap(jsonl_path: str | os.PathLike, tokenizer, out_prefix: str | os.PathLike,
                       num_workers: int | None = None, kind: str = "pretrain",
                       chunk_size: int = 512,
                       on_error: str = "raise", max_samples: int | None = None, force: bool = False,
                       progress: bool = True) -> MemmapInfo:
    """Tokenize a jsonl file once, in `num_workers` processes (0: here), into `<prefix>.bin` (uint16
    ids), `.idx.npy` (offsets), `.mask.bin` (SFT) and `.json` (last: a finished cache); reused while
    the source (size, SHA-1), the tokenizer and the settings are unchanged."""
    reader = JsonlReader(jsonl_path, on_error=on_error, kind=kind, max_samples=max_samples)
    require(int(tokenizer.vocab_size) <= MAX_UINT16_VOCAB,
            f"tokenizer vocab_size={tokenizer.vocab_size} does not fit uint16 token files (max "
            f"{MAX_UINT16_VOCAB}); this memmap format is for small vocabularies like MiniMind's "
            "6400")
    prefix, t0 = str(out_prefix), time.perf_counter()
    if num_workers is None:
        num_workers = default_num_workers(os.path.getsize(jsonl_path), kind)
    num_workers = int(num_workers)
    reused = not force and memmap_is_fresh(prefix, jsonl_path, tokenizer, kind, max_samples,
                                           on_error)[0]
    if not reused:
        key = _cache_key(jsonl_path, tokenizer, kind, max_samples, on_error)
        # a half-rebuilt cache must never look finished
        Path(prefix + ".json").unlink(missing_ok=True)
        offsets, max_id = [np.zeros(1, np.int64)], -1
        bar = tqdm(total=key["source"]["size"], unit="B", unit_scale=True,
                   desc=f"tokenize {reader.path.name}", disable=not progress)
        chunks = tokenize_reader(reader, tokenizer, chunk_size, num_workers)
        # atomic_open writes beside the target and renames on success: an error leaves no
        # half-written file
        masks = contextlib.nullcontext()
        if kind != "pretrain":
            masks = atomic_open(prefix + ".mask.bin")
        with bar, contextlib.closing(chunks), atomic_open(prefix + ".bin") as fbin, masks as fmask:
            for ids, lengths, mask in chunks:
                max_id = max(max_id, int(ids.max(initial=-1)))
                if max_id > MAX_UINT16_VOCAB:
                    raise ValueError(f"{reader.path}: token id {max_id} does not fit uint16")
                fbin.write(ids.astype(np.uint16).tobytes())
                if fmask is not None:
                    fmask.write(mask.astype(np.uint8).tobytes())
                offsets.append(offsets[-1][-1] + np.cumsum(lengths))
                bar.update(reader.n_bytes - bar.n)
            # max_samples can stop before the end of the file: the bar still ends at 100%
            bar.total = bar.n
        offsets = np.concatenate(offsets)
        with atomic_open(prefix + ".idx.npy") as fidx:
            np.save(fidx, offsets)
        meta = {**key, "n_samples": len(offsets) - 1, "n_tokens": int(offsets[-1]),
                "max_token_id": max_id, **reader.counts(),
                "seconds": round(time.perf_counter() - t0, 3), "num_workers": num_workers,
                "chunk_size": chunk_size, "dtype": "uint16",
                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        atomic_write_text(prefix + ".json", json.dumps(meta, indent=1, ensure_ascii=False))
    meta, seconds = read_memmap_meta(prefix), time.perf_counter() - t0
    if not reused:
        seconds = meta["seconds"]
    return MemmapInfo(prefix, kind, meta["n_samples"], meta["n_tokens"], meta["n_skipped"],
                      meta["n_blank"], reused, seconds, num_workers,
                      meta.get("skipped_examples", []))


def read_memmap_meta(prefix: str) -> dict:
    """The metadata of a memmap, checked for its format."""
    meta_path = Path(prefix + ".json")
    if not meta_path.is_file():
        raise FileNotFoundError(f"memmap metadata not found: {meta_path} (build it with "
                                "tokenize_to_memmap)")
    meta = json.loads(meta_path.read_text())
    if meta.get("format") != "minimind-memmap" or meta.get("version") != MEMMAP_FORMAT_VERSION:
        raise ValueError(f"{meta_path}: not a minimind memmap of version {MEMMAP_FORMAT_VERSION}; "
                         "rebuild it")
    return meta
