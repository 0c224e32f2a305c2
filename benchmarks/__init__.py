"""Benchmarks: `python -m benchmarks NAME --json` prints one JSON object per run.

Each benchmark is a module ``benchmarks/<name>.py`` with ``main(argv: list[str]) -> dict``.
Timings are compared only as ratios measured in the same process.
"""
