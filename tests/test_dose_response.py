"""The dose-response's slope of Δ on S, its bootstrap CI over prompts (and seeds) and the causal answer, on per-prompt
scores built with a known relation between S and the change VL training makes (experiments.study.dose_response)."""

import numpy as np
import pytest
from scipy.stats import linregress

from experiments.study.dose_response import AGREES, DISAGREES, OPEN, answer, fit

KW = {"n_boot": 1000, "confidence": 0.95, "seed": 0}
S = np.array([-0.4, 0.6, 1.6, 2.6, 3.6])


def _binary(s, slope, n, rng, before=0.8):
    """Pass/fail per prompt for each point: before at `before`, after at before + (−20 + slope·S) / 100 in expectation."""
    p_after = np.clip(before + (-20 + slope * s) / 100, 0, 1)
    b = (rng.random((len(s), n)) < before).astype(float)
    a = (rng.random((len(s), n)) < p_after[:, None]).astype(float)
    return (b[None], np.ones_like(b)[None]), (a[None], np.ones_like(a)[None])


def _points(s, shares=None, cost=()):
    return [{"model": f"m{i}", "sink_strength": x, "template_share": None if shares is None else shares[i], "text_cost": i in cost}
            for i, x in enumerate(s)]


def test_a_noise_free_linear_relation_gives_its_slope_and_a_ci_that_holds_it():
    # every prompt changes by the same amount at a point: Δ = −10 + 3 S exactly, whatever prompts a replicate draws
    n = 40
    before = np.full((1, len(S), n), 0.5)
    after = before + ((-10 + 3 * S) / 100)[None, :, None]
    ones = np.ones_like(before)
    f = fit(S[None], (before, ones), (after, ones), **KW)
    assert f["slope"] == pytest.approx(3.0) and f["intercept"] == pytest.approx(-10.0)
    assert f["slope_ci"][0] <= 3.0 + 1e-9 and f["slope_ci"][1] >= 3.0 - 1e-9 and f["slope_ci"][1] - f["slope_ci"][0] < 1e-6
    assert (f["n_points"], f["n_prompts"], f["n_seeds"]) == (5, 40, 1)
    assert answer(f, _points(S, [0.0] * 5))["answer"] == AGREES


@pytest.mark.parametrize("slope, expected", [(6.0, AGREES), (-6.0, DISAGREES)])
def test_a_noisy_relation_over_many_prompts_is_recovered_and_answered_by_its_sign(slope, expected):
    before, after = _binary(S, slope, 600, np.random.default_rng(1))
    f = fit(S[None], before, after, **KW)
    deltas = 100 * (after[0][0].mean(-1) - before[0][0].mean(-1))
    assert f["slope"] == pytest.approx(linregress(S, deltas).slope)  # least squares on the points' Δ
    assert f["slope_ci"][0] < slope < f["slope_ci"][1]
    a = answer(f, _points(S, [0.02] * 5))
    assert a["answer"] == expected and a["confounds"] == []


def test_few_prompts_or_points_or_a_collapsed_recipe_establish_nothing():
    before, after = _binary(S, 6.0, 600, np.random.default_rng(1))
    f = fit(S[None], before, after, **KW)
    assert answer(f, _points(S, [0.95, 0.97, 0.05, 1.0, 0.92]))["answer"] == OPEN  # 4 of 5 in the VL template
    collapsed = answer(f, _points(S, [0.95, 0.97, 0.05, 1.0, 0.92]))["reason"]
    assert "collapses" in collapsed and "4 of 5" in collapsed
    few = fit(S[None], tuple(a[..., :5] for a in before), tuple(a[..., :5] for a in after), **KW)
    assert answer(few, _points(S))["answer"] == OPEN and "too few prompts" in answer(few, _points(S))["reason"]
    two = fit(S[None, :2], tuple(a[:, :2] for a in before), tuple(a[:, :2] for a in after), **KW)
    assert answer(two, _points(S[:2]))["answer"] == OPEN and "too few points" in answer(two, _points(S[:2]))["reason"]
    # a dose that costs text skill by itself is named beside the answer, which still stands
    a = answer(f, _points(S, [0.0] * 5, cost=(3,)))
    assert a["answer"] == AGREES and len(a["confounds"]) == 1 and "m3 costs text skill" in a["confounds"][0]


def test_seeds_that_disagree_widen_the_ci_past_zero():
    # seed 0: Δ = +4 S, seed 1: Δ = −4 S, each exact over prompts; pooled slope 0, and resampling each point's seeds
    # spans nearly both (the ends need every point to draw the same seed twice: 2 * (1/4)^5 of the replicates)
    n = 30
    before = np.full((2, len(S), n), 0.5)
    after = before + (np.stack([4 * S, -4 * S]) / 100)[:, :, None]
    ones = np.ones_like(before)
    f = fit(np.stack([S, S]), (before, ones), (after, ones), **KW)
    assert f["n_seeds"] == 2 and f["slope"] == pytest.approx(0.0, abs=1e-9)
    assert -4.0 <= f["slope_ci"][0] < -3.0 and 3.0 < f["slope_ci"][1] <= 4.0
    assert answer(f, _points(np.concatenate([S, S]), [0.0] * 10))["answer"] == OPEN
    one = fit(S[None], (before[:1], ones[:1]), (after[:1], ones[:1]), **KW)
    assert one["slope"] == pytest.approx(4.0) and one["slope_ci"][0] == pytest.approx(4.0)


def test_a_point_with_more_seeds_is_their_mean_and_a_point_with_one_keeps_it():
    """Uneven seeds (a dose adapted again with another seed): each point's Δ is the mean over the seeds it has, the slope
    is fitted on those means, and a point trained with one seed is never drawn with another's numbers."""
    n = 30
    before = np.full((2, len(S), n), 0.5)
    after = before + (np.stack([-10 + 3 * S, -14 + 3 * S]) / 100)[:, :, None]
    ones = np.ones_like(before)
    present = np.array([[True] * 5, [True, False, False, False, True]])  # seed 1 only for the two ends
    after[1, ~present[1]] = 99.0  # never read: those points were not trained with seed 1
    f = fit(np.stack([S, S]), (before, ones), (after, ones), present=present, **KW)
    means = np.where(present, 100 * (after - before)[..., 0], 0).sum(0) / present.sum(0)
    assert f["seeds_per_point"] == [2, 1, 1, 1, 2] and f["slope"] == pytest.approx(linregress(S, means).slope)
    assert f["deltas"][1][1] is None and f["slope_ci"][0] < f["slope"] < f["slope_ci"][1]
    assert f["slope_ci"][1] - f["slope_ci"][0] < 4  # the ends' two seeds differ by 4 points: a CI of that order, not 99s
