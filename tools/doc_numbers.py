"""The numbers the docs quote, regenerated: `python tools/doc_numbers.py [--check] FILE...` (make course-times).

A number in docs/teaching.md, docs/answers.md or README.md that comes from a table or a committed output is written
between markers, `<!--n:KEY-->VALUE<!--/n-->` (invisible once rendered), and this script rewrites VALUE from KEY:

    est:COLUMN:NOTEBOOKS[<=LIMIT]  a sum of the guide's estimates table (tools/course_times.py): COLUMN is reading,
                                   exercises, total (minutes; without optional parts), optional (the optional parts'
                                   reading), lab (minutes to write the lab edition's regions), regions (how many)
                                   or hours; NOTEBOOKS is `all`, `04-06` or `07,08`;
                                   terms add up (`total:07,08+exercises:09`). With <=LIMIT the minutes must fit in
                                   LIMIT (a plan's session), or this fails and names the session.
    region:NN:NAME[,NAME...]       minutes of those lab regions of notebook NN (the lab-regions table), summed
    slot:NN:TERM+TERM[;NN:...][<=LIMIT]  a plan's slot by the guide's rules: TERM is read=all or read=S,S (the
                                   reading of those sections, "## S."), regions=all or regions=NAME,NAME (their
                                   minutes), exercises=all or exercises=K,K (10 minutes each); with <=LIMIT the sum
                                   must fit in LIMIT, or this fails and names the slot
    run:PROFILE:NOTEBOOKS          minutes measured in that profile (docs/timings/PROFILE.json), summed
    out:NAME                       a value printed by a committed notebook (OUTPUTS below: notebook, pattern, format)
    committed:profile|device|cores the profile, device and CPU cores that every committed notebook's outputs come from
                                   (committed:device:00-09: those notebooks' only)
    committed:date:NN              the day notebook NN was executed (its first timed cell)

`--check` exits 1 when a file is not up to date (the test suite runs it), so a typed number that no longer matches
its table or the committed output fails the tests instead of misleading a teacher.
"""

import argparse
import functools
import json
import re
import sys
from pathlib import Path

import nbformat

sys.path.insert(0, str(Path(__file__).resolve().parent))
import course_times  # noqa: E402

REPO = course_times.REPO
NOTEBOOKS = REPO / "notebooks"
MARK = re.compile(r"<!--n:(?P<key>[^>]*?)-->(?P<value>.*?)<!--/n-->")
DOCS = (REPO / "docs" / "teaching.md", REPO / "docs" / "answers.md", REPO / "README.md")

# out:NAME -> (notebook number, a pattern over its printed text with one group, a format for the group's number or
# None to quote it as printed). The first match in cell order is quoted.
OUTPUTS: dict[str, tuple[str, str, str | None]] = {
    "01.held_out_bytes_per_token": ("01", r"held-out slice: [\d,]+ bytes -> [\d,]+ tokens, ([\d.]+) bytes per token",
                                    None),
    "03.init_loss_defaults": ("03", r"\nPyTorch defaults +([\d.]+) ", None),
    "03.init_loss_init_weights": ("03", r"\ninit_weights +([\d.]+) ", None),
    "03.mm3_fp32_peak": ("03", r"\noff +([\d.]+) +[\d.]+ +[\d.]+ +True", None),
    "03.mm3_fp32_activations": ("03", r"\noff +[\d.]+ +[\d.]+ +([\d.]+) +True", None),
    "07.amp": ("07", r'"amp": "(\w+)"', None),
    "07.tokens": ("07", r'"tokens": (\d+)', "{:,.0f}"),
    "07.steps": ("07", r'"steps": (\d+)', None),
    "07.val_loss_before": ("07", r"validation loss before training (\d+\.\d+)", None),
    "07.val_loss_after": ("07", r"validation loss \d+\.\d+ -> (\d+\.\d+) \(perplexity", None),
    "07.ppl_before": ("07", r"\(perplexity ([\d,]+) -> [\d,.]+\)", None),
    "07.ppl_after": ("07", r"\(perplexity [\d,]+ -> ([\d,.]+)\)", None),
    "07.first_losses": ("07", r"this notebook: +\[([\d. ]+)\]", None),
    "08.amp": ("08", r'"amp": "(\w+)"', None),
    "08.tokens": ("08", r'"tokens": (\d+)', "{:,.0f}"),
    "08.steps": ("08", r'"steps": (\d+)', None),
    "08.val_loss_before": ("08", r'"initial_val_loss": ([\d.]+)', "{:.3f}"),
    "08.val_loss_after": ("08", r'"final_val_loss": ([\d.]+)', "{:.3f}"),
}


@functools.lru_cache(maxsize=32)
def _read(path: Path, mtime_ns: int) -> nbformat.NotebookNode:
    return nbformat.read(path, as_version=4)  # read once per version of the file


def _notebook(number: str, notebook_dir: Path = NOTEBOOKS) -> nbformat.NotebookNode:
    paths = sorted(notebook_dir.glob(f"{number}_*.ipynb"))
    if len(paths) != 1:
        raise KeyError(f"expected one notebook {notebook_dir}/{number}_*.ipynb, found {len(paths)}")
    return _read(paths[0], paths[0].stat().st_mtime_ns)


def printed_text(cell: nbformat.NotebookNode) -> str:
    """What a code cell printed: its streams and the text form of its results."""
    return "".join(str(o.get("text", "")) + str(o.get("data", {}).get("text/plain", ""))
                   for o in cell.get("outputs", []))


def output_value(name: str, notebook_dir: Path = NOTEBOOKS) -> str:
    """The value OUTPUTS[name] names, read from the committed notebook's outputs."""
    if name not in OUTPUTS:
        raise KeyError(f"out:{name} is not in tools/doc_numbers.py's OUTPUTS ({', '.join(OUTPUTS)})")
    number, pattern, fmt = OUTPUTS[name]
    value = printed_value(number, pattern, notebook_dir)
    return value if fmt is None else fmt.format(float(value.replace(",", "")))


def committed_value(what: str, notebook_dir: Path = NOTEBOOKS) -> str:
    """The profile, device or CPU cores of the committed outputs (the same in every notebook), or one's run date."""
    numbers = sorted(p.name[:2] for p in notebook_dir.glob("[0-9][0-9]_*.ipynb"))
    if not what.startswith("date:") and ":" in what:  # committed:device:00-09: those notebooks only
        what, spec = what.split(":", 1)
        numbers = _notebooks(spec, numbers)
    if what.startswith("date:"):
        record = course_times.notebook_record(_notebook(what[5:], notebook_dir), what[5:])
        if not record["executed_utc"]:
            raise KeyError(f"committed:{what}: notebook {what[5:]} carries no execution times")
        return record["executed_utc"][:10]
    if what == "cores":
        return printed_value("00", r"cpu_threads +(\d+)", notebook_dir)
    if what not in ("profile", "device"):
        raise KeyError(f"committed:{what}: expected profile, device, cores or date:NN")
    found = {n: course_times.profile_of(_notebook(n, notebook_dir)) for n in numbers}
    if missing := [n for n, f in found.items() if f is None]:
        raise KeyError(f"committed:{what}: notebooks {missing} print no 'DEVICE, profile=NAME' line: execute them")
    values = {n: (f[0] if what == "profile" else f[1].rsplit(", torch", 1)[0]) for n, f in found.items()}
    if len(set(values.values())) != 1:
        raise KeyError(f"committed:{what}: the notebooks' outputs come from different {what}s: {values}")
    return next(iter(values.values()))


def printed_value(number: str, pattern: str, notebook_dir: Path = NOTEBOOKS) -> str:
    """The first group of pattern in what notebook `number` printed (its committed outputs, first match in order)."""
    for cell in _notebook(number, notebook_dir).cells:
        if cell.cell_type == "code" and (match := re.search(pattern, printed_text(cell))):
            return match.group(1)
    raise KeyError(f"notebook {number}'s committed outputs print nothing matching {pattern!r}")


def _notebooks(spec: str, known: list[str]) -> list[str]:
    """`all`, `04-06` or `07,08` (or a mix, `00-02,05`) as notebook numbers, each of which must exist."""
    if spec == "all":
        return known
    chosen = []
    for part in spec.split(","):
        first, _, last = part.partition("-")
        chosen += [n for n in known if first <= n <= (last or first)] if last else [first]
    unknown = [n for n in chosen if n not in known]
    if unknown or not chosen:
        raise KeyError(f"notebooks {spec!r}: {unknown or 'none'} not among {known}")
    return chosen


def estimate_value(spec: str, notebook_dir: Path = NOTEBOOKS) -> str:
    """est:COLUMN:NOTEBOOKS[+COLUMN:NOTEBOOKS...][<=LIMIT]: a sum of the estimates table (minutes, or hours for the
    column `hours`), refused when a limit is given and the sum of minutes passes it."""
    terms, _, limit = spec.partition("<=")
    table = course_times.estimates(notebook_dir)
    columns = {"reading": lambda r: r["reading"], "exercises": lambda r: r["exercise_minutes"],
               "total": lambda r: r["reading"] + r["exercise_minutes"], "optional": lambda r: r["optional"],
               "lab": lambda r: r["lab_minutes"], "regions": lambda r: len(r["regions"])}
    minutes = 0
    for term in terms.split("+"):
        column, _, chosen = term.partition(":")
        if column not in (*columns, "hours"):
            raise KeyError(f"est:{spec}: {column!r} is not one of {[*columns, 'hours']}")
        minutes += sum(columns.get(column, columns["total"])(table[n]) for n in _notebooks(chosen, list(table)))
    if limit and minutes > int(limit):
        raise ValueError(f"est:{spec}: {terms} need {minutes} min by the estimates, more than the {limit} min of "
                         f"their session: change the plan")
    return f"{minutes / 60:.1f}" if terms.startswith("hours:") else str(minutes)


def measured_value(spec: str, timings_dir: Path = course_times.TIMINGS_DIR) -> str:
    """run:PROFILE:NOTEBOOKS: minutes measured in that profile, summed over the notebooks."""
    profile, _, chosen = spec.partition(":")
    if not (path := timings_dir / f"{profile}.json").is_file():
        raise KeyError(f"run:{spec}: no timings {path}")
    recorded = json.loads(path.read_text())["notebooks"]
    by_number = {name[:2]: record["seconds"] for name, record in recorded.items()}
    return f"{sum(by_number[n] for n in _notebooks(chosen, sorted(by_number))) / 60:.1f}"


def region_value(spec: str, notebook_dir: Path = NOTEBOOKS) -> str:
    """region:NN:NAME[,NAME...]: the minutes the lab-regions table gives those regions of notebook NN, summed."""
    number, _, names = spec.partition(":")
    found = {r["name"]: r["minutes"] for r in course_times.estimates(notebook_dir)[number]["regions"]}
    if missing := [n for n in names.split(",") if n not in found]:
        raise KeyError(f"region:{spec}: {missing} not among notebook {number}'s regions {sorted(found)}")
    return str(sum(found[n] for n in names.split(",")))


def slot_value(spec: str, notebook_dir: Path = NOTEBOOKS) -> str:
    """slot:NN:TERM+TERM[;NN:...][<=LIMIT]: the minutes of a plan's slot by the guide's rules (see the module doc),
    refused when a limit is given and they pass it."""
    body, _, limit = spec.partition("<=")
    table, minutes = course_times.estimates(notebook_dir), 0
    for part in body.split(";"):
        number, _, terms = part.partition(":")
        row = table[_notebooks(number, list(table))[0]]
        for term in terms.split("+"):
            kind, _, chosen = term.partition("=")
            parts = {"read": row["sections"], "regions": {r["name"]: r["minutes"] for r in row["regions"]},
                     "exercises": {str(k): course_times.MINUTES_PER_EXERCISE for k in range(1, row["exercises"] + 1)}}
            if kind not in parts:
                raise KeyError(f"slot:{spec}: {term!r} is not read=..., regions=... or exercises=...")
            if unknown := [n for n in chosen.split(",") if chosen != "all" and n not in parts[kind]]:
                raise KeyError(f"slot:{spec}: {kind} {unknown} not among notebook {number}'s {sorted(parts[kind])}")
            if kind == "read" and chosen == "all":
                minutes += row["reading"]
            else:
                minutes += sum(v for k, v in parts[kind].items() if chosen == "all" or k in chosen.split(","))
    if limit and minutes > int(limit):
        raise ValueError(f"slot:{spec}: {body} need {minutes} min by the guide's rules, more than the {limit} min of "
                         "their slot: change the plan")
    return str(minutes)


def value_of(key: str, notebook_dir: Path = NOTEBOOKS, timings_dir: Path = course_times.TIMINGS_DIR) -> str:
    """The text a marker's key stands for."""
    source, _, spec = key.partition(":")
    sources = {"est": lambda: estimate_value(spec, notebook_dir), "run": lambda: measured_value(spec, timings_dir),
               "out": lambda: output_value(spec, notebook_dir), "committed": lambda: committed_value(spec, notebook_dir),
               "region": lambda: region_value(spec, notebook_dir),
               "slot": lambda: slot_value(spec, notebook_dir)}
    if source not in sources:
        raise KeyError(f"{key!r}: a key starts with one of {', '.join(s + ':' for s in sources)}")
    return sources[source]()


def render(text: str, where: str = "text", **dirs) -> str:
    """The text with every marker's value regenerated; an error names the file, the line and the key."""
    def replace(match: re.Match) -> str:
        try:
            value = value_of(match["key"], **dirs)
        except (KeyError, ValueError) as error:
            line = text.count("\n", 0, match.start()) + 1
            raise SystemExit(f"error: {where}:{line}: {error.args[0]}") from None
        return f"<!--n:{match['key']}-->{value}<!--/n-->"
    return MARK.sub(replace, text)


def main(argv: list[str] | None = None) -> int:
    """Rewrite (or with --check, only compare) the generated numbers of each file."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="*", type=Path, default=list(DOCS))
    parser.add_argument("--check", action="store_true", help="exit 1 if a file's numbers are not up to date")
    args = parser.parse_args(argv)
    missing = [str(path) for path in args.files if not path.is_file()]
    if missing:
        parser.error(f"no such file: {', '.join(missing)}")
    stale = []
    for path in args.files:
        text = path.read_text(encoding="utf-8")
        new = render(text, str(path))
        n = len(MARK.findall(text))
        if new != text:
            stale.append(path)
            if not args.check:
                path.write_text(new, encoding="utf-8")
        state = "up to date" if new == text else ("out of date" if args.check else "rewritten")
        print(f"{path}: {n} generated numbers, {state}")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
