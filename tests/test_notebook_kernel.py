"""Every notebook asks for the `minimind` kernel that `make kernel` registers, whose display name names the checkout,
and notebook 00 says which checkout's library the kernel imported, warning when it is another checkout's."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path

import nbformat
import pytest

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted(p for p in (REPO / "notebooks").rglob("*.ipynb") if ".ipynb_checkpoints" not in p.parts)
KERNEL_NAME, NOTEBOOK_DISPLAY_NAME = "minimind", "Python (minimind)"  # committed notebooks carry no machine's path


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
    assert registered_kernel()[0] == KERNEL_NAME
    spec = nbformat.read(path, as_version=4).metadata.get("kernelspec")
    assert spec is not None, f"{path.name} declares no kernelspec"
    assert (spec.get("name"), spec.get("display_name"), spec.get("language")) == (
        KERNEL_NAME, NOTEBOOK_DISPLAY_NAME, "python"), (
        f"{path.name} declares kernel {dict(spec)}; expected name={KERNEL_NAME!r}, "
        f"display_name={NOTEBOOK_DISPLAY_NAME!r} (saved from JupyterLab, it may carry a checkout's path)")


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_kernel_names_this_checkout_in_the_display_name():
    """Two checkouts register the same kernel name; the display name says which one JupyterLab runs."""
    dry_run = subprocess.run(["make", "-n", "-C", str(REPO), "kernel"], capture_output=True, text=True, check=True)
    command = next(line for line in dry_run.stdout.splitlines() if "ipykernel install" in line)
    assert f'--name {KERNEL_NAME} --display-name "Python (minimind: {REPO})"' in command, command


def library_check_cell() -> str:
    """The source of notebook 00's cell that says where minimind_lib was imported from."""
    cells = nbformat.read(REPO / "notebooks" / "00_setup.ipynb", as_version=4).cells
    found = [c.source for c in cells if c.cell_type == "code" and "minimind_lib imported from" in c.source]
    assert len(found) == 1, "notebook 00 should have one cell that prints where minimind_lib was imported from"
    return found[0]


@pytest.mark.parametrize("imported_from, has_own_library, expect", [
    ("course", True, "this checkout"), ("other", True, "WARNING"), ("other", False, "installed")])
def test_notebook_00_names_the_library_it_imported(tmp_path, monkeypatch, capsys, imported_from, has_own_library,
                                                   expect):
    for checkout in ("course", "other"):
        (tmp_path / checkout / "notebooks").mkdir(parents=True)
        if checkout == "other" or has_own_library:
            (tmp_path / checkout / "minimind_lib").mkdir()
    fake = types.ModuleType("minimind_lib")
    fake.__file__ = str(tmp_path / imported_from / "minimind_lib" / "__init__.py")
    monkeypatch.setitem(sys.modules, "minimind_lib", fake)
    monkeypatch.chdir(tmp_path / "course" / "notebooks")  # Jupyter's working directory: the notebook's folder
    exec(library_check_cell(), {})
    out, err = capsys.readouterr()
    if expect == "this checkout":
        assert out == "minimind_lib imported from this checkout: minimind_lib/\n" and not err
    elif expect == "WARNING":  # on stderr: JupyterLab shows it in red, and nothing is printed as if all were well
        assert not out and err.startswith("WARNING") and str(tmp_path / "other" / "minimind_lib") in err
        assert "make kernel" in err and str(tmp_path / "course" / "minimind_lib") in err
    else:
        assert "installed" in out and str(tmp_path / "other" / "minimind_lib") in out and not err


def _kernel_environment(kernel_name: str, env: dict) -> str:
    """OMP_WAIT_POLICY and GOMP_SPINCOUNT as a kernel named `kernel_name` sees them, started with `env`."""
    from jupyter_client.manager import start_new_kernel

    km, kc = start_new_kernel(kernel_name=kernel_name, env=env)
    seen = []
    try:
        kc.execute_interactive("import os; print(os.environ.get('OMP_WAIT_POLICY'), os.environ.get('GOMP_SPINCOUNT'))", timeout=120,
                               output_hook=lambda msg: seen.append(msg["content"].get("text", "")))
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    return "".join(seen).strip()


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_the_minimind_kernel_sets_the_wait_policy_before_torch_and_yours_wins(tmp_path, monkeypatch):
    """`make kernel` registers a kernel that imports minimind_lib first: PASSIVE unless the environment says else."""
    monkeypatch.setenv("JUPYTER_DATA_DIR", str(tmp_path))  # a private registry: the user's own kernels stay as they are
    subprocess.run(["make", "-s", "-C", str(REPO), "kernel"], check=True, capture_output=True)
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    assert _kernel_environment(KERNEL_NAME, env) == "PASSIVE 1000"
    assert _kernel_environment(KERNEL_NAME, {**env, "OMP_WAIT_POLICY": "ACTIVE"}) == "ACTIVE None"
