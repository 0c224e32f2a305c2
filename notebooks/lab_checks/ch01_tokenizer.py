"""01_tokenizer's regions, against minimind_lib.bpe: pair counts, merge, training, encoding."""
from minimind_lib import bpe
from . import draw, pick, region

def some(g, options, most):
    return [pick(g, options) for _ in range(draw(g, 0, most))]
TEXT = "ab 中😀\n"  # few characters: many ties; 3- and 4-byte ones: merges inside a character
region("get_stats", "count each pair of neighbours within a word, overlapping ones too.",
       bpe.get_stats, output="the count of each pair",
       fixed=[([[1, 2], [3, 4]],), ([[5, 5, 5]],), ([[1, 2, 1, 2], [], [7]],)],
       drawn=lambda g: [([some(g, range(n), 12) for _ in range(draw(g, 1, 8))],) for n in (2, 300)],
       mistakes=(("It counts a pair across two words: count within each.", "for ids in words:",
                  "for ids in [sum(words, [])]:"),
                 ("It counts each pair once per word: 'aaa' holds 'aa' twice.", "zip(ids, ids[1:])",
                  "set(zip(ids, ids[1:]))")))
region("merge", "left to right: where the pair starts, new_id and past both; else copy one id.",
       bpe.merge, fixed=[([7, 7, 7], (7, 7), 9), ([1, 2, 3, 1, 2, 3], (1, 2), 9),
                         ([3, 1, 2], (1, 2), 9), ([], (1, 2), 9), ([5], (5, 5), 9)],
       drawn=lambda g: [(some(g, range(n), 16), (pick(g, range(n)), pick(g, range(n))), 256)
                        for n in (2, 3, 5) * 3],
       mistakes=(("It moves on by one, so in [7, 7, 7] the middle 7 merges twice: move past both.",
                  "i += 2", "i += 1"),))
def learned(fn, case):
    out = fn(*case.args)
    if not (isinstance(out, tuple) and len(out) == 2):
        return {"what train returns": out}
    return {"the merges, in the order learned": list(dict(out[0]).items()),
            "the vocabulary": list(out[1])}
region("train", "count, merge the most frequent pair (ties: the smallest ids) under the next id.",
       bpe.train, run=learned, fixed=[(["cdab"], 257), (["aaab"], 257), (["aaabdaaabac"], 259),
                                      (["ab", ""], 262), ([TEXT * 2], 266)],
       drawn=lambda g: [(["".join(some(g, TEXT, 30)) for _ in range(4)], 256 + draw(g, 5, 40))],
       mistakes=(("Of equal counts it takes the one met first: the smallest ids.",
                  "min(stats, key=lambda p: (-stats[p], p))", "max(stats, key=stats.get)"),
                 ("Its new ids count from 0: use len(vocab).", "= len(vocab)", "= len(merges)")))
region("encode", "merge again and again the adjacent pair learned first, while there is one.",
       bpe.encode, fixed=lambda: [(t, bpe.train([m], n)[0]) for t, m, n in (
           ("aaaa", "aaaa", 258), ("abc", "abxbc", 258), ("abcbc", "abxbc", 258),
           ("ab 中😀", "ab 中😀ab 中", 266))],
       drawn=lambda g: [("".join(some(g, "abc \n", 40)), bpe.train(
           ["".join(some(g, "ab \n", 30)) for _ in range(4)], 256 + draw(g, 9, 40))[0])],
       mistakes=(("It replays the merge learned last first.", [("min(", "max("), ("inf", "-1")]),))
