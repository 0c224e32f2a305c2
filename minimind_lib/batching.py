"""Dynamic batching: token-budget batches, sequence packing, and a memory-adaptive micro-batch controller.

Three ways to spend fewer FLOPs on padding and to survive a tight memory budget:

* ``TokenBudgetBatchSampler`` groups samples of similar length (sorted inside shuffled
  megabatches, as fairseq's ``max_tokens`` and transformers' ``group_by_length`` do) so that
  every batch's padded size, rows x longest row, stays within ``max_tokens``.
* ``pack_sequences`` / ``PackedDataset`` concatenate documents into rows of exactly ``seq_len``
  with document ids, per-document ``position_ids`` and a block-causal mask so that documents
  do not attend to (or predict) each other.
* ``AdaptiveBatchController`` watches a memory meter, shrinks or grows the micro-batch while
  keeping the optimizer step's samples (hence its tokens) unchanged, and recovers from
  out-of-memory errors by retrying the same samples with a smaller micro-batch.
"""

from __future__ import annotations

import gc
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler

IGNORE_INDEX = -100


# --------------------------------------------------------------------------------------------
# Token-budget batches
# --------------------------------------------------------------------------------------------


def padded_tokens(lengths: Sequence[int]) -> int:
    """Padded size of one batch: rows x longest row."""
    return len(lengths) * max(lengths) if len(lengths) else 0


def padding_fraction(batches_lengths: Sequence[Sequence[int]]) -> float:
    """Fraction of the padded tokens of these batches that are padding."""
    real = sum(sum(b) for b in batches_lengths)
    padded = sum(padded_tokens(b) for b in batches_lengths)
    return 1.0 - real / padded if padded else 0.0


class TokenBudgetBatchSampler(Sampler[list[int]]):
    """Batches of indices whose padded size (rows x longest row) stays within ``max_tokens``.

    Each epoch: shuffle the indices (seed + epoch), cut them into megabatches of
    ``megabatch_mult`` typical batches, sort each megabatch by length (longest first), fill
    batches greedily up to the budget, then shuffle the batches. Every kept sample appears
    exactly once per epoch. A sample longer than ``min(max_tokens, max_len)`` is either
    truncated to that cap (``"truncate"``: its budget length is the cap and the collate step
    must cut it, see ``truncate_sample``) or left out (``"reject"``); both are counted in
    ``stats`` and listed in ``truncated_indices`` / ``rejected_indices``, never silent.

    ``warmup_batches=N`` puts the N shortest batches first, shortest first, in epoch 0 only
    (a shorter-first warm-up whose effect notebook 06 measures rather than assumes).
    Use it as ``DataLoader(ds, batch_sampler=sampler, ...)`` and call ``set_epoch(e)`` each epoch.
    ``state_dict()`` counts batches handed to the DataLoader; with ``num_workers > 0`` the loader prefetches,
    so count consumed batches in the loop (as train.DataStream does) or resume with ``num_workers=0``.
    """

    def __init__(
        self,
        lengths: Sequence[int] | np.ndarray,
        max_tokens: int,
        max_batch_size: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        megabatch_mult: int = 50,
        drop_or_truncate: str = "truncate",
        max_len: int | None = None,
        warmup_batches: int = 0,
    ) -> None:
        lengths = np.asarray(lengths)
        if lengths.ndim != 1:
            raise ValueError(f"lengths must be a 1-D sequence of ints, got shape {lengths.shape}")
        if lengths.size and not np.issubdtype(lengths.dtype, np.integer):
            raise ValueError(f"lengths must be integers, got dtype {lengths.dtype}")
        if lengths.size and lengths.min() < 1:
            bad = int(np.argmin(lengths))
            raise ValueError(f"lengths[{bad}] = {int(lengths[bad])}: every sample needs at least 1 token")
        if int(max_tokens) < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        if max_batch_size is not None and int(max_batch_size) < 1:
            raise ValueError(f"max_batch_size must be >= 1 or None, got {max_batch_size}")
        if max_len is not None and int(max_len) < 1:
            raise ValueError(f"max_len must be >= 1 or None, got {max_len}")
        if drop_or_truncate not in ("truncate", "reject"):
            raise ValueError(f"drop_or_truncate must be 'truncate' or 'reject', got {drop_or_truncate!r}")
        if int(megabatch_mult) < 1:
            raise ValueError(f"megabatch_mult must be >= 1, got {megabatch_mult}")
        if int(warmup_batches) < 0:
            raise ValueError(f"warmup_batches must be >= 0, got {warmup_batches}")

        self.max_tokens = int(max_tokens)
        self.max_batch_size = None if max_batch_size is None else int(max_batch_size)
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.megabatch_mult = int(megabatch_mult)
        self.drop_or_truncate = drop_or_truncate
        self.max_len = None if max_len is None else int(max_len)
        self.warmup_batches = int(warmup_batches)
        # The longest row a batch may hold: one sample alone must fit the budget.
        self.cap = self.max_tokens if self.max_len is None else min(self.max_tokens, self.max_len)

        self.raw_lengths = lengths.astype(np.int64)
        over = np.flatnonzero(self.raw_lengths > self.cap)
        if drop_or_truncate == "reject":
            self.rejected_indices = over.tolist()
            self.truncated_indices: list[int] = []
            keep = np.ones(len(lengths), dtype=bool)
            keep[over] = False
            self.kept_indices = np.flatnonzero(keep)
        else:
            self.rejected_indices = []
            self.truncated_indices = over.tolist()
            self.kept_indices = np.arange(len(lengths))
        # Lengths as batched: over-long samples count as `cap` tokens (the collate step cuts them).
        self.lengths = np.minimum(self.raw_lengths, self.cap)

        typical = float(np.median(self.lengths[self.kept_indices])) if self.kept_indices.size else 1.0
        rows = max(1, self.max_tokens // max(1, int(typical)))
        if self.max_batch_size is not None:
            rows = min(rows, self.max_batch_size)
        self.megabatch_size = self.megabatch_mult * rows

        self.epoch = 0
        self._served = 0  # batches of the current epoch already handed out
        self._resume_from = 0  # set by load_state_dict: skip this many batches on the next __iter__
        self._cache: tuple[int, list[list[int]]] | None = None

    # -- building an epoch ----------------------------------------------------------------
    def _fill(self, order: np.ndarray) -> list[list[int]]:
        """Greedy batches of `order` (already sorted inside megabatches) within the budget."""
        batches: list[list[int]] = []
        cur: list[int] = []
        cur_max = 0
        for idx in order.tolist():
            n = int(self.lengths[idx])
            new_max = max(cur_max, n)
            fits = (len(cur) + 1) * new_max <= self.max_tokens
            if self.max_batch_size is not None:
                fits = fits and len(cur) + 1 <= self.max_batch_size
            if cur and not fits:
                batches.append(cur)
                cur, new_max = [], n
            cur.append(idx)
            cur_max = new_max
        if cur:
            batches.append(cur)
        return batches

    def batches(self, epoch: int | None = None) -> list[list[int]]:
        """All batches of an epoch, in the order they are served (deterministic given seed + epoch)."""
        epoch = self.epoch if epoch is None else int(epoch)
        if self._cache is not None and self._cache[0] == epoch:
            return self._cache[1]
        rng = np.random.default_rng([self.seed, epoch])
        idx = self.kept_indices.copy()
        if self.shuffle:
            idx = rng.permutation(idx)
        out: list[list[int]] = []
        step = self.megabatch_size if self.shuffle else max(1, len(idx))
        for start in range(0, len(idx), step):
            mega = idx[start : start + step]
            # Stable sort, longest first: ties keep the shuffled order, so it stays seeded.
            mega = mega[np.argsort(-self.lengths[mega], kind="stable")]
            out.extend(self._fill(mega))
        if self.shuffle:
            perm = rng.permutation(len(out))
            out = [out[i] for i in perm]
        if self.warmup_batches and epoch == 0:
            longest = [int(self.lengths[b].max()) for b in out]
            first = sorted(range(len(out)), key=lambda i: (longest[i], i))[: self.warmup_batches]
            chosen = set(first)
            out = [out[i] for i in first] + [b for i, b in enumerate(out) if i not in chosen]
        self._cache = (epoch, out)
        return out

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose order the next __iter__ serves (resets the resume point)."""
        if int(epoch) != self.epoch:
            self._served = 0
            self._resume_from = 0
        self.epoch = int(epoch)

    def __iter__(self) -> Iterator[list[int]]:
        batches = self.batches()
        start, self._resume_from = self._resume_from, 0
        self._served = start
        for b in batches[start:]:
            self._served += 1
            yield list(b)

    def __len__(self) -> int:
        return len(self.batches())

    # -- bookkeeping ----------------------------------------------------------------------
    @property
    def stats(self) -> dict:
        """Counts for the current epoch: samples kept/truncated/rejected, batches, padding."""
        batches = self.batches()
        real = int(self.lengths[self.kept_indices].sum())
        padded = int(sum(len(b) * int(self.lengths[b].max()) for b in batches))
        return {
            "n_samples": int(len(self.raw_lengths)),
            "n_used": int(len(self.kept_indices)),
            "n_truncated": len(self.truncated_indices),
            "tokens_truncated": int((self.raw_lengths - self.lengths)[self.truncated_indices].sum()),
            "n_rejected": len(self.rejected_indices),
            "n_batches": len(batches),
            "max_tokens": self.max_tokens,
            "cap": self.cap,
            "real_tokens": real,
            "padded_tokens": padded,
            "padding_fraction": 1.0 - real / padded if padded else 0.0,
        }

    def state_dict(self) -> dict:
        """Where the sampler is: epoch and batches already served (resume mid-epoch from here)."""
        return {"epoch": self.epoch, "batches_served": self._served, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        """Resume: the next __iter__ serves the remaining batches of the saved epoch."""
        for key in ("epoch", "batches_served"):
            if key not in state:
                raise ValueError(f"sampler state has no key {key!r} (keys: {sorted(state)})")
        if "seed" in state and int(state["seed"]) != self.seed:
            raise ValueError(f"sampler state was saved with seed={state['seed']}, this sampler has seed={self.seed}")
        self.epoch = int(state["epoch"])
        n = len(self.batches())
        served = int(state["batches_served"])
        if not 0 <= served <= n:
            raise ValueError(f"batches_served={served} is outside 0..{n} for epoch {self.epoch}")
        self._served = served
        self._resume_from = served


def truncate_sample(sample: dict, max_len: int) -> dict:
    """A sample with every 1-D tensor field cut to its first `max_len` tokens."""
    return {
        k: (v[:max_len] if isinstance(v, torch.Tensor) and v.dim() == 1 else v) for k, v in sample.items()
    }


def pad_collate(samples: list[dict], pad_id: int = 0, max_len: int | None = None) -> dict:
    """Pad to the longest sample (optionally cutting each to `max_len`): input_ids, labels, attention_mask."""
    if not samples:
        raise ValueError("pad_collate got an empty list of samples")
    if max_len is not None:
        samples = [truncate_sample(s, max_len) for s in samples]
    T = max(int(s["input_ids"].numel()) for s in samples)
    B = len(samples)
    input_ids = torch.full((B, T), pad_id, dtype=torch.long)
    labels = torch.full((B, T), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros((B, T), dtype=torch.long)
    for i, s in enumerate(samples):
        n = int(s["input_ids"].numel())
        input_ids[i, :n] = s["input_ids"]
        labels[i, :n] = s["labels"] if "labels" in s else s["input_ids"]
        attention_mask[i, :n] = 1
    return {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}


# --------------------------------------------------------------------------------------------
# Packing
# --------------------------------------------------------------------------------------------


@dataclass
class PackStats:
    """What packing did: documents in, rows out, and every cut it made."""

    n_docs: int = 0
    n_rows: int = 0
    n_split: int = 0  # documents cut across rows (strategy "stream", or "first_fit" with split_long)
    n_truncated: int = 0  # documents longer than seq_len cut to seq_len (strategy "first_fit")
    tokens_truncated: int = 0
    n_pad: int = 0  # padding tokens at the ends of rows
    n_tokens: int = 0  # real tokens placed in rows

    @property
    def padding_fraction(self) -> float:
        """Padding tokens / all row tokens."""
        total = self.n_pad + self.n_tokens
        return self.n_pad / total if total else 0.0

    def to_dict(self) -> dict:
        """Counts as a plain dict, with the padding fraction."""
        return {**self.__dict__, "padding_fraction": self.padding_fraction}


def _doc_tokens(sample: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, labels) of a sample given as a dict, a tensor or a list of ints."""
    if isinstance(sample, dict):
        ids = torch.as_tensor(sample["input_ids"], dtype=torch.long)
        labels = torch.as_tensor(sample.get("labels", ids), dtype=torch.long)
    else:
        ids = torch.as_tensor(sample, dtype=torch.long)
        labels = ids
    if ids.dim() != 1 or labels.shape != ids.shape:
        raise ValueError(f"a packed sample needs 1-D input_ids and labels of one shape, got {tuple(ids.shape)} / {tuple(labels.shape)}")
    return ids, labels


def pack_sequences(
    samples: Sequence[Any],
    seq_len: int,
    *,
    pad_id: int = 0,
    strategy: str = "stream",
) -> tuple[dict[str, torch.Tensor], PackStats]:
    """Pack documents into rows of exactly `seq_len`: input_ids, labels, position_ids, doc_ids (B, seq_len).

    ``"stream"`` concatenates documents in order and cuts rows at seq_len (a cut document
    continues in the next row as a new segment; counted in ``n_split``); only the last row is
    padded. ``"first_fit"`` keeps every document whole in one row (first-fit decreasing;
    longer-than-seq_len documents are cut to seq_len, counted in ``n_truncated``) and pads rows.
    Labels are -100 at each segment's first position, so no token predicts across a boundary,
    and on padding. position_ids restart at 0 in each segment; doc_ids number the segments of a
    row 0, 1, ... and are -1 on padding.
    """
    if int(seq_len) < 2:
        raise ValueError(f"seq_len must be >= 2, got {seq_len}")
    if strategy not in ("stream", "first_fit"):
        raise ValueError(f"strategy must be 'stream' or 'first_fit', got {strategy!r}")
    seq_len = int(seq_len)
    stats = PackStats(n_docs=len(samples))
    docs = [_doc_tokens(s) for s in samples]

    rows: list[list[tuple[torch.Tensor, torch.Tensor]]] = []  # each row: list of segments (ids, labels)
    if strategy == "stream":
        row: list[tuple[torch.Tensor, torch.Tensor]] = []
        room = seq_len
        for ids, labels in docs:
            if ids.numel() == 0:
                continue
            pieces = 0
            while ids.numel():
                take = min(room, ids.numel())
                row.append((ids[:take], labels[:take]))
                ids, labels = ids[take:], labels[take:]
                room -= take
                pieces += 1
                if room == 0:
                    rows.append(row)
                    row, room = [], seq_len
            stats.n_split += int(pieces > 1)
        if row:
            rows.append(row)
    else:
        order = sorted(range(len(docs)), key=lambda i: -docs[i][0].numel())
        rooms: list[int] = []
        for i in order:
            ids, labels = docs[i]
            if ids.numel() == 0:
                continue
            if ids.numel() > seq_len:
                stats.n_truncated += 1
                stats.tokens_truncated += ids.numel() - seq_len
                ids, labels = ids[:seq_len], labels[:seq_len]
            n = ids.numel()
            for r, room in enumerate(rooms):
                if room >= n:
                    rows[r].append((ids, labels))
                    rooms[r] -= n
                    break
            else:
                rows.append([(ids, labels)])
                rooms.append(seq_len - n)

    B = len(rows)
    out = {
        "input_ids": torch.full((B, seq_len), pad_id, dtype=torch.long),
        "labels": torch.full((B, seq_len), IGNORE_INDEX, dtype=torch.long),
        "position_ids": torch.zeros((B, seq_len), dtype=torch.long),
        "doc_ids": torch.full((B, seq_len), -1, dtype=torch.long),
    }
    for r, segments in enumerate(rows):
        pos = 0
        for d, (ids, labels) in enumerate(segments):
            n = ids.numel()
            out["input_ids"][r, pos : pos + n] = ids
            seg_labels = labels.clone()
            seg_labels[0] = IGNORE_INDEX  # the previous segment's last token must not predict this one
            out["labels"][r, pos : pos + n] = seg_labels
            out["position_ids"][r, pos : pos + n] = torch.arange(n)
            out["doc_ids"][r, pos : pos + n] = d
            pos += n
        stats.n_tokens += pos
        stats.n_pad += seq_len - pos
    stats.n_rows = B
    return out, stats


def block_causal_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """(B, 1, T, T) bool mask for SDPA: query i may attend key j iff j <= i and both are in one document."""
    if doc_ids.dim() != 2:
        raise ValueError(f"doc_ids must be (B, T), got shape {tuple(doc_ids.shape)}")
    T = doc_ids.shape[1]
    same = doc_ids[:, :, None] == doc_ids[:, None, :]
    causal = torch.ones(T, T, dtype=torch.bool, device=doc_ids.device).tril()
    return (same & causal)[:, None]


def flex_attention_available() -> bool:
    """Whether torch.nn.attention.flex_attention can be imported here."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention  # noqa: F401
    except Exception:
        return False
    return True


def flex_block_mask(doc_ids: torch.Tensor, n_heads: int | None = None):
    """flex_attention's BlockMask for block-causal attention over doc_ids (B, T), or None if unavailable."""
    if not flex_attention_available():
        return None
    from torch.nn.attention.flex_attention import create_block_mask

    docs = doc_ids

    def mask_mod(b, h, q, kv):
        return (docs[b, q] == docs[b, kv]) & (q >= kv)

    B, T = doc_ids.shape
    return create_block_mask(mask_mod, B, n_heads, T, T, device=str(doc_ids.device))


def packed_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_ids: torch.Tensor, backend: str = "sdpa", block_mask=None,
    flex_fn: Callable | None = None,
) -> torch.Tensor:
    """Block-causal attention of (B, H, T, D) q/k/v with SDPA and a dense bool mask, or with flex_attention."""
    if backend == "sdpa":
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=block_causal_mask(doc_ids))
    if backend == "flex":
        if not flex_attention_available():
            raise RuntimeError("flex_attention is not available in this torch; use backend='sdpa'")
        import warnings

        from torch.nn.attention.flex_attention import flex_attention

        block_mask = block_mask if block_mask is not None else flex_block_mask(doc_ids, None)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # eager flex warns that it is unfused; we measure that ourselves
            return (flex_fn or flex_attention)(q, k, v, block_mask=block_mask)
    raise ValueError(f"backend must be 'sdpa' or 'flex', got {backend!r}")


class PackedDataset(Dataset):
    """Rows of exactly seq_len packed from a dataset of samples; items are dicts of (seq_len,) tensors."""

    def __init__(self, samples: Sequence[Any], seq_len: int, *, pad_id: int = 0, strategy: str = "stream") -> None:
        rows, self.stats = pack_sequences(samples, seq_len, pad_id=pad_id, strategy=strategy)
        self.rows = rows
        self.seq_len = int(seq_len)

    def __len__(self) -> int:
        return self.rows["input_ids"].shape[0]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {k: v[i] for k, v in self.rows.items()}

    @property
    def lengths(self) -> np.ndarray:
        """Every row is seq_len long."""
        return np.full(len(self), self.seq_len, dtype=np.int64)


def collate_packed(rows: list[dict], block_mask: bool = True) -> dict[str, torch.Tensor]:
    """Stack packed rows; attention_mask is the (B,1,T,T) block-causal mask, or absent (plain causal) if not block_mask."""
    if not rows:
        raise ValueError("collate_packed got an empty list of rows")
    out = {k: torch.stack([r[k] for r in rows]) for k in ("input_ids", "labels", "position_ids", "doc_ids")}
    if block_mask:
        out["attention_mask"] = block_causal_mask(out["doc_ids"])
    return out


# --------------------------------------------------------------------------------------------
# Memory-adaptive micro-batches with OOM recovery
# --------------------------------------------------------------------------------------------

# cuBLAS and cuDNN report a full GPU as a failed workspace allocation, not as torch.OutOfMemoryError
_OOM_PHRASES = ("out of memory", "can't allocate memory", "cannot allocate memory", "cublas_status_alloc_failed",
                "cudnn_status_alloc_failed")


def is_oom_error(err: BaseException) -> bool:
    """True for an out-of-memory error: torch.OutOfMemoryError, memory.OutOfMemory, or a RuntimeError saying so."""
    oom_type = getattr(torch, "OutOfMemoryError", None) or getattr(torch.cuda, "OutOfMemoryError", None)
    if oom_type is not None and isinstance(err, oom_type):
        return True
    try:
        from .memory import OutOfMemory  # the CPU budget's error (may not exist in a stripped-down install)

        if isinstance(err, OutOfMemory):
            return True
    except ImportError:
        pass
    if isinstance(err, (RuntimeError, MemoryError)):
        msg = str(err).lower()
        return isinstance(err, MemoryError) or any(p in msg for p in _OOM_PHRASES)
    return False


def free_memory() -> None:
    """Drop what Python still holds and give cached CUDA blocks back (after an OOM)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _meter_peak(meter: Any) -> int | None:
    """Peak bytes since the last reset from a MemoryMeter-like object or a callable (None: no reading)."""
    if meter is None:
        return None
    for name in ("peak_bytes", "peak", "max_bytes"):
        attr = getattr(meter, name, None)
        if attr is None:
            continue
        value = attr() if callable(attr) else attr
        if value is not None:
            return int(value)
    if callable(meter):
        return int(meter())
    raise TypeError(f"cannot read a peak from meter {meter!r}: give it peak_bytes()/peak() or pass a callable")


def _meter_reset(meter: Any) -> None:
    """Start a new peak window on the meter, if it can."""
    for name in ("reset_peak", "reset_peak_stats", "reset"):
        fn = getattr(meter, name, None)
        if callable(fn):
            fn()
            return


def _meter_budget(meter: Any) -> int | None:
    """The meter's own budget in bytes, if it has one."""
    for name in ("budget_bytes", "budget"):
        value = getattr(meter, name, None)
        if value is not None and not callable(value):
            return int(value)
    return None


@dataclass
class BatchEvent:
    """One change the controller made: when, why, and the sizes before and after."""

    step: int
    kind: str  # "shrink" | "grow" | "oom_halve" | "oom_seq_cut"
    old_micro_batch: int
    new_micro_batch: int
    accum: int  # micro-batches per optimizer step after the change (for this step's samples)
    seq_len: int | None
    peak_bytes: int | None
    budget_bytes: int | None
    message: str = ""

    def to_dict(self) -> dict:
        """The event as a plain dict (a row of the metrics frame)."""
        return dict(self.__dict__)

    def __str__(self) -> str:
        seq = "" if self.seq_len is None else f", seq_len {self.seq_len}"
        return f"{self.kind}(micro {self.old_micro_batch}->{self.new_micro_batch}, accum {self.accum}{seq})"


class AdaptiveBatchController:
    """Splits each optimizer step's samples into micro-batches whose size follows the memory budget.

    The samples of a step are fixed by the training loop, so the effective batch (its tokens)
    never changes: a smaller micro-batch only means more accumulation micro-batches.
    Every `check_every` steps the meter's peak is compared to the budget: above
    ``high_water`` the micro-batch shrinks (x `shrink`), below ``low_water`` it grows back
    (up to the starting size, and only if the predicted peak stays under high_water).
    An out-of-memory error inside `accumulate_fn` zeroes the gradients, frees memory, halves
    the micro-batch and retries the same samples (up to `max_retries` halvings per step), then
    cuts the sequence length to `seq_cut` of itself (truncations counted). Events are kept in
    ``events``; ``samples_seen`` counts samples of successful attempts only.
    """

    def __init__(
        self,
        micro_batch_size: int,
        *,
        meter: Any = None,
        budget_bytes: int | None = None,
        check_every: int = 100,
        high_water: float = 0.80,
        low_water: float = 0.50,
        shrink: float = 0.8,
        max_retries: int = 3,
        seq_cut: float = 0.8,
        seq_len: int | None = None,
        min_seq_len: int = 8,
        collate_fn: Callable[[list], Any] | None = None,
        zero_grad: Callable[[], None] | Any = None,
        max_micro_batch: int | None = None,
    ) -> None:
        if int(micro_batch_size) < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        if int(check_every) < 1:
            raise ValueError(f"check_every must be >= 1, got {check_every}")
        if not 0.0 <= low_water < high_water <= 1.0:
            raise ValueError(f"need 0 <= low_water < high_water <= 1, got low_water={low_water}, high_water={high_water}")
        if not 0.0 < shrink < 1.0:
            raise ValueError(f"shrink must be in (0, 1), got {shrink}")
        if not 0.0 < seq_cut < 1.0:
            raise ValueError(f"seq_cut must be in (0, 1), got {seq_cut}")
        if int(max_retries) < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries}")
        if budget_bytes is not None and int(budget_bytes) <= 0:
            raise ValueError(f"budget_bytes must be > 0 or None, got {budget_bytes}")
        self.micro_batch_size = int(micro_batch_size)
        self.max_micro_batch = int(max_micro_batch or micro_batch_size)
        self.meter = meter
        self.budget_bytes = int(budget_bytes) if budget_bytes is not None else _meter_budget(meter)
        self.check_every = int(check_every)
        self.high_water, self.low_water = float(high_water), float(low_water)
        self.shrink, self.seq_cut = float(shrink), float(seq_cut)
        self.max_retries = int(max_retries)
        self.seq_len = None if seq_len is None else int(seq_len)
        self.min_seq_len = int(min_seq_len)
        self.collate_fn = collate_fn or pad_collate
        self.zero_grad = zero_grad
        self.step = 0  # optimizer steps completed through run_step
        self.events: list[BatchEvent] = []
        self.samples_seen = 0  # samples of successful attempts
        self.samples_in = 0  # samples handed to run_step
        self.n_truncated = 0  # samples cut by a sequence-length cut
        self.tokens_truncated = 0
        self.oom_count = 0
        self._window_peak: int | None = None  # highest per-step peak since the last memory check
        self.warned_no_zero_grad = False

    # -- helpers --------------------------------------------------------------------------
    @property
    def accum_for(self) -> Callable[[int], int]:
        """accum_for(n_samples): micro-batches a step of n samples takes at the current size."""
        return lambda n: max(1, math.ceil(n / self.micro_batch_size))

    def _event(self, kind: str, old: int, n_samples: int, peak: int | None, message: str = "") -> BatchEvent:
        ev = BatchEvent(
            step=self.step, kind=kind, old_micro_batch=old, new_micro_batch=self.micro_batch_size,
            accum=self.accum_for(n_samples), seq_len=self.seq_len, peak_bytes=peak,
            budget_bytes=self.budget_bytes, message=message,
        )
        self.events.append(ev)
        return ev

    def _zero_grads(self, zero_grad: Any = None) -> None:
        target = zero_grad if zero_grad is not None else self.zero_grad
        if target is None:
            # Without it the retry would add to the failed attempt's partial gradients: say so, loudly.
            raise RuntimeError(
                "AdaptiveBatchController caught an out-of-memory error but has no zero_grad to clear the failed "
                "attempt's partial gradients: pass zero_grad=model (or an optimizer, or a callable)"
            )
        if hasattr(target, "zero_grad"):
            target.zero_grad(set_to_none=True)
        else:
            target()

    def _cut(self, samples: list) -> list:
        """Samples cut to the current seq_len (dict samples only; counted once per sample per cut)."""
        if self.seq_len is None:
            return samples
        out = []
        for s in samples:
            if isinstance(s, dict) and isinstance(s.get("input_ids"), torch.Tensor) and s["input_ids"].numel() > self.seq_len:
                self.n_truncated += 1
                self.tokens_truncated += int(s["input_ids"].numel()) - self.seq_len
                s = truncate_sample(s, self.seq_len)
            out.append(s)
        return out

    def split(self, samples: list) -> list[list]:
        """The samples in micro-batches of the current size, in order."""
        m = self.micro_batch_size
        return [samples[i : i + m] for i in range(0, len(samples), m)]

    # -- the step -------------------------------------------------------------------------
    def run_step(self, step_samples: list, accumulate_fn: Callable[[list], dict], zero_grad: Any = None) -> dict:
        """Forward+backward over the step's samples in micro-batches, recovering from OOM; returns stats + events.

        The caller resets the meter's peak at the start of each step (train.fit does); the controller
        reads it after the step, so ``check_every`` compares the highest per-step peak of the window.
        """
        if not step_samples:
            raise ValueError("run_step got no samples for this step")
        n = len(step_samples)
        self.samples_in += n
        first_event = len(self.events)
        halvings = 0
        attempts = 0
        base = list(step_samples)
        while True:
            attempts += 1
            base = self._cut(base)  # a cut sample is replaced, so it is counted once
            micro = None
            oom_msg = None
            try:
                micro = [self.collate_fn(chunk) for chunk in self.split(base)]
                stats = accumulate_fn(micro)
                break
            except Exception as err:  # noqa: BLE001 - only OOMs are handled, the rest re-raised
                if not is_oom_error(err):
                    raise
                oom_msg = f"{type(err).__name__}: {(str(err).splitlines() or [''])[0][:200]}"
            # Outside the except block: the traceback (and the activations its frames hold) is gone.
            micro = None
            self._zero_grads(zero_grad)  # a failed attempt may have accumulated part of the step's gradients
            free_memory()
            self.oom_count += 1
            peak = _meter_peak(self.meter) if self.meter is not None else None
            old = self.micro_batch_size
            if halvings < self.max_retries and self.micro_batch_size > 1:
                self.micro_batch_size = max(1, self.micro_batch_size // 2)
                halvings += 1
                self._event("oom_halve", old, n, peak, oom_msg)
            else:
                longest = max(
                    (int(s["input_ids"].numel()) for s in base if isinstance(s, dict) and "input_ids" in s),
                    default=0,
                )
                current = self.seq_len if self.seq_len is not None else longest
                new_len = int(current * self.seq_cut)
                if new_len < self.min_seq_len:
                    raise RuntimeError(
                        f"out of memory at step {self.step} even with micro_batch_size={self.micro_batch_size} "
                        f"and seq_len={current}; cutting to {new_len} would go below min_seq_len={self.min_seq_len} "
                        f"({oom_msg})"
                    )
                self.seq_len = new_len
                halvings = 0  # the shorter rows get a fresh round of halvings
                self._event("oom_seq_cut", old, n, peak, oom_msg)
            if self.meter is not None:
                _meter_reset(self.meter)  # the failed attempt's peak must not trigger a shrink as well
        self.samples_seen += n
        self.step += 1
        self._check_memory(n)
        out = dict(stats) if isinstance(stats, dict) else {"result": stats}
        out.update(
            micro_batch_size=self.micro_batch_size,
            accum_steps=len(micro),
            seq_len=self.seq_len,
            attempts=attempts,
            events=list(self.events[first_event:]),  # BatchEvent: str() is a short label for the metrics frame
        )
        return out

    def _check_memory(self, n_samples: int) -> None:
        """Every check_every steps: shrink above high water, grow back below low water."""
        if self.meter is None:
            return
        step_peak = _meter_peak(self.meter)
        if step_peak is not None:
            self._window_peak = step_peak if self._window_peak is None else max(self._window_peak, step_peak)
        if self.step % self.check_every:
            return
        peak, self._window_peak = self._window_peak, None
        if peak is None or not self.budget_bytes:
            return
        frac = peak / self.budget_bytes
        old = self.micro_batch_size
        if frac > self.high_water and old > 1:
            self.micro_batch_size = max(1, int(old * self.shrink))
            self._event("shrink", old, n_samples, peak, f"peak {frac:.0%} of budget > high_water {self.high_water:.0%}")
        elif frac < self.low_water and old < self.max_micro_batch:
            new = min(self.max_micro_batch, max(old + 1, int(round(old / self.shrink))))
            if frac * new / old < self.high_water:  # activations scale ~linearly with rows: do not grow into a shrink
                self.micro_batch_size = new
                self._event("grow", old, n_samples, peak, f"peak {frac:.0%} of budget < low_water {self.low_water:.0%}")

    # -- reporting and resume -------------------------------------------------------------
    @property
    def stats(self) -> dict:
        """Totals: steps, OOMs recovered, samples in / seen / lost, truncations, current sizes."""
        return {
            "steps": self.step,
            "oom_events_recovered": self.oom_count,
            "samples_in": self.samples_in,
            "samples_seen": self.samples_seen,
            "samples_lost": self.samples_in - self.samples_seen,
            "n_truncated": self.n_truncated,
            "tokens_truncated": self.tokens_truncated,
            "micro_batch_size": self.micro_batch_size,
            "seq_len": self.seq_len,
            "n_events": len(self.events),
        }

    def events_frame(self):
        """The events as a pandas DataFrame (one row per event)."""
        import pandas as pd

        cols = list(BatchEvent.__dataclass_fields__)
        return pd.DataFrame([e.to_dict() for e in self.events], columns=cols)

    def state_dict(self) -> dict:
        """Everything needed to continue after a checkpoint: sizes, step, counters, events."""
        return {
            "micro_batch_size": self.micro_batch_size,
            "max_micro_batch": self.max_micro_batch,
            "seq_len": self.seq_len,
            "step": self.step,
            "samples_in": self.samples_in,
            "samples_seen": self.samples_seen,
            "n_truncated": self.n_truncated,
            "tokens_truncated": self.tokens_truncated,
            "oom_count": self.oom_count,
            "events": [e.to_dict() for e in self.events],
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore the state saved by state_dict()."""
        required = ("micro_batch_size", "seq_len", "step")
        missing = [k for k in required if k not in state]
        if missing:
            raise ValueError(f"controller state is missing keys {missing} (has {sorted(state)})")
        self.micro_batch_size = int(state["micro_batch_size"])
        self.max_micro_batch = int(state.get("max_micro_batch", self.max_micro_batch))
        self.seq_len = None if state["seq_len"] is None else int(state["seq_len"])
        self.step = int(state["step"])
        for key in ("samples_in", "samples_seen", "n_truncated", "tokens_truncated", "oom_count"):
            setattr(self, key, int(state.get(key, 0)))
        self.events = [BatchEvent(**e) for e in state.get("events", [])]


class StepSamples:
    """Re-iterable source of per-step sample lists for ``fit(..., controller=...)``: `step_size` samples per step.

    Shuffled per epoch with seed + epoch (deterministic, so train.DataStream can resume by skipping);
    the last partial step of an epoch is kept (its samples are not dropped). ``set_epoch`` as for samplers.
    """

    def __init__(self, dataset: Sequence, step_size: int, shuffle: bool = True, seed: int = 0) -> None:
        if int(step_size) < 1:
            raise ValueError(f"step_size must be >= 1, got {step_size}")
        if len(dataset) == 0:
            raise ValueError("StepSamples got an empty dataset")
        self.dataset, self.step_size, self.shuffle, self.seed = dataset, int(step_size), bool(shuffle), int(seed)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch's order."""
        self.epoch = int(epoch)

    def order(self) -> np.ndarray:
        """Sample indices of the current epoch, in order."""
        n = len(self.dataset)
        return np.random.default_rng([self.seed, self.epoch]).permutation(n) if self.shuffle else np.arange(n)

    def __len__(self) -> int:
        return math.ceil(len(self.dataset) / self.step_size)

    def __iter__(self) -> Iterator[list]:
        order = self.order().tolist()
        for start in range(0, len(order), self.step_size):
            yield [self.dataset[i] for i in order[start : start + self.step_size]]
