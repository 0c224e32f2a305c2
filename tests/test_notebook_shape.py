"""The shape of the chapters: no chapter code cell is longer than 40 lines (plots, timing loops, subprocess
measurements, widgets and tables live in helper modules beside the notebooks)."""
from pathlib import Path

import nbformat
import pytest

NB_DIR = Path(__file__).resolve().parents[1] / "notebooks"


# ----------------------------------------------------------------------------------- chapters 07, 08, 09
CHAPTERS_07_TO_09 = ("07_pretrain", "08_sft", "09_beyond_one_gpu")


def code_cells_over_40_lines(nb: nbformat.NotebookNode) -> list[str]:
    """'cell N (id): K lines' for every code cell of more than 40 lines, blank lines counted."""
    return [f"cell {i} ({c.get('id')}): {len(c.source.splitlines())} lines" for i, c in enumerate(nb.cells)
            if c.cell_type == "code" and len(c.source.splitlines()) > 40]


@pytest.mark.parametrize("stem", CHAPTERS_07_TO_09)
def test_chapters_07_to_09_have_no_code_cell_over_40_lines(stem):
    nb = nbformat.read(NB_DIR / f"{stem}.ipynb", as_version=4)
    assert code_cells_over_40_lines(nb) == [], f"{stem}: move the harness into a helper module beside the notebooks"


def test_a_code_cell_of_41_lines_is_caught():
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x = 1\n" * 39 + "x = 1"),
                                         nbformat.v4.new_markdown_cell("words\n" * 60),
                                         nbformat.v4.new_code_cell("x = 1\n" * 20 + "\n" * 20 + "y = 2")])
    assert code_cells_over_40_lines(nb) == [f"cell 2 ({nb.cells[2].id}): 41 lines"]
