"""Extract a VLM's language model as a standalone causal LM in the base LLM's class and vocabulary.

`plan_extraction` does every check and decision from configs and safetensors headers alone (target
class and config, vocabulary alignment, tying); its `tensors` then yield the aligned tensors one at a
time, for `extract_language_model` (in memory) or `writer.write_language_model` (streamed to disk).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from interventions.pairs import archs
from interventions.pairs.layout import PairMismatchError
from interventions.pairs.resolve import ModelSource, resolve, resolve_dtype
from interventions.pairs.tensors import EMBED, HEAD, tensors_of
from sinkstudy.checkpoint import try_load_tokenizer


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
    # Settings where the VLM's text model differs from the base's config: key -> [base value, VLM value].
    # The extracted config is the base's config with exactly these keys taken from the VLM.
    config_changes: dict[str, list] = dataclasses.field(default_factory=dict)

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
        if self.config_changes:
            changed = "; ".join(f"{k} {_short(old)} -> {_short(new)}" for k, (old, new) in self.config_changes.items())
            lines.append(f"config: the base's, with the VLM's {changed}")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


@dataclasses.dataclass
class ExtractionPlan:
    """Everything decided before any weight is read."""

    source: ModelSource
    config: Any  # the extracted causal LM's config (the base's, with the VLM's real changes)
    tensors: "AlignedTensors"
    report: ExtractionReport


def plan_extraction(vlm, base=None, *, vlm_tokenizer=None) -> ExtractionPlan:
    """Resolve and check `vlm` against `base` (path, config, loaded model or ModelSource); read no weights.

    Raises PairMismatchError / SinkstudyError (one line) for unsupported or mismatched architectures and
    for missing, truncated or inconsistent checkpoint files.
    """
    source = resolve(vlm)
    base_source = None if base is None or _is_config(base) else resolve(base)
    base_config = base if _is_config(base) else (base_source.config if base_source else None)
    config, text_config, changes = archs.plan_target_config(source.config, base_config)
    lm = tensors_of(source, config.model_type)
    vocab = config.vocab_size
    pad_from = tensors_of(base_source) if base_source is not None and lm.shape(EMBED)[0] < vocab else None
    tensors = AlignedTensors(lm, vocab, pad_from)
    config.tie_word_embeddings = tensors.tied
    report = ExtractionReport(
        source=source.id, source_arch=_class_name(source), source_text_type=text_config.model_type,
        target_class=_causal_class_name(config), source_vocab=lm.shape(EMBED)[0], source_lm_head_rows=lm.shape(HEAD)[0],
        target_vocab=vocab, dropped_rows=[], dropped_tokens=[], padded_rows=0, pad_source=None, tied=tensors.tied,
        tie_note="tied (lm_head = embed_tokens)" if tensors.tied else "untied (own lm_head)",
        extracted=source.kind == "vlm", config_changes=changes,
    )
    rows = max(report.source_vocab, report.source_lm_head_rows)
    if rows > vocab:
        report.dropped_rows = [vocab, rows]
        if vlm_tokenizer is None and source.tokenizer_path:
            vlm_tokenizer = try_load_tokenizer(source.tokenizer_path)
        if vlm_tokenizer is not None:
            names = vlm_tokenizer.convert_ids_to_tokens(list(range(vocab, min(rows, vocab + 50))))
            report.dropped_tokens = [t for t in names if t is not None]
    if min(report.source_vocab, report.source_lm_head_rows) < vocab:
        report.padded_rows = vocab - min(report.source_vocab, report.source_lm_head_rows)
        report.pad_source = "base" if pad_from is not None else "zeros"
    base_tied = getattr(base_config, "tie_word_embeddings", None)
    if base_tied is not None and base_tied != tensors.tied:
        report.tie_note += f"; the base is {'tied' if base_tied else 'untied'}: merges must treat lm_head explicitly"
    if text_config.model_type in ("qwen2_vl_text", "qwen2_5_vl_text", "qwen3_vl_text"):
        report.notes.append("M-RoPE -> 1D RoPE: identical for text-only input (three equal position streams)")
    if text_config.model_type == "molmo2_text" and config.model_type == "olmo3":
        report.notes.append("Molmo2 attends over the full context: OLMo-3 sliding window set to "
                            f"{config.sliding_window} (the base windows its sliding layers)")
    return ExtractionPlan(source, config, tensors, report)


class AlignedTensors:
    """A language model's tensors with embed_tokens / lm_head cut or padded to `vocab` rows.

    Rows past the base's vocabulary are the VLM's added tokens (dropped); missing rows are copied from
    `pad_from` (the base's tensors) or zero. `tied`: the result's lm_head equals its embed_tokens, by
    the source's tying (as from_pretrained decides it) unless padding copies rows of an untied base. The
    config flag must match the weights: lm-eval's HFLM calls tie_weights().
    """

    def __init__(self, lm, vocab: int, pad_from=None):
        self.lm, self.vocab, self.pad_from = lm, vocab, pad_from
        self.names = list(lm.names)
        self.tied = lm.tied and (pad_from is None or pad_from.tied or lm.shape(EMBED)[0] >= vocab)

    def shape(self, name: str) -> tuple:
        shape = self.lm.shape(name)
        return (self.vocab, *shape[1:]) if name in (EMBED, HEAD) else shape

    def dtype(self, name: str):
        return self.lm.dtype(name)

    def get(self, name: str):
        # lazy: loads torch, numpy
        import torch

        if name == HEAD and self.tied:
            name = EMBED
        if name not in (EMBED, HEAD):
            return self.lm.get(name)
        rows = self.lm.shape(name)[0]
        if rows >= self.vocab:
            return self.lm.get(name, rows=self.vocab)
        out = torch.empty(self.shape(name), dtype=self.dtype(name))  # filled in place: no second copy
        out[:rows] = self.lm.get(name)
        out[rows:] = self.pad_from.get(name, rows=self.vocab)[rows:] if self.pad_from is not None else 0
        return out


def extract_language_model(vlm, base=None, *, dtype=None, device="cpu", attn_implementation=None, vlm_tokenizer=None):
    """Return (causal_lm, ExtractionReport) for a VLM given as a path, hub id, .gguf or loaded model.

    `base` (a path, config or loaded causal LM) fixes the target class, config and vocabulary size; its rows
    fill any vocabulary padding. From a path only the language model's tensors are read (never the vision
    tower). The causal LM shares tensors with a passed VLM.
    """
    plan = plan_extraction(vlm, base, vlm_tokenizer=vlm_tokenizer)
    return build_causal_lm(plan, dtype=dtype, device=device, attn_implementation=attn_implementation), plan.report


def build_causal_lm(plan: ExtractionPlan, *, dtype=None, device="cpu", attn_implementation=None):
    """The planned causal LM in memory (`dtype`, default float32), its tensors assigned without a second copy."""
    # lazy: loads torch, transformers, numpy
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    dtype = resolve_dtype(dtype)
    kwargs = {"dtype": dtype, **({"attn_implementation": attn_implementation} if attn_implementation else {})}
    with no_init_weights():  # every weight comes from the VLM; skip the random init
        model = AutoModelForCausalLM.from_config(plan.config, **kwargs)
    t = plan.tensors
    state = {n: t.get(n).to(dtype) for n in t.names if not (t.tied and n == HEAD)}
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    missing = [k for k in missing if not (t.tied and k == HEAD)]
    if missing or unexpected:
        raise PairMismatchError(f"VLM language model does not fit {type(model).__name__}: "
                                f"missing {missing[:3]}, unexpected {unexpected[:3]}")
    if t.tied:
        model.tie_weights()
    return model.eval().to(device)


def _is_config(obj) -> bool:
    return hasattr(obj, "model_type") and not hasattr(obj, "state_dict")


def _class_name(source: ModelSource) -> str:
    if source.model is not None:
        return type(source.model).__name__
    return (getattr(source.config, "architectures", None) or [source.config.model_type])[0]


def _causal_class_name(config) -> str:
    # lazy: loads torch, transformers, numpy
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
