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

MAX_CELL_LINES = 40
CHAPTERS = sorted(p.stem for p in NB_DIR.glob("[01][0-9]_*.ipynb"))  # 00_setup ... 10_lora_dpo
IMPORTED = re.compile(r"^\s*(?:import|from) (\w+)", re.M)


def long_code_cells(nb: nbformat.NotebookNode, name: str) -> list[str]:
    """'NAME cell N: K lines' for every code cell longer than MAX_CELL_LINES lines, blank lines counted."""
    return [f"{name} cell {i}: {len(c.source.splitlines())} lines" for i, c in enumerate(nb.cells)
            if c.cell_type == "code" and len(c.source.splitlines()) > MAX_CELL_LINES]


@pytest.mark.parametrize("stem", CHAPTERS)
def test_no_chapter_code_cell_is_over_40_lines(stem):
    nb = nbformat.read(NB_DIR / f"{stem}.ipynb", as_version=4)
    assert long_code_cells(nb, stem) == [], "move the harness into a helper module beside the notebooks"


def test_a_cell_of_41_lines_is_caught_and_one_of_40_is_not():
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x = 1\n" * 39 + "x = 1"),
                                         nbformat.v4.new_markdown_cell("words\n" * 60),
                                         nbformat.v4.new_code_cell("x = 1\n" * 20 + "\n" * 20 + "y = 2")])
    assert long_code_cells(nb, "made") == ["made cell 2: 41 lines"]


@pytest.mark.parametrize("stem", CHAPTERS)
def test_the_helper_modules_a_chapter_imports_are_handed_out(stem):
    """A module a chapter imports from beside it (notebooks/NAME.py or notebooks/NAME/) is copied beside the lab
    edition and the chapters in the handout, or the handed-out notebook stops at its import."""
    cells = nbformat.read(NB_DIR / f"{stem}.ipynb", as_version=4).cells
    beside = {name for c in cells if c.cell_type == "code" for name in IMPORTED.findall(c.source)
              if (NB_DIR / f"{name}.py").is_file() or (NB_DIR / name / "__init__.py").is_file()}
    missing = sorted(name for name in beside if f"{name}.py" not in handout.BESIDE_NOTEBOOKS
                     and name not in handout.BESIDE_NOTEBOOKS)
    assert missing == [], f"{stem} imports {missing} from beside it, which tools/handout.py does not hand out"

