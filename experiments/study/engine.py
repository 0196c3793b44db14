"""Runs a plan's steps (`experiments.study.graph`), reusing finished ones.

Every step writes `<out>/steps/<step id>.json` atomically: its result, its key and provenance. The
key is a hash of the step's settings (`Step.spec`) and the keys of the steps it runs after, so a
rerun reuses a step whose settings and inputs are unchanged and re-runs (overwriting its outputs)
one whose config changed, and everything downstream of it. A step whose outputs have gone runs
again; a transient step's (keep_models: false) only when a step that reads them has to run.

A model another step made enters a key by its fingerprint (`StepContext.fingerprint`): read from
disk in a whole run (an edited checkpoint is measured again), the producing step's record for a
single step (`run_one`: its dependencies finished elsewhere, maybe on another machine).

Each step holds its record's lock from the reuse check to its record, so parallel jobs of different
steps run side by side while a second job of one step fails at once.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Callable

from experiments.study.graph import Plan, Step
from sinkstudy import SinkstudyError
from sinkstudy.io import output_lock, remove_tree, write_json_atomic
from sinkstudy.provenance import model_fingerprint

log = logging.getLogger(__name__)
STEP_FORMAT = "sinkstudy.step/1"


class StepContext:
    """What a step's spec and body may read: its dependencies' results and the models they made."""

    def __init__(self, engine: "Engine", results: dict[str, dict]):
        self.engine, self.results, self.progress = engine, results, engine.progress
        self._fingerprints: dict[str, str] = {}

    def result(self, step_id: str) -> dict:
        return self.results[step_id]

    def fingerprint(self, path, made_by: str) -> str:
        """The fingerprint of the checkpoint `path` that step `made_by` wrote."""
        path = os.fspath(path)
        if path not in self._fingerprints:
            if self.engine.live and Path(path).exists():
                self._fingerprints[path] = model_fingerprint(path)
            else:  # a single step, or a transient checkpoint already removed: the producing step's record
                made = self.results[made_by]
                self._fingerprints[path] = made["fingerprint"] if "fingerprint" in made else made["fingerprints"][path]
        return self._fingerprints[path]


class Engine:
    """Runs a plan's steps under `out`; `config` and `seed` go into every record's provenance."""

    def __init__(self, plan: Plan, out: str | os.PathLike, *, config: dict | None = None, seed: int | None = None,
                 force: bool = False, progress: bool = True, on_done: Callable[[str, float, bool], Any] | None = None):
        self.plan, self.out = plan, Path(out)
        self.config, self.seed = config, seed
        self.force, self.progress, self.on_done = force, progress, on_done
        self.live = True  # a whole run: fingerprints of made models from disk
        self.keys: dict[str, str] = {}
        self.results: dict[str, dict] = {}
        self.log: list[dict[str, Any]] = []
        self._status: dict[str, bool] = {}  # run_one: step id -> recorded under its key

    def record_path(self, step_id: str) -> Path:
        return self.out / "steps" / f"{step_id}.json"

    # ----------------------------------------------------------------------- keys and records

    def _keyed(self, step: Step, ctx: StepContext, keys: dict[str, str]) -> tuple[str, dict]:
        """(key, spec) of `step`, its dependencies' keys in `keys`."""
        spec = dict(step.spec(ctx) if callable(step.spec) else step.spec)
        blob = json.dumps({"spec": spec, "deps": {d: keys[d] for d in step.deps}}, sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:24], spec

    def _record(self, step_id: str, key: str) -> dict | None:
        """The stored record of a step with this key, else None."""
        f = self.record_path(step_id)
        try:
            rec = json.loads(f.read_text(encoding="utf-8")) if f.is_file() else None
        except ValueError:
            return None
        return rec if isinstance(rec, dict) and rec.get("key") == key else None

    @staticmethod
    def _usable(step: Step, readers_recorded: Callable[[], bool]) -> bool:
        """A finished step's outputs all exist, or are transient and every step reading them is recorded."""
        return all(Path(o).exists() for o in step.outputs) or (step.transient and readers_recorded())

    # ----------------------------------------------------------------------- a whole run

    def run_all(self) -> dict[str, dict]:
        """Every step in plan order, each reused when finished; {step id: result}."""
        done: set[str] = set()
        for step in self.plan:
            ctx = StepContext(self, self.results)
            key, spec = self._keyed(step, ctx, self.keys)
            self.keys[step.id] = key
            with output_lock(self.record_path(step.id)):
                rec = None if self.force else self._record(step.id, key)
                if rec is not None and self._usable(step, lambda: self._readers_recorded(step, key, rec["result"])):
                    self.results[step.id] = rec["result"]
                    self.log.append({"step": step.id, "reused": True, "seconds": 0.0})
                else:
                    self.results[step.id] = self._execute(step, key, spec, ctx)
            if self.on_done is not None:
                self.on_done(step.id, self.log[-1]["seconds"], self.log[-1]["reused"])
            done.add(step.id)
            self._release(step, done)
        return self.results

    def _readers_recorded(self, step: Step, key: str, result: dict) -> bool:
        """Whether every step reading `step` (a transient one whose outputs have gone) has a record under
        the key it would have now; a reader that also waits on a later step counts as unfinished."""
        keys, results = {**self.keys, step.id: key}, {**self.results, step.id: result}
        for reader in self.plan.dependents(step.id):
            if any(d not in keys for d in reader.deps) or self._record(reader.id, self._keyed(reader, StepContext(self, results), keys)[0]) is None:
                return False
        return True

    def _release(self, step: Step, done: set[str]) -> None:
        """Remove the outputs of transient steps that every reader has now finished with."""
        for dep in (self.plan[d] for d in step.deps):
            if dep.transient and all(r.id in done for r in self.plan.dependents(dep.id)):
                for o in dep.outputs:
                    if Path(o).exists():
                        remove_tree(o, within=self.out)

    def _execute(self, step: Step, key: str, spec: dict, ctx: StepContext) -> dict:
        from sinkstudy.provenance import provenance

        log.info("step %s", step.id)
        t0 = time.perf_counter()
        result = step.run(ctx)
        seconds = time.perf_counter() - t0
        prov = provenance(
            config=self.config,
            seeds={"study": self.seed, **({"step": spec["seed"]} if isinstance(spec.get("seed"), int) else {})},
            model_fingerprints=result.get("fingerprints") or ({result["path"]: result["fingerprint"]} if "fingerprint" in result else {}),
            step=step.id,
        )
        write_json_atomic(self.record_path(step.id), {"format": STEP_FORMAT, "step": step.id, "key": key, "spec": spec,
                                                      "deps": list(step.deps), "seconds": round(seconds, 2), "result": result,
                                                      "provenance": prov})
        self.log.append({"step": step.id, "reused": False, "seconds": round(seconds, 2)})
        return result

    # ----------------------------------------------------------------------- one step

    def run_one(self, step_id: str, *, command: str = "sinkstudy run CONFIG") -> dict:
        """Run step `step_id` once the steps it runs after have finished (recorded under their keys,
        outputs usable); reuse it when finished unless `force`. Takes no lock but the step's own."""
        self.live = False
        step = self.plan[step_id]
        waiting = [d for d in step.deps if not self._finished(self.plan[d])]
        if waiting:
            raise SinkstudyError(f"step {step_id} depends on {', '.join(waiting)}, not finished: run "
                                 + " then ".join(f"`{command} --step {d}`" for d in waiting) + " first")
        ctx = StepContext(self, self.results)
        key, spec = self._keyed(step, ctx, self.keys)
        t0 = time.perf_counter()
        with output_lock(self.record_path(step_id)):  # parallel jobs of other steps run; a second job of this one fails at once
            rec = None if self.force else self._record(step_id, key)
            reused = rec is not None and self._usable(step, lambda: all(self._known(r.id) for r in self.plan.dependents(step_id)))
            result = rec["result"] if reused else self._execute(step, key, spec, ctx)
        return {"step": step_id, "reused": reused, "seconds": round(time.perf_counter() - t0, 1), "result": result}

    def _known(self, step_id: str) -> bool:
        """Whether `step_id` and every step before it have records under their keys (computed from those
        records); fills `keys` and `results` as it goes."""
        if step_id not in self._status:
            step = self.plan[step_id]
            ok = all(self._known(d) for d in step.deps)
            if ok:
                self.keys[step_id] = self._keyed(step, StepContext(self, self.results), self.keys)[0]
                rec = self._record(step_id, self.keys[step_id])
                ok = rec is not None
                if ok:
                    self.results[step_id] = rec["result"]
            self._status[step_id] = ok
        return self._status[step_id]

    def _finished(self, step: Step) -> bool:
        return self._known(step.id) and self._usable(step, lambda: all(self._known(r.id) for r in self.plan.dependents(step.id)))

    def timings(self) -> dict[str, float]:
        """Seconds per stage (the second component of the step id), this run only."""
        out: dict[str, float] = {}
        for e in self.log:
            stage = e["step"].split("/")[1]
            out[stage] = round(out.get(stage, 0.0) + e["seconds"], 2)
        return out
