"""The study report's figures, from summary.json (matplotlib Agg; PNG + SVG side by side under OUT/plots).

Every function returns None when the summary holds nothing to draw, else a record: `path` (the PNG,
relative to the report), `svg`, and what was drawn (colour and axis ranges, points, lines, titles),
so the report links both files and tests check that each figure follows the data it claims. Every figure is
drawn whenever the report is written: a figure is no result, and nothing of it is kept to be reused.
Convention: Δ = VLM LM − base in points (negative = capability lost), Δ/base relative; recovery =
(intervened − VLM LM) / (base − VLM LM), stated only where the pair lost capability significantly.
Colours: blue marks a measured value, grey what has no number; no colour means "good" or "bad".
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from evals.sink import SinkMaps, plot_sink_shift
from evals.sink.plot import axis_facts, plot_layer_profiles, pyplot, save_png_svg
from evals.stats import ci_side
from experiments.report.fmt import ci_text, missing, num
from experiments.report.results import vl_accuracy
from interventions.adapt.trajectory_plot import plot_trajectories

# Recovery axes stop here: a CI over a small loss can span ±50; whatever lies beyond gets an arrow.
RECOVERY_AXIS = (-1.5, 2.5)
COLOUR = "tab:blue"  # a measured value; grey: no number


def _save(fig, out: Path, name: str, **facts) -> dict[str, Any]:
    def read(drawn):
        facts["axes"] = [axis_facts(ax) for ax in drawn.axes if ax.get_label() != "<colorbar>"]

    png, svg = save_png_svg(fig, out / "plots" / name, on_drawn=read)
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
    """Recovery per (pair, intervention) on `task` as a dot with its CI (0 = VLM LM, 1 = base), in one
    colour; where the pair lost nothing significant, the reason in words (no loss to recover, loss not
    established, too few prompts: `evals.stats.Recovery.status`) and no number.
    Whatever lies beyond the axis is marked: a CI end by an arrow at the edge, an estimate by an
    arrow-head in place of its dot with its value written beside it."""
    rows = []
    for p, entry in summary["pairs"].items():
        lost = significant_loss(entry["degradation"][task])
        for name, per_task in entry["interventions"].items():
            r = per_task[task]["recovery"]
            lo, hi = r["ci"] if r.get("ci") else (None, None)
            status = r.get("status") or ("recovery" if lost else "no loss to recover")
            rows.append({"label": f"{p} / {name}", "value": r["recovery"] if status == "recovery" else None,
                         "lo": lo, "hi": hi, "status": status})
    if not rows:
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, max(2.5, 0.32 * len(rows) + 1.4)))
    # The axis spans the data (0 and 1 always shown), never beyond RECOVERY_AXIS.
    ends = [x for r in rows if r["status"] == "recovery" for x in (r["value"], r["lo"], r["hi"]) if not missing(x)]
    lo_ax, hi_ax = max(RECOVERY_AXIS[0], min([0.0, *ends])), min(RECOVERY_AXIS[1], max([1.0, *ends]))
    pad = 0.05 * (hi_ax - lo_ax)
    for y, r in enumerate(rows):
        r["marks"] = []
        if r["status"] != "recovery":
            ax.text(0.5, y, r["status"], ha="center", va="center", fontsize=7, color="grey")
            continue
        if missing(r["value"]):  # base and VLM scored the same in every resample: recovery is undefined
            ax.text(0.5, y, "undefined (base = VLM LM)", ha="center", va="center", fontsize=7, color="grey")
            continue
        if not missing(r["lo"]) and not missing(r["hi"]):
            a, b = max(r["lo"], lo_ax), min(r["hi"], hi_ax)
            ax.plot([a, b], [y, y], color=COLOUR, lw=1.6)
            for end, clipped, marker in ((a, r["lo"] < lo_ax, "<"), (b, r["hi"] > hi_ax, ">")):
                if clipped:  # drawn beyond the axis edge, so an estimate there never hides it
                    ax.plot([end - pad / 2 if marker == "<" else end + pad / 2], [y], marker=marker, color=COLOUR, ms=5,
                            clip_on=False)
                    r["marks"].append(f"ci {marker}")
        x = min(max(r["value"], lo_ax), hi_ax)
        if x != r["value"]:  # the estimate itself lies beyond the axis: an arrow-head and its value
            ax.plot([x], [y], marker="<" if x == lo_ax else ">", ms=8, color=COLOUR)
            ax.annotate(f"{r['value']:.2f}", (x, y), textcoords="offset points", xytext=(8 if x == lo_ax else -8, 5),
                        ha="left" if x == lo_ax else "right", fontsize=7, color=COLOUR)
            r["marks"].append("estimate")
        else:
            ax.plot([x], [y], "o", ms=6, color=COLOUR)
    ax.axvline(0, color="black", lw=0.8)
    ax.axvline(1, color="black", lw=0.8, ls="--")
    ax.set_xlim(lo_ax - pad, hi_ax + pad)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([r["label"] for r in rows], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel(f"share of the {task} loss recovered, 95% CI (0 = VLM LM, 1 = base)")
    ax.set_title("recovery where the pair lost capability (Δ CI < 0); where not, the reason in words and no number;\n"
                 f"arrows: beyond the axis ({RECOVERY_AXIS[0]:g} to {RECOVERY_AXIS[1]:g} at most), with the estimate's value",
                 fontsize=7)
    return _save(fig, out, f"recovery_{task}.png", rows=rows, axis=(lo_ax, hi_ax))


def recovery_vs_vl_cost(summary: dict, task: str, out: Path) -> dict[str, Any] | None:
    """Per (pair, intervention) with a VL skill: text recovery on `task` (y, with its CI where the pair lost capability
    significantly) against Δ VL = its held-out VL accuracy − the VLM's in points (x: its LM put back into the VLM).
    Where recovery has no number (no significant loss, undefined), the point sits on the x axis in grey, named."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.6))
    points = []
    for p, entry in summary["pairs"].items():
        lost = significant_loss(entry["degradation"][task])
        for name, cost in (entry.get("vl_cost") or {}).items():
            if name not in entry["interventions"]:
                continue  # arms and doses: their own VLMs, not a treated LM
            r = entry["interventions"][name][task]["recovery"]
            value = r["recovery"] if lost and (r.get("status") or "recovery") == "recovery" and not missing(r["recovery"]) else None
            lo, hi = r["ci"] if value is not None and r.get("ci") else (None, None)
            x = cost["delta_points"]
            points.append({"pair": p, "intervention": name, "vl_delta_points": x, "recovery": value, "lo": lo, "hi": hi})
            if value is None:
                ax.plot([x], [0], "o", ms=6, color="grey", mfc="none")
                ax.annotate(f"{p} / {name} (no recovery number)", (x, 0), textcoords="offset points", xytext=(4, -10), fontsize=7,
                            color="grey")
                continue
            if not missing(lo) and not missing(hi):
                ax.plot([x, x], [max(lo, RECOVERY_AXIS[0]), min(hi, RECOVERY_AXIS[1])], color=COLOUR, lw=1.4)
            ax.plot([x], [min(max(value, RECOVERY_AXIS[0]), RECOVERY_AXIS[1])], "o", ms=6, color=COLOUR)
            ax.annotate(f"{p} / {name}", (x, value), textcoords="offset points", xytext=(4, 3), fontsize=7)
    if not points:
        plt.close(fig)
        return None
    ax.axhline(0, color="black", lw=0.8)
    ax.axhline(1, color="black", lw=0.8, ls="--")
    ax.axvline(0, color="black", lw=0.8)
    ax.set_xlabel("Δ VL = held-out VL accuracy − the VLM's (points; its LM in the VLM's tower and projector)")
    ax.set_ylabel(f"share of the {task} loss recovered (0 = VLM LM, 1 = base)")
    ax.set_title("Text recovery vs VL cost per intervention (up: text back; left: VL skill lost)", fontsize=9)
    return _save(fig, out, f"recovery_vl_cost_{task}.png", points=points)


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
            skill = vl_accuracy(a.get("vl_skill"))
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
    arms = (summary["pairs"][pair].get("protection") or {}).get("arms") or {}
    lines = {arm: a["adapt"]["trajectory"] for arm, a in arms.items() if (a.get("adapt") or {}).get("trajectory")}
    if not lines:
        return None
    f = out / "plots" / f"protect_trajectory_{pair}.png"
    drawn = plot_trajectories(lines, f, title=f"{pair}: Sink Strength (and scores) of the LM during adaptation, per arm", svg=True)
    return {"path": os.path.relpath(drawn["path"], out), "svg": os.path.relpath(drawn["svg"], out), "lines": lines,
            "axes": drawn["axes"]}


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


# --------------------------------------------------------------------------- dose-response

def dose_response(summary: dict, task: str, out: Path) -> dict[str, Any] | None:
    """Per pair with a dose-response on `task` (`experiments.study.dose_response`), one panel: Δ in VL training (the
    VLM LM − the base it was adapted from, points, with its CI) against S of that base before it, the undosed base
    ringed, a dose that itself costs text skill hollow, and the fitted line; the slope, its CI and the answer in the
    title."""
    pairs = {p: e["dose_response"]["tasks"][task] for p, e in summary["pairs"].items()
             if task in ((e.get("dose_response") or {}).get("tasks") or {})}
    if not pairs:
        return None
    plt = pyplot()
    fig, axes = plt.subplots(1, len(pairs), figsize=(max(7.0, 5.4 * len(pairs)), 4.8), squeeze=False)
    panels = []
    for ax, (p, dr) in zip(axes[0], pairs.items()):
        pooled = (summary["pairs"][p]["dose_response"].get("over_seeds") or {}).get(task)
        shown = pooled or dr
        xs = [pt["sink_strength"] for pt in dr["points"]]
        for pt in dr["points"]:
            x, y = pt["sink_strength"], pt["delta_points"]
            lo, hi = pt["delta_points_ci"] or (None, None)  # a mean over seeds carries no CI: its seeds are drawn instead
            err = None if missing(lo) or missing(hi) else [[max(0.0, y - lo)], [max(0.0, hi - y)]]
            per_seed = pt.get("delta_points_per_seed") or []
            if len(per_seed) > 1:
                ax.plot([x] * len(per_seed), per_seed, "x", color=COLOUR, ms=5)
            ax.errorbar([x], [y], yerr=err, fmt="o", capsize=3, color=COLOUR, mfc="none" if pt["text_cost"] else COLOUR,
                        mec="black" if pt["model"] == "base" else COLOUR, ms=7)
            ax.annotate(pt["model"], (x, y), textcoords="offset points", xytext=(5, 4), fontsize=7)
        line = None
        if not missing(shown["slope"]):
            lo_x, hi_x = min(xs), max(xs)
            line = [[lo_x, shown["intercept"] + shown["slope"] * lo_x], [hi_x, shown["intercept"] + shown["slope"] * hi_x]]
            ax.plot([lo_x, hi_x], [line[0][1], line[1][1]], color="black", lw=1, ls="--")
        seeds = f", {shown['n_seeds']} seeds" if shown["n_seeds"] > 1 else ""
        title = (f"{p}: slope {num(shown['slope'], '+.2f')} {ci_text(shown['slope_ci'], '+.2f')} pts per unit S{seeds}\n"
                 f"a stronger sink, less loss? {shown['answer']}")
        ax.set_title(title, fontsize=8)
        ax.axhline(0, color="grey", lw=0.7)
        ax.set_xlabel("Sink Strength S of the base before VL training")
        ax.set_ylabel(f"Δ in VL training on {task} (points)")
        panels.append({"pair": p, "points": [[pt["sink_strength"], pt["delta_points"]] for pt in dr["points"]], "line": line,
                       "title": title})
    fig.suptitle("Dose-response: Δ = VLM LM − the base it was adapted from, against that base's S; the paper's direction: "
                 "slope > 0\n(ringed: the undosed base; hollow: a dose that itself costs text skill; x: each training seed of a point "
                 "with several, the dot their mean; dashed: least squares)", fontsize=8)
    return _save(fig, out, f"dose_response_{task}.png", panels=panels)
