"""Checks for the chapters' solution regions: the mechanisms a learner writes in the lab edition (notebook 03's now).

A chapter builds each mechanism between nbgrader's `### BEGIN SOLUTION` / `### END SOLUTION` markers; the lab edition
(tools/handout.py) replaces each region by a stub that raises NotImplementedError. The cell after a region calls
`check(name, what_the_region_defined)` and keeps what it returns:
- a stub: prints "<name>: not written yet" and a hint (never the answer) and returns minimind_lib's version, or the
  chapter's class with the library's rule where the library's is called differently (it takes masks and a cache and
  returns tuples), so Run All goes on;
- written but different: raises NotRightYet (Jupyter shows its message, no traceback) naming the first difference
  (which output, which index, yours and the library's values) and, when a probe recognises a usual mistake, that;
- right: prints that it passed and returns the learner's version, which the notebook uses from then on.
Every call draws fresh random inputs (sizes, values, weights; the seed is in a failure's message), so no answer can be
tuned to fixed inputs. The library is open to read, and so is this file: it holds the library's rules, not secrets.
This file is course material beside the notebooks, not part of minimind_lib. A new region gets a compare function
registered with @region(name, hint, fallback, probes), `name` as tools/handout.py names the region (the def around it:
"RMSNorm.forward"), and a check cell `X = lab.check(name, X)` after the region's cell.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F

from exercise_checks import NotRightYet
from minimind_lib import model as mm

NOT_WRITTEN = "not written yet"
PASSED = "passed"


class Different(AssertionError):
    """What a comparison found: the message names the output, the index and the values."""


@dataclass
class RegionCheck:
    hint: str  # where to look, never the answer
    compare: Callable[[Any, torch.Generator], None]  # raises Different (or NotImplementedError from a stub)
    fallback: Callable[[Any], Any]  # the learner's object -> what the notebook uses instead
    probes: tuple[Callable[[Any], str | None], ...] = ()  # on a difference: name a usual mistake, or None


CHECKS: dict[str, RegionCheck] = {}  # region name (as tools/handout.py names it) -> its check


def region(name: str, hint: str, fallback: Callable[[Any], Any], probes: tuple = ()) -> Callable:
    """Register the decorated compare function as the check of region `name`."""
    def register(compare: Callable) -> Callable:
        CHECKS[name] = RegionCheck(hint, compare, fallback, probes)
        return compare
    return register


def check(name: str, yours: Any) -> Any:
    """Check what region `name` defined; return what the notebook should use from here on (see the module doc)."""
    rc, seed = CHECKS[name], int.from_bytes(os.urandom(4), "little")
    try:
        with torch.no_grad():
            rc.compare(yours, torch.Generator().manual_seed(seed))
    except NotImplementedError:
        print(f"{name}: {NOT_WRITTEN}. Hint: {rc.hint} Until it is, the notebook goes on with minimind_lib's version.")
        return rc.fallback(yours)
    except Different as e:
        with torch.no_grad():
            cause = next((c for probe in rc.probes if (c := _quiet(probe, yours))), "")
        raise NotRightYet(f"{name}: not right yet: {e} {cause + ' ' if cause else ''}(fresh random inputs, seed "
                          f"{seed}.) Hint: {rc.hint}") from None
    except Exception as e:  # the learner's code raised: a shape, a name, a missing parameter
        raise NotRightYet(f"{name}: not right yet: checking it raised {type(e).__name__}: {e} Hint: {rc.hint}") \
            from None
    print(f"{name}: {PASSED} (equal to minimind_lib's on fresh random inputs); the notebook uses yours from here on.")
    return yours


def _quiet(probe: Callable[[Any], str | None], yours: Any) -> str | None:
    try:
        return probe(yours)
    except Exception:  # a probe only adds a diagnosis: if it cannot run, the difference alone is reported
        return None


def first_difference(what: str, yours: Any, want: torch.Tensor, tol: float = 1e-5) -> None:
    """Raise Different naming the first index where `yours` is not within tol (absolute and relative) of `want`."""
    if not torch.is_tensor(yours):
        raise Different(f"{what} is a {type(yours).__name__}, not a tensor.")
    if yours.shape != want.shape:
        raise Different(f"{what} has shape {tuple(yours.shape)}; the library's has {tuple(want.shape)}.")
    if yours.dtype != want.dtype:
        raise Different(f"{what} is {yours.dtype}; the library's is {want.dtype}.")
    y, w = yours.double(), want.double()
    bad = ~torch.isclose(y, w, rtol=tol, atol=tol)
    if bad.any():
        at = tuple(int(i) for i in bad.nonzero()[0])
        raise Different(f"{what} differs first at index {at}: yours {y[at]:.6g}, the library's {w[at]:.6g} (off by "
                        f"{abs(y[at] - w[at]):.3g}; {int(bad.sum())} of {bad.numel()} values differ).")


def _pick(g: torch.Generator, options: tuple) -> Any:
    return options[int(torch.randint(len(options), (1,), generator=g))]


def _config(g: torch.Generator, layers: int = 1) -> mm.MiniMindConfig:
    """A small random configuration: heads, kv heads, head_dim, widths, vocabulary drawn afresh."""
    kv = _pick(g, (2, 3))  # more than one kv head, each shared by more than one query head: GQA's mapping shows
    return mm.MiniMindConfig(hidden_size=_pick(g, (32, 48, 64)), num_attention_heads=kv * _pick(g, (2, 4)),
                             num_key_value_heads=kv, head_dim=_pick(g, (8, 16)), intermediate_size=_pick(g, (40, 96)),
                             vocab_size=_pick(g, (97, 300)), num_hidden_layers=layers, max_position_embeddings=64,
                             rope_theta=_pick(g, (1e4, 1e6)))


def _randomize(module: torch.nn.Module, g: torch.Generator) -> torch.nn.Module:
    """Every parameter drawn afresh, norm gains away from 1 (a forgotten or swapped gain shows)."""
    for name, p in module.named_parameters():
        p.copy_(torch.rand(p.shape, generator=g) + 0.5 if "norm" in name else torch.randn(p.shape, generator=g) * 0.2)
    return module


def _load(yours: torch.nn.Module, library: torch.nn.Module) -> torch.nn.Module:
    """The library module's weights in yours; strict: a missing, extra or misshaped parameter is an error."""
    yours.load_state_dict(library.state_dict(), strict=True)
    return yours.eval()


# 03 RMSNorm -----------------------------------------------------------------------------------------------------------
def _rms_rows(g: torch.Generator, dim: int) -> torch.Tensor:
    """Rows of RMS from 1e-3 to 10 (where eps matters and where it does not), and one all-zero row."""
    x = torch.randn(3, 6, dim, generator=g) * 10 ** (torch.rand(3, 6, 1, generator=g) * 4 - 3)
    x[0, 0] = 0
    return x


def _rmsnorm_without_eps(cls: type) -> str | None:
    g = torch.Generator().manual_seed(0)
    dim = 16
    x = torch.randn(2, dim, generator=g) * 1e-3
    ours, no_eps = cls(dim, 1e-5), mm.RMSNorm(dim, eps=0.0)
    if not torch.isfinite(ours(torch.zeros(1, dim))).all() or torch.allclose(ours(x), no_eps(x), rtol=1e-3):
        return "It behaves as RMSNorm without eps does (rows of small RMS blow up, an all-zero row gives nan)."
    return None


@region("RMSNorm.forward", "divide x by the root of the mean of its squares over the last dimension, with eps "
        "inside the root; compute in float32, cast back to x's dtype, then multiply by the gain.",
        fallback=lambda cls: mm.RMSNorm, probes=(_rmsnorm_without_eps,))
def _compare_rmsnorm(cls: type, g: torch.Generator) -> None:
    dim = _pick(g, (16, 48, 512))
    library = _randomize(mm.RMSNorm(dim, 1e-5), g)
    yours, x = _load(cls(dim, 1e-5), library), _rms_rows(g, dim)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
        first_difference(f"the output for a {dtype} input", yours(x.to(dtype)), library(x.to(dtype)), tol)


# 03 RoPE --------------------------------------------------------------------------------------------------------------
@region("rope_tables", "one frequency per pair i: theta^(-2i/head_dim); the angle of position t is t times it; "
        "cos and sin of the angles, the head_dim/2 columns repeated for the second half.",
        fallback=lambda fn: mm.precompute_freqs_cis)
def _compare_rope_tables(fn: Callable, g: torch.Generator) -> None:
    head_dim, n, theta = _pick(g, (8, 16, 64)), int(torch.randint(8, 257, (1,), generator=g)), _pick(g, (1e4, 1e6))
    cos, sin = fn(head_dim, n, theta)
    want_cos, want_sin = mm.precompute_freqs_cis(head_dim, n, theta)
    first_difference(f"cos of rope_tables({head_dim}, {n}, {theta:g})", cos, want_cos, 1e-4)
    first_difference(f"sin of rope_tables({head_dim}, {n}, {theta:g})", sin, want_sin, 1e-4)


def _rotate_half_wrong_half(fn: Callable) -> str | None:
    x = torch.randn(2, 8)
    if torch.allclose(fn(x), -mm.rotate_half(x)):
        return "It is the library's with every sign flipped: the minus sign is on the wrong half."
    x1, x2 = x[..., ::2], x[..., 1::2]
    if torch.allclose(fn(x), torch.stack([-x2, x1], -1).flatten(-2)):
        return "It pairs neighbouring dimensions (2i, 2i+1): MiniMind pairs dimension i with i + head_dim/2."
    return None


@region("rotate_half", "split the last dimension into its two halves x1 and x2 and return them as (-x2, x1).",
        fallback=lambda fn: mm.rotate_half, probes=(_rotate_half_wrong_half,))
def _compare_rotate_half(fn: Callable, g: torch.Generator) -> None:
    x = torch.randn(2, 5, 3, _pick(g, (8, 16, 64)), generator=g)
    first_difference("rotate_half(x)", fn(x), mm.rotate_half(x), 1e-6)


@region("apply_rope", "q * cos + rotate_half(q) * sin, the same for k; cos and sin are (T, head_dim): give them a "
        "heads axis so that every head turns by the same angles.", fallback=lambda fn: mm.apply_rotary_pos_emb)
def _compare_apply_rope(fn: Callable, g: torch.Generator) -> None:
    d, t, kv = _pick(g, (8, 16, 64)), int(torch.randint(2, 20, (1,), generator=g)), _pick(g, (1, 2))
    q, k = torch.randn(2, t, 4 * kv, d, generator=g), torch.randn(2, t, kv, d, generator=g)
    cos, sin = mm.precompute_freqs_cis(d, t, _pick(g, (1e4, 1e6)))
    got, want = fn(q, k, cos, sin), mm.apply_rotary_pos_emb(q, k, cos, sin)
    if not isinstance(got, tuple) or len(got) != 2:
        raise Different(f"apply_rope returns a {type(got).__name__}; it should return (rotated q, rotated k).")
    first_difference("the rotated q", got[0], want[0])
    first_difference("the rotated k", got[1], want[1])


# 03 GQA ---------------------------------------------------------------------------------------------------------------
def _repeat_kv_tiled(fn: Callable) -> str | None:
    x = torch.randn(1, 2, 2, 4)
    if torch.equal(fn(x, 3), x.repeat(1, 1, 3, 1)):
        return "Query head h reads kv head h % n_kv (the heads tiled): it should read kv head h // n_rep."
    return None


@region("repeat_kv", "give x a new axis after the kv heads, expand it to n_rep copies, then merge the two head axes "
        "(each kv head's copies side by side).", fallback=lambda fn: mm.repeat_kv, probes=(_repeat_kv_tiled,))
def _compare_repeat_kv(fn: Callable, g: torch.Generator) -> None:
    x = torch.randn(2, int(torch.randint(1, 9, (1,), generator=g)), _pick(g, (2, 3)), 8, generator=g)
    for n_rep in (1, _pick(g, (2, 3, 4))):
        first_difference(f"repeat_kv(x of shape {tuple(x.shape)}, n_rep={n_rep})", fn(x, n_rep),
                         mm.repeat_kv(x, n_rep), 0.0)


def _attention_forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """minimind_lib's Attention.forward without mask, cache or dropout, on the chapter's module (its `heads`)."""
    b, t, _ = x.shape
    q, k, v = self.heads(x)
    q, k = mm.apply_rotary_pos_emb(q, k, cos, sin)
    k, v = (mm.repeat_kv(z, self.n_rep).transpose(1, 2) for z in (k, v))
    y = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, is_causal=True)
    return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


def _with_forward(cls: type, forward: Callable) -> type:
    """The chapter's class (its __init__ and helpers, given code) with the library's rule as its forward."""
    return type(cls.__name__, (cls,), {"forward": forward, "__doc__": forward.__doc__})


def _attention_sees_the_future(cls: type) -> str | None:
    g = torch.Generator().manual_seed(0)
    c = _config(g)
    attn, x = _load(cls(c), _randomize(mm.Attention(c), g)), torch.randn(1, 6, c.hidden_size, generator=g)
    cos, sin = mm.precompute_freqs_cis(c.head_dim, 6, c.rope_theta)
    later = x.clone()
    later[:, -1] += 1.0
    if not torch.allclose(attn(x, cos, sin)[:, 0], attn(later, cos, sin)[:, 0]):
        return ("Position 0's output changes when only the last position's input does: queries see later keys "
                "(the causal mask is missing).")
    return None


@region("Attention.forward", "heads, then apply_rope to q and k, repeat_kv to k and v, move the heads before T for "
        "F.scaled_dot_product_attention with the causal mask, then back, merge the heads, o_proj.",
        fallback=lambda cls: _with_forward(cls, _attention_forward), probes=(_attention_sees_the_future,))
def _compare_attention(cls: type, g: torch.Generator) -> None:
    c = _config(g)
    library = _randomize(mm.Attention(c), g).eval()
    yours, t = _load(cls(c), library), int(torch.randint(2, 17, (1,), generator=g))
    x, (cos, sin) = torch.randn(2, t, c.hidden_size, generator=g), mm.precompute_freqs_cis(c.head_dim, t, c.rope_theta)
    first_difference(f"the output ({c.num_attention_heads} query heads, {c.num_key_value_heads} kv heads, "
                     f"T={t})", yours(x, cos, sin), library(x, cos, sin)[0], 1e-4)


# 03 SwiGLU, the block, the model --------------------------------------------------------------------------------------
def _gate_and_up_swapped(cls: type) -> str | None:
    g = torch.Generator().manual_seed(0)
    c = _config(g)
    ffn, x = _load(cls(c), _randomize(mm.FeedForward(c), g)), torch.randn(3, c.hidden_size, generator=g)
    if torch.allclose(ffn(x), ffn.down_proj(F.silu(ffn.up_proj(x)) * ffn.gate_proj(x)), atol=1e-5):
        return "silu is applied to up_proj's output: MiniMind gates with gate_proj's."
    return None


@region("FeedForward.forward", "down_proj of (silu of gate_proj(x)) times up_proj(x), element-wise.",
        fallback=lambda cls: mm.FeedForward, probes=(_gate_and_up_swapped,))
def _compare_feed_forward(cls: type, g: torch.Generator) -> None:
    c = _config(g)
    library = _randomize(mm.FeedForward(c), g).eval()
    x = torch.randn(2, 5, c.hidden_size, generator=g)
    first_difference("the output", _load(cls(c), library)(x), library(x), 1e-5)


def _block_forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """minimind_lib's MiniMindBlock.forward for sub-modules called the chapter's way (no mask or cache)."""
    x = x + self.self_attn(self.input_layernorm(x), cos, sin)
    return x + self.mlp(self.post_attention_layernorm(x))


@region("Block.forward", "pre-norm: add attention of the first norm of x to x; then add the feed-forward of the "
        "second norm of that sum. The residual stream itself is never normalised.",
        fallback=lambda cls: _with_forward(cls, _block_forward))
def _compare_block(cls: type, g: torch.Generator) -> None:
    c = _config(g)
    library = _randomize(mm.MiniMindBlock(c), g).eval()
    t = int(torch.randint(2, 17, (1,), generator=g))
    x, (cos, sin) = torch.randn(2, t, c.hidden_size, generator=g), mm.precompute_freqs_cis(c.head_dim, t, c.rope_theta)
    first_difference("the block's output", _load(cls(c), library)(x, cos, sin), library(x, cos, sin)[0], 1e-4)


def _decoder_forward(self, ids: torch.Tensor) -> torch.Tensor:
    """minimind_lib's MiniMindModel.forward without masks or cache, for the chapter's blocks."""
    t = ids.shape[1]
    x = self.embed_tokens(ids)
    for layer in self.layers:
        x = layer(x, self.freqs_cos[:t], self.freqs_sin[:t])
    return self.norm(x)


@region("Decoder.forward", "embed the ids; run every layer with the first T rows of the cos and sin buffers; "
        "the final norm.", fallback=lambda cls: _with_forward(cls, _decoder_forward))
def _compare_decoder(cls: type, g: torch.Generator) -> None:
    c = _config(g, layers=2)
    library = _randomize(mm.MiniMindModel(c), g).eval()
    ids = torch.randint(0, c.vocab_size, (2, int(torch.randint(2, 33, (1,), generator=g))), generator=g)
    first_difference("the hidden states", _load(cls(c), library)(ids), library(ids)[0], 1e-4)


# ======================================================================================================================
# 01_tokenizer and 02_data: byte-level BPE, the loss masks, chunking, the memmap write, padding
# ======================================================================================================================
import functools  # noqa: E402  (this section's own imports: the chapters' sections stay apart)
import json  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
from collections.abc import Mapping, Sequence  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

from minimind_lib import bpe  # noqa: E402
from minimind_lib import corpus as C  # noqa: E402
from minimind_lib import data as D  # noqa: E402
from minimind_lib.tokenizer import load_tokenizer  # noqa: E402


def _int(g: torch.Generator, low: int, high: int) -> int:
    """An integer from low to high, both included."""
    return int(torch.randint(low, high + 1, (1,), generator=g))


def _text(g: torch.Generator, alphabet: str, max_chars: int) -> str:
    """Up to max_chars characters of the alphabet (a small one: many ties and repeated pairs; Chinese and emoji give
    characters of 3 and 4 bytes)."""
    return "".join(alphabet[_int(g, 0, len(alphabet) - 1)] for _ in range(_int(g, 0, max_chars)))


def first_item_difference(what: str, yours: Any, want: Sequence, where: Callable[[int], str] | None = None) -> None:
    """Raise Different naming the first index where the list (or string) `yours` is not `want`; `where(i)` may add
    what position i holds."""
    kind = str if isinstance(want, str) else list
    if not isinstance(yours, kind if kind is str else (list, tuple)):
        raise Different(f"{what} is a {type(yours).__name__}; the library's is a {kind.__name__}.")
    n = min(len(yours), len(want))
    at = next((i for i in range(n) if yours[i] != want[i]), n)
    if at == len(yours) == len(want):
        return
    shown = [repr(s[at]) if at < len(s) else "nothing (it ends before)" for s in (yours, want)]
    count = (f"yours has {len(yours)} items, the library's {len(want)}" if len(yours) != len(want) else
             f"{sum(a != b for a, b in zip(yours, want))} of {n} items differ")
    raise Different(f"{what} differs first at index ({at},): yours {shown[0]}, the library's {shown[1]} ({count})"
                    f"{where(at) if where else ''}.")


# 01 get_stats, merge --------------------------------------------------------------------------------------------------
def _stats_across_words(fn: Callable) -> str | None:
    if fn([[1, 2], [3, 4]]).get((2, 3), 0):
        return ("It counts a pair across two words (the last id of one word with the first of the next): pairs never "
                "cross the end of a word.")
    return None


def _stats_overlap_once(fn: Callable) -> str | None:
    if fn([[5, 5, 5]]).get((5, 5), 0) == 1:
        return ("In the word [5, 5, 5] it counts the pair (5, 5) once: counting takes every pair of neighbours, "
                "overlapping ones too (only merging skips them).")
    return None


@region("get_stats", "for each word on its own, count every pair of neighbouring ids, overlapping pairs too; no pair "
        "joins the last id of one word to the first of the next.", fallback=lambda fn: bpe.get_stats,
        probes=(_stats_across_words, _stats_overlap_once))
def _compare_get_stats(fn: Callable, g: torch.Generator) -> None:
    for n_ids in (2, 3, _pick(g, (5, 300))):  # 2 or 3 ids: repeated and overlapping pairs in every word
        words = [[_int(g, 0, n_ids - 1) for _ in range(_int(g, 0, 12))] for _ in range(_int(g, 1, 20))]
        yours, want = fn([list(w) for w in words]), bpe.get_stats(words)
        if not isinstance(yours, Mapping):
            raise Different(f"get_stats returns a {type(yours).__name__}; it should map each pair to its count.")
        bad = [p for p in want if yours.get(p, 0) != want[p]] + [p for p in yours if p not in want and yours[p]]
        if bad:
            raise Different(f"the count of each pair in the words {words} differs first at index {bad[0]}: yours "
                            f"{yours.get(bad[0], 0)}, the library's {want.get(bad[0], 0)} ({len(bad)} pairs differ).")


def _merge_overlaps(fn: Callable) -> str | None:
    out = fn([7, 7, 7], (7, 7), 9)
    if out.count(9) == 2:
        return ("In [7, 7, 7] it merges the overlapping pairs (7, 7) both, so the middle 7 is used twice: after a "
                "merge the scan goes on after the pair's second id, giving [9, 7].")
    if out == [7, 9]:
        return "In [7, 7, 7] it merges the pair on the right: the scan goes left to right, giving [9, 7]."
    return None


def _merge_misses(fn: Callable) -> str | None:
    if fn([1, 2, 3, 1, 2, 3], (1, 2), 9) == [9, 3, 1, 2, 3]:
        return "It merges only the first occurrence of the pair: every occurrence is replaced."
    if fn([3, 1, 2], (1, 2), 9) == [3, 1, 2]:
        return "It misses the pair formed by the last two ids."
    return None


@region("merge", "scan the ids left to right: where the pair starts, write new_id and move past both of its ids; "
        "anywhere else copy the id and move on by one.", fallback=lambda fn: bpe.merge,
        probes=(_merge_overlaps, _merge_misses))
def _compare_merge(fn: Callable, g: torch.Generator) -> None:
    for _ in range(100):
        n_ids = _pick(g, (2, 3, 5))  # few ids: the pair occurs, often overlapping ('aaa')
        ids = [_int(g, 0, n_ids - 1) for _ in range(_int(g, 0, 16))]
        pair, new_id = (_int(g, 0, n_ids - 1), _int(g, 0, n_ids - 1)), _int(g, 256, 999)
        first_item_difference(f"merge({ids}, {pair}, {new_id})", fn(list(ids), pair, new_id),
                              bpe.merge(ids, pair, new_id))


# 01 train -------------------------------------------------------------------------------------------------------------
TRAIN_ALPHABET = "ab 中😀\n"  # few characters: many pairs tie; multi-byte characters: merges inside a character


def _train_tie_break(fn: Callable) -> str | None:
    c, d, a, b = (bpe.BYTE_ID[ord(x)] for x in "cdab")
    first = next(iter(fn(["cdab"], 257)[0]))  # three pairs, one each: the tie-break alone decides
    if first == (c, d):
        return ("Among pairs of the same count it took the one met first in the text (what Counter.most_common and "
                "max over the counts do): ties go to the smallest pair of ids, as in tokenizers.")
    if first == (d, a):
        return "Among pairs of the same count it took the largest pair of ids: ties go to the smallest."
    return None


def _train_least_frequent_or_new_ids(fn: Callable) -> str | None:
    a, b = bpe.BYTE_ID[ord("a")], bpe.BYTE_ID[ord("b")]
    merges = dict(fn(["aaab"], 257)[0])  # 'aa' twice, 'ab' once
    if list(merges) == [(a, b)]:
        return "It merged the least frequent pair: each merge takes the most frequent one."
    if list(merges) == [(a, a)] and list(merges.values()) != [256]:
        return (f"Its first new token has id {list(merges.values())[0]}: new ids follow the 256 byte tokens, each the "
                "next free id (the vocabulary's length).")
    return None


@region("train", "start from every text's byte ids; while the vocabulary is smaller than vocab_size: count the pairs, "
        "take the most frequent (ties: the smallest pair of ids), give it the next free id, add its bytes to the "
        "vocabulary, merge it in every word; stop early when no pair is left.", fallback=lambda fn: bpe.train,
        probes=(_train_tie_break, _train_least_frequent_or_new_ids))
def _compare_train(fn: Callable, g: torch.Generator) -> None:
    for _ in range(3):
        texts = [_text(g, TRAIN_ALPHABET, 30) for _ in range(_int(g, 1, 6))]
        vocab_size = 256 + _int(g, 5, 40)
        yours, (merges, vocab) = fn(list(texts), vocab_size), bpe.train(texts, vocab_size)
        if not (isinstance(yours, tuple) and len(yours) == 2):
            raise Different(f"train returns a {type(yours).__name__}; it should return (merges, vocab).")
        call = f"train({texts!r}, {vocab_size})"
        first_item_difference(f"the merges of {call}, in the order learned,", list(dict(yours[0]).items()),
                              list(merges.items()))
        first_item_difference(f"the vocabulary of {call}", list(yours[1]), vocab)


# 01 encode, decode ----------------------------------------------------------------------------------------------------
def _encode_order(fn: Callable) -> str | None:
    a, b, c = (bpe.BYTE_ID[ord(x)] for x in "abc")
    if fn("aaaa", {(a, a): 256, (256, 256): 257}) == [256, 256]:
        return "It stops after one pass: a merge can form a pair that is itself a later merge ('aa' + 'aa' here)."
    if fn("abc", {(a, b): 256, (b, c): 257}) == [a, 257]:
        return ("It applied the merge learned last first: the merges are replayed in the order learned (of the pairs "
                "present, the one with the smallest new id first).")
    if fn("abcbc", {(a, b): 256, (b, c): 257}) == [a, 257, 257]:
        return ("It merged the text's most frequent pair first, training's rule: encoding replays the merges in the "
                "order learned.")
    return None


@region("encode", "start from the text's byte ids; again and again merge the adjacent pair that was learned first "
        "(of the pairs present, the one with the smallest new id), until no adjacent pair is a merge.",
        fallback=lambda fn: bpe.encode, probes=(_encode_order,))
def _compare_encode(fn: Callable, g: torch.Generator) -> None:
    small = [_text(g, "ab \n", 30) for _ in range(_int(g, 2, 6))]  # few characters: merges that overlap
    wide = [_text(g, TRAIN_ALPHABET, 30) for _ in range(_int(g, 2, 6))]  # merges inside 3- and 4-byte characters
    x, y, z = (chr(ord("a") + int(i)) for i in torch.randperm(8, generator=g)[:3])
    cases = [(small, 256 + _int(g, 10, 40), [_text(g, "abc \n", 40) for _ in range(30)]),  # 'c': never learned
             (wide, 256 + _int(g, 10, 40), [_text(g, TRAIN_ALPHABET + "é", 30) for _ in range(10)]),
             ([x + y] * 3 + [y + z] * 2, 258, [x + y + z + y + z]),  # x+y learned first, y+z second: order matters
             ([x * 4], 258, [x * 4])]  # x+x, then (x+x)+(x+x): a merge forms the pair of a later one
    for texts, vocab_size, encoded in cases:
        merges = bpe.train(texts, vocab_size)[0]
        for text in encoded:
            first_item_difference(f"encode({text!r}, merges) with the merges of train({texts!r}, {vocab_size})",
                                  fn(text, dict(merges)), bpe.encode(text, merges))


def _decode_token_by_token(fn: Callable) -> str | None:
    if fn([bpe.BYTE_ID[b] for b in "中".encode()], [bytes([b]) for b in bpe.BYTE_ORDER]) == "\ufffd" * 3:
        return ("It decodes token by token: a character whose bytes are split over tokens (the three bytes of '中' "
                "here) comes out as U+FFFD, once per piece.")
    return None


@region("decode", "join the tokens' bytes first, then decode them once as UTF-8, with bytes that are not a whole "
        "character becoming U+FFFD.", fallback=lambda fn: bpe.decode, probes=(_decode_token_by_token,))
def _compare_decode(fn: Callable, g: torch.Generator) -> None:
    texts = [_text(g, TRAIN_ALPHABET + "é", 30) for _ in range(_int(g, 2, 6))]
    merges, vocab = bpe.train(texts, 256 + _int(g, 5, 40))
    for k in range(30):  # random ids (bytes that are pieces of characters), a text's bytes, a text's tokens
        text = _text(g, TRAIN_ALPHABET + "é文", 12)
        ids = ([_int(g, 0, len(vocab) - 1) for _ in range(_int(g, 0, 8))] if k % 3 == 0 else
               [bpe.BYTE_ID[b] for b in text.encode()] if k % 3 == 1 else bpe.encode(text, merges))
        call = f"decode({ids}, vocab) with the vocabulary of train({texts!r}, ...)"
        try:
            yours = fn(list(ids), list(vocab))
        except UnicodeDecodeError as e:
            raise Different(f"{call} raised UnicodeDecodeError ({e.reason}): bytes that are not whole UTF-8 "
                            "characters decode to U+FFFD, they do not stop decoding.") from None
        first_item_difference(call, yours, bpe.decode(ids, vocab))


# 02 the SFT loss mask -------------------------------------------------------------------------------------------------
WORDS = ("To", " be", ",", " or", " not", " the", " question", ".", "\n", " 123", "床", "前", "明月", "光", "，", "。",
         "疑是", "地上", "霜", "😀", "?", " assistant", "user")


@functools.cache
def _tokenizer() -> Any:
    """The course's 6400-token tokenizer, the one 02 loads (loaded once)."""
    return load_tokenizer()


def _words(g: torch.Generator, low: int, high: int) -> str:
    """A random text of low to high pieces of English and Chinese (never starting with a space: a valid record)."""
    return "".join(WORDS[_int(g, 0, len(WORDS) - 1)] for _ in range(_int(g, low, high))).lstrip() or "光"


def _conversation(g: torch.Generator) -> list[dict]:
    """A random chat: a system turn or not, one to three exchanges, sometimes ending on the user's turn."""
    turns = [{"role": "system", "content": _words(g, 1, 6)}] if _int(g, 0, 2) == 0 else []
    for _ in range(_int(g, 1, 3)):
        turns += [{"role": "user", "content": _words(g, 1, 8)}, {"role": "assistant", "content": _words(g, 1, 8)}]
    return turns + ([{"role": "user", "content": _words(g, 1, 4)}] if _int(g, 0, 3) == 0 else [])


def _ints(yours: Any, what: str) -> list[int]:
    try:
        return [int(v) for v in yours]
    except TypeError:
        raise Different(f"{what} is a {type(yours).__name__}, not a list of numbers.") from None


def _library_assistant_mask(ids: Sequence[int]) -> list[int]:
    """minimind_lib's assistant mask (corpus.assistant_mask) of ids, as a list: 1 where trained."""
    return C.assistant_mask(_tokenizer(), ids).tolist()


FIXED_CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who wrote Hamlet?"},
              {"role": "assistant", "content": "Shakespeare."}, {"role": "user", "content": "床前明月光"},
              {"role": "assistant", "content": "疑是地上霜。"}]


def _mask_mistake(fn: Callable) -> str | None:
    tok = _tokenizer()
    ids, want = (a.tolist() for a in C.encode_sft(tok, FIXED_CHAT))
    yours, n = _ints(fn(list(ids)), "the mask"), len(ids)
    if yours == want[1:] + [0] or yours == [0] + want[:-1]:
        return (f"It is the library's mask moved one position {'earlier' if yours == want[1:] + [0] else 'later'}: "
                "the mask is aligned with ids (1 where the token itself is trained); the model does the shift.")
    header = list(tok.encode("assistant\n", add_special_tokens=False))
    at_header = {i + k for i in range(n) if ids[i] == tok.bos_token_id and ids[i + 1:i + 1 + len(header)] == header
                 for k in range(len(header) + 1)}
    ends = [i for i in range(n) if want[i] and ids[i] == tok.eos_token_id]
    if any(yours[i] for i in at_header):
        return "It trains (part of) the header <|im_start|>assistant\\n: training starts with the token after it."
    if any(yours[i] for i in range(n) if not want[i] and i not in at_header):
        return "It trains tokens of the system or user turns (the prompt): only what the assistant says is trained."
    if any(not yours[i] for i in ends):
        return "It leaves the <|im_end|> that closes a reply untrained: the model would never learn to stop."
    if any(not yours[i + 1] for i in ends if i + 1 < n):
        return "It leaves the newline after a reply's <|im_end|> untrained: MiniMind-3 trains it."
    return None


@region("assistant_mask", "find each <|im_start|> followed by the ids of 'assistant\\n'; mark 1 from the token after "
        "that header up to and including the next <|im_end|> and the newline after it; 0 everywhere else. The mask "
        "lines up with ids: the model does the shift.", fallback=lambda fn: _library_assistant_mask,
        probes=(_mask_mistake,))
def _compare_assistant_mask(fn: Callable, g: torch.Generator) -> None:
    tok = _tokenizer()
    for _ in range(20):
        ids, want = (a.tolist() for a in C.encode_sft(tok, _conversation(g)))
        first_item_difference(f"the mask of the conversation {tok.decode(ids)!r}", _ints(fn(list(ids)), "the mask"),
                              want, where=lambda i: f"; position {i} holds {tok.decode([ids[i]])!r}")


# 02 chunking long documents -------------------------------------------------------------------------------------------
def _library_chunk_rows(ids: Sequence[int], seq_len: int) -> list:
    """minimind_lib's chunk rows (data._TokenDataset._row_index): seq_len tokens each, every seq_len - 1 tokens."""
    stride = seq_len - 1
    return [ids[k * stride:k * stride + seq_len] for k in range(max(1, -(-(len(ids) - 1) // stride)))]


def _rows_mistake(fn: Callable) -> str | None:
    rows = [list(r) for r in fn(list(range(10)), 4)]
    if len(rows) > 1 and rows[1][0] != rows[0][-1]:
        return ("Its rows do not overlap: the first token of a row is never a target inside that row, so one target "
                "is lost at every boundary; each row starts on the last token of the row before.")
    if any(len(r) == 1 for r in fn(list(range(7)), 4)):
        return "It ends with a row of one token, which has no next token to train: rows stop once every target is in."
    return None


@region("chunk_rows", "rows of (up to) seq_len tokens, each starting seq_len - 1 tokens after the one before, so that "
        "consecutive rows share one token; no more rows once every next-token target is in one; a document of one "
        "token is one row.", fallback=lambda fn: _library_chunk_rows, probes=(_rows_mistake,))
def _compare_chunk_rows(fn: Callable, g: torch.Generator) -> None:
    tok, texts = _tokenizer(), [_words(g, 1, 30) for _ in range(12)]
    lengths = [len(C.encode_pretrain(tok, t)) for t in texts]
    # a seq_len that some document longer than it fills exactly, rows and all: where a single-token last row shows
    fits = tuple(s for s in range(3, 17) if any(n > s and (n - 1) % (s - 1) == 0 for n in lengths))
    seq_len = _pick(g, fits) if fits else _int(g, 3, 16)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "documents.jsonl"
        path.write_text("".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in texts), encoding="utf-8")
        library = D.PretrainDataset(path, tok, seq_len, long_docs="chunk")
        docs = [library.raw(d)[0].tolist() for d in range(library.n_documents())]
        want = [library[i]["input_ids"].tolist() for i in range(len(library))]
    yours, whose = [], []
    for d, doc in enumerate(docs):
        rows = [_ints(r, "a row") for r in fn(list(doc), seq_len)]
        yours, whose = yours + rows, whose + [f"row {j} of document {d}, {doc}" for j in range(len(rows))]
    first_item_difference(f"the rows of {len(docs)} random documents at seq_len={seq_len}, one document after "
                          "another,", yours, want, where=lambda k: f"; your row {k} is {whose[k]}" if k < len(whose)
                          else "")


# 02 the memmap write --------------------------------------------------------------------------------------------------
def _library_write_tokens(samples: Sequence, path: str | os.PathLike) -> np.ndarray:
    """What minimind_lib's tokenize_to_memmap writes for tokenized samples: the ids back to back as uint16 in `path`;
    returns the n + 1 int64 offsets (its .idx.npy)."""
    np.concatenate([np.zeros(0, np.int64), *samples]).astype(np.uint16).tofile(path)
    return np.concatenate([[0], np.cumsum([len(s) for s in samples])]).astype(np.int64)


def _memmap_mistake(fn: Callable) -> str | None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "probe.bin"
        offsets = np.asarray(fn([np.array([1, 300, 6399, 2]), np.array([1, 2])], path)).tolist()
        per_token = os.path.getsize(path) / 6
    named = {(0, 8, 12): "The offsets count bytes; the reader slices an array of tokens, so they count tokens.",
             (4, 6): "The offsets miss the leading 0: n + 1 of them, from 0 (where the first sample starts) to the "
                     "total.",
             (4, 2): "It returns each sample's length: the offsets are where each sample starts, a running total from "
                     "0."}
    if tuple(offsets) in named:
        return named[tuple(offsets)]
    if per_token != 2:
        dtype = {8: " (int64, the arrays' own dtype)", 4: " (int32 or float32)", 1: " (uint8: ids above 255 wrap)"}
        return (f"It writes {per_token:g} bytes per token{dtype.get(per_token, '')}: the token file holds 2-byte "
                "unsigned integers (uint16), which is what the reader reads.")
    return None


@region("write_tokens", "all samples' ids back to back into the file, each as a 2-byte unsigned integer; return "
        "where each sample starts, counted in tokens: n + 1 numbers from 0 to the total.",
        fallback=lambda fn: _library_write_tokens, probes=(_memmap_mistake,))
def _compare_write_tokens(fn: Callable, g: torch.Generator) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "documents.jsonl").write_text("".join(json.dumps({"text": _words(g, 1, 40)}, ensure_ascii=False) + "\n"
                                                     for _ in range(_int(g, 1, 12))), encoding="utf-8")
        C.tokenize_to_memmap(tmp / "documents.jsonl", _tokenizer(), tmp / "library", num_workers=0, progress=False)
        library = D.MemmapDataset(tmp / "library", seq_len=2)
        docs = [np.array(library.raw(d)[0], dtype=np.int64) for d in range(library.n_documents())]
        del library  # its memmap: the folder is removed below
        offsets = fn(list(docs), tmp / "yours.bin")
        if offsets is None:
            raise Different("write_tokens returned None: it should return the n + 1 offsets where the samples start.")
        offsets = np.asarray(offsets).astype(np.int64)
        first_difference("the offsets", torch.from_numpy(offsets), torch.from_numpy(np.load(tmp / "library.idx.npy")),
                         0.0)
        if (size := os.path.getsize(tmp / "yours.bin")) % 2:
            raise Different(f"your file has {size} bytes, an odd number: the reader reads 2 bytes per token.")
        np.save(tmp / "yours.idx.npy", offsets)  # your file and offsets beside the library's metadata: its reader
        shutil.copy(tmp / "library.json", tmp / "yours.json")
        yours = D.MemmapDataset(tmp / "yours", seq_len=2)
        for d, doc in enumerate(docs):
            first_difference(f"document {d} ({len(doc)} tokens) as the library's reader reads it from your file",
                             torch.from_numpy(np.array(yours.raw(d)[0], dtype=np.int64)), torch.from_numpy(doc), 0.0)
        del yours
        if size != (want := os.path.getsize(tmp / "library.bin")):
            raise Different(f"your file has {size} bytes; the library's has {want} (2 per token, nothing else).")


# 02 padding -----------------------------------------------------------------------------------------------------------
def _pad_batch_by_library(samples: Sequence[dict], pad_id: int, seq_len: int | None = None,
                          fixed: bool = False) -> dict[str, torch.Tensor]:
    """minimind_lib's collator (data.pad_collate), called as the chapter's pad_batch."""
    return D.pad_collate(samples, pad_id, seq_len, fixed)


def _padding_mistake(fn: Callable) -> str | None:
    rows = [torch.tensor([5, 6]), torch.tensor([7, 8, 9, 10])]
    batch = fn([{"input_ids": r, "labels": r.clone()} for r in rows], 3, None, False)
    if int(batch["labels"][0, 2]) == 3:
        return "Pad positions get the label pad_id instead of -100: the loss would train the model to predict padding."
    if int(batch["attention_mask"][0, 2]) == 1:
        return "The attention_mask is 1 on pad positions: 1 marks the real tokens only."
    if int(batch["input_ids"][0, 0]) == 3:
        return "It pads on the left: each row starts at position 0 and its pads follow it."
    return None


@region("pad_batch", "cut each row to seq_len; the width is seq_len (fixed) or the longest row; start from input_ids "
        "all pad_id, labels all -100 and attention_mask all 0, then put each row's ids, labels and ones at its "
        "start.", fallback=lambda fn: _pad_batch_by_library, probes=(_padding_mistake,))
def _compare_pad_batch(fn: Callable, g: torch.Generator) -> None:
    seq_len, pad_id = _int(g, 4, 24), _pick(g, (0, 3, 6399))
    for kind in ("pretrain", "sft"):
        samples = []
        for k in range(_int(g, 2, 6)):  # the first row shorter than seq_len and the longest: it is always padded
            ids = torch.randint(0, 6400, (_int(g, 1, seq_len - 1) if k == 0 else _int(g, seq_len, 2 * seq_len),),
                                generator=g)
            labels = ids.clone()
            if kind == "sft":  # untrained positions of a conversation
                labels[torch.rand(len(ids), generator=g) < 0.5] = D.IGNORE_INDEX
            samples.append({"input_ids": ids, "labels": labels})
        for width, fixed in ((seq_len, True), (seq_len, False), (None, False)):
            yours, want = fn(list(samples), pad_id, width, fixed), D.pad_collate(samples, pad_id, width, fixed)
            how = f"to seq_len={width}" if fixed else "to the longest row" + (f", cut at {width}" if width else "")
            for key in want:
                if not isinstance(yours, Mapping) or key not in yours:
                    raise Different(f"the batch has no {key!r}: pad_batch returns input_ids, labels and "
                                    "attention_mask.")
                first_difference(f"{key} of {len(samples)} {kind} rows of lengths "
                                 f"{[len(s['input_ids']) for s in samples]} padded {how} with pad_id={pad_id}",
                                 yours[key], want[key], 0.0)


# ======================================================================================================================
# 07_pretrain and 08_sft: the verdict against the band, bits per byte, the assistant mask, generation, top-p
# ======================================================================================================================
import math  # noqa: E402
import re  # noqa: E402
from unittest import mock  # noqa: E402

import pandas as pd  # noqa: E402

from minimind_lib import evaluate as ev  # noqa: E402
from minimind_lib import generate as G  # noqa: E402


# 07 the verdict -------------------------------------------------------------------------------------------------------
def _random_run(g: torch.Generator) -> tuple[pd.DataFrame, dict]:
    """A band (grid, lower, upper) and validation points that wander in and out of it, some past 1.1 x its end."""
    n = _int(g, 3, 12)
    tokens = np.cumsum(np.r_[0.0, torch.rand(n - 1, generator=g).double().numpy() + 0.2]) * 1000
    median = 8.8 - 3 * np.linspace(0, 1, n) ** 0.5
    half = torch.rand(n, generator=g).double().numpy() * 0.3 + 0.05
    ref = {"tokens": tokens.tolist(), "lower": (median - half).tolist(), "upper": (median + half).tolist(),
           "quantiles": {"0.5": median.tolist()}}
    x = np.sort(np.r_[0.0, torch.rand(_int(g, 0, 9), generator=g).double().numpy() * 1.3 * tokens[-1]])
    side, sides = _int(g, -1, 1), []
    for _ in x:  # runs of points on one side: a side changes at a third of the points
        side = _int(g, -1, 1) if _int(g, 0, 2) == 0 else side
        sides.append(side)
    margin = torch.rand(len(x), generator=g).double().numpy()
    width = np.interp(x, tokens, half)
    loss = np.interp(x, tokens, median) + np.where(np.array(sides) == 0, (2 * margin - 1) * 0.8 * width,
                                                   np.array(sides) * (width + 0.01 + margin * 0.5))
    return pd.DataFrame({"step": range(len(x)), "tokens_seen": x, "val_loss": loss}), ref


def _library_verdict(val: pd.DataFrame, ref: dict) -> tuple[str, int | None]:
    """minimind_lib's judge (evaluate.judge) on these points and this band: (inside|above|below, N or None)."""
    band = {"profile": "random", "n_seeds": 5, "seeds": [1, 2, 3, 4, 5], "method": "",
            "made_by": dict.fromkeys(("device", "cpu", "threads", "torch", "date"), "?")}
    with mock.patch.object(ev, "load_band", lambda cfg: (band, {"dtype": "fp32", "training": {}, **ref})), \
            mock.patch.object(ev, "doctor", lambda *args: []):  # divergence is the doctor's, not this exercise's
        out = ev.judge(pd.DataFrame(val), {"stage": "pretrain", "train": {}})
    since = re.search(r" from ([\d,]+) tokens on", out["summary"])
    return out["verdict"], int(since.group(1).replace(",", "")) if since else None


def _verdict_mistake(fn: Callable) -> str | None:
    ref = {"tokens": [0.0, 1000.0], "lower": [8.0, 5.0], "upper": [9.0, 6.0], "quantiles": {"0.5": [8.5, 5.5]}}
    if fn(pd.DataFrame({"tokens_seen": [0.0, 500.0, 2000.0], "val_loss": [8.5, 7.0, 9.0]}), ref)[0] != "inside":
        return "It judges a point past 1.1 x the band's last token count: the band says nothing there."
    if fn(pd.DataFrame({"tokens_seen": [0.0, 400.0, 800.0], "val_loss": [9.5, 6.0, 6.3]}), ref)[0] == "above":
        return "The first point decides; the last point does (where the run ended)."
    return None


@region("my_verdict", "read the band's lower and upper at each point's tokens (np.interp), keep the points up to 1.1 "
        "times the band's last token count, mark each above, below or inside; the last point decides, and N is where "
        "the last unbroken run of points on its side began.", fallback=lambda fn: _library_verdict,
        probes=(_verdict_mistake,))
def _compare_verdict(fn: Callable, g: torch.Generator) -> None:
    for k in range(30):
        val, ref = _random_run(g)
        yours = fn(val.copy(), ref)
        if not isinstance(yours, tuple) or len(yours) != 2:
            raise Different(f"my_verdict returns {yours!r}: it should return (verdict, N).")
        first_item_difference(f"(verdict, N) for the points {val[['tokens_seen', 'val_loss']].round(3).values.tolist()}"
                              f" against a band ending at {ref['tokens'][-1]:.0f} tokens", [yours[0], yours[1]],
                              list(_library_verdict(val, ref)))


# 07 bits per byte -----------------------------------------------------------------------------------------------------
def _model(g: torch.Generator, layers: int = 1) -> torch.nn.Module:
    return _randomize(mm.MiniMindForCausalLM(_config(g, layers)), g).eval()


def _library_total_nats(model: torch.nn.Module, ids: Sequence[int]) -> float:
    """minimind_lib's scoring (evaluate.token_scores) of [bos] + ids: the sum of the next tokens' losses, in nats."""
    return float(ev.token_scores(model, [np.array([_tokenizer().bos_token_id, *ids])])[0][0].astype(np.float64).sum())


def _nats_mistake(fn: Callable) -> str | None:
    g = torch.Generator().manual_seed(0)
    model, ids = _model(g), [5, 17, 3, 40, 8, 11]
    got, want = float(fn(model, list(ids))), _library_total_nats(model, ids)
    if math.isclose(got, want / len(ids), rel_tol=1e-4):
        return "It is the mean loss per token; bits per byte needs the total (the sum over the tokens)."
    if math.isclose(got, want - float(ev.token_scores(model, [np.array([1, ids[0]])])[0][0][0]), rel_tol=1e-4):
        return "It leaves out the first token (scored from [bos] alone): forward [bos] + ids, so every token is scored."
    return None


@region("total_nats", "run the model on [bos] followed by the ids; the logits at each position score the next token: "
        "the sum of the cross-entropies of all of them (every token of the document, the first one given [bos]).",
        fallback=lambda fn: _library_total_nats, probes=(_nats_mistake,))
def _compare_total_nats(fn: Callable, g: torch.Generator) -> None:
    model = _model(g)
    for _ in range(5):
        ids = torch.randint(3, model.config.vocab_size, (_int(g, 1, 40),), generator=g).tolist()
        yours = torch.tensor([float(fn(model, list(ids)))], dtype=torch.float64)
        first_difference(f"total_nats of a random model on the {len(ids)} ids {ids}", yours,
                         torch.tensor([_library_total_nats(model, ids)], dtype=torch.float64), 1e-4)


def _library_bits_per_byte(nats: float, text: str) -> float:
    """minimind_lib's bits per byte (evaluate.ladder_row, unrounded): nats / (ln 2 x the text's UTF-8 bytes)."""
    return nats / (math.log(2) * len(text.encode("utf-8")))


def _bpb_mistake(fn: Callable) -> str | None:
    if math.isclose(float(fn(10.0, "床前明月光")), 10.0 / (math.log(2) * 5), rel_tol=1e-6):
        return "It divides by the characters; a Chinese character is 3 bytes in UTF-8: count the bytes."
    if math.isclose(float(fn(10.0, "abcde")), 2.0, rel_tol=1e-6):
        return "It leaves the loss in nats: one bit is ln 2 nats."
    return None


@region("bits_per_byte", "turn the nats into bits (one bit is ln 2 nats) and divide by the number of bytes the text "
        "takes in UTF-8.", fallback=lambda fn: _library_bits_per_byte, probes=(_bpb_mistake,))
def _compare_bits_per_byte(fn: Callable, g: torch.Generator) -> None:
    for _ in range(10):
        text, nats = _words(g, 1, 20), float(torch.rand(1, generator=g)) * 500
        first_difference(f"bits_per_byte({nats:.4f}, {text!r})", torch.tensor([float(fn(nats, text))], dtype=torch.float64),
                         torch.tensor([_library_bits_per_byte(nats, text)], dtype=torch.float64), 1e-9)


# 08 the assistant mask: the same rule as 02's (assistant_mask), written again in 08 with the chapter's names -----------
CHECKS["assistant_mask_of"] = CHECKS["assistant_mask"]


# 08 generation with a KV cache ----------------------------------------------------------------------------------------
def _greedy(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(dim=-1)


@torch.no_grad()
def _library_generate(model: torch.nn.Module, prompt_ids: Sequence[int], max_new_tokens: int, pick: Callable = _greedy,
                      stop_ids: Sequence[int] = (), use_cache: bool = True) -> list[int]:
    """generate_ids's loop (minimind_lib.generate) with the chapter's signature: `pick` chooses from the last logits."""
    model.eval()
    seq = torch.tensor([list(prompt_ids)], device=next(model.parameters()).device)
    out, new = model(seq, use_cache=use_cache, logits_to_keep=1), []
    while True:
        token = pick(out.logits[:, -1])
        new.append(int(token))
        if new[-1] in stop_ids or len(new) == max_new_tokens:
            return new
        seq = torch.cat([seq, token[:, None]], dim=1)
        out = (model(token[:, None], past_key_values=out.past_key_values, use_cache=True, logits_to_keep=1)
               if use_cache else model(seq, logits_to_keep=1))


def _calls(model: torch.nn.Module, run: Callable) -> tuple[Any, list[int]]:
    """What run() returns, and the positions each forward call of the model processed."""
    seen: list[int] = []
    hook = model.register_forward_pre_hook(lambda module, args: seen.append(args[0].shape[1]))
    try:
        return run(), seen
    finally:
        hook.remove()


def _generate_mistake(fn: Callable) -> str | None:
    model = _model(torch.Generator().manual_seed(1), layers=2)
    tokens, seen = _calls(model, lambda: fn(model, [1, 5, 9, 4], 6))
    if seen == [4 + k for k in range(len(tokens))]:
        return "With use_cache=True it runs the whole sequence again at every step: the cache is never used."
    if len(seen) > 1 and seen[1] > 1:
        return ("With the cache it feeds more than the new token: the cache already holds the keys and values of "
                "every earlier position, so each step feeds one token.")
    return None


@region("my_generate", "run the whole prompt once (use_cache=True gives past_key_values); then, until a stop id or "
        "max_new_tokens: pick a token from the last position's logits, append it, and feed only that token with the "
        "cache (without the cache: the whole sequence, one longer).", fallback=lambda fn: _library_generate,
        probes=(_generate_mistake,))
def _compare_generate(fn: Callable, g: torch.Generator) -> None:
    model = _model(g, layers=2)
    prompt = torch.randint(0, model.config.vocab_size, (_int(g, 1, 12),), generator=g).tolist()
    n = _int(g, 2, 20)
    free = G.generate_ids(model, torch.tensor(prompt), n, temperature=0)[0].tolist()
    stops = [free[_int(g, 1, n - 1)]] if _int(g, 0, 1) else []  # a stop id the answer meets (at its first occurrence)
    want = G.generate_ids(model, torch.tensor(prompt), n, temperature=0, stop_token_ids=stops)[0].tolist()
    for use_cache in (True, False):
        (yours, seen) = _calls(model, lambda: fn(model, list(prompt), n, _greedy, stops, use_cache))
        first_item_difference(f"the greedy tokens after the prompt {prompt} (max_new_tokens={n}, stop_ids={stops}, "
                              f"use_cache={use_cache}) of a random model", _ints(yours, "the new tokens"), want)
        calls = [len(prompt)] + [1] * (len(want) - 1) if use_cache else [len(prompt) + k for k in range(len(want))]
        first_item_difference(f"the positions each forward call processed (use_cache={use_cache})", seen, calls)


# 08 top-p -------------------------------------------------------------------------------------------------------------
def _library_top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """The logits minimind_lib samples from (generate.sample_next at temperature 1), -inf outside the nucleus."""
    drawn = {}

    def capture(probs, n, generator=None):
        drawn["probs"] = probs
        return torch.zeros(probs.shape[0], 1, dtype=torch.long)

    with mock.patch.object(G.torch, "multinomial", capture):
        G.sample_next(logits.float(), 1.0, top_p)
    return logits.float().masked_fill(drawn["probs"] == 0, float("-inf"))


def _top_p_mistake(fn: Callable) -> str | None:
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0, -1.0]])
    kept = torch.isfinite(fn(logits.clone(), 0.8))[0].tolist()
    want = torch.isfinite(_library_top_p(logits, 0.8))[0].tolist()
    if kept == [not k for k in want] or (not kept[0] and kept[-1]):
        return ("It keeps the wrong side: the unlikely tail instead of the nucleus; top-p keeps the most likely "
                "tokens, whose probabilities together reach p, and drops the rest.")
    if sum(kept) == sum(want) - 1:
        return ("It drops the token that carries the sum past p: a token goes only when the tokens before it already "
                "hold p (the cumulative sum minus its own probability), so the most likely one always stays.")
    if sum(kept) == sum(want) + 1:
        return "It keeps one token too many: a token whose more likely predecessors already hold p is dropped."
    return None


@region("keep_top_p", "sort the probabilities, most likely first; a token is dropped when the tokens before it already "
        "hold top_p; set the dropped ones' logits to -inf and put the logits back in vocabulary order.",
        fallback=lambda fn: _library_top_p, probes=(_top_p_mistake,))
def _compare_top_p(fn: Callable, g: torch.Generator) -> None:
    for _ in range(10):
        logits = torch.randn(_int(g, 1, 4), _int(g, 5, 300), generator=g) * (float(torch.rand(1, generator=g)) * 4 + 0.5)
        top_p = round(float(torch.rand(1, generator=g)) * 0.9 + 0.05, 3)
        yours = fn(logits.clone(), top_p)
        if not torch.is_tensor(yours):
            raise Different(f"keep_top_p returns a {type(yours).__name__}, not a tensor of logits.")
        first_difference(f"the probabilities to sample from, softmax of keep_top_p(logits of shape {tuple(logits.shape)}, "
                         f"{top_p})", yours.float().softmax(-1), _library_top_p(logits, top_p).softmax(-1), 1e-6)
