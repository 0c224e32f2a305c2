"""The course to hand out: `python tools/handout.py [--out build/handout] [--force [FILE ...]]` (`make handout`).

Writes, output-stripped (no outputs, execution counts or cell timings):
- OUT/notebooks/: the chapters (notebooks/NN_*.ipynb) as they are, and what they read beside them (exercise_checks.py,
  lab_checks/, figures/ and the helper modules they import: BESIDE_NOTEBOOKS);
- OUT/lab/: the lab edition: the same chapters with every solution region replaced by a stub, and the same files
  beside them. A region is nbgrader's: the lines from one holding `### BEGIN SOLUTION` to one holding
  `### END SOLUTION` become `# YOUR CODE HERE` and `raise NotImplementedError()` at the BEGIN line's indentation, as
  nbgrader's ClearSolutions writes them. The function's signature and docstring sit above the region, so the stub
  keeps them; the check cell after it (lab_checks/) says "not written yet" and the notebook goes on. Each lab notebook
  opens, after its title, with a cell made here (LAB_INTRO): what the stubs and checks are, and its regions;
- OUT/solutions/: the exercises' worked solutions with their own exercise_checks.py, kept apart so a teacher decides
  when to hand them out (their links back to the chapters point to ../notebooks/);
- OUT/data/: the bundled data and its licences.
The handout runs on its own: beside a `make lab` checkout, or with the course's package installed by pip, where
minimind_lib finds data/ (and writes runs/) in the folder above the notebooks (minimind_lib.paths.course_dir).
The teacher's notes (docs/answers.md) are not in it.

What is the learner's is never deleted: OUT/.handout-manifest.json records every file this tool wrote with its
SHA-256. A new handout replaces only files it wrote that are unchanged since; a file the learner changed (an edited
notebook), or one of the same name that the tool never wrote, stops the run before anything is written, unless
--force names it (or is given alone: every such file). Files of an earlier handout that the new one no longer holds
are removed when unchanged and of a kind this tool writes (a chapter, a file beside them, a solution, a data file),
inside OUT (not through a folder linked elsewhere), and kept otherwise: a hand-edited manifest cannot make it delete a
learner's file. Each file is replaced atomically, and before the first one is, the manifest lists both the old and
the new SHA-256 of every file: a run killed or failed at any point leaves a folder that the next run accepts, and
that run removes the temp files the killed one left.

Why a hand-written stripper and not nbgrader's ClearSolutions: nbgrader 0.9.6 installs from the package registry
with no server and no conflict with requirements.txt (pip's resolver keeps every pin), but it brings 6 packages into
every learner's environment (nbgrader 20 MB, notebook 17 MB, sqlalchemy 29 MB, rapidfuzz 12 MB, alembic 2.8 MB,
mako 0.8 MB installed: about 82 MB) and registers 4 Jupyter server extensions and a JupyterLab extension, so every
learner's JupyterLab loads its formgrader and assignment panels and logs "No nbgrader_config.py file found". The
part the handout needs is ClearSolutions' 40-line loop, rewritten here with nbgrader's semantics (the delimiters
matched anywhere in a line, the same stub at the BEGIN line's indentation, an error for a nested or unclosed region)
and its metadata rule: a cell holding a region must be marked as an nbgrader solution cell, so a teacher who grades
with nbgrader can run `nbgrader generate_assignment` on the chapters as they are. On notebook 03 nbgrader 0.9.6's
ClearSolutions (enforce_metadata on) gives the same source in every cell as this stripper.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import glob
import hashlib
import json
import os
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import nbformat

from minimind_lib.fileio import TMP_PREFIX, atomic_open, explain
from minimind_lib.paths import REPO_DIR

BESIDE_NOTEBOOKS = ("exercise_checks.py", "lab_checks", "chat_box.py", "band_plot.py", "ddp_demo.py", "lora_dpo.py",
                    "figures", "verdict.py", "matmul_timing.py", "tokenizer_views.py", "data_measurements.py",
                    "model_harness.py", "memory_planner.py", "step_timing.py", "accumulation_harness.py",
                    "precision_harness.py", "batching_harness.py", "run_report.py", "ddp_report.py")
BESIDE_SOLUTIONS = ("exercise_checks.py",)
DATA_FILES = ("pretrain.jsonl", "pretrain_val.jsonl", "sft.jsonl", "pretrain_t2t_mini.jsonl", "sft_t2t_mini.jsonl",
              "dpo.jsonl", "LICENSES.md", "README.md")
BEGIN, END = "BEGIN SOLUTION", "END SOLUTION"  # nbgrader's delimiters, written `### BEGIN SOLUTION` in the chapters
STUB = ("# YOUR CODE HERE", "raise NotImplementedError()")  # nbgrader's ClearSolutions.code_stub["python"]
MANIFEST = ".handout-manifest.json"


class HandoutError(Exception):
    """A handout that cannot be written as asked; nothing was written."""


@dataclass
class Region:
    """One solution region of a cell: lines begin..end (the marker lines), in the function `name`."""
    name: str  # "RMSNorm.forward", "rope_tables": the def (and class) around the region
    begin: int
    end: int
    indent: str


def _enclosing(lines: list[str], at: int) -> str:
    """'Class.method' or 'function': the defs and classes that line `at` sits in, outermost first."""
    names, indent = [], len(lines[at]) - len(lines[at].lstrip())
    for line in reversed(lines[:at]):
        m = re.match(r"(\s*)(?:async\s+)?(?:def|class)\s+(\w+)", line)
        if m and len(m.group(1)) < indent:
            names.insert(0, m.group(2))
            indent = len(m.group(1))
    return ".".join(names) or "top level"


def find_regions(source: str, where: str = "cell") -> list[Region]:
    """The solution regions of a cell's source; ValueError naming `where` and the line for a nested or open one."""
    lines, regions, begin = source.split("\n"), [], None
    for i, line in enumerate(lines):
        if BEGIN in line:
            if begin is not None:
                raise ValueError(f"{where}, line {i + 1}: {BEGIN} inside the region opened on line {begin + 1}")
            begin = i
        elif END in line:
            if begin is None:
                raise ValueError(f"{where}, line {i + 1}: {END} without a {BEGIN} before it")
            regions.append(Region(_enclosing(lines, begin), begin, i, re.match(r"\s*", lines[begin]).group(0)))
            begin = None
    if begin is not None:
        raise ValueError(f"{where}, line {begin + 1}: {BEGIN} without an {END}")
    return regions


def clear_regions(source: str, where: str = "cell") -> tuple[str, list[Region]]:
    """The source with every region replaced by the stub (at the BEGIN line's indentation), and the regions."""
    lines, regions = source.split("\n"), find_regions(source, where)
    kept, start = [], 0
    for r in regions:
        kept += lines[start:r.begin] + [r.indent + line for line in STUB]
        start = r.end + 1
    return "\n".join(kept + lines[start:]), regions


def notebook_regions(nb: nbformat.NotebookNode, name: str = "notebook") -> list[Region]:
    """Every region of a notebook's code cells, in order; ValueError for a region outside an nbgrader solution cell
    or in a text cell."""
    found = []
    for i, cell in enumerate(nb.cells):
        regions = find_regions(cell.source, f"{name}, cell {i}")
        if regions and cell.cell_type != "code":
            raise ValueError(f"{name}, cell {i}: a {cell.cell_type} cell holds nbgrader's solution delimiters "
                             f"({BEGIN!r}, {END!r}), which nbgrader would clear: reword it")
        if regions and not cell.metadata.get("nbgrader", {}).get("solution"):
            raise ValueError(f"{name}, cell {i}: a solution region in a cell without nbgrader's solution metadata "
                             "(metadata.nbgrader.solution = true and a grade_id): nbgrader would refuse it")
        found += regions
    return found


def strip_outputs(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """The notebook with every code cell's outputs, execution count and execution timing removed."""
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
        cell.metadata.pop("execution", None)
    return nb


LAB_INTRO_ID = "lab-edition-intro"
LAB_INTRO = """**This is the lab edition: you write the mechanisms.** In each region listed at the end of this cell
the body of a function is nbgrader's stub, `# YOUR CODE HERE` and `raise NotImplementedError()`; its signature and
docstring (what to write) stay. Replace those two lines with your code, then run the check cell after it (`lab.check`,
from `lab_checks/` beside this notebook). It says one of three things:
- *not written yet*, with a hint: the notebook goes on with minimind_lib's version, so Run All always finishes;
- *not right yet*: the input on which yours first differs from the library's, which output, which index, both values,
  and, when running a usual mistake gives exactly what yours gives, that mistake. Fixed inputs run first, so the same
  code gets the same message every time (a random input, if one is what fails, comes with its seed);
- *passed*: the notebook uses yours from then on.

When a check says the library's rule stood in for another region of yours ("Whose code"), fix that region first.
Calling minimind_lib's own function, or torch's, for the mechanism a region asks for passes its check, but not a
grader (`tools/handout.py --grade`). This notebook's regions, in order: {regions}."""


def lab_edition(nb: nbformat.NotebookNode, name: str = "notebook") -> nbformat.NotebookNode:
    """The notebook (stripped) with every solution region replaced by the stub, and the lab edition's first cell
    (LAB_INTRO, after the title) when it has regions."""
    regions = notebook_regions(nb, name)  # the metadata rule
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            cell.source = clear_regions(cell.source, f"{name}, cell {i}")[0]
    if regions:
        intro = nbformat.v4.new_markdown_cell(LAB_INTRO.format(regions=", ".join(f"`{r.name}`" for r in regions)),
                                              id=LAB_INTRO_ID)
        nb.cells.insert(1, intro)
    return strip_outputs(nb)


def _relink_chapters(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """A solution's links to its chapter, `../NN_x.ipynb` beside it in a checkout, become `../notebooks/NN_x.ipynb`."""
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            cell.source = re.sub(r"\]\(\.\./(\d\d_\w+\.ipynb)\)", r"](../notebooks/\1)", cell.source)
    return nb


def _notebook_bytes(nb: nbformat.NotebookNode) -> bytes:
    return (nbformat.writes(nb) + "\n").encode("utf-8")


def _beside(names: tuple[str, ...], src: Path, folder: str) -> dict[str, Path]:
    """Files of `names` (a folder: its files) that exist in src, keyed by their path in the handout."""
    files = {}
    for name in names:
        path = src / name
        for f in sorted(path.rglob("*")) if path.is_dir() else [path] if path.is_file() else []:
            if f.is_file() and "__pycache__" not in f.parts:
                files[f"{folder}/{f.relative_to(src).as_posix()}"] = f
    return files


def plan_handout(notebook_dir: Path, data_dir: Path) -> dict[str, bytes | Path]:
    """Every file of the handout: its path in the handout -> its content, or the file to copy."""
    chapters = sorted(notebook_dir.glob("*.ipynb"))
    if not chapters:
        raise HandoutError(f"no notebooks in {notebook_dir}")
    plan: dict[str, bytes | Path] = {}
    for path in chapters:
        plan[f"notebooks/{path.name}"] = _notebook_bytes(strip_outputs(nbformat.read(path, as_version=4)))
        plan[f"lab/{path.name}"] = _notebook_bytes(lab_edition(nbformat.read(path, as_version=4), path.name))
    plan |= _beside(BESIDE_NOTEBOOKS, notebook_dir, "notebooks") | _beside(BESIDE_NOTEBOOKS, notebook_dir, "lab")
    for path in sorted((notebook_dir / "solutions").glob("*.ipynb")):
        nb = _relink_chapters(strip_outputs(nbformat.read(path, as_version=4)))
        plan[f"solutions/{path.name}"] = _notebook_bytes(nb)
    if any(p.startswith("solutions/") for p in plan):
        plan |= _beside(BESIDE_SOLUTIONS, notebook_dir, "solutions")
    return plan | _beside(DATA_FILES, data_dir, "data")


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def read_manifest(out: Path) -> dict[str, set[str]]:
    """The files an earlier handout wrote in `out`: path -> the SHA-256 (while a handout runs: the two) each file
    may have; {} when there was none."""
    path = out / MANIFEST
    if not path.exists():
        return {}
    try:
        files = json.loads(path.read_text(encoding="utf-8"))["files"]
        assert isinstance(files, dict), "'files' is not an object"
        files = {rel: {sha} if isinstance(sha, str) else set(sha) for rel, sha in files.items()}
        assert all(all(isinstance(h, str) for h in v) for v in files.values()), "a SHA-256 is not text"
        outside = [k for k in files if Path(k).is_absolute() or ".." in Path(k).parts]
        assert not outside, f"paths outside the folder: {outside[:3]}"  # never remove a file elsewhere
    except (ValueError, KeyError, TypeError, AssertionError) as e:
        raise HandoutError(f"{path} is not a handout manifest ({type(e).__name__}: {e}); it lists the files an "
                           "earlier handout wrote: restore it, or move the folder away and run again") from None
    return files


def _write_manifest(out: Path, files: dict[str, set[str]]) -> None:
    """The manifest, atomically: a file with one possible SHA-256 as text, with two (a handout under way) a list."""
    listed = {rel: next(iter(h)) if len(h) == 1 else sorted(h) for rel, h in sorted(files.items())}
    with atomic_open(out / MANIFEST, "w", encoding="utf-8") as f:
        json.dump({"written_by": "tools/handout.py", "files": listed}, f, indent=1)


def generated(rel: str) -> bool:
    """Whether `rel` is a kind of path this tool writes (a chapter, a file beside the chapters, a solution, a data
    file): the only kind an earlier handout's manifest may have it remove."""
    folder, _, rest = rel.partition("/")
    chapter = re.fullmatch(r"\d\d_[\w-]+\.ipynb", rest) is not None
    if folder in ("notebooks", "lab"):
        return chapter or rest.split("/")[0] in BESIDE_NOTEBOOKS
    if folder == "solutions":
        return chapter or rest in BESIDE_SOLUTIONS
    return folder == "data" and rest in DATA_FILES


def _inside_out(out: Path, rel: str) -> bool:
    """Whether out/rel, links resolved, lies in `out` (a folder linked elsewhere is not the handout's)."""
    return (out / rel).resolve().is_relative_to(out.resolve())


def _refuse_target(out: Path) -> None:
    here, out = Path.cwd().resolve(), out.resolve()
    if out == here or out in (REPO_DIR.resolve(), *REPO_DIR.resolve().parents):
        raise HandoutError(f"refusing to write the handout into {out}: it is the working directory or holds the "
                           "course itself; name a folder of its own, such as build/handout")
    if out.exists() and not out.is_dir():
        raise HandoutError(f"{out} is a file, not a folder")


def _blocked(out: Path, plan: dict, written: dict[str, set[str]], force: bool | set[str]) -> list[str]:
    """The handout's files that exist in `out` as someone else's (changed since written, or never written by it),
    and those whose folder links outside the handout."""
    problems = []
    for rel in plan:
        target = out / rel
        if not _inside_out(out, str(Path(rel).parent)):
            problems.append(f"  {rel}: its folder links outside {out}; the handout writes only inside it")
            continue
        if not target.exists() and not target.is_symlink():
            continue
        if target.is_dir() or target.is_symlink():
            why = "is a folder or a link, not a file this tool wrote"
        elif rel not in written:
            why = "was not written by the handout (not in its manifest)"
        elif _sha256(target) not in written[rel]:
            why = "changed since the last handout"
        else:
            continue
        if target.is_dir() or not (force is True or rel in force):
            problems.append(f"  {rel}: {why}")
    return problems


def _remove_own_temps(out: Path, names: list[str]) -> None:
    """Delete the temp files a killed handout left (atomic_open's, named after the files it writes)."""
    for rel in names:
        folder, name = (out / rel).parent, Path(rel).name
        for tmp in folder.glob(glob.escape(f"{TMP_PREFIX}{name}.") + "*.tmp") if folder.is_dir() else ():
            tmp.unlink()


def _write(target: Path, content: bytes | Path) -> None:
    """One file of the plan, atomically."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with atomic_open(target, "wb") as f:
        if isinstance(content, Path):
            with open(content, "rb") as src:
                shutil.copyfileobj(src, f)
        else:
            f.write(content)


def make_handout(out: Path, notebook_dir: Path = REPO_DIR / "notebooks", data_dir: Path = REPO_DIR / "data",
                 force: bool | set[str] = frozenset()) -> dict[str, list[str]]:
    """Write the handout into `out` by the rules above; return the files written per top-level folder. Before it
    writes a file the manifest names both its old and its new SHA-256, so that a kill at any point leaves a folder
    the next run accepts (and whose temp files it removes)."""
    _refuse_target(out)
    plan, written = plan_handout(notebook_dir, data_dir), read_manifest(out)
    if problems := _blocked(out, plan, written, force):
        raise HandoutError(f"not overwriting {len(problems)} file(s) in {out}:\n" + "\n".join(problems) +
                           "\nnothing was written. Keep them by moving them elsewhere, or replace them with "
                           "`make handout FORCE=1` (all) or `python tools/handout.py --force FILE ...` (as listed).")
    out.mkdir(parents=True, exist_ok=True)
    _remove_own_temps(out, [*plan, MANIFEST])
    new = {rel: _sha256(c) if isinstance(c, Path) else hashlib.sha256(c).hexdigest() for rel, c in plan.items()}
    ours = {rel for rel in plan if (out / rel).is_file() and _sha256(out / rel) in written.get(rel, ())}
    _write_manifest(out, {**written, **{rel: {new[rel]} | (written[rel] if rel in ours else set()) for rel in plan}})
    manifest, done = dict(written), {}
    for rel, content in plan.items():
        _write(out / rel, content)
        manifest[rel] = {_sha256(out / rel)}
        done.setdefault(rel.split("/")[0], []).append(rel)
    for rel in sorted(set(written) - set(plan)):  # an earlier handout's file that this one no longer has
        target = out / rel
        if generated(rel) and _inside_out(out, rel) and target.is_file() and _sha256(target) in written[rel]:
            target.unlink()
        elif target.exists():
            print(f"kept {target}: changed since the handout wrote it, or not a file it writes", file=sys.stderr)
        del manifest[rel]
    _write_manifest(out, manifest)
    return done


def _inside(out: Path, name: str) -> str:
    """A --force FILE as a path inside OUT: given as listed (lab/03_model.ipynb), or with OUT in front."""
    try:
        return Path(name).resolve().relative_to(out.resolve()).as_posix()
    except ValueError:
        return Path(name).as_posix()


# Grading ---------------------------------------------------------------------------------------------------------
# A region's check compares behaviour, so code that calls the library's (or torch's) own version of the mechanism
# passes it. A grader runs `python tools/handout.py --grade lab/*.ipynb` on the learners' notebooks: every call in a
# region to one of these (a dotted prefix, resolved through the notebook's imports) is flagged. lab_checks is flagged
# in every region.
MM, BATCHING = "minimind_lib.model.", "minimind_lib.batching."
READY_MADE = {
    "get_stats": ("minimind_lib.bpe",), "merge": ("minimind_lib.bpe",), "train": ("minimind_lib.bpe", "tokenizers"),
    "encode": ("minimind_lib.bpe", "tokenizers"), "document_rows": ("minimind_lib.data.PretrainDataset",),
    "assistant_mask": ("minimind_lib.corpus.assistant_mask", "minimind_lib.corpus.encode_sft"),
    "write_tokens": ("minimind_lib.corpus.tokenize_to_memmap",),
    "pad_batch": ("minimind_lib.data.pad_collate", "torch.nn.utils.rnn.pad_sequence"),
    "RMSNorm.forward": (MM + "RMSNorm", "torch.nn.RMSNorm", "torch.nn.functional.rms_norm"),
    "rope_tables": (MM + "precompute_freqs_cis",), "apply_rope": (MM + "apply_rotary_pos_emb", MM + "rotate_half"),
    "repeat_kv": (MM + "repeat_kv",),
    "Attention.forward": (MM + "Attention", "torch.nn.MultiheadAttention",
                          "torch.nn.functional.multi_head_attention_forward"),
    "Block.forward": (MM + "MiniMindBlock", MM + "FeedForward", "torch.nn.TransformerEncoderLayer"),
    "Decoder.forward": (MM + "MiniMindModel", MM + "MiniMindForCausalLM"),
    "init_weights": (MM + "MiniMindForCausalLM",), "lr_at": ("minimind_lib.train.lr_at", "torch.optim.lr_scheduler"),
    "clip_by_global_norm": ("torch.nn.utils.clip_grad_norm_", "torch.nn.utils.clip_grad_norm",
                            "torch.nn.utils.clip_grad", "torch.nn.utils.get_total_norm",
                            "torch.nn.utils.clip_grads_with_norm_", "minimind_lib.train"),
    "optimizer_step": ("minimind_lib.train.optimizer_step",),
    "accumulate_step": ("minimind_lib.train.accumulate_step", "minimind_lib.train.fit"),
    "HandScaler.update": ("torch.amp.GradScaler", "torch.cuda.amp.GradScaler", "torch.amp.grad_scaler"),
    "fill_batches": (BATCHING + "fill_batches", BATCHING + "TokenBudgetBatchSampler"),
    "stream_segments": (BATCHING + "stream_segments", BATCHING + "pack_sequences"),
    "rows_from_segments": (BATCHING + "rows_from_segments", BATCHING + "pack_sequences"),
    "after_oom": (BATCHING + "after_oom", BATCHING + "AdaptiveBatchController"),
    "memory_check": (BATCHING + "memory_check", BATCHING + "AdaptiveBatchController"),
    "my_verdict": ("minimind_lib.evaluate.judge",),
    "bits_per_byte": ("minimind_lib.evaluate.text_ladder", "minimind_lib.evaluate.token_scores"),
    "my_generate": ("minimind_lib.generate",), "keep_top_p": ("minimind_lib.generate.sample_next",),
    "deal": ("minimind_lib.distributed.assign_to_ranks", "minimind_lib.distributed.DistributedTokenBudgetSampler"),
    "rank_backward": ("minimind_lib.train.accumulate_step",),
    "accumulate_no_sync": ("minimind_lib.train.accumulate_step",), "per_rank_bytes": (),
}


def _imports(tree: ast.AST) -> dict[str, str]:
    """Each name a notebook's imports bind -> the dotted path it stands for (`mm` -> `minimind_lib.model`)."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.asname or a.name.split(".")[0]: a.name if a.asname else a.name.split(".")[0]
                      for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names |= {a.asname or a.name: f"{node.module}.{a.name}" for a in node.names}
    return names


def _dotted(node: ast.AST) -> str | None:
    """`a.b.c` for a Name or an Attribute chain on a Name, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts, node = [node.attr, *parts], node.value
    return ".".join([node.id, *parts]) if isinstance(node, ast.Name) else None


def _region_def(tree: ast.AST, name: str) -> ast.AST | None:
    """The def (or the method of a class, "Class.method") of region `name` at the top of a cell."""
    nodes = list(getattr(tree, "body", []))
    for part in name.split("."):
        node = next((n for n in nodes if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == part), None)
        nodes = getattr(node, "body", [])
    return node


def grade(path: Path, chapters: Path = REPO_DIR / "notebooks") -> list[str]:
    """What a grader should know about a learner's lab notebook: each region that calls the library's or torch's own
    version of its mechanism (or lab_checks), is still a stub, or cannot be read. HandoutError for a file that is not
    one of the chapters' lab editions."""
    chapter = chapters / path.name
    if not chapter.is_file():
        raise HandoutError(f"{path}: no chapter {path.name} in {chapters} to grade it against")
    try:
        nb = nbformat.read(path, as_version=4)
    except Exception as e:  # nbformat raises several kinds for a file that is not a notebook
        raise HandoutError(f"{path}: not a notebook ({type(e).__name__}: {e})") from None
    code = [c for c in nb.cells if c.cell_type == "code"]
    cells = {c.metadata["nbgrader"].get("grade_id"): _parsable(c.source) for c in code if "nbgrader" in c.metadata}
    imports, notes = {}, []
    for cell in code:
        with contextlib.suppress(SyntaxError):
            imports |= _imports(ast.parse(_parsable(cell.source)))
    for cell in nbformat.read(chapter, as_version=4).cells:
        grade_id = cell.metadata.get("nbgrader", {}).get("grade_id")
        for r in find_regions(cell.source) if cell.cell_type == "code" else []:
            notes += _graded(f"{path.name}: {r.name}", r.name, cells.get(grade_id, ""), imports)
    return notes


def _graded(where: str, name: str, source: str, imports: dict[str, str]) -> list[str]:
    """The grading notes of region `name`, defined in a cell of `source`."""
    try:
        node = _region_def(ast.parse(source), name)
    except SyntaxError as e:
        return [f"{where}: its cell does not parse (line {e.lineno}: {e.msg})"]
    if node is None:
        return [f"{where}: not found in its cell (nbgrader's grade_id) as a def"]
    body = node.body[1:] if ast.get_docstring(node) is not None else node.body
    if body and isinstance(body[0], ast.Raise) and "NotImplementedError" in ast.unparse(body[0]):
        return [f"{where}: still the stub (not written)"]
    ready = READY_MADE.get(name, ()) + ("lab_checks",)
    called = sorted({(n.lineno, full) for n in ast.walk(node) for full in [_resolved(_dotted(n), imports)]
                     if full and any(full == m or full.startswith(m + ".") for m in ready)})
    longest = [(line, full) for line, full in called if not any(o != full and o.startswith(full + ".")
                                                                 for n, o in called if n == line)]
    return [f"{where}: line {line} of its cell uses {full}, a ready-made version of what the region asks for"
            for line, full in longest]


def _parsable(source: str) -> str:
    """A cell's source with IPython's magics and shell lines commented out, so that ast can read it."""
    return "\n".join("#" + line if line.lstrip().startswith(("%", "!")) else line for line in source.split("\n"))


def _resolved(dotted: str | None, imports: dict[str, str]) -> str | None:
    if dotted is None:
        return None
    head, _, rest = dotted.partition(".")
    return f"{imports[head]}.{rest}".rstrip(".") if head in imports else dotted


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, write the handout, list what it holds; exit 2 when it cannot be written as asked."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO_DIR / "build" / "handout")
    parser.add_argument("--force", nargs="*", metavar="FILE",
                        help="replace these files (paths inside OUT, as an error lists them) even if changed since "
                             "the last handout; alone: every such file")
    parser.add_argument("--grade", nargs="+", type=Path, metavar="NOTEBOOK",
                        help="write nothing: flag each region of these lab notebooks that calls a ready-made version "
                             "of its mechanism, or is still a stub (exit 1 if any)")
    args = parser.parse_args(argv)
    if args.grade:
        try:
            notes = [note for path in args.grade for note in grade(path)]
        except (HandoutError, SyntaxError, OSError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print("\n".join(notes) or f"{len(args.grade)} notebook(s): every region is the learner's own code")
        return 1 if notes else 0
    force: bool | set[str] = True if args.force == [] else {_inside(args.out, p) for p in args.force or ()}
    try:
        done = make_handout(args.out, force=force)
    except (HandoutError, ValueError, OSError) as e:  # OSError: a full disk, a read-only folder
        print(f"error: {explain(e)}", file=sys.stderr)
        return 2
    for folder, paths in done.items():
        print(f"{args.out / folder}: {len(paths)} files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
