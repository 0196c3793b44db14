"""A plan as data: every step a `Step` record, held in dependency order by a `Plan`.

A step is `Step(id, args, deps, outputs)`: its arguments (`args`, a frozen `experiments.study.kinds.StepArgs`
of its kind: its identity and its body's input), the steps it runs after (besides those that make the
models and files its arguments read, added by `Plan.add`), and the files and checkpoint dirs it writes
(besides its record `steps/<id>.json`). Its body, `args.run`, is called by `experiments.study.engine`
only: making a plan runs and reads nothing.

`Plan.add` checks each step as it joins, so a plan that exists holds together: ids are unique, every
dependency is an earlier step, and no two steps claim the same output (two config names that would
share a directory fail here, before any work, naming both).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

from experiments.study.kinds import StepArgs, refs
from sinkstudy import SinkstudyError


class PlanError(SinkstudyError):
    """A plan that does not hold together (one line, naming what in the config clashes)."""


@dataclass(frozen=True)
class Step:
    id: str  # <group>/<stage>/...: the second component is its stage (timings, progress estimates)
    args: StepArgs
    deps: tuple[str, ...] = ()
    outputs: tuple[Path, ...] = ()  # re-run when one has gone (or, transient, when a reader needs it)
    owner: str = ""  # what in the config makes this step, for plan errors ("pair p intervention x")
    transient: bool = False  # outputs deleted once every step that reads them has finished (keep_models: false)

    @property
    def reads(self) -> tuple[str, ...]:
        """The models and files it reads from outside the plan (`--plan`'s inputs)."""
        return tuple(dict.fromkeys(r.path for r in refs(self.args) if r.made_by is None))

    @property
    def stage(self) -> str:
        parts = self.id.split("/")
        return parts[1] if len(parts) > 1 else parts[0]


class Plan:
    """Steps in the order they were added: a dependency order (each step's deps come before it)."""

    def __init__(self, steps: Iterable[Step] = ()):
        self.steps: dict[str, Step] = {}
        self._claims: dict[str, Step] = {}
        self.extend(steps)

    def add(self, step: Step) -> Step:
        """Add `step`, its dependencies completed by the makers of what its arguments read."""
        made = tuple(r.made_by for r in refs(step.args) if r.made_by is not None)
        step = dataclasses.replace(step, deps=tuple(dict.fromkeys((*step.deps, *made))))
        who = step.owner or step.id
        if step.id in self.steps:
            other = self.steps[step.id]
            raise PlanError(f"{who}: step {step.id} is used twice (also by {other.owner or other.id}); rename one")
        missing = [d for d in step.deps if d not in self.steps]
        if missing:
            raise PlanError(f"step {step.id} depends on steps that did not run before it: {', '.join(missing)}")
        for path in step.outputs:
            key = os.path.normpath(os.fspath(path))
            if key in self._claims:
                other = self._claims[key]
                raise PlanError(f"{who} and {other.owner or other.id} would both write {path}; rename one")
            self._claims[key] = step
        self.steps[step.id] = step
        return step

    def extend(self, steps: Iterable[Step]) -> None:
        for s in steps:
            self.add(s)

    def __iter__(self) -> Iterator[Step]:
        return iter(self.steps.values())

    def __len__(self) -> int:
        return len(self.steps)

    def __contains__(self, step_id: object) -> bool:
        return step_id in self.steps

    def __getitem__(self, step_id: str) -> Step:
        return self.steps[step_id]

    @property
    def ids(self) -> list[str]:
        return list(self.steps)

    def maker(self, path) -> str | None:
        """The step that writes `path` (or a folder holding it: a run's kept models), if one of the plan does."""
        path = Path(os.path.normpath(os.fspath(path)))
        for candidate in (path, *path.parents):
            step = self._claims.get(os.fspath(candidate))
            if step is not None:
                return step.id
        return None

    def dependents(self, step_id: str) -> list[Step]:
        return [s for s in self if step_id in s.deps]

    def levels(self) -> dict[str, int]:
        """1 + the deepest level among a step's deps: steps of one level can run at once."""
        level: dict[str, int] = {}
        for s in self:
            level[s.id] = 1 + max((level[d] for d in s.deps), default=0)
        return level

    def records(self, record_path: Callable[[str], Path], command: str) -> list[dict]:
        """Every step as an independent command: id, level, the steps it runs after, the files it writes
        (its record last), what it reads (outside models and files, then its dependencies' outputs) and
        the command that runs it."""
        level = self.levels()
        out = []
        for s in self:
            produced = [os.fspath(o) for d in s.deps for o in self.steps[d].outputs]
            out.append({"id": s.id, "level": level[s.id], "after": list(s.deps),
                        "outputs": [os.fspath(o) for o in s.outputs] + [os.fspath(record_path(s.id))],
                        "inputs": list(dict.fromkeys(r for r in [*s.reads, *produced] if r)),
                        "command": f"{command} --step {s.id}"})
        return out


def format_records(records: list[dict], name: str, command: str) -> str:
    """`--plan`'s text form of `Plan.records`."""
    lines = [f"# {name}: {len(records)} steps in {max((s['level'] for s in records), default=0)} levels. Run each step once the "
             "steps it runs after have finished (steps of one level are independent); then "
             f"`{command}` reuses them all and writes the summary and report."]
    for i, st in enumerate(records, 1):
        lines += [f"[{i}] {st['id']}  (level {st['level']})",
                  f"    run:     {st['command']}",
                  f"    after:   {', '.join(st['after']) or '-'}",
                  f"    inputs:  {', '.join(st['inputs']) or '-'}",
                  f"    outputs: {', '.join(st['outputs'])}"]
    return "\n".join(lines)
