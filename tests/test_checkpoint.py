"""Tests of training-state checkpoints: round trip, exact resume, RNG states, clear errors, no NaN checkpoints."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from minimind_lib.data import pad_collate
from minimind_lib.checkpoint import (DataStream, get_rng_state, load_training_state, read_training_state,
                                     save_training_state, set_rng_state)
from minimind_lib.checkpoint import load_checkpoint, save_checkpoint
from minimind_lib.model import MiniMindConfig, MiniMindForCausalLM
from minimind_lib.train import TrainConfig, build_optimizer, fit

torch.set_num_threads(1)  # tiny matmuls: one thread is fastest, and the CI machine's 2 cores are shared
VOCAB = 256


def synthetic_samples(n: int, *, vocab_size: int, min_len: int, max_len: int, seed: int = 0) -> list[dict]:
    """`n` pretrain-style samples of random token ids, lengths spread over [min_len, max_len]."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (n,), generator=g).tolist()
    return [{"input_ids": ids, "labels": ids.clone()} for ids in (torch.randint(3, vocab_size, (m,), generator=g)
                                                                   for m in lengths)]


def tiny_model(seed: int = 0) -> MiniMindForCausalLM:
    torch.manual_seed(seed)
    return MiniMindForCausalLM(MiniMindConfig.preset("smoke", vocab_size=VOCAB))


def batches(n: int, rows: int = 3, seed: int = 0) -> list[dict]:
    s = synthetic_samples(n * rows, vocab_size=VOCAB, min_len=3, max_len=20, seed=seed)
    return [pad_collate(s[i * rows:(i + 1) * rows]) for i in range(n)]


def cfg(**kw) -> TrainConfig:
    base = dict(lr=5e-3, warmup_steps=2, max_steps=8, accum_steps=2, amp="off", progress=False, seed=0)
    base.update(kw)
    return TrainConfig(**base)


def saved(tmp_path, step=3, **kw):
    model = tiny_model()
    opt = build_optimizer(model, cfg(), "cpu")
    path = save_training_state(tmp_path / "ck.pt", model, opt, cfg=cfg(**kw), step=step,
                               data_state={"epoch": 1, "offset": 2})
    return path, model, opt


def test_rng_state_round_trip_is_weights_only_safe(tmp_path):
    torch.manual_seed(1), np.random.seed(2), random.seed(3)
    state = get_rng_state()
    torch.save(state, tmp_path / "rng.pt")
    loaded = torch.load(tmp_path / "rng.pt", weights_only=True)  # plain types and tensors only
    expected = (torch.rand(3), np.random.rand(3), [random.random() for _ in range(3)])
    torch.manual_seed(9), np.random.seed(9), random.seed(9)
    set_rng_state(loaded)
    assert torch.equal(torch.rand(3), expected[0])
    assert np.array_equal(np.random.rand(3), expected[1])
    assert [random.random() for _ in range(3)] == expected[2]


def test_round_trip_restores_model_optimizer_step_and_data(tmp_path):
    model = tiny_model()
    c = cfg(max_steps=2)
    fit(model, batches(2), c, device="cpu")  # so the optimizer has state
    opt = build_optimizer(model, c, "cpu")
    opt.load_state_dict(opt.state_dict())
    path = save_training_state(tmp_path / "ck.pt", model, opt, cfg=c, step=2, data_state={"epoch": 0, "offset": 4},
                               extra={"lr_scale": 0.5})
    assert not list(tmp_path.glob("*.tmp"))  # the atomic writer leaves no temp file behind
    other = tiny_model(seed=1)
    opt2 = build_optimizer(other, c, "cpu")
    info = load_training_state(path, other, optimizer=opt2, cfg=c)
    assert info["step"] == 2 and info["data"] == {"epoch": 0, "offset": 4} and info["extra"]["lr_scale"] == 0.5
    for (k, a), b in zip(model.state_dict().items(), other.state_dict().values()):
        assert torch.equal(a, b), k


def test_interrupted_and_resumed_run_matches_uninterrupted(tmp_path):
    data = batches(5)  # 5 micro-batches, accum 2: epochs end in the middle of steps
    full = fit(tiny_model(), data, cfg(), device="cpu")

    class Crash(Exception):
        pass

    def crash_at_5(step, row):
        if step == 5:
            raise Crash

    c = cfg(ckpt_every=4, ckpt_dir=str(tmp_path))
    with pytest.raises(Crash):
        fit(tiny_model(), data, c, device="cpu", callbacks=[crash_at_5])
    assert read_training_state(tmp_path / "last.pt")["step"] == 4
    resumed_model = tiny_model(seed=123)  # different weights: the checkpoint must overwrite them
    resumed = fit(resumed_model, data, c, device="cpu", resume_from=tmp_path / "last.pt")
    assert resumed["step"].tolist() == [4, 5, 6, 7]
    assert resumed["loss"].tolist() == full["loss"].iloc[4:].tolist()  # exact, not approximate
    assert resumed["grad_norm"].tolist() == full["grad_norm"].iloc[4:].tolist()
    assert resumed["lr"].tolist() == full["lr"].iloc[4:].tolist()


def test_missing_and_corrupt_files_are_named(tmp_path):
    model = tiny_model()
    with pytest.raises(FileNotFoundError, match="nope.pt"):
        load_training_state(tmp_path / "nope.pt", model)
    bad = tmp_path / "corrupt.pt"
    bad.write_bytes(b"not a checkpoint at all")
    with pytest.raises(ValueError, match="corrupt.pt.*corrupt or not a checkpoint"):
        load_training_state(bad, model)
    path, _, _ = saved(tmp_path)
    trunc = tmp_path / "trunc.pt"
    trunc.write_bytes(path.read_bytes()[:200])
    with pytest.raises(ValueError, match="trunc.pt"):
        read_training_state(trunc)


def test_weights_checkpoint_is_not_a_training_checkpoint(tmp_path):
    model = tiny_model()
    save_checkpoint(model, tmp_path / "weights.pt")
    with pytest.raises(ValueError, match="weights.pt: not a training checkpoint"):
        load_training_state(tmp_path / "weights.pt", model)


def test_model_loader_reads_the_model_of_a_training_checkpoint(tmp_path):
    path, model, _ = saved(tmp_path)
    other = tiny_model(seed=5)
    with pytest.warns(UserWarning, match="training checkpoint"):
        load_checkpoint(path, other)
    assert torch.equal(other.lm_head.weight, model.lm_head.weight)


def test_config_mismatch_names_the_field(tmp_path):
    path, model, opt = saved(tmp_path, accum_steps=2)
    with pytest.raises(ValueError, match="'accum_steps' differs.*checkpoint 2, now 4"):
        load_training_state(path, model, optimizer=opt, cfg=cfg(accum_steps=4))
    with pytest.raises(ValueError, match="'betas' differs"):
        load_training_state(path, model, cfg=cfg(betas=(0.9, 0.99)))
    load_training_state(path, model, cfg=cfg(log_every=7, ckpt_every=3))  # bookkeeping fields may change


def test_model_mismatch_names_the_key(tmp_path):
    path, _, _ = saved(tmp_path)
    bigger = MiniMindForCausalLM(MiniMindConfig.preset("smoke", vocab_size=VOCAB, num_hidden_layers=3))
    with pytest.raises(ValueError, match="missing key 'model.layers.2"):
        load_training_state(path, bigger)


def test_scaler_state_required_when_resuming_fp16(tmp_path):
    path, model, _ = saved(tmp_path)
    with pytest.raises(ValueError, match="no GradScaler state"):
        load_training_state(path, model, scaler=torch.amp.GradScaler("cpu"))


def test_never_writes_a_nan_checkpoint(tmp_path):
    model = tiny_model()
    opt = build_optimizer(model, cfg(), "cpu")
    with torch.no_grad():
        model.model.norm.weight[0] = float("nan")
    with pytest.raises(ValueError, match="refusing to write.*'model.norm.weight'.*NaN"):
        save_training_state(tmp_path / "nan.pt", model, opt, cfg=cfg(), step=1)
    assert not (tmp_path / "nan.pt").exists() and not list(tmp_path.iterdir())


def test_data_stream_sets_the_epoch_of_a_sampler_and_resumes_mid_epoch():
    class Sampled(list):  # a source with a sampler whose order depends on the epoch, like DistributedSampler
        def __init__(self):
            super().__init__()
            self.sampler = self

        def set_epoch(self, epoch):
            self[:] = [epoch * 10 + i for i in range(3)]

    s = DataStream(Sampled())
    assert [s.next() for _ in range(5)] == [0, 1, 2, 10, 11]
    t = DataStream(Sampled())
    t.load_state_dict(s.state_dict())
    assert [t.next() for _ in range(2)] == [12, 20]


def test_a_spent_generator_raises_stop_iteration():
    s = DataStream(iter([1]))
    assert s.next() == 1
    with pytest.raises(StopIteration):
        s.next()
