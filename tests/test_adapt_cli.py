"""`sinkstudy adapt` and `sinkstudy qknorm --adapt` on tiny models: end to end, reuse, one-line refusals
before any work, the estimate on real-shape configs, and the QK-norm arms' side-by-side table."""

import json

import pytest

from experiments.cli import main
from sinkstudy.tiny import tiny_causal_lm

RECIPE = """\
seed: 0
precision: fp32
stages:
  stage1: {steps: 2, batch_size: 4, micro_batch_size: 4, lr: 1.0e-3}
  stage2: {steps: 2, batch_size: 4, micro_batch_size: 2, lr: 1.0e-3}
trajectory: {every: 1}
"""


@pytest.fixture(scope="module")
def models(tmp_path_factory, tokenizer):
    root = tmp_path_factory.mktemp("adapt_cli")
    for family in ("qwen2", "qwen3"):
        tiny_causal_lm(family, vocab_size=len(tokenizer)).save_pretrained(root / family)
        tokenizer.save_pretrained(root / family)
    (root / "recipe.yaml").write_text(RECIPE)
    return root


def _tree(path):
    return sorted((str(p.relative_to(path)), p.stat().st_size) for p in path.rglob("*")) if path.exists() else None


def test_adapt_cli_end_to_end_reuse_and_refusal(models, tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["adapt", "--base", str(models / "qwen2"), "--tiny-vision", "--train-data", "digits", "--recipe", str(models / "recipe.yaml"),
            "--out", str(out), "--quiet"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    printed = captured.out
    assert "stage1" in printed and "stage2" in printed and "Sink Strength of the LM" in printed
    # --quiet: no progress bar at all, the libraries' included (transformers' "Loading weights" / "Writing model shards")
    assert "it/s]" not in captured.err and "Loading weights" not in captured.err and "Writing model shards" not in captured.err
    assert "final loss" in printed and "mean loss" in printed
    report = json.loads((out / "run" / "adapt.json").read_text())
    assert [s["steps"] for s in report["stages"]] == [2, 2]
    for s in report["stages"]:  # final_loss: where the stage ended (its last step of 2); mean_loss: the stage's mean
        assert s["final_loss_steps"] == 1 and s["final_loss"] == pytest.approx(s["losses"][-1])
        assert s["mean_loss"] == pytest.approx(sum(s["losses"]) / len(s["losses"]), rel=1e-4)
    assert [p["step"] for p in report["trajectory"]["points"]] == [0, 1, 2, 3, 4]
    assert (out / "model" / "config.json").is_file() and (out / "model" / "processor_config.json").is_file()
    before = _tree(out)
    assert main(argv) == 0  # finished: reused, nothing rewritten
    assert _tree(out) == before
    assert main(argv[:-1] + ["--train-steps", "stage2=3", "--quiet"]) == 2  # another request into the same --out
    assert "made by another request (config differ)" in capsys.readouterr().err and _tree(out) == before


GUARD = """\
from interventions.protect import Protection, register_protection


@register_protection("test_edited_guard", defaults={"gain": 1.0}, edits_training=True)
class Guard(Protection):
    def after_backward(self, ctx):
        for p in ctx.language_model.parameters():
            if p.grad is not None:
                p.grad.mul_(GAIN)
"""


def test_an_edited_protection_plugin_reruns_its_adaptation_without_force(models, tmp_path, capsys):
    """`make protect NAME=my_guard PLUGIN=my_guard.py` twice: an unchanged file reuses the run and says so; an edited
    file trains again into the same --out, no --force needed (the run's key holds the plug-in's source hash)."""
    from interventions.protect import _REGISTRY

    plugin, out = tmp_path / "my_guard.py", tmp_path / "run"
    argv = ["adapt", "--base", str(models / "qwen2"), "--tiny-vision", "--train-data", "digits", "--recipe", str(models / "recipe.yaml"),
            "--protect", "test_edited_guard", "--plugin", str(plugin), "--out", str(out), "--resume", "--quiet"]
    hook = lambda: json.loads((out / "run" / "request.json").read_text())["hooks"][0]["source_sha256"]  # noqa: E731
    try:
        plugin.write_text(GUARD.replace("GAIN", "1.0"))
        assert main(argv) == 0
        first = hook()
        capsys.readouterr()
        assert main(argv) == 0
        printed = capsys.readouterr().out
        assert "reused adapt/run" in printed and "wrote" not in printed and hook() == first
        plugin.write_text(GUARD.replace("GAIN", "0.5"))
        assert main(argv) == 0, capsys.readouterr().err
        printed = capsys.readouterr().out
        assert "reused" not in printed and f"wrote {out}" in printed and hook() != first
    finally:
        _REGISTRY.pop("test_edited_guard", None)


@pytest.mark.parametrize("extra, message", [
    (["--train-data", "missing.json"], "data file not found"),
    (["--train-data", "stage9=digits"], "no stage named 'stage9'"),
    (["--train-data", "digits", "--vision", "/no/such/tower"], "does not exist"),
    (["--train-data", "digits", "--qknorm", "ones"], "--qknorm ones"),
    (["--train-data", "stage1=digits"], "stage stage2: no data"),
])
def test_adapt_cli_bad_input_fails_in_one_line_before_any_work(models, tmp_path, capsys, extra, message):
    out = tmp_path / "run"
    side = [] if "--vision" in extra else ["--tiny-vision"]
    rc = main(["adapt", "--base", str(models / "qwen2"), *side, "--recipe", str(models / "recipe.yaml"), "--out", str(out), *extra])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and message in err and len(err.splitlines()) == 1 and not out.exists()


def test_donor_without_a_loadable_processor_is_refused_before_any_work(models, tmp_path, capsys):
    from vlm_factories import save_tiny_vlm

    save_tiny_vlm(tmp_path / "donor", "qwen2_5_vl")  # weights + tokenizer, no processor
    capsys.readouterr()
    out = tmp_path / "run"
    rc = main(["adapt", "--base", str(models / "qwen2"), "--donor", str(tmp_path / "donor"), "--train-data", "digits",
               "--recipe", str(models / "recipe.yaml"), "--out", str(out)])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "cannot load its processor" in err and len(err.splitlines()) == 1 and not out.exists()


def test_estimate_on_real_shape_configs(tmp_path, capsys):
    """Qwen2.5-3B-Instruct's shape around CLIP ViT-L/14-336 (LLaVA-1.5's tower), from configs only."""
    from transformers import CLIPVisionConfig, Qwen2Config

    Qwen2Config(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2,
                vocab_size=151936, tie_word_embeddings=True).save_pretrained(tmp_path / "qwen2.5-3b")
    CLIPVisionConfig(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16, image_size=336,
                     patch_size=14, projection_dim=768).save_pretrained(tmp_path / "clip-l-336")
    from interventions.adapt import VisionSpec, paper_recipe
    from interventions.adapt.estimate import estimate

    e = estimate(str(tmp_path / "qwen2.5-3b"), VisionSpec("fresh", str(tmp_path / "clip-l-336")), paper_recipe())
    p = e["params"]
    assert 3.0e9 < p["lm"] < 3.2e9 and 0.29e9 < p["tower"] < 0.32e9 and e["image_tokens"] == 576
    s1, s2 = e["stages"]
    assert s1["trainable_params"] == p["projector"] and s2["trainable_params"] == p["projector"] + p["lm"]
    assert s2["memory_gb"]["optimizer"] > 20 * s1["memory_gb"]["optimizer"] and s2["seconds_per_step"] > s1["seconds_per_step"]
    rc = main(["adapt", "--base", str(tmp_path / "qwen2.5-3b"), "--vision", str(tmp_path / "clip-l-336"), "--train-data", "digits",
               "--estimate", "--gpus", "8"])
    printed = capsys.readouterr().out
    assert rc == 0 and "8 x H200" in printed and "stage2" in printed and not (tmp_path / "runs").exists()


def test_text_only_adapt_cli(models, tmp_path):
    chats = tmp_path / "chats.jsonl"
    chats.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": f"Count to {i}."},
                                                        {"role": "assistant", "content": " ".join(map(str, range(1, i + 2)))}]})
                               for i in range(12)))
    out = tmp_path / "text"
    base = ["adapt", "--base", str(models / "qwen2"), "--text-only", "--train-data", str(chats), "--out", str(out), "--quiet"]
    assert main(base + ["--recipe", str(models / "recipe.yaml")]) == 2  # its stage 1 trains a projector
    assert main(base + ["--train-steps", "2"]) == 0  # the text recipe: one stage training the LM
    cfg = json.loads((out / "model" / "config.json").read_text())
    assert cfg["model_type"] == "qwen2" and json.loads((out / "run" / "adapt.json").read_text())["build"]["kind"] == "text-only"


@pytest.mark.slow
def test_qknorm_arms_through_the_same_adaptation(models, tmp_path, capsys):
    out = tmp_path / "arms"
    # --train-steps cuts the recipe's stages as in `sinkstudy adapt` (here stage 2: 2 -> 1 step)
    rc = main(["qknorm", str(models / "qwen2"), "--recipe", str(models / "recipe.yaml"), "--init", "identity-gain,scale-preserving",
               "--train-steps", "stage2=1",
               "--native", str(models / "qwen3"), "--tasks", "sinkstudy_ifeval", "--limit", "3", "--max-gen-toks", "8",
               "--system-instruction", "Answer briefly.", "--chat-template-kwargs", '{"enable_thinking": false}',
               "--gen-kwargs", "do_sample=false", "--batch-size", "2", "--out", str(out)])
    assert rc == 0
    report = json.loads((out / "report.json").read_text())
    arms = report["arms"]
    # `sinkstudy eval`'s protocol flags reach every arm's and every base's eval, and the report records them.
    protocol = {"system_instruction": "Answer briefly.", "chat_template_kwargs": {"enable_thinking": False},
                "gen_kwargs": {"do_sample": False}, "batch_size": 2, "max_gen_toks": 8, "limit": 3}
    assert {k: report["eval"][k] for k in protocol} == protocol
    for run in ("control", "native", "base", "native-base"):
        settings = json.loads((out / "evals" / run / "results.json").read_text())["settings"]
        assert {k: settings[k] for k in protocol} == protocol, run
        prompt = json.loads(next((out / "evals" / run / "samples").glob("*.json*")).read_text().splitlines()[0])["prompt"]
        assert "<|system|>\nAnswer briefly.<|end|>" in prompt, run
    assert list(arms) == ["control", "injected-identity-gain", "injected-scale-preserving", "native"]
    assert "vs_control" not in arms["control"]["tasks"]["sinkstudy_ifeval"]
    for name, arm in arms.items():
        assert arm["round_trip"] <= 1e-5 and [s["steps"] for s in arm["stages"]] == [2, 1]
        vb = arm["tasks"]["sinkstudy_ifeval"]["vs_own_base"]
        assert vb["n"] == 3 and vb["delta"] == pytest.approx(vb["score"] - vb["reference"])
        assert arm["own_base"] == str(models / ("qwen3" if name == "native" else "qwen2"))
    assert (out / "evals" / "base").is_dir() and (out / "evals" / "native-base").is_dir()
    # Same adaptation: identical data order, seed, steps, tower and projector init in every arm.
    requests = {n: json.loads((out / "arms" / n / "request.json").read_text()) for n in arms}
    assert len({json.dumps([r["config"], r["vision"]], sort_keys=True) for r in requests.values()}) == 1
    # Identity gains change the function at init (S moves); scale-preserving gains barely do.
    inj, sp, ctl = arms["injected-identity-gain"], arms["injected-scale-preserving"], arms["control"]
    assert abs(sp["sink_strength_start"] - ctl["sink_strength_start"]) < abs(inj["sink_strength_start"] - ctl["sink_strength_start"])
    assert json.loads((out / "lms" / "injected-identity-gain" / "config.json").read_text())["model_type"] == "qwen3"
    table = (out / "report.md").read_text()
    for name in arms:
        assert f"\n{name} " in table
    assert "Δ = arm − reference in points" in table and (out / "trajectory.png").stat().st_size > 1000
    assert table.rstrip().endswith("3 prompts per comparison: too few prompts for any conclusion (fewer than 6)")  # --limit 3
    printed = capsys.readouterr().out
    assert f"wrote {out}\n── sinkstudy qknorm: sinkstudy_ifeval: Δ = arm − its own base, points: control " in printed  # then the summary
