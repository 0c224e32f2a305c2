"""Fixtures shared by the test modules."""

import minimind_lib  # noqa: F401  (first: it sets OpenMP's wait policy before torch loads, when pytest runs bare)
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
