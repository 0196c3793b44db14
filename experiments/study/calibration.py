"""A recipe's calibration: every adapted model of a pair (each arm's final model and each model it kept during
training, `save_models_at`) as one point of a grid of settings × steps, with its text cost, template share, VL
skill and Sink Strength, and the point the rule below chooses.

The rule is fixed before any number is seen (`RULE`): the control's text cost Δ (VLM LM − base, points of the
study's first task) between −15 and −3 with its paired CI below 0, a template share under 10% (erosion, not
collapse to the VL answers) and a held-out VL accuracy of at least 0.7 (a VLM that sees). Where no point meets all
three, the closest one is named with what it misses: fewest criteria missed, then the highest VL accuracy, then Δ
nearest the middle of its range.
"""

from __future__ import annotations

from typing import Any

RULE = {"delta_points": (-15.0, -3.0), "template_share_below": 0.10, "vl_accuracy_at_least": 0.7}
CONVENTION = ("Δ = model − base in points (score × 100) on the study's first task, paired 95% CI; negative = lost text skill. "
              "template share: the share of its eval answers that open like a VL training answer. VL: held-out accuracy. "
              "train s: seconds of training from the start of the point's stage to the point (its earlier stages are shared).")


def has_grid(study) -> bool:
    """A study calibrates when an arm changes the recipe or keeps models during training."""
    return study.adapt is not None and any(arm.recipe or _kept(study, arm) for arm in study.adapt.arms)


def _kept(study, arm) -> bool:
    from experiments.study.adapt_section import arm_recipe

    return any(s["save_models_at"] for s in arm_recipe(study.adapt.recipe, arm.recipe)["stages"])


def misses(point: dict) -> list[str]:
    """What a point misses of `RULE`, in words (empty: it meets the rule)."""
    lo, hi = RULE["delta_points"]
    out = []
    d, ci = point["delta_points"], point["delta_ci"]
    if d is None or not lo <= d <= hi:
        out.append(f"Δ {'n/a' if d is None else format(d, '+.1f')} outside [{lo:g}, {hi:g}]")
    elif ci is None or ci[1] >= 0:
        out.append("CI reaches 0")
    share = point["template_share"]
    if share is None or share >= RULE["template_share_below"]:
        out.append(f"template share {'n/a' if share is None else format(share, '.2f')} ≥ {RULE['template_share_below']:g}")
    vl = point["vl_accuracy"]
    if vl is None or vl < RULE["vl_accuracy_at_least"]:
        out.append(f"VL {'n/a' if vl is None else format(vl, '.2f')} < {RULE['vl_accuracy_at_least']:g}")
    return out


def choose(points: list[dict]) -> dict | None:
    """The point the rule chooses, with `meets` (bool) and `misses`; None without points."""
    if not points:
        return None
    lo, hi = RULE["delta_points"]
    middle = (lo + hi) / 2

    def rank(p):
        d = p["delta_points"]
        return (len(misses(p)), -(p["vl_accuracy"] or 0.0), abs(d - middle) if d is not None else float("inf"))

    best = min(points, key=rank)
    return {"label": best["label"], "meets": not misses(best), "misses": misses(best)}


def calibration(study, pair: str, models: dict, results: dict, runs: dict, task: str, kw: dict,
                openings: str | None) -> dict[str, Any]:
    """The pair's grid: one point per adapted model (arm or kept model), in arm then step order, and the choice."""
    from evals.stats import compare
    from experiments.study.adapt_section import arm_recipe
    from experiments.study.template import shares

    arms = {a.name: a for a in study.arms_of(pair)}
    points = []
    for label, m in models.items():
        info = m.snapshot or (m.arm and {"arm": m.arm["arm"], "adapt": m.arm["adapt"]})
        if not info or info["arm"] not in arms or arms[info["arm"]].text_only:
            continue
        arm = arms[info["arm"]]
        adapt = results[info["adapt"]].get("summary") or {}
        stages = {s["stage"]: s for s in adapt.get("stages") or []}
        recipe = {s["name"]: s for s in arm_recipe(study.adapt.recipe, arm.recipe)["stages"]}
        stage = info.get("stage") or list(recipe)[-1]
        stage_step = info.get("stage_step") or stages.get(stage, {}).get("steps")
        rate = stages.get(stage, {}).get("steps_per_second")
        c = compare(runs["base"], runs[label], task, **kw)
        skill = results[m.vl_skill] if m.vl_skill else {}
        share = (shares(results[openings], runs[label], [task])[task] if openings else {}).get("share")
        points.append({"label": label, "arm": arm.name, "overrides": arm.recipe or {}, "stage": stage, "stage_step": stage_step,
                       "lr": recipe[stage]["lr"], "schedule": recipe[stage]["schedule"], "stage_steps": recipe[stage]["steps"],
                       "delta_points": c.delta_points, "delta_ci": list(c.delta_points_ci),
                       "lost": c.lost, "gained": c.gained, "n": c.n, "template_share": share,
                       "vl_accuracy": skill.get("accuracy"), "vl_by_type": {t: v["accuracy"] for t, v in (skill.get("by_type") or {}).items()},
                       "vl_majority": {t: v["majority"] for t, v in (skill.get("by_type") or {}).items()},
                       "sink_strength": results[m.sink]["value"],
                       "train_seconds": round(stage_step / rate, 1) if rate and stage_step else None})
    points.sort(key=lambda p: (list(arms).index(p["arm"]), p["stage_step"] or 0))
    chosen = choose(points)
    return {"task": task, "rule": RULE, "points": points, "chosen": chosen, "convention": CONVENTION}

