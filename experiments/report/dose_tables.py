"""The report's sink-dose section, from summary.json's per-pair `dose` block (`experiments.study.doses.dose_summary`):
per pair the undosed base and each dosed base, their Sink Strength and text skill before any VL training (Δ =
dosed − base), each dose that itself costs text skill named as a confound, and where the doses were adapted the
change VL training made (Δ = VLM LM − its own base) beside the S it started from."""

from __future__ import annotations

from evals.stats import MIN_CONCLUSIVE_N
from experiments.report.fmt import num, points, with_ci


def _level(level: dict) -> str:
    key, value = next(iter(level.items()))
    return {"shift": f"S {value:+g}", "target": f"S = {value:g}", "scale": f"logits × {value:g}"}[key]


def dose_blocks(summary: dict) -> list[tuple]:
    pairs = {p: e for p, e in summary.get("pairs", {}).items() if e.get("dose")}
    if not pairs:
        return []
    tasks = summary["tasks"]
    adapted = any("vl" in d for e in pairs.values() for d in e["dose"]["doses"].values())
    header = ["pair", "model", "dose", "logit scale", "S before VL"]
    for t in tasks:
        header += [f"{t} score", f"{t} Δ pts vs base [95% CI]"] + ([f"{t} Δ pts in VL training [95% CI]"] if adapted else [])
    rows, confounds = [], []
    for p, e in pairs.items():
        row = [p, "base", "none", "1", num(e["models"]["base"]["sink_strength"])]
        for t in tasks:
            deg = e["degradation"][t]
            row += [points(deg["before"]), "-"] + ([with_ci(deg["delta_points"], deg["delta_points_ci"], ".1f")] if adapted else [])
        rows.append(row)
        for name, d in e["dose"]["doses"].items():
            row = [p, name, _level(d["level"]), num(d["scale"], ".4g"), num(d["sink_strength"])]
            for t in tasks:
                c = d["vs_base"][t]
                row += [points(c["after"]), with_ci(c["delta_points"], c["delta_points_ci"], ".1f")
                        + (" (confound)" if t in d["text_cost"] else "")]
                if adapted:
                    vl = (d.get("vl") or {}).get("degradation", {}).get(t)
                    row.append(with_ci(vl["delta_points"], vl["delta_points_ci"], ".1f") if vl else "-")
            rows.append(row)
            confounds += [f"{p} / {name}: the dose itself costs {t} text skill before any VL training (Δ = "
                          f"{with_ci(d['vs_base'][t]['delta_points'], d['vs_base'][t]['delta_points_ci'], '.1f')} points vs the "
                          "undosed base): a confound of any dose-response read from it" for t in d["text_cost"]]
    b = [("h", 2, "Sink dose"),
         ("p", "Each dosed base is the pair's base with the query of its last layers' heads scaled until its Sink Strength "
               "reached the dose's level (docs/dose.md); nothing else in its weights differs. S before VL: the study's sink "
               "metric on the dosed base. Δ pts vs base = dosed base − base in points with a paired bootstrap CI over prompts, "
               "before any VL training (the dose's own cost)."
               + (" Δ pts in VL training = the VLM LM − the base it was adapted from (the undosed row: the pair's VLM; each "
                  "dose: the control arm's recipe from the dosed base)." if adapted else "")),
         ("table", header, rows)]
    few = sorted({t for e in pairs.values() for d in e["dose"]["doses"].values() for t, c in d["vs_base"].items()
                  if c["n"] < MIN_CONCLUSIVE_N})
    if few:
        confounds.append(f"Whether a dose costs text skill is not decided on {', '.join(few)}: fewer than {MIN_CONCLUSIVE_N} "
                         "prompts compared.")
    b.append(("ul", confounds or ["No dose costs text skill before VL training: every Δ vs base CI includes or lies above 0."]))
    return b
