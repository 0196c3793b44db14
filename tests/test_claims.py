"""The paper's claims answered from a summary: each claim agrees or disagrees only where every unit (pair,
and each training seed an arm ran with) says so through its CI; otherwise it is not established. Built on
the report tests' summary (real paired statistics over per-prompt outcomes), with seed replicates added
the way `experiments.study.arms.protection_summary` writes them."""

import pytest

from evals.eval_run import HEADLINE_METRICS
from evals.stats import ci_side, compare
from tests.test_report import KW, TASKS, _outcomes, make_summary, maps_dir  # noqa: F401 (a fixture)


@pytest.fixture
def summary(maps_dir):
    return make_summary(maps_dir)


def _claims(summary):
    from experiments.report.claims import claims
    from experiments.report.results import StudyResults

    return {c.claim.split(" (")[0]: c for c in claims(StudyResults.of(summary))}


def _arm(label, protections, seed, vs, *, replicate_of=None, control="control", extra=None):
    base, vlm, _ = _outcomes(12)
    return {"label": label, "protections": protections, "vl_skill": None, "sink_strength": 0.1, "adapt": None,
            "training_seed": seed, "replicate_of": replicate_of, "control": control,
            "vs_control": {t: compare(vlm, vs, t, HEADLINE_METRICS[t], **KW).as_dict() for t in TASKS}, **(extra or {})}


def test_each_claim_follows_the_side_of_every_units_ci(summary):
    c = _claims(summary)
    t = "sinkstudy_ifeval"
    sides = [ci_side(e["degradation"][t]["delta_points_ci"]) for e in summary["pairs"].values()]
    degradation = c["VL training costs text skill on strict graders"]
    assert degradation.answer == ("agrees" if set(sides) == {-1} else "not established")
    assert "p0 " in degradation.evidence and "Δ = VLM LM − base in points" in degradation.evidence
    # qknorm-vl regains all but 2 lost prompts: Δ against the VLM LM above 0 on every lossy pair -> it protected
    q = c["QK-RMSNorm injected after pretraining does not protect text skill through VL training"]
    q_sides = [ci_side(e["interventions"]["qknorm-vl"][t]["vs_vlm"]["delta_points_ci"]) for e in summary["pairs"].values()]
    assert q.answer == ("disagrees" if set(q_sides) == {1} else "not established")
    assert "59.9 to 11.0" in q.evidence
    m = c["Merging the base and the VLM LM after VL training does not recover the loss"]
    sides = [ci_side(e["interventions"]["linear"][t]["recovery"]["ci"]) for e in summary["pairs"].values()
             if ci_side(e["degradation"][t]["delta_points_ci"]) < 0]
    assert m.answer == ("agrees" if set(sides) == {-1} else "disagrees" if set(sides) == {1} else "not established")
    assert f"{sides.count(1)} recovered, {sides.count(-1)} worse, {sides.count(0)} undecided of {len(sides)}" in m.evidence
    assert c["A stronger sink"].answer in ("agrees", "disagrees", "not established")
    # the open directions: text replay (the baseline every protection is also set against) and the mitigation
    assert [k for k in c if k.startswith("Open direction")] == ["Open direction: does replay", "Open direction: does mitigation head_restore keep more text skill than its control"]


def test_a_protection_is_answered_only_where_every_seed_agrees(summary):
    """Seed 0 keeps 10 more prompts than its control (CI above 0), seed 1 loses 10 (CI below 0) against the control
    of seed 1: no answer across seeds, though seed 0 alone would say yes. The control's seed-1 replicate adds its own
    degradation as a unit of the first claim."""
    base, vlm, _ = _outcomes(12)
    _, _, better = _outcomes(12, 10)
    worse = vlm.copy()
    worse[20:30] = False
    arms = summary["pairs"]["p1"]["protection"]["arms"]
    arms["control"]["training_seed"] = 0
    arms["control-s1"] = _arm("control-s1", [], 1, vlm, replicate_of="control",
                              extra={"vs_base": {t: compare(base, vlm, t, HEADLINE_METRICS[t], **KW).as_dict() for t in TASKS}})
    arms["head"] = _arm("head", ["sink_head_freeze"], 0, better)
    arms["head-s1"] = _arm("head-s1", ["sink_head_freeze"], 1, worse, replicate_of="head", control="control-s1")
    c = _claims(summary)
    head = next(x for k, x in c.items() if k.startswith("Open direction: does head"))
    assert head.answer == "not established"
    assert "p1 (seed 0): vs control +16.7" in head.evidence and "p1 (seed 1): vs control -16.7" in head.evidence
    assert "p1 (seed 1) " in c["VL training costs text skill on strict graders"].evidence
    assert "1 of 2 agree, 1 disagree" in head.evidence  # the rule's count, in the one line that answers
    assert not any("control-s1" in k for k in c)  # the seed's effect, not a protection
    del arms["head-s1"]
    assert next(x for k, x in _claims(summary).items() if k.startswith("Open direction: does head")).answer == "yes"


def _trajectory(*s):
    return {"trajectory": [{"step": 10 * i, "stage": "stage2", "sink_strength": x} for i, x in enumerate(s)]}


def test_the_trajectory_claim_needs_every_seeds_vl_control_to_lower_s(summary):
    """Seed 0: S falls under VL training, rises under text-only training, which keeps 10 more prompts -> agrees.
    A seed-1 control with no text-only twin whose S does not fall refutes the claim's first half on that seed."""
    _, vlm, _ = _outcomes(12)
    _, _, better = _outcomes(12, 10)
    arms = summary["pairs"]["p1"]["protection"]["arms"]
    arms["control"].update(training_seed=0, adapt=_trajectory(1.5, 0.2, -0.3))
    arms["text"] = _arm("text", [], 0, better, extra={"text_only": {"json": "chats.jsonl"}, "adapt": _trajectory(1.5, 1.6, 1.8)})
    key = "VL training lowers S while text-only training of the same length does not, and text skill follows"
    claim = _claims(summary)[key]
    assert claim.answer == "agrees" and "p1 (seed 0): S +1.50 → -0.30 (Δ -1.80) under VL training" in claim.evidence
    arms["control-s1"] = _arm("control-s1", [], 1, vlm, replicate_of="control", extra={"adapt": _trajectory(1.5, 1.52)})
    claim = _claims(summary)[key]
    assert claim.answer == "not established"
    assert "p1 (seed 1): S +1.50 → +1.52 (Δ +0.02) under VL training (no text-only run of this seed: S did not fall)" in claim.evidence
    arms["control-s1"]["adapt"] = _trajectory(1.5, 1.1)
    assert _claims(summary)[key].answer == "agrees"


def test_an_arm_passing_exactly_its_controls_prompts_is_said_to(summary):
    """Δ 0.0 [0.0, 0.0] may hide a floor both sit on: the line says when not one prompt moved, and only then."""
    _, vlm, _ = _outcomes(12)
    _, _, better = _outcomes(12, 10)
    arms = summary["pairs"]["p1"]["protection"]["arms"]
    arms["same"] = _arm("same", ["sink_head_freeze"], None, vlm.copy())
    arms["moved"] = _arm("moved", ["sink_head_freeze"], None, better)
    c = _claims(summary)
    same, moved = (c[f"Open direction: does {n}"] for n in ("same", "moved"))
    assert "vs control +0.0 [0.0, 0.0] pts (the same prompts passed as the control)" in same.evidence
    assert "the same prompts passed" not in moved.evidence


def test_each_line_states_its_rule_and_lists_harms_beside_recoveries(summary):
    """The degradation claim says that every unit must agree and how many do; a merge scoring below the VLM LM is
    named as a harm in the claim, the merge verdict and the findings (beside the recoveries), and as below both of its
    inputs; the native-QK-norm contrast carries a CI over pairs."""
    from evals.stats import recovery
    from experiments.report.findings import findings
    from experiments.report.results import StudyResults

    t = "sinkstudy_ifeval"
    base, vlm, _ = _outcomes(20)
    worse = vlm.copy()
    worse[20:36] = False  # the merge loses 16 more prompts than the VLM LM
    summary["pairs"]["p2"]["interventions"]["linear"] = {
        task: {"recovery": recovery(base, vlm, worse, task, HEADLINE_METRICS[task], **KW).as_dict(),
               "vs_base": compare(base, worse, task, HEADLINE_METRICS[task], **KW).as_dict(),
               "vs_vlm": compare(vlm, worse, task, HEADLINE_METRICS[task], **KW).as_dict()} for task in TASKS}
    degradation = _claims(summary)["VL training costs text skill on strict graders"]
    sides = {p: ci_side(e["degradation"][t]["delta_points_ci"]) for p, e in summary["pairs"].items()}
    agree = sum(s == -1 for s in sides.values())
    assert f"Rule: the claim holds only where every unit (pair, and training seed where repeated) has its CI below 0; {agree} of 3 agree" \
        in degradation.evidence
    if agree < 3:
        assert degradation.answer == "not established" and "undecided: " + ", ".join(p for p, s in sides.items() if s == 0) in degradation.evidence
    merges = _claims(summary)["Merging the base and the VLM LM after VL training does not recover the loss"]
    assert "made it worse (CI below 0: below the VLM LM): p2/linear" in merges.evidence
    found = findings(StudyResults.of(summary))
    recovered = next(f for f in found if f.startswith("Recovery on sinkstudy_ifeval"))
    assert "made it worse (CI below 0, i.e. scored below the VLM LM): p2/linear (-0.80" in recovered and "recovered part of the loss" in recovered
    assert any(f.startswith("Below both of its inputs on sinkstudy_ifeval") and "p2/linear (vs base -60.0" in f for f in found)
    native = _claims(summary)["Backbones with QK-norm of their own lose less text skill through VL training"]
    assert native.answer == "not established" and "with native QK-norm (1 pair) vs" in native.evidence
    assert "with one pair in a group there is no CI over pairs" in native.evidence
    assert not any("QK-norm" in f and "not established" in f for f in found)  # the findings describe; the claims decide


def _merge(summary, pair: str, fixed) -> None:
    """The pair's linear merge passing `fixed` (per prompt, on every task)."""
    from evals.stats import recovery

    base, vlm, _ = _outcomes(20)
    summary["pairs"][pair]["interventions"]["linear"] = {
        task: {"recovery": recovery(base, vlm, fixed, task, HEADLINE_METRICS[task], **KW).as_dict(),
               "vs_base": compare(base, fixed, task, HEADLINE_METRICS[task], **KW).as_dict(),
               "vs_vlm": compare(vlm, fixed, task, HEADLINE_METRICS[task], **KW).as_dict()} for task in TASKS}


def test_the_merges_claim_follows_the_one_rule(summary):
    """Each (pair, merge) with a significant loss is a unit that answers by its recovery CI: the claim (merging does not
    recover the loss) agrees only where every merge scored below the VLM LM, disagrees only where every one won back
    part of the loss, and is otherwise not established with its count; one merge recovering no longer refutes it."""
    key = "Merging the base and the VLM LM after VL training does not recover the loss"
    base, vlm, regained = _outcomes(20, 16)
    worse = vlm.copy()
    worse[20:36] = False
    lossy = [p for p, e in summary["pairs"].items() if ci_side(e["degradation"]["sinkstudy_ifeval"]["delta_points_ci"]) < 0]
    assert len(lossy) >= 2
    for p in summary["pairs"]:
        _merge(summary, p, worse)
    claim = _claims(summary)[key]
    assert claim.answer == "agrees" and f"0 recovered, {len(lossy)} worse, 0 undecided of {len(lossy)}" in claim.evidence
    for p in summary["pairs"]:
        _merge(summary, p, regained)
    assert _claims(summary)[key].answer == "disagrees"
    _merge(summary, lossy[0], worse)  # one recovered is not enough any more: every unit must say so
    claim = _claims(summary)[key]
    assert claim.answer == "not established" and f"{len(lossy) - 1} recovered, 1 worse, 0 undecided" in claim.evidence
    assert "Rule: the claim agrees only where every unit's recovery CI lies below 0, disagrees only where every one lies above 0" \
        in claim.evidence

