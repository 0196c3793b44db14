"""Per-layer sink statistics from one forward pass: a fast hooked path and the eager baseline.

Fast path: a registered transformers `AttentionInterface` function receives q and k exactly as the
model's attention sees them (after q/k norms, RoPE and the cache, in the model's dtype), lets SDPA
compute the layer output, and computes the statistics in float32 in query chunks from the logits:
per query the log-sum-exp, the sink probability and the per-query maximum, and per head the column
sums that pick the argmax key. No L x H x T x T tensor is ever held; one chunk is B x H x c x T floats.

Eager path: `attn_implementation="eager"` with `output_attentions=True` (the naive baseline);
the same statistics are read off the attention probabilities the model's own eager attention
returns, in the model's dtype (bf16: logits formed in bf16, probabilities rounded to bf16), plus
the mask each attention layer received (to tell a masked key from an underflowed one).

One underflow convention for both: log-odds are clipped to +-LOGODDS_CAP. Where the attention on
the argmax key underflows to 0 the log-odds is -LOGODDS_CAP, where every other key's does it is
+LOGODDS_CAP (the fast path computes them in log space and clips the same way); only a key the
query cannot see (causal, padding, sliding window) gives NaN.

Both return, per layer, tensors of shape (B, H, T) (queries) plus the head argmax key (B, H).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Iterator

import torch

from sinkstudy import SinkstudyError

IMPL_NAME = "sinkstudy_sink"
# Past ~87 float32 probabilities underflow and a log-odds turns infinite; the clip keeps results
# (and JSON) finite, far beyond any value a median could reach, and the same on both paths.
LOGODDS_CAP = 80.0
# Architectures known to fit the fast path and the eager baseline (tested in tests/test_sink.py).
TESTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "olmo2")
# Logits per query chunk: 2 MiB of float32 on CPU (cache-friendly, measured in bench.py); on an
# accelerator 128 MiB, so a long sequence is a few kernels per layer rather than hundreds.
_CPU_CHUNK = 1 << 19
_ACCEL_CHUNK = 1 << 25
_ACTIVE: dict[int, "_Capture"] = {}  # id(attention module) -> capture in progress
_REGISTERED = False


@dataclass
class _Capture:
    layer_of: dict[int, int]
    sink_index: torch.Tensor  # (B,) absolute key index of the sink in each row
    valid: torch.Tensor  # (B, T) bool: real token and relative position >= skip_queries
    results: dict[int, dict[str, torch.Tensor]]
    chunk_elems: int


def attention_layers(model) -> list[torch.nn.Module]:
    """The self-attention module of every decoder layer, in order; one line naming the architecture
    when the sink pass cannot measure it (checked before any forward pass)."""
    config = getattr(model, "config", None)
    arch = f"{type(model).__name__} (model_type {getattr(config, 'model_type', None)!r})"
    base = getattr(model, "base_model", model)
    layers = getattr(base, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or not len(layers) or not all(hasattr(layer, "self_attn") for layer in layers):
        reason = f"its decoder layers are not at `{type(base).__name__}.layers[i].self_attn`"
    elif not getattr(model, "_supports_attention_backend", False):
        reason = "its attention does not go through transformers' AttentionInterface"
    else:
        return [layer.self_attn for layer in layers]
    raise SinkstudyError(f"the sink pass does not support {arch}: {reason}; it measures causal LMs with decoder layers at "
                         f"`model.layers[i].self_attn` whose attention goes through transformers' AttentionInterface "
                         f"(tested: {', '.join(TESTED_MODEL_TYPES)})")


def check_supported_config(config) -> None:
    """`attention_layers`' refusal from a causal-LM config alone: the same check on a weightless
    (meta-device) instance, so an unsupported architecture fails before any weights are loaded."""
    # lazy: loads transformers, PIL, huggingface_hub
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config)
    except ValueError as exc:  # no causal-LM class for this config
        raise SinkstudyError(f"the sink pass measures causal LMs; {getattr(config, 'model_type', None)!r} has none: "
                             f"{str(exc).splitlines()[0]}") from None
    attention_layers(skeleton)


def capture_layer_stats(
    model,
    *,
    input_ids: torch.Tensor | None = None,
    inputs_embeds: torch.Tensor | None = None,
    attention_mask: torch.Tensor,
    sink_position: int = 0,
    skip_queries: int = 1,
    method: str = "fast",
    chunk_elems: int | None = None,
) -> list[dict[str, torch.Tensor]]:
    """Run one batch (left padded) and return per-layer sink statistics.

    Each layer's dict holds (B, H, T) float64 tensors `p_sink`, `logodds_head`, `logodds_query`,
    `colsum` (column sums over valid queries) and the (B, H) `head_argmax` key index (absolute).
    Undefined entries (padding, skipped queries, argmax key not visible) are NaN.
    """
    if method not in ("fast", "eager"):
        raise SinkstudyError(f"unknown method {method!r}; choose 'fast' or 'eager'")
    mask2d = attention_mask.bool()
    offsets = (~mask2d).sum(-1)  # left padding per row
    rel = torch.arange(mask2d.shape[1], device=mask2d.device)[None, :] - offsets[:, None]
    valid = mask2d & (rel >= skip_queries)
    # Positions count from each row's first real token, so padding does not shift RoPE.
    position_ids = (mask2d.long().cumsum(-1) - 1).clamp(min=0)
    cap = _Capture(
        layer_of={id(m): i for i, m in enumerate(attention_layers(model))},
        sink_index=offsets + sink_position,
        valid=valid,
        results={},
        chunk_elems=chunk_elems or (_CPU_CHUNK if attention_mask.device.type == "cpu" else _ACCEL_CHUNK),
    )
    inputs = dict(input_ids=input_ids, inputs_embeds=inputs_embeds, attention_mask=attention_mask.long(),
                  position_ids=position_ids, use_cache=False)
    with torch.no_grad():
        if method == "fast":
            with _fast_attention(model, cap):
                model.base_model(**inputs)
            layers = [cap.results[i] for i in range(len(cap.layer_of))]
        else:
            with _attn_implementation(model, "eager"), _recorded_masks(attention_layers(model)) as masks:
                out = model.base_model(**inputs, output_attentions=True)
            layers = [_eager_stats(p, mask, cap) for p, mask in zip(out.attentions, masks)]
    return layers


# ---------------------------------------------------------------- fast path


def _register() -> None:
    global _REGISTERED
    if _REGISTERED:
        return
    # lazy: loads transformers, PIL, huggingface_hub
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(IMPL_NAME, _sink_attention)
    AttentionMaskInterface.register(IMPL_NAME, sdpa_mask)  # masks exactly as for SDPA (bool or None)
    _REGISTERED = True


@contextlib.contextmanager
def _attn_implementation(model, name: str) -> Iterator[None]:
    old = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        yield
    finally:
        model.set_attn_implementation(old)


@contextlib.contextmanager
def _fast_attention(model, cap: _Capture) -> Iterator[None]:
    _register()
    for key in cap.layer_of:
        _ACTIVE[key] = cap
    try:
        with _attn_implementation(model, IMPL_NAME):
            yield
    finally:
        for key in cap.layer_of:
            _ACTIVE.pop(key, None)


def _sink_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """SDPA for the output; sink statistics on the side when a capture is active for `module`."""
    # lazy: loads transformers, PIL, huggingface_hub
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    for unsupported in ("s_aux", "position_bias"):
        if kwargs.get(unsupported) is not None:
            raise SinkstudyError(f"attention with `{unsupported}` is not supported by the fast sink path; use method='eager'")
    softcap = kwargs.pop("softcap", None)
    if attention_mask is not None and attention_mask.dtype != torch.bool:
        raise SinkstudyError("fast sink path expects a boolean SDPA mask; got an additive one")
    if scaling is None:
        scaling = module.head_dim**-0.5
    cap = _ACTIVE.get(id(module))
    if cap is None:  # model called outside a capture while switched: behave like SDPA
        if softcap is not None:
            raise SinkstudyError("softcapped attention needs an active sink capture")
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    if attention_mask is None and not kwargs.get("is_causal", getattr(module, "is_causal", True)):
        raise SinkstudyError("bidirectional attention without a mask: the sink statistics assume a causal LM")
    want_output = softcap is not None  # SDPA has no softcap: the chunk loop computes the output then
    stats, out = _chunked_stats(query, key, value if want_output else None, attention_mask, scaling, softcap,
                                kwargs.get("sliding_window"), cap)
    cap.results[cap.layer_of[id(module)]] = stats
    if out is None:
        out, _ = sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    return out, None


def _repeat_kv(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    b, kvh, t, d = x.shape
    if kvh == n_heads:
        return x
    return x[:, :, None].expand(b, kvh, n_heads // kvh, t, d).reshape(b, n_heads, t, d)


def _chunked_stats(q, k, v, mask, scaling, softcap, sliding_window, cap: _Capture):
    """Sink statistics from q (B,H,T,D) and k (B,Hkv,T,D), query chunk by query chunk.

    Per chunk only the keys a causal query can see are used (and, with a sliding window, only the
    window). Logits follow the model: scaling, optional tanh softcap, boolean mask (None = causal).
    """
    B, H, T, _ = q.shape
    out_dtype = q.dtype
    q = q.float()
    k = _repeat_kv(k.float(), H)
    if v is not None:
        v = _repeat_kv(v.float(), H)
        out = torch.empty(B, H, T, v.shape[-1], device=q.device)
    dev = q.device
    lse = torch.empty(B, H, T, dtype=torch.float64, device=dev)
    p_sink = torch.empty(B, H, T, dtype=torch.float64, device=dev)
    others = torch.empty(B, H, T, dtype=torch.float64, device=dev)  # sum of exp(l - max) over all keys but the max
    colsum = torch.zeros(B, H, T, dtype=torch.float64, device=dev)
    valid = cap.valid.to(dev)
    sink_idx = cap.sink_index.to(dev)
    chunk = max(1, cap.chunk_elems // max(1, B * H * T))
    for a in range(0, T, chunk):
        b = min(T, a + chunk)
        lo = 0 if sliding_window is None else max(0, a - sliding_window)
        logits = torch.matmul(q[:, :, a:b], k[:, :, lo:b].transpose(-1, -2)).mul_(scaling)
        if softcap is not None:
            logits.div_(softcap).tanh_().mul_(softcap)
        if mask is None:  # causal: only the diagonal block (keys a..b-1) has masked entries
            future = torch.ones(b - a, b - a, dtype=torch.bool, device=dev).triu_(1)
            logits[..., a - lo:].masked_fill_(future, float("-inf"))
        else:
            logits.masked_fill_(~mask[:, :, a:b, lo:b], float("-inf"))
        m, top = logits.max(-1, keepdim=True)
        live = m > float("-inf")  # False on fully masked (padding) rows
        m.masked_fill_(~live, 0.0)
        e = logits.sub_(m).exp_()
        # The max term is exactly 1: summing the rest without it keeps 1 - a = rest / s exact as a -> 1.
        rest = e.scatter_(-1, top, 0.0).sum(-1).double()
        e.scatter_(-1, top, live.float())
        s = torch.where(live.squeeze(-1), 1.0 + rest, 0.0)
        others[:, :, a:b] = rest
        lse[:, :, a:b] = m.squeeze(-1) + s.log()
        col = (sink_idx - lo).view(B, 1, 1, 1)
        in_chunk = (col >= 0) & (col < b - lo)  # else the sink is outside this chunk's keys: p = 0
        e_sink = e.gather(-1, col.clamp(0, b - lo - 1).expand(B, H, b - a, 1)).squeeze(-1)
        p_sink[:, :, a:b] = torch.where(in_chunk.view(B, 1, 1), e_sink, 0.0) / s
        w = torch.where(valid[:, None, a:b], 1.0 / s, 0.0).float()
        colsum[:, :, lo:b] += torch.matmul(w.unsqueeze(-2), e).squeeze(-2).double()
        if v is not None:
            # Fully masked (padding) rows get 0, not 0/0: NaN would leak into real rows' values.
            out[:, :, a:b] = torch.matmul(e, v[:, :, lo:b]) / s.masked_fill(s == 0, 1.0).float().unsqueeze(-1)
    head_argmax = colsum.argmax(-1)  # (B, H)
    k_star = k.gather(2, head_argmax[:, :, None, None].expand(B, H, 1, k.shape[-1]))
    l_star = (q * k_star).sum(-1) * scaling
    if softcap is not None:
        l_star = torch.tanh(l_star / softcap) * softcap
    if mask is None:
        visible = head_argmax[:, :, None] <= torch.arange(T, device=dev)[None, None, :]
    else:
        visible = mask.expand(B, H, T, T).gather(-1, head_argmax[:, :, None, None].expand(B, H, T, 1)).squeeze(-1)
    # Per-query argmax: a = 1/s and 1 - a = rest/s, so log-odds = -log(rest). The head's key, once
    # it holds over half the mass, is that maximum too; below that 1 - a >= 1/2 is safe from a.
    lo_query = -torch.log(others)
    log_a = l_star.double() - lse
    lo_head = torch.where(log_a > -math.log(2.0), lo_query, log_a - torch.log(-torch.expm1(log_a)))
    lo_head = torch.where(visible, lo_head, float("nan"))
    stats = _finish(p_sink, lo_head, lo_query, colsum, head_argmax, valid)
    if v is not None:
        return stats, out.to(out_dtype).transpose(1, 2).contiguous()
    return stats, None


def _finish(p_sink, lo_head, lo_query, colsum, head_argmax, valid) -> dict[str, torch.Tensor]:
    nan = float("nan")
    vmask = valid[:, None, :]
    return {
        "p_sink": torch.where(vmask, p_sink, nan).cpu(),
        "logodds_head": torch.where(vmask, lo_head, nan).clamp(-LOGODDS_CAP, LOGODDS_CAP).cpu(),
        "logodds_query": torch.where(vmask, lo_query, nan).clamp(-LOGODDS_CAP, LOGODDS_CAP).cpu(),
        "colsum": colsum.cpu(),
        "head_argmax": head_argmax.cpu(),
    }


# ---------------------------------------------------------------- eager baseline


@contextlib.contextmanager
def _recorded_masks(modules: list[torch.nn.Module]) -> Iterator[list[torch.Tensor | None]]:
    """The `attention_mask` each attention module is called with (per layer: sliding windows differ)."""
    masks: list[torch.Tensor | None] = [None] * len(modules)

    def recorder(i):
        def pre_hook(module, args, kwargs):
            masks[i] = kwargs.get("attention_mask")
        return pre_hook

    handles = [m.register_forward_pre_hook(recorder(i), with_kwargs=True) for i, m in enumerate(modules)]
    try:
        yield masks
    finally:
        for h in handles:
            h.remove()


def _eager_stats(attn: torch.Tensor, mask: torch.Tensor | None, cap: _Capture) -> dict[str, torch.Tensor]:
    """The same statistics read off one layer's full (B, H, T, T) attention probabilities."""
    B, H, T, _ = attn.shape
    p = attn.double()
    valid = cap.valid.to(p.device)
    sink = cap.sink_index.to(p.device).view(B, 1, 1, 1).expand(B, H, T, 1)
    p_sink = p.gather(-1, sink).squeeze(-1)
    colsum = (p * valid[:, None, :, None]).sum(-2)
    head_argmax = colsum.argmax(-1)
    idx = head_argmax[:, :, None, None].expand(B, H, T, 1)
    if mask is None:  # no mask handed to the layer: plain causal attention
        visible = head_argmax[:, :, None] <= torch.arange(T, device=p.device)[None, None, :]
    else:  # eager masks are additive (0 = visible, the dtype's minimum = masked) or boolean
        seen = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2
        visible = seen.to(p.device).expand(B, H, T, T).gather(-1, idx).squeeze(-1)
    lo_head = torch.where(visible, _logodds_at(p, idx), float("nan"))
    lo_query = _logodds_at(p, p.argmax(-1, keepdim=True))
    return _finish(p_sink, lo_head, lo_query, colsum, head_argmax, valid)


def _logodds_at(p: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """log(a) - log(sum of the other probabilities): no 1 - a cancellation. An underflowed a gives
    -inf and underflowed others +inf, which `_finish` clips to -+LOGODDS_CAP like the fast path."""
    a = p.gather(-1, idx).squeeze(-1)
    rest = p.scatter(-1, idx, 0.0).sum(-1)
    return torch.log(a) - torch.log(rest)
