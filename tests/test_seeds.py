"""A study repeated over training seeds: every training seed replaced, the data kept; the report gives each
headline figure per seed with its spread and states an answer only where every seed agrees."""

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
    from experiments.report.document import answers, write_report

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
    lines = answers(summary)
    assert lines == [x[2:] for x in claims.strip().splitlines()]  # the one list of answers, stated as the report states it
    merges = next(x for x in lines if x.startswith("Merging the base and the VLM LM"))
    assert "Every seed (0, 1) gives this answer; the numbers are seed 0's." in merges
    table = md.split("## Across training seeds\n", 1)[1].split("\n## ", 1)[0]
    row = next(x for x in table.splitlines() if x.startswith("| S base, p0 |"))
    assert row.rstrip(" |").endswith("| 0.71 | 1.00")  # SD of two values 1 apart, and their range
    assert "seed 1 in OUT/seeds/1" in table


def test_a_study_on_two_numeric_modes_reports_the_spread_and_answers_only_where_both_agree(maps_dir, tmp_path):  # noqa: F811
    from experiments.report.document import write_report

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
    section = md.split("## Across numeric modes\n", 1)[1].split("\n## ", 1)[0]
    assert "native-aten-default computed as native[ATEN_CPU_CAPABILITY=default]" in section
    assert "numeric mode native-aten-default in OUT/numerics/native-aten-default" in section
    row = next(x for x in section.splitlines() if x.startswith("| S base, p0 |"))
    assert row.rstrip(" |").endswith("| 0.00 | 0.00")  # the same S on both modes: no spread
    assert "## Across training seeds" not in md
