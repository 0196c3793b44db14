"""Head-selective restore: give back the base's attention projections only for the heads whose
sink the VLM lost.

Heads are ranked by the sink-shift map (`evals.sink.sink_shift(base, vlm)["delta"]`, the change of
sink mass, VLM - base, per layer and head); the `top_k` most negative (largest loss; ties broken
by layer, then head) with a loss of at least `min_loss` are restored.

What is copied for a selected query head h in layer l (rows of the output dim, head_dim each):
- scope "qk" (default): q_proj rows (and bias) of h, and the k_proj rows of h's KV group;
- scope "attn": also v_proj rows of the KV group and o_proj's input columns of h.
GQA: a key/value head is shared by num_heads / num_kv_heads query heads. With kv="group"
(default) the whole KV head is restored as soon as one of its query heads is selected, so the
other query heads of that group see base keys too (the sink is formed by q.k, so the key side
matters); kv="none" restores the query side only and leaves every KV head the VLM's.
Norms inside attention: a full-width q_norm/k_norm (OLMo-2/3) has per-head slices, restored with
the rows; a per-head-dim norm shared by all heads (Qwen3, Gemma3) cannot be split by head and
stays the VLM's (noted in the report).
"""

from __future__ import annotations

import math
from typing import Any, Iterable

from interventions.mitigations import MitigationError, register_mitigation

SCOPES = ("qk", "attn")
KV_MODES = ("group", "none")


def select_heads(delta, top_k: int, min_loss: float = 0.0) -> list[tuple[int, int]]:
    """The top_k (layer, head) pairs with the most negative `delta`, each a loss >= min_loss."""
    # lazy: loads torch, numpy
    import torch

    if top_k < 1:
        raise MitigationError(f"top_k must be >= 1, got {top_k}")
    delta = torch.as_tensor(delta, dtype=torch.float64)
    n_heads = delta.shape[1]
    flat = delta.flatten()
    # Stable sort on the loss keeps (layer, head) order among equal losses.
    order = sorted(range(flat.numel()), key=lambda i: (flat[i].item(), i))
    picked = [i for i in order if -flat[i].item() >= min_loss and flat[i].item() < 0][:top_k]
    return [(i // n_heads, i % n_heads) for i in picked]


def _geometry(model) -> tuple[int, int, int]:
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    n_q = cfg.num_attention_heads
    n_kv = getattr(cfg, "num_key_value_heads", None) or n_q
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_q
    return n_q, n_kv, head_dim


def restore_heads(base, target, heads: Iterable[tuple[int, int]], *, scope: str = "qk", kv: str = "group") -> dict[str, Any]:
    """Copy the base's projection slices of `heads` into `target` in place; returns a report."""
    if scope not in SCOPES:
        raise MitigationError(f"scope must be one of {', '.join(SCOPES)}, got {scope!r}")
    if kv not in KV_MODES:
        raise MitigationError(f"kv must be one of {', '.join(KV_MODES)}, got {kv!r}")
    n_q, n_kv, hd = _geometry(target)
    group = n_q // n_kv
    layers_b, layers_t = base.get_decoder().layers, target.get_decoder().layers
    heads = sorted(set(heads))
    for layer, head in heads:
        if not (0 <= layer < len(layers_t) and 0 <= head < n_q):
            raise MitigationError(f"head ({layer}, {head}) outside the model ({len(layers_t)} layers x {n_q} heads)")
    notes, kv_restored = [], set()

    def copy_rows(name: str, index: int, width: int, attn_b, attn_t) -> None:
        src, dst = getattr(attn_b, name, None), getattr(attn_t, name, None)
        if dst is None:
            return
        rows = slice(index * width, (index + 1) * width)
        for p in ("weight", "bias"):
            if getattr(dst, p, None) is not None:
                getattr(dst, p)[rows] = getattr(src, p)[rows]

    for layer, head in heads:
        attn_b, attn_t = layers_b[layer].self_attn, layers_t[layer].self_attn
        copy_rows("q_proj", head, hd, attn_b, attn_t)
        if scope == "attn":
            attn_t.o_proj.weight[:, head * hd:(head + 1) * hd] = attn_b.o_proj.weight[:, head * hd:(head + 1) * hd]
        g = head // group
        if kv == "group" and (layer, g) not in kv_restored:
            kv_restored.add((layer, g))
            copy_rows("k_proj", g, hd, attn_b, attn_t)
            if scope == "attn":
                copy_rows("v_proj", g, hd, attn_b, attn_t)
        for norm, index, count in (("q_norm", head, n_q), ("k_norm", g, n_kv)):
            module = getattr(attn_t, norm, None)
            if module is None or (norm == "k_norm" and kv == "none"):
                continue
            if module.weight.numel() == count * hd:  # full-width norm: per-head slices exist
                copy_rows(norm, index, hd, attn_b, attn_t)
            elif f"{norm} shared across heads: kept the VLM's" not in notes:
                notes.append(f"{norm} shared across heads: kept the VLM's")
    return {
        "heads": [list(h) for h in heads],
        "kv_heads_restored": sorted([list(x) for x in kv_restored]),
        "scope": scope,
        "kv": kv,
        "gqa_group_size": group,
        "notes": notes,
    }


def validate(config: dict[str, Any]) -> None:
    if not isinstance(config["top_k"], int) or isinstance(config["top_k"], bool) or config["top_k"] < 1:
        raise MitigationError(f"top_k must be a positive integer, got {config['top_k']!r}")
    min_loss = config["min_loss"]
    if isinstance(min_loss, bool) or not isinstance(min_loss, (int, float)) or not math.isfinite(min_loss) or min_loss < 0:
        raise MitigationError(f"min_loss must be a finite number >= 0, got {min_loss!r}")
    if config["scope"] not in SCOPES:
        raise MitigationError(f"scope must be one of {', '.join(SCOPES)}, got {config['scope']!r}")
    if config["kv"] not in KV_MODES:
        raise MitigationError(f"kv must be one of {', '.join(KV_MODES)}, got {config['kv']!r}")


@register_mitigation("head_restore", needs_sink_maps=True, validate=validate,
                     defaults={"top_k": 8, "scope": "qk", "kv": "group", "min_loss": 0.0})
def head_restore(base, vlm_lm, sink_maps, config):
    """Restore the base's q/k (or whole attention) slices of the top-k heads whose sink mass the VLM lost."""
    delta = sink_maps["shift"]["delta"]
    heads = select_heads(delta, int(config["top_k"]), float(config["min_loss"]))
    report = restore_heads(base, vlm_lm, heads, scope=config["scope"], kv=config["kv"])
    report["sink_mass_delta"] = [float(delta[l][h]) for l, h in heads]
    if not heads:
        report["notes"].append("no head lost sink mass: nothing restored")
    return vlm_lm, report
