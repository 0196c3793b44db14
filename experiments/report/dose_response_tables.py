"""The report's dose-response section, from summary.json's per-pair `dose_response` block
(`experiments.study.dose_response`): per backbone and task, each point (the undosed base and every adapted dose: S
before VL training, Δ in VL training with its CI, the adapted model's template share), the slope of Δ on S with its
CI, the causal answer to "a stronger sink, less loss" with its reason and confounds, the across-backbone correlation
of the study's pairs beside it (labelled with its n), and the plot."""

from __future__ import annotations

from pathlib import Path

from experiments.report import plots
from experiments.report.fmt import ci_text, num, with_ci


def _level(level: dict | None) -> str:
    if not level:
        return "none (undosed)"
    key, value = next(iter(level.items()))
    return {"shift": f"S {value:+g}", "target": f"S = {value:g}", "scale": f"logits × {value:g}"}[key]


def _slope(fit: dict) -> str:
    seeds = f", {fit['n_seeds']} training seeds" if fit["n_seeds"] > 1 else ""
    return (f"slope = {num(fit['slope'], '+.2f')} {ci_text(fit['slope_ci'], '+.2f')} points of Δ per unit of S over "
            f"{fit['n_points']} points ({fit['n_prompts']} prompts{seeds})")


def _answer(p: str, t: str, fit: dict, which: str = "") -> str:
    confounds = f" Confounds: {'; '.join(fit['confounds'])}." if fit["confounds"] else ""
    return f"{p} on {t}{which}: {_slope(fit)}. A stronger sink, less loss? {fit['answer'].upper()}: {fit['reason']}.{confounds}"


def _across(summary: dict, t: str) -> str:
    corr = (summary.get("correlation") or {}).get(t)
    n = len(summary["pairs"])
    if not corr:
        return (f"Across backbones on {t} (the undosed bases of this study's {n} pair{'s' if n != 1 else ''}): n = {n}; a rank "
                "correlation needs at least 3 backbones, so it decides nothing here.")
    c = corr["points"]
    return (f"Across backbones on {t} (the undosed bases of this study's pairs, n = {c['n']}): Spearman ρ(S, Δ points) = "
            f"{with_ci(c['spearman'], c['spearman_ci'], '+.3f')} (CI from resampling pairs): a correlation across backbones "
            "that differ in more than S, beside the within-backbone slope above.")


def dose_response_blocks(summary: dict, out: Path) -> list[tuple]:
    pairs = {p: e["dose_response"] for p, e in summary.get("pairs", {}).items() if e.get("dose_response")}
    if not pairs:
        return []
    b = [("h", 2, "Dose-response"),
         ("p", "Does a stronger sink cause less loss? Each backbone's base and its sink doses (each the base with only its "
               "Sink Strength moved, section Sink dose) were adapted with the same VL recipe. Per point: S before VL "
               "training, and Δ in VL training = the VLM LM − the base it was adapted from, in points, with its paired "
               "bootstrap CI over prompts. Slope: least squares of Δ on S, in points of Δ per unit of S; positive = a "
               "stronger sink loses less (the paper's direction); its 95% CI resamples the prompts jointly over every "
               "point (and training seeds, where several). The answer agrees where the CI lies above 0, disagrees where it "
               "lies below, and is not established otherwise, or when too few prompts or points are compared, or when most "
               "adapted models answer in the VL template (their Δ measures a collapse, not erosion). Template share: the "
               "adapted model's share of answers that open like a VL training answer.")]
    for t in summary["tasks"]:
        rows, lines = [], []
        for p, dr in pairs.items():
            fit = dr["tasks"].get(t)
            if not fit:
                continue
            for pt in fit["points"]:
                share = pt["template_share"]
                seeds = pt.get("delta_points_per_seed") or []
                delta = (with_ci(pt["delta_points"], pt["delta_points_ci"], "+.1f") if len(seeds) < 2 else
                         f"{num(pt['delta_points'], '+.1f')} (mean of seeds " + ", ".join(
                             f"{s} {num(d, '+.1f')}" for s, d in zip(pt["seeds"], seeds)) + ")")
                rows.append([p, pt["model"], _level(pt["level"]), num(pt["sink_strength"], "+.3f"), delta,
                             "n/a" if share is None else f"{share:.2f}", "yes (confound)" if pt["text_cost"] else "no"])
            pooled = (dr.get("over_seeds") or {}).get(t)
            if pooled:
                first = next(iter(pooled["per_seed"]))
                lines.append(_answer(p, t, pooled, ", over every training seed (per seed: " + ", ".join(
                    f"seed {s} {num(v, '+.2f')}" for s, v in pooled["per_seed"].items()) + ")"))
                lines.append(_answer(p, t, fit, f", training seed {first} alone"))
            else:
                lines.append(_answer(p, t, fit))
        if not rows:
            continue
        b += [("h", 3, t),
              ("table", ["pair", "model", "dose", "S before VL", "Δ pts in VL training [95% CI]", "template share",
                         "dose costs text skill"], rows),
              ("ul", lines + [_across(summary, t)])]
        fig = plots.dose_response(summary, t, out)
        if fig:
            b.append(("img", fig, f"Δ in VL training against S before it on {t}, per backbone, with the fitted line"))
    return b
