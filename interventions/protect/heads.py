"""Which heads a protection acts on: the one selection rule all protections share, and where a head's
rows live in the attention projections.

A rule is an explicit list of [layer, head] pairs, or a mapping

    {by: strength | mass, top_k: K | null, threshold: T | null, layers: [FIRST, LAST] | null}

over the base's sink maps (`evals.sink.SinkMaps`, measured once before training):
- `strength`: the head's Sink Strength, the median over counted queries and calibration texts of
  log(a / (1 - a)), a = the query's attention on the head's argmax key (the paper's S, per head);
- `mass`: the head's mean attention on the sink position (Gu et al.'s per-head quantity).
Heads in `layers` (inclusive; negative counts from the end; default all) whose statistic is at
least `threshold` (default: no threshold) are ranked by it, highest first (ties: lower layer, then
lower head), and the first `top_k` (default: all) are chosen. At least one of top_k / threshold.

A ranking always finds its top heads, also in a model without an attention sink. A chosen head is a
*sink head* when its mean attention on the sink position exceeds 0.3 (Gu et al.'s epsilon, the
`ratio@0.3` metric's); a selection that chose other heads logs a warning naming them (the run goes
on: acting on the strongest heads of a sinkless model is a legitimate arm, e.g. a control of a
protection's mechanism), and `describe` marks each head. To act on sink heads only, select with
`{by: mass, threshold: 0.3}`: a model without one is then refused.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch

from evals.sink.maps import TABLE_EPS
from sinkstudy import SinkstudyError

HEAD_STATISTICS = ("strength", "mass")
DEFAULT_RULE = {"by": "strength", "top_k": 4}
_RULE_KEYS = {"by", "top_k", "threshold", "layers"}
SINK_HEAD_MASS = TABLE_EPS  # a sink head's mean attention on the sink position exceeds this (Gu et al.'s epsilon)
log = logging.getLogger(__name__)


def validate_heads(rule: Any) -> None:
    """Check a rule without sink maps (one line naming the problem)."""
    if isinstance(rule, list):
        if not rule or not all(isinstance(x, (list, tuple)) and len(x) == 2 and all(_is_int(v) and v >= 0 for v in x) for x in rule):
            raise SinkstudyError(f"heads: an explicit list is [[layer, head], ...] with integers >= 0, got {rule!r}")
        return
    if not isinstance(rule, dict):
        raise SinkstudyError(f"heads: a list of [layer, head] pairs or a mapping {{by, top_k, threshold, layers}}, got {rule!r}")
    unknown = set(rule) - _RULE_KEYS
    if unknown:
        raise SinkstudyError(f"heads: unknown key(s) {', '.join(sorted(unknown))}; allowed: {', '.join(sorted(_RULE_KEYS))}")
    if rule.get("by", "strength") not in HEAD_STATISTICS:
        raise SinkstudyError(f"heads.by: one of {', '.join(HEAD_STATISTICS)}, got {rule.get('by')!r}")
    top_k, threshold = rule.get("top_k"), rule.get("threshold")
    if top_k is None and threshold is None:
        raise SinkstudyError("heads: give top_k, threshold or both")
    if top_k is not None and (not _is_int(top_k) or top_k < 1):
        raise SinkstudyError(f"heads.top_k: a positive integer, got {top_k!r}")
    if threshold is not None and (isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not math.isfinite(threshold)):
        raise SinkstudyError(f"heads.threshold: a finite number, got {threshold!r}")
    layers = rule.get("layers")
    if layers is not None and (not isinstance(layers, (list, tuple)) or len(layers) != 2 or not all(_is_int(v) for v in layers)):
        raise SinkstudyError(f"heads.layers: [first, last] (inclusive; negative counts from the end), got {layers!r}")


def head_statistic(maps, by: str) -> torch.Tensor:
    """(L, H) per-head statistic of the sink maps: `strength` (median log-odds) or `mass`."""
    if by == "mass":
        return maps.mass.double()
    if by != "strength":
        raise SinkstudyError(f"unknown head statistic {by!r}; choose from {', '.join(HEAD_STATISTICS)}")
    if maps.logodds is None:
        raise SinkstudyError("these sink maps carry no per-query log-odds; recompute them (not from a trimmed JSON)")
    return maps.logodds.double().nanmedian(dim=-1).values


def select_heads(maps, rule: Any = None) -> list[tuple[int, int]]:
    """The (layer, head) pairs `rule` chooses on `maps`, in (layer, head) order; raises if none, warns
    when some are no sink heads."""
    rule = DEFAULT_RULE if rule is None else rule
    validate_heads(rule)
    n_layers, n_heads = maps.num_layers, maps.num_heads
    if isinstance(rule, list):
        heads = sorted({(int(a), int(b)) for a, b in rule})
        outside = [h for h in heads if h[0] >= n_layers or h[1] >= n_heads]
        if outside:
            raise SinkstudyError(f"heads {outside} outside the model ({n_layers} layers x {n_heads} heads)")
        warn_unless_sink_heads(maps, heads, rule)
        return heads
    stat = head_statistic(maps, rule.get("by", "strength"))
    first, last = rule.get("layers") or (0, n_layers - 1)
    first, last = first % n_layers if first < 0 else first, last % n_layers if last < 0 else last
    candidates = [(float(stat[layer, head]), layer, head) for layer in range(first, min(last, n_layers - 1) + 1)
                  for head in range(n_heads) if not math.isnan(float(stat[layer, head]))]
    if rule.get("threshold") is not None:
        candidates = [c for c in candidates if c[0] >= rule["threshold"]]
    candidates.sort(key=lambda c: (-c[0], c[1], c[2]))
    chosen = candidates[: rule.get("top_k") or len(candidates)]
    if not chosen:
        raise SinkstudyError(f"no head passes the selection {rule} (max {rule.get('by', 'strength')} "
                             f"{float(stat.nan_to_num(-math.inf).max()):.3f})")
    heads = sorted((layer, head) for _, layer, head in chosen)
    warn_unless_sink_heads(maps, heads, rule)
    return heads


def is_sink_head(maps, layer: int, head: int) -> bool:
    return float(maps.mass[layer, head]) > SINK_HEAD_MASS


def warn_unless_sink_heads(maps, heads: list[tuple[int, int]], rule: Any) -> str | None:
    """Log (and return) one warning line when some of `heads` are no sink heads; None when all are."""
    others = [h for h in heads if not is_sink_head(maps, *h)]
    if not others:
        return None
    sinks = int((maps.mass > SINK_HEAD_MASS).sum())
    strength = head_statistic(maps, "strength")
    listed = ", ".join(f"L{layer}H{head} (S {float(strength[layer, head]):.2f}, mass {float(maps.mass[layer, head]):.2f})"
                       for layer, head in others)
    model = (f"this model has no sink head (highest mass {float(maps.mass.max()):.2f}): a protection of sink heads has none to act on"
             if not sinks else f"the model has {sinks} sink head(s); {{by: mass, threshold: {SINK_HEAD_MASS}}} selects them alone")
    message = (f"{len(others)} of the {len(heads)} heads chosen by {rule} are no sink heads (mean attention on the sink "
               f"position <= {SINK_HEAD_MASS}): {listed}; {model}")
    said = maps.__dict__.setdefault("_said", set())  # once per run: each stage of an adaptation selects again on the same maps
    if message not in said:
        said.add(message)
        log.warning(message)
    return message


def describe(maps, heads: list[tuple[int, int]]) -> list[dict]:
    """The chosen heads with both statistics and whether each is a sink head, for reports."""
    strength, mass = head_statistic(maps, "strength"), head_statistic(maps, "mass")
    return [{"layer": layer, "head": head, "strength": round(float(strength[layer, head]), 4),
             "mass": round(float(mass[layer, head]), 4), "sink_head": is_sink_head(maps, layer, head)} for layer, head in heads]


def geometry(decoder) -> tuple[int, int, int]:
    """(query heads, key/value heads, head_dim) of a text decoder."""
    cfg = decoder.config
    n_q = cfg.num_attention_heads
    n_kv = getattr(cfg, "num_key_value_heads", None) or n_q
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_q
    return n_q, n_kv, head_dim


def kv_group(decoder, head: int) -> int:
    n_q, n_kv, _ = geometry(decoder)
    return head // (n_q // n_kv)


def head_rows(decoder, layer: int, head: int) -> dict[str, Any]:
    """Where head `head` of `layer` lives: its attention module, its q_proj rows and its KV group's
    k_proj rows (GQA: a key head is shared by num_heads / num_kv_heads query heads)."""
    _, _, hd = geometry(decoder)
    group = kv_group(decoder, head)
    attn = decoder.layers[layer].self_attn
    return {"attn": attn, "group": group, "q": slice(head * hd, (head + 1) * hd), "k": slice(group * hd, (group + 1) * hd)}


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
