"""Sink maps and Sink Strength: fast path vs eager baseline, the paper metric by hand, metrics, shift, CLI."""

import json
import math

import numpy as np
import pytest
import torch

from evals.sink import (
    SinkMaps, compute_sink_maps, get_metric, plot_sink_map, plot_sink_shift, sink_shift, sink_strength, strength_from_maps,
)
from evals.sink.capture import capture_layer_stats, check_supported_config
from sinkstudy import SinkstudyError
from sinkstudy.tiny import tiny_causal_lm, tiny_text_config

FAMILIES = {
    "llama": {},
    "mistral": {"sliding_window": 6},
    "qwen2": {},
    "qwen3": {},
    "gemma3_text": {"sliding_window": 5, "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]},
    "olmo2": {},
}
TEXTS = ["The cat sat on the mat and looked at the bird.", "def add(a, b):\n    return a + b\n",
         "Write your answer in upper case letters only, please."]


@pytest.fixture(autouse=True)
def _one_thread():
    # Tiny models on shared CPUs: extra threads only add contention.
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def _assert_close(a: torch.Tensor, b: torch.Tensor, atol=1e-5):
    a, b = a.double(), b.double()
    assert torch.equal(torch.isnan(a), torch.isnan(b))
    assert torch.allclose(torch.nan_to_num(a), torch.nan_to_num(b), atol=atol, rtol=0), (a - b).abs().nan_to_num().max()


@pytest.mark.parametrize("family", [*FAMILIES, "gemma2_softcap"])
def test_fast_matches_eager_with_left_padding(family):
    if family == "gemma2_softcap":
        from transformers import AutoConfig, AutoModelForCausalLM

        torch.manual_seed(0)
        cfg = AutoConfig.for_model("gemma2", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, attn_logit_softcapping=2.0,
                                   sliding_window=5, query_pre_attn_scalar=16)
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    else:
        model = tiny_causal_lm(family, num_hidden_layers=3, **FAMILIES[family])
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(8, 500, (3, 19), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    mask[2, :2] = 0
    # Small chunks so several query chunks (and window offsets) are exercised.
    fast = capture_layer_stats(model, input_ids=ids, attention_mask=mask, method="fast", chunk_elems=300)
    eager = capture_layer_stats(model, input_ids=ids, attention_mask=mask, method="eager")
    assert model.config._attn_implementation == "eager"  # restored after the fast pass
    offsets = (mask == 0).sum(-1, keepdim=True)
    counted = mask.bool() & (torch.arange(19)[None] - offsets >= 1)  # default skip_queries=1
    for lf, le in zip(fast, eager):
        assert torch.equal(~torch.isnan(lf["p_sink"]), counted[:, None, :].expand_as(lf["p_sink"]))
        for key in ("p_sink", "logodds_head", "logodds_query", "colsum"):
            _assert_close(lf[key], le[key])
        assert torch.equal(lf["head_argmax"], le["head_argmax"])
    if family == "gemma3_text":  # layer 0 slides: queries 5+ tokens after the sink cannot see it
        p = fast[0]["p_sink"][0, :, 5:]
        assert torch.all(p == 0)
        assert torch.all(fast[1]["p_sink"][0, :, 5:] > 0)


def test_batched_fast_equals_unbatched_eager(tokenizer):
    model = tiny_causal_lm("qwen3", num_hidden_layers=3)
    kw = dict(metric="mass", progress=False, max_length=40)
    fast = compute_sink_maps(model, tokenizer, TEXTS, batch_size=3, **kw)
    eager = compute_sink_maps(model, tokenizer, TEXTS, batch_size=1, method="eager", **kw)
    for name in ("mass", "mass_per_text", "argmax_mass", "logodds", "logodds_query"):
        _assert_close(getattr(fast, name), getattr(eager, name))
    assert torch.equal(fast.argmax_key, eager.argmax_key)
    assert fast.settings["skip_queries"] == 4 and fast.settings["apply_chat_template"] is False


def test_paper_logodds_equals_hand_computation(tokenizer):
    model = tiny_causal_lm("qwen3", num_hidden_layers=3)
    result = sink_strength(model, tokenizer, texts=TEXTS, last_layers=2, progress=False)
    values = []
    for text in TEXTS:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
        ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            attn = model(ids, output_attentions=True).attentions
        for layer in (1, 2):  # the last two of three
            a = attn[layer][0].double().numpy()  # (H, T, T)
            for h in range(a.shape[0]):
                k = int(a[h, 1:].mean(0).argmax())  # head's argmax key over queries 1.. (query 0 excluded)
                p = a[h, max(1, k):, k]
                values.extend(np.log(p / (1 - p)))
    assert result.metric == "logodds" and result.details["n_values"] == len(values)
    assert result.value == pytest.approx(float(np.median(values)), abs=1e-5)
    assert result.maps.settings["apply_chat_template"] is True


def test_mass_and_ratio_on_uniform_attention(tokenizer):
    # q = 0 makes every logit 0: query q attends 1/(q+1) to each visible key, the sink included.
    model = tiny_causal_lm("llama", num_hidden_layers=3)
    for layer in model.model.layers:
        layer.self_attn.q_proj.weight.data.zero_()
    maps = compute_sink_maps(model, tokenizer, TEXTS, metric="mass", skip_queries=2, progress=False)
    expected = np.mean([1 / (q + 1) for n in maps.n_tokens for q in range(2, n)])
    assert torch.allclose(maps.mass, torch.full((3, 4), expected, dtype=torch.float64), atol=1e-6)
    assert strength_from_maps(maps, "mass").value == pytest.approx(expected, abs=1e-6)
    assert strength_from_maps(maps, f"ratio@{expected - 0.01:.4f}").value == 1.0
    assert strength_from_maps(maps, f"ratio@{expected + 0.01:.4f}").value == 0.0


def _maps(mass) -> SinkMaps:
    mass = torch.tensor(mass, dtype=torch.float64)
    L, H = mass.shape
    return SinkMaps(mass=mass, mass_per_text=mass[None], argmax_key=torch.zeros(1, L, H, dtype=torch.long), argmax_mass=mass,
                    logodds=None, logodds_query=None, query_text=torch.zeros(0, dtype=torch.long),
                    query_pos=torch.zeros(0, dtype=torch.long), text_ids=["t"], n_tokens=[10], texts_fingerprint="x",
                    settings={"sink_position": 0, "calibration": "custom"})


def test_metrics_on_constructed_maps():
    maps = _maps([[0.9, 0.9, 0.9], [0.1, 0.5, 0.2], [0.4, 0.0, 0.3]])
    assert strength_from_maps(maps, "mass").value == pytest.approx((0.8 + 0.7) / 6)  # layers 2..L
    ratio = strength_from_maps(maps, "ratio@0.3")
    assert ratio.value == pytest.approx(5 / 9) and ratio.details["sink_heads"] == 5  # 0.3 itself is not above
    assert strength_from_maps(maps, "ratio@0.05").value == pytest.approx(8 / 9)
    noise = _maps([[0.9, 0.9, 0.9], [0.05, 0.25, 0.1], [0.2, 0.0, 0.15]])
    assert strength_from_maps(maps, "robustness", noise).value == pytest.approx(0.5)
    with pytest.raises(SinkstudyError, match="per-query log-odds"):
        strength_from_maps(maps, "logodds")
    with pytest.raises(SinkstudyError, match="noise"):
        strength_from_maps(maps, "robustness")


def test_unknown_metric_and_bad_options(tokenizer):
    with pytest.raises(SinkstudyError, match="logodds, mass, ratio@0.3, robustness"):
        get_metric("sinkiness")
    with pytest.raises(SinkstudyError, match="unknown sink metric"):
        get_metric("ratio@1.5")
    model = tiny_causal_lm("llama")
    with pytest.raises(SinkstudyError, match="unknown option"):
        sink_strength(model, tokenizer, "mass", texts=TEXTS, eps=0.2)
    with pytest.raises(SinkstudyError, match="unknown calibration set"):
        compute_sink_maps(model, tokenizer, "no-such-set", progress=False)
    with pytest.raises(SinkstudyError, match="texts file not found"):
        compute_sink_maps(model, tokenizer, "/nonexistent/texts.json", progress=False)


def test_robustness_seeded(tokenizer):
    model = tiny_causal_lm("gemma3_text")  # scaled embeddings: noise must be matched after the scale
    kw = dict(texts=TEXTS, max_length=32, progress=False)
    a = sink_strength(model, tokenizer, "robustness", **kw)
    b = sink_strength(model, tokenizer, "robustness", **kw)
    c = sink_strength(model, tokenizer, "robustness", noise_seed=1, **kw)
    assert a.value == b.value and a.value != c.value and math.isfinite(a.value) and a.value > 0
    assert a.value == pytest.approx(a.details["noise_mass"] / a.details["text_mass"])
    assert a.noise_maps.settings["noise_seed"] == 0 and a.maps.settings["noise_seed"] is None
    assert not torch.allclose(a.maps.mass, a.noise_maps.mass)


def test_json_roundtrip_and_shift(tokenizer, tmp_path):
    base = compute_sink_maps(tiny_causal_lm("qwen2", seed=0), tokenizer, TEXTS, progress=False)
    other = compute_sink_maps(tiny_causal_lm("qwen2", seed=1), tokenizer, TEXTS, progress=False)
    path = tmp_path / "maps.json"
    path.write_text(json.dumps(base.to_json(), allow_nan=False))
    loaded = SinkMaps.from_json(path)
    _assert_close(loaded.mass, base.mass, atol=1e-6)
    _assert_close(loaded.logodds, base.logodds, atol=1e-6)
    assert strength_from_maps(loaded).value == pytest.approx(strength_from_maps(base).value, abs=1e-6)

    shift = sink_shift(base, other)
    assert torch.allclose(shift["delta"], other.mass - base.mass)
    x, y = base.mass.flatten().numpy(), other.mass.flatten().numpy()
    assert shift["pearson"]["r"] == pytest.approx(np.corrcoef(x, y)[0, 1])
    assert shift["same_texts"] is True
    plot_sink_shift(base, other, tmp_path / "shift.png")
    plot_sink_map(base, tmp_path / "map.png")
    assert (tmp_path / "shift.png").read_bytes()[:4] == b"\x89PNG" and (tmp_path / "map.png").stat().st_size > 0


def test_shift_lost_heads_on_constructed_maps():
    shift = sink_shift(_maps([[0.5, 0.1], [0.4, 0.6]]), _maps([[0.2, 0.1], [0.5, 0.3]]))
    assert shift["base_sink_heads"] == 3 and shift["lost_sink_heads"] == 2
    assert shift["lost_fraction"] == pytest.approx(2 / 3) and shift["lost_heads"] == [[0, 0], [1, 1]]
    with pytest.raises(SinkstudyError, match="differ in shape"):
        sink_shift(_maps([[0.5, 0.1]]), _maps([[0.5], [0.1]]))


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory, tokenizer):
    path = tmp_path_factory.mktemp("sinkcli") / "tiny-llama"
    tiny_causal_lm("llama").save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_cli_writes_json_png_and_refuses_overwrite(tiny_model_dir, tmp_path, capsys):
    from experiments.cli import main

    out = tmp_path / "out"
    texts = tmp_path / "texts.txt"
    texts.write_text("\n".join(t.replace("\n", " ") for t in TEXTS) + "\n")
    assert main(["sink", str(tiny_model_dir), "--calibration", str(texts), "--metric", "ratio@0.2", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "mass_mean" in printed and "Sink Strength [ratio@0.2]" in printed
    result = json.loads((out / "sink.json").read_text())
    assert result["metric"] == "ratio@0.2" and 0 <= result["value"] <= 1
    assert result["provenance"]["model_fingerprint"].startswith("ckpt-sha256:")
    assert result["maps"]["text_ids"] == ["texts-000", "texts-001", "texts-002"]
    assert (out / "sink_map.png").read_bytes()[:4] == b"\x89PNG"
    before = (out / "sink.json").read_bytes()

    # The same run again reuses what is there (as `sinkstudy eval` does); another run is refused in one line.
    assert main(["sink", str(tiny_model_dir), "--calibration", str(texts), "--metric", "ratio@0.2", "--out", str(out)]) == 0
    assert "reused sink/run (finished before" in capsys.readouterr().out and (out / "sink.json").read_bytes() == before
    assert main(["sink", str(tiny_model_dir), "--out", str(out)]) == 2
    assert "holds sink/run made by another request (metric, texts differ); pass --force" in capsys.readouterr().err
    assert (out / "sink.json").read_bytes() == before

    missing = tmp_path / "fresh"
    assert main(["sink", str(tiny_model_dir), "--calibration", str(tmp_path / "nope.json"), "--out", str(missing)]) == 2
    assert "file not found" in capsys.readouterr().err and not missing.exists()
    assert main(["sink", str(tiny_model_dir), "--metric", "bogus", "--out", str(missing)]) == 2
    assert "known: logodds, mass" in capsys.readouterr().err
    assert main(["sink", str(tiny_model_dir), "--metric", "mass", "--last-layers", "3", "--out", str(missing)]) == 2
    assert "does not apply" in capsys.readouterr().err


def test_cli_default_logodds_on_shipped_prompts(tiny_model_dir, tmp_path, capsys):
    from experiments.cli import main

    out = tmp_path / "paper"
    assert main(["sink", str(tiny_model_dir), "--out", str(out), "--sink-batch-size", "4"]) == 0
    result = json.loads((out / "sink.json").read_text())
    assert result["metric"] == "logodds" and result["maps"]["settings"]["calibration"] == "ifeval15"
    assert len(result["maps"]["text_ids"]) == 15 and result["details"]["params"]["last_layers"] == 10


def test_bench_cases_report_time_and_memory_and_the_table_both_ratios_per_length():
    from benchmarks.sink_pass import METHODS, format_table, run_case

    rows = {}
    for length in (24, 48):
        for method in METHODS:  # fast sink pass, HF eager output_attentions (the peer), plain SDPA (the floor)
            res = rows.setdefault(length, {})[method] = run_case(method, length, repeat=1)
            assert res["method"] == method and res["time_s"] > 0 and res["peak_mib"] >= 0
    lines = format_table(rows).splitlines()
    assert "eager/fast" in lines[0] and "fast/sdpa" in lines[0]
    for length, line in zip((24, 48), lines[2:4]):
        cells = line.split()
        assert cells[0] == str(length) and sum(c.endswith("x") for c in cells) == 4  # time and memory, both ratios
        r = rows[length]
        assert cells[5] == f"{r['eager']['time_s'] / r['fast']['time_s']:.1f}x"  # computed from this run's numbers
    with pytest.raises(ValueError, match="unknown configuration"):
        run_case("flash", 8, repeat=1)


def test_sharp_sinks_keep_logodds_precision():
    # Scaled q/k make attention nearly one-hot: log-odds near 10, where 1 - a ~ 1e-5 in float32.
    model = tiny_causal_lm("llama")
    for layer in model.model.layers:
        layer.self_attn.q_proj.weight.data *= 10
        layer.self_attn.k_proj.weight.data *= 10
    ids = torch.randint(8, 500, (1, 40), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    fast = capture_layer_stats(model, input_ids=ids, attention_mask=mask)
    eager = capture_layer_stats(model, input_ids=ids, attention_mask=mask, method="eager")
    assert max(float(ly["logodds_query"].nan_to_num().max()) for ly in eager) > 8
    for lf, le in zip(fast, eager):
        for key in ("logodds_head", "logodds_query"):
            _assert_close(lf[key] / (1 + le[key].abs()), le[key] / (1 + le[key].abs()))


def _sharpen(model, factor: float):
    for layer in model.model.layers:
        layer.self_attn.q_proj.weight.data *= factor
        layer.self_attn.k_proj.weight.data *= factor


def test_underflow_convention_is_the_same_on_both_paths(tokenizer):
    # x40 on W_q and W_k scales logits by 1600: some attention underflows to exactly 0 in float32.
    from evals.sink.capture import LOGODDS_CAP

    model = tiny_causal_lm("llama", num_hidden_layers=2)
    _sharpen(model, 40)
    ids = torch.randint(8, 500, (2, 40), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :6] = 0
    with torch.no_grad():
        probs = model(ids, attention_mask=mask, output_attentions=True).attentions
    causal = torch.ones(40, 40, dtype=torch.bool).tril()
    assert any(bool(((p[0] == 0) & causal).any()) for p in probs)  # underflow on visible keys really happens
    fast = capture_layer_stats(model, input_ids=ids, attention_mask=mask)
    eager = capture_layer_stats(model, input_ids=ids, attention_mask=mask, method="eager")
    clipped = 0
    for lf, le in zip(fast, eager):
        for key in ("logodds_head", "logodds_query"):
            # NaN only where the key is unseen, on both; logits near 1e3 carry float32 rounding of ~1e-4
            _assert_close(lf[key] / (1 + le[key].abs()), le[key] / (1 + le[key].abs()), atol=1e-4)
            clipped += int((le[key] == -LOGODDS_CAP).sum())
        assert torch.equal(lf["head_argmax"], le["head_argmax"])
    assert clipped > 0  # eager keeps an underflowed a as -CAP (never drops it)
    kw = dict(texts=TEXTS, max_length=40, progress=False)
    s_fast = strength_from_maps(compute_sink_maps(model, tokenizer, **kw), last_layers=2)
    s_eager = strength_from_maps(compute_sink_maps(model, tokenizer, method="eager", **kw), last_layers=2)
    assert s_fast.details["n_values"] == s_eager.details["n_values"]
    assert s_fast.value == pytest.approx(s_eager.value, abs=1e-3)


def _record_qk(model, ids, mask):
    """q and k exactly as each attention layer receives them (a recording AttentionInterface function)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    seen = []

    def record(module, query, key, value, attention_mask, **kw):
        seen.append((query.detach().clone(), key.detach().clone(), module.scaling))
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kw)

    AttentionInterface.register("test_record_qk", record)
    AttentionMaskInterface.register("test_record_qk", sdpa_mask)
    old = model.config._attn_implementation
    model.set_attn_implementation("test_record_qk")
    try:
        with torch.no_grad():
            model.base_model(input_ids=ids, attention_mask=mask)
    finally:
        model.set_attn_implementation(old)
    return seen


def test_bf16_fast_reads_float32_from_the_models_qk_and_eager_the_models_probabilities():
    # What `sinkstudy sink --dtype bfloat16` documents: fast = float32 statistics from the model's own
    # (bf16) q and k; eager = the bf16 attention probabilities transformers' eager attention returns.
    model = tiny_causal_lm("llama", num_hidden_layers=2)
    _sharpen(model, 12)
    model = model.to(torch.bfloat16)
    ids = torch.randint(8, 500, (1, 32), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    fast = capture_layer_stats(model, input_ids=ids, attention_mask=mask)
    eager = capture_layer_stats(model, input_ids=ids, attention_mask=mask, method="eager")
    for (q, k, scaling), lf, le in zip(_record_qk(model, ids, mask), fast, eager):
        assert q.dtype == torch.bfloat16
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        logits = (q.float() @ k.float().transpose(-1, -2) * scaling).double()
        logits.masked_fill_(~torch.ones(32, 32, dtype=torch.bool).tril(), float("-inf"))
        logp = logits.log_softmax(-1)
        top = logp.max(-1).values
        rest = torch.logsumexp(logp.scatter(-1, logp.argmax(-1, keepdim=True), float("-inf")), -1)
        want = (top - rest)[..., 1:]  # query 0 is not counted
        _assert_close(lf["logodds_query"][..., 1:], want, atol=1e-3)
        p_fast, p_eager = lf["p_sink"][..., 1:], le["p_sink"][..., 1:]
        assert torch.equal(p_eager, p_eager.bfloat16().double())  # eager: the model's bf16 probabilities
        assert not torch.equal(p_fast, p_fast.bfloat16().double())  # fast: float32, not rounded to bf16
    from experiments.cli import build_parser

    sink_cmd = build_parser()._subparsers._group_actions[0].choices["sink"]
    dtype_help = next(a.help for a in sink_cmd._actions if a.dest == "dtype")
    assert "fast: statistics in float32 from the model's q and k" in dtype_help and "eager" in dtype_help


def _tiny_unsupported(arch: str):
    from transformers import AutoModelForCausalLM, GPT2Config, GPTNeoXConfig

    torch.manual_seed(0)
    if arch == "gpt2":
        cfg = GPT2Config(vocab_size=512, n_embd=32, n_layer=2, n_head=2, n_positions=128, bos_token_id=1, eos_token_id=6)
    else:
        cfg = GPTNeoXConfig(vocab_size=512, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                            max_position_embeddings=128, bos_token_id=1, eos_token_id=6)
    return AutoModelForCausalLM.from_config(cfg).eval()


@pytest.mark.parametrize("arch", ["gpt2", "gpt_neox"])
def test_unsupported_architecture_is_refused_in_one_line_before_any_forward(arch, tokenizer, tmp_path, capsys, monkeypatch):
    model = _tiny_unsupported(arch)
    calls = []
    model.register_forward_pre_hook(lambda *a: calls.append(1))
    for run in (lambda: sink_strength(model, tokenizer, texts=TEXTS, progress=False),
                lambda: compute_sink_maps(model, tokenizer, TEXTS, method="eager", progress=False),
                lambda: capture_layer_stats(model, input_ids=torch.ones(1, 4, dtype=torch.long), attention_mask=torch.ones(1, 4))):
        with pytest.raises(SinkstudyError) as err:
            run()
        message = str(err.value)
        assert f"model_type '{arch}'" in message and "model.layers[i].self_attn" in message and "llama" in message
        assert "\n" not in message
    assert calls == []  # refused before any forward pass
    with pytest.raises(SinkstudyError, match=f"model_type '{arch}'"):
        check_supported_config(model.config)  # the same refusal from the config alone
    check_supported_config(tiny_text_config("qwen2"))

    from experiments.cli import main

    path = tmp_path / arch
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    out = tmp_path / "out"
    capsys.readouterr()
    monkeypatch.setattr("interventions.pairs.load_causal_lm", lambda *a, **k: pytest.fail("the CLI loaded the model"))
    assert main(["sink", str(path), "--out", str(out)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1  # one line: no progress bar, no model loaded
    assert captured.err.startswith("sinkstudy: error:") and f"model_type '{arch}'" in captured.err and not out.exists()


def test_sink_modules_import_without_a_circle():
    """evals/sink modules import each other in one direction (no circle, lazy imports included)."""
    import ast
    from pathlib import Path

    import evals.sink

    root = Path(evals.sink.__file__).parent
    graph = {}
    for f in root.glob("*.py"):
        name = "evals.sink" if f.stem == "__init__" else f"evals.sink.{f.stem}"
        deps = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("evals.sink"):
                deps.add(node.module)
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name.startswith("evals.sink")}
        graph[name] = deps - {name}

    def cycle_from(node, path):
        for dep in graph.get(node, ()):
            if dep in path:
                return path[path.index(dep):] + [dep]
            found = cycle_from(dep, path + [dep])
            if found:
                return found
        return None

    for start in graph:
        assert cycle_from(start, [start]) is None, " -> ".join(cycle_from(start, [start]))
