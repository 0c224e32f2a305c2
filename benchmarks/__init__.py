"""Benchmarks: `python -m benchmarks NAME --json` prints one JSON object per run.

Each benchmark is a module ``benchmarks/<name>.py`` with ``main(argv: list[str]) -> dict``.
Timings are compared only as ratios measured in the same process.
"""

import minimind_lib  # noqa: F401  (first: it sets OpenMP's wait policy before torch loads)
