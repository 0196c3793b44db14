"""The closing summary of every `sinkstudy` command: where its outputs are, the one-line result, how
long it took and what to run next. A command returns a `Summary`; `experiments.cli.main` prints it
with the command's wall time, so every command ends the same way."""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path

from experiments.report.fmt import format_duration


@dataclass
class Summary:
    """What a command did. `result`: one line; `outputs`: the paths it wrote (files or directories);
    `next`: commands worth running next (each a shell line)."""

    command: str
    result: str
    outputs: list = field(default_factory=list)
    next: list[str] = field(default_factory=list)
    exit_code: int = 0

    def format(self, seconds: float) -> str:
        lines = [f"── sinkstudy {self.command}: {' '.join(self.result.split())}"]
        shown = [str(p) for p in self.outputs if p is not None]
        lines.append(f"   outputs:  {', '.join(shown) if shown else 'none written (printed above)'}")
        lines.append(f"   took:     {format_duration(seconds)}")
        lines += [f"   {'next:' if i == 0 else '':<9} {step}" for i, step in enumerate(self.next)]
        return "\n".join(lines)


def existing(*paths) -> list[Path]:
    """The paths that exist: a summary names only outputs that were really written."""
    return [Path(p) for p in paths if p is not None and Path(p).exists()]


def cmd(*parts) -> str:
    """A shell line from its words (paths quoted where needed), for `Summary.next`."""
    return shlex.join(str(p) for p in parts if p is not None)
