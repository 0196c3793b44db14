"""What a study's numbers say, in words: every verdict the report states, decided here and only here.

A sign is established only where its CI excludes 0 (`evals.stats.ci_side`), and a comparison of fewer than
6 prompts establishes none (`evals.stats.comparison_side`); a recovery is read only for pairs that lost
beyond noise (a share of a loss within noise is a ratio of noise), and both sides are named: recoveries
(CI above 0) and harms (CI below 0: below the VLM LM). Every comparison carries its CI. Convention
throughout: Δ = after − before in points (score × 100; base -> VLM LM: negative = capability lost),
relative = Δ / before; the paper's direction in it is ρ(S, Δ) > 0 (experiments/data/published_choi2026.yaml).
Inputs are `experiments.report.results.StudyResults` (the summary's typed statistics).
"""

from __future__ import annotations

from evals.stats import DEFAULT_CONFIDENCE, DEFAULT_N_BOOT, MIN_CONCLUSIVE_N, Comparison, ci_side, comparison_side, group_difference
from experiments.report.fmt import ci_text, missing, num, points, with_ci
from experiments.report.results import StudyResults, vl_accuracy

PAPER_DIRECTION = ("Δ = VLM LM − base in points (negative = capability lost), Δ/base = Δ / the base's score; in this "
                   "convention the paper's direction is ρ > 0 (a stronger sink, less loss)")
_CI_WORDS = {1: "CI above 0", -1: "CI below 0", 0: "CI includes 0"}


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
    from interventions.merge import MERGEKIT_METHODS
    from interventions.spectral import SPECTRAL_METHODS

    return "merge" if method in MERGEKIT_METHODS or method in SPECTRAL_METHODS else "mitigation"


def by_kind(r: StudyResults, what: str) -> dict[str, dict[str, dict]]:
    """{treated model: {pair: per-task effects}} of one kind, in the summary's order."""
    out: dict[str, dict[str, dict]] = {}
    for p, e in r.pairs.items():
        for name, per_task in e.interventions.items():
            if kind(e.method(name)) == what:
                out.setdefault(name, {})[p] = per_task
    return out


def _answer(sides: list[int]) -> str:
    """yes / no only where every unit (pair, and seed where an arm was repeated) says so."""
    up, down = sides.count(1), sides.count(-1)
    if up == len(sides):
        return "yes"
    if down == len(sides):
        return "no: worse"
    return f"on {up} of {len(sides)} pairs/seeds" + (f" (worse on {down})" if down else "") if up or down else "not established"


# --------------------------------------------------------------------------- the verdict lines

def verdicts(r: StudyResults) -> list[str]:
    """One line per study question the results hold, each with its number, CI and convention; for the demo,
    where its miniatures' S lies comes first, so no one reads its ρ as a test of sinks."""
    first = [miniature_sink_finding(r)] if _trained(r) else []
    return first + _sink(r) + _qknorm(r) + _merges(r) + _protections(r)


def _sink(r: StudyResults) -> list[str]:
    from experiments.report.published import load_published

    rep, out = load_published().reported, []
    for t, corr in r.correlation.items():
        pts, rel = corr.points, corr.relative
        answer = {1: "yes, in the paper's direction", -1: "no: the opposite of the paper's direction",
                  0: "not established"}[ci_side(pts.spearman_ci)]
        out.append(f"Does S track degradation on {t}? {answer}: Spearman ρ(S, Δ points) = {_rho(pts)} ({_CI_WORDS[ci_side(pts.spearman_ci)]}), "
                   f"ρ(S, Δ/base) = {_rho(rel)} ({_CI_WORDS[ci_side(rel.spearman_ci)]}); {corr.n} pairs, {corr.confidence:.0%} CIs "
                   f"resampling pairs; Δ = VLM LM − base in points (negative = capability lost). The paper, same convention: "
                   f"ρ = {rep['spearman_points']:+.3f} on points and {rep['spearman_relative']:+.3f} on Δ/base over six 7-8B pairs "
                   "(ρ > 0: a stronger sink, less loss).")
    return out


def _qknorm(r: StudyResults) -> list[str]:
    from experiments.report.published import load_published

    q, t = load_published().qknorm_injection, r.tasks[0]
    native = [(p, e.degradation[t]) for p, e in r.pairs.items() if e.native_qk_norm]
    out = []
    for name, per_pair in by_kind(r, "qknorm+vl").items():
        for p, per_task in per_pair.items():
            c, vb = per_task[t].vs_vlm, per_task[t].vs_base
            answer = {1: "yes, against the control", -1: "no: it lost more than the control",
                      0: "not established against the control"}[comparison_side(c)]
            line = (f"Does injected QK-norm protect {p} on {t}? {answer}: Δ = {name} − VLM LM = {_pts_ci(c)} (the control: the same "
                    f"VL recipe on the uninjected base; positive = the injection kept more text skill); against the base Δ/base = "
                    f"{_rel_ci(vb)}")
            if native:
                line += "; native QK-norm pairs: " + ", ".join(f"{n} Δ/base = {_rel_ci(d)}" for n, d in native)
            if q:
                line += (f". The paper: no ({q['base']} with injected QK-norm scored IFEval {q['ifeval_after']:g} after VL training "
                         f"vs {q['ifeval_base']:g} for the base, Δ/base = {(q['ifeval_after'] - q['ifeval_base']) / q['ifeval_base']:+.3f})")
            out.append(line + ".")
    return out


def _merges(r: StudyResults) -> list[str]:
    """Per merge: the share of each significant loss it recovered, with its CI."""
    from experiments.report.published import load_published

    m = load_published().merges
    paper = f" The paper: none of its {len(m['tried'])} merges recovered IFEval." if m else ""
    out, unmeasurable = [], []
    for name, per_pair in by_kind(r, "merge").items():
        parts, above, below = [], 0, 0
        for p, per_task in per_pair.items():
            for t in r.tasks:
                if not lost(r.pairs[p].degradation[t]):
                    continue  # recovery of a loss within noise is a ratio of noise
                rec = per_task[t].recovery
                above += ci_side(rec.ci) > 0
                below += ci_side(rec.ci) < 0
                parts.append(f"{p} {t} {with_ci(rec.recovery, rec.ci, '.2f')}")
        if not parts:
            unmeasurable.append(name)
            continue
        answer = "yes" if above == len(parts) else f"on {above} of {len(parts)}" if above else "no"
        harm = f"; worse than the VLM LM (CI below 0) on {below} of {len(parts)}" if below else ""
        out.append(f"Does {name} recover? {answer}{harm}: share of the loss recovered (0 = VLM LM, 1 = base; CI above 0 = "
                   f"recovered some, below 0 = scored below the VLM LM): " + "; ".join(parts) + "." + paper)
    if unmeasurable:
        out.append(f"Does {' / '.join(unmeasurable)} recover? not measurable: no pair ({', '.join(r.pairs)}) lost capability beyond "
                   f"noise on any task (a share of a loss within noise is a ratio of noise).{paper}")
    return out


def _protections(r: StudyResults) -> list[str]:
    """Per protection arm (against the control adaptation) and per post-hoc mitigation (against the VLM LM)."""
    tasks, out = r.tasks, []
    arms: dict[str, list[str]] = {}
    sides: dict[str, list[int]] = {}
    for p, e in r.pairs.items():
        for arm, a in e.arms.items():
            group = a.replicate_of or arm  # seed replicates answer one question, each seed against its own control
            if not a.vs_control or group == "control" or a.text_only:  # text-only training: the trajectory claim's contrast
                continue
            control = e.arms.get(a.control or "control")
            skill, ctrl_skill = _skill(a), _skill(control)
            repeated = sum((x.replicate_of or n) == group for n, x in e.arms.items()) > 1
            seed = f" seed {a.training_seed}" if repeated else ""
            arms.setdefault(group, []).append(
                f"{p}{seed}: " + ", ".join(f"{t} {_pts_ci(a.vs_control[t])}" for t in tasks)
                + (f" (VL skill {skill:.2f} vs control {ctrl_skill:.2f})" if not missing(skill) and not missing(ctrl_skill) else ""))
            sides.setdefault(group, []).append(comparison_side(a.vs_control[tasks[0]]))
    for arm, parts in arms.items():
        out.append(f"Does protection {arm} beat the control? {_answer(sides[arm])} on {tasks[0]}: Δ = arm − control adaptation "
                   "of the same training seed (positive = kept more text skill): " + "; ".join(parts) + ".")
    for name, per_pair in by_kind(r, "mitigation").items():
        parts = [f"{p}: " + ", ".join(f"{t} {_pts_ci(per_task[t].vs_vlm)}" for t in tasks) for p, per_task in per_pair.items()]
        s = [comparison_side(per_task[tasks[0]].vs_vlm) for per_task in per_pair.values()]
        out.append(f"Does mitigation {name} beat its control (the unmitigated VLM LM)? {_answer(s)} on {tasks[0]}: "
                   "Δ = mitigated − VLM LM (positive = better): " + "; ".join(parts) + ".")
    return out


def _skill(arm) -> float | None:
    return vl_accuracy(arm.vl_skill if arm else None)


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
    from experiments.report.published import load_published

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

def _trained(r: StudyResults) -> set[str]:
    """The demo's backbones trained from scratch (its miniature pairs)."""
    return {b["name"] for b in (r.build or {}).get("backbones", []) if b["kind"] == "trained"}


def miniature_sink_finding(r: StudyResults) -> str:
    """Where the miniatures' S lies, said plainly, beside the real models' S measured the same way."""
    vals = [x for x in r.base_strengths(_trained(r)) if not missing(x)]
    if not vals:
        return "No base has a defined Sink Strength."
    lo, hi = min(vals), max(vals)
    real = "; ".join(f"{x['name']}: S = {x['sink_strength']:+.2f} (mean sink mass {x['mean_mass']:.2f}, {x['layers']} layers)"
                     for x in (r.build or {}).get("references", []))
    if hi > 0:
        head = f"Base S spans {lo:.2f} to {hi:.2f} (span {hi - lo:.2f}); {sum(x > 0 for x in vals)} of {len(vals)} bases have S > 0."
    else:
        head = (f"No miniature base reaches S > 0: base S spans {lo:.2f} to {hi:.2f} (span {hi - lo:.2f}, {len(vals)} backbones). "
                "No training recipe within the demo's budget grows a sink on the calibration prompts (docs/sink-growth.md); "
                "the spread comes from lr, QK-norm and noise knobs and ranks how sharply heads attend to non-BOS keys, "
                "not how strong a sink is (published S 0.24 to 2.36 for 7-8B bases).")
    return head + (f" Real-scale reference, same metric and prompts: {real}." if real else "")


def agreement_finding(r: StudyResults) -> str:
    """Whether the miniature agrees with the paper (ρ > 0 in the Δ = after − before convention), and why it might not."""
    s_base, corr = r.base_strengths(), r.correlation.get(r.tasks[0])
    why = ("Why the miniature may differ from the paper: its models have about a million parameters or fewer, pretrained for a few "
           "hundred steps on generated text, its VL task is 8x8 digits, its stage 2 mixes in text-only chats, and "
           + ("no base has a sink (S < 0 throughout), so S here measures attention sharpness rather than the sink the paper "
              "ties to text retention." if s_base and all(not missing(x) and x < 0 for x in s_base) else
              "few pairs decide a rank correlation."))
    if not corr:
        return "Agreement with the paper cannot be judged: no correlation was computed. " + why
    signs = [ci_side(c.spearman_ci) for c in (corr.points, corr.relative)]
    if signs == [1, 1]:
        verdict = "The miniature agrees with the paper: ρ > 0 in both conventions, both CIs above 0."
    elif -1 in signs:
        verdict = ("The miniature disagrees with the paper: ρ < 0 with its CI below 0 in "
                   + " and ".join(k for k, x in zip(("Δ points", "Δ/base"), signs) if x == -1) + ".")
    elif 1 in signs:
        verdict = "The miniature partly agrees with the paper: ρ > 0 with a CI above 0 on one convention only."
    else:
        verdict = "The miniature neither agrees nor disagrees with the paper: both CIs include 0."
    return verdict + " " + why


def findings(r: StudyResults) -> list[str]:
    """The per-pair change on the first task, the QK-norm arms against the base, agreement with the paper (the
    demo), the native-QK-norm contrast, the VL side of the build and what recovered."""
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
    s_base, trained = r.base_strengths(), _trained(r)
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
    if trained:
        out.append(agreement_finding(r))
    out += _native_contrast(r, head) + _vl_side(r) + [_recovered(r, head)] + _below_both(r, head) + _templated(r, head)
    return out


def _templated(r: StudyResults, head: str) -> list[str]:
    """Per pair, the models whose eval answers mostly open like the VL training answers (template share at or above
    `evals.template_share.COLLAPSE_SHARE`): their text loss is collapse to the template, not erosion."""
    from evals.template_share import COLLAPSE_SHARE

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


def _native_contrast(r: StudyResults, head: str) -> list[str]:
    """Mean Δ/base of the native QK-norm backbones minus that of the others, with its CI over pairs."""
    native = [e.degradation[head].delta_relative for e in r.pairs.values() if e.native_qk_norm]
    plain = [e.degradation[head].delta_relative for e in r.pairs.values() if e.native_qk_norm is False]
    if not native or not plain or any(missing(x) for x in native + plain):
        return []
    s = r.settings
    g = group_difference(native, plain, n_boot=int(s.get("n_boot") or DEFAULT_N_BOOT), confidence=float(s.get("confidence") or DEFAULT_CONFIDENCE),
                         seed=int(s.get("seed") or 0))
    side = ci_side(g.ci)
    answer = ("the paper's direction (QK-norm protects), CI above 0" if side > 0 else
              "the opposite of the paper's direction, CI below 0" if side < 0 else
              "no CI over pairs with one pair in a group: not established" if missing(g.ci[0]) else
              "the CI includes 0: not established whether QK-norm protects")
    n = lambda k: f"{k} pair{'s' if k != 1 else ''}"  # noqa: E731
    return [f"Native QK-norm backbones: mean Δ/base {g.mean_a:+.3f} ({n(g.n_a)}) vs {g.mean_b:+.3f} without ({n(g.n_b)}); "
            f"difference {with_ci(g.difference, g.ci, '+.3f')} ({g.confidence:.0%} CI resampling the pairs of each group; "
            f"Δ/base = (VLM LM − base) / base, negative = loss; > 0: the native backbones lost less): {answer}."]


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
