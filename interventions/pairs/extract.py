"""Extract a VLM's language model as a standalone causal LM in the base LLM's class and vocabulary."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from interventions.pairs import archs
from interventions.pairs.layout import PairMismatchError, check_same_layout
from interventions.pairs.resolve import is_model, load_config, model_id, resolve_dtype, try_load_tokenizer


@dataclasses.dataclass
class ExtractionReport:
    """What extraction did: source and target classes, vocabulary alignment, embedding tying."""

    source: str
    source_arch: str  # the VLM's class (or the causal LM's, when nothing was extracted)
    source_text_type: str
    target_class: str
    source_vocab: int  # embedding rows in the source
    source_lm_head_rows: int
    target_vocab: int
    dropped_rows: list[int]  # [start, stop) of source rows removed (VLM-added tokens), or []
    dropped_tokens: list[str]  # names of the dropped rows where the VLM tokenizer knows them (first 50)
    padded_rows: int  # rows added to reach the base vocabulary
    pad_source: str | None  # "base" (copied from the base) or "zeros"
    tied: bool  # embed_tokens and lm_head hold the same values in the extracted LM
    tie_note: str
    extracted: bool = True  # False when the source already was a causal LM
    notes: list[str] = dataclasses.field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def summary(self) -> str:
        what = f"text model {self.source_text_type}" if self.extracted else "already a causal LM"
        lines = [f"{self.source}: {self.source_arch} -> {self.target_class} ({what})"]
        if self.dropped_rows:
            start, stop = self.dropped_rows
            names = f" ({', '.join(self.dropped_tokens[:8])}{', ...' if len(self.dropped_tokens) > 8 else ''})" if self.dropped_tokens else ""
            lines.append(f"vocabulary: dropped rows {start}..{stop - 1} ({stop - start} VLM-added){names}")
        if self.padded_rows:
            lines.append(f"vocabulary: padded {self.padded_rows} rows from {self.pad_source}")
        lines.append(f"vocabulary: {self.source_vocab} -> {self.target_vocab} rows; embeddings: {self.tie_note}")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def plan_target_config(vlm_config, base_config=None, vocab_size: int | None = None):
    """(causal config, text config) for a VLM config, checked against the base's layout. Cheap: no weights."""
    archs.classify(vlm_config)
    text_config = archs.text_config_of(vlm_config)
    base_type = base_config.model_type if base_config is not None else None
    target_type = archs.choose_causal_type(text_config, base_type)
    if vocab_size is None:
        vocab_size = base_config.vocab_size if base_config is not None else text_config.vocab_size
    target = archs.causal_config_from_text(text_config, target_type, vocab_size)
    target.tie_word_embeddings = bool(getattr(vlm_config, "tie_word_embeddings", False))
    if base_config is not None:
        # The extracted LM is used with the base's tokenizer, so it takes the base's special-token ids.
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            setattr(target, key, getattr(base_config, key, None))
        check_same_layout(base_config, target)
    return target, text_config


def extract_language_model(vlm, base=None, *, dtype=None, device="cpu", attn_implementation=None, vlm_tokenizer=None):
    """Return (causal_lm, ExtractionReport) for a VLM given as a path, hub id or loaded model.

    `base` (a path, config or loaded causal LM) fixes the target class and vocabulary size; when it is a
    loaded model its rows fill any vocabulary padding. The causal LM shares tensors with a passed VLM.
    """
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    dtype = resolve_dtype(dtype)
    base_config = _config_of(base) if base is not None else None
    vlm_config = vlm.config if is_model(vlm) else load_config(vlm)
    target_config, text_config = plan_target_config(vlm_config, base_config)  # fails before loading weights
    is_vlm = archs.classify(vlm_config) == "vlm"
    if is_model(vlm):
        model = vlm
    else:
        auto = AutoModelForImageTextToText if is_vlm else AutoModelForCausalLM
        model = auto.from_pretrained(os.fspath(vlm), dtype=dtype)
        if vlm_tokenizer is None:
            vlm_tokenizer = try_load_tokenizer(os.fspath(vlm))
    decoder = model.get_decoder()
    state = {
        "model." + archs.rename_text_keys(text_config, target_config.model_type, k): v
        for k, v in decoder.state_dict().items()
    }
    state["lm_head.weight"] = model.get_output_embeddings().weight

    base_model = base if is_model(base) else None
    report = ExtractionReport(
        source=model_id(vlm), source_arch=type(model).__name__, source_text_type=text_config.model_type,
        target_class="", source_vocab=state["model.embed_tokens.weight"].shape[0],
        source_lm_head_rows=state["lm_head.weight"].shape[0], target_vocab=target_config.vocab_size,
        dropped_rows=[], dropped_tokens=[], padded_rows=0, pad_source=None, tied=False, tie_note="",
        extracted=is_vlm,
    )
    align_vocab(state, target_config.vocab_size, base_model, report, vlm_tokenizer)
    causal = _build(target_config, state, dtype, attn_implementation, report, base_config)
    report.target_class = type(causal).__name__
    if text_config.model_type in ("qwen2_vl_text", "qwen2_5_vl_text", "qwen3_vl_text"):
        report.notes.append("M-RoPE -> 1D RoPE: identical for text-only input (three equal position streams)")
    if text_config.model_type == "molmo2_text" and target_config.model_type == "olmo3":
        report.notes.append("Molmo2 attends over the full context: OLMo-3 sliding window set to "
                            f"{target_config.sliding_window} (the base windows its sliding layers)")
    return causal.to(device), report


def align_vocab(state: dict, target_vocab: int, base_model, report: ExtractionReport, vlm_tokenizer=None) -> None:
    """Truncate VLM-added embedding/lm_head rows to `target_vocab`, or pad (base rows if known, else zeros)."""
    import torch

    base_state = base_model.state_dict() if base_model is not None else {}
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        w = state[name]
        rows = w.shape[0]
        if rows > target_vocab:
            state[name] = w[:target_vocab]
            if name == "model.embed_tokens.weight" or not report.dropped_rows:
                report.dropped_rows = [target_vocab, rows]
        elif rows < target_vocab:
            src = base_state.get(name)
            pad = src[rows:target_vocab].to(w.dtype) if src is not None else w.new_zeros(target_vocab - rows, w.shape[1])
            state[name] = torch.cat([w, pad.to(w.device)])
            report.padded_rows = max(report.padded_rows, target_vocab - rows)
            report.pad_source = "base" if src is not None else "zeros"
    if report.dropped_rows and vlm_tokenizer is not None:
        start, stop = report.dropped_rows
        ids = list(range(start, min(stop, start + 50)))
        report.dropped_tokens = [t for t in vlm_tokenizer.convert_ids_to_tokens(ids) if t is not None]


def _build(config, state, dtype, attn_implementation, report, base_config):
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    embed, head = state["model.embed_tokens.weight"], state["lm_head.weight"]
    tied = head is embed or (head.shape == embed.shape and torch.equal(head, embed))
    # The config flag must match the weights: lm-eval's HFLM calls tie_weights(), which would
    # overwrite an untied lm_head with the embeddings if the flag said "tied".
    config.tie_word_embeddings = tied
    base_tied = getattr(base_config, "tie_word_embeddings", None)
    report.tied = tied
    report.tie_note = "tied (lm_head = embed_tokens)" if tied else "untied (own lm_head)"
    if base_tied is not None and base_tied != tied:
        report.tie_note += f"; the base is {'tied' if base_tied else 'untied'}: merges must treat lm_head explicitly"
    kwargs = {"dtype": dtype}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    with no_init_weights():  # every weight comes from the VLM; skip the random init
        model = AutoModelForCausalLM.from_config(config, **kwargs)
    if tied:
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}
    state = {k: v.to(dtype) for k, v in state.items()}
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    missing = [k for k in missing if not (tied and k == "lm_head.weight")]
    if missing or unexpected:
        raise PairMismatchError(
            f"VLM language model does not fit {type(model).__name__}: "
            f"missing {missing[:3]}, unexpected {unexpected[:3]}"
        )
    if tied:
        model.tie_weights()
    return model.eval()


def _config_of(obj):
    if is_model(obj):
        return obj.config
    if hasattr(obj, "model_type"):
        return obj
    return load_config(obj)
