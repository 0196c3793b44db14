"""A protection study end to end on a tiny base: the control and each arm through the same adaptation,
measured like any model, compared with the control (paired CIs), VL skill and S trajectory per arm,
the report's protection section with its Pareto and trajectory plots. An external plug-in file
(a protection and a mitigation) runs in it; editing the file reruns exactly the steps it shaped.
"""

import json
import textwrap

import pytest
import yaml

pytestmark = pytest.mark.slow

PLUGIN = textwrap.dedent('''
    """A test plug-in: a protection and a mitigation in one file. # version 1"""
    import torch

    from interventions.mitigations import register_mitigation
    from interventions.protect import Protection, register_protection, select_heads


    @register_protection("test_damp_sink_heads", defaults={"heads": {"by": "strength", "top_k": 1}, "factor": 0.5},
                         needs_sink_maps=True, edits_training=True)
    class DampSinkHeads(Protection):
        """Scale the sink heads' q_proj gradient rows by `factor`."""

        def setup(self, ctx):
            hd = ctx.language_model.config.hidden_size // ctx.language_model.config.num_attention_heads
            ctx.state["rows"] = [(ctx.language_model.layers[layer].self_attn.q_proj.weight, slice(head * hd, (head + 1) * hd))
                                 for layer, head in select_heads(ctx.sink_maps, self.config["heads"])]

        def after_backward(self, ctx):
            for weight, rows in ctx.state["rows"]:
                if weight.grad is not None:
                    weight.grad[rows] *= self.config["factor"]

        def teardown(self, ctx):
            return {"rows": len(ctx.state["rows"])}


    @register_mitigation("test_shrink_q", defaults={"factor": 0.9})
    def shrink_q(base, vlm_lm, sink_maps, config):
        """Shrink every q_proj of the VLM's LM."""
        for layer in vlm_lm.model.layers:
            layer.self_attn.q_proj.weight.mul_(config["factor"])
        return vlm_lm
''')

ARMS = ["control", "damp", "freeze"]
PLUGIN_STEPS = {"p/adapt/damp", "p/intervene/shrink"}  # what the plug-ins make (their steps' code is their source)
# ...and what measures it: reused when the remade models are the same bits (a comment edit), keyed by content
MEASURING_PLUGIN_STEPS = {"p/adapt/damp-extract", "p/sink/damp", "p/eval/damp", "p/vlskill/damp", "p/sink/shrink", "p/eval/shrink"}


@pytest.fixture(scope="module")
def study_files(tmp_path_factory, tokenizer):
    from sinkstudy.tiny import tiny_causal_lm

    root = tmp_path_factory.mktemp("protect_study")
    tiny_causal_lm("qwen2", vocab_size=len(tokenizer)).save_pretrained(root / "base")
    tokenizer.save_pretrained(root / "base")
    (root / "my_plugin.py").write_text(PLUGIN)
    cfg = {
        "name": "ptest", "seed": 0, "plugins": ["my_plugin.py"],
        "pairs": [{"name": "p", "base": str(root / "base"), "native_qk_norm": False}],
        "sink": {"metric": "logodds", "options": {"batch_size": 8}},
        "evals": {"tasks": ["sinkstudy_gsm"], "limit": 3, "max_gen_toks": 6, "batch_size": 3, "n_boot": 200},
        "interventions": [{"name": "shrink", "method": "test_shrink_q", "params": {}}],
        "adapt": {
            "recipe": {"seed": 0, "precision": "fp32", "max_length": 256, "trajectory": {"every": 2}, "stages": [
                {"name": "stage1", "trainable": ["projector"], "steps": 2, "batch_size": 4, "micro_batch_size": 4, "lr": 1e-3},
                {"name": "stage2", "trainable": ["projector", "lm"], "steps": 3, "batch_size": 4, "micro_batch_size": 4,
                 "lr": 1e-3}]},
            "vision": {"kind": "tiny", "tiny": {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "patch_size": 4}},
            "data": ["digits"],
            "vl_eval": {"heldout": 10},
            "arms": [{"name": "damp", "protection": "test_damp_sink_heads"},
                     {"name": "freeze", "protection": "sink_head_freeze", "params": {"heads": {"by": "strength", "top_k": 1}}}],
        },
    }
    (root / "study.yaml").write_text(yaml.safe_dump(cfg))
    return root


def _run(root, out):
    from experiments.study.runner import run_study
    from experiments.study.config import load_study

    log = run_study(load_study(root / "study.yaml", out=out), progress=False)["log"]
    return {e["step"]: e["reused"] for e in log}


def test_protection_study_runs_compares_arms_and_reruns_exactly_what_a_plugin_edit_touches(study_files, tmp_path, own_cache):
    out = tmp_path / "out"
    first = _run(study_files, out)
    assert not any(first.values())
    assert {f"p/adapt/{a}" for a in ARMS} | {"p/vlskill/control", "p/adapt/freeze-extract", "p/eval/freeze"} <= set(first)
    summary = json.loads((out / "summary.json").read_text())
    prot = summary["pairs"]["p"]["protection"]
    assert set(prot["arms"]) == set(ARMS)
    for arm in ARMS:
        a = prot["arms"][arm]
        assert 0 <= a["vl_skill"]["digit_accuracy"] <= 1 and a["vl_skill"]["n_images"] == 10
        assert [p["step"] for p in a["adapt"]["trajectory"]] == [0, 2, 4, 5] and isinstance(a["sink_strength"], float)
        if arm != "control":
            c = a["vs_control"]["sinkstudy_gsm"]
            assert c["n"] == 3 and c["delta_points"] == pytest.approx(100 * (c["after"] - c["before"]))
    assert prot["arms"]["damp"]["adapt"]["stages"][1]["hooks"]["test_damp_sink_heads"] == {"rows": 1}
    assert prot["arms"]["damp"]["adapt"]["protections"][0]["source"].startswith("plugin-sha256:")
    # The control's VLM is the pair's VLM: its degradation is base -> control.
    assert summary["pairs"]["p"]["models"]["vlm"]["path"].endswith("p-vlm-lm")
    report = (out / "report.md").read_text()
    assert "## Training-time protections" in report and "Δ pts vs control" in report
    assert (out / "plots" / "protect_pareto_sinkstudy_gsm.png").stat().st_size > 1000
    assert (out / "plots" / "protect_trajectory_p.png").stat().st_size > 1000

    assert all(_run(study_files, out).values())  # everything reused

    plugin = study_files / "my_plugin.py"
    plugin.write_text(plugin.read_text().replace("# version 1", "# version 2"))  # the source changes, nothing else
    third = _run(study_files, out)
    rerun = {s for s, reused in third.items() if reused is False}
    assert rerun == PLUGIN_STEPS, sorted(rerun ^ PLUGIN_STEPS)
    assert all(third[s] for s in MEASURING_PLUGIN_STEPS)


def test_adapt_section_errors_are_one_line(study_files, tmp_path):
    from experiments.study.config import StudyConfigError, validate

    base = yaml.safe_load((study_files / "study.yaml").read_text())
    base["plugins"] = [str(study_files / "my_plugin.py")]
    for patch, needle in [
        ({"arms": [{"name": "x"}]}, "differs from the control by nothing"),
        ({"arms": [{"name": "x", "qknorm": {"init": "nope"}}]}, "qknorm init must be one of"),
        ({"arms": [{"name": "x", "qknorm": {"gain": 1}}]}, "unknown key"),
        ({"arms": [{"name": "x", "seed": -1}]}, "seed"),
        ({"arms": [{"name": "control", "qknorm": {}}]}, "control arm takes no protection, qknorm or text_only"),
        ({"arms": [{"name": "x", "text_only": "missing.jsonl"}]}, "text_only: data file not found"),
        ({"arms": [{"name": "x", "text_only": "digits", "seed": 1, "qknorm": {}}]}, "give it no protection or qknorm"),
        ({"arms": [{"name": "x", "protection": "nope"}]}, "unknown protection"),
        ({"arms": [{"name": "x", "protection": "sink_head_freeze", "params": {"k": 1}}]}, "no parameter"),
        ({"arms": [{"name": "control", "protection": "sink_head_freeze"}]}, "control arm takes no protection"),
        ({"arms": [{"name": "x", "protection": "text_replay", "params": {"data": "digits", "stages": ["s9"]}}]}, "s9"),
        ({"arms": [{"name": "x", "protection": "sink_head_freeze", "pairs": ["q"]}]}, "pair names"),
        ({"vl_eval": {"heldout": 500}}, "held-out digits"),
        ({"recipe": "missing.yaml"}, "not found"),
        ({"vision": {"kind": "fresh"}}, "needs a source"),
        ({"data": {"stage7": ["digits"]}}, "unknown key"),
    ]:
        cfg = {**base, "adapt": {**base["adapt"], **patch}}
        with pytest.raises(StudyConfigError, match=needle) as err:
            validate(cfg, path=study_files / "study.yaml", out=tmp_path)
        assert "\n" not in str(err.value)
    with pytest.raises(StudyConfigError, match="remove vlm"):
        validate({**base, "pairs": [{**base["pairs"][0], "vlm": "x"}]}, path=study_files / "study.yaml", out=tmp_path)
    with pytest.raises(StudyConfigError, match="plug-in file not found"):
        validate({**base, "plugins": ["nope.py"]}, path=study_files / "study.yaml", out=tmp_path)


def test_the_plan_lists_the_arms_steps_with_their_dependencies(study_files, tmp_path):
    from experiments.study.runner import plan_records
    from experiments.study.config import load_study

    steps = {s["id"]: s for s in plan_records(load_study(study_files / "study.yaml", out=tmp_path / "out"))}
    assert {f"p/adapt/{a}" for a in ARMS} | {"p/adapt/damp-extract", "p/vlskill/freeze", "p/eval/damp"} <= set(steps)
    assert all(steps[f"p/adapt/{a}"]["level"] == 1 for a in ARMS)
    assert steps["p/extract"]["after"] == ["p/adapt/control"]  # the control's VLM is the pair's VLM
    assert steps["p/sink/base"]["after"] == []  # the base is measured without waiting for any adaptation
    assert steps["p/vlskill/damp"]["after"] == ["p/adapt/damp"] and steps["p/eval/damp"]["after"] == ["p/adapt/damp-extract"]
    assert not (tmp_path / "out").exists()


def test_the_qk_norm_switch_arm_is_measured_as_its_own_class(study_files, tmp_path, tokenizer):
    """disable_qk_norm hands the engine the base's Llama twin: the arm's language model is extracted as a
    Llama (not refused against the Qwen3 base) and measured like any arm."""
    from sinkstudy.tiny import tiny_causal_lm

    tiny_causal_lm("qwen3", vocab_size=len(tokenizer)).save_pretrained(tmp_path / "q3")
    tokenizer.save_pretrained(tmp_path / "q3")
    cfg = yaml.safe_load((study_files / "study.yaml").read_text())
    cfg.update(plugins=[], interventions=[], pairs=[{"name": "q", "base": str(tmp_path / "q3"), "native_qk_norm": True}])
    cfg["adapt"]["arms"] = [{"name": "qknorm-off", "protection": "disable_qk_norm"}]
    (tmp_path / "study.yaml").write_text(yaml.safe_dump(cfg))
    _run(tmp_path, tmp_path / "out")
    arm = json.loads((tmp_path / "out" / "summary.json").read_text())["pairs"]["q"]["protection"]["arms"]["qknorm-off"]
    assert isinstance(arm["sink_strength"], float) and "sinkstudy_gsm" in arm["vs_control"]
    lm = next((tmp_path / "out").rglob("q-qknorm-off-vlm-lm/config.json"))
    assert json.loads(lm.read_text())["model_type"] == "llama"


def test_an_arm_its_base_cannot_run_is_refused_before_any_step(study_files, tmp_path, tokenizer):
    """disable_qk_norm on a base without native QK-norm fails at planning, in one line naming the arm,
    not after the other arms have trained."""
    from experiments.study.runner import plan_records
    from experiments.study.config import load_study
    from sinkstudy import SinkstudyError
    from sinkstudy.tiny import tiny_causal_lm

    tiny_causal_lm("qwen2", vocab_size=len(tokenizer)).save_pretrained(tmp_path / "q2")
    cfg = yaml.safe_load((study_files / "study.yaml").read_text())
    cfg.update(plugins=[], interventions=[], pairs=[{"name": "q", "base": str(tmp_path / "q2")}])
    cfg["adapt"]["arms"] = [{"name": "freeze", "protection": "sink_head_freeze", "params": {"heads": [[0, 1]]}},
                            {"name": "qknorm-off", "protection": "disable_qk_norm"}]
    (tmp_path / "study.yaml").write_text(yaml.safe_dump(cfg))
    with pytest.raises(SinkstudyError, match="pair q arm qknorm-off: disable_qk_norm needs a backbone") as err:
        plan_records(load_study(tmp_path / "study.yaml", out=tmp_path / "out"))
    assert "\n" not in str(err.value) and not (tmp_path / "out").exists()


def test_qk_norm_and_seed_arms_inject_before_the_recipe_and_train_another_draw(study_files, tmp_path):
    """An arm may differ from the control by QK-RMSNorm injected into the base before the same recipe (the
    paper's negative result 1 as an arm; its LM extracted with the injected norms) or by its training seed."""
    import torch
    from safetensors.torch import load_file

    from interventions import qknorm
    from interventions.pairs import load_causal_lm

    cfg = yaml.safe_load((study_files / "study.yaml").read_text())
    cfg.update(plugins=[], interventions=[])
    cfg["adapt"]["arms"] = [{"name": "qk", "qknorm": {"init": "identity-gain"}}, {"name": "s1", "seed": 1}]
    (tmp_path / "study.yaml").write_text(yaml.safe_dump(cfg))
    _run(tmp_path, tmp_path / "out")
    arms = json.loads((tmp_path / "out" / "summary.json").read_text())["pairs"]["p"]["protection"]["arms"]
    assert arms["qk"]["qknorm"] == {"init": "identity-gain"} and arms["s1"]["seed"] == 1
    assert all("sinkstudy_gsm" in arms[a]["vs_control"] for a in ("qk", "s1"))
    requests = {a: json.loads((tmp_path / "out" / "adapt" / "p" / a / "request.json").read_text()) for a in ("control", "qk", "s1")}
    assert requests["qk"]["qknorm"] == {"init": "identity-gain"} and requests["control"]["qknorm"] is None
    assert (requests["s1"]["config"]["seed"], requests["control"]["config"]["seed"]) == (1, 0)
    lm, _ = load_causal_lm(next((tmp_path / "out").rglob("p-qk-vlm-lm/config.json")).parent)
    base, _ = load_causal_lm(cfg["pairs"][0]["base"])
    assert qknorm.qk_norm_kind(base) == "none" and qknorm.qk_norm_kind(lm) != "none"  # the arm's LM carries the norms
    weights = {a: load_file(next((tmp_path / "out").rglob(f"p-{a}-vlm/model.safetensors"))) for a in ("s1",)}
    control = load_file(next((tmp_path / "out").rglob("p-control-vlm/model.safetensors")))
    assert any(not torch.equal(control[k], v) for k, v in weights["s1"].items() if k in control)  # another draw


def test_a_text_only_arm_trains_the_recipes_lm_stages_on_text_and_is_measured_without_extraction(study_files, tmp_path, tokenizer):
    """The trajectory claim's contrast: the recipe's LM-training stages (same steps, lr, batch) on text chats
    alone, no vision side, no VL probe; its causal LM measured and compared with the control like any arm."""
    cfg = yaml.safe_load((study_files / "study.yaml").read_text())
    cfg.update(plugins=[], interventions=[])
    chats = tmp_path / "chats.jsonl"
    chats.write_text("\n".join(json.dumps({"user": f"Say {i}.", "assistant": f"{i}."}) for i in range(40)))
    cfg["adapt"]["arms"] = [{"name": "text", "text_only": {"json": str(chats)}}]
    (tmp_path / "study.yaml").write_text(yaml.safe_dump(cfg))
    steps = _run(tmp_path, tmp_path / "out")
    assert "p/adapt/text" in steps and "p/vlskill/text" not in steps and "p/adapt/text-extract" not in steps
    arm = json.loads((tmp_path / "out" / "summary.json").read_text())["pairs"]["p"]["protection"]["arms"]["text"]
    assert arm["vl_skill"] is None and "sinkstudy_gsm" in arm["vs_control"] and arm["text_only"] == {"json": str(chats)}
    request = json.loads((tmp_path / "out" / "adapt" / "p" / "text" / "request.json").read_text())
    control = json.loads((tmp_path / "out" / "adapt" / "p" / "control" / "request.json").read_text())
    assert request["vision"] is None and [s["name"] for s in request["config"]["stages"]] == ["stage2"]
    stage, vl = request["config"]["stages"][0], control["config"]["stages"][1]
    assert stage["trainable"] == ["lm"] and stage["data"][0]["json"] == str(chats)
    assert {k: stage[k] for k in ("steps", "lr", "batch_size", "schedule")} == {k: vl[k] for k in ("steps", "lr", "batch_size", "schedule")}
    assert [p["stage"] for p in arm["adapt"]["trajectory"]][-1] == "stage2"


def test_a_study_repeated_over_training_seeds_keeps_the_data_and_reports_the_spread(study_files, tmp_path):
    """`seeds: [0, 1]`: the first seed's run in the study's out, seed 1's in out/seeds/1 with every training seed 1;
    the base is graded on the same prompts with the same scores; the VLMs differ; a rerun reuses every step."""
    import torch
    from safetensors.torch import load_file

    from experiments.study.runner import run_study
    from experiments.study.seeds import run_seeds
    from experiments.study.config import load_study

    cfg = yaml.safe_load((study_files / "study.yaml").read_text())
    cfg.update(plugins=[], interventions=[], seeds=[0, 1])
    cfg["adapt"]["arms"] = [{"name": "control"}]
    (tmp_path / "study.yaml").write_text(yaml.safe_dump(cfg))
    out = tmp_path / "out"
    run_seeds(load_study(tmp_path / "study.yaml", out=out), lambda s: run_study(s, progress=False))
    summary = json.loads((out / "summary.json").read_text())
    second = summary["seeds"]["runs"]["1"]["summary"]
    assert summary["seeds"]["seeds"] == [0, 1] and json.loads((out / "seeds" / "1" / "summary.json").read_text())["pairs"]
    seeds = [json.loads((d / "adapt" / "p" / "control" / "request.json").read_text())["config"]["seed"] for d in (out, out / "seeds" / "1")]
    assert seeds == [0, 1]
    assert second["pairs"]["p"]["models"]["base"]["scores"] == summary["pairs"]["p"]["models"]["base"]["scores"]
    a, b = (load_file(str(next(d.rglob("p-control-vlm/model.safetensors")))) for d in (out, out / "seeds" / "1"))
    assert any(not torch.equal(a[k], b[k]) for k in a)
    assert "## Across training seeds" in (out / "report.md").read_text()
    again = run_seeds(load_study(tmp_path / "study.yaml", out=out), lambda s: run_study(s, progress=False))
    assert again["reused"] == again["steps"]
