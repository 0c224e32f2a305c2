"""01_tokenizer's regions, against minimind_lib.bpe: pair counts, merge, training, encoding."""
from collections.abc import Mapping

from minimind_lib import bpe

from . import Case, draw, region

ALPHABET = "ab 中😀\n"  # few characters: many ties; characters of 3 and 4 bytes: merges inside a character


def text(g, alphabet: str = ALPHABET, most: int = 30) -> str:
    return "".join(alphabet[draw(g, 0, len(alphabet) - 1)] for _ in range(draw(g, 0, most)))


def _counts(fn, case):
    stats = fn([list(w) for w in case.args[0]])
    return {p: n for p, n in stats.items() if n} if isinstance(stats, Mapping) else stats


region("get_stats", "count every pair of neighbours within each word, overlapping ones too, never across two words.",
       bpe.get_stats, run=_counts, output="the count of each pair",
       fixed=lambda: [Case(f"the words {w}", w) for w in ([[1, 2], [3, 4]], [[5, 5, 5]], [[1, 2, 1, 2], [], [7]])],
       drawn=lambda g: [Case(f"the words {w}", w) for w in ([[draw(g, 0, n) for _ in range(draw(g, 0, 12))]
                                                             for _ in range(draw(g, 1, 8))] for n in (1, 2, 300))],
       mistakes=(("It counts a pair across two words: pairs never cross the end of a word.",
                  ("for ids in words:", "for ids in [[i for w in words for i in w]]:")),
                 ("It counts each pair once per word ('aaa' holds 'aa' twice).",
                  ("zip(ids, ids[1:])", "set(zip(ids, ids[1:]))")),))

region("merge", "scan left to right: where the pair starts, write new_id and move past both its ids; else copy one.",
       bpe.merge, fixed=lambda: [Case(f"merge({i}, {p}, 9)", i, p, 9) for i, p in (
           ([7, 7, 7], (7, 7)), ([1, 2, 3, 1, 2, 3], (1, 2)), ([3, 1, 2], (1, 2)), ([], (1, 2)), ([5], (5, 5)))],
       drawn=lambda g: [Case(f"merge({i}, {p}, 256)", i, p, 256) for i, p in (
           ([draw(g, 0, n) for _ in range(draw(g, 0, 16))], (draw(g, 0, n), draw(g, 0, n))) for n in (1, 2, 4) * 3)],
       mistakes=(("After a merge it moves on by one, so in [7, 7, 7] the middle 7 is used twice.",
                  ("i += 2", "i += 1")),
                 ("It merges only the first occurrence of the pair.", ("append(new_id)", "append(new_id)\n            "
                                                                       "pair = None")),
                 ("It misses the pair formed by the last two ids.", ("i + 1 < len(ids)", "i + 2 < len(ids)")),
                 ("It scans right to left ([7, 7, 7] gives [7, 9], not [9, 7]).",
                  lambda ids, pair, new: bpe.merge(ids[::-1], pair[::-1], new)[::-1])))


def _learned(fn, case):
    out = fn(list(case.args[0]), case.args[1])
    return {"the merges, in the order learned": list(dict(out[0]).items()), "the vocabulary": list(out[1])} if (
        isinstance(out, tuple) and len(out) == 2) else {"what train returns": out}


PICK = "min(stats, key=lambda p: (-stats[p], p))"
region("train", "from every text's byte ids: count, merge the most frequent pair (ties: the smallest ids) under the "
       "next free id, add its bytes, until vocab_size or no pair is left.", bpe.train, run=_learned,
       fixed=lambda: [Case(f"train({t!r}, {n})", t, n) for t, n in (
           (["cdab"], 257), (["aaab"], 257), (["aaabdaaabac"], 259), (["ab", ""], 262), ([ALPHABET * 2], 266))],
       drawn=lambda g: [Case(f"train({t!r}, {n})", t, n) for t, n in (
           ([text(g) for _ in range(draw(g, 1, 6))], 256 + draw(g, 5, 40)) for _ in range(2))],
       mistakes=(("Of pairs of the same count it takes the one met first (max, most_common): ties go to the smallest "
                  "pair of ids, as in tokenizers.", (PICK, "max(stats, key=stats.get)")),
                 ("Of pairs of the same count it takes the largest pair of ids: ties go to the smallest.",
                  (PICK, "max(stats, key=lambda p: (stats[p], p))")),
                 ("It merges the least frequent pair.", (PICK, "min(stats, key=lambda p: (stats[p], p))")),
                 ("Its new ids count from 0: they follow the 256 bytes, each the vocabulary's length.",
                  ("= len(vocab)", "= len(merges)")),
                 ("Its new ids count from 255: each is the vocabulary's length.",
                  ("= len(vocab)", "= len(vocab) - 1"))))


def _encode_cases() -> list:
    a, b, c = (bpe.BYTE_ID[ord(x)] for x in "abc")
    return [Case(f"encode({t!r}, {m})", t, m) for t, m in (
        ("aaaa", {(a, a): 256, (256, 256): 257}), ("abc", {(a, b): 256, (b, c): 257}),
        ("abcbc", {(a, b): 256, (b, c): 257}), ("ab 中😀", bpe.train(["ab 中😀ab 中"], 266)[0]))]


NEXT = 'min(zip(ids, ids[1:]), key=lambda p: merges.get(p, float("inf")))'
region("encode", "from the text's byte ids, merge again and again the adjacent pair learned first (the smallest new "
       "id), until no adjacent pair is a merge.", bpe.encode, fixed=_encode_cases,
       drawn=lambda g: [Case(f"encode({t!r}, the merges of train({x!r}, {n}))", t, bpe.train(x, n)[0]) for x, n, t in (
           ([text(g, "ab \n") for _ in range(4)], 256 + draw(g, 10, 40), text(g, "abc \n", 40)) for _ in range(2))],
       mistakes=(("It stops after one merge: a merge can make a pair that is a later merge ('aa' + 'aa').",
                  ("while len(ids) >= 2:", "for _ in range(len(ids) >= 2):")),
                 ("It applies the merge learned last first: merges replay in the order learned.",
                  (NEXT, "max(zip(ids, ids[1:]), key=lambda p: merges.get(p, -1))")),
                 ("It merges the text's most frequent pair first, training's rule: merges replay in the order learned.",
                  (NEXT, "max(zip(ids, ids[1:]), key=lambda p: (p in merges, [*zip(ids, ids[1:])].count(p)))"))))
