"""Reliability (issue 43): a result is printed only for the model it names, --json is strict JSON, a hand-edited or
cut metrics.csv is refused, a killed handout never blocks the next, system errors read as sentences, SFT data with
roles out of order is refused, the benchmarks and tools refuse bad arguments in one line, and a long document is
tokenized in bounded pieces. Each test checks the exit code and the message."""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from minimind_lib import cli, pipeline
from minimind_lib.corpus import JsonlReader, tokenize_samples, tokenize_to_memmap
from minimind_lib.data import holdout_indices
from minimind_lib.export import export_run
from minimind_lib.model import MAX_POSITIONS
from minimind_lib.paths import DATA_DIR
from minimind_lib.tokenizer import PIECE_CHARS, load_tokenizer

torch.set_num_threads(1)

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))

import handout  # noqa: E402

TINY = dict(profile="smoke", seq_len=32, max_tokens=128, accum_steps=1, max_samples=48, val_batches=1, progress=False,
            log=lambda msg: None, sample_prompts=())
TINY_CLI = ["--profile", "smoke", "--seq-len", "32", "--max-tokens", "128", "--accum", "1", "--max-samples", "48",
            "--val-batches", "1", "--no-progress"]
ENV = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "MINIMIND_PROFILE": "smoke"}


def strict_json(text: str):
    """json.loads that refuses NaN and Infinity, as jq and JSON.parse do."""
    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")
    return json.loads(text, parse_constant=refuse)


def run_cli(args: list) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main([str(a) for a in args])
        except SystemExit as e:  # argparse
            code = e.code
    return code, out.getvalue(), err.getvalue()


def snapshot(d: Path) -> dict:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def cache(tiny_cache):
    return tiny_cache


@pytest.fixture(scope="module")
def pre(tiny_pretrain):
    """A finished 2-step pretraining run (the session's, tests/conftest.py: copy it before changing it)."""
    return tiny_pretrain


@pytest.fixture(scope="module")
def hf(pre, tmp_path_factory):
    """Its export in the transformers format."""
    return export_run(pre, tmp_path_factory.mktemp("hf") / "export")


def edited_copy(src: Path, dst: Path, config=None, weights: bytes | None = None) -> Path:
    shutil.copytree(src, dst)
    if config is not None:
        (dst / "config.json").write_text(config(json.loads((dst / "config.json").read_text())))
    if weights is not None:
        (dst / "model.safetensors").write_bytes(weights)
    return dst


def with_fields(**changes):
    return lambda c: json.dumps({**c, **changes})


# ------------------------------------------------------------------------------------------ 1. eval names its model
@pytest.mark.parametrize("name, config, message", [
    ("one layer fewer", with_fields(num_hidden_layers=1), "model.safetensors: unexpected key 'model.layers.1."),
    ("one layer more", with_fields(num_hidden_layers=3), "model.safetensors: missing key 'model.layers.2."),
    ("an untied head", with_fields(tie_word_embeddings=False), "config.json: not a model config this course reads "
     "(RunError: tie_word_embeddings=False: the course's model has tie_word_embeddings=True only)"),
    ("a number", lambda c: "5", "config.json: not a model config this course reads (ValueError: a JSON object of "
     "fields, not int 5)"),
    ("broken JSON", lambda c: "{bad", "config.json: not a model config this course reads (JSONDecodeError"),
    ("another vocabulary", with_fields(vocab_size=6401), "does not match the model's vocab_size=6401"),
    ("2**62 positions", with_fields(max_position_embeddings=2**62), f"MiniMindConfig.max_position_embeddings="
     f"{2**62}: must be a positive integer <= {MAX_POSITIONS}"),
    ("10**9 positions", with_fields(max_position_embeddings=10**9), "must be a positive integer <= 131072"),
])
def test_eval_of_an_edited_export_prints_no_numbers(hf, tmp_path, name, config, message):
    bad = edited_copy(hf, tmp_path / "bad", config)
    code, out, err = run_cli(["eval", bad, "--json"])
    assert code == 2 and out == "" and message in err and str(bad) in err, err
    assert err.startswith("error: ") and "Traceback" not in err
    code, out, err = run_cli(["import-hf", bad, "--out", tmp_path / "imported"])  # refused the same way
    assert code == 2 and message in err and not (tmp_path / "imported").exists()


def test_eval_of_a_truncated_weights_file_names_it(hf, tmp_path):
    bad = edited_copy(hf, tmp_path / "bad", weights=(hf / "model.safetensors").read_bytes()[:5000])
    code, out, err = run_cli(["eval", bad, "--json"])
    assert code == 2 and out == "" and f"{bad / 'model.safetensors'}: cannot read the weights (SafetensorError" in err


def test_a_run_config_with_too_many_positions_is_refused(pre, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(pre, bad)
    config = json.loads((bad / "config.json").read_text())
    config["model"]["max_position_embeddings"] = 2**62
    (bad / "config.json").write_text(json.dumps(config))
    code, out, err = run_cli(["chat", "--ckpt", bad, "--prompt", "hi"])
    assert code == 2 and out == "" and f"MiniMindConfig.max_position_embeddings={2**62}: must be a positive" in err


# ------------------------------------------------------------------------------------------ 2. SFT's held-out rows
def conversation(system_words: int, answer: str = "hello") -> str:
    turns = ([{"role": "system", "content": "word " * system_words}] if system_words else []) + [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": answer}]
    return json.dumps({"conversations": turns}) + "\n"


def test_sft_holds_out_conversations_that_train_something(pre, tmp_path, cache):
    # 40 conversations; the two the seed drew before (holdout_indices without `trains`) answer past seq_len 32, so
    # they used to leave the validation loss without a token: "evaluate: the batches have no trained tokens".
    before = holdout_indices(40, 1337)[1]
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(conversation(100 if i in before else 0) for i in range(40)))
    out = tmp_path / "sft"
    code, stdout, err = run_cli(["sft", "--init", pre, "--out", out, "--data", data, "--steps", 1, "--cache", cache]
                                + TINY_CLI)
    assert code == 0, err
    summary = json.loads(stdout)
    assert math.isfinite(summary["initial_val_loss"]) and json.loads((out / "config.json").read_text())[
        "sft_val_holdout"] == 2
    trains = [i not in before for i in range(40)]
    assert not set(holdout_indices(40, 1337, trains)[1]) & set(before)


def test_sft_with_too_few_conversations_that_train_is_refused_before_writing(pre, tmp_path, cache):
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(conversation(0 if i == 7 else 100) for i in range(20)))  # line 8 alone trains
    out = tmp_path / "sft"
    code, _, err = run_cli(["sft", "--init", pre, "--out", out, "--data", data, "--steps", 1, "--cache", cache]
                           + TINY_CLI)
    assert code == 2 and not out.exists(), err
    assert (f"error: {data}: only 1 of 20 conversations train a token within seq_len=32; SFT holds out 1 that do "
            f"for its validation loss and needs more to train on. The others (lines 1, 2, 3, 4, 5 ...) answer past "
            f"it (line 1: from token ") in err and "raise --seq-len (to " in err and "--val-data FILE" in err


# ------------------------------------------------------------------------------------------ 3. JSON is JSON
def test_eval_json_without_an_assistant_token_is_strict_json_with_null_and_exit_3(pre, tmp_path):
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(conversation(0) for _ in range(3)))
    code, out, err = run_cli(["eval", pre, "--data", data, "--seq-len", 4, "--replies", 1, "--json"])
    result = strict_json(out)  # raises on NaN or Infinity
    chat = result["chat"]
    assert code == 3 and chat["assistant_loss"] is None and chat["assistant_tokens"] == 0, err
    assert chat["assistant_loss_missing"] == ("no assistant token within the first 4 tokens of any of the 3 "
                                              "conversations: a longer --seq-len")
    code, out, _ = run_cli(["eval", pre, "--data", data, "--seq-len", 4, "--replies", 1])
    assert code == 3 and "assistant-token loss: none (no assistant token within the first 4 tokens" in out


# ------------------------------------------------------------------------------------------ 4. compare's metrics.csv
def edit_metrics(run: Path, dst: Path, edit) -> Path:
    shutil.copytree(run, dst)
    path = dst / "metrics.csv"
    path.write_bytes(edit(path.read_bytes()))
    return dst


def set_cell(row: int, column: str, value: str):
    def edit(data: bytes) -> bytes:
        lines = data.decode().split("\n")
        cells = lines[row].split(",")
        cells[lines[0].split(",").index(column)] = value
        lines[row] = ",".join(cells)
        return "\n".join(lines).encode()
    return edit


@pytest.mark.parametrize("name, edit, message", [
    ("cut mid-row", lambda b: b[:-7], "metrics.csv: its last row is cut short (no end of line): the file is "
     "incomplete"),
    ("0x in step", set_cell(2, "step", "0x"), "metrics.csv:3: column 'step' holds '0x', not a number"),
    ("abc in val_loss", set_cell(1, "val_loss", "abc"), "metrics.csv:2: column 'val_loss' holds 'abc', not a number"),
    ("lots in tokens", set_cell(3, "tokens", "lots"), "metrics.csv:4: column 'tokens' holds 'lots', not a number"),
    ("a short row", lambda b: b.replace(b"\n", b"\n0,1\n", 1), "metrics.csv:2: not a row of"),
    ("its last row gone", lambda b: b"\n".join(b.split(b"\n")[:-2]) + b"\n", "trained tokens, "),
])
def test_compare_refuses_an_edited_or_cut_metrics_table(pre, tmp_path, name, edit, message):
    run = edit_metrics(pre, tmp_path / "run", edit)
    code, out, err = run_cli(["compare", run, "--json"])
    assert code == 2 and out == "" and message in err and "Traceback" not in err, err
    assert "so no verdict" in err


# ------------------------------------------------------------------------------------------ 5. the handout
def small_course(root: Path) -> tuple[Path, Path]:
    src, data = root / "notebooks", root / "data"
    (src / "solutions").mkdir(parents=True)
    (src / "figures").mkdir()
    (src / "figures" / "a.svg").write_text("<svg/>")
    (src / "exercise_checks.py").write_text("STRICT = False\n")
    (src / "ddp_demo.py").write_text("print(1)\n")
    data.mkdir()
    (data / "pretrain.jsonl").write_text('{"text": "x"}\n')
    import nbformat
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("print(1)")])
    for name in ("01_a.ipynb", "02_b.ipynb"):
        nbformat.write(nb, src / name)
        nbformat.write(nb, src / "solutions" / name)
    return src, data


def temp_files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob(".minimind-tmp*"))


def killed_handout(out: Path, src: Path, data: Path, call: str, nth: int, after: bool) -> int:
    """make_handout in a child process that SIGKILLs itself at the nth call of os.`call` (before or after it runs);
    the child's exit: -9 when the kill came, 0 when the run ended first."""
    pid = os.fork()
    if pid == 0:  # the child: no pytest machinery, no cleanup (os._exit)
        real, count = getattr(os, call), [0]

        def dying(*args, **kwargs):
            count[0] += 1
            if count[0] == nth and not after:
                os.kill(os.getpid(), signal.SIGKILL)
            result = real(*args, **kwargs)
            if count[0] == nth and after:
                os.kill(os.getpid(), signal.SIGKILL)
            return result
        setattr(os, call, dying)
        try:
            handout.make_handout(out, src, data)
        except BaseException:
            os._exit(1)
        os._exit(0)
    status = os.waitpid(pid, 0)[1]
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def test_a_handout_killed_at_any_point_leaves_a_rerun_that_works_and_no_temp_file(tmp_path):
    src, data = small_course(tmp_path)
    reference = tmp_path / "reference"
    handout.make_handout(reference, src, data)
    (src / "ddp_demo.py").unlink()  # the course drops a file: the rerun removes the earlier handout's copy
    (src / "02_b.ipynb").write_text((src / "02_b.ipynb").read_text().replace("print(1)", "print(2)"))
    expected = tmp_path / "expected"
    shutil.copytree(reference, expected)
    handout.make_handout(expected, src, data)
    kills = 0
    for call in ("replace", "unlink", "fsync"):
        for after in (False, True):
            for nth in range(1, 60):
                out = tmp_path / f"out-{call}-{after}-{nth}"
                shutil.copytree(reference, out)
                (out / "lab" / "my_notes.ipynb").write_text("the learner's")
                code = killed_handout(out, src, data, call, nth, after)
                assert code in (0, -signal.SIGKILL), (call, after, nth, code)
                if code == 0:
                    break  # the run ended before its nth such call: every kill point of this call is covered
                kills += 1
                handout.make_handout(out, src, data)  # the rerun: no "was not written by the handout"
                assert temp_files(out) == [], (call, after, nth)
                assert (out / "lab" / "my_notes.ipynb").read_text() == "the learner's"
                got = {k: v for k, v in snapshot(out).items() if k != "lab/my_notes.ipynb"}
                assert got == snapshot(expected), (call, after, nth)
                shutil.rmtree(out)
    assert kills > 30  # every file's write and replace, both manifests', the removal of the dropped file's copies


def test_a_handout_is_not_made_to_delete_a_learners_file_by_its_manifest(tmp_path):
    src, data = small_course(tmp_path)
    out = tmp_path / "handout"
    handout.make_handout(out, src, data)
    (out / "lab" / "mine.ipynb").write_text("the learner's")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "01_a.ipynb").write_text("outside the handout")
    (out / "old").symlink_to(elsewhere, target_is_directory=True)
    manifest = json.loads((out / handout.MANIFEST).read_text())
    manifest["files"]["lab/mine.ipynb"] = handout._sha256(out / "lab" / "mine.ipynb")  # its true SHA-256
    manifest["files"]["old/01_a.ipynb"] = handout._sha256(elsewhere / "01_a.ipynb")
    (out / handout.MANIFEST).write_text(json.dumps(manifest))
    handout.make_handout(out, src, data)
    assert (out / "lab" / "mine.ipynb").read_text() == "the learner's"
    assert (elsewhere / "01_a.ipynb").read_text() == "outside the handout"
    assert set(handout.read_manifest(out)) == set(handout.plan_handout(src, data))


def test_a_handout_never_writes_through_a_folder_linked_elsewhere(tmp_path):
    src, data = small_course(tmp_path)
    out, elsewhere = tmp_path / "handout", tmp_path / "elsewhere"
    elsewhere.mkdir()
    out.mkdir()
    (out / "data").symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(handout.HandoutError, match=r"data/pretrain\.jsonl: its folder links outside"):
        handout.make_handout(out, src, data)
    assert list(elsewhere.iterdir()) == []


def handout_command(out: Path, limit: int | None = None, drop_dac: bool = False) -> subprocess.CompletedProcess:
    prefix = without_dac_override() if drop_dac else []
    rlimit = None if limit is None else lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return subprocess.run([*prefix, sys.executable, str(REPO / "tools" / "handout.py"), "--out", str(out)], env=ENV,
                          capture_output=True, text=True, preexec_fn=rlimit)


def test_the_handout_on_a_full_disk_exits_2_and_the_next_run_goes_on(tmp_path):
    out = tmp_path / "handout"
    p = handout_command(out, limit=2**20)  # data/pretrain.jsonl does not fit in 1 MB
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert p.stderr.startswith("error: cannot write ") and "the file-size limit (ulimit -f) was reached" in p.stderr
    p = handout_command(out)
    assert p.returncode == 0 and temp_files(out) == [], p.stderr


def without_dac_override() -> list[str]:
    """A command prefix under which a folder's permissions hold (root: without the capability to override them)."""
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        pytest.skip("root without setpriv: a read-only folder cannot be made")
    return ["setpriv", "--bounding-set=-dac_override,-dac_read_search"]


def test_the_handout_into_a_read_only_folder_exits_2(tmp_path):
    out = tmp_path / "handout"
    out.mkdir()
    out.chmod(0o555)
    try:
        p = handout_command(out, drop_dac=True)
    finally:
        out.chmod(0o755)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert p.stderr == (f"error: {out / handout.MANIFEST}: permission denied: this user may not write (or read) "
                        f"there; choose another folder or change its permissions\n")


# ------------------------------------------------------------------------------------------ 6. system errors
READ_ONLY_SCRIPT = """
import json, sys
from minimind_lib import cli
import contextlib, io
results = []
for args in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = cli.main(args)
    results.append([code, err.getvalue()])
print(json.dumps(results))
"""


def test_read_only_folders_give_one_line_naming_the_path(pre, hf, tmp_path, cache):
    ro = tmp_path / "ro"
    ro.mkdir()
    shutil.copytree(pre, ro / "run")
    shutil.copytree(hf, ro / "hf")
    cases = {"pretrain": ["pretrain", "--out", ro / "new", "--steps", 1, "--cache", cache] + TINY_CLI,
             "--resume": ["pretrain", "--out", ro / "run", "--steps", 4, "--resume", "--cache", cache] + TINY_CLI,
             "export": ["export", pre, "--to", ro / "hf2"],
             "export --overwrite": ["export", pre, "--to", ro / "hf", "--overwrite"],
             "import-hf": ["import-hf", hf, "--out", ro / "imported"]}
    before = snapshot(ro)
    for d in (ro, ro / "run", ro / "hf"):
        d.chmod(0o555)
    try:
        argv = [*without_dac_override(), sys.executable, "-c", READ_ONLY_SCRIPT,
                json.dumps([[str(a) for a in args] for args in cases.values()])]
        p = subprocess.run(argv, env=ENV, capture_output=True, text=True)
    finally:
        for d in (ro, ro / "run", ro / "hf"):
            d.chmod(0o755)
    assert p.returncode == 0, p.stderr
    for name, (code, err) in zip(cases, json.loads(p.stdout)):
        assert code == 2 and err.count("\n") == 1 and "Errno" not in err, (name, err)
        assert err.startswith(f"error: {ro}/") and ": permission denied: this user may not write" in err, (name, err)
    assert snapshot(ro) == before


def test_an_out_that_is_not_utf8_is_refused_before_writing(tmp_path, cache):
    out = os.fsdecode(os.fsencode(str(tmp_path)) + b"/run\xff")
    code, _, err = run_cli(["pretrain", "--out", out, "--steps", 1, "--cache", cache] + TINY_CLI)
    assert code == 2 and "the name holds bytes that are not UTF-8 text" in err and "codec" not in err
    assert list(tmp_path.iterdir()) == []


def test_a_full_disk_during_export_names_the_file_and_replaces_nothing(pre, tmp_path):
    out = tmp_path / "hf"
    p = subprocess.run([sys.executable, "-m", "minimind_lib", "export", str(pre), "--to", str(out)], env=ENV,
                       capture_output=True, text=True,
                       preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (2**20, 2**20)))
    assert p.returncode == 2 and "Traceback" not in p.stderr and "SafetensorError" not in p.stderr, p.stderr
    assert p.stderr == (f"error: cannot write {out / 'model.safetensors'}: the file-size limit (ulimit -f) was "
                        f"reached; nothing in {out} was replaced\n")
    assert not out.exists()


def test_a_folder_where_export_writes_a_file_is_refused_before_anything_is_replaced(pre, hf, tmp_path):
    target = tmp_path / "hf"
    shutil.copytree(hf, target)
    (target / "model.safetensors").unlink()
    (target / "model.safetensors").mkdir()  # the user's folder, of the name of a file the earlier export wrote
    before = snapshot(target)
    code, _, err = run_cli(["export", pre, "--to", target, "--overwrite"])
    assert code == 2 and err == (f"error: {target / 'model.safetensors'} is a folder where this command writes a "
                                 f"file: move it away or choose another directory\n")
    assert snapshot(target) == before and (target / "model.safetensors").is_dir()


# ------------------------------------------------------------------------------------------ 7. roles out of order
def turns(*roles: str) -> str:
    return json.dumps({"conversations": [{"role": r, "content": f"a {r} turn"} for r in roles]}) + "\n"


@pytest.mark.parametrize("roles, message", [
    (("assistant", "user", "assistant"), "conversations[0] ('assistant'): an answer needs a 'user' turn before it"),
    (("system", "assistant"), "conversations[1] ('assistant'): an answer needs a 'user' turn before it"),
    (("user", "user", "assistant"), "conversations[1] ('user'): two 'user' turns in a row"),
    (("user", "assistant", "assistant"), "conversations[2] ('assistant'): two 'assistant' turns in a row"),
])
def test_sft_data_with_roles_out_of_order_is_refused_with_file_and_line(pre, tmp_path, cache, roles, message):
    data = tmp_path / "sft.jsonl"
    data.write_text(turns("user", "assistant") + turns(*roles))
    code, _, err = run_cli(["sft", "--init", pre, "--out", tmp_path / "sft", "--data", data, "--steps", 1,
                            "--cache", cache] + TINY_CLI)
    assert code == 2 and f"error: {data}:2: {message}" in err and "--on-error skip" in err, err
    assert not (tmp_path / "sft").exists()


def test_a_later_system_turn_is_kept_as_minimind3_renders_it_and_warned_of_with_file_and_line(tmp_path):
    data = tmp_path / "sft.jsonl"
    data.write_text(turns("user", "assistant") + turns("user", "assistant", "system", "user", "assistant"))
    with pytest.warns(UserWarning, match=rf"1 conversation\(s\) with a 'system' turn after the first, kept as "
                                         rf"MiniMind-3's template renders it \(first: {re.escape(str(data))}:2\)"):
        reader = JsonlReader(data, kind="sft")
        assert len(list(reader)) == 2
    assert reader.counts()["n_late_system_turns"] == 1


def test_tool_turns_in_minimind3s_order_are_kept(tmp_path):
    calls = [{"type": "function", "function": {"name": "add", "arguments": "{}"}}] * 2
    conv = [{"role": "system", "content": "s", "tools": [{"type": "function", "function": {"name": "add"}}]},
            {"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "", "tool_calls": calls},
            {"role": "tool", "content": "2"}, {"role": "tool", "content": "2"},
            {"role": "assistant", "content": "2."}, {"role": "user", "content": "thanks"},
            {"role": "assistant", "content": "ok"}]
    data = tmp_path / "tools.jsonl"
    data.write_text(json.dumps({"conversations": conv}) + "\n")
    assert len(list(JsonlReader(data, kind="sft"))) == 1
    assert len(list(JsonlReader(DATA_DIR / "sft_t2t_mini.jsonl", kind="sft"))) == 60  # MiniMind-3's tool data


# ------------------------------------------------------------------------------------------ 8. benchmarks and tools
def bench(argv: list[str]) -> tuple[int, str]:
    from benchmarks.__main__ import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(argv)
        except SystemExit as e:  # argparse
            code = e.code
    return code, err.getvalue()


@pytest.mark.parametrize("argv, message", [
    (["accumulation", "--batch", "-1"], "argument --batch: -1: must be an integer >= 1"),
    (["accumulation", "--k", "0"], "argument --k: 0: must be an integer >= 1"),
    (["accumulation", "--profile", "bogus"], "argument --profile: invalid choice: 'bogus'"),
    (["batching", "--batches", "0"], "argument --batches: 0: must be an integer >= 1"),
    (["batching", "--profile", "bogus"], "argument --profile: invalid choice: 'bogus'"),
    (["memmap", "--data", "/nonexistent/missing.jsonl"], "error: benchmark data not found: /nonexistent/missing.jsonl"),
    (["memmap", "--seq-len", "0"], "argument --seq-len: 0: must be an integer >= 2"),
    (["throughput", "--steps", "0"], "error: --steps=0 must be >= 1"),
    (["throughput", "--profile", "bogus"], "argument --profile: invalid choice: 'bogus'"),
])
def test_benchmarks_refuse_bad_arguments_in_one_line(argv, message):
    code, err = bench(argv)
    assert code == 2 and message in err and "Traceback" not in err, err


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine with CUDA has the device")
@pytest.mark.parametrize("name", ["accumulation", "throughput"])
def test_benchmarks_refuse_a_missing_device(name):
    code, err = bench([name, "--device", "cuda", "--profile", "smoke"])
    assert code == 2 and err.startswith("error: device cuda is not available on this machine"), err


def test_the_throughput_benchmark_refuses_an_empty_data_file(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    code, err = bench(["throughput", "--profile", "smoke", "--data", str(tmp_path / "empty.jsonl")])
    assert code == 2 and err == f"error: {tmp_path / 'empty.jsonl'}: no samples\n"


def test_the_memmap_benchmark_refuses_an_empty_data_file(tmp_path, monkeypatch):
    monkeypatch.setenv("MINIMIND_PROFILE", "smoke")
    (tmp_path / "empty.jsonl").write_text("")
    code, err = bench(["memmap", "--data", str(tmp_path / "empty.jsonl"), "--hash-bytes", "1000"])
    assert code == 2 and err == (f"error: memmap benchmark, memmap side failed: ValueError: "
                                 f"{tmp_path / 'empty.jsonl'}: no samples to read\n"), err


def tool(name: str, argv: list[str], capsys) -> tuple[int, str]:
    module = __import__(name)
    try:
        code = module.main(argv)
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().err


def test_the_tools_refuse_bad_arguments_in_one_line(tmp_path, capsys):
    (tmp_path / "existing").mkdir()
    (tmp_path / "afile").write_text("a file")
    code, err = tool("make_reference", ["smoke", "--work", str(tmp_path / "existing")], capsys)
    assert code == 2 and f"--work {tmp_path / 'existing'} exists: name a folder that does not exist yet" in err
    code, err = tool("run_course", ["--out", str(tmp_path / "afile")], capsys)
    assert code == 2 and f"--out {tmp_path / 'afile'}: {tmp_path / 'afile'} is a file, not a folder" in err
    code, err = tool("run_course", ["--out", str(tmp_path / "build"), "--only", "99"], capsys)
    assert code == 2 and "--only 99: no notebook's name starts with that" in err and not (tmp_path / "build").exists()
    code, err = tool("doc_numbers", [str(tmp_path / "missing.md")], capsys)
    assert code == 2 and f"no such file: {tmp_path / 'missing.md'}" in err
    assert set(tmp_path.iterdir()) == {tmp_path / "existing", tmp_path / "afile"}


# ------------------------------------------------------------------------------------------ 9. a long document
def long_text() -> str:
    """Some 600,000 characters of the bundled corpus (English and Chinese) with special-token strings, runs of
    spaces and newlines, and a 3,000-character word at a piece's edge."""
    texts = [json.loads(line)["text"] for line in (DATA_DIR / "pretrain.jsonl").open(encoding="utf-8")]
    body, k = [], 0
    while sum(map(len, body)) < 600_000:
        body.append(texts[k % len(texts)] + ["\n", "   ", "<|im_start|>", " <|im_end|>\n\n", "x" * 3000][k % 5])
        k += 1
    return "".join(body)


def test_ordinary_documents_give_the_same_tokens_as_before():
    tok = load_tokenizer()
    texts = [json.loads(line)["text"] for line in (DATA_DIR / "pretrain.jsonl").open(encoding="utf-8")][:500]
    flat, lengths, _ = tokenize_samples("pretrain", texts, tok)
    before = [t for ids in tok.encode_batch(texts) for t in [tok.bos_token_id, *ids, tok.eos_token_id]]
    assert flat.tolist() == before and lengths.tolist() == [len(i) + 2 for i in tok.encode_batch(texts)]


def test_a_long_document_is_tokenized_in_bounded_pieces_into_the_same_ids(tmp_path):
    tok, text = load_tokenizer(), long_text()
    whole = tok.encode(text)
    for size in (1000, 20_000, PIECE_CHARS):
        pieces = tok.pieces(text, size)
        assert "".join(pieces) == text and max(map(len, pieces)) <= size + 3000  # the long word: one piece
        assert [t for p in pieces for t in tok.encode(p)] == whole, size
    assert len(tok.pieces(text)) > 1 and len(text) > PIECE_CHARS
    data = tmp_path / "one_line.jsonl"
    data.write_text(json.dumps({"text": text}) + "\n", encoding="utf-8")
    info = tokenize_to_memmap(data, tok, tmp_path / "cache", num_workers=0, progress=False)
    ids = np.fromfile(tmp_path / "cache.bin", dtype=np.uint16)
    assert info.n_samples == 1 and ids.tolist() == [tok.bos_token_id, *whole, tok.eos_token_id]
