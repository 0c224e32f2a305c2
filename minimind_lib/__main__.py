"""Command line: `python -m minimind_lib COMMAND`.

Commands:
  info      print JSON facts about the device and the selected profile
  pretrain  pretrain a model on a {"text"} jsonl file (MiniMind's pretrain_hq.jsonl works unchanged)
  sft       fine-tune a pretrained run on a {"conversations"} jsonl file
  chat      talk to a trained run directory
"""

from __future__ import annotations

import argparse
import json
import sys


def cmd_info(args: argparse.Namespace) -> int:
    """Print the device report as JSON."""
    from .device import device_report
    from .profiles import get_profile

    report = device_report(profile=get_profile(args.profile))
    print(json.dumps(report, indent=None if args.compact else 2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the CLI (one subcommand per task)."""
    parser = argparse.ArgumentParser(prog="python -m minimind_lib", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="print device and profile facts as JSON")
    info.add_argument("--profile", default=None, help="profile name (default: MINIMIND_PROFILE or auto)")
    info.add_argument("--compact", action="store_true", help="one-line JSON")
    info.set_defaults(func=cmd_info)
    from .cli import add_subcommands

    add_subcommands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse arguments and run the command; errors become a message and exit code 2."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
