"""A study's `dose:` section end to end on a tiny planted-sink base: each dosed base made by one step, its S (the
study's metric) at the asked level, its text skill compared with the undosed base before any VL training, then
adapted with the control's recipe; the report's dose section names a dose that costs text skill as a confound."""

import copy
import json

import numpy as np
import pytest
import yaml
from scipy.stats import linregress

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def study_file(tmp_path_factory, tokenizer):
    from test_sink_dose import planted_sink

    root = tmp_path_factory.mktemp("dose_study")
    planted_sink("qwen2", tokenizer).save_pretrained(root / "base")
    tokenizer.save_pretrained(root / "base")
    cfg = {
        "name": "dtest", "seed": 0,
        "pairs": [{"name": "p", "base": str(root / "base"), "native_qk_norm": False}],
        "sink": {"metric": "logodds", "options": {"batch_size": 8}},
        "evals": {"tasks": ["sinkstudy_gsm"], "limit": 3, "max_gen_toks": 6, "batch_size": 3, "n_boot": 200},
        "dose": [-1, {"name": "up", "shift": 1.0, "tolerance": 0.05, "seeds": [1]}],
        "adapt": {
            "recipe": {"seed": 0, "precision": "fp32", "max_length": 256, "stages": [
                {"name": "stage1", "trainable": ["projector"], "steps": 2, "batch_size": 4, "micro_batch_size": 4, "lr": 1e-3},
                {"name": "stage2", "trainable": ["projector", "lm"], "steps": 2, "batch_size": 4, "micro_batch_size": 4,
                 "lr": 1e-3}]},
            "vision": {"kind": "tiny", "tiny": {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "patch_size": 4}},
            "data": ["digits"],
            "vl_eval": {"heldout": 10},
            "arms": [{"name": "control"}, {"name": "control-s1", "seed": 1}],
        },
    }
    (root / "study.yaml").write_text(yaml.safe_dump(cfg))
    return root / "study.yaml"


def test_a_dose_study_measures_each_dosed_base_before_and_after_vl_training(study_file, tmp_path, own_cache):
    from safetensors.torch import load_file

    from experiments.report.document import build_blocks
    from experiments.report.render import render_md
    from experiments.study.config import load_study
    from experiments.study.dose_response import fit, over_seeds
    from experiments.study.runner import run_study

    out = tmp_path / "out"
    log = {e["step"]: e["reused"] for e in run_study(load_study(study_file, out=out), progress=False)["log"]}
    assert {"p/dose/dose-minus1", "p/dose/up", "p/sink/dose-minus1", "p/eval/up", "p/adapt/up", "p/vlskill/up",
            "p/adapt/up-extract", "p/eval/up-vl"} <= set(log)
    summary = json.loads((out / "summary.json").read_text())
    e = summary["pairs"]["p"]
    s0 = e["models"]["base"]["sink_strength"]
    doses = e["dose"]["doses"]
    assert set(doses) == {"dose-minus1", "up"} and not set(e["interventions"]) - {"control-s1"}  # doses are no intervention
    assert abs(doses["dose-minus1"]["sink_strength"] - (s0 - 1)) <= 0.02 + 1e-3 and abs(doses["up"]["sink_strength"] - (s0 + 1)) <= 0.05 + 1e-3
    assert doses["up"]["scale"] > 1 > doses["dose-minus1"]["scale"]
    c = doses["up"]["vs_base"]["sinkstudy_gsm"]
    assert c["n"] == 3 and c["before"] == e["degradation"]["sinkstudy_gsm"]["before"] and doses["up"]["text_cost"] == []
    assert doses["up"]["vl"]["degradation"]["sinkstudy_gsm"]["before"] == c["after"]  # VL training's change from the dosed base
    assert doses["up"]["vl"]["vl_skill"]["digit_accuracy"] is not None
    before = load_file(study_file.parent / "base" / "model.safetensors")
    after = load_file(out / "models" / "p-up-base" / "model.safetensors")
    assert [n for n in before if not before[n].equal(after[n])] and all(
        before[n].equal(after[n]) for n in before if "q_proj" not in n)
    report = (out / "report.md").read_text()
    # three prompts decide nothing: the report says so instead of clearing the doses
    assert "## Sink dose" in report and "is not decided on sinkstudy_gsm: fewer than 6 prompts" in report
    assert "No dose costs text skill" not in report

    # the dose-response: the undosed base and both adapted doses, Δ in VL training against S before it; the undosed base
    # (its control and control-s1) and `up` (seeds 0 and 1) are each the mean of two training seeds
    dr = e["dose_response"]["tasks"]["sinkstudy_gsm"]
    pts = dr["points"]
    assert [p["model"] for p in pts] == ["base", "dose-minus1", "up"] and [p["seeds"] for p in pts] == [[0, 1], [0], [0, 1]]
    assert {"p/adapt/up-s1", "p/eval/up-s1-vl"} <= set(log) and "p/adapt/dose-minus1-s1" not in log
    assert [p["sink_strength"] for p in pts] == [s0, doses["dose-minus1"]["sink_strength"], doses["up"]["sink_strength"]]
    base_deltas = [e["degradation"]["sinkstudy_gsm"]["delta_points"], e["protection"]["arms"]["control-s1"]["vs_base"]["sinkstudy_gsm"]["delta_points"]]
    up_deltas = [doses["up"][k]["degradation"]["sinkstudy_gsm"]["delta_points"] for k in ("vl",)] + \
        [doses["up"]["vl_seeds"]["1"]["degradation"]["sinkstudy_gsm"]["delta_points"]]
    assert pts[0]["delta_points_per_seed"] == pytest.approx(base_deltas) and pts[2]["delta_points_per_seed"] == pytest.approx(up_deltas)
    means = [np.mean(base_deltas), doses["dose-minus1"]["vl"]["degradation"]["sinkstudy_gsm"]["delta_points"], np.mean(up_deltas)]
    assert [p["delta_points"] for p in pts] == pytest.approx(means) and pts[0]["delta_points_ci"] is None
    assert all(0 <= p["template_share"] <= 1 for p in pts) and dr["n_prompts"] == 3 and dr["seeds_per_point"] == [2, 1, 2]
    assert dr["slope"] == pytest.approx(linregress([p["sink_strength"] for p in pts], means).slope)
    assert dr["answer"] == "not established" and dr["reason"].startswith("too few prompts")
    assert "## Dose-response" in report and "A stronger sink, less loss? NOT ESTABLISHED: too few prompts" in report
    assert "(mean of seeds 0 " in report
    assert "study's 1 pair): n = 1; a rank correlation needs at least 3 backbones" in report
    assert (out / "plots" / "dose_response_sinkstudy_gsm.png").is_file()

    doses["up"]["text_cost"] = ["sinkstudy_gsm"]  # the report is a function of the summary: a flagged dose is named
    assert "p / up: the dose itself costs sinkstudy_gsm text skill before any VL training" in render_md(build_blocks(summary, tmp_path))

    # over two training seeds of the whole study: a second run whose adapted models all pass every prompt pools with
    # the first, each point's seeds of both runs together
    second = copy.deepcopy(summary)
    pp = second["pairs"]["p"]["dose_response"]["tasks"]["sinkstudy_gsm"]["per_prompt"]
    pp["after"] = (np.ones_like(np.array(pp["after"]))).tolist()
    summary["seeds"] = {"seeds": [0, 7], "runs": {"7": {"out": str(tmp_path / "seed7"), "summary": second}}}
    over_seeds(summary)
    pooled = summary["pairs"]["p"]["dose_response"]["over_seeds"]["sinkstudy_gsm"]
    both = dr["per_prompt"], pp
    stacked = {k: np.concatenate([np.array(x[k]) for x in both]) for k in ("before", "before_den", "after", "after_den", "present")}
    s = np.broadcast_to([p["sink_strength"] for p in pts], stacked["present"].shape)
    refit = fit(s, (stacked["before"], stacked["before_den"]), (stacked["after"], stacked["after_den"]), present=stacked["present"],
                n_boot=200, confidence=0.95, seed=0)
    assert pooled["n_seeds"] == 4 and pooled["slope"] == pytest.approx(refit["slope"]) and pooled["slope_ci"] == refit["slope_ci"]
    assert list(pooled["per_seed"]) == ["0", "7"] and pooled["answer"] == "not established"
    assert "p on sinkstudy_gsm, over every training seed (per seed: seed 0 " in render_md(build_blocks(summary, tmp_path))

    again = {e["step"]: e["reused"] for e in run_study(load_study(study_file, out=out), progress=False)["log"]}
    assert all(again.values())


@pytest.mark.parametrize("dose, needle", [
    ([], "a non-empty list of doses"),
    ([{"shift": 1, "scale": 2}], "takes one of target"),
    ([{"levels": 1}], "unknown key(s) levels"),
    ([1, 1], "duplicate"),
    ([{"name": "lin", "shift": 1}], "an intervention's / arm's name"),
    ([{"name": "a b", "shift": 1}], "name"),
    ([{"shift": 1, "pairs": ["q"]}], "a non-empty list of pair names (p)"),
    ([{"shift": 1, "pairs": "p"}], "a non-empty list of pair names (p)"),
    ([{"shift": 1, "pairs": ["p"]}, {"shift": 1, "heads": "sink"}], "duplicate"),
    ([{"shift": 1, "seeds": [1, 1]}], "distinct training seeds"),
    ([{"shift": 1, "seeds": [-1]}], "seeds: must be an integer >= 0"),
])
def test_bad_doses_fail_in_one_line(dose, needle):
    from experiments.study.config import StudyConfigError, validate

    raw = {"name": "t", "pairs": [{"name": "p", "base": "some/base", "vlm": "some/vlm"}], "evals": {"tasks": ["sinkstudy_ifeval"]},
           "interventions": [{"name": "lin", "method": "linear", "params": {"weight": 0.5}}], "dose": dose}
    with pytest.raises(StudyConfigError) as exc:
        validate(raw)
    assert needle in str(exc.value) and "\n" not in str(exc.value)


def test_a_dose_can_name_its_pairs_and_repeat_a_name_on_other_pairs():
    from experiments.study.config import validate

    raw = {"name": "t", "pairs": [{"name": n, "base": "some/base", "vlm": "some/vlm"} for n in ("a", "b")],
           "evals": {"tasks": ["sinkstudy_ifeval"]},
           "dose": [{"shift": -2, "heads": "sink", "pairs": ["a"]}, {"shift": -2, "pairs": ["b"]}, 1]}
    doses = validate(raw).dose
    assert [(d.name, d.params["heads"], d.doses("a"), d.doses("b")) for d in doses] == [
        ("dose-minus2", "sink", True, False), ("dose-minus2", "all", False, True), ("dose-plus1", "all", True, True)]


def test_the_dose_response_configs_dose_each_backbone_five_times_across_two_units_of_s_each_way(tmp_path):
    """make dose-response's configs plan (no input read): each backbone's base dosed from S −2 to at least +2 and each
    dose adapted; SmolLM2 on its sink heads, Gemma (a QK-norm gain per layer) on all, the undosed base and the two extreme
    doses with a second training seed; QUICK: SmolLM2 alone, three doses."""
    from experiments.cli.cmd_study import CONFIG_DIR
    from experiments.study.config import load_study
    from experiments.study.runner import plan_records

    for config, pairs, least in (("dose_response", {"smollm2": "sink", "gemma": "all"}, 5), ("dose_response_quick", {"smollm2": "sink"}, 3)):
        study = load_study(CONFIG_DIR / f"{config}.yaml", out=tmp_path / config)
        ids = {s["id"] for s in plan_records(study)}
        assert [p.name for p in study.pairs] == list(pairs)
        for p, heads in pairs.items():
            doses = [d for d in study.dose if d.doses(p)]
            shifts = [d.params["shift"] for d in doses]
            assert len(doses) >= least and min(shifts) <= -2 and max(shifts) >= 2 and {d.params["heads"] for d in doses} == {heads}
            assert {f"{p}/adapt/{d.name}" for d in doses} | {f"{p}/eval/{d.name}-vl" for d in doses} | {f"{p}/eval/{d.name}" for d in doses} <= ids
            if config == "dose_response":
                extremes = {d.name for d in doses if d.params["shift"] in (min(shifts), max(shifts))}
                assert {d.name for d in doses if d.seeds == (1,)} == extremes and f"{p}/eval/control-s1" in ids
                assert {f"{p}/adapt/{d}-s1" for d in extremes} <= ids
