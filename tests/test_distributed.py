"""DDP on CPU with gloo: 2 real processes give the gradients and losses of one process on the same data.

The equivalence test launches notebook 09's demo job (notebooks/ddp_demo.py, which trains through
minimind_lib.distributed.fit_distributed) on 2 ranks once (bounded time, every process killed afterwards, even on
failure); everything else (sampler, env parsing, the launcher's clean-up) runs in-process.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
from pathlib import Path

import pytest
import torch

from minimind_lib import distributed as D
from minimind_lib.data import pad_collate
from minimind_lib.train import accumulate_step, world_size

DEMO = Path(__file__).resolve().parents[1] / "notebooks" / "ddp_demo.py"
sys.path.insert(0, str(DEMO.parent))
import ddp_demo as demo  # noqa: E402  (notebook 09's harness: a script beside the notebook, not the library)
import lab_checks  # noqa: E402  (09's per-rank memory: the reference its lab check holds)

# 32 variable-length samples, budget 96 padded tokens, 3 micro-batches per step -> an epoch of 4 global steps
# [3, 3, 3, 1]: under 2 ranks one rank gets 2 micro-batches and the other 1, and in step 3 rank 1 gets none.
SAMPLES = {"n": 32, "min_len": 3, "max_len": 40, "seed": 1, "masked_frac": 0.4}
BASE = {"synthetic": SAMPLES, "model": "smoke", "max_tokens": 96, "accum_steps": 3, "sampler_seed": 0,
        "threads": 1, "capture_grads": [0, 1, 3]}
TRAIN = {"max_steps": 5, "lr": 3e-3, "warmup_steps": 1, "seed": 0, "amp": "off", "grad_clip": 1.0}
CKPT_STEP = 3  # ckpt_every=3 with 5 steps: one checkpoint, after step index 2; resuming runs steps 3 (a rank empty) and 4


def _lengths(samples):
    return [int(s["input_ids"].numel()) for s in samples]


def _load(path: Path) -> dict:
    return torch.load(path, weights_only=True)


def _assert_grads_close(a: dict, b: dict, what: str, atol: float = 1e-6, rtol: float = 1e-5) -> None:
    assert a.keys() == b.keys(), what
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=atol, rtol=rtol, msg=lambda m: f"{what}: {name}: {m}")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Single-process reference (in-process) + one 2-rank gloo launch + a 1-rank resume of the 2-rank checkpoint."""
    torch.set_num_threads(1)
    tmp = tmp_path_factory.mktemp("ddp")
    one = D.DistInfo()
    ref = demo.run_job({**BASE, "out": str(tmp / "ref"),
                     "train": {**TRAIN, "ckpt_every": CKPT_STEP, "ckpt_dir": str(tmp / "ref_ckpt")}}, one)
    specs = [
        {**BASE, "out": str(tmp / "ddp_a"), "train": {**TRAIN, "ckpt_every": CKPT_STEP, "ckpt_dir": str(tmp / "ddp_ckpt")}},
        # resume a checkpoint written by ONE process with TWO ranks
        {**BASE, "out": str(tmp / "ddp_b"), "resume_from": str(tmp / "ref" / f"ckpt_step{CKPT_STEP}.pt"), "train": TRAIN},
    ]
    spec_path = tmp / "job.json"
    spec_path.write_text(json.dumps(specs))
    res = demo.launch([str(DEMO), str(spec_path)], nproc=2, launcher="env", timeout_s=150, log_dir=tmp / "logs")
    for pid in res.pids:  # the launcher must leave nothing running
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert res.ok, f"2-rank run failed (rc {res.returncodes}, timed_out={res.timed_out}):\n" + \
        "\n".join(o[-3000:] for o in res.outputs)
    # resume the TWO-rank checkpoint in ONE process
    resumed = demo.run_job({**BASE, "out": str(tmp / "one_from_two"), "resume_from": str(tmp / "ddp_a" / f"ckpt_step{CKPT_STEP}.pt"),
                         "train": TRAIN}, one)
    return {"tmp": tmp, "ref": ref, "resumed_1_from_2": resumed,
            "a": [_load(tmp / "ddp_a" / f"result_rank{r}.pt") for r in range(2)],
            "b": [_load(tmp / "ddp_b" / f"result_rank{r}.pt") for r in range(2)], "seconds": res.seconds}


def test_two_ranks_match_single_process_losses(runs):
    ref = runs["ref"]
    assert len(ref["losses"]) == TRAIN["max_steps"]
    for r in range(2):
        a = runs["a"][r]
        assert a["world_size"] == 2 and a["backend"] == "gloo"
        assert a["tokens"] == ref["tokens"]  # the all-reduced token count is the single-process count
        torch.testing.assert_close(torch.tensor(a["losses"]), torch.tensor(ref["losses"]), atol=1e-5, rtol=1e-5)
    # each rank trained only its share; together they trained every token of the step
    assert [x + y for x, y in zip(runs["a"][0]["rank_tokens"], runs["a"][1]["rank_tokens"])] == ref["tokens"]
    assert 0 in runs["a"][1]["rank_tokens"]  # the step where rank 1 had no micro-batch (the empty one)


def test_two_ranks_match_single_process_gradients(runs):
    ref_grads = runs["ref"]["grads"]
    assert set(ref_grads) == {0, 1, 3}
    for step in ref_grads:
        for r in range(2):
            _assert_grads_close(runs["a"][r]["grads"][step], ref_grads[step], f"rank {r} step {step}")


def test_one_gradient_allreduce_per_step_whatever_the_micro_batches(runs):
    """no_sync on all but the last micro-batch: DDP's bucket all-reduces run once per optimizer step."""
    a0, a1 = runs["a"]
    per_step = list(zip(a0["rank_micro_batches"], a1["rank_micro_batches"]))
    assert per_step[:3] == [(1, 2)] * 3 and per_step[3] == (1, 0)  # 3 micro-batches a step: dealt 1 + 2; the last 1
    grad_bytes = 4 * sum(p.numel() for p in demo.job_model(BASE).parameters())
    for a in (a0, a1):  # the whole fp32 gradient once per step, not once per micro-batch
        assert a["allreduce_bytes"] == [grad_bytes] * TRAIN["max_steps"], a["allreduce_bytes"]


def test_reference_is_plain_accumulation_and_naive_ddp_is_not():
    """Step 0's gradient from train.accumulate_step on the whole step; naive per-rank means averaged differ."""
    torch.set_num_threads(1)
    spec = {**BASE, "out": "unused", "train": TRAIN}
    model, samples, sampler, _ = demo.build_job(spec, D.DistInfo())
    step0 = sampler.global_steps()[0]
    accumulate_step(model, [pad_collate([samples[i] for i in mb]) for mb in step0])
    exact = {n: p.grad.clone() for n, p in model.named_parameters()}
    # naive DDP: each rank normalises by its own tokens, DDP averages the ranks
    naive = {n: torch.zeros_like(g) for n, g in exact.items()}
    for r in range(2):
        model.zero_grad(set_to_none=True)
        share = D.DistributedTokenBudgetSampler(_lengths(samples), 96, 3, num_replicas=2, rank=r).split_step(step0)
        accumulate_step(model, [pad_collate([samples[i] for i in mb]) for mb in share])
        for n, p in model.named_parameters():
            naive[n] += p.grad / 2
    diff = max(float((naive[n] - exact[n]).abs().max() / exact[n].abs().max()) for n in exact)
    assert diff > 1e-3, "the data must make naive averaging wrong, or the equivalence test proves nothing"


def test_reference_grads_equal_plain_accumulate_step(runs, tmp_path):
    spec = {**BASE, "out": str(tmp_path), "train": TRAIN}
    model, samples, sampler, _ = demo.build_job(spec, D.DistInfo())
    accumulate_step(model, [pad_collate([samples[i] for i in mb]) for mb in sampler.global_steps()[0]])
    exact = {n: p.grad.clone() for n, p in model.named_parameters()}
    _assert_grads_close(runs["a"][0]["grads"][0], exact, "2-rank step 0 vs accumulate_step on the whole step")


def test_resume_with_a_different_world_size(runs):
    ref = torch.tensor(runs["ref"]["losses"][CKPT_STEP:])
    for r in range(2):  # 1 -> 2 ranks
        b = runs["b"][r]
        assert b["steps"] == list(range(CKPT_STEP, TRAIN["max_steps"]))
        torch.testing.assert_close(torch.tensor(b["losses"]), ref, atol=1e-5, rtol=1e-5)
    one = runs["resumed_1_from_2"]  # 2 -> 1 rank
    assert one["world_size"] == 1 and one["steps"] == list(range(CKPT_STEP, TRAIN["max_steps"]))
    torch.testing.assert_close(torch.tensor(one["losses"]), ref, atol=1e-5, rtol=1e-5)


def test_only_rank0_writes_the_checkpoint(runs):
    files = sorted(p.name for p in (runs["tmp"] / "ddp_ckpt").iterdir())
    assert files == ["last.pt"]  # no second writer's temp file, nothing per rank
    assert runs["a"][0]["snapshots"] == [f"ckpt_step{CKPT_STEP}.pt"] and runs["a"][1]["snapshots"] == []
    state = torch.load(runs["tmp"] / "ddp_a" / f"ckpt_step{CKPT_STEP}.pt", weights_only=True)
    assert state["step"] == CKPT_STEP and state["data"] == {"epoch": 0, "offset": CKPT_STEP}
    assert state["controller"]["world_size"] == 2


# --------------------------------------------------------------------------------------------- sampler


@pytest.mark.parametrize("world", [1, 2, 3, 5])
@pytest.mark.parametrize("per_step", [1, 3, 4])
def test_sampler_every_sample_exactly_once_and_equal_steps(world, per_step):
    lengths = _lengths(demo.synthetic_samples(57, min_len=1, max_len=60, seed=3))
    samplers = [D.DistributedTokenBudgetSampler(lengths, 120, per_step, num_replicas=world, rank=r, seed=7)
                for r in range(world)]
    for epoch in (0, 1):
        for s in samplers:
            s.set_epoch(epoch)
        per_rank = [list(s) for s in samplers]
        assert len({len(p) for p in per_rank}) == 1 == len({len(s) for s in samplers})  # same number of steps
        assert len(per_rank[0]) == len(samplers[0])
        seen = [i for p in per_rank for step in p for mb in step for i in mb]
        assert sorted(seen) == list(range(len(lengths)))  # every sample on exactly one rank
        # each step's shares are the single-process step, dealt out
        single = D.DistributedTokenBudgetSampler(lengths, 120, per_step, num_replicas=1, rank=0, seed=7)
        single.set_epoch(epoch)
        for t, step in enumerate(single.global_steps()):
            union = sorted(i for p in per_rank for mb in p[t] for i in mb)
            assert union == sorted(i for mb in step for i in mb)
        if per_step < world:
            assert any(len(step) == 0 for p in per_rank for step in p)  # some rank idles in some step


def test_sampler_balances_padded_tokens():
    lengths = _lengths(demo.synthetic_samples(200, min_len=1, max_len=64, seed=5))
    s0, s1 = (D.DistributedTokenBudgetSampler(lengths, 256, 8, num_replicas=2, rank=r) for r in range(2))
    cost = lambda mbs: sum(len(b) * max(lengths[i] for i in b) for b in mbs)  # noqa: E731
    for a, b in zip(s0, s1):
        assert len(a) + len(b) <= 8 and a and b  # counts may differ: tokens are what is balanced
        assert abs(cost(a) - cost(b)) <= 256  # within one micro-batch's budget


def test_sampler_resume_position_is_world_size_independent():
    """fit resumes by skipping the steps already served (train.DataStream): the rest is the same for any world size."""
    lengths = _lengths(demo.synthetic_samples(60, min_len=1, max_len=50, seed=2))
    two = D.DistributedTokenBudgetSampler(lengths, 100, 3, num_replicas=2, rank=0, seed=1)
    three = [D.DistributedTokenBudgetSampler(lengths, 100, 3, num_replicas=3, rank=r, seed=1) for r in range(3)]
    rest = sorted(i for s in three for step in itertools.islice(s, 2, None) for mb in step for i in mb)
    expected = sorted(i for step in two.global_steps()[2:] for mb in step for i in mb)
    assert rest == expected and len(expected) > 0


def test_assign_to_ranks():
    assert D.assign_to_ranks([5, 1, 1, 1, 1, 1], 2) == [[0], [1, 2, 3, 4, 5]]
    assert D.assign_to_ranks([1], 3) == [[0], [], []]
    with pytest.raises(ValueError, match="n_ranks must be >= 1"):
        D.assign_to_ranks([1], 0)


def test_sampler_bad_inputs():
    with pytest.raises(ValueError, match="accum_steps must be >= 1"):
        D.DistributedTokenBudgetSampler([3, 4], 10, 0)
    with pytest.raises(ValueError, match=r"rank=2 is outside 0..1"):
        D.DistributedTokenBudgetSampler([3, 4], 10, 1, num_replicas=2, rank=2)


def test_sampler_serves_dataset_samples_and_cuts_at_seq_len():
    ds = demo.synthetic_samples(20, min_len=2, max_len=30, seed=4)
    s = D.DistributedTokenBudgetSampler(_lengths(ds), 64, 2, seq_len=16, dataset=ds)
    got = [x for step in s for mb in step for x in mb]
    assert sorted(map(id, got)) == sorted(map(id, ds))  # the dataset's own samples, each once
    assert s.base.longest_row == 16  # rows longer than seq_len count as seq_len tokens (the collate cuts them)


# --------------------------------------------------------------------------------------------- env, launch


def test_env_ranks():
    assert D.env_ranks({}) == (0, 1, 0)
    assert D.env_ranks({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}) == (1, 2, 1)
    with pytest.raises(ValueError, match="RANK=1 is set but WORLD_SIZE is not"):
        D.env_ranks({"RANK": "1"})
    with pytest.raises(ValueError, match="WORLD_SIZE=2 is set but RANK is not"):
        D.env_ranks({"WORLD_SIZE": "2"})
    with pytest.raises(ValueError, match="RANK=2 is outside 0..1"):
        D.env_ranks({"RANK": "2", "WORLD_SIZE": "2"})
    with pytest.raises(ValueError, match="WORLD_SIZE='two' is not an integer"):
        D.env_ranks({"WORLD_SIZE": "two"})


def test_setup_without_torchrun_is_single_process(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    info = D.setup(device="cpu")
    assert (info.rank, info.world_size, info.is_main, info.distributed, info.backend) == (0, 1, True, False, None)
    assert world_size() == 1 and D.wrap_ddp(model := torch.nn.Linear(2, 2), info) is model
    D.barrier()  # nothing to wait for: must not raise
    D.teardown()  # nothing to tear down: must not raise


def test_setup_bad_backend(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    with pytest.raises(ValueError, match="backend='mpi'"):
        D.setup(backend="mpi")
    monkeypatch.delenv("MASTER_PORT")
    with pytest.raises(ValueError, match="MASTER_PORT is not set"):
        D.setup()


def test_controller_rejects_naive_normalization():
    from minimind_lib.train import TrainConfig

    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="normalization='naive'"):
        D.DDPController(model, model, D.DistInfo(), TrainConfig(normalization="naive"))


def test_launch_kills_every_process_on_timeout(tmp_path):
    res = demo.launch(["-c", "import time; time.sleep(120)"], nproc=2, launcher="env", timeout_s=1.5, log_dir=tmp_path)
    assert res.timed_out and not res.ok  # and every process is gone (below), however long the machine took
    for pid in res.pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_launch_reports_a_failing_rank(tmp_path):
    code = "import os, sys, time; r = int(os.environ['RANK']); print('rank', r); sys.exit(3) if r == 1 else time.sleep(120)"
    res = demo.launch(["-c", code], nproc=2, launcher="env", timeout_s=60, log_dir=tmp_path)
    assert not res.ok and not res.timed_out and 3 in res.returncodes and "rank 1" in res.outputs[1]
    with pytest.raises(ValueError, match="launcher='mpirun'"):
        demo.launch(["x"], launcher="mpirun")


def test_demo_missing_spec(capsys, tmp_path):
    assert demo.main([str(tmp_path / "nope.json")]) == 2
    assert "job spec not found" in capsys.readouterr().err


def test_distributed_step_source_deals_dataset_samples():
    class DS(list):
        @property
        def lengths(self):
            return [int(s["input_ids"].numel()) for s in self]

    ds = DS(demo.synthetic_samples(20, min_len=2, max_len=30, seed=4))
    sources = [D.distributed_step_source(ds, 64, 2, seed=3, info=D.DistInfo(rank=r, world_size=2)) for r in range(2)]
    assert len(sources[0]) == len(sources[1])
    got = [id(x) for src in sources for step in src for mb in step for x in mb]
    assert sorted(got) == sorted(id(x) for x in ds)  # the dataset's own samples, each once


def test_controller_runs_fits_accumulate_fn_on_the_ddp_model_with_the_global_count():
    # The controller must go through fit's accumulate_fn (so fit's GradScaler is used, fp16 included), hand it the
    # DDP wrapper (whose hooks all-reduce the gradients) and the step's global token count.
    from minimind_lib.train import TrainConfig

    model, wrapper = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    ctrl = D.DDPController(model, wrapper, D.DistInfo(), TrainConfig(amp="fp16"))
    calls = []

    def accumulate_fn(micro_batches, *, forward_model=None, n_tokens_total=None):
        calls.append((len(micro_batches), forward_model, n_tokens_total))
        return {"loss_sum": 1.5, "n_tokens": n_tokens_total}

    samples = demo.synthetic_samples(3, min_len=4, max_len=9, seed=1)
    stats = ctrl.run_step([samples[:2], samples[2:]], accumulate_fn)
    n_tokens = sum(int((s["labels"][1:] != -100).sum()) for s in samples)
    assert calls == [(2, wrapper, n_tokens)]
    assert stats["n_tokens"] == n_tokens and stats["loss_sum"] == 1.5
    assert ctrl.state_dict() == {"step": 1, "world_size": 1}


# --------------------------------------------------------------------------------------------- what a rank sends and holds


@pytest.mark.parametrize("amp", ["bf16", "off"])
def test_per_rank_memory_one_gpu_ddp_and_fsdp2(amp):
    from minimind_lib.memory import estimate_memory
    from minimind_lib.model import MiniMindConfig

    c, P = MiniMindConfig.preset("minimind2-small"), 25_829_888
    one, eight = lab_checks.per_rank_memory(c, 1, 2, 512, amp), lab_checks.per_rank_memory(c, 8, 2, 512, amp)
    total = lambda parts: sum(parts.values())  # noqa: E731
    state = lambda parts: parts["fp32 weights"] + parts["fp32 gradients"] + parts["AdamW moments"]  # noqa: E731
    # one GPU is estimate_memory's peak under accumulation; DDP adds its buckets alone, on any number of ranks
    assert total(one["one GPU"]) == estimate_memory(c, 2, 512, amp=amp, accum_steps=2)["peak_bytes"]
    assert total(eight["DDP"]) - total(one["one GPU"]) == eight["DDP"]["DDP gradient buckets"] == 4 * P
    assert state(one["one GPU"]) == 16 * P and state(eight["FSDP2"]) == 2 * P and state(one["FSDP2"]) == 16 * P
    assert eight["FSDP2"]["activations, logits, buffers"] == one["one GPU"]["activations, logits, buffers"]
    assert one["one GPU"]["autocast weight copy"] == (2 * P if amp == "bf16" else 0) and not eight["FSDP2"][
        "autocast weight copy"]
    unit = 6400 * 512  # the embedding (3,276,800) is larger than a block (2,819,072)
    assert eight["FSDP2"]["unsharded units"] == 2 * unit * (2 if amp == "bf16" else 4) + 4 * unit
    with pytest.raises(ValueError, match="world must be >= 1"):
        lab_checks.per_rank_memory(c, 0, 2, 512)
