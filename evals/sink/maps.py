"""SinkMaps: per-(layer, head) sink statistics over a calibration set, and the driver that computes them."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from sinkstudy import SinkstudyError

FORMAT = "sinkstudy.sink_maps/1"
# Per-query log-odds go into the JSON only up to this many values (L*H*Q); above, only in memory.
JSON_LOGODDS_LIMIT = 4_000_000
TABLE_EPS = 0.3


@dataclass
class SinkMaps:
    """Sink statistics of one model on one calibration set.

    mass           (L, H) mean attention on the sink position, pooled over all counted queries
    mass_per_text  (N, L, H) the same per text
    argmax_key     (N, L, H) per text, the key with the highest mean attention (relative position)
    argmax_mass    (L, H) mean attention on that per-text argmax key, pooled
    logodds        (L, H, Q) log(a/(1-a)) with a = attention of each counted query on its head's
                   argmax key (per text); NaN where the query cannot see that key
    logodds_query  (L, H, Q) the same with each query's own argmax key
    query_text, query_pos  (Q,) text index and relative position of each counted query
    """

    mass: torch.Tensor
    mass_per_text: torch.Tensor
    argmax_key: torch.Tensor
    argmax_mass: torch.Tensor
    logodds: torch.Tensor | None
    logodds_query: torch.Tensor | None
    query_text: torch.Tensor
    query_pos: torch.Tensor
    text_ids: list[str]
    n_tokens: list[int]
    texts_fingerprint: str
    settings: dict[str, Any]
    model: dict[str, Any] = field(default_factory=dict)

    @property
    def num_layers(self) -> int:
        return self.mass.shape[0]

    @property
    def num_heads(self) -> int:
        return self.mass.shape[1]

    @property
    def argmax_mode(self) -> torch.Tensor:
        """(L, H) most frequent per-text argmax key position."""
        return self.argmax_key.mode(dim=0).values

    @property
    def argmax_is_sink(self) -> torch.Tensor:
        """(L, H) share of texts whose argmax key is the sink position."""
        return (self.argmax_key == self.settings["sink_position"]).double().mean(0)

    def layer_table(self, eps: float = TABLE_EPS) -> list[dict[str, Any]]:
        rows = []
        off_sink = self.argmax_mode != self.settings["sink_position"]
        for layer in range(self.num_layers):
            row = {
                "layer": layer,
                "mass_mean": float(self.mass[layer].mean()),
                "mass_max": float(self.mass[layer].max()),
                f"heads_mass>{eps}": int((self.mass[layer] > eps).sum()),
                "heads_argmax_off_sink": int(off_sink[layer].sum()),
            }
            if self.logodds is not None:
                vals = self.logodds[layer].flatten()
                vals = vals[~torch.isnan(vals)]
                row["median_logodds"] = float(vals.double().median()) if vals.numel() else math.nan
            rows.append(row)
        return rows

    def off_sink_heads(self) -> list[tuple[int, int, int]]:
        """(layer, head, position) of heads whose most-attended key is usually not the sink position."""
        mode = self.argmax_mode
        off = (mode != self.settings["sink_position"]).nonzero().tolist()
        return [(layer, head, int(mode[layer, head])) for layer, head in off]

    def format_table(self, eps: float = TABLE_EPS) -> str:
        rows = self.layer_table(eps)
        cols = list(rows[0])
        lines = ["  ".join(f"{c:>14}" for c in cols)]
        for r in rows:
            lines.append("  ".join(f"{r[c]:>14.4f}" if isinstance(r[c], float) else f"{r[c]:>14}" for c in cols))
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        keep = self.logodds is not None and self.logodds.numel() <= JSON_LOGODDS_LIMIT
        return {
            "format": FORMAT,
            "model": self.model,
            "settings": self.settings,
            "text_ids": self.text_ids,
            "n_tokens": self.n_tokens,
            "texts_fingerprint": self.texts_fingerprint,
            "num_layers": self.num_layers,
            "num_heads": self.num_heads,
            "mass": _rounded(self.mass),
            "mass_per_text": _rounded(self.mass_per_text),
            "argmax_key": self.argmax_key.tolist(),
            "argmax_mode": self.argmax_mode.tolist(),
            "argmax_mass": _rounded(self.argmax_mass),
            "layer_table": self.layer_table(),
            "logodds_omitted": not keep,
            "query_text": self.query_text.tolist() if keep else None,
            "query_pos": self.query_pos.tolist() if keep else None,
            "logodds": _rounded(self.logodds) if keep else None,
            "logodds_query": _rounded(self.logodds_query) if keep else None,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any] | str | os.PathLike) -> "SinkMaps":
        if not isinstance(data, dict):
            from sinkstudy.io import read_json

            data = read_json(data)
        if data.get("format") != FORMAT:
            raise SinkstudyError(f"not a sink-maps JSON (format {data.get('format')!r}, expected {FORMAT!r})")
        f64 = lambda x: torch.tensor(_unnull(x), dtype=torch.float64)  # noqa: E731
        f32 = lambda x: None if x is None else torch.tensor(_unnull(x), dtype=torch.float32)  # noqa: E731
        return cls(
            mass=f64(data["mass"]),
            mass_per_text=f64(data["mass_per_text"]),
            argmax_key=torch.tensor(data["argmax_key"], dtype=torch.long),
            argmax_mass=f64(data["argmax_mass"]),
            logodds=f32(data["logodds"]),
            logodds_query=f32(data["logodds_query"]),
            query_text=torch.tensor(data["query_text"] or [], dtype=torch.long),
            query_pos=torch.tensor(data["query_pos"] or [], dtype=torch.long),
            text_ids=list(data["text_ids"]),
            n_tokens=list(data["n_tokens"]),
            texts_fingerprint=data["texts_fingerprint"],
            settings=dict(data["settings"]),
            model=dict(data.get("model") or {}),
        )


def _rounded(t: torch.Tensor):
    # 6 decimals is far below any effect we compare; NaN -> null keeps the file strict JSON.
    def walk(x):
        if isinstance(x, list):
            return [walk(v) for v in x]
        return None if math.isnan(x) else round(x, 6)

    return walk(t.tolist())


def _unnull(x):
    if isinstance(x, list):
        return [_unnull(v) for v in x]
    return math.nan if x is None else x


# ---------------------------------------------------------------- driver


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
    from tqdm.auto import tqdm

    from evals.sink.calibration import encode_texts, resolve_texts, texts_fingerprint
    from evals.sink.capture import capture_layer_stats
    from evals.sink.metrics import DEFAULT_METRIC, get_metric

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
    L = len(model.base_model.layers)
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
