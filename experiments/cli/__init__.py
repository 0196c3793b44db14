"""The `sinkstudy` command line.

Each command module exposes `register(subparsers)`, which adds its sub-commands with
`set_defaults(func=...)`; `func(args)` returns an exit code, or an `experiments.cli.closing.Summary`
that `main` prints last with the command's wall time (where the outputs are, the one-line result,
how long it took, what to run next) before exiting with its code. Command modules keep their
top-level imports light (torch and friends are imported inside `func`) so `--help` is instant.
Bad input (a SinkstudyError, an argparse error, a full disk) is one line on stderr and exit 2; Ctrl-C is one line
and exit 130.
Every command takes the shared option groups of `experiments.cli.options` for what it does; its
`--quiet` silences every progress bar of the run (`sinkstudy.progress.quiet`); a command that computes runs on
its `--threads` (`sinkstudy.threads`: set up here, before torch loads) in its `--numerics` mode.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
import time

from experiments.cli.closing import Summary
from experiments.cli.options import check_device, check_model_names
from sinkstudy import SinkstudyError, __version__, numerics, threads
from sinkstudy.distributed import leave_process_group
from sinkstudy.io import disk_full
from sinkstudy.progress import quiet

COMMAND_MODULES = (
    "experiments.cli.cmd_pair",    # pair extract / pair diff
    "experiments.cli.cmd_sink",    # sink
    "experiments.cli.cmd_eval",    # eval / compare
    "experiments.cli.cmd_qknorm",  # qknorm
    "experiments.cli.cmd_adapt",   # adapt
    "experiments.cli.cmd_merge",   # merge / mitigate
    "experiments.cli.cmd_sweep",   # merge-sweep
    "experiments.cli.cmd_dose",    # dose
    "experiments.cli.cmd_study",   # run / demo / paper
    "experiments.cli.cmd_published",  # paper-table
    "experiments.cli.cmd_clean",   # clean
)


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one line (no usage block): `--help` still shows the usage."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="sinkstudy", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"sinkstudy {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:  # every output is written whole or not at all; finished steps stay for a rerun
        print("sinkstudy: interrupted: nothing half-written is left; rerun the command to go on (finished steps are reused)",
              file=sys.stderr)
        return 130


def _main(argv: list[str] | None) -> int:
    started = time.perf_counter()
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # what a study on several numeric modes runs again per mode
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        check_model_names(args)
        mode = numerics.requested(getattr(args, "numerics", None), getattr(args, "numerics_default", "native"))
        if len(getattr(args, "numerics", None) or []) > 1 and not args.numeric_spread:
            raise SinkstudyError(f"--numerics {','.join(args.numerics)}: sinkstudy {args.command} computes in one numeric mode; "
                                 "several are for a study (sinkstudy run / demo)")
        n = _threads(args, mode) if hasattr(args, "threads") else None
        # before torch loads: the reproducible mode restarts the program with its environment (sinkstudy.numerics)
        numerics.enter(mode, reexec=argv is None)
        numerics.configure_torch()
        if n is not None:
            threads.apply(n)
        check_device(getattr(args, "device", None))
        with quiet(getattr(args, "quiet", False)):  # --quiet: the libraries' progress bars too
            result = args.func(args)
        leave_process_group()
        if isinstance(result, Summary):
            print(result.format(time.perf_counter() - started), flush=True)
            return result.exit_code
        return int(result or 0)
    except SinkstudyError as exc:
        return _fail(str(exc))
    except UnicodeDecodeError as exc:  # a reader that does not name its file (sinkstudy.io.read_text does)
        return _fail(f"an input file is not UTF-8 text ({exc.reason}, byte 0x{exc.object[exc.start]:02x} at offset {exc.start})")
    except Exception as exc:
        full = disk_full(exc)
        if full is None:
            raise
        where = f" writing {full.filename}" if getattr(full, "filename", None) else ""
        return _fail(f"the disk is full{where} ({full.strerror or 'No space left on device'}); "
                     "nothing was moved into place: free space and rerun (finished steps are reused)")


def _threads(args, mode: str) -> int:
    """The compute threads of a command (--threads, else `sinkstudy.threads.default_threads`; one in the reproducible
    mode, whose numbers must not depend on the cores), set up before torch loads (`sinkstudy.threads.prepare`)."""
    if mode == "reproducible":
        if (args.threads or 1) > 1:
            raise SinkstudyError(f"--threads {args.threads}: the reproducible numeric mode computes on one thread, so that its "
                                 "numbers are the same on any machine; pass --numerics native to use more")
        n = 1
    else:
        n = args.threads or threads.default_threads()
    threads.prepare(n)
    return n


def _fail(message: str) -> int:
    print(f"sinkstudy: error: {' '.join(message.split())}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
