"""The from-scratch BPE: basics, round trips, and exact agreement with Hugging Face `tokenizers`.

The claim proved here (and in notebook 01): with no regex pre-split (ByteLevel(use_regex=False): each input string
is one word) and all 256 bytes in the alphabet, our trainer and `tokenizers`' BpeTrainer learn the same merges in
the same order, give every token the same id, and then encode every string to the same ids.
"""

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from minimind_lib.bpe import BPE, BYTE_ID, BYTE_ORDER, BYTE_TO_UNICODE, UNICODE_TO_BYTE, decode, encode, get_stats, merge, train

CORPUS = [
    "To be, or not to be, that is the question:",
    "Whether 'tis nobler in the mind to suffer",
    "The slings and arrows of outrageous fortune,",
    "Or to take arms against a sea of troubles",
    "And by opposing end them. To die—to sleep,",
    "床前明月光，疑是地上霜。舉頭望明月，低頭思故鄉。",
    "春眠不覺曉，處處聞啼鳥。夜來風雨聲，花落知多少。",
    "aaaaaaa bbbb aaaa 😀😀 tab\there\r\nnew line  double  space",
] * 3


def hf_train(corpus, vocab_size):
    """`tokenizers`' BpeTrainer set up like our trainer: byte-level, no regex split, all 256 bytes, no specials."""
    hf = Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    hf.train_from_iterator(corpus, trainer=trainer)
    hf.decoder = decoders.ByteLevel()
    return hf


def as_hf_merges(bpe: BPE) -> list[list[str]]:
    """Our merges written the way tokenizer.json writes them (ByteLevel's printable strings)."""
    s = lambda i: "".join(BYTE_TO_UNICODE[b] for b in bpe.vocab[i])
    return [[s(a), s(b)] for a, b in bpe.merges]


def assert_agree(corpus, vocab_size):
    ours = BPE.train(corpus, vocab_size)
    hf = hf_train(corpus, vocab_size)
    model = json.loads(hf.to_str())["model"]
    assert as_hf_merges(ours) == model["merges"]  # same merges, same order
    ours_vocab = {"".join(BYTE_TO_UNICODE[b] for b in tok): i for i, tok in enumerate(ours.vocab)}
    assert ours_vocab == model["vocab"]  # same ids
    assert len(set(ours.vocab)) == ours.vocab_size  # no two merges spell the same bytes
    for text in corpus:
        assert ours.encode(text) == hf.encode(text).ids
    return ours, hf


def test_get_stats_and_merge():
    assert get_stats([[1, 2, 1, 2], [1, 2], [1, 2], [1, 2], [7]]) == {(1, 2): 5, (2, 1): 1}  # no pair across words
    assert merge([7, 7, 7], (7, 7), 9) == [9, 7]  # left to right, no overlap
    assert merge([1, 2, 3, 1, 2], (1, 2), 4) == [4, 3, 4]


def test_byte_order_matches_tokenizers_alphabet():
    assert sorted(BYTE_ORDER) == list(range(256))
    assert set(BYTE_TO_UNICODE.values()) == set(pre_tokenizers.ByteLevel.alphabet())
    assert BYTE_TO_UNICODE[ord(" ")] == "Ġ" and BYTE_TO_UNICODE[ord("a")] == "a" and UNICODE_TO_BYTE["Ġ"] == 32
    assert BYTE_ID[ord("!")] == 0 and BYTE_ID[ord(" ")] == 220  # GPT-2's 'Ġ' is 220
    hf = hf_train(["x"], 256)  # no merges: the vocabulary is just the alphabet
    vocab = json.loads(hf.to_str())["model"]["vocab"]
    assert {BYTE_TO_UNICODE[b]: i for i, b in enumerate(BYTE_ORDER)} == vocab


def test_train_records_merges_in_order():
    bpe = BPE.train("aaabdaaabac", 256 + 3)
    a, b = BYTE_ID[ord("a")], BYTE_ID[ord("b")]
    merges = list(bpe.merges.items())
    assert merges[0] == ((a, a), 256)  # 'aa' occurs 4 times (overlapping pairs counted)
    # then 'a'+'b' and 'aa'+'a' both occur twice: the tie goes to the smaller pair of ids, (a, b)
    assert merges[1] == ((a, b), 257)
    assert [bpe.vocab[i] for i in bpe.merges.values()] == [b"aa", b"ab", b"aaab"]
    assert bpe.encode("aaabdaaabac") == [258, BYTE_ID[ord("d")], 258, a, BYTE_ID[ord("c")]]
    assert bpe.vocab_size == 259


def test_functions_and_class_agree():
    merges, vocab = train(CORPUS, 256 + 40)
    bpe = _trained()
    assert list(merges.items()) == list(bpe.merges.items())[:40] and vocab == bpe.vocab[:296]  # greedy: a prefix
    assert [encode(t, bpe.merges) for t in CORPUS] == [bpe.encode(t) for t in CORPUS]
    assert decode(bpe.encode(CORPUS[5]), vocab=bpe.vocab) == CORPUS[5]
    assert decode([BYTE_ID[0xC3]], bpe.vocab) == "\ufffd"  # half of 'é': not UTF-8 on its own


def test_training_stops_when_no_pairs_left():
    bpe = BPE.train(["ab", "ab"], 1000)
    assert bpe.vocab_size == 257 and len(bpe.merges) == 1


def test_vocab_size_too_small_is_refused():
    with pytest.raises(ValueError, match="vocab_size=100 must be at least 256"):
        BPE.train("abc", 100)


@settings(max_examples=60, deadline=None)
@given(st.text())
def test_round_trip_any_unicode(text):
    bpe = _trained()
    assert bpe.decode(bpe.encode(text)) == text


_CACHE = {}


def _trained() -> BPE:
    if "bpe" not in _CACHE:
        _CACHE["bpe"] = BPE.train(CORPUS, 256 + 120)
    return _CACHE["bpe"]


def test_agrees_with_tokenizers_on_corpus():
    ours, hf = assert_agree(CORPUS, 256 + 120)
    assert len(ours.merges) == 120


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.text(max_size=200))
def test_same_encoding_as_tokenizers_for_any_text(text):
    bpe = _trained()
    if "hf" not in _CACHE:
        _CACHE["hf"] = hf_train(CORPUS, 256 + 120)
    assert bpe.encode(text) == _CACHE["hf"].encode(text).ids


# Small alphabets make count ties (and tie-breaking) the rule rather than the exception.
@settings(max_examples=40, deadline=None)
@given(st.lists(st.text(alphabet="ab c", min_size=1, max_size=30), min_size=1, max_size=12),
       st.integers(min_value=1, max_value=60))
def test_same_merges_as_tokenizers_with_many_ties(corpus, n_merges):
    assert_agree(corpus, 256 + n_merges)
