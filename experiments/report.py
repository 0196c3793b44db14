"""report.md + report.html + plots from a study's summary.json.

The document is built once as a list of blocks (heading, paragraph, bullet list, table, image)
and rendered twice, to Markdown and to self-contained HTML (images as files beside it). The
findings section states what the numbers show, including when they do not show the paper's
effects; nothing in it is written by hand. Convention throughout: Δ = after − before in points
(score × 100; base -> VLM LM: negative = capability lost), relative = Δ / before; the paper's
direction in it is ρ(S, Δ) > 0 (experiments/data/published_choi2026.yaml).
"""

from __future__ import annotations

import html
import math
import os
from pathlib import Path

from sinkstudy.io import read_json, save_figure_atomic, write_text_atomic

CONVENTION = ("Δ = after − before in points (score × 100; base → VLM LM: negative = capability lost); "
              "Δ/before = Δ / the before score (relative)")


# --------------------------------------------------------------------------- formatting

def _nan(x) -> bool:
    return x is None or (isinstance(x, float) and math.isnan(x))


def _f(x, digits: int = 3) -> str:
    if _nan(x):
        return "n/a"
    return f"{(x or 0.0):.{digits}f}" if isinstance(x, float) else str(x)  # `or 0.0` turns -0.0 into 0.0


def _ci(ci, digits: int = 3) -> str:
    if not ci or any(_nan(v) for v in ci):
        return ""
    return f"[{(ci[0] or 0.0):.{digits}f}, {(ci[1] or 0.0):.{digits}f}]"


def _lost(d: dict) -> bool:
    """The base -> VLM Δ's CI lies below 0 (a loss): there is something to recover."""
    hi = d["delta_points_ci"][1] if d.get("delta_points_ci") else None
    return not _nan(hi) and hi < 0


def _pts(score) -> str:
    """A score in [0, 1] printed in points."""
    return "n/a" if _nan(score) else f"{100 * score:.1f}"


def _with_ci(x, ci, digits: int = 3) -> str:
    return f"{_f(x, digits)} {_ci(ci, digits)}".strip()


def _short(metric: str | None) -> str:
    return (metric or "").replace(",none", "").replace("exact_match,", "em/")


def _cell(text: str) -> str:
    """Model text inside a table cell: one line, escapes visible."""
    return repr(text)[1:-1]


def _pass(v) -> str:
    return "pass" if v else "fail"


# --------------------------------------------------------------------------- blocks -> md / html

def render_md(blocks: list[tuple]) -> str:
    out = []
    for b in blocks:
        kind = b[0]
        if kind == "h":
            out.append("#" * b[1] + " " + b[2])
        elif kind == "p":
            out.append(b[1])
        elif kind == "ul":
            out.append("\n".join(f"- {x}" for x in b[1]))
        elif kind == "table":
            header, rows = b[1], b[2]
            out.append("\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
                                 + ["| " + " | ".join(str(c).replace("|", "\\|") for c in r) + " |" for r in rows]))
        elif kind == "img":
            out.append(f"![{b[2]}]({b[1]})")
        elif kind == "code":
            out.append("```\n" + b[1] + "\n```")
    return "\n\n".join(out) + "\n"


def render_html(blocks: list[tuple], title: str) -> str:
    e = html.escape
    body = []
    for b in blocks:
        kind = b[0]
        if kind == "h":
            body.append(f"<h{b[1]}>{e(b[2])}</h{b[1]}>")
        elif kind == "p":
            body.append(f"<p>{e(b[1])}</p>")
        elif kind == "ul":
            body.append("<ul>" + "".join(f"<li>{e(x)}</li>" for x in b[1]) + "</ul>")
        elif kind == "table":
            head = "".join(f"<th>{e(h)}</th>" for h in b[1])
            rows = "".join("<tr>" + "".join(f"<td>{e(str(c))}</td>" for c in r) + "</tr>" for r in b[2])
            body.append(f"<table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>")
        elif kind == "img":
            body.append(f'<figure><img src="{e(b[1])}" alt="{e(b[2])}"><figcaption>{e(b[2])}</figcaption></figure>')
        elif kind == "code":
            body.append(f"<pre>{e(b[1])}</pre>")
    style = ("body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;line-height:1.45}"
             "table{border-collapse:collapse;margin:1em 0;font-size:.9em}td,th{border:1px solid #bbb;padding:.25em .6em;text-align:right}"
             "th{background:#eee}td:first-child,th:first-child{text-align:left}img{max-width:100%}pre{background:#f5f5f5;padding:1em;overflow:auto}")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{e(title)}</title><style>{style}</style></head>"
            f"<body>{''.join(body)}</body></html>\n")


# --------------------------------------------------------------------------- plots

def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_sink_maps(summary: dict, out: Path) -> dict[str, str]:
    """One base-vs-VLM sink-mass figure per pair (evals.sink.plot_sink_shift)."""
    from evals.sink import SinkMaps, plot_sink_shift

    paths = {}
    for p, entry in summary["pairs"].items():
        m = entry["models"]
        f = out / "plots" / f"sink_{p}.png"
        plot_sink_shift(SinkMaps.from_json(m["base"]["sink_maps"]), SinkMaps.from_json(m["vlm"]["sink_maps"]), f,
                        title=f"{p}: sink mass, base vs VLM LM")
        paths[p] = f
    return {p: os.path.relpath(f, out) for p, f in paths.items()}


def plot_scatter(summary: dict, task: str, out: Path) -> str:
    """S of the base against Δ points and against Δ / before (two panels), with the pairs' CIs."""
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(9.5, 4))
    for ax, key, label in ((axes[0], "delta_points", f"Δ = VLM LM − base on {task} (points)"),
                           (axes[1], "delta_relative", f"Δ / base on {task}")):
        shown = 0
        for p, entry in summary["pairs"].items():
            s = entry["models"]["base"]["sink_strength"]
            d = entry["degradation"][task]
            y = d[key]
            if _nan(s) or _nan(y):
                continue
            shown += 1
            lo, hi = d[key + "_ci"]
            err = None if _nan(lo) or _nan(hi) else [[max(0.0, y - lo)], [max(0.0, hi - y)]]
            ax.errorbar([s], [y], yerr=err, fmt="o", capsize=3, color="tab:red" if entry.get("native_qk_norm") else "tab:blue")
            ax.annotate(p, (s, y), textcoords="offset points", xytext=(5, 4), fontsize=8)
        if not shown:  # e.g. Δ / base where every base scores 0
            ax.text(0.5, 0.5, "undefined for every pair", ha="center", va="center", transform=ax.transAxes, color="grey")
        ax.axhline(0, color="grey", lw=0.7)
        ax.set_xlabel("Sink Strength S of the base")
        ax.set_ylabel(label)
    fig.suptitle("Sink Strength vs change (negative = loss; red: native QK-norm; the paper: rho > 0 in both)", fontsize=9)
    return _save(fig, plt, out, f"scatter_{task}.png")


def _save(fig, plt, out: Path, name: str) -> str:
    """Write the figure under OUT/plots atomically; return its path relative to the report."""
    fig.tight_layout()
    f = out / "plots" / name
    try:
        save_figure_atomic(fig, f, dpi=120)
    finally:
        plt.close(fig)
    return os.path.relpath(f, out)


def plot_recovery(summary: dict, task: str, out: Path) -> str | None:
    plt = _plt()
    bars = []
    for p, entry in summary["pairs"].items():
        for name, per_task in entry["interventions"].items():
            r = per_task[task]["recovery"]
            bars.append((f"{p}\n{name}", r["recovery"], r["ci"], _lost(entry["degradation"][task])))
    if not bars:
        return None
    fig, ax = plt.subplots(figsize=(max(5, 0.55 * len(bars) + 1.5), 4))
    xs = range(len(bars))
    vals = [0.0 if _nan(b[1]) else b[1] for b in bars]
    lows = [v if _nan(b[2][0]) else b[2][0] for v, b in zip(vals, bars)]
    highs = [v if _nan(b[2][1]) else b[2][1] for v, b in zip(vals, bars)]
    errs = [[max(0.0, v - lo) for v, lo in zip(vals, lows)], [max(0.0, hi - v) for v, hi in zip(vals, highs)]]
    # Where the pair's own Δ is within noise, recovery is a ratio of noise: grey it out.
    colours = ["tab:green" if b[3] else "lightgrey" for b in bars]
    ax.bar(xs, vals, yerr=errs, capsize=2, color=colours)
    from matplotlib.patches import Patch

    ax.legend(handles=[Patch(color="tab:green", label="pair lost capability (Δ CI < 0)"),
                       Patch(color="lightgrey", label="no significant loss: ratio of noise")], fontsize=7, loc="best")
    for x, b in zip(xs, bars):
        if _nan(b[1]):  # base and VLM scored the same: recovery is undefined
            ax.text(x, 0.02, "n/a", ha="center", va="bottom", fontsize=7, color="grey")
    ax.axhline(0, color="black", lw=0.7)
    ax.axhline(1, color="grey", lw=0.7, ls="--")
    ax.set_xticks(list(xs))
    ax.set_xticklabels([b[0] for b in bars], fontsize=6, rotation=60, ha="right")
    ax.set_ylabel(f"recovery on {task}\n(0 = VLM LM, 1 = base)")
    return _save(fig, plt, out, f"recovery_{task}.png")


def plot_protect_pareto(summary: dict, task: str, out: Path) -> str | None:
    """Text retention vs VL skill per adaptation arm: the score on `task` (points) against held-out
    digit accuracy, one colour per pair, the control ringed; up-right is better on both."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 4.6))
    shown = 0
    for i, (p, entry) in enumerate(summary["pairs"].items()):
        arms = (entry.get("protection") or {}).get("arms") or {}
        colour = f"C{i % 10}"
        for arm, a in arms.items():
            model = entry["models"][a["label"]]
            score = (model["scores"].get(task) or {}).get(summary["headline"].get(task) or "")
            skill = (a.get("vl_skill") or {}).get("digit_accuracy")
            if _nan(score) or _nan(skill):
                continue
            shown += 1
            ax.scatter([skill], [100 * score], color=colour, s=40, zorder=3, edgecolors="black" if arm == "control" else colour,
                       linewidths=1.5 if arm == "control" else 0.5, label=p if arm == "control" else None)
            ax.annotate(arm, (skill, 100 * score), textcoords="offset points", xytext=(4, 3), fontsize=7)
    if not shown:
        plt.close(fig)
        return None
    ax.set_xlabel("VL skill: held-out digit accuracy")
    ax.set_ylabel(f"{task} score after adaptation (points)")
    ax.legend(fontsize=7, title="pair (ringed: control)", title_fontsize=7)
    ax.set_title("Text retention vs VL skill per arm (up-right is better)", fontsize=9)
    return _save(fig, plt, out, f"protect_pareto_{task}.png")


def plot_protect_trajectory(summary: dict, pair: str, out: Path) -> str | None:
    """Sink Strength during adaptation, one line per arm (interventions.adapt.trajectory's plot)."""
    from interventions.adapt.trajectory import plot_trajectories

    arms = (summary["pairs"][pair].get("protection") or {}).get("arms") or {}
    lines = {arm: a["adapt"]["trajectory"] for arm, a in arms.items() if (a.get("adapt") or {}).get("trajectory")}
    if not lines:
        return None
    f = out / "plots" / f"protect_trajectory_{pair}.png"
    plot_trajectories(lines, f, title=f"{pair}: Sink Strength of the LM during adaptation, per arm")
    return os.path.relpath(f, out)


def _protection_note(where: str, name: str, stage: str, rep) -> str | None:
    """One line on what a protection chose (first sink layer, heads, the removed QK-norm), from its report."""
    if not isinstance(rep, dict):
        return None
    if "first_sink_layer" in rep:
        if rep["first_sink_layer"] is None:
            return f"{where}: {name}: {rep['note']}"
        return (f"{where}: {name} froze the layers below layer {rep['first_sink_layer']} ({rep['statistic']} >= "
                f"{rep['threshold']}; per layer {rep['per_layer']})")
    if rep.get("heads"):
        return (f"{where} ({stage}): {name} on heads "
                + ", ".join(f"L{h['layer']}H{h['head']} (S {h['strength']:.2f}, mass {h['mass']:.2f})" for h in rep["heads"]))
    if rep.get("mode") == "remove":
        return (f"{where}: QK-norm removed (Llama twin, next-token KL to the original {rep['mean_next_token_kl_to_original']:.4f}; "
                f"S {rep['sink_strength_original']:.3f} -> {rep['sink_strength_without_norm']:.3f} before any training)")
    return None


def protection_blocks(summary: dict, out: Path) -> list[tuple]:
    """The training-time protection section: per arm VL skill, S and text scores vs control and base."""
    tasks = summary["tasks"]
    pairs = {p: e for p, e in summary["pairs"].items() if e.get("protection")}
    if not pairs:
        return []
    header = ["pair", "arm", "protections", "digit acc.", "S after"]
    for t in tasks:
        header += [f"{t} score", f"{t} Δ pts vs control [95% CI]", f"{t} Δ pts vs base [95% CI]"]
    rows, notes = [], []
    for p, entry in pairs.items():
        for arm, a in entry["protection"]["arms"].items():
            skill = (a.get("vl_skill") or {}).get("digit_accuracy")
            row = [p, arm, ", ".join(a["protections"]) or "none", _f(skill), _f(a["sink_strength"])]
            for t in tasks:
                base_cmp = entry["degradation"][t] if a["label"] == "vlm" else entry["interventions"][a["label"]][t]["vs_base"]
                ctrl = (a.get("vs_control") or {}).get(t)
                row += [_pts(base_cmp["after"]), _with_ci(ctrl["delta_points"], ctrl["delta_points_ci"], 1) if ctrl else "-",
                        _with_ci(base_cmp["delta_points"], base_cmp["delta_points_ci"], 1)]
            rows.append(row)
            last = {}  # what each protection reported in the last stage it acted in
            for stage in (a.get("adapt") or {}).get("stages") or []:
                last.update({name: (stage["stage"], rep) for name, rep in (stage.get("hooks") or {}).items()})
            notes += [n for name, (stage, rep) in last.items() if (n := _protection_note(f"{p} / {arm}", name, stage, rep))]
    b = [("h", 2, "Training-time protections"),
         ("p", "Every arm adapts the same base with the same recipe, vision side, data order and seed; the control arm has no "
               "protection and its VLM is the pair's VLM above. Δ pts vs control = arm − control in points with a paired bootstrap "
               "CI over prompts (positive = the protection kept more text skill than the unprotected adaptation); Δ pts vs base "
               "= arm − base (negative = capability lost). Digit accuracy: held-out 8x8 digits, chance 0.10. S after: Sink "
               "Strength of the arm's LM."),
         ("table", header, rows)]
    if notes:
        b.append(("ul", notes))
    for t in tasks:
        f = plot_protect_pareto(summary, t, out)
        if f:
            b.append(("img", f, f"text retention on {t} vs VL skill per arm"))
    for p in pairs:
        f = plot_protect_trajectory(summary, p, out)
        if f:
            b.append(("img", f, f"{p}: Sink Strength during adaptation per arm (stage starts dashed)"))
    return b


# --------------------------------------------------------------------------- content

def _sign(c: dict, key: str) -> str:
    """The sign of one relation against the paper's (ρ > 0), read off its CI."""
    lo, hi = c[key + "_ci"]
    if _nan(c[key]) or _nan(lo) or lo <= 0 <= hi:
        return "its CI includes 0: neither the paper's sign nor the opposite is established"
    return "the sign agrees with the paper's (ρ > 0)" if lo > 0 else "the sign is opposite to the paper's (ρ < 0, CI below 0)"


def rho_finding(corr: dict, task: str) -> str:
    """The correlation sentence: both conventions, their CIs, the paper's figures in the same convention."""
    from experiments.published import load_published

    rep = load_published().reported
    pts, rel = corr["points"], corr["relative"]
    return (f"Across {corr['n']} pairs, Spearman ρ(S, Δ points on {task}) = {_f(pts['spearman'])} (CI {_ci(pts['spearman_ci']) or 'n/a'}): "
            f"{_sign(pts, 'spearman')}; ρ(S, Δ/base) = {_f(rel['spearman'])} (CI {_ci(rel['spearman_ci']) or 'n/a'}): "
            f"{_sign(rel, 'spearman')}. Convention: Δ = VLM LM − base in points, negative = capability lost; in it the paper "
            f"reports ρ = +{rep['spearman_points']:.3f} on points and +{rep['spearman_relative']:.3f} on Δ/base over six 7-8B pairs "
            "(a stronger sink, less loss). With few pairs one pair moves ρ a lot: read the CI.")


def reference_results(study) -> list[dict]:
    """The finished `build/reference/<name>` steps: real pretrained LLMs' Sink Strength (skipped ones left out)."""
    refs = []
    for name in (study.build or {}).get("references", []):
        f = study.out / "steps" / "build" / "reference" / f"{name}.json"
        res = read_json(f)["result"] if f.is_file() else None
        if res and "sink_strength" in res:
            refs.append(res)
    return refs


def miniature_sink_finding(s_base: list, refs: list[dict]) -> str:
    """Where the miniatures' S lies, said plainly, beside the real models' S measured the same way."""
    vals = [x for x in s_base if not _nan(x)]
    if not vals:
        return "No base has a defined Sink Strength."
    lo, hi = min(vals), max(vals)
    real = "; ".join(f"{r['name']}: S = {r['sink_strength']:+.2f} (mean sink mass {r['mean_mass']:.2f}, {r['layers']} layers)"
                     for r in refs)
    if hi > 0:
        head = f"Base S spans {lo:.2f} to {hi:.2f} (span {hi - lo:.2f}); {sum(x > 0 for x in vals)} of {len(vals)} bases have S > 0."
    else:
        head = (f"No miniature base reaches S > 0: base S spans {lo:.2f} to {hi:.2f} (span {hi - lo:.2f}, {len(vals)} backbones). "
                "No training recipe within the demo's budget grows a sink on the calibration prompts (docs/sinks.md); "
                "the spread comes from lr, QK-norm and noise knobs and ranks how sharply heads attend to non-BOS keys, "
                "not how strong a sink is (published S 0.24 to 2.36 for 7-8B bases).")
    return head + (f" Real-scale reference, same metric and prompts: {real}." if real else "")


def agreement_finding(corr: dict | None, s_base: list) -> str:
    """Whether the miniature agrees with the paper (ρ > 0 in the Δ = after − before convention), and why it might not."""
    why = ("Why the miniature may differ from the paper: its models have about a million parameters or fewer, pretrained for a few "
           "hundred steps on generated text, its VL task is 8x8 digits, its stage 2 mixes in text-only chats, and "
           + ("no base has a sink (S < 0 throughout), so S here measures attention sharpness rather than the sink the paper "
              "ties to text retention." if s_base and all(not _nan(x) and x < 0 for x in s_base) else
              "few pairs decide a rank correlation."))
    if not corr:
        return "Agreement with the paper cannot be judged: no correlation was computed. " + why
    signs = []
    for c in (corr["points"], corr["relative"]):
        lo, hi = c["spearman_ci"]
        signs.append("?" if _nan(lo) or _nan(hi) or lo <= 0 <= hi else "+" if lo > 0 else "-")
    if signs == ["+", "+"]:
        verdict = "The miniature agrees with the paper: ρ > 0 in both conventions, both CIs above 0."
    elif "-" in signs:
        verdict = ("The miniature disagrees with the paper: ρ < 0 with its CI below 0 in "
                   + " and ".join(k for k, x in zip(("Δ points", "Δ/base"), signs) if x == "-") + ".")
    elif "+" in signs:
        verdict = "The miniature partly agrees with the paper: ρ > 0 with a CI above 0 on one convention only."
    else:
        verdict = "The miniature neither agrees nor disagrees with the paper: both CIs include 0."
    return verdict + " " + why


def _findings(summary: dict, study) -> list[str]:
    tasks = summary["tasks"]
    head = tasks[0]
    out = []
    for p, e in summary["pairs"].items():
        d = e["degradation"][head]
        lo, hi = d["delta_points_ci"]
        sig = not _nan(lo) and (lo > 0 or hi < 0)
        direction = "lost" if d["delta_points"] < 0 else "gained" if d["delta_points"] > 0 else "kept"
        out.append(f"{p}: the VLM's LM {direction} {abs(d['delta_points']):.1f} points on {head} ({_short(d['metric'])}: "
                   f"{_pts(d['before'])} -> {_pts(d['after'])}; Δ = VLM LM − base = {_f(d['delta_points'], 1)} points, "
                   f"95% CI {_ci(d['delta_points_ci'], 1) or 'n/a'}, Δ/base {_f(d['delta_relative'])}, n={d['n']})"
                   + ("" if sig else "; the interval includes 0, so this study does not establish a change for this pair") + ".")
    s_base = [e["models"]["base"]["sink_strength"] for e in summary["pairs"].values()]
    trained = {b["name"] for b in (study.build or {}).get("backbones", []) if b["kind"] == "trained"}
    if trained:
        out.append(miniature_sink_finding([e["models"]["base"]["sink_strength"] for p, e in summary["pairs"].items() if p in trained],
                                          reference_results(study)))
    elif s_base and all(not _nan(x) and x < 0 for x in s_base):
        out.append(f"Every base has S < 0 ({', '.join(_f(x, 2) for x in s_base)}): its heads put well under half their attention on "
                   "their argmax key, i.e. these models have not formed the strong attention sink the paper measures "
                   "(published S 0.24 to 2.36 for 7-8B bases).")
    for p, e in summary["pairs"].items():
        for name, per_task in e["interventions"].items():
            if e["models"][name].get("method") in ("qknorm", "qknorm+vl"):
                c = per_task[head]["vs_base"]
                what = "injecting QK-norm" if e["models"][name]["method"] == "qknorm" else "injecting QK-norm and then the same VL training"
                out.append(f"{p}: {what} changed {head} by Δ = {_f(c['delta_points'], 1)} points against the base "
                           f"(CI {_ci(c['delta_points_ci'], 1) or 'n/a'}).")
    corr = summary.get("correlation", {}).get(head)
    if corr:
        out.append(rho_finding(corr, head))
    elif summary.get("correlation_note"):
        out.append(summary["correlation_note"] + ".")
    if trained:
        out.append(agreement_finding(corr, s_base))
    native = [e["degradation"][head]["delta_relative"] for e in summary["pairs"].values() if e.get("native_qk_norm")]
    plain = [e["degradation"][head]["delta_relative"] for e in summary["pairs"].values() if e.get("native_qk_norm") is False]
    if native and plain and not any(_nan(x) for x in native + plain):
        mn, mp = sum(native) / len(native), sum(plain) / len(plain)
        noise = not any(_lost(e["degradation"][head]) for e in summary["pairs"].values())
        out.append(f"Native QK-norm backbones: mean Δ/base {mn:+.3f} vs {mp:+.3f} without (negative = loss): "
                   + ("no pair's loss is distinguishable from 0, so this says nothing about whether QK-norm protects."
                      if noise else "the direction the paper reports (QK-norm protects)." if mn > mp else "not the direction the paper reports."))
    recovered = []
    for p, e in summary["pairs"].items():
        if not _lost(e["degradation"][head]):
            continue  # recovery of a loss within noise is a ratio of noise
        for name, per_task in e["interventions"].items():
            r = per_task[head]["recovery"]
            lo = r["ci"][0] if r["ci"] else None
            if not _nan(r["recovery"]) and not _nan(lo) and lo > 0:
                recovered.append(f"{p}/{name} ({r['recovery']:.2f}, CI {_ci(r['ci'], 2)})")
    if study.build:
        acc = {b["name"]: read_json(study.out / "steps" / "build" / "vl" / f"{b['name']}.json")["result"]["heldout"]
               for b in study.build["backbones"]}
        worst = min(a["digit_accuracy"] for a in acc.values())
        n = next(iter(acc.values()))["n_images"]
        out.append(f"VL side: held-out digit accuracy ({n} images, chance 0.10) "
                   + ", ".join(f"{k} {a['digit_accuracy']:.2f}" for k, a in acc.items()) + "; "
                   + (f"every VLM reads digits well above chance (the lowest {worst / 0.1:.1f}x chance)." if worst >= 0.2 else
                      "some VLMs read digits at most slightly better than chance: their LM was fine-tuned on image chats "
                      "(the text-side effect studied here) without becoming a capable VLM."))
    if not any(_lost(e["degradation"][head]) for e in summary["pairs"].values()):
        out.append(f"No pair lost {head} beyond noise, so recovery is not measurable here; the 'Δ pts vs base' column still shows "
                   "what each intervention costs or gains against the base.")
    else:
        out.append(("Interventions whose recovery CI on " + head + " excludes 0 (pairs with a significant loss): " + ", ".join(recovered)
                    + ". The paper found that no merge recovered IFEval.")
                   if recovered else f"No intervention's recovery CI on {head} excludes 0, as the paper found for its merges.")
    return out


def published_blocks(summary: dict) -> list[tuple]:
    """The study's pairs beside the published figures its config gives (`published:` per pair)."""
    pairs = {p: e for p, e in summary["pairs"].items() if e.get("published")}
    if not pairs:
        return []
    task = next((t for t in summary["tasks"] if "ifeval" in t), None)
    rows = []
    for p, e in pairs.items():
        pub = e["published"]
        d = e["degradation"][task] if task else None
        base = pub.get("ifeval_base")
        rows.append([p, _f(e["models"]["base"]["sink_strength"], 2), _f(pub.get("sink_strength"), 2),
                     _with_ci(d["delta_points"], d["delta_points_ci"], 1) if d else "n/a", _f(pub.get("ifeval_delta"), 1),
                     _f(d["delta_relative"]) if d else "n/a",
                     _f(pub["ifeval_delta"] / base) if base and pub.get("ifeval_delta") is not None else "n/a"])
    what = f"our {task} (headline metric)" if task else "no IFEval task in this study"
    out = [("h", 2, "Beside the published pairs"),
           ("table", ["pair", "S (ours)", "S (paper)", "Δ pts (ours) [95% CI]", "Δ pts (paper)", "Δ/base (ours)", "Δ/base (paper)"], rows),
           ("p", f"Ours: {what}; paper: IFEval prompt-level strict at 7-8B (as given in the study config). {CONVENTION}.")]
    corr = summary.get("correlation", {}).get(task) if task else None
    if corr:
        out.append(("p", rho_finding(corr, task)))
    return out


def build_blocks(study, summary: dict, out: Path) -> list[tuple]:
    tasks = summary["tasks"]
    title = study.report.get("title") or f"sinkstudy report: {study.name}"
    b: list[tuple] = [("h", 1, title)]
    b.append(("p", f"Pairs: {', '.join(summary['pairs'])}. Sink metric: {study.sink['metric']}. Strict evals through lm-eval: "
                   f"{', '.join(tasks)} (chat template {'on' if study.evals['apply_chat_template'] else 'off'}, "
                   f"max_gen_toks {study.evals['max_gen_toks']}, batch size {study.evals['batch_size']}). "
                   f"Interventions: {', '.join(i['name'] for i in study.interventions) or 'none'}. "
                   f"CIs: paired bootstrap over prompts ({study.evals['n_boot']} replicates, {study.evals['confidence']:.0%})."))
    if study.report.get("notes"):
        b.append(("p", study.report["notes"]))
    b += [("h", 2, "Findings"), ("ul", _findings(summary, study))]

    b.append(("h", 2, "Sink Strength and strict scores, base -> VLM LM"))
    header = ["pair", "QK-norm", "S base", "S VLM LM"]
    for t in tasks:
        header += [f"{t} base", f"{t} VLM", f"{t} Δ pts [95% CI]", f"{t} Δ/base", f"{t} lost/gained", f"{t} McNemar p"]
    rows = []
    for p, e in summary["pairs"].items():
        m = e["models"]
        row = [p, {True: "native", False: "none"}.get(e.get("native_qk_norm"), "?"), _f(m["base"]["sink_strength"]), _f(m["vlm"]["sink_strength"])]
        for t in tasks:
            d = e["degradation"][t]
            row += [_pts(d["before"]), _pts(d["after"]), _with_ci(d["delta_points"], d["delta_points_ci"], 1), _f(d["delta_relative"]),
                    "-" if d["lost"] is None else f"{d['lost']}/{d['gained']}", _f(d["mcnemar_p"])]
        rows.append(row)
    b.append(("table", header, rows))
    b.append(("p", "Headline metrics: " + ", ".join(f"{t}: {_short(m)}" for t, m in summary["headline"].items())
                   + f". Scores in points. {CONVENTION}. lost/gained: prompts only the base / only the VLM LM passes."))
    b += published_blocks(summary)

    if any(e["interventions"] for e in summary["pairs"].values()):
        b.append(("h", 2, "Recovery per intervention"))
        header = ["pair", "intervention", "method", "S"]
        for t in tasks:
            header += [f"{t} score", f"{t} recovery [95% CI]", f"{t} Δ pts vs base"]
        rows = []
        for p, e in summary["pairs"].items():
            for name, per_task in e["interventions"].items():
                m = e["models"][name]
                row = [p, name, m.get("method") or "", _f(m["sink_strength"])]
                for t in tasks:
                    r, c = per_task[t]["recovery"], per_task[t]["vs_base"]
                    rec = _with_ci(r["recovery"], r["ci"], 2) if _lost(e["degradation"][t]) else f"({_f(r['recovery'], 2)}: no significant loss)"
                    row += [_pts(c["after"]), rec, _with_ci(c["delta_points"], c["delta_points_ci"], 1)]
                rows.append(row)
        b.append(("table", header, rows))
        b.append(("p", "recovery = (intervened - VLM LM) / (base - VLM LM): 0 = no better than the VLM's LM, 1 = back to the base; "
                       "undefined (n/a) when base and VLM score the same, and shown in parentheses when the pair's Δ CI includes 0 "
                       "(a ratio of noise). 'Δ pts vs base' = intervened − base in points with its CI. "
                       "qknorm rows are the injected base (text-only cost of the injection); qknorm-vl rows are the LM of a VLM "
                       "trained from the injected base with the same VL recipe (the paper's experiment)."))

    b += protection_blocks(summary, out)

    examples = [(p, x) for p, e in summary["pairs"].items() for x in e.get("examples") or []]
    if examples:
        b.append(("h", 2, f"Example outputs on {tasks[0]} (prompts the base passes and the VLM LM fails, where any)"))
        b.append(("table", ["pair", "doc", "prompt", "base output", "VLM LM output"],
                  [[p, x["doc_id"], _cell(x["prompt"]), f"{_cell(x['base'])} ({_pass(x['base_pass'])})", f"{_cell(x['vlm'])} ({_pass(x['vlm_pass'])})"]
                   for p, x in examples]))

    b.append(("h", 2, "Plots"))
    for p, f in plot_sink_maps(summary, out).items():
        b.append(("img", f, f"{p}: sink mass per layer and head, base / VLM LM / difference"))
    for t in tasks:
        b.append(("img", plot_scatter(summary, t, out), f"Sink Strength of the base vs Δ points and Δ/base on {t} (negative = loss)"))
        rec = plot_recovery(summary, t, out)
        if rec:
            b.append(("img", rec, f"recovery per intervention on {t}, with 95% CIs"))

    if study.build:
        b += _build_blocks(study, out)
    b += [("h", 2, "Caveats"), ("ul", [
        "lm-eval's strict graders are kept as they are: GSM8K-CoT strict-match 'The answer is (\\-?[0-9\\.\\,]+).' has an "
        "unescaped final '.', IFEval strict fails a one-line preamble that loose accepts (docs/evals.md).",
        "Small prompt sets give wide intervals; read the CIs before the point estimates.",
        "A rank correlation over few pairs is fragile: one pair moves it a lot.",
    ])]
    prov = (summary.get("provenance") or {})
    b += [("h", 2, "Provenance"), ("p", f"config: {study.path}; output: {study.out}; seed: {study.seed}. "
                                         "Every step's JSON under steps/ carries the config, seeds, package versions and model fingerprints."),
          ("code", "\n".join(f"{k}: {v}" for k, v in (prov.get("versions") or {}).items())),
          ("p", "seconds per stage in the run that wrote this report (0 = reused): "
                + ", ".join(f"{k} {v}" for k, v in summary.get("timings", {}).items()))]
    return b


def _knobs(bb: dict) -> str:
    """What a trained backbone's recipe sets beyond its shape: lr, weight decay, data mix."""
    if bb.get("kind") == "pretrained":
        return f"pretrained: {bb['pretrained']}"
    mix = [f"{k.replace('_share', '').replace('_rate', '')} {bb[k]:g}"
           for k in ("backcopy_share", "retrieval_share", "noise_share", "sprinkle_rate") if bb.get(k)]
    return f"lr {bb['lr']:g}, wd {bb['weight_decay']:g}" + (f", {', '.join(mix)}" if mix else "")


def plot_pretrain_curves(curves: dict[str, list[dict]], out: Path) -> str | None:
    """S against pretraining steps, one line per backbone."""
    curves = {k: v for k, v in curves.items() if len(v) > 1}
    if not curves:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for name, pts in curves.items():
        ax.plot([p["step"] for p in pts], [p["S"] for p in pts], marker="o", ms=3, label=name)
    ax.axhline(0, color="grey", lw=0.7, ls="--")
    ax.set_xlabel("pretraining step")
    ax.set_ylabel("Sink Strength S (calibration prompts)")
    ax.legend(fontsize=7)
    return _save(fig, plt, out, "pretrain_sink_curves.png")


def _build_blocks(study, out: Path) -> list[tuple]:
    steps = study.out / "steps" / "build"
    rows, curves = [], {}
    for bb in study.build["backbones"]:
        pre = read_json(steps / "pretrain" / f"{bb['name']}.json")["result"]
        vl = read_json(steps / "vl" / f"{bb['name']}.json")["result"]
        curve = pre.get("sink_curve") or []
        curves[bb["name"]] = curve
        shape = (f"{bb['num_hidden_layers']}x{bb['hidden_size']}, {bb['num_attention_heads']} heads"
                 if bb.get("kind") != "pretrained" else "")
        rows.append([bb["name"], bb.get("family", bb.get("pretrained")), "native" if bb["native_qk_norm"] else "none", shape,
                     _knobs(bb), pre.get("params"), pre.get("steps", "-"),
                     " → ".join(_f(curve[i]["S"], 2) for i in (0, -1)) if len(curve) > 1 else "-",
                     _f(pre.get("final_loss")), _f(vl["stages"]["stage1"]["final_loss"]), _f(vl["stages"]["stage2"]["final_loss"]),
                     sum(vl.get("n_text_chats", {}).values()), _f(vl["heldout"]["digit_accuracy"]), _f(vl["heldout"]["answer_ppl"], 2)])
    corpus = read_json(steps / "corpus.json")["result"]
    vl_cfg = study.build["vl"]
    b = [("h", 2, "How the miniature pairs were built"),
         ("p", f"Corpus: {corpus['train_records']} procedurally generated records ({corpus['kinds']['chat']} chats with strict-format "
               f"instructions, arithmetic and plain requests; {corpus['kinds']['plain']} plain stories); held-out evals: "
               f"{corpus['heldout_ifeval']} IFEval-schema prompts and {corpus['heldout_gsm']} GSM-schema problems on entities the "
               "corpus never shows. Tokenizer: byte-level BPE trained on the corpus. Every backbone is a config entry (a "
               "sinkgrow recipe: family, shape, steps, lr, weight decay, data mix; docs/sinks.md) pretrained from scratch on that "
               "corpus through the engine's text path. VL adaptation through the engine: LLaVA "
               "(LlavaForConditionalGeneration, tiny CLIP tower frozen at random init) on scikit-learn's 8x8 digits, "
               f"stage 1 projector ({vl_cfg['stage1']['steps']} steps), stage 2 projector+LM ({vl_cfg['stage2']['steps']} steps, "
               f"{vl_cfg['stage2'].get('text_share', 0):.0%} of its examples text-only chats from the pretraining corpus, as "
               "LLaVA-665K mixes ShareGPT text into its stage 2), loss on answers only. Held-out digit accuracy: the most "
               f"likely of the ten answers 'It is a d.' on {vl_cfg['heldout_images']} unseen images (chance 0.10)."),
         ("table", ["backbone", "family", "QK-norm", "shape", "knobs", "params", "pretrain steps", "S step 0 → end", "pretrain loss",
                    "VL stage-1 loss", "VL stage-2 loss", "text chats in VL", "held-out digit acc.", "answer ppl"], rows)]
    plot = plot_pretrain_curves(curves, out)
    if plot:
        b.append(("img", plot, "Sink Strength of each backbone against pretraining steps"))
    refs = reference_results(study)
    if refs:
        b += [("h", 2, "Real-scale reference"),
              ("table", ["model", "source", "QK-norm", "layers", "S", "mean sink mass"],
               [[r["name"], r["source"], "native" if r["native_qk_norm"] else "none", r["layers"], _f(r["sink_strength"]),
                 _f(r["mean_mass"])] for r in refs]),
              ("p", "The same Sink Strength (metric, prompts, layers) as the miniatures' S, on a real pretrained LLM: what a "
                    "formed attention sink reads as on this scale. A reference, not a pair (it is not adapted in `make demo`; "
                    "`make demo-real` adapts it).")]
    return b


def write_report(study, summary: dict) -> Path:
    """Write report.md, report.html and plots/ under the study's output dir; return report.md's path."""
    from sinkstudy.provenance import provenance

    out = Path(study.out)
    summary = {**summary, "provenance": provenance()}
    blocks = build_blocks(study, summary, out)
    title = blocks[0][2]
    md = write_text_atomic(out / "report.md", render_md(blocks))
    write_text_atomic(out / "report.html", render_html(blocks, title))
    return md
