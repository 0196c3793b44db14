"""A study as `sinkstudy run`, `demo` and `paper` run it: its output folder checked before any work (`check_out`),
its steps run in this process or on N workers, once per training seed or numeric mode (`launch`), and the command line
that runs one of its steps on its own (`step_command`, what `--plan` lists)."""

from __future__ import annotations

import os
import shlex
from pathlib import Path
from typing import Any

from experiments.study.jobs import run_study_parallel
from experiments.study.numeric_spread import run_spread
from experiments.study.runner import run_study
from experiments.study.seeds import run_seeds
from sinkstudy.io import check_replaceable
from sinkstudy.numerics import ENV

# What may lie in a study's --out before its first step is recorded: the inputs make's study targets put there (the
# linked real checkpoints, the chats), a parallel run's worker logs.
STUDY_INPUTS = ("inputs", "logs")


def check_out(study, force: bool) -> None:
    """A study writes into an empty or absent --out, one holding an earlier run of a study (its steps/ records or
    summary.json; --force runs every step again), or one holding only the inputs make put there first."""
    def not_mine(out: Path) -> str | None:
        if (out / "steps").is_dir() or (out / "summary.json").is_file():
            return None
        other = sorted(n for n in os.listdir(out) if not n.startswith(".") and n not in STUDY_INPUTS)
        return f"no steps/ nor summary.json of an earlier study, but {', '.join(other[:3])}" if other else None

    check_replaceable(study.out, force, not_mine=not_mine)


def launch(study, *, jobs: int, force: bool, progress: bool, threads: int, numerics: list[str], argv: list[str]) -> dict[str, Any]:
    """Every step of `study` (reused when finished), its summary and report: on `jobs` worker processes of `threads`
    threads each (1: in this process), over each numeric mode of `numerics` when it names several (each other mode a
    run of `argv` in its own process), else over the study's training seeds. The first run's result."""
    check_out(study, force)
    if jobs > 1:
        def run_one(s):
            return run_study_parallel(s, jobs=jobs, force=force, progress=progress, threads=threads)
    else:
        def run_one(s):
            return run_study(s, force=force, progress=progress)
    return run_spread(study, numerics, argv, run_one) if len(numerics) > 1 else run_seeds(study, run_one)


def step_command(config: str, out: str | None, plugins: list[str], overrides: dict[str, Any]) -> str:
    """`sinkstudy run CONFIG` as this run was asked for (its --out, plug-ins and overriding flags, the numeric mode in
    effect unless the default): the command each step's job runs with `--step ID`."""
    mode = os.environ.get(ENV, "reproducible")
    return ("sinkstudy run " + shlex.quote(config) + (f" --out {shlex.quote(out)}" if out else "")
            + "".join(f" --plugin {shlex.quote(x)}" for x in plugins)
            + "".join(f" --{k} {shlex.quote(str(v))}" for k, v in overrides.items() if v is not None)
            + (f" --numerics {mode}" if mode != "reproducible" else ""))  # each step job in this run's mode
