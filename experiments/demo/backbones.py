"""The demo's tiny causal LMs: built from a backbone spec, saved with the demo tokenizer.

Each backbone is a real transformers model of one family (Qwen3: native per-head QK-RMSNorm;
Qwen2 / Llama: none), trained from scratch by `experiments.demo.sinkgrow.grow` (the engine's text
stage) and saved as an HF checkpoint with the demo tokenizer, so every other module loads it like
a hub model.
"""

from __future__ import annotations

from pathlib import Path

from sinkstudy.io import atomic_output_dir
from sinkstudy.tiny import tiny_causal_lm


def build_backbone(spec: dict, tokenizer):
    """A randomly initialised float32 causal LM for one backbone spec of the demo config."""
    hidden, heads = spec["hidden_size"], spec["num_attention_heads"]
    return tiny_causal_lm(
        spec["family"],
        vocab_size=len(tokenizer),
        seed=spec["seed"],
        hidden_size=hidden,
        intermediate_size=spec.get("intermediate_size", 3 * hidden),
        num_hidden_layers=spec["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=spec.get("num_key_value_heads", heads),
        head_dim=hidden // heads,
        max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def save_backbone(model, tokenizer, out_dir: Path) -> None:
    """Save a trained backbone with the demo tokenizer (and its generation defaults) atomically."""
    _set_generation_defaults(model, tokenizer)
    with atomic_output_dir(out_dir, replace=True) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)


def _set_generation_defaults(model, tokenizer) -> None:
    gc = model.generation_config
    gc.bos_token_id, gc.eos_token_id, gc.pad_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id
