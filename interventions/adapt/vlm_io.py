"""A VLM's weights in and out: saved as an ordinary HF checkpoint + processor (`save_vlm`, with the QK-norm
sidecar where norms are carried as hooks) and loaded back (`load_vlm`); its language model taken out as a causal
LM (`extract_lm`, `save_extracted_lm`) or another causal LM put back in its place (`implant_lm`); and the views
of a live VLM the trainer and probes use (`language_model`, `parameter_groups`, `causal_view`). The VLM itself is
built by `interventions.adapt.build`.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoProcessor

from interventions import qknorm
from interventions.adapt.build import Built, load_language_model
from interventions.pairs import archs, extract_language_model, load_tokenizer, save_causal_lm
from sinkstudy import SinkstudyError
from sinkstudy.io import atomic_output_dir


# --------------------------------------------------------------------------- groups, views, round trip

def is_vlm(model) -> bool:
    return getattr(model.config, "text_config", None) is not None


def language_model(model):
    """The text decoder (embeddings + layers + norm) inside a VLM, or the causal LM's own."""
    return model.get_decoder() if is_vlm(model) else model.model


def parameter_groups(model) -> dict[str, set[str]]:
    """Parameter names per named group: lm (decoder + head), embeddings, projector, tower."""
    names = {id(p): n for n, p in model.named_parameters()}

    def of(module) -> set[str]:
        return {names[id(p)] for p in module.parameters() if id(p) in names} if module is not None else set()

    lm = of(language_model(model)) | of(model.get_output_embeddings())
    emb = of(model.get_input_embeddings()) | of(model.get_output_embeddings())
    groups = {"lm": lm, "embeddings": emb, "projector": set(), "tower": set()}
    if is_vlm(model):
        inner = model.model
        projector = getattr(inner, "multi_modal_projector", None)
        if projector is None and hasattr(inner, "visual"):
            projector = getattr(inner.visual, "merger", None)
        tower = getattr(inner, "vision_tower", None) or getattr(inner, "visual", None)
        groups["projector"] = of(projector)
        groups["tower"] = of(tower) - groups["projector"]
    return groups


def causal_view(model):
    """A `*ForCausalLM` sharing the VLM's text decoder and head (no copy): for evals on the live weights."""

    if not is_vlm(model):
        return model
    text = model.config.get_text_config()
    target = archs.choose_causal_type(text, None)
    cfg = text if text.model_type == target else archs.causal_config_from_text(text, target, text.vocab_size)
    cfg.tie_word_embeddings = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    with torch.device("meta"):
        view = AutoModelForCausalLM.from_config(cfg)
    view.model = model.get_decoder()
    view.lm_head = model.get_output_embeddings()
    view.generation_config = model.generation_config
    view.config._attn_implementation = text._attn_implementation
    return view.train(model.training)


# --------------------------------------------------------------------------- save / load

def save_vlm(built_or_model, processor, out: str | os.PathLike, *, replace: bool = False, metadata: dict | None = None) -> Path:
    """An ordinary HF checkpoint + processor (+ the QK-norm sidecar when norms are carried as hooks)."""
    model = built_or_model.model if isinstance(built_or_model, Built) else built_or_model
    decoder = model.get_decoder()
    carried = any(isinstance(m, qknorm.QKRMSNorm) for m in decoder.modules())
    with atomic_output_dir(out, replace=replace) as tmp:
        if carried:
            gains, _ = qknorm.injected_norms(decoder)
            prefix = _prefix_of(model, decoder)
            state = {k: v for k, v in model.state_dict().items() if k.removeprefix(prefix) not in gains}
            model.save_pretrained(tmp, state_dict=state)
            qknorm.save_vlm_norms(decoder, tmp, metadata)
        else:
            model.save_pretrained(tmp)
        processor.save_pretrained(tmp)
    return Path(out)


def _prefix_of(model, module) -> str:
    for name, m in model.named_modules():
        if m is module:
            return f"{name}." if name else ""
    raise SinkstudyError("module is not part of the model")


def load_vlm(path: str | os.PathLike, *, dtype=torch.float32, device: str = "cpu"):
    """(VLM, processor) saved by `save_vlm` (or any hub VLM), carried QK-norm re-attached."""
    model = AutoModelForImageTextToText.from_pretrained(os.fspath(path), dtype=dtype).to(device)
    qknorm.load_vlm_norms(path, model.get_decoder())
    return model.eval(), AutoProcessor.from_pretrained(os.fspath(path))


def extract_lm(vlm_path, base=None, *, dtype=torch.float32):
    """The VLM's language model as a causal LM (the pair loader's extraction), carried QK-norm re-attached."""

    model = AutoModelForImageTextToText.from_pretrained(os.fspath(vlm_path), dtype=dtype)
    lm, report = extract_language_model(model, base, dtype=dtype)
    if qknorm.load_vlm_norms(vlm_path, lm.model):  # the decoder's names are the causal LM's model.*
        report.notes.append("injected QK-norm re-attached from the VLM's sidecar")
    return lm, report


def implant_lm(vlm, lm) -> None:
    """Put a causal LM back into a VLM in place of its language model (the inverse of `extract_lm`): a merged
    or mitigated LM scored with the VLM's own tower and projector. The LM's decoder and head replace the VLM's;
    vocabulary rows past the LM's (the image token) keep the VLM's trained values. The LM must have the VLM
    LM's architecture (a merge of base and VLM LM has)."""
    if qknorm.qk_norm_kind(lm) == "injected":
        raise SinkstudyError("cannot put an LM with injected QK-norm into a VLM built without it")
    state = {k.removeprefix("model."): v for k, v in lm.state_dict().items() if k.startswith("model.")}
    try:
        load_language_model(vlm, lm, state, vlm.get_input_embeddings().weight.shape[0], own_rows=True)
    except RuntimeError as exc:  # load_state_dict's size or key mismatch, many lines
        raise SinkstudyError(f"the LM does not fit the VLM's language model: {str(exc).splitlines()[0]}") from None


def save_extracted_lm(vlm_path, base, out: str | os.PathLike, *, replace: bool = False, own_class: bool = False) -> Path:
    """Extract the VLM's language model (vocabulary aligned to `base`) and save it as a causal LM that
    `interventions.pairs.load_causal_lm` reads back exactly: injected norms in the qknorm format.
    `own_class`: the VLM was built around another class than the base's (a hook's `changes_architecture`):
    extract it in that class; the base then only gives the tokenizer."""

    lm, report = extract_lm(vlm_path, None if own_class else base)
    tok = load_tokenizer(base) if isinstance(base, (str, os.PathLike)) else None
    if qknorm.qk_norm_kind(lm) == "injected":
        return qknorm.save_injected(lm, out, tokenizer=tok, metadata={"extraction": report.to_dict()}, replace=replace)
    return save_causal_lm(lm, tok, out, replace=replace, extra={"extraction": report.to_dict(), "vlm": os.fspath(vlm_path)})
