"""The sink dose on tiny models with a planted sink: S moved to the asked level, only the dosed query weights changed."""

import json
import math

import pytest
import torch

TEXTS = ["Write a short note to a neighbour asking to borrow a ladder.",
         "Describe a sunrise over the sea in two sentences, in all lowercase letters."]


def planted_sink(family: str, tokenizer, strength: float = 3.0):
    """A tiny random model whose heads park attention on the BOS token: only BOS has embedding dimension 0 (large);
    every key reads it along a direction u per KV head, every query carries u (Qwen2: through q_proj's bias; Gemma-3:
    through a dimension every token has, since it has no bias). Random init alone gives near-uniform attention."""
    from sinkstudy.tiny import tiny_causal_lm

    model = tiny_causal_lm(family, vocab_size=len(tokenizer), seed=0)
    g = torch.Generator().manual_seed(1)
    cfg = model.config
    hd = cfg.hidden_size // cfg.num_attention_heads if getattr(cfg, "head_dim", None) is None else cfg.head_dim
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    with torch.no_grad():
        emb = model.get_input_embeddings().weight
        emb[:, :2] = 0.0
        emb[tokenizer.bos_token_id, 0] = 10.0
        emb[:, 1] = 1.0  # a constant every token carries (queries read it where there is no bias)
        for layer in model.model.layers:
            attn = layer.self_attn
            for kv in range(cfg.num_key_value_heads):
                u = torch.randn(hd, generator=g)
                u /= u.norm()
                attn.k_proj.weight[kv * hd:(kv + 1) * hd, 0] = u
                for h in range(kv * group, (kv + 1) * group):
                    rows = slice(h * hd, (h + 1) * hd)
                    if attn.q_proj.bias is not None:
                        attn.q_proj.bias[rows] = strength * u
                    else:
                        attn.q_proj.weight[rows, 1] = strength * u
    return model


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory, tokenizer):
    d = tmp_path_factory.mktemp("dose") / "qwen2"
    planted_sink("qwen2", tokenizer).save_pretrained(d)
    tokenizer.save_pretrained(d)
    return d


def _strength(path, tokenizer) -> float:
    from interventions.pairs import load_causal_lm
    from interventions.sink_dose import measure

    model, _ = load_causal_lm(path, dtype=torch.float32)
    return measure(model, tokenizer, TEXTS)[0]


@pytest.mark.parametrize("shift", [+1.0, -1.5])
def test_a_target_dose_moves_s_to_the_level_and_changes_only_the_dosed_query_rows(qwen2, tokenizer, tmp_path, shift):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from interventions import sink_dose

    s0 = _strength(qwen2, tokenizer)
    assert s0 > 0  # the planted sink: most queries put most attention on BOS
    target = s0 + shift
    out = sink_dose.run(tmp_path / "dosed", qwen2, qwen2, {"target": target, "tolerance": 0.02, "texts": TEXTS})
    report = json.loads((out / "intervention.json").read_text())["report"]
    assert abs(report["sink_strength"] - target) <= 0.02 and (report["scale"] > 1) == (shift > 0)
    assert abs(_strength(out, tokenizer) - target) <= 0.02  # the saved checkpoint, measured afresh

    again = AutoModelForCausalLM.from_pretrained(out)
    assert type(again).__name__ == "Qwen2ForCausalLM"
    before, after = load_file(qwen2 / "model.safetensors"), load_file(out / "model.safetensors")
    assert before.keys() == after.keys()
    c = report["scale"]
    for name, t in before.items():
        if name.endswith(("q_proj.weight", "q_proj.bias")):  # every head of both layers (the last 10 hold them all)
            assert torch.allclose(after[name], t * c, rtol=1e-6, atol=0) and not torch.equal(after[name], t)
        else:
            assert torch.equal(after[name], t), name  # bit-identical


def test_a_shift_on_a_bfloat16_checkpoint_keeps_its_dtype_and_reaches_the_level_as_saved(qwen2, tokenizer, tmp_path):
    """shift: the level relative to the model's own S; the edited rows are rounded to the stored dtype before S is
    measured, so the saved checkpoint, read afresh, has the reported S; every other tensor keeps its bits."""
    from safetensors.torch import load_file

    from interventions import sink_dose
    from interventions.pairs import load_causal_lm

    half = tmp_path / "bf16"
    load_causal_lm(qwen2, dtype=torch.bfloat16)[0].save_pretrained(half)
    tokenizer.save_pretrained(half)
    s0 = _strength(half, tokenizer)
    out = sink_dose.run(tmp_path / "dosed", half, half, {"shift": 1.0, "tolerance": 0.02, "texts": TEXTS})
    report = json.loads((out / "intervention.json").read_text())["report"]
    assert abs(report["sink_strength_before"] - s0) < 1e-9 and abs(report["target"] - (s0 + 1.0)) < 1e-9
    assert abs(_strength(out, tokenizer) - report["sink_strength"]) < 1e-6 and abs(report["sink_strength"] - s0 - 1.0) <= 0.02
    before, after = load_file(half / "model.safetensors"), load_file(out / "model.safetensors")
    c = report["scale"]
    for name, t in before.items():
        assert after[name].dtype == torch.bfloat16, name
        if name.endswith(("q_proj.weight", "q_proj.bias")):
            assert torch.equal(after[name], (t.float() * c).to(torch.bfloat16)), name
        else:
            assert torch.equal(after[name], t), name


def test_sink_heads_only_and_a_fixed_scale(qwen2, tokenizer, tmp_path):
    """heads=sink scales only heads whose median log-odds is above 0; here, with one head's sink removed, the others."""
    from safetensors.torch import load_file

    from interventions import sink_dose

    src = load_file(qwen2 / "model.safetensors")
    weak = tmp_path / "weak"
    weak.mkdir()
    for f in qwen2.iterdir():
        if f.name != "model.safetensors":
            (weak / f.name).write_bytes(f.read_bytes())
    src["model.layers.1.self_attn.q_proj.bias"][16:32] = 0.0  # head 1 of layer 1: no sink
    from safetensors.torch import save_file

    save_file(src, weak / "model.safetensors", metadata={"format": "pt"})
    out = sink_dose.run(tmp_path / "dosed", weak, weak, {"scale": 2.0, "heads": "sink", "texts": TEXTS})
    report = json.loads((out / "intervention.json").read_text())["report"]
    assert [1, 1] not in report["units"] and [1, 0] in report["units"] and report["scale"] == 2.0
    after = load_file(out / "model.safetensors")
    bias = "model.layers.1.self_attn.q_proj.bias"
    assert torch.equal(after[bias][16:32], src[bias][16:32]) and torch.equal(after[bias][:16], src[bias][:16] * 2)
    assert report["sink_strength"] > report["sink_strength_before"]


def test_a_qk_norm_layer_is_dosed_through_its_q_norm_gain(tokenizer, tmp_path):
    """Gemma-3 applies (1 + w): w becomes c (1 + w) - 1, for the whole layer; nothing else changes; heads=sink is
    refused (the gain is shared by the layer's heads)."""
    from safetensors.torch import load_file

    from interventions import sink_dose
    from sinkstudy import SinkstudyError

    src = tmp_path / "gemma"
    model = planted_sink("gemma3_text", tokenizer)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_norm.weight.uniform_(-0.2, 0.2)  # not the zero init: (1 + w) has to be read right
    model.save_pretrained(src)
    tokenizer.save_pretrained(src)
    out = sink_dose.run(tmp_path / "dosed", src, src, {"scale": 1.5, "texts": TEXTS})
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Gemma3ForCausalLM"]
    before, after = load_file(src / "model.safetensors"), load_file(out / "model.safetensors")
    for name, t in before.items():
        if name.endswith("q_norm.weight"):
            assert torch.allclose(1 + after[name], (1 + t) * 1.5, rtol=0, atol=1e-6)
        else:
            assert torch.equal(after[name], t), name
    with pytest.raises(SinkstudyError, match=r"^sink_dose heads=sink needs per-head query projections"):
        sink_dose.run(tmp_path / "refused", src, src, {"scale": 1.5, "heads": "sink", "texts": TEXTS})
    assert not (tmp_path / "refused").exists()


@pytest.mark.parametrize("params, message", [
    ({}, "takes one of target"),
    ({"target": 1.0, "scale": 2.0}, "takes one of target"),
    ({"shift": 1.0, "target": 2.0}, "takes one of target"),
    ({"shift": math.inf}, "shift must be a finite number"),
    ({"target": math.nan}, "target must be a finite number"),
    ({"scale": 0.0}, r"scale must be in \[0.015625, 64.0\]"),
    ({"target": 1.0, "heads": "some"}, "heads must be one of all, sink"),
    ({"target": 1.0, "layers": 0}, r"layers must be in \[1, inf\]"),
    ({"target": 1.0, "layer": 3}, "has no parameter"),
    ({"target": 1.0, "texts": "no_such_set"}, "unknown calibration set"),
])
def test_bad_settings_fail_in_one_line_before_any_model_is_read(params, message, tmp_path):
    from interventions import sink_dose
    from sinkstudy import SinkstudyError

    with pytest.raises(SinkstudyError, match=message) as err:
        sink_dose.run(tmp_path / "out", tmp_path / "no-such-model", tmp_path / "no-such-model", params)
    assert "\n" not in str(err.value) and not (tmp_path / "out").exists()


def test_the_solver_brackets_then_interpolates_and_says_when_a_level_is_out_of_reach():
    from interventions.sink_dose import DoseError, solve_scale

    calls = []
    strength = lambda c: calls.append(c) or 2.0 * math.log2(c)  # noqa: E731  (S rises by 2 per doubling)
    c, s, trace = solve_scale(strength, 3.0, 0.0, 0.01)
    assert abs(s - 3.0) <= 0.01 and abs(c - 2 ** 1.5) < 0.01 and calls == [2.0, 4.0, c] and trace[0] == [1.0, 0.0]
    bent = lambda c: 4.0 * math.tanh(math.log2(c) / 3) ** 3 + 0.5  # noqa: E731  (flat near c = 1, steep further out)
    for target in (-2.0, 0.45, 3.0):
        c, s, trace = solve_scale(bent, target, bent(1.0), 0.001)
        assert abs(bent(c) - target) <= 0.001 and len(trace) < 16
    with pytest.raises(DoseError, match=r"Sink Strength \+30.000 is out of reach of these heads \(S spans \+0.000 to \+12.000"):
        solve_scale(strength, 30.0, 0.0, 0.01)


def test_the_dose_command_plans_one_step_reuses_it_and_refuses_another_request_into_its_out(qwen2, tokenizer, tmp_path, capsys):
    from experiments.cli import main

    texts = tmp_path / "texts.txt"
    texts.write_text("\n".join(TEXTS), encoding="utf-8")
    out = tmp_path / "dose"
    argv = ["dose", str(qwen2), "--shift", "-1", "--calibration", str(texts), "--out", str(out), "--quiet"]
    assert main(argv) == 0
    report = json.loads((out / "model" / "intervention.json").read_text())["report"]
    assert abs(_strength(out / "model", tokenizer) - (report["sink_strength_before"] - 1.0)) <= 0.02
    assert main(argv) == 0 and "reused dose/run" in capsys.readouterr().out
    assert main(["dose", str(qwen2), "--shift", "-2", "--calibration", str(texts), "--out", str(out), "--quiet"]) == 2
    assert "made by another request" in capsys.readouterr().err
    assert main(["dose", str(qwen2), "--scale", "100", "--out", str(tmp_path / "bad")]) == 2
    assert "sink_dose scale must be in" in capsys.readouterr().err and not (tmp_path / "bad").exists()


def test_dose_takes_device_and_dtype_as_every_model_loading_command_does(tmp_path, tokenizer, capsys):
    """`dose` measures S on --device in --dtype while it searches (each keyed: another device, other numbers); the dosed
    model keeps the checkpoint's own dtype."""
    import json

    from experiments.cli import main
    from interventions.registry import validate_intervention
    from sinkstudy import SinkstudyError
    from sinkstudy.tiny import tiny_causal_lm

    assert validate_intervention("sink_dose", {"scale": 1.5})["device"] == "cpu"
    with pytest.raises(SinkstudyError, match="dtype must be one of"):
        validate_intervention("sink_dose", {"scale": 1.5, "dtype": "int8"})
    model = tmp_path / "m"
    tiny_causal_lm("qwen2").save_pretrained(model)
    tokenizer.save_pretrained(model)
    out = tmp_path / "d"
    assert main(["dose", str(model), "--scale", "1.5", "--device", "cpu", "--dtype", "bfloat16", "--out", str(out), "--quiet"]) == 0
    made = json.loads((out / "model" / "intervention.json").read_text())
    assert made["settings"]["dtype"] == "bfloat16" and made["settings"]["device"] == "cpu"
    assert json.loads((out / "model" / "config.json").read_text())["dtype"] == "float32"  # stored as the checkpoint was
