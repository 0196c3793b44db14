"""The embedded demo: generated data that lm-eval's own graders accept, a LLaVA built around a
backbone, and the reduced demo end to end (report, plots, tables; a rerun reuses every step; a
changed intervention re-runs only its own steps)."""

import random

import pytest

from experiments.demo import corpus


def test_heldout_reference_answers_pass_lm_eval_graders():
    from evals.nltk_offline import ensure_punkt_tab

    ensure_punkt_tab()
    from lm_eval.tasks.ifeval import utils

    _, held = corpus._splits()
    rng = random.Random(3)
    ids = set()
    for key in range(200):
        rec, resp = corpus.ifeval_example(rng, held, key)
        ids.update(rec["instruction_id_list"])
        inp = utils.InputExample(key=key, instruction_id_list=rec["instruction_id_list"], prompt=rec["prompt"], kwargs=rec["kwargs"])
        assert utils.test_instruction_following_strict(inp, resp).follow_all_instructions, (rec, resp)
    assert ids == set(corpus.INSTRUCTIONS)
    # ...and a response that ignores the instruction fails it (the graders are not vacuous here).
    rec = {"instruction_id_list": ["change_case:english_capital"], "kwargs": [{}], "prompt": "Tell me about the owl."}
    inp = utils.InputExample(key=0, prompt=rec["prompt"], instruction_id_list=rec["instruction_id_list"], kwargs=rec["kwargs"])
    assert not utils.test_instruction_following_strict(inp, "The owl is white.").follow_all_instructions


def test_heldout_prompts_use_unseen_entities():
    train, held = corpus._splits()
    assert not {t[0] for t in train.things} & {t[0] for t in held.things}
    assert not set(train.names) & set(held.names)
    ifeval, gsm = corpus.heldout_prompts(30, 20, seed=0)
    train_text = " ".join(u + " " + (a or "") for u, a in corpus.training_records(2000, seed=0))
    assert all(rec["prompt"] not in train_text for rec in ifeval)
    assert all(g["answer"].split("#### ")[-1].isdigit() and "The answer is" in g["answer"] for g in gsm)


def test_llava_built_around_backbone_keeps_its_text_function(tokenizer):
    import torch

    from experiments.demo.vl import build_vlm
    from sinkstudy.tiny import tiny_causal_lm

    base = tiny_causal_lm("qwen3", vocab_size=len(tokenizer))
    vlm = build_vlm(base, tokenizer, {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "image_size": 8, "patch_size": 2})
    assert vlm.config.image_seq_length == 16 and vlm.config.text_config.model_type == "qwen3"
    ids = tokenizer(["The answer is 8."], return_tensors="pt")["input_ids"]
    with torch.no_grad():
        assert torch.allclose(vlm(input_ids=ids).logits, base(input_ids=ids).logits, atol=1e-5)


def test_llava_stages_learn_to_read_digits(tokenizer):
    """A few LLaVA steps with the demo's stage split must make the answer depend on the digit shown:
    a regression test for the VLM whose held-out accuracy sat at chance (0.1). Stage 1 leaves the
    vision tower and the LM untouched (training the tower against a frozen LM collapsed the image
    information)."""
    import torch

    from experiments.demo.vl import STAGE_TRAINABLE, build_vlm, digit_accuracy, digits_split, encode_turn, train_stage
    from sinkstudy.tiny import tiny_causal_lm

    base = tiny_causal_lm("qwen2", vocab_size=len(tokenizer))
    vlm = build_vlm(base, tokenizer, {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "image_size": 8, "patch_size": 4})
    n = vlm.config.image_seq_length
    (images, labels), (held_img, held_lab) = digits_split(100, seed=0)
    examples = [(img, *encode_turn(tokenizer, "What digit is this?", f"It is a {d}.", n)) for img, d in zip(images, labels)]
    run = dict(batch_size=16, seed=0, pad_id=tokenizer.pad_token_id, progress=False, desc="")
    frozen = {k: v.clone() for k, v in vlm.state_dict().items() if not k.startswith("model.multi_modal_projector.")}
    train_stage(vlm, examples, trainable=STAGE_TRAINABLE["stage1"], steps=5, lr=1e-3, **run)
    assert all(torch.equal(v, vlm.state_dict()[k]) for k, v in frozen.items())
    # The tiny LM is untrained, so stage 2 runs at a pretraining lr.
    train_stage(vlm, examples, trainable=STAGE_TRAINABLE["stage2"], steps=100, lr=3e-3, **run)
    assert digit_accuracy(vlm, tokenizer, held_img, held_lab, n)["digit_accuracy"] >= 0.25  # chance is 0.1


def test_saved_llava_processor_feeds_the_model_as_training_did(tmp_path, tokenizer):
    """The saved processor expands the image placeholder to as many tokens as the model has image
    features (it used to give 15 for 16: CLIP's CLS, dropped by "default", was not counted), and
    normalises pixels as training did; the answer depends on the image."""
    import copy

    import numpy as np
    import torch
    from transformers import LlavaForConditionalGeneration, LlavaProcessor

    from experiments.demo.build import DEFAULTS
    from experiments.demo.vl import IMAGE_TOKEN, adapt_vl, digits_split
    from sinkstudy.tiny import tiny_causal_lm

    base_dir, out = tmp_path / "base", tmp_path / "vlm"
    tiny_causal_lm("qwen2", vocab_size=len(tokenizer)).save_pretrained(base_dir)
    tokenizer.save_pretrained(base_dir)
    cfg = copy.deepcopy(DEFAULTS["vl"])
    cfg["heldout_images"] = 4
    cfg["vision"].update(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, patch_size=2)
    cfg["stage1"]["steps"] = cfg["stage2"]["steps"] = 1
    adapt_vl(base_dir, out, cfg, progress=False)

    processor = LlavaProcessor.from_pretrained(out)
    vlm = LlavaForConditionalGeneration.from_pretrained(out)
    assert vlm.config.image_seq_length == 16
    (images, _), _ = digits_split(0, seed=0)
    text = processor.apply_chat_template([{"role": "user", "content": IMAGE_TOKEN + "\nWhat digit is this?"}], add_generation_prompt=True)
    logits = []
    for pixels in images[:2]:
        image = np.uint8((pixels.permute(1, 2, 0).numpy() + 1) * 127.5)
        enc = processor(images=image, text=text, return_tensors="pt")
        assert int((enc["input_ids"] == vlm.config.image_token_id).sum()) == vlm.config.image_seq_length
        assert torch.allclose(enc["pixel_values"][0], pixels, atol=1e-2)
        with torch.no_grad():
            logits.append(vlm(**enc).logits[0, -1])
    assert (logits[0] - logits[1]).abs().max() > 1e-3


@pytest.mark.slow
def test_quick_demo_end_to_end_and_resume(tmp_path, capsys):
    import json

    import yaml

    from experiments.cli import main
    from experiments.cmd_study import DEMO_CONFIG
    from experiments.demo.build import quick_overrides
    from experiments.runner import run_study
    from experiments.study import load_study

    out = tmp_path / "demo"
    assert main(["demo", "--quick", "--quiet", "--out", str(out)]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("sinkstudy: demo: report ") and str(out / "report.md") in line

    report = (out / "report.md").read_text()
    for section in ("## Findings", "## Sink Strength and strict scores", "## Recovery per intervention", "## Plots",
                    "## How the miniature pairs were built", "## Provenance"):
        assert section in report
    for pair in ("qwen3", "qwen2"):
        assert f"| {pair} |" in report
        assert (out / "plots" / f"sink_{pair}.png").stat().st_size > 1000
    for name in ("linear", "ties", "dare", "head_restore", "qknorm", "qknorm-vl"):
        assert f"| {name} |" in report
    for plot in ("scatter_sinkstudy_ifeval.png", "recovery_sinkstudy_ifeval.png", "recovery_sinkstudy_gsm.png"):
        assert (out / "plots" / plot).is_file()
    html = (out / "report.html").read_text()
    assert html.count("<table>") == report.count("\n|---") and 'src="plots/sink_qwen3.png"' in html

    # Every step JSON carries provenance with the config and model fingerprints.
    step = json.loads((out / "steps" / "qwen2" / "eval" / "vlm.json").read_text())
    prov = step["provenance"]
    assert prov["config"]["content"]["name"] == "demo" and prov["versions"]["lm_eval"]
    assert any(v.startswith("ckpt-sha256:") for v in prov["model_fingerprints"].values())
    assert json.loads((out / "steps" / "qwen2" / "intervene" / "ties.json").read_text())["provenance"]["seeds"]["study"] == 0

    # A rerun reuses every step; a changed intervention re-runs only its own steps.
    raw = yaml.safe_load(DEMO_CONFIG.read_text())
    again = run_study(load_study(DEMO_CONFIG, out=out, overrides=quick_overrides(raw)), progress=False)
    assert again["reused"] == again["steps"]
    changed = quick_overrides(raw)
    changed["interventions"] = [dict(i, params={**i["params"], "density": 0.3}) if i["name"] == "ties" else i
                                for i in changed["interventions"]]
    third = run_study(load_study(DEMO_CONFIG, out=out, overrides=changed), progress=False)
    assert third["steps"] - third["reused"] == 2 * 3  # per pair: intervene, sink and eval of ties
