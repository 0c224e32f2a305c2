"""`torchrun --nproc_per_node=2 -m minimind_lib pretrain ...` on CPU (gloo): the CLI's own run under DDP.

One 2-rank launch (bounded time; every process group is killed afterwards, even on failure) and one
single-process run of the same command: the 2-rank run writes one run directory, and its per-step losses are
those of the single process to fp32 tolerance (the point of data parallelism done right).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

from minimind_lib import cli

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "notebooks"))
from ddp_demo import launch  # noqa: E402  (notebook 09's launcher: kills every process it started)
STEPS = 3
# 48 samples of <= 32 tokens, micro-batches of <= 128 tokens, 3 per step: the 2 ranks get 2 and 1 of them.
ARGS = ["--profile", "smoke", "--seq-len", "32", "--max-tokens", "128", "--accum", "3", "--max-samples", "48",
        "--val-batches", "1", "--steps", str(STEPS), "--amp", "off", "--device", "cpu", "--no-progress"]


def test_torchrun_pretrain_matches_single_process(tmp_path):
    torch.set_num_threads(1)
    ddp_out, one_out = tmp_path / "ddp" / "pre", tmp_path / "one" / "pre"
    env = {"PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    res = launch(["-m", "minimind_lib", "pretrain", "--out", str(ddp_out), "--cache", str(tmp_path / "ddp_cache"), *ARGS],
                   nproc=2, launcher="torchrun", env=env, timeout_s=85, log_dir=tmp_path / "logs")
    for pid in res.pids:  # the launcher must leave nothing running
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert res.ok, f"torchrun failed (rc {res.returncodes}, timed_out={res.timed_out}, {res.seconds:.0f} s):\n" + \
        "\n".join(o[-4000:] for o in res.outputs)

    # One run directory, written once (no second writer's temp files, nothing per rank).
    names = sorted(p.name for p in ddp_out.iterdir())
    assert names == ["config.json", "last.pt", "metrics.csv", "model.pth", "summary.json", "tokenizer"], names
    from minimind_lib.checkpoint import load_run

    load_run(ddp_out)  # model.pth, tokenizer and config.json agree
    cfg = json.loads((ddp_out / "config.json").read_text())
    assert cfg["world_size"] == 2 and cfg["data_stats"]["batches_per_epoch"] >= STEPS * 3  # one epoch: same steps
    summary = json.loads((ddp_out / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["world_size"] == 2
    state = torch.load(ddp_out / "last.pt", weights_only=True)
    assert state["step"] == STEPS and state["controller"]["world_size"] == 2
    ddp = pd.read_csv(ddp_out / "metrics.csv")
    ddp = ddp[ddp["step"] >= 0]
    assert ddp["step"].tolist() == list(range(STEPS))
    assert set(ddp["world_size"]) == {2} and ddp["val_loss"].notna().iloc[-1]
    assert (ddp["rank_tokens"] < ddp["tokens"]).all()  # rank 0 trained only its share of every step

    # The same command in one process.
    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        assert cli.main(["pretrain", "--out", str(one_out), "--cache", str(tmp_path / "one_cache"), *ARGS]) == 0
    assert sorted(p.name for p in one_out.iterdir()) == names
    one = pd.read_csv(one_out / "metrics.csv")
    one = one[one["step"] >= 0]
    assert ddp["tokens"].tolist() == one["tokens"].tolist()  # the all-reduced token count is the single one
    torch.testing.assert_close(torch.tensor(ddp["loss"].values), torch.tensor(one["loss"].values), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.tensor(ddp["val_loss"].values), torch.tensor(one["val_loss"].values),
                               atol=1e-5, rtol=1e-5, equal_nan=True)
    a = torch.load(ddp_out / "model.pth", weights_only=True)
    b = torch.load(one_out / "model.pth", weights_only=True)
    for k in b:
        torch.testing.assert_close(a[k], b[k], atol=1e-5, rtol=1e-4, msg=lambda m: f"{k}: {m}")
