"""Tiny random VLMs built from configs (no hub), for tests across the suite.

Every factory gives a float32, eval-mode, eager-attention model whose language model has the same
shape as `tiny_base(text_family)` (= `sinkstudy.tiny.tiny_causal_lm(text_family)`, plus OLMo-3) except
for a few extra vocabulary rows (VLMs add image/special tokens), so
`extract_language_model(tiny_vlm(arch, fam), base=tiny_base(fam))` works.

    vlm = tiny_vlm("qwen2_5_vl")                       # text family qwen2
    vlm = tiny_vlm("llava", text_family="qwen3")       # LLaVA with a Qwen3 language model
    path = save_tiny_vlm(tmp_path / "vlm", "gemma3")   # + a locally trained tokenizer (+ its added tokens)
    base = tiny_base("qwen2")                          # the matching base LLM
"""

from __future__ import annotations

from pathlib import Path

BASE_VOCAB = 512  # sinkstudy.tiny's tokenizer/model vocabulary
EXTRA_VOCAB = 8  # rows a tiny VLM adds past the base vocabulary (its image/special tokens)
IMAGE_TOKEN_ID = BASE_VOCAB + 2  # lives in the extra rows, like real VLMs' <image> tokens

# VLM architecture -> the text families its language model may have (first = default).
VLM_TEXT_FAMILIES = {
    "qwen2_vl": ("qwen2",),
    "qwen2_5_vl": ("qwen2",),
    "qwen3_vl": ("qwen3",),
    "llava": ("llama", "mistral", "qwen2", "qwen3"),
    "llava_next": ("llama", "mistral", "qwen2"),
    "llava_onevision": ("qwen2",),
    "idefics3": ("llama",),
    "smolvlm": ("llama",),
    "gemma3": ("gemma3_text",),
    "internvl": ("qwen2", "qwen3"),
    "molmo2": ("qwen3", "olmo3"),
}

_CLIP = dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=2, image_size=8, patch_size=4, projection_dim=32)
_SIGLIP = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
               num_attention_heads=2, image_size=8, patch_size=4)


def tiny_text_kwargs(text_family: str, vocab_size: int = BASE_VOCAB + EXTRA_VOCAB) -> dict:
    """The language-model config of a tiny VLM, as a dict with `model_type` (sinkstudy.tiny's shape)."""
    from sinkstudy.tiny import tiny_text_config

    if text_family == "olmo3":
        # OLMo-3 shape for Molmo2-O: full-width QK-norm, post-norm blocks; windows wider than any test input.
        from transformers import Olmo3Config

        cfg = Olmo3Config(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, sliding_window=4096,
                          max_position_embeddings=4096, tie_word_embeddings=False, pad_token_id=0,
                          bos_token_id=1, eos_token_id=6)
        return cfg.to_dict()
    return tiny_text_config(text_family, vocab_size=vocab_size).to_dict()


def tiny_vlm_config(arch: str, text_family: str | None = None):
    """The config of a tiny `arch` VLM (vision tower ~10-30k parameters, 8x8 images)."""
    from transformers import AutoConfig

    if arch not in VLM_TEXT_FAMILIES:
        raise ValueError(f"unknown tiny VLM {arch!r}; choose from {', '.join(VLM_TEXT_FAMILIES)}")
    text_family = text_family or VLM_TEXT_FAMILIES[arch][0]
    if text_family not in VLM_TEXT_FAMILIES[arch]:
        raise ValueError(f"{arch} has no {text_family} language model here; choose from {VLM_TEXT_FAMILIES[arch]}")
    text = tiny_text_kwargs(text_family)
    n_layers, hidden = text["num_hidden_layers"], text["hidden_size"]
    head_dim = text.get("head_dim") or hidden // text["num_attention_heads"]
    mrope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": _mrope_section(head_dim)}

    if arch in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl"):
        text = {k: v for k, v in text.items() if k not in ("model_type", "architectures", "tie_word_embeddings")}
        text["rope_parameters"] = mrope
        if arch == "qwen2_vl":
            vision = dict(depth=1, embed_dim=32, hidden_size=hidden, num_heads=2, patch_size=2, spatial_merge_size=2,
                          temporal_patch_size=2)
        elif arch == "qwen2_5_vl":
            vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=hidden,
                          patch_size=2, spatial_merge_size=2, temporal_patch_size=2, window_size=8,
                          fullatt_block_indexes=[0])
        else:
            vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=hidden,
                          patch_size=2, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16,
                          deepstack_visual_indexes=[0])
        return AutoConfig.for_model(arch, text_config=text, vision_config=vision, image_token_id=IMAGE_TOKEN_ID,
                                    video_token_id=IMAGE_TOKEN_ID + 1, vision_start_token_id=IMAGE_TOKEN_ID + 2,
                                    vision_end_token_id=IMAGE_TOKEN_ID + 3, tie_word_embeddings=False)
    if arch in ("llava", "llava_next"):
        extra = {"image_grid_pinpoints": [[8, 8]]} if arch == "llava_next" else {"image_seq_length": 4}
        return AutoConfig.for_model(arch, text_config=text, vision_config=dict(_CLIP), image_token_index=IMAGE_TOKEN_ID,
                                    vision_feature_layer=-1, tie_word_embeddings=False, **extra)
    if arch == "llava_onevision":
        return AutoConfig.for_model(arch, text_config=text, vision_config=dict(_SIGLIP), image_token_index=IMAGE_TOKEN_ID,
                                    video_token_index=IMAGE_TOKEN_ID + 1, image_grid_pinpoints=[[8, 8]],
                                    tie_word_embeddings=False)
    if arch in ("idefics3", "smolvlm"):
        vision = {k: v for k, v in _SIGLIP.items() if k != "model_type"}
        return AutoConfig.for_model(arch, text_config=text, vision_config=vision, image_token_id=IMAGE_TOKEN_ID,
                                    scale_factor=2, tie_word_embeddings=False)
    if arch == "gemma3":
        text["tie_word_embeddings"] = True  # Gemma ties its embeddings
        return AutoConfig.for_model(arch, text_config=text, vision_config=dict(_SIGLIP), mm_tokens_per_image=4,
                                    boi_token_index=IMAGE_TOKEN_ID + 1, eoi_token_index=IMAGE_TOKEN_ID + 2,
                                    image_token_index=IMAGE_TOKEN_ID, tie_word_embeddings=True)
    if arch == "internvl":
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      image_size=[8, 8], patch_size=[2, 2])
        # InternVLConfig ties embeddings by default; the released 8B checkpoints do not.
        return AutoConfig.for_model(arch, text_config=text, vision_config=vision, image_token_id=IMAGE_TOKEN_ID,
                                    image_seq_length=4, tie_word_embeddings=False)
    # molmo2: its own text model type; Qwen3 (per-head QK-norm, pre-norm) or OLMo-3 (full-width, post-norm)
    olmo = text_family == "olmo3"
    rope = text["rope_parameters"]
    theta = rope.get("full_attention", rope)["rope_theta"]  # OLMo-3 keys rope parameters by layer type
    molmo_text = dict(hidden_size=hidden, intermediate_size=text["intermediate_size"], num_hidden_layers=n_layers,
                      num_attention_heads=text["num_attention_heads"], num_key_value_heads=text["num_key_value_heads"],
                      head_dim=head_dim, vocab_size=BASE_VOCAB, additional_vocab_size=EXTRA_VOCAB,
                      qk_norm_type="olmo" if olmo else "qwen3", norm_after=olmo, attention_bias=False,
                      max_position_embeddings=4096, rms_norm_eps=text["rms_norm_eps"],
                      rope_parameters={"rope_type": "default", "rope_theta": theta})
    return AutoConfig.for_model(
        arch, text_config=molmo_text,
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                           num_key_value_heads=2, head_dim=16, image_size=[8, 8], patch_size=4),
        adapter_config=dict(vision_feature_layer=[-1], hidden_size=32, num_attention_heads=2, num_key_value_heads=2,
                            head_dim=16, intermediate_size=64, text_hidden_size=hidden),
        image_start_token_id=BASE_VOCAB, image_end_token_id=BASE_VOCAB + 1, image_patch_id=IMAGE_TOKEN_ID,
        low_res_image_start_token_id=BASE_VOCAB + 3, frame_start_token_id=BASE_VOCAB + 4,
        frame_end_token_id=BASE_VOCAB + 5, tie_word_embeddings=False)


def tiny_vlm(arch: str, text_family: str | None = None, seed: int = 0):
    """A random float32 tiny VLM of architecture `arch` (a transformers model_type), eval mode, eager."""
    import torch
    from transformers import AutoModelForImageTextToText

    config = tiny_vlm_config(arch, text_family)
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config, attn_implementation="eager", dtype=torch.float32)
    return model.eval()


def tiny_base(text_family: str, seed: int = 1, **overrides):
    """A tiny base causal LM whose layout matches the language model of `tiny_vlm(..., text_family)`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from sinkstudy.tiny import tiny_causal_lm

    if text_family == "gemma3_text":
        overrides.setdefault("tie_word_embeddings", True)  # as the real Gemma 3 models
    if text_family != "olmo3":
        overrides.setdefault("vocab_size", BASE_VOCAB)
        return tiny_causal_lm(text_family, seed=seed, **overrides)
    torch.manual_seed(seed)
    kwargs = {**tiny_text_kwargs("olmo3", vocab_size=overrides.pop("vocab_size", BASE_VOCAB)), **overrides}
    config = AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32).eval()


def save_tiny_vlm(out: str | Path, arch: str, text_family: str | None = None, seed: int = 0, tokenizer=None,
                  dtype=None, max_shard_size: str | None = None) -> Path:
    """Save a tiny VLM and a locally trained tokenizer (sinkstudy.tiny) to `out`; returns the path.

    `dtype` (e.g. torch.bfloat16) converts the weights before saving; `max_shard_size` (e.g. "20KB")
    writes several shards with a model.safetensors.index.json, as real checkpoints have.
    """
    from sinkstudy.tiny import train_bpe_tokenizer

    import copy

    out = Path(out)
    model = tiny_vlm(arch, text_family, seed)
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(out, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    # Like real VLMs, the VLM's tokenizer adds its image/special tokens after the base vocabulary.
    tok = copy.deepcopy(tokenizer) if tokenizer is not None else train_bpe_tokenizer(vocab_size=BASE_VOCAB)
    tok.add_tokens([f"<|vlm_{i}|>" for i in range(BASE_VOCAB + EXTRA_VOCAB - len(tok))], special_tokens=True)
    tok.save_pretrained(out)
    return out


def _mrope_section(head_dim: int) -> list[int]:
    # M-RoPE splits head_dim/2 rotary frequencies into (temporal, height, width) sections.
    half = head_dim // 2
    return [half - 2 * (half // 3), half // 3, half // 3]
