"""--log tensorboard|wandb (minimind_lib/loggers.py): the values are read back, with TensorBoard's own event reader
and from wandb's offline run files, and must equal metrics.csv step for step (no step twice, none missing) for a run
(pretrain and SFT), a run stopped by a signal and resumed, and a run whose controller shrank the micro-batch; the
config and device, and at the end compare's verdict and eval's ladder, are there too. A run killed outright (SIGKILL)
leaves TensorBoard's files whole and readable, and its resume sends no step twice. Offline by default, and the runs
of a process work without a network; clear errors for a missing package and a bad directory; nothing imports either
package unless a run asks for it."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from minimind_lib import cli, loggers, pipeline, train

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[1]
TINY = dict(profile="smoke", seq_len=32, max_tokens=128, accum_steps=1, max_samples=48, val_batches=1, progress=False,
            log=lambda msg: None)
TINY_ARGS = ["--profile", "smoke", "--seq-len", "32", "--max-tokens", "128", "--accum", "1", "--max-samples", "48",
             "--val-batches", "1", "--no-progress"]
NOT_LOGGED = {"step", "tokens_seen"}  # the x axis; tokens_seen is summed from the rows as metrics.csv is written


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path):
    """The default: no WANDB_MODE (offline), and a server address nothing listens on, should anything try."""
    for name in ("WANDB_MODE", "WANDB_PROJECT", "WANDB_ERROR_REPORTING"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))


# ----------------------------------------------------------------------------------- reading the values back
def tensorboard_values(run_dir: Path) -> tuple[dict, dict]:
    """({tag: [(step, value)]}, {tag: [(step, text)]}) of every event file in run_dir/tensorboard, in order."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"tensors": 0, "scalars": 0},
                           purge_orphaned_data=False)
    acc.Reload()
    scalars = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    texts = {tag[:-len("/text_summary")]: [(e.step, tensor_util.make_ndarray(e.tensor_proto).item().decode())
                                           for e in acc.Tensors(tag)] for tag in acc.Tags()["tensors"]}
    return scalars, texts


def float32(values: dict) -> dict:
    """{key: [(step, value)]} with each value as TensorBoard keeps a scalar: a float32."""
    return {key: [(step, float(np.float32(value))) for step, value in pairs] for key, pairs in values.items()}


def wandb_records(path: Path):
    """The records of a .wandb file (a LevelDB log: 32 KiB blocks of chunks, each with a 7-byte header)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, chunk = path.read_bytes(), 7, b""
    assert data[:4] == b":W&B", path
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if left < 7 or kind == 0:  # the end of a block: padding
            pos += left
            continue
        chunk, pos = chunk + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            record = pb.Record()
            record.ParseFromString(chunk)
            chunk = b""
            yield record


def wandb_values(run_dir: Path) -> tuple[dict, dict, list]:
    """({key: [(step, value)]}, {key: [(step, text)]}, the run records) of every offline run in run_dir/wandb."""
    scalars, texts, runs = defaultdict(list), defaultdict(list), []
    for path in sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb")):
        for record in wandb_records(path):
            if record.WhichOneof("record_type") == "run":
                runs.append(record.run)
            if record.WhichOneof("record_type") != "history":
                continue
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            for key, value in row.items():
                if not key.startswith("_") and key != "step":
                    (texts if isinstance(value, str) else scalars)[key].append((row["step"], value))
    return dict(scalars), dict(texts), runs


def metrics_values(run_dir: Path) -> tuple[dict, dict]:
    """metrics.csv as ({column: [(step, number)]}, {column: [(step, text)]}): what the loggers must hold."""
    df = pd.read_csv(run_dir / "metrics.csv")
    scalars, texts = defaultdict(list), defaultdict(list)
    for row in df.to_dict("records"):
        for key, value in row.items():
            if key in NOT_LOGGED:
                continue
            if isinstance(value, str) and value:
                texts[key].append((int(row["step"]), value))
            elif isinstance(value, (bool, int, float)) and math.isfinite(value):
                scalars[key].append((int(row["step"]), float(value)))
    return dict(scalars), dict(texts)


def assert_logged_as_metrics(run_dir: Path, extra: set[str] = frozenset()) -> None:
    """TensorBoard's and wandb's values equal metrics.csv's, step for step, each step once (extra: other keys)."""
    want_scalars, want_texts = metrics_values(run_dir)
    tb_scalars, tb_texts = tensorboard_values(run_dir)
    wb_scalars, wb_texts, _ = wandb_values(run_dir)
    for name, scalars, texts, want in (("tensorboard", tb_scalars, tb_texts, float32(want_scalars)),
                                       ("wandb", wb_scalars, wb_texts, want_scalars)):
        texts = {k: v for k, v in texts.items() if k != "config"}
        assert {k: v for k, v in scalars.items() if k not in extra} == want, name
        assert {k: v for k, v in texts.items() if k not in extra} == want_texts, name
    steps = [s for s, _ in want_scalars["lr"]]
    assert len(steps) == len(set(steps)) and steps == sorted(steps)


def read_config(run_dir: Path) -> dict:
    return json.loads((run_dir / "config.json").read_text())


# ----------------------------------------------------------------------------------- runs
def test_a_logged_run_matches_metrics_csv_step_for_step(tmp_path):
    run = pipeline.pretrain(out=tmp_path / "pre", steps=4, eval_every=2, cache_dir=tmp_path / "cache",
                            loggers=("tensorboard", "wandb"), **TINY)
    assert_logged_as_metrics(run.out_dir)
    scalars, texts = tensorboard_values(run.out_dir)
    assert [s for s, _ in scalars["val_loss"]] == [-1, 1, 3]  # before training, then every eval_every steps
    assert "peak_memory_bytes" not in scalars  # a CPU run measures none: nothing is logged rather than a guess
    config = read_config(run.out_dir)
    assert json.loads(texts["config"][0][1].strip("`\n")) == config and config["device"] == "cpu"
    _, _, runs = wandb_values(run.out_dir)
    assert [r.run_id for r in runs] == [config["run_id"]]
    wandb_config = {item.key: json.loads(item.value_json) for item in runs[0].config.update}
    assert wandb_config["device"] == "cpu" and wandb_config["run_id"] == config["run_id"]
    assert "offline-run-" in next((run.out_dir / "wandb").glob("offline-run-*")).name  # offline by default
    sft = pipeline.sft(out=tmp_path / "sft", init=run.out_dir, steps=2, cache_dir=tmp_path / "cache",
                       loggers=("tensorboard", "wandb"), **TINY)  # SFT: the same code path
    assert_logged_as_metrics(sft.out_dir)
    assert read_config(sft.out_dir)["run_id"] != config["run_id"]


def stop_itself(out: Path, cache: Path, sig: signal.Signals, steps: int) -> list[str]:
    """Start the command line in a process of its own that sends itself `sig` right after its second checkpoint's
    rows went to the loggers (without a network where unshare can take it away); its arguments, for a resume."""
    args = ["pretrain", "--out", str(out), "--cache", str(cache), "--steps", str(steps), "--eval-every", "2",
            *TINY_ARGS, "--log", "tensorboard", "--log", "wandb"]
    script = ("import os, signal, sys\nfrom minimind_lib import cli, loggers\n"
              "send, sent = loggers.SendRows.after_checkpoint, []\n"
              "def after_checkpoint(self):\n    send(self)\n    sent.append(1)\n"
              f"    if len(sent) == 2:\n        os.kill(os.getpid(), {int(sig)})\n"
              "loggers.SendRows.after_checkpoint = after_checkpoint\nsys.exit(cli.main(sys.argv[1:]))\n")
    no_network = ["unshare", "--net"] if shutil.which("unshare") and subprocess.run(
        ["unshare", "--net", "true"], capture_output=True).returncode == 0 else []
    env = {k: v for k, v in os.environ.items() if k != "WANDB_SERVICE"}  # its own wandb process, not ours
    proc = subprocess.Popen([*no_network, sys.executable, "-c", script, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**env, "MINIMIND_PROFILE": "smoke"},
                            cwd=out.parent)
    _, err = proc.communicate(timeout=600)
    expected = -signal.SIGKILL if sig == signal.SIGKILL else 2  # SIGTERM: stopped after the step, checkpointed
    assert proc.returncode == expected, err[-3000:]
    deadline = time.monotonic() + 60  # wandb's own process outlives a killed one a moment, then ends
    while any(f"--pid\0{proc.pid}\0" in c for c in _commands()) and time.monotonic() < deadline:
        time.sleep(0.2)
    return args


def test_a_stopped_run_resumed_continues_the_same_curves_and_ends_with_verdict_and_ladder(tmp_path, monkeypatch,
                                                                                          capsys):
    out = tmp_path / "pre"
    args = stop_itself(out, tmp_path / "cache", signal.SIGTERM, steps=8)  # as Ctrl-C or a cluster's SIGTERM
    assert pd.read_csv(out / "metrics.csv")["step"].tolist() == [-1, 0, 1, 2, 3, 4, 5]
    assert_logged_as_metrics(out)
    reports, report_of = [], cli.run_report  # the numbers the resumed invocation sends at its end
    monkeypatch.setattr(cli, "run_report", lambda run_dir: reports.append(report_of(run_dir)) or reports[-1])
    capsys.readouterr()
    assert cli.main([*args, "--resume"]) == 0
    assert json.loads(capsys.readouterr().out)["steps"] == 8  # stdout: the summary alone (wandb talks on stderr)
    assert pd.read_csv(out / "metrics.csv")["step"].tolist() == [-1, *range(8)]
    report = loggers.flatten(reports[0])
    assert_logged_as_metrics(out, extra=set(report))  # every step once, in both, across the two invocations
    runs = wandb_values(out)[2]
    assert len(runs) == 2 and {r.run_id for r in runs} == {read_config(out)["run_id"]}  # one wandb run, resumed
    # at the end, at the last step: compare's verdict (or why there is none) and eval's ladder, in both
    (tb_scalars, tb_texts), (wb_scalars, wb_texts, _) = tensorboard_values(out), wandb_values(out)
    numbers = {k: float(v) for k, v in report.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    assert "ladder/table/model/all/bits_per_byte" in numbers and "ladder/two_choice/share" in numbers
    for key, value in numbers.items():
        assert tb_scalars[key] == [(7, float(np.float32(value)))] and wb_scalars[key] == [(7, value)], key
    words = {k: v for k, v in report.items() if isinstance(v, str)}
    assert {"band/verdict", "band/error"} & set(words)
    for key, text in words.items():
        assert tb_texts[key] == [(7, text)] and wb_texts[key] == [(7, text)], key


def test_a_killed_run_leaves_readable_files_and_its_resume_sends_no_step_twice(tmp_path):
    out = tmp_path / "pre"
    stop_itself(out, tmp_path / "cache", signal.SIGKILL, steps=6)  # no handler runs: as kill -9 or a power cut
    assert pd.read_csv(out / "metrics.csv")["step"].tolist() == [-1, 0, 1, 2, 3]
    want, _ = metrics_values(out)
    assert tensorboard_values(out)[0] == float32(want)  # the event files read back whole, to the last checkpoint
    # wandb's file reads back too, holding what wandb's own process had written of it when the run died (it
    # writes 32 KiB blocks, and the rest at a run's end, which a killed run never reaches): here, a few rows at most
    kept, _, _ = wandb_values(out)
    assert all(set(values) <= set(want[key]) for key, values in kept.items())
    pipeline.pretrain(out=out, steps=6, eval_every=2, cache_dir=tmp_path / "cache", resume=True,
                      loggers=("tensorboard", "wandb"), **TINY)
    want, _ = metrics_values(out)
    assert tensorboard_values(out)[0] == float32(want)  # every step once, none missing
    logged, _, runs = wandb_values(out)
    for key in want:
        steps = [step for step, _ in logged.get(key, [])]
        assert len(steps) == len(set(steps)) and set(logged.get(key, [])) <= set(want[key]), key  # none twice
        resumed = [(step, value) for step, value in logged.get(key, []) if step >= 4]
        assert resumed == [(step, value) for step, value in want[key] if step >= 4], key  # all it sent
    assert {r.run_id for r in runs} == {read_config(out)["run_id"]}  # the same wandb run


def _commands() -> list[str]:
    """The command lines of this machine's processes (Linux /proc), arguments joined by NUL."""
    lines = []
    for path in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            lines.append(path.read_text(errors="replace") + "\0")
        except OSError:
            continue
    return lines


def test_a_controller_shrink_is_logged_at_its_step(tmp_path, inject_oom):
    inject_oom(3)  # the third multi-row forward runs out of memory: the controller halves the micro-batch
    run = pipeline.pretrain(out=tmp_path / "pre", steps=3, eval_every=3, cache_dir=tmp_path / "cache",
                            loggers=("tensorboard", "wandb"), **TINY)
    assert run.summary["batching"]["oom_events_recovered"] == 1
    assert_logged_as_metrics(run.out_dir)
    _, texts = tensorboard_values(run.out_dir)
    shrinks = [(step, text) for step, text in texts["event"] if "oom_halve" in text]
    assert len(shrinks) == 1 and run.metrics.query(f"step == {shrinks[0][0]}")["event"].item() == shrinks[0][1]


def test_rows_go_out_with_their_checkpoint_and_a_rollback_sends_only_the_rows_it_kept(tmp_path):
    class Memo:
        def __init__(self):
            self.rows = []

        def log(self, step, values):
            self.rows.append((step, loggers.split(values)[0].get("loss")))

    memo = Memo()
    sender = loggers.SendRows([memo], buffered=True)
    for step in range(3):
        sender(step, {"step": step, "loss": 1.0 + step, "event": ""})
    assert memo.rows == []  # nothing before the checkpoint that holds them
    sender.after_checkpoint()
    assert memo.rows == [(0, 1.0), (1, 2.0), (2, 3.0)]
    sender(3, {"step": 3, "loss": math.nan, "event": "nonfinite_loss_skipped"})
    sender(4, {"step": 4, "loss": math.nan, "event": "nonfinite_loss_skipped;rollback_to_step_3;lr_scale=0.5"})
    sender(3, {"step": 3, "loss": 4.0, "event": "ckpt"})
    sender.after_checkpoint()
    assert memo.rows[3:] == [(3, 4.0)]  # the undone steps never show; metrics.csv keeps them, marked rolled_back
    live = loggers.SendRows([memo], buffered=False)  # no checkpoints: at fit's log points
    live(5, {"step": 5, "loss": 5.0})
    assert memo.rows[-1] == (5, 5.0)


def test_fit_sends_every_row_to_its_loggers():
    from minimind_lib.data import pad_collate
    from minimind_lib.model import MiniMindConfig, MiniMindForCausalLM

    class Memo:
        def __init__(self):
            self.steps = []

        def log(self, step, values):
            self.steps.append(step)

    torch.manual_seed(0)
    model = MiniMindForCausalLM(MiniMindConfig.preset("smoke", vocab_size=256))
    data = [pad_collate([{"input_ids": torch.arange(3, 3 + n), "labels": torch.arange(3, 3 + n)}]) for n in (5, 9)]
    memo = Memo()
    df = train.fit(model, data, train.TrainConfig(max_steps=5, log_every=2, progress=False), device="cpu",
                   loggers=[memo])
    assert memo.steps == df["step"].tolist() == list(range(5))  # no checkpoints: at fit's log points


# ----------------------------------------------------------------------------------- errors, imports, make
def test_a_missing_package_and_a_bad_directory_are_clear_errors(tmp_path, monkeypatch, capsys):
    out = tmp_path / "pre"
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed: find_spec finds none, import fails
    assert cli.main(["pretrain", "--out", str(out), *TINY_ARGS, "--log", "wandb"]) == 2
    err = capsys.readouterr().err
    assert "--log wandb: the wandb package is not installed" in err and "pip install -r requirements-wandb.txt" in err
    assert not out.exists()  # refused before anything was written
    out.mkdir()
    (out / "tensorboard").write_text("not a folder")
    assert cli.main(["pretrain", "--out", str(out), *TINY_ARGS, "--log", "tensorboard"]) == 2
    assert f"{out / 'tensorboard'} is a file, not a directory" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == ["tensorboard"]
    with pytest.raises(SystemExit) as exit_:
        cli.main(["pretrain", "--out", str(out), *TINY_ARGS, "--log", "tensorbord"])
    assert exit_.value.code == 2 and "invalid choice: 'tensorbord'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="'tensorbord': not a logger; choose from tensorboard, wandb"):
        loggers.check_loggers(["tensorbord"], out)


def test_an_overwritten_run_starts_new_curves(tmp_path):
    out = tmp_path / "pre"
    first = pipeline.pretrain(out=out, steps=2, eval_every=2, cache_dir=tmp_path / "cache",
                              loggers=("tensorboard",), **TINY)
    second = pipeline.pretrain(out=out, steps=2, eval_every=2, cache_dir=tmp_path / "cache", overwrite=True,
                               loggers=("tensorboard",), **TINY)
    assert first.config["run_id"] != second.config["run_id"]
    assert len(list((out / "tensorboard").iterdir())) == 1  # the replaced run's event file went with it
    scalars, _ = tensorboard_values(out)
    assert scalars["lr"] == float32(metrics_values(out)[0])["lr"]


def test_nothing_imports_tensorboard_or_wandb_unless_a_run_asks(tmp_path):
    code = ("import sys\nfrom minimind_lib import cli, pipeline, train, loggers, evaluate\n"
            "print(sorted(m for m in ('tensorboard', 'wandb', 'torch.utils.tensorboard') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("run, message", [("", "usage: make tensorboard RUN="), ("no/such/dir", "is not a directory"),
                                          ("data", "holds no TensorBoard event files")])
def test_make_tensorboard_refuses_what_it_cannot_open(run, message):
    # -o: take the installed venv as it is (never reinstall from a test)
    done = subprocess.run(["make", "-s", "-o", ".venv/.installed", "tensorboard", f"RUN={run}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and message in done.stderr
