"""Tests of minimind_lib.batching: token-budget sampler, packing and masks, adaptive controller."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.batching import StepSamples
from minimind_lib.batching import (
    AdaptiveBatchController,
    PackedDataset,
    TokenBudgetBatchSampler,
    TokenBudgetSteps,
    block_causal_mask,
    collate_packed,
    fill_batches,
    is_oom_error,
    pack_sequences,
    sort_megabatches,
    split_step,
    step_groups,
)
from minimind_lib.data import pad_collate, padding_fraction

# --------------------------------------------------------------------------------------------
# TokenBudgetBatchSampler
# --------------------------------------------------------------------------------------------


def _lengths(n: int = 500, seed: int = 0, hi: int = 300) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(2, hi, size=n)


def test_each_sample_exactly_once_and_budget_kept():
    lengths = _lengths()
    s = TokenBudgetBatchSampler(lengths, max_tokens=1024, seed=1)
    batches = list(s)
    flat = [i for b in batches for i in b]
    assert sorted(flat) == list(range(len(lengths)))
    for b in batches:
        assert len(b) * max(lengths[b]) <= 1024
    assert len(s) == len(batches) == s.stats["n_batches"]


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 400), min_size=1, max_size=200),
    max_tokens=st.integers(1, 1500),
    max_bs=st.one_of(st.none(), st.integers(1, 20)),
    seq_len=st.one_of(st.none(), st.integers(1, 400)),
    seed=st.integers(0, 5),
    mult=st.integers(1, 8),
)
def test_property_budget_and_coverage(lengths, max_tokens, max_bs, seq_len, seed, mult):
    s = TokenBudgetBatchSampler(
        lengths, max_tokens, max_batch_size=max_bs, seed=seed, megabatch_mult=mult,
        seq_len=seq_len,
    )
    cap = max_tokens if seq_len is None else min(max_tokens, seq_len)
    assert s.longest_row == cap
    batches = list(s)
    flat = sorted(i for b in batches for i in b)
    over = [i for i, n in enumerate(lengths) if n > cap]
    assert flat == list(range(len(lengths)))
    assert s.stats["n_truncated"] == len(over) == len(s.truncated_indices)
    for b in batches:
        assert b, "no empty batch"
        eff = [min(lengths[i], cap) for i in b]
        assert len(b) * max(eff) <= max_tokens
        if max_bs is not None:
            assert len(b) <= max_bs


def test_deterministic_and_epochs_differ():
    lengths = _lengths()
    a = list(TokenBudgetBatchSampler(lengths, 1024, seed=3))
    b = list(TokenBudgetBatchSampler(lengths, 1024, seed=3))
    assert a == b
    s = TokenBudgetBatchSampler(lengths, 1024, seed=3)
    s.set_epoch(1)
    e1 = list(s)
    assert e1 != a
    assert sorted(i for x in e1 for i in x) == list(range(len(lengths)))
    assert list(TokenBudgetBatchSampler(lengths, 1024, seed=4)) != a


def test_sorting_inside_megabatches_reduces_padding():
    lengths = _lengths(2000)
    s = TokenBudgetBatchSampler(lengths, 2048, seed=0)
    grouped = s.stats["padding_fraction"]
    # Random batches of the same mean row count, for comparison.
    rng = np.random.default_rng(0)
    perm = rng.permutation(len(lengths))
    rows = int(np.mean([len(b) for b in s]))
    random_batches = [lengths[perm[i : i + rows]] for i in range(0, len(perm), rows)]
    assert grouped < 0.05 < padding_fraction(random_batches)


def test_no_shuffle_is_sorted_descending():
    lengths = [5, 1, 9, 3, 7]
    s = TokenBudgetBatchSampler(lengths, max_tokens=9, shuffle=False)
    assert list(s) == [[2], [4], [0], [3, 1]]


def test_resume_mid_epoch_gives_remaining_batches():
    """checkpoint.DataStream resumes a DataLoader over the sampler mid-epoch by skipping: the epoch order is deterministic."""
    from minimind_lib.checkpoint import DataStream

    lengths = _lengths()
    s = TokenBudgetBatchSampler(lengths, 1024, seed=7)
    loader = torch.utils.data.DataLoader(range(len(lengths)), batch_sampler=s, collate_fn=list)
    stream = DataStream(loader)
    first_epoch = [stream.next() for _ in range(len(s))]
    assert sorted(i for b in first_epoch for i in b) == list(range(len(lengths)))
    seen = [stream.next() for _ in range(5)]  # 5 batches into epoch 1
    state = stream.state_dict()
    assert state == {"epoch": 1, "offset": 5}
    fresh = TokenBudgetBatchSampler(lengths, 1024, seed=7)
    resumed = DataStream(torch.utils.data.DataLoader(range(len(lengths)), batch_sampler=fresh, collate_fn=list))
    resumed.load_state_dict(state)
    rest = [resumed.next() for _ in range(len(s) - 5)]
    assert seen + rest == [list(b) for b in s.batches(1)] != first_epoch


def test_over_long_samples_truncated_and_counted():
    lengths = [10, 50, 200, 30]
    s = TokenBudgetBatchSampler(lengths, max_tokens=100)
    assert s.truncated_indices == [2]
    assert s.stats["n_truncated"] == 1 and s.stats["tokens_truncated"] == 100
    assert sorted(i for b in s for i in b) == [0, 1, 2, 3]
    r = TokenBudgetBatchSampler(lengths, max_tokens=100, seq_len=40)
    assert r.truncated_indices == [1, 2] and r.stats["tokens_truncated"] == 10 + 160 and r.longest_row == 40
    assert all(len(b) * max(min(lengths[i], 40) for i in b) <= 100 for b in r)


def test_megabatches_sorted_and_fill_greedy():
    lengths = np.array([5, 1, 9, 3, 7, 2])
    megas = sort_megabatches(np.array([0, 1, 2, 3, 4, 5]), lengths, size=4)
    assert [m.tolist() for m in megas] == [[2, 0, 3, 1], [4, 5]]
    assert fill_batches([2, 0, 3, 1], lengths, max_tokens=10) == [[2], [0, 3], [1]]  # 2 x 5 fits, 3 x 5 not
    assert fill_batches([1, 3, 0], lengths, max_tokens=None, max_batch_size=2) == [[1, 3], [0]]
    assert fill_batches([1, 2], lengths, max_tokens=4) == [[1], [2]]  # 9 > 4: alone, never dropped


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(lengths=[3, 0, 2], max_tokens=10), r"lengths\[1\] = 0"),
        (dict(lengths=[[1, 2]], max_tokens=10), "1-D"),
        (dict(lengths=[1.5, 2.0], max_tokens=10), "integers"),
        (dict(lengths=[3], max_tokens=0), "max_tokens must be >= 1"),
        (dict(lengths=[3], max_tokens=10, max_batch_size=0), "max_batch_size"),
        (dict(lengths=[3], max_tokens=10, seq_len=0), "seq_len must be >= 1"),
        (dict(lengths=[3], max_tokens=10, megabatch_mult=0), "megabatch_mult"),
    ],
)
def test_sampler_bad_inputs(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TokenBudgetBatchSampler(**kwargs)


def test_works_with_dataloader_and_pad_collate():
    samples = [{"input_ids": torch.arange(n) + 3, "labels": torch.arange(n) + 3} for n in (4, 9, 2, 7, 12)]
    s = TokenBudgetBatchSampler([len(x["input_ids"]) for x in samples], max_tokens=16, seq_len=8, seed=0)
    assert s.longest_row == 8 and s.truncated_indices == [1, 4]
    dl = torch.utils.data.DataLoader(samples, batch_sampler=s, collate_fn=lambda b: pad_collate(b, seq_len=s.longest_row))
    seen = []
    for batch in dl:
        B, T = batch["input_ids"].shape
        assert B * T <= 16
        assert (batch["labels"][batch["attention_mask"] == 0] == -100).all()
        seen += [row[:n].tolist() for row, n in zip(batch["input_ids"], batch["attention_mask"].sum(1))]
    assert sorted(seen) == sorted([list(range(3, 3 + min(n, 8))) for n in (4, 9, 2, 7, 12)])  # long ones cut to 8


# --------------------------------------------------------------------------------------------
# Packing
# --------------------------------------------------------------------------------------------


def _doc(start: int, n: int, masked_prefix: int = 0) -> dict:
    ids = torch.arange(start, start + n)
    labels = ids.clone()
    labels[:masked_prefix] = -100
    return {"input_ids": ids, "labels": labels}


def test_pack_stream_layout_labels_positions():
    docs = [_doc(10, 3), _doc(20, 4), _doc(30, 5)]  # 12 tokens into rows of 5
    rows, stats = pack_sequences(docs, 5, pad_id=0)
    assert rows["input_ids"].tolist() == [[10, 11, 12, 20, 21], [22, 23, 30, 31, 32], [33, 34, 0, 0, 0]]
    assert rows["doc_ids"].tolist() == [[0, 0, 0, 1, 1], [0, 0, 1, 1, 1], [0, 0, -1, -1, -1]]
    assert rows["position_ids"].tolist() == [[0, 1, 2, 0, 1], [0, 1, 0, 1, 2], [0, 1, 0, 0, 0]]
    assert rows["labels"].tolist() == [
        [-100, 11, 12, -100, 21], [-100, 23, -100, 31, 32], [-100, 34, -100, -100, -100]
    ]
    assert (stats.n_docs, stats.n_rows, stats.n_split, stats.n_pad, stats.n_tokens) == (3, 3, 2, 3, 12)
    assert stats.padding_fraction == pytest.approx(3 / 15)


def test_pack_keeps_sft_label_mask():
    rows, _ = pack_sequences([_doc(10, 4, masked_prefix=2), _doc(20, 3)], 8)
    assert rows["labels"][0].tolist() == [-100, -100, 12, 13, -100, 21, 22, -100]


def test_pack_bad_inputs():
    with pytest.raises(ValueError, match="seq_len must be >= 2"):
        pack_sequences([_doc(0, 3)], 1)
    with pytest.raises(ValueError, match="1-D input_ids"):
        pack_sequences([{"input_ids": torch.zeros(2, 2, dtype=torch.long)}], 4)
    with pytest.raises(ValueError, match="doc_ids must be"):
        block_causal_mask(torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="empty list"):
        collate_packed([])


def test_block_causal_mask_values():
    doc = torch.tensor([[0, 0, 1, 1, -1]])
    m = block_causal_mask(doc)
    assert m.shape == (1, 1, 5, 5) and m.dtype == torch.bool
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0],
            [1, 1, 0, 0, 0],
            [0, 0, 1, 0, 0],
            [0, 0, 1, 1, 0],
            [0, 0, 0, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(m[0, 0], expected)


def test_packed_dataset_and_collate():
    ds = PackedDataset([_doc(10 + 10 * i, 3 + i) for i in range(6)], 8)
    assert len(ds) == ds.stats.n_rows and ds.lengths.tolist() == [8] * len(ds)
    batch = collate_packed([ds[i] for i in range(len(ds))])
    assert batch["attention_mask"].shape == (len(ds), 1, 8, 8)
    assert "attention_mask" not in collate_packed([ds[0]], block_mask=False)


def test_sdpa_block_mask_equals_separate_documents():
    torch.manual_seed(0)
    doc = torch.tensor([[0] * 5 + [1] * 7 + [2] * 4])
    q, k, v = (torch.randn(1, 2, 16, 8) for _ in range(3))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=block_causal_mask(doc))
    for lo, hi in [(0, 5), (5, 12), (12, 16)]:
        ref = torch.nn.functional.scaled_dot_product_attention(
            q[:, :, lo:hi], k[:, :, lo:hi], v[:, :, lo:hi], is_causal=True
        )
        torch.testing.assert_close(out[:, :, lo:hi], ref)


def test_model_no_cross_document_attention():
    model_mod = pytest.importorskip("minimind_lib.model")
    torch.manual_seed(0)
    model = model_mod.MiniMindForCausalLM(model_mod.MiniMindConfig.preset("smoke")).eval()
    a, b = _doc(5, 9), _doc(40, 7)
    a2 = _doc(100, 9)  # a different first document of the same length
    rows1, _ = pack_sequences([a, b], 16)
    rows2, _ = pack_sequences([a2, b], 16)
    with torch.no_grad():
        def logits(rows, mask=True):
            batch = collate_packed([{k: v[0] for k, v in rows.items()}], block_mask=mask)
            return model(batch["input_ids"], attention_mask=batch.get("attention_mask"),
                         position_ids=batch["position_ids"]).logits[0]
        l1, l2 = logits(rows1), logits(rows2)
        # document 2 (positions 9..15) does not see document 1 ...
        torch.testing.assert_close(l1[9:], l2[9:])
        # ... and equals document 2 run alone
        alone = model(b["input_ids"][None]).logits[0]
        torch.testing.assert_close(l1[9:], alone, atol=1e-5, rtol=1e-4)
        # without the block mask it does see document 1
        assert not torch.allclose(logits(rows1, mask=False)[9:], logits(rows2, mask=False)[9:])


# --------------------------------------------------------------------------------------------
# AdaptiveBatchController
# --------------------------------------------------------------------------------------------


def _samples(n: int, length: int = 10, start: int = 0) -> list[dict]:
    return [{"input_ids": torch.full((length,), start + i), "labels": torch.full((length,), start + i)} for i in range(n)]


class FakeTrainer:
    """accumulate_fn stand-in: OOMs when a micro-batch has more than `limit` padded tokens; records what succeeded."""

    def __init__(self, limit: int, error: type = RuntimeError, msg: str = "CUDA out of memory. Tried to allocate"):
        self.limit, self.error, self.msg = limit, error, msg
        self.seen: list[int] = []
        self.zeroed = 0
        self.calls = 0

    def __call__(self, micro_batches):
        self.calls += 1
        ids = []
        for mb in micro_batches:
            if mb["input_ids"].numel() > self.limit:
                raise self.error(self.msg)
            ids += mb["input_ids"][:, 0].tolist()
        self.seen += ids  # only a whole successful step counts
        return {"loss_sum": 1.0, "n_tokens": int(sum(mb["attention_mask"].sum() for mb in micro_batches))}

    def zero_grad(self):
        self.zeroed += 1


def test_oom_halves_and_retries_same_samples():
    fake = FakeTrainer(limit=30)  # 3 rows of 10 tokens fit, 4 do not
    ctl = AdaptiveBatchController(16, zero_grad=fake.zero_grad)
    all_ids = []
    for step in range(5):
        batch = _samples(16, start=100 * step)
        all_ids += [100 * step + i for i in range(16)]
        out = ctl.run_step(batch, fake)
        assert out["n_tokens"] == 160
    assert sorted(fake.seen) == sorted(all_ids)  # no sample lost or seen twice
    assert ctl.micro_batch_size == 2  # 16 -> 8 -> 4 -> 2
    kinds = [e.kind for e in ctl.events]
    assert kinds == ["oom_halve"] * 3
    assert fake.zeroed == 3 and ctl.stats["oom_events_recovered"] == 3 and ctl.stats["samples_lost"] == 0
    assert [(e.step, e.micro_batch_size, e.accum_steps) for e in ctl.events] == [(0, 8, 2), (0, 4, 4), (0, 2, 8)]
    assert "out of memory" in ctl.events[0].message and ctl.events[0].max_tokens is None


def test_oom_after_max_retries_cuts_seq_len_and_counts():
    fake = FakeTrainer(limit=24, msg="DefaultCPUAllocator: can't allocate memory: you tried to allocate 123 bytes")
    ctl = AdaptiveBatchController(4, max_retries=1, zero_grad=fake.zero_grad)
    out = ctl.run_step(_samples(4, length=20), fake)
    # 4x20 -> halve to 2 (2x20 > 24) -> retries used up: cut 20 -> 16 (2x16 > 24) -> halve to 1 (1x16 fits)
    assert [e.kind for e in ctl.events] == ["oom_halve", "oom_seq_cut", "oom_halve"]
    assert (ctl.seq_len, ctl.micro_batch_size) == (16, 1)
    assert ctl.n_truncated == 4 and ctl.tokens_truncated == 4 * 4
    assert sorted(fake.seen) == [0, 1, 2, 3] and out["seq_len"] == ctl.seq_len


def test_oom_gives_up_below_min_seq_len():
    fake = FakeTrainer(limit=0)
    ctl = AdaptiveBatchController(2, max_retries=1, min_seq_len=4)
    with pytest.raises(RuntimeError, match="below min_seq_len=4"):
        ctl.run_step(_samples(2, length=10), fake, zero_grad=fake.zero_grad)


def test_oom_without_zero_grad_is_an_error_not_silent():
    with pytest.raises(RuntimeError, match="pass zero_grad=model"):
        AdaptiveBatchController(4).run_step(_samples(4), FakeTrainer(limit=10))


def test_non_oom_errors_propagate():
    fake = FakeTrainer(limit=0, error=ValueError, msg="bad labels")
    ctl = AdaptiveBatchController(2)
    with pytest.raises(ValueError, match="bad labels"):
        ctl.run_step(_samples(2), fake)
    assert ctl.events == []


@pytest.mark.parametrize(
    "err, expected",
    [
        (RuntimeError("CUDA out of memory."), True),
        (RuntimeError("[enforce fail at alloc_cpu.cpp] DefaultCPUAllocator: can't allocate memory"), True),
        (torch.OutOfMemoryError("x"), True),
        (MemoryError(), True),
        (RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"), True),
        (RuntimeError("shape mismatch"), False),
        (ValueError("out of memory"), False),
    ],
)
def test_is_oom_error(err, expected):
    assert is_oom_error(err) is expected


class FakeMeter:
    def __init__(self, budget):
        self.budget_bytes = budget
        self.value = 0
        self.resets = 0

    def peak(self):
        return self.value

    def reset_peak(self):
        self.resets += 1


def test_high_water_shrinks_low_water_grows_back_effective_batch_unchanged():
    meter = FakeMeter(1000)  # the loop resets its peak each step; here the test sets it by hand
    fake = FakeTrainer(limit=10**9)
    ctl = AdaptiveBatchController(10, meter=meter, check_every=2, high_water=0.8, low_water=0.5)
    meter.value = 900
    ctl.run_step(_samples(20), fake)
    meter.value = 100  # the window's highest per-step peak counts, not the last one
    for _ in range(1):
        out = ctl.run_step(_samples(20), fake)
    assert ctl.micro_batch_size == 8 and ctl.events[-1].kind == "shrink"
    out = ctl.run_step(_samples(20), fake)
    assert out["accum_steps"] == 3 and out["n_tokens"] == 200  # 8+8+4 rows: same samples, more accumulation
    meter.value = 300
    ctl.run_step(_samples(20), fake)
    assert ctl.micro_batch_size == 10 and ctl.events[-1].kind == "grow"
    meter.value = 450  # 450/1000 < low water, but 450*12/10 ... already at max_micro_batch: no growth beyond start
    ctl.run_step(_samples(20), fake)
    ctl.run_step(_samples(20), fake)
    assert ctl.micro_batch_size == 10
    assert meter.resets == 0  # the controller never resets the loop's meter outside an OOM
    assert [(e.kind, e.step, e.peak_bytes, e.budget_bytes) for e in ctl.events] == [("shrink", 2, 900, 1000),
                                                                                    ("grow", 4, 300, 1000)]


def test_controller_state_roundtrip():
    fake = FakeTrainer(limit=30)
    ctl = AdaptiveBatchController(16, seq_len=64, zero_grad=fake.zero_grad)
    out = ctl.run_step(_samples(16), fake)
    assert [str(e) for e in out["events"]][0] == "oom_halve(micro 8, accum 2, seq_len 64)"
    state = ctl.state_dict()
    other = AdaptiveBatchController(16)
    other.load_state_dict(state)
    assert other.state_dict() == state
    assert other.micro_batch_size == 2 and other.step == 1 and len(other.events) == 3
    with pytest.raises(ValueError, match="missing keys"):
        other.load_state_dict({"step": 1})


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(), "micro_batch_size and/or max_tokens"),
        (dict(micro_batch_size=0), "needs micro_batch_size >= 1; got micro_batch_size=0"),
        (dict(max_tokens=0), "needs max_tokens >= 1; got micro_batch_size=None, max_tokens=0"),
        (dict(micro_batch_size=2, check_every=0), "check_every"),
        (dict(micro_batch_size=2, high_water=0.5, low_water=0.6), "low_water < high_water"),
        (dict(micro_batch_size=2, shrink=1.0), "shrink"),
        (dict(micro_batch_size=2, seq_cut=0), "seq_cut"),
        (dict(micro_batch_size=2, max_retries=-1), "max_retries"),
    ],
)
def test_controller_bad_inputs(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AdaptiveBatchController(**kwargs)


def test_run_step_empty():
    with pytest.raises(ValueError, match="no samples"):
        AdaptiveBatchController(2).run_step([], FakeTrainer(10))


def test_step_samples_source():
    ds = _samples(10)
    src = StepSamples(ds, 4, seed=0)
    steps = list(src)
    assert [len(x) for x in steps] == [4, 4, 2] and len(src) == 3
    ids = sorted(int(s["input_ids"][0]) for st_ in steps for s in st_)
    assert ids == list(range(10))
    assert [[int(s["input_ids"][0]) for s in x] for x in steps] == [[int(s["input_ids"][0]) for s in x] for x in src]
    src.set_epoch(1)
    assert [[int(s["input_ids"][0]) for s in x] for x in src] != [[int(s["input_ids"][0]) for s in x] for x in steps]
    with pytest.raises(ValueError, match="samples_per_step >= 1"):
        StepSamples(ds, 0)
    with pytest.raises(ValueError, match="non-empty dataset"):
        StepSamples([], 2)


def test_controller_state_survives_weights_only_checkpoint(tmp_path):
    fake = FakeTrainer(limit=30)
    ctl = AdaptiveBatchController(16, zero_grad=fake.zero_grad)
    ctl.run_step(_samples(16), fake)
    torch.save({"controller": ctl.state_dict()}, tmp_path / "c.pt")
    other = AdaptiveBatchController(16)
    other.load_state_dict(torch.load(tmp_path / "c.pt", weights_only=True)["controller"])
    assert other.state_dict() == ctl.state_dict()


def test_controller_with_real_fit_recovers_from_tiny_memory_budget():
    model_mod = pytest.importorskip("minimind_lib.model")
    memory = pytest.importorskip("minimind_lib.memory")
    train = pytest.importorskip("minimind_lib.train")
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    ds = []
    for i in range(48):
        ids = torch.randint(3, 6400, (int(torch.randint(20, 50, (1,), generator=g)),), generator=g)
        ds.append({"input_ids": ids, "labels": ids.clone(), "sid": i})

    def collate(batch):
        return {**pad_collate(batch), "sid": [s["sid"] for s in batch]}

    class Recording(AdaptiveBatchController):
        """Records the sample ids of successful attempts only."""

        def run_step(self, step_samples, accumulate_fn, zero_grad=None):
            def recorded(micro):
                out = accumulate_fn(micro)
                self.recorded += [i for mb in micro for i in mb["sid"]]
                return out

            return super().run_step(step_samples, recorded, zero_grad)

    def run(mbs, budget, steps):
        torch.manual_seed(0)
        model = model_mod.MiniMindForCausalLM(model_mod.MiniMindConfig.preset("smoke"))
        meter = memory.MemoryMeter("cpu", budget_bytes=budget)
        ctl = Recording(mbs, meter=meter, zero_grad=model, check_every=1, collate_fn=collate)
        ctl.recorded = []
        cfg = train.TrainConfig(max_steps=steps, lr=1e-3, warmup_steps=1, amp="off", progress=False)
        df = train.fit(model, StepSamples(ds, 16, seed=0), cfg, device="cpu", controller=ctl)
        return df, ctl

    free8, _ = run(8, None, 2)
    free2, _ = run(2, None, 2)
    budget = int((free8["peak_memory_bytes"].max() + free2["peak_memory_bytes"].max()) / 2)
    df, ctl = run(8, budget, 3)
    assert ctl.stats["oom_events_recovered"] >= 1 and ctl.micro_batch_size < 8
    assert "oom_halve" in ";".join(df["event"])
    assert sorted(ctl.recorded) == list(range(48))  # 3 steps x 16: every sample once, none twice
    assert ctl.stats["samples_lost"] == 0
    assert (df["peak_memory_bytes"] <= budget).all()
    # exact token-weighted accumulation: the loss does not depend on the micro-batch split
    np.testing.assert_allclose(df["loss"].iloc[:2], free8["loss"], rtol=1e-5)


# --------------------------------------------------------------------------------------------
# Token-budget steps: the pipeline's micro-batches through the controller
# --------------------------------------------------------------------------------------------


def _varied(n: int, seed: int = 0, lo: int = 3, hi: int = 40) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        ids = torch.randint(3, 200, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g)
        out.append({"input_ids": ids, "labels": ids.clone(), "sid": i})
    return out


def test_step_groups_flat_and_nested():
    a, b, c = _samples(3)
    assert step_groups([a, b, c]) == [[a, b, c]]
    assert step_groups([[a, b], [], [c]]) == [[a, b], [c]]
    with pytest.raises(ValueError, match="no samples"):
        step_groups([[], []])


def test_token_budget_steps_are_the_dataloaders_micro_batches():
    ds = _varied(60)
    sampler = TokenBudgetBatchSampler([len(s["input_ids"]) for s in ds], max_tokens=64, seq_len=32, seed=3)
    steps = TokenBudgetSteps(ds, sampler, accum_steps=3)
    loader = [[s["sid"] for s in mb] for mb in torch.utils.data.DataLoader(ds, batch_sampler=sampler, collate_fn=list)]
    got = [[[s["sid"] for s in mb] for mb in step] for step in steps]
    assert [mb for step in got for mb in step] == loader and len(got) == len(steps) == -(-len(loader) // 3)
    assert all(len(step) == 3 for step in got[:-1])
    steps.set_epoch(1)
    assert sampler.epoch == 1 and [[[s["sid"] for s in mb] for mb in step] for step in steps] != got
    # resumable: checkpoint.DataStream skips steps of the (deterministic) epoch, and set_epoch reaches the sampler
    from minimind_lib.checkpoint import DataStream

    def ids(step):
        return [[s["sid"] for s in mb] for mb in step]

    fresh = lambda: TokenBudgetSteps(ds, TokenBudgetBatchSampler([len(s["input_ids"]) for s in ds], 64, seq_len=32,
                                                                 seed=3), accum_steps=3)
    stream = DataStream(fresh())
    seen = [ids(stream.next()) for _ in range(len(got) + 2)]  # into epoch 1
    assert seen[:len(got)] == got and seen[len(got)] == [[i for i in b] for b in sampler.batches(1)[:3]]
    resumed = DataStream(fresh())
    resumed.load_state_dict({"epoch": 1, "offset": 1})
    assert ids(resumed.next()) == seen[-1]
    with pytest.raises(ValueError, match="accum_steps must be >= 1"):
        TokenBudgetSteps(ds, sampler, 0)
    with pytest.raises(ValueError, match="this dataset's lengths"):
        TokenBudgetSteps(ds[:10], sampler, 2)


def test_token_mode_keeps_fitting_micro_batches_and_resplits_after_oom():
    ds = _varied(40, seed=1)
    sampler = TokenBudgetBatchSampler([len(s["input_ids"]) for s in ds], max_tokens=96, seq_len=32, seed=0)
    step = next(iter(TokenBudgetSteps(ds, sampler, accum_steps=4)))
    assert split_step(step_groups(step), None, 96, 32) == step  # no pressure: the sampler's micro-batches, untouched
    assert all(len(mb) * max(min(len(s["input_ids"]), 32) for s in mb) <= 40 for mb in split_step(step, None, 40, 32)
               if len(mb) > 1)
    fake = FakeTrainer(limit=40)  # a micro-batch of more than 40 padded tokens "runs out of memory"
    fake_ids = []  # the sample ids of successful steps (the fake records input_ids[:, 0])

    def accumulate(micro):
        out = fake(micro)
        fake_ids.extend(i for mb in micro for i in mb["sid"])
        return out

    ctl = AdaptiveBatchController(max_tokens=96, seq_len=32, zero_grad=fake.zero_grad,
                                  collate_fn=lambda b: {**pad_collate(b), "sid": [s["sid"] for s in b]})
    out = ctl.run_step(step, accumulate)
    assert sorted(fake_ids) == sorted(s["sid"] for mb in step for s in mb)  # every sample once, none twice
    assert ctl.max_tokens <= 48 and ctl.micro_batch_size is None and out["accum_steps"] > len(step)
    assert {e.kind for e in ctl.events} == {"oom_halve"} and ctl.stats["samples_lost"] == 0


def test_seq_len_cut_comes_back_when_memory_is_low():
    meter = FakeMeter(1000)
    fake = FakeTrainer(limit=30)
    ctl = AdaptiveBatchController(2, meter=meter, check_every=1, max_retries=0, zero_grad=fake.zero_grad)
    meter.value = 600  # between the water marks: no shrink, no growth
    ctl.run_step(_samples(1, length=40), fake)  # one row of 40 > 30: no halving possible, cut 40 -> 32 -> 25
    assert [e.kind for e in ctl.events] == ["oom_seq_cut", "oom_seq_cut"] and ctl.seq_len == 25
    assert meter.resets == 2 and ctl.uncut_len == 40 and ctl.n_truncated == 1 and ctl.tokens_truncated == 15
    meter.value = 200  # 20% of the budget, x 40/25 = 32% < high water: the full rows come back
    ctl.run_step(_samples(1, length=10), fake)
    assert ctl.events[-1].kind == "grow_seq_len" and ctl.seq_len is None and ctl.uncut_len is None


def test_fit_trains_token_budget_steps_through_the_controller_with_injected_oom():
    """The pipeline's micro-batches (TokenBudgetSteps) through train.fit and the controller: an OOM injected into
    large micro-batches is recovered, every sample is trained exactly once, and every step's loss equals the plain
    DataLoader run with cfg.accum_steps (the split changes, the token-weighted gradient does not)."""
    model_mod = pytest.importorskip("minimind_lib.model")
    train = pytest.importorskip("minimind_lib.train")
    torch.set_num_threads(1)
    ds = _varied(48, seed=2, lo=4, hi=48)
    lengths = [len(s["input_ids"]) for s in ds]
    accum, max_tokens, steps = 2, 96, 4

    def make():
        torch.manual_seed(0)
        model = model_mod.MiniMindForCausalLM(model_mod.MiniMindConfig.preset("smoke", vocab_size=256))
        return model

    def cfg(**kw):
        return train.TrainConfig(max_steps=steps, lr=1e-3, warmup_steps=1, amp="off", progress=False, **kw)

    sampler = TokenBudgetBatchSampler(lengths, max_tokens, seq_len=48, seed=0)
    assert len(sampler) >= steps * accum  # the first epoch holds every step: no shorter last step
    loader = torch.utils.data.DataLoader(ds, batch_sampler=sampler, collate_fn=pad_collate)
    plain = train.fit(make(), loader, cfg(accum_steps=accum), device="cpu")

    model = make()
    recorded = []

    def boom(module, args, kwargs):  # an OOM for any micro-batch above 60 padded tokens
        if args[0].numel() > 60:
            raise torch.OutOfMemoryError("CUDA out of memory (injected by the test)")

    model.register_forward_pre_hook(boom, with_kwargs=True)

    def collate(b):
        recorded.append([s["sid"] for s in b])
        return pad_collate(b)

    ctl = AdaptiveBatchController(max_tokens=max_tokens, seq_len=48, collate_fn=collate, zero_grad=model)
    df = train.fit(model, TokenBudgetSteps(ds, TokenBudgetBatchSampler(lengths, max_tokens, seq_len=48, seed=0), accum),
                   cfg(), device="cpu", controller=ctl)
    assert ctl.stats["oom_events_recovered"] >= 1 and "oom_halve" in ";".join(df["event"])
    assert ctl.stats["samples_lost"] == 0 and ctl.stats["n_truncated"] == 0
    expected = sorted(i for b in sampler.batches(0)[:steps * accum] for i in b)
    trained = [sid for mb in recorded for sid in mb]
    # every sample of the 4 steps trained once in the successful attempts (failed attempts collated too: count sets)
    assert sorted(set(trained)) == expected and ctl.stats["samples_seen"] == len(expected)
    np.testing.assert_allclose(df["loss"], plain["loss"], rtol=1e-5)
    assert (df["max_tokens"].iloc[-1] <= 60) and list(df["accum_steps"])[-1] > accum


def test_whole_packing_never_cuts_a_conversation():
    docs = [{"input_ids": torch.arange(n), "labels": torch.arange(n)} for n in (5, 4, 3, 8)]
    rows, stats = pack_sequences(docs, 8, whole=True)
    assert stats.n_split == 0 and stats.n_tokens == 20 and stats.n_rows == 3
    assert rows["doc_ids"].tolist() == [[0] * 5 + [-1] * 3, [0] * 4 + [1] * 3 + [-1], [0] * 8]
    with pytest.raises(ValueError, match="sample 0: 9 tokens do not fit a row of 8 whole"):
        pack_sequences([{"input_ids": torch.arange(9)}], 8, whole=True)
