"""What a study's numbers show, described: the findings (per pair the change on the first task, the QK-norm arms
against the base, the VL side of a build, each intervention's recovery or harm and what scored below both of its
inputs, the template share), the published figures beside ours (`paper_rows`), and the treated models by kind
(`kind`, `by_kind`, `lost`). It answers no question: every answer (agrees / disagrees / yes / no / not established) is
decided once, in `experiments.report.claims`.

Each number carries its CI, and a sign is read only off a CI (`evals.stats.ci_side`; a comparison of fewer than 6
prompts has none, `evals.stats.comparison_side`); a recovery is read only for pairs that lost beyond noise (a share of
a loss within noise is a ratio of noise), and both sides are named: recoveries (CI above 0) and harms (CI below 0:
below the VLM LM). Convention throughout: Δ = after − before in points (score × 100; base -> VLM LM: negative =
capability lost), relative = Δ / before; the paper's direction in it is ρ(S, Δ) > 0
(experiments/data/published_choi2026.yaml). Inputs are `experiments.report.results.StudyResults`.
"""

from __future__ import annotations

from evals.stats import MIN_CONCLUSIVE_N, Comparison, ci_side, comparison_side
from evals.template_share import COLLAPSE_SHARE
from experiments.report.fmt import ci_text, missing, num, points, with_ci
from experiments.report.published import load_published
from experiments.report.results import StudyResults, vl_accuracy
from interventions.merge import MERGEKIT_METHODS
from interventions.spectral import SPECTRAL_METHODS

PAPER_DIRECTION = ("Δ = VLM LM − base in points (negative = capability lost), Δ/base = Δ / the base's score; in this "
                   "convention the paper's direction is ρ > 0 (a stronger sink, less loss)")


def lost(c: Comparison) -> bool:
    """The base -> VLM Δ's CI lies below 0 (a loss, over enough prompts): there is something to recover."""
    return comparison_side(c) < 0


def _signed(x, ci, spec: str, unit: str = "") -> str:
    return "n/a" if missing(x) else f"{num(x, spec)}{unit} {ci_text(ci, spec)}".strip()


def _pts_ci(c: Comparison) -> str:
    """A comparison's Δ in points with its CI, signed."""
    return _signed(c.delta_points, c.delta_points_ci, "+.1f", " pts")


def _rel_ci(c: Comparison) -> str:
    return "n/a (base scores 0)" if missing(c.delta_relative) else _signed(c.delta_relative, c.delta_relative_ci, "+.3f")


def _rho(c) -> str:
    return _signed(c.spearman, c.spearman_ci, "+.3f")


def kind(method: str | None) -> str:
    """What a treated model is, from its method: qknorm / qknorm+vl / protection / merge / mitigation."""
    if method in ("qknorm", "qknorm+vl", "protection"):
        return method

    return "merge" if method in MERGEKIT_METHODS or method in SPECTRAL_METHODS else "mitigation"


def by_kind(r: StudyResults, what: str) -> dict[str, dict[str, dict]]:
    """{treated model: {pair: per-task effects}} of one kind, in the summary's order."""
    out: dict[str, dict[str, dict]] = {}
    for p, e in r.pairs.items():
        for name, per_task in e.interventions.items():
            if kind(e.method(name)) == what:
                out.setdefault(name, {})[p] = per_task
    return out


# --------------------------------------------------------------------------- the paper beside ours

def _agreement(ours_ci, paper: float) -> str:
    side = ci_side(ours_ci)
    if side == 0:
        return "sign not established (our CI includes 0)"
    inside = ours_ci[0] <= paper <= ours_ci[1]
    return ("same sign" if (side > 0) == (paper > 0) else "different sign") + ("; the paper's value is inside our CI" if inside else "")


def _range_agreement(ours_ci, low: float, high: float) -> str:
    """Our CI against a range of published values of one sign."""
    side = ci_side(ours_ci)
    if side == 0:
        return "sign not established (our CI includes 0)"
    overlap = ours_ci[0] <= high and ours_ci[1] >= low
    return ("same sign" if (side > 0) == (high > 0) else "different sign") + ("; our CI overlaps the paper's range" if overlap else "")


def paper_rows(r: StudyResults) -> list[list[str]]:
    """[figure, paper, ours with CI, agreement] for each published figure the study measured a counterpart of."""
    pub, t = load_published(), r.paper_task
    rows = []
    corr = r.correlation.get(t)
    if corr:
        for c, label, ref in ((corr.points, "ρ(S, Δ points)", "spearman_points"), (corr.relative, "ρ(S, Δ/base)", "spearman_relative")):
            rows.append([label, f"{pub.reported[ref]:+.3f} (6 pairs)", f"{_rho(c)} ({corr.n} pairs)", _agreement(c.spearman_ci, pub.reported[ref])])
    six = [x.ifeval_delta for x in pub.six]
    for p, e in r.pairs.items():
        published = e.published or {}
        d = e.degradation[t]
        if published.get("ifeval_delta") is not None and not missing(d.delta_points):
            rows.append([f"Δ points, {p}", f"{published['ifeval_delta']:+.1f}", _pts_ci(d), _agreement(d.delta_points_ci, published["ifeval_delta"])])
            continue
        # a pair the paper did not measure: beside the range of its six pairs, per training seed of the control
        controls = [("", d)] + [(f" (seed {a.training_seed})", a.vs_base[t]) for name, a in e.arms.items()
                                if a.replicate_of == "control" and a.vs_base]
        for seed, c in controls:
            if not missing(c.delta_points):
                rows.append([f"Δ points from VL training, {p}{seed}", f"{max(six):+.1f} to {min(six):+.1f} (six pairs)", _pts_ci(c),
                             _range_agreement(c.delta_points_ci, min(six), max(six))])
    q = pub.qknorm_injection
    if q:  # arms trained from a base with the paper's unit-gain QK-norm injected (the paper's own experiment)
        paper = (q["ifeval_after"] - q["ifeval_base"]) / q["ifeval_base"]
        for p, e in r.pairs.items():
            for name, a in e.arms.items():
                vb = (e.interventions.get(a.label) or {}).get(t)
                if (a.qknorm or {}).get("init") == "identity-gain" and vb is not None and not missing(vb.vs_base.delta_relative):
                    rows.append([f"injected QK-norm + VL training, Δ/base, {p} {name}", f"{paper:+.3f} ({q['base']})", _rel_ci(vb.vs_base),
                                 _agreement(vb.vs_base.delta_relative_ci, paper)])
    for name, per_pair in by_kind(r, "qknorm+vl").items():
        for p, per_task in per_pair.items():
            vb = per_task[t].vs_base
            if not q or missing(vb.delta_relative):  # Δ/base of a base that scores 0: nothing to set beside the paper's
                continue
            paper = (q["ifeval_after"] - q["ifeval_base"]) / q["ifeval_base"]
            rows.append([f"injected QK-norm + VL training, Δ/base, {p}", f"{paper:+.3f} ({q['base']})", _rel_ci(vb),
                         _agreement(vb.delta_relative_ci, paper)])
    merges = by_kind(r, "merge")
    losses = [(p, name) for name, per_pair in merges.items() for p in per_pair if lost(r.pairs[p].degradation[t])]
    if losses and pub.merges:
        recovered = [f"{p}/{name}" for p, name in losses if ci_side(merges[name][p][t].recovery.ci) > 0]
        rows.append(["merges that recover the loss", f"{pub.merges['recovered_ifeval']} of {len(pub.merges['tried'])}",
                     f"{len(recovered)} of {len(losses)}" + (f" ({', '.join(recovered)})" if recovered else ""),
                     "same" if bool(recovered) == bool(pub.merges["recovered_ifeval"]) else "different"])
    return rows


# --------------------------------------------------------------------------- findings

def trained_backbones(r: StudyResults) -> set[str]:
    """The backbones a build section trained from scratch (the demo's miniature pairs)."""
    return {b["name"] for b in (r.build or {}).get("backbones", []) if b["kind"] == "trained"}


def findings(r: StudyResults) -> list[str]:
    """The per-pair change on the first task, the QK-norm arms against the base, the VL side of the build, each
    intervention's recovery or harm by the side of its CI, what scored below both inputs, and the template share."""
    head = r.tasks[0]
    out = []
    for p, e in r.pairs.items():
        d = e.degradation[head]
        direction = "lost" if d.delta_points < 0 else "gained" if d.delta_points > 0 else "kept"
        out.append(f"{p}: the VLM's LM {direction} {abs(d.delta_points):.1f} points on {head} ({short(d.metric)}: "
                   f"{points(d.before)} -> {points(d.after)}; Δ = VLM LM − base = {num(d.delta_points, '.1f')} points, "
                   f"95% CI {ci_text(d.delta_points_ci, '.1f') or 'n/a'}, Δ/base {num(d.delta_relative)}, n={d.n})"
                   + (f"; {d.n} prompts decide nothing (fewer than {MIN_CONCLUSIVE_N}: no paired rank test can reach 5%)"
                      if d.n < MIN_CONCLUSIVE_N else
                      "" if ci_side(d.delta_points_ci) else "; the interval includes 0, so this study does not establish a change for this pair")
                   + ".")
    s_base, trained = r.base_strengths(), trained_backbones(r)
    if not trained and s_base and all(not missing(x) and x < 0 for x in s_base):
        out.append(f"Every base has S < 0 ({', '.join(num(x, '.2f') for x in s_base)}): its heads put well under half their attention on "
                   "their argmax key, i.e. these models have not formed the strong attention sink the paper measures "
                   "(published S 0.24 to 2.36 for 7-8B bases).")
    for p, e in r.pairs.items():
        for name, per_task in e.interventions.items():
            if e.method(name) in ("qknorm", "qknorm+vl"):
                c = per_task[head].vs_base
                what = "injecting QK-norm" if e.method(name) == "qknorm" else "injecting QK-norm and then the same VL training"
                out.append(f"{p}: {what} changed {head} by Δ = {num(c.delta_points, '.1f')} points against the base "
                           f"(CI {ci_text(c.delta_points_ci, '.1f') or 'n/a'}).")
    if head not in r.correlation and r.correlation_note:
        out.append(r.correlation_note + ".")
    out += _vl_side(r) + [_recovered(r, head)] + _below_both(r, head) + _templated(r, head)
    return out


def _templated(r: StudyResults, head: str) -> list[str]:
    """Per pair, the models whose eval answers mostly open like the VL training answers (template share at or above
    `evals.template_share.COLLAPSE_SHARE`): their text loss is collapse to the template, not erosion."""
    out = []
    for p, e in r.pairs.items():
        shares = {label: m.template_share[head] for label, m in e.models.items() if m.template_share and head in m.template_share}
        if not shares:
            continue
        high = {label: x for label, x in shares.items() if x["share"] >= COLLAPSE_SHARE}
        if high:
            out.append(f"{p}: template share at or above {COLLAPSE_SHARE:.0%} on {head} for "
                       + ", ".join(f"{label} {x['share']:.2f} ({x['templated']}/{x['n']})" for label, x in high.items())
                       + ": their answers open like the VL training answers, a loss by collapse to the template rather than erosion.")
        else:
            out.append(f"{p}: every model's template share on {head} is below {COLLAPSE_SHARE:.0%} (highest "
                       f"{max(x['share'] for x in shares.values()):.2f}): no model answers in the VL template.")
    return out


def _vl_side(r: StudyResults) -> list[str]:
    acc = {b["name"]: b["vl"]["heldout"] for b in (r.build or {}).get("backbones", [])}
    if not acc:
        return []
    worst = min(a["digit_accuracy"] for a in acc.values())
    n = next(iter(acc.values()))["n_images"]
    return [f"VL side: held-out digit accuracy ({n} images, chance 0.10) " + ", ".join(f"{k} {a['digit_accuracy']:.2f}" for k, a in acc.items())
            + "; " + (f"every VLM reads digits well above chance (the lowest {worst / 0.1:.1f}x chance)." if worst >= 0.2 else
                      "some VLMs read digits at most slightly better than chance: their LM was fine-tuned on image chats "
                      "(the text-side effect studied here) without becoming a capable VLM.")]


def _recovered(r: StudyResults, head: str) -> str:
    """Recoveries and harms side by side, over the pairs with a significant loss."""
    if not any(lost(e.degradation[head]) for e in r.pairs.values()):
        return (f"No pair lost {head} beyond noise, so recovery is not measurable here; the 'Δ pts vs base' column still shows "
                "what each intervention costs or gains against the base.")
    read = [(f"{p}/{name} ({per_task[head].recovery.recovery:.2f}, CI {ci_text(per_task[head].recovery.ci, '.2f')})",
             ci_side(per_task[head].recovery.ci))
            for p, e in r.pairs.items() if lost(e.degradation[head])  # recovery of a loss within noise is a ratio of noise
            for name, per_task in e.interventions.items() if not missing(per_task[head].recovery.recovery)]
    recovered, harmed = [x for x, side in read if side > 0], [x for x, side in read if side < 0]
    parts = [f"recovered part of the loss (CI above 0): {', '.join(recovered) or 'none'}",
             f"made it worse (CI below 0, i.e. scored below the VLM LM): {', '.join(harmed) or 'none'}"]
    return (f"Recovery on {head} (pairs with a significant loss; 0 = VLM LM, 1 = base), of {len(read)} interventions: "
            + "; ".join(parts) + f"; the other {len(read) - len(recovered) - len(harmed)} CIs include 0."
            + (" The paper found that no merge recovered IFEval." if not recovered else ""))


def _below_both(r: StudyResults, head: str) -> list[str]:
    """Interventions that scored below both their inputs (the base and the VLM LM), each CI below 0."""
    below = [f"{p}/{name} (vs base {_pts_ci(per_task[head].vs_base)}, vs VLM LM {_pts_ci(per_task[head].vs_vlm)})"
             for p, e in r.pairs.items() for name, per_task in e.interventions.items()
             if kind(e.method(name)) in ("merge", "mitigation") and per_task[head].vs_base is not None
             and comparison_side(per_task[head].vs_base) < 0 and comparison_side(per_task[head].vs_vlm) < 0]
    return [f"Below both of its inputs on {head} (Δ = intervened − input, CI below 0 against the base and the VLM LM): "
            + "; ".join(below) + "."] if below else []


def short(metric: str | None) -> str:
    """A headline metric's name, shortened for tables."""
    return (metric or "").replace(",none", "").replace("exact_match,", "em/")
