"""The paper's published tables as data, the statistics recomputed from them (paper-table,
compare --published), and the direction of every correlation the toolkit reports."""

import json

import numpy as np
import pytest
import scipy.stats
import yaml

from evals.eval_run import EvalRun
from evals.stats import compare, mcnemar_counts, sink_correlation
from experiments.cli import main
from experiments.report.published import PUBLISHED, PairChange, beside, correlate, load_published, paper_table
from sinkstudy import SinkstudyError

METRIC = "prompt_level_strict_acc,none"


@pytest.fixture(scope="module")
def tables():
    return load_published()


def test_six_pair_rho_is_positive_on_points_and_relative(tables):
    # ../shared/PAPER.md: 0.971 on Δ points, 0.794 on Δ / base, Δ = VLM LM − base (negative = loss).
    corr = correlate([p.change() for p in tables.six], n_boot=2000)
    assert corr.points.spearman == pytest.approx(0.971, abs=5e-4)
    assert corr.relative.spearman == pytest.approx(0.794, abs=5e-4)
    assert corr.points.spearman == pytest.approx(tables.reported["spearman_points"], abs=5e-4)
    assert corr.relative.spearman == pytest.approx(tables.reported["spearman_relative"], abs=5e-4)
    assert corr.points.spearman_ci[0] > 0 and corr.points.spearman_ci[1] <= 1  # the paper's direction, CI over pairs
    # The loss-positive convention flips the sign: what the old report wrongly called agreement.
    s = [p.sink_strength for p in tables.six]
    loss = [-p.ifeval_delta for p in tables.six]
    assert scipy.stats.spearmanr(s, loss).statistic == pytest.approx(-0.971, abs=5e-4)


def test_tables_hold_together_and_tampering_is_refused(tables, tmp_path):
    assert len(tables.six) == 6 and len(tables.panel) == 17
    for p in tables.six:  # each row's counts give its scores and Δ
        c = p.counts
        assert sum(c.values()) == 541
        assert 100 * (c["both_pass"] + c["lost"]) / 541 == pytest.approx(p.ifeval_base, abs=0.006)
        assert 100 * (c["both_pass"] + c["gained"]) / 541 == pytest.approx(p.ifeval_vlm, abs=0.006)
    raw = yaml.safe_load(PUBLISHED.read_text())
    raw["six_pairs"][2]["counts"]["lost"] += 5
    raw["six_pairs"][2]["counts"]["both_fail"] -= 5
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(raw))
    with pytest.raises(SinkstudyError, match=r"six_pairs\[2\] \(Qwen2.5-VL-7B\): counts give base 73.01"):
        load_published(bad)
    raw["six_pairs"][2]["typo"] = 1
    bad.write_text(yaml.safe_dump(raw))
    with pytest.raises(SinkstudyError, match="unknown key"):
        load_published(bad)


def test_leave_one_out_and_panel_from_the_rounded_table(tables):
    d = paper_table(tables, n_boot=500)
    loo = d["leave_one_out"]
    assert loo["mae"] == pytest.approx(2.59, abs=0.005) and loo["mae_mean"] == pytest.approx(4.42, abs=0.005)
    # Paper Table 10 came from unrounded S and Δ: the recomputed predictions agree to its rounding.
    assert np.allclose(loo["predictions"], [p.loo_prediction for p in tables.six], atol=0.07)
    assert d["panel"]["correlation"]["spearman"] == pytest.approx(0.88, abs=0.005)
    molmo = d["six"][5]
    assert molmo["mcnemar_p"] == pytest.approx(scipy.stats.binomtest(126, 151, 0.5).pvalue)
    assert molmo["counts_delta_points"] == pytest.approx(100 * (25 - 126) / 541)
    assert molmo["counts_delta_points_ci"][1] < 0  # a significant loss
    assert d["six"][1]["mcnemar_p"] == pytest.approx(mcnemar_counts(43, 33)) and d["six"][1]["mcnemar_p"] > 0.05


def test_paper_table_cli_prints_the_figures(tmp_path, capsys):
    out = tmp_path / "paper.json"
    assert main(["paper-table", "--n-boot", "1000", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "Spearman ρ(S, Δ points) = +0.971" in text and "Spearman ρ(S, Δ / base) = +0.794" in text
    assert "mean abs error 2.59" in text and "vs 4.42" in text and "paper 2.54 vs 4.40" in text
    assert "Δ = VLM LM − base" in text and "ρ > 0" in text
    assert "17-pair panel: Spearman ρ(S, Δ points) = +0.877" in text
    saved = json.loads(out.read_text())
    assert saved["correlation"]["points"]["spearman"] == pytest.approx(0.971, abs=5e-4)
    assert saved["provenance"]["seeds"] == {"bootstrap": 0}
    with pytest.raises(SystemExit) as exit_:
        main(["paper-table", "--n-boot", "0"])
    assert exit_.value.code == 2 and "--n-boot: must be an integer >= 1" in capsys.readouterr().err


def _save_run(path, passes, name, metric=METRIC, task="sinkstudy_ifeval"):
    samples = [{"doc_id": i, "doc_hash": f"h{i}", "prompt": f"p{i}", "output": "", "target": "", "extracted": {},
                "metrics": {metric: bool(v)}} for i, v in enumerate(passes)]
    EvalRun(scores={task: {metric: float(np.mean(passes))}}, samples={task: samples}, settings={}, fingerprint=name,
            model_name=name, tasks=[task]).save(path)
    return str(path)


def test_compare_published_puts_the_pair_beside_the_six(tables, tmp_path, capsys):
    # The paper's measurement: IFEval, all 541 prompts, no limit. 75 -> 55 points: Δ = -20.
    before = [1] * 406 + [0] * 135
    after = [1] * 298 + [0] * 243
    a, b = (_save_run(tmp_path / n, passes, n, task="ifeval") for n, passes in (("a", before), ("b", after)))
    out = tmp_path / "cmp.json"
    assert main(["compare", a, b, "--published", "--sink-strength", "0.5", "--n-boot", "400", "--json", str(out)]) == 0
    captured = capsys.readouterr()
    text = captured.out
    assert "this pair (ifeval)" in text and "with ours:" in text and "(paper +0.971)" in text and "warning" not in captured.err
    got = json.loads(out.read_text())["published"]
    d = 100 * (298 - 406) / 541
    assert got["pairs"][-1]["delta_points"] == pytest.approx(d) and got["pairs"][-1]["relative"] == pytest.approx(d / (100 * 406 / 541))
    assert got["not_comparable"] == []
    union = [p.change() for p in tables.six] + [PairChange("ours", 0.5, d, 100 * 406 / 541)]
    ref = sink_correlation([c.sink_strength for c in union], [c.delta_points for c in union], [c.relative for c in union], n_boot=400)
    assert got["union"]["points"]["spearman"] == pytest.approx(ref.points.spearman)
    assert got["union"]["relative"]["spearman"] == pytest.approx(ref.relative.spearman)
    assert got["union"]["n"] == 7 and got["published"]["points"]["spearman"] == pytest.approx(0.971, abs=5e-4)

    sink_json = tmp_path / "sink.json"
    sink_json.write_text(json.dumps({"metric": "logodds", "value": 0.5}))
    assert main(["compare", a, b, "--published", "--sink-json", str(sink_json), "--n-boot", "400"]) == 0
    assert "with ours:" in capsys.readouterr().out


def test_compare_published_leaves_rho_out_when_task_or_size_differ_from_the_papers(tmp_path, capsys):
    """A 40-prompt offline score beside the paper's 541-prompt IFEval: shown, with a one-line warning, no ρ over the union."""
    a = _save_run(tmp_path / "a", [1] * 30 + [0] * 10, "base")
    b = _save_run(tmp_path / "b", [1] * 22 + [0] * 18, "vlm")
    out = tmp_path / "cmp.json"
    assert main(["compare", a, b, "--published", "--sink-strength", "0.5", "--n-boot", "200", "--json", str(out)]) == 0
    captured = capsys.readouterr()
    (warning,) = [line for line in captured.err.splitlines() if "warning" in line]
    assert "task sinkstudy_ifeval, not ifeval" in warning and "40 prompts, not 541" in warning and "rho is not recomputed" in warning
    assert "this pair (sinkstudy_ifeval)" in captured.out and "with ours:      not recomputed" in captured.out
    got = json.loads(out.read_text())["published"]
    assert got["union"] is None and got["published"]["n"] == 6 and len(got["not_comparable"]) == 2


@pytest.mark.parametrize("extra, message", [
    (["--published"], "--published needs the base's Sink Strength"),
    (["--sink-strength", "1.0"], "only apply with --published"),
    (["--published", "--sink-strength", "nan"], "must be a finite number"),
    (["--published", "--sink-json", "MASS"], "not a logodds sink.json"),
    (["--published", "--sink-json", "MISSING"], "cannot read --sink-json"),
    (["--published", "--sink-strength", "1", "--tasks", "other"], "need exactly one compared task with it in both runs, found none"),
])
def test_compare_published_refuses_bad_input_before_any_output(tmp_path, capsys, extra, message):
    a = _save_run(tmp_path / "a", [1, 0, 1], "base")
    b = _save_run(tmp_path / "b", [1, 0, 0], "vlm")
    mass = tmp_path / "mass.json"
    mass.write_text(json.dumps({"metric": "mass", "value": 0.4}))
    extra = [str(mass) if x == "MASS" else str(tmp_path / "nope.json") if x == "MISSING" else x for x in extra]
    try:
        rc = main(["compare", a, b, "--n-boot", "50", *extra])
    except SystemExit as exc:  # refused while parsing (a non-finite --sink-strength)
        rc = exc.code
    assert rc == 2
    captured = capsys.readouterr()
    assert message in captured.err and len(captured.err.strip().splitlines()) == 1 and captured.out == ""


def test_beside_refuses_a_pair_without_a_base_score():
    with pytest.raises(SinkstudyError, match="must all be defined"):
        beside([PairChange("x", 1.0, -3.0, 0.0)], n_boot=10)


# --------------------------------------------------------------------------- the study report's verdict


def _summary(sink, before_after, task="sinkstudy_ifeval"):
    """A study summary built by the real statistics from per-prompt outcomes of each pair."""
    pairs, comps = {}, []
    for i, (s, (b, a)) in enumerate(zip(sink, before_after)):
        c = compare(np.array(b), np.array(a), n_boot=300).as_dict()
        comps.append(c)
        pairs[f"p{i}"] = {"models": {"base": {"sink_strength": s}}, "degradation": {task: c}, "interventions": {},
                          "native_qk_norm": None, "published": None}
    corr = sink_correlation(sink, [c["delta_points"] for c in comps], [c["delta_relative"] for c in comps], n_boot=2000)
    return {"tasks": [task], "pairs": pairs, "correlation": {task: corr.as_dict()}}


def _outcomes(n_lost, n=60):
    before = [1] * 40 + [0] * (n - 40)
    return before, [0] * n_lost + before[n_lost:]


def _rho_sentence(findings):
    return next(f for f in findings if "Spearman ρ(S, Δ points" in f)


def _results(summary):
    from experiments.report.results import StudyResults

    return StudyResults.of({"study": "t", "headline": {}, **summary})


def test_the_sink_claim_names_the_convention_and_reads_the_sign_right():
    from experiments.report.claims import claims
    from experiments.report.findings import paper_rows

    def sink_claim(r):
        return next(c for c in claims(r) if "Spearman ρ(S, Δ points)" in c.evidence)

    strengths = [0.2, 0.6, 1.0, 1.4, 1.8, 2.2]
    # The paper's relation: a stronger sink, less loss (Δ closer to 0): ρ(S, Δ) > 0.
    r = _results(_summary(strengths, [_outcomes(k) for k in (30, 24, 18, 12, 6, 1)]))
    paper_like = sink_claim(r)
    assert paper_like.answer == "agrees" and "ρ(S, Δ points) = +1.000" in paper_like.evidence
    assert "(ρ > 0: a stronger sink, less loss" in paper_like.evidence
    assert "ρ = +0.971 on points and +0.794 on Δ/base" in paper_like.evidence
    assert [row[-1] for row in paper_rows(r) if row[0].startswith("ρ(S")] == ["same sign", "same sign"]
    # The opposite relation (a stronger sink, more loss) must not be called agreement.
    r = _results(_summary(strengths, [_outcomes(k) for k in (1, 6, 12, 18, 24, 30)]))
    opposite = sink_claim(r)
    assert "= -1.000" in opposite.evidence and opposite.answer == "disagrees"
    assert [row[-1] for row in paper_rows(r) if row[0].startswith("ρ(S")] == ["different sign", "different sign"]


def test_report_puts_the_pairs_beside_the_published_values():
    from experiments.report.document import published_blocks

    summary = _summary([2.0, 1.0, 0.5], [_outcomes(k) for k in (2, 10, 20)])
    summary["pairs"]["p0"]["published"] = {"sink_strength": 2.36, "ifeval_delta": -5.4, "ifeval_base": 83.18}
    summary["pairs"]["p1"]["published"] = {"sink_strength": 1.18, "ifeval_delta": -9.6}
    blocks = published_blocks(_results(summary))
    table = next(b for b in blocks if b[0] == "table")
    assert [r[0] for r in table[2]] == ["p0", "p1"]  # only pairs the config gives published values for
    p0 = table[2][0]
    assert p0[1] == "2.00" and p0[2] == "2.36" and p0[3].startswith("-3.3 [") and p0[4] == "-5.4"
    assert p0[6] == f"{-5.4 / 83.18:.3f}" and table[2][1][6] == "n/a"
    assert published_blocks(_results({**summary, "pairs": {"p2": summary["pairs"]["p2"]}})) == []


def test_paper_config_states_both_conventions():
    from experiments.cli.cmd_study import PAPER_CONFIG
    from experiments.study.config import load_study

    label = load_study(PAPER_CONFIG).protocol["correlation"]
    assert "relative degradation) = 0.971" not in label
    assert "+0.971" in label and "+0.794" in label and "points" in label and "VLM LM - base" in label
