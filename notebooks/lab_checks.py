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


# 03 initialisation ----------------------------------------------------------------------------------------------------
WEIGHT_KINDS = ("embed_tokens", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _initialised(fn: Callable, g: torch.Generator) -> torch.nn.Module:
    """A library model of random size with PyTorch's defaults, as the chapter's model starts (Linear uniform, the tied
    embedding N(0, 1)), after model.apply(fn)."""
    model = mm.MiniMindForCausalLM(_config(g, layers=_pick(g, (2, 3))))
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.reset_parameters()
    model.model.embed_tokens.reset_parameters()  # last: the head is this matrix, and the embedding's default wins
    return model.apply(fn)


def _init_mistake(fn: Callable) -> str | None:
    big, norm = torch.nn.Linear(1024, 1024, bias=False), mm.RMSNorm(64)  # a million draws: the statistics are sharp
    fn(big)
    fn(norm)
    mean, std = big.weight.mean().item(), big.weight.std().item()
    if abs(mean - 0.02) < 0.005 and abs(std - 1) < 0.05:
        return ("The weights have mean 0.02 and standard deviation 1: the second positional argument of "
                "torch.nn.init.normal_ is the mean; name the keyword arguments.")
    if abs(std - 0.02 ** 0.5) < 0.005:
        return "The standard deviation is the square root of 0.02: 0.02 is the standard deviation, not the variance."
    if 0.01 < std and big.weight.abs().max().item() <= 0.0201:
        return "The weights are uniform in [-0.02, 0.02]: the library draws them from a normal distribution."
    if not torch.equal(norm.weight, torch.ones(64)):
        return "It draws the RMSNorm gains too: they start at 1 (a norm that first scales by 1)."
    return None


@region("init_weights", "when the module is an nn.Linear or an nn.Embedding, draw its weight in place from a normal "
        "distribution of mean 0 and standard deviation 0.02 (torch.nn.init has the function: name its keyword "
        "arguments); do nothing to any other module.", fallback=lambda fn: mm.MiniMindForCausalLM._init_weights,
        probes=(_init_mistake,))
def _compare_init_weights(fn: Callable, g: torch.Generator) -> None:
    model = _initialised(fn, g)
    if model.lm_head.weight is not model.model.embed_tokens.weight:
        raise Different("lm_head.weight is no longer model.embed_tokens.weight: the tie is broken (a new Parameter "
                        "replaced the shared one); draw into the existing weight, in place.")
    kinds = {kind: torch.cat([p.flatten() for n, p in model.named_parameters() if f".{kind}." in n])
             for kind in WEIGHT_KINDS}
    what = f"of each kind of weight ({', '.join(kinds)}; {sum(w.numel() for w in kinds.values())} draws)"
    first_difference(f"the standard deviation {what}", torch.stack([w.std() for w in kinds.values()]),
                     torch.full((len(kinds),), 0.02), 0.003)  # +-15%: above 6 standard errors for these sizes
    first_difference(f"the mean {what}", torch.stack([w.mean() for w in kinds.values()]), torch.zeros(len(kinds)),
                     0.003)
    z = torch.cat(list(kinds.values()))
    z = (z - z.mean()) / z.std()
    first_difference("the kurtosis of all the weights together (3 for a normal distribution)", z.pow(4).mean()[None],
                     torch.tensor([3.0]), 0.1)  # +-0.4; a uniform distribution has 1.8
    gains = torch.cat([p.flatten() for n, p in model.named_parameters() if "norm" in n])
    first_difference("the RMSNorm gains, every norm together", gains, torch.ones_like(gains), 0.0)
    c = model.config
    first_difference("the RoPE table freqs_cos (a buffer, not a weight)", model.model.freqs_cos,
                     mm.precompute_freqs_cis(c.head_dim, c.max_position_embeddings, c.rope_theta)[0], 0.0)


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


# ======================================================================================================================
# 04_gradient_accumulation and 05_mixed_precision: the schedule, clipping, the update, exact accumulation, loss scaling
# ======================================================================================================================
import copy  # noqa: E402
import math  # noqa: E402

from minimind_lib import train as T  # noqa: E402
from minimind_lib.device import get_device  # noqa: E402


def _log_uniform(g: torch.Generator, low: float, high: float) -> float:
    """A number drawn log-uniformly between low and high."""
    return float(low * (high / low) ** torch.rand(1, generator=g))


def _one(value: Any) -> torch.Tensor:
    """A number as a 1-element float64 tensor, for first_difference (which then names index (0,))."""
    return torch.tensor([float(value)], dtype=torch.float64)


def _with_method(cls: type, name: str, method: Callable) -> type:
    """The chapter's class (its __init__ and other methods, given code) with the library's rule as method `name`."""
    return type(cls.__name__, (cls,), {name: method, "__doc__": cls.__doc__})


# 04 the learning-rate schedule ----------------------------------------------------------------------------------------
def _lrs(fn: Callable, schedule: dict, steps: int) -> torch.Tensor:
    return torch.tensor([float(fn(s, **schedule)) for s in range(steps)], dtype=torch.float64)


def _schedule_mistake(fn: Callable) -> str | None:
    schedule, cosine = {"lr": 1.0, "min_lr": 0.1, "warmup_steps": 4, "max_steps": 20}, lambda progress, low: \
        low + 0.5 * (1 + math.cos(math.pi * progress)) * (1.0 - low)
    yours, decay = _lrs(fn, schedule, 26).tolist(), range(4, 20)
    if yours[0] == 0:
        return ("At step 0 it gives 0: warmup starts at lr / warmup_steps, so the first step already trains (a step "
                "at rate 0 would only cost time).")
    if all(abs(yours[s] - cosine(s / 20, 0.1)) < 1e-9 for s in decay):
        return ("The cosine's progress counts from step 0, not from the end of warmup: the decay starts below lr. "
                "Progress is 0 at the first step after warmup and 1 at max_steps.")
    if all(abs(yours[s] - cosine((s - 4) / 16, 0.0)) < 1e-9 for s in decay):
        return "It decays towards 0, not towards min_lr: the cosine runs between lr and min_lr."
    if any(abs(yours[s] - 0.1) > 1e-9 for s in range(20, 26)):
        return "From max_steps on it does not stay at min_lr (a cosine past its end comes back up)."
    return None


@region("lr_at", "during warmup the rate rises in equal steps from lr / warmup_steps at step 0 to lr at the last "
        "warmup step; then it follows the cosine from lr down to min_lr, its progress going from 0 when warmup ends "
        "to 1 at max_steps; from max_steps on it is min_lr. No warmup at all when warmup_steps is 0.",
        fallback=lambda fn: T.lr_at, probes=(_schedule_mistake,))
def _compare_lr_at(fn: Callable, g: torch.Generator) -> None:
    for i in range(6):  # warmups of 0 steps, 1 step and more, twice each
        max_steps, lr = _int(g, 2, 60), _log_uniform(g, 1e-4, 1e-1)
        schedule = {"lr": lr, "min_lr": lr * _pick(g, (0.0, 0.1, 0.5)), "max_steps": max_steps,
                    "warmup_steps": (0, 1, _int(g, 2, max_steps))[i % 3]}
        steps = max_steps + 3
        first_difference(f"the rate at steps 0..{steps - 1} of lr_at(step, "
                         + ", ".join(f"{k}={v:.4g}" for k, v in schedule.items()) + ")",
                         _lrs(fn, schedule, steps), _lrs(T.lr_at, schedule, steps), 1e-8)


# 04 clipping by the global norm ---------------------------------------------------------------------------------------
def _twins(params: list[torch.Tensor]) -> list[torch.nn.Parameter]:
    """Copies of the parameters with copies of their gradients (None stays None)."""
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for twin, p in zip(twins, params):
        twin.grad = None if p.grad is None else p.grad.clone()
    return twins


def _clip_mistake(fn: Callable) -> str | None:
    big, small = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    big.grad, small.grad = torch.tensor([3.0, 4.0]), torch.tensor([0.3, 0.4])  # norms 5 and 0.5
    fn([big, small], 1.0)
    if torch.allclose(small.grad, torch.tensor([0.3, 0.4])) and abs(float(big.grad.norm()) - 1.0) < 1e-4:
        return ("It clips each gradient by its own norm: one global norm over all the gradients decides one scale for "
                "all of them, so the small gradient shrinks too and the update keeps its direction.")
    small.grad, big.grad = torch.tensor([0.3, 0.4]), None
    fn([small], 1.0)
    if float(small.grad.norm()) > 0.5 + 1e-4:
        return "With a norm below max_norm it scales the gradients up: the scale is never above 1."
    small.grad = torch.tensor([3.0, 4.0])
    if abs(float(fn([small], 1.0)) - 1.0) < 1e-4:
        return "It returns the norm after clipping: return the norm before it, the number the loop logs."
    return None


@region("clip_by_global_norm", "the global norm is the L2 norm of all the gradients' entries together (parameters "
        "without a gradient are left out); when it is above max_norm, multiply every gradient in place by max_norm / "
        "(norm + 1e-6), never by more than 1; return the norm measured before clipping.",
        fallback=lambda fn: torch.nn.utils.clip_grad_norm_, probes=(_clip_mistake,))
def _compare_clip(fn: Callable, g: torch.Generator) -> None:
    params = [torch.nn.Parameter(torch.zeros(*[_int(g, 1, 7) for _ in range(_int(g, 1, 3))]))
              for _ in range(_int(g, 3, 6))]
    for p in params[:-1] if _int(g, 0, 1) else params:  # sometimes the last has no gradient (an unused weight)
        p.grad = torch.randn(p.shape, generator=g) * _log_uniform(g, 0.01, 10)
    norm = float(torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None]))
    for max_norm in (norm * _pick(g, (0.1, 0.5, 0.9)), norm * _pick(g, (1.5, 4.0))):  # one that clips, one that not
        yours, library = _twins(params), _twins(params)
        got, want = fn(yours, max_norm), torch.nn.utils.clip_grad_norm_(library, max_norm)
        what = f"clipping {len(params)} gradients of global norm {norm:.4g} to max_norm={max_norm:.4g}"
        for i, (y, w) in enumerate(zip(yours, library)):
            if w.grad is not None:
                first_difference(f"gradient {i} after {what}", y.grad, w.grad, 1e-5)
        first_difference(f"the norm returned by {what}", _one(got), _one(want), 1e-5)


# 04 clip and step -----------------------------------------------------------------------------------------------------
def _step_mistake(fn: Callable) -> str | None:
    p = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([p], lr=0.1)
    p.grad = torch.tensor([1.0, math.inf, 1.0])
    fn(optimizer, [p], 1.0)
    if not torch.equal(p.detach(), torch.ones(3)):
        return ("It takes the step although the gradient norm is inf/NaN: such a step turns weights into inf/NaN "
                "(and AdamW's states with them); skip it, and still clear the gradients.")
    p.grad = torch.tensor([3.0, 4.0, 0.0])
    norm = fn(optimizer, [p], 1.0)[0]
    if p.grad is not None and float(p.grad.abs().sum()) > 0:
        return ("It leaves the gradients in .grad after the step: the next step's backward would add its gradients to "
                "them. Clear them (zero_grad) after every step, a skipped one too.")
    if abs(float(norm) - 1.0) < 1e-4:
        return "It returns the norm after clipping (1.0 here): return the norm before it, the number the loop logs."
    return None


@region("optimizer_step", "clip the gradients' global norm to grad_clip with PyTorch's clip_grad_norm_ (no limit "
        "when grad_clip is None or 0); call the optimizer's step only when that norm is finite; then clear the "
        "gradients; return the norm before clipping as a float and whether it was finite.",
        fallback=lambda fn: _library_optimizer_step, probes=(_step_mistake,))
def _compare_optimizer_step(fn: Callable, g: torch.Generator) -> None:
    shapes = [tuple(_int(g, 1, 6) for _ in range(_int(g, 1, 2))) for _ in range(_int(g, 1, 4))]
    start = [torch.randn(s, generator=g) for s in shapes]
    kind, lr = _pick(g, ("AdamW", "SGD")), _log_uniform(g, 1e-3, 0.1)

    def make() -> tuple[list[torch.nn.Parameter], torch.optim.Optimizer]:
        params = [torch.nn.Parameter(t.clone()) for t in start]
        return params, (torch.optim.AdamW(params, lr=lr, weight_decay=0.1) if kind == "AdamW" else
                        torch.optim.SGD(params, lr=lr, momentum=0.9))

    (yours, yours_opt), (library, library_opt) = make(), make()
    bad_step = _int(g, 0, 3)  # the step whose gradient holds an inf or a nan
    for step in range(4):
        grads = [torch.randn(s, generator=g) * _log_uniform(g, 0.1, 10) for s in shapes]
        norm = float(torch.nn.utils.get_total_norm(grads))
        if step == bad_step:
            grads[_int(g, 0, len(grads) - 1)].view(-1)[0] = _pick(g, (math.inf, -math.inf, math.nan))
        # even steps clip (to a fraction of the norm), odd ones do not or may not (None, 0: no limit)
        clip = norm * _log_uniform(g, 0.2, 0.9) if step % 2 == 0 else _pick(g, (None, 0.0, _log_uniform(g, 0.1, 10)))
        for params in (yours, library):
            for p, grad in zip(params, grads):
                p.grad = grad.clone()
        got, (norm, finite) = fn(yours_opt, yours, clip), T.optimizer_step(library_opt, library, clip)
        what = (f"step {step} of {kind} (grad_clip={clip if clip is None else round(clip, 4)!r}"
                + (", a gradient holding an inf or a nan)" if step == bad_step else ")"))
        if not isinstance(got, tuple) or len(got) != 2:
            raise Different(f"optimizer_step returns a {type(got).__name__}; it should return (the norm before "
                            "clipping, whether it was finite).")
        for i, (y, w) in enumerate(zip(yours, library)):
            first_difference(f"weight {i} after {what}", y.detach(), w.detach(), 1e-5)
        left = [0.0 if p.grad is None else float(p.grad.abs().max()) for p in yours]
        first_difference(f"what .grad still holds after {what} (largest entry of each weight's; 0: cleared)",
                         torch.tensor(left, dtype=torch.float64), torch.zeros(len(left), dtype=torch.float64), 0.0)
        first_difference(f"whether the norm was finite at {what} (1: yes)", _one(bool(got[1])), _one(bool(finite)), 0)
        if bool(finite):
            first_difference(f"the norm returned at {what}", _one(got[0]), _one(norm), 1e-5)


def _library_optimizer_step(optimizer: torch.optim.Optimizer, params: list, grad_clip: float | None) -> tuple:
    """minimind_lib's optimizer_step, returning Python numbers as the chapter's does."""
    norm, finite = T.optimizer_step(optimizer, params, grad_clip)
    return float(norm), bool(finite)


# 04 exact token-weighted accumulation ---------------------------------------------------------------------------------
def _library_accumulate_step(model: torch.nn.Module, micro_batches: Sequence[dict],
                             normalization: str = "token") -> dict:
    """minimind_lib's accumulate_step, called as the chapter calls its own."""
    return T.accumulate_step(model, micro_batches, normalization=normalization)


def _accumulation_case(g: torch.Generator) -> tuple[torch.nn.Module, list[dict]]:
    """A small random model on the notebook's device, and k micro-batches whose trained-token counts differ a lot (one
    of short rows among longer ones), padded as the chapter pads them."""
    c = _config(g, layers=_int(g, 1, 2))
    model = _randomize(mm.MiniMindForCausalLM(c), g).to(get_device())
    micro = [[_int(g, 2, 4)]]  # one row of 1 to 3 trained tokens; the others at least one row of 7 or more
    micro += [[longest := _int(g, 8, 24)] + [_int(g, 2, longest) for _ in range(_int(g, 0, 2))]
              for _ in range(_int(g, 1, 3))]
    micro = [D.pad_collate([{"input_ids": ids, "labels": ids.clone()} for ids in
                            (torch.randint(0, c.vocab_size, (n,), generator=g) for n in lengths)]) for lengths in micro]
    return model, [micro[i] for i in torch.randperm(len(micro), generator=g).tolist()]


def _accumulated(fn: Callable, model: torch.nn.Module, micro: list[dict], normalization: str) -> tuple[Any, dict]:
    """What fn returns for one step of a copy of the model, and the gradients it leaves, by parameter name."""
    model = copy.deepcopy(model)
    model.zero_grad(set_to_none=True)
    with torch.enable_grad():
        stats = fn(model, [dict(mb) for mb in micro], normalization=normalization)
    return stats, {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _accumulation_mistake(fn: Callable) -> str | None:
    model, micro = _accumulation_case(torch.Generator().manual_seed(0))
    def flat(fn: Callable, normalization: str) -> torch.Tensor:
        return torch.cat([v.flatten() for v in _accumulated(fn, model, micro, normalization)[1].values()])

    yours = flat(fn, "token")
    naive, exact = flat(_library_accumulate_step, "naive"), flat(_library_accumulate_step, "token")
    if yours.shape == naive.shape and torch.allclose(yours, naive, rtol=1e-4, atol=1e-4 * float(naive.abs().max())):
        return ("Under normalization='token' it computes the naive gradient, averaging per micro-batch: each "
                "micro-batch's mean token loss / k, so a token of a short micro-batch weighs more than one of a long "
                "micro-batch. Exact: divide every micro-batch's summed token loss by the trained tokens of the whole "
                "step, counted over all k micro-batches before the first backward.")
    if yours.shape == exact.shape:
        factor = float(yours @ exact / (exact @ exact))
        if abs(factor - 1) > 1e-3 and torch.allclose(yours, factor * exact, atol=1e-4 * float(yours.abs().max())):
            n = sum(int((mb["labels"][:, 1:] != -100).sum()) for mb in micro)
            return (f"Its gradient is the exact one times {factor:.4g}: the right direction, the wrong division (the "
                    f"exact step divides the summed token losses by the step's {n} trained tokens).")
    return None


@region("accumulate_step", "count the trained tokens N of all the micro-batches from their labels first; then for "
        "each micro-batch: forward, the sum of its token losses, that sum divided by N ('token') or by its own "
        "trained tokens and by k ('naive'), backward. Add up the summed token losses for the result.",
        fallback=lambda fn: _library_accumulate_step, probes=(_accumulation_mistake,))
def _compare_accumulate_step(fn: Callable, g: torch.Generator) -> None:
    model, micro = _accumulation_case(g)
    counts = [int((mb["labels"][:, 1:] != -100).sum()) for mb in micro]
    for normalization in ("token", "naive"):
        (stats, yours), (want_stats, want) = (_accumulated(f, model, micro, normalization)
                                              for f in (fn, _library_accumulate_step))
        what = f"normalization={normalization!r}, {len(micro)} micro-batches of {counts} trained tokens"
        scale = max(float(w.abs().max()) for w in want.values())
        for name, w in want.items():
            first_difference(f"the gradient of {name} under {what} (as a fraction of the largest entry)",
                             yours[name] / scale if name in yours else None, w / scale, 1e-4)
        for key in ("n_tokens", "loss_sum", "loss"):
            if not isinstance(stats, Mapping) or key not in stats:
                raise Different(f"accumulate_step returns no {key!r}: it returns a dict with loss_sum, n_tokens, loss.")
            first_difference(f"{key} returned under {what}", _one(stats[key]), _one(want_stats[key]), 1e-5)


# 05 the GradScaler's update -------------------------------------------------------------------------------------------
def _scaler_update(self: Any) -> None:
    """torch.amp.GradScaler's update rule (its _amp_update_scale_), on the chapter's HandScaler."""
    if self.found_inf:
        self.scale_value, self.good_steps = self.scale_value * self.backoff_factor, 0
    else:
        self.good_steps += 1
        if self.good_steps == self.growth_interval:
            self.scale_value, self.good_steps = self.scale_value * self.growth_factor, 0
    self.unscaled = False


def _scale_trace(make: Callable, overflows: Sequence[bool]) -> torch.Tensor:
    """The scale after each step of a run whose step i overflows when overflows[i] (make() builds the scaler)."""
    p = torch.nn.Parameter(torch.zeros(3))
    optimizer, scaler, trace = torch.optim.SGD([p], lr=0.0), make(), []
    for bad in overflows:
        scaler.scale(torch.ones(()))
        p.grad = torch.tensor([1.0, math.inf if bad else 1.0, 1.0])
        scaler.unscale_(optimizer)
        scaler.step(optimizer)
        scaler.update()
        trace.append(float(scaler.get_scale()))
    return torch.tensor(trace, dtype=torch.float64)


def _rule_trace(overflows: Sequence[bool], interval: int, variant: str) -> list[float]:
    """The scale after each step by the update rule with one usual mistake (init 1024, growth 2, backoff 0.5)."""
    scale, good, trace = 1024.0, 0, []
    for bad in overflows:
        if bad:
            scale, good = scale * (1.0 if variant == "no backoff" else 0.5), good if variant == "keeps count" else 0
        else:
            good += 1
            if (variant == "every step" or good == interval + (variant == "one late")
                    or (variant == "no restart" and good > interval)):
                scale, good = scale * 2.0, good if variant == "no restart" else 0
        trace.append(scale)
    return trace


SCALER_MISTAKES = {
    "keeps count": "After an overflow it goes on counting the good steps from before it: an overflow starts the count "
                   "again from 0, so the scale grows only after growth_interval good steps in a row.",
    "every step": "It grows the scale after every good step: only after growth_interval good steps in a row.",
    "one late": "It grows the scale one good step late: the step that brings the count to growth_interval grows it.",
    "no restart": "After growing it does not start the count again, so it grows at every good step from then on.",
    "no backoff": "On an overflow it leaves the scale as it is: it must shrink (times backoff_factor), or the next "
                  "step overflows again.",
}


def _scaler_mistake(cls: type) -> str | None:
    overflows = [False, False, True, False, False, False, False, False, False, False, True, False, False, False]
    yours = _scale_trace(lambda: cls(init_scale=1024.0, growth_interval=3), overflows).tolist()
    return next((SCALER_MISTAKES[v] for v in SCALER_MISTAKES if yours == _rule_trace(overflows, 3, v)), None)


@region("HandScaler.update", "after a step whose gradients overflowed (found_inf): multiply the scale by "
        "backoff_factor and start the count of good steps again from 0; after a good step: count it, and when the "
        "count reaches growth_interval multiply the scale by growth_factor and start the count again.",
        fallback=lambda cls: _with_method(cls, "update", _scaler_update), probes=(_scaler_mistake,))
def _compare_scaler_update(cls: type, g: torch.Generator) -> None:
    kw = {"init_scale": 2.0 ** _int(g, 4, 16), "growth_factor": _pick(g, (2.0, 4.0)),
          "backoff_factor": _pick(g, (0.5, 0.25)), "growth_interval": _int(g, 2, 5)}
    n = kw["growth_interval"]  # good steps, an overflow, then more good steps than a growth takes; then at random
    overflows = [False] * (n - 1) + [True] + [False] * (n + 1)
    overflows += (torch.rand(_int(g, 10, 25), generator=g) < _pick(g, (0.15, 0.4))).tolist()
    settings = ", ".join(f"{k}={v:g}" for k, v in kw.items())
    first_difference(f"the scale after each of {len(overflows)} steps ({settings}; overflows at steps "
                     f"{[i for i, bad in enumerate(overflows) if bad]})",
                     _scale_trace(lambda: cls(**kw), overflows),
                     _scale_trace(lambda: torch.amp.GradScaler("cpu", **kw), overflows), 0.0)


# ======================================================================================================================
# 06_dynamic_batching: the token budget, packing, the controller's decisions
# ======================================================================================================================
from minimind_lib import batching as B  # noqa: E402


def _rows_of_lengths(*lengths: int) -> list[dict]:
    """Samples of the given lengths, as the controller sees them (only their length matters)."""
    return [{"input_ids": torch.zeros(n, dtype=torch.long)} for n in lengths]


# 06 fill_batches ------------------------------------------------------------------------------------------------------
def _budget_mistake(fn: Callable) -> str | None:
    if fn([0, 1, 2], [5, 5, 5], 8) == [[0, 1, 2]]:
        return ("Three rows of 5 tokens made one batch under max_tokens=8: it counts rows against the budget, which "
                "is on padded tokens, rows x the longest row.")
    if fn([0, 1, 2], [5, 2, 2], 8) == [[0, 1, 2]]:
        return ("Rows of 5, 2 and 2 tokens made one batch under max_tokens=8: it multiplies by the new row's length, "
                "but every row is padded to the longest row in the batch, counting the rows already in it.")
    if fn([0, 1, 2], [5, 2, 2], 8) == [[0, 1], [2]]:
        return ("Rows of 5 and 2 tokens made one batch under max_tokens=8: it counts the real tokens of the rows "
                "(their sum); every row is padded to the longest row of its batch, so the budget is on rows x the "
                "longest row.")
    if fn([0, 1], [4, 4], 8) == [[0], [1]]:
        return "Two rows of 4 tokens were split under max_tokens=8: a batch that fills the budget exactly is allowed."
    return None


@region("fill_batches", "walk the samples in the given order, keeping the open batch and the longest row in it; a "
        "sample joins while (rows + 1) times the longest row, this sample's length included, stays within max_tokens "
        "and the rows stay under max_batch_size (either limit may be None); otherwise close the batch and let the "
        "sample open the next one; close the last batch at the end.", fallback=lambda fn: B.fill_batches,
        probes=(_budget_mistake,))
def _compare_fill_batches(fn: Callable, g: torch.Generator) -> None:
    for k in range(60):
        unit = _int(g, 1, 16)
        if k % 3 == 0:  # few distinct lengths and a budget they fill exactly, or one below the longest row
            lengths = [unit * _int(g, 1, 3) for _ in range(_int(g, 1, 24))]
        else:
            lengths = [_int(g, 1, _pick(g, (8, 64))) for _ in range(_int(g, 0, 24))]
        order = (sorted(range(len(lengths)), key=lambda i: -lengths[i]) if k % 2 else  # a megabatch's order
                 torch.randperm(len(lengths), generator=g).tolist())
        longest = max(lengths, default=1)
        max_tokens = (None if k % 7 == 0 else unit * _int(g, 1, 8) if k % 3 == 0 else
                      _int(g, max(1, longest // 2), 4 * longest))
        max_rows = _int(g, 1, 6) if max_tokens is None or k % 3 == 0 else None
        call = f"fill_batches(order={order}, lengths={lengths}, max_tokens={max_tokens}, max_batch_size={max_rows})"
        yours = fn(list(order), list(lengths), max_tokens, max_rows)
        first_item_difference(call, [list(b) for b in yours] if isinstance(yours, (list, tuple)) else yours,
                              B.fill_batches(order, lengths, max_tokens, max_rows))


# 06 stream_segments ---------------------------------------------------------------------------------------------------
def _doc(n: int, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.arange(start, start + n)
    return ids, ids + 1000


def _random_docs(g: torch.Generator, longest: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """1 to 8 documents of 1 to `longest` tokens, about 30% of their labels -100 (a prompt's untrained positions)."""
    docs = [_doc(_int(g, 1, longest), 100 * d) for d in range(_int(g, 1, 8))]
    for ids, labels in docs:
        labels[torch.rand(len(ids), generator=g) < 0.3] = -100
    return docs


def _segments(rows: Any) -> list:
    """Rows of segments as plain lists: [[(ids, labels), ...], ...]."""
    return [[(torch.as_tensor(i).tolist(), torch.as_tensor(lab).tolist()) for i, lab in row] for row in rows]


def _stream_mistake(fn: Callable) -> str | None:
    def run(lengths: tuple, seq_len: int, whole: bool = False) -> tuple[list, int]:
        stats = B.PackStats()
        rows = fn([_doc(n, 10 * d) for d, n in enumerate(lengths)], seq_len, stats, whole)
        return [[len(ids) for ids, _ in row] for row in rows], stats.n_split
    if run((3, 4), 5, whole=True)[0] == [[3, 2], [2]]:
        return ("With whole=True it cut a document across rows: a document that does not fit the room left starts "
                "the next row whole, and the row before keeps its empty end.")
    if run((2, 2), 5)[0] == [[2], [2]]:
        return "It starts a new row for every document: packing puts the next document in the room left in the row."
    if sum(map(sum, run((7,), 5)[0])) < 7:
        return "A document longer than the room left lost its rest: what does not fit goes on in the next row."
    if run((5,), 5)[1] == 1:
        return "It counts a document that exactly fills the room left as cut: it was placed whole."
    if run((12,), 5)[1] > 1:
        return "It counts a document once per cut: n_split counts the documents cut, once each."
    return None


@region("stream_segments", "keep the open row and the room left in it; put as much of each document as fits in the "
        "room left, close the row when it is full and go on with the rest of the document in a new row; count each "
        "document that does not fit the room left once in stats.n_split; with whole=True a document that does not fit "
        "closes the row first (it is never cut). Close the last row if it holds anything.",
        fallback=lambda fn: B.stream_segments, probes=(_stream_mistake,))
def _compare_stream_segments(fn: Callable, g: torch.Generator) -> None:
    for k in range(30):
        whole, seq_len = bool(k % 2), _int(g, 2, 16)
        docs = _random_docs(g, seq_len if whole else 3 * seq_len)
        yours, want = B.PackStats(), B.PackStats()
        call = f"stream_segments(documents of lengths {[len(d[0]) for d in docs]}, seq_len={seq_len}, whole={whole})"
        first_item_difference(f"the rows of segments (ids, labels) of {call}", _segments(fn(list(docs), seq_len,
                              yours, whole)), _segments(B.stream_segments(docs, seq_len, want, whole)))
        if yours.n_split != want.n_split:
            raise Different(f"stats.n_split after {call} differs first at index (0,): yours {yours.n_split}, the "
                            f"library's {want.n_split} (documents cut across rows).")


# 06 rows_from_segments ------------------------------------------------------------------------------------------------
def _rows_mistake_06(fn: Callable) -> str | None:
    out = fn([[_doc(3), _doc(2, 50)], [_doc(4, 70)]], 6, 0, B.PackStats())
    positions, labels, docs = (out[k].tolist() for k in ("position_ids", "labels", "doc_ids"))
    if positions[0][3:5] == [3, 4]:
        return ("Its position_ids count on across a document boundary: positions restart at 0 in each document, so "
                "RoPE sees the positions the document has alone.")
    if labels[0][3] == 1050 or labels[0][0] == 1000:
        return ("The first position of each document keeps its label: it must be -100, or the last token of the "
                "document before would be trained to predict it (the model shifts the labels by one).")
    if labels[0][0] == 1001:
        return "It shifts the labels itself: labels line up with input_ids (the model does the shift)."
    if docs[0][5] != -1 or docs[1][4] != -1:
        return "doc_ids on padding are not -1: padding belongs to no document."
    if docs[1][0] != 0:
        return "doc_ids count on from the row before: they number the segments within each row, from 0."
    return None


@region("rows_from_segments", "start from (rows, seq_len) tensors of pad_id, -100, 0 and -1; in each row write its "
        "segments one after the other: the ids, the labels from the segment's second position on (its first stays "
        "-100), positions 0, 1, 2, ... starting again at each segment, and the segment's number in the row as its "
        "doc id; add the tokens placed and the pads to the stats and set their row count.",
        fallback=lambda fn: B.rows_from_segments, probes=(_rows_mistake_06,))
def _compare_rows_from_segments(fn: Callable, g: torch.Generator) -> None:
    for k in range(12):
        whole, seq_len, pad_id = bool(k % 2), _int(g, 2, 24), _pick(g, (0, 3, 6399))
        docs = _random_docs(g, seq_len if whole else 2 * seq_len)
        rows = B.stream_segments(docs, seq_len, B.PackStats(), whole)
        yours, want = B.PackStats(n_docs=len(docs)), B.PackStats(n_docs=len(docs))
        out, lib = fn(rows, seq_len, pad_id, yours), B.rows_from_segments(rows, seq_len, pad_id, want)
        what = f"of {len(rows)} rows of seq_len={seq_len} (segments of lengths {[[len(s[0]) for s in r] for r in rows]})"
        for key in lib:
            if not isinstance(out, Mapping) or key not in out:
                raise Different(f"the result has no {key!r}: it holds input_ids, labels, position_ids and doc_ids.")
            first_difference(f"{key} {what}", out[key], lib[key], 0.0)
        for field in ("n_tokens", "n_pad", "n_rows"):
            if getattr(yours, field) != getattr(want, field):
                raise Different(f"stats.{field} {what} differs first at index (0,): yours {getattr(yours, field)}, the "
                                f"library's {getattr(want, field)}.")


# 06 after_oom, memory_check -------------------------------------------------------------------------------------------
def _after_oom_mistake(fn: Callable) -> str | None:
    rows = [_rows_of_lengths(100, 90, 90)]  # 300 padded tokens, under a cap of 1000
    kind, sizes, _ = fn((None, 1000), rows, 0, 3, 0.8, None)
    if sizes == (None, 500):
        return ("Asked with a cap of 1000 padded tokens after a micro-batch of 300 ran out of memory, it halved the "
                "cap, to 500, which that micro-batch does not reach: the retry is the same work and fails again. "
                "Halve what the largest micro-batch used.")
    if sizes[1] and sizes[1] >= 300:
        return f"After an out-of-memory error its token cap is {sizes[1]}, no smaller than the 300 that failed."
    if fn((8, None), [_rows_of_lengths(10, 10, 10, 10)], 0, 3, 0.8, None)[1][0] >= 4:
        return "After an out-of-memory error the rows per micro-batch did not shrink below the 4 that failed."
    if fn((None, 400), [_rows_of_lengths(100), _rows_of_lengths(50)], 0, 3, 0.8, None)[0] == "oom_halve":
        return "It halves when every micro-batch is a single row: halving cannot make a row shorter; cut the rows."
    if fn((4, None), [_rows_of_lengths(10, 10)], 3, 3, 0.8, None)[0] == "oom_halve":
        return "It halves again after max_retries halvings: then the rows are cut instead."
    return None


@region("after_oom", "while halvings < max_retries and some micro-batch has more than one row: halve each size that is "
        "set, from what the largest such micro-batch used (its rows; its rows x longest row), never below 1. "
        "Otherwise cut: seq_len becomes seq_cut times the longest row of the step (as cut now).",
        fallback=lambda fn: B.after_oom, probes=(_after_oom_mistake,))
def _compare_after_oom(fn: Callable, g: torch.Generator) -> None:
    for k in range(120):
        seq_len = None if k % 3 == 0 else _int(g, 8, 256)
        single = k % 5 == 0  # every micro-batch a single row: only a cut can help
        micro = [_rows_of_lengths(*(_int(g, 1, 300) for _ in range(1 if single else _int(g, 1, 6))))
                 for _ in range(_int(g, 1, 4))]
        used_rows = max(map(len, micro))
        used_tokens = max(len(mb) * max(B.row_length(s, seq_len) for s in mb) for mb in micro)
        sizes = _pick(g, ((used_rows + _int(g, 0, 8), None), (None, used_tokens + _int(g, 0, 2000)),
                          (used_rows + _int(g, 0, 4), used_tokens + _int(g, 0, 500))))
        max_retries = _int(g, 0, 4)
        args = (sizes, micro, _int(g, 0, max_retries), max_retries, _pick(g, (0.5, 0.8, 0.9)), seq_len)
        shown = [[len(s["input_ids"]) for s in mb] for mb in micro]
        call = (f"after_oom(sizes={sizes}, micro-batches of row lengths {shown}, halvings={args[2]}, max_retries="
                f"{max_retries}, seq_cut={args[4]}, seq_len={seq_len})")
        first_item_difference(f"(kind, sizes, seq_len) of {call}", tuple(fn(*args)), B.after_oom(*args))


def _memory_check_mistake(fn: Callable) -> str | None:
    if fn(0.45, (None, 500), (None, 1000), 100, 256, 256)[0] == "grow":
        return ("It grew the micro-batch while the rows were still cut after an out-of-memory error (asked at a "
                "peak of 45% with rows cut from 256 to 100 tokens, where 45% x 256/100 passes high water): the cut "
                "sequence length comes back first, and until it can, nothing grows.")
    if fn(0.45, (1, None), (8, None), 256, 256, None)[0] == "grow":
        return ("It grows 1 row to 2 at a peak of 45%: that predicts 90%, above high water. Grow only if the peak "
                "scaled by the growth stays under high water.")
    if (out := fn(0.2, (None, 900), (None, 1000), 256, 256, None)[1]) != (None, 1000):
        return f"From 900 tokens at a peak of 20% (start 1000) it went to {out[1]}: growth stops at the start size."
    if fn(0.9, (1, None), (8, None), 256, 256, None)[0] == "shrink":
        return "It shrinks a micro-batch of 1 row: there is nothing left to shrink."
    if fn(0.3, (None, 500), (None, 1000), 163, 256, 256)[0] != "grow_seq_len":
        return "At a peak of 30% with rows cut from 256 to 163 it did not bring the sequence length back first."
    return None


@region("memory_check", "above high_water (and some size above 1): shrink every set size by the factor shrink. Below "
        "low_water with rows cut (uncut_len): bring seq_len back to its start if the peak scaled by uncut_len / "
        "seq_len stays under high_water, else change nothing. Below low_water otherwise: grow every set size by "
        "1 / shrink, rounded, at least by one and at most to its start, if the peak scaled by the largest growth "
        "stays under high_water. Anything else: no change.", fallback=lambda fn: B.memory_check,
        probes=(_memory_check_mistake,))
def _compare_memory_check(fn: Callable, g: torch.Generator) -> None:
    for k in range(200):
        high = _pick(g, (0.8, 0.9, 0.7))
        low, shrink = high * _pick(g, (0.625, 0.5)), _pick(g, (0.8, 0.5, 0.75))
        start = _pick(g, ((_int(g, 1, 32), None), (None, _int(g, 64, 4096)), (_int(g, 1, 32), _int(g, 64, 4096))))
        sizes = tuple(s and _int(g, 1, min(s, 3) if k % 3 == 0 else s) for s in start)  # 1 to 3: growth doubles
        seq_len_start = _int(g, 16, 512)
        cut = k % 2 == 0  # rows cut after an out-of-memory error: uncut_len set, seq_len below it
        seq_len, uncut = (_int(g, 8, seq_len_start - 1), seq_len_start) if cut else (seq_len_start, None)
        r = float(torch.rand((), generator=g))  # the peak: anywhere, below low water, or just below it
        frac = r * 1.2 if k % 4 < 2 else r * low if k % 4 == 2 else low * (0.7 + 0.3 * r)
        args = (frac, sizes, start, seq_len, seq_len_start, uncut, high, low, shrink)
        call = (f"memory_check(frac={frac:.4f}, sizes={sizes}, start_sizes={start}, seq_len={seq_len}, seq_len_start="
                f"{seq_len_start}, uncut_len={uncut}, high_water={high}, low_water={low:g}, shrink={shrink})")
        first_item_difference(f"(kind, sizes, seq_len, uncut_len) of {call}", tuple(fn(*args)), B.memory_check(*args))


# ======================================================================================================================
# 09_beyond_one_gpu: the split, the global token count, no_sync, the memory of a rank
# ======================================================================================================================
import contextlib  # noqa: E402  (this section's own imports: the chapters' sections stay apart)
import copy  # noqa: E402

import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

from minimind_lib import distributed as DP  # noqa: E402
from minimind_lib import train as T  # noqa: E402
from minimind_lib.data import pad_collate, trained_tokens  # noqa: E402


# 09 the split -------------------------------------------------------------------------------------------------------
def _deal_mistake(fn: Callable) -> str | None:
    if [list(o) for o in fn([5, 1, 1, 1, 1, 1], 2)] == [[0, 2, 4], [1, 3, 5]]:
        return "It deals round-robin, whatever the costs: one rank then waits for the other at every all-reduce."
    if [list(o) for o in fn([1, 1, 5], 2)] == [[0, 2], [1]]:
        return ("It deals the micro-batches in the order given: the largest must go first, or a large one that comes "
                "last lands on a rank that is already loaded.")
    got, want = fn([3, 1, 2, 2], 2), DP.assign_to_ranks([3, 1, 2, 2], 2)
    if [sorted(o) for o in got] == want and [list(o) for o in got] != want:
        return "Each rank's positions should be listed in increasing order (the order of the step's micro-batches)."
    return None


@region("deal", "go through the positions from the largest cost to the smallest (equal costs: the lower position "
        "first); give each to the rank whose costs add up to the least so far (equal: the one with fewer items, then "
        "the lower rank); return each rank's positions in increasing order.",
        fallback=lambda fn: DP.assign_to_ranks, probes=(_deal_mistake,))
def _compare_deal(fn: Callable, g: torch.Generator) -> None:
    for _ in range(40):  # costs from a few values (many ties), sometimes fewer micro-batches than ranks
        n_ranks, scale = _int(g, 1, 6), _pick(g, (1, 1, 100))
        costs = [_int(g, 1, 6) * scale for _ in range(_int(g, 0, 12))]
        got = fn(list(costs), n_ranks)
        first_item_difference(f"deal({costs}, {n_ranks})", [list(o) for o in got], DP.assign_to_ranks(costs, n_ranks))


# 09 the global token count ------------------------------------------------------------------------------------------
def _micro_batch(g: torch.Generator, vocab: int) -> dict[str, torch.Tensor]:
    """1 to 3 rows of 2 to 12 random ids, padded on the right (labels -100 there), some with untrained positions."""
    samples = []
    for _ in range(_int(g, 1, 3)):
        ids = torch.randint(0, vocab, (_int(g, 2, 12),), generator=g)
        labels = ids.clone()
        if _int(g, 0, 2) == 0:  # positions that are not trained, as in SFT
            labels[torch.rand(len(ids), generator=g) < 0.4] = -100
        samples.append({"input_ids": ids, "labels": labels})
    return pad_collate(samples, 0)


def _rank_shares(g: torch.Generator, vocab: int, world: int) -> tuple[list[list[dict]], list[int]]:
    """Each rank's micro-batches (1 to 3) and trained tokens, the ranks' counts clearly unequal: where a rank dividing
    by its own count shows."""
    while True:
        shares = [[_micro_batch(g, vocab) for _ in range(_int(g, 1, 3))] for _ in range(world)]
        counts = [sum(trained_tokens(mb["labels"]) for mb in share) for share in shares]
        if min(counts) > 0 and max(counts) >= 1.3 * min(counts):
            return shares, counts


def _gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
            for n, p in model.named_parameters()}


def _library_rank_backward(model: Any, micro_batches: Sequence[dict], n_global: int, world: int) -> None:
    """train.accumulate_step's loss, called the chapter's way: each micro-batch's sum of token losses times world
    over n_global (the step's trained tokens on all ranks), backpropagated."""
    for mb in micro_batches:
        (T.lm_loss(T.forward_logits(model, mb), mb["labels"], reduction="sum") * (world / n_global)).backward()


def _flat_gradient(model: torch.nn.Module, backward: Callable[[], Any]) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    with torch.enable_grad():
        backward()
    return torch.cat([g.flatten() for g in _gradients(model).values()])


def _rank_loss_mistake(fn: Callable) -> str | None:
    g = torch.Generator().manual_seed(0)
    c = _config(g)
    model = _randomize(mm.MiniMindForCausalLM(c), g)
    while True:  # rank 0 with micro-batches of different token counts, the ranks unequal
        shares, counts = _rank_shares(g, c.vocab_size, 2)
        if len({trained_tokens(mb["labels"]) for mb in shares[0]}) > 1:
            break
    share, n = shares[0], sum(counts)
    yours = _flat_gradient(model, lambda: fn(model, [dict(mb) for mb in share], n, 2))
    own = _flat_gradient(model, lambda: T.accumulate_step(model, share))  # / the rank's own count
    naive = _flat_gradient(model, lambda: T.accumulate_step(model, share, normalization="naive"))
    global_only = _flat_gradient(model, lambda: T.accumulate_step(model, share, n_tokens_total=n))
    same = lambda a, b: torch.allclose(a, b, rtol=1e-3, atol=1e-7)  # noqa: E731
    if same(yours, 2 * own) or same(yours, own):
        return ("It divides by the rank's own token count: a token of the rank holding fewer tokens then weighs more; "
                "every rank must divide by the same count, the step's on all ranks.")
    if same(yours, 2 * naive) or same(yours, naive):
        return "It averages each micro-batch's loss on its own (notebook 04's naive mean): divide the sums by n_global."
    if same(yours, global_only):
        return ("It divides by n_global but does not multiply by world: DDP's average then divides by world once "
                "more, a gradient world times too small (a silently lower learning rate).")
    return None


@region("rank_backward", "for each micro-batch, the sum (not the mean) of its token losses, divided by n_global, the "
        "trained tokens of the whole step on all ranks, which every rank is given; then times world, because DDP "
        "averages the ranks' gradients; backward.", fallback=lambda fn: _library_rank_backward,
        probes=(_rank_loss_mistake,))
def _compare_rank_backward(fn: Callable, g: torch.Generator) -> None:
    c, world = _config(g), _pick(g, (2, 3, 4))
    model = _randomize(mm.MiniMindForCausalLM(c), g)
    shares, counts = _rank_shares(g, c.vocab_size, world)
    n_global = sum(counts)
    with torch.enable_grad():
        model.zero_grad(set_to_none=True)
        T.accumulate_step(model, [mb for share in shares for mb in share])  # one process, the whole step
        want, average = _gradients(model), None
        for share in shares:  # the ranks one after the other; DDP's all-reduce is their average
            model.zero_grad(set_to_none=True)
            fn(model, [dict(mb) for mb in share], n_global, world)
            got = _gradients(model)
            average = got if average is None else {k: average[k] + got[k] for k in got}
    for name, grad in want.items():
        first_difference(f"the gradient of {name} averaged over {world} ranks as DDP does (the ranks' trained tokens "
                         f"{counts}, n_global = {n_global}), against one process running the whole step",
                         average[name] / world, grad, 1e-4)


# 09 no_sync ---------------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def _one_rank_group() -> Any:
    """A gloo process group of this process alone, for a real DistributedDataParallel (the running one if any)."""
    if dist.is_initialized():
        yield
        return
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{Path(tmp) / 'pg'}", rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


@contextlib.contextmanager
def _as_one_rank_of(world: int) -> Any:
    """minimind_lib.train reads its world size as `world`: accumulate_step runs as each rank of `world` runs it."""
    saved, T.world_size = T.world_size, lambda: world
    try:
        yield
    finally:
        T.world_size = saved


def _recording_hook(state: dict, bucket):  # no annotation on bucket: DDP inspects the hook's signature
    """DDP's all-reduce (one rank: the sum is the bucket itself), noting the micro-batch whose backward sent it."""
    state["synced"].add(state["forwards"] - 1)
    return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda f: f.value()[0])


def _ddp_backward(fn: Callable, model: torch.nn.Module, micro_batches: Sequence[dict], n_global: int,
                  world: int) -> tuple[list[int], dict[str, torch.Tensor]]:
    """fn(ddp, micro_batches, n_global, world) on a fresh DDP around a copy of model: the micro-batches in whose
    backward DDP all-reduced the gradient, and the gradients after them."""
    model = copy.deepcopy(model)
    ddp, seen = DistributedDataParallel(model), {"forwards": 0, "synced": set()}
    model.register_forward_pre_hook(lambda *_: seen.update(forwards=seen["forwards"] + 1))
    ddp.register_comm_hook(seen, _recording_hook)
    with torch.enable_grad():
        fn(ddp, [dict(mb) for mb in micro_batches], n_global, world)
    return sorted(seen["synced"]), _gradients(model)


def _library_accumulate_no_sync(ddp: Any, micro_batches: Sequence[dict], n_global: int, world: int = 1) -> None:
    """train.accumulate_step's choice under DDP, called the chapter's way: every micro-batch but the last under
    ddp.no_sync(), so that only the last backward all-reduces."""
    for i, mb in enumerate(micro_batches):
        with contextlib.nullcontext() if i == len(micro_batches) - 1 else ddp.no_sync():
            _library_rank_backward(ddp, [mb], n_global, world)


def _no_sync_mistake(fn: Callable) -> str | None:
    g = torch.Generator().manual_seed(0)
    c = _config(g)
    model, micro = _randomize(mm.MiniMindForCausalLM(c), g), [_micro_batch(g, c.vocab_size) for _ in range(4)]
    with _one_rank_group():
        synced, _ = _ddp_backward(fn, model, micro, 10_000, 2)
    return {(0, 1, 2, 3): "Every micro-batch's backward all-reduces (no no_sync()): the same gradient, sent k times.",
            (0,): ("The all-reduce happens in the first micro-batch's backward: the later micro-batches' gradients stay "
                   "on their rank and are never summed across ranks."),
            (): "No backward all-reduces: the last micro-batch ran under no_sync() too, so the ranks never sum.",
            (0, 1, 2): "no_sync() is on the last micro-batch instead of the others."}.get(tuple(synced))


@region("accumulate_no_sync", "run every micro-batch's backward through the DDP model with rank_backward; all but "
        "the last inside ddp.no_sync() (which only adds into .grad), the last outside it, so that its backward "
        "all-reduces the sum once.", fallback=lambda fn: _library_accumulate_no_sync, probes=(_no_sync_mistake,))
def _compare_accumulate_no_sync(fn: Callable, g: torch.Generator) -> None:
    c, world, k = _config(g), _pick(g, (2, 3, 4)), _int(g, 2, 5)
    model, micro = _randomize(mm.MiniMindForCausalLM(c), g), [_micro_batch(g, c.vocab_size) for _ in range(k)]
    n_global = sum(trained_tokens(mb["labels"]) for mb in micro) + _int(g, 1, 200)  # plus the other ranks' tokens
    with _one_rank_group():
        synced, got = _ddp_backward(fn, model, micro, n_global, world)
        with _as_one_rank_of(world):  # the library's own loop, as rank 0 of `world` runs it
            want_synced, want = _ddp_backward(lambda ddp, mbs, n, w: T.accumulate_step(ddp, mbs, n_tokens_total=n),
                                              model, micro, n_global, world)
    first_item_difference(f"the micro-batches (of {k}, numbered from 0) in whose backward DDP all-reduced the "
                          "gradient", synced, want_synced)
    for name, grad in want.items():
        first_difference(f"the gradient of {name} after the {k} micro-batches (your accumulate_no_sync calls "
                         "rank_backward: it must have passed its check)", got[name], grad, 1e-4)


# 09 the memory of a rank --------------------------------------------------------------------------------------------
from minimind_lib.memory import estimate_memory  # noqa: E402


def per_rank_memory(config: Any, world: int, batch_size: int, seq_len: int, amp: str = "bf16") -> dict:
    """The reference for 09's per_rank_bytes (no later chapter uses it, so it lives beside the check, not in
    minimind_lib). Bytes a rank holds as a micro-batch's backward starts under gradient accumulation (estimate_memory's
    terms), as {setup: {component: bytes}} for one plain GPU, DDP (plus its gradient buckets, a second fp32 gradient)
    and FSDP2 over `world` ranks: weights, gradients and AdamW moments sharded, no autocast copy, two units (root or
    block) gathered in the compute dtype and one unit's fp32 gradient before its reduce-scatter. Activations never
    shrink."""
    if int(world) < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    est = estimate_memory(config, batch_size, seq_len, amp=amp, accum_steps=2)
    embedding = config.vocab_size * config.hidden_size
    unit = max(embedding, (est["n_params"] - embedding - config.hidden_size) // config.num_hidden_layers)
    one = {"fp32 weights": est["params_bytes"], "fp32 gradients": est["grads_bytes"],
           "AdamW moments": est["optimizer_bytes"], "autocast weight copy": est["amp_weight_copies_bytes"],
           "DDP gradient buckets": 0, "unsharded units": 0,
           "activations, logits, buffers": est["activations_bytes"] + est["head_bytes"] + est["buffers_bytes"]}
    sharded = {k: one[k] / world for k in ("fp32 weights", "fp32 gradients", "AdamW moments")}
    return {"one GPU": one, "DDP": {**one, "DDP gradient buckets": est["grads_bytes"]},
            "FSDP2": {**one, **sharded, "autocast weight copy": 0,
                      "unsharded units": unit * (2 * (4 if amp == "off" else 2) + 4)}}


def _memory_config(g: torch.Generator) -> mm.MiniMindConfig:
    """A dense MiniMind of random size, from a few million to billions of parameters (head_dim = hidden / heads)."""
    heads = _pick(g, (4, 8, 16, 32))
    return mm.MiniMindConfig(hidden_size=heads * _pick(g, (32, 64, 128)), num_hidden_layers=_int(g, 1, 32),
                             num_attention_heads=heads, num_key_value_heads=heads // _pick(g, (1, 2, 4)),
                             vocab_size=_pick(g, (6400, 32000, 151936)),
                             intermediate_size=_pick(g, (None, 64 * _int(g, 4, 180))))


def _memory_mistake(fn: Callable) -> str | None:
    c = mm.MiniMindConfig(hidden_size=2048, num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=4)
    yours, want = fn(c, 8, 2, 512, "bf16"), per_rank_memory(c, 8, 2, 512, "bf16")
    act = "activations, logits, buffers"
    if abs(yours["FSDP2"][act] * 8 - want["FSDP2"][act]) < 1:
        return "It divides the activations by world: every rank runs its own micro-batch, so they do not shrink."
    if not yours["DDP"]["DDP gradient buckets"]:
        return ("It leaves out DDP's gradient buckets: DDP all-reduces from a second fp32 copy of the gradients, 4 "
                "bytes per parameter (unless gradient_as_bucket_view=True).")
    if abs(yours["FSDP2"]["fp32 gradients"] - 8 * want["FSDP2"]["fp32 gradients"]) < 1:
        return "It keeps FSDP2's gradients whole: the reduce-scatter leaves each rank its shard."
    if abs(yours["one GPU"]["AdamW moments"] - want["one GPU"]["AdamW moments"] / 2) < 1:
        return "It counts one AdamW moment: AdamW keeps two in fp32 (exp_avg, exp_avg_sq), 8 bytes per parameter."
    if yours["FSDP2"]["autocast weight copy"]:
        return "It keeps an autocast copy of every weight under FSDP2: FSDP2 casts one unit at a time."
    return None


@region("per_rank_bytes", "take the weights, gradients, AdamW moments, the autocast copy and the activations (with "
        "the logits and buffers) from estimate_memory with accum_steps=2; DDP adds its buckets, 4 bytes per "
        "parameter; FSDP2 divides the first three by world, keeps no autocast copy, and adds two units gathered (2 "
        "bytes per parameter under autocast, 4 without) and one unit's fp32 gradient.",
        fallback=lambda fn: per_rank_memory, probes=(_memory_mistake,))
def _compare_per_rank_bytes(fn: Callable, g: torch.Generator) -> None:
    for _ in range(6):
        c, world, batch, seq, amp = (_memory_config(g), _int(g, 1, 16), _int(g, 1, 8), _pick(g, (128, 512, 2048)),
                                     _pick(g, ("bf16", "fp16", "off")))
        want, yours = per_rank_memory(c, world, batch, seq, amp), fn(c, world, batch, seq, amp)
        call = (f"per_rank_bytes(c, {world}, {batch}, {seq}, {amp!r}) for c of hidden {c.hidden_size}, "
                f"{c.num_hidden_layers} layers, vocabulary {c.vocab_size}")
        names = [(setup, part) for setup, parts in want.items() for part in parts]
        for setup, part in names:
            if not isinstance(yours, Mapping) or not isinstance(yours.get(setup), Mapping) or part not in yours[setup]:
                raise Different(f"{call} has no {setup!r}: {part!r}: it returns {{setup: {{component: bytes}}}} with "
                                f"the setups {list(want)} and the components {list(want[setup])}.")
        got = torch.tensor([float(yours[s][p]) for s, p in names], dtype=torch.float64)
        expected = torch.tensor([float(want[s][p]) for s, p in names], dtype=torch.float64)
        try:
            first_difference(call, got, expected, 1e-9)
        except Different as e:
            at = int(torch.nonzero(~torch.isclose(got, expected, rtol=1e-9, atol=1e-9))[0])
            raise Different(f"{e} The value at index {at} is {names[at][0]}: {names[at][1]}.") from None
