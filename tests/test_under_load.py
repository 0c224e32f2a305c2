"""The notebooks that time things (04, 05, 06) pass while other processes keep the cores busy: `make notebooks` runs
their ordinary nbval pass beside busy processes (tests/notebooks_stage.py), not a second pass.

No cell asserts a time, a speed or a ratio of times (the course's rule, since CI is a loaded 2-core machine): the
cells assert what is counted and report what is timed, so load can slow them down but not fail them. Here: the
Makefile asks for that load for exactly those notebooks, and the plugin keeps its processes running through every
cell of a matching notebook, none through another notebook's, and none after pytest ends, even killed."""
import fnmatch
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
TIMED = ["04_gradient_accumulation", "05_mixed_precision", "06_dynamic_batching"]
MARK = "a busy process of the notebooks stage"

# A cell's view of the busy processes started for its kernel: (pid, state) of each, from /proc.
FIND_BUSY = f'''
import json, os, pathlib, time

def busy():
    found = []
    for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
        try:
            fields, command = stat.read_text().rsplit(")", 1)[1].split(), (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if b"{MARK}" in command and int(fields[1]) == os.getppid():  # started by this kernel's pytest process
            found.append((int(stat.parent.name), fields[0]))
    return sorted(found)
'''
UNDER_LOAD = ('found = busy()\nassert len(found) == 2 and {state for _, state in found} == {"R"}, found\n'
              'pathlib.Path("pids.tmp").write_text(json.dumps([os.getpid(), [p for p, _ in found]]))\n'
              'os.replace("pids.tmp", f"pids_{NAME}.json")')


def notebook(path: Path, *cells: str) -> Path:
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells]), path)
    return path


def notebooks_command() -> list[str]:
    """The pytest arguments of the Makefile's notebooks target (-o: take the installed venv as it is)."""
    dry = subprocess.run(["make", "-n", "-s", "-o", ".venv/.installed", "notebooks"], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout
    line = next(ln for ln in dry.replace("\\\n", " ").splitlines() if "--nbval-lax" in ln)
    return shlex.split(line)


def gone(pid: int) -> bool:
    """No such process (or only its exit status, not yet collected by its new parent)."""
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_notebooks_runs_the_timing_notebooks_under_load():
    args = notebooks_command()
    assert "tests.notebooks_stage" in [args[i + 1] for i, arg in enumerate(args) if arg == "-p"], args
    assert int(args[args.index("--busy") + 1]) >= 2, args
    patterns = args[args.index("--busy-notebooks") + 1].split(",")
    matched = sorted(p.stem for p in (ROOT / "notebooks").glob("*.ipynb")
                     if any(fnmatch.fnmatch(p.name, pattern) for pattern in patterns))
    assert matched == TIMED, patterns


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_notebooks_runs_each_chapter_once_and_leaves_the_solutions_to_the_handout_test():
    """Every chapter (a new one included) once; the worked solutions (notebooks/solutions/) not here: the handout test
    (tests/test_workshop_kit.py) runs them with nbval, in the handout, with the library installed apart."""
    args = notebooks_command()
    named = [ROOT / a for a in args if a.startswith("notebooks")]
    assert named and not any(p.is_dir() for p in named), named  # a folder would take in solutions/ too
    ran = [p for pattern in named for p in sorted(ROOT.glob(str(pattern.relative_to(ROOT))))]
    assert ran == sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")), ran
    handout_test = (ROOT / "tests" / "test_workshop_kit.py").read_text()
    assert '"--nbval-lax", "--nbval-current-env"' in handout_test and '"solutions"],' in handout_test


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads the processes from /proc")
@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["serial", "xdist"])
def test_busy_processes_run_through_every_cell_of_a_matching_notebook_and_only_there(tmp_path, workers):
    notebook(tmp_path / "a_plain.ipynb", FIND_BUSY, "assert busy() == [], busy()")
    notebook(tmp_path / "b_timed.ipynb", FIND_BUSY + "NAME = 'first'", UNDER_LOAD,
             "NAME = 'last'\n" + UNDER_LOAD)
    notebook(tmp_path / "c_plain.ipynb", FIND_BUSY, "assert busy() == [], busy()")
    run = subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.notebooks_stage", "--busy", "2",
                          "--busy-notebooks", "b_*,nothing_*", "--nbval-lax", "--nbval-current-env", "-p",
                          "no:cacheprovider", *workers, str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    summary = [ln for ln in run.stdout.splitlines() if ln.startswith("under load: ")]
    assert len(summary) == 1 and summary[0].startswith("under load: b_timed.ipynb: ran "), run.stdout[-2000:]
    assert "beside 2 busy processes" in summary[0]
    (_, first), (_, last) = (json.loads((tmp_path / f"pids_{n}.json").read_text()) for n in ("first", "last"))
    assert first == last, "the same processes through every cell"
    assert all(gone(pid) for pid in first), "busy processes left running after pytest ended"


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads the processes from /proc")
def test_busy_processes_end_when_pytest_is_killed(tmp_path):
    notebook(tmp_path / "timed.ipynb", FIND_BUSY + "NAME = 'cell'", UNDER_LOAD, "time.sleep(300)")
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-p", "tests.notebooks_stage", "--busy", "2",
                             "--busy-notebooks", "timed*", "--nbval-lax", "--nbval-current-env", "-p",
                             "no:cacheprovider", str(tmp_path)], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    pids = tmp_path / "pids_cell.json"
    try:
        deadline = time.monotonic() + 300
        while not pids.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert pids.exists(), f"the notebook never reached its load check (pytest exit {proc.poll()})"
        kernel, busy = json.loads(pids.read_text())
    finally:
        proc.kill()  # as kill -9: no hook of pytest runs
        proc.wait()
    os.kill(kernel, signal.SIGKILL)  # the notebook's kernel, which pytest started and can no longer stop
    deadline = time.monotonic() + 30
    while not all(gone(pid) for pid in busy) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(gone(pid) for pid in busy), "a busy process outlived the pytest that started it"


def test_under_xdist_the_chapters_that_start_from_07s_runs_go_with_07_in_order():
    from tests.notebooks_stage import TOGETHER, scope_of

    scopes = {p.stem: scope_of(f"notebooks/{p.name}::Cell 0") for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")}
    assert scopes["08_sft"] == scopes["07_pretrain"] == "notebooks/07_pretrain.ipynb"
    assert scope_of("notebooks/10_lora_dpo.ipynb::Cell 3") == "notebooks/07_pretrain.ipynb"
    alone = {stem: scope for stem, scope in scopes.items() if stem not in ("07_pretrain", *TOGETHER)}
    assert alone == {stem: f"notebooks/{stem}.ipynb" for stem in alone}
