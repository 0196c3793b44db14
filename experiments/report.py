"""report.md + report.html + plots from a study's summary.json.

The document is built once as a list of blocks (heading, paragraph, bullet list, table, image,
links, example) and rendered twice, to Markdown and to self-contained HTML (images as files
beside it). It opens with one verdict line per study question the summary holds (number, CI,
convention), then the paper's figures beside ours, then the details; parts without data are left
out. Every sentence states what the numbers show, including when they do not show the paper's
effects; nothing in it is written by hand. Figures: `experiments.plots`. Convention throughout: Δ = after − before in points
(score × 100; base -> VLM LM: negative = capability lost), relative = Δ / before; the paper's
direction in it is ρ(S, Δ) > 0 (experiments/data/published_choi2026.yaml).
"""

from __future__ import annotations

import html
import re
from pathlib import Path

from experiments import plots
from experiments.plots import missing as _nan, significant_loss as _lost
from sinkstudy.io import read_json, write_text_atomic
from sinkstudy.provenance import describe_hardware

CONVENTION = ("Δ = after − before in points (score × 100; base → VLM LM: negative = capability lost); "
              "Δ/before = Δ / the before score (relative)")


# --------------------------------------------------------------------------- formatting

def _f(x, digits: int = 3) -> str:
    if _nan(x):
        return "n/a"
    return f"{(x or 0.0):.{digits}f}" if isinstance(x, float) else str(x)  # `or 0.0` turns -0.0 into 0.0


def _ci(ci, digits: int = 3) -> str:
    if not ci or any(_nan(v) for v in ci):
        return ""
    return f"[{(ci[0] or 0.0):.{digits}f}, {(ci[1] or 0.0):.{digits}f}]"


def _pts(score) -> str:
    """A score in [0, 1] printed in points."""
    return "n/a" if _nan(score) else f"{100 * score:.1f}"


def _with_ci(x, ci, digits: int = 3) -> str:
    return f"{_f(x, digits)} {_ci(ci, digits)}".strip()


def _short(metric: str | None) -> str:
    return (metric or "").replace(",none", "").replace("exact_match,", "em/")


# --------------------------------------------------------------------------- blocks -> md / html
# Blocks: ("h", level, text), ("p", text), ("ul", [text]), ("table", header, rows), ("code", text),
# ("img", {"path", "svg", ...}, caption), ("links", [(text, href)]), ("example", {...} from `_example`).

def _fence(text: str) -> str:
    return "```text\n" + text.replace("```", "ʼʼʼ") + "\n```"


def _example_md(x: dict) -> str:
    return "\n\n".join([f"**{x['title']}**", "Prompt (the user's message, chat markup removed):", _fence(x["prompt"]),
                        f"Expected: {x['expected']}"]
                       + [f"{who}: **{verdict}**\n\n{_fence(text)}" for who, text, verdict in x["outputs"]])


def _example_html(x: dict) -> str:
    e = html.escape
    outputs = "".join(f"<dt>{e(who)}: <b>{e(verdict)}</b></dt><dd><pre class='text'>{e(text)}</pre></dd>"
                      for who, text, verdict in x["outputs"])
    return (f"<div class='example'><h4>{e(x['title'])}</h4><dl><dt>Prompt (the user's message, chat markup removed)</dt>"
            f"<dd><pre class='text'>{e(x['prompt'])}</pre></dd><dt>Expected</dt><dd>{e(x['expected'])}</dd>{outputs}</dl></div>")


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
            out.append(f"![{b[2]}]({b[1]['path']})\n\n*{b[2]}* ([PNG]({b[1]['path']}), [SVG]({b[1]['svg']}))")
        elif kind == "links":
            out.append("\n".join(f"- [{text}]({href})" for text, href in b[1]))
        elif kind == "example":
            out.append(_example_md(b[1]))
        elif kind == "code":
            out.append("```\n" + b[1] + "\n```")
    return "\n\n".join(out) + "\n"


STYLE = ("body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;line-height:1.45}"
         ".table{overflow-x:auto;max-width:100%;margin:1em 0}"  # wide tables scroll inside their box, not the page
         "table{border-collapse:collapse;font-size:.9em}td,th{border:1px solid #bbb;padding:.25em .6em;text-align:right;"
         "vertical-align:top}th{background:#eee}td:first-child,th:first-child{text-align:left}"
         "img{max-width:100%}figure{margin:1.5em 0}figcaption{font-size:.9em;color:#444}"
         "pre{background:#f5f5f5;padding:1em;overflow:auto}pre.text{white-space:pre-wrap;word-break:break-word;padding:.5em;margin:.2em 0}"
         ".example{border:1px solid #ddd;padding:.5em 1em;margin:1em 0}dd{margin-left:1em}")


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
            body.append(f"<div class='table'><table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table></div>")
        elif kind == "img":
            f = b[1]
            body.append(f'<figure><a href="{e(f["path"])}"><img src="{e(f["path"])}" alt="{e(b[2])}"></a>'
                        f'<figcaption>{e(b[2])} (<a href="{e(f["path"])}">PNG</a>, <a href="{e(f["svg"])}">SVG</a>)</figcaption></figure>')
        elif kind == "links":
            body.append("<ul>" + "".join(f'<li><a href="{e(href)}">{e(text)}</a></li>' for text, href in b[1]) + "</ul>")
        elif kind == "example":
            body.append(_example_html(b[1]))
        elif kind == "code":
            body.append(f"<pre>{e(b[1])}</pre>")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{e(title)}</title><style>{STYLE}</style></head>"
            f"<body>{''.join(body)}</body></html>\n")


# --------------------------------------------------------------------------- adaptation arms

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
        f = plots.protect_pareto(summary, t, out)
        if f:
            b.append(("img", f, f"text retention on {t} vs VL skill per arm"))
    for p in pairs:
        f = plots.adaptation_trajectory(summary, p, out)
        if f:
            b.append(("img", f, f"{p}: Sink Strength (and scores, where measured) during adaptation per arm (stage starts dashed)"))
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


# --------------------------------------------------------------------------- verdicts (the report's first screen)

PAPER_DIRECTION = ("Δ = VLM LM − base in points (negative = capability lost), Δ/base = Δ / the base's score; in this "
                   "convention the paper's direction is ρ > 0 (a stronger sink, less loss)")


def _side(ci) -> int:
    """+1: the CI lies above 0, -1: below 0, 0: it includes 0 (or is undefined)."""
    if not ci or any(_nan(v) for v in ci):
        return 0
    return 1 if ci[0] > 0 else -1 if ci[1] < 0 else 0


def _ci_words(ci) -> str:
    return {1: "CI above 0", -1: "CI below 0", 0: "CI includes 0"}[_side(ci)]


def _pts_ci(c: dict) -> str:
    """A comparison's Δ in points with its CI, signed."""
    lo, hi = c["delta_points_ci"] or (None, None)
    ci = "" if _nan(lo) or _nan(hi) else f" [{lo:+.1f}, {hi:+.1f}]"
    return f"{c['delta_points']:+.1f} pts{ci}" if not _nan(c["delta_points"]) else "n/a"


def _rel_ci(c: dict) -> str:
    lo, hi = c["delta_relative_ci"] or (None, None)
    ci = "" if _nan(lo) or _nan(hi) else f" [{lo:+.3f}, {hi:+.3f}]"
    return f"{c['delta_relative']:+.3f}{ci}" if not _nan(c["delta_relative"]) else "n/a (base scores 0)"


def _rho(c: dict) -> str:
    lo, hi = c["spearman_ci"]
    return f"{c['spearman']:+.3f}" + ("" if _nan(lo) or _nan(hi) else f" [{lo:+.3f}, {hi:+.3f}]")


def _kind(method: str | None) -> str:
    """What an intervention is, from its method: qknorm / qknorm+vl / protection / merge / mitigation."""
    if method in ("qknorm", "qknorm+vl", "protection"):
        return method
    from interventions.merge import MERGEKIT_METHODS
    from interventions.spectral import SPECTRAL_METHODS

    return "merge" if method in MERGEKIT_METHODS or method in SPECTRAL_METHODS else "mitigation"


def _by_kind(summary: dict, kind: str) -> dict[str, dict[str, dict]]:
    """{intervention name: {pair: per-task results}} of one kind, in the summary's order."""
    out: dict[str, dict[str, dict]] = {}
    for p, e in summary["pairs"].items():
        for name, per_task in e["interventions"].items():
            if _kind(e["models"][name].get("method")) == kind:
                out.setdefault(name, {})[p] = per_task
    return out


def _paper_task(summary: dict) -> str:
    """The task set beside the paper's IFEval figures: the study's IFEval-like task, else its first."""
    return next((t for t in summary["tasks"] if "ifeval" in t), summary["tasks"][0])


def _verdict_sink(summary: dict) -> list[str]:
    from experiments.published import load_published

    rep = load_published().reported
    out = []
    for t in summary["tasks"]:
        corr = (summary.get("correlation") or {}).get(t)
        if not corr:
            continue
        pts, rel = corr["points"], corr["relative"]
        answer = {1: "yes, in the paper's direction", -1: "no: the opposite of the paper's direction",
                  0: "not established"}[_side(pts["spearman_ci"])]
        out.append(f"Does S track degradation on {t}? {answer}: Spearman ρ(S, Δ points) = {_rho(pts)} ({_ci_words(pts['spearman_ci'])}), "
                   f"ρ(S, Δ/base) = {_rho(rel)} ({_ci_words(rel['spearman_ci'])}); {corr['n']} pairs, {corr['confidence']:.0%} CIs "
                   f"resampling pairs; Δ = VLM LM − base in points (negative = capability lost). The paper, same convention: "
                   f"ρ = {rep['spearman_points']:+.3f} on points and {rep['spearman_relative']:+.3f} on Δ/base over six 7-8B pairs "
                   "(ρ > 0: a stronger sink, less loss).")
    return out


def _verdict_qknorm(summary: dict) -> list[str]:
    from experiments.published import load_published

    q = load_published().qknorm_injection
    t = summary["tasks"][0]
    native = [(p, e["degradation"][t]) for p, e in summary["pairs"].items() if e.get("native_qk_norm")]
    out = []
    for name, per_pair in _by_kind(summary, "qknorm+vl").items():
        for p, per_task in per_pair.items():
            c, vb = per_task[t].get("vs_vlm"), per_task[t]["vs_base"]
            if c is None:  # a summary from before vs_vlm: the recovery is the same paired comparison, normalised
                r = per_task[t]["recovery"]
                control, side = f"recovery {_with_ci(r['recovery'], r['ci'], 2)}", _side(r["ci"])
            else:
                control, side = f"Δ = {name} − VLM LM = {_pts_ci(c)}", _side(c["delta_points_ci"])
            answer = {1: "yes, against the control", -1: "no: it lost more than the control", 0: "not established against the control"}[side]
            line = (f"Does injected QK-norm protect {p} on {t}? {answer}: {control} (the control: the same VL recipe on the "
                    f"uninjected base; positive = the injection kept more text skill); against the base Δ/base = {_rel_ci(vb)}")
            if native:
                line += "; native QK-norm pairs: " + ", ".join(f"{n} Δ/base = {_rel_ci(d)}" for n, d in native)
            if q:
                line += (f". The paper: no ({q['base']} with injected QK-norm scored IFEval {q['ifeval_after']:g} after VL training "
                         f"vs {q['ifeval_base']:g} for the base, Δ/base = {(q['ifeval_after'] - q['ifeval_base']) / q['ifeval_base']:+.3f})")
            out.append(line + ".")
    return out


def _verdict_merges(summary: dict) -> list[str]:
    """Per merge: the share of each significant loss it recovered, with its CI."""
    from experiments.published import load_published

    m = load_published().merges
    paper = f" The paper: none of its {len(m['tried'])} merges recovered IFEval." if m else ""
    out, unmeasurable = [], []
    for name, per_pair in _by_kind(summary, "merge").items():
        parts, above = [], 0
        for p, per_task in per_pair.items():
            for t in summary["tasks"]:
                if not _lost(summary["pairs"][p]["degradation"][t]):
                    continue  # recovery of a loss within noise is a ratio of noise
                r = per_task[t]["recovery"]
                above += _side(r["ci"]) > 0
                parts.append(f"{p} {t} {_with_ci(r['recovery'], r['ci'], 2)}")
        if not parts:
            unmeasurable.append(name)
            continue
        answer = "yes" if above == len(parts) else f"on {above} of {len(parts)}" if above else "no"
        out.append(f"Does {name} recover? {answer}: share of the loss recovered (0 = VLM LM, 1 = base; CI above 0 = recovered "
                   f"some): " + "; ".join(parts) + "." + paper)
    if unmeasurable:
        pairs = ", ".join(summary["pairs"])
        out.append(f"Does {' / '.join(unmeasurable)} recover? not measurable: no pair ({pairs}) lost capability beyond noise on any task "
                   f"(a share of a loss within noise is a ratio of noise).{paper}")
    return out


def _verdict_protections(summary: dict) -> list[str]:
    """Per protection arm (against the control adaptation) and per post-hoc mitigation (against the VLM LM)."""
    tasks, out = summary["tasks"], []
    arms: dict[str, list[str]] = {}
    sides: dict[str, list[int]] = {}
    for p, e in summary["pairs"].items():
        for arm, a in ((e.get("protection") or {}).get("arms") or {}).items():
            if not a.get("vs_control"):
                continue
            skill = (a.get("vl_skill") or {}).get("digit_accuracy")
            ctrl = next((c for c in e["protection"]["arms"].values() if not c.get("vs_control")), {})
            ctrl_skill = (ctrl.get("vl_skill") or {}).get("digit_accuracy")
            arms.setdefault(arm, []).append(
                f"{p}: " + ", ".join(f"{t} {_pts_ci(a['vs_control'][t])}" for t in tasks)
                + (f" (VL skill {skill:.2f} vs control {ctrl_skill:.2f})" if not _nan(skill) and not _nan(ctrl_skill) else ""))
            sides.setdefault(arm, []).append(_side(a["vs_control"][tasks[0]]["delta_points_ci"]))
    for arm, parts in arms.items():
        out.append(f"Does protection {arm} beat the control? {_answer(sides[arm])} on {tasks[0]}: Δ = arm − control adaptation "
                   "(positive = kept more text skill): " + "; ".join(parts) + ".")
    for name, per_pair in _by_kind(summary, "mitigation").items():
        parts, s = [], []
        for p, per_task in per_pair.items():
            if "vs_vlm" not in per_task[tasks[0]]:
                continue
            parts.append(f"{p}: " + ", ".join(f"{t} {_pts_ci(per_task[t]['vs_vlm'])}" for t in tasks))
            s.append(_side(per_task[tasks[0]]["vs_vlm"]["delta_points_ci"]))
        if parts:
            out.append(f"Does mitigation {name} beat its control (the unmitigated VLM LM)? {_answer(s)} on {tasks[0]}: "
                       "Δ = mitigated − VLM LM (positive = better): " + "; ".join(parts) + ".")
    return out


def _answer(sides: list[int]) -> str:
    up, down = sides.count(1), sides.count(-1)
    if up == len(sides):
        return "yes"
    if down == len(sides):
        return "no: worse"
    return f"on {up} of {len(sides)} pairs" + (f" (worse on {down})" if down else "") if up or down else "not established"


def verdicts(summary: dict) -> list[str]:
    """One line per study question the summary holds, each with its number, CI and convention."""
    return _verdict_sink(summary) + _verdict_qknorm(summary) + _verdict_merges(summary) + _verdict_protections(summary)


def _agreement(ours_ci, paper: float) -> str:
    side = _side(ours_ci)
    if side == 0:
        return "sign not established (our CI includes 0)"
    same = (side > 0) == (paper > 0)
    inside = ours_ci[0] <= paper <= ours_ci[1]
    return ("same sign" if same else "different sign") + ("; the paper's value is inside our CI" if inside else "")


def paper_vs_ours(summary: dict) -> list[tuple]:
    """The published figures beside ours, each row only where the study measured its counterpart."""
    from experiments.published import load_published

    pub = load_published()
    t = _paper_task(summary)
    rows = []
    corr = (summary.get("correlation") or {}).get(t)
    if corr:
        for key, label, ref in (("points", "ρ(S, Δ points)", "spearman_points"), ("relative", "ρ(S, Δ/base)", "spearman_relative")):
            c = corr[key]
            rows.append([label, f"{pub.reported[ref]:+.3f} (6 pairs)", f"{_rho(c)} ({corr['n']} pairs)", _agreement(c["spearman_ci"], pub.reported[ref])])
    for p, e in summary["pairs"].items():
        published = e.get("published") or {}
        if published.get("ifeval_delta") is not None:
            d = e["degradation"][t]
            if not _nan(d["delta_points"]):
                rows.append([f"Δ points, {p}", f"{published['ifeval_delta']:+.1f}", _pts_ci(d), _agreement(d["delta_points_ci"], published["ifeval_delta"])])
    q = pub.qknorm_injection
    for name, per_pair in _by_kind(summary, "qknorm+vl").items():
        for p, per_task in per_pair.items():
            vb = per_task[t]["vs_base"]
            if not q or _nan(vb["delta_relative"]):  # Δ/base of a base that scores 0: nothing to set beside the paper's
                continue
            paper = (q["ifeval_after"] - q["ifeval_base"]) / q["ifeval_base"]
            rows.append([f"injected QK-norm + VL training, Δ/base, {p}", f"{paper:+.3f} ({q['base']})", _rel_ci(vb),
                         _agreement(vb["delta_relative_ci"], paper)])
    merges = _by_kind(summary, "merge")
    lost = [(p, name) for name, per_pair in merges.items() for p in per_pair if _lost(summary["pairs"][p]["degradation"][t])]
    if lost and pub.merges:
        recovered = [f"{p}/{name}" for p, name in lost if _side(merges[name][p][t]["recovery"]["ci"]) > 0]
        rows.append(["merges that recover the loss", f"{pub.merges['recovered_ifeval']} of {len(pub.merges['tried'])}",
                     f"{len(recovered)} of {len(lost)}" + (f" ({', '.join(recovered)})" if recovered else ""),
                     "same" if bool(recovered) == bool(pub.merges["recovered_ifeval"]) else "different"])
    if not rows:
        return []
    return [("h", 2, "Paper vs ours"),
            ("table", ["figure", "paper (published)", f"ours ({t}) [95% CI]", "agreement"], rows),
            ("p", f"Paper: IFEval prompt-level strict at 7-8B ({pub.source}); ours: {t}, headline metric. {PAPER_DIRECTION}. "
                  "Agreement is read off our CI: the sign is established only where it excludes 0.")]


# --------------------------------------------------------------------------- examples

# Chat-template markup: <|...|> tokens (ChatML, Llama 3, the demo's), Gemma's turns, Llama 2's [INST], BOS/EOS, empty think blocks.
_MARKUP = re.compile(r"<\|[^<>|\s]*\|>|</?(?:s|bos|eos|start_of_turn|end_of_turn|think)>|\[/?INST\]")
_ROLES = {"system", "user", "assistant", "model"}


def chat_text(prompt: str) -> str:
    """The text of a chat-templated prompt: markup removed, role names dropped, turns on their own lines."""
    parts = []
    for seg in _MARKUP.split(prompt):
        lines = seg.strip("\n").split("\n")
        if lines and lines[0].strip().lower() in _ROLES:
            lines = lines[1:]
        text = "\n".join(lines).strip()
        if text:
            parts.append(text)
    return "\n\n".join(parts)


def _verdict_of(passed, graded: dict | None) -> str:
    graded = graded or {}
    words = "pass" if passed else "fail"
    inst = graded.get("instructions")
    if isinstance(inst, list) and inst:
        return f"{words} ({sum(bool(x) for x in inst)} of {len(inst)} instructions followed)"
    if graded.get("extracted") is not None:
        return f"{words} (extracted answer: {graded['extracted']!r})"
    return words


def _example(pair: str, task: str, x: dict) -> dict:
    base_g, vlm_g = x.get("base_graded") or {}, x.get("vlm_graded") or {}
    if isinstance(base_g.get("instructions"), list):
        expected = "a response that follows every instruction in the prompt (lm-eval's IFEval checkers, strict)"
    elif x.get("target") not in (None, ""):
        expected = f"{x['target']}"
    else:
        expected = "what the task's grader accepts"
    return {"title": f"{pair}, {task} doc {x['doc_id']}", "prompt": chat_text(x["prompt"]), "expected": expected,
            "outputs": [("base", _visible(x["base"]), _verdict_of(x["base_pass"], base_g)),
                        ("VLM LM", _visible(x["vlm"]), _verdict_of(x["vlm_pass"], vlm_g))]}


def _visible(output: str) -> str:
    """A model's output as text; one that is only whitespace is said so (a blank box reads as a rendering fault)."""
    return output if output.strip() else f"(no visible text: {len(output)} whitespace character(s), {output!r})"


def example_blocks(summary: dict) -> list[tuple]:
    task = summary["tasks"][0]
    examples = [("example", _example(p, task, x)) for p, e in summary["pairs"].items() for x in e.get("examples") or []]
    if not examples:
        return []
    return [("h", 2, f"Example outputs on {task} (prompts the base passes and the VLM LM fails, where any)"), *examples]


# --------------------------------------------------------------------------- files

def _href(path, out: Path) -> str:
    path = Path(path)
    try:
        return path.resolve().relative_to(out.resolve()).as_posix()
    except ValueError:
        return path.resolve().as_uri()


def file_blocks(summary: dict, out: Path, figures: list[dict]) -> list[tuple]:
    """Links to every figure (PNG and SVG) and every artifact the summary names."""
    links = [("summary.json (every number in this report)", "summary.json"), ("report.md", "report.md"), ("report.html", "report.html")]
    for f in figures:
        links += [(f["path"], f["path"]), (f["svg"], f["svg"])]
    for p, e in summary["pairs"].items():
        for label, m in e["models"].items():
            if m.get("sink_maps"):
                links.append((f"{p} / {label}: sink maps (JSON)", _href(m["sink_maps"], out)))
            if m.get("path"):
                links.append((f"{p} / {label}: model", _href(m["path"], out)))
    if (out / "steps").is_dir():
        links.append(("steps/: every step's record (key, settings, result, provenance)", "steps/"))
    return [("h", 2, "Files"), ("links", links)]


def build_blocks(study, summary: dict, out: Path) -> list[tuple]:
    tasks = summary["tasks"]
    title = study.report.get("title") or f"sinkstudy report: {study.name}"
    b: list[tuple] = [("h", 1, title), ("p", f"Computed on: {describe_hardware(summary.get('hardware'))}.")]
    lines = verdicts(summary)
    trained = {bb["name"] for bb in (study.build or {}).get("backbones", []) if bb["kind"] == "trained"}
    if trained:  # the demo: where its S lies comes first, so no one reads its ρ as a test of sinks
        lines = [miniature_sink_finding([e["models"]["base"]["sink_strength"] for p, e in summary["pairs"].items() if p in trained],
                                        reference_results(study))] + lines
    if lines:
        b += [("h", 2, "Verdicts"), ("ul", lines)]
    b += paper_vs_ours(summary)
    b += [("h", 2, "The study"),
          ("p", f"Pairs: {', '.join(summary['pairs'])}. Sink metric: {study.sink['metric']}. Strict evals through lm-eval: "
                f"{', '.join(tasks)} (chat template {'on' if study.evals['apply_chat_template'] else 'off'}, "
                f"max_gen_toks {study.evals['max_gen_toks']}, batch size {study.evals['batch_size']}). "
                f"Interventions: {', '.join(i['name'] for i in study.interventions) or 'none'}. "
                f"CIs: paired bootstrap over prompts ({study.evals['n_boot']} replicates, {study.evals['confidence']:.0%}).")]
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
    b += example_blocks(summary)
    b += plot_blocks(study, summary, out)

    if study.build:
        b += _build_blocks(study, out)
    b += [("h", 2, "Caveats"), ("ul", [
        "lm-eval's strict graders are kept as they are: GSM8K-CoT strict-match 'The answer is (\\-?[0-9\\.\\,]+).' has an "
        "unescaped final '.', IFEval strict fails a one-line preamble that loose accepts (docs/evals.md).",
        "Small prompt sets give wide intervals; read the CIs before the point estimates.",
        "A rank correlation over few pairs is fragile: one pair moves it a lot.",
    ])]
    b += file_blocks(summary, out, [x[1] for x in b if x[0] == "img"])
    prov = (summary.get("provenance") or {})
    b += [("h", 2, "Provenance"), ("p", f"config: {study.path}; output: {study.out}; seed: {study.seed}. "
                                         "Every step's JSON under steps/ carries the config, seeds, package versions and model fingerprints."),
          ("code", "\n".join(f"{k}: {v}" for k, v in (prov.get("versions") or {}).items())),
          ("p", "seconds per stage in the run that wrote this report (0 = reused): "
                + ", ".join(f"{k} {v}" for k, v in summary.get("timings", {}).items()))]
    return b


def plot_blocks(study, summary: dict, out: Path) -> list[tuple]:
    """The sink maps and profiles per pair, S vs Δ and recovery per task (experiments.plots)."""
    metric = study.sink["metric"]
    b: list[tuple] = [("h", 2, "Plots")]
    profiles = plots.layer_profiles(summary, metric, out)
    for p, f in plots.sink_maps(summary, metric, out).items():
        b.append(("img", f, f"{p}: per layer and head, base / VLM LM on one colour scale, and the shift VLM LM − base ({f['note']})"))
        b.append(("img", profiles[p], f"{p}: {profiles[p]['ylabel']} per layer, every measured model (base and VLM LM bold)"))
    for t in summary["tasks"]:
        b.append(("img", plots.scatter(summary, t, out), f"Sink Strength of the base vs Δ points and Δ/base on {t} (negative = loss), "
                                                         "Spearman ρ with its CI in each title"))
        rec = plots.recovery(summary, t, out)
        if rec:
            b.append(("img", rec, f"recovery per intervention on {t}: dot = estimate, line = 95% CI"))
    return b


def _knobs(bb: dict) -> str:
    """What a trained backbone's recipe sets beyond its shape: lr, weight decay, data mix."""
    if bb.get("kind") == "pretrained":
        return f"pretrained: {bb['pretrained']}"
    mix = [f"{k.replace('_share', '').replace('_rate', '')} {bb[k]:g}"
           for k in ("backcopy_share", "retrieval_share", "noise_share", "sprinkle_rate") if bb.get(k)]
    return f"lr {bb['lr']:g}, wd {bb['weight_decay']:g}" + (f", {', '.join(mix)}" if mix else "")


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
                     sum(vl.get("n_text_chats", {}).values()),
                     ", ".join(f"{step}: {x:+.2f}" for step, x in vl.get("sink_trajectory") or []) or "-",
                     _f(vl["heldout"]["digit_accuracy"]), _f(vl["heldout"]["answer_ppl"], 2)])
    corpus = read_json(steps / "corpus.json")["result"]
    vl_cfg = study.build["vl"]
    trained = [bb for bb in study.build["backbones"] if bb["kind"] == "trained"]
    backbones = ("Tokenizer: byte-level BPE trained on the corpus. Every backbone is a config entry (a sinkgrow recipe: family, shape, steps, lr, weight decay, data mix; "
                 "docs/sinks.md) pretrained from scratch on that corpus through the engine's text path." if trained else
                 "The backbone is a real pretrained LLM (its converted checkpoint, with its family's chat template; "
                 "experiments/demo/real.py), not trained on the corpus; the corpus gives its held-out evals and stage 2's text chats.")
    b = [("h", 2, "How the miniature pairs were built" if trained else "How the pair was built"),
         ("p", f"Corpus: {corpus['train_records']} procedurally generated records ({corpus['kinds']['chat']} chats with strict-format "
               f"instructions, arithmetic and plain requests; {corpus['kinds']['plain']} plain stories); held-out evals: "
               f"{corpus['heldout_ifeval']} IFEval-schema prompts and {corpus['heldout_gsm']} GSM-schema problems on entities the "
               f"corpus never shows. {backbones} VL adaptation through the engine: LLaVA "
               "(LlavaForConditionalGeneration, tiny CLIP tower frozen at random init) on scikit-learn's 8x8 digits, "
               f"stage 1 projector ({vl_cfg['stage1']['steps']} steps), stage 2 projector+LM ({vl_cfg['stage2']['steps']} steps, "
               f"{vl_cfg['stage2'].get('text_share', 0):.0%} of its examples text-only chats from the corpus, as "
               "LLaVA-665K mixes ShareGPT text into its stage 2), loss on answers only. Held-out digit accuracy: the most "
               f"likely of the ten answers 'It is a d.' on {vl_cfg['heldout_images']} unseen images (chance 0.10). S during VL: "
               "the LM's Sink Strength at adaptation steps (stage 1 then stage 2, counted on)."),
         ("table", ["backbone", "family", "QK-norm", "shape", "knobs", "params", "pretrain steps", "S step 0 → end", "pretrain loss",
                    "VL stage-1 loss", "VL stage-2 loss", "text chats in VL", "S during VL (step: S)", "held-out digit acc.",
                    "answer ppl"], rows)]
    plot = plots.pretrain_sink_curves(curves, out)
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
