"""Tests of the training loop: exact accumulation, AMP choice, schedule, optimizer groups, fit, NaN handling."""

from __future__ import annotations

import math

import pytest
import torch

import minimind_lib.device as device_mod
from minimind_lib.checkpoint import DataStream
from minimind_lib.data import pad_collate, trained_tokens
from minimind_lib.model import MiniMindConfig, MiniMindForCausalLM, lm_loss
from minimind_lib.train import (AmpSettings, TrainConfig, accumulate_step, build_optimizer, evaluate, fit,
                                forward_logits, lr_at, optimizer_step, resolve_amp, step_token_count)
from minimind_lib.device import CPU_BF16_MEASURED
from minimind_lib.train import CPU_BF16_MIN_HIDDEN

torch.set_num_threads(1)  # tiny matmuls: one thread is fastest, and the CI machine's 2 cores are shared
VOCAB = 256  # a small vocabulary keeps the LM head (the biggest matmul of the smoke model) cheap


def synthetic_samples(n: int, *, vocab_size: int = VOCAB, min_len: int = 3, max_len: int = 24,
                      seed: int = 0) -> list[dict]:
    """`n` pretrain-style samples of random token ids, lengths spread over [min_len, max_len]."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (n,), generator=g).tolist()
    return [{"input_ids": ids, "labels": ids.clone()} for ids in (torch.randint(3, vocab_size, (m,), generator=g)
                                                                   for m in lengths)]


def collate(samples: list[dict]) -> dict:
    return pad_collate(samples)


def split(samples: list[dict], k: int) -> list[dict]:
    m = len(samples) // k
    return [collate(samples[i * m:(i + 1) * m]) for i in range(k)]


def gradients(model, micro_batches, normalization: str = "token") -> torch.Tensor:
    """The flattened gradient of one step's loss over `micro_batches` (fp32)."""
    model.zero_grad(set_to_none=True)
    accumulate_step(model, micro_batches, normalization=normalization)
    flat = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    model.zero_grad(set_to_none=True)
    return flat


def max_rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def tiny_model(seed: int = 0) -> MiniMindForCausalLM:
    torch.manual_seed(seed)
    return MiniMindForCausalLM(MiniMindConfig.preset("smoke", vocab_size=VOCAB))


def batches(n: int, rows: int = 4, max_len: int = 24, seed: int = 0) -> list[dict]:
    s = synthetic_samples(n * rows, vocab_size=VOCAB, min_len=3, max_len=max_len, seed=seed)
    return [collate(s[i * rows:(i + 1) * rows]) for i in range(n)]


def cfg(**kw) -> TrainConfig:
    # log_every=1: these tests follow each step's callbacks and rollbacks (the default reads the device every 10)
    base = dict(lr=3e-3, warmup_steps=2, max_steps=6, accum_steps=2, amp="off", progress=False, seed=0, log_every=1)
    base.update(kw)
    return TrainConfig(**base)


# ------------------------------------------------------------------------------------------ config, schedule, AMP


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="amp='fp8'"):
        TrainConfig(amp="fp8")
    with pytest.raises(ValueError, match="normalization='mean'"):
        TrainConfig(normalization="mean")
    with pytest.raises(ValueError, match="accum_steps=0"):
        TrainConfig(accum_steps=0)
    with pytest.raises(ValueError, match="lr=0"):
        TrainConfig(lr=0)
    assert TrainConfig(lr=1e-3).min_lr == pytest.approx(1e-4)


def test_from_profile_reads_sizes():
    from minimind_lib.profiles import get_profile

    p = get_profile("smoke")
    c = TrainConfig.from_profile(p, progress=False)
    assert (c.lr, c.max_steps, c.accum_steps) == (p.lr, p.train_steps, p.accum_steps)


def test_lr_schedule_warmup_then_cosine():
    kw = dict(lr=1.0, min_lr=0.1, warmup_steps=4, max_steps=20)
    lrs = [lr_at(s, **kw) for s in range(25)]
    assert lrs[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert lrs[4] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[4:20], lrs[5:21]))  # decays monotonically
    assert lrs[20] == pytest.approx(0.1) and lrs[24] == pytest.approx(0.1)
    assert lr_at(12, **kw) == pytest.approx(0.55)  # half way: the mean of lr and min_lr


def test_resolve_amp(monkeypatch):
    monkeypatch.setattr(device_mod, "bf16_native", lambda d: False)
    assert resolve_amp("auto", "cpu") == AmpSettings(None, False, resolve_amp("auto", "cpu").reason)
    assert "no bf16 instructions on this CPU" in resolve_amp("auto", "cpu").reason  # what decides it, named
    assert resolve_amp("auto", "cuda").dtype == torch.float16 and resolve_amp("auto", "cuda").use_scaler
    assert resolve_amp("auto", "mps").dtype == torch.float16 and resolve_amp("auto", "mps").use_scaler
    assert resolve_amp("auto", "cpu", hidden_size=4096).dtype is None  # no native bf16: fp32 at any size
    monkeypatch.setattr(device_mod, "bf16_native", lambda d: True)
    # bf16 instructions of another kind than the CPU where notebook 05 measured bf16 faster (an AMX Xeon measured it
    # slower; Arm's "bf16" was not measured): fp32 at every size, and the reason says why
    for flags in (("amx_bf16", "avx512_bf16"), ("bf16",), ()):
        monkeypatch.setattr(device_mod, "cpu_native_flags", lambda dtype, flags=flags: flags)
        other = resolve_amp("auto", "cpu", hidden_size=4096)
        assert other.dtype is None and "measured bf16 faster only with avx512_bf16 alone" in other.reason, flags
    monkeypatch.setattr(device_mod, "cpu_native_flags", lambda dtype: CPU_BF16_MEASURED)
    # the measured kind (AVX512-BF16, no AMX): bf16 from CPU_BF16_MIN_HIDDEN (notebook 05's crossover), fp32 below
    assert CPU_BF16_MEASURED == ("avx512_bf16",)
    assert resolve_amp("auto", "cpu", hidden_size=CPU_BF16_MIN_HIDDEN).dtype == torch.bfloat16
    assert resolve_amp("auto", "cpu", hidden_size=512).dtype == torch.bfloat16
    below = resolve_amp("auto", "cpu", hidden_size=64)  # the smoke model
    assert below.dtype is None and not below.use_scaler and "hidden size 64 < 256" in below.reason
    assert "notebook 05's width sweep" in below.reason and "AVX512-BF16" in below.reason  # where the bar was measured
    assert resolve_amp("auto", "cpu").dtype is None and "model size not given" in resolve_amp("auto", "cpu").reason
    assert resolve_amp("auto", "cuda", hidden_size=64).dtype == torch.bfloat16  # CUDA: bf16 whatever the size
    a = resolve_amp("auto", "cuda")
    assert a.dtype == torch.bfloat16 and not a.use_scaler and a.name == "bf16"
    assert resolve_amp("off", "cuda").name == "fp32"
    assert resolve_amp("fp16", "cpu").use_scaler
    with pytest.raises(ValueError, match="amp='int8'"):
        resolve_amp("int8", "cpu")


def test_fit_auto_amp_follows_the_model_size_on_a_bf16_cpu(monkeypatch):
    monkeypatch.setattr(device_mod, "bf16_native", lambda d: True)
    monkeypatch.setattr(device_mod, "cpu_native_flags", lambda dtype: CPU_BF16_MEASURED)  # the kind measured faster
    x = torch.randint(0, 64, (2, 8))
    for hidden, want in ((64, "fp32"), (CPU_BF16_MIN_HIDDEN, "bf16")):
        torch.manual_seed(0)
        model = MiniMindForCausalLM(MiniMindConfig(hidden_size=hidden, num_hidden_layers=1, num_attention_heads=4,
                                                   num_key_value_heads=1, vocab_size=64))
        df = fit(model, [{"input_ids": x, "labels": x}], TrainConfig(lr=1e-3, max_steps=1, accum_steps=1,
                                                                     amp="auto", progress=False), device="cpu")
        assert df.attrs["amp"] == want, (hidden, df.attrs["amp_reason"])


def test_auto_amp_on_a_t4_and_on_mps_from_mocked_capabilities(monkeypatch):
    # the real bf16_native: CUDA reads the compute capability (a T4 is 7.5: no bf16 tensor cores), MPS the support
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    t4 = resolve_amp("auto", "cuda")
    assert (t4.dtype, t4.use_scaler, t4.name) == (torch.float16, True, "fp16") and "GradScaler" in t4.reason
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))  # an A100
    assert (resolve_amp("auto", "cuda").dtype, resolve_amp("auto", "cuda").use_scaler) == (torch.bfloat16, False)
    for supported, want in ((True, (torch.bfloat16, False)), (False, (torch.float16, True))):
        monkeypatch.setattr(device_mod, "bf16_supported", lambda d, supported=supported: supported)
        mps = resolve_amp("auto", "mps")
        assert (mps.dtype, mps.use_scaler) == want, mps


def test_optimizer_step_clips_measures_and_skips_nonfinite():
    w = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.SGD([w], lr=1.0)
    w.grad = torch.full((4,), 3.0)  # norm 6
    norm, finite = optimizer_step(opt, [w], 1.0)
    assert finite and norm == pytest.approx(6.0) and w.grad is None
    assert torch.allclose(w.detach(), torch.full((4,), 1 - 0.5), atol=1e-5)  # clipped to norm 1: each entry 0.5
    w.grad = torch.full((4,), 3.0)
    norm, _ = optimizer_step(opt, [w], None)  # None: measure, do not clip
    assert norm == pytest.approx(6.0) and torch.allclose(w.detach(), torch.full((4,), 0.5 - 3.0))
    before = w.detach().clone()
    w.grad = torch.tensor([1.0, float("nan"), 0.0, 0.0])
    norm, finite = optimizer_step(opt, [w], 1.0)
    assert not finite and math.isnan(norm) and torch.equal(w.detach(), before) and w.grad is None


def test_optimizer_step_with_scaler_unscales_before_clipping():
    w = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=1.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler.scale((w * torch.tensor([3.0, 4.0])).sum()).backward()  # true gradient (3, 4): norm 5
    norm, finite = optimizer_step(opt, [w], 10.0, scaler)
    assert finite and norm == pytest.approx(5.0) and torch.allclose(w.detach(), torch.tensor([-2.0, -3.0]))


def test_forward_logits_equals_the_model_on_a_right_padded_batch():
    model = tiny_model()
    b = batches(1)[0]
    assert torch.allclose(forward_logits(model, b), model(b["input_ids"], attention_mask=b["attention_mask"]).logits)


def test_optimizer_decays_only_2d_weights():
    model = tiny_model()
    opt = build_optimizer(model, cfg(weight_decay=0.1), "cpu")
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() == 2 for p in decay["params"]) and all(p.dim() == 1 for p in no_decay["params"])
    n_unique = len({id(p) for p in model.parameters()})
    assert len(decay["params"]) + len(no_decay["params"]) == n_unique  # tied weight counted once
    assert opt.defaults.get("fused")  # fused AdamW on CPU too (one kernel per group instead of many small ops)


# ------------------------------------------------------------------------------------------ accumulation


def test_token_weighted_accumulation_equals_big_batch_with_varied_lengths():
    model = tiny_model()
    samples = synthetic_samples(8, vocab_size=VOCAB, min_len=2, max_len=40, seed=3)
    assert len({len(s["input_ids"]) for s in samples}) > 4  # lengths really vary
    g_big = gradients(model, [collate(samples)])
    g_acc = gradients(model, split(samples, 4))
    g_naive = gradients(model, split(samples, 4), normalization="naive")
    assert torch.allclose(g_acc, g_big, rtol=1e-4, atol=1e-7)
    assert max_rel_err(g_acc, g_big) < 1e-5
    assert max_rel_err(g_naive, g_big) > 1e-3  # the per-micro-batch mean over-weights short micro-batches


def test_accumulate_step_returns_token_loss():
    model = tiny_model()
    mbs = batches(3)
    n = step_token_count(mbs)
    assert n == sum(int((b["labels"][:, 1:] != -100).sum()) for b in mbs)
    assert n == sum(trained_tokens(b["labels"]) for b in mbs)
    out = accumulate_step(model, mbs)
    with torch.no_grad():
        ref = sum(float(lm_loss(model(b["input_ids"]).logits, b["labels"], reduction="sum")) for b in mbs) / n
    assert out["n_tokens"] == n and out["micro_batches"] == 3
    assert out["loss"] == pytest.approx(ref, rel=1e-5)


def test_accumulate_step_bad_inputs():
    model = tiny_model()
    b = batches(1)[0]
    empty = {**b, "labels": torch.full_like(b["labels"], -100)}
    out = accumulate_step(model, [empty])  # nothing to learn from: no forward, no gradient, the caller skips the step
    assert out["n_tokens"] == 0 and out["empty_micro_batches"] == 1 and math.isnan(out["loss"])
    assert all(p.grad is None for p in model.parameters())
    out = accumulate_step(model, [empty, b])  # the empty micro-batch is not run; the other one trains
    assert out["n_tokens"] == trained_tokens(b["labels"]) and out["empty_micro_batches"] == 1
    with pytest.raises(ValueError, match="no micro-batches"):
        accumulate_step(model, [])
    with pytest.raises(ValueError, match="normalization='x'"):
        accumulate_step(model, [b], normalization="x")


def test_evaluate_is_token_weighted():
    model = tiny_model()
    bs = batches(3)
    ev = evaluate(model, bs)
    with torch.no_grad():
        total = sum(float(lm_loss(model(b["input_ids"]).logits, b["labels"], reduction="sum")) for b in bs)
    assert ev["loss"] == pytest.approx(total / step_token_count(bs), rel=1e-5)
    assert ev["ppl"] == pytest.approx(math.exp(ev["loss"]))
    assert model.training  # restored


def test_data_stream_wraps_epochs_and_resumes():
    s = DataStream([1, 2, 3])
    got = [s.next() for _ in range(5)]
    assert got == [1, 2, 3, 1, 2] and s.state_dict() == {"epoch": 1, "offset": 2}
    t = DataStream([1, 2, 3])
    t.load_state_dict(s.state_dict())
    assert [t.next() for _ in range(3)] == [3, 1, 2]
    with pytest.raises(ValueError, match="empty"):
        DataStream([]).next()


# ------------------------------------------------------------------------------------------ fit


def test_fit_records_metrics_and_learns():
    model = tiny_model()
    data = batches(2)
    df = fit(model, data, cfg(max_steps=12, lr=1e-2), device="cpu", val_batches=data[:1])
    for col in ("step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s", "peak_memory_bytes", "wall_time",
                "skipped", "event", "val_loss", "val_ppl"):
        assert col in df.columns, col
    assert list(df["step"]) == list(range(12))
    assert df["loss"].iloc[-1] < df["loss"].iloc[0] - 0.5
    assert not df["skipped"].any()
    assert df["tokens"].iloc[0] == step_token_count(data)  # 2 micro-batches per step = the whole list
    assert math.isfinite(df["val_loss"].iloc[-1])
    assert df.attrs["amp"] == "fp32"


def test_fit_accepts_a_dataloader_and_wraps_epochs():
    from torch.utils.data import DataLoader

    samples = synthetic_samples(6, vocab_size=VOCAB, min_len=3, max_len=16)
    loader = DataLoader(samples, batch_size=2, collate_fn=collate)  # 3 micro-batches per epoch
    df = fit(tiny_model(), loader, cfg(max_steps=4), device="cpu")  # 8 micro-batches: into the 3rd epoch
    assert len(df) == 4 and df["loss"].map(math.isfinite).all()


def test_fit_with_memory_meter_and_fp16_scaler():
    from minimind_lib.memory import MemoryMeter

    model = tiny_model()
    df = fit(model, batches(2), cfg(max_steps=3, amp="fp16"), device="cpu", meter=MemoryMeter("cpu"))
    assert (df["peak_memory_bytes"] > 0).all()
    assert df["scale"].notna().all() and df.attrs["amp"] == "fp16"


class SplitController:
    """A stand-in for batching.AdaptiveBatchController: splits the step's samples into fixed micro-batches."""

    def __init__(self, rows: int):
        self.rows = rows

    def run_step(self, samples, accumulate_fn):
        mbs = [collate(samples[i:i + self.rows]) for i in range(0, len(samples), self.rows)]
        stats = dict(accumulate_fn(mbs))
        stats["events"] = [f"split_into_{len(mbs)}"]
        stats["micro_batch_size"] = self.rows
        return stats

    def state_dict(self):
        return {"rows": self.rows}

    def load_state_dict(self, state):
        self.rows = state["rows"]


def test_every_callback_runs_and_stop_ends_training():
    calls = []
    df = fit(tiny_model(), batches(2), cfg(max_steps=5), device="cpu",
             callbacks=[lambda step, row: "stop" if step == 1 else None, lambda step, row: calls.append(step)])
    assert df["step"].tolist() == [0, 1] and calls == [0, 1]  # the second callback ran at the stopping step too


def test_fit_with_controller_logs_events():
    samples = synthetic_samples(12, vocab_size=VOCAB, min_len=3, max_len=20)
    steps = [samples[0:6], samples[6:12]]
    df = fit(tiny_model(), steps, cfg(max_steps=2), device="cpu", controller=SplitController(2))
    assert list(df["event"]) == ["split_into_3", "split_into_3"]
    assert list(df["micro_batch_size"]) == [2, 2]
    # the controller's split is exact: same gradients, so same loss as one micro-batch per step
    df1 = fit(tiny_model(), steps, cfg(max_steps=2), device="cpu", controller=SplitController(6))
    assert df["loss"].tolist() == pytest.approx(df1["loss"].tolist(), rel=1e-5)


# ------------------------------------------------------------------------------------------ NaN / inf handling


class PoisonCalls:
    """A forward hook that turns the logits of chosen forward calls into NaN (a diverging step)."""

    def __init__(self, model, calls):
        self.calls, self.n = set(calls), 0
        self.handle = model.lm_head.register_forward_hook(self)

    def __call__(self, module, inputs, output):
        poisoned = self.n in self.calls
        self.n += 1
        return output * float("nan") if poisoned else output


def test_nan_step_is_skipped_and_counted():
    model = tiny_model()
    PoisonCalls(model, calls={4})  # accum 2: forward call 4 is the first micro-batch of step 2
    df = fit(model, batches(2), cfg(max_steps=5), device="cpu")
    assert df["skipped"].tolist() == [False, False, True, False, False]
    assert "nonfinite_loss_skipped" in df["event"].iloc[2]
    assert df.attrs["bad_steps"] == 1 and df.attrs["rollbacks"] == 0
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert df["loss"].drop(index=2).map(math.isfinite).all()


def test_bad_steps_in_a_row_roll_back_and_lower_lr(tmp_path):
    from minimind_lib.checkpoint import read_training_state

    model = tiny_model()
    PoisonCalls(model, calls={3, 4, 5})  # accum 1: steps 3, 4, 5 diverge
    c = cfg(max_steps=6, accum_steps=1, ckpt_every=2, ckpt_dir=str(tmp_path), max_bad_steps=3)
    df = fit(model, batches(3), c, device="cpu")
    assert df.attrs["rollbacks"] == 1 and df.attrs["bad_steps"] == 3
    assert "rollback_to_step_2" in df["event"].iloc[5] and "lr_scale=0.5" in df["event"].iloc[5]
    # after the rollback, steps 2..5 run again at half the scheduled LR
    assert df["step"].tolist() == [0, 1, 2, 3, 4, 5, 2, 3, 4, 5]
    after = df.iloc[6:]
    expected = [0.5 * lr_at(s, lr=c.lr, min_lr=c.min_lr, warmup_steps=c.warmup_steps, max_steps=c.max_steps)
                for s in after["step"]]
    assert after["lr"].tolist() == pytest.approx(expected)
    assert not after["skipped"].any()
    state = read_training_state(tmp_path / "last.pt")
    assert all(torch.isfinite(v).all() for v in state["model"].values())
    assert state["extra"]["lr_scale"] == 0.5  # the lowered LR survives a later resume


def test_no_checkpoint_lowers_lr_and_gives_up_after_max_rollbacks():
    model = tiny_model()
    PoisonCalls(model, calls=set(range(100)))  # every step diverges
    with pytest.raises(RuntimeError, match="training diverged"):
        fit(model, batches(2), cfg(max_steps=20, accum_steps=1, max_bad_steps=2, max_rollbacks=2), device="cpu")
    model = tiny_model()
    PoisonCalls(model, calls={0, 1})
    df = fit(model, batches(2), cfg(max_steps=4, accum_steps=1, max_bad_steps=2), device="cpu")
    assert "no_checkpoint_to_roll_back_to" in df["event"].iloc[1]
    assert df.attrs["final_lr_scale"] == 0.5


def test_fit_with_adaptive_controller_recovers_from_oom():
    """The real batching controller plugged into fit: a tight CPU budget forces OOM, halving, retry."""
    from minimind_lib.batching import AdaptiveBatchController
    from minimind_lib.memory import MemoryMeter

    samples = synthetic_samples(16, vocab_size=VOCAB, min_len=16, max_len=24, seed=1)
    steps = [samples[0:8], samples[8:16]]
    ref = fit(tiny_model(), steps, cfg(max_steps=2), device="cpu", controller=SplitController(8))
    probe = MemoryMeter("cpu")
    model = tiny_model()
    fit(model, steps[:1], cfg(max_steps=1), device="cpu", controller=SplitController(8), meter=probe)
    budget = int(probe.peak() * 0.97)  # just below what a micro-batch of 8 needs
    ctrl = AdaptiveBatchController(8, meter=MemoryMeter("cpu", budget_bytes=budget), collate_fn=collate)
    df = fit(tiny_model(), steps, cfg(max_steps=2), device="cpu", controller=ctrl)
    assert "oom_halve" in df["event"].iloc[0]
    assert ctrl.stats["samples_lost"] == 0 and df["micro_batch_size"].iloc[-1] < 8
    assert df["loss"].tolist() == pytest.approx(ref["loss"].tolist(), rel=1e-5)  # same step, smaller pieces


def test_fit_stops_when_a_generator_runs_out():
    gen = (b for b in batches(3))  # 3 micro-batches, accum 2: one full step, then the generator is spent
    with pytest.warns(UserWarning, match="ran out after 1 of 5 steps; 1 micro-batch"):
        df = fit(tiny_model(), gen, cfg(max_steps=5), device="cpu")
    assert len(df) == 1 and df.attrs["data_exhausted"] and df.attrs["dropped_micro_batches"] == 1


def test_to_device_drops_only_a_right_padded_mask():
    from minimind_lib.train import _to_device

    ids = torch.tensor([[5, 6, 7], [5, 6, 0]])
    right = {"input_ids": ids, "labels": ids, "attention_mask": torch.tensor([[1, 1, 1], [1, 1, 0]])}
    left = {**right, "attention_mask": torch.tensor([[1, 1, 1], [0, 1, 1]])}
    assert "attention_mask" not in _to_device(right, torch.device("cpu"))  # the model would drop it: exact
    assert torch.equal(_to_device(left, torch.device("cpu"))["attention_mask"], left["attention_mask"])
    assert "attention_mask" in right  # the caller's batch is not changed
