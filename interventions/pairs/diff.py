"""Per-tensor relative weight change ||W_other - W_base|| / ||W_base|| (Frobenius), grouped for tables."""

from __future__ import annotations

import math
import re

from tqdm.auto import tqdm

from interventions.pairs.layout import compare_layouts
from interventions.pairs.tensors import HEAD, ModelTensors

GROUPS = ("q", "k", "v", "o", "mlp", "norm", "embed", "lm_head", "other")
_LAYER = re.compile(r"\.layers\.(\d+)\.")


def group_of(name: str) -> str:
    if name.startswith("lm_head."):
        return "lm_head"
    if "embed_tokens" in name:
        return "embed"
    m = re.search(r"\.([qkvo])_proj\.", name)
    if m:
        return m.group(1)
    if ".mlp." in name:
        return "mlp"
    if "norm" in name:  # input/post-attention layernorms, q_norm/k_norm, final norm
        return "norm"
    return "other"


def weight_diff(base, other, *, dtype=None, device=None, progress: bool = False) -> list[dict]:
    """One row per base tensor: name, module, layer (None outside decoder layers), group, shape, norms, rel_change.

    `base` / `other`: loaded causal LMs, or tensor views (`plan_extraction(...).tensors`,
    `tensors_of(resolve(path))`) that read one tensor at a time: one tensor of each model is in memory.
    The two must share names and shapes (PairMismatchError otherwise). `dtype` casts both first (default:
    each as stored); sums run in float32/float64 either way. lm_head tied to the embeddings in both models
    is skipped. rel_change is None where ||W_base|| = 0.
    """
    a, b = _view(base), _view(other)
    compare_layouts({n: a.shape(n) for n in a.names}, {n: b.shape(n) for n in b.names}, names=("base", "other"))
    rows = []
    for name in tqdm(a.names, desc="weight diff", disable=not progress):
        if name == HEAD and a.tied and b.tied:
            continue  # tied in both: counted as the embedding
        wa, wb = _cast(a.get(name), dtype, device), _cast(b.get(name), dtype, device)
        base_norm, diff_norm = _norms(wa.detach(), wb.detach().to(wa.device))
        m = _LAYER.search(name)
        rows.append({
            "name": name,
            "module": name.rsplit(".", 1)[0],
            "layer": int(m.group(1)) if m else None,
            "group": group_of(name),
            "shape": list(wa.shape),
            "base_norm": base_norm,
            "diff_norm": diff_norm,
            "rel_change": diff_norm / base_norm if base_norm > 0 else None,
        })
    return rows


def _view(obj):
    if hasattr(obj, "state_dict"):
        return ModelTensors(obj, obj.config, obj.config.model_type)
    return obj


def _cast(t, dtype, device):
    return t.to(device=device or t.device, dtype=dtype or t.dtype)


def _norms(wa, wb, chunk: int = 1 << 22) -> tuple[float, float]:
    """(||W_a||, ||W_b - W_a||), accurate and with little extra memory.

    One float32 norm is not safe at this size: torch 2.13 CPU `.float().norm()` of a random
    152064 x 3584 embedding gave 417.96 against 466.93 exact. Here float32 sums run over rows of
    65,536 elements and are added in float64 (relative error ~1e-8, about 2x faster than float64).
    """
    a, b = wa.reshape(-1), wb.reshape(-1)
    base2 = diff2 = 0.0
    for i in range(0, a.numel(), chunk):
        ca, cb = a[i:i + chunk].float(), b[i:i + chunk].float()
        base2 += _sum_squares(ca)
        diff2 += _sum_squares(cb - ca)  # not in place: .float() of a float32 tensor is the tensor itself
    return math.sqrt(base2), math.sqrt(diff2)


def _sum_squares(x, row: int = 1 << 16) -> float:
    n = x.numel() // row * row
    return float(x[:n].view(-1, row).square().sum(1).double().sum()) + float(x[n:].double().square().sum())


def diff_summary(rows: list[dict]) -> list[dict]:
    """Aggregate rows per (layer, group): sqrt(sum diff^2) / sqrt(sum base^2), in layer order."""
    acc: dict[tuple, list[float]] = {}
    for r in rows:
        d, bn = acc.setdefault((r["layer"], r["group"]), [0.0, 0.0])
        acc[(r["layer"], r["group"])] = [d + r["diff_norm"] ** 2, bn + r["base_norm"] ** 2]
    out = []
    for (layer, group), (d2, b2) in sorted(acc.items(), key=lambda kv: (_layer_key(kv[0][0]), GROUPS.index(kv[0][1]))):
        out.append({"layer": layer, "group": group, "rel_change": math.sqrt(d2 / b2) if b2 > 0 else None})
    return out


def format_diff_table(rows: list[dict]) -> str:
    """A layer x group table of relative change; the non-layer tensors (embeddings, final norm, head) first."""
    summary = diff_summary(rows)
    cols = [g for g in GROUPS if any(s["group"] == g for s in summary)]
    layers = sorted({s["layer"] for s in summary}, key=_layer_key)
    cell = {(s["layer"], s["group"]): s["rel_change"] for s in summary}
    lines = ["layer  " + "".join(f"{c:>10}" for c in cols)]
    for layer in layers:
        label = "-" if layer is None else str(layer)
        vals = "".join(f"{_fmt(cell[(layer, c)]) if (layer, c) in cell else '':>10}" for c in cols)
        lines.append(f"{label:<7}{vals}")
    return "\n".join(lines)


def _fmt(x) -> str:
    return "n/a" if x is None else f"{x:.4f}"


def _layer_key(layer):
    return -1 if layer is None else layer
