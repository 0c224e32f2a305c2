"""The device report and the CLI's `info` command."""

import json
import subprocess
import sys

import torch

from minimind_lib import device as dev
from minimind_lib.profiles import get_profile

KEYS = {"device", "device_name", "profile", "torch", "bf16_supported", "total_memory_bytes"}


def test_report_has_the_promised_fields():
    report = dev.device_report(torch.device("cpu"), get_profile("smoke"))
    assert KEYS <= set(report)
    assert report["device"] == "cpu" and report["profile"] == "smoke"
    assert report["torch"] == torch.__version__
    assert report["total_memory_bytes"] > 0
    json.dumps(report)  # JSON-ready


def test_cpu_bf16_native_follows_the_cpu_flags(monkeypatch, tmp_path):
    # bf16_native must come from the CPU's instruction flags, not from "autocast runs" (it always runs).
    dev.cpu_has_native.cache_clear()
    fake = tmp_path / "cpuinfo"
    fake.write_text("model name\t: Test CPU\nflags\t\t: fpu sse2 avx2 avx512f\n")
    real_open = open
    monkeypatch.setattr("builtins.open", lambda p, *a, **k: real_open(fake if p == "/proc/cpuinfo" else p, *a, **k))
    assert dev.cpu_has_native(torch.bfloat16) is False and dev.bf16_native(torch.device("cpu")) is False
    dev.cpu_has_native.cache_clear()
    fake.write_text("model name\t: Test CPU\nflags\t\t: fpu avx512f avx512_bf16\n")
    assert dev.cpu_has_native(torch.bfloat16) is True and dev.cpu_has_native(torch.float16) is False
    dev.cpu_has_native.cache_clear()


def test_get_device_prefers_explicit_choice(monkeypatch):
    monkeypatch.setenv("MINIMIND_DEVICE", "cpu")
    assert dev.get_device() == torch.device("cpu")
    assert dev.get_device("meta") == torch.device("meta")


def test_describe_names_device_and_profile():
    line = dev.describe(get_profile("smoke"), torch.device("cpu"))
    assert line.startswith("cpu (") and "profile=smoke" in line


def test_describe_names_the_cpus_16_bit_instructions(monkeypatch, tmp_path):
    # two CPUs of one model name can differ in what decides notebook 05's results: the line names their flags
    fake, real_open = tmp_path / "cpuinfo", open
    monkeypatch.setattr("builtins.open", lambda p, *a, **k: real_open(fake if p == "/proc/cpuinfo" else p, *a, **k))
    for flags, named in (("fpu sse2 avx2", "no bf16/fp16 instructions"), ("avx2 avx512f avx512_bf16", "avx512_bf16"),
                         ("avx512_bf16 amx_bf16 avx512_fp16 amx_tile", "amx_bf16 avx512_bf16 avx512_fp16")):
        fake.write_text(f"model name\t: AMD EPYC 7B13\nflags\t\t: {flags}\n")
        line = dev.describe(get_profile("smoke"), torch.device("cpu"))
        assert line.startswith(f"cpu (AMD EPYC 7B13; {named}), profile=smoke, torch "), line


def test_cli_info_prints_json():
    out = subprocess.run([sys.executable, "-m", "minimind_lib", "info", "--profile", "smoke", "--compact"],
                         capture_output=True, text=True, check=True).stdout
    report = json.loads(out)
    assert KEYS <= set(report) and report["profile"] == "smoke"


def test_cli_bad_profile_exits_nonzero_with_message():
    proc = subprocess.run([sys.executable, "-m", "minimind_lib", "info", "--profile", "huge"],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert "unknown profile 'huge'" in proc.stderr


def test_fp16_report_agrees_with_what_autocast_does():
    # notebook 05 runs fp16 autocast on the CPU: the report must say it runs, and whether the hardware has fp16 math
    report = dev.device_report(torch.device("cpu"), get_profile("smoke"))
    with torch.autocast("cpu", dtype=torch.float16):
        ran = (torch.ones(4, 4) @ torch.ones(4, 4)).dtype == torch.float16
    assert report["fp16_supported"] is ran is True
    assert report["fp16_native"] == dev.cpu_has_native(torch.float16)
    assert report["bf16_supported"] is True and report["bf16_native"] == dev.cpu_has_native(torch.bfloat16)
