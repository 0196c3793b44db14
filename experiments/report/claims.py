"""Every question a study's results answer, decided here and only here, each in one line with the numbers that
decide it: the paper's claims (agrees / disagrees / not established) and the open direction of each training-time
protection, text replay included, and of each post-hoc mitigation (yes / no / not established). The report opens
with these lines; `experiments.report.findings` describes, and decides nothing.

The one rule. A question is decided per unit: a pair, and within a pair each training seed an arm was run with (for
the merges claim, each (pair, merge) whose pair lost beyond noise). A unit answers by the side of its CI
(`evals.stats.comparison_side`, where a comparison of fewer than 6 prompts decides nothing; `evals.stats.ci_side` for a
correlation or a recovery), and the question's answer holds only where every unit gives it; otherwise it is not
established, and the line says so with the count ("k of n agree; undecided: ..."). The merges claim (merging base and
VLM LM does not recover the loss) follows the same rule: a (pair, merge) unit agrees where its recovery CI lies below 0
(the merge scored below the VLM LM) and disagrees where it lies above 0 (it won back part of the loss), so the claim
agrees only where every merge made the loss worse, disagrees only where every merge recovered part of it, and is
otherwise not established ("k recovered, m worse, rest undecided"); one merge recovering no longer refutes it alone.
Convention throughout: Δ = after − before in points (score × 100; negative = capability lost); an arm's Δ is against
its control, the unprotected adaptation with the same training seed (`experiments.study.arms.replicates`); Δ/base =
Δ / the base's score.
"""

from __future__ import annotations

from dataclasses import dataclass

from evals.stats import DEFAULT_CONFIDENCE, DEFAULT_N_BOOT, ci_side, comparison_side, group_difference
from experiments.report.findings import by_kind, lost
from experiments.report.fmt import ci_text, missing, num, with_ci
from experiments.report.published import load_published
from experiments.report.results import ArmResult, StudyResults, vl_accuracy

AGREES, DISAGREES, OPEN = "agrees", "disagrees", "not established"
YES, NO = "yes", "no"


@dataclass
class Claim:
    claim: str  # the claim in words (the paper's, or the open question)
    answer: str  # agrees / disagrees / not established (yes / no for the open direction)
    evidence: str  # the numbers that decide it, with their convention

    def __str__(self) -> str:
        return f"{self.claim} — {self.answer}: {self.evidence}"


def overall(answers: list[str], yes: str = AGREES, no: str = DISAGREES) -> str:
    """The claim's answer from its units': one answer only where every unit gives it."""
    if answers and all(a == yes for a in answers):
        return yes
    if answers and all(a == no for a in answers):
        return no
    return OPEN


def claims(r: StudyResults) -> list[Claim]:
    """Every question the study holds evidence for: the paper's claims in its order, then the open direction per
    protection and per mitigation."""
    found = [_degradation(r), _sink_predicts(r), _native_qk_norm(r), _qknorm_injection(r), _merges(r), _trajectory(r)]
    return [c for c in found if c is not None] + _protections(r) + _mitigations(r)


def _pts(delta, ci) -> str:
    return "n/a" if missing(delta) else f"{num(delta, '+.1f')} {ci_text(ci, '.1f')}".strip()


def _rel(c) -> str:
    """A comparison's Δ/base with its CI (n/a where the base scores 0)."""
    if missing(c.delta_relative):
        return "n/a (base scores 0)"
    return f"{num(c.delta_relative, '+.3f')} {ci_text(c.delta_relative_ci, '.3f')}".strip()


def _same_prompts(c) -> str:
    """A note where an arm passed exactly its control's prompts: no CI width can separate them then (a floor both
    sit on, e.g. every model collapsed to one answer template, reads the same)."""
    return " (the same prompts passed as the control)" if c.lost == 0 and c.gained == 0 and c.n else ""


def _side_answer(c, agree_side: int) -> str:
    """A unit's answer from a comparison's Δ CI (or a bare CI, e.g. a correlation's)."""
    side = ci_side(c) if isinstance(c, (tuple, list)) else comparison_side(c)
    return OPEN if side == 0 else AGREES if side == agree_side else DISAGREES


def _rule(units: list[tuple[str, str]], needs: str) -> str:
    """The claim's rule stated where it applies, with how many units meet it and which do not."""
    agree = sum(a == AGREES for _, a in units)
    disagree = sum(a == DISAGREES for _, a in units)
    undecided = [u for u, a in units if a == OPEN]
    count = f"{agree} of {len(units)} agree" + (f", {disagree} disagree" if disagree else "")
    return (f" Rule: the claim holds only where every unit (pair, and training seed where repeated) {needs}; {count}"
            + (f"; undecided: {', '.join(undecided)}" if undecided else "") + ".")


def _seeded(arms: dict[str, ArmResult], group: str) -> list[tuple[str, ArmResult]]:
    """The arms of one treatment (`group`: its first arm's name), by training seed."""
    members = [(name, a) for name, a in arms.items() if (a.replicate_of or name) == group]
    return sorted(members, key=lambda x: (x[1].training_seed is None, x[1].training_seed or 0))


def _seed(a: ArmResult) -> str:
    return "" if a.training_seed is None else f" (seed {a.training_seed})"


# --------------------------------------------------------------------------- the paper's claims

def _degradation(r: StudyResults) -> Claim | None:
    """VL training costs text skill on strict graders: base -> VLM LM, per pair and control seed."""
    t, answers, parts, labels = r.paper_task, [], [], []
    for p, e in r.pairs.items():
        units = [(e.arms["control"] if "control" in e.arms else None, e.degradation[t])]
        units += [(a, a.vs_base[t]) for name, a in _seeded(e.arms, "control") if name != "control" and a.vs_base]
        for arm, c in units:
            answers.append(_side_answer(c, -1))
            labels.append(f"{p}{_seed(arm) if arm else ''}")
            parts.append(f"{labels[-1]} {_pts(c.delta_points, c.delta_points_ci)} pts "
                         f"({num(100 * c.before, '.1f')} → {num(100 * c.after, '.1f')}, n={c.n})")
    return Claim(f"VL training costs text skill on strict graders ({t})", overall(answers),
                 "; ".join(parts) + ". Δ = VLM LM − base in points, paired 95% CI (negative = lost)."
                 + _rule(list(zip(labels, answers)), "has its CI below 0") + " The paper: IFEval "
                 "Δ from −1.8 to −18.7 points over six 7-8B pairs.")


def _sink_predicts(r: StudyResults) -> Claim | None:
    t = r.paper_task
    corr = r.correlation.get(t)
    if corr:
        c, rel, rep = corr.points, corr.relative, load_published().reported
        return Claim("A stronger sink (higher S of the base) predicts less loss", _side_answer(c.spearman_ci, 1),
                     f"Spearman ρ(S, Δ points) = {num(c.spearman, '+.3f')} {ci_text(c.spearman_ci, '.3f')} and ρ(S, Δ/base) = "
                     f"{num(rel.spearman, '+.3f')} {ci_text(rel.spearman_ci, '.3f')} over {corr.n} pairs, {corr.confidence:.0%} CIs "
                     "resampling pairs (ρ > 0: a stronger sink, less loss; the claim holds where the CI of ρ on points lies above 0, "
                     f"and is refuted where it lies below). The paper, same convention: ρ = {rep['spearman_points']:+.3f} on points "
                     f"and {rep['spearman_relative']:+.3f} on Δ/base over six 7-8B pairs.")
    rows = [(p, e.models["base"].sink_strength, e.degradation[t]) for p, e in r.pairs.items()]
    rows = [(p, s, d) for p, s, d in rows if not missing(s) and not missing(d.delta_points)]
    if len(rows) != 2:
        return None
    (p1, s1, d1), (p2, s2, d2) = sorted(rows, key=lambda x: -x[1])
    order = ("the paper's order" if d1.delta_points > d2.delta_points else
             "the opposite of the paper's order" if d1.delta_points < d2.delta_points else "no order")
    return Claim("A stronger sink (higher S of the base) predicts less loss", OPEN,
                 f"two backbones cannot establish a rank correlation: {p1} S = {num(s1, '+.2f')}, Δ = "
                 f"{_pts(d1.delta_points, d1.delta_points_ci)} pts; {p2} S = {num(s2, '+.2f')}, Δ = "
                 f"{_pts(d2.delta_points, d2.delta_points_ci)} pts ({order}: the stronger sink lost "
                 f"{'less' if d1.delta_points > d2.delta_points else 'more' if d1.delta_points < d2.delta_points else 'as much'}). "
                 "The paper: ρ = +0.971 over six pairs.")


def _native_qk_norm(r: StudyResults) -> Claim | None:
    """Backbones with QK-norm of their own lose less text skill in VL training (the paper's direction). One unit: the
    difference of mean Δ/base between the native and the other pairs, by the side of its CI resampling each group."""
    t = r.paper_task
    native = [e.degradation[t].delta_relative for e in r.pairs.values() if e.native_qk_norm]
    plain = [e.degradation[t].delta_relative for e in r.pairs.values() if e.native_qk_norm is False]
    if not native or not plain or any(missing(x) for x in native + plain):
        return None
    s = r.settings
    g = group_difference(native, plain, n_boot=int(s.get("n_boot") or DEFAULT_N_BOOT),
                         confidence=float(s.get("confidence") or DEFAULT_CONFIDENCE), seed=int(s.get("seed") or 0))
    n = lambda k: f"{k} pair{'s' if k != 1 else ''}"  # noqa: E731
    return Claim("Backbones with QK-norm of their own lose less text skill through VL training", _side_answer(g.ci, 1),
                 f"mean Δ/base {g.mean_a:+.3f} with native QK-norm ({n(g.n_a)}) vs {g.mean_b:+.3f} without ({n(g.n_b)}); difference "
                 f"{with_ci(g.difference, g.ci, '+.3f')} ({g.confidence:.0%} CI resampling the pairs of each group; > 0: the native "
                 "backbones lost less)" + ("; with one pair in a group there is no CI over pairs" if missing(g.ci[0]) else "")
                 + ". Rule: one unit, the difference; the claim holds where its CI lies above 0 and is refuted where it lies below.")


def _qknorm_injection(r: StudyResults) -> Claim | None:
    """QK-RMSNorm injected before VL training does not protect (the paper: it lost far more): arms with `qknorm`
    against their seed's control, and the demo's injection intervention against the VLM LM (and, beside it, against
    the base in Δ/base, with the native QK-norm pairs' own)."""
    t, answers, parts, labels = r.paper_task, [], [], []
    for p, e in r.pairs.items():
        groups = dict.fromkeys((a.replicate_of or name) for name, a in e.arms.items() if a.qknorm)
        for g in groups:
            for name, a in _seeded(e.arms, g):
                c = a.vs_control[t]
                answers.append(_side_answer(c, -1))
                labels.append(f"{p} {g}{_seed(a)}")
                parts.append(f"{p} {g} ({a.qknorm['init']}){_seed(a)}: Δ = arm − control = {_pts(c.delta_points, c.delta_points_ci)} pts"
                             + _same_prompts(c))
    for name, per_pair in by_kind(r, "qknorm+vl").items():
        for p, per_task in per_pair.items():
            c = per_task[t].vs_vlm
            answers.append(_side_answer(c, -1))
            labels.append(f"{p} {name}")
            parts.append(f"{p} {name}: Δ = injected + VL − VLM LM = {_pts(c.delta_points, c.delta_points_ci)} pts, against the "
                         f"base Δ/base = {_rel(per_task[t].vs_base)}")
    if not parts:
        return None
    native = [f"{p} Δ/base = {_rel(e.degradation[t])}" for p, e in r.pairs.items() if e.native_qk_norm]
    q = load_published().qknorm_injection
    paper = (f" The paper: {q['base']} with injected unit-gain QK-norm fell from IFEval {q['ifeval_base']:.1f} to {q['ifeval_after']:.1f} "
             f"after VL training (Δ/base = {(q['ifeval_after'] - q['ifeval_base']) / q['ifeval_base']:+.3f}).") if q else ""
    return Claim("QK-RMSNorm injected after pretraining does not protect text skill through VL training", overall(answers),
                 "; ".join(parts) + " (negative = the injection lost more than the same recipe without it)"
                 + (f"; native QK-norm pairs from VL training: {', '.join(native)}" if native else "") + "."
                 + _rule(list(zip(labels, answers)), "has its CI below 0") + paper)


def _merges(r: StudyResults) -> Claim | None:
    """Merging base and VLM LM after VL training does not recover the loss (the paper: 0 of 7 merges). Units: each
    (pair, merge) whose pair lost beyond noise; agrees where its recovery CI lies below 0, disagrees above 0."""
    t = r.paper_task
    merges = by_kind(r, "merge")
    if not merges:
        return None
    m = load_published().merges
    paper = f" The paper: none of its {len(m['tried'])} merges recovered IFEval." if m else ""
    claim = "Merging the base and the VLM LM after VL training does not recover the loss"
    units = [(f"{p}/{name}", per_pair[p][t].recovery) for name, per_pair in merges.items() for p in per_pair
             if lost(r.pairs[p].degradation[t])]
    if not units:
        return Claim(claim, OPEN, f"no pair lost {t} beyond noise, so no merge ({', '.join(merges)}) has a loss to recover "
                                  f"(a share of a loss within noise is a ratio of noise).{paper}")
    answers = [{-1: AGREES, 1: DISAGREES}.get(ci_side(rec.ci), OPEN) for _, rec in units]
    recovered = [u for (u, _), a in zip(units, answers) if a == DISAGREES]
    worse = [u for (u, _), a in zip(units, answers) if a == AGREES]
    shares = "; ".join(f"{u} {num(rec.recovery, '.2f')} {ci_text(rec.ci, '.2f')}" for u, rec in units)
    return Claim(claim, overall(answers),
                 f"{len(recovered)} recovered, {len(worse)} worse, {len(units) - len(recovered) - len(worse)} undecided of "
                 f"{len(units)} (pair, merge) units with a significant loss"
                 + (f"; recovered part of it (CI above 0): {', '.join(recovered)}" if recovered else "")
                 + (f"; made it worse (CI below 0: below the VLM LM): {', '.join(worse)}" if worse else "")
                 + f". Share of the loss recovered (0 = VLM LM, 1 = base), with its CI: {shares}. Rule: the claim agrees only "
                 "where every unit's recovery CI lies below 0, disagrees only where every one lies above 0, else it is not "
                 f"established.{paper}")


def _trajectory(r: StudyResults) -> Claim | None:
    """VL training lowers S while text-only training of the same length does not, and text scores follow.
    Units: each text-only arm against the VL control of its pair and seed; and each VL control with no
    text-only twin, which cannot confirm the contrast but refutes the claim's first half where S does not fall."""
    t, answers, parts, labels = r.paper_task, [], [], []
    for p, e in r.pairs.items():
        controls = {a.training_seed: a for _, a in _seeded(e.arms, "control")}
        twinned = set()
        for name, a in e.arms.items():
            vl = controls.get(a.training_seed)
            if not a.text_only or vl is None:
                continue
            s_vl, s_txt = _s_change(vl), _s_change(a)
            if s_vl is None or s_txt is None:
                continue
            twinned.add(a.training_seed)
            c = a.vs_control[t]
            labels.append(f"{p}{_seed(a)}")
            if s_vl >= 0 or s_txt < s_vl or comparison_side(c) < 0:
                answers.append(DISAGREES)
            elif comparison_side(c) > 0:
                answers.append(AGREES)
            else:
                answers.append(OPEN)
            parts.append(f"{p}{_seed(a)}: S {_s_text(vl)} under VL training, {_s_text(a)} under text-only training ({name}); "
                         f"Δ = text-only − VL control = {_pts(c.delta_points, c.delta_points_ci)} pts")
        for seed, vl in controls.items():
            s_vl = _s_change(vl)
            if seed in twinned or s_vl is None:
                continue
            if s_vl >= 0:
                answers.append(DISAGREES)
                labels.append(f"{p}{_seed(vl)}")
            parts.append(f"{p}{_seed(vl)}: S {_s_text(vl)} under VL training (no text-only run of this seed"
                         f"{': S did not fall' if s_vl >= 0 else ''})")
    if not answers:
        return None
    return Claim("VL training lowers S while text-only training of the same length does not, and text skill follows",
                 overall(answers), "; ".join(parts) + " (S: first and last point of the run's trajectory, one run per seed, no CI; "
                 "a unit agrees where S falls under VL training, falls less under text training, and the text-only run keeps more "
                 "text skill with its CI above 0; a VL control without a text-only twin disagrees where its S does not fall)."
                 + _rule(list(zip(labels, answers)), "agrees"))


def _s_change(a: ArmResult) -> float | None:
    points = [x["sink_strength"] for x in ((a.adapt or {}).get("trajectory") or []) if not missing(x.get("sink_strength"))]
    return points[-1] - points[0] if len(points) >= 2 else None


def _s_text(a: ArmResult) -> str:
    points = [x["sink_strength"] for x in ((a.adapt or {}).get("trajectory") or []) if not missing(x.get("sink_strength"))]
    return f"{points[0]:+.2f} → {points[-1]:+.2f} (Δ {points[-1] - points[0]:+.2f})"


# --------------------------------------------------------------------------- the open direction

def _protections(r: StudyResults) -> list[Claim]:
    """Per training-time protection, text replay (the baseline) included: does it keep more text skill than its seed's
    control, and (a sink-specific one) than text replay on the same seed? Yes only where every seed's CI is above 0."""
    t, groups = r.paper_task, {}
    for p, e in r.pairs.items():
        for name, a in e.arms.items():
            if a.protections and a.vs_control:
                groups.setdefault(a.replicate_of or name, []).append((p, name, a))
    out = []
    for g, members in groups.items():
        vs_c = [_side_answer(a.vs_control[t], 1) for _, _, a in members]
        vs_r = [_side_answer(a.vs_replay[t], 1) for _, _, a in members if a.vs_replay]
        parts = []
        for p, name, a in members:
            c = a.vs_control[t]
            text = f"{p}{_seed(a)}: vs control {_pts(c.delta_points, c.delta_points_ci)} pts{_same_prompts(c)}"
            if a.vs_replay:
                x = a.vs_replay[t]
                text += f", vs text replay {_pts(x.delta_points, x.delta_points_ci)} pts"
            skill = vl_accuracy(a.vl_skill)
            parts.append(text + (f", VL skill {skill:.2f}" if not missing(skill) else ""))
        answer = {AGREES: YES, DISAGREES: NO}.get(overall(vs_c), OPEN)
        if answer == YES and vs_r:
            answer = {AGREES: YES, DISAGREES: NO}.get(overall(vs_r), OPEN) + " (against text replay)"
        out.append(Claim(f"Open direction: does {g} ({', '.join(members[0][2].protections)}) keep more text skill than the "
                         "unprotected adaptation" + (" and than text replay" if vs_r else ""), answer,
                         "; ".join(parts) + " (Δ = arm − control or − text replay, same seed; positive = kept more)."
                         + _rule([(f"{p}{_seed(a)}", x) for (p, _, a), x in zip(members, vs_c)], "has its CI against the control above 0")))
    return out


def _mitigations(r: StudyResults) -> list[Claim]:
    """Per post-hoc mitigation: does it beat its control, the unmitigated VLM LM? Units: the pairs, by the CI of
    Δ = mitigated − VLM LM; yes only where every pair's lies above 0."""
    t, out = r.paper_task, []
    for name, per_pair in by_kind(r, "mitigation").items():
        units = [(p, per_task[t].vs_vlm) for p, per_task in per_pair.items()]
        answers = [_side_answer(c, 1) for _, c in units]
        parts = []
        for p, c in units:
            cost = r.pairs[p].vl_cost.get(name) or {}
            vl = "" if missing(cost.get("delta_points")) else f", Δ VL vs the VLM {num(cost['delta_points'], '+.1f')} pts"
            parts.append(f"{p}: {_pts(c.delta_points, c.delta_points_ci)} pts{vl}")
        out.append(Claim(f"Open direction: does mitigation {name} keep more text skill than its control (the unmitigated VLM LM)",
                         {AGREES: YES, DISAGREES: NO}.get(overall(answers), OPEN),
                         "; ".join(parts) + " (Δ = mitigated − VLM LM; positive = better)."
                         + _rule([(p, a) for (p, _), a in zip(units, answers)], "has its CI above 0")))
    return out
