"""Helpers of notebook 10_lora_dpo: the checks of the mechanisms its cells build, the measurement of sampled replies
(the rule's share, the KL to the reference) and its figures. Course material beside the notebooks, not part of
minimind_lib (whose versions of LoRA and DPO the checks compare with: minimind_lib/lora.py, minimind_lib/dpo.py).

The checks print what notebooks/lab_checks.py prints for the other chapters' regions: "<region>: not written yet"
with a hint, and the notebook goes on with the library's version; "<region>: passed ..." and the notebook uses yours;
a difference raises NotRightYet naming it. Every call draws fresh random inputs.
"""
from __future__ import annotations

import math
import os
from typing import Any, Callable

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from torch import nn

from exercise_checks import NotRightYet
from minimind_lib import dpo as library_dpo
from minimind_lib import lora as library_lora
from minimind_lib.generate import chat_prompt_ids, generate_ids
from minimind_lib.model import IGNORE_INDEX, MiniMindConfig, MiniMindForCausalLM


# ----------------------------------------------------------------------------------- the checks of the regions
def check(name: str, hint: str, compare: Callable[[Any, torch.Generator], None], yours: Any, library: Any) -> Any:
    """Run compare(yours, generator): print "not written yet" (a stub: NotImplementedError) and return `library`, or
    print that it passed and return `yours`; an AssertionError or another error raises NotRightYet."""
    seed = int.from_bytes(os.urandom(4), "little")
    try:
        compare(yours, torch.Generator().manual_seed(seed))
    except NotImplementedError:
        print(f"{name}: not written yet. Hint: {hint} Until it is, the notebook goes on with minimind_lib's version.")
        return library
    except AssertionError as e:
        raise NotRightYet(f"{name}: not right yet: {e} (fresh random inputs, seed {seed}.) Hint: {hint}") from None
    except Exception as e:  # the learner's code raised: a shape, a name, a missing attribute
        raise NotRightYet(f"{name}: not right yet: checking it raised {type(e).__name__}: {e} Hint: {hint}") from None
    print(f"{name}: passed (equal to minimind_lib's on fresh random inputs); the notebook uses yours from here on.")
    return yours


def _close(what: str, yours: torch.Tensor, want: torch.Tensor, tol: float = 1e-5) -> None:
    assert torch.is_tensor(yours), f"{what} is a {type(yours).__name__}, not a tensor."
    assert yours.shape == want.shape, f"{what} has shape {tuple(yours.shape)}; the library's {tuple(want.shape)}."
    bad = ~torch.isclose(yours.double(), want.double(), rtol=tol, atol=tol)
    if bad.any():
        at = tuple(int(i) for i in bad.nonzero()[0])
        raise AssertionError(f"{what} differs first at index {at}: yours {float(yours[at]):.6g}, the library's "
                             f"{float(want[at]):.6g} ({int(bad.sum())} of {bad.numel()} values differ).")


def _linear(g: torch.Generator) -> tuple[nn.Linear, int, float]:
    """A random square Linear (no bias), a rank and an alpha drawn afresh."""
    dim = int(torch.randint(8, 40, (1,), generator=g))
    base = nn.Linear(dim, dim, bias=False)
    with torch.no_grad():
        base.weight.copy_(torch.randn(dim, dim, generator=g) * 0.3)
    return base, int(torch.randint(1, 6, (1,), generator=g)), float(torch.randint(1, 33, (1,), generator=g))


def _lora_init(cls: type, g: torch.Generator) -> None:
    base, rank, alpha = _linear(g)
    torch.manual_seed(int(torch.randint(1 << 30, (1,), generator=g)))
    layer = cls(base, rank, alpha)
    out, inp = base.weight.shape
    assert tuple(layer.A.shape) == (rank, inp) and tuple(layer.B.shape) == (out, rank), \
        f"A should be [rank, in] = {[rank, inp]} and B [out, rank] = {[out, rank]}."
    assert torch.equal(layer.B, torch.zeros_like(layer.B)), "B must start at zero: then B A = 0, the model unchanged."
    wide = cls(nn.Linear(256, 256, bias=False), 16, 16.0).A.detach()  # 4096 draws: their std is 0.02 within 5%
    assert 0.019 < float(wide.std()) < 0.021 and abs(float(wide.mean())) < 0.002, \
        f"A's values have mean {float(wide.mean()):.4f} and std {float(wide.std()):.4f}: draw them from N(0, 0.02)."
    assert math.isclose(layer.scale, alpha / rank), f"scale is {layer.scale!r}; alpha / rank is {alpha / rank}."
    assert torch.equal(layer.weight, base.weight) and not layer.weight.requires_grad, "keep the base weight, frozen."
    assert layer.A.requires_grad and layer.B.requires_grad, "A and B are what trains: nn.Parameter, requires_grad."


def _lora_forward(cls: type, g: torch.Generator) -> None:
    base, rank, alpha = _linear(g)
    want = library_lora.LoRALinear(base, rank, alpha)
    with torch.no_grad():
        want.lora.B.weight.copy_(torch.randn(want.lora.B.weight.shape, generator=g))
    layer = cls.__new__(cls)  # built without your __init__: this checks forward alone
    nn.Module.__init__(layer)
    layer.weight, layer.scale = base.weight, alpha / rank
    layer.A, layer.B = nn.Parameter(want.lora.A.weight.clone()), nn.Parameter(want.lora.B.weight.clone())
    x = torch.randn(3, 5, base.in_features, generator=g)
    _close("forward(x)", layer(x), want(x))


def check_lora_linear(cls: type) -> type:
    """MyLoRALinear's __init__ and forward, each checked (a class with the library's rule if either is a stub)."""
    hint_init = ("keep base.weight, frozen; A and B are nn.Parameters of shapes [rank, in] and [out, rank]; which "
                 "of them starts at zero decides whether the model starts unchanged (the text above the cell).")
    hint_forward = "the base layer's output plus the scaled update; in B A x, A acts first."
    init_ok = check("MyLoRALinear.__init__", hint_init, _lora_init, cls, None) is cls
    forward_ok = check("MyLoRALinear.forward", hint_forward, _lora_forward, cls, None) is cls
    return cls if init_ok and forward_ok else LibraryRuleLoRALinear


class LibraryRuleLoRALinear(nn.Module):
    """The chapter's class (weight, A, B, scale) computing what minimind_lib.lora.LoRALinear computes."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float) -> None:
        super().__init__()
        library = library_lora.LoRALinear(base, rank, alpha)
        self.weight, self.scale = library.weight, library.lora.scale
        self.A, self.B = nn.Parameter(library.lora.A.weight.detach()), nn.Parameter(library.lora.B.weight.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight) + self.scale * F.linear(F.linear(x, self.A), self.B)


def _merge(fn: Callable, g: torch.Generator) -> None:
    base, rank, alpha = _linear(g)
    layer = LibraryRuleLoRALinear(base, rank, alpha)
    with torch.no_grad():
        layer.B.copy_(torch.randn(layer.B.shape, generator=g))
    merged = fn(layer)
    assert isinstance(merged, nn.Linear) and merged.bias is None, "return an nn.Linear without bias."
    x = torch.randn(4, base.in_features, generator=g)
    _close("the merged layer's output", merged(x), layer(x))


def check_merge(fn: Callable) -> Callable:
    """merge(layer): a plain nn.Linear computing what the LoRA layer computes."""
    def library(layer: nn.Module) -> nn.Linear:
        merged = nn.Linear(layer.weight.shape[1], layer.weight.shape[0], bias=False)
        with torch.no_grad():
            merged.weight.copy_(layer.weight + layer.scale * layer.B @ layer.A)
        return merged
    return check("merge", "one weight of W's shape, from W, B, A and the scale; put it in a new nn.Linear(in, out, "
                 "bias=False) under torch.no_grad().", _merge, fn, library)


def _logits_and_labels(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    rows, length, vocab = (int(torch.randint(2, 6, (1,), generator=g)), int(torch.randint(5, 12, (1,), generator=g)),
                           int(torch.randint(7, 40, (1,), generator=g)))
    logits = torch.randn(rows, length, vocab, generator=g) * 3
    labels = torch.randint(0, vocab, (rows, length), generator=g)
    prompt = torch.randint(1, length - 2, (rows, 1), generator=g)
    labels[torch.arange(length)[None] < prompt] = IGNORE_INDEX  # a prompt of random length
    labels[0, -2:] = IGNORE_INDEX  # padding
    return logits, labels


def check_sequence_logps(fn: Callable) -> Callable:
    def compare(yours: Callable, g: torch.Generator) -> None:
        logits, labels = _logits_and_labels(g)
        _close("the log-probabilities", yours(logits, labels), library_dpo.sequence_logps(logits, labels), 1e-4)
    return check("sequence_logps", "log-probabilities over the vocabulary; logits[:, t] scores labels[:, t + 1]; "
                 "only labels that are not -100 count (gather needs a valid index there too).",
                 compare, fn, library_dpo.sequence_logps)


def check_dpo_loss(fn: Callable) -> Callable:
    def compare(yours: Callable, g: torch.Generator) -> None:
        pi_c, pi_r, ref_c, ref_r = (torch.randn(6, generator=g) * 20 - 40 for _ in range(4))
        beta = float(torch.rand(1, generator=g)) + 0.01
        _close("the losses", yours(pi_c, pi_r, ref_c, ref_r, beta),
               library_dpo.dpo_loss(pi_c, pi_r, ref_c, ref_r, beta))
    return check("dpo_loss", "the formula above the cell, one value per pair; F.logsigmoid is exact where "
                 "log(sigmoid(.)) underflows.", compare, fn, library_dpo.dpo_loss)


def _tiny(g: torch.Generator) -> MiniMindForCausalLM:
    torch.manual_seed(int(torch.randint(1 << 30, (1,), generator=g)))
    return MiniMindForCausalLM(MiniMindConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                              num_key_value_heads=1, intermediate_size=48, vocab_size=97,
                                              max_position_embeddings=64)).eval()


def check_dpo_objective(cls: type) -> type:
    def compare(yours: type, g: torch.Generator) -> None:
        policy, reference = _tiny(g), _tiny(g)
        _, labels = _logits_and_labels(g)
        rows = 2 * max(1, len(labels) // 2)
        batch = {"input_ids": torch.randint(0, 97, (rows, labels.shape[1]), generator=g), "labels": labels[:rows]}
        batch["labels"] = torch.where(batch["labels"] == IGNORE_INDEX, IGNORE_INDEX, batch["input_ids"])
        beta = float(torch.rand(1, generator=g)) + 0.05
        for ref in (reference, None):
            want = library_dpo.DPO(ref, beta).loss_sum(policy, batch, None)[0]
            got = yours(ref, beta).loss_sum(policy, batch, None)
            got = got[0] if isinstance(got, tuple) else got
            _close("loss_sum" + (" without a reference" if ref is None else ""), got, want)
            assert yours(ref, beta).count(batch) == rows // 2, "count: a batch's pairs (half its rows)."
    return check("MyDPO.loss_sum", "forward_logits gives the rows' logits; the reference's log-probabilities need no "
                 "gradient (zeros without a reference); pair_collate puts the chosen rows first; return the sum of "
                 "the pairs' losses and None.", compare, cls, library_dpo.DPO)


# ----------------------------------------------------------------------------------- sampled replies and their KL
@torch.no_grad()
def sample_replies(model: nn.Module, tok: Any, conversations: list[list[dict]], max_new_tokens: int,
                   seed: int = 0) -> list[dict]:
    """For each conversation (its turns before the reply), a reply sampled at temperature 1 (seed + its index):
    prompt ids, reply ids (<|im_end|> included when it ended) and text."""
    out = []
    for i, turns in enumerate(conversations):
        prompt = chat_prompt_ids(tok, turns)
        reply = generate_ids(model, torch.tensor(prompt), max_new_tokens, temperature=1.0, seed=seed + i,
                             stop_token_ids=[tok.eos_token_id])[0].tolist()
        out.append({"prompt_ids": prompt, "reply_ids": reply, "text": tok.decode(reply, skip_special_tokens=True)})
    return out


@torch.no_grad()
def reply_kl(policy: nn.Module, reference: nn.Module, sample: dict) -> float:
    """KL(policy || reference) of one sampled reply: the exact KL of the next-token distributions summed over the
    positions that produced the reply's tokens (nats)."""
    ids = torch.tensor([sample["prompt_ids"] + sample["reply_ids"]])
    start = len(sample["prompt_ids"]) - 1  # the logits at start predict the reply's first token
    p = policy(ids).logits[0, start:-1].float().log_softmax(-1)
    q = reference(ids).logits[0, start:-1].float().log_softmax(-1)
    return float((p.exp() * (p - q)).sum())


def mean_interval(values: list[float]) -> dict:
    """The mean of values and its 95% normal interval (mean +- 1.96 sd / sqrt(n))."""
    t = torch.tensor(values, dtype=torch.float64)
    half = 1.959964 * float(t.std()) / math.sqrt(len(t)) if len(t) > 1 else float("nan")
    return {"mean": float(t.mean()), "interval95": [float(t.mean()) - half, float(t.mean()) + half], "n": len(t)}


# ----------------------------------------------------------------------------------- figures
def plot_beta(title: str, betas: tuple[float, ...] = (0.05, 0.1, 0.5)) -> Any:
    """The DPO loss of one pair, and the weight its gradient carries, against the log-ratio margin, per beta
    (computed from the formula, not from a run)."""
    margin = torch.linspace(-20, 40, 400)
    fig, ax = plt.subplots(1, 2, figsize=(11, 3.6))
    for beta in betas:
        ax[0].plot(margin, -F.logsigmoid(beta * margin), label=f"beta {beta:g}")
        ax[1].plot(margin, beta * torch.sigmoid(-beta * margin), label=f"beta {beta:g}")
    ax[0].set(xlabel="(pi_c - pi_r) - (ref_c - ref_r)  (nats)", ylabel="loss", title="the DPO loss of one pair")
    ax[1].set(xlabel="(pi_c - pi_r) - (ref_c - ref_r)  (nats)", ylabel="beta x sigmoid(-beta x margin)",
              title="how hard the gradient still pushes")
    for a in ax:
        a.axvline(0, color="k", lw=0.5)
        a.legend()
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def plot_runs(table: Any, title: str) -> Any:
    """The measurements of the table (one row per model) side by side, with the rule share's 95% interval."""
    fig, ax = plt.subplots(1, 3, figsize=(12, 3.6))
    names = list(table.index)
    low = [r - lo for r, lo in zip(table["one line"], table["one line low"])]
    high = [hi - r for r, hi in zip(table["one line"], table["one line high"])]
    ax[0].bar(names, table["one line"], yerr=[low, high], capsize=4, color="tab:orange")
    ax[0].set(ylabel="share of sampled replies", title="replies on one line (95% interval)", ylim=(0, 1))
    ax[1].bar(names, table["KL to the SFT model"], color="tab:blue")
    ax[1].set(ylabel="nats per reply", title="KL to the SFT model (sampled replies)")
    ax[2].bar(names, table["bits per byte"], color="tab:green")
    ax[2].set(ylabel="bits per byte", title="ordinary held-out text", ylim=(min(table["bits per byte"]) * 0.95,
                                                                              max(table["bits per byte"]) * 1.02))
    for a in ax:
        a.tick_params(axis="x", labelrotation=15)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig
