"""08_sft's regions, against minimind_lib.generate: generation with a KV cache, the top-p nucleus. (08 takes its loss
mask from the library: it is 02's rule, checked there.)"""
import functools
from unittest import mock

import torch

from minimind_lib import generate as G
from minimind_lib.model import MiniMindForCausalLM

from . import Case, draw, edited, randomized, region
from .ch03_model import config


def greedy(logits):
    return logits.argmax(dim=-1)


@torch.no_grad()
def generate(model, prompt_ids, max_new_tokens, pick=greedy, stop_ids=(), use_cache=True):
    """generate_ids's loop (minimind_lib.generate) with the chapter's signature."""
    seq = torch.tensor([list(prompt_ids)], device=next(model.parameters()).device)
    out, new = model(seq, use_cache=use_cache, logits_to_keep=1), []
    while True:
        token = pick(out.logits[:, -1])
        new.append(int(token))
        if new[-1] in stop_ids or len(new) == max_new_tokens:
            return new
        seq = torch.cat([seq, token[:, None]], dim=1)
        if use_cache:
            out = model(token[:, None], past_key_values=out.past_key_values, use_cache=True, logits_to_keep=1)
        else:
            out = model(seq, logits_to_keep=1)


@functools.cache
def _model() -> torch.nn.Module:
    return randomized(MiniMindForCausalLM(config(0, layers=2)), 0)


def _generated(fn, case):
    model, seen = _model(), []
    hook = model.register_forward_pre_hook(lambda m, args, kw: seen.append(
        (args[0] if args else kw["input_ids"]).shape[1]), with_kwargs=True)
    try:
        new = fn(model, list(case.args[0]), case.args[1], greedy, list(case.args[2]), case.args[3])
    finally:
        hook.remove()
    return {"the new tokens": [int(t) for t in new], "the positions each forward call processed": seen}


def _cases(prompt, n, stop_at=None, caches=(True, False)):
    free = G.generate_ids(_model(), torch.tensor(prompt), n, temperature=0)[0].tolist()
    stops = [] if stop_at is None else [free[stop_at]]
    return [Case(f"the greedy tokens after the prompt {prompt} of a random model (max_new_tokens={n}, stop_ids={stops},"
                 f" use_cache={c})", prompt, n, stops, c) for c in caches]


region("my_generate", "run the whole prompt once (use_cache=True gives past_key_values); then, until a stop id or "
       "max_new_tokens: pick a token from the last position's logits, append it, and feed only that token with the "
       "cache (without the cache: the whole sequence, one longer).", generate, run=_generated,
       fixed=lambda: _cases([1, 5, 9, 4], 6) + _cases([1, 5, 9, 4], 6, 2) + _cases([7], 1, caches=(True,))
       + _cases([3, 3], 5, 0, caches=(True,)),
       drawn=lambda g: _cases(torch.randint(0, 97, (draw(g, 1, 10),), generator=g).tolist(), draw(g, 2, 12)),
       mistakes=(("With use_cache=True it runs the whole sequence again at every step: the cache is never used.",
                  ("if use_cache:", "if False:")),
                 ("With the cache it feeds more than the new token: the cache holds the keys and values of every "
                  "earlier position, so each step feeds one token.", ("model(token[:, None], past", "model(seq, past")),
                 ("It makes one token more than max_new_tokens: stop once there are max_new_tokens new tokens.",
                  ("len(new) == max_new_tokens", "len(new) == max_new_tokens + 1")),
                 ("It leaves out the stop id: the new tokens end with the first stop id, included.",
                  ("return new", "return new[:-1] if new[-1] in stop_ids else new"))))


def library_top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """The logits minimind_lib samples from (generate.sample_next at temperature 1), -inf outside the nucleus."""
    drawn = {}

    def capture(probs, n, generator=None):
        drawn["probs"] = probs
        return torch.zeros(probs.shape[0], 1, dtype=torch.long)

    with mock.patch.object(G.torch, "multinomial", capture):
        G.sample_next(logits.float(), 1.0, top_p)
    return logits.float().masked_fill(drawn["probs"] == 0, float("-inf"))


def top_p(logits, p):
    """The chapter's nucleus (the base of the usual mistakes)."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(-1)
    sorted_logits = sorted_logits.masked_fill(probs.cumsum(-1) - probs >= p, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


def _logits(logits, p):
    logits = torch.tensor(logits)
    shown = logits.tolist() if logits.numel() < 20 else f"random logits {tuple(logits.shape)}"
    return Case(f"keep_top_p({shown}, {p})", logits, p)


region("keep_top_p", "sort the probabilities, most likely first; a token is dropped when the tokens before it already "
       "hold top_p; set the dropped ones' logits to -inf and put the logits back in vocabulary order.", library_top_p,
       run=lambda fn, c: fn(c.args[0].clone(), c.args[1]).float().softmax(-1), tol=1e-6, axes=("row", "token"),
       output="the probabilities to sample from (the softmax of what it returns)",
       fixed=lambda: [_logits([[4.0, 3.0, 2.0, 1.0, 0.0, -1.0]], 0.8),
                      _logits([[0.1, 2.0, -1.0], [3.0, -2.0, 0.2]], 0.5),
                      _logits([[1.0, 5.0, 2.0, 0.0]], 0.05)],
       drawn=lambda g: [_logits((torch.randn(draw(g, 1, 4), draw(g, 5, 300), generator=g) * 2).tolist(),
                                round(float(torch.rand(1, generator=g)) * 0.9 + 0.05, 3)) for _ in range(3)],
       mistakes=(("It keeps the wrong side, the unlikely tail: top-p keeps the most likely tokens, whose probabilities "
                  "together reach p.", edited(top_p, (">= p", "< p"))),
                 ("It keeps the wrong side: sorted least likely first it keeps the tail; sort most likely first.",
                  edited(top_p, ("descending=True", "descending=False"))),
                 ("It drops the token that carries the sum past p: a token goes only when the tokens before it already "
                  "hold p (the cumulative sum minus its own probability), so the most likely always stays.",
                  edited(top_p, ("probs.cumsum(-1) - probs >= p", "probs.cumsum(-1) > p"))),
                 ("Its softmax runs over the batch (dim 0): each row's probabilities are over the vocabulary.",
                  edited(top_p, ("softmax(-1)", "softmax(0)"))),
                 ("It returns the logits in sorted order: scatter them back to the vocabulary's order.",
                  edited(top_p, ('torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)',
                                 "sorted_logits")))))
