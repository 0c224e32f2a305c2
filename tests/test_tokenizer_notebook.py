"""Notebook 01 invites rewriting its BPE functions in the learner's own way: its check against the library compares
behaviour (outputs on our texts and on fresh random inputs), so a rewrite that computes the same passes and one that
computes something else fails."""

import contextlib
import inspect
import io
from pathlib import Path

import matplotlib
import nbformat
import pytest

from minimind_lib import bpe

matplotlib.use("Agg")
NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "01_tokenizer.ipynb"

# The same rule as the chapter's merge (left to right, no overlap), written another way.
MERGE_REWRITTEN = '''
def merge(ids, pair, new_id):
    """Left to right: a pair that was just merged cannot give its right token to the next pair."""
    out, skip = [], False
    for left, right in zip(ids, [*ids[1:], None]):
        if skip:
            skip = False
        elif (left, right) == pair:
            out.append(new_id)
            skip = True
        else:
            out.append(left)
    return out
'''
# The library's merge with one mutation: a pair at the very end of the ids is left alone.
MERGE_WRONG_AT_THE_END = inspect.getsource(bpe.merge).replace("i + 1 < len(ids)", "i + 2 < len(ids)")


@pytest.fixture(scope="module")
def chapter():
    """01's code cells executed up to its check against the library (smoke profile): (namespace, the check's cells)."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setenv("MINIMIND_PROFILE", "smoke")
        monkeypatch.chdir(NOTEBOOK.parent)
        monkeypatch.syspath_prepend(str(NOTEBOOK.parent))  # lab_checks/ and tokenizer_views.py, as in Jupyter
        namespace: dict = {}
        cells = [c.source for c in nbformat.read(NOTEBOOK, as_version=4).cells if c.cell_type == "code"]
        check = next(k for k, source in enumerate(cells) if "NBVAL_CHECK_OUTPUT" in source and "same_as_library" in source)
        build = max(k for k in range(check) if "same_as_library = " in cells[k])
        with contextlib.redirect_stdout(io.StringIO()):
            for source in cells[:check]:
                exec(source, namespace)
        return namespace, (cells[build], cells[check])


def check_with(chapter, merge_source: str) -> str:
    """The library check, run again after the learner's `merge` is replaced by merge_source; what it printed."""
    namespace, (build, check) = chapter
    namespace = dict(namespace)  # a copy: each test starts from the chapter's definitions
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        for source in (merge_source, build, check):
            exec(source, namespace)
    return printed.getvalue()


def test_a_function_rewritten_in_another_way_passes_the_check(chapter):
    printed = check_with(chapter, MERGE_REWRITTEN)
    assert "same merge: True" in printed and "False" not in printed


def test_a_function_that_computes_something_else_fails_it(chapter):
    assert MERGE_WRONG_AT_THE_END != inspect.getsource(bpe.merge)
    with pytest.raises(AssertionError, match="'same merge': False"):
        check_with(chapter, MERGE_WRONG_AT_THE_END)
