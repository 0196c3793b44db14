"""The embedded demo: generated data that lm-eval's own graders accept, its VL config of the
adaptation engine, and the reduced demo end to end (report, plots, tables; a rerun reuses every step; a
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


def _demo_vl_cfg(steps1: int, steps2: int, lr2: float):
    import copy

    from experiments.demo.build import DEFAULTS

    cfg = copy.deepcopy(DEFAULTS["vl"])
    cfg["heldout_images"] = 100
    cfg["vision"].update(hidden_size=32, num_hidden_layers=1, num_attention_heads=2)
    cfg["stage1"].update(steps=steps1)
    cfg["stage2"].update(steps=steps2, lr=lr2)
    cfg["trajectory_every"] = None
    return cfg


def test_demo_vl_recipe_learns_to_read_digits(tmp_path, tokenizer):
    """The demo's VL config of the engine must make the answer depend on the digit shown: a regression
    test for the VLM whose held-out accuracy sat at chance (0.1). Stage 1 trains the projector only.
    (One answer wording here, "It is a d.", the one the probe scores; the demo varies it.)"""
    from experiments.demo.vl import recipe, vision
    from interventions.adapt.probe import digit_skill
    from interventions.adapt import adapt
    from interventions.adapt.sources import digits_records
    from sinkstudy.tiny import tiny_causal_lm

    tiny_causal_lm("qwen2", vocab_size=len(tokenizer)).save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    cfg = _demo_vl_cfg(5, 150, 3e-3)  # the tiny LM is untrained, so stage 2 runs at a pretraining lr (0.76 measured)
    config = recipe(cfg, digits_records("train", n_heldout=cfg["heldout_images"], seed=cfg["seed"]))
    report = adapt(tmp_path / "base", vision=vision(cfg), config=config, out=tmp_path / "run", progress=False)
    assert report["stages"][0]["trainable_groups"] == ["projector"] and report["build"]["round_trip_max_abs_logit_diff"] <= 1e-5
    assert digit_skill(tmp_path / "run" / "model", cfg["heldout_images"], cfg["seed"])["digit_accuracy"] >= 0.25  # chance is 0.1


def test_saved_demo_vlm_processor_feeds_the_model_as_training_did(tmp_path, tokenizer):
    """The saved processor expands the image placeholder to as many tokens as the model has image
    features and prepares pixels exactly as the engine's training encoder did; the answer depends on
    the image."""
    import torch

    from experiments.demo.vl import adapt_vl
    from interventions.adapt.vlm_io import load_vlm
    from interventions.adapt.sources import IMAGE, digits_records
    from interventions.adapt.encoding import Encoder
    from sinkstudy.tiny import tiny_causal_lm

    tiny_causal_lm("qwen2", vocab_size=len(tokenizer)).save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    adapt_vl(tmp_path / "base", tmp_path / "vlm", _demo_vl_cfg(1, 1, 1e-3), work_dir=tmp_path / "run", progress=False)
    vlm, processor = load_vlm(tmp_path / "vlm")
    assert vlm.config.image_seq_length == 4
    records = digits_records("heldout", n_heldout=2)
    encoder = Encoder(processor.tokenizer, processor=processor, image_token=processor.image_token)
    text = processor.apply_chat_template([{"role": "user", "content": processor.image_token + "\nWhat digit is this?"}],
                                         add_generation_prompt=True)
    logits = []
    for rec in records:
        enc = processor(images=rec["images"][0], text=text, return_tensors="pt")
        assert int((enc["input_ids"] == vlm.config.image_token_id).sum()) == vlm.config.image_seq_length
        trained = encoder({"images": rec["images"], "messages": [{"role": "user", "content": f"{IMAGE}\nWhat digit is this?"},
                                                                 {"role": "assistant", "content": "x"}]})
        assert torch.equal(enc["pixel_values"], trained["images"][0]["pixel_values"])
        with torch.no_grad():
            logits.append(vlm(**enc).logits[0, -1])
    assert (logits[0] - logits[1]).abs().max() > 1e-3


RECIPE_KNOBS = ("family", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "steps", "lr",
                "weight_decay", "backcopy_share", "noise_share", "sprinkle_rate", "seed")


def test_demo_backbones_vary_the_knobs_linked_to_sinks():
    """The demo's backbones are >= 6 config entries that vary every knob the literature links to sinks
    (native QK-norm on/off, lr, weight decay, data mix, depth), all on the same corpus."""
    from experiments.cli.cmd_study import DEMO_CONFIG
    from experiments.demo.study import load_study

    backbones = load_study(DEMO_CONFIG).build.backbones
    assert len(backbones) >= 6
    mix = lambda b: (b["backcopy_share"], b["retrieval_share"], b["noise_share"], b["sprinkle_rate"])  # noqa: E731
    for knob in (lambda b: b["native_qk_norm"], lambda b: b["lr"], lambda b: b["weight_decay"], mix,
                 lambda b: b["num_hidden_layers"]):
        assert len({knob(b) for b in backbones}) >= 2


def test_demo_build_and_study_schema_import_each_other_in_neither_direction():
    """experiments.demo.build (the build section's schema) and experiments.study.config (the study schema) share
    experiments.study.schema; loading the build module does not load the study module."""
    import subprocess
    import sys

    code = "import sys, experiments.demo.build; sys.exit('experiments.study.config' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


def test_step_clock_prints_elapsed_and_an_estimate_from_the_stage_means():
    """One line per finished step: done/total, elapsed, and the time left estimated from the mean of the
    finished steps of each stage (other stages: the mean over stages), divided by the parallel jobs."""
    import io

    from experiments.study.clock import StepClock

    stream = io.StringIO()
    clock = StepClock(["build/pretrain/a", "build/pretrain/b", "build/vl/a", "a/eval/base", "a/eval/vlm"], jobs=2, stream=stream)
    first = clock.tick("build/pretrain/a", 100.0, reused=False)
    assert first.startswith("[1/5] 0:00 elapsed, ~") and first.endswith("| build/pretrain/a 100.0s")
    assert clock.estimate_left() == pytest.approx(4 * 100.0 / 2)  # every stage estimated at pretrain's mean
    clock.tick("build/pretrain/b", 60.0, reused=False)
    clock.tick("a/eval/base", 4.0, reused=True)  # reused: done, but not a measurement
    assert clock.estimate_left() == pytest.approx((80.0 + 80.0) / 2)
    assert stream.getvalue().count("\n") == 3 and "a/eval/base reused" in stream.getvalue()
    # With typical seconds per stage, an unseen stage is estimated from its prior, scaled by this run's pace.
    clock = StepClock(["build/pretrain/a", "build/vl/a", "a/eval/base"], priors={"pretrain": 50.0, "vl": 30.0, "eval": 4.0},
                      stream=io.StringIO())
    clock.tick("build/pretrain/a", 100.0, reused=False)  # twice as slow as typical
    assert clock.estimate_left() == pytest.approx(2 * (30.0 + 4.0))
    # Interventions are timed per intervention (a merge vs a VL re-training), with the stage's prior as fallback.
    clock = StepClock(["a/intervene/ties", "a/intervene/qknorm-vl"], priors={"intervene": 1.0, "intervene/qknorm-vl": 30.0},
                      stream=io.StringIO())
    assert clock.stage("a/intervene/qknorm-vl") == "intervene/qknorm-vl" and clock.stage("a/eval/base") == "eval"
    clock.tick("a/intervene/ties", 1.0, reused=False)
    assert clock.estimate_left() == pytest.approx(30.0)


def test_round_trip_tolerance_scales_with_logit_size(tokenizer):
    """The engine's logits round trip (the seam demo-real needed): fp32-size differences pass at any logit
    scale, a real difference fails."""
    import copy

    import torch

    from interventions.adapt.build import check_round_trip
    from sinkstudy import SinkstudyError
    from sinkstudy.tiny import tiny_causal_lm

    base = tiny_causal_lm("qwen2", vocab_size=len(tokenizer)).eval()
    with torch.no_grad():
        base.lm_head.weight.mul_(1e4)  # logits in the thousands
        other = copy.deepcopy(base)
        other.lm_head.weight.mul_(1 + 1e-7)  # fp32-rounding-size relative change: above 1e-5 absolute
    assert check_round_trip(other, base, tokenizer) > 1e-5  # would have failed an absolute 1e-5
    with torch.no_grad():
        other.lm_head.weight.mul_(1 + 1e-3)
    with pytest.raises(SinkstudyError, match="round trip failed"):
        check_round_trip(other, base, tokenizer)


@pytest.mark.slow(seconds=80)
def test_quick_demo_end_to_end_and_resume(tmp_path, capsys):
    import json

    import yaml

    from experiments.cli import main
    from experiments.cli.cmd_study import DEMO_CONFIG
    from experiments.demo.build import quick_overrides
    from experiments.study.runner import run_study
    from experiments.demo.study import load_study

    # The shipped demo with two of --quick's three backbones: the recipe-built qwen3 and a plain qwen2 (the QK-norm
    # VL arm's class), every intervention; --quick shrinks it as it shrinks the shipped one.
    raw = yaml.safe_load(DEMO_CONFIG.read_text())
    raw["build"]["backbones"] = [b for b in raw["build"]["backbones"] if b["name"] in ("qwen3-sprinkle", "qwen2-lr1e-2")]
    config = tmp_path / "demo.yaml"
    config.write_text(yaml.safe_dump(raw, sort_keys=False))
    out = tmp_path / "demo"
    assert main(["demo", "--quick", "--config", str(config), "--quiet", "--jobs", "1", "--out", str(out)]) == 0  # --jobs 2: test_determinism.py
    printed = capsys.readouterr().out.strip().splitlines()
    line = next(x for x in printed if x.startswith("sinkstudy: demo: report "))
    assert str(out / "report.md") in line
    head = next(i for i, x in enumerate(printed) if x.startswith("── sinkstudy demo: study demo"))  # the closing summary
    assert str(out / "report.md") in printed[head + 1] and printed[-1].split()[-1] == "--dry-run"

    report = (out / "report.md").read_text()
    for section in ("## Findings", "## Sink Strength and strict scores", "## Recovery per intervention", "## Plots",
                    "## How the miniature pairs were built", "## Provenance"):
        assert section in report
    study = load_study(config, out=out, overrides=quick_overrides(raw))
    backbones = study.build.backbones
    assert [b["name"] for b in backbones] == ["qwen3-sprinkle", "qwen2-lr1e-2"]
    for b in backbones:
        assert f"| {b['name']} |" in report
        assert (out / "plots" / f"sink_{b['name']}.png").stat().st_size > 1000
    for name in [i["name"] for i in raw["interventions"]] + ["qknorm-vl"]:
        assert f"| {name} |" in report

    # The backbones span what the config gives them: each trained with its entry's recipe, its pair's QK-norm
    # its family's; the report's S statement is the summary's (range, span, S > 0 or not), before the claims.
    summary = json.loads((out / "summary.json").read_text())
    assert list(summary["pairs"]) == [b["name"] for b in backbones]
    for b in backbones:
        recipe = json.loads((out / "steps" / "build" / "pretrain" / f"{b['name']}.json").read_text())["result"]["recipe"]
        assert {k: recipe[k] for k in RECIPE_KNOBS} == {k: b[k] for k in RECIPE_KNOBS}
        assert summary["pairs"][b["name"]]["native_qk_norm"] is (b["family"] == "qwen3")
    s = [e["models"]["base"]["sink_strength"] for e in summary["pairs"].values()]
    assert f"spans {min(s):.2f} to {max(s):.2f} (span {max(s) - min(s):.2f}" in report
    assert ("No miniature base reaches S > 0" in report) is (max(s) <= 0)
    assert report.index("## The miniature's sinks") < report.index("## The paper's claims")  # said before any answer
    assert "Why the miniature may differ from the paper:" in report
    assert "- A stronger sink (higher S of the base) predicts less loss — " in report  # whether it agrees: the claims' answer
    assert (out / "plots" / "pretrain_sink_curves.png").stat().st_size > 1000
    for plot in ("scatter_sinkstudy_ifeval.png", "recovery_sinkstudy_ifeval.png", "recovery_sinkstudy_gsm.png"):
        assert (out / "plots" / plot).is_file()
    html = (out / "report.html").read_text()
    assert html.count("<table>") == report.count("\n|---") and 'src="plots/sink_qwen3-sprinkle.png"' in html

    # Every step JSON carries provenance with the config and model fingerprints.
    plain = next(b["name"] for b in backbones if b["family"] != "qwen3")
    step = json.loads((out / "steps" / plain / "eval" / "vlm.json").read_text())
    prov = step["provenance"]
    assert prov["config"]["content"]["name"] == "demo" and prov["versions"]["lm_eval"]
    assert any(v.startswith("ckpt-sha256:") for v in prov["model_fingerprints"].values())
    assert json.loads((out / "steps" / plain / "intervene" / "ties.json").read_text())["provenance"]["seeds"]["study"] == 0

    # A rerun reuses every step; a changed intervention re-runs only its own steps.
    again = run_study(load_study(config, out=out, overrides=quick_overrides(raw)), progress=False)
    assert again["reused"] == again["steps"], [e["step"] for e in again["log"] if not e["reused"]]
    changed = quick_overrides(raw)
    changed["interventions"] = [dict(i, params={**i["params"], "density": 0.3}) if i["name"] == "ties" else i
                                for i in changed["interventions"]]
    third = run_study(load_study(config, out=out, overrides=changed), progress=False)
    assert third["steps"] - third["reused"] == len(backbones) * 3  # per pair: intervene, sink and eval of ties


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_probe_scores_each_answer_as_a_whole_forward_pass_does(tokenizer, family):
    """The probe runs the shared image + question once and continues each answer from its cache: every answer's
    log-probability must equal the one a plain forward pass of the whole row gives (the study's two backbones)."""
    import torch

    from evals.vqa import answer_logprobs
    from interventions.adapt.build import build_vlm
    from interventions.adapt.config import VisionSpec
    from interventions.adapt.sources import digits_records
    from interventions.adapt.encoding import Encoder, collate
    from sinkstudy.tiny import tiny_causal_lm

    torch.manual_seed(0)
    base = tiny_causal_lm(family, vocab_size=len(tokenizer), tie_word_embeddings=family == "gemma3_text")
    built = build_vlm(base, tokenizer, VisionSpec("tiny", tiny={"hidden_size": 32, "num_hidden_layers": 1,
                                                                "num_attention_heads": 2, "patch_size": 4}))
    vlm = built.model.eval()
    encoder = Encoder(built.tokenizer, processor=built.processor, image_token=built.image_token)
    answers = [f"It is a {d}." for d in range(10)] + ["It is a large seven, drawn thin."]  # rows of unequal length
    feats = [encoder({"images": rec["images"], "messages": [rec["messages"][0], {"role": "assistant", "content": a}]})
             for rec in digits_records("heldout", n_heldout=3, seed=0) for a in answers]
    batch = collate(feats, built.tokenizer.pad_token_id)
    with torch.no_grad():
        score, n_tokens = answer_logprobs(vlm, dict(batch), rows_per_image=len(answers))
        labels = batch.pop("labels")
        logp = torch.log_softmax(vlm(**batch, use_cache=False).logits[:, :-1].float(), -1)
        answer = labels[:, 1:] != -100
        ref = (logp.gather(-1, labels[:, 1:].clamp(min=0).unsqueeze(-1)).squeeze(-1) * answer).sum(1)
    assert torch.equal(n_tokens, answer.sum(1).float())
    assert torch.allclose(score, ref, atol=1e-4), (score - ref).abs().max()
    assert len(set(score.tolist())) == len(score)  # the answers, and the images, really are scored apart
