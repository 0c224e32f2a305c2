"""Timing harness of notebooks 05 and 06: calls timed in turns, so that the machine's other load falls on each alike.

On a shared machine only ratios of times taken in the same round mean anything; `verdict.ratios` reads them (the
median and range of the paired ratios). Nothing here is what a chapter teaches.
"""

import time
from typing import Callable

import torch

from minimind_lib.device import synchronize


def interleaved(calls: dict[str, Callable[[], object]], repeats: int, device: torch.device,
                warmup: int = 1) -> dict[str, list[float]]:
    """Seconds of each call in each of `repeats` rounds; within a round the calls run back to back, in an order that
    rotates every round, so that none always runs first. `warmup` rounds run first and are not recorded (allocations,
    kernel choice). The device is synchronized before and after each call: a GPU runs kernels asynchronously."""
    names = list(calls)
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(warmup + repeats):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            synchronize(device)
            start = time.perf_counter()
            calls[name]()
            synchronize(device)
            if round_ >= warmup:
                times[name].append(time.perf_counter() - start)
    return times
