"""04_gradient_accumulation's regions, against minimind_lib.train and torch's clip_grad_norm_: the schedule, clipping,
the update, exact token-weighted accumulation."""
import copy
import functools
import math
from collections.abc import Mapping

import torch

from minimind_lib import train as T
from minimind_lib.data import pad_collate, trained_tokens
from minimind_lib.device import get_device
from minimind_lib.model import MiniMindForCausalLM

from . import Case, draw, edited, pick, randomized, region
from .ch03_model import config


def _schedule(lr, min_lr, warmup, most, steps):
    kw = {"lr": lr, "min_lr": min_lr, "warmup_steps": warmup, "max_steps": most}
    return Case(f"lr_at(step, {', '.join(f'{k}={v:g}' for k, v in kw.items())}) at steps 0..{steps - 1}", kw, steps)


region("lr_at", "warmup: from lr / warmup_steps at step 0 up to lr at step warmup_steps - 1, in equal steps; then the "
       "cosine from lr down to min_lr, its progress 0 when warmup ends and 1 at max_steps; min_lr from max_steps on.",
       T.lr_at, run=lambda fn, c: torch.tensor([float(fn(s, **c.args[0])) for s in range(c.args[1])],
                                                dtype=torch.float64), output="the rate at each step", axes=("step",),
       tol=1e-8, fixed=lambda: [_schedule(1.0, 0.1, 4, 20, 26), _schedule(1e-3, 0.0, 0, 10, 12),
                                _schedule(0.5, 0.05, 1, 8, 10), _schedule(0.1, 0.01, 6, 6, 8)],
       drawn=lambda g: [_schedule(lr, lr * pick(g, (0.0, 0.1)), draw(g, 0, m), m, m + 3)
                        for lr, m in ((pick(g, (1e-3, 3e-4)), draw(g, 2, 40)) for _ in range(2))],
       mistakes=(("At step 0 it gives 0: warmup starts at lr / warmup_steps, so the first step already trains.",
                  ("(step + 1)", "step")),
                 ("The cosine's progress counts from step 0, not from the end of warmup: the decay starts below lr.",
                  ("(step - warmup_steps) / max(1, max_steps - warmup_steps)", "step / max_steps")),
                 ("It decays towards 0, not min_lr: the cosine runs between lr and min_lr.",
                  [("return min_lr + 0.5", "return 0.5"), ("(lr - min_lr)", "lr")]),
                 ("From max_steps on it does not stay at min_lr (a cosine past its end comes back up).",
                  ("if step >= max_steps:", "if False:"))))


def _clipped(fn, case):
    params = [torch.nn.Parameter(torch.zeros(len(g or [0]))) for g in case.args[0]]
    for p, g in zip(params, case.args[0]):
        p.grad = None if g is None else torch.tensor(g)
    norm = fn(params, case.args[1])
    return {"the gradients after clipping": [p.grad for p in params], "the norm returned": float(norm)}


def clip(params, max_norm):
    """Clipping by the global norm as the chapter writes it (the base of the usual mistakes)."""
    grads = [p.grad for p in params if p.grad is not None]
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    for g in grads:
        g.mul_(torch.clamp(max_norm / (norm + 1e-6), max=1.0))
    return norm


region("clip_by_global_norm", "the global norm is the L2 norm of all the gradients' entries together (skip a "
       "parameter without a gradient); above max_norm, multiply every gradient in place by max_norm / (norm + 1e-6), "
       "never by more than 1; return the norm measured before clipping.", torch.nn.utils.clip_grad_norm_, run=_clipped,
       fixed=lambda: [Case(f"the gradients {g} clipped to max_norm={m}", g, m) for g, m in (
           ([[3.0, 4.0], [0.3, 0.4]], 1.0), ([[0.3, 0.4]], 1.0), ([[3.0, 4.0], None, [12.0]], 2.0))],
       drawn=lambda g: [Case(f"the gradients {gs} clipped to max_norm=1.5", gs, 1.5) for gs in [
           [(torch.randn(draw(g, 1, 4), generator=g) * 3).tolist() for _ in range(3)]]],
       mistakes=(("It clips each gradient by its own norm: one global norm gives one scale for all the gradients, so "
                  "the update keeps its direction.", edited(clip, ("(norm + 1e-6)", "(torch.linalg.vector_norm(g) + "
                                                                                    "1e-6)"))),
                 ("With a norm below max_norm it scales the gradients up: the scale is never above 1.",
                  edited(clip, ("torch.clamp(max_norm / (norm + 1e-6), max=1.0)", "max_norm / (norm + 1e-6)"))),
                 ("It returns the norm after clipping: return the norm before it, the number the loop logs.",
                  edited(clip, ("return norm", "return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm("
                                                "g) for g in grads]))")))))


def library_step(optimizer, params, grad_clip):
    """minimind_lib's optimizer_step, returning Python numbers as the chapter's does."""
    norm, finite = T.optimizer_step(optimizer, params, grad_clip)
    return float(norm), bool(finite)


def step(optimizer, params, grad_clip):
    """The chapter's optimizer_step (the base of the usual mistakes)."""
    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, grad_clip or float("inf")))
    if math.isfinite(grad_norm):
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm, math.isfinite(grad_norm)


def _stepped(fn, case):
    kind, start, steps = case.args
    params = [torch.nn.Parameter(t.clone()) for t in start]
    optimizer = torch.optim.AdamW(params, lr=0.01) if kind == "AdamW" else torch.optim.SGD(params, 0.01, momentum=0.9)
    out = {"the weights after each step": [], "the largest entry left in .grad after each step (0: cleared)": [],
           "(the norm before clipping, whether it was finite) at each step": []}
    for grads, grad_clip in steps:
        for p, grad in zip(params, grads):
            p.grad = grad.clone()
        got = fn(optimizer, params, grad_clip)
        for key, value in zip(out, ([p.detach().clone() for p in params], [
                0.0 if p.grad is None else float(p.grad.abs().max()) for p in params], [float(got[0]), bool(got[1])])):
            out[key].append(value)
    return out


def _steps(kind, seed, clips, bad):
    g = torch.Generator().manual_seed(seed)
    start = [torch.randn(3, generator=g), torch.randn(2, 2, generator=g)]
    steps = [([torch.randn(s.shape, generator=g) * 3 for s in start], c) for c in clips]
    steps[bad][0][1].view(-1)[0] = math.inf
    return Case(f"4 steps of {kind} with grad_clip {clips}, step {bad}'s gradient holding an inf", kind, start, steps)


region("optimizer_step", "clip the global norm to grad_clip with PyTorch's clip_grad_norm_ (no limit for None or 0); "
       "step only when that norm is finite; then clear the gradients; return (the norm before clipping as a float, "
       "whether it was finite).", library_step, run=_stepped,
       fixed=lambda: [_steps("AdamW", 0, [1.0, None, 2.0, 0.0], 2), _steps("SGD", 1, [0.5, 100.0, None, 1.0], 0)],
       drawn=lambda g: [_steps(pick(g, ("AdamW", "SGD")), draw(g, 2, 999), [1.0, None, 0.5, 3.0], draw(g, 0, 3))],
       mistakes=(("It steps although the norm is inf/NaN: that turns the weights (and AdamW's states) into inf/NaN; "
                  "skip the step, and still clear the gradients.",
                  edited(step, ("if math.isfinite(grad_norm):", "if 1:"))),
                 ("It leaves the gradients in .grad: the next backward would add to them. Clear them (zero_grad) after "
                  "every step, a skipped one too.", edited(step, ("optimizer.zero_grad(set_to_none=True)", "pass"))),
                 ("It returns the norm after clipping: return the norm before it, the number the loop logs.",
                  edited(step, ("grad_norm = float(", "grad_norm = 0 * float("),
                         ("    if math", "    grad_norm = float(torch.nn.utils.get_total_norm([p.grad for p in "
                                       "params]))\n    if math")))))


def accumulate(model, micro_batches, normalization="token"):
    """The chapter's accumulate_step (the base of the usual mistakes)."""
    n_tokens, loss_sum = sum(trained_tokens(mb["labels"]) for mb in micro_batches), 0.0
    for mb in micro_batches:
        token_losses = T.lm_loss(T.forward_logits(model, mb), mb["labels"], reduction="sum")
        if normalization == "token":
            loss = token_losses / n_tokens
        else:
            loss = token_losses / trained_tokens(mb["labels"]) / len(micro_batches)
        loss.backward()
        loss_sum += float(token_losses.detach())
    return {"loss_sum": loss_sum, "n_tokens": n_tokens, "loss": loss_sum / n_tokens}


@functools.cache
def _model_and_batches(seed):
    """A small random model on the notebook's device; micro-batches of very different token counts (one of 1-3)."""
    g, c = torch.Generator().manual_seed(seed), config(seed, layers=1 + seed % 2)
    lengths = [[draw(g, 2, 4)]] + [[draw(g, 8, 24) for _ in range(draw(g, 1, 3))] for _ in range(draw(g, 1, 3))]
    micro = [pad_collate([{"input_ids": ids, "labels": ids.clone()} for ids in
                          (torch.randint(0, c.vocab_size, (n,), generator=g) for n in rows)]) for rows in lengths]
    return randomized(MiniMindForCausalLM(c), seed).to(get_device()), micro


def _accumulated(fn, case):
    model, micro = _model_and_batches(case.args[0])
    model = copy.deepcopy(model)
    with torch.enable_grad():
        stats = fn(model, [dict(mb) for mb in micro], normalization=case.args[1])
    keys = ("loss_sum", "n_tokens", "loss")
    return {"the gradient of each weight, times 1000": {n: p.grad * 1000 for n, p in model.named_parameters()},
            "what it returns": {k: stats[k] for k in keys} if isinstance(stats, Mapping) and set(keys) <= set(stats)
            else stats}


def _micro(seed, normalization):
    counts = [trained_tokens(mb["labels"]) for mb in _model_and_batches(seed)[1]]
    return Case(f"normalization={normalization!r}, micro-batches of {counts} trained tokens", seed, normalization)


TOKEN = "loss = token_losses / n_tokens"
NAIVE = 'loss = token_losses / trained_tokens(mb["labels"]) / len(micro_batches)'
region("accumulate_step", "count the trained tokens N of all the micro-batches from their labels first; then for each "
       "micro-batch: forward, the sum of its token losses, divided by N ('token') or by its own trained tokens and by "
       "k ('naive'), backward. Add up the summed token losses for the result.",
       lambda m, mbs, normalization="token": T.accumulate_step(m, mbs, normalization=normalization),
       run=_accumulated, tol=1e-3, fixed=lambda: [_micro(0, "token"), _micro(0, "naive")],
       drawn=lambda g: [_micro(draw(g, 1, 999), pick(g, ("token", "naive")))],
       mistakes=(("Under 'token' it averages per micro-batch (each one's mean token loss / k, the naive rule): a token "
                  "of a short micro-batch then weighs more. Exact: divide every summed token loss by N, the step's "
                  "trained tokens, counted before the first backward.", edited(accumulate, (TOKEN, NAIVE))),
                 ("It divides the summed token losses by k: N / k times too large; divide by N, the step's trained "
                  "tokens.", edited(accumulate, (TOKEN, "loss = token_losses / len(micro_batches)"))),
                 ("It does not divide the summed token losses: divide by N, the step's trained tokens.",
                  edited(accumulate, (TOKEN, "loss = token_losses"))),
                 ("Under 'naive' it divides by the step's trained tokens: the naive rule divides each micro-batch's "
                  "sum by its own trained tokens and by k.", edited(accumulate, (NAIVE, TOKEN)))))
