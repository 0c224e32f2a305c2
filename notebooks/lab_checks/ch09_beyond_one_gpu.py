"""09_beyond_one_gpu's regions, against minimind_lib.distributed and .train (ranks in turn)."""
import contextlib
import copy
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from minimind_lib import distributed as DP, train as T
from minimind_lib.data import trained_tokens
from minimind_lib.memory import estimate_memory
from minimind_lib.model import MiniMindConfig
from . import Case, draw, pick, region
from .ch04_gradient_accumulation import gradients, model_and_batches

region("deal", "largest cost first, each to the least loaded rank; each rank's positions sorted.",
       DP.assign_to_ranks, output="each rank's positions",
       fixed=[([5] + [1] * 5, 2), ([1, 1, 5], 2), ([3, 1, 2, 2], 2), ([2, 2, 1, 1], 3), ([], 3),
              ([1, 2, 9], 2), ([1, 1, 1, 3, 3, 4], 2)],
       drawn=lambda g: [([draw(g, 1, 6) * s for _ in range(draw(g, 0, 12))], draw(g, 1, 6))
                        for s in (1, 100, 1, 1)],
       mistakes=(("It deals round-robin, whatever the costs: the largest first, the least loaded.",
                  lambda costs, n: [list(range(r, len(costs), n)) for r in range(n)]),))
def rank_backward(model, micro_batches, n_global, world):  # accumulate_step's loss on one rank
    for mb in micro_batches:
        loss = T.lm_loss(T.forward_logits(model, mb), mb["labels"], reduction="sum")
        (loss * world / n_global).backward()
def ranks(fn, case):  # rank 0: micro-batch 0, rank 1: the rest; summed gradients
    model, micro = copy.deepcopy(model_and_batches(case.args[0]))
    with torch.enable_grad():
        for share in (micro[:1], micro[1:]):  # the ranks one after the other
            fn(model, share, case.args[1], 2)
    return gradients(model)
def two_ranks(seed):
    n = [trained_tokens(mb["labels"]) for mb in model_and_batches(seed)[1]]
    return Case(f"2 ranks holding {n[0]} and {sum(n[1:])} trained tokens", seed, sum(n))
region("rank_backward", "each micro-batch's summed token losses x world / n_global, backward.",
       rank_backward, run=ranks, tol=1e-3, output="the sum of the ranks' gradients, times 1000",
       fixed=lambda: [two_ranks(0), two_ranks(1)], drawn=lambda g: [two_ranks(draw(g, 2, 999))],
       mistakes=(("It divides by the rank's own token count: every rank divides by n_global.",
                  "n_global)", 'sum(trained_tokens(m["labels"]) for m in micro_batches))'),
                 ("It does not multiply by world, which DDP's mean divides by.", "* world /", "/")))
@contextlib.contextmanager
def one_rank_group():  # a gloo group of this process alone, for a real DDP
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        if started:
            dist.destroy_process_group()
def no_sync(ddp, micro_batches, n_global, world=1):  # all but the last under ddp.no_sync()
    for i, mb in enumerate(micro_batches):
        with contextlib.nullcontext() if i == len(micro_batches) - 1 else ddp.no_sync():
            rank_backward(ddp, [mb], n_global, world)
def synced(fn, case):  # the micro-batches whose backward all-reduced; gradients
    model, micro = copy.deepcopy(model_and_batches(case.args[0]))
    ddp, seen = DistributedDataParallel(model), {"forwards": 0, "synced": set()}
    ddp.module.register_forward_pre_hook(lambda *_: seen.update(forwards=seen["forwards"] + 1))
    ddp.register_comm_hook(seen, lambda state, bucket: state["synced"].add(
        state["forwards"] - 1) or dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(
            lambda f: f.value()[0]))
    with torch.enable_grad():
        fn(ddp, micro, 10_000, 2)
    return {"the micro-batches (from 0) in whose backward DDP all-reduced": sorted(seen["synced"]),
            "the gradients, times 1000": gradients(ddp.module)}
LAST = "i == len(micro_batches) - 1"
region("accumulate_no_sync", "every micro-batch's backward; all but the last under ddp.no_sync().",
       no_sync, run=synced, around=one_rank_group, tol=1e-3,
       fixed=lambda: [Case(f"{len(model_and_batches(1)[1])} micro-batches through a DDP model", 1)],
       drawn=lambda g: [Case("micro-batches through a DDP model", draw(g, 1, 999))],
       mistakes=(("Every micro-batch's backward all-reduces: only the last one's should.", LAST,
                  "True"), ("The all-reduce happens in the first micro-batch's backward: the later "
                            "ones' gradients are never summed across ranks.", LAST, "i == 0")))
def per_rank_memory(config, world, batch_size, seq_len, amp="bf16"):
    """09's per_rank_bytes (only 09 uses it): {one GPU, DDP, FSDP2: {component: bytes}}."""
    if int(world) < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    est = estimate_memory(config, batch_size, seq_len, amp=amp, accum_steps=2)
    embedding = config.vocab_size * config.hidden_size
    block = (est["n_params"] - embedding - config.hidden_size) // config.num_hidden_layers
    unit = max(embedding, block)  # FSDP2's largest unit: the embedding or a block
    one = {"fp32 weights": est["params_bytes"], "fp32 gradients": est["grads_bytes"],
           "AdamW moments": est["optimizer_bytes"], "DDP gradient buckets": 0, "unsharded units": 0,
           "autocast weight copy": est["amp_weight_copies_bytes"], "activations, logits, buffers":
           est["activations_bytes"] + est["head_bytes"] + est["buffers_bytes"]}
    sharded = {k: one[k] / world for k in ("fp32 weights", "fp32 gradients", "AdamW moments")}
    return {"one GPU": one, "DDP": {**one, "DDP gradient buckets": est["grads_bytes"]},
            "FSDP2": {**one, **sharded, "autocast weight copy": 0,
                      "unsharded units": unit * (2 * (4 if amp == "off" else 2) + 4)}}
def sizes(preset, *args, layers=None):
    c = MiniMindConfig.preset(preset, **{"num_hidden_layers": layers} if layers else {})
    return Case(f"per_rank_bytes(MiniMindConfig.preset({preset!r}) of {c.num_hidden_layers} "
                f"layers, {', '.join(map(repr, args))})", c, *args)
region("per_rank_bytes", "estimate_memory's terms; DDP adds buckets; FSDP2 shards, gathers units.",
       per_rank_memory, tol=1e-9, output="the bytes per rank",
       fixed=lambda: [sizes("minimind2-small", 8, 2, 512, "bf16"), sizes("cpu", 3, 4, 2048, "off")],
       drawn=lambda g: [sizes(pick(g, ("cpu", "minimind2-small", "smoke")), draw(g, 1, 16),
                              draw(g, 1, 8), pick(g, (128, 2048)), pick(g, ("bf16", "off")),
                              layers=draw(g, 1, 32))],
       mistakes=(("It divides the activations by world: every rank runs its own micro-batch.",
                  '"autocast weight copy": 0,', '"autocast weight copy": 0, "activations, logits, '
                  'buffers": one["activations, logits, buffers"] / world,'),
                 ("It leaves out DDP's gradient buckets: a second fp32 gradient, 4 bytes each.",
                  '"DDP gradient buckets": est["grads_bytes"]', '"DDP gradient buckets": 0')))
