"""Output-stripped copies of the course for a teacher to hand out: `python tools/handout.py [--out build/handout]`.

Writes OUT/notebooks/ (every notebooks/*.ipynb without outputs, execution counts or cell timings, plus what the
notebooks read beside them: exercise_checks.py, chat_box.py, ddp_demo.py and figures/), OUT/data/ (the bundled data
and its licences) and, when notebooks/solutions/ exists, OUT/solutions/ (the worked solutions, stripped the same way, with
their own copy of exercise_checks.py, kept apart so a teacher decides when to hand them out).
The handout runs on its own: beside a `make lab` checkout, or with the course's package installed by pip, where
minimind_lib finds data/ (and writes runs/) in the folder above the notebooks (minimind_lib.paths.course_dir).
The teacher's notes (docs/answers.md) are not in it. `make handout` calls this.
"""

import argparse
import shutil
import sys
from pathlib import Path

import nbformat

from minimind_lib.paths import REPO_DIR

BESIDE_NOTEBOOKS = ("exercise_checks.py", "chat_box.py", "ddp_demo.py", "figures")  # read from their own folder
BESIDE_SOLUTIONS = ("exercise_checks.py",)
DATA_FILES = ("pretrain.jsonl", "pretrain_val.jsonl", "sft.jsonl", "pretrain_t2t_mini.jsonl", "sft_t2t_mini.jsonl",
              "LICENSES.md", "README.md")


def strip_outputs(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """The notebook with every code cell's outputs, execution count and execution timing removed."""
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
        cell.metadata.pop("execution", None)
    return nb


def copy_stripped(src_dir: Path, dst_dir: Path) -> list[Path]:
    """Strip every *.ipynb of src_dir into dst_dir (created); return the written paths."""
    dst_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for path in sorted(src_dir.glob("*.ipynb")):
        nbformat.write(strip_outputs(nbformat.read(path, as_version=4)), dst_dir / path.name)
        written.append(dst_dir / path.name)
    return written


def copy_beside(names: tuple[str, ...], src_dir: Path, dst_dir: Path) -> list[Path]:
    """Copy the files and folders of `names` that exist in src_dir into dst_dir; return the written paths."""
    written = []
    for name in names:
        src, dst = src_dir / name, dst_dir / name
        if src.is_dir():
            shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__"))
        elif src.is_file():
            shutil.copy2(src, dst)
        else:
            continue
        written.append(dst)
    return written


def make_handout(out: Path, notebook_dir: Path = REPO_DIR / "notebooks",
                 data_dir: Path = REPO_DIR / "data") -> dict[str, list[Path]]:
    """Build the handout in `out` (replacing an older one); return the written files per folder."""
    if not any(notebook_dir.glob("*.ipynb")):
        raise SystemExit(f"error: no notebooks in {notebook_dir}")
    if out.exists():
        shutil.rmtree(out)
    written = {"notebooks": copy_stripped(notebook_dir, out / "notebooks")}
    written["notebooks"] += copy_beside(BESIDE_NOTEBOOKS, notebook_dir, out / "notebooks")
    if (notebook_dir / "solutions").is_dir():
        written["solutions"] = copy_stripped(notebook_dir / "solutions", out / "solutions")
        written["solutions"] += copy_beside(BESIDE_SOLUTIONS, notebook_dir, out / "solutions")
    (out / "data").mkdir()
    written["data"] = copy_beside(DATA_FILES, data_dir, out / "data")
    return written


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, build the handout, list what it holds."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO_DIR / "build" / "handout")
    args = parser.parse_args(argv)
    for folder, paths in make_handout(args.out).items():
        print(f"{args.out / folder}: {len(paths)} files ({', '.join(p.name for p in paths)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
