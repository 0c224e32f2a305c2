"""04_gradient_accumulation's regions, against minimind_lib.train and torch's clip_grad_norm_."""
import copy
import functools
import math
import torch
from torch.nn.utils import clip_grad_norm_
from minimind_lib import train as T
from minimind_lib.data import pad_collate, trained_tokens
from minimind_lib.device import get_device
from minimind_lib.model import MiniMindForCausalLM
from . import Case, draw, pick, randomized, region
from .ch03_model import config

def schedule(lr, min_lr, warmup, most, steps):
    kw = {"lr": lr, "min_lr": min_lr, "warmup_steps": warmup, "max_steps": most}
    return Case(f"lr_at(step, {', '.join(f'{k}={v:g}' for k, v in kw.items())}) at steps 0.."
                f"{steps - 1}", kw, steps)
region("lr_at", "warmup from lr / warmup_steps; then the cosine to min_lr at max_steps; min_lr.",
       T.lr_at, output="the rate at each step", axes=("step",), tol=1e-8,
       run=lambda fn, c: torch.tensor([fn(s, **c.args[0]) for s in range(c.args[1])], dtype=float),
       fixed=lambda: [schedule(1.0, 0.1, 4, 20, 26), schedule(1e-3, 0.0, 0, 10, 12),
                      schedule(0.5, 0.05, 1, 8, 10), schedule(0.1, 0.01, 6, 6, 8)],
       drawn=lambda g: [schedule(1e-3, pick(g, (0.0, 1e-4)), draw(g, 0, 20), 20, 23)],
       mistakes=(("At step 0 it gives 0: warmup starts at lr / warmup_steps.", "step + 1", "step"),
                 ("The cosine's progress counts from step 0: count from the end of warmup.",
                  "(step - warmup_steps) / max(1, max_steps - warmup_steps)", "step / max_steps")))
def clipped(fn, case):
    params = [torch.nn.Parameter(torch.zeros(len(g or [0]))) for g in case.args[0]]
    for p, g in zip(params, case.args[0]):
        p.grad = None if g is None else torch.tensor(g)
    norm = float(fn(params, case.args[1]))
    return {"the gradients after clipping": [p.grad for p in params], "the norm returned": norm}
def per_tensor(params, max_norm):  # each gradient clipped by its own norm
    norm = clip_grad_norm_(params, math.inf)
    for p in params:
        clip_grad_norm_([p], max_norm)
    return norm
region("clip_by_global_norm", "the L2 norm of all gradients' entries; scale them all to max_norm.",
       clip_grad_norm_, run=clipped, fixed=[([[3.0, 4.0], [0.3, 0.4]], 1.0), ([[0.3, 0.4]], 1.0),
                                            ([[3.0, 4.0], None, [12.0]], 2.0)],
       drawn=lambda g: [([torch.randn(k, generator=g).tolist() for k in (2, 3)], 1.5)],
       mistakes=(("It clips each gradient by its own norm: one global norm scales them all alike.",
                  per_tensor),))
def stepped(fn, case):  # each step: weights, norm, finite, gradients left
    kind, start, steps = case.args
    params, out = [torch.nn.Parameter(t.clone()) for t in start], []
    opt = torch.optim.AdamW(params) if kind == "AdamW" else torch.optim.SGD(params, 0.01, 0.9)
    for grads, grad_clip in steps:
        for p, grad in zip(params, grads):
            p.grad = grad.clone()
        norm, finite = fn(opt, params, grad_clip)
        out.append([[p.detach().clone() for p in params], float(norm), bool(finite),
                    [0.0 if p.grad is None else float(p.grad.abs().max()) for p in params]])
    return {"(the weights, the norm, whether finite, the largest gradient left) each step": out}
def steps(kind, seed, clips, bad):
    g = torch.Generator().manual_seed(seed)
    start = [torch.randn(3, generator=g), torch.randn(2, 2, generator=g)]
    grads = [[torch.randn(s.shape, generator=g) * 3 for s in start] for _ in clips]
    grads[bad][1][0, 0] = math.inf
    return Case(f"4 steps of {kind} with grad_clip {clips}, step {bad}'s gradient holding an inf",
                kind, start, list(zip(grads, clips)))
region("optimizer_step", "clip_grad_norm_ to grad_clip or inf; step when finite; clear; the norm.",
       T.optimizer_step, run=stepped, fixed=lambda: [steps("AdamW", 0, [1.0, None, 2.0, 0.0], 2),
                                                    steps("SGD", 1, [0.5, 100.0, None, 1.0], 0)],
       drawn=lambda g: [steps(pick(g, ("AdamW", "SGD")), draw(g, 2, 99), [1.0, None, 0.5, 3.0], 3)],
       mistakes=(("It steps although the norm is inf/NaN: skip it.", "elif finite:", "elif True:"),
                 ("It leaves the gradients in .grad: clear them after every step, skipped or not.",
                  "optimizer.zero_grad(set_to_none=True)", "pass")))
@functools.cache
def model_and_batches(seed):  # a random model; micro-batches, one of 2-4 tokens
    g, c = torch.Generator().manual_seed(seed), config(seed, layers=1 + seed % 2)
    lengths = [[draw(g, 2, 4)]] + [[draw(g, 8, 24) for _ in range(draw(g, 1, 3))]
                                   for _ in range(draw(g, 1, 3))]
    ids = [[torch.randint(c.vocab_size, (n,), generator=g) for n in rows] for rows in lengths]
    untrained = lambda i: torch.rand(len(i), generator=g) < 0.2  # noqa: E731
    return randomized(MiniMindForCausalLM(c), seed), [pad_collate([
        {"input_ids": i, "labels": i.masked_fill(untrained(i), -100)} for i in mb]) for mb in ids]
def gradients(model):
    return {n: (torch.zeros_like(p) if p.grad is None else p.grad.clone()) * 1000
            for n, p in model.named_parameters()}
def accumulated(fn, case):
    model, micro = copy.deepcopy(model_and_batches(case.args[0]))
    with torch.enable_grad():
        got = fn(model.to(get_device()), micro, normalization=case.args[1])
    keys = ("loss_sum", "n_tokens", "loss")
    if isinstance(got, dict) and set(keys) <= set(got):
        got = {k: got[k] for k in keys}
    return {"the gradient of each weight, times 1000": gradients(model), "what it returns": got}
def micro(seed, normalization):
    counts = [trained_tokens(mb["labels"]) for mb in model_and_batches(seed)[1]]
    return Case(f"normalization={normalization!r}, micro-batches of {counts} trained tokens", seed,
                normalization)
region("accumulate_step", "count N, the step's trained tokens; backward each token loss sum / N.",
       T.accumulate_step, run=accumulated, tol=1e-3,
       fixed=lambda: [micro(0, "token"), micro(0, "naive")],
       drawn=lambda g: [micro(draw(g, 1, 999), pick(g, ("token", "naive")))],
       mistakes=(("Under 'token' it averages per micro-batch (the naive rule): divide by N.",
                  "* (world / n_tokens_total)", "/ max(n_i, 1) / k"),))
