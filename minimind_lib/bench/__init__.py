"""Benchmarks: `python -m minimind_lib.bench NAME --json` prints one JSON object per run.

Each benchmark is a module ``minimind_lib/bench/<name>.py`` with ``main(argv: list[str]) -> dict``.
Timings are compared only as ratios measured in the same process.
"""
