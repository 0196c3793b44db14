"""A study's `dose:` section end to end on a tiny planted-sink base: each dosed base made by one step, its S (the
study's metric) at the asked level, its text skill compared with the undosed base before any VL training, then
adapted with the control's recipe; the report's dose section names a dose that costs text skill as a confound."""

import json

import pytest
import yaml

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
        "dose": [-1, {"name": "up", "shift": 1.0, "tolerance": 0.05}],
        "adapt": {
            "recipe": {"seed": 0, "precision": "fp32", "max_length": 256, "stages": [
                {"name": "stage1", "trainable": ["projector"], "steps": 2, "batch_size": 4, "micro_batch_size": 4, "lr": 1e-3},
                {"name": "stage2", "trainable": ["projector", "lm"], "steps": 2, "batch_size": 4, "micro_batch_size": 4,
                 "lr": 1e-3}]},
            "vision": {"kind": "tiny", "tiny": {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "patch_size": 4}},
            "data": ["digits"],
            "vl_eval": {"heldout": 10},
            "arms": [{"name": "control"}],
        },
    }
    (root / "study.yaml").write_text(yaml.safe_dump(cfg))
    return root / "study.yaml"


def test_a_dose_study_measures_each_dosed_base_before_and_after_vl_training(study_file, tmp_path, own_cache):
    from safetensors.torch import load_file

    from experiments.report.document import build_blocks
    from experiments.report.render import render_md
    from experiments.study.config import load_study
    from experiments.study.runner import run_study

    out = tmp_path / "out"
    log = {e["step"]: e["reused"] for e in run_study(load_study(study_file, out=out), progress=False)["log"]}
    assert {"p/dose/dose-minus1", "p/dose/up", "p/sink/dose-minus1", "p/eval/up", "p/adapt/up", "p/vlskill/up",
            "p/adapt/up-extract", "p/eval/up-vl"} <= set(log)
    summary = json.loads((out / "summary.json").read_text())
    e = summary["pairs"]["p"]
    s0 = e["models"]["base"]["sink_strength"]
    doses = e["dose"]["doses"]
    assert set(doses) == {"dose-minus1", "up"} and not e["interventions"]  # doses are no intervention on the VLM LM
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

    doses["up"]["text_cost"] = ["sinkstudy_gsm"]  # the report is a function of the summary: a flagged dose is named
    assert "p / up: the dose itself costs sinkstudy_gsm text skill before any VL training" in render_md(build_blocks(summary, tmp_path))

    again = {e["step"]: e["reused"] for e in run_study(load_study(study_file, out=out), progress=False)["log"]}
    assert all(again.values())


@pytest.mark.parametrize("dose, needle", [
    ([], "a non-empty list of doses"),
    ([{"shift": 1, "scale": 2}], "takes one of target"),
    ([{"levels": 1}], "unknown key(s) levels"),
    ([1, 1], "duplicate"),
    ([{"name": "lin", "shift": 1}], "an intervention's / arm's name"),
    ([{"name": "a b", "shift": 1}], "name"),
])
def test_bad_doses_fail_in_one_line(dose, needle):
    from experiments.study.config import StudyConfigError, validate

    raw = {"name": "t", "pairs": [{"name": "p", "base": "some/base", "vlm": "some/vlm"}], "evals": {"tasks": ["sinkstudy_ifeval"]},
           "interventions": [{"name": "lin", "method": "linear", "params": {"weight": 0.5}}], "dose": dose}
    with pytest.raises(StudyConfigError) as exc:
        validate(raw)
    assert needle in str(exc.value) and "\n" not in str(exc.value)
