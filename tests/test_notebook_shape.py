"""The shape of the chapters: no chapter code cell is longer than 40 lines (plots, timing loops, subprocess
measurements, widgets and tables live in helper modules beside the notebooks), and the helper modules a chapter
imports from beside it are handed out with it."""
import re
import sys
from pathlib import Path

import nbformat
import pytest

REPO = Path(__file__).resolve().parents[1]
NB_DIR = REPO / "notebooks"
sys.path.insert(0, str(REPO / "tools"))
import handout  # noqa: E402

MAX_CELL_LINES_04_TO_06 = 40
CHAPTERS_04_TO_06 = ("04_gradient_accumulation", "05_mixed_precision", "06_dynamic_batching")
IMPORTED_04_TO_06 = re.compile(r"^\s*(?:import|from) (\w+)", re.M)


def code_cells_over_40_lines(nb: nbformat.NotebookNode, name: str) -> list[str]:
    """'NAME cell N: K lines' for every code cell over 40 lines, blank lines counted."""
    return [f"{name} cell {i}: {len(c.source.splitlines())} lines" for i, c in enumerate(nb.cells)
            if c.cell_type == "code" and len(c.source.splitlines()) > MAX_CELL_LINES_04_TO_06]


@pytest.mark.parametrize("stem", CHAPTERS_04_TO_06)
def test_chapters_04_to_06_have_no_code_cell_over_40_lines(stem):
    nb = nbformat.read(NB_DIR / f"{stem}.ipynb", as_version=4)
    assert code_cells_over_40_lines(nb, stem) == [], "move the harness into a helper module beside the notebooks"


def test_the_04_to_06_cell_count_catches_41_lines_and_passes_40():
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x = 1\n" * 39 + "x = 1"),
                                         nbformat.v4.new_markdown_cell("words\n" * 60),
                                         nbformat.v4.new_code_cell("x = 1\n" * 20 + "\n" * 20 + "y = 2")])
    assert code_cells_over_40_lines(nb, "made") == ["made cell 2: 41 lines"]


@pytest.mark.parametrize("stem", CHAPTERS_04_TO_06)
def test_the_helper_modules_chapters_04_to_06_import_are_handed_out(stem):
    """A module that a chapter imports from beside it is copied beside the lab edition in the handout, or the handed-
    out notebook stops at its import."""
    cells = nbformat.read(NB_DIR / f"{stem}.ipynb", as_version=4).cells
    beside = {name for c in cells if c.cell_type == "code" for name in IMPORTED_04_TO_06.findall(c.source)
              if (NB_DIR / f"{name}.py").is_file() or (NB_DIR / name / "__init__.py").is_file()}
    missing = sorted(name for name in beside
                     if f"{name}.py" not in handout.BESIDE_NOTEBOOKS and name not in handout.BESIDE_NOTEBOOKS)
    assert missing == [], f"{stem} imports {missing} from beside it, which tools/handout.py does not hand out"
