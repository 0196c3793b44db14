"""Which VLM architectures the pair loader knows, and how each one's language model maps to a causal LM.

Facts read in transformers 5.23 (`models/*/modeling_*.py`): every supported VLM keeps its text decoder
as a `*Model` whose parameter names equal the causal LM's `model.*` names (`get_decoder()` returns it)
and its head as a top-level `lm_head`. Only the text model_type and a few configs need translating.
"""

from __future__ import annotations

from interventions.pairs.layout import PairMismatchError, compare_layouts
from sinkstudy import SinkstudyError

# VLM config model_type -> human name (transformers-native classes only).
SUPPORTED_VLMS = {
    "qwen2_vl": "Qwen2-VL",
    "qwen2_5_vl": "Qwen2.5-VL",
    "qwen3_vl": "Qwen3-VL",
    "llava": "LLaVA-1.5",
    "llava_next": "LLaVA-NeXT",
    "llava_onevision": "LLaVA-OneVision",
    "idefics3": "Idefics3",
    "smolvlm": "SmolVLM",
    "gemma3": "Gemma3ForConditionalGeneration",
    "internvl": "InternVL (transformers-native -hf checkpoints)",
    "molmo2": "Molmo2",
}

# Checkpoint formats that need remote code: say what to use instead.
NOT_NATIVE = {
    "internvl_chat": "the remote-code InternVL format; transformers 5.x loads only the native conversions "
    "(e.g. OpenGVLab/InternVL3-8B-hf, OpenGVLab/InternVL3_5-8B-HF)",
    "llava_qwen": "the original lmms-lab LLaVA-OneVision format; use the transformers-native conversion "
    "(e.g. llava-hf/llava-onevision-qwen2-7b-ov-hf)",
    "molmo": "Molmo (v1), which has no native transformers 5.x class (Molmo2 has one)",
    "qwen3_vl_moe": "a mixture-of-experts Qwen3-VL, whose language model has no dense causal-LM twin",
}

# Text model types with no causal-LM class of their own -> the causal family with the same weights.
# M-RoPE variants: with text-only input all three position streams are equal, which is 1D RoPE.
_TEXT_TO_CAUSAL = {
    "qwen2_vl_text": "qwen2",
    "qwen2_5_vl_text": "qwen2",
    "qwen3_vl_text": "qwen3",
}


def supported_list() -> str:
    return ", ".join(f"{name} ({mt})" for mt, name in SUPPORTED_VLMS.items())


def classify(config) -> str:
    """'vlm' or 'causal_lm' for a config, else a SinkstudyError listing what is supported."""
    # lazy: loads torch, transformers, numpy
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = getattr(config, "model_type", None)
    if model_type in SUPPORTED_VLMS:
        return "vlm"
    if model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and getattr(config, "text_config", None) is None:
        return "causal_lm"
    why = f" ({NOT_NATIVE[model_type]})" if model_type in NOT_NATIVE else ""
    raise SinkstudyError(
        f"unsupported architecture {model_type!r}{why}; supported VLMs: {supported_list()}; "
        "or any causal LM transformers can load"
    )


def text_config_of(vlm_config):
    return vlm_config.get_text_config(decoder=True) if hasattr(vlm_config, "get_text_config") else vlm_config.text_config


def causal_types_for(text_config) -> tuple[str, ...]:
    """Causal-LM model types that can hold this VLM text model's weights (first = default)."""
    # lazy: loads torch, transformers, numpy
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    mt = text_config.model_type
    if mt == "molmo2_text":
        # qwen3-style QK-norm + pre-norm = Qwen3 (Molmo2-8B); olmo-style + post-norm = OLMo-3/2 (Molmo2-O).
        if text_config.qk_norm_type == "qwen3" and not text_config.norm_after:
            return ("qwen3",)
        if text_config.qk_norm_type == "olmo" and text_config.norm_after:
            return ("olmo3", "olmo2")
        raise SinkstudyError(
            f"Molmo2 text model with qk_norm_type={text_config.qk_norm_type!r}, norm_after={text_config.norm_after} "
            "has no causal-LM twin in transformers"
        )
    if mt in _TEXT_TO_CAUSAL:
        return (_TEXT_TO_CAUSAL[mt],)
    if mt in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return (mt,)
    raise SinkstudyError(f"VLM language model type {mt!r} has no causal-LM class in transformers")


def choose_causal_type(text_config, base_type: str | None) -> str:
    candidates = causal_types_for(text_config)
    if base_type is None:
        return candidates[0]
    if base_type not in candidates:
        raise PairMismatchError(
            f"architecture mismatch: the VLM's language model ({text_config.model_type}) maps to "
            f"{'/'.join(candidates)} but the base is {base_type}"
        )
    return base_type


def translated_kwargs(text_config, target_type: str) -> dict:
    """The VLM text config's settings that the causal class `target_type` has, in that class's terms."""
    # lazy: loads transformers, numpy, PIL
    from transformers import CONFIG_MAPPING

    src = text_config.to_dict()
    if text_config.model_type == "molmo2_text":
        src = _molmo2_text_kwargs(text_config, target_type)
    allowed = set(CONFIG_MAPPING[target_type]().to_dict())
    kwargs = {k: v for k, v in src.items() if k in allowed and k not in _NEVER_COPY}
    if isinstance(kwargs.get("rope_parameters"), dict):
        kwargs["rope_parameters"] = one_d_rope(kwargs["rope_parameters"])
    return kwargs


def one_d_rope(rope: dict) -> dict:
    """M-RoPE -> 1D RoPE: identical for text-only positions (three equal streams); θ and scaling are kept.

    Qwen2-VL's legacy `rope_scaling: {"type": "mrope", "mrope_section": ...}` arrives here as
    `rope_parameters` with `type: mrope` beside `rope_type: default`: none of it may survive.
    """
    if "full_attention" in rope or "sliding_attention" in rope:  # keyed by layer type (OLMo-3, Gemma-3)
        return {k: one_d_rope(v) if isinstance(v, dict) else v for k, v in rope.items()}
    out = {k: v for k, v in rope.items() if k not in ("mrope_section", "mrope_interleaved")}
    if out.get("type") == "mrope":
        del out["type"]
    if out.get("rope_type") == "mrope":
        out["rope_type"] = "default"
    return out


# Settings that are never the VLM's to change: identity, format, training-only init, the tokenizer's ids
# (the extracted LM is used with the base's tokenizer), vocabulary size (aligned to the base), tying (follows
# the weights).
_NEVER_COPY = {"model_type", "architectures", "transformers_version", "_name_or_path", "auto_map", "id2label",
               "label2id", "tie_word_embeddings", "vocab_size", "dtype", "torch_dtype", "bos_token_id",
               "eos_token_id", "pad_token_id", "use_cache", "output_attentions", "output_hidden_states", "return_dict",
               "initializer_range"}


def plan_target_config(vlm_config, base_config=None):
    """(causal config, text config, changes) for a VLM (or causal-LM) config. Cheap: no weights.

    Without a base the config reproduces the VLM's text model as is. With a base it is the base's own
    config, overridden only where the VLM's text model really differs (θ, window, ...): `changes` maps
    each such key to [base value, VLM value]. The layout is checked against the base's.
    """
    # lazy: loads transformers, numpy, PIL
    from transformers import CONFIG_MAPPING

    classify(vlm_config)
    text_config = text_config_of(vlm_config)
    base_type = base_config.model_type if base_config is not None else None
    target_type = choose_causal_type(text_config, base_type)
    kwargs = translated_kwargs(text_config, target_type)
    vocab = base_config.vocab_size if base_config is not None else text_config.vocab_size
    translated = CONFIG_MAPPING[target_type](**kwargs, vocab_size=vocab)
    translated.tie_word_embeddings = bool(getattr(vlm_config, "tie_word_embeddings", False))
    if base_config is None:
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            setattr(translated, key, _first_set(key, text_config, vlm_config))
        return translated, text_config, {}
    base_dict, vlm_dict = base_config.to_dict(), translated.to_dict()
    changes = {k: [base_dict.get(k), vlm_dict[k]] for k in kwargs if base_dict.get(k) != vlm_dict[k]}
    target = type(base_config).from_dict({**base_dict, **{k: new for k, (_, new) in changes.items()}})
    target.tie_word_embeddings = bool(getattr(vlm_config, "tie_word_embeddings", False))
    compare_layouts(base_config, target)
    return target, text_config, changes


def _first_set(key: str, *configs):
    return next((getattr(c, key) for c in configs if getattr(c, key, None) is not None), None)


def _molmo2_text_kwargs(tc, target_type: str) -> dict:
    """Molmo2's text config in the target family's terms (read in molmo2/modeling_molmo2.py)."""
    src = tc.to_dict()
    rope = dict(tc.rope_parameters)
    n = tc.num_hidden_layers
    scaled = set(tc.rope_scaling_layers)
    if target_type == "qwen3":
        if rope.get("rope_type", "default") != "default" and scaled != set(range(n)):
            raise SinkstudyError("Molmo2 with RoPE scaling on only some layers has no Qwen3 twin")
        src.update(rope_parameters=rope, attention_bias=tc.attention_bias)
        return src
    unscaled = {"rope_type": "default", "rope_theta": rope["rope_theta"]}
    if target_type == "olmo2":
        if rope.get("rope_type", "default") != "default" and scaled != set(range(n)):
            raise SinkstudyError("Molmo2 with RoPE scaling on only some layers has no OLMo-2 twin; use an OLMo-3 base")
        src.update(rope_parameters=rope)
        return src
    # OLMo-3 keys RoPE by layer type: Molmo2's scaled layers become "full_attention", the rest
    # "sliding_attention" with unscaled RoPE. Molmo2 attends over the whole context, so the window
    # is set to the full length: the twin is exact, though the base OLMo-3 windows its sliding layers.
    src.update(
        layer_types=["full_attention" if i in scaled else "sliding_attention" for i in range(n)],
        rope_parameters={"full_attention": rope, "sliding_attention": unscaled},
        sliding_window=tc.max_position_embeddings,
    )
    return src


# Molmo2 (olmo-style, norm_after) names its post-norms like a pre-norm block; OLMo-2/3 name them by place.
_MOLMO2_OLMO_RENAMES = {
    ".input_layernorm.": ".post_attention_layernorm.",
    ".post_attention_layernorm.": ".post_feedforward_layernorm.",
}


def rename_text_keys(text_config, target_type: str, name: str) -> str:
    if text_config.model_type == "molmo2_text" and target_type in ("olmo2", "olmo3"):
        for old, new in _MOLMO2_OLMO_RENAMES.items():
            if old in name:
                return name.replace(old, new)
    return name
