"""Fixtures shared by the test modules."""

import minimind_lib  # noqa: F401  (first: it sets OpenMP's wait policy before torch loads, when pytest runs bare)
import hashlib
from pathlib import Path

import pytest
import torch

from minimind_lib.model import MiniMindForCausalLM


@pytest.fixture
def inject_oom(monkeypatch):
    """inject_oom(n): the n-th training forward of a multi-row micro-batch raises a CUDA-style out-of-memory error
    (once); returns the counts of such forwards, updated as the run goes."""
    def install(nth: int) -> dict:
        forward, calls = MiniMindForCausalLM.forward, {"multi_row": 0}

        def forward_that_runs_out_of_memory_once(self, input_ids, *args, **kwargs):
            if self.training and input_ids.shape[0] > 1:
                calls["multi_row"] += 1
                if calls["multi_row"] == nth:
                    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
            return forward(self, input_ids, *args, **kwargs)

        monkeypatch.setattr(MiniMindForCausalLM, "forward", forward_that_runs_out_of_memory_once)
        return calls
    return install


# The tiny sizes of the runs the tests train: 48 samples of <= 32 tokens, micro-batches of <= 128 tokens, one
# validation batch, no samples written.
TINY_RUN = dict(profile="smoke", seq_len=32, max_tokens=128, accum_steps=1, max_samples=48, val_batches=1,
                progress=False, log=lambda msg: None, sample_prompts=())


def digest(folder: Path) -> dict[str, str]:
    """Every file under folder, with the sha256 of its bytes."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*"))
            if p.is_file()}


@pytest.fixture(scope="session")
def tiny_cache(tmp_path_factory) -> Path:
    """The tokenization cache of the session's tiny runs."""
    return tmp_path_factory.mktemp("tiny_cache")


@pytest.fixture(scope="session")
def tiny_pretrain(tmp_path_factory, tiny_cache) -> Path:
    """A finished 2-step pretraining run of tiny sizes, trained once per session (per worker under pytest-xdist) for
    every test that starts from a trained run. Read it, or copy it to change it: a test that changed it fails the
    session at its end."""
    from minimind_lib import pipeline

    run = pipeline.pretrain(out=tmp_path_factory.mktemp("tiny_pretrain") / "run", steps=2, cache_dir=tiny_cache,
                            **TINY_RUN).out_dir
    before = digest(run)
    yield run
    assert digest(run) == before, f"{run}: a test changed the session's shared run (copy it before changing it)"
