"""QK-RMSNorm injection on real tiny Llama / Mistral / Qwen2 / Gemma2 models."""

import copy
import json

import pytest
import torch

from interventions.qknorm import (
    SCALE_PRESERVING_KL_BOUND,
    SIDECAR,
    QKNormError,
    QKRMSNorm,
    inject_qk_norm,
    load_injected,
    mean_next_token_kl,
    qk_norm_kind,
    save_injected,
    trainable_filter,
)
from sinkstudy import SinkstudyError
from sinkstudy.tiny import DEFAULT_TOKENIZER_TEXTS, tiny_causal_lm

TEXTS = DEFAULT_TOKENIZER_TEXTS
FAMILIES = ["llama", "mistral", "qwen2"]


def tiny_gemma2(vocab_size):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = AutoConfig.for_model(
        "gemma2", vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
        sliding_window=4096, bos_token_id=1, eos_token_id=6, pad_token_id=0,
    )
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32).eval()


def logits(model, tokenizer, text="Respond in exactly three sentences."):
    with torch.no_grad():
        return model(**tokenizer(text, return_tensors="pt")).logits


def inject(base, tokenizer, init, **kw):
    return inject_qk_norm(copy.deepcopy(base), init=init, calibration_texts=TEXTS, tokenizer=tokenizer, progress=False, **kw)


@pytest.mark.parametrize("family", FAMILIES)
def test_adds_two_norms_per_layer_before_rope(family, tokenizer):
    model = inject(tiny_causal_lm(family, vocab_size=len(tokenizer)), tokenizer, "identity-gain")
    norms = [(n, m) for n, m in model.named_modules() if isinstance(m, QKRMSNorm)]
    layers = model.config.num_hidden_layers
    assert len(norms) == 2 * layers
    assert {n.rsplit(".", 1)[-1] for n, _ in norms} == {"q_norm", "k_norm"}
    assert all(m.weight.shape == (16,) for _, m in norms)  # head_dim, shared by heads as in Qwen3
    assert qk_norm_kind(model) == "injected"
    # q_proj's output (before RoPE) now has unit RMS per head with unit gains.
    seen = []
    model.model.layers[0].self_attn.q_proj.register_forward_hook(lambda m, i, o: seen.append(o))
    logits(model, tokenizer)
    rms = seen[0].view(*seen[0].shape[:-1], -1, 16).pow(2).mean(-1).sqrt()
    assert torch.allclose(rms, torch.ones_like(rms), atol=1e-3)


def test_an_injected_model_is_named_as_such_in_logs_and_records_never_in_its_checkpoint(tokenizer, tmp_path):
    """The eval of the injected copy was logged (and recorded) under the original's path."""
    import json

    from transformers import AutoModelForCausalLM

    tiny_causal_lm("llama", vocab_size=len(tokenizer)).save_pretrained(tmp_path / "base")
    model = inject(AutoModelForCausalLM.from_pretrained(tmp_path / "base"), tokenizer, "identity-gain")
    assert model.config._name_or_path == f"{tmp_path / 'base'}+qknorm-identity-gain"
    model.save_pretrained(tmp_path / "saved")
    assert "_name_or_path" not in json.loads((tmp_path / "saved" / "config.json").read_text())


def test_deepcopy_of_injected_model_uses_its_own_norms(tokenizer):
    model = inject(tiny_causal_lm("llama", vocab_size=len(tokenizer)), tokenizer, "identity-gain")
    before = logits(model, tokenizer)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin.model.layers[0].self_attn.q_norm.weight.mul_(3.0)
    assert torch.equal(logits(model, tokenizer), before)
    assert not torch.allclose(logits(twin, tokenizer), before, atol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_scale_preserving_stays_under_kl_bound_identity_does_not(family, tokenizer):
    base = tiny_causal_lm(family, vocab_size=len(tokenizer))
    kl_scale = mean_next_token_kl(base, inject(base, tokenizer, "scale-preserving"), tokenizer, TEXTS, progress=False)
    kl_identity = mean_next_token_kl(base, inject(base, tokenizer, "identity-gain"), tokenizer, TEXTS, progress=False)
    assert kl_scale < SCALE_PRESERVING_KL_BOUND < kl_identity


def test_blend_alpha_zero_is_exact_and_alpha_one_is_the_norm(tokenizer):
    base = tiny_causal_lm("qwen2", vocab_size=len(tokenizer))
    assert torch.equal(logits(inject(base, tokenizer, "blend", alpha=0.0), tokenizer), logits(base, tokenizer))
    full = logits(inject(base, tokenizer, "blend", alpha=1.0), tokenizer)
    assert torch.equal(full, logits(inject(base, tokenizer, "scale-preserving"), tokenizer))
    assert not torch.allclose(full, logits(base, tokenizer), atol=1e-6)


@pytest.mark.parametrize("family", FAMILIES)
def test_sibling_checkpoint_reloads_identical_as_qwen3(family, tokenizer, tmp_path):
    from transformers import AutoModelForCausalLM

    model = inject(tiny_causal_lm(family, vocab_size=len(tokenizer)), tokenizer, "scale-preserving")
    with torch.no_grad():  # distinct gains per layer, so a swapped or dropped norm would show
        for i, layer in enumerate(model.model.layers):
            layer.self_attn.k_norm.weight.mul_(1.0 + 0.1 * i)
    save_injected(model, tmp_path / "ckpt", tokenizer=tokenizer)
    assert json.loads((tmp_path / "ckpt" / SIDECAR).read_text())["format"] == "qwen3-sibling"
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", attn_implementation="eager")
    assert plain.config.model_type == "qwen3" and qk_norm_kind(plain) == "native"
    assert torch.equal(logits(plain, tokenizer), logits(model, tokenizer))
    assert torch.equal(logits(load_injected(tmp_path / "ckpt", attn_implementation="eager"), tokenizer), logits(model, tokenizer))
    with pytest.raises(SinkstudyError, match="already exists"):
        save_injected(model, tmp_path / "ckpt")


@pytest.mark.parametrize("family", FAMILIES)
def test_in_memory_qwen3_sibling_runs_and_matches(family, tokenizer):
    """The twin used inside LLaVA builds works in memory too (RoPE buffers built, not left on meta)."""
    from interventions.qknorm import to_qwen3_sibling

    model = inject(tiny_causal_lm(family, vocab_size=len(tokenizer)), tokenizer, "scale-preserving").eval()
    twin = to_qwen3_sibling(model)
    assert twin.config.model_type == "qwen3" and not twin.training
    assert torch.equal(logits(twin, tokenizer), logits(model, tokenizer))


@pytest.mark.parametrize("kind", ["blend", "gemma2"])
def test_hooks_checkpoint_reloads_identical(kind, tokenizer, tmp_path):
    if kind == "gemma2":
        model = inject(tiny_gemma2(len(tokenizer)), tokenizer, "scale-preserving")
    else:
        model = inject(tiny_causal_lm("llama", vocab_size=len(tokenizer)), tokenizer, "blend", alpha=0.3)
    save_injected(model, tmp_path / "ckpt")
    assert json.loads((tmp_path / "ckpt" / SIDECAR).read_text())["format"] == "sinkstudy-hooks"
    loaded = load_injected(tmp_path / "ckpt", attn_implementation="eager")
    assert type(loaded) is type(model) and qk_norm_kind(loaded) == "injected"
    assert torch.equal(logits(loaded, tokenizer), logits(model, tokenizer))
    # The one loader every module uses must re-attach the norms too, not drop them silently.
    from interventions.pairs import load_causal_lm

    via_pairs, _ = load_causal_lm(tmp_path / "ckpt", attn_implementation="eager")
    assert qk_norm_kind(via_pairs) == "injected"
    assert torch.equal(logits(via_pairs, tokenizer), logits(model, tokenizer))


@pytest.mark.parametrize("family", ["qwen3", "olmo2", "gemma3_text"])
def test_native_qk_norm_is_refused(family, tokenizer):
    model = tiny_causal_lm(family, vocab_size=len(tokenizer))
    assert qk_norm_kind(model) == "native"
    with pytest.raises(QKNormError, match="native QK-norm.*--native-ok"):
        inject_qk_norm(model, init="identity-gain")


def test_bad_input_is_refused_before_any_change(tokenizer):
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(QKNormError, match="supported: llama, mistral, qwen2, gemma, gemma2"):
        inject_qk_norm(gpt2, init="identity-gain")
    model = tiny_causal_lm("llama", vocab_size=len(tokenizer))
    with pytest.raises(SinkstudyError, match="unknown init"):
        inject_qk_norm(model, init="unit")
    with pytest.raises(SinkstudyError, match="needs a tokenizer"):
        inject_qk_norm(model, init="scale-preserving")
    assert qk_norm_kind(model) == "none"
    inject_qk_norm(model, init="identity-gain")
    with pytest.raises(QKNormError, match="already carries injected"):
        inject_qk_norm(model, init="identity-gain")


def test_training_gains_only_changes_only_gains(tokenizer):
    from interventions.training import train_causal_lm

    model = inject(tiny_causal_lm("qwen2", vocab_size=len(tokenizer)), tokenizer, "identity-gain")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    stats = train_causal_lm(model, tokenizer, TEXTS, steps=3, lr=1e-2, batch_size=4,
                            trainable=trainable_filter("gains"), progress=False)
    assert stats["trainable_params"] == 2 * 2 * 16
    for name, p in model.named_parameters():
        changed = not torch.equal(p, before[name])
        assert changed == name.endswith(("q_norm.weight", "k_norm.weight")), name


def test_the_registry_and_the_library_read_one_list_of_choices():
    import interventions.qknorm as lib
    from interventions import qknorm_modes, registry

    assert lib.INIT_MODES is qknorm_modes.INIT_MODES and lib.TRAINABLE_MODES is qknorm_modes.TRAINABLE_MODES
    with pytest.raises(registry.MergeError, match="init must be one of identity-gain, scale-preserving, blend"):
        registry.QKNORM.resolve({"init": "unit"})


def test_train_steps_per_stage_belongs_to_the_recipe(tmp_path, capsys):
    """--train-steps STAGE=N cuts a --recipe stage (tests/test_adapt_cli.py runs it); recovery training is one stage."""
    from experiments.cli import main

    out = tmp_path / "out"
    assert main(["qknorm", "org/base", "--train-steps", "stage2=3", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "recovery training is one stage" in err and not out.exists()
    assert main(["qknorm", "org/base", "--recipe", "r.yaml", "--train-steps", "0", "--out", str(out)]) == 2
    assert "--train-steps must be >= 1, got 0" in capsys.readouterr().err and not out.exists()


@pytest.mark.slow
def test_cli_end_to_end_on_tiny_qwen2(tokenizer, tmp_path, monkeypatch, capsys):
    from experiments.cli import main

    monkeypatch.setenv("SINKSTUDY_CACHE", str(tmp_path / "cache"))
    base = tmp_path / "qwen2"
    tiny_causal_lm("qwen2", vocab_size=len(tokenizer)).save_pretrained(base)
    tokenizer.save_pretrained(base)
    calib = tmp_path / "calib.txt"
    calib.write_text("\n".join(TEXTS[:4]))
    out = tmp_path / "out"
    # The flags of `make qknorm BASE=... OUT=... TRAIN_STEPS=2 ARGS="..."`.
    argv = ["qknorm", str(base), "--init", "scale-preserving", "--train-steps", "2", "--out", str(out),
            "--limit", "2", "--max-gen-toks", "8", "--calibration", str(calib), "--train-texts", str(calib), "--train-batch-size", "2"]
    assert main(argv) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["arm"] == "injected" and report["checkpoint_format"] == "qwen3-sibling"
    assert report["at_init"]["mean_kl"] < SCALE_PRESERVING_KL_BOUND
    assert report["training"]["trainable_params"] == 2 * 2 * 16 and len(report["training"]["losses"]) == 2
    assert {c["task"] for c in report["evals"]["paired"]} == {"sinkstudy_ifeval", "sinkstudy_gsm"}
    assert all(c["n"] == 2 for c in report["evals"]["paired"])
    assert report["provenance"]["model_fingerprints"]["injected"] != report["provenance"]["model_fingerprints"]["original"]
    assert "Sink Strength" in capsys.readouterr().out
    assert qk_norm_kind(load_injected(out / "model")) == "native"  # reloads as Qwen3
    assert main(argv) == 0 and "reused qknorm/inject" in capsys.readouterr().out  # finished: reused, and said so
    assert main([*argv, "--train-lr", "0.01"]) == 2  # other settings never overwrite without --force
    assert "made by another request (lr differ)" in capsys.readouterr().err
