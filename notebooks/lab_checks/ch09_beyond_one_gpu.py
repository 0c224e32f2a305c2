"""09_beyond_one_gpu's regions, against minimind_lib.distributed and .train in one process (ranks one after the other;
a real DistributedDataParallel in a one-rank gloo group): the split, the rank's loss, no_sync, the memory of a rank."""
import contextlib
import copy
import functools
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from minimind_lib import distributed as DP
from minimind_lib import train as T
from minimind_lib.data import pad_collate, trained_tokens
from minimind_lib.memory import estimate_memory
from minimind_lib.model import MiniMindConfig, MiniMindForCausalLM

from . import Case, draw, pick, randomized, region
from .ch03_model import config

ORDER = "sorted(range(len(costs)), key=lambda i: (-float(costs[i]), i))"
region("deal", "go through the positions from the largest cost to the smallest (ties: the lower position first); give "
       "each to the rank whose costs add up to the least so far (ties: fewer items, then the lower rank); return each "
       "rank's positions in increasing order.", DP.assign_to_ranks,
       run=lambda fn, c: [list(o) for o in fn(list(c.args[0]), c.args[1])], output="each rank's positions",
       fixed=lambda: [Case(f"deal({c}, {n})", c, n) for c, n in (([5, 1, 1, 1, 1, 1], 2), ([1, 1, 5], 2),
                                                                  ([3, 1, 2, 2], 2), ([2, 2, 1, 1], 3), ([], 3))],
       drawn=lambda g: [Case(f"deal({c}, {n})", c, n) for c, n in (
           ([draw(g, 1, 6) * s for _ in range(draw(g, 0, 12))], draw(g, 1, 6)) for s in (1, 100, 1, 1))],
       mistakes=(("It deals round-robin, whatever the costs: one rank then waits for the other at every all-reduce.",
                  lambda costs, n: [list(range(r, len(costs), n)) for r in range(n)]),
                 ("It deals in the order given: the largest must go first, or a large one that comes last lands on a "
                  "rank already loaded.", (ORDER, "range(len(costs))")),
                 ("Each rank's positions should be in increasing order (the order of the step's micro-batches).",
                  ("return [sorted(o) for o in owned]", "return owned")),
                 ("It breaks ties between equally loaded ranks by the lower rank alone: fewer items go first.",
                  ("(loads[k], len(owned[k]), k)", "(loads[k], k)"))))


def rank_backward(model, micro_batches, n_global, world):
    """accumulate_step's loss as one rank of `world` runs it, called the chapter's way: each micro-batch's summed
    token losses times world over n_global, backpropagated."""
    for mb in micro_batches:
        (T.lm_loss(T.forward_logits(model, mb), mb["labels"], reduction="sum") * world / n_global).backward()


def micro_batch(g, vocab: int) -> dict:
    """1 to 3 rows of 2 to 12 random ids, padded on the right, sometimes with untrained positions (labels -100)."""
    samples = []
    for _ in range(draw(g, 1, 3)):
        ids = torch.randint(0, vocab, (draw(g, 2, 12),), generator=g)
        labels = ids.clone()
        labels[torch.rand(len(ids), generator=g) < 0.4 * draw(g, 0, 1)] = -100
        samples.append({"input_ids": ids, "labels": labels})
    return pad_collate(samples, 0)


@functools.cache
def _shares(seed: int, world: int) -> tuple:
    """A random model; each rank's micro-batches, the ranks' trained tokens clearly unequal."""
    g, c = torch.Generator().manual_seed(seed), config(seed)
    while True:
        shares = [[micro_batch(g, c.vocab_size) for _ in range(draw(g, 1, 3))] for _ in range(world)]
        counts = [sum(trained_tokens(mb["labels"]) for mb in share) for share in shares]
        if min(counts) > 0 and max(counts) >= 1.3 * min(counts):
            return randomized(MiniMindForCausalLM(c), seed), shares, counts


def gradients(model) -> dict:
    return {n: (torch.zeros_like(p) if p.grad is None else p.grad.clone()) * 1000 for n, p in model.named_parameters()}


def _ranks(fn, case):
    model, shares, counts = _shares(*case.args)
    total = None
    with torch.enable_grad():
        for share in shares:  # the ranks one after the other; DDP's all-reduce is their average
            model.zero_grad(set_to_none=True)
            fn(model, [dict(mb) for mb in share], sum(counts), len(shares))
            total = {k: v + (0 if total is None else total[k]) for k, v in gradients(model).items()}
    return {k: v / len(shares) for k, v in total.items()}


def _world(seed, world):
    counts = _shares(seed, world)[2]
    return Case(f"{world} ranks holding {counts} trained tokens (n_global {sum(counts)})", seed, world)


LOSS = "* world / n_global"
region("rank_backward", "for each micro-batch, the sum (not the mean) of its token losses, divided by n_global, the "
       "trained tokens of the whole step on all ranks; times world, since DDP averages the ranks' gradients; "
       "backward.", rank_backward, run=_ranks, tol=1e-3, output="the gradient averaged over the ranks, times 1000",
       fixed=lambda: [_world(0, 2), _world(1, 3)], drawn=lambda g: [_world(draw(g, 2, 999), 2)],
       mistakes=(("It divides by the rank's own token count: a token of the rank holding fewer weighs more; every rank "
                  "divides by the same count, the step's on all ranks.",
                  (LOSS, '* world / sum(trained_tokens(m["labels"]) for m in micro_batches)')),
                 ("It divides by the rank's own token count and leaves out world.",
                  (LOSS, '/ sum(trained_tokens(m["labels"]) for m in micro_batches)')),
                 ("It divides by n_global but does not multiply by world: DDP's average then divides by world again, a "
                  "gradient world times too small.", (LOSS, "/ n_global")),
                 ("It averages each micro-batch's loss on its own (04's naive mean): divide the sums by n_global.",
                  [('reduction="sum"', 'reduction="mean"'), (LOSS, "* world / len(micro_batches)")])))


@contextlib.contextmanager
def one_rank_group():
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


def no_sync(ddp, micro_batches, n_global, world=1):
    """accumulate_step's choice under DDP, called the chapter's way: all but the last micro-batch under no_sync()."""
    for i, mb in enumerate(micro_batches):
        with contextlib.nullcontext() if i == len(micro_batches) - 1 else ddp.no_sync():
            rank_backward(ddp, [mb], n_global, world)


def _recording_hook(state: dict, bucket):  # no annotation on bucket: DDP inspects the hook's signature
    """DDP's all-reduce (one rank: the bucket itself), noting the micro-batch whose backward sent it."""
    state["synced"].add(state["forwards"] - 1)
    return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda f: f.value()[0])


def _ddp(fn, case):
    seed, k, world = case.args
    g, model = torch.Generator().manual_seed(seed), copy.deepcopy(randomized(MiniMindForCausalLM(config(seed)), seed))
    micro, ddp, seen = [micro_batch(g, 97) for _ in range(k)], DistributedDataParallel(model), {"forwards": 0,
                                                                                                 "synced": set()}
    model.register_forward_pre_hook(lambda *_: seen.update(forwards=seen["forwards"] + 1))
    ddp.register_comm_hook(seen, _recording_hook)
    with torch.enable_grad():
        fn(ddp, [dict(mb) for mb in micro], 10_000, world)
    return {"the micro-batches (from 0) in whose backward DDP all-reduced": sorted(seen["synced"]),
            "the gradients after the micro-batches, times 1000": gradients(model)}


LAST = "i == len(micro_batches) - 1"
region("accumulate_no_sync", "every micro-batch's backward through the DDP model with rank_backward; all but the last "
       "inside ddp.no_sync() (which only adds into .grad), the last outside it, so its backward all-reduces the sum "
       "once.", no_sync, run=_ddp, around=one_rank_group, tol=1e-3,
       fixed=lambda: [Case("4 micro-batches through a DDP model of one rank (world=2)", 0, 4, 2)],
       drawn=lambda g: [Case("micro-batches through a DDP model of one rank", draw(g, 1, 999), draw(g, 2, 5), 2)],
       mistakes=(("Every micro-batch's backward all-reduces (no no_sync()): the same gradient, sent k times.",
                  (LAST, "True")),
                 ("The all-reduce happens in the first micro-batch's backward: the later ones' gradients stay on their "
                  "rank and are never summed across ranks.", (LAST, "i == 0")),
                 ("No backward all-reduces: the last micro-batch ran under no_sync() too.", (LAST, "False")),
                 ("no_sync() is on the last micro-batch instead of the others.",
                  (LAST, "i != len(micro_batches) - 1"))))


def per_rank_memory(config: MiniMindConfig, world: int, batch_size: int, seq_len: int, amp: str = "bf16") -> dict:
    """The reference for 09's per_rank_bytes (no later chapter uses it, so it lives here, not in minimind_lib): bytes a
    rank holds as a micro-batch's backward starts under accumulation (estimate_memory's terms), {setup: {component:
    bytes}} for one GPU, DDP (plus its buckets, a second fp32 gradient) and FSDP2 over `world` ranks (weights,
    gradients and AdamW moments sharded, no autocast copy, two units gathered in the compute dtype and one unit's fp32
    gradient before its reduce-scatter; a unit: the root or a block). Activations never shrink."""
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


def _sizes(g=None):
    c, world, batch, seq, amp = MiniMindConfig(hidden_size=2048, num_hidden_layers=24, num_attention_heads=16,
                                               num_key_value_heads=4), 8, 2, 512, "bf16"
    if g is not None:
        heads = pick(g, (4, 8, 16, 32))
        c = MiniMindConfig(hidden_size=heads * pick(g, (32, 64, 128)), num_hidden_layers=draw(g, 1, 32),
                           num_attention_heads=heads, num_key_value_heads=heads // pick(g, (1, 2, 4)),
                           vocab_size=pick(g, (6400, 32000, 151936)))
        world, batch, seq, amp = draw(g, 1, 16), draw(g, 1, 8), pick(g, (128, 2048)), pick(g, ("bf16", "fp16", "off"))
    return Case(f"per_rank_bytes(c, {world}, {batch}, {seq}, {amp!r}), c of width {c.hidden_size}, "
                f"{c.num_hidden_layers} layers, vocabulary {c.vocab_size}", c, world, batch, seq, amp)


COPY = '"autocast weight copy": 0,'
region("per_rank_bytes", "weights, gradients, AdamW moments, the autocast copy and the activations (with the logits "
       "and buffers) from estimate_memory with accum_steps=2; DDP adds its buckets, 4 bytes per parameter; FSDP2 "
       "divides the first three by world, keeps no autocast copy, and adds two units gathered (2 bytes per parameter "
       "under autocast, 4 without) and one unit's fp32 gradient.", per_rank_memory, tol=1e-9,
       output="the bytes per rank", fixed=lambda: [_sizes()], drawn=lambda g: [_sizes(g) for _ in range(3)],
       mistakes=(("It divides the activations by world: every rank runs its own micro-batch, so they do not shrink.",
                  (COPY, COPY + ' "activations, logits, buffers": one["activations, logits, buffers"] / world,')),
                 ("It leaves out DDP's gradient buckets: DDP all-reduces from a second fp32 copy of the gradients, 4 "
                  "bytes per parameter.", ('"DDP gradient buckets": est["grads_bytes"]', '"DDP gradient buckets": 0')),
                 ("It keeps FSDP2's gradients whole: the reduce-scatter leaves each rank its shard.",
                  ('("fp32 weights", "fp32 gradients", "AdamW moments")', '("fp32 weights", "AdamW moments")')),
                 ("It counts one AdamW moment: AdamW keeps two in fp32 (exp_avg, exp_avg_sq), 8 bytes per parameter.",
                  ('est["optimizer_bytes"]', 'est["optimizer_bytes"] / 2')),
                 ("It keeps an autocast copy of every weight under FSDP2: FSDP2 casts one unit at a time.",
                  (COPY, ""))))
