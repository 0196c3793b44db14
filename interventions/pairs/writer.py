"""Write causal-LM checkpoints: an extraction plan streamed shard by shard, or a loaded model.

`write_language_model` never holds more than one output shard: each tensor is read from the source
checkpoint (memory-mapped), converted to the output dtype, and the shard is written and freed before
the next one is read. Both writers are atomic and record provenance in `sinkstudy_extraction.json`.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

from tqdm.auto import tqdm

from interventions.pairs.extract import ExtractionPlan
from interventions.pairs.resolve import resolve_dtype
from interventions.pairs.tensors import HEAD
from sinkstudy.checkpoint import SAFE_INDEX, SAFE_WEIGHTS
from sinkstudy.io import atomic_output_dir, check_output_dir, write_json_atomic, write_text_atomic
from sinkstudy.provenance import model_fingerprint, provenance, state_dict_fingerprint

EXTRACTION_JSON = "sinkstudy_extraction.json"
DEFAULT_MAX_SHARD_BYTES = 1 << 30  # the peak memory of a streamed extraction is about one output shard


def write_language_model(plan: ExtractionPlan, out, *, tokenizer=None, dtype=None, replace: bool = False,
                         max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, extra: dict | None = None,
                         progress: bool = False) -> Path:
    """Stream the planned language model to `out` as sharded safetensors (+ index), config and tokenizer.

    `dtype` defaults to the source checkpoint's own dtype. Refuses an existing `out` unless `replace`.
    """
    # lazy: loads torch, transformers, numpy
    import torch
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    dtype = plan.source.dtype if dtype is None else resolve_dtype(dtype)
    out = check_output_dir(out, replace)
    t = plan.tensors
    names = [n for n in t.names if not (t.tied and n == HEAD)]  # a tied head is the embedding: saved once
    itemsize = torch.empty((), dtype=dtype).element_size()
    sizes = {n: math.prod(t.shape(n)) * itemsize for n in names}
    shards = _shards(names, sizes, max_shard_bytes)
    with atomic_output_dir(out, replace=replace) as tmp:
        weight_map = {}
        with tqdm(total=len(names), desc="writing the language model", unit="tensor", disable=not progress) as bar:
            for i, shard in enumerate(shards, 1):
                file = SAFE_WEIGHTS if len(shards) == 1 else f"model-{i:05d}-of-{len(shards):05d}.safetensors"
                tensors = {}
                for name in shard:
                    tensors[name] = t.get(name).to(dtype).contiguous()
                    bar.update()
                save_file(tensors, tmp / file, metadata={"format": "pt"})
                del tensors
                weight_map.update(dict.fromkeys(shard, file))
        if len(shards) > 1:
            write_text_atomic(tmp / SAFE_INDEX, json.dumps(
                {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}, indent=2) + "\n")
        config = copy.deepcopy(plan.config)
        config.dtype = dtype
        config.architectures = [plan.report.target_class]
        config.save_pretrained(tmp)
        GenerationConfig.from_model_config(config).save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        _write_provenance(tmp, plan.report.target_class, model_fingerprint(tmp), extra)  # as downstream sees the files
    return out


def save_causal_lm(model, tokenizer, out, *, replace: bool = False, extra: dict | None = None) -> Path:
    """Write a loaded model as an HF checkpoint (safetensors + config + tokenizer) atomically, with provenance JSON."""
    out = check_output_dir(out, replace)
    with atomic_output_dir(out, replace=replace) as tmp:
        model.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        _write_provenance(tmp, type(model).__name__, state_dict_fingerprint(model), extra)
    return out


def _write_provenance(tmp: Path, model_class: str, fingerprint: str, extra: dict | None) -> None:
    write_json_atomic(tmp / EXTRACTION_JSON, {
        "model_class": model_class,
        "provenance": provenance(model_fingerprint=fingerprint, **(extra or {})),
    })


def _shards(names: list[str], sizes: dict[str, int], limit: int) -> list[list[str]]:
    """Consecutive groups of at most `limit` bytes (a larger tensor gets a shard of its own)."""
    shards, current, used = [], [], 0
    for name in names:
        if current and used + sizes[name] > limit:
            shards.append(current)
            current, used = [], 0
        current.append(name)
        used += sizes[name]
    return shards + ([current] if current else [])
