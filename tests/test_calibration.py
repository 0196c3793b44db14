"""A recipe calibration as a study on a tiny base: arms that change stage 2's lr (recipe overrides) share the tower,
stage 1 and data; each keeps models during stage 2 (`save_models_at`), and every kept model is measured like an arm's
final model (Δ against the base with its CI, template share, VL skill, S). The rule that chooses a point is fixed before
the numbers (`experiments.study.calibration.RULE`)."""

import json

import pytest
import yaml

from experiments.study.calibration import RULE, choose, misses

pytestmark = pytest.mark.slow(seconds=10)


@pytest.fixture(scope="module")
def study_file(tmp_path_factory, tokenizer):
    from sinkstudy.tiny import tiny_causal_lm

    root = tmp_path_factory.mktemp("calibration")
    tiny_causal_lm("qwen2", vocab_size=len(tokenizer)).save_pretrained(root / "base")
    tokenizer.save_pretrained(root / "base")
    stage = {"batch_size": 4, "micro_batch_size": 4, "lr": 1e-3}
    cfg = {
        "name": "ctest", "seed": 0,
        "pairs": [{"name": "p", "base": str(root / "base"), "native_qk_norm": False}],
        "sink": {"metric": "logodds", "options": {"batch_size": 8}},
        "evals": {"tasks": ["sinkstudy_gsm"], "limit": 3, "max_gen_toks": 6, "batch_size": 3, "n_boot": 200},
        "adapt": {
            "recipe": {"seed": 0, "precision": "fp32", "max_length": 256, "stages": [
                {"name": "stage1", "trainable": ["projector"], "steps": 2, **stage},
                {"name": "stage2", "trainable": ["projector", "lm"], "steps": 4, "save_models_at": [2], **stage}]},
            "vision": {"kind": "tiny", "tiny": {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "patch_size": 4}},
            "data": ["digits"],
            "vl_eval": {"heldout": 10},
            "arms": [{"name": "lr-high", "recipe": {"stage2": {"lr": 1e-2}}}],
        },
    }
    (root / "study.yaml").write_text(yaml.safe_dump(cfg))
    return root


def test_a_calibration_grid_measures_every_kept_model_and_shares_stage_one(study_file, tmp_path, own_cache):
    from experiments.study.config import load_study
    from experiments.study.runner import run_study

    out = tmp_path / "out"
    log = run_study(load_study(study_file / "study.yaml", out=out), progress=False)["log"]
    ran = {e["step"] for e in log}
    assert {"p/adapt/control-stage2-2-extract", "p/eval/lr-high-stage2-2", "p/vlskill/lr-high-stage2-2", "p/sink/control-stage2-2"} <= ran
    summary = json.loads((out / "summary.json").read_text())
    cal = summary["pairs"]["p"]["calibration"]
    assert [(p["arm"], p["stage_step"], p["lr"]) for p in cal["points"]] == [
        ("control", 2, 1e-3), ("control", 4, 1e-3), ("lr-high", 2, 1e-2), ("lr-high", 4, 1e-2)]
    for p in cal["points"]:
        assert p["n"] == 3 and 0 <= p["vl_accuracy"] <= 1 and isinstance(p["sink_strength"], float)
        assert p["template_share"] is not None and p["train_seconds"] > 0
    # The kept models are other models: the two arms' stage-2 models differ at step 2 (the lr), and stage 1 was shared.
    models = summary["pairs"]["p"]["models"]
    assert models["control-stage2-2"]["method"] == "snapshot" and "control-stage2-2" not in summary["pairs"]["p"]["interventions"]
    assert set(summary["pairs"]["p"]["protection"]["arms"]) == {"control", "lr-high"}  # kept models are not arms
    stages = {a: models_of(out, a) for a in ("control", "lr-high")}
    assert stages["control"] != stages["lr-high"]
    assert cal["chosen"]["label"] in {p["label"] for p in cal["points"]}
    report = (out / "report.md").read_text()
    assert "## Calibration" in report and "◀" in report and "lr-high" in report


def models_of(out, arm):
    """The fingerprints of an arm's kept model at step 2 and of its final model."""
    run = json.loads((out / "adapt" / "p" / arm / "adapt.json").read_text())
    return [s["fingerprint"] for s in run["snapshots"]] + [run["provenance"]["model_fingerprints"]["result"]]


def test_arm_recipe_overrides_are_checked_in_one_line(study_file):
    from experiments.study.config import StudyConfigError, validate

    raw = yaml.safe_load((study_file / "study.yaml").read_text())
    for override, needle in [({"stage3": {"lr": 1}}, "unknown key"), ({"stage2": {"data": ["digits"]}}, "unknown key"),
                             ({"stage2": {"lr": -1}}, "lr"), ({"stage2": {"save_models_at": [9]}}, "save_models_at")]:
        bad = {**raw, "adapt": {**raw["adapt"], "arms": [{"name": "x", "recipe": override}]}}
        with pytest.raises(StudyConfigError, match=needle) as err:
            validate(bad)
        assert "\n" not in str(err.value) and "arms" in str(err.value)


def _point(label, delta, hi, share, vl):
    return {"label": label, "delta_points": delta, "delta_ci": [delta - 3, hi], "template_share": share, "vl_accuracy": vl}


def test_the_rule_chooses_a_point_that_meets_it_else_the_closest_with_what_it_misses():
    meets = _point("ok", -8.0, -2.0, 0.02, 0.75)
    assert misses(meets) == [] and choose([_point("collapse", -12.0, -6.0, 0.3, 0.8), meets])["label"] == "ok"
    assert misses(_point("ci", -4.0, 1.0, 0.0, 0.9)) == ["CI reaches 0"]
    assert misses(_point("big", -20.0, -15.0, 0.0, 0.9))[0].startswith("Δ -20.0 outside")
    # None meets: fewest criteria missed first, then the higher VL accuracy
    blind, share = _point("blind", -8.0, -2.0, 0.02, 0.5), _point("share", -8.0, -2.0, 0.2, 0.75)
    both = _point("both", -1.0, 2.0, 0.3, 0.9)
    chosen = choose([both, share, blind])
    assert chosen["label"] == "share" and not chosen["meets"] and chosen["misses"] == [
        f"template share 0.20 ≥ {RULE['template_share_below']:g}"]
    assert choose([]) is None
