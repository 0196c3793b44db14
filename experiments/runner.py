"""Resumable study runner.

Every step writes `<out>/steps/<step id>.json` atomically: its result, a key and provenance. The
key is a hash of the step's settings and the keys of the steps it reads from, so a rerun reuses a
step whose settings and inputs are unchanged and re-runs (overwriting its outputs) one whose
config changed, and everything downstream of it. An interrupted run continues at the first
unfinished step.

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
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from sinkstudy import SinkstudyError
from sinkstudy.io import read_json, write_json_atomic

log = logging.getLogger(__name__)
STEP_FORMAT = "sinkstudy.step/1"


class Runner:
    """Runs keyed steps, reusing finished ones; records timing and what was reused."""

    def __init__(self, study, *, force: bool = False, progress: bool = True):
        self.study = study
        self.out = Path(study.out)
        self.force = force
        self.progress = progress
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

    def run(self, step_id: str, spec: dict, fn: Callable[[], dict], deps: Sequence[str] = (), outputs: Path | None = None) -> dict:
        """Reuse the finished step with this key, or run `fn` and record it. A step whose `outputs`
        (a checkpoint dir it writes) has gone is run again."""
        from sinkstudy.provenance import provenance

        key = self.key(spec, deps)
        self.keys[step_id] = key
        f = self.path(step_id)
        if f.is_file() and not self.force and (outputs is None or Path(outputs).exists()):
            try:
                done = json.loads(f.read_text(encoding="utf-8"))
            except ValueError:
                done = {}
            if done.get("key") == key:
                self.log.append({"step": step_id, "reused": True, "seconds": 0.0})
                return done["result"]
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
        write_json_atomic(f, {"format": STEP_FORMAT, "step": step_id, "key": key, "spec": spec, "deps": list(deps),
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


# --------------------------------------------------------------------------- the study

def run_study(study, *, force: bool = False, progress: bool = True) -> dict:
    """Run every step of `study` (reusing finished ones); write the report; return a summary."""
    from experiments.report import write_report

    _check_inputs(study)
    t0 = time.perf_counter()
    runner = Runner(study, force=force, progress=progress)
    built: dict[str, str] = {}
    if study.build:
        from experiments.demo.build import run_build

        built = run_build(runner, study.build)
    pairs = {}
    for pair in study.pairs:
        pairs[pair["name"]] = run_pair(runner, study, pair, deps=[built[pair["name"]]] if pair["name"] in built else [])
    summary = summarise(study, pairs, runner)
    write_json_atomic(study.out / "summary.json", summary)
    report = write_report(study, summary)
    reused = sum(e["reused"] for e in runner.log)
    return {"report": str(report), "html": str(report.with_suffix(".html")), "steps": len(runner.log), "reused": reused,
            "seconds": round(time.perf_counter() - t0, 1), "stage_seconds": runner.timings()}


def _check_inputs(study) -> None:
    """Fail before any work when a local input the study does not build is missing."""
    if study.build is not None:
        return
    for pair in study.pairs:
        for k in ("base", "vlm", "root"):
            p = pair.get(k)
            # A hub id is "org/name": a path with more parts, or starting with . / ~, must exist here.
            if p and not Path(p).exists() and (p.startswith((".", "/", "~")) or p.count("/") > 1):
                raise SinkstudyError(f"pair {pair['name']}: {k} {p} does not exist")
    for task, f in study.evals["data_files"].items():
        if not Path(f).is_file():
            raise SinkstudyError(f"evals.data_files.{task}: {f} does not exist")


def _dtype(study):
    import torch

    return getattr(torch, study.model["dtype"])


def run_pair(runner: Runner, study, pair: dict, deps: list[str]) -> dict:
    """Every step of one pair; returns {model label: {"path", "sink", "eval", ...}}."""
    p = pair["name"]
    models_dir = runner.out / "models"
    lm_dir = models_dir / f"{p}-vlm-lm"
    model_spec = {"base": pair["base"], "vlm": pair["vlm"], "dtype": study.model["dtype"]}
    runner.run(f"{p}/extract", model_spec, lambda: extract_step(pair, lm_dir, study), deps=deps, outputs=lm_dir)
    models: dict[str, dict] = {"base": {"path": pair["base"], "step": deps[0] if deps else None},
                               "vlm": {"path": str(lm_dir), "step": f"{p}/extract"}}
    results: dict[str, dict] = {}
    for label in ("base", "vlm"):
        results[label] = measure(runner, study, pair, label, models[label]["path"], deps=[d for d in [models[label]["step"]] if d])

    for iv in study.interventions:
        name = iv["name"]
        if iv["method"] == "qknorm":
            results.update(qknorm_arm(runner, study, pair, iv, deps))
            continue
        params = dict(iv["params"])
        iv_deps = [f"{p}/extract"] + deps
        if pair.get("root") and not _is_mitigation(iv["method"]):
            params.setdefault("root", pair["root"])  # task vectors from the common pretrained ancestor
        if _needs_sink_maps(iv["method"]):
            params["sink_maps"] = {"base": results["base"]["sink"]["maps"], "vlm": results["vlm"]["sink"]["maps"]}
            iv_deps += [f"{p}/sink/base", f"{p}/sink/vlm"]
        out_dir = models_dir / f"{p}-{name}"
        spec = {"method": iv["method"], "params": {k: v for k, v in params.items() if k != "sink_maps"}, "seed": study.seed}
        step = f"{p}/intervene/{name}"
        make = lambda iv=iv, params=params, out_dir=out_dir: intervene_step(study, pair, iv, params, lm_dir, out_dir, runner.progress)  # noqa: E731
        runner.run(step, spec, make, deps=iv_deps, outputs=out_dir if study.keep_models else None)
        if not out_dir.exists() and not _measured(runner, study, pair, name, str(out_dir), step):
            runner.force_step(step, spec, make, deps=iv_deps)  # deleted after an earlier run (keep_models: false)
        results[name] = measure(runner, study, pair, name, str(out_dir), deps=[step])
        results[name]["method"] = iv["method"]
        if not study.keep_models and out_dir.exists():
            shutil.rmtree(out_dir)
    return results


def _is_mitigation(method: str) -> bool:
    from interventions.mitigations import list_mitigations

    return method in list_mitigations()


def _needs_sink_maps(method: str) -> bool:
    from interventions.mitigations import list_mitigations

    m = list_mitigations().get(method)
    return bool(m and m.needs_sink_maps)


def _measured(runner: Runner, study, pair: dict, label: str, path: str, dep: str) -> bool:
    p = pair["name"]
    return (runner.finished(f"{p}/sink/{label}", {"sink": study.sink, "path": path}, [dep])
            and runner.finished(f"{p}/eval/{label}", {"evals": _eval_spec(study), "path": path}, [dep]))


def measure(runner: Runner, study, pair: dict, label: str, path: str, deps: list[str]) -> dict:
    p = pair["name"]
    sink = runner.run(f"{p}/sink/{label}", {"sink": study.sink, "path": path},
                      lambda: sink_step(study, pair, label, path, runner.progress), deps=deps)
    ev = runner.run(f"{p}/eval/{label}", {"evals": _eval_spec(study), "path": path},
                    lambda: eval_step(study, pair, label, path, runner.progress), deps=deps)
    return {"path": path, "sink": sink, "eval": ev}


def _eval_spec(study) -> dict:
    spec = {k: v for k, v in study.evals.items() if k not in ("n_boot", "confidence")}
    spec["data_files"] = {t: _file_digest(f) for t, f in spec["data_files"].items()}
    return {**spec, "seed": study.seed, "device": study.model["device"], "dtype": study.model["dtype"]}


def _file_digest(path: str) -> str:
    f = Path(path)
    return hashlib.sha256(f.read_bytes()).hexdigest()[:16] if f.is_file() else f"missing:{path}"


# --------------------------------------------------------------------------- step bodies

def extract_step(pair: dict, lm_dir: Path, study) -> dict:
    from interventions.pairs import load_pair, save_causal_lm
    from sinkstudy.provenance import model_fingerprint

    mp = load_pair(pair["base"], pair["vlm"], dtype=_dtype(study), device=study.model["device"] or "cpu")
    save_causal_lm(mp.vlm_lm, mp.tokenizer, lm_dir, force=True, extra={"extraction": mp.report.to_dict(), "vlm": pair["vlm"]})
    fps = {pair["base"]: model_fingerprint(pair["base"]), pair["vlm"]: model_fingerprint(pair["vlm"]),
           str(lm_dir): model_fingerprint(lm_dir)}
    return {"path": str(lm_dir), "report": mp.report.to_dict(), "fingerprints": fps}


def _load(path: str, study):
    from interventions.pairs import load_causal_lm

    return load_causal_lm(path, dtype=_dtype(study), device=study.model["device"] or "cpu")


def sink_step(study, pair: dict, label: str, path: str, progress: bool) -> dict:
    from evals.sink import compute_sink_maps, strength_from_maps
    from sinkstudy.provenance import model_fingerprint

    model, tok = _load(path, study)
    if tok is None:
        tok = _load_tokenizer(pair["base"])
    maps = compute_sink_maps(model, tok, study.sink["texts"], metric=study.sink["metric"], progress=progress, **study.sink["options"])
    strength = strength_from_maps(maps, study.sink["metric"], **study.sink["params"])
    maps_file = study.out / "sink" / pair["name"] / f"{label}.json"
    write_json_atomic(maps_file, maps.to_json())
    details = {k: v for k, v in strength.details.items() if k != "median_per_layer"}
    return {"value": strength.value, "metric": strength.metric, "details": details,
            "median_per_layer": strength.details.get("median_per_layer"), "mean_mass": float(maps.mass.mean()),
            "maps": str(maps_file), "path": path, "fingerprint": model_fingerprint(path)}


def _load_tokenizer(path: str):
    from interventions.pairs import load_tokenizer

    return load_tokenizer(path)


def eval_step(study, pair: dict, label: str, path: str, progress: bool) -> dict:
    from evals.lmeval import run_eval

    ev = study.evals
    out_dir = study.out / "evals" / pair["name"] / label
    # A path is fingerprinted by its files (cheap); other dtypes (bf16 7B models) are loaded here.
    model = path if study.model["dtype"] == "float32" else _load(path, study)[0]
    run = run_eval(model, _load_tokenizer(pair["base"]), tasks=ev["tasks"], limit=ev["limit"], batch_size=ev["batch_size"],
                   apply_chat_template=ev["apply_chat_template"], max_gen_toks=ev["max_gen_toks"], num_fewshot=ev["num_fewshot"],
                   data_files=ev["data_files"] or None, out_dir=out_dir, force=True, device=study.model["device"],
                   seed=study.seed, progress=progress)
    return {"dir": str(out_dir), "scores": run.scores, "path": path, "fingerprint": run.fingerprint}


def intervene_step(study, pair: dict, iv: dict, params: dict, lm_dir: Path, out_dir: Path, progress: bool) -> dict:
    from interventions.registry import apply_intervention
    from sinkstudy.provenance import model_fingerprint

    out = apply_intervention(iv["method"], pair["base"], lm_dir, params, out_dir, seed=study.seed, force=True, progress=progress)
    info = read_json(Path(out) / "intervention.json") if (Path(out) / "intervention.json").is_file() else {}
    return {"path": str(out), "fingerprint": model_fingerprint(out), "info": {k: v for k, v in info.items() if k != "provenance"}}


# --------------------------------------------------------------------------- QK-norm arm

def _native_qk(pair: dict) -> bool:
    if "native_qk_norm" in pair:
        return bool(pair["native_qk_norm"])
    from interventions.pairs.resolve import load_config

    cfg = load_config(pair["base"])
    return getattr(cfg, "model_type", "") in ("qwen3", "gemma3_text", "olmo2", "olmo3")


def qknorm_arm(runner: Runner, study, pair: dict, iv: dict, deps: list[str]) -> dict:
    """Inject QK-RMSNorm into the base (pairs without native QK-norm); measure the injected base and,
    with `vl: true` (the demo), re-run the same VL recipe (the adaptation engine) on it and measure
    that VLM's LM, extracted by the engine (which re-attaches norms carried as hooks)."""
    p, name = pair["name"], iv["name"]
    if _native_qk(pair):
        return {}
    params = {"init": "scale-preserving", "train_steps": 0, "trainable": "all", "lr": 1e-3, "vl": False, **iv["params"]}
    models = runner.out / "models"
    base_out = models / f"{p}-{name}-base"
    runner.run(f"{p}/intervene/{name}", {"qknorm": params, "seed": study.seed},
               lambda: qknorm_step(study, pair, params, base_out, runner.progress), deps=deps, outputs=base_out)
    out = {f"{name}": {**measure(runner, study, pair, name, str(base_out), deps=[f"{p}/intervene/{name}"]), "method": "qknorm"}}
    if params["vl"]:
        from experiments.demo.build import vl_step

        vlm_out, lm_out = models / f"{p}-{name}-vlm", models / f"{p}-{name}-vlm-lm"
        runner.run(f"{p}/intervene/{name}-vl", {"vl": study.build["vl"]},
                   lambda: vl_step(base_out, vlm_out, study.build["vl"], runner.progress), deps=[f"{p}/intervene/{name}"],
                   outputs=vlm_out)
        def extract() -> dict:
            from interventions.adapt.build import save_extracted_lm
            from sinkstudy.provenance import model_fingerprint

            save_extracted_lm(vlm_out, str(base_out), lm_out, force=True)
            return {"path": str(lm_out), "fingerprint": model_fingerprint(lm_out)}

        runner.run(f"{p}/intervene/{name}-vl-extract", {}, extract, deps=[f"{p}/intervene/{name}-vl"], outputs=lm_out)
        out[f"{name}-vl"] = {**measure(runner, study, pair, f"{name}-vl", str(lm_out), deps=[f"{p}/intervene/{name}-vl-extract"]),
                             "method": "qknorm+vl"}
    return out


def qknorm_step(study, pair: dict, params: dict, out_dir: Path, progress: bool) -> dict:
    from interventions.qknorm import init_report, inject_qk_norm, save_injected, trainable_filter
    from sinkstudy.provenance import model_fingerprint

    model, tok = _load(pair["base"], study)
    tok = tok or _load_tokenizer(pair["base"])
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
    """Up to `n` prompts the base passes and the VLM LM fails (else the first ones), outputs cut to `width`."""
    if metric is None:
        return []
    try:
        b, v = base.docs(task), vlm.docs(task)
    except SinkstudyError:  # a run without samples
        return []
    ids = [d for d in b if d in v]
    lost = [d for d in ids if b[d]["metrics"].get(metric) and not v[d]["metrics"].get(metric)]
    cut = lambda t: t if len(t) <= width else t[:width] + "..."  # noqa: E731
    return [{"doc_id": d, "prompt": cut(b[d]["prompt"]), "base": cut(b[d]["output"]), "vlm": cut(v[d]["output"]),
             "base_pass": b[d]["metrics"].get(metric), "vlm_pass": v[d]["metrics"].get(metric)} for d in (lost or ids)[:n]]


def summarise(study, pairs: dict[str, dict], runner: Runner) -> dict:
    """Paired degradation (base -> VLM LM) with CIs, recovery per intervention, Sink Strength vs
    relative degradation (Spearman) across pairs, and the published figures beside ours."""
    from evals.lmeval import HEADLINE_METRICS, EvalRun
    from evals.stats import compare, recovery, sink_correlation

    ev = study.evals
    kw = {"n_boot": ev["n_boot"], "confidence": ev["confidence"], "seed": study.seed}
    out: dict[str, Any] = {"study": study.name, "tasks": ev["tasks"], "headline": {t: HEADLINE_METRICS.get(t) for t in ev["tasks"]},
                           "pairs": {}, "correlation": {}, "timings": runner.timings()}
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
            entry["interventions"][label] = {
                task: {"recovery": recovery(runs["base"], runs["vlm"], runs[label], task, **kw).as_dict(),
                       "vs_base": compare(runs["base"], runs[label], task, **kw).as_dict()} for task in ev["tasks"]}
        entry["examples"] = _examples(runs["base"], runs["vlm"], ev["tasks"][0], out["headline"].get(ev["tasks"][0]))
        pair_cfg = next(x for x in study.pairs if x["name"] == p)
        entry["published"] = pair_cfg.get("published")
        entry["native_qk_norm"] = pair_cfg.get("native_qk_norm")
        out["pairs"][p] = entry
    s = [out["pairs"][p]["models"]["base"]["sink_strength"] for p in pairs]
    notes = []
    for task in ev["tasks"]:
        deg = [out["pairs"][p]["degradation"][task]["rel_degradation"] for p in pairs]
        finite = [(a, b) for a, b in zip(s, deg) if _finite(a) and _finite(b)]
        if len(finite) >= 3:
            out["correlation"][task] = sink_correlation(*zip(*finite), **kw).as_dict()
        else:  # relative degradation is undefined where the base scores 0
            notes.append(f"{task}: {len(finite)} pair(s) with a defined S and relative degradation; a rank correlation needs at least 3")
    if notes:
        out["correlation_note"] = "; ".join(notes)
    return out
