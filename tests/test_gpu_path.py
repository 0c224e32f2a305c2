"""The CUDA path, proved without a GPU: a fake CUDA memory API for the controller's checks, pinned batches, the CUDA
set-up, the loop that reads the device only at its log points (and trains bit for bit as a step-by-step loop),
FlexAttention against the dense mask, the memory planner, and the layering of the modules."""

from __future__ import annotations

import ast
import math
import os
import types
import warnings
from pathlib import Path

import pytest
import torch

from minimind_lib import batching, device as device_mod, memory, pipeline, train
from minimind_lib.data import pad_collate
from minimind_lib.model import MiniMindConfig, MiniMindForCausalLM, lm_loss
from minimind_lib.profiles import get_profile

torch.set_num_threads(1)
GiB = 2**30
LIB = Path(__file__).resolve().parents[1] / "minimind_lib"


class FakeCudaMemory:
    """torch.cuda's memory counters on a 16 GiB card, set by the test: allocated, reserved, and what else holds the
    card (the CUDA context, other processes), which only the driver's free memory (mem_get_info) shows."""

    def __init__(self, monkeypatch, total: int = 16 * GiB):
        self.total, self.allocated, self.reserved, self.peak_reserved, self.outside = total, 0, 0, 0, GiB // 2
        for name, fn in {"memory_allocated": lambda d=None: self.allocated,
                         "max_memory_allocated": lambda d=None: self.allocated,
                         "memory_reserved": lambda d=None: self.reserved,
                         "max_memory_reserved": lambda d=None: self.peak_reserved,
                         "reset_peak_memory_stats": lambda d=None: setattr(self, "peak_reserved", self.reserved),
                         "mem_get_info": lambda d=None: (self.total - self.reserved - self.outside, self.total),
                         "get_device_properties": lambda d=None: types.SimpleNamespace(total_memory=self.total),
                         "current_device": lambda: 0, "empty_cache": lambda: None}.items():
            monkeypatch.setattr(torch.cuda, name, fn)
        monkeypatch.setattr(torch.Tensor, "pin_memory", lambda t: t)  # a CPU-only torch cannot pin

    def step(self, allocated: float, reserved: float) -> None:
        """One training step's peaks, in GiB (the loop resets the peaks before each step)."""
        self.allocated, self.reserved = int(allocated * GiB), int(reserved * GiB)
        self.peak_reserved = self.reserved


def samples(n: int, length: int = 16) -> list[dict]:
    return [{"input_ids": torch.arange(3, 3 + length), "labels": torch.arange(3, 3 + length)} for _ in range(n)]


# ------------------------------------------------------------------------------------------ 1. what an OOM depends on
def test_controller_reads_reserved_and_driver_memory_on_cuda(monkeypatch):
    cuda = FakeCudaMemory(monkeypatch)
    ctl = pipeline.make_controller(torch.device("cuda", 0), max_tokens=8 * 16, seq_len=16, pad_id=0)
    assert ctl.meter.budget_bytes == 16 * GiB and ctl.pin_memory
    ctl.check_every = 1
    accumulate = lambda micro: {"loss_sum": 0.0, "n_tokens": 1}  # noqa: E731 - memory is what the fake says
    kinds = []
    # allocated stays at 6 GiB (37% of the card) while reserved grows (a cache fragmented by changing shapes): the
    # controller shrinks when reserved + context pass 80%, before any OOM; reading allocated it never would
    for reserved in (7, 9, 11, 13):
        cuda.step(allocated=6, reserved=reserved)
        kinds += [e.kind for e in ctl.run_step(samples(8), accumulate)["events"]]
    assert kinds == ["shrink"], kinds
    shrink = ctl.events[0]
    assert shrink.peak_bytes == 13 * GiB + GiB // 2 and shrink.max_tokens < 8 * 16
    # reserved falls (cache released), allocated the same: below 50% the micro-batch grows back
    cuda.step(allocated=6, reserved=6.5)
    assert [e.kind for e in ctl.run_step(samples(8), accumulate)["events"]] == ["grow"]
    assert ctl.max_tokens == 8 * 16


def test_each_metrics_row_holds_the_peak_allocated_and_reserved_on_cuda(monkeypatch):
    # the two memory curves --log sends: allocated (what tensors hold) and reserved (plus the allocator's cache);
    # the fake CUDA counters stand behind the run's meter while the model trains on the CPU
    cuda = FakeCudaMemory(monkeypatch)
    meter = memory.MemoryMeter("cuda")
    run = train._Run(tiny_model(), batches(2), cfg(accum_steps=1), torch.device("cpu"), None, meter, True)
    cuda.step(allocated=6, reserved=9)
    row = run.train_step()
    assert (meter.peak(), meter.peak_reserved()) == (6 * GiB, 9 * GiB)
    assert (row["peak_memory_bytes"], row["peak_reserved_bytes"]) == (6 * GiB, 9 * GiB)
    assert memory.MemoryMeter("cpu").peak_reserved() == 0  # a CPU: peak(), no cache to add


def test_peak_in_use_reads_the_mps_driver(monkeypatch):
    monkeypatch.setattr(torch.mps, "driver_allocated_memory", lambda: 7 * GiB)
    monkeypatch.setattr(torch.mps, "recommended_max_memory", lambda: 10 * GiB)
    meter = memory.MemoryMeter("mps")
    assert meter.peak_in_use() == 7 * GiB and device_mod.total_memory_bytes(torch.device("mps")) == 10 * GiB
    assert memory.MemoryMeter("cpu").peak_in_use() == 0  # a CPU: the tracked live bytes, as peak()


# ------------------------------------------------------------------------------------------ 3. pinned batches, TF32
def test_batches_are_pinned_on_cuda_only(monkeypatch):
    FakeCudaMemory(monkeypatch)
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
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("MINIMIND_DEVICE", raising=False)
    tf32, torch.backends.cuda.matmul.allow_tf32 = torch.backends.cuda.matmul.allow_tf32, False
    try:
        assert device_mod.get_device().type == "cuda"
        assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
        assert torch.backends.cuda.matmul.allow_tf32  # fp32 matmuls on TF32 tensor cores
        monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128")  # the user's setting stays
        device_mod.get_device()
        assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:128"
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


# ------------------------------------------------------------------------------------------ 7. a learner's GPU
def test_the_gpu_profile_fits_a_free_t4_by_the_estimate(monkeypatch):
    """A T4 (compute capability 7.5: no bf16): amp="auto" is fp16 + GradScaler, and estimate_memory puts the gpu
    profile's step (32 rows of 512 tokens, 2 micro-batches, logits not held) at under 80% of its 16 GB."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    amp, gpu = train.resolve_amp("auto", "cuda"), get_profile("gpu")
    est = memory.estimate_memory(MiniMindConfig.preset(gpu.model), gpu.batch_size, gpu.seq_len, amp=amp.name,
                                 accum_steps=gpu.accum_steps, logits_held=False)
    assert amp.name == "fp16" and amp.use_scaler and est["peak_bytes"] < 0.8 * 16e9
    assert round(est["peak_bytes"] / 1e9, 2) == 5.18  # README's T4 row quotes this estimate


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
