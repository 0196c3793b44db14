"""Resumable study runner.

Every step writes `<out>/steps/<step id>.json` atomically: its result, a key and provenance. The
key is a hash of the step's settings and the keys of the steps it reads from, so a rerun reuses a
step whose settings and inputs are unchanged and re-runs (overwriting its outputs) one whose
config changed, and everything downstream of it. An interrupted run continues at the first
unfinished step. Settings include what the step reads, by content: the fingerprints of its input
models (`sinkstudy.provenance.model_fingerprint`: weights, config, tokenizer, chat template...),
data files by hash, and the version of the code that computes it (sink code, eval code, pair
loader, intervention code or plug-in source).

A whole run holds the output directory's lock. `plan_study` lists every step as an independent
command (`run_step`: one step, once its dependencies finished) for a scheduler; a plan takes no
lock, and each step holds its own (`steps/<id>.json`'s) from the reuse check to its record, so
parallel jobs of different steps run side by side while a second job of one step fails at once.

Per pair: extract the VLM's language model -> Sink maps + Strength of base, VLM LM and every
intervened model -> strict evals through lm-eval of each -> interventions (mergekit / TSV / STAR
merges and registered mitigations through `interventions.registry.apply_intervention`; QK-norm
injection, optionally followed by the demo's VL recipe) -> summary statistics -> report.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import logging
import os
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from sinkstudy import SinkstudyError
from sinkstudy.io import output_lock, read_json, remove_tree, write_json_atomic
from sinkstudy.provenance import code_version, model_fingerprint

log = logging.getLogger(__name__)
STEP_FORMAT = "sinkstudy.step/1"


class Runner:
    """Runs keyed steps, reusing finished ones; records timing and what was reused."""

    executes = True  # False: a plan or a single step, which must not delete what other steps made

    def __init__(self, study, *, force: bool = False, progress: bool = True, clock: "StepClock | None" = None):
        self.study = study
        self.out = Path(study.out)
        self.force = force
        self.progress = progress
        self.clock = clock
        self.keys: dict[str, str] = {}
        self.log: list[dict[str, Any]] = []

    def key(self, spec: dict, deps: Sequence[str]) -> str:
        missing = [d for d in deps if d not in self.keys]
        if missing:
            raise SinkstudyError(f"step depends on steps that did not run: {', '.join(missing)}")
        blob = json.dumps({"spec": spec, "deps": {d: self.keys[d] for d in deps}}, sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:24]

    def path(self, step_id: str) -> Path:
        return self.out / "steps" / f"{step_id}.json"

    def finished(self, step_id: str, spec: dict, deps: Sequence[str] = ()) -> bool:
        """Whether `run` would reuse this step (its JSON holds the same key)."""
        f = self.path(step_id)
        if self.force or not f.is_file():
            return False
        try:
            return json.loads(f.read_text(encoding="utf-8")).get("key") == self.key(spec, deps)
        except ValueError:
            return False

    def fingerprint(self, path, recorded) -> str:
        """The fingerprint of a model a step made, for the keys of the steps that read it: read from
        disk in a whole run (an edited checkpoint is measured again), the producing step's record
        in a plan or a single step (the checkpoint may not exist yet)."""
        return model_fingerprint(path) if self.executes else recorded

    def run(self, step_id: str, spec: dict, fn: Callable[[], dict], deps: Sequence[str] = (), outputs: Path | None = None) -> dict:
        """Reuse the finished step with this key, or run `fn` and record it. A step whose `outputs`
        (a checkpoint dir or file it writes) has gone is run again. The step's own lock is held from
        the reuse check to its record, so a `--step` job running it elsewhere fails this at once."""
        key = self.key(spec, deps)
        self.keys[step_id] = key
        with output_lock(self.path(step_id)):
            done = None if self.force else self.stored(step_id, key, outputs)
            if done is not None:
                self.log.append({"step": step_id, "reused": True, "seconds": 0.0})
            else:
                done = self.execute(step_id, spec, fn, deps, key)
        if self.clock is not None:
            self.clock.tick(step_id, self.log[-1]["seconds"], self.log[-1]["reused"])
        return done

    def stored(self, step_id: str, key: str, outputs: Path | None = None) -> dict | None:
        """The recorded result of a finished step with this key whose outputs still exist, else None."""
        f = self.path(step_id)
        if not f.is_file() or (outputs is not None and not Path(outputs).exists()):
            return None
        try:
            done = json.loads(f.read_text(encoding="utf-8"))
        except ValueError:
            return None
        return done["result"] if done.get("key") == key else None

    def execute(self, step_id: str, spec: dict, fn: Callable[[], dict], deps: Sequence[str], key: str) -> dict:
        from sinkstudy.provenance import provenance

        log.info("step %s", step_id)
        t0 = time.perf_counter()
        result = fn()
        seconds = time.perf_counter() - t0
        prov = provenance(
            config={"path": os.fspath(self.study.path) if self.study.path else None, "content": self.study.raw},
            seeds={"study": self.study.seed, **({"step": spec["seed"]} if isinstance(spec.get("seed"), int) else {})},
            model_fingerprints=result.get("fingerprints") or ({result["path"]: result["fingerprint"]} if "fingerprint" in result else {}),
            step=step_id,
        )
        write_json_atomic(self.path(step_id), {"format": STEP_FORMAT, "step": step_id, "key": key, "spec": spec, "deps": list(deps),
                                               "seconds": round(seconds, 2), "result": result, "provenance": prov})
        self.log.append({"step": step_id, "reused": False, "seconds": round(seconds, 2)})
        return result

    def force_step(self, step_id: str, spec: dict, fn: Callable[[], dict], deps: Sequence[str] = ()) -> dict:
        self.path(step_id).unlink(missing_ok=True)
        self.log = [e for e in self.log if e["step"] != step_id]
        return self.run(step_id, spec, fn, deps)

    def timings(self) -> dict[str, float]:
        """Seconds per stage (the second component of the step id), this run only."""
        out: dict[str, float] = {}
        for e in self.log:
            stage = e["step"].split("/")[1]  # build/<stage>/... or <pair>/<stage>/...
            out[stage] = round(out.get(stage, 0.0) + e["seconds"], 2)
        return out


# --------------------------------------------------------------------------- plan and single steps

class _Pending(dict):
    """The result of a step that has not run here (a plan; a step outside `--step`'s target): any
    field read from it is another pending value that names where it would come from."""

    def __init__(self, origin: str):
        super().__init__()
        self.origin = origin

    def __getitem__(self, key):
        return _Pending(f"{self.origin}:{key}")

    def get(self, key, default=None):
        return self[key]

    def __str__(self) -> str:
        return f"<result of {self.origin}>"

    __repr__ = __str__


class PlanRunner(Runner):
    """Walks the study's steps without running any: records each step, its dependencies and outputs."""

    executes = False

    def __init__(self, study):
        super().__init__(study, progress=False)
        self.steps: dict[str, dict] = {}

    def run(self, step_id, spec, fn, deps=(), outputs=None):
        self.keys[step_id] = self.key(spec, deps)
        if step_id not in self.steps:
            level = 1 + max((self.steps[d]["level"] for d in deps if d in self.steps), default=0)
            self.steps[step_id] = {"id": step_id, "level": level, "after": list(deps), "spec": spec,
                                   "outputs": [os.fspath(o) for o in ([outputs] if outputs is not None else [])]
                                   + [os.fspath(self.path(step_id))]}
        return _Pending(step_id)

    def force_step(self, step_id, spec, fn, deps=()):
        return self.run(step_id, spec, fn, deps)

    def finished(self, step_id, spec, deps=()):
        return False


class _StepDone(Exception):
    def __init__(self, result: dict, reused: bool):
        self.result, self.reused = result, reused


class StepRunner(Runner):
    """Runs exactly one step (`target`): the steps before it are reused when finished and left
    pending otherwise; the target refuses to run while a step it depends on is pending."""

    executes = False

    def __init__(self, study, target: str, *, force: bool = False, progress: bool = True, command: str = "sinkstudy run CONFIG"):
        super().__init__(study, progress=progress)
        self.target, self.force_target, self.command = target, force, command
        self.pending: set[str] = set()

    def run(self, step_id, spec, fn, deps=(), outputs=None):
        key = self.key(spec, deps)
        self.keys[step_id] = key
        if step_id != self.target:
            done = self.stored(step_id, key, outputs)
            if done is None:
                self.pending.add(step_id)
                return _Pending(step_id)
            return done
        waiting = [d for d in deps if d in self.pending]
        if waiting:
            raise SinkstudyError(f"step {step_id} depends on {', '.join(waiting)}, not finished: run "
                                 + " then ".join(f"`{self.command} --step {d}`" for d in waiting) + " first")
        with output_lock(self.path(step_id)):  # parallel jobs of other steps run; a second job of this one fails at once
            done = None if self.force_target else self.stored(step_id, key, outputs)
            if done is not None:
                raise _StepDone(done, reused=True)
            raise _StepDone(self.execute(step_id, spec, fn, deps, key), reused=False)

    def force_step(self, step_id, spec, fn, deps=()):
        # An intervention deleted after measuring (keep_models: false) is made again only as a target.
        if step_id == self.target:
            return self.run(step_id, spec, fn, deps)
        self.pending.add(step_id)
        return _Pending(step_id)


def _walk(runner: Runner, study) -> dict[str, dict]:
    """Every step of the study through `runner`, in dependency order; {pair: run_pair's results}."""
    built: dict[str, str] = {}
    if study.build:
        from experiments.demo.build import run_build

        built = run_build(runner, study.build)
    out = {}
    for pair in study.pairs:
        deps = [built[pair["name"]]] if pair["name"] in built else []
        if study.adapt is None:
            out[pair["name"]] = run_pair(runner, study, pair, deps)
            continue
        from experiments.protection import measure_arms, run_arms

        made = run_arms(runner, study, pair, deps)  # the control arm makes the pair's VLM
        results = run_pair(runner, study, pair, deps, vlm_deps=[f"{pair['name']}/adapt/control"])
        arms = measure_arms(runner, study, pair, made, measure)
        results["vlm"]["control_arm"] = arms.pop("vlm")
        out[pair["name"]] = {**results, **arms}
    return out


def plan_study(study, command: str = "sinkstudy run CONFIG") -> list[dict]:
    """Every step as an independent command, in dependency order: id, the command that runs it, the
    steps it runs after, its level (1 + the deepest of those: steps of one level can run at once),
    the models and data it reads and the files it writes (its record under steps/ included)."""
    runner = PlanRunner(study)
    _walk(runner, study)
    pairs = {p["name"]: p for p in study.pairs}
    steps = list(runner.steps.values())
    for st in steps:
        spec = st.pop("spec")
        refs = [spec.get(k) for k in ("base", "vlm", "root", "path")] + [(spec.get("params") or {}).get("root")]
        pair, _, rest = st["id"].partition("/")
        if rest.startswith("intervene/") and pair in pairs:  # an intervention reads the pair's base besides its VLM LM
            refs.insert(0, pairs[pair]["base"])
        produced = [o for d in st["after"] for o in runner.steps[d]["outputs"][:-1]]  # [-1]: the dep's record
        st["inputs"] = list(dict.fromkeys(r for r in refs + produced if isinstance(r, str) and r))
        st["command"] = f"{command} --step {st['id']}"
    return steps


def format_steps(steps: list[dict], study, command: str) -> str:
    lines = [f"# {study.name}: {len(steps)} steps in {max((s['level'] for s in steps), default=0)} levels. Run each step once the "
             "steps it runs after have finished (steps of one level are independent); then "
             f"`{command}` reuses them all and writes the summary and report."]
    for i, st in enumerate(steps, 1):
        lines += [f"[{i}] {st['id']}  (level {st['level']})",
                  f"    run:     {st['command']}",
                  f"    after:   {', '.join(st['after']) or '-'}",
                  f"    inputs:  {', '.join(st['inputs']) or '-'}",
                  f"    outputs: {', '.join(st['outputs'])}"]
    return "\n".join(lines)


def run_step(study, step_id: str, *, force: bool = False, progress: bool = True, command: str = "sinkstudy run CONFIG") -> dict:
    """Run one step of the study (its dependencies must have finished); reuse it when finished unless `force`."""
    import difflib

    _check_backend(study)
    runner = StepRunner(study, step_id, force=force, progress=progress, command=command)
    t0 = time.perf_counter()
    try:
        _walk(runner, study)
    except _StepDone as done:
        return {"step": step_id, "reused": done.reused, "seconds": round(time.perf_counter() - t0, 1), "result": done.result}
    known = list(runner.keys)
    close = difflib.get_close_matches(step_id, known, n=3, cutoff=0.5)
    raise SinkstudyError(f"study {study.name} has no step {step_id!r}" + (f"; did you mean {', '.join(close)}?" if close else "")
                         + f" (`{command} --plan` lists them)")


# --------------------------------------------------------------------------- the study

def run_study(study, *, force: bool = False, progress: bool = True) -> dict:
    """Run every step of `study` (reusing finished ones); write the report; return a summary.
    With `progress`, one line per step: how many are done, the time elapsed and an estimate of the time left."""
    _check_backend(study)
    t0 = time.perf_counter()
    with output_lock(study.out):  # a second run into the same directory fails at once
        clock = StepClock([s["id"] for s in plan_study(study)], priors=step_priors(study)) if progress else None
        res = collect_study(study, force=force, progress=progress, clock=clock)
    return {**res, "seconds": round(time.perf_counter() - t0, 1)}


def collect_study(study, *, force: bool = False, progress: bool = True, clock: "StepClock | None" = None,
                  executed: list[dict] | None = None) -> dict:
    """Walk every step (running what is not finished), write the summary and report; the caller
    holds the output lock. `executed`: the log of steps another process ran for this run (parallel
    jobs), reported in place of this walk's reuse of them."""
    from experiments.report import write_report

    runner = Runner(study, force=force, progress=progress, clock=clock)
    pairs = _walk(runner, study)
    if executed is not None:
        runner.log = executed
    summary = summarise(study, pairs, runner)
    write_json_atomic(study.out / "summary.json", summary)
    report = write_report(study, summary)
    reused = sum(e["reused"] for e in runner.log)
    return {"report": str(report), "html": str(report.with_suffix(".html")), "steps": len(runner.log), "reused": reused,
            "stage_seconds": runner.timings()}


class StepClock:
    """Progress of a run, one line per finished step: `[done/total] elapsed, ~left | step time`.

    The time left is an estimate: each unfinished step is expected to take the mean of the steps of
    its stage (pretrain, vl, eval, ...) that ran in this run; for a stage none has run in yet, its
    `priors` entry (typical seconds per step) scaled by how this run's measured steps compare with
    their priors, or without one the mean over stages seen so far; all divided by the number of
    parallel jobs. Reused steps count as done."""

    def __init__(self, step_ids: Sequence[str], *, jobs: int = 1, priors: dict[str, float] | None = None, stream=None):
        import sys

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
        line = (f"[{self.done:>{len(str(self.total))}}/{self.total}] {_clock(time.perf_counter() - self.t0)} elapsed, "
                f"{'~' + _clock(left) if left is not None else 'estimating'} left | {step_id} "
                + ("reused" if reused else f"{seconds:.1f}s"))
        print(line, file=self.stream, flush=True)
        return line


def step_priors(study) -> dict[str, float]:
    """Typical seconds per step of each stage for the progress estimate (the demo's build knows its own)."""
    if study.build is None:
        return {}
    from experiments.demo.build import STAGE_SECONDS

    return STAGE_SECONDS


def _clock(seconds: float) -> str:
    m, s = divmod(int(round(seconds)), 60)
    return f"{m}:{s:02d}"


def _check_backend(study) -> None:
    """The eval backend's package is installed (vLLM is optional): checked when steps run, not by --plan."""
    from evals.protocol import check_backend

    check_backend(study.evals["backend"])


_HERE = Path(__file__).resolve().parent.parent


def sink_code_version() -> str:
    """The sink measurement code (evals/sink): part of every sink result's key."""
    return code_version(_HERE / "evals" / "sink")


def _dtype(study):
    import torch

    return getattr(torch, study.model["dtype"])


def run_pair(runner: Runner, study, pair: dict, deps: list[str], vlm_deps: Sequence[str] = ()) -> dict:
    """Every step of one pair; returns {model label: {"path", "sink", "eval", ...}}. `vlm_deps`: steps
    that make the pair's VLM (a study's control adaptation), read by the extraction only."""
    from experiments.study import model_dir
    from interventions.registry import intervention_request, takes_root

    p = pair["name"]
    lm_dir = model_dir(runner.out, p, "vlm", "lm")
    model_spec = {"base": pair["base"], "vlm": pair["vlm"], "dtype": study.model["dtype"],
                  "models": {"base": pair_fingerprint(pair, pair["base"]), "vlm": pair_fingerprint(pair, pair["vlm"])},
                  "code": code_version(_HERE / "interventions" / "pairs")}
    extracted = runner.run(f"{p}/extract", model_spec, lambda: extract_step(pair, lm_dir, study, runner.progress),
                           deps=[*deps, *vlm_deps], outputs=lm_dir)
    results: dict[str, dict] = {
        "base": measure(runner, study, pair, "base", pair["base"], deps=deps[:1], fingerprint=pair_fingerprint(pair, pair["base"])),
        "vlm": measure(runner, study, pair, "vlm", str(lm_dir), deps=[f"{p}/extract"],
                       fingerprint=runner.fingerprint(lm_dir, extracted["fingerprints"][str(lm_dir)])),
    }

    for iv in study.interventions:
        name = iv["name"]
        if iv["method"] == "qknorm":
            results.update(qknorm_arm(runner, study, pair, iv, deps))
            continue
        params = dict(iv["params"])
        iv_deps = [f"{p}/extract"] + deps
        if pair.get("root") and takes_root(iv["method"]):
            params.setdefault("root", pair["root"])  # task vectors from the common pretrained ancestor
        if _needs_sink_maps(iv["method"]):
            params["sink_maps"] = {"base": results["base"]["sink"]["maps"], "vlm": results["vlm"]["sink"]["maps"]}
            iv_deps += [f"{p}/sink/base", f"{p}/sink/vlm"]
        out_dir = model_dir(runner.out, p, name)
        # Input fingerprints, full settings, seed and the intervention's code (a plug-in's source).
        pins = {r: rev for r, rev in pair["revision"].items() if r != "vlm"}  # the request's vlm is the extracted LM
        spec = intervention_request(iv["method"], pair["base"], lm_dir, params, study.seed, revisions=pins)
        step = f"{p}/intervene/{name}"
        make = lambda iv=iv, params=params, out_dir=out_dir: intervene_step(study, pair, iv, params, lm_dir, out_dir, runner.progress)  # noqa: E731
        made = runner.run(step, spec, make, deps=iv_deps, outputs=out_dir if study.keep_models else None)
        if not out_dir.exists() and not _measured(runner, study, pair, name, str(out_dir), step, made["fingerprint"]):
            made = runner.force_step(step, spec, make, deps=iv_deps)  # deleted after an earlier run (keep_models: false)
        results[name] = measure(runner, study, pair, name, str(out_dir), deps=[step], fingerprint=made["fingerprint"])
        results[name]["method"] = iv["method"]
        if not study.keep_models and runner.executes and out_dir.exists():
            remove_tree(out_dir, within=runner.out)
    return results


def _needs_sink_maps(method: str) -> bool:
    from interventions.mitigations import list_mitigations

    m = list_mitigations().get(method)
    return bool(m and m.needs_sink_maps)


def _measured(runner: Runner, study, pair: dict, label: str, path: str, dep: str, fingerprint: str) -> bool:
    p = pair["name"]
    return (runner.finished(f"{p}/sink/{label}", _sink_spec(study, path, fingerprint), [dep])
            and runner.finished(f"{p}/eval/{label}", _eval_step_spec(study, path, fingerprint), [dep]))


def measure(runner: Runner, study, pair: dict, label: str, path: str, deps: list[str], fingerprint: str | None = None) -> dict:
    """Sink and eval steps of one model, keyed on its fingerprint (`fingerprint`: the one its
    producing step recorded, where the checkpoint may be gone or not made yet)."""
    p = pair["name"]
    fingerprint = model_fingerprint(path) if fingerprint is None else fingerprint  # a pending one is an empty dict
    sink = runner.run(f"{p}/sink/{label}", _sink_spec(study, path, fingerprint),
                      lambda: sink_step(study, pair, label, path, runner.progress), deps=deps, outputs=_sink_file(study, p, label))
    ev = runner.run(f"{p}/eval/{label}", _eval_step_spec(study, path, fingerprint),
                    lambda: eval_step(study, pair, label, path, runner.progress), deps=deps, outputs=_eval_dir(study, p, label))
    return {"path": path, "sink": sink, "eval": ev}


def _sink_spec(study, path: str, fingerprint: str) -> dict:
    return {"sink": study.sink, "path": path, "model": fingerprint, "dtype": study.model["dtype"], "code": sink_code_version()}


def _eval_step_spec(study, path: str, fingerprint: str) -> dict:
    from evals.lmeval import eval_code_version

    return {"evals": _eval_spec(study), "path": path, "model": fingerprint, "code": eval_code_version()}


def _eval_spec(study) -> dict:
    spec = {k: v for k, v in study.evals.items() if k not in ("n_boot", "confidence")}
    spec["data_files"] = {t: _file_digest(f) for t, f in spec["data_files"].items()}
    return {**spec, "seed": study.seed, "device": study.model["device"], "dtype": study.model["dtype"]}


def _file_digest(path: str) -> str:
    from sinkstudy.provenance import file_digest

    return file_digest(path) if Path(path).is_file() else f"missing:{path}"


# --------------------------------------------------------------------------- a pair's models

def _pinned(pair: dict, path) -> str | None:
    """The revision the study pins `path` to (`base_revision`..., for the pair's hub ids), else None."""
    return next((rev for role, rev in pair["revision"].items() if pair.get(role) == path), None)


def pair_fingerprint(pair: dict, path) -> str:
    """A model's identity in `pair`'s steps: content for a local path, `hub:<id>@<revision>` for a hub id
    the study pins, `hub:<id>` otherwise."""
    return model_fingerprint(path, revision=_pinned(pair, path))


def loadable(pair: dict, path) -> str:
    """What loaders read for `path`: itself, or for a pinned hub id its snapshot at that revision (fetched
    once, when a step body needs it; never by a plan)."""
    from sinkstudy.checkpoint import local_checkpoint

    revision = _pinned(pair, path)
    return path if revision is None else os.fspath(local_checkpoint(path, revision))


# --------------------------------------------------------------------------- step bodies

def extract_step(pair: dict, lm_dir: Path, study, progress: bool = False) -> dict:
    """The VLM's language model in the base's class and vocabulary, streamed disk to disk in the study's
    dtype: about one shard in memory; the vision tower is never read or built."""
    from interventions.pairs import plan_extraction, resolve, write_language_model
    from sinkstudy.checkpoint import try_load_tokenizer

    base = resolve(loadable(pair, pair["base"]))
    if base.kind != "causal_lm":
        raise SinkstudyError(f"pair {pair['name']}: the base must be a causal LM, got a {base.config.model_type} VLM: {base.id}")
    plan = plan_extraction(loadable(pair, pair["vlm"]), base)  # every check before any weight is read
    report = plan.report.to_dict()
    write_language_model(plan, lm_dir, tokenizer=try_load_tokenizer(base.tokenizer_path), dtype=_dtype(study), force=True,
                         extra={"extraction": report, "vlm": pair["vlm"]}, progress=progress)
    fps = {pair["base"]: pair_fingerprint(pair, pair["base"]), pair["vlm"]: pair_fingerprint(pair, pair["vlm"]),
           str(lm_dir): model_fingerprint(lm_dir)}
    return {"path": str(lm_dir), "report": report, "fingerprints": fps}


def _load(path: str, study):
    from interventions.pairs import load_causal_lm

    return load_causal_lm(path, dtype=_dtype(study), device=study.model["device"] or "cpu")


def sink_step(study, pair: dict, label: str, path: str, progress: bool) -> dict:
    from evals.sink import compute_sink_maps, strength_from_maps

    model, tok = _load(loadable(pair, path), study)
    if tok is None:
        tok = _load_tokenizer(loadable(pair, pair["base"]))
    maps = compute_sink_maps(model, tok, study.sink["texts"], metric=study.sink["metric"], progress=progress, **study.sink["options"])
    strength = strength_from_maps(maps, study.sink["metric"], **study.sink["params"])
    maps_file = _sink_file(study, pair["name"], label)
    write_json_atomic(maps_file, maps.to_json())
    details = {k: v for k, v in strength.details.items() if k != "median_per_layer"}
    return {"value": strength.value, "metric": strength.metric, "details": details,
            "median_per_layer": strength.details.get("median_per_layer"), "mean_mass": float(maps.mass.mean()),
            "maps": str(maps_file), "path": path, "fingerprint": pair_fingerprint(pair, path)}


def _load_tokenizer(path: str):
    from interventions.pairs import load_tokenizer

    return load_tokenizer(path)


def _sink_file(study, pair: str, label: str) -> Path:
    return study.out / "sink" / pair / f"{label}.json"


def _eval_dir(study, pair: str, label: str) -> Path:
    return study.out / "evals" / pair / label


def eval_step(study, pair: dict, label: str, path: str, progress: bool) -> dict:
    from evals.lmeval import run_eval
    from experiments.loaders import load_model

    ev = study.evals
    out_dir = _eval_dir(study, pair["name"], label)
    # Every model is prompted through the base's tokenizer and chat template, so runs pair on doc_id.
    # The path is loaded (in the study's dtype) only when something is left to evaluate.
    protocol = {k: ev[k] for k in ("limit", "batch_size", "apply_chat_template", "chat_template_kwargs", "system_instruction",
                                   "max_gen_toks", "gen_kwargs", "num_fewshot", "confirm_run_unsafe_code", "backend",
                                   "backend_args")}
    run = run_eval(loadable(pair, path), _load_tokenizer(loadable(pair, pair["base"])), tasks=ev["tasks"],
                   data_files=ev["data_files"] or None, out_dir=out_dir, force=True, device=study.model["device"],
                   dtype=study.model["dtype"], seed=study.seed, progress=progress, loader=load_model, **protocol)
    return {"dir": str(out_dir), "scores": run.scores, "path": path, "fingerprint": run.fingerprint}


def intervene_step(study, pair: dict, iv: dict, params: dict, lm_dir: Path, out_dir: Path, progress: bool) -> dict:
    from interventions.registry import apply_intervention

    params = {**params, **({"root": loadable(pair, params["root"])} if params.get("root") else {})}
    out = apply_intervention(iv["method"], loadable(pair, pair["base"]), lm_dir, params, out_dir, seed=study.seed, force=True,
                             progress=progress)
    info = read_json(Path(out) / "intervention.json") if (Path(out) / "intervention.json").is_file() else {}
    return {"path": str(out), "fingerprint": model_fingerprint(out), "info": {k: v for k, v in info.items() if k != "provenance"}}


# --------------------------------------------------------------------------- QK-norm arm

def _native_qk(pair: dict) -> bool:
    if "native_qk_norm" in pair:
        return bool(pair["native_qk_norm"])
    from interventions.pairs.resolve import load_config

    cfg = load_config(pair["base"], revision=_pinned(pair, pair["base"]))
    return getattr(cfg, "model_type", "") in ("qwen3", "gemma3_text", "olmo2", "olmo3")


def qknorm_arm(runner: Runner, study, pair: dict, iv: dict, deps: list[str]) -> dict:
    """Inject QK-RMSNorm into the base (pairs without native QK-norm); measure the injected base and,
    with `vl: true` (the demo), re-run the same VL recipe (the adaptation engine) on it and measure
    that VLM's LM, extracted by the engine (which re-attaches norms carried as hooks)."""
    from experiments.study import model_dir

    p, name = pair["name"], iv["name"]
    if _native_qk(pair):
        return {}
    params = {"init": "scale-preserving", "train_steps": 0, "trainable": "all", "lr": 1e-3, "vl": False, **iv["params"]}
    base_out = model_dir(runner.out, p, name, "base")
    spec = {"qknorm": params, "seed": study.seed, "base": pair_fingerprint(pair, pair["base"]),
            "code": code_version(_HERE / "interventions" / "qknorm.py", _HERE / "interventions" / "training.py",
                                 _HERE / "interventions" / "adapt")}
    made = runner.run(f"{p}/intervene/{name}", spec,
                      lambda: qknorm_step(study, pair, params, base_out, runner.progress), deps=deps, outputs=base_out)
    out = {name: {**measure(runner, study, pair, name, str(base_out), deps=[f"{p}/intervene/{name}"],
                            fingerprint=runner.fingerprint(base_out, made["fingerprint"])), "method": "qknorm"}}
    if params["vl"]:
        from experiments.demo.build import vl_step

        vlm_out, lm_out = model_dir(runner.out, p, name, "vlm"), model_dir(runner.out, p, name, "vlm", "lm")
        runner.run(f"{p}/intervene/{name}-vl", {"vl": study.build["vl"], "code": code_version(_HERE / "experiments" / "demo" / "vl.py",
                                                                                             _HERE / "interventions" / "adapt")},
                   lambda: vl_step(base_out, vlm_out, study.build["vl"], runner.progress, data=runner.out / "data"),
                   deps=[f"{p}/intervene/{name}"],
                   outputs=vlm_out)
        def extract() -> dict:
            from interventions.adapt.build import save_extracted_lm
            from sinkstudy.provenance import model_fingerprint

            save_extracted_lm(vlm_out, str(base_out), lm_out, force=True)
            return {"path": str(lm_out), "fingerprint": model_fingerprint(lm_out)}

        extracted = runner.run(f"{p}/intervene/{name}-vl-extract", {}, extract, deps=[f"{p}/intervene/{name}-vl"], outputs=lm_out)
        out[f"{name}-vl"] = {**measure(runner, study, pair, f"{name}-vl", str(lm_out), deps=[f"{p}/intervene/{name}-vl-extract"],
                                       fingerprint=runner.fingerprint(lm_out, extracted["fingerprint"])),
                             "method": "qknorm+vl"}
    return out


def qknorm_step(study, pair: dict, params: dict, out_dir: Path, progress: bool) -> dict:
    from interventions.qknorm import init_report, inject_qk_norm, save_injected, trainable_filter

    model, tok = _load(loadable(pair, pair["base"]), study)
    tok = tok or _load_tokenizer(loadable(pair, pair["base"]))
    texts = _calibration_texts(study)
    injected = inject_qk_norm(copy.deepcopy(model), init=params["init"], calibration_texts=texts, tokenizer=tok,
                              **({"alpha": params["alpha"]} if "alpha" in params else {}))
    report = {"init": init_report(model, injected, tok, texts, progress=progress)}
    if params["train_steps"]:
        from interventions.training import train_causal_lm

        train = _recovery_texts(study, tok)
        stats = train_causal_lm(injected, tok, train, steps=params["train_steps"], lr=params["lr"],
                                trainable=trainable_filter(params["trainable"]), seed=study.seed, progress=progress,
                                desc=f"qknorm recovery {pair['name']}")
        stats.pop("losses", None)
        report["training"] = stats
        report["after_training"] = init_report(model, injected, tok, texts, progress=progress)
    save_injected(injected, out_dir, tokenizer=tok, metadata={"params": params}, force=True)
    return {"path": str(out_dir), "fingerprint": model_fingerprint(out_dir), "report": report}


def _calibration_texts(study) -> list[str]:
    from evals.sink.calibration import resolve_texts
    from evals.sink.metrics import get_metric

    return [t.text for t in resolve_texts(study.sink["texts"], get_metric(study.sink["metric"]).calibration)[0]]


def _recovery_texts(study, tok) -> list[str]:
    if study.build is None:
        raise SinkstudyError("qknorm train_steps needs training text: only the demo (build section) has a corpus")
    from experiments.demo.build import training_texts

    return training_texts(study.out / "data", tok)


# --------------------------------------------------------------------------- statistics

def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def _examples(base, vlm, task: str, metric: str | None, n: int = 2, width: int = 240) -> list[dict]:
    """Up to `n` prompts the base passes and the VLM LM fails (else the first ones), outputs cut to `width`,
    with the task's target, each model's extracted answer and, for instruction-level metrics, each
    instruction's verdict (what the grader decided on)."""
    if metric is None:
        return []
    try:
        b, v = base.docs(task), vlm.docs(task)
    except SinkstudyError:  # a run without samples
        return []
    ids = [d for d in b if d in v]
    lost = [d for d in ids if b[d]["metrics"].get(metric) and not v[d]["metrics"].get(metric)]
    cut = lambda t: t if len(t) <= width else t[:width] + "..."  # noqa: E731
    flt = metric.split(",", 1)[1] if "," in metric else None
    inst = metric.replace("prompt_level", "inst_level")

    def graded(s):
        per_instruction = s["metrics"].get(inst) if inst != metric else None
        return {"extracted": (s.get("extracted") or {}).get(flt), "instructions": per_instruction}

    return [{"doc_id": d, "prompt": cut(b[d]["prompt"]), "base": cut(b[d]["output"]), "vlm": cut(v[d]["output"]),
             "base_pass": b[d]["metrics"].get(metric), "vlm_pass": v[d]["metrics"].get(metric), "target": b[d].get("target"),
             "base_graded": graded(b[d]), "vlm_graded": graded(v[d])} for d in (lost or ids)[:n]]


def summarise(study, pairs: dict[str, dict], runner: Runner) -> dict:
    """Paired change base -> VLM LM with CIs (Δ = after − before in points, and Δ / before),
    recovery per intervention, Sink Strength vs both across pairs, and the published figures beside ours."""
    from evals.lmeval import HEADLINE_METRICS, EvalRun
    from evals.stats import CONVENTION, compare, recovery, sink_correlation
    from sinkstudy.provenance import recorded_hardware

    ev = study.evals
    kw = {"n_boot": ev["n_boot"], "confidence": ev["confidence"], "seed": study.seed}
    out: dict[str, Any] = {"study": study.name, "tasks": ev["tasks"], "headline": {t: HEADLINE_METRICS.get(t) for t in ev["tasks"]},
                           "convention": CONVENTION, "pairs": {}, "correlation": {}, "timings": runner.timings(),
                           "hardware": recorded_hardware((study.out / "steps").rglob("*.json"))}  # what computed the steps
    for p, res in pairs.items():
        runs = {label: EvalRun.load(r["eval"]["dir"]) for label, r in res.items()}
        entry: dict[str, Any] = {"models": {}, "degradation": {}, "interventions": {}}
        for label, r in res.items():
            entry["models"][label] = {"path": r["path"], "sink_strength": r["sink"]["value"], "mean_mass": r["sink"]["mean_mass"],
                                      "sink_maps": r["sink"]["maps"], "scores": r["eval"]["scores"], "method": r.get("method")}
        for task in ev["tasks"]:
            entry["degradation"][task] = compare(runs["base"], runs["vlm"], task, **kw).as_dict()
        for label in res:
            if label in ("base", "vlm"):
                continue
            entry["interventions"][label] = {  # vs_vlm: against the unintervened VLM LM, its control
                task: {"recovery": recovery(runs["base"], runs["vlm"], runs[label], task, **kw).as_dict(),
                       "vs_base": compare(runs["base"], runs[label], task, **kw).as_dict(),
                       "vs_vlm": compare(runs["vlm"], runs[label], task, **kw).as_dict()} for task in ev["tasks"]}
        if study.adapt is not None:
            from experiments.protection import protection_summary

            entry["protection"] = protection_summary(study, p, res, runs, kw)
        entry["examples"] = _examples(runs["base"], runs["vlm"], ev["tasks"][0], out["headline"].get(ev["tasks"][0]))
        pair_cfg = next(x for x in study.pairs if x["name"] == p)
        entry["published"] = pair_cfg.get("published")
        entry["native_qk_norm"] = pair_cfg.get("native_qk_norm")
        out["pairs"][p] = entry
    s = [out["pairs"][p]["models"]["base"]["sink_strength"] for p in pairs]
    notes = []
    for task in ev["tasks"]:
        changes = [out["pairs"][p]["degradation"][task] for p in pairs]
        finite = [(a, c["delta_points"], c["delta_relative"]) for a, c in zip(s, changes)
                  if _finite(a) and _finite(c["delta_points"]) and _finite(c["delta_relative"])]
        if len(finite) >= 3:
            out["correlation"][task] = sink_correlation(*zip(*finite), **kw).as_dict()
        else:  # Δ / before is undefined where the base scores 0: such a pair is left out of both relations
            notes.append(f"{task}: {len(finite)} pair(s) with a defined S, Δ and Δ / before; a rank correlation needs at least 3")
    if notes:
        out["correlation_note"] = "; ".join(notes)
    return out
