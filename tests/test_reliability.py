"""Reliability (issue 18): a run survives kills and concurrent use, nothing of the user's is lost, every bad number
is refused with one clear error. Tiny smoke-profile runs of a few steps; each test fails without its fix."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import math
import os
import pickle
import shutil
import signal
from pathlib import Path

import pandas as pd
import pytest
import torch

from minimind_lib import cli, paths, pipeline
from minimind_lib.generate import generate, generate_ids
from minimind_lib.model import MiniMindConfig, MiniMindForCausalLM, load_checkpoint
from minimind_lib.paths import DATA_DIR
from minimind_lib.tokenizer import load_tokenizer

torch.set_num_threads(1)

TINY = dict(profile="smoke", seq_len=32, max_tokens=128, accum_steps=1, max_samples=48, val_batches=1, progress=False,
            log=lambda msg: None, sample_prompts=())
TINY_CLI = ["--profile", "smoke", "--seq-len", "32", "--max-tokens", "128", "--accum", "1", "--max-samples", "48",
            "--val-batches", "1", "--no-progress"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def pre(tmp_path_factory, cache):
    """A finished 2-step pretraining run (the starting point of the SFT and checkpoint tests)."""
    return pipeline.pretrain(out=tmp_path_factory.mktemp("pre") / "run", steps=2, cache_dir=cache, **TINY).out_dir


def run_cli(args: list, capsys=None) -> tuple[int, str, str]:
    if capsys is not None:
        code = cli.main([str(a) for a in args])
        captured = capsys.readouterr()
        return code, captured.out, captured.err
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main([str(a) for a in args])
    return code, out.getvalue(), err.getvalue()


def snapshot(d: Path) -> dict:
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.rglob("*"))
            if p.is_file()}


# ------------------------------------------------------------------------------------------ must fix 1-5
def test_a_kill_between_checkpoint_and_metrics_loses_no_row(tmp_path, cache, monkeypatch):
    # The kill lands after last.pt (step 2) is written and before metrics.csv is: --resume must still restore the
    # rows of steps 0 and 1 exactly, from the checkpoint itself.
    straight = pipeline.pretrain(out=tmp_path / "straight", steps=4, ckpt_every=2, cache_dir=cache, **TINY).metrics
    real_write = pipeline.Recorder.write_metrics

    def killed(self):
        raise RuntimeError("killed after last.pt was written")

    monkeypatch.setattr(pipeline.Recorder, "write_metrics", killed)
    with pytest.raises(RuntimeError, match="killed"):
        pipeline.pretrain(out=tmp_path / "run", steps=4, ckpt_every=2, cache_dir=cache, **TINY)
    monkeypatch.setattr(pipeline.Recorder, "write_metrics", real_write)
    assert torch.load(tmp_path / "run" / "last.pt", weights_only=True)["step"] == 2
    assert not (tmp_path / "run" / "metrics.csv").exists()
    stale = tmp_path / "run" / ".last.pt.x1y2z3.tmp"  # what a kill during torch.save leaves
    stale.write_bytes(b"\0" * 1000)
    resumed = pipeline.pretrain(out=tmp_path / "run", steps=4, ckpt_every=2, cache_dir=cache, resume=True, **TINY)
    assert resumed.metrics["step"].tolist() == [-1, 0, 1, 2, 3]
    assert resumed.metrics["loss"].tolist()[1:] == pytest.approx(straight["loss"].tolist()[1:], abs=1e-6)
    assert pd.read_csv(tmp_path / "run" / "metrics.csv")["step"].tolist() == [-1, 0, 1, 2, 3]
    assert resumed.summary["tokens"] == straight["tokens"].sum() and not stale.exists()


def test_a_users_files_in_the_tokenizer_folder_are_never_deleted(tmp_path, cache, capsys):
    out = tmp_path / "run"
    (out / "tokenizer").mkdir(parents=True)
    (out / "tokenizer" / "my_notes.txt").write_text("mine")
    code, _, err = run_cli(["pretrain", "--out", out, "--steps", 1, "--cache", cache] + TINY_CLI, capsys)
    assert code == 2 and "tokenizer" in err and "not a tokenizer this program wrote" in err
    assert (out / "tokenizer" / "my_notes.txt").read_text() == "mine" and not (out / "config.json").exists()
    code, _, err = run_cli(["pretrain", "--out", out, "--steps", 1, "--overwrite", "--cache", cache] + TINY_CLI, capsys)
    assert code == 2 and (out / "tokenizer" / "my_notes.txt").exists()


def test_a_second_run_into_the_same_out_is_refused(tmp_path, cache, capsys):
    from minimind_lib.fileio import exclusive_dir

    out = tmp_path / "run"
    with exclusive_dir(out):  # the first run holds the lock (another process in real use; flock is per open file)
        code, _, err = run_cli(["pretrain", "--out", out, "--steps", 1, "--cache", cache] + TINY_CLI, capsys)
        assert code == 2 and f"is in use by pid {os.getpid()}" in err
        assert sorted(p.name for p in out.iterdir()) == [".lock"]
    assert not out.exists()  # the lock removes the folder it created, as nothing else was written
    code, _, err = run_cli(["pretrain", "--out", out, "--steps", 1, "--cache", cache] + TINY_CLI, capsys)
    assert code == 0, err


@pytest.mark.parametrize("poison", ["nan", "int64"])
def test_non_finite_or_integer_weights_are_refused_at_load(pre, tmp_path, cache, capsys, poison):
    bad = tmp_path / "bad"
    shutil.copytree(pre, bad)
    state = torch.load(bad / "model.pth", weights_only=True)
    key = "model.layers.0.mlp.up_proj.weight"
    state[key] = state[key].clone().fill_(math.nan) if poison == "nan" else state[key].long()
    torch.save(state, bad / "model.pth")
    with pytest.raises(ValueError, match="NaN/inf" if poison == "nan" else "torch.int64"):
        load_checkpoint(bad / "model.pth", MiniMindForCausalLM(MiniMindConfig.preset("smoke")))
    code, _, err = run_cli(["sft", "--init", bad, "--out", tmp_path / "sft", "--steps", 1, "--cache", cache]
                           + TINY_CLI, capsys)
    assert code == 2 and key in err and not (tmp_path / "sft").exists()
    code, out, err = run_cli(["chat", "--ckpt", bad, "--prompt", "hi"], capsys)
    assert code == 2 and key in err and out == ""


def test_resume_refuses_a_changed_data_file(tmp_path, cache, capsys):
    data = tmp_path / "data.jsonl"
    lines = (DATA_DIR / "pretrain.jsonl").read_text(encoding="utf-8").splitlines(keepends=True)[:200]
    data.write_text("".join(lines), encoding="utf-8")
    out, common = tmp_path / "run", ["--data", data, "--steps", 4, "--cache", cache] + TINY_CLI
    assert run_cli(["pretrain", "--out", out, "--stop-after", 2] + common, capsys)[0] == 0
    data.write_text("".join(lines[100:]), encoding="utf-8")  # 100 lines deleted: the saved position means nothing
    before = snapshot(out)
    code, _, err = run_cli(["pretrain", "--out", out, "--resume"] + common, capsys)
    assert code == 2 and "data.jsonl changed since the run started" in err and snapshot(out) == before
    data.write_text("".join(lines), encoding="utf-8")  # restored: the run goes on
    assert run_cli(["pretrain", "--out", out, "--resume"] + common, capsys)[0] == 0


def test_resume_of_a_run_without_a_data_fingerprint_says_why(tmp_path, cache, capsys):
    out, common = tmp_path / "run", ["--steps", 4, "--cache", cache] + TINY_CLI
    assert run_cli(["pretrain", "--out", out, "--stop-after", 2] + common, capsys)[0] == 0
    config = json.loads((out / "config.json").read_text())
    del config["data_fingerprint"]  # as written before runs recorded one
    (out / "config.json").write_text(json.dumps(config))
    code, _, err = run_cli(["pretrain", "--out", out, "--resume"] + common, capsys)
    assert code == 2 and "records no data_fingerprint (written by an older version)" in err


# ------------------------------------------------------------------------------------------ also
def test_an_out_of_memory_error_in_a_cli_run_is_recovered_without_losing_a_sample(tmp_path, cache, inject_oom, capsys):
    inject_oom(2)  # the second multi-row training forward runs out of memory
    code, out, err = run_cli(["pretrain", "--out", tmp_path / "run", "--steps", 3, "--cache", cache] + TINY_CLI, capsys)
    assert code == 0, err
    batching = json.loads(out)["batching"]
    assert batching["oom_events_recovered"] == 1 and batching["samples_lost"] == 0
    assert batching["samples_seen"] == batching["samples_in"] > 0


def test_inputs_are_validated_before_out_is_written(tmp_path, cache, pre):
    sft_data = tmp_path / "sft.jsonl"  # a system prompt longer than seq_len: no assistant token survives the cut
    sft_data.write_text(json.dumps({"conversations": [{"role": "system", "content": "word " * 100},
                                                      {"role": "user", "content": "hi"},
                                                      {"role": "assistant", "content": "hello"}]}) + "\n")
    with pytest.raises(ValueError, match="no trained .assistant. tokens"):
        pipeline.sft(sft_data, tmp_path / "sft", init=pre, steps=1, cache_dir=cache, **TINY)
    with pytest.raises(ValueError, match="lr=nan"):
        pipeline.pretrain(out=tmp_path / "a", lr=math.nan, cache_dir=cache, **TINY)
    with pytest.raises(ValueError, match="seq_len=4096 exceeds the model's max_position_embeddings=2048"):
        pipeline.pretrain(out=tmp_path / "b", cache_dir=cache, **{**TINY, "seq_len": 4096, "max_tokens": 4096})
    for name, value in [("steps", 0), ("accum_steps", 0), ("max_tokens", 0), ("seq_len", 0), ("lr", 0.0),
                        ("max_samples", -1), ("stop_after", 0), ("eval_every", -2)]:
        with pytest.raises(ValueError, match=f"{name}="):
            pipeline.pretrain(out=tmp_path / "c", cache_dir=cache, **{**TINY, name: value})
    assert not any((tmp_path / name).exists() for name in ("sft", "a", "b", "c"))


@pytest.mark.parametrize("flag,value", [("--steps", "0"), ("--accum", "0"), ("--max-tokens", "0"), ("--lr", "0"),
                                        ("--lr", "nan"), ("--seq-len", "0"), ("--max-samples", "-1"),
                                        ("--stop-after", "0"), ("--eval-every", "-1"), ("--steps", "two")])
def test_zero_negative_and_non_numbers_are_refused_by_the_cli(flag, value, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["pretrain", "--out", str(tmp_path / "run"), flag, value])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and f"argument {flag}" in err and value in err
    assert not (tmp_path / "run").exists()


def test_one_line_errors_for_a_missing_device_and_an_out_that_is_a_file(tmp_path, cache, capsys):
    if not torch.cuda.is_available():
        code, _, err = run_cli(["pretrain", "--out", tmp_path / "r", "--device", "cuda"] + TINY_CLI, capsys)
        assert code == 2 and "device cuda is not available" in err and len(err.splitlines()) == 1
    (tmp_path / "file").write_text("a file")
    code, _, err = run_cli(["pretrain", "--out", tmp_path / "file", "--cache", cache] + TINY_CLI, capsys)
    assert code == 2 and "is a file, not a directory" in err and len(err.splitlines()) == 1


def test_sigint_during_training_checkpoints_and_resume_finishes(tmp_path, cache, monkeypatch, capsys):
    forward, calls = MiniMindForCausalLM.forward, {"n": 0}

    def forward_then_ctrl_c(self, input_ids, *args, **kwargs):
        if self.training:
            calls["n"] += 1
            if calls["n"] == 2:  # Ctrl-C in the middle of the second step
                os.kill(os.getpid(), signal.SIGINT)
        return forward(self, input_ids, *args, **kwargs)

    out = tmp_path / "run"
    monkeypatch.setattr(MiniMindForCausalLM, "forward", forward_then_ctrl_c)
    code, _, err = run_cli(["pretrain", "--out", out, "--steps", 5, "--cache", cache] + TINY_CLI, capsys)
    assert code == 2 and err.splitlines()[-1].startswith("error: stopped by SIGINT after step") and "--resume" in err
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handler is put back
    step = torch.load(out / "last.pt", weights_only=True)["step"]
    assert 1 <= step < 5 and json.loads((out / "summary.json").read_text())["interrupted_by"] == "SIGINT"
    monkeypatch.setattr(MiniMindForCausalLM, "forward", forward)
    code, _, err = run_cli(["pretrain", "--out", out, "--steps", 5, "--resume", "--cache", cache] + TINY_CLI, capsys)
    assert code == 0, err
    assert pd.read_csv(out / "metrics.csv")["step"].tolist() == [-1, 0, 1, 2, 3, 4]


def test_resuming_a_finished_run_changes_nothing(pre, tmp_path, cache, capsys):
    run = tmp_path / "run"
    shutil.copytree(pre, run)
    before = snapshot(run)
    code, _, err = run_cli(["pretrain", "--out", run, "--steps", 2, "--resume", "--cache", cache] + TINY_CLI, capsys)
    assert code == 2 and "is a finished run (2 of 2 steps)" in err and "nothing changed" in err
    assert snapshot(run) == before


def test_on_error_skip_counts_and_names_bad_lines(tmp_path, cache, capsys):
    data = tmp_path / "bad.jsonl"
    lines = (DATA_DIR / "pretrain.jsonl").read_text(encoding="utf-8").splitlines(keepends=True)[:60]
    data.write_text("".join(lines[:30]) + "{not json\n" + "".join(lines[30:]), encoding="utf-8")
    common = ["--data", data, "--steps", 1, "--cache", cache] + TINY_CLI
    code, _, err = run_cli(["pretrain", "--out", tmp_path / "a"] + common, capsys)
    assert code == 2 and "bad.jsonl:31" in err and not (tmp_path / "a").exists()
    code, _, err = run_cli(["pretrain", "--out", tmp_path / "b", "--on-error", "skip"] + common, capsys)
    assert code == 0 and "skipped 1 bad line(s)" in err
    assert json.loads((tmp_path / "b" / "config.json").read_text())["data_stats"]["n_skipped"] == 1


def test_rolled_back_rows_are_marked_and_their_tokens_not_counted(tmp_path):
    settings = pipeline.RunSettings(stage="pretrain", sample_prompts=())
    rec = pipeline.Recorder(tmp_path, settings, None, None, None, write=False)
    for step, event in [(0, "ckpt"), (1, ""), (2, "nonfinite_loss_skipped"),
                        (2, "nonfinite_loss_skipped;rollback_to_step_1;lr_scale=0.5"), (1, ""), (2, "")]:
        rec(step, {"step": step, "loss": 1.0, "tokens": 10, "event": event, "skipped": "skipped" in event})
    df = rec.frame()
    assert df["rolled_back"].fillna(False).tolist() == [False, True, True, True, False, False]
    assert df["tokens_seen"].iloc[-1] == 30 and pipeline.summarize(df, 1.0)["tokens"] == 30


# ------------------------------------------------------------------------------------------ library API
def test_config_and_token_ids_are_validated():
    for field in ("hidden_size", "vocab_size", "num_hidden_layers"):
        with pytest.raises(ValueError, match=f"{field}=0: must be a positive integer"):
            MiniMindConfig(**{field: 0})
    for head_dim in (0, 3):  # rotary embeddings rotate pairs of dimensions
        with pytest.raises(ValueError, match=f"head_dim={head_dim} must be a positive even integer"):
            MiniMindConfig(head_dim=head_dim)
    model = MiniMindForCausalLM(MiniMindConfig.preset("smoke"))
    for bad in (6400, -1):
        with pytest.raises(ValueError, match=r"token ids range .* is outside \[0, vocab_size=6400\)"):
            model(torch.tensor([[1, 2, bad]]))


def test_generate_refuses_what_it_cannot_do():
    model, tok = MiniMindForCausalLM(MiniMindConfig.preset("smoke", max_position_embeddings=16)), load_tokenizer()
    with pytest.raises(ValueError, match="no room to generate"):
        generate_ids(model, torch.ones(16, dtype=torch.long), max_new_tokens=1)
    with pytest.raises(ValueError, match="temperature must be >= 0 and finite"):
        generate(model, tok, "hi", temperature=math.nan, max_new_tokens=2)
    with pytest.warns(UserWarning, match="generating 2 of the 10 new tokens"):
        new = generate_ids(model, torch.ones(14, dtype=torch.long), max_new_tokens=10, temperature=0)
    assert new.shape == (1, 2)


class Payload:
    def __reduce__(self):
        return (print, ("this must never run",))


@pytest.mark.parametrize("content", [b"random bytes \x00\x01", pickle.dumps(Payload())])
def test_load_errors_never_advise_unpickling(tmp_path, content):
    path = tmp_path / "model.pth"
    path.write_bytes(content)
    with pytest.raises(ValueError) as error:
        load_checkpoint(path)
    assert "weights_only" not in str(error.value) and "refused because loading them could run code" in str(error.value)
    assert error.value.__cause__ is None  # torch's own advice is not chained in either


def test_the_data_folder_finds_minimind_file_names(tmp_path, monkeypatch):
    monkeypatch.setattr(paths, "DATA_DIR", tmp_path)
    with pytest.raises(FileNotFoundError, match="looked for pretrain.jsonl, pretrain_hq.jsonl, pretrain_t2t"):
        paths.find_data_file("pretrain")
    (tmp_path / "pretrain_hq.jsonl").write_text("{}\n")
    (tmp_path / "sft_t2t_mini.jsonl").write_text("{}\n")
    assert paths.find_data_file("pretrain").name == "pretrain_hq.jsonl"
    assert paths.find_data_file("sft").name == "sft_t2t_mini.jsonl"
    assert pipeline.resolve_settings(pipeline.RunSettings(stage="sft"), pipeline.get_profile("smoke")).data == \
        tmp_path / "sft_t2t_mini.jsonl"
