"""benchmarks/gpu_check.sh and its wheel list: what can be checked without a GPU."""
from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _pins(path: Path) -> dict[str, str]:
    """name -> version of the `name==version` lines of a requirements-style file (names normalised)."""
    pins = {}
    for line in path.read_text().splitlines():
        m = re.match(r"^\s*([A-Za-z0-9_.-]+)==([^\s#;]+)", line)
        if m:
            pins[re.sub(r"[-_.]+", "-", m.group(1)).lower()] = m.group(2)
    return pins


def test_gpu_wheels_pin_the_versions_requirements_pins():
    wheels, reqs = _pins(ROOT / "benchmarks" / "gpu_wheels.txt"), _pins(ROOT / "requirements.txt")
    assert {"nbclient", "nbformat", "ipykernel"} <= set(wheels)
    differ = {k: (wheels[k], reqs[k]) for k in wheels.keys() & reqs.keys() if wheels[k] != reqs[k]}
    assert not differ, f"benchmarks/gpu_wheels.txt and requirements.txt pin different versions: {differ}"


def test_script_parses():
    subprocess.run(["bash", "-n", str(ROOT / "benchmarks" / "gpu_check.sh")], check=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_gpu_profile_without_cuda_stops_at_once(tmp_path):
    env = {**os.environ, "MINIMIND_PROFILE": "gpu"}
    r = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), str(tmp_path / "out")], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "MINIMIND_PROFILE=gpu but torch sees no CUDA device" in r.stderr
    assert not (tmp_path / "out" / "gpu_check.tar.gz").exists()
