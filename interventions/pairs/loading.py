"""Load causal LMs and (base LLM, VLM language model) pairs."""

from __future__ import annotations

import dataclasses
import logging
import os

from interventions.pairs.extract import ExtractionReport, build_causal_lm, plan_extraction
from interventions.pairs.layout import compare_layouts
from interventions.pairs.resolve import resolve, resolve_dtype
from sinkstudy import SinkstudyError
from sinkstudy.checkpoint import CheckpointError, try_load_tokenizer

log = logging.getLogger(__name__)


@dataclasses.dataclass
class ModelPair:
    base: object  # PreTrainedModel (causal LM)
    vlm_lm: object  # the VLM's language model, same class, names and vocabulary as `base`
    tokenizer: object | None  # the base's tokenizer
    base_id: str
    vlm_id: str
    report: ExtractionReport


def load_causal_lm(model_or_path, *, dtype=None, device="cpu", attn_implementation=None, tokenizer=None):
    """(causal LM, tokenizer) from a causal-LM or VLM checkpoint, .gguf file, hub id, or loaded model.

    A VLM yields its language model (all vocabulary rows kept; its vision tower is never read). The
    tokenizer comes from the checkpoint (a VLM dir's tokenizer is its processor's); for a loaded model
    it is `tokenizer` (may be None). Checkpoint files are validated before anything is loaded.
    """
    dtype = resolve_dtype(dtype)
    source = resolve(model_or_path)
    if source.model is not None and source.kind == "causal_lm":
        return source.model.to(device), tokenizer
    if source.kind == "vlm":
        model = build_causal_lm(plan_extraction(source), dtype=dtype, device=device,
                                attn_implementation=attn_implementation)
    else:
        # lazy: loads transformers, numpy, PIL
        from transformers import AutoModelForCausalLM

        from interventions import qknorm  # lazy: qknorm itself loads through this module

        kwargs = {"attn_implementation": attn_implementation} if attn_implementation else {}
        path = os.fspath(source.path)
        if qknorm.is_injected_checkpoint(path):  # the hooks format needs its norms re-attached after loading
            model = qknorm.load_injected(path, dtype=dtype, **kwargs)
        else:
            model, info = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, output_loading_info=True, **kwargs)
            if info["missing_keys"]:  # transformers would leave them randomly initialised
                missing = sorted(info["missing_keys"])
                raise CheckpointError(f"{path}: no weights for {missing[0]}"
                                      f"{f' and {len(missing) - 1} more' if len(missing) > 1 else ''}: "
                                      "the checkpoint does not match its config")
        model = model.to(device).eval()
    if tokenizer is None and source.tokenizer_path is not None:
        tokenizer = try_load_tokenizer(source.tokenizer_path)
        if tokenizer is None:
            log.warning("no tokenizer found at %s", model_or_path)
    return model, tokenizer


def load_pair(base, vlm, *, dtype=None, device="cpu", attn_implementation=None, tokenizer=None) -> ModelPair:
    """Load the base LLM and the VLM's language model in the base's class, config and vocabulary.

    `vlm` may be a VLM or an already-extracted causal LM (then only aligned and checked). Both are resolved
    once; architecture, layout and checkpoint files are checked before any weights are read (a mismatch
    raises PairMismatchError). `dtype` applies to models loaded here; a passed-in base keeps its dtype and
    the VLM's LM follows it.
    """
    base_source = resolve(base)
    if base_source.kind != "causal_lm":
        raise SinkstudyError(f"the base must be a causal LM, got a {base_source.config.model_type} VLM: {base_source.id}")
    plan = plan_extraction(vlm, base_source)  # every check, no weights yet
    base_model, base_tok = load_causal_lm(base_source, dtype=dtype, device="cpu", attn_implementation=attn_implementation,
                                          tokenizer=tokenizer)
    # The pair shares one dtype: a passed-in base keeps its own, and the VLM's LM follows it.
    vlm_lm = build_causal_lm(plan, dtype=base_model.dtype, attn_implementation=attn_implementation)
    compare_layouts(base_model, vlm_lm)
    return ModelPair(base=base_model.to(device), vlm_lm=vlm_lm.to(device), tokenizer=base_tok,
                     base_id=base_source.id, vlm_id=plan.source.id, report=plan.report)
