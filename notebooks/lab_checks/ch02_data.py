"""02_data's regions, against minimind_lib.corpus and .data: rows, SFT mask, memmap, padding."""
import functools
import os
import tempfile
from pathlib import Path
import numpy as np
import torch
from minimind_lib import corpus as C, data as D
from minimind_lib.tokenizer import load_tokenizer
from . import Case, draw, edited, pick, region

tok = functools.cache(load_tokenizer)  # the course's 6400-token tokenizer, loaded once
def library_rows(ids, seq_len, long_docs):  # minimind_lib.data's rows of a document
    if long_docs == "truncate":
        return [list(ids) if len(ids) <= seq_len else list(ids[:seq_len - 1]) + list(ids[-1:])]
    return [list(ids[s:s + seq_len]) for s in range(0, max(1, len(ids) - 1), seq_len - 1)]
region("document_rows", "truncate: keep the last id; chunk: rows share an id, every target in one.",
       library_rows, fixed=[(list(range(n)), 4, "chunk") for n in (10, 7, 1, 2)] + [
           (list(range(n)), 4, "truncate") for n in (10, 4)],
       drawn=lambda g: [(list(range(draw(g, 1, 40))), draw(g, 2, 12), mode)
                        for mode in ("chunk", "truncate")],
       mistakes=(("Its rows do not overlap: each starts on the last id of the row before.",
                  [("seq_len - 1)]", "seq_len)]"), ("len(ids) - 1)", "len(ids))")]),
                 ("It ends on a row of one token, training nothing.", "len(ids) - 1)", "len(ids))"),
                 ("It drops the <|im_end|>: keep the first seq_len - 1 ids and the last.",
                  "list(ids[:seq_len - 1]) + list(ids[-1:])", "list(ids[:seq_len])")))
WORDS = "To| be|,| or| not|.|\n| 123|床|前|明月|光|，|😀| assistant|user".split("|")
def words(g, low, high):  # random English and Chinese, never starting with a space
    return "".join(pick(g, WORDS) for _ in range(draw(g, low, high))).lstrip() or "光"
def chat(*turns):
    ids = C.encode_sft(tok(), [{"role": r, "content": c} for r, c in turns])[0].tolist()
    return Case(f"the conversation {tok().decode(ids)!r}", ids)
def mask_of(*edits):  # the region's assistant_mask(ids) from the library's (tokenizer, ids)
    return lambda ids: [int(v) for v in edited(C.assistant_mask, *edits)(tok(), ids)]
region("assistant_mask", "1 on each assistant reply, its <|im_end|> and the newline after it.",
       mask_of(), output="the mask", run=lambda fn, c: list(map(int, fn(*c.args))),
       fixed=lambda: [chat(("system", "Be brief."), ("user", "Who wrote Hamlet?"), ("assistant",
                           "Shakespeare."), ("user", "床前明月光"), ("assistant", "疑是地上霜。")),
                      chat(("user", "2 + 2?"), ("assistant", "4"), ("user", "?"))],
       drawn=lambda g: [chat(*[(r, words(g, 1, 8)) for _ in range(draw(g, 1, 3))
                               for r in ("user", "assistant")], ("user", words(g, 1, 4)))],
       reading=lambda case, at: f"Position {at[0]} holds {tok().decode([case.args[0][at[0]]])!r}.",
       mistakes=(("It is the mask moved one position earlier: it lines up with ids.",
                  lambda ids: mask_of()(ids)[1:] + [0]),
                 ("It trains the system or user turns: only the assistant's replies.",
                  mask_of(("_read_role(tokenizer, ids, i, header)",
                           '"assistant", i + 1 + len(header)'))),
                 ("It leaves the <|im_end|> closing a reply untrained: the model would never stop.",
                  mask_of(("= 1\n", "= 1; mask[end] = 0\n")))))
def library_write_tokens(samples, path):  # tokenize_to_memmap's uint16 ids; n + 1 offsets
    np.concatenate([np.zeros(0, np.int64), *samples]).astype(np.uint16).tofile(path)
    return np.concatenate([[0], np.cumsum([len(s) for s in samples])]).astype(np.int64)
def written(fn, case):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "tokens.bin"
        offsets = fn([np.array(s, dtype=np.int64) for s in case.args[0]], path)
        return {"the offsets": None if offsets is None else np.asarray(offsets).tolist(),
                "your file's bytes per token": os.path.getsize(path) / sum(map(len, case.args[0])),
                "the ids read back as uint16": np.fromfile(path, np.uint16).tolist()}
region("write_tokens", "the ids back to back as 2-byte unsigned integers; n + 1 offsets in tokens.",
       library_write_tokens, run=written, fixed=[([[1, 300, 6399, 2], [1, 2]],), ([[5], [65535]],)],
       drawn=lambda g: [([[draw(g, 0, 6399) for _ in range(draw(g, 1, 9))] for _ in range(3)],)],
       mistakes=(("It writes 8 bytes per token (int64, the arrays' own): write uint16.",
                  "np.uint16)", "np.int64)"),))
def rows(lengths, pad_id, seq_len, fixed, untrained=()):
    samples = [{"input_ids": torch.arange(10 * r, 10 * r + n),
                "labels": torch.arange(10 * r, 10 * r + n)} for r, n in enumerate(lengths)]
    for r, p in untrained:
        samples[r]["labels"][p] = -100
    return Case(f"rows of lengths {list(lengths)}{' with untrained positions' * bool(untrained)} "
                f"(pad_id={pad_id}, seq_len={seq_len}, fixed={fixed})", samples, pad_id, seq_len,
                fixed)
region("pad_batch", "cut to seq_len; pad_id, -100 and 0 after each row, up to its width.",
       D.pad_collate, axes=("row", "position"), fixed=lambda: [
           rows((2, 4), 3, None, False), rows((2, 6), 0, 4, True),
           rows((5, 3), 6399, 4, False, ((0, 1), (1, 0)))],
       drawn=lambda g: [rows([draw(g, 1, 12) for _ in range(draw(g, 1, 4))], pick(g, (0, 3)),
                             draw(g, 2, 12), bool(draw(g, 0, 1)))],
       mistakes=(("Pads get the label pad_id, not -100: the loss would train predicting padding.",
                  "length), IGNORE_INDEX", "length), int(pad_id)"),))
