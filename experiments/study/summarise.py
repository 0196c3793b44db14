"""A finished plan's results -> `summary.json`: every number the report shows, and everything else it
says (the study's settings, the build's facts, package versions), so that the report is a function of
this file alone (`experiments.report.document.write_report`; `sinkstudy report RUN_DIR`).

Per pair: each measured model (path, Sink Strength, scores, method), the paired change base -> VLM LM
per task with CIs (Δ = after − before in points, and Δ / before: `evals.stats.compare`), per treated
model its recovery of that loss and Δ against the base and against the VLM LM, the adaptation arms
against the control, each sink dose of the base (`experiments.study.doses.dose_summary`) and, where two or more were
adapted, the dose-response of Δ on S (`experiments.study.dose_response`), example prompts; across pairs, Sink Strength of the base against both changes
(`evals.stats.sink_correlation`).
"""

from __future__ import annotations

import math
from typing import Any

from evals.eval_run import HEADLINE_METRICS, EvalRun
from experiments.study.arms import protection_summary
from experiments.study.calibration import calibration, has_grid
from experiments.study.doses import dose_summary, labels
from experiments.study.template import shares
from sinkstudy import SinkstudyError
from sinkstudy.provenance import package_versions, recorded_hardware


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def examples(base, vlm, task: str, metric: str | None, n: int = 2, width: int = 240) -> list[dict]:
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


TEMPLATE_CONVENTION = ("template share = the share of a model's eval answers that open like a VL training answer: their "
                       "first 4 words (lower-cased, punctuation dropped, numbers as #) equal the first 4 of some answer "
                       "the VL recipe trained on, or the whole answer equals a shorter training answer (\"yes\", \"top "
                       "left\"); a high share means text skill lost by collapse to the VL template, not by erosion")
VL_CONVENTION = "Δ VL = the model's held-out VL accuracy − the VLM's, in points (accuracy × 100; its LM put back into the VLM)"


def vl_cost(models: dict) -> dict[str, dict]:
    """Per model with a VL skill besides the VLM's: its accuracy, the VLM's, and Δ VL (`VL_CONVENTION`)."""
    vlm = (models.get("vlm") or {}).get("vl_skill") or {}
    out = {}
    for label, m in models.items():
        skill = m.get("vl_skill") or {}
        if label == "vlm" or skill.get("accuracy") is None or vlm.get("accuracy") is None:
            continue
        out[label] = {"accuracy": skill["accuracy"], "vlm_accuracy": vlm["accuracy"],
                      "delta_points": 100 * (skill["accuracy"] - vlm["accuracy"]), "convention": VL_CONVENTION}
    return out


def settings(study) -> dict[str, Any]:
    """What the report says the study was set to."""
    ev = study.evals
    return {"title": study.report.title or f"sinkstudy report: {study.name}", "notes": study.report.notes,
            "sink_metric": study.sink.metric, **ev.protocol.as_dict(), "n_boot": ev.n_boot, "confidence": ev.confidence,
            "interventions": [iv.name for iv in study.interventions],
            "config": str(study.path) if study.path else None, "out": str(study.out), "seed": study.seed,
            "see_also": dict(study.report.see_also)}


def summarise(plan, results: dict[str, dict], timings: dict[str, float]) -> dict:
    """The summary of a finished `experiments.study.pipeline.StudyPlan` from its steps' results."""
    # lazy: loads numpy
    from evals.stats import CONVENTION, compare, recovery, sink_correlation
    from experiments.study.dose_response import dose_response

    study = plan.study
    dose_labels = labels(study)
    ev = study.evals
    tasks = list(ev.protocol.tasks)
    kw = {"n_boot": ev.n_boot, "confidence": ev.confidence, "seed": study.seed}
    out: dict[str, Any] = {"study": study.name, "tasks": tasks, "headline": {t: HEADLINE_METRICS.get(t) for t in tasks},
                           "convention": CONVENTION, "pairs": {}, "correlation": {}, "timings": timings,
                           "hardware": recorded_hardware((study.out / "steps").rglob("*.json"))}  # what computed the steps
    for pair in study.pairs:
        p, models = pair.name, plan.models[pair.name]
        runs = {label: EvalRun.load(results[m.eval]["dir"]) for label, m in models.items()}
        entry: dict[str, Any] = {"models": {}, "degradation": {}, "interventions": {}}
        for label, m in models.items():
            sink = results[m.sink]
            entry["models"][label] = {"path": m.path, "sink_strength": sink["value"], "mean_mass": sink["mean_mass"],
                                      "sink_maps": sink["maps"], "scores": results[m.eval]["scores"], "method": m.method,
                                      "template_share": shares(results[plan.openings], runs[label], tasks) if plan.openings else None,
                                      "vl_skill": results[m.vl_skill] if m.vl_skill else None}
        for task in tasks:
            entry["degradation"][task] = compare(runs["base"], runs["vlm"], task, **kw).as_dict()
        for label in models:
            if label in ("base", "vlm") or label in dose_labels or models[label].snapshot:
                continue
            entry["interventions"][label] = {  # vs_vlm: against the unintervened VLM LM, its control
                task: {"recovery": recovery(runs["base"], runs["vlm"], runs[label], task, **kw).as_dict(),
                       "vs_base": compare(runs["base"], runs[label], task, **kw).as_dict(),
                       "vs_vlm": compare(runs["vlm"], runs[label], task, **kw).as_dict()} for task in tasks}
        entry["vl_cost"] = vl_cost(entry["models"])
        if study.adapt is not None:
            entry["protection"] = protection_summary(study, p, models, results, runs, kw)
        if has_grid(study):
            entry["calibration"] = calibration(study, p, models, results, runs, tasks[0], kw, plan.openings)
        if study.dose:
            entry["dose"] = dose_summary(study, p, results, runs, kw)
            response = dose_response(entry, runs, tasks, kw)
            if response:
                entry["dose_response"] = response
        entry["examples"] = examples(runs["base"], runs["vlm"], tasks[0], out["headline"].get(tasks[0]))
        entry["published"] = pair.published
        entry["native_qk_norm"] = pair.native_qk_norm
        out["pairs"][p] = entry
    s = [e["models"]["base"]["sink_strength"] for e in out["pairs"].values()]
    notes = []
    for task in tasks:
        changes = [e["degradation"][task] for e in out["pairs"].values()]
        finite = [(a, c["delta_points"], c["delta_relative"]) for a, c in zip(s, changes)
                  if _finite(a) and _finite(c["delta_points"]) and _finite(c["delta_relative"])]
        if len(finite) >= 3:
            out["correlation"][task] = sink_correlation(*zip(*finite), **kw).as_dict()
        else:  # Δ / before is undefined where the base scores 0: such a pair is left out of both relations
            notes.append(f"{task}: {len(finite)} pair(s) with a defined S, Δ and Δ / before; a rank correlation needs at least 3")
    if notes:
        out["correlation_note"] = "; ".join(notes)
    if plan.openings:
        out["template_share"] = {"openings": {k: v for k, v in results[plan.openings].items() if k in ("n_answers", "n_words")},
                                 "convention": TEMPLATE_CONVENTION}
    out["settings"] = settings(study)
    if study.build is not None:
        out["build"] = study.build.facts(results)
    out["provenance"] = {"versions": package_versions()}
    return out
