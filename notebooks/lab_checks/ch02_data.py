"""02_data's regions, against minimind_lib.corpus and .data: a document's rows, the SFT loss mask, the memmap write,
padding."""
import functools
import os
import tempfile
from pathlib import Path

import numpy as np
import torch

from minimind_lib import corpus as C
from minimind_lib import data as D
from minimind_lib.tokenizer import load_tokenizer

from . import Case, draw, edited, pick, region

tok = functools.cache(load_tokenizer)  # the course's 6400-token tokenizer, loaded once


def library_rows(ids, seq_len, long_docs):
    """minimind_lib.data's rows of a document (PretrainDataset's long_docs; the chapter compares them on its data)."""
    if long_docs == "truncate":
        return [list(ids) if len(ids) <= seq_len else list(ids[:seq_len - 1]) + list(ids[-1:])]
    stride = seq_len - 1
    return [list(ids[s:s + seq_len]) for s in range(0, max(1, len(ids) - 1), stride)]


region("document_rows", "'truncate': one row, the first seq_len - 1 ids and the last; 'chunk': rows of up to seq_len "
       "ids, each starting on the last id of the row before, until every next-token target is in one.", library_rows,
       fixed=lambda: [Case(f"document_rows({list(i)}, {n}, {m!r})", list(i), n, m) for i, n, m in (
           (range(10), 4, "chunk"), (range(7), 4, "chunk"), ([5], 4, "chunk"), ([1, 2], 4, "chunk"),
           (range(10), 4, "truncate"), (range(4), 4, "truncate"))],
       drawn=lambda g: [Case(f"document_rows({i}, {n}, {m!r})", i, n, m) for i, n, m in (
           (list(range(draw(g, 1, 40))), draw(g, 2, 12), pick(g, ("chunk", "truncate"))) for _ in range(8))],
       mistakes=(("Its rows do not overlap, so a target is lost at every boundary: each row starts on the last token "
                  "of the row before.", [("stride = seq_len - 1", "stride = seq_len"), ("len(ids) - 1", "len(ids)")]),
                 ("It ends with a row of one token, which trains nothing.", ("len(ids) - 1", "len(ids)")),
                 ("Its cut drops the <|im_end|>: MiniMind keeps the first seq_len - 1 ids and the last one.",
                  ("list(ids[:seq_len - 1]) + list(ids[-1:])", "list(ids[:seq_len])"))))


def mask(ids):
    """The chapter's rule (the base of the usual mistakes): 1 after <|im_start|>assistant\\n up to <|im_end|>\\n."""
    header, newline, bos, eos = tok().encode("assistant\n"), tok().encode("\n"), tok().bos_token_id, tok().eos_token_id
    out, i = [0] * len(ids), 0
    while i < len(ids):
        if ids[i] == bos and ids[i + 1:i + 1 + len(header)] == header:
            j = i + 1 + len(header)
            while j < len(ids) and ids[j] != eos:
                out[j], j = 1, j + 1
            if j < len(ids):
                out[j] = 1
            if ids[j + 1:j + 2] == newline:
                out[j + 1], j = 1, j + 1
            i = j
        i += 1
    return out


WORDS = ("To", " be", ",", " or", " not", " the", ".", "\n", " 123", "床", "前", "明月", "光", "，", "疑是", "霜", "😀", "?",
         " assistant", "user")


def words(g, low: int, high: int) -> str:
    """Random English and Chinese, never starting with a space."""
    return "".join(WORDS[draw(g, 0, len(WORDS) - 1)] for _ in range(draw(g, low, high))).lstrip() or "光"


def _chat(g) -> Case:
    turns = [("system", words(g, 1, 6))] * (draw(g, 0, 2) == 0)
    for _ in range(draw(g, 1, 3)):
        turns += [("user", words(g, 1, 8)), ("assistant", words(g, 1, 8))]
    return _conversation(turns + [("user", words(g, 1, 4))] * (draw(g, 0, 3) == 0))


def _conversation(turns) -> Case:
    ids = C.encode_sft(tok(), [{"role": r, "content": c} for r, c in turns])[0].tolist()
    return Case(f"the conversation {tok().decode(ids)!r}", ids)


region("assistant_mask", "1 from the token after each <|im_start|>assistant\\n header up to and including the next "
       "<|im_end|> and the newline after it, 0 elsewhere, lined up with ids (the model does the shift).",
       lambda ids: C.assistant_mask(tok(), ids).tolist(), output="the mask",
       run=lambda fn, c: [int(v) for v in fn(list(c.args[0]))], drawn=lambda g: [_chat(g) for _ in range(3)],
       fixed=lambda: [_conversation([("system", "Be brief."), ("user", "Who wrote Hamlet?"),
                                     ("assistant", "Shakespeare."), ("user", "床前明月光"), ("assistant", "疑是地上霜。")]),
                      _conversation([("user", "2 + 2?"), ("assistant", "4"), ("user", "?")])],
       reading=lambda case, at: f"Position {at[0]} holds {tok().decode([case.args[0][at[0]]])!r}.",
       mistakes=(("It is the mask moved one position earlier: it lines up with ids; the model does the shift.",
                  lambda ids: mask(ids)[1:] + [0]),
                 ("It is the mask moved one position later: it lines up with ids.", lambda ids: [0] + mask(ids)[:-1]),
                 ("It trains the system or user turns (the prompt): only what the assistant says is trained.",
                  edited(mask, (" and ids[i + 1:i + 1 + len(header)] == header", ""))),
                 ("It trains the header <|im_start|>assistant\\n: training starts after it.",
                  edited(mask, ("j = i + 1 + len(header)", "j = i + len(header)"))),
                 ("It leaves the <|im_end|> closing a reply untrained: the model would never learn to stop.",
                  edited(mask, ("out[j] = 1\n", "pass\n"))),
                 ("It leaves the newline after a reply's <|im_end|> untrained: MiniMind-3 trains it.",
                  edited(mask, ("out[j + 1], j = 1, j + 1", "j = j + 1")))))


def library_write_tokens(samples, path):
    """What minimind_lib's tokenize_to_memmap writes: the ids back to back as uint16; the n + 1 offsets (.idx.npy)."""
    np.concatenate([np.zeros(0, np.int64), *samples]).astype(np.uint16).tofile(path)
    return np.concatenate([[0], np.cumsum([len(s) for s in samples])]).astype(np.int64)


def _written(fn, case):
    with tempfile.TemporaryDirectory() as tmp:
        path, n = Path(tmp) / "tokens.bin", sum(len(s) for s in case.args[0])
        offsets = fn([np.array(s, dtype=np.int64) for s in case.args[0]], path)
        return {"the offsets": None if offsets is None else [int(v) for v in np.asarray(offsets)],
                "your file's bytes per token": os.path.getsize(path) / n,
                "the ids read back from your file as uint16": np.fromfile(path, np.uint16).tolist()}


OFFSETS = "np.concatenate([[0], np.cumsum([len(s) for s in samples])])"
region("write_tokens", "the ids back to back, each a 2-byte unsigned integer; return the n + 1 offsets, in tokens, "
       "where the samples start (0 first, the total last).", library_write_tokens, run=_written,
       fixed=lambda: [Case(f"the samples {s}", s) for s in ([[1, 300, 6399, 2], [1, 2]], [[5], [65535, 0, 7]])],
       drawn=lambda g: [Case(f"the samples {s}", s) for s in ([[draw(g, 0, 6399) for _ in range(draw(g, 1, 9))]
                                                               for _ in range(draw(g, 1, 5))] for _ in range(2))],
       mistakes=(*((f"It writes {t}: the file holds 2-byte unsigned integers (uint16), what the reader reads.",
                    (".astype(np.uint16)", f".astype(np.{d})")) for t, d in (
           ("8 bytes per token (int64, the arrays' own)", "int64"), ("4 bytes per token", "int32"),
           ("1 byte per token (ids above 255 wrap)", "uint8"))),
                 ("The offsets count bytes: the reader slices an array of tokens.", ("[len(s) for", "[2 * len(s) for")),
                 ("The offsets miss the leading 0.", (OFFSETS, "np.cumsum([len(s) for s in samples])")),
                 ("It returns each sample's length: the offsets are a running total from 0.",
                  (OFFSETS, "np.array([len(s) for s in samples])"))))


def _pad(what, lengths, pad_id, seq_len, fixed, untrained=()):
    samples = [{"input_ids": torch.arange(10 * r, 10 * r + n), "labels": torch.arange(10 * r, 10 * r + n)}
               for r, n in enumerate(lengths)]
    for r, p in untrained:
        samples[r]["labels"][p] = -100
    return Case(f"{what} of lengths {list(lengths)} (pad_id={pad_id}, seq_len={seq_len}, fixed={fixed})", samples,
                pad_id, seq_len, fixed)


region("pad_batch", "cut the rows to seq_len; width seq_len (fixed) or the longest row; start from pad_id, -100 and 0, "
       "then put each row's ids, labels and ones at its start.", D.pad_collate, axes=("row", "position"),
       fixed=lambda: [_pad("pretraining rows", (2, 4), 3, None, False), _pad("rows cut to seq_len", (2, 6), 0, 4, True),
                      _pad("SFT rows with untrained positions", (5, 3), 6399, 4, False, ((0, 1), (1, 0)))],
       drawn=lambda g: [_pad("random rows", [draw(g, 1, 12) for _ in range(draw(g, 1, 4))], pick(g, (0, 3)),
                             draw(g, 2, 12), bool(draw(g, 0, 1)))],
       mistakes=(("Pads get the label pad_id, not -100: the loss would train the model to predict padding.",
                  ("length), IGNORE_INDEX", "length), int(pad_id)")),
                 ("The attention_mask is 1 on pads: 1 marks the real tokens only.", (".zeros((", ".ones((")),
                 ("It pads on the left: each row starts at position 0.",
                  ("[r, :len(ids)]", "[r, length - len(ids):]"))))
