"""Measuring a model: sink maps over calibration texts (`compute_sink_maps`) and Sink Strength in
one call (`sink_strength`). The layers below: `capture` (one forward pass), `calibration` (texts),
`maps` (the result), `metrics` (scalars over maps).
"""

from __future__ import annotations

import inspect
import math
from typing import Any

import torch
from tqdm.auto import tqdm

from evals.sink.calibration import encode_texts, resolve_texts, texts_fingerprint
from evals.sink.capture import attention_layers, capture_layer_stats
from evals.sink.maps import SinkMaps
from evals.sink.metrics import DEFAULT_METRIC, SinkStrength, get_metric, strength_from_maps
from sinkstudy import SinkstudyError


def compute_sink_maps(
    model,
    tokenizer,
    texts=None,
    *,
    metric: str | None = None,
    sink_position: int = 0,
    skip_queries: int | None = None,
    max_length: int = 512,
    method: str = "fast",
    apply_chat_template: bool | None = None,
    batch_size: int = 1,
    noise_seed: int | None = None,
    progress: bool = True,
) -> SinkMaps:
    """Sink maps of a causal LM over calibration texts.

    texts: None (the metric's default shipped set), a shipped set name, a file path, or a list of
    strings / {"id", "text"} dicts. `metric` (default: the paper's log-odds) supplies the defaults
    for texts, `skip_queries` and `apply_chat_template` (None = that default; the log-odds metric
    uses the chat template when the tokenizer has one). Queries at relative positions below
    `skip_queries` are not counted. Batches are left padded (`batch_size` > 1). `noise_seed`
    replaces every token after the first by random embeddings matched per dimension to the
    embedding table's mean and std (the robustness form).
    """
    L = len(attention_layers(model))  # an unsupported architecture fails here, before any work
    spec = get_metric(metric or DEFAULT_METRIC)
    if method not in ("fast", "eager"):
        raise SinkstudyError(f"unknown method {method!r}; choose 'fast' or 'eager'")
    skip = spec.skip_queries if skip_queries is None else int(skip_queries)
    if skip < 0 or sink_position < 0 or batch_size < 1 or max_length < 2:
        raise SinkstudyError("skip_queries and sink_position must be >= 0, batch_size >= 1, max_length >= 2")
    has_template = bool(getattr(tokenizer, "chat_template", None))
    use_template = (spec.chat_template and has_template) if apply_chat_template is None else bool(apply_chat_template)
    if use_template and not has_template:
        raise SinkstudyError("apply_chat_template=True but the tokenizer has no chat template")
    items, source = resolve_texts(texts, spec.calibration)
    ids = encode_texts(tokenizer, items, apply_chat_template=use_template, max_length=max_length)
    if all(len(s) <= max(skip, sink_position) for s in ids):
        raise SinkstudyError(f"every text is too short to count a query after skip_queries={skip}")
    device = next(model.parameters()).device
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    H = model.config.num_attention_heads
    N = len(ids)
    mass_sum = torch.zeros(L, H, dtype=torch.float64)
    argmax_sum = torch.zeros(L, H, dtype=torch.float64)
    counted = 0
    mass_per_text = torch.full((N, L, H), math.nan, dtype=torch.float64)
    argmax_key = torch.zeros(N, L, H, dtype=torch.long)
    lo_head, lo_query, q_text, q_pos = [], [], [], []
    noise = _noise_stats(model) if noise_seed is not None else None
    starts = range(0, N, batch_size)
    for start in tqdm(starts, desc="sink maps", unit="batch", disable=not progress):
        batch = list(range(start, min(N, start + batch_size)))
        T = max(len(ids[n]) for n in batch)
        input_ids = torch.full((len(batch), T), pad_id, dtype=torch.long)
        attention_mask = torch.zeros(len(batch), T, dtype=torch.long)
        for row, n in enumerate(batch):
            input_ids[row, T - len(ids[n]):] = torch.tensor(ids[n])
            attention_mask[row, T - len(ids[n]):] = 1
        inputs = {"input_ids": input_ids.to(device)}
        if noise is not None:
            inputs = {"inputs_embeds": _noised_embeddings(model, input_ids, attention_mask, batch, noise, noise_seed).to(device)}
        layers = capture_layer_stats(model, **inputs, attention_mask=attention_mask.to(device), sink_position=sink_position,
                                     skip_queries=skip, method=method)
        for row, n in enumerate(batch):
            offset = T - len(ids[n])
            pos = torch.arange(skip, len(ids[n]))
            if not len(pos):
                continue
            cols = pos + offset
            p_sink = torch.stack([ly["p_sink"][row][:, cols] for ly in layers])  # (L, H, q)
            kstar = torch.stack([ly["head_argmax"][row] for ly in layers])  # (L, H)
            on_argmax = torch.stack([ly["colsum"][row].gather(-1, ly["head_argmax"][row][:, None]).squeeze(-1) for ly in layers])
            mass_sum += p_sink.sum(-1)
            argmax_sum += on_argmax
            counted += len(pos)
            mass_per_text[n] = p_sink.mean(-1)
            argmax_key[n] = kstar - offset
            lo_head.append(torch.stack([ly["logodds_head"][row][:, cols] for ly in layers]).float())
            lo_query.append(torch.stack([ly["logodds_query"][row][:, cols] for ly in layers]).float())
            q_text.append(torch.full((len(pos),), n))
            q_pos.append(pos)
    settings = {
        "metric": spec.name,
        "calibration": source,
        "sink_position": sink_position,
        "skip_queries": skip,
        "max_length": max_length,
        "method": method,
        "apply_chat_template": use_template,
        "batch_size": batch_size,
        "noise_seed": noise_seed,
        "argmax_convention": "per text and head: key with the highest mean attention over counted queries",
        "dtype_statistics": "float32 logits, float64 accumulation",
    }
    return SinkMaps(
        mass=mass_sum / counted,
        mass_per_text=mass_per_text,
        argmax_key=argmax_key,
        argmax_mass=argmax_sum / counted,
        logodds=torch.cat(lo_head, -1),
        logodds_query=torch.cat(lo_query, -1),
        query_text=torch.cat(q_text),
        query_pos=torch.cat(q_pos),
        text_ids=[t.id for t in items],
        n_tokens=[len(s) for s in ids],
        texts_fingerprint=texts_fingerprint(items),
        settings=settings,
        model=model_info(model),
    )


def model_info(model) -> dict[str, Any]:
    cfg = model.config
    return {
        "name_or_path": getattr(cfg, "_name_or_path", "") or "",
        "model_type": cfg.model_type,
        "num_layers": cfg.num_hidden_layers,
        "num_heads": cfg.num_attention_heads,
        "num_kv_heads": getattr(cfg, "num_key_value_heads", None),
        "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
    }


def _noise_stats(model) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-dimension mean and std of the embedding table, as the embedding layer outputs them."""
    emb = model.get_input_embeddings()
    w = emb.weight.detach().float()
    scale = getattr(emb, "embed_scale", 1.0)  # Gemma scales embeddings by sqrt(d) in forward
    scale = float(scale) if not torch.is_tensor(scale) else float(scale.float())
    return w.mean(0) * scale, w.std(0) * scale


def _noised_embeddings(model, input_ids, attention_mask, batch, noise, seed) -> torch.Tensor:
    emb = model.get_input_embeddings()
    dev = emb.weight.device
    with torch.no_grad():
        embeds = emb(input_ids.to(dev)).float().cpu()
    mu, sd = (x.cpu() for x in noise)
    for row, n in enumerate(batch):
        first = int((attention_mask[row] == 0).sum())
        length = input_ids.shape[1] - first - 1
        gen = torch.Generator().manual_seed(int(seed) * 100_003 + n)  # per text: independent of batching
        embeds[row, first + 1:] = mu + sd * torch.randn(length, mu.shape[0], generator=gen)
    return embeds.to(emb.weight.dtype)


def sink_strength(model, tokenizer, metric: str = DEFAULT_METRIC, texts=None, **kw) -> SinkStrength:
    """Sink Strength of a model: computes the maps the metric needs, then the scalar.

    Keyword arguments are the metric's parameters (e.g. `last_layers`, `argmax`, `eps`,
    `noise_seed`) and `compute_sink_maps` options (`method`, `batch_size`, `max_length`, ...).
    """
    spec = get_metric(metric)
    params = {k: kw.pop(k) for k in list(kw) if k in spec.params}
    allowed = set(inspect.signature(compute_sink_maps).parameters) - {"model", "tokenizer", "texts", "metric", "noise_seed"}
    unknown = set(kw) - allowed
    if unknown:
        raise SinkstudyError(f"unknown option(s) {', '.join(sorted(unknown))} for metric {spec.name}; "
                             f"metric parameters: {', '.join(spec.params) or 'none'}; map options: {', '.join(sorted(allowed))}")
    maps = compute_sink_maps(model, tokenizer, texts, metric=spec.name, **kw)
    noise_maps = None
    if spec.needs_noise:
        seed = params.get("noise_seed", spec.params["noise_seed"])
        noise_maps = compute_sink_maps(model, tokenizer, texts, metric=spec.name, noise_seed=seed, **kw)
    return strength_from_maps(maps, spec.name, noise_maps, **params)
