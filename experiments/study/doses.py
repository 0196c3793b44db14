"""A study's sink doses (the `dose:` section, `experiments.study.dose_section`, docs/dose.md) as steps and summary: each pair's base with its Sink Strength moved by
`interventions.sink_dose`, measured before any VL training (S, and the strict evals against the undosed base:
a dose that itself costs text skill confounds any dose-response read from it), and, with an `adapt:` section,
adapted with the control arm's recipe, so the text skill lost in VL training can be read against S before it.

Steps per pair P and dose D:
    P/dose/D                       the dosed base (`Intervene` of sink_dose with the base as both models)
    P/sink/D, P/eval/D             its measurements, before any VL training
    P/adapt/D, P/vlskill/D         with an adapt section: the control arm's adaptation of the dosed base (its
                                   self-distilled text the undosed base's, so every dose trains on the same records), its
                                   VL skill
    P/adapt/D-extract, P/sink|eval/D-vl   that VLM's language model and its measurements
"""

from __future__ import annotations

import dataclasses
from typing import Any

from experiments.study.adapt_section import Arm
from experiments.study.arms import VLSkill, arm_step
from experiments.study.config import model_dir
from experiments.study.graph import Step
from experiments.study.kinds import Ref
from experiments.study.pair_steps import Intervene
from sinkstudy import SinkstudyError


def plan_doses(pp) -> None:
    """Every dose's steps on the pair of `pp` (experiments.study.pipeline.PairPlan)."""
    study, pair, p = pp.study, pp.pair, pp.pair.name
    for dose in (d for d in study.dose if d.doses(p)):
        owner = f"pair {p} dose {dose.name}"
        base_out = model_dir(study.out, p, dose.name, "base")
        made = pp.add(Step(f"{p}/dose/{dose.name}", Intervene("sink_dose", pp.ref(pair.base), pp.ref(pair.base), dose.params,
                                                              study.seed, out=base_out), outputs=(base_out,), owner=owner))
        pp.measure(dose.name, Ref(str(base_out), made), method="sink_dose", owner=owner)
        if study.adapt is None:
            continue
        control = study.arms_of(p)[0]
        own_seed = study.adapt.recipe["seed"] if control.seed is None else control.seed
        if own_seed in dose.seeds:
            raise SinkstudyError(f"pair {p} dose {dose.name}: seed {own_seed} is the control's, adapted anyway; list only further seeds")
        for seed in (None, *dose.seeds):
            _adapt_dose(pp, dose, Ref(str(base_out), made), control, seed, owner)


def _adapt_dose(pp, dose, base: Ref, control, seed: int | None, owner: str) -> None:
    """The dosed base adapted with the control's recipe, vision side and seed (or training seed `seed`), its VL skill,
    language model and measurements, as `<dose>-vl` (`<dose>-s<seed>-vl`)."""
    study, pair, p = pp.study, pp.pair, pp.pair.name
    name = dose.name if seed is None else f"{dose.name}-s{seed}"
    args = arm_step(study, pair, Arm(name, recipe=control.recipe, seed=control.seed if seed is None else seed), base)
    args = dataclasses.replace(args, recipe=undosed_text(args.recipe, pair.base))
    adapted = pp.add(Step(f"{p}/adapt/{name}", args, outputs=(args.model_dir, args.run_dir), owner=owner))
    if study.adapt.vl_eval is not None:
        pp.add(Step(f"{p}/vlskill/{name}", VLSkill(Ref(str(args.model_dir), adapted), study.adapt.vl_eval), owner=owner))
    pp.adapted(f"{name}-vl", args.model_dir, model_dir(study.out, p, name, "vlm", "lm"), base.path,
               extract_id=f"{p}/adapt/{name}-extract", method="sink_dose+vl", owner=owner)


def undosed_text(recipe: dict, base: str) -> dict:
    """The recipe with its self-distilled text made by the undosed `base`: every dose then trains on the same records,
    so only S differs between the points (a `{selfdistill: base}` spec would take each dosed base's own replies)."""
    stages = [{**stage, "data": [{**spec, "selfdistill": str(base)} if isinstance(spec, dict) and spec.get("selfdistill") == "base"
                                 else spec for spec in stage["data"]]} for stage in recipe["stages"]]
    return {**recipe, "stages": stages}


def labels(study) -> set[str]:
    """The model labels the doses add to a pair (not interventions on its VLM LM)."""
    return {n for d in study.dose for n in (d.name, f"{d.name}-vl", *(f"{d.name}-s{seed}-vl" for seed in d.seeds))}


def dose_summary(study, pair: str, results: dict[str, dict], runs: dict, kw: dict) -> dict[str, Any]:
    """Per dose: its level, what the dose solved (scale, S before and after in its own measurement), the dosed base's
    S in the study's metric and its text skill against the undosed base (Δ = dosed − base in points, paired
    bootstrap CI), `text_cost`: the tasks where that CI lies below 0 (a confound), and with an adapt section the
    VL training's change (Δ = its VLM LM − the dosed base) with the adapted LM's S and VL skill."""
    # lazy: loads numpy
    from evals.stats import compare, comparison_side

    tasks = list(study.evals.protocol.tasks)
    out = {}
    for dose in (d for d in study.dose if d.doses(pair)):
        d, made = dose.name, results[f"{pair}/dose/{dose.name}"]
        rep = (made.get("info") or {}).get("report") or {}
        vs_base = {t: compare(runs["base"], runs[d], t, **kw) for t in tasks}
        entry = {"level": dict([dose.level]), "params": {k: v for k, v in dose.params.items() if k != "texts"},
                 "scale": rep.get("scale"), "dose_sink_strength": [rep.get("sink_strength_before"), rep.get("sink_strength")],
                 "sink_strength": results[f"{pair}/sink/{d}"]["value"], "vs_base": {t: c.as_dict() for t, c in vs_base.items()},
                 "text_cost": [t for t, c in vs_base.items() if comparison_side(c) < 0]}
        if f"{d}-vl" in runs:
            entry["vl"] = _vl(pair, d, d, results, runs, tasks, kw)
            entry["vl_seeds"] = {str(seed): _vl(pair, d, f"{d}-s{seed}", results, runs, tasks, kw) for seed in dose.seeds}
        out[d] = entry
    return {"doses": out, "convention": "vs_base: Δ = dosed base − base in points (before any VL training; text_cost: the tasks "
                                        "where its CI lies below 0, a confound of the dose-response); vl.degradation: Δ = the "
                                        "dosed base's VLM LM − the dosed base in points; vl_seeds: the same for each further "
                                        "training seed of the dose"}


def _vl(pair: str, dose: str, name: str, results: dict, runs: dict, tasks: list[str], kw: dict) -> dict[str, Any]:
    """One adaptation of a dosed base: its LM's S, its VL skill and Δ = that LM − the dosed base, per task."""
    # lazy: loads numpy
    from evals.stats import compare

    return {"sink_strength": results[f"{pair}/sink/{name}-vl"]["value"], "vl_skill": results.get(f"{pair}/vlskill/{name}"),
            "degradation": {t: compare(runs[dose], runs[f"{name}-vl"], t, **kw).as_dict() for t in tasks}}
