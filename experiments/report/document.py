"""report.md + report.html + plots, a function of a study's summary.json alone (`write_report`;
`sinkstudy report RUN_DIR` re-renders an old run without its step files).

The document is a list of blocks (`experiments.report.render`) rendered twice, to Markdown and to
self-contained HTML. It opens with one line per question the summary answers (`experiments.report.claims`,
where every answer is decided: number, CI, convention, the rule), then the paper's figures beside ours, then
the details (`experiments.report.findings`, which describes); parts without data are left out. Every sentence
states what the numbers show, including when they do not show the paper's effects; nothing in it is written by
hand. Figures: `experiments.report.plots`, drawn with every report. Convention throughout: Δ = after − before
in points (score × 100; base -> VLM LM: negative = capability lost), relative = Δ / before.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from evals.protocol import DEFAULT_CONFIDENCE
from experiments.report import findings as f, plots
from experiments.report.across_seeds import claims_across, replicate_blocks, replicated
from experiments.report.build_section import build_blocks as how_built, miniature_notes
from experiments.report.calibration_tables import calibration_blocks
from experiments.report.claims import claims
from experiments.report.dose_response_tables import dose_response_blocks
from experiments.report.dose_tables import dose_blocks
from experiments.report.fmt import num, points, with_ci
from experiments.report.published import load_published
from experiments.report.render import render_html, render_md
from experiments.report.results import StudyResults, vl_accuracy
from sinkstudy.io import write_text_atomic
from sinkstudy.provenance import describe_hardware

CONVENTION = ("Δ = after − before in points (score × 100; base → VLM LM: negative = capability lost); "
              "Δ/before = Δ / the before score (relative)")


# --------------------------------------------------------------------------- tables

def score_blocks(r: StudyResults) -> list[tuple]:
    """Sink Strength and strict scores, base -> VLM LM, per pair."""
    header = ["pair", "QK-norm", "S base", "S VLM LM"]
    for t in r.tasks:
        header += [f"{t} base", f"{t} VLM", f"{t} Δ pts [95% CI]", f"{t} Δ/base", f"{t} lost/gained", f"{t} McNemar p"]
    rows = []
    for p, e in r.pairs.items():
        row = [p, {True: "native", False: "none"}.get(e.native_qk_norm, "?"), num(e.models["base"].sink_strength),
               num(e.models["vlm"].sink_strength)]
        for t in r.tasks:
            d = e.degradation[t]
            row += [points(d.before), points(d.after), with_ci(d.delta_points, d.delta_points_ci, ".1f"), num(d.delta_relative),
                    "-" if d.lost is None else f"{d.lost}/{d.gained}", num(d.mcnemar_p)]
        rows.append(row)
    return [("h", 2, "Sink Strength and strict scores, base -> VLM LM"), ("table", header, rows),
            ("p", "Headline metrics: " + ", ".join(f"{t}: {f.short(m)}" for t, m in r.headline.items())
                  + f". Scores in points. {CONVENTION}. lost/gained: prompts only the base / only the VLM LM passes.")]


def published_blocks(r: StudyResults) -> list[tuple]:
    """The study's pairs beside the published figures its config gives (`published:` per pair)."""
    pairs = {p: e for p, e in r.pairs.items() if e.published}
    if not pairs:
        return []
    task = next((t for t in r.tasks if "ifeval" in t), None)
    rows = []
    for p, e in pairs.items():
        pub, d = e.published, e.degradation[task] if task else None
        base = pub.get("ifeval_base")
        rows.append([p, num(e.models["base"].sink_strength, ".2f"), num(pub.get("sink_strength"), ".2f"),
                     with_ci(d.delta_points, d.delta_points_ci, ".1f") if d else "n/a", num(pub.get("ifeval_delta"), ".1f"),
                     num(d.delta_relative) if d else "n/a",
                     num(pub["ifeval_delta"] / base) if base and pub.get("ifeval_delta") is not None else "n/a"])
    what = f"our {task} (headline metric)" if task else "no IFEval task in this study"
    return [("h", 2, "Beside the published pairs"),
            ("table", ["pair", "S (ours)", "S (paper)", "Δ pts (ours) [95% CI]", "Δ pts (paper)", "Δ/base (ours)", "Δ/base (paper)"], rows),
            ("p", f"Ours: {what}; paper: IFEval prompt-level strict at 7-8B (as given in the study config). {CONVENTION}.")]


def paper_blocks(r: StudyResults) -> list[tuple]:
    """The published figures beside ours, each row only where the study measured its counterpart."""
    rows = f.paper_rows(r)
    if not rows:
        return []
    return [("h", 2, "Paper vs ours"),
            ("table", ["figure", "paper (published)", f"ours ({r.paper_task}) [95% CI]", "agreement"], rows),
            ("p", f"Paper: IFEval prompt-level strict at 7-8B ({load_published().source}); ours: {r.paper_task}, headline metric. "
                  f"{f.PAPER_DIRECTION}. Agreement is read off our CI: the sign is established only where it excludes 0.")]


def recovery_blocks(r: StudyResults) -> list[tuple]:
    if not any(e.interventions for e in r.pairs.values()):
        return []
    vl = any(e.vl_cost for e in r.pairs.values())
    header = ["pair", "intervention", "method", "S"] + (["VL acc.", "Δ VL pts vs VLM"] if vl else [])
    for t in r.tasks:
        header += [f"{t} score", f"{t} recovery [95% CI]", f"{t} Δ pts vs base"]
    rows = []
    for p, e in r.pairs.items():
        for name, per_task in e.interventions.items():
            row = [p, name, e.method(name) or "", num(e.models[name].sink_strength)]
            if vl:
                cost = e.vl_cost.get(name) or {}
                row += [num(cost.get("accuracy")), num(cost.get("delta_points"), "+.1f")]
            for t in r.tasks:
                rec, c = per_task[t].recovery, per_task[t].vs_base
                shown = (with_ci(rec.recovery, rec.ci, ".2f") if f.lost(e.degradation[t])
                         else f"({num(rec.recovery, '.2f')}: no significant loss)")
                row += [points(c.after), shown, with_ci(c.delta_points, c.delta_points_ci, ".1f")]
            rows.append(row)
    return [("h", 2, "Recovery per intervention"), ("table", header, rows),
            ("p", "recovery = (intervened - VLM LM) / (base - VLM LM): 0 = no better than the VLM's LM, 1 = back to the base; "
                  "undefined (n/a) when base and VLM score the same, and shown in parentheses when the pair's Δ CI includes 0 "
                  "(a ratio of noise). 'Δ pts vs base' = intervened − base in points with its CI. "
                  "qknorm rows are the injected base (text-only cost of the injection); qknorm-vl rows are the LM of a VLM "
                  "trained from the injected base with the same VL recipe (the paper's experiment)."
                  + (f" VL acc.: the intervened LM put back into the pair's VLM (its tower and projector); {vl_probe_text(r)} "
                     "Δ VL pts vs VLM = that accuracy − the VLM's, in points (negative = VL skill lost)." if vl else ""))]


def vl_probe_text(r: StudyResults) -> str:
    """What the VL accuracy is, in words, with each question type's chance (from the pair VLMs' results)."""
    skills = [m.vl_skill for e in r.pairs.values() for m in e.models.values() if m.vl_skill]
    skills += [a.vl_skill for e in r.pairs.values() for a in e.arms.values() if a.vl_skill]
    if not skills:
        return "no VL probe."
    if (skills[0].get("probe") or "digits") == "digits":
        return "held-out 8x8 digits, the answer \"It is a d.\" the VLM finds most likely (chance 0.10)."
    by_type = skills[0].get("by_type") or {}
    types = "; ".join(f"{t} {x['n']} (chance {x['chance']:.2f}, commonest answer {x['majority']:.2f})" for t, x in by_type.items())
    return (f"held-out short-answer VQA, {skills[0].get('n')} questions on images no training record shows, greedy answer "
            f"equal to the reference after normalisation; per type: {types}.")


def template_blocks(r: StudyResults, summary: dict) -> list[tuple]:
    """Per pair and model, the share of its eval answers that open like a VL training answer."""
    rows = [[p, label, m.method or "", *(_share(m.template_share, t) for t in r.tasks)]
            for p, e in r.pairs.items() for label, m in e.models.items() if m.template_share]
    if not rows:
        return []
    info = summary.get("template_share") or {}
    n = (info.get("openings") or {}).get("n_answers")
    return [("h", 2, "Template share"),
            ("table", ["pair", "model", "method", *(f"{t} template share (k/n)" for t in r.tasks)], rows),
            ("p", f"{info.get('convention', 'template share: eval answers that open like a VL training answer')}. "
                  f"Training answers: {n if n is not None else '?'} (the VL recipe's image records).")]


def _share(shares: dict, task: str) -> str:
    x = shares.get(task)
    return "-" if not x else f"{num(x['share'], '.2f')} ({x['templated']}/{x['n']})"


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
        others = sum(h.get("sink_head") is False for h in rep["heads"])  # interventions.protect.heads.describe
        return (f"{where} ({stage}): {name} on heads "
                + ", ".join(f"L{h['layer']}H{h['head']} (S {h['strength']:.2f}, mass {h['mass']:.2f})" for h in rep["heads"])
                + (f"; {others} of them no sink head (mass <= 0.3)" if others else ""))
    if rep.get("mode") == "remove":
        return (f"{where}: QK-norm removed (Llama twin, next-token KL to the original {rep['mean_next_token_kl_to_original']:.4f}; "
                f"S {rep['sink_strength_original']:.3f} -> {rep['sink_strength_without_norm']:.3f} before any training)")
    return None


def protection_blocks(r: StudyResults, summary: dict, out: Path) -> list[tuple]:
    """The training-time protection section: per arm VL skill, S and text scores vs control and base."""
    pairs = {p: e for p, e in r.pairs.items() if e.arms}
    if not pairs:
        return []
    header = ["pair", "arm", "changes vs control", "VL acc.", "S after"]
    shares = any(e.models[a.label].template_share for e in pairs.values() for a in e.arms.values())
    for t in r.tasks:
        header += [f"{t} score", f"{t} Δ pts vs control [95% CI]", f"{t} Δ pts vs base [95% CI]"] + ([f"{t} template share"] if shares else [])
    rows, notes = [], []
    for p, e in pairs.items():
        for arm, a in e.arms.items():
            row = [p, arm, a.changes(), num(vl_accuracy(a.vl_skill)), num(a.sink_strength)]
            for t in r.tasks:
                base_cmp = e.degradation[t] if a.label == "vlm" else e.interventions[a.label][t].vs_base
                ctrl = (a.vs_control or {}).get(t)
                row += [points(base_cmp.after), with_ci(ctrl.delta_points, ctrl.delta_points_ci, ".1f") if ctrl else "-",
                        with_ci(base_cmp.delta_points, base_cmp.delta_points_ci, ".1f")]
                row += [_share(e.models[a.label].template_share or {}, t)] if shares else []
            rows.append(row)
            last = {}  # what each protection reported in the last stage it acted in
            for stage in (a.adapt or {}).get("stages") or []:
                last.update({name: (stage["stage"], rep) for name, rep in (stage.get("hooks") or {}).items()})
            notes += [n for name, (stage, rep) in last.items() if (n := _protection_note(f"{p} / {arm}", name, stage, rep))]
    b = [("h", 2, "Training-time protections"),
         ("p", "Every arm adapts the same base with the same recipe, vision side, data order and seed; the control arm has no "
               "protection and its VLM is the pair's VLM above. Δ pts vs control = arm − control in points with a paired bootstrap "
               "CI over prompts (positive = the protection kept more text skill than the unprotected adaptation); Δ pts vs base "
               f"= arm − base (negative = capability lost). VL acc.: {vl_probe_text(r)} S after: Sink Strength of the arm's LM."
               + (" Template share: the share of the arm's eval answers that open like a VL training answer (section Template "
                  "share)." if shares else "")),
         ("table", header, rows)]
    if notes:
        b.append(("ul", notes))
    for t in r.tasks:
        f = plots.protect_pareto(summary, t, out)
        if f:
            b.append(("img", f, f"text retention on {t} vs VL skill per arm"))
    for p in pairs:
        f = plots.adaptation_trajectory(summary, p, out)
        if f:
            b.append(("img", f, f"{p}: Sink Strength (and scores, where measured) during adaptation per arm (stage starts dashed)"))
    return b


def plot_blocks(r: StudyResults, summary: dict, out: Path) -> list[tuple]:
    """The sink maps and profiles per pair, S vs Δ and recovery per task (experiments.report.plots)."""
    metric = r.settings.get("sink_metric", "logodds")
    b: list[tuple] = [("h", 2, "Plots")]
    profiles = plots.layer_profiles(summary, metric, out)
    for p, f in plots.sink_maps(summary, metric, out).items():
        b.append(("img", f, f"{p}: per layer and head, base / VLM LM on one colour scale, and the shift VLM LM − base ({f['note']})"))
        b.append(("img", profiles[p], f"{p}: {profiles[p]['ylabel']} per layer, every measured model (base and VLM LM bold)"))
    for t in r.tasks:
        b.append(("img", plots.scatter(summary, t, out), f"Sink Strength of the base vs Δ points and Δ/base on {t} (negative = loss), "
                                                         "Spearman ρ with its CI in each title"))
        rec = plots.recovery(summary, t, out)
        if rec:
            b.append(("img", rec, f"recovery per intervention on {t}: dot = estimate, line = 95% CI"))
        cost = plots.recovery_vs_vl_cost(summary, t, out)
        if cost:
            b.append(("img", cost, f"text recovery on {t} against the VL accuracy change vs the VLM, per intervention "
                                   "(its LM put back into the VLM): right of 0 kept VL skill, up recovered text"))
    return b


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


def _graded(passed, graded: dict | None) -> str:
    graded = graded or {}
    words = "pass" if passed else "fail"
    inst = graded.get("instructions")
    if isinstance(inst, list) and inst:
        return f"{words} ({sum(bool(x) for x in inst)} of {len(inst)} instructions followed)"
    if graded.get("extracted") is not None:
        return f"{words} (extracted answer: {graded['extracted']!r})"
    return words


def _visible(output: str) -> str:
    """A model's output as text; one that is only whitespace is said so (a blank box reads as a rendering fault)."""
    return output if output.strip() else f"(no visible text: {len(output)} whitespace character(s), {output!r})"


def _example(pair: str, task: str, x: dict) -> dict:
    base_g, vlm_g = x.get("base_graded") or {}, x.get("vlm_graded") or {}
    if isinstance(base_g.get("instructions"), list):
        expected = "a response that follows every instruction in the prompt (lm-eval's IFEval checkers, strict)"
    elif x.get("target") not in (None, ""):
        expected = f"{x['target']}"
    else:
        expected = "what the task's grader accepts"
    return {"title": f"{pair}, {task} doc {x['doc_id']}", "prompt": chat_text(x["prompt"]), "expected": expected,
            "outputs": [("base", _visible(x["base"]), _graded(x["base_pass"], base_g)),
                        ("VLM LM", _visible(x["vlm"]), _graded(x["vlm_pass"], vlm_g))]}


def example_blocks(r: StudyResults) -> list[tuple]:
    task = r.tasks[0]
    examples = [("example", _example(p, task, x)) for p, e in r.pairs.items() for x in e.examples]
    if not examples:
        return []
    return [("h", 2, f"Example outputs on {task} (prompts the base passes and the VLM LM fails, where any)"), *examples]


# --------------------------------------------------------------------------- files and the document

def _href(path, out: Path) -> str:
    path = Path(path)
    try:
        return path.resolve().relative_to(out.resolve()).as_posix()
    except ValueError:
        return path.resolve().as_uri()


def file_blocks(r: StudyResults, out: Path, figures: list[dict]) -> list[tuple]:
    """Links to every figure (PNG and SVG) and every artifact the summary names."""
    links = [("summary.json (every number in this report)", "summary.json"), ("report.md", "report.md"), ("report.html", "report.html")]
    for f in figures:
        links += [(f["path"], f["path"]), (f["svg"], f["svg"])]
    for p, e in r.pairs.items():
        for label, m in e.models.items():
            if m.sink_maps:
                links.append((f"{p} / {label}: sink maps (JSON)", _href(m.sink_maps, out)))
            if m.path:
                links.append((f"{p} / {label}: model", _href(m.path, out)))
    if (out / "steps").is_dir():
        links.append(("steps/: every step's record (key, settings, result, provenance)", "steps/"))
    return [("h", 2, "Files"), ("links", links)]


def answers(summary: dict) -> list[str]:
    """The report's answers: one line per question `summary` holds (`experiments.report.claims`), each stated only where
    every training seed (or numeric mode) gives the same answer."""
    repeated = replicated(summary)
    return [str(c) for c in (claims_across(repeated[1], repeated[0]) if repeated else claims(StudyResults.of(summary)))]


def build_blocks(summary: dict, out: Path) -> list[tuple]:
    """The whole document, from the summary (figures written under `out`/plots)."""
    r = StudyResults.of(summary)
    s = r.settings
    b: list[tuple] = [("h", 1, s.get("title") or f"sinkstudy report: {r.name}"),
                      ("p", f"Computed on: {describe_hardware(summary.get('hardware'))}.")]
    if s.get("see_also"):  # related reports, linked by their path relative to this one where they exist
        made = {title: path for title, path in s["see_also"].items() if Path(path).exists()}
        b += [("p", "See also:"), ("links", [(title, os.path.relpath(path, out)) for title, path in made.items()])] if made else []
        b += [("p", f"Not run yet, so not linked: {title} ({path})") for title, path in s["see_also"].items() if title not in made]
    notes = miniature_notes(r)  # a miniature's S first: no one reads its ρ as a test of sinks
    if notes:
        b += [("h", 2, "The miniature's sinks"), ("ul", notes)]
    answered = answers(summary)  # over training seeds or numeric modes: answers only where every run agrees
    if answered:
        b += [("h", 2, "The paper's claims"), ("ul", answered)]
    b += paper_blocks(r)
    repeated = replicated(summary)
    if repeated:
        b += replicate_blocks(*repeated, summary)
    b += [("h", 2, "The study"),
          ("p", f"Pairs: {', '.join(r.pairs)}. Sink metric: {s.get('sink_metric')}. Strict evals through lm-eval: "
                f"{', '.join(r.tasks)} (chat template {'on' if s.get('apply_chat_template') else 'off'}, "
                f"max_gen_toks {s.get('max_gen_toks')}, batch size {s.get('batch_size')}). "
                f"Interventions: {', '.join(s.get('interventions') or []) or 'none'}. "
                f"CIs: paired bootstrap over prompts ({s.get('n_boot')} replicates, {s.get('confidence', DEFAULT_CONFIDENCE):.0%}).")]
    if s.get("notes"):
        b.append(("p", s["notes"]))
    b += [("h", 2, "Findings"), ("ul", f.findings(r))]
    b += calibration_blocks(summary)
    b += score_blocks(r) + template_blocks(r, summary) + published_blocks(r) + recovery_blocks(r) + protection_blocks(r, summary, out)
    b += dose_blocks(summary) + dose_response_blocks(summary, out)
    b += example_blocks(r) + plot_blocks(r, summary, out)
    if r.build:
        b += how_built(r.build, out)
    b += [("h", 2, "Caveats"), ("ul", [
        "lm-eval's strict graders are kept as they are: GSM8K-CoT strict-match 'The answer is (\\-?[0-9\\.\\,]+).' has an "
        "unescaped final '.', IFEval strict fails a one-line preamble that loose accepts (docs/evals.md).",
        "Small prompt sets give wide intervals; read the CIs before the point estimates.",
        "A rank correlation over few pairs is fragile: one pair moves it a lot.",
    ])]
    b += file_blocks(r, out, [x[1] for x in b if x[0] == "img"])
    b += [("h", 2, "Provenance"), ("p", f"config: {s.get('config')}; output: {s.get('out')}; seed: {s.get('seed')}. "
                                         "Every step's JSON under steps/ carries the config, seeds, package versions and model fingerprints."),
          ("code", "\n".join(f"{k}: {val}" for k, val in r.versions.items())),
          ("p", "seconds per stage in the run that wrote this report (0 = reused): "
                + ", ".join(f"{k} {val}" for k, val in r.timings.items()))]
    return b


def write_report(summary: dict, out: str | Path) -> Path:
    """Write report.md, report.html and plots/ under `out` from `summary` (summary.json's content); return report.md's path."""
    out = Path(out)
    blocks = build_blocks(summary, out)
    md = write_text_atomic(out / "report.md", render_md(blocks))
    write_text_atomic(out / "report.html", render_html(blocks, blocks[0][2]))
    return md
