"""The study report's figures, from summary.json (matplotlib Agg; PNG + SVG side by side under OUT/plots).

Every function returns None when the summary holds nothing to draw, else a record: `path` (the PNG,
relative to the report), `svg`, and what was drawn (colour ranges, points, lines, titles), so the
report links both files and tests check that each figure follows the data it claims. Convention:
Δ = VLM LM − base in points (negative = capability lost), Δ/base relative; recovery = (intervened −
VLM LM) / (base − VLM LM).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from evals.sink.plot import pyplot, save_png_svg
from evals.stats import ci_side
from experiments.fmt import missing

# Recovery axes stop here: a CI over a loss within noise can span ±50 (a ratio of noise); clipped ends get an arrow.
RECOVERY_AXIS = (-1.5, 2.5)


def _save(fig, out: Path, name: str, **facts) -> dict[str, Any]:
    png, svg = save_png_svg(fig, out / "plots" / name)
    return {"path": os.path.relpath(png, out), "svg": os.path.relpath(svg, out), **facts}


def significant_loss(d: dict) -> bool:
    """The base -> VLM Δ's CI lies below 0 (a loss): there is something to recover."""
    return ci_side(d.get("delta_points_ci")) < 0


def _rho_text(c: dict | None, what: str, n_pairs: int) -> str:
    if not c:
        return f"ρ(S, {what}): needs ≥ 3 pairs with defined values (n = {n_pairs})"
    lo, hi = c["spearman_ci"]
    ci = "" if missing(lo) or missing(hi) else f" [{lo:+.2f}, {hi:+.2f}]"
    return f"Spearman ρ(S, {what}) = {c['spearman']:+.2f}{ci}, n = {c['n']}"


# --------------------------------------------------------------------------- sink maps and profiles

def sink_maps(summary: dict, metric: str, out: Path) -> dict[str, dict]:
    """Per pair: base / VLM LM / shift on shared scales of the study's metric (evals.sink.plot_sink_shift)."""
    from evals.sink import SinkMaps, plot_sink_shift

    figs = {}
    for p, entry in summary["pairs"].items():
        m = entry["models"]
        f = out / "plots" / f"sink_{p}.png"
        facts = plot_sink_shift(SinkMaps.from_json(m["base"]["sink_maps"]), SinkMaps.from_json(m["vlm"]["sink_maps"]), f,
                                metric=metric, names=("base", "VLM LM"), title=f"{p}: sink maps, base / VLM LM / shift")
        png, svg = facts.pop("paths")
        figs[p] = {"path": os.path.relpath(png, out), "svg": os.path.relpath(svg, out), **facts}
    return figs


def layer_profiles(summary: dict, metric: str, out: Path) -> dict[str, dict]:
    """Per pair: the per-layer sink profile of every measured model (base and VLM LM bold)."""
    from evals.sink import SinkMaps
    from evals.sink.plot import plot_layer_profiles

    figs = {}
    for p, entry in summary["pairs"].items():
        series = {("VLM LM" if label == "vlm" else label): SinkMaps.from_json(m["sink_maps"])
                  for label, m in entry["models"].items() if m.get("sink_maps")}
        f = out / "plots" / f"profile_{p}.png"
        facts = plot_layer_profiles(series, f, metric=metric, title=f"{p}: sink statistic per layer, per model",
                                    emphasise=("base", "VLM LM"))
        png, svg = facts.pop("paths")
        figs[p] = {"path": os.path.relpath(png, out), "svg": os.path.relpath(svg, out), **facts}
    return figs


# --------------------------------------------------------------------------- S vs Δ

def scatter(summary: dict, task: str, out: Path) -> dict[str, Any]:
    """S of the base against Δ points and Δ/base on `task` (two panels), pair labels, each pair's CI,
    and the across-pair Spearman ρ with its CI in each panel's title (from summary['correlation'])."""
    plt = pyplot()
    corr = (summary.get("correlation") or {}).get(task)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2))
    panels = []
    for ax, key, what, label in ((axes[0], "delta_points", "Δ points", f"Δ = VLM LM − base on {task} (points)"),
                                 (axes[1], "delta_relative", "Δ/base", f"Δ / base on {task}")):
        points = []
        for p, entry in summary["pairs"].items():
            s = entry["models"]["base"]["sink_strength"]
            d = entry["degradation"][task]
            y = d[key]
            if missing(s) or missing(y):
                continue
            points.append({"pair": p, "s": s, "y": y, "relative_defined": not missing(d["delta_relative"])})
            lo, hi = d[key + "_ci"]
            err = None if missing(lo) or missing(hi) else [[max(0.0, y - lo)], [max(0.0, hi - y)]]
            ax.errorbar([s], [y], yerr=err, fmt="o", capsize=3, color="tab:red" if entry.get("native_qk_norm") else "tab:blue")
            ax.annotate(p, (s, y), textcoords="offset points", xytext=(5, 4), fontsize=8)
        if not points:  # e.g. Δ / base where every base scores 0
            ax.text(0.5, 0.5, "undefined for every pair", ha="center", va="center", transform=ax.transAxes, color="grey")
        title = _rho_text(corr and corr[key.replace("delta_", "")], what, len(points))
        ax.set_title(title, fontsize=9)
        ax.axhline(0, color="grey", lw=0.7)
        ax.set_xlabel("Sink Strength S of the base")
        ax.set_ylabel(label)
        panels.append({"title": title, "points": points})
    fig.suptitle("Sink Strength vs change (negative = loss; red: native QK-norm). The paper: ρ > 0 in both (a stronger sink, "
                 "less loss)", fontsize=9)
    return _save(fig, out, f"scatter_{task}.png", panels=panels)


# --------------------------------------------------------------------------- recovery

def recovery(summary: dict, task: str, out: Path) -> dict[str, Any] | None:
    """Recovery per (pair, intervention) on `task` as a dot with its CI (0 = VLM LM, 1 = base);
    hollow grey where the pair's own loss is within noise (a ratio of noise)."""
    rows = []
    for p, entry in summary["pairs"].items():
        lost = significant_loss(entry["degradation"][task])
        for name, per_task in entry["interventions"].items():
            r = per_task[task]["recovery"]
            lo, hi = r["ci"] if r.get("ci") else (None, None)
            rows.append({"label": f"{p} / {name}", "value": r["recovery"], "lo": lo, "hi": hi, "lost": lost})
    if not rows:
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, max(2.5, 0.32 * len(rows) + 1.4)))
    # The axis spans the data (0 and 1 always shown), never beyond RECOVERY_AXIS.
    ends = [x for r in rows for x in (r["value"], r["lo"], r["hi"]) if not missing(x)]
    lo_ax, hi_ax = max(RECOVERY_AXIS[0], min([0.0, *ends])), min(RECOVERY_AXIS[1], max([1.0, *ends]))
    for y, r in enumerate(rows):
        colour = "tab:green" if r["lost"] else "grey"
        if missing(r["value"]):  # base and VLM scored the same: recovery is undefined
            ax.text(0.5, y, "undefined (base = VLM LM)", ha="center", va="center", fontsize=7, color="grey")
            continue
        if not missing(r["lo"]) and not missing(r["hi"]):
            a, b = max(r["lo"], lo_ax), min(r["hi"], hi_ax)
            ax.plot([a, b], [y, y], color=colour, lw=1.6)
            for end, clipped, marker in ((a, r["lo"] < lo_ax, "<"), (b, r["hi"] > hi_ax, ">")):
                if clipped:
                    ax.plot([end], [y], marker=marker, color=colour, ms=5)
        x = min(max(r["value"], lo_ax), hi_ax)
        ax.plot([x], [y], "o", ms=6, color=colour, markerfacecolor=colour if r["lost"] else "white")
    ax.axvline(0, color="black", lw=0.8)
    ax.axvline(1, color="black", lw=0.8, ls="--")
    pad = 0.05 * (hi_ax - lo_ax)
    ax.set_xlim(lo_ax - pad, hi_ax + pad)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([r["label"] for r in rows], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel(f"share of the {task} loss recovered, 95% CI (0 = VLM LM, 1 = base)")
    ax.set_title("green: the pair lost capability (Δ CI < 0); hollow grey: no significant loss (a ratio of noise);\n"
                 f"arrows: CI beyond the axis ({RECOVERY_AXIS[0]:g} to {RECOVERY_AXIS[1]:g} at most)", fontsize=7)
    return _save(fig, out, f"recovery_{task}.png", rows=rows, axis=(lo_ax, hi_ax))


# --------------------------------------------------------------------------- adaptation arms

def protect_pareto(summary: dict, task: str, out: Path) -> dict[str, Any] | None:
    """Text retention vs VL skill per adaptation arm: the score on `task` (points) against held-out
    digit accuracy, one colour per pair, the control ringed; up-right is better on both."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.6))
    points = []
    for i, (p, entry) in enumerate(summary["pairs"].items()):
        arms = (entry.get("protection") or {}).get("arms") or {}
        colour = f"C{i % 10}"
        for arm, a in arms.items():
            model = entry["models"][a["label"]]
            score = (model["scores"].get(task) or {}).get(summary["headline"].get(task) or "")
            skill = (a.get("vl_skill") or {}).get("digit_accuracy")
            if missing(score) or missing(skill):
                continue
            points.append({"pair": p, "arm": arm, "skill": skill, "score_points": 100 * score})
            ax.scatter([skill], [100 * score], color=colour, s=40, zorder=3, edgecolors="black" if arm == "control" else colour,
                       linewidths=1.5 if arm == "control" else 0.5, label=p if arm == "control" else None)
            ax.annotate(arm, (skill, 100 * score), textcoords="offset points", xytext=(4, 3), fontsize=7)
    if not points:
        plt.close(fig)
        return None
    ax.set_xlabel("VL skill: held-out digit accuracy")
    ax.set_ylabel(f"{task} score after adaptation (points)")
    ax.legend(fontsize=7, title="pair (ringed: control)", title_fontsize=7)
    ax.set_title("Text retention vs VL skill per arm (up-right is better)", fontsize=9)
    return _save(fig, out, f"protect_pareto_{task}.png", points=points)


def adaptation_trajectory(summary: dict, pair: str, out: Path) -> dict[str, Any] | None:
    """S (and each strict score measured during training) against the optimizer step, one line per
    adaptation arm (interventions.adapt.trajectory's plot)."""
    from interventions.adapt.trajectory import plot_trajectories

    arms = (summary["pairs"][pair].get("protection") or {}).get("arms") or {}
    lines = {arm: a["adapt"]["trajectory"] for arm, a in arms.items() if (a.get("adapt") or {}).get("trajectory")}
    if not lines:
        return None
    f = out / "plots" / f"protect_trajectory_{pair}.png"
    png = plot_trajectories(lines, f, title=f"{pair}: Sink Strength (and scores) of the LM during adaptation, per arm", svg=True)
    return {"path": os.path.relpath(png, out), "svg": os.path.relpath(png.with_suffix(".svg"), out), "lines": lines}


# --------------------------------------------------------------------------- the demo's backbones

def pretrain_sink_curves(curves: dict[str, list[dict]], out: Path) -> dict[str, Any] | None:
    """Sink Strength against pretraining steps, one line per backbone (the demo's build; `curves`: name ->
    [{step, S}, ...]); None when no backbone has two points."""
    lines = {k: [(p["step"], p["S"]) for p in v] for k, v in curves.items() if len(v) > 1}
    if not lines:
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for name, pts in lines.items():
        ax.plot(*zip(*pts), marker="o", ms=3, label=name)
    ax.axhline(0, color="grey", lw=0.7, ls="--")
    ax.set_xlabel("pretraining step")
    ax.set_ylabel("Sink Strength S (calibration prompts)")
    ax.legend(fontsize=7)
    return _save(fig, out, "pretrain_sink_curves.png", lines=lines)
