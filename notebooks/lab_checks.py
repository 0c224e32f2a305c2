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

