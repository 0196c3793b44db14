"""Sink shift between two models measured on the same calibration texts (base vs VLM LM, merged...)."""

from __future__ import annotations

import math
from typing import Any


from sinkstudy import SinkstudyError
from evals.sink.maps import SinkMaps

LOST_EPS = 0.3  # a base head is a sink head above this mass (Gu et al.'s eps); it lost it at or below


def sink_shift(maps_a: SinkMaps, maps_b: SinkMaps, *, eps: float = LOST_EPS) -> dict[str, Any]:
    """Per-head change of sink mass from model A (base) to model B.

    Returns `delta` (L x H tensor, B - A; head-selective mitigations rank heads by it), per-layer
    mean delta, the fraction of A's sink heads (mass > eps) whose mass in B is <= eps, and the
    Pearson and Spearman correlations (scipy) of the two flattened maps.
    """
    # lazy: loads scipy
    from scipy import stats

    if maps_a.mass.shape != maps_b.mass.shape:
        raise SinkstudyError(f"sink maps differ in shape: {tuple(maps_a.mass.shape)} vs {tuple(maps_b.mass.shape)} (layers x heads)")
    a, b = maps_a.mass.double(), maps_b.mass.double()
    delta = b - a
    base_sinks = a > eps
    lost = base_sinks & (b <= eps)
    n_base = int(base_sinks.sum())
    x, y = a.flatten().numpy(), b.flatten().numpy()
    constant = x.std() == 0 or y.std() == 0  # correlation undefined
    pearson = (math.nan, math.nan) if constant else tuple(map(float, stats.pearsonr(x, y)))
    spearman = (math.nan, math.nan) if constant else tuple(map(float, stats.spearmanr(x, y)))
    return {
        "delta": delta,
        "delta_per_layer": delta.mean(-1).tolist(),
        "mean_delta": float(delta.mean()),
        "eps": eps,
        "base_sink_heads": n_base,
        "lost_sink_heads": int(lost.sum()),
        "lost_fraction": (int(lost.sum()) / n_base) if n_base else None,
        "lost_heads": [[int(l), int(h)] for l, h in lost.nonzero().tolist()],
        "pearson": {"r": _none(pearson[0]), "p": _none(pearson[1])},
        "spearman": {"rho": _none(spearman[0]), "p": _none(spearman[1])},
        "same_texts": maps_a.texts_fingerprint == maps_b.texts_fingerprint,
    }


def _none(x: float):
    return None if math.isnan(x) else x
