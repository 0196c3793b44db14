"""`disable_qk_norm`: the sufficiency test the paper suggests. On a backbone with native per-head
QK-norm, adapt with the norm disabled (Qwen3) or its gains frozen (Qwen3, Gemma 3) and see whether its
protection of text skill goes.

mode `remove` (default): the per-head RMS normalisation of q and k is taken out of the model for the
adaptation and after it, and replaced by the fixed linear map that best matches it on the
calibration texts. Per layer, head h and dimension d the norm computes gamma_d * x_d / r(x) with r
the head's RMS; the replacement is s_{h,d} * x_d with the least-squares

    s_{h,d} = gamma_d * sum_t (x_{t,h,d}^2 / r_t) / sum_t x_{t,h,d}^2      (tokens t of the texts),

folded into the q_proj / k_proj rows (the norm acts before RoPE, so scaling the projection rows is
the same function). A Qwen3 without q/k norms is exactly a Llama (same decoder, MLP, RMSNorm and
RoPE code), so the base becomes its `LlamaForCausalLM` twin with those weights before the VLM is
built (checked against the Qwen3 computing s * x in place of its norms; max |logit diff| in the
report), and the adapted model saves and loads as an ordinary checkpoint. Why not the identity:
a Qwen3 was trained with normalised q and k, so dropping the norm outright changes every attention
logit by the product of two RMS values (a broken model before any VL data); the fitted scale keeps
the function close (the report gives the next-token KL to the original and both Sink Strengths)
while removing what the paper asks about: nothing normalises q and k during adaptation any more,
so W_q / W_k updates can rescale the logits, the sink's included.

mode `freeze_gains`: the norm stays and only its gains are frozen during adaptation. Weaker (q and
k are still normalised per token, so it asks whether the learnable gains carry the change, not whether
normalisation protects). The only mode on Gemma 3: no transformers architecture runs a Gemma 3 without
its q/k norms (Gemma 2 lacks its per-layer-type RoPE), so there is no twin to remove them into.
"""

from __future__ import annotations

import copy

import torch

from evals.sink import sink_strength
from evals.sink.calibration import DEFAULT_SET, encode_texts, resolve_texts
from interventions.protect import Protection, register_protection
from interventions.qknorm import mean_next_token_kl, twin_from_state
from sinkstudy import SinkstudyError

MODES = ("remove", "freeze_gains")
# Text model types whose attention normalises q and k per head with learnable gains (q_norm / k_norm).
NATIVE_PER_HEAD = ("qwen3", "gemma3_text")
CHECK_TOLERANCE = 1e-3


def _validate(config: dict) -> None:
    if config["mode"] not in MODES:
        raise SinkstudyError(f"mode must be one of {', '.join(MODES)}, got {config['mode']!r}")


@register_protection("disable_qk_norm", defaults={"mode": "remove"}, validate=_validate)
class DisableQKNorm(Protection):
    """Sufficiency switch: adapt a native per-head QK-norm backbone with its QK-norm removed (or its gains frozen)."""

    def check_base(self, config) -> None:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        if text.model_type not in NATIVE_PER_HEAD:
            raise SinkstudyError(f"disable_qk_norm needs a backbone with native per-head QK-norm "
                                 f"({', '.join(NATIVE_PER_HEAD)}); this base is {text.model_type!r}")
        if self.config["mode"] != "remove":
            return
        if text.model_type != "qwen3":
            raise SinkstudyError(f"disable_qk_norm mode remove needs a Qwen3 (its Llama twin runs it without the norms); "
                                 f"on {text.model_type!r} use mode freeze_gains")
        if getattr(text, "layer_types", None) and any(t != "full_attention" for t in text.layer_types):
            raise SinkstudyError("disable_qk_norm: this Qwen3 has sliding-window layers, which its Llama twin cannot run")

    def prepare_base(self, lm, tokenizer, texts):
        self.check_base(lm.config)
        if self.config["mode"] != "remove":
            return None
        twin, report = remove_qk_norm(lm, tokenizer, [t.text for t in texts])
        self._report = report
        return twin

    def changes_architecture(self) -> bool:
        return self.config["mode"] == "remove"  # the Llama twin

    def setup(self, ctx) -> None:
        frozen = 0
        if self.config["mode"] == "freeze_gains":
            for name, p in ctx.language_model.named_parameters():
                if name.endswith(("q_norm.weight", "k_norm.weight")) and p.requires_grad:
                    p.requires_grad_(False)
                    frozen += p.numel()
        ctx.state["frozen"] = frozen

    def teardown(self, ctx) -> dict:
        return {"mode": self.config["mode"], **({"frozen_gain_params": ctx.state["frozen"]} if self.config["mode"] == "freeze_gains"
                                                 else getattr(self, "_report", {}))}


class _Scale(torch.nn.Module):
    """s * x over (..., heads, head_dim): a per-head linear stand-in for a q/k norm (the check)."""

    def __init__(self, scale: torch.Tensor):
        super().__init__()
        self.register_buffer("scale", scale)

    def forward(self, x):
        return x * self.scale.to(x.dtype)


@torch.no_grad()
def fitted_scales(model, tokenizer, texts: list[str]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, the (heads, head_dim) least-squares linear stand-ins for q_norm and k_norm (module doc)."""
    attns = [layer.self_attn for layer in model.model.layers]
    sums = [[torch.zeros(2, 1, 1, dtype=torch.float64) for _ in range(2)] for _ in attns]
    handles = []

    def collect(i: int, which: int, norm):
        def hook(module, inputs, output):
            x = inputs[0].detach().double()  # (..., heads, head_dim), what the norm receives
            r = (x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon).sqrt()
            flat = lambda t: t.reshape(-1, *t.shape[-2:]).sum(0)  # noqa: E731
            sums[i][which] = sums[i][which] + torch.stack([flat(x.pow(2) / r), flat(x.pow(2))])
        return hook

    for i, attn in enumerate(attns):
        handles.append(attn.q_norm.register_forward_hook(collect(i, 0, attn.q_norm)))
        handles.append(attn.k_norm.register_forward_hook(collect(i, 1, attn.k_norm)))
    items, _ = resolve_texts(list(texts), DEFAULT_SET)
    ids = encode_texts(tokenizer, items, apply_chat_template=bool(getattr(tokenizer, "chat_template", None)), max_length=512)
    device = next(model.parameters()).device
    try:
        for seq in ids:
            model(input_ids=torch.tensor([seq], device=device))
    finally:
        for h in handles:
            h.remove()
    out = []
    for attn, (q, k) in zip(attns, sums):
        gains = (attn.q_norm.weight.detach().double(), attn.k_norm.weight.detach().double())
        out.append(tuple(g * s[0] / s[1].clamp_min(1e-30) for g, s in zip(gains, (q, k))))
    return out


def llama_config_for(config):
    """The LlamaConfig that runs a (full-attention) Qwen3's weights without its q/k norms."""
    # lazy: loads transformers, PIL, huggingface_hub
    from transformers import LlamaConfig

    cfg = LlamaConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers, num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads, head_dim=config.head_dim, hidden_act=config.hidden_act,
        max_position_embeddings=config.max_position_embeddings, initializer_range=config.initializer_range,
        rms_norm_eps=config.rms_norm_eps, tie_word_embeddings=config.tie_word_embeddings,
        rope_parameters=dict(config.rope_parameters) if config.rope_parameters else None,
        attention_bias=config.attention_bias, attention_dropout=config.attention_dropout, mlp_bias=False,
        pad_token_id=config.pad_token_id, bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id)
    cfg.dtype = getattr(config, "dtype", None)
    return cfg


@torch.no_grad()
def remove_qk_norm(model, tokenizer, texts: list[str]) -> tuple:
    """(the Llama twin of `model` with its q/k norms replaced by fitted scales, a report)."""
    # lazy: loads transformers, PIL, huggingface_hub
    from transformers import LlamaForCausalLM

    cfg = model.config
    scales = fitted_scales(model, tokenizer, texts)
    hd = cfg.head_dim
    state = {k: v.clone() for k, v in model.state_dict().items() if ".q_norm." not in k and ".k_norm." not in k}
    for i, (sq, sk) in enumerate(scales):
        for proj, s in (("q_proj", sq), ("k_proj", sk)):
            factor = s.reshape(-1).to(state[f"model.layers.{i}.self_attn.{proj}.weight"].dtype)  # (heads * head_dim,)
            for part in ("weight", "bias"):
                key = f"model.layers.{i}.self_attn.{proj}.{part}"
                if key in state:
                    state[key] = state[key] * (factor[:, None] if part == "weight" else factor)
    twin = twin_from_state(LlamaForCausalLM, llama_config_for(cfg), state, model, what="Llama twin").eval()
    # The twin must be the Qwen3 with s * x in place of each norm (the fold is the only change).
    stand_in = copy.deepcopy(model).eval()
    for attn, (sq, sk) in zip((layer.self_attn for layer in stand_in.model.layers), scales):
        attn.q_norm, attn.k_norm = _Scale(sq.reshape(-1, hd).float()), _Scale(sk.reshape(-1, hd).float())
    ids = tokenizer(texts[0], return_tensors="pt")["input_ids"]
    fold_error = float((twin(input_ids=ids).logits - stand_in(input_ids=ids).logits).abs().max())
    if fold_error > CHECK_TOLERANCE:
        raise SinkstudyError(f"disable_qk_norm: the Llama twin differs from the stand-in model by {fold_error:.3g}")
    s_before = float(sink_strength(model, tokenizer, texts=list(texts), progress=False).value)
    s_after = float(sink_strength(twin, tokenizer, texts=list(texts), progress=False).value)
    report = {"mode": "remove", "twin": "LlamaForCausalLM", "fold_max_abs_logit_diff": fold_error,
              "mean_next_token_kl_to_original": mean_next_token_kl(model, twin, tokenizer, texts, progress=False),
              "sink_strength_original": s_before, "sink_strength_without_norm": s_after}
    return twin.train(model.training), report
