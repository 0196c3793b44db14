"""The `sinkstudy` command line.

Each command module exposes `register(subparsers)`, which adds its sub-commands with
`set_defaults(func=...)`; `func(args)` returns an exit code. Command modules keep their
top-level imports light (torch and friends are imported inside `func`) so `--help` is instant.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from sinkstudy import SinkstudyError, __version__

COMMAND_MODULES = (
    "experiments.cmd_pair",    # pair extract / pair diff
    "experiments.cmd_sink",    # sink
    "experiments.cmd_eval",    # eval / compare
    "experiments.cmd_qknorm",  # qknorm
    "experiments.cmd_adapt",   # adapt
    "experiments.cmd_merge",   # merge / merge-sweep / mitigate
    "experiments.cmd_study",   # run / demo / paper
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sinkstudy", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"sinkstudy {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except SinkstudyError as exc:
        print(f"sinkstudy: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
