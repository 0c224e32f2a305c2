"""benchmarks/gpu_check.sh and its wheel list: what can be checked without a GPU."""
from __future__ import annotations

import json
import os
import re
import subprocess
import tarfile
from pathlib import Path

import nbformat
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


def test_smoke_run_finishes_and_archives_every_output(tmp_path):
    """The whole script on a CPU in the smoke profile (what a GPU run executes, in tiny sizes): every benchmark's JSON,
    the executed notebooks and their cell timings land in the archive, status.txt says what ran and what was cut (07
    runs, 03 is given 3 seconds so that the deadline path runs too), and nothing is written to docs/timings."""
    timings_before = {p.name: p.read_bytes() for p in (ROOT / "docs" / "timings").glob("*.json")}
    env = {**os.environ, "MINIMIND_PROFILE": "smoke", "GPU_CHECK_NOTEBOOKS": "07:600 03:3"}
    r = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), str(tmp_path / "out")], env=env,
                       capture_output=True, text=True, timeout=1800)
    status = (tmp_path / "out" / "work" / "status.txt").read_text()
    assert r.returncode == 1, (r.stdout[-3000:], r.stderr[-3000:])  # 1: notebook 03 was cut, on purpose
    assert "failed:" not in status, status
    with tarfile.open(tmp_path / "out" / "gpu_check.tar.gz") as tar:
        names = set(tar.getnames())
        read = lambda name: tar.extractfile(f"./{name}").read().decode()  # noqa: E731
        for bench in ("throughput", "throughput_ablation", "accumulation", "batching", "memmap", "throughput_levers"):
            assert f"ran: bench bench_{bench} (" in status, status
            assert json.loads(read(f"bench_{bench}.json"))["profile"] == "smoke"
        assert {"ratio_useful_tokens_per_s_runs", "spec_peak_flops_per_s", "mfu"} <= json.loads(
            read("bench_throughput.json")).keys()
        assert set(json.loads(read("bench_throughput_ablation.json"))["levers"]) == {"loop", "padding", "dtype",
                                                                                     "optimizer"}
        # measured, or (in its few seconds, on a CPU) noted as not measured: not a failure
        assert re.search(r"ran: bench bench_throughput_compile \(|cut: bench bench_throughput_compile, not measured",
                         status), status
        for nb in ("07_pretrain", "03_model"):
            assert f"./notebooks/{nb}.ipynb" in names
        assert "ran: notebook 07" in status
        assert "cut: notebook 03 at its 3s deadline" in status and "CellTimeoutError" in read("course_03.json")
        cut = nbformat.reads(read("notebooks/03_model.ipynb"), as_version=4)
        unrun = [c for c in cut.cells if c.cell_type == "code" and c.execution_count is None]
        assert unrun and not any(c.outputs for c in unrun)  # cut: the cells it never ran show no older run's outputs
        timings = json.loads(read("timings/smoke.json"))["notebooks"]
        assert {"07_pretrain.ipynb", "03_model.ipynb"} <= set(timings) and timings["07_pretrain.ipynb"]["cells"]
        assert "./runs/smoke/pretrain/metrics.csv" in names and not [n for n in names if n.endswith((".pt", ".pth"))]
    assert "not run: 00_setup 01_tokenizer 02_data 09_beyond_one_gpu" in status
    assert {p.name: p.read_bytes() for p in (ROOT / "docs" / "timings").glob("*.json")} == timings_before


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_gpu_check_profile_without_cuda_stops_at_once(tmp_path):
    r = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), str(tmp_path / "out")],
                       env={k: v for k, v in os.environ.items() if k != "MINIMIND_PROFILE"}, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and "MINIMIND_PROFILE=gpu-check but torch sees no CUDA device" in r.stderr
    assert not (tmp_path / "out").exists()
