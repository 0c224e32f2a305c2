"""Train, before class, the runs later notebooks reuse: `python tools/prepare_workshop.py [--profile workshop]`.

Notebook 08 starts from notebook 07's pretraining run in runs/<profile>/pretrain. This runs the same pretraining
with the command line (`python -m minimind_lib pretrain`), then writes provenance.json beside it: the command, the
profile, the steps, when it ran and the SHA-256 of model.pth, so that notebook 08 can say where its run came from
(and notice when notebook 07 has replaced it since). `make prepare-workshop` calls this.
"""

import argparse
import datetime as dt
import hashlib
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

from minimind_lib.fileio import atomic_write_text
from minimind_lib.paths import REPO_DIR
from minimind_lib.pipeline import run_dir_for
from minimind_lib.profiles import PROFILES

PROVENANCE_FILE = "provenance.json"


def sha256_of(path: Path) -> str:
    """Hex SHA-256 of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def utc_now() -> str:
    """The current UTC time, to the second, ISO 8601."""
    return dt.datetime.now(dt.timezone.utc).replace(microsecond=0).isoformat()


def prepare(profile: str) -> dict:
    """Run the profile's pretraining into runs/<profile>/pretrain and record its provenance; return the record."""
    if profile not in PROFILES:
        raise SystemExit(f"error: unknown profile {profile!r}; choose one of {sorted(PROFILES)}")
    out = run_dir_for(profile, "pretrain")
    command = [sys.executable, "-m", "minimind_lib", "pretrain", "--profile", profile, "--out", str(out),
               "--overwrite", "--no-progress"]
    started = utc_now()
    print("$", shlex.join(command), flush=True)
    subprocess.run(command, check=True, env={**os.environ, "MINIMIND_PROFILE": profile})
    summary = json.loads((out / "summary.json").read_text())
    shown = os.path.relpath(out, REPO_DIR) if out.resolve().is_relative_to(REPO_DIR) else str(out)
    record = {"made_by": "make prepare-workshop (tools/prepare_workshop.py)",
              "command": shlex.join(["python", *command[1:-3], shown, *command[-2:]]), "profile": profile,
              "steps": summary.get("steps"), "tokens": summary.get("tokens"),
              "final_val_loss": summary.get("final_val_loss"), "device": summary.get("device"),
              "started_utc": started, "finished_utc": utc_now(), "model_sha256": sha256_of(out / "model.pth")}
    atomic_write_text(out / PROVENANCE_FILE, json.dumps(record, indent=2) + "\n")
    return record


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, prepare the runs, print where they are."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="workshop", help=f"one of {sorted(PROFILES)} (default: workshop)")
    args = parser.parse_args(argv)
    record = prepare(args.profile)
    print(json.dumps(record, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
