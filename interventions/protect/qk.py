"""The attention's q and k, as the model computes them (after q/k norms and RoPE), with autograd.

`forward_qk(decoder, ids, layers)` runs a text decoder on one calibration sequence with a registered
transformers `AttentionInterface` function that hands each requested layer's query and key states
(B, H, T, D) / (B, H_kv, T, D) and scaling to the caller, computes the layer's output with SDPA, and
stops the forward pass after the deepest requested layer (nothing past it is computed). The
tensors keep their autograd graph: differentiating a sink logit through them reaches W_q / W_k (and
anything below) exactly as the model's own attention would. Calibration texts are tokenised as the
sink maps were (chat template and length from their settings), so a sink map's argmax key indexes
the same token.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import torch

from evals.sink.calibration import encode_texts, texts_fingerprint
from evals.sink.capture import attention_layers
from sinkstudy import SinkstudyError

IMPL_NAME = "sinkstudy_qk"
_ACTIVE: dict[int, "_Capture"] = {}
_REGISTERED = False


class _Stop(Exception):
    """Raised after the deepest requested layer: the rest of the forward pass is not needed."""


class _Capture:
    def __init__(self, layer_of: dict[int, int], wanted: set[int]):
        self.layer_of, self.wanted, self.out = layer_of, wanted, {}


def calibration_ids(tokenizer, texts, maps) -> list[list[int]]:
    """Token ids of each calibration text, encoded exactly as `maps` (evals.sink.SinkMaps) were."""
    if texts is None:
        raise SinkstudyError("this protection needs the calibration texts the sink maps were measured on")
    if texts_fingerprint(texts) != maps.texts_fingerprint:
        raise SinkstudyError("the calibration texts are not those the sink maps were measured on")
    ids = encode_texts(tokenizer, texts, apply_chat_template=maps.settings["apply_chat_template"],
                       max_length=maps.settings["max_length"])
    if [len(s) for s in ids] != list(maps.n_tokens):
        raise SinkstudyError("the calibration texts tokenise differently from the sink maps' (another tokenizer?)")
    return ids


def counted_queries(n_tokens: int, sink: int, skip: int) -> list[int]:
    """Query positions whose attention on the sink key counts: at or after `skip` (the sink maps'
    skip_queries) and able to see the sink key (causal)."""
    return list(range(max(skip, sink), n_tokens))


def forward_qk(decoder, ids: Sequence[int], layers: set[int] | Sequence[int]) -> dict[int, dict]:
    """{layer: {"q": (1, H, T, D), "k": (1, H_kv, T, D), "scaling": float}} for one sequence."""
    _register()
    attns = attention_layers(decoder)
    wanted = set(layers)
    cap = _Capture({id(m): i for i, m in enumerate(attns)}, wanted)
    device = next(decoder.parameters()).device
    input_ids = torch.tensor([list(ids)], device=device)
    for m in attns:
        _ACTIVE[id(m)] = cap
    old = decoder.config._attn_implementation
    # Activation checkpointing would recompute a layer this pass leaves half done: off for this short pass.
    checkpointed = [m for m in decoder.modules() if getattr(m, "gradient_checkpointing", False) is True]
    decoder.set_attn_implementation(IMPL_NAME)
    try:
        for m in checkpointed:
            m.gradient_checkpointing = False
        decoder(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), use_cache=False)
    except _Stop:
        pass
    finally:
        for m in checkpointed:
            m.gradient_checkpointing = True
        decoder.set_attn_implementation(old)
        for m in attns:
            _ACTIVE.pop(id(m), None)
    missing = wanted - set(cap.out)
    if missing:
        raise SinkstudyError(f"attention of layer(s) {sorted(missing)} was not captured")
    return cap.out


def sink_log_probs(q: torch.Tensor, k: torch.Tensor, scaling: float, head: int, group: int, sink: int,
                   queries: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For one head on one sequence: (sink logit, log a, log(1 - a)) per query in `queries`, where a
    is the query's causal softmax attention on key `sink`; at least float32, differentiable."""
    qh, kg = at_least_float32(q[0, head]), at_least_float32(k[0, group])  # (T, D)
    logits = scaling * (qh[list(queries)] @ kg.T)  # (Q, T)
    pos = torch.as_tensor(list(queries), device=logits.device)
    visible = torch.arange(kg.shape[0], device=logits.device)[None, :] <= pos[:, None]
    logits = logits.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)
    others = logits.clone()
    others[:, sink] = float("-inf")
    return logits[:, sink], logits[:, sink] - lse, torch.logsumexp(others, dim=-1) - lse


def at_least_float32(t: torch.Tensor) -> torch.Tensor:
    """bf16 / fp16 statistics in float32 (they cap log-odds otherwise); float64 stays float64."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _register() -> None:
    global _REGISTERED
    if _REGISTERED:
        return
    # lazy: loads transformers, PIL, huggingface_hub
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(IMPL_NAME, _qk_attention)
    AttentionMaskInterface.register(IMPL_NAME, sdpa_mask)
    _REGISTERED = True


def _qk_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    # lazy: loads transformers, PIL, huggingface_hub
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if kwargs.get("softcap") is not None:
        raise SinkstudyError("attention logit softcapping is not supported by the protections' q/k capture")
    cap = _ACTIVE.get(id(module))
    if cap is not None:
        layer = cap.layer_of[id(module)]
        if layer in cap.wanted:
            cap.out[layer] = {"q": query, "k": key, "scaling": float(scaling if scaling is not None else module.head_dim ** -0.5)}
            if set(cap.out) >= cap.wanted:
                raise _Stop
    return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)


@contextlib.contextmanager
def projection_leaves(attn) -> Iterator[dict]:
    """Within the block, the outputs of `attn.q_proj` / `attn.k_proj` are autograd leaves (before any
    injected norm hooks), recorded with the projections' inputs: {"q_in", "q_out", "k_in", "k_out"}."""
    seen: dict = {}

    def hook(which):
        def fn(module, args, output):
            seen[f"{which}_in"] = args[0].detach()
            leaf = output.detach().requires_grad_(True)
            seen[f"{which}_out"] = leaf
            return leaf
        return fn

    handles = [attn.q_proj.register_forward_hook(hook("q"), prepend=True),
               attn.k_proj.register_forward_hook(hook("k"), prepend=True)]
    try:
        yield seen
    finally:
        for h in handles:
            h.remove()
