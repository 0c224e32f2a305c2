"""Where the course's files live (notebook 00_setup): the repository's data/ folder and the bundled assets."""

from __future__ import annotations

import os
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
ASSETS_DIR = PACKAGE_DIR / "assets"
REPO_DIR = PACKAGE_DIR.parent
# MINIMIND_DATA_DIR points the course at another folder (e.g. one holding MiniMind's full jsonl files).
DATA_DIR = Path(os.environ.get("MINIMIND_DATA_DIR", REPO_DIR / "data")).resolve()
