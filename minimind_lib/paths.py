"""Where the course's files live (notebook 00_setup): the course folder's data/ (or
MINIMIND_DATA_DIR, with MiniMind's own file names) and the bundled assets."""

from __future__ import annotations

import os
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
ASSETS_DIR = PACKAGE_DIR / "assets"


def course_dir(start: Path | None = None) -> Path:
    """The checkout this package lives in; for an installed package, the nearest folder at or above
    `start` (the working directory) that holds data/pretrain.jsonl, as an unzipped handout does;
    else `start` itself."""
    if (PACKAGE_DIR.parent / "data" / "pretrain.jsonl").is_file():
        return PACKAGE_DIR.parent
    start = (start or Path.cwd()).resolve()
    return next((d for d in (start, *start.parents) if (d / "data" / "pretrain.jsonl").is_file()),
                start)


REPO_DIR = course_dir()
# MINIMIND_DATA_DIR points the course at another folder (e.g. one holding MiniMind's full jsonl
# files).
DATA_DIR = Path(os.environ.get("MINIMIND_DATA_DIR", REPO_DIR / "data")).resolve()
# The default data file of each stage in DATA_DIR: the bundled name first, then MiniMind2's and
# MiniMind-3's.
DATA_FILE_PATTERNS = {"pretrain": ("pretrain.jsonl", "pretrain_hq.jsonl", "pretrain_t2t*.jsonl"),
                      "sft": ("sft.jsonl", "sft_mini_512.jsonl", "sft_t2t*.jsonl"),
                      "dpo": ("dpo.jsonl",)}


def find_data_file(stage: str) -> Path:
    """The first file in DATA_DIR matching the stage's DATA_FILE_PATTERNS; FileNotFoundError lists
    what was sought."""
    found = [path for pattern in DATA_FILE_PATTERNS[stage]
             for path in sorted(DATA_DIR.glob(pattern))]
    if found:
        return found[0]
    raise FileNotFoundError(f"no {stage} data in {DATA_DIR} (looked for "
                            f"{', '.join(DATA_FILE_PATTERNS[stage])}); "
                            f"pass --data FILE or set MINIMIND_DATA_DIR to the folder holding one")
