"""The workshop kit: `make reset` on a dirty checkout, `make handout`'s stripped copies, the diagrams' files."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))

import handout  # noqa: E402

needs_git_make = pytest.mark.skipif(not (shutil.which("git") and shutil.which("make")), reason="needs git and make")


def git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout


@pytest.fixture
def dirty_checkout(tmp_path: Path) -> Path:
    """A git repository with the course's Makefile and a committed notebook, then everything a learner leaves."""
    repo = tmp_path / "course"
    (repo / "notebooks").mkdir(parents=True)
    shutil.copy2(REPO / "Makefile", repo / "Makefile")
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x = 1")])
    nbformat.write(nb, repo / "notebooks" / "00_setup.ipynb")
    git(repo, "init", "-q")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "add", ".")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "course")
    nb.cells[0].source = "x = 2  # a learner's edit"
    nb.cells[0].outputs = [nbformat.v4.new_output("stream", text="executed\n")]
    nbformat.write(nb, repo / "notebooks" / "00_setup.ipynb")
    for d in ("runs/workshop/pretrain", "data/cache", "build/handout"):
        (repo / d).mkdir(parents=True)
        (repo / d / "file.bin").write_bytes(b"x")
    return repo


def run_reset(repo: Path, *make_args: str, answer: str = "") -> subprocess.CompletedProcess:
    return subprocess.run(["make", "-s", "-C", str(repo), "reset", *make_args], input=answer,
                          capture_output=True, text=True)


@needs_git_make
def test_reset_restores_a_dirty_checkout(dirty_checkout: Path):
    result = run_reset(dirty_checkout, "YES=1")
    assert result.returncode == 0, result.stderr
    for d in ("runs", "data/cache", "build"):
        assert not (dirty_checkout / d).exists(), d
    assert git(dirty_checkout, "status", "--porcelain") == ""  # the committed notebook is back, nothing else left
    assert nbformat.read(dirty_checkout / "notebooks" / "00_setup.ipynb", 4).cells[0].source == "x = 1"


@needs_git_make
@pytest.mark.parametrize("answer", ["", "n\n", "no\n"])
def test_reset_asks_first_and_a_no_changes_nothing(dirty_checkout: Path, answer: str):
    result = run_reset(dirty_checkout, answer=answer)
    assert result.returncode != 0 and "Continue?" in result.stdout and "cancelled" in result.stdout
    assert (dirty_checkout / "runs/workshop/pretrain/file.bin").exists() and (dirty_checkout / "data/cache").exists()
    assert "00_setup.ipynb" in git(dirty_checkout, "status", "--porcelain")


@needs_git_make
def test_reset_says_yes_when_asked(dirty_checkout: Path):
    result = run_reset(dirty_checkout, answer="y\n")
    assert result.returncode == 0, result.stderr
    assert not (dirty_checkout / "runs").exists() and git(dirty_checkout, "status", "--porcelain") == ""


def test_handout_strips_outputs_and_keeps_solutions_apart(tmp_path: Path):
    src = tmp_path / "notebooks"
    (src / "solutions").mkdir(parents=True)
    (src / "figures").mkdir()
    (src / "figures" / "a.svg").write_text("<svg/>")
    (src / "ddp_demo.py").write_text("print(1)\n")
    cell = nbformat.v4.new_code_cell("print(42)", execution_count=3, metadata={"execution": {"a": "b"}, "tags": ["t"]})
    cell.outputs = [nbformat.v4.new_output("stream", text="42\n")]
    nbformat.write(nbformat.v4.new_notebook(cells=[cell, nbformat.v4.new_markdown_cell("# hi")]), src / "01_a.ipynb")
    nbformat.write(nbformat.v4.new_notebook(cells=[cell]), src / "solutions" / "01_a.ipynb")
    out = tmp_path / "handout"
    (out / "stale.txt").parent.mkdir()
    (out / "stale.txt").write_text("old")
    written = handout.make_handout(out, src)
    assert not (out / "stale.txt").exists()  # a new handout replaces the old one
    assert {p.name for p in written["notebooks"]} == {"01_a.ipynb", "ddp_demo.py", "figures"}
    assert (out / "notebooks" / "figures" / "a.svg").is_file()
    for path in (out / "notebooks" / "01_a.ipynb", out / "solutions" / "01_a.ipynb"):
        code = nbformat.read(path, 4).cells[0]
        assert code.source == "print(42)" and code.outputs == [] and code.execution_count is None
        assert "execution" not in code.metadata and code.metadata["tags"] == ["t"]
    assert not list((out / "notebooks").glob("solutions"))  # solutions only in their own folder


def test_handout_of_an_empty_folder_is_an_error(tmp_path: Path):
    with pytest.raises(SystemExit, match="no notebooks in"):
        handout.make_handout(tmp_path / "out", tmp_path)
