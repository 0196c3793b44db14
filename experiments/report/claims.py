"""The paper's claims, each answered from a study's results in one line: agrees, disagrees or not established,
with the numbers that decide it. The report opens with these lines.

Each claim is decided per unit (a pair, and within a pair each training seed an arm was run with): a unit's
answer comes from the side of its CI (`evals.stats.comparison_side`: a comparison of fewer than 6 prompts decides
nothing), and the claim agrees (or disagrees) only where every unit does; otherwise it is not established. The
line says what each unit showed and states that rule with its count ("3 of 4 agree; undecided: ..."). Convention
throughout: Δ = after − before in points (score × 100; negative = capability lost); an arm's Δ is against
its control, the unprotected adaptation with the same training seed (`experiments.study.arms.replicates`).
"""

from __future__ import annotations

from dataclasses import dataclass

from evals.stats import ci_side, comparison_side
from experiments.report.fmt import ci_text, missing, num
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
    """Every claim the study holds evidence for, in the paper's order, then the open direction per protection."""
    found = [_degradation(r), _sink_predicts(r), _qknorm_injection(r), _merges(r), _trajectory(r)]
    return [c for c in found if c is not None] + _protections(r)


def _pts(delta, ci) -> str:
    return "n/a" if missing(delta) else f"{num(delta, '+.1f')} {ci_text(ci, '.1f')}".strip()


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
        c = corr.points
        return Claim("A stronger sink (higher S of the base) predicts less loss", _side_answer(c.spearman_ci, 1),
                     f"Spearman ρ(S, Δ points) = {num(c.spearman, '+.3f')} {ci_text(c.spearman_ci, '.3f')} over {corr.n} pairs "
                     "(ρ > 0: a stronger sink, less loss; the claim holds where the CI, from resampling pairs, lies above 0, "
                     "and is refuted where it lies below). The paper: ρ = +0.971 over six pairs.")
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


def _qknorm_injection(r: StudyResults) -> Claim | None:
    """QK-RMSNorm injected before VL training does not protect (the paper: it lost far more): arms with `qknorm`
    against their seed's control, and the demo's injection intervention against the VLM LM."""
    from experiments.report.verdicts import by_kind

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
            parts.append(f"{p} {name}: Δ = injected + VL − VLM LM = {_pts(c.delta_points, c.delta_points_ci)} pts")
    if not parts:
        return None
    return Claim("QK-RMSNorm injected after pretraining does not protect text skill through VL training", overall(answers),
                 "; ".join(parts) + " (negative = the injection lost more than the same recipe without it)."
                 + _rule(list(zip(labels, answers)), "has its CI below 0") + " The paper: Qwen2.5-3B-Instruct with "
                 "injected unit-gain QK-norm fell from IFEval 59.9 to 11.0 after VL training.")


def _merges(r: StudyResults) -> Claim | None:
    """Merging base and VLM LM after VL training does not recover the loss (the paper: 0 of 7 merges)."""
    from experiments.report.verdicts import by_kind, lost

    t = r.paper_task
    merges = by_kind(r, "merge")
    if not merges:
        return None
    units = [(p, name, per_pair[p][t].recovery) for name, per_pair in merges.items() for p in per_pair
             if lost(r.pairs[p].degradation[t])]
    tried = ", ".join(merges)
    if not units:
        return Claim("Merging the base and the VLM LM after VL training does not recover the loss", OPEN,
                     f"no pair lost {t} beyond noise, so no merge ({tried}) has a loss to recover. The paper: none of 7 "
                     "merges recovered IFEval.")
    recovered = [(p, n, rec) for p, n, rec in units if ci_side(rec.ci) > 0]
    harmed = [f"{p}/{n}" for p, n, rec in units if ci_side(rec.ci) < 0]
    parts = "; ".join(f"{p} {n} {num(rec.recovery, '.2f')} {ci_text(rec.ci, '.2f')}" for p, n, rec in units)
    return Claim("Merging the base and the VLM LM after VL training does not recover the loss",
                 DISAGREES if recovered else AGREES,
                 f"{len(recovered)} of {len(units)} merges recovered part of a significant loss (recovery CI above 0)"
                 + (f", {len(harmed)} made it worse (CI below 0: below the VLM LM: {', '.join(harmed)})" if harmed else "")
                 + f": {parts} (share of the loss recovered: 0 = VLM LM, 1 = base; read only for pairs whose loss CI lies "
                 "below 0). Rule: one merge recovering is enough to refute the claim. The paper: none of 7 merges recovered IFEval.")


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
    """Per training-time protection (text replay excluded): does it keep more text skill than its seed's control,
    and than text replay on the same seed? Yes only where every seed's CI is above 0."""
    t, groups = r.paper_task, {}
    for p, e in r.pairs.items():
        for name, a in e.arms.items():
            if a.protections and a.protections != ["text_replay"]:
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
