"""The notebooks that time things (04, 05, 06) pass while two other processes keep both cores busy.

No cell asserts a time, a speed or a ratio of times (the course's rule, since CI is a loaded 2-core machine): the
cells assert what is counted and report what is timed, so load can slow them down but not fail them."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TIMED = ["04_gradient_accumulation", "05_mixed_precision", "06_dynamic_batching"]


def test_timing_notebooks_pass_with_both_cores_busy():
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        env = {**os.environ, "MINIMIND_PROFILE": "smoke", "PYTHONPATH": str(ROOT)}
        run = subprocess.run([sys.executable, "-m", "pytest", "--nbval-lax", "--nbval-current-env", "-p",
                              "no:cacheprovider", "-q", *(f"notebooks/{n}.ipynb" for n in TIMED)],
                             cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    finally:
        for p in busy:
            p.kill()
            p.wait()
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
