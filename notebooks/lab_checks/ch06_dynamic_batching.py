"""06_dynamic_batching's regions, against minimind_lib.batching: budgets, packing, controller."""
import copy
import torch
from minimind_lib import batching as B
from . import Case, draw, pick, region

COST = "(len(batch) + 1) * max(longest, n)"  # the library's budget test, edited below
region("fill_batches", "a sample joins while rows x the longest row and the rows stay in budget.",
       B.fill_batches, output="the batches", fixed=[
           ([0, 1, 2], [5, 5, 5], 8), ([0, 1, 2], [5, 2, 2], 8), ([0, 1], [4, 4], 8),
           ([2, 0, 1], [3, 9, 3], 8), ([0, 1, 2, 3], [1, 1, 1, 1], None, 3), ([], [], 8)],
       drawn=lambda g: [(torch.randperm(n, generator=g).tolist(), [draw(g, 1, 30) for _ in
                          range(n)], draw(g, 8, 100), pick(g, (None, 3))) for n in (12, 20)],
       mistakes=(("It counts the rows' real tokens: they are padded; count rows x the longest row.",
                  COST, "sum(int(lengths[j]) for j in batch) + n"),
                 ("It multiplies by the new row's length: rows pad to the longest.",
                  COST, "(len(batch) + 1) * n")))
def docs(lengths, g=None):  # documents (ids, labels); with g, ~30% of labels -100
    out = [(a, a + 1000) for a in (torch.arange(n) + 100 * d for d, n in enumerate(lengths))]
    for ids, labels in out if g is not None else []:
        labels[torch.rand(len(ids), generator=g) < 0.3] = -100
    return out
def packed(fn, case):  # the output, and the PackStats in the case
    args = copy.deepcopy(case.args)
    out, stats = fn(*args), next(a for a in args if isinstance(a, B.PackStats))
    return {"what it returns": out if isinstance(out, dict) else [[[torch.as_tensor(t).tolist()
            for t in seg] for seg in row] for row in out], "the stats": vars(stats)}
def stream(lengths, seq_len, whole, g=None):
    return Case(f"stream_segments(documents of lengths {list(lengths)}, seq_len={seq_len}, "
                f"whole={whole})", docs(lengths, g), seq_len, B.PackStats(), whole)
region("stream_segments", "fill each row's room, the rest in the next row; count cut ones.",
       B.stream_segments, run=packed,
       fixed=lambda: [stream((3, 4), 5, True), stream((2, 2), 5, False), stream((7,), 5, False),
                      stream((5, 2), 5, False), stream((12, 1), 5, False)],
       drawn=lambda g: [stream([draw(g, 1, 8) for _ in range(6)], 8, w, g) for w in (False, True)],
       mistakes=(("With whole=True it cuts a document across rows: one that does not fit starts "
                  "the next row.", "if whole and", "if False and"),))
def segments(lengths, seq_len, pad_id, g=None):
    rows = B.stream_segments(docs(lengths, g), seq_len, B.PackStats())
    shown = [[len(s[0]) for s in r] for r in rows]
    return Case(f"rows of seq_len={seq_len} of segments of lengths {shown}, pad_id={pad_id}", rows,
                seq_len, pad_id, B.PackStats())
region("rows_from_segments", "ids; labels but each segment's first; positions from 0 per segment.",
       B.rows_from_segments, run=packed, axes=("row", "position"),
       fixed=lambda: [segments((3, 2, 4), 6, 0), segments((5, 9), 4, 7)],
       drawn=lambda g: [segments([draw(g, 1, 12) for _ in range(draw(g, 1, 6))], 8, 3, g)],
       mistakes=(("Its position_ids count on across a document boundary: start again at 0 in each.",
                  "torch.arange(n)", "torch.arange(pos, pos + n)"),
                 ("The first position of each document keeps its label: make it -100.",
                  "pos + 1:pos + n] = labels[1:]", "pos:pos + n] = labels")))
def oom(sizes, lengths, halvings, retries, seq_cut, seq_len=None):
    micro = [[{"input_ids": torch.zeros(n, dtype=int)} for n in mb] for mb in lengths]
    return Case(f"after_oom(sizes={sizes}, micro-batches of row lengths {lengths}, halvings="
                f"{halvings}, max_retries={retries}, seq_cut={seq_cut}, seq_len={seq_len})", sizes,
                micro, halvings, retries, seq_cut, seq_len)
region("after_oom", "halve what the largest micro-batch of 2+ rows used, while retries last; cut.",
       B.after_oom, output="(kind, sizes, seq_len)", fixed=lambda: [
           oom((None, 1000), [[100, 90, 90]], 0, 3, 0.8), oom((8, None), [[10] * 4], 0, 3, 0.8),
           oom((4, None), [[10, 10]], 3, 3, 0.8), oom((None, 400), [[100], [50]], 0, 3, 0.8),
           oom((6, 500), [[300, 20]], 1, 2, 0.5, 64)],
       drawn=lambda g: [oom(pick(g, ((draw(g, 1, 12), None), (None, draw(g, 50, 2000)), (4, 600))),
                            [[draw(g, 1, 300) for _ in range(draw(g, 1, 4))] for _ in range(3)],
                            draw(g, 0, 2), 2, pick(g, (0.5, 0.8)), pick(g, (None, 64)))
                        for _ in range(6)],
       mistakes=(("It halves the cap, not what the micro-batch that ran out used: the retry fails "
                  "again.", "zip(sizes, (rows, padded))", "zip(sizes, (rows, sizes[1]))"),))
def memory_drawn(g):  # readings above, below and between the marks
    start = pick(g, ((draw(g, 2, 32), None), (None, draw(g, 64, 4096)), (draw(g, 2, 8), 900)))
    sizes, top, r = tuple(s and draw(g, 1, s) for s in start), draw(g, 16, 512), draw(g, 0, 99) / 99
    high, shrink = pick(g, (0.8, 0.9)), pick(g, (0.8, 0.5))
    return [(round(f, 4), sizes, start, *lengths, high, 0.5, shrink)
            for f in (r * 1.2, r * 0.5, 0.35 + 0.1 * r)
            for lengths in ((draw(g, 8, top - 1), top, top), (top, top, None))]
region("memory_check", "shrink above high water; below low water, the cut seq_len first, or grow.",
       B.memory_check, drawn=memory_drawn, output="(kind, sizes, seq_len, uncut_len)",
       fixed=[(f, s, start, n, 256, u) for f, s, start, n, u in (
           (0.45, (None, 500), (None, 1000), 100, 256), (0.3, (None, 500), (None, 1000), 163, 256),
           (0.45, (1, None), (8, None), 256, None), (0.9, (1, None), (8, None), 256, None),
           (0.2, (None, 900), (None, 1000), 256, None), (0.1, (3, 250), (8, 1000), 256, None),
           (0.1, (7, None), (16, None), 256, None))],
       mistakes=(("It grows the micro-batch while the rows are still cut: uncut them first.",
                  "        return None, sizes, seq_len, uncut_len\n    grown", "    grown"),))
