"""Sink Strength: a registry of named scalar definitions over SinkMaps, one entry point.

Default (`logodds`, the seed paper's S): median over (layer, head, query) of log(a / (1 - a)),
a = the attention a query puts on its head's argmax key, over the last 10 layers, query 0
excluded, 15 IFEval-style prompts with the chat template. The others stay available by name.
Per-observation log-odds come clipped to +-LOGODDS_CAP the same way on the fast and the eager path
(an underflowed a counts as -CAP, not as missing; see `evals.sink.capture`), so S does not depend
on the path.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from sinkstudy import SinkstudyError
from evals.sink.calibration import DEFAULT_SET
from evals.sink.maps import SinkMaps

DEFAULT_METRIC = "logodds"


@dataclass(frozen=True)
class SinkMetric:
    name: str
    description: str
    calibration: str  # default shipped calibration set
    skip_queries: int  # default first counted query position
    chat_template: bool  # default: wrap texts in the chat template when the tokenizer has one
    compute: Callable[..., tuple[float, dict[str, Any]]]  # (maps, noise_maps, **params)
    params: dict[str, Any] = field(default_factory=dict)
    needs_noise: bool = False


def _logodds(maps: SinkMaps, noise_maps=None, *, last_layers: int = 10, argmax: str = "head"):
    if argmax not in ("head", "query"):
        raise SinkstudyError(f"argmax must be 'head' or 'query', not {argmax!r}")
    lo = maps.logodds if argmax == "head" else maps.logodds_query
    if lo is None:
        raise SinkstudyError("these sink maps carry no per-query log-odds (omitted from the JSON); recompute them")
    if last_layers < 1:
        raise SinkstudyError("last_layers must be >= 1")
    first = max(0, maps.num_layers - last_layers)
    vals = lo[first:].double().numpy().ravel()
    vals = vals[~np.isnan(vals)]
    if not vals.size:
        raise SinkstudyError("no defined log-odds values to take a median of")
    per_layer = [float(np.nanmedian(lo[i].double().numpy())) for i in range(first, maps.num_layers)]
    q25, q75 = np.percentile(vals, [25, 75])
    details = {"layers": [first, maps.num_layers - 1], "argmax": argmax, "n_values": int(vals.size),
               "iqr": [float(q25), float(q75)], "median_per_layer": per_layer}
    return float(np.median(vals)), details


def _layers_from(maps: SinkMaps, first_layer: int) -> int:
    return first_layer if maps.num_layers > first_layer else 0


def _mass(maps: SinkMaps, noise_maps=None, *, first_layer: int = 1):
    first = _layers_from(maps, first_layer)
    per_layer = maps.mass[first:].mean(-1)
    return float(per_layer.mean()), {"layers": [first, maps.num_layers - 1], "mass_per_layer": per_layer.tolist()}


def _ratio(maps: SinkMaps, noise_maps=None, *, eps: float = 0.3):
    over = maps.mass > eps
    return float(over.double().mean()), {"eps": eps, "sink_heads": int(over.sum()), "heads": over.numel(),
                                         "ratio_per_layer": over.double().mean(-1).tolist()}


def _robustness(maps: SinkMaps, noise_maps: SinkMaps | None, *, first_layer: int = 1, noise_seed: int = 0):
    if noise_maps is None:
        raise SinkstudyError("the robustness metric needs sink maps of the noise-replaced texts")
    text_mass, _ = _mass(maps, first_layer=first_layer)
    noise_mass, _ = _mass(noise_maps, first_layer=first_layer)
    if text_mass <= 0:
        raise SinkstudyError("sink mass on the texts is zero: robustness is undefined")
    return noise_mass / text_mass, {"text_mass": text_mass, "noise_mass": noise_mass, "noise_seed": noise_seed,
                                    "layers": [_layers_from(maps, first_layer), maps.num_layers - 1]}


SINK_METRICS: dict[str, SinkMetric] = {
    "logodds": SinkMetric(
        "logodds", "paper S: median log-odds of attention on each head's argmax key, last 10 layers",
        calibration=DEFAULT_SET, skip_queries=1, chat_template=True, compute=_logodds,
        params={"last_layers": 10, "argmax": "head"}),
    "mass": SinkMetric(
        "mass", "mean attention on the sink position over layers 2..L and all heads",
        calibration="passages64", skip_queries=4, chat_template=False, compute=_mass, params={"first_layer": 1}),
    "ratio@0.3": SinkMetric(
        "ratio@0.3", "Gu et al. (ICLR 2025): share of heads with mean sink attention above eps",
        calibration="passages64", skip_queries=4, chat_template=False, compute=_ratio, params={"eps": 0.3}),
    "robustness": SinkMetric(
        "robustness", "sink mass surviving when text after token 0 becomes random embeddings (noise / text)",
        calibration="passages64", skip_queries=4, chat_template=False, compute=_robustness,
        params={"first_layer": 1, "noise_seed": 0}, needs_noise=True),
}


def get_metric(name: str) -> SinkMetric:
    """A registered metric; `ratio@EPS` works for any EPS in (0, 1)."""
    if name in SINK_METRICS:
        return SINK_METRICS[name]
    match = re.fullmatch(r"ratio@([0-9]*\.?[0-9]+)", name or "")
    if match and 0 < float(match.group(1)) < 1:
        base = SINK_METRICS["ratio@0.3"]
        return SinkMetric(name, base.description, base.calibration, base.skip_queries, base.chat_template,
                          base.compute, {"eps": float(match.group(1))})
    raise SinkstudyError(f"unknown sink metric {name!r}; known: {', '.join(SINK_METRICS)} (ratio@EPS for any EPS in (0, 1))")


@dataclass
class SinkStrength:
    value: float
    metric: str
    details: dict[str, Any]
    maps: SinkMaps
    noise_maps: SinkMaps | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "metric": self.metric,
            "value": None if math.isnan(self.value) else self.value,
            "details": self.details,
            "maps": self.maps.to_json(),
            "noise_maps": self.noise_maps.to_json() if self.noise_maps is not None else None,
        }


def strength_from_maps(maps: SinkMaps, metric: str = DEFAULT_METRIC, noise_maps: SinkMaps | None = None, **params) -> SinkStrength:
    """Evaluate a metric on already computed maps (e.g. loaded with `SinkMaps.from_json`)."""
    spec = get_metric(metric)
    unknown = set(params) - set(spec.params)
    if unknown:
        raise SinkstudyError(f"metric {spec.name} has no parameter(s) {', '.join(sorted(unknown))}; it takes {', '.join(spec.params) or 'none'}")
    value, details = spec.compute(maps, noise_maps, **{**spec.params, **params})
    return SinkStrength(value, spec.name, {"params": {**spec.params, **params}, **details}, maps, noise_maps)
