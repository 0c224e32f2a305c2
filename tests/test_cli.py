"""CLI tests (smoke profile, a few tiny steps, tmp dirs): train, save, resume, sft, chat, and every bad input."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch

from minimind_lib import cli
from minimind_lib.paths import DATA_DIR

torch.set_num_threads(1)  # tiny matmuls; the CI machine's 2 cores are shared

# Tiny runs: 48 samples of <= 32 tokens, micro-batches of <= 128 tokens, one validation batch.
TINY = ["--profile", "smoke", "--seq-len", "32", "--max-tokens", "128", "--accum", "1", "--max-samples", "48",
        "--val-batches", "1", "--no-progress"]


def run_cli(args: list[str], capsys) -> tuple[int, str, str]:
    code = cli.main([str(a) for a in args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def snapshot(d: Path) -> dict:
    """Every file under d with its bytes' hash: proves that a failed command changed nothing."""
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One pretraining run (stopped after 2 of 4 steps, then resumed) and one SFT run from it."""
    base = tmp_path_factory.mktemp("cli")
    cache = base / "cache"
    pre = base / "pre"
    common = TINY + ["--cache", cache]
    import io
    import contextlib

    err1, err2 = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err1), contextlib.redirect_stdout(io.StringIO()):
        assert cli.main([str(a) for a in ["pretrain", "--out", pre, "--steps", 4, "--stop-after", 2] + common]) == 0
    stopped_state = torch.load(pre / "last.pt", weights_only=True)["step"]
    with contextlib.redirect_stderr(err2), contextlib.redirect_stdout(io.StringIO()) as out2:
        assert cli.main([str(a) for a in ["pretrain", "--out", pre, "--steps", 4, "--resume"] + common]) == 0
    sft_dir = base / "sft"
    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        assert cli.main([str(a) for a in ["sft", "--out", sft_dir, "--init", pre, "--steps", 3] + common]) == 0
    return {"base": base, "cache": cache, "pre": pre, "sft": sft_dir, "stopped_step": stopped_state,
            "resume_log": err2.getvalue(), "resume_summary": json.loads(out2.getvalue())}


def test_pretrain_writes_the_run_directory(runs):
    pre = runs["pre"]
    for name in ("config.json", "model.pth", "metrics.csv", "last.pt", "summary.json", "tokenizer/tokenizer.json",
                 "tokenizer/tokenizer_config.json"):
        assert (pre / name).is_file(), name
    cfg = json.loads((pre / "config.json").read_text())
    assert cfg["stage"] == "pretrain" and cfg["model_preset"] == "smoke"
    assert cfg["train"]["max_steps"] == 4 and cfg["max_tokens"] == 128 and cfg["seq_len"] == 32
    assert len(cfg["tokenizer"]["fingerprint"]) == 16


def test_model_pth_has_minimind_key_names(runs):
    from minimind_lib.model import MiniMindConfig, MiniMindForCausalLM

    state = torch.load(runs["pre"] / "model.pth", weights_only=True)  # a bare state dict, nothing pickled
    assert all(isinstance(v, torch.Tensor) for v in state.values())
    model = MiniMindForCausalLM(MiniMindConfig.preset("smoke"))
    model.load_state_dict(state, strict=True)  # exactly the keys MiniMind's own code has
    assert "model.embed_tokens.weight" in state and "lm_head.weight" in state
    assert "model.layers.0.self_attn.q_proj.weight" in state and "model.norm.weight" in state


def test_resume_continues_from_the_saved_step(runs):
    import pandas as pd

    assert runs["stopped_step"] == 2
    assert "resuming" in runs["resume_log"] and "at step 2 of 4" in runs["resume_log"]
    metrics = pd.read_csv(runs["pre"] / "metrics.csv")
    assert metrics["step"].tolist() == [-1, 0, 1, 2, 3]  # -1: validation before training
    assert runs["resume_summary"]["resumed_from_step"] == 2 and runs["resume_summary"]["steps"] == 4
    assert torch.load(runs["pre"] / "last.pt", weights_only=True)["step"] == 4


def test_resumed_run_equals_an_uninterrupted_one(runs, tmp_path, capsys):
    straight = tmp_path / "straight"
    code, _, err = run_cli(["pretrain", "--out", straight, "--steps", 4, "--cache", runs["cache"]] + TINY, capsys)
    assert code == 0, err
    a = torch.load(runs["pre"] / "model.pth", weights_only=True)
    b = torch.load(straight / "model.pth", weights_only=True)
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)


def test_sft_from_the_pretrained_run(runs):
    cfg = json.loads((runs["sft"] / "config.json").read_text())
    assert cfg["stage"] == "sft" and cfg["init"] == str(runs["pre"].resolve())
    assert cfg["model"] == json.loads((runs["pre"] / "config.json").read_text())["model"]
    assert (runs["sft"] / "model.pth").is_file()


def test_chat_answers_deterministically_with_a_seed(runs, capsys):
    args = ["chat", "--ckpt", runs["sft"], "--prompt", "Hello!", "--seed", 7, "--max-new-tokens", 12]
    code1, out1, err1 = run_cli(args, capsys)
    code2, out2, _ = run_cli(args, capsys)
    assert code1 == 0 and code2 == 0, err1
    assert out1 == out2 and out1.strip()


def test_chat_reads_prompts_from_stdin_when_not_a_tty(runs, capsys, monkeypatch):
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO("Hello!\n\nHow are you?\n"))
    code, out, err = run_cli(["chat", "--ckpt", runs["sft"], "--seed", 1, "--max-new-tokens", 4], capsys)
    assert code == 0, err
    assert len(out.splitlines()) >= 2


# ------------------------------------------------------------------------------------------ bad input


def test_missing_data_path(tmp_path, capsys):
    out = tmp_path / "run"
    code, _, err = run_cli(["pretrain", "--data", tmp_path / "nope.jsonl", "--out", out] + TINY, capsys)
    assert code == 2
    assert "data file not found" in err and "nope.jsonl" in err
    assert not out.exists()


def test_missing_checkpoint_for_chat_and_sft(runs, tmp_path, capsys):
    broken = tmp_path / "broken"
    shutil.copytree(runs["pre"], broken)
    (broken / "model.pth").unlink()
    before = snapshot(broken)
    code, _, err = run_cli(["chat", "--ckpt", broken, "--prompt", "hi"], capsys)
    assert code == 2 and "checkpoint not found" in err and "model.pth" in err
    out = tmp_path / "sft"
    code, _, err = run_cli(["sft", "--out", out, "--init", broken] + TINY, capsys)
    assert code == 2 and "checkpoint not found" in err
    assert not out.exists() and snapshot(broken) == before
    code, _, err = run_cli(["chat", "--ckpt", tmp_path / "nowhere"], capsys)
    assert code == 2 and "run directory not found" in err


def test_corrupt_checkpoint(runs, tmp_path, capsys):
    broken = tmp_path / "corrupt"
    shutil.copytree(runs["pre"], broken)
    (broken / "model.pth").write_bytes(b"not a torch file")
    code, _, err = run_cli(["chat", "--ckpt", broken, "--prompt", "hi"], capsys)
    assert code == 2 and "cannot read checkpoint" in err and "model.pth" in err
    (broken / "config.json").write_text("{ not json")
    code, _, err = run_cli(["chat", "--ckpt", broken, "--prompt", "hi"], capsys)
    assert code == 2 and "config.json" in err and "not valid JSON" in err


def test_corrupt_training_state_on_resume(runs, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(runs["pre"], run)
    (run / "last.pt").write_bytes(b"\x00" * 100)
    before = snapshot(run)
    code, _, err = run_cli(["pretrain", "--out", run, "--steps", 4, "--resume", "--cache", runs["cache"]] + TINY, capsys)
    assert code == 2 and "cannot read training checkpoint" in err and "last.pt" in err
    assert snapshot(run) == before


def test_vocab_mismatch(tmp_path, capsys):
    from minimind_lib.tokenizer import Tokenizer

    texts = [json.loads(line)["text"] for line in (DATA_DIR / "pretrain_val.jsonl").open()][:50]
    small = tmp_path / "tok300"
    Tokenizer.train(texts, vocab_size=300).save(small)
    out = tmp_path / "run"
    code, _, err = run_cli(["pretrain", "--out", out, "--tokenizer", small] + TINY, capsys)
    assert code == 2 and "vocab" in err and "300" in err and "6400" in err
    assert not out.exists()


def test_resume_with_a_different_config(runs, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(runs["pre"], run)
    before = snapshot(run)
    base = ["pretrain", "--out", run, "--resume", "--cache", runs["cache"]]
    changed = [a if a != "128" else "256" for a in TINY]  # --max-tokens 256 instead of 128
    code, _, err = run_cli(base + ["--steps", 4] + changed, capsys)
    assert code == 2 and "cannot resume" in err and "'max_tokens' differs" in err
    code, _, err = run_cli(base + ["--steps", 9] + TINY, capsys)
    assert code == 2 and "'max_steps' differs" in err
    code, _, err = run_cli(base + ["--steps", 4, "--config", "cpu"] + TINY, capsys)
    assert code == 2 and "'model' differs" in err
    code, _, err = run_cli(base + ["--steps", 4, "--data", DATA_DIR / "pretrain_val.jsonl"] + TINY, capsys)
    assert code == 2 and "'data' differs" in err
    assert snapshot(run) == before


def test_resume_without_a_run(tmp_path, capsys):
    code, _, err = run_cli(["pretrain", "--out", tmp_path / "empty", "--resume"] + TINY, capsys)
    assert code == 2 and "no run config" in err and "config.json" in err and "is not a run to resume" in err


def test_existing_run_is_not_overwritten(runs, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(runs["pre"], run)
    before = snapshot(run)
    code, _, err = run_cli(["pretrain", "--out", run, "--steps", 2, "--cache", runs["cache"]] + TINY, capsys)
    assert code == 2 and "already holds a run" in err and "--overwrite" in err
    assert snapshot(run) == before


def test_add_subcommands_registers_pretrain_sft_chat():
    import argparse

    parser = argparse.ArgumentParser()
    cli.add_subcommands(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["chat", "--ckpt", "x", "--prompt", "p", "--temperature", "0"])
    assert args.func is cli.cmd_chat and args.temperature == 0.0
    args = parser.parse_args(["pretrain", "--data", "d", "--out", "o", "--config", "minimind2-small", "--max-tokens",
                              "64", "--accum", "2", "--amp", "bf16", "--resume"])
    assert (args.config, args.max_tokens, args.accum_steps, args.amp, args.resume) == ("minimind2-small", 64, 2, "bf16", True)
    with pytest.raises(SystemExit):
        parser.parse_args(["sft", "--out", "o"])  # --init is required
