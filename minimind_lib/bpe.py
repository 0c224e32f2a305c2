"""Byte-level BPE from scratch, small enough to read in one sitting (in the spirit of Karpathy's minbpe).

Text -> UTF-8 bytes -> one token per byte; training repeatedly finds the most frequent adjacent pair of tokens
and gives it a new id (a *merge*). Encoding replays the merges; decoding concatenates the tokens' bytes.

Three choices make this trainer learn *exactly* what Hugging Face `tokenizers`' BpeTrainer learns with
`ByteLevel(add_prefix_space=False, use_regex=False)` (no regex pre-split) and `initial_alphabet=ByteLevel.alphabet()`
(notebook 01 and tests/test_bpe.py prove it on a corpus):
1. The 256 byte tokens are numbered as `tokenizers` numbers ByteLevel's alphabet: sorted by the printable character
   GPT-2 maps each byte to, so b'!' is id 0 and b' ' is id 220 (see BYTE_ORDER).
2. Count ties are broken by the smallest pair (left id, then right id), as BpeTrainer's priority queue does.
3. A merge whose bytes are already a token reuses that token's id instead of minting a new one, as BpeTrainer does.
Encoding merges the lowest-ranked adjacent pair, leftmost first, one at a time: the order `tokenizers`' BPE model uses.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable


def _printable_bytes() -> list[int]:
    """Bytes GPT-2's byte-to-unicode map keeps as themselves (visible Latin-1 characters)."""
    return [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]


# GPT-2 maps the printable bytes to themselves and the rest (space, control bytes...) to chr(256 + n) in byte order;
# `tokenizers` sorts that alphabet by code point, so ids follow: printable bytes first, then the others.
BYTE_ORDER: list[int] = _printable_bytes() + [b for b in range(256) if b not in set(_printable_bytes())]
BYTE_ID: dict[int, int] = {b: i for i, b in enumerate(BYTE_ORDER)}  # byte value -> token id


def get_stats(words: list[list[int]], freqs: list[int] | None = None) -> Counter:
    """Count adjacent token pairs over all words (each word weighted by its frequency)."""
    stats: Counter = Counter()
    for k, ids in enumerate(words):
        f = 1 if freqs is None else freqs[k]
        for pair in zip(ids, ids[1:]):
            stats[pair] += f
    return stats


def merge(ids: list[int], pair: tuple[int, int], new_id: int) -> list[int]:
    """Replace every occurrence of pair in ids by new_id, scanning left to right (so 'aaa' -> 'aa' 'a')."""
    out, i = [], 0
    while i < len(ids):
        if i + 1 < len(ids) and (ids[i], ids[i + 1]) == pair:
            out.append(new_id)
            i += 2
        else:
            out.append(ids[i])
            i += 1
    return out


class BPE:
    """A byte-level BPE tokenizer: `train`, `encode`, `decode`, with the learned merges in order."""

    def __init__(self) -> None:
        self.vocab: list[bytes] = [bytes([b]) for b in BYTE_ORDER]  # id -> the bytes it stands for
        self.merges: list[tuple[tuple[int, int], int]] = []  # ((left id, right id), new id), in training order
        self.merge_counts: list[int] = []  # how often each merged pair occurred when it was chosen
        self.merge_ties: list[int] = []  # how many pairs shared that top count (>1: the tie-break decided)
        self.ranks: dict[tuple[int, int], tuple[int, int]] = {}  # pair -> (rank, new id), for encode

    @property
    def vocab_size(self) -> int:
        """Number of distinct tokens (256 bytes + new tokens)."""
        return len(self.vocab)

    def train(self, text: str | Iterable[str], vocab_size: int, verbose: bool = False) -> "BPE":
        """Learn merges until the vocabulary has vocab_size tokens (or no pair is left).

        text is one string or several (pairs never cross from one string to the next).
        """
        if vocab_size < 256:
            raise ValueError(f"vocab_size={vocab_size} must be at least 256 (one token per byte)")
        chunks = Counter([text] if isinstance(text, str) else text)  # identical chunks are counted once, weighted
        words = [[BYTE_ID[b] for b in chunk.encode("utf-8")] for chunk in chunks]
        freqs = list(chunks.values())
        index = {tok: i for i, tok in enumerate(self.vocab)}  # bytes -> id
        while len(self.vocab) < vocab_size:
            stats = get_stats(words, freqs)
            if not stats:
                break  # every chunk is a single token already
            # The most frequent pair; ties go to the smallest (left id, right id), as in `tokenizers`.
            pair = min(stats, key=lambda p: (-stats[p], p))
            new_bytes = self.vocab[pair[0]] + self.vocab[pair[1]]
            new_id = index.get(new_bytes)
            if new_id is None:  # a brand new token (else: same bytes reached by another path, same id)
                new_id = len(self.vocab)
                self.vocab.append(new_bytes)
                index[new_bytes] = new_id
            self.ranks[pair] = (len(self.merges), new_id)
            self.merges.append((pair, new_id))
            self.merge_counts.append(stats[pair])
            self.merge_ties.append(sum(1 for c in stats.values() if c == stats[pair]))
            words = [merge(w, pair, new_id) for w in words]
            if verbose:
                print(f"merge {len(self.merges):4d}: {self.vocab[pair[0]]!r} + {self.vocab[pair[1]]!r}"
                      f" -> {new_id} {new_bytes!r} ({stats[pair]} times)")
        return self

    def encode(self, text: str) -> list[int]:
        """Token ids of text: bytes first, then merges, lowest rank first, leftmost occurrence first."""
        ids = [BYTE_ID[b] for b in text.encode("utf-8")]
        never = (len(self.merges), -1)
        while len(ids) >= 2:
            # Position of the adjacent pair that was learned earliest (leftmost among equals).
            i = min(range(len(ids) - 1), key=lambda k: self.ranks.get((ids[k], ids[k + 1]), never)[0])
            rank, new_id = self.ranks.get((ids[i], ids[i + 1]), never)
            if new_id < 0:
                break  # no adjacent pair is a merge: done
            ids[i : i + 2] = [new_id]
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        """Text of token ids (bytes that are not valid UTF-8 become U+FFFD, as in `tokenizers`)."""
        return b"".join(self.vocab[i] for i in ids).decode("utf-8", errors="replace")

    def token_str(self, token_id: int) -> str:
        """A token's text for display (bytes that are not whole characters shown as \\x.. escapes)."""
        return self.vocab[token_id].decode("utf-8", errors="backslashreplace")
