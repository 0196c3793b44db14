"""Runs a plan's steps (`experiments.study.graph`), reusing finished ones: the one way every command and
every study makes and measures things.

Every step writes `<out>/steps/<step id>.json` atomically: its kind, key, identity, result, the
fingerprints of its outputs and provenance. The key is the step's kind, arguments and code
(`experiments.study.kinds.step_key`), so a rerun reuses a step whose arguments and inputs are unchanged
and re-runs one whose settings or inputs changed, and everything downstream of it. A step finished in
another run (another output directory, another command) with the same key is reused from there
(`experiments.study.store`; `share=False`, a command's `--no-cache`, reuses only this run's own). A step whose
outputs have gone runs again; a transient step's (keep_models: false) only when a step that reads them has to run.
Nothing below the engine reuses a result: a step's body writes what it is asked to make (`replace=True` to the
writers: the engine has decided).

A model or file another step made enters a key by its fingerprint (`StepContext.fingerprint`): read from
disk in a whole run (an edited checkpoint is measured again), the producing step's record for a single
step (`run_one`: its dependencies finished elsewhere, maybe on another machine).

A study owns its directory: a step whose record holds another key is re-run there. In a command's `--out`
a step of a `guarded` stage (what the command makes, not what it measures) made by another request is
refused instead, in the one refusal (`made_by_another`) naming what differs, unless `force`. Each step holds its
record's lock from the reuse check to its record, so parallel jobs of different steps run side by side
while a second job of one step fails at once. Under a data-parallel launch every rank runs the bodies,
and only the main one locks and writes records.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Callable

from experiments.study import store
from experiments.study.graph import Plan, Step
from experiments.study.kinds import refs, step_key
from sinkstudy import SinkstudyError
from sinkstudy.io import output_lock, remove_tree, write_json_atomic
from sinkstudy.provenance import model_fingerprint, provenance

log = logging.getLogger(__name__)
STEP_FORMAT = "sinkstudy.step/2"


def made_by_another(out: Path, what: str, differ: list[str]) -> str:
    """The one refusal of an output that another request made: what holds it and what differs."""
    return (f"{out} holds {what} made by another request ({', '.join(differ)} differ); pass --force to replace it, "
            "or choose another --out")


class StepContext:
    """What a step's key and body may read: its dependencies' results and the fingerprints of what they made."""

    def __init__(self, engine: "Engine", results: dict[str, dict]):
        self.engine, self.results, self.progress = engine, results, engine.progress
        self._fingerprints: dict[str, str] = {}

    def result(self, step_id: str) -> dict:
        return self.results[step_id]

    def fingerprint(self, path, made_by: str) -> str:
        """The fingerprint of `path`, which step `made_by` wrote."""
        path = os.fspath(path)
        if path not in self._fingerprints:
            if self.engine.live and Path(path).exists():
                self._fingerprints[path] = model_fingerprint(path)
            else:  # a single step, or a transient output already removed: the producing step's record
                made = self.engine.made.get(made_by, {})
                if path in made:
                    self._fingerprints[path] = made[path]
                elif Path(path).exists():  # inside an output the record names (a run's model dir)
                    self._fingerprints[path] = model_fingerprint(path)
                else:
                    raise SinkstudyError(f"step {made_by} has no record of writing {path}")
        return self._fingerprints[path]


def _main_process() -> bool:
    """False on a data-parallel launch's other ranks (accelerate launch / torchrun)."""
    return int(os.environ.get("RANK", "0")) == 0


class Engine:
    """Runs a plan's steps under `out`; `config` and `seed` go into every record's provenance."""

    def __init__(self, plan: Plan, out: str | os.PathLike, *, config: dict | None = None, seed: int | None = None,
                 force: bool = False, progress: bool = True, on_done: Callable[[str, float, bool], Any] | None = None,
                 guarded: tuple[str, ...] = (), share: bool = True, store_root: str | os.PathLike | None = None):
        self.plan, self.out = plan, Path(out)
        self.config, self.seed = config, seed
        self.force, self.progress, self.on_done, self.guarded = force, progress, on_done, guarded
        # share: reuse a step another run finished (`store`, under `store_root`); its own records are reused either way
        self.share, self.store_root = share, Path(store_root) if store_root is not None else None
        self.live = True  # a whole run: fingerprints of made models from disk
        self.main = _main_process()
        self.keys: dict[str, str] = {}
        self.results: dict[str, dict] = {}
        self.made: dict[str, dict[str, str]] = {}  # step id -> {output path: fingerprint}
        self.reused_from: dict[str, str] = {}  # step id -> the record of the run it was reused from
        self.log: list[dict[str, Any]] = []
        self._status: dict[str, bool] = {}  # run_one: step id -> recorded under its key

    def record_path(self, step_id: str) -> Path:
        return self.out / "steps" / f"{step_id}.json"

    # ----------------------------------------------------------------------- keys and records

    def _record(self, step_id: str, key: str | None = None) -> dict | None:
        """The stored record of a step (with this key, when given), else None."""
        f = self.record_path(step_id)
        try:
            rec = json.loads(f.read_text(encoding="utf-8")) if f.is_file() else None
        except ValueError:
            return None
        if not isinstance(rec, dict) or rec.get("format") != STEP_FORMAT:
            return None
        return rec if key is None or rec.get("key") == key else None

    def _lock(self, step: Step):
        return output_lock(self.record_path(step.id)) if self.main else contextlib.nullcontext()

    @staticmethod
    def _usable(step: Step, readers_recorded: Callable[[], bool]) -> bool:
        """A finished step's outputs all exist, or are transient and every step reading them is recorded."""
        return all(Path(o).exists() for o in step.outputs) or (step.transient and readers_recorded())

    def _reuse(self, step: Step, key: str, readers_recorded: Callable[[], bool]) -> dict | None:
        """The result of `step` finished under `key`: in this run, else in another (copied here), else None."""
        if self.force:
            return None
        rec = self._record(step.id, key)
        if rec is not None and self._usable(step, readers_recorded):
            self.made[step.id] = rec.get("outputs") or {}
            return rec["result"]
        found = store.lookup(key, self.store_root) if self.share else None
        if found is None:
            return None
        result, self.made[step.id] = store.adopt(found, step.outputs, copy=self.main)
        self.reused_from[step.id] = found["record_path"]
        if self.main:
            rec = found["record"]
            self._write(step, key, rec["identity"], result, rec["seconds"], rec["provenance"],
                        reused_from=rec.get("reused_from") or found["record_path"])
        return result

    def _refuse_other(self, step: Step, identity: dict) -> None:
        """A command's --out whose guarded step was made by other settings: one line naming what differs. Code
        alone (an edited plug-in, a new version) reruns it: the result it names is the same request's."""
        if step.stage not in self.guarded or self.force or not self.main:
            return
        rec = self._record(step.id)  # its outputs may have gone (keep_models: false): the record still names them
        if rec is None:
            return
        old, new = rec.get("identity", {}).get("args", {}), identity["args"]
        differ = sorted(k for k in set(old) | set(new) if k != "code" and old.get(k) != new.get(k))
        if differ:
            raise SinkstudyError(made_by_another(self.out, step.id, differ))

    # ----------------------------------------------------------------------- a whole run

    def run_all(self) -> dict[str, dict]:
        """Every step in plan order, each reused when finished; {step id: result}."""
        done: set[str] = set()
        for step in self.plan:
            ctx = StepContext(self, self.results)
            key, identity = step_key(step.args, ctx)
            self.keys[step.id] = key
            with self._lock(step):
                t0 = time.perf_counter()
                result = self._reuse(step, key, lambda: self._readers_recorded(step))
                if result is not None:
                    self.results[step.id] = result
                    self.log.append({"step": step.id, "reused": True, "seconds": 0.0})
                else:
                    self._refuse_other(step, identity)
                    self.results[step.id] = self._execute(step, key, identity, ctx)
                    self.log.append({"step": step.id, "reused": False, "seconds": round(time.perf_counter() - t0, 2)})
            if self.on_done is not None:
                self.on_done(step.id, self.log[-1]["seconds"], self.log[-1]["reused"])
            done.add(step.id)
            self._release(step, done)
        return self.results

    def _readers_recorded(self, step: Step) -> bool:
        """Whether every step reading `step` (a transient one whose outputs have gone) has a record under
        the key it would have now; a reader that also waits on a later step counts as unfinished."""
        rec = self._record(step.id)
        if rec is None:
            return False
        made = {**self.made, step.id: rec.get("outputs") or {}}
        saved, self.made, live = self.made, made, self.live
        self.live = False  # the outputs have gone: their fingerprints are the record's
        try:
            for reader in self.plan.dependents(step.id):
                if any(d not in self.keys and d != step.id for d in reader.deps):
                    return False
                if self._record(reader.id, step_key(reader.args, StepContext(self, self.results))[0]) is None:
                    return False
            return True
        except (SinkstudyError, KeyError):
            return False
        finally:
            self.made, self.live = saved, live

    def _release(self, step: Step, done: set[str]) -> None:
        """Remove the outputs of transient steps that every reader has now finished with."""
        if not self.main:
            return
        for dep in (self.plan[d] for d in step.deps):
            if dep.transient and all(r.id in done for r in self.plan.dependents(dep.id)):
                for o in dep.outputs:
                    if Path(o).exists():
                        remove_tree(o, within=self.out)

    def _execute(self, step: Step, key: str, identity: dict, ctx: StepContext) -> dict:
        log.info("step %s", step.id)
        if self.main and self.record_path(step.id).exists():
            self.record_path(step.id).unlink()  # its outputs are about to change: no record may vouch for them
        t0 = time.perf_counter()
        result = step.args.run(ctx)
        seconds = time.perf_counter() - t0
        outputs = {os.fspath(o): model_fingerprint(o) for o in step.outputs if Path(o).exists()}
        self.made[step.id] = outputs
        if self.main:
            inputs = {r.path: r.fingerprint(ctx) for r in refs(step.args)}
            seed = getattr(step.args, "seed", None)
            prov = provenance(config=self.config, seeds={"study": self.seed, **({"step": seed} if isinstance(seed, int) else {})},
                              model_fingerprints={**inputs, **outputs}, step=step.id)
            self._write(step, key, identity, result, round(seconds, 2), prov)
        return result

    def _write(self, step: Step, key: str, identity: dict, result: dict, seconds: float, prov: dict,
               reused_from: str | None = None) -> None:
        record = {"format": STEP_FORMAT, "step": step.id, "kind": step.args.kind, "key": key, "identity": identity,
                  "deps": list(step.deps), "seconds": seconds, "result": result, "outputs": self.made[step.id],
                  "provenance": prov, **({"reused_from": reused_from} if reused_from else {})}
        write_json_atomic(self.record_path(step.id), record)
        store.register(key, self.record_path(step.id), list(self.made[step.id]), self.store_root)

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
        key, identity = step_key(step.args, ctx)
        t0 = time.perf_counter()
        with self._lock(step):  # parallel jobs of other steps run; a second job of this one fails at once
            result = self._reuse(step, key, lambda: all(self._known(r.id) for r in self.plan.dependents(step_id)))
            reused = result is not None
            if not reused:
                self._refuse_other(step, identity)
                result = self._execute(step, key, identity, ctx)
        return {"step": step_id, "reused": reused, "seconds": round(time.perf_counter() - t0, 1), "result": result}

    def _known(self, step_id: str) -> bool:
        """Whether `step_id` and every step before it have records under their keys (computed from those
        records); fills `keys`, `results` and `made` as it goes."""
        if step_id not in self._status:
            step = self.plan[step_id]
            ok = all(self._known(d) for d in step.deps)
            if ok:
                try:
                    self.keys[step_id] = step_key(step.args, StepContext(self, self.results))[0]
                except SinkstudyError:
                    ok = False
            if ok:
                rec = self._record(step_id, self.keys[step_id])
                ok = rec is not None
                if ok:
                    self.results[step_id] = rec["result"]
                    self.made[step_id] = rec.get("outputs") or {}
            self._status[step_id] = ok
        return self._status[step_id]

    def _finished(self, step: Step) -> bool:
        return self._known(step.id) and self._usable(step, lambda: all(self._known(r.id) for r in self.plan.dependents(step.id)))

    def finished(self, step_id: str) -> bool:
        """Whether `step_id` would be reused from this run's records (before running anything; `force` aside)."""
        return not self.force and self._finished(self.plan[step_id])

    def timings(self) -> dict[str, float]:
        """Seconds per stage (the second component of the step id), this run only."""
        out: dict[str, float] = {}
        for e in self.log:
            parts = e["step"].split("/")
            stage = parts[1] if len(parts) > 1 else parts[0]
            out[stage] = round(out.get(stage, 0.0) + e["seconds"], 2)
        return out
