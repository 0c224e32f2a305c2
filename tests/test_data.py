"""Tests of minimind_lib.corpus and minimind_lib.data: jsonl validation, datasets, label masks, memmap cache, collators."""

from __future__ import annotations

import functools
import json
import os
import pickle
import time

import numpy as np
import pytest
import torch

from minimind_lib import corpus as C
from minimind_lib import data as D
from minimind_lib.tokenizer import Tokenizer

CORPUS = [
    "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer.",
    "The slings and arrows of outrageous fortune, or to take arms against a sea of troubles.",
    "床前明月光，疑是地上霜。举头望明月，低头思故乡。",
    "Hello there! How can I help you today? I am a helpful assistant.",
] * 4


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.train(CORPUS, vocab_size=400)


@pytest.fixture(scope="module")
def tok2():
    return Tokenizer.train(CORPUS, vocab_size=380)


def write_jsonl(path, rows):
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(r if isinstance(r, str) else json.dumps(r, ensure_ascii=False))
            f.write("\n")
    return path


def conv(*turns):
    return {"conversations": [{"role": r, "content": c} for r, c in turns]}


@pytest.fixture
def pre_path(tmp_path):
    return write_jsonl(tmp_path / "pre.jsonl", [{"text": t} for t in CORPUS])


@pytest.fixture
def sft_path(tmp_path):
    rows = [conv(("system", "You are helpful."), ("user", "Hello there?"), ("assistant", "To be, or not to be.")),
            conv(("user", "床前明月光"), ("assistant", "疑是地上霜。"), ("user", "again"), ("assistant", "\n\nHello!"))] * 5
    return write_jsonl(tmp_path / "sft.jsonl", rows)


# ---------------------------------------------------------------- read_jsonl and validation


def test_read_jsonl_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="jsonl file not found: .*nope.jsonl"):
        C.read_jsonl(tmp_path / "nope.jsonl")


def test_read_jsonl_malformed_line_names_file_and_line(tmp_path):
    p = write_jsonl(tmp_path / "bad.jsonl", [{"text": "a"}, {"text": "b"}, '{"text": "c"', {"text": "d"}])
    with pytest.raises(C.DataFormatError, match=r"bad\.jsonl:3: malformed JSON \(Expecting .* at column 13\)"):
        list(C.read_jsonl(p))


def test_read_jsonl_skip_counts_and_warns(tmp_path):
    p = write_jsonl(tmp_path / "bad.jsonl", [{"text": "a"}, "not json", "", {"nottext": 1}, {"text": "d"}])
    reader = C.read_jsonl(p, on_error="skip", kind="pretrain")
    with pytest.warns(UserWarning, match=r"skipped 2"):
        records = list(reader)
    assert [r["text"] for r in records] == ["a", "d"]
    assert (reader.n_skipped, reader.n_blank, reader.n_lines) == (2, 1, 5)
    assert "bad.jsonl:2: malformed JSON" in reader.skipped_examples[0]
    assert "bad.jsonl:4: missing key 'text'" in reader.skipped_examples[1]


def test_read_jsonl_bad_on_error_value(tmp_path):
    p = write_jsonl(tmp_path / "a.jsonl", [{"text": "a"}])
    with pytest.raises(ValueError, match="on_error='ignore' is not valid"):
        C.read_jsonl(p, on_error="ignore")


def test_read_jsonl_max_samples(pre_path):
    assert len(list(C.read_jsonl(pre_path, max_samples=3))) == 3


@pytest.mark.parametrize("record, match", [
    ({"txt": "a"}, "missing key 'text'"),
    ({"text": 3}, "key 'text' must be a string, got int"),
    ({"text": "  \n"}, "key 'text' is empty"),
    ({"text": "a\ud800b"}, "lone surrogate"),
    ([1, 2], "expected a JSON object, got list"),
])
def test_validate_pretrain(record, match):
    with pytest.raises(ValueError, match=match):
        C.validate_record(record, "pretrain")


@pytest.mark.parametrize("record, match", [
    ({"messages": []}, "missing key 'conversations'"),
    ({"conversations": []}, "must be a non-empty list"),
    (conv(("human", "hi"), ("assistant", "yo")), r"conversations\[0\]\['role'\] = 'human' is not one of"),
    ({"conversations": [{"role": "user"}]}, r"conversations\[0\] is missing key 'content'"),
    ({"conversations": [{"content": "x"}]}, r"conversations\[0\] is missing key 'role'"),
    (conv(("user", "hi")), "no 'assistant' turn"),
    (conv(("user", "hi"), ("assistant", " ")), r"conversations\[1\]\['content'\] is empty"),
    ({"conversations": [{"role": "user", "content": "q", "tools": []}, {"role": "assistant", "content": "a"}]},
     r"conversations\[0\]\['tools'\] is only allowed on the first turn, a system turn"),
    ({"conversations": [{"role": "assistant", "content": None}]}, r"conversations\[0\]\['content'\] must be a string"),
    ({"conversations": [{"role": "user", "content": 5}, {"role": "assistant", "content": "a"}]}, "must be a string"),
])
def test_validate_sft(record, match):
    with pytest.raises(ValueError, match=match):
        C.validate_record(record, "sft")


def test_dataset_error_names_file_line_and_value(tmp_path, tok):
    p = write_jsonl(tmp_path / "s.jsonl", [conv(("user", "a"), ("assistant", "b")), conv(("bot", "a"), ("assistant", "b"))])
    with pytest.raises(C.DataFormatError, match=r"s\.jsonl:2: conversations\[0\]\['role'\] = 'bot'"):
        D.SFTDataset(p, tok, 64)
    with pytest.warns(UserWarning, match="skipped 1"):
        ds = D.SFTDataset(p, tok, 64, on_error="skip")
    assert len(ds) == 1 and ds.stats.n_skipped == 1 and "s.jsonl:2" in ds.stats.skipped_examples[0]


# ---------------------------------------------------------------- pretrain samples


def test_pretrain_sample_is_bos_tokens_eos(pre_path, tok):
    ds = D.PretrainDataset(pre_path, tok, seq_len=512)
    s = ds[0]
    expected = [tok.bos_token_id, *tok.encode(CORPUS[0]), tok.eos_token_id]
    assert s["input_ids"].dtype == torch.long and s["input_ids"].ndim == 1
    assert s["input_ids"].tolist() == expected
    assert torch.equal(s["labels"], s["input_ids"])
    assert ds.lengths[0] == len(expected) and ds.lengths.dtype == np.int64
    assert ds.stats.n_truncated == 0 and ds.stats.n_samples == len(CORPUS)


def test_pretrain_truncation_is_counted(pre_path, tok):
    full = D.PretrainDataset(pre_path, tok, seq_len=10_000)
    ds = D.PretrainDataset(pre_path, tok, seq_len=16)
    raw = full.lengths
    assert ds.lengths.max() == 16 and len(ds[0]["input_ids"]) == 16
    assert ds.stats.n_truncated == int((raw > 16).sum()) > 0
    assert ds.stats.truncated_tokens == int((raw - 16).clip(0).sum())
    assert ds.stats.n_tokens == int(ds.lengths.sum())
    # MiniMind-3's cut: bos + text[:seq_len - 2] + eos, the text's tokens encoded whole and then cut
    for i in np.flatnonzero(raw > 16):
        text_ids = tok.encode(CORPUS[i])
        assert ds[int(i)]["input_ids"].tolist() == [tok.bos_token_id, *text_ids[:14], tok.eos_token_id]
    wide = D.PretrainDataset(pre_path, tok, seq_len=int(raw.max()))  # no text longer than seq_len: nothing is cut
    assert all(wide[i]["input_ids"].tolist() == full[i]["input_ids"].tolist() for i in range(len(CORPUS)))
    assert D.PretrainDataset(pre_path, tok, seq_len=2)[0]["input_ids"].tolist() == [tok.bos_token_id, tok.eos_token_id]


def _rows_of(ds):
    """Rebuild each document from its chunked rows (dropping each continuation row's one-token overlap)."""
    docs: dict[int, list[int]] = {}
    for i, (doc, start) in enumerate(ds._row_index()):
        ids = ds[i]["input_ids"].tolist()
        assert len(ids) == ds.lengths[i] <= ds.seq_len
        docs.setdefault(int(doc), []).extend(ids if start == 0 else ids[1:])
    return docs


@pytest.mark.parametrize("seq_len", [2, 3, 7, 16])
def test_pretrain_chunking_trains_every_target_once(pre_path, tok, seq_len):
    full = D.PretrainDataset(pre_path, tok, seq_len=10_000)
    ds = D.PretrainDataset(pre_path, tok, seq_len=seq_len, long_docs="chunk")
    raw = full.lengths
    rebuilt = _rows_of(ds)
    assert [rebuilt[d] for d in range(len(full))] == [full[d]["input_ids"].tolist() for d in range(len(full))]
    # every next-token target of every document is in exactly one row: sum(row - 1) == sum(doc - 1)
    assert int((ds.lengths - 1).sum()) == int((raw - 1).sum())
    assert int((ds.lengths < 2).sum()) == 0  # no row without a target
    st = ds.stats
    assert st.n_truncated == st.truncated_tokens == 0
    assert st.n_documents == len(full) and st.n_samples == len(ds) > len(full)
    assert st.n_chunked == int((raw > seq_len).sum()) and st.n_tokens == int(ds.lengths.sum())
    assert "split into rows" in st.summary()


def test_pretrain_chunk_row_boundaries(tmp_path, tok):
    seq = 8
    doc_ids = [tok.bos_token_id, *tok.encode(CORPUS[0]), tok.eos_token_id]
    n = len(doc_ids)
    ds = D.PretrainDataset(write_jsonl(tmp_path / "one.jsonl", [{"text": CORPUS[0]}]), tok, seq, long_docs="chunk")
    # rows start every seq - 1 tokens; the last row may be as short as 2 tokens, never 1
    starts = list(range(0, n - 1, seq - 1))
    assert ds._row_index()[:, 1].tolist() == starts
    assert [ds[i]["input_ids"].tolist() for i in range(len(ds))] == [doc_ids[a:a + seq] for a in starts]
    assert ds[0]["input_ids"][0] == tok.bos_token_id and ds[len(ds) - 1]["input_ids"][-1] == tok.eos_token_id
    assert torch.equal(ds[1]["labels"], ds[1]["input_ids"])


def test_chunking_without_long_documents_changes_nothing(pre_path, tok):
    trunc = D.PretrainDataset(pre_path, tok, seq_len=10_000)
    chunk = D.PretrainDataset(pre_path, tok, seq_len=10_000, long_docs="chunk")
    assert len(trunc) == len(chunk) and np.array_equal(trunc.lengths, chunk.lengths)
    assert all(torch.equal(trunc[i]["input_ids"], chunk[i]["input_ids"]) for i in range(len(trunc)))
    assert chunk.stats.n_chunked == 0


def test_chunking_refused_for_sft_and_unknown_modes(pre_path, sft_path, tok):
    with pytest.raises(ValueError, match="long_docs='chunk' is for pretraining text"):
        D.SFTDataset(sft_path, tok, 16, long_docs="chunk")
    with pytest.raises(ValueError, match="long_docs"):
        D.PretrainDataset(pre_path, tok, 16, long_docs="split")


def test_lazy_matches_eager(pre_path, sft_path, tok):
    for cls, path in ((D.PretrainDataset, pre_path), (D.SFTDataset, sft_path)):
        eager, lazy = cls(path, tok, 40), cls(path, tok, 40, lazy=True)
        assert len(eager) == len(lazy)
        assert np.array_equal(eager.lengths, lazy.lengths)
        for i in range(len(eager)):
            for k in ("input_ids", "labels"):
                assert torch.equal(eager[i][k], lazy[i][k])
        assert eager.stats == lazy.stats


def test_vocab_mismatch_refused(pre_path, tok):
    with pytest.raises(ValueError, match="does not match the model's vocab_size=6400"):
        D.PretrainDataset(pre_path, tok, 32, vocab_size=6400)
    D.PretrainDataset(pre_path, tok, 32, vocab_size=tok.vocab_size)  # matching: fine


def test_seq_len_too_short(pre_path, tok):
    with pytest.raises(ValueError, match="seq_len=1 is too short"):
        D.PretrainDataset(pre_path, tok, 1)


# ---------------------------------------------------------------- SFT labels


def _trained_text(tok, sample):
    ids, labels = sample["input_ids"], sample["labels"]
    assert torch.equal(labels[labels != -100], ids[labels != -100])  # aligned: a label is the token itself
    return tok.decode(ids[labels != -100].tolist())


def test_sft_labels_only_on_assistant_content_and_im_end(sft_path, tok):
    ds = D.SFTDataset(sft_path, tok, 512)
    assert _trained_text(tok, ds[0]) == "To be, or not to be.<|im_end|>\n"
    # multi-turn: both assistant replies, content starting with blank lines included, user turns not
    assert _trained_text(tok, ds[1]) == "疑是地上霜。<|im_end|>\n" + "\n\nHello!<|im_end|>\n"
    s = ds[0]
    ids = s["input_ids"].tolist()
    rendered = tok.apply_chat_template(
        [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "Hello there?"},
         {"role": "assistant", "content": "To be, or not to be."}], tokenize=True)
    assert ids == rendered
    # the "\n" after <|im_end|> is trained too, as MiniMind-3 trains it; the header before the reply is not
    assert ids[-2] == tok.eos_token_id and s["labels"][-2:].tolist() == ids[-2:] == [tok.eos_token_id, *tok.encode("\n")]
    header = len(tok.encode("<|im_start|>assistant\n"))
    assert (s["labels"][-2 - len(tok.encode("To be, or not to be.")) - header:][:header] == -100).all()


def test_assistant_mask_slow_path_and_content_with_special_text(tok):
    c = [{"role": "user", "content": "say <|im_end|> please"}, {"role": "assistant", "content": "ok <|im_start|>user"}]
    ids, mask = C.encode_sft(tok, c)
    assert tok.decode(np.asarray(ids)[mask == 1].tolist()) == "ok <|im_start|>user<|im_end|>\n"
    # a header tokenized differently from encode("assistant\n") still masks, by decoding the role tokens
    b, e, nl = tok.bos_token_id, tok.eos_token_id, tok.encode("\n")
    header = [t for c in "assistant" for t in tok.encode(c)]  # one token per letter: not what encode() gives
    ids2 = [b, *tok.encode("u"), *tok.encode("ser"), *nl, *tok.encode("Q"), e, *nl,
            b, *header, *nl, *tok.encode("Hi"), e, *nl]
    k = len(ids2) - ids2[::-1].index(b)  # just after the second <|im_start|>
    assert tuple(ids2[k:k + len(tok.encode("assistant\n"))]) != tuple(tok.encode("assistant\n"))
    m2 = C.assistant_mask(tok, ids2)
    assert tok.decode([i for i, k in zip(ids2, m2) if k]) == "Hi<|im_end|>\n"
    # a turn cut before its <|im_end|> is trained to the cut; an <|im_end|> without its "\n" alone
    assert tok.decode([i for i, k in zip(ids2[:-2], C.assistant_mask(tok, ids2[:-2])) if k]) == "Hi"
    assert tok.decode([i for i, k in zip(ids2[:-1], C.assistant_mask(tok, ids2[:-1])) if k]) == "Hi<|im_end|>"


def test_sft_truncation_and_no_target_counted(tmp_path, tok):
    long_user = "To be, or not to be, that is the question. " * 5
    p = write_jsonl(tmp_path / "s.jsonl", [conv(("user", long_user), ("assistant", "yes")),
                                           conv(("user", "hi"), ("assistant", "Hello there!"))])
    ds = D.SFTDataset(p, tok, 24)
    assert ds.stats.n_truncated == 1 and ds.stats.truncated_tokens > 0
    assert ds.stats.n_no_target == 1  # the first sample lost its whole reply to truncation: counted, not hidden
    assert (ds[0]["labels"] == -100).all() and len(ds[0]["input_ids"]) == 24
    assert ds.stats.n_trained_tokens == int((ds[1]["labels"][1:] != -100).sum())
    assert "1 samples left with nothing to train" in ds.stats.summary()


# ---------------------------------------------------------------- memmap


@pytest.mark.parametrize("num_workers", [0, 2])
def test_memmap_pretrain_matches_in_memory(tmp_path, pre_path, tok, num_workers):
    info = C.tokenize_to_memmap(pre_path, tok, tmp_path / "cache" / "pre", num_workers=num_workers,
                                chunk_size=3, progress=False)
    assert not info.reused and info.n_samples == len(CORPUS) and info.num_workers == num_workers
    for f in info.files:
        assert os.path.isfile(f)
    mem = D.PretrainDataset(pre_path, tok, 20)
    mm = D.PretrainDataset(info.prefix, tok, 20)
    raw = D.MemmapDataset(info.prefix, 20)
    assert np.array_equal(mem.lengths, mm.lengths) and np.array_equal(mm.lengths, raw.lengths)
    for i in range(len(mem)):
        assert torch.equal(mem[i]["input_ids"], mm[i]["input_ids"]) and torch.equal(mem[i]["labels"], raw[i]["labels"])
    assert mem.stats.n_truncated == mm.stats.n_truncated == raw.stats.n_truncated
    assert np.load(info.prefix + ".idx.npy").dtype == np.int64
    meta = json.loads(open(info.prefix + ".json").read())
    assert meta["n_tokens"] * 2 == os.path.getsize(info.prefix + ".bin")
    assert meta["tokenizer"]["vocab_size"] == tok.vocab_size and meta["source"]["size"] == os.path.getsize(pre_path)


def test_memmap_chunking_matches_in_memory(tmp_path, pre_path, sft_path, tok):
    info = C.tokenize_to_memmap(pre_path, tok, tmp_path / "pre", num_workers=0, progress=False)
    mem = D.PretrainDataset(pre_path, tok, 12, long_docs="chunk")
    for mm in (D.PretrainDataset(info.prefix, tok, 12, long_docs="chunk"), D.MemmapDataset(info.prefix, 12, "chunk")):
        assert len(mm) == len(mem) and np.array_equal(mm.lengths, mem.lengths)
        assert all(torch.equal(mem[i]["input_ids"], mm[i]["input_ids"]) for i in range(len(mem)))
        assert mm.stats.n_chunked == mem.stats.n_chunked > 0
    sft_info = C.tokenize_to_memmap(sft_path, tok, tmp_path / "sft", kind="sft", num_workers=0, progress=False)
    with pytest.raises(ValueError, match="is for pretraining text"):
        D.MemmapDataset(sft_info.prefix, 12, "chunk")


def test_memmap_sft_matches_in_memory(tmp_path, sft_path, tok):
    info = C.tokenize_to_memmap(sft_path, tok, tmp_path / "sft", kind="sft", num_workers=2, chunk_size=4, progress=False)
    mem, mm = D.SFTDataset(sft_path, tok, 30), D.SFTDataset(info.prefix, tok, 30)
    for i in range(len(mem)):
        assert torch.equal(mem[i]["labels"], mm[i]["labels"])
    assert mem.stats.n_trained_tokens == mm.stats.n_trained_tokens
    with pytest.raises(ValueError, match="holds 'sft' samples, not 'pretrain'"):
        D.PretrainDataset(info.prefix, tok, 30)


def test_memmap_reuse_and_rebuild_when_stale(tmp_path, pre_path, tok, tok2):
    prefix = tmp_path / "pre"
    assert not C.tokenize_to_memmap(pre_path, tok, prefix, num_workers=0, progress=False).reused
    assert C.tokenize_to_memmap(pre_path, tok, prefix, num_workers=0, progress=False).reused
    fresh, reason = C.memmap_is_fresh(prefix, pre_path, tok2)
    assert not fresh and "tokenizer changed" in reason
    info = C.tokenize_to_memmap(pre_path, tok2, prefix, num_workers=0, progress=False)
    assert not info.reused
    with pytest.raises(ValueError, match="tokenized with another tokenizer"):
        D.PretrainDataset(prefix, tok, 32)
    with open(pre_path, "a") as f:  # the source changes: size and mtime differ
        f.write(json.dumps({"text": "one more line"}) + "\n")
    os.utime(pre_path, ns=(time.time_ns(), time.time_ns() + 10**9))
    fresh, reason = C.memmap_is_fresh(prefix, pre_path, tok2)
    assert not fresh and "source changed" in reason
    info = C.tokenize_to_memmap(pre_path, tok2, prefix, num_workers=0, progress=False)
    assert not info.reused and info.n_samples == len(CORPUS) + 1


@pytest.mark.parametrize("num_workers", [0, 2])
def test_memmap_malformed_line_raises_or_skips(tmp_path, tok, num_workers):
    p = write_jsonl(tmp_path / "bad.jsonl", [{"text": "ok"}] * 5 + ['{"text": '] + [{"text": "fine"}] * 3)
    with pytest.raises(C.DataFormatError, match=r"bad\.jsonl:6: malformed JSON"):
        C.tokenize_to_memmap(p, tok, tmp_path / "c", num_workers=num_workers, chunk_size=2, progress=False)
    assert not os.path.exists(tmp_path / "c.json") and not os.path.exists(tmp_path / "c.bin")  # nothing half-written
    assert not [f for f in os.listdir(tmp_path) if ".tmp-" in f]
    with pytest.warns(UserWarning, match="skipped 1 lines"):
        info = C.tokenize_to_memmap(p, tok, tmp_path / "c", num_workers=num_workers, chunk_size=2,
                                    on_error="skip", progress=False)
    assert info.n_samples == 8 and info.n_skipped == 1 and "bad.jsonl:6" in info.skipped_examples[0]
    assert D.MemmapDataset(info.prefix, 8).stats.n_skipped == 1


def test_memmap_max_samples(tmp_path, pre_path, tok):
    info = C.tokenize_to_memmap(pre_path, tok, tmp_path / "c", num_workers=2, chunk_size=3, max_samples=7, progress=False)
    assert info.n_samples == 7 and len(D.MemmapDataset(info.prefix, 16)) == 7
    assert not C.memmap_is_fresh(info.prefix, pre_path, tok, max_samples=None)[0]  # a capped cache is not the full one


def test_memmap_refuses_big_vocab_and_missing_files(tmp_path, pre_path, tok):
    class Big:
        vocab_size = 70_000

    with pytest.raises(ValueError, match="vocab_size=70000 does not fit uint16"):
        C.tokenize_to_memmap(pre_path, Big(), tmp_path / "c")
    with pytest.raises(FileNotFoundError, match="jsonl file not found"):
        C.tokenize_to_memmap(tmp_path / "none.jsonl", tok, tmp_path / "c")
    with pytest.raises(FileNotFoundError, match="memmap metadata not found"):
        D.MemmapDataset(tmp_path / "nothing", 16)


def test_memmap_dataset_opens_lazily_and_pickles_without_mapping(tmp_path, pre_path, tok):
    info = C.tokenize_to_memmap(pre_path, tok, tmp_path / "c", num_workers=0, progress=False)
    mm = D.MemmapDataset(info.prefix, 32)
    assert mm._tokens is None  # nothing mapped until the first read
    first = mm[0]
    assert mm._tokens is not None
    clone = pickle.loads(pickle.dumps(mm))
    assert clone._tokens is None and torch.equal(clone[0]["input_ids"], first["input_ids"])
    loader = torch.utils.data.DataLoader(mm, batch_size=4, num_workers=1,
                                         collate_fn=functools.partial(D.pad_collate, pad_id=tok.pad_token_id))
    assert sum(b["input_ids"].shape[0] for b in loader) == len(mm)


# ---------------------------------------------------------------- collators


def _samples(lengths):
    return [{"input_ids": torch.arange(1, n + 1), "labels": torch.arange(1, n + 1)} for n in lengths]


def test_pad_collate_fixed_and_longest():
    batch = _samples([3, 5, 2])
    fixed = D.pad_collate(batch, pad_id=0, seq_len=8, fixed=True)
    longest = D.pad_collate(batch, pad_id=0)
    assert fixed["input_ids"].shape == (3, 8) and longest["input_ids"].shape == (3, 5)
    for out in (fixed, longest):
        assert set(out) == {"input_ids", "labels", "attention_mask"}
        assert all(v.dtype == torch.long for v in out.values())
        assert out["attention_mask"].sum(1).tolist() == [3, 5, 2]
        assert (out["labels"][out["attention_mask"] == 0] == -100).all()
        assert (out["input_ids"][out["attention_mask"] == 0] == 0).all()
    assert D.padding_fraction([[3, 5, 2]], seq_len=8) == pytest.approx(1 - 10 / 24)
    assert D.padding_fraction([[3, 5, 2]]) == pytest.approx(1 - 10 / 15)
    assert D.padding_fraction([[3, 5], [2]]) == pytest.approx(1 - 10 / 12)
    assert D.trained_tokens(longest["labels"]) == 2 + 4 + 1
    assert D.pad_collate(batch, seq_len=4)["input_ids"].shape == (3, 4)  # rows cut to seq_len


def test_collator_errors():
    with pytest.raises(ValueError, match="pad_collate got an empty list of samples"):
        D.pad_collate([])
    with pytest.raises(ValueError, match=r"pad_collate\(fixed=True\) needs seq_len"):
        D.pad_collate(_samples([3]), fixed=True)


def test_pad_collate_is_picklable():
    fn = pickle.loads(pickle.dumps(functools.partial(D.pad_collate, pad_id=0, seq_len=6, fixed=True)))
    assert fn(_samples([2, 3]))["input_ids"].shape == (2, 6)


def test_missing_source_names_both_options(tmp_path, tok):
    with pytest.raises(FileNotFoundError, match="neither a jsonl file nor a memmap prefix"):
        D.PretrainDataset(tmp_path / "cache" / "pretrain", tok, 32)


def test_memmap_dataset_seq_len_is_independent(tmp_path, pre_path, tok):
    info = C.tokenize_to_memmap(pre_path, tok, tmp_path / "c", num_workers=0, progress=False)
    mm = D.MemmapDataset(info.prefix, 8)
    ds = D.PretrainDataset(mm, tok, 16)
    assert mm.lengths.max() == 8 and ds.lengths.max() == 16 and len(ds[0]["input_ids"]) == 16


def test_default_tokenizer_workers_follow_the_measured_rule(monkeypatch):
    # notebook 02 (2 cores): 2 processes were faster for SFT (Python template and mask), slower for pretraining text
    monkeypatch.setattr(C.multiprocessing, "get_start_method", lambda: "fork")
    big, small = 2**18, 2**18 - 1
    assert [C.default_num_workers(big, "sft", cores=c) for c in (1, 2, 3, 8, 64)] == [0, 2, 3, 8, 8]
    assert [C.default_num_workers(2**30, "pretrain", cores=c) for c in (1, 2, 64)] == [0, 0, 0]
    assert C.default_num_workers(small, "sft", cores=8) == 0  # a small file: start-up would outweigh the work
    monkeypatch.setattr(C.multiprocessing, "get_start_method", lambda: "spawn")
    assert C.default_num_workers(big, "sft", cores=8) == 0  # measured with fork only


def test_a_call_without_num_workers_asks_the_default_for_its_kind(tmp_path, tok, monkeypatch):
    seen = []
    monkeypatch.setattr(C, "default_num_workers", lambda n_bytes, kind: seen.append((n_bytes, kind)) or 0)
    src = tmp_path / "sft.jsonl"
    src.write_text("".join(json.dumps({"conversations": [{"role": "user", "content": f"q{i}"},
                                                         {"role": "assistant", "content": "a"}]}) + "\n"
                           for i in range(5)))
    info = C.tokenize_to_memmap(src, tok, tmp_path / "a", kind="sft", progress=False)
    assert seen == [(src.stat().st_size, "sft")] and info.num_workers == 0
