"""Dynamic batching (notebook 06_dynamic_batching): token budgets (TokenBudgetBatchSampler), packing
(pack_sequences, its masks), OOM-safe adaptive micro-batches (AdaptiveBatchController), steps
(TokenBudgetSteps)."""

import gc
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch
from torch.nn.attention import flex_attention  # the module: tests stand in for create_block_mask
from torch.nn.attention.flex_attention import BlockMask
from torch.utils.data import Dataset, Sampler

from .checks import require
from .data import IGNORE_INDEX, pad_collate, round_up
from .device import empty_cache


def sort_megabatches(order: np.ndarray, lengths: np.ndarray, size: int) -> list[np.ndarray]:
    """`order` cut into megabatches of `size` indices, each sorted longest first (stable: ties stay
    shuffled)."""
    megas = [order[i:i + size] for i in range(0, len(order), size)]
    return [m[np.argsort(-lengths[m], kind="stable")] for m in megas]


def fill_batches(order: Sequence[int], lengths: Sequence[int], max_tokens: int | None,
                 max_batch_size: int | None = None) -> list[list[int]]:
    """Greedy batches: a sample joins while (rows + 1) x longest row <= max_tokens and rows <
    max_batch_size."""
    batches, batch, longest = [], [], 0
    for i in order:
        n = int(lengths[i])
        fits = max_tokens is None or (len(batch) + 1) * max(longest, n) <= max_tokens
        if batch and not (fits and (max_batch_size is None or len(batch) < max_batch_size)):
            batches.append(batch)
            batch, longest = [], 0
        batch.append(int(i))
        longest = max(longest, n)
    return batches + [batch] if batch else batches


class TokenBudgetBatchSampler(Sampler[list[int]]):
    """Batches of indices, every sample once in an order fixed by seed + epoch, of padded size (rows
    x longest row) <= max_tokens; longer samples count as longest_row = min(max_tokens, seq_len)
    (truncated_indices: pad_collate cuts)."""
    def __init__(self, lengths: Sequence[int] | np.ndarray, max_tokens: int,
                 max_batch_size: int | None = None,
                 shuffle: bool = True, seed: int = 0, megabatch_mult: int = 50,
                 seq_len: int | None = None) -> None:
        lengths = np.asarray(lengths)
        if lengths.ndim != 1 or (lengths.size and not np.issubdtype(lengths.dtype, np.integer)):
            raise ValueError("lengths must be a 1-D sequence of integers, got shape "
                             f"{lengths.shape}, {lengths.dtype}")
        if lengths.size and lengths.min() < 1:
            raise ValueError(f"lengths[{np.argmin(lengths)}] = {lengths.min()}: every sample needs "
                             "at least 1 token")
        for name, value in (("max_tokens", max_tokens), ("megabatch_mult", megabatch_mult),
                            ("max_batch_size", max_batch_size), ("seq_len", seq_len)):
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.max_tokens, self.max_batch_size, self.seq_len, self.epoch = (
            int(max_tokens),
            max_batch_size,
            seq_len,
            0,
        )
        self.shuffle, self.seed, self.megabatch_mult, self._cache = (
            shuffle,
            int(seed),
            int(megabatch_mult),
            None,
        )
        # one row must fit
        if seq_len is None:
            self.longest_row = self.max_tokens
        else:
            self.longest_row = min(self.max_tokens, seq_len)
        self.raw_lengths = lengths.astype(np.int64)
        self.truncated_indices = np.flatnonzero(self.raw_lengths > self.longest_row).tolist()
        # as batched: the collate cuts longer ones
        self.lengths = np.minimum(self.raw_lengths, self.longest_row)
        median = 1
        if lengths.size:
            median = max(1, int(np.median(self.lengths)))
        rows = max(1, self.max_tokens // median)
        # samples of ~mult batches
        self.megabatch_size = self.megabatch_mult * min(rows, max_batch_size or rows)

    def batches(self, epoch: int | None = None) -> list[list[int]]:
        """All batches of an epoch, in the order they are served (deterministic given seed + epoch).
        """
        if epoch is None:
            epoch = self.epoch
        else:
            epoch = int(epoch)
        if self._cache is None or self._cache[0] != epoch:  # _cache: (epoch, its batches)
            rng = np.random.default_rng([self.seed, epoch])
            if self.shuffle:
                order = rng.permutation(len(self.lengths))
            else:
                order = np.arange(len(self.lengths))
            # unshuffled: one sorted megabatch
            if self.shuffle:
                size = self.megabatch_size
            else:
                size = max(1, len(order))
            out = [b for mega in sort_megabatches(order, self.lengths, size)
                   for b in fill_batches(mega, self.lengths, self.max_tokens, self.max_batch_size)]
            if self.shuffle:
                out = [out[i] for i in rng.permutation(len(out))]
            self._cache = (epoch, out)
        return self._cache[1]

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose order the next __iter__ serves."""
        self.epoch = int(epoch)

    def __iter__(self) -> Iterator[list[int]]:
        return (list(b) for b in self.batches())

    def __len__(self) -> int:
        return len(self.batches())

    @property
    def stats(self) -> dict:
        """Counts for the current epoch: samples, truncated samples and tokens, batches, padding."""
        real, padded = int(self.lengths.sum()), int(sum(len(b) * int(self.lengths[b].max())
                                                        for b in self.batches()))
        return {"n_samples": len(self.lengths), "n_truncated": len(self.truncated_indices),
                "tokens_truncated": int((self.raw_lengths - self.lengths).sum()),
                "n_batches": len(self),
                "max_tokens": self.max_tokens, "longest_row": self.longest_row, "real_tokens": real,
                "padded_tokens": padded, "padding_fraction": 1.0 - real / padded if padded else 0.0}


@dataclass
class PackStats:
    """What packing did: documents in, rows out, and every cut it made."""
    n_docs: int = 0
    n_rows: int = 0
    n_split: int = 0  # documents cut across rows (each piece is trained as a document of its own)
    n_pad: int = 0  # padding tokens at the ends of rows
    n_tokens: int = 0  # real tokens placed in rows

    @property
    def padding_fraction(self) -> float:
        """Padding tokens / all row tokens."""
        return self.n_pad / (self.n_pad + self.n_tokens) if self.n_pad + self.n_tokens else 0.0

    def to_dict(self) -> dict:
        """Counts as a plain dict, with the padding fraction."""
        return {**self.__dict__, "padding_fraction": self.padding_fraction}


def stream_segments(docs: Sequence[tuple], seq_len: int, stats: PackStats,
                    whole: bool = False) -> list[list[tuple]]:
    """Rows of segments (input_ids, labels): the documents in order, cut every seq_len tokens (and
    go on next row); `whole` (SFT): a document that does not fit the rest of a row starts the next
    one, never cut."""
    rows, row, room = [], [], seq_len
    for i, (ids, labels) in enumerate(docs):
        if whole and ids.numel() > room:
            if ids.numel() > seq_len:
                raise ValueError(f"sample {i}: {ids.numel()} tokens do not fit a row of {seq_len} "
                                 "whole")
            rows.append(row)
            row, room = [], seq_len
        stats.n_split += int(ids.numel() > room)  # it does not fit the rest of this row
        while ids.numel():
            take = min(room, ids.numel())
            row.append((ids[:take], labels[:take]))
            ids, labels, room = ids[take:], labels[take:], room - take
            if room == 0:
                rows.append(row)
                row, room = [], seq_len
    return rows + [row] if row else rows


def rows_from_segments(rows: list[list[tuple]], seq_len: int, pad_id: int,
                       stats: PackStats) -> dict:
    """(B, seq_len) input_ids, labels (-100 at each segment's first position), position_ids, doc_ids
    (-1: pad)."""
    shape = (len(rows), seq_len)
    out = {"input_ids": torch.full(shape, pad_id), "labels": torch.full(shape, IGNORE_INDEX),
           "position_ids": torch.zeros(shape, dtype=torch.long), "doc_ids": torch.full(shape, -1)}
    for r, segments in enumerate(rows):
        pos = 0
        for d, (ids, labels) in enumerate(segments):
            n = ids.numel()
            out["input_ids"][r, pos:pos + n] = ids
            # the previous segment's last token must not predict this
            out["labels"][r, pos + 1:pos + n] = labels[1:]
            out["position_ids"][r, pos:pos + n] = torch.arange(n)
            out["doc_ids"][r, pos:pos + n] = d
            pos += n
        stats.n_tokens, stats.n_pad = stats.n_tokens + pos, stats.n_pad + seq_len - pos
    stats.n_rows = len(rows)
    return out


def pack_sequences(samples: Sequence[Any], seq_len: int, *, pad_id: int = 0,
                   whole: bool = False) -> tuple[dict, PackStats]:
    """Documents in rows of `seq_len`: input_ids, labels, position_ids, doc_ids, each (B, seq_len);
    `whole`: never cut."""
    if int(seq_len) < 2:
        raise ValueError(f"seq_len must be >= 2, got {seq_len}")
    docs = [(torch.as_tensor(s["input_ids"]), torch.as_tensor(s.get("labels", s["input_ids"])))
            for s in samples]
    for i, (ids, labels) in enumerate(docs):
        if ids.dim() != 1 or labels.shape != ids.shape:
            raise ValueError(f"sample {i}: packing needs 1-D input_ids and labels of one shape, "
                             "got "
                             f"{tuple(ids.shape)} / {tuple(labels.shape)}")
    # stream_segments and rows_from_segments add their counts
    stats = PackStats(n_docs=len(samples))
    return rows_from_segments(stream_segments(docs, int(seq_len), stats, whole), int(seq_len),
                              pad_id, stats), stats


def block_causal_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """(B, 1, T, T) bool mask for SDPA: query i may attend key j iff j <= i and both are in one
    document."""
    if doc_ids.dim() != 2:
        raise ValueError(f"doc_ids must be (B, T), got shape {tuple(doc_ids.shape)}")
    causal = torch.ones(doc_ids.shape[1], doc_ids.shape[1], dtype=torch.bool,
                        device=doc_ids.device).tril()
    return ((doc_ids[:, :, None] == doc_ids[:, None, :]) & causal)[:, None]


def document_mask(doc_ids: torch.Tensor, kernel: str = "auto",
                  device: torch.device | str | None = None) -> torch.Tensor | BlockMask:
    """The block-causal mask of (B, T) doc_ids on `device` (default: theirs), the model's
    attention_mask: "flex", FlexAttention's BlockMask (a fused kernel skips the tiles no query may
    see), or "dense", block_causal_mask (B*T*T entries for SDPA, off its flash kernels); "auto":
    flex on CUDA only (torch 2.13's FlexAttention has no CPU backward). Made from CPU doc_ids (the
    collate's), a mask is kept: a batch whose documents have the lengths of one of the last few gets
    that mask back, not rebuilt (no host read: the key is the CPU copy's bytes)."""
    if kernel not in ("auto", "flex", "dense"):
        raise ValueError(f"block mask kernel {kernel!r}; choose 'auto', 'flex' or 'dense'")
    if device is None:
        device = doc_ids.device
    else:
        device = torch.device(device)
    on_cpu = type(doc_ids) is torch.Tensor and doc_ids.device.type == "cpu"
    if on_cpu:
        key = (doc_ids.numpy().tobytes(), tuple(doc_ids.shape), kernel, str(device))
    else:
        key = None
    if key in _RECENT_MASKS:
        return _RECENT_MASKS[key]
    ids = doc_ids
    if ids.device != device:  # the collate's CPU doc_ids to the device
        ids = ids.to(device)
    if kernel == "dense" or (kernel == "auto" and device.type != "cuda"):
        mask = block_causal_mask(ids)
    else:
        same_doc_causal = lambda b, h, q, kv: (ids[b, q] == ids[b, kv]) & (kv <= q)  # noqa: E731
        rows, length = ids.shape
        mask = flex_attention.create_block_mask(same_doc_causal, rows, None, length, length,
                                                device=device)
    if key is not None:
        _RECENT_MASKS[key] = mask
        if len(_RECENT_MASKS) > 8:  # the oldest goes: a few batches' masks, not one per batch
            del _RECENT_MASKS[next(iter(_RECENT_MASKS))]
    return mask


_RECENT_MASKS: dict[tuple, torch.Tensor | BlockMask] = {}


class PackedDataset(Dataset):
    """Rows of exactly seq_len packed from a dataset of samples; items are dicts of (seq_len,)
    tensors."""
    def __init__(self, samples: Sequence[Any], seq_len: int, *, pad_id: int = 0) -> None:
        self.rows, self.stats = pack_sequences(samples, seq_len, pad_id=pad_id)
        self.lengths = np.full(len(self), int(seq_len), dtype=np.int64)  # every row is seq_len long

    def __len__(self) -> int:
        return self.rows["input_ids"].shape[0]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {k: v[i] for k, v in self.rows.items()}


def collate_packed(rows: list[dict], block_mask: bool | str = True) -> dict:
    """Stacked packed rows: block_mask=True adds the (B,1,T,T) block-causal attention_mask, False
    none (plain causal); "auto", "flex" or "dense" ask the loop (train.forward_logits) for
    document_mask(doc_ids, kernel) on the device."""
    if not rows:
        raise ValueError("collate_packed got an empty list of rows")
    if block_mask not in (True, False, "auto", "flex", "dense"):
        raise ValueError(
            f"block_mask={block_mask!r}; choose True, False, 'auto', 'flex' or 'dense'"
        )
    out = {k: torch.stack([r[k] for r in rows]) for k in ("input_ids", "labels", "position_ids",
                                                          "doc_ids")}
    if block_mask is True:
        return {**out, "attention_mask": block_causal_mask(out["doc_ids"])}
    return {**out, "block_mask": block_mask} if block_mask else out


def is_oom_error(err: BaseException) -> bool:
    """True for an out-of-memory error: torch.OutOfMemoryError (memory.OutOfMemory too) or a
    RuntimeError saying so."""
    # cuBLAS/cuDNN on a full GPU: *_ALLOC_FAILED
    phrases = ("out of memory", "allocate memory", "status_alloc_failed")
    said_so = isinstance(err, RuntimeError) and any(p in str(err).lower() for p in phrases)
    return said_so or isinstance(err, (MemoryError, torch.OutOfMemoryError))


def step_groups(step: Sequence) -> list[list]:
    """A step as groups of samples: a flat list of samples is one group, a list of micro-batches one
    per micro-batch."""
    if step and isinstance(step[0], (list, tuple)):
        groups = [list(g) for g in step if len(g)]
    else:
        groups = [list(step)]
    if not sum(map(len, groups)):
        raise ValueError("run_step got no samples for this step")
    return groups


def row_length(sample: dict, seq_len: int | None) -> int:
    """Tokens of the sample's row once cut to seq_len."""
    if seq_len is None:
        return len(sample["input_ids"])
    return min(len(sample["input_ids"]), seq_len)


def split_step(groups: list[list], micro_batch_size: int | None, max_tokens: int | None,
               seq_len: int | None, multiple: int = 1) -> list[list]:
    """A step's micro-batches: each group filled greedily (fill_batches) under the sizes, a row
    counted at its length rounded up to `multiple` (as the collate pads it)."""
    padded = [[round_up(row_length(s, seq_len), multiple, seq_len) for s in g] for g in groups]
    return [[g[i] for i in b] for g, lengths in zip(groups, padded)
            for b in fill_batches(range(len(g)), lengths, max_tokens, micro_batch_size)]


def after_oom(sizes: tuple, micro: list[list], halvings: int, max_retries: int, seq_cut: float,
              seq_len: int | None) -> tuple[str, tuple, int | None]:
    """(kind, sizes, seq_len) after an OOM: halve the largest 2+ row micro-batch while retries last,
    else cut rows."""
    # halve what they use, not a cap none reaches (the same work again)
    several = [mb for mb in micro if len(mb) > 1]
    if halvings < max_retries and several:
        rows = max(len(mb) for mb in several)
        padded = max(len(mb) * max(row_length(s, seq_len) for s in mb) for mb in several)
        halved = []
        for cap, used in zip(sizes, (rows, padded)):
            if cap:  # None: no cap of that kind, and none after
                cap = max(1, min(cap, used) // 2)
            halved.append(cap)
        return "oom_halve", tuple(halved), seq_len
    longest = max(row_length(s, seq_len) for mb in micro for s in mb)
    return "oom_seq_cut", sizes, int(longest * seq_cut)


def memory_check(frac: float, sizes: tuple, start_sizes: tuple, seq_len: int | None,
                 seq_len_start: int | None,
                 uncut_len: int | None, high_water: float = 0.8, low_water: float = 0.5,
                 shrink: float = 0.8) -> tuple:
    """What a peak at `frac` of the budget does: (event kind or None, sizes, seq_len, uncut_len)
    after it."""
    if frac > high_water and max(s or 0 for s in sizes) > 1:
        return "shrink", tuple(s and max(1, int(s * shrink)) for s in sizes), seq_len, uncut_len
    # a cut seq_len comes back first (memory grows ~linearly with row length)
    if frac < low_water and uncut_len:
        if frac * uncut_len / seq_len < high_water:
            return "grow_seq_len", sizes, seq_len_start, None
        return None, sizes, seq_len, uncut_len
    grown = tuple(s and min(start, max(s + 1, round(s / shrink))) for s, start in zip(sizes,
                                                                                      start_sizes))
    if frac < low_water and grown != sizes and frac * max(g / s for g, s in zip(grown, sizes)
                                                          if s) < high_water:
        return "grow", grown, seq_len, uncut_len  # ... and with the micro-batch
    return None, sizes, seq_len, uncut_len


@dataclass
class BatchEvent:
    """One change the controller made: at which step, why, and the sizes after it."""
    step: int
    kind: str  # "shrink" | "grow" | "grow_seq_len" | "oom_halve" | "oom_seq_cut"
    micro_batch_size: int | None  # rows per micro-batch (None: no row limit)
    max_tokens: int | None  # padded tokens per micro-batch (None: no token limit)
    seq_len: int | None
    accum_steps: int  # micro-batches this step's samples take at the new sizes
    peak_bytes: int | None
    budget_bytes: int | None
    message: str = ""

    def __str__(self) -> str:
        sizes = {"micro": self.micro_batch_size, "max_tokens": self.max_tokens,
                 "accum": self.accum_steps,
                 "seq_len": self.seq_len}
        return f"{self.kind}({', '.join(f'{k} {v}' for k, v in sizes.items() if v is not None)})"


def _cut(value: Any, seq_len: int) -> Any:
    """A sample's 1-D tensor cut to seq_len; anything else as it is."""
    if torch.is_tensor(value) and value.dim() == 1:
        return value[:seq_len]
    return value


def _pinned(value: Any) -> Any:
    """A tensor in page-locked memory (the loop's non_blocking copies overlap GPU work)."""
    if torch.is_tensor(value):
        return value.pin_memory()
    return value


class AdaptiveBatchController:
    """Splits each step into micro-batches of micro_batch_size rows and/or max_tokens (rows x
    longest row), resized every check_every steps by memory_check (step peaks, _peak, vs
    meter.budget_bytes); an OOM retries at after_oom's sizes. pin_memory (CUDA): batches in
    page-locked memory, so the loop's non_blocking copies overlap GPU work."""
    def __init__(self, micro_batch_size: int | None = None, *, max_tokens: int | None = None,
                 meter: Any = None,
                 check_every: int = 100, high_water: float = 0.80, low_water: float = 0.50,
                 shrink: float = 0.8,
                 max_retries: int = 3, seq_cut: float = 0.8, seq_len: int | None = None,
                 min_seq_len: int = 8,
                 collate_fn: Callable[[list], Any] | None = None, zero_grad: Any = None,
                 pin_memory: bool = False, row_multiple: int = 1) -> None:
        rules = {"micro_batch_size and/or max_tokens": micro_batch_size is not None
                 or max_tokens is not None,
                 "micro_batch_size >= 1": micro_batch_size is None or micro_batch_size >= 1,
                 "max_tokens >= 1": max_tokens is None or max_tokens >= 1,
                 "check_every >= 1": check_every >= 1,
                 "max_retries >= 0": max_retries >= 0, "0 < shrink < 1": 0 < shrink < 1,
                 "0 < seq_cut < 1":
                 0 < seq_cut < 1,
                 "0 <= low_water < high_water <= 1": 0 <= low_water < high_water <= 1}
        for rule in (rule for rule, ok in rules.items() if not ok):
            raise ValueError(f"AdaptiveBatchController needs {rule}; got {micro_batch_size=}, "
                             f"{max_tokens=}, "
                             f"{check_every=}, {max_retries=}, {shrink=}, {seq_cut=}, "
                             f"{low_water=}, {high_water=}")
        # grow up to these
        self.micro_batch_size, self.max_tokens = self.start_sizes = (micro_batch_size, max_tokens)
        self.meter, self.check_every, self.max_retries, self.min_seq_len = (
            meter,
            check_every,
            max_retries,
            min_seq_len,
        )
        self.high_water, self.low_water, self.shrink, self.seq_cut = (
            high_water,
            low_water,
            shrink,
            seq_cut,
        )
        # uncut_len: longest row before a cut
        self.seq_len, self.seq_len_start, self.uncut_len = seq_len, seq_len, None
        self.collate_fn, self.zero_grad, self.pin_memory = (
            collate_fn or pad_collate,
            zero_grad,
            pin_memory,
        )
        self.row_multiple = row_multiple  # a row counts at the length the collate pads it to
        self.step = self.samples_in = self.samples_seen = self.oom_count = self.n_truncated = (
            self.tokens_truncated
        ) = 0
        # _window_peak: highest step peak since the last memory check
        self.events, self._window_peak = [], 0

    sizes = property(lambda self: (self.micro_batch_size, self.max_tokens),
                     doc="(micro_batch_size, max_tokens) now")

    def _collate(self, samples: list) -> Any:
        """collate_fn of the samples cut to seq_len (collate_fn may be any callable: the controller
        cuts them)."""
        rows = []
        for s in samples:
            if row_length(s, self.seq_len) != len(s["input_ids"]):
                s = {k: _cut(v, self.seq_len) for k, v in s.items()}
            rows.append(s)
        batch = self.collate_fn(rows)
        if self.pin_memory:
            batch = {k: _pinned(v) for k, v in batch.items()}
        return batch

    def _peak(self) -> int:
        """The meter's peak since its reset: peak_in_use() (what an OOM depends on) if it has one,
        else peak()."""
        return int(getattr(self.meter, "peak_in_use", self.meter.peak)())

    def _event(self, kind: str, groups: list[list], peak: int | None, message: str) -> None:
        accum = len(split_step(groups, *self.sizes, self.seq_len, self.row_multiple))
        self.events.append(BatchEvent(self.step, kind, *self.sizes, self.seq_len, accum, peak,
                                      getattr(self.meter, "budget_bytes", None), message))

    def run_step(self, step: Sequence, accumulate_fn: Callable[[list], dict],
                 zero_grad: Any = None) -> dict:
        """One step's forward+backward at the current sizes, recovering from OOM (the caller resets
        the meter peak)."""
        groups = step_groups(step)
        n, first_event, halvings = sum(map(len, groups)), len(self.events), 0
        self.samples_in += n
        while True:
            micro = split_step(groups, *self.sizes, self.seq_len, self.row_multiple)
            try:
                stats = accumulate_fn([self._collate(mb) for mb in micro])
                break
            except Exception as err:  # noqa: BLE001 - only OOMs are handled, the rest re-raised
                if not is_oom_error(err):
                    raise
                message = f"{type(err).__name__}: {(str(err).splitlines() or [''])[0][:200]}"
            # Outside the except block: the traceback (and the activations its frames hold) is gone.
            halvings = self._recover(groups, micro, halvings, message, zero_grad)
        excess = [len(s["input_ids"]) - row_length(s, self.seq_len) for g in groups for s in g]
        self.n_truncated += sum(map(bool, excess))
        self.tokens_truncated += sum(excess)
        self.samples_seen, self.step = self.samples_seen + n, self.step + 1
        used = {"micro_batch_size": self.micro_batch_size, "max_tokens": self.max_tokens,
                "seq_len": self.seq_len}
        if self.meter is not None:
            self._window_peak = max(self._window_peak, self._peak())
        # read live: the budget may change during a run
        budget = getattr(self.meter, "budget_bytes", None)
        # sizes of the next step by memory_check
        if self.step % self.check_every == 0 and budget and self._window_peak:
            outside = getattr(self.meter, "end_window", lambda: 0)()  # the driver, once a decision
            peak, self._window_peak = self._window_peak + outside, 0
            kind, (self.micro_batch_size, self.max_tokens), self.seq_len, self.uncut_len = (
                memory_check(
                    peak / budget,
                    self.sizes,
                    self.start_sizes,
                    self.seq_len,
                    self.seq_len_start,
                    self.uncut_len,
                    self.high_water,
                    self.low_water,
                    self.shrink,
                )
            )
            if kind:
                self._event(kind, groups, peak, f"peak {peak / budget:.0%} of the budget")
        return {**stats, **used, "accum_steps": len(micro), "events": self.events[first_event:]}

    def _recover(self, groups: list[list], micro: list[list], halvings: int, message: str,
                 zero_grad: Any) -> int:
        """After an OOM: zero the partial gradients, free memory, then halve or cut (after_oom);
        returns halvings."""
        target = zero_grad if zero_grad is not None else self.zero_grad
        # the retry would add to the failed attempt's partial gradients: refuse, loudly
        require(target is not None, "AdaptiveBatchController caught an out-of-memory error but has "
                "no zero_grad to clear the failed attempt's partial gradients: pass "
                "zero_grad=model (or a callable)", RuntimeError)
        if hasattr(target, "zero_grad"):
            target.zero_grad(set_to_none=True)
        else:
            target()
        gc.collect()
        empty_cache(getattr(self.meter, "device", None))  # the cached blocks back (CUDA, MPS)
        self.oom_count += 1
        if self.meter is None:
            peak = None
        else:
            peak = self._peak()
        if self.meter is not None:
            self.meter.reset_peak()  # the failed attempt's peak must not trigger a shrink as well
        kind, sizes, seq_len = after_oom(self.sizes, micro, halvings, self.max_retries,
                                         self.seq_cut, self.seq_len)
        if kind == "oom_seq_cut":
            if seq_len < self.min_seq_len:
                raise RuntimeError(f"OOM at step {self.step} (micro_batch_size={sizes[0]}, "
                                   f"max_tokens={sizes[1]}): "
                                   f"rows cut to {seq_len} tokens are below "
                                   f"min_seq_len={self.min_seq_len} ({message})")
            self.uncut_len = self.uncut_len or max(row_length(s, self.seq_len) for mb in micro
                                                   for s in mb)
        (self.micro_batch_size, self.max_tokens), self.seq_len = sizes, seq_len
        self._event(kind, groups, peak, message)
        # shorter rows get a fresh round of halvings
        return halvings + 1 if kind == "oom_halve" else 0

    @property
    def stats(self) -> dict:
        """Sizes and totals: steps, OOMs recovered, samples in / seen / lost, truncated samples and
        tokens, events."""
        return {**{k: getattr(self, k) for k in self._STATE},
                "oom_events_recovered": self.oom_count,
                "samples_lost": self.samples_in - self.samples_seen, "n_events": len(self.events)}

    _STATE = ("micro_batch_size", "max_tokens", "seq_len", "uncut_len", "step", "samples_in",
              "samples_seen",
              "n_truncated", "tokens_truncated", "oom_count")

    def state_dict(self) -> dict:
        """Sizes, step, counters and events as plain types (a weights_only checkpoint holds them).
        """
        return {**{k: getattr(self, k) for k in self._STATE}, "events": [dict(e.__dict__)
                                                                         for e in self.events]}

    def load_state_dict(self, state: dict) -> None:
        """Restore the state saved by state_dict()."""
        missing = [k for k in ("micro_batch_size", "max_tokens", "seq_len", "step")
                   if k not in state]
        if missing:
            raise ValueError(f"controller state is missing keys {missing} (has {sorted(state)})")
        for key in self._STATE:
            setattr(self, key, state.get(key, None if key == "uncut_len" else 0))
        self.events = [BatchEvent(**e) for e in state.get("events", [])]


class TokenBudgetSteps:
    """Steps of `accum_steps` of `sampler`'s batches (lists of samples; resumable, by epoch) for
    fit(controller=...)."""
    def __init__(self, dataset: Sequence, sampler: TokenBudgetBatchSampler,
                 accum_steps: int) -> None:
        require(int(accum_steps) >= 1, f"accum_steps must be >= 1, got {accum_steps}")
        require(len(sampler.raw_lengths) == len(dataset), "TokenBudgetSteps needs a sampler built "
                f"from this dataset's lengths (it has {len(sampler.raw_lengths)}, the dataset "
                f"{len(dataset)})")
        self.dataset, self.batch_sampler, self.accum_steps = dataset, sampler, int(accum_steps)

    def set_epoch(self, epoch: int) -> None:
        """Select the sampler's epoch."""
        self.batch_sampler.set_epoch(epoch)

    def __len__(self) -> int:
        return math.ceil(len(self.batch_sampler) / self.accum_steps)

    def __iter__(self) -> Iterator[list[list]]:
        batches, k = self.batch_sampler.batches(), self.accum_steps
        return (
            [[self.dataset[i] for i in b] for b in batches[s : s + k]]
            for s in range(0, len(batches), k)
        )
