"""SinkMaps: per-(layer, head) sink statistics of one model over a calibration set, and their JSON form.

`evals.sink.measure.compute_sink_maps` computes them; this module only holds and serialises them.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from sinkstudy import SinkstudyError
from sinkstudy.io import read_json

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
