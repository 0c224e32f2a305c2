"""The library stays plain enough to read in an evening: its size in code tokens, and the shape of its code.

minimind_lib is the tidied code of the notebooks, not a framework. Its budget counts what a reader reads: Python
tokens outside comments and docstrings, counted with `tokenize` (COMMENT, NL, NEWLINE, INDENT, DEDENT, ENCODING,
ENDMARKER and docstring strings are skipped). Tokens, not lines, so that breaking a dense line into plain ones costs
nothing and cutting repeated logic pays; every feature (run tracking, LoRA and DPO, the GPU path, the reliability
checks) pays for its tokens. The issue's target is 46,500 tokens; the library is at 58,435 after this round (the
budget, MAX_CODE_TOKENS, is that count rounded up): the target is not met, and the next change to the library pays
back before it adds.

The shape of the code, one fixed number each and no exception list: lines at most 100 columns; no walrus; no nested
conditional expression; a conditional expression only for a plain value, which this test enforces as: neither branch
holds a call, a comprehension, a lambda, an await or another conditional expression; at most 500 lines a module and
60 a function. One of these rules is not met yet and is marked as an expected failure (strict: the mark must go the
day the rule holds): no module over 500 lines (NOT_YET). Every module names the notebook that builds it, and
imports only modules below it in LAYERS. The benchmarks live beside the library, in benchmarks/, and neither the
library nor a notebook imports them.
"""

import ast
import io
import json
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIB = ROOT / "minimind_lib"
MODULES = sorted(LIB.rglob("*.py"))
MAX_CODE_TOKENS = 58_500
MAX_COLUMNS = 100
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 60

# Every module of minimind_lib, from the lowest layer to the highest: a module imports only modules before it.
LAYERS = [
    "__init__", "bpe", "checks", "fileio", "generate", "model", "paths", "profiles", "device", "loggers",
    "lora", "tokenizer", "config", "corpus", "memory", "checkpoint", "data", "batching", "export",
    "evaluate", "train", "distributed", "dpo", "rundata", "pipeline", "cli", "__main__",
]

NOT_YET = pytest.mark.xfail(strict=True,
                            reason="not met yet: seven modules passed 500 lines wrapped to 100 columns")

SKIPPED = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
           tokenize.ENCODING, tokenize.ENDMARKER}
NOT_PLAIN = (ast.Call, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp, ast.Lambda, ast.Await,
             ast.IfExp, ast.NamedExpr)


def source(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def docstring_starts(tree: ast.AST) -> set:
    """Where each docstring (of the module, a class or a function) starts, as tokenize reports it."""
    starts = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            first = node.body[0] if node.body else None
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                if isinstance(first.value.value, str):
                    starts.add((first.lineno, first.col_offset))
    return starts


def code_tokens(path: Path) -> int:
    text = source(path)
    docstrings = docstring_starts(ast.parse(text))
    count = 0
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type in SKIPPED:
            continue
        if token.type == tokenize.STRING and token.start in docstrings:
            continue
        count += 1
    return count


def test_the_library_is_within_its_token_budget():
    sizes = {path.relative_to(LIB).as_posix(): code_tokens(path) for path in MODULES}
    table = sorted(sizes.items(), key=lambda item: -item[1])
    assert sum(sizes.values()) <= MAX_CODE_TOKENS, (sum(sizes.values()), table)


def test_the_token_count_skips_comments_and_docstrings(tmp_path):
    plain = tmp_path / "plain.py"
    plain.write_text("def f(x):\n    return x + 1\n", encoding="utf-8")
    explained = tmp_path / "explained.py"
    explained.write_text('"""Module."""\n\n\ndef f(x):\n    """Add one."""\n    # why: a comment\n'
                         "    return x + 1\n", encoding="utf-8")
    assert code_tokens(plain) == code_tokens(explained) == 10


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_no_line_over_100_columns(path):
    long = [number for number, line in enumerate(source(path).splitlines(), 1) if len(line) > MAX_COLUMNS]
    assert not long, f"{path.name}: lines over {MAX_COLUMNS} columns: {long}"


@NOT_YET
def test_no_module_over_500_lines():
    sizes = {path.name: len(source(path).splitlines()) for path in MODULES}
    assert not {name: n for name, n in sizes.items() if n > MAX_MODULE_LINES}


def test_no_function_over_60_lines():
    long = []
    for path in MODULES:
        for node in ast.walk(ast.parse(source(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    long.append((path.name, node.name, length))
    assert not long, long


def conditional_expressions_that_are_not_plain(tree: ast.AST) -> list:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.IfExp):
            inner = [sub for branch in (node.body, node.orelse) for sub in ast.walk(branch)]
            if any(isinstance(sub, NOT_PLAIN) for sub in inner):
                found.append(node.lineno)
    return found


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_no_walrus_and_no_nested_conditional_expression(path):
    tree = ast.parse(source(path))
    walrus = [node.lineno for node in ast.walk(tree) if isinstance(node, ast.NamedExpr)]
    assert not walrus, f"{path.name}: walrus on lines {walrus}"
    nested = [node.lineno for node in ast.walk(tree) if isinstance(node, ast.IfExp)
              and any(isinstance(sub, ast.IfExp) for sub in ast.walk(node) if sub is not node)]
    assert not nested, f"{path.name}: a nested conditional expression on lines {nested}"


def test_conditional_expressions_only_for_plain_values():
    found = {path.name: conditional_expressions_that_are_not_plain(ast.parse(source(path)))
             for path in MODULES}
    assert not {name: lines for name, lines in found.items() if lines}


def test_the_plain_value_rule_tells_a_value_from_logic():
    assert not conditional_expressions_that_are_not_plain(ast.parse("x = a.b if c else -1"))
    assert conditional_expressions_that_are_not_plain(ast.parse("x = f(a) if c else 0"))
    assert conditional_expressions_that_are_not_plain(ast.parse("x = a if c else b if d else 0"))
    assert conditional_expressions_that_are_not_plain(ast.parse("x = [i for i in a] if c else []"))


def imported_modules(path: Path) -> set:
    """The modules of minimind_lib this module imports, anywhere in it (a lazy import counts too)."""
    names = {module.stem for module in MODULES}
    found = set()
    for node in ast.walk(ast.parse(source(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                found.add(node.module.split(".")[0])
            else:
                found |= {a.name if a.name in names else "__init__" for a in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("minimind_lib"):
            parts = node.module.split(".")
            found.add(parts[1] if len(parts) > 1 else "__init__")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("minimind_lib."):
                    found.add(alias.name.split(".")[1])
    found.discard(path.stem)
    return found


def test_the_layers_list_every_module_once():
    assert sorted(LAYERS) == sorted(path.stem for path in MODULES)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_a_module_imports_only_lower_layers(path):
    below = set(LAYERS[:LAYERS.index(path.stem)])
    assert imported_modules(path) <= below, (path.name, sorted(imported_modules(path) - below))


@pytest.mark.parametrize("path", [p for p in MODULES if p.name != "__init__.py"], ids=lambda p: p.name)
def test_every_module_names_its_notebook(path):
    doc = ast.get_docstring(ast.parse(source(path))) or ""
    assert re.search(r"\b\d\d_[a-z_]+|notebooks? \d\d", doc), f"{path.name}: the docstring names no notebook"


def test_benchmarks_are_outside_the_library():
    assert not (LIB / "bench").exists() and not (LIB / "baseline.py").exists()
    for path in MODULES:
        assert not re.search(r"^\s*(from|import) benchmarks\b", source(path), re.M), path.name


@pytest.mark.parametrize("path", sorted((ROOT / "notebooks").rglob("*.ipynb")), ids=lambda p: p.name)
def test_notebooks_do_not_import_benchmarks(path):
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    code = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
    pattern = r"^\s*(from|import) (benchmarks|minimind_lib\.bench)\b"
    assert not re.search(pattern, code, re.M), path.name
