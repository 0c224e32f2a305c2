"""06_dynamic_batching's regions, against minimind_lib.batching: token-budget batches, packing, the controller's
decisions after an out-of-memory error and after a memory reading."""
import torch

from minimind_lib import batching as B

from . import Case, draw, pick, region


def _fill(order, lengths, max_tokens, max_rows=None):
    return Case(f"fill_batches({order}, {lengths}, max_tokens={max_tokens}, max_batch_size={max_rows})", order,
                lengths, max_tokens, max_rows)


def _fill_drawn(g):
    out = []
    for k in range(8):
        lengths = [draw(g, 1, pick(g, (8, 64))) for _ in range(draw(g, 0, 20))]
        order = sorted(range(len(lengths)), key=lambda i: -lengths[i]) if k % 2 else torch.randperm(
            len(lengths), generator=g).tolist()
        out.append(_fill(order, lengths, draw(g, 8, 160), pick(g, (None, 3))))
    return out


COST = "(len(batch) + 1) * max(longest, n)"
region("fill_batches", "walk the samples in order, keeping the open batch and its longest row; a sample joins while "
       "(rows + 1) x the longest row (this sample included) stays within max_tokens and the rows under max_batch_size "
       "(either may be None); else the batch closes and the sample opens the next; close the last at the end.",
       B.fill_batches, run=lambda fn, c: [list(b) for b in fn(*c.args)], output="the batches", drawn=_fill_drawn,
       fixed=lambda: [_fill([0, 1, 2], [5, 5, 5], 8), _fill([0, 1, 2], [5, 2, 2], 8), _fill([0, 1], [4, 4], 8),
                      _fill([2, 0, 1], [3, 9, 3], 8), _fill([0, 1, 2, 3], [1, 1, 1, 1], None, 3), _fill([], [], 8)],
       mistakes=(("It counts rows against the budget, which is on padded tokens: rows x the longest row.",
                  (COST, "len(batch) + 1")),
                 ("It counts the rows' real tokens (their sum): every row is padded to the longest row of its batch, "
                  "so the budget is on rows x the longest row.", (COST, "sum(int(lengths[j]) for j in batch) + n")),
                 ("It multiplies by the new row's length, but every row is padded to the longest row in the batch, "
                  "counting the rows already in it.", (COST, "(len(batch) + 1) * n")),
                 ("It splits a batch that fills the budget exactly (< for <=).", ("<= max_tokens", "< max_tokens"))))


def docs(lengths, g=None):
    """Documents (ids, labels) of the given lengths; with g, about 30% of the labels -100."""
    out = [(torch.arange(100 * d, 100 * d + n), torch.arange(100 * d, 100 * d + n) + 1000)
           for d, n in enumerate(lengths)]
    for ids, labels in out if g is not None else []:
        labels[torch.rand(len(ids), generator=g) < 0.3] = -100
    return out


def _streamed(fn, case):
    stats = B.PackStats()
    rows = fn([(i.clone(), lab.clone()) for i, lab in case.args[0]], case.args[1], stats, case.args[2])
    return {"the rows of segments (ids, labels)": [[(torch.as_tensor(i).tolist(), torch.as_tensor(lab).tolist())
                                                    for i, lab in row] for row in rows], "stats.n_split": stats.n_split}


def _stream(lengths, seq_len, whole, g=None):
    return Case(f"stream_segments(documents of lengths {list(lengths)}, seq_len={seq_len}, whole={whole})",
                docs(lengths, g), seq_len, whole)


SPLIT = "int(ids.numel() > room)"
region("stream_segments", "keep the open row and the room left in it; put as much of each document as fits, close the "
       "row when full and go on with the rest in a new row; count each document that does not fit the room left once "
       "in stats.n_split; with whole=True such a document closes the row first (never cut).", B.stream_segments,
       run=_streamed,
       fixed=lambda: [_stream((3, 4), 5, True), _stream((2, 2), 5, False), _stream((7,), 5, False),
                      _stream((5, 2), 5, False), _stream((12, 1), 5, False)],
       drawn=lambda g: [_stream([draw(g, 1, n * (1 + 2 * (k % 2))) for _ in range(draw(g, 1, 8))], n, k % 2 == 0, g)
                        for k, n in ((k, draw(g, 2, 16)) for k in range(6))],
       mistakes=(("With whole=True it cuts a document across rows: one that does not fit the room left starts the next "
                  "row whole (the row before keeps its empty end).", ("if whole and", "if False and")),
                 ("A document longer than the room left loses its rest: what does not fit goes on in the next row.",
                  ("ids, labels, room = ids[take:], labels[take:]", "ids, labels, room = ids[:0], labels[:0]")),
                 ("It counts a document that exactly fills the room left as cut: it was placed whole.",
                  (SPLIT, "int(ids.numel() >= room)")),
                 ("It counts a document once per cut: n_split counts the documents cut, once each.",
                  (SPLIT, "max(0, (ids.numel() - room + seq_len - 1) // seq_len)"))))


def _rowed(fn, case):
    stats = B.PackStats()
    out = fn([[(i.clone(), lab.clone()) for i, lab in row] for row in case.args[0]], case.args[1], case.args[2], stats)
    return {**(out if isinstance(out, dict) else {"the result": out}),
            "the stats (n_tokens, n_pad, n_rows)": [stats.n_tokens, stats.n_pad, stats.n_rows]}


def _rows(lengths, seq_len, pad_id, whole=False, g=None):
    rows = B.stream_segments(docs(lengths, g), seq_len, B.PackStats(), whole)
    return Case(f"rows of seq_len={seq_len} of segments of lengths {[[len(s[0]) for s in r] for r in rows]}, "
                f"pad_id={pad_id}", rows, seq_len, pad_id)


LABELS = 'out["labels"][r, pos + 1:pos + n] = labels[1:]'
region("rows_from_segments", "start from (rows, seq_len) tensors of pad_id, -100, 0 and -1; write each row's segments "
       "one after the other: the ids, the labels from the segment's second position on (its first stays -100), "
       "positions 0, 1, 2, ... again from 0 at each segment, the segment's number in the row as its doc id; add the "
       "tokens placed and the pads to the stats and set n_rows.", B.rows_from_segments, run=_rowed,
       axes=("row", "position"), fixed=lambda: [_rows((3, 2, 4), 6, 0), _rows((5, 9), 4, 7)],
       drawn=lambda g: [_rows([draw(g, 1, n * (2 - k)) for _ in range(draw(g, 1, 6))], n, pick(g, (0, 3)), bool(k), g)
                        for k, n in ((k, draw(g, 2, 16)) for k in range(2))],
       mistakes=(("Its position_ids count on across a document boundary: they start again at 0 in each document, so "
                  "RoPE sees each document's own positions.", ("torch.arange(n)", "torch.arange(pos, pos + n)")),
                 ("The first position of each document keeps its label: it must be -100, or the last token of the "
                  "document before would be trained to predict it (the model shifts the labels).",
                  (LABELS, 'out["labels"][r, pos:pos + n] = labels')),
                 ("It shifts the labels itself: labels line up with input_ids (the model does the shift).",
                  (LABELS, 'out["labels"][r, pos:pos + n - 1] = labels[1:]')),
                 ("doc_ids on padding are not -1: padding belongs to no document.",
                  ('"doc_ids": torch.full(shape, -1)', '"doc_ids": torch.full(shape, 0)')),
                 ("doc_ids count on from the row before: they number the segments within each row, from 0.",
                  ('out["doc_ids"][r, pos:pos + n] = d',
                   'out["doc_ids"][r, pos:pos + n] = d + sum(map(len, rows[:r]))'))))


def _oom(sizes, lengths, halvings, retries, seq_cut, seq_len):
    return Case(f"after_oom(sizes={sizes}, micro-batches of row lengths {lengths}, halvings={halvings}, max_retries="
                f"{retries}, seq_cut={seq_cut}, seq_len={seq_len})", sizes, [[{"input_ids": torch.zeros(n, dtype=int)}
                                                                              for n in mb] for mb in lengths],
                halvings, retries, seq_cut, seq_len)


def _oom_drawn(g):
    out = []
    for k in range(12):
        lengths = [[draw(g, 1, 300) for _ in range(1 if k % 5 == 0 else draw(g, 1, 6))] for _ in range(draw(g, 1, 4))]
        sizes = pick(g, ((draw(g, 1, 12), None), (None, draw(g, 50, 2000)), (draw(g, 1, 8), draw(g, 50, 900))))
        retries = draw(g, 0, 4)
        out.append(_oom(sizes, lengths, draw(g, 0, retries), retries, pick(g, (0.5, 0.8)), pick(g, (None, 64))))
    return out


region("after_oom", "while halvings < max_retries and some micro-batch has more than one row: halve each size that is "
       "set, from what the largest such micro-batch used (its rows; rows x longest row), never below 1; otherwise cut: "
       "seq_len becomes seq_cut x the step's longest row (as cut now).", B.after_oom,
       run=lambda fn, c: list(fn(*c.args)), output="(kind, sizes, seq_len)", drawn=_oom_drawn,
       fixed=lambda: [_oom((None, 1000), [[100, 90, 90]], 0, 3, 0.8, None),
                      _oom((8, None), [[10] * 4], 0, 3, 0.8, None),
                      _oom((None, 400), [[100], [50]], 0, 3, 0.8, None), _oom((4, None), [[10, 10]], 3, 3, 0.8, None),
                      _oom((6, 500), [[300, 20]], 1, 2, 0.5, 64)],
       mistakes=(("It halves the cap, not what the micro-batch that ran out used: with a cap of 1000 padded tokens and "
                  "a micro-batch of 300, a cap of 500 retries the same work, which fails again.",
                  ("zip(sizes, (rows, padded))", "zip(sizes, (rows, sizes[1]))")),
                 ("Its sizes do not shrink after an out-of-memory error: halve what the largest micro-batch used.",
                  ("max(1, min(cap, used) // 2)", "cap")),
                 ("It halves when every micro-batch is a single row: that cannot make a row shorter; cut the rows.",
                  ("several = [mb for mb in micro if len(mb) > 1]", "several = micro")),
                 ("It halves again after max_retries halvings: then the rows are cut instead.",
                  ("halvings < max_retries and ", ""))))

NAMES = ("frac", "sizes", "start_sizes", "seq_len", "seq_len_start", "uncut_len", "high_water", "low_water", "shrink")


def _memory(*args):
    return Case(f"memory_check({', '.join(f'{n}={v!r}' for n, v in zip(NAMES, args))})", *args)


def _memory_drawn(g):
    out = []
    for k in range(40):
        high = pick(g, (0.8, 0.9))
        low, shrink = high * pick(g, (0.625, 0.5)), pick(g, (0.8, 0.5))
        start = pick(g, ((draw(g, 1, 32), None), (None, draw(g, 64, 4096)), (draw(g, 1, 32), draw(g, 64, 4096))))
        sizes, top = tuple(s and draw(g, 1, min(s, 3) if k % 3 == 0 else s) for s in start), draw(g, 16, 512)
        seq_len, uncut = (draw(g, 8, top - 1), top) if k % 2 == 0 else (top, None)
        r = float(torch.rand((), generator=g))
        frac = round((r * 1.2, r * 1.2, r * low, low * (0.7 + 0.3 * r))[k % 4], 4)
        out.append(_memory(frac, sizes, start, seq_len, top, uncut, high, low, shrink))
    return out


GROWN = "min(start, max(s + 1, round(s / shrink)))"
region("memory_check", "above high_water (and some size above 1): every set size times shrink. Below low_water with "
       "rows cut (uncut_len): seq_len back to its start if the peak x uncut_len / seq_len stays under high_water, else "
       "no change. Below low_water otherwise: every set size to round(size / shrink), at least +1, at most its start, "
       "if the peak x the largest growth stays under high_water. Anything else: no change.", B.memory_check,
       run=lambda fn, c: list(fn(*c.args)), output="(kind, sizes, seq_len, uncut_len)", drawn=_memory_drawn,
       fixed=lambda: [_memory(0.45, (None, 500), (None, 1000), 100, 256, 256, 0.8, 0.5, 0.8),
                      _memory(0.45, (1, None), (8, None), 256, 256, None, 0.8, 0.5, 0.8),
                      _memory(0.2, (None, 900), (None, 1000), 256, 256, None, 0.8, 0.5, 0.8),
                      _memory(0.9, (1, None), (8, None), 256, 256, None, 0.8, 0.5, 0.8),
                      _memory(0.3, (None, 500), (None, 1000), 163, 256, 256, 0.8, 0.5, 0.8),
                      _memory(0.1, (3, 250), (8, 1000), 256, 256, None, 0.8, 0.5, 0.8)],
       mistakes=(("It grows the micro-batch while the rows are still cut after an out-of-memory error: the cut "
                  "sequence length comes back first, and until it can, nothing grows.",
                  ("        return None, sizes, seq_len, uncut_len\n    grown", "    grown")),
                 ("It grows without predicting the peak: only if the peak x the growth stays under high water.",
                  ("frac * max(g / s for g, s in zip(grown, sizes) if s) < high_water", "True")),
                 ("It grows past the start size: growth stops at the size the run started with.",
                  (GROWN, "max(s + 1, round(s / shrink))")),
                 ("It shrinks a micro-batch of 1 row: there is nothing left to shrink.",
                  (" and max(s or 0 for s in sizes) > 1", "")),
                 ("It rounds the growth up instead of to the nearest: round(size / shrink).",
                  ("round(s / shrink)", "-int(-s // shrink)")),
                 ("It truncates the growth instead of rounding to the nearest: round(size / shrink).",
                  ("round(s / shrink)", "int(s / shrink)"))))
