"""Every notebook asks for the `minimind` kernel that `make kernel` registers, so any JupyterLab runs the course's Python."""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted(p for p in (REPO / "notebooks").rglob("*.ipynb") if ".ipynb_checkpoints" not in p.parts)


def registered_kernel() -> tuple[str, str]:
    """The --name and --display-name that the Makefile's kernel target passes to ipykernel install."""
    makefile = (REPO / "Makefile").read_text(encoding="utf-8")
    match = re.search(r'ipykernel install .*--name (\S+) --display-name "([^"]+)"', makefile)
    assert match, "the Makefile's kernel target no longer registers a kernel with --name and --display-name"
    return match.group(1), match.group(2)


def test_there_are_notebooks():
    assert len(NOTEBOOKS) >= 10, NOTEBOOKS


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: str(p.relative_to(REPO / "notebooks")))
def test_notebook_declares_the_minimind_kernel(path: Path):
    name, display_name = registered_kernel()
    spec = nbformat.read(path, as_version=4).metadata.get("kernelspec")
    assert spec is not None, f"{path.name} declares no kernelspec"
    assert (spec.get("name"), spec.get("display_name"), spec.get("language")) == (name, display_name, "python"), (
        f"{path.name} declares kernel {dict(spec)}; expected name={name!r}, display_name={display_name!r}")
