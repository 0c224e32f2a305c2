"""Benchmark: the workshop model's training step as OpenMP waits by default, as the course sets it, fully passive, and
on one thread, on a quiet machine and beside a competing busy process.

`python -m benchmarks threads --json`. OpenMP reads its settings once, when torch loads, so each setting runs in a
fresh process (torch imported before minimind_lib, so the library's default cannot creep into the "default" runs).
The settings and conditions are interleaved within each repeat; every ratio is paired (the same repeat and condition)
and reported as median, min and max. Why it matters: with the default policy a waiting OpenMP thread spins for its
partner, and when the scheduler has given the partner's core to another process (a browser, JupyterLab, pytest),
every barrier of a small matmul waits for a time slice (notebook 00_setup).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from minimind_lib import COURSE_OPENMP
from minimind_lib.device import describe

# One child: `steps` timed optimizer steps of the profile's model and micro-batches (random tokens: the time of a
# step does not depend on which tokens), after one untimed step; prints its seconds per step and what it ran with.
CHILD = r"""
import json, os, sys, time
given = {name: os.environ.get(name) for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
import torch  # first: OpenMP reads the environment this process was given, before minimind_lib could change it
from minimind_lib.model import MiniMindConfig, MiniMindForCausalLM
from minimind_lib.profiles import get_profile
from minimind_lib.train import TrainConfig, accumulate_step, build_optimizer, optimizer_step
profile, steps, threads = get_profile(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
if threads:
    torch.set_num_threads(threads)
torch.manual_seed(0)
model = MiniMindForCausalLM(MiniMindConfig.preset(profile.model))
optimizer = build_optimizer(model, TrainConfig(lr=1e-3, progress=False), "cpu")
shape = (profile.batch_size, profile.seq_len)
micro_batches = []
for _ in range(profile.accum_steps):
    ids = torch.randint(0, model.config.vocab_size, shape)
    micro_batches.append({"input_ids": ids, "labels": ids.clone()})
params = list(model.parameters())
times = []
for step in range(steps + 1):
    start = time.perf_counter()
    accumulate_step(model, micro_batches)
    optimizer_step(optimizer, params, 1.0)
    times.append(time.perf_counter() - start)
print(json.dumps({"s_per_step": sorted(times[1:])[len(times[1:]) // 2], "threads": torch.get_num_threads(),
                  **given}))
"""

BUSY = "while True:\n    pass\n"  # one process that always wants a core, like a busy browser tab or a test run


SETTINGS = {  # name: (variables, torch threads; 0: torch's default, one per core)
    "default": ({}, 0),  # nothing set: GNU OpenMP spins about 3 ms at a barrier before it sleeps
    "course": (COURSE_OPENMP, 0),  # what minimind_lib sets
    "passive": ({"OMP_WAIT_POLICY": "PASSIVE"}, 0),  # sleep at once
    "one_thread": ({"OMP_NUM_THREADS": "1"}, 1),
}


def setting_env(name: str) -> tuple[dict, int]:
    """The environment and torch thread count of a setting of SETTINGS."""
    variables, threads = SETTINGS[name]
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS", "GOMP_SPINCOUNT")}
    return {**env, **variables}, threads


def run_child(setting: str, profile: str, steps: int, loaded: bool) -> dict:
    """One fresh process's seconds per step under `setting`, with a competing busy process beside it if `loaded`."""
    env, threads = setting_env(setting)
    busy = subprocess.Popen([sys.executable, "-c", BUSY]) if loaded else None
    try:
        done = subprocess.run([sys.executable, "-c", CHILD, profile, str(steps), str(threads)], env=env,
                              capture_output=True, text=True, timeout=1800)
    finally:
        if busy is not None:
            busy.kill()
            busy.wait()
    if done.returncode != 0:
        raise RuntimeError(f"threads benchmark: the {setting} child failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def spread(values: list[float]) -> dict:
    """Median, min and max of a list of numbers."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main(argv: list[str]) -> dict:
    """Run the benchmark; return its JSON-ready result."""
    ap = argparse.ArgumentParser(prog="python -m benchmarks threads", description=__doc__.split("\n")[0])
    ap.add_argument("--profile", default="workshop", help="whose model and micro-batches (default: workshop)")
    ap.add_argument("--steps", type=int, default=10, help="timed optimizer steps per child (default 10)")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved repeats of every setting (default 3)")
    ap.add_argument("--conditions", default="quiet,loaded", help="quiet, loaded or both (default: both)")
    args = ap.parse_args(argv)
    for name in ("steps", "repeats"):
        if getattr(args, name) < 1:
            raise SystemExit(f"error: --{name} must be >= 1, got {getattr(args, name)}")
    conditions = [c for c in args.conditions.split(",") if c]
    if not conditions or set(conditions) - {"quiet", "loaded"}:
        raise SystemExit(f"error: --conditions {args.conditions!r}: use quiet, loaded or quiet,loaded")
    settings = tuple(SETTINGS)
    runs = {(c, s): [] for c in conditions for s in settings}
    load = os.getloadavg()  # 1, 5 and 15 minutes: a quiet machine reads below 1 before the first child
    facts = {}
    for _ in range(args.repeats):
        for condition in conditions:
            for setting in settings:
                child = run_child(setting, args.profile, args.steps, condition == "loaded")
                runs[condition, setting].append(child["s_per_step"])
                facts[setting] = {k: v for k, v in child.items() if k != "s_per_step"}
    result = {"profile": args.profile, "steps": args.steps, "repeats": args.repeats, "cpu_count": os.cpu_count(),
              "device": describe(), "load_average_at_start": load, "load_average_at_end": os.getloadavg(),
              "settings": facts}
    for (condition, setting), times in runs.items():
        result[f"s_per_step_{condition}_{setting}"] = spread(times)
    for condition in conditions:
        for a in ("default", "passive", "one_thread"):
            ratios = [x / y for x, y in zip(runs[condition, a], runs[condition, "course"])]
            result[f"ratio_{condition}_{a}_vs_course"] = spread(ratios)  # > 1: the course's is faster
        medians = {s: statistics.median(runs[condition, s]) for s in settings}
        result[f"fastest_{condition}"] = min(medians, key=medians.get)
    return result
