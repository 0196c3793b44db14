"""Progress of a run, one line per finished step: `[done/total] elapsed, ~left | step time`.

The time left is an estimate: each unfinished step is expected to take the mean of the steps of
its stage (pretrain, vl, eval, ...) that ran in this run; for a stage none has run in yet, its
`priors` entry (typical seconds per step) scaled by how this run's measured steps compare with
their priors, or without one the mean over stages seen so far; all divided by the number of
parallel jobs. Reused steps count as done.
"""

from __future__ import annotations

import sys
import time
from typing import Sequence

from experiments.report.fmt import format_clock


class StepClock:
    def __init__(self, step_ids: Sequence[str], *, jobs: int = 1, priors: dict[str, float] | None = None, stream=None):
        self.left_ids = dict.fromkeys(step_ids)
        self.total, self.done, self.jobs = len(self.left_ids), 0, max(1, jobs)
        self.priors = dict(priors or {})
        self.by_stage: dict[str, list[float]] = {}
        self.stream = stream or sys.stdout
        self.t0 = time.perf_counter()

    @staticmethod
    def stage(step_id: str) -> str:
        """The step's stage; intervention steps per intervention (a merge takes a second, a VL re-training a minute)."""
        parts = step_id.split("/")
        if len(parts) > 2 and parts[1] == "intervene":
            return "/".join(parts[1:3])
        return parts[1] if len(parts) > 1 else parts[0]

    def prior(self, stage: str) -> float | None:
        return self.priors.get(stage) or self.priors.get(stage.split("/")[0])

    def estimate_left(self) -> float | None:
        means = {k: sum(v) / len(v) for k, v in self.by_stage.items()}
        if not means:
            return None
        fallback = sum(means.values()) / len(means)
        known = [(sum(v), self.prior(k) * len(v)) for k, v in self.by_stage.items() if self.prior(k)]
        speed = sum(m for m, _ in known) / sum(p for _, p in known) if known else 1.0

        def expected(stage: str) -> float:
            if stage in means:
                return means[stage]
            return self.prior(stage) * speed if self.prior(stage) else fallback

        return sum(expected(self.stage(i)) for i in self.left_ids) / self.jobs

    def tick(self, step_id: str, seconds: float, reused: bool) -> str:
        self.left_ids.pop(step_id, None)
        self.done = min(self.done + 1, self.total)
        if not reused:
            self.by_stage.setdefault(self.stage(step_id), []).append(seconds)
        left = 0.0 if not self.left_ids else self.estimate_left()
        line = (f"[{self.done:>{len(str(self.total))}}/{self.total}] {format_clock(time.perf_counter() - self.t0)} elapsed, "
                f"{'~' + format_clock(left) if left is not None else 'estimating'} left | {step_id} "
                + ("reused" if reused else f"{seconds:.1f}s"))
        print(line, file=self.stream, flush=True)
        return line
