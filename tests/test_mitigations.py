"""Mitigation registry and head-selective restore on tiny models."""

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.test_merge import _perturbed, _save_model

HD = 16  # tiny models: hidden 64, 4 query heads, 2 KV heads


@pytest.fixture(scope="module")
def pair(tmp_path_factory, tokenizer):
    from sinkstudy.tiny import tiny_causal_lm

    d = tmp_path_factory.mktemp("mitigation_pair")
    base = tiny_causal_lm("qwen2", seed=0)
    return {"base": _save_model(base, tokenizer, d / "base"), "vlm": _save_model(_perturbed(base, 5), tokenizer, d / "vlm")}


def _models(family="qwen2"):
    from sinkstudy.tiny import tiny_causal_lm

    base = tiny_causal_lm(family, seed=0)
    return base, _perturbed(base, 7)


def test_select_heads_ranks_largest_losses():
    from interventions.mitigations.head_restore import select_heads

    delta = torch.tensor([[0.1, -0.5, -0.2, 0.0], [-0.5, -0.05, 0.3, -0.9]])
    assert select_heads(delta, 2) == [(1, 3), (0, 1)]
    assert select_heads(delta, 3) == [(1, 3), (0, 1), (1, 0)]  # tie at -0.5: earlier layer first
    assert select_heads(delta, 10) == [(1, 3), (0, 1), (1, 0), (0, 2), (1, 1)]  # only losses
    assert select_heads(delta, 10, min_loss=0.3) == [(1, 3), (0, 1), (1, 0)]


def _rows(t, i):
    return t[i * HD:(i + 1) * HD]


def test_restore_changes_exactly_the_selected_heads_rows():
    from interventions.mitigations.head_restore import restore_heads

    base, vlm = _models()
    before = {k: v.clone() for k, v in vlm.state_dict().items()}
    with torch.no_grad():
        report = restore_heads(base, vlm, [(0, 1), (1, 3)], scope="qk", kv="group")
    sb, sv = base.state_dict(), vlm.state_dict()
    assert report["kv_heads_restored"] == [[0, 0], [1, 1]]  # head 1 -> KV group 0, head 3 -> group 1
    selected = {("0", "q_proj"): {1}, ("0", "k_proj"): {0}, ("1", "q_proj"): {3}, ("1", "k_proj"): {1}}
    for name, value in sv.items():
        parts = name.split(".")
        key = (parts[2], parts[4]) if ".self_attn." in name else None
        heads = selected.get(key, set())
        n = value.shape[0] // HD if heads else 0
        for i in range(n):
            expected = _rows(sb[name], i) if i in heads else _rows(before[name], i)
            assert torch.equal(_rows(value, i), expected), (name, i)
        if not heads:
            assert torch.equal(value, before[name]), name


def test_restore_scope_attn_and_kv_none():
    from interventions.mitigations.head_restore import restore_heads

    base, vlm = _models()
    before = {k: v.clone() for k, v in vlm.state_dict().items()}
    with torch.no_grad():
        restore_heads(base, vlm, [(1, 2)], scope="attn", kv="group")
    sb, sv = base.state_dict(), vlm.state_dict()
    p = "model.layers.1.self_attn."
    assert torch.equal(_rows(sv[p + "v_proj.weight"], 1), _rows(sb[p + "v_proj.weight"], 1))
    assert torch.equal(_rows(sv[p + "v_proj.weight"], 0), _rows(before[p + "v_proj.weight"], 0))
    o = sv[p + "o_proj.weight"]
    assert torch.equal(o[:, 2 * HD:3 * HD], sb[p + "o_proj.weight"][:, 2 * HD:3 * HD])
    assert torch.equal(o[:, :2 * HD], before[p + "o_proj.weight"][:, :2 * HD])

    base, vlm = _models()
    k_before = vlm.state_dict()["model.layers.0.self_attn.k_proj.weight"].clone()
    with torch.no_grad():
        report = restore_heads(base, vlm, [(0, 0)], kv="none")
    assert torch.equal(vlm.state_dict()["model.layers.0.self_attn.k_proj.weight"], k_before)
    assert report["kv_heads_restored"] == []


def test_restore_full_width_qk_norm_slices_olmo2():
    from interventions.mitigations.head_restore import restore_heads

    base, vlm = _models("olmo2")
    with torch.no_grad():
        for m in (base, vlm):  # norms start at ones: make them differ
            for n, p in m.named_parameters():
                if "norm" in n:
                    p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(n) + id(m) % 7)))
        q_before = vlm.model.layers[0].self_attn.q_norm.weight.clone()
        restore_heads(base, vlm, [(0, 2)])
    q = vlm.model.layers[0].self_attn.q_norm.weight
    assert torch.equal(_rows(q, 2), _rows(base.model.layers[0].self_attn.q_norm.weight, 2))
    assert torch.equal(_rows(q, 0), _rows(q_before, 0))


def test_registry_plugin_round_trip(pair, tmp_path):
    from interventions.mitigations import (MitigationError, _REGISTRY, get_mitigation, list_mitigations,
                                           register_mitigation, run_mitigation)
    from interventions.merge import RESULT_JSON

    @register_mitigation("test_scale_lm_head", defaults={"factor": 2.0})
    def scale(base, vlm_lm, sink_maps, config):
        """Scale the output head (a test plug-in)."""
        vlm_lm.lm_head.weight.mul_(config["factor"])
        return vlm_lm, {"scaled": True}

    try:
        assert "head_restore" in list_mitigations() and get_mitigation("test_scale_lm_head").description.startswith("Scale")
        out = run_mitigation("test_scale_lm_head", pair["base"], pair["vlm"], tmp_path / "o", params={"factor": 3.0}, progress=False)
        v, o = load_file(str(pair["vlm"] / "model.safetensors")), load_file(str(out / "model.safetensors"))
        torch.testing.assert_close(o["lm_head.weight"], 3.0 * v["lm_head.weight"])
        result = json.loads((out / RESULT_JSON).read_text())
        assert result["settings"] == {"factor": 3.0} and result["report"] == {"scaled": True}
        with pytest.raises(MitigationError, match="no parameter"):
            run_mitigation("test_scale_lm_head", pair["base"], pair["vlm"], tmp_path / "p", params={"factr": 3})
        with pytest.raises(MitigationError, match="registered: .*head_restore"):
            run_mitigation("nope", pair["base"], pair["vlm"], tmp_path / "p")
        assert not (tmp_path / "p").exists()
    finally:
        _REGISTRY.pop("test_scale_lm_head", None)


def test_head_restore_end_to_end_with_sink_maps(pair, tmp_path):
    from interventions.mitigations import run_mitigation

    out = run_mitigation("head_restore", pair["base"], pair["vlm"], tmp_path / "hr", params={"top_k": 2},
                         texts=["The quick brown fox jumps over the lazy dog.", "Write your answer in upper case letters only."],
                         progress=False)
    result = json.loads((out / "intervention.json").read_text())
    heads = [tuple(h) for h in result["report"]["heads"]]
    assert 1 <= len(heads) <= 2 and all(d < 0 for d in result["report"]["sink_mass_delta"])
    assert (out / "sink_maps_base.json").is_file() and (out / "sink_maps_vlm.json").is_file()
    b, v, o = (load_file(str(p / "model.safetensors")) for p in (pair["base"], pair["vlm"], out))
    for name in o:
        if ".self_attn.q_proj." in name:
            layer = int(name.split(".")[2])
            for h in range(4):
                src = b if (layer, h) in heads else v
                assert torch.equal(_rows(o[name], h), _rows(src[name], h)), (name, h)
        elif ".self_attn.k_proj." not in name:
            assert torch.equal(o[name], v[name]), name


def test_cli_mitigate_top_k_and_params(pair, tmp_path):
    from experiments.cli import main

    out = tmp_path / "cli"
    texts = tmp_path / "texts.txt"
    texts.write_text("The quick brown fox jumps over the lazy dog.\nRespond in exactly three sentences.\n")
    assert main(["mitigate", "head_restore", "--base", str(pair["base"]), "--vlm", str(pair["vlm"]), "--out", str(out),
                 "--top-k", "1", "--param", "scope=attn", "--calibration", str(texts), "--no-eval"]) == 0
    result = json.loads((out / "model" / "intervention.json").read_text())
    assert result["settings"]["scope"] == "attn" and result["settings"]["top_k"] == 1
    assert len(result["report"]["heads"]) <= 1 and result["request"]["params"]["texts"] == str(texts)
    assert main(["mitigate", "head_restore", "--base", str(pair["base"]), "--vlm", str(pair["vlm"]), "--out", str(tmp_path / "x"),
                 "--param", "scope=everything", "--calibration", "ifeval15", "--no-eval"]) == 2
    assert not (tmp_path / "x").exists()
