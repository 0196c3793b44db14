"""Every model a study makes carries its template share and its VL skill: a causal LM put back into its VLM's tower
and projector is the VLM again (its own LM) or the base on text (the base's); the openings are the VL recipe's
image answers only; a study with the instruction recipe's held-out VQA scores its merge in the VLM and reports
template share per model, Δ VL beside recovery and the recovery vs VL-cost plot."""

import json

import pytest
import torch
import yaml

from evals import template_share as ts
from interventions.adapt.build import build_vlm, check_round_trip
from interventions.adapt.config import VisionSpec
from interventions.adapt.vlm_io import implant_lm
from sinkstudy import SinkstudyError
from sinkstudy.tiny import tiny_causal_lm

TINY = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "patch_size": 4}


def _vlm_logits(vlm, processor, image):
    text = processor.tokenizer.apply_chat_template([{"role": "user", "content": f"{processor.image_token}\nWhat is it?"}],
                                                   tokenize=False, add_generation_prompt=True)
    inputs = processor(text=[text], images=[image], return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        return vlm(**inputs).logits


def test_an_lm_put_back_into_its_vlm_is_the_vlm_and_another_lm_takes_its_place(tokenizer):
    from PIL import Image

    from interventions.pairs import extract_language_model

    base = tiny_causal_lm("qwen2", vocab_size=len(tokenizer) - 1)  # the VLM's vocabulary has a row past the base's
    built = build_vlm(base, tokenizer, VisionSpec("tiny", tiny=TINY))
    vlm, processor = built.model, built.processor
    with torch.no_grad():  # the VLM's LM moves away from the base, its image-token row included
        for p in vlm.get_decoder().parameters():
            p.add_(0.05 * torch.randn_like(p))
    image = Image.new("RGB", (8, 8), (200, 30, 30))
    before = _vlm_logits(vlm, processor, image)
    own, _ = extract_language_model(vlm, base)  # the base's vocabulary: the last row is not in it
    extra_row = vlm.get_input_embeddings().weight[-1].clone()
    implant_lm(vlm, own)
    assert torch.equal(_vlm_logits(vlm, processor, image), before)  # the VLM again, bit for bit
    implant_lm(vlm, base)
    check_round_trip(vlm, base, tokenizer)  # now the base on text...
    assert torch.equal(vlm.get_input_embeddings().weight[-1], extra_row)  # ...with the VLM's own row past the base's
    with pytest.raises(SinkstudyError, match="does not fit") as err:
        implant_lm(vlm, tiny_causal_lm("qwen2", vocab_size=len(tokenizer), num_hidden_layers=3))
    assert "\n" not in str(err.value)


def test_openings_are_the_recipes_image_answers_only():
    import numpy as np

    from experiments.study.template import TrainingOpenings, training_data

    rows = [{"images": [np.zeros((8, 8, 3), "uint8")], "messages": [
                {"role": "user", "content": "<image>\nWhat is it?"}, {"role": "assistant", "content": "It is a 3, I think."}]},
            {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there my good friend."}]}]
    recipe = {"stages": [{"data": [{"records": rows}]}, {"data": [{"records": rows}, {"selfdistill": "base"}]}]}
    specs = training_data(recipe)
    assert specs == ({"records": rows},)  # once, and never the base's replies
    found = ts.Openings.from_dict(TrainingOpenings(specs).run(None))
    assert found.n_answers == 1 and found.matches("It is a 7, for sure.") and not found.matches("Hello there my good friend.")
    assert ts.Openings.from_dict(found.as_dict()) == found


def test_vl_eval_probe_settings_fail_in_one_line(tmp_path):
    from experiments.study.adapt_section import _probe
    from experiments.study.schema import StudyConfigError
    from interventions.adapt.config import from_dict

    recipe = from_dict({"stages": [{"name": "s", "data": ["digits"], "steps": 1}]})
    assert _probe({"probe": "vqa", "scenes": 5}, recipe, "adapt")["scenes"] == 5
    assert _probe({"heldout": 10}, recipe, "adapt") == {"probe": "digits", "heldout": 10, "seed": recipe.seed}
    for bad, needle in [({"probe": "nope"}, "probe"), ({"probe": "vqa", "heldout": 3}, "digit probe's setting"),
                        ({"scenes": 3}, "vqa probe"), ({"probe": "vqa", "easyvqa": 0, "scenes": 0, "digits": 0}, "at least one"),
                        ({"probe": "vqa", "max_new_tokens": 0}, "max_new_tokens")]:
        with pytest.raises(StudyConfigError, match=needle) as err:
            _probe(bad, recipe, "adapt")
        assert "\n" not in str(err.value)


@pytest.mark.slow(seconds=60)
def test_a_study_reports_template_share_per_model_and_each_merges_vl_cost(tmp_path, tokenizer, own_cache):
    from evals.eval_run import EvalRun
    from experiments.report.document import write_report
    from experiments.study.config import load_study
    from experiments.study.runner import run_study

    tiny_causal_lm("qwen2", vocab_size=len(tokenizer)).save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    stage = {"batch_size": 4, "micro_batch_size": 4, "lr": 1e-3}
    cfg = {"name": "vlcost", "seed": 0, "pairs": [{"name": "p", "base": str(tmp_path / "base"), "native_qk_norm": False}],
           "sink": {"metric": "logodds", "options": {"batch_size": 8}},
           "evals": {"tasks": ["sinkstudy_gsm"], "limit": 3, "max_gen_toks": 6, "batch_size": 3, "n_boot": 200},
           "interventions": [{"name": "half", "method": "linear", "params": {"weight": 0.5}}],
           "adapt": {"recipe": {"seed": 0, "precision": "fp32", "max_length": 256, "stages": [
                         {"name": "stage1", "trainable": ["projector"], "steps": 1, **stage, "data": [{"generated": "caption", "n": 6}]},
                         {"name": "stage2", "trainable": ["projector", "lm"], "steps": 2, **stage,
                          "data": [{"generated": "scene_vqa", "n": 6}, {"generated": "detail", "n": 3}]}]},
                     "vision": {"kind": "tiny", "tiny": TINY},
                     "vl_eval": {"probe": "vqa", "easyvqa": 2, "scenes": 3, "digits": 2},
                     "arms": [{"name": "control"}]}}
    (tmp_path / "study.yaml").write_text(yaml.safe_dump(cfg))
    out = tmp_path / "out"
    run_study(load_study(tmp_path / "study.yaml", out=out), progress=False)
    summary = json.loads((out / "summary.json").read_text())
    pair = summary["pairs"]["p"]
    openings = ts.Openings.from_dict(json.loads((out / "steps" / "adapt" / "openings.json").read_text())["result"])
    assert openings.n_answers == 6 + 6 + 3  # every image answer of both stages
    for label in ("base", "vlm", "half"):
        outputs = [s["output"] for s in EvalRun.load(out / "evals" / "p" / label).samples["sinkstudy_gsm"]]
        assert pair["models"][label]["template_share"]["sinkstudy_gsm"] == ts.template_share(outputs, openings).as_dict()
    vlm, half = pair["models"]["vlm"]["vl_skill"], pair["models"]["half"]["vl_skill"]
    assert vlm["probe"] == half["probe"] == "vqa" and vlm["n"] == half["n"] == 7
    assert vlm["by_type"]["digit"]["n"] == 2 and sum(t["n"] for t in vlm["by_type"].values()) == 7
    assert all(0 < t["chance"] < 1 for t in vlm["by_type"].values())
    cost = pair["vl_cost"]["half"]
    assert cost["delta_points"] == pytest.approx(100 * (half["accuracy"] - vlm["accuracy"]))
    report = (out / "report.md").read_text()
    assert "## Template share" in report and "Δ VL pts vs VLM" in report and "chance" in report
    assert "p: every model's template share on sinkstudy_gsm is below 10%" in report  # the tiny models' answers are no template
    protections = report.split("## Training-time protections")[1]
    assert "sinkstudy_gsm template share" in protections.split("\n\n")[2]  # the arms' table has the column
    assert (out / "plots" / "recovery_vl_cost_sinkstudy_gsm.png").stat().st_size > 1000
    # a VLM LM answering in the template is named as a collapse
    pair["models"]["vlm"]["template_share"]["sinkstudy_gsm"] = {"share": 0.5, "n": 4, "templated": 2, "examples": []}
    report = write_report(summary, tmp_path / "again").read_text()
    assert "template share at or above 10% on sinkstudy_gsm for vlm 0.50 (2/4)" in report
