"""Freezing protections: the layers below the first sink layer, or the q/k rows of the sink heads.

`freeze_below_sink`: the first sink layer is the first decoder layer whose per-layer statistic of
the base's sink maps reaches `threshold`:
    max_mass         the largest per-head mean attention on the sink position in the layer
                     (default, threshold 0.3: the layer has a sink head in Gu et al.'s sense, eps = 0.3)
    mean_mass        the layer's mean sink mass over heads
    median_logodds   the layer's median log-odds on each head's argmax key (the paper's S, per layer)
    sink_head_share  the share of the layer's heads with sink mass > 0.3
Every parameter of the decoder layers below it is frozen (`requires_grad = False`: out of the
optimizer, bit-identical under AdamW weight decay), and the input embeddings with them when
`embeddings` is true (they are below layer 0). The chosen layer and the statistic per layer are
logged and reported; a base without a sink layer freezes nothing and says so.

`sink_head_freeze`: the q_proj rows (and bias) of the selected heads and, with `keys: true`, the
k_proj rows of their KV groups (GQA: shared with the group's other query heads) keep their values
bit for bit: their gradient is zeroed after backward (so the clip norm ignores it) and the rows are
restored after every optimizer step (AdamW's decoupled weight decay moves every trained tensor).
Norm gains shared by all heads of a layer (Qwen3's q_norm / k_norm) cannot be split by head: they
stay trainable, as the report notes.
"""

from __future__ import annotations

import math

import torch

from interventions.protect import Protection, register_protection
from interventions.protect.heads import DEFAULT_RULE, describe, head_rows, select_heads, validate_heads
from sinkstudy import SinkstudyError

LAYER_STATISTICS = ("max_mass", "mean_mass", "median_logodds", "sink_head_share")
SINK_HEAD_EPS = 0.3


def layer_statistic(maps, statistic: str) -> list[float]:
    """Per decoder layer, the statistic `freeze_below_sink` compares with its threshold."""
    if statistic == "max_mass":
        return maps.mass.double().amax(-1).tolist()
    if statistic == "mean_mass":
        return maps.mass.double().mean(-1).tolist()
    if statistic == "sink_head_share":
        return (maps.mass > SINK_HEAD_EPS).double().mean(-1).tolist()
    if statistic == "median_logodds":
        return [row.get("median_logodds", math.nan) for row in maps.layer_table()]
    raise SinkstudyError(f"unknown layer statistic {statistic!r}; choose from {', '.join(LAYER_STATISTICS)}")


def first_sink_layer(maps, statistic: str, threshold: float) -> int | None:
    values = layer_statistic(maps, statistic)
    return next((i for i, v in enumerate(values) if not math.isnan(v) and v >= threshold), None)


def _validate_below(config: dict) -> None:
    if config["statistic"] not in LAYER_STATISTICS:
        raise SinkstudyError(f"statistic must be one of {', '.join(LAYER_STATISTICS)}, got {config['statistic']!r}")
    if isinstance(config["threshold"], bool) or not isinstance(config["threshold"], (int, float)):
        raise SinkstudyError(f"threshold must be a number, got {config['threshold']!r}")
    if not isinstance(config["embeddings"], bool):
        raise SinkstudyError("embeddings must be true or false")


@register_protection("freeze_below_sink", defaults={"statistic": "max_mass", "threshold": 0.3, "embeddings": True},
                     needs_sink_maps=True, validate=_validate_below)
class FreezeBelowSink(Protection):
    """Freeze every decoder layer below the first sink layer (and the input embeddings)."""

    def setup(self, ctx) -> None:
        decoder = ctx.language_model
        values = layer_statistic(ctx.sink_maps, self.config["statistic"])
        first = first_sink_layer(ctx.sink_maps, self.config["statistic"], self.config["threshold"])
        modules = list(decoder.layers[:first or 0])
        if self.config["embeddings"] and first is not None:
            modules.append(decoder.get_input_embeddings())
        frozen = 0
        for module in modules:
            for p in module.parameters():
                if p.requires_grad:
                    p.requires_grad_(False)
                    frozen += p.numel()
        ctx.state.update(first=first, values=values, frozen=frozen)
        ctx.log({"first_sink_layer": first, "frozen_params": frozen})

    def teardown(self, ctx) -> dict:
        return {"first_sink_layer": ctx.state["first"], "statistic": self.config["statistic"],
                "threshold": self.config["threshold"], "per_layer": [round(v, 4) for v in ctx.state["values"]],
                "frozen_params": ctx.state["frozen"],
                "note": None if ctx.state["first"] is not None else "no layer reaches the threshold: nothing frozen"}


def _validate_heads(config: dict) -> None:
    validate_heads(config["heads"])
    if not isinstance(config["keys"], bool):
        raise SinkstudyError("keys must be true or false")


@register_protection("sink_head_freeze", defaults={"heads": DEFAULT_RULE, "keys": True}, needs_sink_maps=True,
                     edits_training=True, validate=_validate_heads)
class SinkHeadFreeze(Protection):
    """Keep the selected heads' q_proj rows (and their KV groups' k_proj rows) bit-identical."""

    def setup(self, ctx) -> None:
        decoder = ctx.language_model
        heads = select_heads(ctx.sink_maps, self.config["heads"])
        rows = {}  # (id(parameter), start) -> (parameter, slice, saved values)
        for layer, head in heads:
            where = head_rows(decoder, layer, head)
            attn = where["attn"]
            targets = [(attn.q_proj, where["q"])] + ([(attn.k_proj, where["k"])] if self.config["keys"] else [])
            for proj, sl in targets:
                for p in (proj.weight, proj.bias):
                    if p is not None and p.requires_grad:
                        rows[(id(p), sl.start)] = (p, sl, p.detach()[sl].clone())
        notes = ["q_norm / k_norm gains are shared by all heads of a layer and stay trainable"] \
            if any(getattr(decoder.layers[layer].self_attn, "q_norm", None) is not None for layer, _ in heads) else []
        ctx.state.update(rows=list(rows.values()), heads=describe(ctx.sink_maps, heads), notes=notes)

    def after_backward(self, ctx) -> None:
        for p, sl, _ in ctx.state["rows"]:
            if p.grad is not None:
                p.grad[sl] = 0

    def after_optimizer_step(self, ctx) -> None:
        with torch.no_grad():
            for p, sl, saved in ctx.state["rows"]:
                p[sl] = saved

    def teardown(self, ctx) -> dict:
        return {"heads": ctx.state["heads"], "frozen_rows": sum(saved.shape[0] for _, _, saved in ctx.state["rows"]),
                "notes": ctx.state["notes"]}
