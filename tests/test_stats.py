"""Paired statistics checked against scipy and hand-computed values."""

import numpy as np
import pytest
import scipy.stats

from evals.eval_run import EvalRun
from evals.stats import (
    Comparison, compare, compare_runs, correlation, format_table, leave_one_out, mcnemar_counts, mcnemar_exact, outcomes_from_counts,
    paired, recovery, sink_correlation,
)
from sinkstudy import SinkstudyError


def test_mcnemar_exact_matches_hand_computed_binomial():
    # 6 prompts only base passes, 1 only other passes: p = 2 * P(X <= 1 | n=7, 1/2) = 2 * 8/128.
    base = [1] * 6 + [0] * 1 + [1] * 3 + [0] * 2
    other = [0] * 6 + [1] * 1 + [1] * 3 + [0] * 2
    p, lost, gained = mcnemar_exact(base, other)
    assert (lost, gained) == (6, 1)
    assert p == pytest.approx(0.125) and mcnemar_counts(6, 1) == p and mcnemar_counts(1, 6) == p
    assert mcnemar_exact([1, 0], [1, 0])[0] == 1.0  # no discordant pairs


def test_compare_delta_is_after_minus_before_in_points():
    base = np.array([1, 1, 1, 1, 0, 1, 1, 0, 1, 1])  # 0.8
    other = np.array([1, 0, 1, 0, 0, 1, 0, 0, 1, 1])  # 0.5
    c = compare(base, other, n_boot=2000)
    assert (c.n, c.before, c.after) == (10, 0.8, 0.5)
    assert c.delta_points == pytest.approx(-30.0)  # a loss is negative, in points
    assert c.delta_relative == pytest.approx(-0.3 / 0.8)
    assert (c.lost, c.gained) == (3, 0)
    assert c.mcnemar_p == pytest.approx(scipy.stats.binomtest(3, 3, 0.5).pvalue)
    assert c.delta_points_ci[0] <= c.delta_points <= c.delta_points_ci[1]
    assert c.delta_relative_ci[0] <= c.delta_relative <= c.delta_relative_ci[1]
    # paired resampling: Δ can never be positive here (other never beats base)
    assert c.delta_points_ci[1] <= 0
    gain = compare(other, base, n_boot=200)  # the reverse direction flips every sign
    assert gain.delta_points == pytest.approx(30.0) and (gain.lost, gain.gained) == (0, 3)
    assert not any(hasattr(c, old) for old in ("abs_diff", "rel_degradation", "base_only"))  # no loss-positive fields remain


def test_paired_bootstrap_ci_matches_scipy_bootstrap_for_a_mean_difference():
    rng = np.random.default_rng(3)
    base = rng.random(400) < 0.7
    other = base & (rng.random(400) < 0.8)
    c = compare(base, other, n_boot=4000, seed=1)
    ref = scipy.stats.bootstrap((base.astype(float), other.astype(float)), lambda a, b, axis: 100 * (b.mean(axis) - a.mean(axis)),
                                paired=True, n_resamples=4000, method="percentile", rng=np.random.default_rng(2))
    # Different resamples, same distribution: the limits agree to Monte-Carlo error (in points).
    assert c.delta_points_ci[0] == pytest.approx(ref.confidence_interval.low, abs=0.6)
    assert c.delta_points_ci[1] == pytest.approx(ref.confidence_interval.high, abs=0.6)
    # and to the normal approximation of a paired difference
    d = 100 * (other.astype(float) - base.astype(float))
    half = 1.96 * d.std(ddof=1) / np.sqrt(len(d))
    assert c.delta_points_ci[1] - c.delta_points_ci[0] == pytest.approx(2 * half, rel=0.1)


def test_instruction_level_lists_are_ratio_of_sums_and_skip_mcnemar():
    base = [[True, True], [True, False, True], [False]]  # 4/6
    other = [[True, False], [False, False, True], [False]]  # 2/6
    c = compare(base, other, n_boot=500)
    assert c.before == pytest.approx(4 / 6) and c.after == pytest.approx(2 / 6)
    assert c.mcnemar_p is None and c.lost is None


def test_relative_change_undefined_when_base_scores_zero():
    c = compare([0, 0, 0], [0, 1, 0], n_boot=200)
    assert np.isnan(c.delta_relative) and c.delta_relative_undefined == 1.0 and all(np.isnan(c.delta_relative_ci))
    assert c.delta_points == pytest.approx(100 / 3)


def test_bootstrap_settings_are_refused_in_one_line():
    with pytest.raises(SinkstudyError, match="replicates must be an integer >= 1"):
        compare([1, 0, 1], [1, 1, 0], n_boot=0)
    with pytest.raises(SinkstudyError, match="confidence"):
        compare([1, 0, 1], [1, 1, 0], n_boot=10, confidence=1.5)


def test_dicts_pair_on_keys_and_arrays_on_position():
    c = compare({1: 1, 2: 0, 3: 1, 9: 1}, {3: 0, 2: 0, 1: 1}, n_boot=200)
    assert c.n == 3 and c.before == pytest.approx(2 / 3) and c.after == pytest.approx(1 / 3)
    with pytest.raises(SinkstudyError, match="no shared prompts"):
        compare({1: 1}, {2: 1})


def test_recovery_value_and_within_replicate_ci():
    base = np.array([1] * 8 + [0] * 2)
    vlm = np.array([1] * 4 + [0] * 6)
    intervened = np.array([1] * 6 + [0] * 4)
    r = recovery(base, vlm, intervened, n_boot=3000)
    assert (r.base, r.vlm, r.intervened) == (0.8, 0.4, 0.6)
    assert r.recovery == pytest.approx(0.5)
    assert r.ci[0] <= 0.5 <= r.ci[1]
    # Resampled prompts keep base >= intervened >= vlm prompt by prompt, so every defined replicate is in [0, 1].
    assert 0 <= r.ci[0] and r.ci[1] <= 1
    assert 0 <= r.undefined < 0.01
    full = recovery(base, vlm, base, n_boot=500)
    assert full.recovery == 1.0 and full.ci == (1.0, 1.0)


def test_sink_correlation_matches_scipy_in_both_conventions():
    s = [0.2, 0.5, 0.9, 1.4, 2.0, 2.2]
    pts = [-1.0, -5.0, -4.0, -15.0, -30.0, -28.0]
    rel = [-0.01, -0.08, -0.05, -0.2, -0.5, -0.3]
    c = sink_correlation(s, pts, rel, n_boot=3000)
    for got, y in ((c.points, pts), (c.relative, rel)):
        assert got.spearman == pytest.approx(scipy.stats.spearmanr(s, y).statistic)
        assert got.spearman_p == pytest.approx(scipy.stats.spearmanr(s, y).pvalue)
        assert got.pearson == pytest.approx(scipy.stats.pearsonr(s, y).statistic)
        assert -1 <= got.spearman_ci[0] <= got.spearman <= got.spearman_ci[1] <= 1
        assert got.pearson_ci[0] <= got.pearson <= got.pearson_ci[1]
    assert c.points.spearman < 0 and "Δ = after − before" in c.convention  # more loss with a stronger sink: negative here
    assert correlation(s, pts, n_boot=3000).as_dict() == c.points.as_dict()  # same resamples, same CI
    with pytest.raises(SinkstudyError, match="at least 3"):
        sink_correlation([1, 2], [0.1, 0.2], [0.1, 0.2])
    with pytest.raises(SinkstudyError, match="all finite"):
        sink_correlation([1, 2, 3], [0.1, 0.2, 0.3], [0.1, float("nan"), 0.3])


def test_outcomes_from_counts_reproduce_scores_and_mcnemar():
    before, after = outcomes_from_counts(394, 56, 27, 64)
    assert len(before) == 541 and before.mean() == pytest.approx(450 / 541) and after.mean() == pytest.approx(421 / 541)
    c = compare(before, after, n_boot=500)
    assert (c.lost, c.gained) == (56, 27) and c.mcnemar_p == pytest.approx(scipy.stats.binomtest(56, 83, 0.5).pvalue)
    assert c.delta_points == pytest.approx(100 * (421 - 450) / 541)
    with pytest.raises(SinkstudyError, match="non-negative integers"):
        outcomes_from_counts(1, -1, 0, 0)


def test_leave_one_out_by_hand():
    x, y = [0.0, 1.0, 2.0, 4.0], [1.0, 3.0, 4.0, 9.0]
    loo = leave_one_out(x, y)
    for i in range(4):
        keep = [j for j in range(4) if j != i]
        slope, intercept = np.polyfit(np.take(x, keep), np.take(y, keep), 1)
        assert loo.predictions[i] == pytest.approx(intercept + slope * x[i])
        assert loo.mean_predictions[i] == pytest.approx(np.mean(np.take(y, keep)))
    assert loo.mae == pytest.approx(np.mean(np.abs(np.array(loo.predictions) - y)))
    on_a_line = leave_one_out([0, 1, 2, 3], [1, 3, 5, 7])
    assert on_a_line.mae == pytest.approx(0, abs=1e-12) and on_a_line.mae_mean > 0
    with pytest.raises(SinkstudyError, match="equal x"):
        leave_one_out([1, 1, 2], [0, 1, 2])


def _run(values, name, prompts=None):
    samples = [{"doc_id": i, "doc_hash": (prompts or {}).get(i, f"h{i}"), "prompt": f"p{i}", "output": "", "target": "",
                "extracted": {}, "metrics": {"exact_match,strict-match": float(v), "exact_match,flexible-extract": 1.0}}
               for i, v in enumerate(values)]
    score = float(np.mean(values))
    return EvalRun(scores={"t": {"exact_match,strict-match": score, "exact_match_stderr,strict-match": 0.1,
                                 "exact_match,flexible-extract": 1.0}},
                   samples={"t": samples}, settings={}, fingerprint=name, model_name=name)


def test_compare_runs_warns_on_every_protocol_setting_that_differs(caplog):
    """The settings compared are the eval protocol's (`evals.protocol.COMPARABLE_SETTINGS`): a system instruction, the
    generation kwargs, the backend... not a shorter list of their own."""
    from evals.protocol import COMPARABLE_SETTINGS, EvalProtocol

    assert {"system_instruction", "gen_kwargs", "chat_template_kwargs", "backend", "max_gen_toks", "seed"} <= set(COMPARABLE_SETTINGS)
    assert set(COMPARABLE_SETTINGS) - {"seed"} <= set(EvalProtocol().as_dict())
    a, b = _run([1, 1, 0, 1], "a"), _run([1, 0, 0, 0], "b")
    with caplog.at_level("WARNING", logger="evals.stats"):
        compare_runs(a, b, n_boot=50)
    assert not caplog.records
    b.settings = {"system_instruction": "Answer briefly."}
    with caplog.at_level("WARNING", logger="evals.stats"):
        compare_runs(a, b, n_boot=50)
    assert "differ in system_instruction" in caplog.text


def test_compare_runs_pairs_eval_runs_on_doc_id_and_checks_prompts():
    a, b = _run([1, 1, 0, 1], "a"), _run([1, 0, 0, 0], "b")
    comps = compare_runs(a, b, n_boot=200)
    assert [(c.task, c.metric) for c in comps] == [("t", "exact_match,strict-match"), ("t", "exact_match,flexible-extract")]
    assert comps[0].delta_points == pytest.approx(-50.0) and comps[1].delta_points == 0
    assert "exact_match,strict-match" in format_table(comps)
    # 4 prompts decide nothing, and the table ends by saying so; 6 can
    assert format_table(comps).splitlines()[-1] == "4 prompts per comparison: too few prompts for any conclusion (fewer than 6)"
    assert "too few" not in format_table(compare_runs(_run([1, 1, 0, 1, 1, 1], "a"), _run([1, 0, 0, 0, 0, 0], "b"), n_boot=200))
    assert compare(a, b, "t", n_boot=50).metric == "exact_match,strict-match"  # headline metric by default
    other_data = _run([1, 0, 0, 0], "c", prompts={2: "different"})
    with pytest.raises(SinkstudyError, match="disagree on the prompt"):
        compare(a, other_data, "t")
    with pytest.raises(SinkstudyError, match="needs a task"):
        paired(a, b)
    assert isinstance(comps[0], Comparison)


def test_group_pools_subtask_samples_like_lm_eval_size_weighted_mean():
    a1, a2 = _run([1, 1, 0], "a"), _run([1, 0], "a")
    b1, b2 = _run([0, 1, 0], "b"), _run([0, 0], "b")

    def group(r1, r2, name):
        return EvalRun(scores={"g": {"exact_match,strict-match": None}, "t1": r1.scores["t"], "t2": r2.scores["t"]},
                       samples={"t1": r1.samples["t"], "t2": r2.samples["t"]}, settings={}, fingerprint=name,
                       groups={"g": ["t1", "t2"]})

    a, b = group(a1, a2, "a"), group(b1, b2, "b")
    assert sorted(a.per_doc("g", "exact_match,strict-match")) == ["t1/0", "t1/1", "t1/2", "t2/0", "t2/1"]
    c = compare(a, b, "g", "exact_match,strict-match", n_boot=100)
    assert (c.n, c.before, c.after) == (5, 0.6, 0.2) and (c.lost, c.gained) == (2, 0)
    assert [x.task for x in compare_runs(a, b, n_boot=50)][::2] == ["g", "t1", "t2"]


def test_ci_side_reads_which_side_of_zero_an_interval_lies_on():
    from evals.stats import ci_side

    assert [ci_side(ci) for ci in ((0.1, 2.0), (-3.0, -0.5), (-1.0, 1.0), (0.0, 1.0), (-1.0, 0.0))] == [1, -1, 0, 0, 0]
    assert [ci_side(ci) for ci in (None, (), (float("nan"), 1.0), (None, -1.0))] == [0, 0, 0, 0]  # undefined: no side
    c = compare(np.array([1] * 8 + [0] * 2), np.array([0] * 8 + [0] * 2), n_boot=300)  # every pass lost
    assert ci_side(c.delta_points_ci) == -1 and ci_side(compare(np.ones(10), np.ones(10), n_boot=300).delta_points_ci) == 0


def test_statistics_come_back_from_their_stored_form():
    """What a summary stores (`as_dict`, through JSON) reads back as the same typed record (`from_dict`)."""
    import json

    from evals.stats import Recovery, SinkCorrelation

    base, vlm, fixed = (np.array(x) for x in ([1] * 8 + [0] * 4, [1] * 3 + [0] * 9, [1] * 6 + [0] * 6))
    c, r = compare(base, vlm, n_boot=300), recovery(base, vlm, fixed, n_boot=300)
    s = sink_correlation([0.1, 0.5, 0.9, 1.4], [-9.0, -6.0, -4.0, -1.0], [-0.3, -0.2, -0.1, 0.0], n_boot=300)
    stored = lambda x: json.loads(json.dumps(x.as_dict()))  # noqa: E731  (tuples come back as lists)
    assert Comparison.from_dict(stored(c)) == c and Recovery.from_dict(stored(r)) == r and SinkCorrelation.from_dict(stored(s)) == s
    assert isinstance(Comparison.from_dict(stored(c)).delta_points_ci, tuple)


def test_equal_changes_reached_along_different_float_paths_rank_as_ties():
    """Two pairs that each lose 11 of 120 prompts (83 -> 72 and 69 -> 58) get Δ points that differ in the last bits;
    ranked apart they would move Spearman's ρ (0.26 instead of 0.44 here). ρ equals scipy's on the exact values."""
    from fractions import Fraction

    counts = [(72, 66), (83, 72), (66, 52), (85, 63), (80, 66), (69, 58)]  # (base, VLM) prompts passed of 120
    s = [-2.39, -3.34, -3.40, -3.65, -4.71, -9.26]

    def outcomes(passed):
        return np.r_[np.ones(passed), np.zeros(120 - passed)]

    changes = [compare(outcomes(b), outcomes(v), n_boot=10) for b, v in counts]
    points, relative = [c.delta_points for c in changes], [c.delta_relative for c in changes]
    assert points[1] != points[5]  # the float paths differ: what ranking has to see through
    exact_points = [float(Fraction(100 * (v - b), 120)) for b, v in counts]
    exact_relative = [float(Fraction(v - b, b)) for b, v in counts]
    c = sink_correlation(s, points, relative, n_boot=200)
    assert c.points.spearman == pytest.approx(scipy.stats.spearmanr(s, exact_points).statistic)
    assert c.relative.spearman == pytest.approx(scipy.stats.spearmanr(s, exact_relative).statistic)
    assert c.points.spearman == pytest.approx(0.4414, abs=1e-4)
    # values apart by more than rounding stay apart
    assert correlation([1.0, 2.0, 3.0], [0.0, 1e-6, 2e-6], n_boot=10).spearman == pytest.approx(1.0)


def test_recovery_says_why_there_is_no_number_and_few_prompts_decide_nothing():
    """A recovery only over a significant loss; otherwise the status names the reason: the VLM LM lost nothing
    (CI at or above 0), a loss is not established (CI includes one), or too few prompts to decide anything
    (3 prompts that all flipped give a bootstrap CI of [-100, -100], yet no rank test can reach 5% below 6)."""
    from evals.stats import LOSS_UNCLEAR, MIN_CONCLUSIVE_N, NO_LOSS, RECOVERED, TOO_FEW, comparison_side

    three = recovery(np.ones(3), np.zeros(3), np.zeros(3), n_boot=500)
    assert three.loss_points_ci == (-100.0, -100.0) and three.status == TOO_FEW and three.recovery is None
    assert comparison_side(compare(np.ones(3), np.zeros(3), n_boot=500)) == 0 < MIN_CONCLUSIVE_N
    assert comparison_side(compare(np.ones(6), np.zeros(6), n_boot=500)) == -1
    base = np.array([1] * 6 + [0] * 14)
    unclear = recovery(base, np.array([1] * 4 + [0] * 16), base, n_boot=2000)  # lost 2 of 20: the CI reaches 0
    assert unclear.loss_points_ci[0] < 0 <= unclear.loss_points_ci[1] and unclear.status == LOSS_UNCLEAR and unclear.recovery is None
    gained = recovery(base, np.ones(20), base, n_boot=500)
    assert gained.status == NO_LOSS and gained.loss_points_ci[0] >= 0
    assert recovery(np.ones(20), np.zeros(20), np.ones(20), n_boot=500).status == RECOVERED


def test_group_difference_resamples_the_pairs_of_each_group():
    from evals.stats import group_difference

    g = group_difference([-0.05, -0.10, -0.03], [-0.30, -0.20, -0.25], n_boot=4000, seed=1)
    assert g.difference == pytest.approx(np.mean([-0.05, -0.10, -0.03]) - np.mean([-0.30, -0.20, -0.25]))
    # every resample of each group stays within its range, so the CI lies within (min a - max b, max a - min b)
    assert -0.10 + 0.20 <= g.ci[0] < g.difference < g.ci[1] <= -0.03 + 0.30
    assert np.isnan(group_difference([0.1], [0.2, 0.3], n_boot=100).ci).all()  # one pair: no CI over pairs
    with pytest.raises(SinkstudyError, match="two non-empty groups"):
        group_difference([], [0.1])



def test_a_recovery_carries_the_change_against_each_input_and_flags_a_result_below_both():
    base = np.array([1] * 30 + [0] * 10)
    vlm = np.array([1] * 20 + [0] * 20)
    worse = np.array([1] * 5 + [0] * 35)  # 25 fewer passes than the base, 15 fewer than the VLM LM
    r = recovery(base, vlm, worse, n_boot=2000)
    assert r.vs_base_points == pytest.approx(-62.5) and r.vs_vlm_points == pytest.approx(-37.5)
    assert r.vs_base_ci[1] < 0 and r.vs_vlm_ci[1] < 0 and r.below_both and r.recovery < 0
    between = recovery(base, vlm, np.array([1] * 25 + [0] * 15), n_boot=2000)
    assert between.vs_base_ci[1] < 0 < between.vs_vlm_ci[0] and not between.below_both
    assert not recovery(base[:4], vlm[:4], worse[:4], n_boot=200).below_both  # 4 prompts decide nothing
    from evals.stats import Recovery

    assert Recovery.from_dict(r.as_dict()) == r
