"""Reliability (issues 18 and 29): a run survives kills, full disks and concurrent use, nothing of the user's is lost,
every bad number is refused with one clear error. Tiny smoke-profile runs of a few steps; each test fails without its
fix."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import math
import os
import pickle
import re
import shutil
import signal
from pathlib import Path

import pandas as pd
import pytest
import torch

from minimind_lib import cli, paths, pipeline
from minimind_lib.checkpoint import load_run
from minimind_lib.corpus import JsonlReader
from minimind_lib.data import memmap_dataset
from minimind_lib.generate import generate, generate_ids
from minimind_lib.checkpoint import load_checkpoint
from minimind_lib.model import MiniMindConfig, MiniMindForCausalLM
from minimind_lib.paths import DATA_DIR
from minimind_lib.tokenizer import load_tokenizer
from minimind_lib.train import evaluate

torch.set_num_threads(1)

TINY = dict(profile="smoke", seq_len=32, max_tokens=128, accum_steps=1, max_samples=48, val_batches=1, progress=False,
            log=lambda msg: None, sample_prompts=())
TINY_CLI = ["--profile", "smoke", "--seq-len", "32", "--max-tokens", "128", "--accum", "1", "--max-samples", "48",
            "--val-batches", "1", "--no-progress"]


@pytest.fixture(scope="module")
def cache(tiny_cache):
    return tiny_cache


@pytest.fixture(scope="module")
def pre(tiny_pretrain):
    """A finished 2-step pretraining run (the session's, tests/conftest.py: copy it before changing it)."""
    return tiny_pretrain


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
    real_write = pipeline.Recorder.after_checkpoint

    def killed(self):
        raise RuntimeError("killed after last.pt was written")

    monkeypatch.setattr(pipeline.Recorder, "after_checkpoint", killed)
    with pytest.raises(RuntimeError, match="killed"):
        pipeline.pretrain(out=tmp_path / "run", steps=4, ckpt_every=2, cache_dir=cache, **TINY)
    monkeypatch.setattr(pipeline.Recorder, "after_checkpoint", real_write)
    assert torch.load(tmp_path / "run" / "last.pt", weights_only=True)["step"] == 2
    assert not (tmp_path / "run" / "metrics.csv").exists()
    stale = tmp_path / "run" / ".minimind-tmp.last.pt.x1y2z3.tmp"  # what a kill during torch.save leaves
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
        assert sorted(p.name for p in out.iterdir()) == [".minimind-lock"]
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
    assert code == 2 and "records no data_fingerprint of the whole file (written by an older version)" in err


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
        rec(step, {"step": step, "loss": 1.0, "tokens": 10, "event": event, "skipped": "skipped" in event,
                   "applied": "skipped" not in event})
    df = rec.frame()
    assert df["rolled_back"].fillna(False).tolist() == [False, True, True, True, False, False]
    assert df["tokens_seen"].iloc[-1] == 30 and pipeline.summarize(df, 1.0)["tokens"] == 30


# ------------------------------------------------------------------------------------------ library API
def test_config_and_token_ids_are_validated():
    for field in ("hidden_size", "vocab_size", "num_hidden_layers"):
        with pytest.raises(ValueError, match=f"{field}=0: must be a positive integer"):
            MiniMindConfig(**{field: 0})
    with pytest.raises(ValueError, match="head_dim=0: must be a positive integer"):
        MiniMindConfig(head_dim=0)
    with pytest.raises(ValueError, match="head_dim=3 must be a positive even integer"):  # RoPE rotates pairs of dims
        MiniMindConfig(head_dim=3)
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


# ------------------------------------------------------------------------------------------ issue 29: must fix 1-6
def test_files_of_the_users_in_out_are_never_removed(pre, tmp_path, cache, capsys):
    def users_files(d: Path) -> None:
        d.mkdir(parents=True, exist_ok=True)
        (d / ".lock").write_text("my lock")
        (d / ".draft.tmp.txt").write_text("my draft")
        (d / ".notes.tmp-1").mkdir(exist_ok=True)

    def kept(d: Path) -> bool:
        return ((d / ".lock").read_text() == "my lock" and (d / ".draft.tmp.txt").read_text() == "my draft"
                and (d / ".notes.tmp-1").is_dir())

    mine = tmp_path / "mine"  # refused (a tokenizer/ this program did not write): nothing of the user's goes
    users_files(mine)
    (mine / "tokenizer").mkdir()
    (mine / "tokenizer" / "notes.txt").write_text("mine")
    code, _, err = run_cli(["pretrain", "--out", mine, "--steps", 1, "--cache", cache] + TINY_CLI, capsys)
    assert code == 2 and "not a tokenizer this program wrote" in err and kept(mine)
    code, _, err = run_cli(["pretrain", "--out", mine, "--steps", 1, "--overwrite", "--cache", cache] + TINY_CLI, capsys)
    assert code == 2 and kept(mine)
    run = tmp_path / "run"  # a run directory replaced with --overwrite: still only the program's own files go
    shutil.copytree(pre, run)
    users_files(run)
    ours = run / ".minimind-tmp.last.pt.abc.tmp"  # a killed write's leftover: the program's own prefix
    ours.write_bytes(b"\0" * 10)
    code, _, err = run_cli(["pretrain", "--out", run, "--steps", 1, "--overwrite", "--cache", cache] + TINY_CLI, capsys)
    assert code == 0, err
    assert kept(run) and not ours.exists() and not (run / ".minimind-lock").exists()
    (mine / "tokenizer" / "model.pth").write_text("not a model")  # --overwrite of a folder that is not a run
    code, _, err = run_cli(["pretrain", "--out", mine / "tokenizer", "--steps", 1, "--overwrite", "--cache", cache]
                           + TINY_CLI, capsys)
    assert code == 2 and "replaces a run of this program only" in err
    assert (mine / "tokenizer" / "model.pth").read_text() == "not a model"


def test_resume_refuses_a_same_size_edit_in_the_middle_of_the_data(tmp_path, cache, capsys):
    data = tmp_path / "data.jsonl"  # 7 MB: a fingerprint of the first and last MiB would miss the middle
    shutil.copy(DATA_DIR / "pretrain.jsonl", data)
    out, common = tmp_path / "run", ["--data", data, "--steps", 4, "--cache", cache] + TINY_CLI
    assert run_cli(["pretrain", "--out", out, "--stop-after", 2] + common, capsys)[0] == 0
    content, stat = data.read_bytes(), data.stat()
    middle = content.index(b" the ", len(content) // 2)
    data.write_bytes(content[:middle] + b" THE " + content[middle + 5:])  # same size,
    os.utime(data, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # same mtime
    code, _, err = run_cli(["pretrain", "--out", out, "--resume"] + common, capsys)
    assert code == 2 and "data.jsonl changed since the run started" in err
    data.write_bytes(content)
    assert run_cli(["pretrain", "--out", out, "--resume"] + common, capsys)[0] == 0


def nan_forward(monkeypatch, bad_calls):
    """Training forwards number 1, 2, ... whose logits are NaN (a diverged model, deterministically)."""
    forward, calls = MiniMindForCausalLM.forward, {"n": 0}

    def forward_nan(self, input_ids, *args, **kwargs):
        out = forward(self, input_ids, *args, **kwargs)
        if self.training:
            calls["n"] += 1
            if bad_calls(calls["n"]):
                out.logits = out.logits * math.nan
        return out

    monkeypatch.setattr(MiniMindForCausalLM, "forward", forward_nan)


def test_a_run_that_never_trained_fails_and_skipped_steps_are_not_counted(tmp_path, cache, monkeypatch, capsys):
    nan_forward(monkeypatch, lambda n: True)
    out = tmp_path / "never"
    code, stdout, err = run_cli(["pretrain", "--out", out, "--steps", 8, "--cache", cache] + TINY_CLI, capsys)
    assert code == 2 and "no optimizer step was applied: all 8 step(s) were skipped (nonfinite_loss_skipped)" in err
    assert stdout == "" and not (out / "summary.json").exists() and not (out / "model.pth").exists()
    monkeypatch.undo()
    nan_forward(monkeypatch, lambda n: n == 2)  # only the second step's loss is NaN
    code, stdout, err = run_cli(["pretrain", "--out", tmp_path / "one", "--steps", 4, "--cache", cache,
                                 "--allow-skipped-steps"] + TINY_CLI, capsys)
    assert code == 0 and "warning: 1 of the 4 steps were skipped" in err, err
    summary, metrics = json.loads(stdout), pd.read_csv(tmp_path / "one" / "metrics.csv")
    trained = metrics[metrics["step"] >= 0]
    assert trained["applied"].tolist() == [True, False, True, True] and summary["skipped_steps"] == [1]
    assert summary["steps"] == 3 and summary["tokens"] == trained["tokens"][trained["applied"]].sum()
    assert metrics["tokens_seen"].iloc[-1] == summary["tokens"] < trained["tokens"].sum()


def test_an_empty_out_is_refused(tmp_path, cache, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # where an empty --out would put a whole run
    code, _, err = run_cli(["pretrain", "--out", "", "--steps", 1, "--cache", cache] + TINY_CLI, capsys)
    assert code == 2 and f"--out '' is the working directory ({tmp_path})" in err
    assert list(tmp_path.iterdir()) == []


def test_a_run_stopped_before_its_first_checkpoint_resumes_from_step_0(tmp_path, cache, monkeypatch, capsys):
    out, common = tmp_path / "run", ["--steps", 3, "--cache", cache] + TINY_CLI
    fit = pipeline.fit

    def killed(*args, **kwargs):
        raise RuntimeError("killed before the first checkpoint")

    monkeypatch.setattr(pipeline, "fit", killed)
    assert run_cli(["pretrain", "--out", out] + common, capsys)[0] == 2
    monkeypatch.setattr(pipeline, "fit", fit)
    assert (out / "config.json").is_file() and not (out / "last.pt").exists()
    code, _, err = run_cli(["pretrain", "--out", out, "--resume", "--lr", "0.01"] + common, capsys)
    assert code == 2 and "config field 'lr' differs" in err  # the recorded settings still hold
    code, stdout, err = run_cli(["pretrain", "--out", out, "--resume"] + common, capsys)
    assert code == 0, err
    assert "holds no checkpoint yet: starting it again from step 0 with its recorded settings" in err
    code, _, err = run_cli(["pretrain", "--out", tmp_path / "straight"] + common, capsys)
    assert code == 0, err
    assert snapshot(out)["model.pth"] == snapshot(tmp_path / "straight")["model.pth"]
    assert json.loads(stdout)["steps"] == 3


def test_a_full_disk_names_the_file_and_keeps_the_previous_checkpoint(tmp_path, cache, capsys):
    import resource
    import subprocess
    import sys

    out, common = tmp_path / "run", ["--steps", 4, "--cache", cache] + TINY_CLI
    assert run_cli(["pretrain", "--out", out, "--stop-after", 2] + common, capsys)[0] == 0
    before = (out / "last.pt").read_bytes()
    limit = 2**20  # the file-size limit (ulimit -f): last.pt (6 MB) does not fit, tokenizer.json (0.4 MB) does
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-m", "minimind_lib", "pretrain", "--out", out, "--resume"]
                       + [str(a) for a in common], capture_output=True, text=True, env=env,
                       preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)))
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert (f"error: cannot write {out / 'last.pt'}: the file-size limit (ulimit -f) was reached; the partial file "
            f"was removed, the previous last.pt is unchanged") in p.stderr
    assert (out / "last.pt").read_bytes() == before and not list(out.glob(".minimind-tmp*"))
    assert run_cli(["pretrain", "--out", out, "--resume"] + common, capsys)[0] == 0


# ------------------------------------------------------------------------------------------ issue 29: also
def test_config_shapes_dtypes_and_undefined_losses_are_explained():
    for field, value, rule in [("intermediate_size", 0, "a positive integer"), ("intermediate_size", -1,
                               "a positive integer"), ("rope_theta", math.nan, "a finite number > 0")]:
        with pytest.raises(ValueError, match=f"MiniMindConfig.{field}={value}: must be {rule}"):
            MiniMindConfig.preset("smoke", **{field: value})
    model = MiniMindForCausalLM(MiniMindConfig.preset("smoke"))
    for ids in (torch.tensor([[1.0, 2.0]]), torch.tensor([1, 2]), torch.ones(1, 2, 3, dtype=torch.long)):
        with pytest.raises(ValueError, match=r"input_ids must be a \(batch, seq_len\) tensor of token ids, torch.long "
                                             r"or torch.int; got shape"):
            model(ids)
    with pytest.raises(ValueError, match="the loss is undefined: every label after the first position is -100"):
        model(torch.tensor([[1, 2, 3]]), labels=torch.tensor([[1, -100, -100]]))


def test_the_loop_never_steps_on_a_micro_batch_without_trained_tokens():
    from minimind_lib.train import TrainConfig, fit

    ids = torch.randint(0, 6400, (2, 16))
    good, empty = {"input_ids": ids, "labels": ids.clone()}, {"input_ids": ids, "labels": torch.full_like(ids, -100)}
    model = MiniMindForCausalLM(MiniMindConfig.preset("smoke"))
    cfg = TrainConfig(lr=1e-3, max_steps=3, warmup_steps=0, amp="off", progress=False)
    weights = []
    df = fit(model, [good, empty, good], cfg, device="cpu",
             callbacks=[lambda step, row: weights.append(model.lm_head.weight.detach().clone())])
    assert df["applied"].tolist() == [True, False, True] and df["skipped"].tolist() == [False, True, False]
    assert "no_trained_tokens_skipped" in df["event"].iloc[1] and df.attrs["bad_steps"] == 0
    assert df["empty_micro_batches"].sum() == 1 and torch.equal(weights[0], weights[1])  # AdamW did not move them
    with pytest.raises(RuntimeError, match=r"no optimizer step was applied: all 2 step\(s\) were skipped "
                                           r"\(no_trained_tokens_skipped\)"):
        fit(model, [empty], TrainConfig(max_steps=2, warmup_steps=0, amp="off", progress=False), device="cpu")


def test_clear_messages_for_a_dangling_link_a_bad_device_and_a_cache_file(tmp_path, cache, capsys):
    (tmp_path / "link").symlink_to(tmp_path / "gone")
    code, _, err = run_cli(["pretrain", "--out", tmp_path / "link", "--cache", cache] + TINY_CLI, capsys)
    assert code == 2 and f"is a symbolic link to {tmp_path / 'gone'}, which does not exist" in err
    with pytest.raises(SystemExit):
        cli.main(["pretrain", "--out", str(tmp_path / "r"), "--device", "gpu0"])
    assert "'gpu0' is not a device: use cpu, cuda, cuda:N (N: a GPU's index) or mps" in capsys.readouterr().err
    (tmp_path / "afile").write_text("a file")
    code, _, err = run_cli(["pretrain", "--out", tmp_path / "r", "--cache", tmp_path / "afile"] + TINY_CLI, capsys)
    assert code == 2 and "afile is a file, not a directory (pass --cache DIR)" in err
    assert not (tmp_path / "r").exists()


def test_the_generation_cap_warning_points_at_the_caller():
    model = MiniMindForCausalLM(MiniMindConfig.preset("smoke", max_position_embeddings=16))
    with pytest.warns(UserWarning, match="generating 2 of the 10") as warned:
        generate_ids(model, torch.ones(14, dtype=torch.long), max_new_tokens=10, temperature=0)
    assert warned[0].filename == __file__


def test_a_kill_between_checkpoint_and_samples_loses_no_sample(tmp_path, cache, monkeypatch):
    kw = {**TINY, "steps": 4, "ckpt_every": 2, "sample_every": 2, "sample_prompts": ("ROMEO.\n",), "cache_dir": cache}
    straight = pipeline.pretrain(out=tmp_path / "straight", **kw).samples
    def killed(self):  # last.pt of step 2 (with the sample of step 2) is written; samples.jsonl is next
        raise RuntimeError("killed after last.pt was written")

    monkeypatch.setattr(pipeline.Recorder, "after_checkpoint", killed)
    with pytest.raises(RuntimeError, match="killed"):
        pipeline.pretrain(out=tmp_path / "run", **kw)
    monkeypatch.undo()
    assert torch.load(tmp_path / "run" / "last.pt", weights_only=True)["step"] == 2
    assert not (tmp_path / "run" / "samples.jsonl").exists()
    resumed = pipeline.pretrain(out=tmp_path / "run", resume=True, **kw)
    assert [r["step"] for r in straight] == [2, 4] and resumed.samples == straight
    lines = (tmp_path / "run" / "samples.jsonl").read_text(encoding="utf-8").splitlines()
    assert [json.loads(line) for line in lines] == straight


# ------------------------------------------------------------------------------------------ issue 35
def test_a_run_with_skipped_steps_says_so_fails_and_reports_the_trained_models_loss(tmp_path, cache, capsys):
    out, args = tmp_path / "lr", ["--lr", "1e6", "--steps", 8, "--cache", cache] + TINY_CLI  # the gradients overflow
    code, stdout, err = run_cli(["pretrain", "--out", out] + args, capsys)
    summary, metrics = json.loads((out / "summary.json").read_text()), pd.read_csv(out / "metrics.csv")
    skipped = int(metrics["skipped"].eq(True).sum())
    assert code == 2 and stdout == "" and skipped > 0 and f"error: {skipped} of the 8 steps were skipped" in err, err
    assert "--allow-skipped-steps" in err and summary["shortfalls"][0].startswith(f"{skipped} of the 8 steps")
    model, tok, run_cfg = load_run(out)  # model.pth evaluated again on the run's validation batches
    val_ds, _ = memmap_dataset(Path(run_cfg["val_data"]), tok, "pretrain", 32, cache)
    val = pipeline.validation_batches(val_ds, 128, 32, tok.pad_token_id, n_batches=1)
    assert summary["final_val_loss"] == pytest.approx(evaluate(model, val, device="cpu")["loss"], abs=1e-6)
    assert summary["final_val_loss"] != summary["initial_val_loss"] and metrics["val_loss"].notna().iloc[-1]
    code, stdout, err = run_cli(["pretrain", "--out", tmp_path / "allowed", "--allow-skipped-steps"] + args, capsys)
    assert code == 0 and json.loads(stdout)["shortfalls"] and f"warning: {skipped} of the 8 steps" in err


@pytest.mark.parametrize("field, value, rule", [
    ("rms_norm_eps", -1, "a finite number > 0"), ("rms_norm_eps", 0.0, "a finite number > 0"),
    ("rope_theta", "abc", "a finite number > 0"), ("rope_theta", math.inf, "a finite number > 0"),
    ("dropout", 1.0, "a number from 0 to 1"), ("dropout", -0.1, "a number from 0 to 1"),
    ("router_aux_loss_coef", -1.0, "a finite number >= 0"), ("moe_intermediate_size", 0, "a positive integer"),
    ("num_hidden_layers", 2.0, "a positive integer"), ("hidden_size", True, "a positive integer"),
    ("qk_norm", 1, "a bool"), ("use_moe", "yes", "a bool"), ("max_position_embeddings", -5, "a positive integer"),
])
def test_every_config_field_is_checked_where_the_config_is_built(field, value, rule):
    with pytest.raises(ValueError, match=re.escape(f"MiniMindConfig.{field}={value!r}: must be {rule}")):
        MiniMindConfig.preset("smoke", **{field: value})


def test_a_hand_edited_run_config_names_the_file_and_field(pre, tmp_path, capsys):
    bad = tmp_path / "bad"
    shutil.copytree(pre, bad)
    config = json.loads((bad / "config.json").read_text())
    config["model"]["rope_theta"] = "abc"
    (bad / "config.json").write_text(json.dumps(config))
    code, out, err = run_cli(["chat", "--ckpt", bad, "--prompt", "hi"], capsys)
    assert code == 2 and out == "" and f"{bad / 'config.json'}: 'model': MiniMindConfig.rope_theta='abc'" in err, err
    config["model"]["rope_theta"], config["model"]["rms_norm_eps"] = 1e6, -1  # NaN logits, an empty reply, before
    (bad / "config.json").write_text(json.dumps(config))
    code, out, err = run_cli(["chat", "--ckpt", bad, "--prompt", "hi"], capsys)
    assert code == 2 and out == "" and "MiniMindConfig.rms_norm_eps=-1: must be a finite number > 0" in err, err


def test_chat_with_a_file_for_a_run_directory_says_so(pre, tmp_path, capsys):
    code, _, err = run_cli(["chat", "--ckpt", pre / "model.pth", "--prompt", "hi"], capsys)
    assert code == 2 and f"{pre / 'model.pth'} is a file, not a run directory" in err, err


def test_a_tool_call_the_system_turn_never_declared_is_warned_of_and_counted(tmp_path, cache):
    tools = [{"type": "function", "function": {"name": "add", "parameters": {}}}]
    call = lambda name: [{"role": "assistant", "content": "", "tool_calls": [  # noqa: E731
        {"type": "function", "function": {"name": name, "arguments": '{"a": 3, "b": 4}'}}]},
        {"role": "tool", "content": "7"}, {"role": "assistant", "content": "7."}]
    lines = [{"conversations": [{"role": "system", "content": "You can add.", "tools": tools},
                                {"role": "user", "content": "3+4?"}, *call("add")]},  # declared: nothing to say
             {"conversations": [{"role": "system", "content": "You can add.", "tools": tools},
                                {"role": "user", "content": "3*4?"}, *call("mul")]},  # never declared
             {"conversations": [{"role": "user", "content": "3-4?"}, *call("sub")]}]  # no tools at all
    data = tmp_path / "tools.jsonl"
    data.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    with pytest.warns(UserWarning, match=r"2 tool call\(s\) to a tool the system turn does not declare, kept "
                                         rf"\(first: {re.escape(str(data))}:2: 'mul'\)"):
        reader = JsonlReader(data, kind="sft")
        assert len(list(reader)) == 3  # accepted: MiniMind-3's data has such calls
    assert reader.counts()["n_undeclared_tool_calls"] == 2
    with pytest.warns(UserWarning, match="does not declare"):
        ds, _ = memmap_dataset(data, load_tokenizer(), "sft", 256, tmp_path / "cache", None, False, "raise")
    assert ds.stats.n_undeclared_tool_calls == 2  # in the run's data_stats too
