"""Smoke test of `python -m benchmarks memmap`: runs main() small and checks keys and types."""

from __future__ import annotations

import json

from benchmarks import memmap


def test_bench_memmap_keys(tmp_path, monkeypatch):
    monkeypatch.setenv("MINIMIND_PROFILE", "smoke")
    data = tmp_path / "pre.jsonl"
    with open(data, "w") as f:
        for i in range(60):
            f.write(json.dumps({"text": f"To be, or not to be, line {i}. 床前明月光，疑是地上霜。" * (1 + i % 5)}) + "\n")
    r = memmap.main(["--data", str(data), "--max-samples", "50", "--random-reads", "20", "--num-workers", "1",
                      "--hash-bytes", str(5 * 2**20)])
    json.dumps(r)  # JSON-ready
    for key in ("tokens_per_s_memmap", "tokens_per_s_getitem", "ratio", "ratio_first_epoch", "tokens_per_s_memmap_build",
                "peak_rss_mb_memmap", "peak_rss_mb_getitem", "tokens_per_s_memmap_random", "tokens_per_s_getitem_random"):
        assert isinstance(r[key], float) and r[key] > 0, key
    assert r["n_samples"] == 50 and r["tokens"] <= r["raw_tokens"] and r["num_workers"] == 1
    assert r["profile"] == "smoke" and isinstance(r["device"], str)
    assert r["fingerprint_bytes"] == 5 * 2**20 and r["fingerprint_s_median"] > 0 and r["fingerprint_s_spread"] >= 0
