"""Smoke test of `python -m benchmarks accumulation --json`: keys and types, not the figures."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.__main__ import main as bench_main
from benchmarks.accumulation import main

torch.set_num_threads(1)


def test_accumulation_bench_json(capsys, monkeypatch):
    monkeypatch.setenv("MINIMIND_PROFILE", "smoke")
    assert bench_main(["accumulation", "--json", "--device", "cpu"]) == 0
    result = json.loads(capsys.readouterr().out)
    for key in ("grad_max_rel_err", "naive_grad_max_rel_err", "peak_ratio_accumK_vs_1"):
        assert isinstance(result[key], float), key
    for key in ("peak_bytes_accum1", "peak_bytes_accumK", "k", "batch_rows", "micro_batch_rows"):
        assert isinstance(result[key], int) and result[key] > 0, key
    assert result["device"] == "cpu" and result["profile"] == "smoke"
    assert isinstance(result["config"], dict) and result["config"]["vocab_size"] > 0
    assert isinstance(result["data"], str) and len(result["tokens_per_micro_batch"]) == result["k"]


def test_accumulation_bench_rejects_uneven_split():
    with pytest.raises(ValueError, match="--batch 6 is not a multiple of --k 4"):
        main(["--profile", "smoke", "--device", "cpu", "--batch", "6", "--k", "4"])
