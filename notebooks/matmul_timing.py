"""Notebook 00's timing loop: how fast one matrix product runs in bf16 and fp16 against fp32, on one device.

Harness, not course material: the notebook reads the ratios it returns. All three dtypes run in the same process,
back to back, so only their ratios mean something (an absolute time on a shared machine is noise).
"""

import statistics
import time

import torch

from minimind_lib.device import synchronize


def time_matmul(device: torch.device, dtype: torch.dtype, n: int, repeats: int) -> float:
    """Median seconds of an n x n matrix product in `dtype`; a first run warms up caches and kernels."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    times = []
    for _ in range(repeats + 1):
        synchronize(device)  # a GPU runs asynchronously: wait for it before reading the clock
        start = time.perf_counter()
        a @ b
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def matmul_speed_vs_fp32(device: torch.device, n: int, repeats: int = 5) -> dict[str, float]:
    """{"bf16": x, "fp16": y}: the speed of an n x n matmul in that dtype over its speed in fp32 (> 1: faster)."""
    seconds = {name: time_matmul(device, dtype, n, repeats) for name, dtype in
               (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16))}
    return {name: seconds["fp32"] / seconds[name] for name in ("bf16", "fp16")}
