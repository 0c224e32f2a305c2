"""Byte-level BPE from scratch: the code written cell by cell in notebook 01_tokenizer, same names,
same order.

One token per UTF-8 byte; training gives the most frequent adjacent pair a new id (a *merge*),
encoding replays the merges in the order learned. It learns and encodes exactly as `tokenizers`'
BpeTrainer with ByteLevel(add_prefix_space= False, use_regex=False) and its alphabet
(tests/test_bpe.py proves it) by two choices: byte ids sorted by the printable character GPT-2 maps
them to ('!' is 0, ' ' is 220), and count ties going to the smallest pair, as BpeTrainer's do."""

from collections import Counter
from collections.abc import Iterable

# (left id, right id) -> new id, in the order learned (so new ids grow)
Merges = dict[tuple[int, int], int]


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map from the 256 bytes to printable characters: ByteLevel's alphabet, the spelling of
    tokenizer.json."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    # space, control bytes...: moved past 255, in byte order
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + n) for n, b in enumerate(others)}}


BYTE_TO_UNICODE: dict[int, str] = bytes_to_unicode()  # e.g. 32 (space) -> 'Ġ'
UNICODE_TO_BYTE: dict[str, int] = {c: b for b, c in BYTE_TO_UNICODE.items()}
# token id -> byte value, as `tokenizers` numbers
BYTE_ORDER: list[int] = sorted(range(256), key=BYTE_TO_UNICODE.get)
BYTE_ID: dict[int, int] = {b: i for i, b in enumerate(BYTE_ORDER)}  # byte value -> token id


def get_stats(words: list[list[int]]) -> Counter:
    """Count adjacent token pairs over all words (pairs never cross from one word to the next)."""
    stats: Counter = Counter()
    for ids in words:
        stats.update(zip(ids, ids[1:]))
    return stats


def merge(ids: list[int], pair: tuple[int, int], new_id: int) -> list[int]:
    """Replace every occurrence of pair in ids by new_id, scanning left to right (so 'aaa' -> 'aa'
    'a')."""
    out, i = [], 0
    while i < len(ids):
        if i + 1 < len(ids) and (ids[i], ids[i + 1]) == pair:
            out.append(new_id)
            i += 2
        else:
            out.append(ids[i])
            i += 1
    return out


def train(texts: Iterable[str], vocab_size: int) -> tuple[Merges, list[bytes]]:
    """Learn merges until the vocabulary has vocab_size tokens (or no pair is left): returns
    (merges, vocab)."""
    if vocab_size < 256:
        raise ValueError(f"vocab_size={vocab_size} must be at least 256 (one token per byte)")
    words = [[BYTE_ID[b] for b in text.encode("utf-8")] for text in texts]
    vocab = [bytes([b]) for b in BYTE_ORDER]  # token id -> the bytes it stands for
    merges: Merges = {}
    while len(vocab) < vocab_size:
        stats = get_stats(words)
        if not stats:
            break  # every word is a single token already
        # most frequent; ties: smallest pair, as in `tokenizers`
        pair = min(stats, key=lambda p: (-stats[p], p))
        merges[pair] = len(vocab)
        vocab.append(vocab[pair[0]] + vocab[pair[1]])
        words = [merge(ids, pair, merges[pair]) for ids in words]
    return merges, vocab


def encode(text: str, merges: Merges) -> list[int]:
    """Token ids of text: its bytes, then the merges replayed, the earliest-learned pair present
    first."""
    ids = [BYTE_ID[b] for b in text.encode("utf-8")]
    while len(ids) >= 2:
        # The pair learned first (smallest new id); pairs that this merge creates were learned
        # later, if at all.
        pair = min(zip(ids, ids[1:]), key=lambda p: merges.get(p, float("inf")))
        if pair not in merges:
            break  # no adjacent pair is a merge
        ids = merge(ids, pair, merges[pair])
    return ids


def decode(ids: Iterable[int], vocab: list[bytes]) -> str:
    """Text of token ids (bytes that are not valid UTF-8 become U+FFFD, as in `tokenizers`)."""
    return b"".join(vocab[i] for i in ids).decode("utf-8", errors="replace")


class BPE:
    """The functions above bundled with their state: `BPE.train(texts, vocab_size)`, then encode /
    decode."""
    def __init__(self, merges: Merges, vocab: list[bytes]) -> None:
        self.merges, self.vocab = merges, vocab

    @classmethod
    def train(cls, texts: str | Iterable[str], vocab_size: int) -> "BPE":
        """Train on one string or several (each one a word of its own)."""
        return cls(*train([texts] if isinstance(texts, str) else texts, vocab_size))

    @property
    def vocab_size(self) -> int:
        """Number of distinct tokens (256 bytes + new tokens)."""
        return len(self.vocab)

    def encode(self, text: str) -> list[int]:
        """Token ids of text."""
        return encode(text, self.merges)

    def decode(self, ids: Iterable[int]) -> str:
        """Text of token ids."""
        return decode(ids, self.vocab)
