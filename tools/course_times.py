"""Minutes per notebook per profile, measured: `python tools/course_times.py [--write docs/teaching.md] [--check]`.

tools/run_course.py stores, for every notebook it executes, the seconds of each cell (from the `metadata.execution`
timestamps Jupyter records) in docs/timings/<profile>.json. This script turns those files into the table of
docs/teaching.md (between its course-times markers), so the table is regenerated, never typed:

    python tools/course_times.py --from-notebooks notebooks   # record already-executed notebooks (their profile)
    python tools/course_times.py --write docs/teaching.md     # rewrite the table (make course-times)

It also writes the guide's second table, of estimates: the reading and exercise minutes of each notebook, computed
from its words, code lines and exercises at the paces of WORDS_PER_MINUTE, CODE_LINES_PER_MINUTE and
MINUTES_PER_EXERCISE (a rule, stated in the guide, not a measurement).
"""

import argparse
import datetime as dt
import json
import os
import re
import sys
from pathlib import Path

import nbformat

sys.path.insert(0, str(Path(__file__).resolve().parent))
import handout  # noqa: E402  (the lab edition's regions, as `make handout` finds them)

REPO = Path(__file__).resolve().parents[1]
TIMINGS_DIR = REPO / "docs" / "timings"
START, END = "<!-- course-times:start -->", "<!-- course-times:end -->"
ESTIMATES_START, ESTIMATES_END = "<!-- course-estimates:start -->", "<!-- course-estimates:end -->"
REGIONS_START, REGIONS_END = "<!-- lab-regions:start -->", "<!-- lab-regions:end -->"
PROFILE_ORDER = ("smoke", "workshop", "cpu", "gpu")


def _when(stamp: str) -> dt.datetime:
    return dt.datetime.fromisoformat(stamp.replace("Z", "+00:00"))


def cell_seconds(cell: nbformat.NotebookNode) -> float | None:
    """Seconds a code cell ran (execute_input to execute_reply), or None when it carries no timing."""
    timing = cell.get("metadata", {}).get("execution", {})
    if "iopub.execute_input" not in timing or "shell.execute_reply" not in timing:
        return None
    return (_when(timing["shell.execute_reply"]) - _when(timing["iopub.execute_input"])).total_seconds()


def profile_of(nb: nbformat.NotebookNode) -> tuple[str, str] | None:
    """(profile, device) of an executed notebook, read from the `DEVICE, profile=NAME` line its first cells print."""
    for cell in nb.cells[:6]:
        for output in cell.get("outputs", []):
            if match := re.search(r"^(.*), profile=([\w-]+), (torch .*)$", str(output.get("text", "")), re.M):
                return match.group(2), f"{match.group(1)}, {match.group(3)}"
    return None


def notebook_record(nb: nbformat.NotebookNode, name: str, error: str | None = None) -> dict:
    """One notebook's timing: total seconds, the seconds of each timed cell (with its first line), the error."""
    cells = [{"index": i, "seconds": round(s, 2), "first_line": cell.source.strip().splitlines()[0][:80]}
             for i, cell in enumerate(nb.cells) if cell.cell_type == "code" and (s := cell_seconds(cell)) is not None]
    stamps = [c.metadata.execution["iopub.execute_input"] for c in nb.cells if cell_seconds(c) is not None]
    return {"notebook": name, "seconds": round(sum(c["seconds"] for c in cells), 1), "n_cells_timed": len(cells),
            "executed_utc": min(stamps) if stamps else None, "error": error, "cells": cells}


def update_timings(profile: str, device: str, records: list[dict], timings_dir: Path = TIMINGS_DIR) -> Path:
    """Merge notebook records into timings_dir/<profile>.json (a notebook's newer record replaces its older one)."""
    path = timings_dir / f"{profile}.json"
    data = json.loads(path.read_text()) if path.exists() else {"profile": profile, "notebooks": {}}
    for record in records:
        data["notebooks"][record["notebook"]] = {"device": device, "load_average": None, **record}
    data["notebooks"] = dict(sorted(data["notebooks"].items()))
    timings_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
    os.replace(tmp, path)
    return path


def from_notebooks(notebook_dir: Path, timings_dir: Path = TIMINGS_DIR) -> list[Path]:
    """Record the timings already inside executed notebooks, grouped by the profile (and device) each ran in."""
    by_run: dict[tuple[str, str], list[dict]] = {}
    for path in sorted(notebook_dir.glob("[0-9][0-9]_*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        if (found := profile_of(nb)) is None:
            raise SystemExit(f"error: {path} has no 'DEVICE, profile=NAME, torch X' line in its first outputs")
        by_run.setdefault(found, []).append(notebook_record(nb, path.name))
    return [update_timings(p, device, records, timings_dir) for (p, device), records in by_run.items()]


def _column(run: str) -> str:
    # docs/timings/browser-PROFILE.json holds what tools/browser_test.py --record measured: Run All in JupyterLab
    return f"{run.removeprefix('browser-')}, Run All in a browser (min)" if run.startswith("browser-") else \
        f"{run} (min)"


def minutes_table(timings_dir: Path = TIMINGS_DIR) -> str:
    """The markdown table: one row per notebook, one column of minutes per recorded profile, then the devices."""
    runs = {p.stem: json.loads(p.read_text()) for p in timings_dir.glob("*.json")}
    if not runs:
        raise SystemExit(f"error: no timings in {timings_dir}; run tools/run_course.py first")
    profiles = sorted(runs, key=lambda p: (PROFILE_ORDER.index(p) if p in PROFILE_ORDER else 99, p))
    names = sorted({n for run in runs.values() for n in run["notebooks"]})
    lines = ["| notebook | " + " | ".join(_column(p) for p in profiles) + " |",
             "|---|" + "---:|" * len(profiles)]
    for name in names:
        cells = []
        for p in profiles:
            rec = runs[p]["notebooks"].get(name)
            cells.append("" if rec is None else f"{rec['seconds'] / 60:.1f}" + (" (error)" if rec["error"] else ""))
        lines.append(f"| `{name.removesuffix('.ipynb')}` | " + " | ".join(cells) + " |")
    totals = [f"**{sum(r['seconds'] for r in runs[p]['notebooks'].values()) / 60:.1f}**"
              + ("" if len(runs[p]["notebooks"]) == len(names) else f" ({len(runs[p]['notebooks'])} notebooks)")
              for p in profiles]
    lines.append("| **all** | " + " | ".join(totals) + " |")
    lines.append("")
    for p in profiles:
        recs = runs[p]["notebooks"].values()
        dates = sorted({(r["executed_utc"] or "")[:10] for r in recs} - {""})
        devices = sorted({r["device"] for r in recs})
        loads = [r["load_average"] for r in recs if r.get("load_average") is not None]
        load = f", 1-minute load average {min(loads):.1f}-{max(loads):.1f} while running" if loads else ""
        slowest = max(recs, key=lambda r: r["seconds"])
        lines.append(f"- `{p}`: {'; '.join(devices)}, executed {', '.join(dates)}{load}; slowest notebook "
                     f"`{slowest['notebook'].removesuffix('.ipynb')}`, {slowest['seconds']:.0f} s.")
    return "\n".join(lines)


# Estimates, not measurements: a study pace for prose, a pace for reading (not typing) code, a time per exercise.
WORDS_PER_MINUTE, CODE_LINES_PER_MINUTE, MINUTES_PER_EXERCISE = 120, 15, 10
# A lab region (the learner writes a mechanism): a fixed time to read its docstring, run the check and read one
# message, plus a pace for writing (not reading) new code, counted in the solution's non-blank lines; then the loop
# of fixing the code after a "not right yet" and running the check again, an allowance of FIX_AND_RERUN times the two.
MINUTES_PER_REGION, WRITTEN_LINES_PER_MINUTE, FIX_AND_RERUN = 5, 1, 0.5
SECTION = re.compile(r"^## (\d+)\.")  # a numbered section of a notebook, from its heading to the next "## "


OPTIONAL_PART = re.compile(r"^## Part \d+ \(optional\)")  # a notebook's optional part runs from this heading to its end


def _reading(cells: list) -> tuple[int, int, float]:
    """Words of the markdown cells, non-blank code lines, and the minutes to read both at the stated paces."""
    words = sum(len(c.source.split()) for c in cells if c.cell_type == "markdown")
    code = sum(len([ln for ln in c.source.splitlines() if ln.strip()]) for c in cells if c.cell_type == "code")
    return words, code, words / WORDS_PER_MINUTE + code / CODE_LINES_PER_MINUTE


def region_estimates(nb: nbformat.NotebookNode, name: str) -> list[dict]:
    """The notebook's lab regions in order: name, non-blank solution lines, and the minutes to write it (the rule)."""
    rows = []
    for cell in nb.cells:
        lines = cell.source.split("\n")
        for r in (handout.find_regions(cell.source, name) if cell.cell_type == "code" else []):
            written = len([ln for ln in lines[r.begin + 1:r.end] if ln.strip() and not ln.strip().startswith("#")])
            rows.append({"name": r.name, "lines": written, "minutes": round(
                (MINUTES_PER_REGION + written / WRITTEN_LINES_PER_MINUTE) * (1 + FIX_AND_RERUN))})
    return rows


def section_reading(cells: list) -> dict[str, int]:
    """Reading minutes of each section of a notebook, by the reading rule: "1", "2"... for "## 1. ..." up to the next
    "## " heading, "Exercises" for "## Exercises", "0" for the text before the first."""
    sections, name = {"0": []}, "0"
    for cell in cells:
        heading = re.search(r"^## (.*)$", cell.source, re.M) if cell.cell_type == "markdown" else None
        if heading:
            name = heading.group(1).split(".")[0] if SECTION.match(heading.group(0)) else heading.group(1).strip()
            sections.setdefault(name, [])
        sections[name].append(cell)
    return {k: round(_reading(v)[2]) for k, v in sections.items() if v}


def estimates(notebook_dir: Path = REPO / "notebooks") -> dict[str, dict]:
    """Per notebook (by its number, "00"...): words, code lines, exercises, and the estimated reading and exercise
    minutes, rounded as the table shows them (so that the guide's sums are sums of its table). "reading" leaves out
    an optional part (from a "## Part N (optional)" heading on), whose reading minutes are "optional"."""
    rows = {}
    for path in sorted(notebook_dir.glob("[0-9][0-9]_*.ipynb")):
        cells = nbformat.read(path, as_version=4).cells
        start = next((i for i, c in enumerate(cells) if c.cell_type == "markdown" and OPTIONAL_PART.match(c.source)),
                     len(cells))
        (words, code, reading), optional = _reading(cells[:start]), _reading(cells[start:])
        exercises = sum(bool(re.match(r"#+ Exercise \d", c.source)) for c in cells if c.cell_type == "markdown")
        regions = region_estimates(nbformat.NotebookNode(cells=cells[:start]), path.stem)
        rows[path.stem[:2]] = {"stem": path.stem, "words": words + optional[0], "code": code + optional[1],
                               "exercises": exercises, "reading": round(reading), "optional": round(optional[2]),
                               "exercise_minutes": exercises * MINUTES_PER_EXERCISE, "regions": regions,
                               "lab_minutes": sum(r["minutes"] for r in regions),
                               "sections": section_reading(cells[:start])}
    return rows


def estimate_table(notebook_dir: Path = REPO / "notebooks") -> str:
    """Estimated minutes a learner spends reading and doing the exercises of each notebook, from its text."""
    lines = ["| notebook | words | code lines | exercises | reading (min, est.) | optional part (min, est.) | "
             "exercises (min, est.) |", "|---|---:|---:|---:|---:|---:|---:|"]
    for r in estimates(notebook_dir).values():
        lines.append(f"| `{r['stem']}` | {r['words']:,} | {r['code']:,} | {r['exercises']} | {r['reading']} | "
                     f"{r['optional'] or ''} | {r['exercise_minutes']} |")
    return "\n".join(lines)


def regions_table(notebook_dir: Path = REPO / "notebooks") -> str:
    """The lab edition's regions (Part 1 of each notebook): what the learner writes, and the minutes by the rule."""
    lines = ["| notebook | region (the learner writes) | solution lines | minutes (est.) |", "|---|---|---:|---:|"]
    for r in estimates(notebook_dir).values():
        for region in r["regions"]:
            lines.append(f"| `{r['stem']}` | `{region['name']}` | {region['lines']} | {region['minutes']} |")
        if r["regions"]:
            lines.append(f"| `{r['stem']}` | **all {len(r['regions'])}** | | **{r['lab_minutes']}** |")
    return "\n".join(lines)


def write_table(doc: Path, table: str, check: bool = False, start: str = START, end: str = END) -> bool:
    """Put the table between the markers of `doc`; with check, only report whether it is up to date."""
    text = doc.read_text()
    if start not in text or end not in text:
        raise SystemExit(f"error: {doc} lacks the markers {start} ... {end}")
    head, rest = text.split(start, 1)
    new = f"{head}{start}\n{table}\n{end}{rest.split(end, 1)[1]}"
    if not check and new != text:
        doc.write_text(new)
    return new == text


def main(argv: list[str] | None = None) -> int:
    """Record executed notebooks and/or print or write the minutes table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--from-notebooks", type=Path, default=None, help="record the timings of executed notebooks")
    parser.add_argument("--timings", type=Path, default=TIMINGS_DIR)
    parser.add_argument("--write", type=Path, default=None, help="a markdown file with the course-times markers")
    parser.add_argument("--check", action="store_true", help="exit 1 if --write's table is not up to date")
    args = parser.parse_args(argv)
    if args.from_notebooks:
        for path in from_notebooks(args.from_notebooks, args.timings):
            print(f"wrote {path}")
    table = minutes_table(args.timings)
    if args.write is None:
        print(table)
        return 0
    up_to_date = write_table(args.write, table, check=args.check)
    up_to_date &= write_table(args.write, estimate_table(), args.check, ESTIMATES_START, ESTIMATES_END)
    up_to_date &= write_table(args.write, regions_table(), args.check, REGIONS_START, REGIONS_END)
    print(f"{args.write}: {'up to date' if up_to_date else ('out of date' if args.check else 'table rewritten')}")
    return 1 if args.check and not up_to_date else 0


if __name__ == "__main__":
    sys.exit(main())
