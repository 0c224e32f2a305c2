"""Dispatch `python -m benchmarks NAME [args]` to benchmarks/NAME.py; a bad argument or input exits 2 with one
`error: ...` line."""

from __future__ import annotations

import importlib
import json
import pkgutil
import sys

import benchmarks as bench_pkg
from minimind_lib.fileio import explain


def available() -> list[str]:
    """Names of the benchmarks that exist."""
    helpers = {"baseline"}  # imported by the benchmarks, not one itself
    return sorted(m.name for m in pkgutil.iter_modules(bench_pkg.__path__)
                  if not m.name.startswith("_") and m.name not in helpers)


def main(argv: list[str] | None = None) -> int:
    """Run one benchmark and print its JSON result."""
    argv = list(sys.argv[1:] if argv is None else argv)
    names = available()
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: python -m benchmarks NAME [--json] [options]\nbenchmarks: {', '.join(names)}")
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in names:
        print(f"error: unknown benchmark {name!r}; available: {', '.join(names)}", file=sys.stderr)
        return 2
    as_json = "--json" in rest
    rest = [a for a in rest if a != "--json"]
    try:
        result = importlib.import_module(f"benchmarks.{name}").main(rest)
    except (ValueError, OSError, RuntimeError) as e:  # a bad argument or input: one line, as the CLI's
        print(f"error: {explain(e)}", file=sys.stderr)
        return 2
    if as_json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:32s} {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
