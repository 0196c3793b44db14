"""Load causal LMs and (base LLM, VLM language model) pairs; save extracted checkpoints."""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path

from interventions.pairs import archs
from interventions.pairs.extract import ExtractionReport, extract_language_model
from interventions.pairs.layout import check_same_layout
from interventions.pairs.resolve import is_model, load_config, model_id, resolve_dtype, try_load_tokenizer

log = logging.getLogger(__name__)

EXTRACTION_JSON = "sinkstudy_extraction.json"


@dataclasses.dataclass
class ModelPair:
    base: object  # PreTrainedModel (causal LM)
    vlm_lm: object  # the VLM's language model, same class, names and vocabulary as `base`
    tokenizer: object | None  # the base's tokenizer
    base_id: str
    vlm_id: str
    report: ExtractionReport


def load_causal_lm(model_or_path, *, dtype=None, device="cpu", attn_implementation=None, tokenizer=None):
    """(causal LM, tokenizer) from a causal-LM or VLM checkpoint, hub id, or loaded model.

    A VLM yields its language model (all vocabulary rows kept). The tokenizer comes from the path
    (a VLM dir's tokenizer is its processor's); for a loaded model it is `tokenizer` (may be None).
    """
    dtype = resolve_dtype(dtype)
    config = model_or_path.config if is_model(model_or_path) else load_config(model_or_path)
    kind = archs.classify(config)
    if is_model(model_or_path) and kind == "causal_lm":
        return model_or_path.to(device), tokenizer
    if kind == "vlm":
        model, _ = extract_language_model(model_or_path, dtype=dtype, device=device,
                                          attn_implementation=attn_implementation)
    else:
        from transformers import AutoModelForCausalLM

        from interventions import qknorm  # lazy: qknorm itself loads through this module

        kwargs = {"attn_implementation": attn_implementation} if attn_implementation else {}
        # An injected checkpoint in the hooks format needs its norms re-attached after loading.
        load = qknorm.load_injected if qknorm.is_injected_checkpoint(model_or_path) else AutoModelForCausalLM.from_pretrained
        model = load(os.fspath(model_or_path), dtype=dtype, **kwargs).to(device).eval()
    if tokenizer is None and not is_model(model_or_path):
        tokenizer = try_load_tokenizer(os.fspath(model_or_path))
        if tokenizer is None:
            log.warning("no tokenizer found at %s", model_or_path)
    return model, tokenizer


def load_pair(base, vlm, *, dtype=None, device="cpu", attn_implementation=None, tokenizer=None) -> ModelPair:
    """Load the base LLM and the VLM's language model in the base's class and vocabulary.

    `vlm` may be a VLM or an already-extracted causal LM (then only aligned and checked). Layouts are
    compared on configs before any weights are read; a mismatch raises PairMismatchError. `dtype`
    applies to models loaded here; a passed-in base keeps its dtype and the VLM's LM follows it.
    """
    from interventions.pairs.extract import plan_target_config

    dtype = resolve_dtype(dtype)
    base_config = base.config if is_model(base) else load_config(base)
    if archs.classify(base_config) != "causal_lm":
        from sinkstudy import SinkstudyError

        raise SinkstudyError(f"the base must be a causal LM, got a {base_config.model_type} VLM: {model_id(base)}")
    vlm_config = vlm.config if is_model(vlm) else load_config(vlm)
    plan_target_config(vlm_config, base_config)  # layout check, no weights yet
    base_model, base_tok = load_causal_lm(base, dtype=dtype, device="cpu", attn_implementation=attn_implementation,
                                          tokenizer=tokenizer)
    # The pair shares one dtype: a passed-in base keeps its own, and the VLM's LM follows it.
    vlm_lm, report = extract_language_model(vlm, base_model, dtype=base_model.dtype, device="cpu",
                                            attn_implementation=attn_implementation)
    check_same_layout(base_model, vlm_lm)
    return ModelPair(base=base_model.to(device), vlm_lm=vlm_lm.to(device), tokenizer=base_tok,
                     base_id=model_id(base), vlm_id=model_id(vlm), report=report)


def save_causal_lm(model, tokenizer, out, *, force: bool = False, extra: dict | None = None) -> Path:
    """Write an HF checkpoint (safetensors + config + tokenizer) atomically, with provenance JSON."""
    from sinkstudy.io import atomic_output_dir, check_output_dir, write_json_atomic
    from sinkstudy.provenance import provenance, state_dict_fingerprint

    out = check_output_dir(out, force)
    with atomic_output_dir(out, force=force) as tmp:
        model.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        write_json_atomic(tmp / EXTRACTION_JSON, {
            "model_class": type(model).__name__,
            "provenance": provenance(model_fingerprint=state_dict_fingerprint(model), **(extra or {})),
        })
    return out
