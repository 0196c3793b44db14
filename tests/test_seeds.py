"""A study repeated over training seeds: every training seed replaced, the data kept; the report gives each
headline figure per seed with its spread and states a claim or verdict only where every seed agrees."""

import copy
import json

import pytest
import yaml

from tests.test_report import make_summary, maps_dir  # noqa: F401 (a fixture)

ROOT = __import__("pathlib").Path(__file__).resolve().parent.parent


def test_reseed_replaces_every_training_seed_and_keeps_the_data():
    from experiments.study.seeds import reseed
    from experiments.demo.study import validate

    raw = yaml.safe_load((ROOT / "experiments" / "configs" / "demo.yaml").read_text())
    raw["seeds"] = [0, 4]
    out = reseed(raw, 4)
    assert "seeds" not in out and out["seed"] == 4 and raw["seed"] == 0  # the input is left as it was
    assert out["build"]["pretrain"]["seed"] == 4 and out["build"]["vl"]["seed"] == 4
    assert all(b["seed"] == 4 for b in out["build"]["backbones"])
    assert out["build"]["corpus"] == raw["build"]["corpus"] and out["evals"] == raw["evals"]  # same data, same prompts
    study = validate(out, path=ROOT / "experiments" / "configs" / "demo.yaml")
    assert study.seed == 4 and {b["seed"] for b in study.build.backbones} == {4}
    protect = yaml.safe_load((ROOT / "experiments" / "configs" / "protect.yaml").read_text())
    assert reseed(protect, 2)["adapt"]["seed"] == 2


@pytest.mark.parametrize("seeds, needle", [([1], "at least two"), ([0, 0], "distinct"), ([0, -1], ">= 0"), ("0,1", "a list")])
def test_bad_seeds_fail_in_one_line(seeds, needle, tmp_path):
    from experiments.demo.study import validate
    from experiments.study.config import StudyConfigError

    raw = yaml.safe_load((ROOT / "experiments" / "configs" / "demo.yaml").read_text())
    with pytest.raises(StudyConfigError, match=needle) as err:
        validate({**raw, "seeds": seeds}, path=ROOT / "experiments" / "configs" / "demo.yaml", out=tmp_path)
    assert "\n" not in str(err.value)


def test_the_report_states_only_what_every_seed_agrees_on_and_gives_the_spread(maps_dir, tmp_path):  # noqa: F811
    from experiments.report.document import verdicts, write_report

    first = make_summary(maps_dir)
    second = copy.deepcopy(first)
    for e in second["pairs"].values():  # on seed 1 the injected QK-norm loses against the control
        for t in e["interventions"]["qknorm-vl"].values():
            t["vs_vlm"].update(delta_points=-3.0, delta_points_ci=[-5.0, -1.0])
    second["pairs"]["p0"]["models"]["base"]["sink_strength"] = first["pairs"]["p0"]["models"]["base"]["sink_strength"] + 1.0
    summary = {**first, "seeds": {"seeds": [0, 1], "runs": {"1": {"out": "OUT/seeds/1", "summary": second}}}}
    md = write_report(summary, tmp_path).read_text()
    claims = md.split("## The paper's claims\n", 1)[1].split("\n## ", 1)[0]
    qk = next(x for x in claims.splitlines() if "QK-RMSNorm injected" in x)
    assert "not established (the seeds disagree): seed 0: " in qk and "; seed 1: agrees. Seed 0's numbers: " in qk
    degradation = next(x for x in claims.splitlines() if "VL training costs text skill" in x)
    assert "Every seed (0, 1) gives this answer" in degradation
    lines = verdicts(summary)
    assert any(x.startswith("Does injected QK-norm protect p2 on sinkstudy_ifeval? not established (the seeds disagree") for x in lines)
    assert any(x.startswith("Does linear recover? ") and x.endswith("Every seed (0, 1) gives this answer.") for x in lines)
    table = md.split("## Across training seeds\n", 1)[1].split("\n## ", 1)[0]
    row = next(x for x in table.splitlines() if x.startswith("| S base, p0 |"))
    assert row.rstrip(" |").endswith("| 0.71 | 1.00")  # SD of two values 1 apart, and their range
    assert "seed 1 in OUT/seeds/1" in table


def test_verdict_lines_agree_across_seeds_by_question_and_statements_stay_the_first_seeds():
    from experiments.report.across_seeds import verdicts_across

    said = {0: ["No base reaches S > 0: S spans -3 to -1.", "Does X help? yes: +5 [+1, +9].", "Does Y help? no: -4 [-8, -1]."],
            1: ["No base reaches S > 0: S spans -4 to -2.", "Does X help? yes: +3 [+1, +6].", "Does Y help? not established: -1 [-5, +3]."]}
    lines = verdicts_across({0: 0, 1: 1}, lambda seed: said[seed])
    assert lines[0] == "No base reaches S > 0: S spans -3 to -1. (Seed 0's figures; every seed's: Across training seeds.)"
    assert lines[1] == "Does X help? yes: +5 [+1, +9]. Every seed (0, 1) gives this answer."
    assert lines[2].startswith("Does Y help? not established (the seeds disagree: seed 0: no; seed 1: not established). Seed 0: no: -4")


def test_a_study_on_two_numeric_modes_reports_the_spread_and_answers_only_where_both_agree(maps_dir, tmp_path):  # noqa: F811
    from experiments.report.document import verdicts, write_report

    first = make_summary(maps_dir)
    first["hardware"] = [{"numerics": "native"}]
    second = copy.deepcopy(first)
    second["hardware"] = [{"numerics": "native[ATEN_CPU_CAPABILITY=default]"}]
    for e in second["pairs"].values():  # on the second mode the injected QK-norm loses against the control
        for t in e["interventions"]["qknorm-vl"].values():
            t["vs_vlm"].update(delta_points=-3.0, delta_points_ci=[-5.0, -1.0])
    summary = {**first, "numerics_spread": {"paths": ["native", "native-aten-default"],
                                            "runs": {"native-aten-default": {"out": "OUT/numerics/native-aten-default",
                                                                             "summary": second}}}}
    md = write_report(summary, tmp_path).read_text()
    claims = md.split("## The paper's claims\n", 1)[1].split("\n## ", 1)[0]
    qk = next(x for x in claims.splitlines() if "QK-RMSNorm injected" in x)
    assert "not established (the numeric modes disagree): numeric mode native: " in qk
    assert "Numeric mode native's numbers: " in qk
    degradation = next(x for x in claims.splitlines() if "VL training costs text skill" in x)
    assert "Every numeric mode (native, native-aten-default) gives this answer" in degradation
    assert any(x.startswith("Does injected QK-norm protect p2 on sinkstudy_ifeval? not established (the numeric modes disagree")
               for x in verdicts(summary))
    section = md.split("## Across numeric modes\n", 1)[1].split("\n## ", 1)[0]
    assert "native-aten-default computed as native[ATEN_CPU_CAPABILITY=default]" in section
    assert "numeric mode native-aten-default in OUT/numerics/native-aten-default" in section
    row = next(x for x in section.splitlines() if x.startswith("| S base, p0 |"))
    assert row.rstrip(" |").endswith("| 0.00 | 0.00")  # the same S on both modes: no spread
    assert "## Across training seeds" not in md
