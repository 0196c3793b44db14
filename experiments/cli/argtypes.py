"""argparse value types shared by the commands: bad numbers are refused while parsing, before
any work, with one line naming the option (experiments.cli prints argparse errors as one line)."""

from __future__ import annotations

import argparse
import math

from evals.protocol import check_batch_size
from sinkstudy import SinkstudyError
from sinkstudy.numerics import path_list
from sinkstudy.plugins import load_plugins



def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
    return value


def finite_float(text: str) -> float:
    return _number(text)


def int_at_least(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {value}")
        return value

    parse.__name__ = f"integer >= {minimum}"
    return parse


positive_int = int_at_least(1)


def seed_list(text: str) -> list[int]:
    """`0,1,2`: at least two distinct training seeds (integers >= 0)."""
    parse = int_at_least(0)
    seeds = [parse(x.strip()) for x in text.split(",") if x.strip()]
    if len(seeds) < 2 or len(set(seeds)) != len(seeds):
        raise argparse.ArgumentTypeError(f"give at least two distinct seeds, e.g. 0,1,2; got {text!r}")
    return seeds
n_boot = int_at_least(1)  # bootstrap replicates: 0 would give no CI at all


def limit(text: str) -> int | float:
    """Prompts per task: a whole number >= 1, or a fraction in (0, 1) of each task's prompts."""
    value = _number(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"limit must be positive, got {text}")
    if value >= 1 and not value.is_integer():
        raise argparse.ArgumentTypeError(f"limit above 1 must be a whole number of prompts, got {text}")
    return int(value) if value >= 1 else value


def batch_size(text: str) -> int | str:
    """An integer >= 1, or lm-eval's adaptive auto / auto:N (`evals.protocol.check_batch_size`)."""
    try:
        return check_batch_size(text)
    except SinkstudyError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def confidence(text: str) -> float:
    value = _number(text)
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"confidence must be in (0, 1), got {text}")
    return value


def numeric_modes(text: str) -> list[str]:
    """`--numerics`: one numeric mode, or several separated by commas (`sinkstudy.numerics.path_list`)."""
    try:
        return path_list(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_plugin_option(parser) -> None:
    """`--plugin FILE.py|MODULE` (repeatable): protections / mitigations from outside the package."""
    parser.add_argument("--plugin", action="append", default=[], metavar="FILE.py|MODULE",
                        help="load protections and mitigations from a plug-in file or module first (repeatable; docs/protect.md)")


def load_plugin_options(args) -> list:
    """Import the plug-ins named by `--plugin` (one-line error for a missing or failing one)."""
    return load_plugins(getattr(args, "plugin", None) or [])
