"""Runs a study along its data path: config (`experiments.study.config`) -> plan (`experiments.study.pipeline`) ->
steps (`experiments.study.engine`, reusing finished ones) -> summary.json (`experiments.study.summarise`) ->
report.md / .html / plots (`experiments.report.document`, from the summary alone).

A whole run (`run_study`) holds the output directory's lock. For a scheduler, `plan_records` lists
every step as an independent command and `run_step` runs one, once the steps it runs after have
finished (a plan takes no lock; each step holds its own record's lock, so parallel jobs of different
steps run side by side while a second job of one step fails at once).
"""

from __future__ import annotations

import contextlib
import difflib
import os
import time
from pathlib import Path
from typing import Any, Callable

from evals.protocol import check_backend
from experiments.study.summarise import summarise
from experiments.study.clock import StepClock
from experiments.study.engine import Engine
from experiments.study.pipeline import StudyPlan, plan_study
from sinkstudy import SinkstudyError
from sinkstudy.io import check_replaceable, output_lock, remove_stale_temps, write_json_atomic


def run_plan(plan, out, *, force: bool = False, progress: bool = True, guarded: tuple[str, ...] = (), config: dict | None = None,
             seed: int | None = None, say: Callable[[str], Any] = print, before: Callable[[Engine], Any] | None = None,
             on_done: Callable[[str, float, bool], Any] | None = None, not_mine: Callable[[Path], str | None] | None = None,
             share: bool = True, store_root: str | os.PathLike | None = None) -> Engine:
    """A command's plan (`experiments.study.graph.Plan`) under `out`, its lock held: every step reused when finished
    (in `out`, or with `share` in any run with the same key, `store_root` the store of them), each reuse said in one
    line; a step of a `guarded` stage in `out` made by another request is refused unless `force`. `out` may hold
    only what this plan's steps write (`not_mine(out)`: what else it holds, or None; default: their records or
    outputs). `before(engine)` runs once planned, before any step."""

    def done(step_id: str, seconds: float, reused: bool) -> None:
        if reused:
            source = engine.reused_from.get(step_id)
            say(f"reused {step_id} " + (f"(made by an earlier run: {source})" if source else "(finished before; --force runs it again)"))
        if on_done is not None:
            on_done(step_id, seconds, reused)

    engine = Engine(plan, out, config=config, seed=seed, force=force, progress=progress, guarded=guarded, on_done=done,
                    share=share, store_root=store_root)
    check_replaceable(out, force, not_mine=not_mine or (lambda where: _not_made_by(plan, where)))
    fresh = not Path(out).exists()
    with output_lock(out) if engine.main else contextlib.nullcontext():
        if engine.main:
            remove_stale_temps(out, recursive=True)  # a killed run's, even where every step is now reused
        if before is not None:
            before(engine)
        try:
            engine.run_all()
        except BaseException:
            _prune(Path(out), fresh)
            raise
    return engine


def _not_made_by(plan, out: Path) -> str | None:
    """None when `out` holds an earlier run of this plan's command: a record of one of its steps, or what one of them
    writes (a killed run's partial output, e.g. an adaptation to resume); else what is missing."""
    steps = list(plan)
    if any((out / "steps" / f"{s.id}.json").is_file() for s in steps):
        return None
    inside = [Path(o) for s in steps for o in s.outputs if out.resolve() in Path(o).resolve().parents]
    if any(o.exists() for o in inside):
        return None
    return f"no {out / 'steps' / (steps[0].id + '.json')} nor any other record of its steps"


def _prune(out: Path, fresh: bool) -> None:
    """What a failed command leaves: no empty folder of its records, no empty OUT it made (bad input writes nothing)."""
    steps = out / "steps"
    for d in sorted((p for p in steps.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True) if steps.is_dir() else []:
        if not any(d.iterdir()):
            d.rmdir()
    for d in (steps, out) if fresh else (steps,):
        if d.is_dir() and not any(d.iterdir()):
            d.rmdir()


def engine_for(study, plan: StudyPlan, **kw) -> Engine:
    """The engine that runs `plan` under the study's output dir, its records carrying the config and seed."""
    return Engine(plan.plan, study.out, config={"path": os.fspath(study.path) if study.path else None, "content": study.raw},
                  seed=study.seed, **kw)


def plan_records(study, command: str = "sinkstudy run CONFIG") -> list[dict]:
    """Every step as an independent command, in dependency order (`experiments.study.graph.Plan.records`)."""
    plan = plan_study(study)
    return plan.plan.records(engine_for(study, plan).record_path, command)


def run_step(study, step_id: str, *, force: bool = False, progress: bool = True, command: str = "sinkstudy run CONFIG") -> dict:
    """Run one step of the study (its dependencies must have finished); reuse it when finished unless `force`."""
    _check_backend(study)
    plan = plan_study(study)
    if step_id not in plan.plan:
        close = difflib.get_close_matches(step_id, plan.plan.ids, n=3, cutoff=0.5)
        raise SinkstudyError(f"study {study.name} has no step {step_id!r}" + (f"; did you mean {', '.join(close)}?" if close else "")
                             + f" (`{command} --plan` lists them)")
    return engine_for(study, plan, force=force, progress=progress).run_one(step_id, command=command)


def run_study(study, *, force: bool = False, progress: bool = True) -> dict:
    """Run every step of `study` (reusing finished ones); write the summary and report.
    With `progress`, one line per step: how many are done, the time elapsed and an estimate of the time left."""
    _check_backend(study)
    t0 = time.perf_counter()
    plan = plan_study(study)  # a plan that does not hold together fails here, before anything is written
    with output_lock(study.out):  # a second run into the same directory fails at once
        clock = StepClock(plan.plan.ids, priors=step_priors(study)) if progress else None
        res = collect_study(plan, force=force, progress=progress, clock=clock)
    return {**res, "seconds": round(time.perf_counter() - t0, 1)}


def collect_study(plan: StudyPlan, *, force: bool = False, progress: bool = True, clock: StepClock | None = None,
                  executed: list[dict] | None = None) -> dict:
    """Run every step not finished, write summary.json and the report; the caller holds the output lock.
    `executed`: the log of steps other processes ran for this run (parallel jobs), reported in place of
    this pass's reuse of them. Returns the report's paths, the step counts and the log (step, reused, seconds)."""
    # lazy: loads torch, numpy
    from experiments.report.document import write_report

    study = plan.study
    engine = engine_for(study, plan, force=force, progress=progress, on_done=clock.tick if clock is not None else None)
    results = engine.run_all()
    if executed is not None:
        engine.log = executed
    summary = summarise(plan, results, engine.timings())
    write_json_atomic(study.out / "summary.json", summary)
    report = write_report(summary, study.out)
    return {"report": str(report), "html": str(report.with_suffix(".html")), "steps": len(engine.log),
            "reused": sum(e["reused"] for e in engine.log), "stage_seconds": engine.timings(), "log": engine.log}


def step_priors(study) -> dict[str, float]:
    """Typical seconds per step of each stage for the progress estimate (a build section knows its own)."""
    return dict(study.build.stage_seconds) if study.build is not None else {}


def _check_backend(study) -> None:
    """The eval backend's package is installed (vLLM is optional): checked when steps run, not by --plan."""
    check_backend(study.evals.protocol.backend)
