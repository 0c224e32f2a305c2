"""Smoke test of `python -m benchmarks batching`: keys and types, not the figures."""

from __future__ import annotations

import json

import pytest

from minimind_lib.paths import DATA_DIR

pytestmark = pytest.mark.skipif(not (DATA_DIR / "pretrain.jsonl").is_file(), reason="data/pretrain.jsonl not built")

KEYS = {
    "padding_fraction_fixed": float,
    "padding_fraction_longest": float,
    "padding_fraction_token_budget": float,
    "padding_fraction_packed": float,
    "useful_tokens_per_s_fixed": float,
    "useful_tokens_per_s_token_budget": float,
    "useful_tokens_per_s_packed": float,
    "oom_events_recovered": int,
    "samples_lost": int,
    "device": str,
    "profile": str,
    "config": dict,
}


def test_bench_batching_smoke_keys_and_types():
    from benchmarks.batching import main

    res = main(["--profile", "smoke", "--batches", "1", "--oom-steps", "2", "--max-samples", "200", "--threads", "1"])
    for key, typ in KEYS.items():
        assert isinstance(res[key], typ), (key, type(res[key]))
    for key in KEYS:
        if key.startswith("padding_fraction"):
            assert 0.0 <= res[key] < 1.0
    assert res["profile"] == "smoke"
    assert res["samples_lost"] == 0 and res["oom_events_recovered"] >= 1
    json.dumps(res)  # the CLI prints it as JSON


def test_bench_batching_bad_data_choice():
    from benchmarks.batching import load_dataset, main
    from minimind_lib.profiles import get_profile

    with pytest.raises(SystemExit):
        main(["--data", "nope"])
    with pytest.raises(ValueError, match="'pretrain' or 'sft'"):
        load_dataset("nope", get_profile("smoke"))
