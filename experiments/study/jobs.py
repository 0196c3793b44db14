"""Run a study's steps on several local worker processes (`sinkstudy demo`, `sinkstudy run --jobs N`).

The study's plan (`experiments.study.pipeline.plan_study`) says which steps each step runs after; each
worker runs one step at a time through `runner.run_step`, the same path as a scheduler's
`--step` jobs (each step keyed, locked and recorded on its own), so a parallel run leaves exactly
what a sequential one leaves. Steps start in plan order as soon as the steps they read have
finished. Afterwards the calling process runs the plan once more, reusing every step, and
writes the summary and report.

Workers are spawned (not forked: the parent may hold torch's thread pool) with `threads` intra-op
threads each, claimed (`sinkstudy.threads`; the parent, which only waits, claims none): the demo's tiny
models run fastest on one thread per process (measured: a 4-layer
d=128 training step 2.6x faster on 1 thread than on 2 on the shared 2-core machine), so the cores
are used by running steps side by side. Each worker's output (library warnings, progress bars)
goes to `OUT/logs/worker-<pid>.log`; the console gets one progress line per finished step.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from pathlib import Path

from evals.protocol import check_backend
from experiments.study.clock import StepClock
from experiments.study.pipeline import plan_study
from experiments.study.runner import collect_study, run_step, step_priors
from sinkstudy import SinkstudyError, threads as compute
from sinkstudy.io import output_lock
from sinkstudy.numerics import configure_torch


def default_jobs(limit: int = 4) -> int:
    """One worker per available core, at most `limit` (each holds a model and lm-eval in memory)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(limit, cores))


def _init_worker(log_dir: str, threads: int) -> None:
    configure_torch()  # the parent's numeric mode (its environment is inherited; torch's part is per process)
    compute.apply(threads)  # and claimed: a command started beside the study takes the cores left
    log = open(Path(log_dir) / f"worker-{os.getpid()}.log", "a", buffering=1, encoding="utf-8")
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)


def _run_one(study, step_id: str, force: bool) -> dict:
    done = run_step(study, step_id, force=force, progress=False)
    return {"step": step_id, "reused": done["reused"], "seconds": done["seconds"]}


def execute_plan(plan, *, jobs: int, force: bool = False, progress: bool = True, threads: int = 1) -> list[dict]:
    """Run every step of `plan` (an `experiments.study.pipeline.StudyPlan`) on `jobs` worker processes; returns the
    log of steps (step, reused, seconds). The caller holds the study's output lock."""
    study = plan.study
    order = plan.plan.ids
    waiting = {s.id: set(s.deps) for s in plan.plan}
    clock = StepClock(order, jobs=jobs, priors=step_priors(study)) if progress else None
    log_dir = Path(study.out) / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    log: list[dict] = []
    running: dict = {}
    compute.claim(0)  # this process only waits while its workers compute
    pool = ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn"), initializer=_init_worker,
                               initargs=(str(log_dir), threads))
    try:
        while waiting or running:
            for step_id in [i for i in order if i in waiting and not waiting[i]][: jobs - len(running)]:
                del waiting[step_id]
                with compute.for_children(threads):  # a worker starts on its first submit and loads its libraries then
                    running[pool.submit(_run_one, study, step_id, force)] = step_id
            if not running:
                raise SinkstudyError(f"steps wait on steps that are not in the plan: {', '.join(sorted(waiting))}")
            finished, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in finished:
                step_id = running.pop(future)
                try:
                    entry = future.result()
                except SinkstudyError as exc:  # one line, naming the step (a worker's traceback is in its log)
                    raise SinkstudyError(f"step {step_id}: {exc}") from None
                except Exception as exc:
                    raise RuntimeError(f"step {step_id} failed in a worker ({type(exc).__name__}: {exc}); "
                                       f"its output is in {log_dir}") from exc
                log.append(entry)
                if clock is not None:
                    clock.tick(step_id, entry["seconds"], entry["reused"])
                for after in waiting.values():
                    after.discard(step_id)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    return log


def run_study_parallel(study, *, jobs: int, force: bool = False, progress: bool = True, threads: int = 1) -> dict:
    """`experiments.study.runner.run_study` with the steps run on `jobs` worker processes."""
    check_backend(study.evals.protocol.backend)
    t0 = time.perf_counter()
    plan = plan_study(study)  # a plan that does not hold together fails here, before anything is written
    with output_lock(study.out):
        executed = execute_plan(plan, jobs=jobs, force=force, progress=progress, threads=threads)
        res = collect_study(plan, progress=False, executed=executed)
    return {**res, "seconds": round(time.perf_counter() - t0, 1)}
