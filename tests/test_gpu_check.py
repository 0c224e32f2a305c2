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


BENCHES = ("throughput", "throughput_pack", "throughput_ablation", "accumulation", "batching", "throughput_levers")


def run_check(tmp_path: Path, **env: str) -> tuple[subprocess.CompletedProcess, str]:
    r = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), str(tmp_path / "out")],
                       env={**os.environ, "MINIMIND_PROFILE": "smoke", **env}, capture_output=True, text=True,
                       timeout=3600)
    return r, (tmp_path / "out" / "work" / "status.txt").read_text()


def test_smoke_run_runs_every_part_to_its_end_and_archives_it(tmp_path):
    """The whole script on this CPU in the smoke profile, as a GPU runs it in gpu-check (tiny benchmark sizes, caps
    for a loaded 2-core CPU): every benchmark (packed rows, the ablation with its compile rung), the command line's
    compiled run, and every notebook run to its end, exit 0; the archive holds their JSON, runs, notebooks, cell
    timings and the allocator and compile settings; nothing is written to docs/timings."""
    timings_before = {p.name: p.read_bytes() for p in (ROOT / "docs" / "timings").glob("*.json")}
    r, status = run_check(tmp_path)
    print(status)  # each part's seconds of its cap (pytest -s shows them)
    assert r.returncode == 0 and "cut:" not in status and "failed:" not in status, (status, r.stderr[-3000:])
    with tarfile.open(tmp_path / "out" / "gpu_check.tar.gz") as tar:
        names = set(tar.getnames())
        read = lambda name: tar.extractfile(f"./{name}").read().decode()  # noqa: E731
        for bench in BENCHES:
            assert f"ran: bench_{bench} (" in status, status
            assert json.loads(read(f"bench_{bench}.json"))["profile"] == "smoke"
        assert {"ratio_useful_tokens_per_s_runs", "spec_peak_flops_per_s", "mfu"} <= json.loads(
            read("bench_throughput.json")).keys()
        pack = json.loads(read("bench_throughput_pack.json"))
        assert pack["strategy"] == "pack" and pack["compile"] == "compiled" and pack["doc_attention"] == "dense"
        ablation = json.loads(read("bench_throughput_ablation.json"))
        assert set(ablation["levers"]) == {"loop", "padding", "dtype", "optimizer", "chunked_loss", "micro_batch",
                                           "compile"} and ablation["compile"] == "compiled"
        assert "ran: pipeline_pretrain (" in status
        cli_run = json.loads(read("runs/cli/pretrain/config.json"))
        assert cli_run["compile"]["trunk"] and cli_run["train"]["loss_chunk"] == 64
        for nb in ("03_model", "04_gradient_accumulation", "05_mixed_precision", "06_dynamic_batching",
                   "07_pretrain", "08_sft"):
            assert f"ran: notebook {nb[:2]} (" in status and f"./notebooks/{nb}.ipynb" in names, status
        timings = json.loads(read("timings/smoke.json"))["notebooks"]
        assert "07_pretrain.ipynb" in timings and timings["07_pretrain.ipynb"]["cells"]
        assert "./runs/smoke/pretrain/metrics.csv" in names and not [n for n in names if n.endswith((".pt", ".pth"))]
        device = read("device.txt")
        assert "PYTORCH_ALLOC_CONF=expandable_segments:True" in device
        assert "compile: profile smoke compile=False loss_chunk=0 row_multiple=32" in device
    assert "not run: 00_setup 01_tokenizer 02_data 09_beyond_one_gpu" in status
    assert {p.name: p.read_bytes() for p in (ROOT / "docs" / "timings").glob("*.json")} == timings_before


def test_what_runs_out_of_time_is_cut_and_said(tmp_path):
    """No time for the benchmarks: each is noted as cut; notebook 03 given 3 s is saved as far as it ran (no older
    outputs in the cells it never ran); 08 without 07's run trains a small start of its own and runs to its end."""
    r, status = run_check(tmp_path, BENCH_SECONDS="0", GPU_CHECK_NOTEBOOKS="03:3 08:600")
    assert r.returncode == 1 and "failed:" not in status, status
    for part in (*(f"bench_{b}" for b in BENCHES), "pipeline_pretrain"):
        assert f"cut: {part} (out of time)" in status, status
    assert "cut: notebook 03 at its 3s deadline" in status and "ran: notebook 08 (" in status
    assert "note: 07's run is missing" in status
    with tarfile.open(tmp_path / "out" / "gpu_check.tar.gz") as tar:
        read = lambda name: tar.extractfile(f"./{name}").read().decode()  # noqa: E731
        assert "CellTimeoutError" in read("course_03.json")
        cut = nbformat.reads(read("notebooks/03_model.ipynb"), as_version=4)
        unrun = [c for c in cut.cells if c.cell_type == "code" and c.execution_count is None]
        assert unrun and not any(c.outputs for c in unrun)  # cut: the cells it never ran show no older outputs
        sft = nbformat.reads(read("notebooks/08_sft.ipynb"), as_version=4)
        said = "".join(o.get("text", "") for c in sft.cells if c.cell_type == "code" for o in c.outputs)
        assert "a small start of 6 steps (a quarter of 07's)" in said


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_gpu_check_profile_without_cuda_stops_at_once(tmp_path):
    r = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), str(tmp_path / "out")],
                       env={k: v for k, v in os.environ.items() if k != "MINIMIND_PROFILE"}, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and "MINIMIND_PROFILE=gpu-check but torch sees no CUDA device" in r.stderr
    assert not (tmp_path / "out").exists()
