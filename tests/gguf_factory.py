"""A real GGUF file of a tiny causal LM (float32 tensors + its BPE tokenizer), written with the `gguf`
package under llama.cpp's tensor and metadata names, which transformers' GGUF loader reads back."""

from __future__ import annotations

import json
from pathlib import Path


def save_tiny_gguf(path: Path, model, tokenizer) -> Path:
    """Write a Qwen2 `model` and its byte-level BPE `tokenizer` as an F32 GGUF file at `path`."""
    import gguf

    cfg = model.config
    assert cfg.model_type == "qwen2", "llama.cpp permutes q/k of llama-family GGUFs; qwen2 is stored as is"
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_name("sinkstudy tiny qwen2")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)

    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    tokens = sorted(spec["model"]["vocab"], key=spec["model"]["vocab"].get)
    special = {t["id"] for t in spec["added_tokens"]}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL for i in range(len(tokens))])
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in spec["model"]["merges"]])
    w.add_bos_token_id(tokenizer.bos_token_id)
    w.add_eos_token_id(tokenizer.eos_token_id)
    w.add_pad_token_id(tokenizer.pad_token_id)

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN2, cfg.num_hidden_layers)
    for name, tensor in model.state_dict().items():
        module, kind = name.rsplit(".", 1)
        w.add_tensor(f"{names.get_name(module)}.{kind}", tensor.float().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
