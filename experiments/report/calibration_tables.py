"""The report's calibration section, from summary.json's per-pair `calibration` block (`experiments.study.calibration`):
one row per point (an arm's setting × the step its model was kept at), the rule fixed before the numbers, and the
point it chooses with what it misses."""

from __future__ import annotations

from experiments.report.fmt import ci_text, num

TYPES = ("colour", "count", "digit", "shape", "where", "yes/no")


def _overrides(point: dict) -> str:
    parts = [f"{stage} " + ", ".join(f"{k} {v}" for k, v in values.items() if k != "save_models_at")
             for stage, values in point["overrides"].items()]
    parts = [p for p in parts if not p.endswith(" ")]
    return "; ".join(parts) or "the recipe's"


def _types(point: dict) -> str:
    by = point["vl_by_type"]
    return " / ".join(num(by.get(t), ".2f") for t in TYPES)


def calibration_rows(cal: dict) -> list[list[str]]:
    chosen = (cal.get("chosen") or {}).get("label")
    rows = []
    for p in cal["points"]:
        rows.append([p["arm"] + (" ◀" if p["label"] == chosen else ""), _overrides(p), f"{p['stage']} {p['stage_step']}",
                     f"{num(p['delta_points'], '+.1f')} {ci_text(p['delta_ci'], '+.1f')} ({p['lost']}/{p['gained']})",
                     num(p["template_share"], ".2f"), num(p["vl_accuracy"], ".3f"), _types(p), num(p["sink_strength"], "+.3f"),
                     num(p["train_seconds"], ".0f")])
    return rows


def calibration_blocks(summary: dict) -> list[tuple]:
    pairs = {p: e["calibration"] for p, e in summary.get("pairs", {}).items() if e.get("calibration")}
    if not pairs:
        return []
    first = next(iter(pairs.values()))
    lo, hi = first["rule"]["delta_points"]
    b = [("h", 2, "Calibration"),
         ("p", f"Every adapted model of the grid: each arm's setting at each step its model was kept. {first['convention']} "
               f"The rule, fixed before the numbers: Δ in [{lo:g}, {hi:g}] with its CI below 0, template share under "
               f"{first['rule']['template_share_below']:g}, VL accuracy at least {first['rule']['vl_accuracy_at_least']:g}; "
               "where no point meets all three, the closest (fewest criteria missed, then the highest VL accuracy, then Δ "
               "nearest the range's middle). ◀ marks the chosen point.")]
    for pair, cal in pairs.items():
        base_s = summary["pairs"][pair]["models"]["base"]["sink_strength"]
        b += [("h", 3, f"{pair} (base S {num(base_s, '+.3f')}; {cal['task']})"),
              ("table", ["arm", "changes", "step", "Δ [95% CI] (lost/gained)", "template share", "VL acc.",
                         "VL by type (" + " / ".join(TYPES) + ")", "S after", "train s"], calibration_rows(cal))]
        chosen = cal.get("chosen")
        if chosen:
            point = next(p for p in cal["points"] if p["label"] == chosen["label"])
            verdict = ("meets the rule" if chosen["meets"] else "no point of the grid meets the rule; the closest misses: "
                       + "; ".join(chosen["misses"]))
            b.append(("p", f"Chosen: {point['arm']} after {point['stage_step']} steps of {point['stage']} "
                           f"(model {chosen['label']}): {verdict}."))
        majority = next((p["vl_majority"] for p in cal["points"] if p["vl_majority"]), {})
        if majority:
            b.append(("p", "Held-out majority share per type (" + " / ".join(TYPES) + "): "
                      + " / ".join(num(majority.get(t), ".2f") for t in TYPES) + "."))
    return b
