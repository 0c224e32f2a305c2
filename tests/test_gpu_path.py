"""The CUDA and MPS paths, proved without a GPU: a fake caching allocator (it keeps its cache, as CUDA's does) under
the controller, a fake MPS layer under the loop, pinned batches, the CUDA set-up, no host read in the step (meta and
fake CUDA tensors hold no readable values), the loop that reads the device only at its log points (and trains bit for
bit as a step-by-step loop), FlexAttention against the dense mask and compiled on CUDA, the memory planner, and the
layering of the modules. benchmarks/README.md says which test guards which change."""

from __future__ import annotations

import ast
import math
import os
import sys
import types
import warnings
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.func import functional_call
from torch.nn.attention import flex_attention as fa
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from minimind_lib import batching, device as device_mod, memory, model as model_mod, pipeline, train
from minimind_lib.data import pad_collate
from minimind_lib.model import MiniMindConfig, MiniMindForCausalLM, lm_loss
from minimind_lib.profiles import GPU_PLAN_BYTES, get_profile

torch.set_num_threads(1)
GiB = 2**30
LIB = Path(__file__).resolve().parents[1] / "minimind_lib"


class FakeCachingAllocator:
    """torch.cuda's memory API on a 16 GiB card, kept as CUDA's caching allocator keeps it. A step allocates up to its
    peak and frees back to `base` (weights, gradients, optimizer states); the freed blocks stay cached, so reserved
    memory never falls but on empty_cache(); `split` bytes of free blocks inside segments still in use (what
    fragmentation holds); a step of a new shape may leave `stale` bytes of cached blocks of the wrong size; the CUDA
    context and other processes (`outside`) show only in the driver's free memory, mem_get_info (calls counted)."""

    def __init__(self, monkeypatch, total: int = 16 * GiB, base: float = 2.0, outside: float = 0.5):
        self.total, self.base, self.outside = total, int(base * GiB), int(outside * GiB)
        self.allocated = self.reserved = self.peak_allocated = self.peak_reserved = self.base
        self.split = self.peak_split = 0
        self.driver_reads = self.releases = 0
        api = {"memory_allocated": lambda d=None: self.allocated, "max_memory_allocated": lambda d=None: self.peak_allocated,
               "memory_reserved": lambda d=None: self.reserved, "max_memory_reserved": lambda d=None: self.peak_reserved,
               "memory_stats": lambda d=None: {"allocated_bytes.all.peak": self.peak_allocated,
                                               "inactive_split_bytes.all.peak": self.peak_split,
                                               "reserved_bytes.all.current": self.reserved},
               "reset_peak_memory_stats": self.reset_peak, "mem_get_info": self.mem_get_info,
               "empty_cache": self.empty_cache, "current_device": lambda: 0,
               "get_device_properties": lambda d=None: types.SimpleNamespace(total_memory=self.total)}
        for name, fn in api.items():
            monkeypatch.setattr(torch.cuda, name, fn)
        monkeypatch.setattr(torch.Tensor, "pin_memory", lambda t: t)  # a CPU-only torch cannot pin

    def reset_peak(self, d=None) -> None:
        self.peak_allocated, self.peak_split, self.peak_reserved = self.allocated, self.split, self.reserved

    def mem_get_info(self, d=None) -> tuple[int, int]:
        self.driver_reads += 1
        return self.total - self.reserved - self.outside, self.total

    def empty_cache(self) -> None:  # the unused cached blocks go back to the driver: reserved falls to what is live
        self.releases += 1
        self.reserved = self.allocated + self.split

    def step(self, peak: float, split: float = 0.0, stale: float = 0.0) -> None:
        """One step's forward+backward: allocate up to `peak` GiB, then free back to base; the cache keeps it all."""
        peak_bytes, self.split = int(peak * GiB), int(split * GiB)
        self.peak_allocated, self.peak_split = max(self.peak_allocated, peak_bytes), max(self.peak_split, self.split)
        self.reserved = min(max(self.reserved, peak_bytes + self.split) + int(stale * GiB), self.total - self.outside)
        self.peak_reserved, self.allocated = max(self.peak_reserved, self.reserved), self.base


def samples(n: int, length: int = 16) -> list[dict]:
    return [{"input_ids": torch.arange(3, 3 + length), "labels": torch.arange(3, 3 + length)} for _ in range(n)]


def workload(cuda: FakeCachingAllocator, gib_per_token: float, spikes=(), stale: float = 0.0):
    """accumulate_fn of a model whose step peak grows with its largest micro-batch's padded tokens; a step in `spikes`
    needs 5 GiB more (a transient, once); the micro-batch sizes each step ran are kept in .tokens."""
    state = {"step": 0, "tokens": []}

    def accumulate(micro: list[dict]) -> dict:
        tokens = max(mb["input_ids"].numel() for mb in micro)
        extra = 5.0 if state["step"] in spikes else 0.0
        cuda.step(cuda.base / GiB + gib_per_token * tokens + extra, split=0.2, stale=stale)
        state["step"] += 1
        state["tokens"].append(tokens)
        return {"loss_sum": 0.0, "n_tokens": 1}
    accumulate.state = state
    return accumulate


def cuda_controller(max_tokens: int = 1600) -> batching.AdaptiveBatchController:
    return pipeline.make_controller(torch.device("cuda", 0), max_tokens=max_tokens, seq_len=16, pad_id=0)


def run_steps(ctl: batching.AdaptiveBatchController, accumulate, n: int) -> None:
    """n steps as fit runs them: the meter's peak reset before each, then the controller's step."""
    for _ in range(n):
        ctl.meter.reset_peak()
        ctl.run_step(samples(100), accumulate)


# ------------------------------------------------------------------------------------------ 1. what an OOM depends on
def test_a_pressure_spike_shrinks_once_and_the_batch_grows_back(monkeypatch):
    """A 5 GiB spike at step 9 takes the need (allocated peak + fragmentation + context) to 87% of the card: one
    shrink at step 10's check; at the smaller size the need is 46%, so step 20's check grows the batch back, and it
    stays there for 80 steps more. The cache keeps the spike's 13 GiB reserved all along (as CUDA's does): a check
    on reserved memory would shrink at every check after the spike and never grow back."""
    cuda = FakeCachingAllocator(monkeypatch)
    ctl = cuda_controller()
    assert ctl.meter.budget_bytes == 16 * GiB and ctl.pin_memory and ctl.check_every == 10
    accumulate = workload(cuda, gib_per_token=6 / 1600, spikes={9})
    run_steps(ctl, accumulate, 100)
    assert [(e.step, e.kind) for e in ctl.events] == [(10, "shrink"), (20, "grow")]
    shrink = ctl.events[0]
    assert abs(shrink.peak_bytes - (2 + 6 + 5 + 0.2 + 0.5) * GiB) < 2**20  # allocated + split + context
    assert shrink.max_tokens == 1280 and ctl.max_tokens == 1600 and accumulate.state["tokens"][-1] == 1600
    assert cuda.reserved >= 13 * GiB and cuda.releases == 0  # the cache kept the spike; nothing released it


def test_each_metrics_row_holds_the_peak_allocated_and_reserved_on_cuda(monkeypatch):
    # the two memory curves --log sends: allocated (what tensors hold) and reserved (plus the allocator's cache);
    # the fake CUDA counters stand behind the run's meter while the model trains on the CPU
    cuda = FakeCachingAllocator(monkeypatch)
    meter = memory.MemoryMeter("cuda")
    run = train._Run(tiny_model(), batches(2), cfg(accum_steps=1), torch.device("cpu"), None, meter, True)
    forward_backward = run.forward_backward

    def allocating(items):  # the step's peak: 6 GiB allocated, 3 GiB more left in the cache: 9 GiB reserved
        cuda.step(6.0, stale=3.0)
        return forward_backward(items)
    run.forward_backward = allocating
    row = run.train_step()
    assert (meter.peak(), meter.peak_reserved()) == (6 * GiB, 9 * GiB)
    assert (row["peak_memory_bytes"], row["peak_reserved_bytes"]) == (6 * GiB, 9 * GiB)
    assert memory.MemoryMeter("cpu").peak_reserved() == 0  # a CPU: peak(), no cache to add



def test_a_steady_load_never_moves_the_batch_while_the_cache_grows(monkeypatch):
    """Allocated flat at 53% of the card, while every step leaves cached blocks of the wrong size (reserved memory
    creeps to the card's limit, as fragmentation by changing shapes does): the need never changes, nor the batch."""
    cuda = FakeCachingAllocator(monkeypatch)
    ctl = cuda_controller()
    accumulate = workload(cuda, gib_per_token=6 / 1600, stale=0.1)
    run_steps(ctl, accumulate, 100)
    assert ctl.events == [] and set(accumulate.state["tokens"]) == {1600}
    assert cuda.reserved == 16 * GiB - GiB // 2  # the cache filled the card; an OOM would first release it


def test_the_driver_is_read_once_per_check(monkeypatch):
    cuda = FakeCachingAllocator(monkeypatch)
    ctl = cuda_controller()
    accumulate = workload(cuda, gib_per_token=6 / 1600)
    run_steps(ctl, accumulate, 30)
    assert cuda.driver_reads == 3  # mem_get_info at steps 10, 20, 30: not every step


def test_an_oom_releases_the_cache_and_halves(monkeypatch):
    cuda = FakeCachingAllocator(monkeypatch)
    ctl = cuda_controller()
    fail = iter([True, False, False])

    def accumulate(micro):
        if next(fail):
            cuda.step(14.0)  # the failed attempt filled the cache
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return {"loss_sum": 0.0, "n_tokens": 1}
    out = ctl.run_step(samples(100), accumulate, zero_grad=lambda: None)
    assert [e.kind for e in out["events"]] == ["oom_halve"] and ctl.max_tokens == 800
    assert cuda.releases == 1 and cuda.reserved == cuda.base  # empty_cache gave the cached blocks back


def test_peak_in_use_reads_the_mps_driver_and_releases_its_cache_per_window(monkeypatch):
    released = []
    monkeypatch.setattr(torch.mps, "driver_allocated_memory", lambda: 7 * GiB)
    monkeypatch.setattr(torch.mps, "recommended_max_memory", lambda: 10 * GiB)
    monkeypatch.setattr(torch.mps, "empty_cache", lambda: released.append(1))
    meter = memory.MemoryMeter("mps")
    assert meter.peak_in_use() == 7 * GiB and device_mod.total_memory_bytes(torch.device("mps")) == 10 * GiB
    assert meter.end_window() == 0 and released == [1]  # the next window's driver count starts from live tensors
    assert memory.MemoryMeter("cpu").peak_in_use() == 0 and memory.MemoryMeter("cpu").end_window() == 0


# ------------------------------------------------------------------------------------------ 3. pinned batches, TF32
def test_batches_are_pinned_on_cuda_only(monkeypatch):
    FakeCachingAllocator(monkeypatch)
    pinned = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda t: pinned.append(t.shape) or t)
    accumulate = lambda micro: {"loss_sum": 0.0, "n_tokens": 1}  # noqa: E731
    cpu = pipeline.make_controller(torch.device("cpu"), max_tokens=64, seq_len=16, pad_id=0)
    cpu.run_step(samples(4), accumulate)
    assert not cpu.pin_memory and pinned == []
    cuda = pipeline.make_controller(torch.device("cuda", 0), max_tokens=64, seq_len=16, pad_id=0)
    cuda.run_step(samples(4), accumulate)
    assert cuda.pin_memory and pinned == [(4, 16)] * 3  # input_ids, labels, attention_mask of the one micro-batch


def test_get_device_sets_up_cuda_before_it_allocates(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "MINIMIND_DEVICE"):
        monkeypatch.delenv(name, raising=False)
    tf32, torch.backends.cuda.matmul.allow_tf32 = torch.backends.cuda.matmul.allow_tf32, False
    try:
        assert device_mod.get_device().type == "cuda"
        assert os.environ["PYTORCH_ALLOC_CONF"] == "expandable_segments:True"  # the current name (torch >= 2.9)
        assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ
        assert torch.backends.cuda.matmul.allow_tf32  # fp32 matmuls on TF32 tensor cores
        monkeypatch.delenv("PYTORCH_ALLOC_CONF")
        monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128")  # the user's, by the older name
        device_mod.get_device()
        assert "PYTORCH_ALLOC_CONF" not in os.environ
        monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
        monkeypatch.setenv("PYTORCH_ALLOC_CONF", "max_split_size_mb:128")  # by the current name
        device_mod.get_device()
        assert os.environ["PYTORCH_ALLOC_CONF"] == "max_split_size_mb:128"
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32


# ------------------------------------------------------------------------------------------ 2. no host sync
def tiny_model(seed: int = 0) -> MiniMindForCausalLM:
    torch.manual_seed(seed)
    return MiniMindForCausalLM(MiniMindConfig.preset("smoke", vocab_size=256))


def batches(n: int, rows: int = 3, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = [torch.randint(3, 256, (int(torch.randint(4, 20, (1,), generator=g)),), generator=g) for _ in range(rows)]
        out.append(pad_collate([{"input_ids": x, "labels": x} for x in ids]))
    return out


def cfg(**kw) -> train.TrainConfig:
    return train.TrainConfig(**{**dict(lr=3e-3, warmup_steps=2, max_steps=8, accum_steps=2, amp="off", progress=False,
                                       seed=0), **kw})


def test_the_step_keeps_its_values_on_the_device_until_a_log_point(monkeypatch):
    run = train._Run(tiny_model(), batches(4), cfg(log_every=4), torch.device("cpu"), None, None, True)
    rows = [run.train_step() for _ in range(3)]
    for row in rows:  # between log points: tensors, not Python numbers (reading one would wait for a GPU)
        assert all(torch.is_tensor(row[k]) for k in ("loss_sum", "grad_norm", "finite"))
    run.read(rows, t_start=0.0)
    assert all(isinstance(r["loss"], float) and isinstance(r["grad_norm"], float) and r["applied"] for r in rows)
    reads, real_read = [], train._Run.read
    monkeypatch.setattr(train._Run, "read", lambda self, rows, t: reads.append([r["step"] for r in rows]) or
                        real_read(self, rows, t))
    df = train.fit(tiny_model(), batches(4), cfg(log_every=4, max_steps=10, eval_every=5), device="cpu")
    assert reads == [[0, 1, 2, 3], [4], [5, 6, 7], [8, 9]]  # every 4 steps, before the evaluation (5) and the end
    assert df["loss"].map(type).eq(float).all() and df["grad_norm"].map(type).eq(float).all()


def reference_fit(model: MiniMindForCausalLM, data: list[dict], c: train.TrainConfig) -> tuple[list, list]:
    """The loop step by step as notebook 04 writes it, reading the loss and grad norm every step (the old loop)."""
    from minimind_lib.checkpoint import seed_everything

    seed_everything(c.seed)
    optimizer, losses, norms = train.build_optimizer(model, c, "cpu"), [], []
    params = [p for p in model.parameters() if p.requires_grad]
    for step in range(c.max_steps):
        lr = train.lr_at(step, lr=c.lr, min_lr=c.min_lr, warmup_steps=c.warmup_steps, max_steps=c.max_steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        micro = [data[(step * c.accum_steps + i) % len(data)] for i in range(c.accum_steps)]
        stats = train.accumulate_step(model, micro)
        norm = float(torch.nn.utils.clip_grad_norm_(params, c.grad_clip))
        if math.isfinite(norm) and math.isfinite(stats["loss"]):
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(stats["loss"]), norms.append(norm)
    return losses, norms


@pytest.mark.parametrize("log_every", [1, 3])
def test_the_deferred_loop_trains_bit_for_bit_as_the_step_by_step_loop(log_every):
    data = batches(5)
    ref_model, model = tiny_model(), tiny_model()
    losses, norms = reference_fit(ref_model, data, cfg())
    df = train.fit(model, data, cfg(log_every=log_every), device="cpu")
    assert df["loss"].tolist() == losses and df["grad_norm"].tolist() == norms  # exactly, not approximately
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), ref_model.state_dict().values()))


def test_a_nan_step_is_skipped_on_the_device_without_a_read():
    model = tiny_model()
    calls = iter(range(1000))
    model.lm_head.register_forward_hook(lambda m, i, out: out * float("nan") if next(calls) in (4, 5) else out)
    run = train._Run(model, batches(4), cfg(log_every=8), torch.device("cpu"), None, None, True)
    rows = [run.train_step() for _ in range(3)]  # step 2 (forward calls 4 and 5) diverges
    assert not bool(rows[2]["finite"])  # decided on the device: fused AdamW's found_inf left the weights alone
    assert all(torch.isfinite(p).all() for p in model.parameters())
    run.read(rows, t_start=0.0)
    assert [r["skipped"] for r in rows] == [False, False, True] and rows[2]["events"] == ["nonfinite_loss_skipped"]


def test_the_controller_signature_is_read_once_per_fit(monkeypatch):
    calls = []
    real = train.inspect.signature
    monkeypatch.setattr(train.inspect, "signature", lambda fn: calls.append(fn) or real(fn))
    ctl = batching.AdaptiveBatchController(2, collate_fn=pad_collate)
    steps = [samples(4, 8) for _ in range(3)]
    train.fit(tiny_model(), steps, cfg(max_steps=3), device="cpu", controller=ctl)
    assert len(calls) == 1


class HostReads(TorchDispatchMode):
    """Counts the reads of a tensor's value into Python (item, float, bool, if tensor): on a GPU each waits for every
    queued kernel. On a CPU they are cheap, which is why a test must count them."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


def test_the_forward_and_backward_read_no_device_value():
    """A step on meta tensors (shapes without values: what a GPU's memory is to the host until it syncs) runs through
    the model, packed positions included, and back: any read of a value, such as checking position_ids' range on the
    device every forward, would raise here. (A CPU tensor is checked: its values are on the host.)"""
    with torch.device("meta"):
        model = MiniMindForCausalLM(MiniMindConfig.preset("smoke", vocab_size=256))
    ids = torch.zeros(2, 24, dtype=torch.long, device="meta")
    positions = torch.arange(24, device="meta").repeat(2, 1)
    logits = model(ids, position_ids=positions).logits
    lm_loss(logits, ids, reduction="sum").backward()
    hidden, _ = model.model(ids, position_ids=positions)
    model_mod.chunked_lm_loss(hidden, model.lm_head.weight, ids, 16).backward()
    assert logits.shape == (2, 24, 256) and model.lm_head.weight.grad.device.type == "meta"
    with pytest.raises(ValueError, match="position_ids range"):  # on the host the range is still checked
        tiny_model()(torch.zeros(1, 4, dtype=torch.long), position_ids=torch.tensor([[0, 1, 2, 5000]]))


def test_a_fused_step_skips_nan_on_the_device_without_a_read():
    """optimizer_step with the fused AdamW (CUDA, MPS, CPU): a NaN gradient leaves weights and states unchanged,
    decided on the device (found_inf), with no read of the verdict; a for-loop AdamW has to read it."""
    model = tiny_model()
    params = [p for p in model.parameters()]
    fused = train.build_optimizer(model, cfg(), "cpu")
    for p in params:
        p.grad = torch.full_like(p, float("nan"))
    before = [p.detach().clone() for p in params]
    with HostReads() as reads:
        norm, finite = train.optimizer_step(fused, params, 1.0)
    assert reads.count == 0 and not bool(finite) and fused.defaults["fused"]
    assert all(torch.equal(a, b) for a, b in zip(before, params))
    plain = torch.optim.AdamW(params, lr=1e-3)
    for p in params:
        p.grad = torch.ones_like(p)
    with HostReads() as reads:
        train.optimizer_step(plain, params, 1.0)
    assert reads.count > 0  # a for-loop AdamW reads the verdict (and its step counts): host syncs every step


def test_build_optimizer_fuses_on_every_device_that_has_the_kernel():
    for device in ("cuda", "mps", "cpu"):
        assert train.build_optimizer(tiny_model(), cfg(), device).defaults["fused"], device


def test_log_every_defaults_to_a_window(monkeypatch):
    """TrainConfig's default reads the device every 10 steps (one stacked .tolist() per window), not every step."""
    assert train.TrainConfig().log_every == 10
    reads, real = [], torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(t.shape) or real(t))
    c = train.TrainConfig(lr=3e-3, warmup_steps=2, max_steps=20, amp="off", progress=False, seed=0)
    df = train.fit(tiny_model(), batches(4), c, device="cpu")
    assert len(df) == 20 and len(reads) == 2  # steps 10 and 20


class FakeMPS(TorchDispatchMode):
    """What MPS refuses, on CPU tensors: every op that makes or takes a float64 tensor fails as MPS fails ("MPS
    framework doesn't support float64"), and every torch.cuda memory call fails as on a Mac without CUDA. torch.mps'
    memory calls answer from a fake driver (7 GiB allocated of 16), its releases counted."""

    def __init__(self, monkeypatch):
        super().__init__()
        self.releases, self.fractions, self.seen_through_another_mode = 0, [], 0
        monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
        for name, fn in {"driver_allocated_memory": lambda: 7 * GiB, "current_allocated_memory": lambda: 3 * GiB,
                         "recommended_max_memory": lambda: 16 * GiB, "empty_cache": self.release,
                         "set_per_process_memory_fraction": self.fractions.append}.items():
            monkeypatch.setattr(torch.mps, name, fn)

        def no_cuda(*a, **kw):
            raise AssertionError("Torch not compiled with CUDA enabled")
        for name in ("empty_cache", "memory_allocated", "max_memory_allocated", "memory_reserved", "memory_stats",
                     "max_memory_reserved", "reset_peak_memory_stats", "mem_get_info", "synchronize"):
            monkeypatch.setattr(torch.cuda, name, no_cuda)

    def release(self) -> None:
        self.releases += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        frame = sys._getframe(1)  # an op that reached MPS through another Python dispatch layer (a per-op cost)
        while frame is not None and not (frame.f_code.co_name == "__torch_dispatch__"
                                         and frame.f_locals.get("self") is not self):
            frame = frame.f_back
        self.seen_through_another_mode += frame is not None
        out = func(*args, **(kwargs or {}))
        if any(isinstance(t, torch.Tensor) and t.dtype == torch.float64 for t in tree_flatten((args, kwargs, out))[0]):
            raise TypeError(f"{func}: Cannot convert a MPS Tensor to float64 dtype as the MPS framework doesn't "
                            f"support float64. Please use float32 instead.")
        return out


def test_fit_runs_through_a_fake_mps_layer(monkeypatch):
    """The loop as it runs on MPS: the controller of pipeline.make_controller for an MPS device (its meter reads the
    fake driver and releases the cache at each check), an out-of-memory error MPS-style at one step (recovered: the
    MPS cache released, never CUDA's), validation, a checkpoint, the log points' reads, all under FakeMPS. What this
    cannot prove: that every op has an MPS kernel (the tensors are CPU tensors), MPS's autocast and fused AdamW
    kernels (tested above as the CPU's), speed, or Metal's real memory counts."""
    mps = FakeMPS(monkeypatch)
    ctl = pipeline.make_controller(torch.device("mps"), max_tokens=64, seq_len=16, pad_id=0)
    assert ctl.meter.budget_bytes == 16 * GiB and not ctl.pin_memory
    model = tiny_model()
    calls = iter(range(1000))

    def oom_once(module, args):
        if next(calls) == 5:
            raise RuntimeError("MPS backend out of memory (MPS allocated: 15.90 GB, other allocations: 0 bytes)")
    model.register_forward_pre_hook(oom_once)
    c = train.TrainConfig(lr=3e-3, warmup_steps=2, max_steps=12, amp="off", progress=False, seed=0,
                          eval_every=6, ckpt_every=6)
    with mps:
        df = train.fit(model, [samples(4, 12) for _ in range(12)], c, device="cpu", controller=ctl,
                       val_batches=batches(1))
    assert len(df) == 12 and df["loss"].map(math.isfinite).all() and df["val_loss"].notna().sum() == 2
    assert [e.kind for e in ctl.events] == ["oom_halve", "grow"]  # 7 of 16 GiB at the check of step 10: room again
    assert mps.releases == 2  # the OOM and that check released the MPS cache (and nothing touched CUDA)
    assert (df["peak_memory_bytes"] == 7 * GiB).all()  # the driver's count: MPS keeps no peak
    assert mps.seen_through_another_mode == 0  # the meter adds nothing per op on MPS (no TorchDispatchMode)
    meter = memory.MemoryMeter("mps", budget_bytes=4 * GiB)
    assert mps.fractions == [0.25] and meter.current() == 3 * GiB  # the allocator enforces the budget


# ------------------------------------------------------------------------------------------ 4. FlexAttention
def packed_batch() -> dict:
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(3, 256, (n,), generator=g) for n in (7, 12, 5, 20, 9, 3)]
    rows, _ = batching.pack_sequences([{"input_ids": d, "labels": d} for d in docs], 24)
    return batching.collate_packed([{k: v[i] for k, v in rows.items()} for i in range(rows["input_ids"].shape[0])],
                                   block_mask="flex")


def test_flex_attention_equals_the_dense_block_mask(monkeypatch):
    """Outputs and gradients through FlexAttention's BlockMask equal the dense (B,1,T,T) mask's. On a CPU torch 2.13
    runs FlexAttention forward only (unfused, eager) and refuses its backward by a device check; the gradients are
    compared with that check lifted: FlexAttention's eager implementation, the one CUDA runs uncompiled."""
    from torch.nn.attention import flex_attention as fa

    batch, model = packed_batch(), tiny_model()
    dense = batching.document_mask(batch["doc_ids"], "dense")
    flex = batching.document_mask(batch["doc_ids"], "flex")
    assert torch.equal(dense, batching.block_causal_mask(batch["doc_ids"])) and not torch.is_tensor(flex)
    assert torch.equal(fa.create_mask(flex.mask_mod, *dense.shape[:1], 1, *dense.shape[2:], device="cpu"), dense)
    monkeypatch.setattr(fa, "_validate_device", lambda *a: None)
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "flex_attention called without torch.compile()"
        for name, mask in (("dense", dense), ("flex", flex)):
            model.zero_grad(set_to_none=True)
            logits = model(batch["input_ids"], attention_mask=mask, position_ids=batch["position_ids"]).logits
            lm_loss(logits, batch["labels"], reduction="sum").backward()
            out[name] = (logits.detach(), [p.grad.clone() for p in model.parameters()])
    torch.testing.assert_close(out["flex"][0], out["dense"][0], rtol=1e-5, atol=1e-5)
    for g_flex, g_dense in zip(out["flex"][1], out["dense"][1]):
        torch.testing.assert_close(g_flex, g_dense, rtol=1e-4, atol=1e-5)


def test_packed_batches_get_their_mask_on_the_device():
    batch, model = packed_batch(), tiny_model().eval()
    assert "attention_mask" not in batch and batch["block_mask"] == "flex"
    with torch.no_grad():
        dense = train.forward_logits(model, {**batch, "block_mask": "auto"})  # a CPU: auto is the dense mask
        made_in_collate = train.forward_logits(model, {**batch, "block_mask": None,
                                                       "attention_mask": batching.block_causal_mask(batch["doc_ids"])})
    assert torch.equal(dense, made_in_collate)
    with pytest.raises(ValueError, match="block_mask='bad'"):
        batching.collate_packed([{k: v[0] for k, v in batch.items() if torch.is_tensor(v)}], block_mask="bad")


def test_auto_masks_packed_rows_with_flex_attention_on_cuda(monkeypatch):
    """document_mask(doc_ids, "auto") on CUDA builds FlexAttention's BlockMask (fake CUDA tensors: shapes on a
    device this machine lacks; create_block_mask stands in); on a CPU the dense mask, the same rows."""
    made = []
    monkeypatch.setattr(fa, "create_block_mask", lambda *a, **kw: made.append(kw["device"]) or "block mask")
    with FakeTensorMode():
        doc_ids = torch.zeros(2, 32, dtype=torch.long, device="cuda")
        assert batching.document_mask(doc_ids, "auto") == "block mask"
    assert [d.type for d in made] == ["cuda"]
    cpu_ids = torch.zeros(2, 32, dtype=torch.long)
    assert torch.equal(batching.document_mask(cpu_ids, "auto"), batching.block_causal_mask(cpu_ids))


def test_flex_attention_runs_compiled_on_cuda(monkeypatch):
    """Attention with a BlockMask on CUDA calls torch.compile(flex_attention) (eager FlexAttention materialises every
    score); on a CPU the eager one. Fake CUDA tensors; torch.compile stands in, recording what it runs on."""
    ran_on = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: lambda q, k, v, **kw2: ran_on.append(q.device.type)
                        or torch.zeros_like(q))
    model_mod.flex_attention_for.cache_clear()
    try:
        config = MiniMindConfig.preset("smoke", vocab_size=256)
        attn, mask = model_mod.Attention(config), fa.create_block_mask(lambda b, h, q, kv: kv <= q, 2, None, 128, 128,
                                                                       device="cpu")
        with FakeTensorMode(allow_non_fake_inputs=True):
            params = {k: torch.empty(v.shape, device="cuda") for k, v in attn.named_parameters()}
            x, cos, sin = (torch.empty(*shape, device="cuda") for shape in ((2, 128, 64), (128, 16), (128, 16)))
            y, _ = functional_call(attn, params, (x, cos, sin, mask))
        assert ran_on == ["cuda"] and y.shape == (2, 128, 64)
        assert model_mod.flex_attention_for("cpu") is fa.flex_attention
    finally:
        model_mod.flex_attention_for.cache_clear()


def test_the_block_mask_is_reused_when_the_lengths_repeat():
    """The mask of packed rows is made from their CPU doc_ids: a batch whose documents have the lengths of a recent
    one gets that mask object back (no rebuild, no host read); other lengths, another mask."""
    a = torch.tensor([[0] * 5 + [1] * 11, [0] * 16])
    first = batching.document_mask(a, "flex", device="cpu")
    assert batching.document_mask(a.clone(), "flex", device="cpu") is first
    other = batching.document_mask(torch.tensor([[0] * 6 + [1] * 10, [0] * 16]), "flex", device="cpu")
    dense = [fa.create_mask(m.mask_mod, 2, 1, 16, 16, device="cpu") for m in (first, other)]
    assert other is not first and torch.equal(dense[0], batching.block_causal_mask(a)) and not torch.equal(*dense)
    batch = {**packed_batch(), "block_mask": "auto"}  # a CPU: dense (FlexAttention has no CPU backward)
    stats = train.accumulate_step(tiny_model(), [batch, batch], device="cpu")  # the loop asks for it per micro-batch
    assert math.isfinite(stats["loss"])


# ------------------------------------------------------------------------------------------ 5. the speed left
def test_chunked_linear_cross_entropy_equals_the_full_logits():
    """model.chunked_lm_loss (the head and the loss a chunk of positions at a time): the same summed loss and the same
    gradients of the hidden states and the (tied) head as lm_loss over the whole logits, for chunks that divide the
    positions, that do not, of one position and of all; ignored labels train nothing."""
    torch.manual_seed(0)
    hidden = torch.randn(3, 17, 32, requires_grad=True)
    weight = (0.1 * torch.randn(50, 32)).requires_grad_()
    labels = torch.randint(0, 50, (3, 17))
    labels[0, 5:], labels[2, :3] = -100, -100
    full = lm_loss(hidden @ weight.T, labels, reduction="sum")
    want = torch.autograd.grad(full, (hidden, weight))
    for chunk in (1, 7, 17, 51, 1000):
        got = model_mod.chunked_lm_loss(hidden, weight, labels, chunk)
        torch.testing.assert_close(got, full, rtol=1e-6, atol=1e-5)
        for g, w in zip(torch.autograd.grad(3 * got, (hidden, weight)), want):
            torch.testing.assert_close(g, 3 * w, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="chunk=0"):
        model_mod.chunked_lm_loss(hidden, weight, labels, 0)


def test_the_loop_with_the_chunked_loss_trains_as_with_the_full_logits():
    """fit with TrainConfig.loss_chunk trains the same losses; a step's peak (MemoryMeter) is lower: the (B, T, V)
    logits never exist."""
    data = batches(4)
    runs = {chunk: train.fit(tiny_model(), data, cfg(log_every=4, loss_chunk=chunk), device="cpu")
            for chunk in (0, 7)}
    torch.testing.assert_close(runs[7]["loss"].to_numpy(), runs[0]["loss"].to_numpy(), rtol=1e-5, atol=0)
    peaks, ids = {}, torch.randint(3, 6400, (4, 64), generator=torch.Generator().manual_seed(0))
    for chunk in (0, 64):
        model, meter = MiniMindForCausalLM(MiniMindConfig.preset("smoke")), memory.MemoryMeter("cpu")
        with meter.track(model):
            train.accumulate_step(model, [{"input_ids": ids, "labels": ids}], device="cpu", loss_chunk=chunk)
        peaks[chunk] = meter.peak()
    assert peaks[64] < 0.6 * peaks[0], peaks
    with pytest.raises(ValueError, match="TrainConfig.loss_chunk=-1"):
        cfg(loss_chunk=-1)


def test_the_chunked_loss_estimate_matches_the_measured_step():
    """estimate_memory's head with the chunked loss against MemoryMeter's count of a real step (fp32 and bf16
    autocast), and the chunked step's peak below the full logits' one."""
    config = MiniMindConfig.preset("smoke")
    for amp in ("off", "bf16"):
        est = memory.estimate_memory(config, 4, 128, amp, logits_held=False, loss_chunk=256)["peak_bytes"]
        got = memory.measure_step_memory(config, 4, 128, amp, logits_held=False, loss_chunk=256)["peak_bytes"]
        full = memory.measure_step_memory(config, 4, 128, amp, logits_held=False)["peak_bytes"]
        assert abs(est / got - 1) < 0.06 and got < 0.6 * full, (amp, est, got, full)


def test_the_gpu_profiles_micro_batch_is_the_planners_choice():
    """The gpu profiles take 64 rows a step in the fewest micro-batches memory.plan_micro_batches fits in 60% of a
    free 16 GB T4 (fp16 there), with the chunked loss: one micro-batch of 64 rows (with the full logits: 2 of 32)."""
    for name in ("gpu", "gpu-check"):
        p = get_profile(name)
        config, rows = MiniMindConfig.preset(p.model), p.batch_size * p.accum_steps
        assert (p.batch_size, p.accum_steps) == memory.plan_micro_batches(config, p.seq_len, rows, GPU_PLAN_BYTES,
                                                                          "fp16", p.loss_chunk) == (64, 1)
        assert memory.plan_micro_batches(config, p.seq_len, rows, GPU_PLAN_BYTES, "fp16") == (32, 2)
        assert p.compile and p.loss_chunk and p.seq_len % p.row_multiple == 0


def test_rows_are_padded_to_a_few_lengths_within_the_budget():
    """Compiled, rows are padded to a multiple of row_multiple (pad_collate), and the controller counts a row at
    that length: rows x padded length stays within max_tokens."""
    mb = pad_collate([{"input_ids": torch.arange(3, 3 + n)} for n in (5, 9)], pad_id=0, seq_len=16, multiple=8)
    assert mb["input_ids"].shape == (2, 16) and (mb["labels"][:, 9:] == -100).all()
    assert pad_collate([{"input_ids": torch.arange(3, 16)}], seq_len=12, multiple=8)["input_ids"].shape == (1, 12)
    ctl = pipeline.make_controller(torch.device("cpu"), max_tokens=64, seq_len=32, pad_id=0, row_multiple=16)
    seen = []
    ctl.run_step([{"input_ids": torch.arange(3, 3 + n)} for n in (17, 9, 9, 3)],
                 lambda micro: seen.extend(mb["input_ids"].shape for mb in micro) or {"loss_sum": 0.0, "n_tokens": 1})
    assert all(t % 16 == 0 and b * t <= 64 for b, t in seen) and sum(b for b, _ in seen) == 4


def test_a_compiled_chunked_bucketed_run_trains_as_the_eager_one(tmp_path, monkeypatch):
    """pipeline.pretrain as the gpu profiles run it (the trunk compiled, the chunked loss, rows padded to a multiple),
    on this CPU in the smoke profile: the same losses as the eager run with the whole logits, to compile's rounding;
    config.json says what ran."""
    runs, compiles, real_compile = {}, [], torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compiles.append(fn) or real_compile(fn, **kw))
    for name, kw in (("eager", dict(compile=False, loss_chunk=0)), ("compiled", dict(compile=True, loss_chunk=96))):
        runs[name] = pipeline.pretrain(out=tmp_path / name, profile=get_profile("smoke", row_multiple=32), steps=3,
                                       max_samples=60, progress=False, sample_every=0, log=lambda m: None, **kw)
    eager, compiled = (runs[n].metrics.query("step >= 0")["loss"].to_numpy() for n in ("eager", "compiled"))
    torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=0)
    assert len(compiles) == 1 and runs["compiled"].config["compile"] == {"trunk": True, "row_multiple": 32}
    assert runs["compiled"].config["train"]["loss_chunk"] == 96 and runs["eager"].config["compile"]["trunk"] is False


# ------------------------------------------------------------------------------------------ 7. a learner's GPU
def test_the_gpu_profile_fits_a_free_t4_by_the_estimate(monkeypatch):
    """A T4 (compute capability 7.5: no bf16): amp="auto" is fp16 + GradScaler, amp="bf16" warns (emulated), and
    estimate_memory puts the gpu profile's step (one micro-batch of 64 rows of 512 tokens, the chunked loss) at under
    80% of its 16 GB."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    amp, gpu = train.resolve_amp("auto", "cuda"), get_profile("gpu")
    est = memory.estimate_memory(MiniMindConfig.preset(gpu.model), gpu.batch_size, gpu.seq_len, amp=amp.name,
                                 accum_steps=gpu.accum_steps, logits_held=False, loss_chunk=gpu.loss_chunk)
    assert amp.name == "fp16" and amp.use_scaler and est["peak_bytes"] < 0.8 * 16e9
    assert round(est["peak_bytes"] / 1e9, 2) == 7.51  # README's T4 row quotes this estimate
    with pytest.warns(UserWarning, match="without bf16 tensor cores.*emulated"):
        assert train.resolve_amp("bf16", "cuda").name == "bf16"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an A100: native bf16, no warning
        train.resolve_amp("bf16", "cuda")


# ------------------------------------------------------------------------------------------ 8. layers
def imports_of(module: str) -> set[str]:
    tree = ast.parse((LIB / f"{module}.py").read_text(encoding="utf-8"))
    return {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level == 1}


def test_lower_layers_do_not_import_higher_ones():
    assert imports_of("model") == set()  # neither the data module nor file writing
    assert "memory" not in imports_of("batching") and "profiles" not in imports_of("device")


def test_the_recorders_checkpoint_hook_only_reads(tmp_path):
    s = pipeline.RunSettings(stage="pretrain", sample_every=1, sample_prompts=("ROMEO.\n",))
    rec = pipeline.Recorder(tmp_path, s, None, None, None, write=True)
    rec(0, {"step": 0, "loss": 1.0, "tokens": 4, "event": "", "skipped": True, "applied": False})
    assert rec.checkpoint_extra() == rec.checkpoint_extra() and rec.samples == []  # no sampling (no model here)
