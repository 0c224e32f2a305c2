"""Execute the course's notebooks in order, headless: `python tools/run_course.py [--out build] [--inplace]`.

Writes executed copies to OUT/notebooks/ and every PNG figure to OUT/figures/ (named after its notebook and cell).
With --inplace the notebooks in notebooks/ get the outputs (how the committed outputs are made).
Each notebook's cell timings go to docs/timings/<profile>.json (tools/course_times.py makes docs/teaching.md's table),
or with --timings-dir to that folder (benchmarks/gpu_check.sh keeps them in its archive). --deadline S gives each
notebook S seconds: a cell still running then fails with a timeout, and the notebook is saved as far as it ran.
The profile is chosen as everywhere else (MINIMIND_PROFILE, else gpu with CUDA, else cpu).
The kernel is the `minimind` kernel the notebooks declare (registered by `make kernel`) when it is registered,
else this Python's own (as in CI, where nothing is registered); the runner prints which.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import sys
import time
from pathlib import Path

from course_times import TIMINGS_DIR, notebook_record, update_timings
from minimind_lib.device import describe, device_report
from minimind_lib.paths import REPO_DIR
from minimind_lib.profiles import get_profile


def notebook_paths(notebook_dir: Path, only: list[str] | None = None) -> list[Path]:
    """The numbered notebooks in order, optionally only those whose names start with one of `only`."""
    paths = sorted(p for p in notebook_dir.glob("[0-9][0-9]_*.ipynb"))
    if only:
        paths = [p for p in paths if any(p.name.startswith(prefix) for prefix in only)]
    return paths


def extract_figures(nb, stem: str, figure_dir: Path) -> list[Path]:
    """Write every image/png output of an executed notebook to figure_dir and return the paths."""
    figure_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for cell_index, cell in enumerate(nb.cells):
        for output_index, output in enumerate(cell.get("outputs", [])):
            png = output.get("data", {}).get("image/png")
            if png:
                path = figure_dir / f"{stem}_cell{cell_index:02d}_{output_index}.png"
                path.write_bytes(base64.b64decode(png))
                written.append(path)
    return written


def settle_streams(nb) -> None:
    """Merge each cell's consecutive stream outputs and keep, on every line, only what follows its last carriage
    return: a progress bar is saved as its last frame (100%), as a terminal shows it, not as every frame it drew."""
    for cell in nb.cells:
        merged = []
        for output in cell.get("outputs", []):
            if merged and output.output_type == "stream" and merged[-1].output_type == "stream" \
                    and merged[-1].name == output.name:
                merged[-1].text += output.text
            else:
                merged.append(output)
        for output in merged:
            if output.output_type == "stream":
                output.text = "\n".join(line.rsplit("\r", 1)[-1] for line in output.text.split("\n"))
        if cell.cell_type == "code":
            cell.outputs = merged


def choose_kernel(requested: str | None) -> str:
    """The kernel to run: `requested`, else 'minimind' when registered, else 'python3' (this Python); printed."""
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    manager = KernelSpecManager()
    name = requested or ("minimind" if "minimind" in manager.find_kernel_specs() else "python3")
    try:
        python = manager.get_kernel_spec(name).argv[0]
    except NoSuchKernel:
        raise SystemExit(f"error: no Jupyter kernel named {name!r}; run `make kernel` or pass --kernel python3")
    python = sys.executable if python in ("python", "python3", "{python}") else python
    print(f"kernel {name!r}: {python}", flush=True)
    return name


def run_course(out: Path, inplace: bool, only: list[str] | None, timeout: int, kernel: str,
               timings_dir: Path = TIMINGS_DIR, deadline: float | None = None) -> list[dict]:
    """Execute the notebooks; return one record per notebook (name, seconds, figures, error); store cell timings.
    deadline: seconds per notebook (each cell may run until then, at most `timeout`)."""
    import nbformat
    from nbclient import NotebookClient

    notebook_dir = REPO_DIR / "notebooks"
    profile = get_profile()
    device = describe(profile).replace(f", profile={profile.name}", "")
    records = []
    for path in notebook_paths(notebook_dir, only):
        nb = nbformat.read(path, as_version=4)
        for cell in nb.cells:  # a cell that does not run (after an error) must not keep an older run's timing or output
            cell.metadata.pop("execution", None)
            if cell.cell_type == "code":
                cell.outputs, cell.execution_count = [], None
        start = time.perf_counter()
        left = None if deadline is None else lambda cell: max(1, min(timeout, int(start + deadline - time.perf_counter())))
        client = NotebookClient(nb, timeout=timeout, timeout_func=left, kernel_name=kernel,
                                resources={"metadata": {"path": str(notebook_dir)}})
        error = None
        try:
            client.execute()
        except Exception as exc:  # keep going so one broken notebook does not hide the others
            error = f"{type(exc).__name__}: {str(exc)[-2000:]}"
        seconds = round(time.perf_counter() - start, 1)
        settle_streams(nb)
        target = path if inplace else out / "notebooks" / path.name
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_suffix(".ipynb.tmp")
        nbformat.write(nb, tmp)
        tmp.replace(target)
        figures = extract_figures(nb, path.stem, out / "figures")
        records.append({"notebook": path.name, "seconds": seconds, "figures": len(figures), "error": error})
        timing = {**notebook_record(nb, path.name, error), "load_average": round(os.getloadavg()[0], 2)}
        update_timings(profile.name, device, [timing], timings_dir)
        print(f"{path.name:40s} {seconds:8.1f} s  {len(figures):2d} figures  {'ERROR ' + error.splitlines()[0] if error else 'ok'}", flush=True)
    return records


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, run the notebooks, write OUT/course.json; exit 1 if any notebook failed."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO_DIR / "build")
    parser.add_argument("--inplace", action="store_true", help="write outputs into notebooks/ themselves")
    parser.add_argument("--only", nargs="*", default=None, help="notebook name prefixes, e.g. 03 04")
    parser.add_argument("--timeout", type=int, default=3600, help="seconds per cell")
    parser.add_argument("--timings-dir", type=Path, default=TIMINGS_DIR, help="where <profile>.json goes")
    parser.add_argument("--deadline", type=float, default=None, help="seconds per notebook (default: none)")
    parser.add_argument("--kernel", default=None,
                        help="Jupyter kernel name (default: minimind when registered, else python3 = this Python)")
    args = parser.parse_args(argv)
    blocking = next((p for p in (args.out, *args.out.parents) if p.exists() and not p.is_dir()), None)
    if blocking is not None:
        parser.error(f"--out {args.out}: {blocking} is a file, not a folder")
    unmatched = [prefix for prefix in args.only or () if not notebook_paths(REPO_DIR / "notebooks", [prefix])]
    if unmatched:
        parser.error(f"--only {' '.join(unmatched)}: no notebook's name starts with that (the notebooks: "
                     f"{', '.join(p.name[:2] for p in notebook_paths(REPO_DIR / 'notebooks'))})")
    args.out.mkdir(parents=True, exist_ok=True)
    records = run_course(args.out, args.inplace, args.only, args.timeout, choose_kernel(args.kernel), args.timings_dir,
                         args.deadline)
    summary = {"device": device_report(profile=get_profile()), "notebooks": records}
    (args.out / "course.json").write_text(json.dumps(summary, indent=2))
    return 1 if any(r["error"] for r in records) else 0


if __name__ == "__main__":
    sys.exit(main())
