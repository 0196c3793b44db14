"""What `sinkstudy merge`, `mitigate` and `merge-sweep` report about a treated pair, from the results of
their plan (`experiments.study.treat`): per treatment its Sink Strength beside the base's and the VLM LM's,
each task's recovery with its CI (or "no loss to recover") for the paper's headline metric and the other
graders, and the VL-side proxies (`measure.json`); for a sweep the table of points, its Pareto front and the
plot (text recovery against each proxy)."""

from __future__ import annotations

import math
from typing import Any

from evals.eval_run import EvalRun
from experiments.report.fmt import ci_text, finite_or_none, format_duration, num
from sinkstudy.io import save_figure_atomic

RECOVERY_CONVENTION = ("recovery = (intervened − VLM LM) / (base − VLM LM): 0 none, 1 back to base; stated only where the "
                       "base -> VLM LM loss is significant (its paired CI below 0, over at least 6 prompts), else the reason "
                       "(null): no loss to recover, loss not established, or too few prompts for any conclusion; \"below both "
                       "inputs\": the intervened model scored below the base and the VLM LM, each paired CI below 0")


def measure_summary(results: dict[str, dict], refs: dict[str, dict[str, str]], point: dict[str, str], tasks, *,
                    n_boot: int, confidence: float, seed: int) -> dict[str, Any]:
    """A treatment's measure.json: Sink Strength (base, VLM LM, it), per task the recovery with its CI for the
    paper's headline metric first, then the other graders (`also`), and the VL-side proxies."""
    # lazy: loads numpy
    from evals.stats import headline_metrics, recovery

    b, v, run = (EvalRun.load(results[s["eval"]]["dir"]) for s in (refs["base"], refs["vlm"], point))
    kw = {"n_boot": n_boot, "confidence": confidence, "seed": seed}
    rows = {}
    for task in tasks:
        head, *others = reversed(headline_metrics(b, task))  # the paper's headline first, then strict-match
        rows[task] = {**recovery_row(recovery(b, v, run, task, head, **kw)),
                      "also": {m: recovery_row(recovery(b, v, run, task, m, **kw)) for m in others}}
    sink = {label: results[s["sink"]] for label, s in (("base", refs["base"]), ("vlm", refs["vlm"]), ("value", point))}
    captions = "captions" in point
    return {
        "sink_strength": {"base": sink["base"]["value"], "vlm": sink["vlm"]["value"], "value": sink["value"]["value"],
                          "metric": sink["value"]["metric"]},
        "tasks": rows,
        "recovery": RECOVERY_CONVENTION,
        "caption_nll": ({"vlm": results[refs["vlm"]["captions"]]["caption_nll"], "value": results[point["captions"]]["caption_nll"]}
                        if captions else None),
        "weight_distance_to_vlm": results[point["distance"]]["weight_distance_to_vlm"],
    }


def recovery_row(r) -> dict[str, Any]:
    return {"metric": r.metric, "base": r.base, "vlm": r.vlm, "score": r.intervened, "recovery": finite_or_none(r.recovery),
            "ci": [finite_or_none(c) for c in r.ci], "status": r.status, "loss_points": r.loss_points,
            "loss_points_ci": list(r.loss_points_ci), "n": r.n, "vs_base_points": r.vs_base_points,
            "vs_base_ci": list(r.vs_base_ci or ()), "vs_vlm_points": r.vs_vlm_points, "vs_vlm_ci": list(r.vs_vlm_ci or ()),
            "below_both": r.below_both}


def recovery_text(row: dict[str, Any]) -> str:
    """"recovery 0.42 [0.10, 0.80]", or "no loss to recover (Δ VLM LM − base +1.2 points [−3.0, +5.0])"."""
    if row.get("status", "recovery") != "recovery":
        lo, hi = row["loss_points_ci"]
        text = f"{row['status']} (Δ VLM LM − base {row['loss_points']:+.1f} points [{lo:+.1f}, {hi:+.1f}])"
    else:
        text = f"recovery {num(row['recovery'], '.2f')} {ci_text(row['ci'], '.2f', '[n/a, n/a]')}"
    if row.get("below_both"):
        text += (f"; below both inputs (Δ vs base {row['vs_base_points']:+.1f} {ci_text(row['vs_base_ci'], '+.1f')}, "
                 f"vs VLM LM {row['vs_vlm_points']:+.1f} {ci_text(row['vs_vlm_ci'], '+.1f')} points)")
    return text


def format_measure(name: str, summary: dict[str, Any]) -> str:
    """A treatment's measurements as lines: S beside the references', then each task and grader's recovery."""
    s = summary["sink_strength"]
    lines = [f"{name}: Sink Strength ({s['metric']}) {s['value']:.3f}  [base {s['base']:.3f}, VLM LM {s['vlm']:.3f}]"]
    for task, t in summary["tasks"].items():
        for metric, row in [(t["metric"], t), *t.get("also", {}).items()]:
            lines.append(f"  {task:<18} {metric:<32} {row['score']:.3f}  [base {row['base']:.3f}, VLM LM {row['vlm']:.3f}]  "
                         f"{recovery_text(row)}")
    lines.append(f"  ({summary.get('recovery') or RECOVERY_CONVENTION})")
    return "\n".join(lines)


def recoveries(summary: dict[str, Any]) -> list[str]:
    """'<task> <metric> <recovery text>' for every task and grader of a treatment."""
    return [f"{task} {metric.removesuffix(',none')} {recovery_text(row)}" for task, t in summary["tasks"].items()
            for metric, row in [(t["metric"], t), *t.get("also", {}).items()]]


# --------------------------------------------------------------------------- a sweep

def text_recovery(row: dict[str, Any]) -> float:
    """Mean recovery over the tasks that have one (a loss to recover, a defined ratio); NaN: none has."""
    vals = [t["recovery"] for t in row["tasks"].values() if t["recovery"] is not None]
    return sum(vals) / len(vals) if vals else float("nan")


def _proxy(row: dict[str, Any], key: str):
    return row[key] if key == "weight_distance_to_vlm" else (row.get(key) or {}).get("value")


def pareto_front(rows: list[dict[str, Any]], key: str = "weight_distance_to_vlm") -> list[str]:
    """Names of points no other point beats on both: higher text recovery, lower VL proxy `key`
    (weight distance to the VLM LM, or caption NLL)."""
    pts = [(r["name"], text_recovery(r), _proxy(r, key)) for r in rows]
    pts = [p for p in pts if math.isfinite(p[1]) and p[2] is not None]  # undefined recovery: off the front
    return [n for n, rec, d in pts
            if not any((r2 >= rec and d2 <= d) and (r2 > rec or d2 < d) for _, r2, d2 in pts)]


def format_plan(points: list[dict[str, Any]], total: int, reused: set[str], seconds_per_point: float | None) -> str:
    """What the sweep will do, before it does it: the points, which are reused, the estimated time."""
    todo = [pt for pt in points if pt["name"] not in reused]
    head = f"merge sweep plan: {len(points)} point(s)" + (f" of {total}, evenly spread over the grid" if len(points) < total else "")
    lines = [f"{head}: {len(todo)} to run, {len(points) - len(todo)} reused"]
    lines += [f"  {'reused' if pt['name'] in reused else 'run':<7}{pt['name']}" for pt in points]
    if not todo:
        lines.append("estimated time: seconds (every point is reused)")
    elif seconds_per_point is None:
        lines.append("estimated time: printed once the base and VLM LM references are measured (a point ≈ one merge + one such measurement)")
    else:
        lines.append(f"estimated time: {len(todo)} × ~{format_duration(seconds_per_point)} ≈ {format_duration(len(todo) * seconds_per_point)}")
    return "\n".join(lines)


def format_sweep(rows: list[dict[str, Any]]) -> str:
    tasks = list(rows[0]["tasks"]) if rows else []
    head = ["point", "S"] + [f"{t} recovery [CI]" for t in tasks] + ["dist to VLM"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["name"], f"{r['sink_strength']['value']:.3f}"]
        cells += [_cell(r["tasks"][t]) for t in tasks]
        cells.append(f"{r['weight_distance_to_vlm']:.3f}")
        lines.append("| " + " | ".join(cells) + " |")
    if rows:
        s = rows[0]["sink_strength"]
        lines.append(f"\nSink Strength: base {s['base']:.3f}, VLM LM {s['vlm']:.3f}. {RECOVERY_CONVENTION}.")
        lines.append(f"Pareto front (recovery vs distance to VLM LM): {', '.join(pareto_front(rows))}")
    return "\n".join(lines) + "\n"


def _cell(t: dict[str, Any]) -> str:
    """A task's recovery [CI] (the headline metric), or "no loss to recover"."""
    if t.get("status", "recovery") != "recovery":
        return t["status"]
    return f"{num(t['recovery'], '.2f')} {ci_text(t['ci'], '.2f', '[n/a, n/a]')}"


def plot_pareto(rows: list[dict[str, Any]], path) -> dict[str, Any]:
    """Text recovery (mean over the tasks with a loss) against each VL-side proxy, the Pareto front
    outlined; a point without any loss to recover is left out and counted in the title. Returns what
    it drew (points and axis ranges)."""
    # lazy: loads torch, numpy
    from evals.sink.plot import axis_facts, pyplot

    plt = pyplot()
    with_ppl = any(r.get("caption_nll") for r in rows)
    fig, axes = plt.subplots(1, 2 if with_ppl else 1, figsize=(11 if with_ppl else 6, 4.5), squeeze=False)
    methods = sorted({r["method"] for r in rows})
    colors = {m: plt.cm.tab10(i % 10) for i, m in enumerate(methods)}
    proxies = [("weight_distance_to_vlm", "weight distance to VLM LM (0 = VLM, 1 = base)")]
    if with_ppl:
        proxies.append(("caption_nll", "caption NLL, text-only (lower = closer to VLM)"))
    drawn = []
    for ax, (key, label) in zip(axes[0], proxies):
        front = set(pareto_front(rows, key))
        for r in rows:
            x, y = _proxy(r, key), text_recovery(r)
            if x is None or not math.isfinite(y):
                continue
            ax.scatter(x, y, color=colors[r["method"]], edgecolor="black" if r["name"] in front else "none", s=40, label=r["method"])
            drawn.append({"proxy": key, "name": r["name"], "x": x, "y": y})
        handles, labels = ax.get_legend_handles_labels()
        if handles:
            uniq = dict(zip(labels, handles))
            ax.legend(uniq.values(), uniq.keys(), fontsize=8)
        else:
            ax.text(0.5, 0.5, "no loss to recover on any task", ha="center", va="center", transform=ax.transAxes, color="grey")
        ax.axhline(0, color="grey", lw=0.5)
        ax.axhline(1, color="grey", lw=0.5, ls="--")
        ax.set_xlabel(label)
        ax.set_ylabel("text recovery (mean over tasks with a loss)")
    without = sum(1 for r in rows if not math.isfinite(text_recovery(r)))
    fig.suptitle("Merges: text recovery vs VL-side proxy (outlined: Pareto front)"
                 + (f"; {without} point(s) without a loss to recover left out" if without else ""), fontsize=10)
    fig.tight_layout()
    save_figure_atomic(fig, path, dpi=120)
    facts = {"points": drawn, "axes": [axis_facts(ax) for ax in axes[0]]}  # as drawn: read after the save, no draw of its own
    plt.close(fig)
    return facts
