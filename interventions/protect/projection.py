"""`sink_head_qk_projection`: the sink heads' W_q / W_k may not move along their sink logits.

The sink direction, precisely. For a selected head h of layer l with KV group g, calibration text n
and counted query i (at or after the sink maps' skip_queries, able to see the key), the sink logit is

    z_{n,i} = scaling * q_i . k_s,   s = the head's argmax key on text n in the base's sink maps,

with q_i and k_s exactly as the attention sees them (after q/k norms and RoPE). Its gradient with
respect to the block theta = (W_q rows of the selected heads of group g, their q bias, W_k rows of
group g, their k bias) is, through the linear projection q_out = W_q x + b_q,

    dz/dW_q[h] = G^q_{n,i} [x_i, 1]^T,   dz/dW_k[g] = G^k_{n,i} [x_s, 1]^T,

where x is the layer's attention input and G^q = dz/dq_out_i, G^k = dz/dk_out_s are taken by
autograd through the model's own norm and RoPE code (`qk.forward_qk`). The protected
subspace U is the span of these gradients over every text, query and selected head of the block,
truncated to the singular directions with sigma >= rtol * sigma_max (at most max_rank; memory:
rank x block size floats per (layer, KV group), e.g. 256 x 0.8M for two heads of a 3B model): computed
from the Gram matrix of the per-query gradients (which factorises into small dot products) in
float64, at the start of each stage the protection acts in (in the LLaVA recipe, whose stage 1
leaves the LM alone, that is the base).

Why this direction: a head is a sink head because its queries put a large logit on one key; that
logit is the sink. Moving theta orthogonally to every dz/dtheta leaves every calibration sink logit
unchanged to first order (the change is O(step^2)), while the rest of the head (its logits on
content keys, its value path) still learns. Constraining the whole attention row instead would
freeze the head; constraining only the key side would let the queries rotate away from the sink.

What is enforced, per optimizer step: the block's gradient is projected onto U's orthogonal
complement after backward (before clipping: Adam's moments and the clip norm see no sink
component), and the parameter update is projected again after the step. Adam divides every
coordinate by its own second moment, so a projected gradient alone does not give a projected
update; projecting the update (weight decay included) is what makes theta - theta_base stay
orthogonal to U exactly. Parameters outside the block (the shared q/k norm gains of Qwen3, lower
layers, embeddings) still move the sink logit: the protection is about the heads' own projections.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from interventions.protect import Protection, register_protection
from interventions.protect.qk import at_least_float32, calibration_ids, counted_queries, forward_qk, projection_leaves
from interventions.protect.heads import DEFAULT_RULE, describe, geometry, head_rows, kv_group, select_heads, validate_heads
from sinkstudy import SinkstudyError

MIN_RTOL = 1e-7  # sigma / sigma_max: float64 eigenvalues below ~1e-14 lambda_max are round-off

def _validate(config: dict) -> None:
    validate_heads(config["heads"])
    if isinstance(config["rtol"], bool) or not isinstance(config["rtol"], (int, float)) or not MIN_RTOL <= config["rtol"] < 1:
        raise SinkstudyError(f"rtol must be in [{MIN_RTOL}, 1) (below that float64 round-off makes directions up), got {config['rtol']!r}")
    if not isinstance(config["max_rank"], int) or config["max_rank"] < 1:
        raise SinkstudyError(f"max_rank must be a positive integer, got {config['max_rank']!r}")


class Block:
    """The projected parameters of one (layer, KV group): row slices of q_proj / k_proj (weights and
    biases), flattened in a fixed order into one vector; `basis` holds U as (rank, size) rows."""

    def __init__(self, attn, layer: int, group: int, heads: list[int], hd: int):
        self.layer, self.group, self.heads = layer, group, heads
        self.parts = []  # (parameter, row slice)
        for h in heads:
            self.parts.append((attn.q_proj.weight, slice(h * hd, (h + 1) * hd)))
            if attn.q_proj.bias is not None:
                self.parts.append((attn.q_proj.bias, slice(h * hd, (h + 1) * hd)))
        self.parts.append((attn.k_proj.weight, slice(group * hd, (group + 1) * hd)))
        if attn.k_proj.bias is not None:
            self.parts.append((attn.k_proj.bias, slice(group * hd, (group + 1) * hd)))
        self.basis = None
        self.energy = None  # share of the sink-logit gradients' energy (sum of squared singular values) in U
        self.before = None

    @property
    def trainable(self) -> set[bool]:
        return {p.requires_grad for p, _ in self.parts}

    def values(self) -> torch.Tensor:
        return torch.cat([p.detach()[rows].reshape(-1) for p, rows in self.parts])

    def grads(self) -> torch.Tensor | None:
        if all(p.grad is None for p, _ in self.parts):
            return None
        return torch.cat([(p.grad[rows] if p.grad is not None else torch.zeros_like(p[rows])).reshape(-1) for p, rows in self.parts])

    def write(self, vector: torch.Tensor, *, grad: bool) -> None:
        start = 0
        with torch.no_grad():
            for p, rows in self.parts:
                target = p.grad if grad else p
                n = target[rows].numel()
                target[rows] = vector[start:start + n].view_as(target[rows]).to(target.dtype)
                start += n

    def project(self, vector: torch.Tensor) -> torch.Tensor:
        u = self.basis.to(vector.dtype)
        return vector - u.T @ (u @ vector)


@register_protection("sink_head_qk_projection", defaults={"heads": DEFAULT_RULE, "rtol": 1e-3, "max_rank": 256},
                     needs_sink_maps=True, edits_training=True, validate=_validate)
class SinkHeadQKProjection(Protection):
    """Project the sink heads' W_q / W_k gradients and updates off their sink-logit gradients (first-order invariant sink logits)."""

    def setup(self, ctx) -> None:
        decoder = ctx.language_model
        heads = select_heads(ctx.sink_maps, self.config["heads"])
        _, _, hd = geometry(decoder)
        grouped: dict[tuple[int, int], list[int]] = defaultdict(list)
        for layer, head in heads:
            grouped[(layer, kv_group(decoder, head))].append(head)
        blocks = [Block(head_rows(decoder, layer, hs[0])["attn"], layer, group, hs, hd) for (layer, group), hs in sorted(grouped.items())]
        mixed = [b for b in blocks if len(b.trainable) > 1]
        if mixed:
            raise SinkstudyError(f"sink_head_qk_projection: layer {mixed[0].layer} trains only one of q_proj / k_proj in stage "
                                 f"{ctx.stage.name}; the projection needs both trainable or both frozen")
        active = [b for b in blocks if b.trainable == {True}]
        if active:
            ids = calibration_ids(ctx.tokenizer, ctx.calibration, ctx.sink_maps)
            for block in active:
                block.basis, block.energy = sink_directions(decoder, block, ids, ctx.sink_maps, self.config["rtol"],
                                                            self.config["max_rank"])
        ctx.state.update(blocks=active, heads=describe(ctx.sink_maps, heads), removed=[])

    def after_backward(self, ctx) -> None:
        removed = []
        for block in ctx.state["blocks"]:
            block.before = block.values().clone()
            g = block.grads()
            if g is None:
                continue
            projected = block.project(g)
            block.write(projected, grad=True)
            total = float(g.pow(2).sum())
            removed.append(1.0 - float(projected.pow(2).sum()) / total if total > 0 else 0.0)
        if removed:
            share = sum(removed) / len(removed)
            ctx.state["removed"].append(share)
            ctx.log({"removed_grad_share": round(share, 6)})

    def after_optimizer_step(self, ctx) -> None:
        for block in ctx.state["blocks"]:
            if block.before is None:
                continue
            update = block.values() - block.before
            block.write(block.before + block.project(update), grad=False)
            block.before = None

    def teardown(self, ctx) -> dict:
        removed = ctx.state.get("removed") or []
        return {"heads": ctx.state.get("heads"),
                "blocks": [{"layer": b.layer, "kv_group": b.group, "heads": b.heads, "rank": int(b.basis.shape[0]),
                            "size": int(b.basis.shape[1]), "energy_kept": round(b.energy, 6)} for b in ctx.state.get("blocks", [])],
                "mean_removed_grad_share": round(sum(removed) / len(removed), 6) if removed else None}


def sink_directions(decoder, block: Block, ids: list[list[int]], maps, rtol: float, max_rank: int) -> tuple[torch.Tensor, float]:
    """(U, energy kept): U (rank, block size) has orthonormal rows spanning the block's sink-logit
    gradients (module doc); the energy is the kept share of their squared singular values."""
    attn = decoder.layers[block.layer].self_attn
    _, _, hd = geometry(decoder)
    skip = int(maps.settings["skip_queries"])
    rows = {"gq": [], "x": [], "head": [], "gk": [], "xs": []}
    for n, seq in enumerate(ids):
        with projection_leaves(attn) as leaves, torch.enable_grad():
            cap = forward_qk(decoder, seq, {block.layer})[block.layer]
            q, k = at_least_float32(cap["q"][0]), at_least_float32(cap["k"][0])
            for h in block.heads:
                sink = int(maps.argmax_key[n, block.layer, h])
                queries = counted_queries(len(seq), sink, skip)
                if not queries:
                    continue
                q_post = q[h, queries]  # (Q, D)
                k_post = k[block.group, sink]  # (D,)
                logits = cap["scaling"] * (q_post @ k_post)
                # Each z_i reads q_out only at position i (per-position norm and RoPE): one backward gives all of them.
                g_q = torch.autograd.grad(logits.sum(), leaves["q_out"], retain_graph=True)[0][0, queries, h * hd:(h + 1) * hd]
                # dz_i/dk_out_s = J_s^T (scaling q_i), J_s = d k_post_s / d k_out_s (norm and RoPE at the sink position).
                eye = torch.eye(k_post.numel(), dtype=k_post.dtype, device=k_post.device)
                jac = torch.autograd.grad(k_post, leaves["k_out"], grad_outputs=eye, retain_graph=True,
                                          is_grads_batched=True)[0][:, 0, sink, block.group * hd:(block.group + 1) * hd]
                g_k = (cap["scaling"] * q_post.detach()) @ jac
                rows["gq"].append(g_q.double())
                rows["x"].append(leaves["q_in"][0, queries].double())
                rows["head"] += [h] * len(queries)
                rows["gk"].append(g_k.double())
                rows["xs"].append(leaves["k_in"][0, sink].double().expand(len(queries), -1))
    if not rows["head"]:
        raise SinkstudyError(f"layer {block.layer}: no calibration query sees the selected heads' sink key")
    gq, x, gk, xs = (torch.cat(rows[k]) for k in ("gq", "x", "gk", "xs"))
    head = torch.tensor(rows["head"])
    bias_q = float(attn.q_proj.bias is not None)
    bias_k = float(attn.k_proj.bias is not None)
    same_head = (head[:, None] == head[None, :]).double()
    gram = same_head * (gq @ gq.T) * (x @ x.T + bias_q) + (gk @ gk.T) * (xs @ xs.T + bias_k)
    eigvals, eigvecs = torch.linalg.eigh(gram)
    order = eigvals.flip(0)
    keep = int((order >= (max(rtol, MIN_RTOL) ** 2) * order[0].clamp_min(0)).logical_and(order > 0).sum())
    keep = min(keep, max_rank)
    vals, vecs = order[:keep], eigvecs.flip(1)[:, :keep]
    w = vecs / vals.sqrt()  # u_c = J^T v_c / sqrt(lambda_c): orthonormal
    parts = []
    for h in block.heads:
        sel = head == h
        parts.append(torch.einsum("rc,ra,rb->cab", w[sel], gq[sel], x[sel]).reshape(keep, -1))
        if bias_q:
            parts.append((w[sel].T @ gq[sel]).reshape(keep, -1))
    parts.append(torch.einsum("rc,ra,rb->cab", w, gk, xs).reshape(keep, -1))
    if bias_k:
        parts.append((w.T @ gk).reshape(keep, -1))
    # Re-orthonormalise: directions of small lambda carry eigenvector round-off amplified by 1/sqrt(lambda).
    basis = torch.linalg.qr(torch.cat(parts, dim=1).T).Q.T
    energy = float(vals.sum() / order.clamp_min(0).sum())
    return basis.to(block.parts[0][0].dtype), energy
