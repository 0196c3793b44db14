"""A study run on two or more numeric modes (`--numerics native,native-aten-default`): the numeric spread.

The reproducible mode gives the same numbers on any x86-64 CPU; it does not say how far other kernels would
move them. The spread does, the way `--seeds` says how far the training seed does (docs/numerics.md has the
cost of each). The first mode's run is the study's own output directory, computed in this process; every
other mode's runs as a process of its own started in that mode (`sinkstudy.numerics.environment_for`), the
same command line with `--numerics MODE --out <out>/numerics/MODE`, so its results carry that mode's identity
in every key and are never taken for the first mode's. The first mode's summary.json then gains a
`numerics_spread` section holding every other mode's summary; its report gives each headline figure per mode
with the spread, and states an answer only where every mode gives the same one
(`experiments.report.across_seeds`).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Callable

from sinkstudy import SinkstudyError
from sinkstudy.io import read_json, write_json_atomic
from sinkstudy.numerics import environment_for

SECTION = "numerics_spread"


def path_dir(out: Path, paths: list[str], path: str) -> Path:
    return Path(out) if path == paths[0] else Path(out) / "numerics" / path


def check(study, paths: list[str]) -> None:
    """Refuse, in one line and before any work, what a spread cannot run."""
    if study.seeds:
        raise SinkstudyError(f"--numerics {','.join(paths)} runs the study once per numeric mode and {study.name} repeats over "
                             f"seeds {','.join(map(str, study.seeds))}: spread one of the two at a time")


def run_spread(study, paths: list[str], argv: list[str], run_one: Callable) -> dict:
    """Run `study` in this process (already in `paths[0]`'s mode), then the same command line once per other mode,
    each in a process of its own; attach their summaries to the first's and re-render its report. Returns the
    first path's result."""
    # lazy: loads torch, numpy
    from experiments.report.document import write_report

    check(study, paths)
    first = run_one(study)
    out = Path(study.out)
    others = {path: path_dir(out, paths, path) for path in paths[1:]}
    for path, sub in others.items():
        command = [sys.executable, "-m", "experiments.cli", *argv, "--numerics", path, "--out", str(sub)]
        done = subprocess.run(command, env=environment_for(path, dict(os.environ)))
        if done.returncode != 0:
            raise SinkstudyError(f"the study in the {path} numeric mode failed (exit {done.returncode}); its output is in "
                                 f"{sub}: rerun the same command (finished steps are reused)")
    summary = read_json(out / "summary.json")
    summary[SECTION] = {"paths": list(paths),
                        "note": "numeric modes: the same config, data, seeds and code computed on other kernels",
                        "runs": {p: {"out": str(sub), "summary": _lean(read_json(sub / "summary.json"))} for p, sub in others.items()}}
    write_json_atomic(out / "summary.json", summary)
    write_report(summary, out)
    return first


def _lean(summary: dict) -> dict:
    """A mode's summary without what the first mode's report never reads from it (its hardware is kept: it
    names the mode's numeric identity)."""
    return {k: v for k, v in summary.items() if k not in (SECTION, "seeds")}
