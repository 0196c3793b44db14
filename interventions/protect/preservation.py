"""`sink_preservation_loss`: a penalty for moving the sink heads' attention on their sink.

For each selected head, calibration text and counted query i (as in the sink maps: at or after
skip_queries, able to see the key), a_i is the query's softmax attention on the head's argmax key
of the base's sink maps. The term added to the training loss, every micro-batch, is

    weight * mean over (texts of the batch, heads, queries) of D(a_ref || a_now)

with D = the Bernoulli KL  a_ref log(a_ref / a_now) + (1 - a_ref) log((1 - a_ref) / (1 - a_now))
(`divergence: kl`, default), or (a_now - a_ref)^2 (`divergence: l2`). a_ref is computed at the start
of each stage the protection acts in, with the same code on the same tokens, so the term is exactly
0 before the first update and positive once the heads drift (in the LLaVA recipe the LM is the
base's at the start of stage 2). Texts: `batch_texts` calibration texts per optimizer step, cycled
in order by the global step (a resumed run sees the same ones); each is one extra forward pass of
the text decoder, stopped after the deepest selected layer.
"""

from __future__ import annotations

import torch

from interventions.protect import Protection, register_protection
from interventions.protect.qk import calibration_ids, counted_queries, forward_qk, sink_log_probs
from interventions.protect.heads import DEFAULT_RULE, describe, kv_group, select_heads, validate_heads
from sinkstudy import SinkstudyError

DIVERGENCES = ("kl", "l2")


def _validate(config: dict) -> None:
    validate_heads(config["heads"])
    if config["divergence"] not in DIVERGENCES:
        raise SinkstudyError(f"divergence must be one of {', '.join(DIVERGENCES)}, got {config['divergence']!r}")
    if isinstance(config["weight"], bool) or not isinstance(config["weight"], (int, float)) or config["weight"] <= 0:
        raise SinkstudyError(f"weight must be a number > 0, got {config['weight']!r}")
    if not isinstance(config["batch_texts"], int) or isinstance(config["batch_texts"], bool) or config["batch_texts"] < 1:
        raise SinkstudyError(f"batch_texts must be a positive integer, got {config['batch_texts']!r}")


def sink_attention(decoder, ids: list[int], heads: list[tuple[int, int]], sinks: dict, skip: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(log a, log(1 - a)) over the heads and counted queries of one sequence, concatenated in
    (layer, head, query) order; `sinks[(layer, head)]` is the head's sink key on this sequence."""
    captured = forward_qk(decoder, ids, {layer for layer, _ in heads})
    log_a, log_rest = [], []
    for layer, head in heads:
        cap = captured[layer]
        sink = sinks[(layer, head)]
        queries = counted_queries(len(ids), sink, skip)
        if queries:
            _, la, lr = sink_log_probs(cap["q"], cap["k"], cap["scaling"], head, kv_group(decoder, head), sink, queries)
            log_a.append(la)
            log_rest.append(lr)
    return torch.cat(log_a), torch.cat(log_rest)


def divergence(ref: tuple[torch.Tensor, torch.Tensor], now: tuple[torch.Tensor, torch.Tensor], kind: str) -> torch.Tensor:
    (ra, rr), (na, nr) = ref, now
    if kind == "l2":
        return (na.exp() - ra.exp()).pow(2)
    return ra.exp() * (ra - na) + rr.exp() * (rr - nr)


@register_protection("sink_preservation_loss", defaults={"heads": DEFAULT_RULE, "divergence": "kl", "weight": 1.0, "batch_texts": 4},
                     needs_sink_maps=True, validate=_validate)
class SinkPreservationLoss(Protection):
    """Add weight x divergence between the base's and the current attention-on-sink of the sink heads on calibration text."""

    def setup(self, ctx) -> None:
        decoder = ctx.language_model
        active = any(p.requires_grad for p in decoder.parameters())
        heads = select_heads(ctx.sink_maps, self.config["heads"])
        ctx.state.update(active=active, heads=heads, terms=[])
        if not active:  # nothing below the sink heads trains in this stage: the term would be a constant 0
            return
        ids = calibration_ids(ctx.tokenizer, ctx.calibration, ctx.sink_maps)
        sinks = [{(layer, head): int(ctx.sink_maps.argmax_key[n, layer, head]) for layer, head in heads} for n in range(len(ids))]
        skip = int(ctx.sink_maps.settings["skip_queries"])
        with torch.no_grad():
            reference = [tuple(t.detach() for t in sink_attention(decoder, seq, heads, s, skip)) for seq, s in zip(ids, sinks)]
        ctx.state.update(ids=ids, sinks=sinks, skip=skip, reference=reference, described=describe(ctx.sink_maps, heads))

    def loss(self, ctx, model, inputs) -> torch.Tensor | None:
        if not ctx.state["active"]:
            return None
        ids, n, k = ctx.state["ids"], len(ctx.state["ids"]), self.config["batch_texts"]
        chosen = [(ctx.step * k + j) % n for j in range(min(k, n))]
        terms = []
        for t in chosen:
            now = sink_attention(ctx.language_model, ids[t], ctx.state["heads"], ctx.state["sinks"][t], ctx.state["skip"])
            terms.append(divergence(ctx.state["reference"][t], now, self.config["divergence"]))
        term = self.config["weight"] * torch.cat(terms).mean()
        ctx.state["terms"].append(float(term.detach()))
        return term

    def after_optimizer_step(self, ctx) -> None:
        if ctx.state["active"] and ctx.state["terms"]:
            ctx.log({"preservation_term": ctx.state["terms"][-1]})

    def teardown(self, ctx) -> dict | None:
        if not ctx.state["active"]:
            return {"active": False}
        terms = ctx.state["terms"]
        return {"heads": ctx.state["described"], "divergence": self.config["divergence"], "weight": self.config["weight"],
                "first_term": terms[0] if terms else None, "last_term": terms[-1] if terms else None}
