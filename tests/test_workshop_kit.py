"""The workshop kit: `make reset` on a dirty checkout, `make handout`'s stripped copies, the diagrams' files."""

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
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


REGION_CELL = 'def twice(x):\n    """Twice x."""\n    ### BEGIN SOLUTION\n    return 2 * x\n    ### END SOLUTION'


def small_course(tmp_path: Path) -> tuple[Path, Path]:
    """A notebooks folder (a chapter with an output and a solution region, its solution, the files beside them) and a
    data folder."""
    src = tmp_path / "notebooks"
    (src / "solutions").mkdir(parents=True)
    (src / "figures").mkdir()
    (src / "figures" / "a.svg").write_text("<svg/>")
    (src / "ddp_demo.py").write_text("print(1)\n")
    (src / "exercise_checks.py").write_text("STRICT = False\n")
    data = tmp_path / "data"
    data.mkdir()
    for name in ("pretrain.jsonl", "LICENSES.md"):
        (data / name).write_text("{}\n")
    cell = nbformat.v4.new_code_cell("print(42)", execution_count=3, metadata={"execution": {"a": "b"}, "tags": ["t"]})
    cell.outputs = [nbformat.v4.new_output("stream", text="42\n")]
    region = nbformat.v4.new_code_cell(REGION_CELL, metadata={"nbgrader": {"solution": True, "grade_id": "twice"}})
    nbformat.write(nbformat.v4.new_notebook(cells=[cell, nbformat.v4.new_markdown_cell("# hi"), region]),
                   src / "01_a.ipynb")
    link = nbformat.v4.new_markdown_cell("Solutions of [01_a](../01_a.ipynb).")
    nbformat.write(nbformat.v4.new_notebook(cells=[link, cell]), src / "solutions" / "01_a.ipynb")
    return src, data


def test_handout_strips_outputs_and_keeps_solutions_apart(tmp_path: Path):
    src, data = small_course(tmp_path)
    out = tmp_path / "handout"
    written = handout.make_handout(out, src, data)
    assert sorted(written["notebooks"]) == ["notebooks/01_a.ipynb", "notebooks/ddp_demo.py",
                                            "notebooks/exercise_checks.py", "notebooks/figures/a.svg"]
    assert sorted(written["lab"]) == [p.replace("notebooks/", "lab/") for p in sorted(written["notebooks"])]
    assert sorted(written["solutions"]) == ["solutions/01_a.ipynb", "solutions/exercise_checks.py"]
    assert sorted(written["data"]) == ["data/LICENSES.md", "data/pretrain.jsonl"]
    for path in (out / "notebooks" / "01_a.ipynb", out / "lab" / "01_a.ipynb", out / "solutions" / "01_a.ipynb"):
        code = next(c for c in nbformat.read(path, 4).cells if c.cell_type == "code")
        assert code.source == "print(42)" and code.outputs == [] and code.execution_count is None
        assert "execution" not in code.metadata and code.metadata["tags"] == ["t"]
    assert nbformat.read(out / "notebooks" / "01_a.ipynb", 4).cells[2].source == REGION_CELL
    lab = nbformat.read(out / "lab" / "01_a.ipynb", 4)
    assert lab.cells[3].source == ('def twice(x):\n    """Twice x."""\n    # YOUR CODE HERE\n'
                                   '    raise NotImplementedError()')
    assert lab.cells[1].id == handout.LAB_INTRO_ID and "regions, in order: `twice`." in lab.cells[1].source  # made here
    assert "lab-edition" not in nbformat.read(out / "notebooks" / "01_a.ipynb", 4).cells[1].get("id", "")
    assert nbformat.read(out / "solutions" / "01_a.ipynb", 4).cells[0].source == \
        "Solutions of [01_a](../notebooks/01_a.ipynb)."  # the chapter, from the handout's solutions/
    assert not list((out / "notebooks").glob("solutions"))  # solutions only in their own folder


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_a_second_handout_keeps_everything_the_learner_added(tmp_path: Path):
    """The tool used to remove the whole folder first: the learner's notes and runs went with it."""
    src, data = small_course(tmp_path)
    out = tmp_path / "handout"
    handout.make_handout(out, src, data)
    (out / "notes.txt").write_text("mine")
    (out / "runs" / "smoke").mkdir(parents=True)
    (out / "runs" / "smoke" / "model.pth").write_bytes(b"weights")
    (out / "lab" / "my_try.ipynb").write_text("{}")
    handout.make_handout(out, src, data)
    assert (out / "notes.txt").read_text() == "mine" and (out / "lab" / "my_try.ipynb").is_file()
    assert (out / "runs" / "smoke" / "model.pth").read_bytes() == b"weights"


def test_a_second_handout_refuses_a_changed_notebook_and_writes_nothing(tmp_path: Path):
    src, data = small_course(tmp_path)
    out = tmp_path / "handout"
    handout.make_handout(out, src, data)
    mine = out / "lab" / "01_a.ipynb"
    nb = nbformat.read(mine, 4)
    nb.cells[3].source = nb.cells[3].source.replace("raise NotImplementedError()", "return x + x")
    nbformat.write(nb, mine)
    (out / "notebooks" / "exercise_checks.py").unlink()  # a file the learner deleted would be written again
    before = snapshot(out)
    with pytest.raises(handout.HandoutError, match=r"lab/01_a\.ipynb: changed since the last handout"):
        handout.make_handout(out, src, data)
    assert snapshot(out) == before  # nothing was written


def test_forcing_replaces_only_the_files_it_names(tmp_path: Path):
    src, data = small_course(tmp_path)
    out = tmp_path / "handout"
    handout.make_handout(out, src, data)
    (out / "lab" / "01_a.ipynb").write_text("{}")  # the learner's version
    with pytest.raises(handout.HandoutError, match="lab/01_a.ipynb"):
        handout.make_handout(out, src, data, force={"notebooks/01_a.ipynb"})  # another file named
    assert (out / "lab" / "01_a.ipynb").read_text() == "{}"
    handout.make_handout(out, src, data, force={"lab/01_a.ipynb"})
    assert "YOUR CODE HERE" in (out / "lab" / "01_a.ipynb").read_text()
    (out / "data" / "LICENSES.md").write_text("edited")
    handout.make_handout(out, src, data, force=True)  # FORCE=1: every such file
    assert (out / "data" / "LICENSES.md").read_text() == "{}\n"


def test_a_handout_never_replaces_a_file_it_did_not_write(tmp_path: Path):
    src, data = small_course(tmp_path)
    out = tmp_path / "handout"
    (out / "lab").mkdir(parents=True)
    (out / "lab" / "01_a.ipynb").write_text("a learner's own notebook of that name")
    with pytest.raises(handout.HandoutError, match=r"lab/01_a\.ipynb: was not written by the handout"):
        handout.make_handout(out, src, data)
    assert (out / "lab" / "01_a.ipynb").read_text() == "a learner's own notebook of that name"


def test_files_an_earlier_handout_wrote_are_removed_only_if_unchanged(tmp_path: Path):
    src, data = small_course(tmp_path)
    out = tmp_path / "handout"
    handout.make_handout(out, src, data)
    (out / "lab" / "ddp_demo.py").write_text("print('changed by the learner')\n")
    (src / "ddp_demo.py").unlink()  # no longer part of the course
    handout.make_handout(out, src, data)
    assert not (out / "notebooks" / "ddp_demo.py").exists()  # the handout's own, unchanged: removed
    assert (out / "lab" / "ddp_demo.py").read_text() == "print('changed by the learner')\n"  # the learner's: kept
    assert "lab/ddp_demo.py" not in handout.read_manifest(out)  # and never the handout's again


def test_a_manifest_naming_files_elsewhere_is_refused(tmp_path: Path):
    src, data = small_course(tmp_path)
    out = tmp_path / "handout"
    handout.make_handout(out, src, data)
    (tmp_path / "elsewhere.txt").write_text("not the handout's")
    manifest = json.loads((out / handout.MANIFEST).read_text())
    manifest["files"]["../elsewhere.txt"] = handout._sha256(tmp_path / "elsewhere.txt")
    (out / handout.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(handout.HandoutError, match="paths outside the folder"):
        handout.make_handout(out, src, data)
    assert (tmp_path / "elsewhere.txt").exists()


def test_a_failed_handout_leaves_every_file_it_found(tmp_path: Path, monkeypatch):
    src, data = small_course(tmp_path)
    out = tmp_path / "handout"
    handout.make_handout(out, src, data)
    (out / "notes.txt").write_text("mine")
    before = set(snapshot(out))

    def broken_copy(*args, **kwargs):
        raise OSError(28, "No space left on device")
    for name in ("copyfileobj", "copy2", "copytree"):
        monkeypatch.setattr(shutil, name, broken_copy)
    with pytest.raises(OSError, match="(?i)no space left"):
        handout.make_handout(out, src, data)
    assert set(snapshot(out)) >= before, "a failed handout removed files"
    monkeypatch.undo()
    handout.make_handout(out, src, data)  # what it wrote before failing is in its manifest: the next run goes on


def test_a_handout_refuses_the_working_directory_and_the_course(tmp_path: Path, monkeypatch):
    src, data = small_course(tmp_path)
    (tmp_path / "mine.txt").write_text("mine")
    monkeypatch.chdir(tmp_path)
    for target in (Path("."), Path(""), REPO, REPO.parent):
        with pytest.raises(handout.HandoutError, match="refusing to write the handout into"):
            handout.make_handout(target, src, data)
    assert (tmp_path / "mine.txt").read_text() == "mine" and not (tmp_path / "lab").exists()


def test_the_handout_command_exits_2_and_names_the_file(tmp_path: Path, capsys):
    out = tmp_path / "handout"
    assert handout.main(["--out", str(out)]) == 0
    (out / "lab" / "03_model.ipynb").write_text("{}")
    assert handout.main(["--out", str(out)]) == 2
    assert "lab/03_model.ipynb: changed since the last handout" in capsys.readouterr().err
    assert handout.main(["--out", str(out), "--force", str(out / "lab" / "03_model.ipynb")]) == 0
    assert handout.main(["--out", str(out)]) == 0


@needs_git_make
def test_make_handout_passes_force_on():
    def dry_run(*args: str) -> str:
        return subprocess.run(["make", "-n", "-s", "-C", str(REPO), "handout", *args], capture_output=True,
                              text=True).stdout
    assert "tools/handout.py --out build/handout --force \n" in dry_run("FORCE=1")
    assert "tools/handout.py --out build/handout --force lab/03_model.ipynb" in dry_run("FORCE=lab/03_model.ipynb")
    assert "--force" not in dry_run()


def executed_lab_notebooks(handout_dir: Path, env: dict, into: Path) -> list[Path]:
    """Execute every lab notebook of a handout in a fresh kernel of this Python (as nbval's current env does), in
    its own folder, and save each executed copy in `into`; stop at the first cell that fails."""
    script = textwrap.dedent("""
        import sys
        from pathlib import Path
        import nbformat
        from jupyter_client.manager import KernelManager
        from nbclient import NotebookClient
        from nbval.kernel import CURRENT_ENV_KERNEL_NAME, NbvalKernelspecManager
        lab, into = Path(sys.argv[1]), Path(sys.argv[2])
        for path in sorted(lab.glob("*.ipynb")):
            nb = nbformat.read(path, as_version=4)
            km = KernelManager(kernel_name=CURRENT_ENV_KERNEL_NAME, kernel_spec_manager=NbvalKernelspecManager())
            try:
                NotebookClient(nb, km=km, timeout=900, resources={"metadata": {"path": str(lab)}}).execute()
            finally:
                if km.has_kernel:  # a kernel given to nbclient is not shut down by it
                    km.shutdown_kernel(now=True)
            nbformat.write(nb, into / path.name)
    """)
    into.mkdir()
    result = subprocess.run([sys.executable, "-c", script, str(handout_dir / "lab"), str(into)], cwd=handout_dir,
                            env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return sorted(into.glob("*.ipynb"))


def test_the_handout_runs_on_its_own(tmp_path: Path):
    """Build the handout in a temporary folder and execute there (smoke profile) every lab notebook (untouched: every
    region a stub) and every solution, with minimind_lib installed apart from any checkout, as `pip install` of the
    course gives it: nothing may reach back into the repository (checks, ddp_demo.py, data, runs). Each lab notebook
    runs top to bottom with every region's check saying "not written yet". (The chapters themselves, which the
    handout's notebooks/ holds without outputs, are executed by nbval in `make notebooks`.)"""
    out = tmp_path / "handout"
    handout.make_handout(out)
    site = tmp_path / "site-packages"
    shutil.copytree(REPO / "minimind_lib", site / "minimind_lib", ignore=shutil.ignore_patterns("__pycache__"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("MINIMIND_")}
    env.update(PYTHONPATH=str(site), MINIMIND_PROFILE="smoke", PYTHONNOUSERSITE="1")
    probe = subprocess.run([sys.executable, "-c", "import minimind_lib.paths as p; print(p.__file__, p.REPO_DIR)"],
                           cwd=out / "lab", env=env, capture_output=True, text=True, check=True).stdout
    assert probe.split() == [str(site / "minimind_lib" / "paths.py"), str(out.resolve())]
    executed = executed_lab_notebooks(out, env, tmp_path / "executed")
    assert [p.name for p in executed] == [p.name for p in sorted((REPO / "notebooks").glob("[0-9][0-9]_*.ipynb"))]
    for path in executed:
        printed = "".join(o.get("text", "") for c in nbformat.read(path, 4).cells for o in c.get("outputs", []))
        for region in handout.notebook_regions(nbformat.read(REPO / "notebooks" / path.name, 4)):
            assert f"\n{region.name}: not written yet. Hint: " in f"\n{printed}", f"{path.name}: {region.name}"
            assert f"{region.name}: passed" not in printed
    result = subprocess.run([sys.executable, "-m", "pytest", "--nbval-lax", "--nbval-current-env", "-p",
                             "no:cacheprovider", "--nbval-cell-timeout=900", "-q", "solutions"],
                            cwd=out, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert (out / "runs" / "smoke" / "pretrain" / "model.pth").is_file()  # 07 wrote its run into the handout


def test_handout_of_an_empty_folder_is_an_error(tmp_path: Path):
    with pytest.raises(handout.HandoutError, match="no notebooks in"):
        handout.make_handout(tmp_path / "out", tmp_path)


MARKDOWN_LINK = re.compile(r"\]\(([^)#\s]+)")


def test_links_and_solution_hints_resolve_in_the_checkout_and_the_handout(tmp_path: Path, monkeypatch):
    """Every relative link of every notebook, and the path a check's hint gives for the worked solution, lead to a
    file: in the checkout (notebooks/, notebooks/solutions/) and in the handout (notebooks/, lab/, solutions/)."""
    import importlib.util
    out = tmp_path / "handout"
    handout.make_handout(out)
    folders = [REPO / "notebooks", REPO / "notebooks" / "solutions", out / "notebooks", out / "lab", out / "solutions"]
    for i, folder in enumerate(folders):
        notebooks = sorted(folder.glob("*.ipynb"))
        assert notebooks, folder
        for path in notebooks:
            for cell in nbformat.read(path, 4).cells:
                for target in MARKDOWN_LINK.findall(cell.source) if cell.cell_type == "markdown" else []:
                    if "://" not in target:
                        assert (folder / target).exists(), f"{path}: the link {target} leads nowhere"
        # the hint as a notebook of this folder prints it: the kernel's working directory is the folder, the checks
        # module the one beside it (the checkout's solutions import the one in the folder above)
        checks = folder / "exercise_checks.py"
        spec = importlib.util.spec_from_file_location(f"checks_{i}", checks if checks.is_file()
                                                      else folder.parent / "exercise_checks.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        monkeypatch.chdir(folder)
        for exercise in ("00.1", "03.1", "09.4"):
            hint = module.solution_path(exercise)
            assert Path(hint).is_file() and "solutions" in Path(hint).resolve().parent.name, f"{folder}: {hint}"


ANSWERS = REPO / "docs" / "answers.md"  # the teacher's notes


def exercise_ids() -> set[str]:
    """"NN.K" for every "### Exercise K" heading of chapter NN (notebooks/NN_*.ipynb): the ids the checks print."""
    ids = set()
    for path in sorted((REPO / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        for cell in nbformat.read(path, as_version=4).cells:
            if cell.cell_type == "markdown":
                ids |= {f"{path.name[:2]}.{k}" for k in re.findall(r"^### Exercise (\d+)\b", cell.source, re.M)}
    return ids


def test_every_exercise_has_a_teachers_note():
    """docs/answers.md has a heading "### NN.K <title>" for every exercise K of chapter NN, and none for an exercise
    that no longer exists; each note holds an expected answer and the usual wrong answers."""
    notes = ANSWERS.read_text(encoding="utf-8")
    wanted = exercise_ids()
    assert len(wanted) >= 30, sorted(wanted)  # every chapter has exercises: a broken heading pattern finds none
    sections = re.split(r"^### ", notes, flags=re.M)[1:]
    noted = {m.group(1): body for body in sections if (m := re.match(r"(\d\d\.\d+) ", body))}
    assert sorted(wanted - set(noted)) == [], "exercises without a teacher's note"
    assert sorted(set(noted) - wanted) == [], "notes for exercises that no longer exist"
    for ex, body in noted.items():
        assert "**Expected:**" in body and "**Wrong:**" in body, ex


def test_the_handout_leaves_the_teachers_notes_out(tmp_path: Path):
    """`make handout` gives the learners notebooks, data and solutions, never docs/ (docs/answers.md)."""
    assert ANSWERS.is_file()
    out = tmp_path / "handout"
    handout.make_handout(out)
    files = [p for p in out.rglob("*") if p.is_file()]
    assert files and not (out / "docs").exists()
    assert not [p for p in files if p.name == "answers.md"]
    title = ANSWERS.read_text(encoding="utf-8").splitlines()[0]
    assert not [p for p in files if p.suffix in (".md", ".py", ".ipynb") and title in p.read_text(encoding="utf-8")]


import course_times  # noqa: E402
import draw_diagrams  # noqa: E402


def test_diagrams_are_what_the_script_draws_and_each_is_shown(tmp_path: Path):
    drawn = draw_diagrams.draw_all(tmp_path)
    assert len(drawn) == 4
    notebooks = "".join((REPO / "notebooks" / p).read_text() for p in sorted(os.listdir(REPO / "notebooks"))
                        if p.endswith(".ipynb"))
    for path in drawn:
        committed = REPO / "notebooks" / "figures" / path.name
        assert committed.read_bytes() == path.read_bytes(), f"{committed} is stale: run tools/draw_diagrams.py"
        assert f"figures/{path.name}" in notebooks, f"no notebook shows {path.name}"


def timed_notebook(seconds: list[float], profile_line: str = "cpu (X), profile=workshop, torch 2.13.0\n"):
    cells = [nbformat.v4.new_code_cell("print('profile')")]
    cells[0].outputs = [nbformat.v4.new_output("stream", text=profile_line)]
    cells += [nbformat.v4.new_code_cell(f"step_{i}()\nmore") for i in range(len(seconds))]
    for cell, s in zip(cells[1:], seconds):
        cell.metadata["execution"] = {"iopub.execute_input": "2026-12-03T10:00:00.000000Z",
                                      "shell.execute_reply": f"2026-12-03T10:00:{s:09.6f}Z"}
    return nbformat.v4.new_notebook(cells=cells + [nbformat.v4.new_markdown_cell("text")])


def test_course_times_table_comes_from_the_recorded_cells(tmp_path: Path):
    nb_dir, timings = tmp_path / "notebooks", tmp_path / "timings"
    nb_dir.mkdir()
    nbformat.write(timed_notebook([30.0, 15.5]), nb_dir / "01_a.ipynb")
    nbformat.write(timed_notebook([6.0], "cpu (X), profile=smoke, torch 2.13.0\n"), nb_dir / "02_b.ipynb")
    course_times.from_notebooks(nb_dir, timings)
    record = json.loads((timings / "workshop.json").read_text())["notebooks"]["01_a.ipynb"]
    assert record["seconds"] == 45.5 and [c["first_line"] for c in record["cells"]] == ["step_0()", "step_1()"]
    assert record["device"] == "cpu (X), torch 2.13.0"
    table = course_times.minutes_table(timings)
    assert "| notebook | smoke (min) | workshop (min) |" in table  # profiles in size order
    assert "| `01_a` |  | 0.8 |" in table and "| `02_b` | 0.1 |  |" in table
    doc = tmp_path / "teaching.md"
    doc.write_text(f"intro\n{course_times.START}\nold\n{course_times.END}\nafter\n")
    assert not course_times.write_table(doc, table, check=True) and "old" in doc.read_text()
    course_times.write_table(doc, table)
    assert course_times.write_table(doc, table, check=True) and doc.read_text().endswith("after\n")


def test_course_times_refuses_an_unexecuted_notebook(tmp_path: Path):
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("1")]), tmp_path / "01_a.ipynb")
    with pytest.raises(SystemExit, match="no 'DEVICE, profile=NAME"):
        course_times.from_notebooks(tmp_path, tmp_path / "timings")


def test_teaching_guide_table_is_generated():
    guide = REPO / "docs" / "teaching.md"
    assert course_times.write_table(guide, course_times.minutes_table(), check=True), \
        "docs/teaching.md's minutes table differs from docs/timings/: run make course-times"
    assert course_times.write_table(guide, course_times.estimate_table(), True, course_times.ESTIMATES_START,
                                    course_times.ESTIMATES_END), \
        "docs/teaching.md's estimates differ from the notebooks' text: run make course-times"
    assert "docs/teaching.md" in (REPO / "README.md").read_text()


def test_prepare_workshop_records_where_the_run_came_from(tmp_path: Path, monkeypatch):
    import prepare_workshop
    monkeypatch.setenv("MINIMIND_RUNS_DIR", str(tmp_path))
    record = prepare_workshop.prepare("smoke")
    run = tmp_path / "smoke" / "pretrain"
    saved = json.loads((run / prepare_workshop.PROVENANCE_FILE).read_text())
    assert saved == record and saved["profile"] == "smoke" and saved["steps"] == 24
    assert saved["model_sha256"] == prepare_workshop.sha256_of(run / "model.pth")
    assert "pretrain --profile smoke --out" in saved["command"] and saved["started_utc"] <= saved["finished_utc"]
    with pytest.raises(SystemExit, match="unknown profile 'huge'"):
        prepare_workshop.prepare("huge")


def _network_can_be_cut() -> bool:
    return shutil.which("unshare") is not None and subprocess.run(["unshare", "-n", "true"]).returncode == 0


@needs_git_make
@pytest.mark.skipif(not _network_can_be_cut(), reason="needs `unshare -n` (Linux, as root) to run without a network")
def test_a_room_without_internet_installs_from_the_wheelhouse(tmp_path: Path):
    """`make wheelhouse` downloads every wheel; then `make venv` in a fresh copy of the course installs from it alone,
    in a network namespace with no network and with no pip configuration (no index, no other wheel folder)."""
    course = tmp_path / "course"
    course.mkdir()
    for name in ("Makefile", "requirements.txt", "requirements-wandb.txt", "pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, course / name)
    shutil.copytree(REPO / "minimind_lib", course / "minimind_lib", ignore=shutil.ignore_patterns("__pycache__"))
    download = subprocess.run(["make", "-s", "-C", str(course), "wheelhouse"], capture_output=True, text=True)
    assert download.returncode == 0, download.stderr[-3000:]
    offline_env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "PIP_CONFIG_FILE": os.devnull,
                   "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    install = subprocess.run(["unshare", "-n", "make", "-s", "-C", str(course), "venv"], env=offline_env,
                             capture_output=True, text=True)
    assert install.returncode == 0, install.stdout[-2000:] + install.stderr[-3000:]
    assert "installing from wheelhouse/ only (no network)" in install.stdout
    extra = subprocess.run(["unshare", "-n", "make", "-s", "-C", str(course), ".venv/.wandb-installed"],
                           env=offline_env, capture_output=True, text=True)  # what `make unit` adds: --log wandb
    assert extra.returncode == 0, extra.stdout[-2000:] + extra.stderr[-3000:]
    python = str(course / ".venv" / "bin" / "python")
    check = subprocess.run(["unshare", "-n", python, "-m", "pip", "check"], env=offline_env, capture_output=True,
                           text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    wanted = {line.split("==")[0].strip().lower() for line in (REPO / "requirements.txt").read_text().splitlines()
              if "==" in line and not line.lstrip().startswith("#")}
    listed = subprocess.run([python, "-m", "pip", "list", "--format=freeze"], env=offline_env, capture_output=True,
                            text=True, check=True).stdout
    have = {line.split("==")[0].lower().replace("_", "-") for line in listed.splitlines()}
    assert {w.replace("_", "-") for w in wanted} <= have, sorted(wanted - have)
    info = subprocess.run(["unshare", "-n", python, "-m", "minimind_lib", "info"], env=offline_env, cwd=course,
                          capture_output=True, text=True)
    assert info.returncode == 0 and "cpu_threads" in info.stdout, info.stderr[-2000:]
