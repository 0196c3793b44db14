"""Post-pretraining QK-RMSNorm injection (per head, over head_dim, before RoPE: where Qwen3 has it).

The attention code of Llama / Mistral / Qwen2 / Gemma / Gemma2 is not copied. Each attention module
gets two `QKRMSNorm` children named `q_norm` / `k_norm` (the Qwen3 names, shape (head_dim,)) and
forward hooks on `q_proj` / `k_proj` that normalise the projection output per head before the
module reshapes it and applies RoPE. The model class, `forward`, `generate`, any attention
implementation and lm-eval's HFLM keep working, and the state-dict keys match Qwen3's.

Checkpoints (`save_injected` / `load_injected`, see docs/qknorm.md):
- "qwen3-sibling": Qwen2, Llama (mlp_bias off) and Mistral with a plain RMSNorm (alpha = 1) are
  written as an exact `Qwen3ForCausalLM` with the same weights (Qwen2's missing o_proj bias is
  written as zeros), loadable by plain `AutoModelForCausalLM.from_pretrained`.
- "sinkstudy-hooks": everything else (Gemma family, blend mode, Llama with MLP bias) is the
  original architecture's checkpoint plus `qknorm.safetensors` with the gains; `load_injected`
  re-attaches them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Sequence

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from tqdm.auto import tqdm

from evals.sink import sink_strength
from interventions.qknorm_modes import INIT_MODES, TRAINABLE_MODES
from sinkstudy import SinkstudyError
from sinkstudy.io import atomic_output_dir, read_json, write_json_atomic

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "gemma", "gemma2")
SIDECAR = "sinkstudy_qknorm.json"
GAINS_FILE = "qknorm.safetensors"
# Sibling conversion is exact only for these (read in transformers 5.23: same decoder layer,
# MLP, RMSNorm and rotary code as Qwen3; sliding windows map onto Qwen3's layer_types).
_QWEN3_SIBLINGS = ("llama", "mistral", "qwen2")


class QKNormError(SinkstudyError):
    """Refused injection: native QK-norm, already injected, or unsupported architecture."""


class QKRMSNorm(nn.Module):
    """Per-head RMSNorm over head_dim, numerically identical to `Qwen3RMSNorm` when alpha == 1.

    With alpha < 1 it returns the blend (1 - alpha) x + alpha * norm(x), which is the identity at
    alpha = 0 (no Qwen3 equivalent: such checkpoints use the "sinkstudy-hooks" format).
    """

    def __init__(self, head_dim: int, eps: float, alpha: float = 1.0):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(head_dim))
        self.variance_epsilon = eps
        self.alpha = float(alpha)
        if self.alpha != 1.0:
            # In the state dict, so model fingerprints (and so the keys of the steps that read them) tell blends apart.
            self.register_buffer("blend_alpha", torch.tensor(self.alpha))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Same op order as Qwen3RMSNorm, so the sibling checkpoint reproduces logits bit for bit.
        input_dtype = x.dtype
        h = x.to(torch.float32)
        variance = h.pow(2).mean(-1, keepdim=True)
        h = h * torch.rsqrt(variance + self.variance_epsilon)
        normed = self.weight * h.to(input_dtype)
        if self.alpha == 1.0:
            return normed
        return (1.0 - self.alpha) * x + self.alpha * normed

    def projection_hook(self, module, inputs, output: torch.Tensor) -> torch.Tensor:
        """Forward hook for q_proj / k_proj: normalise each head of the flat projection output.

        A bound method, so `copy.deepcopy(model)` re-binds it to the copy's own norm (a closure would
        keep pointing at the original's).
        """
        shape = output.shape
        return self(output.view(*shape[:-1], -1, self.weight.shape[0])).view(shape)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}, alpha={self.alpha}"


# ---------------------------------------------------------------------------------------------
# Inspection


def attention_modules(model) -> list[nn.Module]:
    """The self-attention module of every decoder layer (modules with q_proj, k_proj, head_dim)."""
    return [m for m in model.modules() if hasattr(m, "q_proj") and hasattr(m, "k_proj") and hasattr(m, "head_dim")]


def qk_norm_kind(model) -> str:
    """'injected' (ours), 'native' (the architecture has q_norm/k_norm) or 'none'."""
    kinds = set()
    for attn in attention_modules(model):
        norm = getattr(attn, "q_norm", None)
        if isinstance(norm, QKRMSNorm):
            kinds.add("injected")
        elif norm is not None or getattr(attn, "k_norm", None) is not None:
            kinds.add("native")
    return kinds.pop() if len(kinds) == 1 else ("none" if not kinds else "mixed")


def _text_config(model):
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def check_injectable(model) -> list[nn.Module]:
    """Raise `QKNormError` (one line) unless `model` is a supported architecture without QK-norm."""
    model_type = getattr(_text_config(model), "model_type", type(model).__name__)
    kind = qk_norm_kind(model)
    if kind == "native":
        raise QKNormError(
            f"{model_type} already has native QK-norm (q_norm/k_norm in its attention); refusing to inject "
            "a second one. Measure it as a native backbone instead (CLI: --native-ok)"
        )
    if kind in ("injected", "mixed"):
        raise QKNormError(f"this {model_type} model already carries injected QK-norm")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise QKNormError(
            f"QK-norm injection does not support model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    attns = attention_modules(model)
    if len(attns) != _text_config(model).num_hidden_layers:
        raise QKNormError(f"found {len(attns)} attention modules for {_text_config(model).num_hidden_layers} layers in {model_type}")
    return attns


# ---------------------------------------------------------------------------------------------
# Calibration and injection


@torch.no_grad()
def calibrate_gains(model, tokenizer, texts: Sequence[str], *, progress: bool = True) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, the least-squares (q, k) gains g with g * x / rms(x) closest to x on `texts`.

    For each dimension d of a head: g_d = sum(x_d^2 / r) / sum(x_d^2 / r^2), pooled over tokens and
    heads (the gain vector is shared by all heads, as in Qwen3), with r the per-head RMS of that
    token. That is the mean of r weighted by the share of each token's energy in dimension d, so
    tokens with huge norms (the sink) cannot dominate it.
    """
    attns = attention_modules(model)
    stats = [[torch.zeros(a.head_dim, dtype=torch.float64) for _ in range(4)] for a in attns]
    handles = []
    eps = _text_config(model).rms_norm_eps

    def collect(i: int, which: int, head_dim: int):
        def hook(module, inputs, output):
            x = output.detach().to(torch.float64).reshape(-1, head_dim)
            r2 = x.pow(2).mean(-1, keepdim=True) + eps
            stats[i][2 * which] += (x.pow(2) / r2.sqrt()).sum(0)
            stats[i][2 * which + 1] += (x.pow(2) / r2).sum(0)

        return hook

    for i, attn in enumerate(attns):
        handles.append(attn.q_proj.register_forward_hook(collect(i, 0, attn.head_dim)))
        handles.append(attn.k_proj.register_forward_hook(collect(i, 1, attn.head_dim)))
    try:
        device = next(model.parameters()).device
        for text in tqdm(list(texts), desc="calibrate qk gains", disable=not progress, leave=False):
            ids = tokenizer(text, return_tensors="pt")["input_ids"].to(device)
            model(input_ids=ids)
    finally:
        for h in handles:
            h.remove()
    return [(q1 / q2.clamp_min(1e-30), k1 / k2.clamp_min(1e-30)) for q1, q2, k1, k2 in stats]


def inject_qk_norm(
    model,
    *,
    init: str = "scale-preserving",
    calibration_texts: Sequence[str] | None = None,
    tokenizer=None,
    alpha: float = 0.5,
    progress: bool = True,
):
    """Add per-head QK-RMSNorm to every attention layer of `model`, in place; returns `model`.

    init: "identity-gain" (gains 1: what the paper did; changes the function), "scale-preserving"
    (gains from `calibrate_gains` on `calibration_texts`), "blend" ((1-alpha) x + alpha * norm(x)
    with scale-preserving gains; alpha = 0 is exactly the original model).
    """
    if init not in INIT_MODES:
        raise SinkstudyError(f"unknown init {init!r}; choose from {', '.join(INIT_MODES)}")
    if init == "blend" and not 0.0 <= alpha <= 1.0:
        raise SinkstudyError(f"blend alpha must be in [0, 1], got {alpha}")
    attns = check_injectable(model)
    needs_calibration = init != "identity-gain"
    if needs_calibration and (tokenizer is None or not calibration_texts):
        raise SinkstudyError(f"init {init!r} needs a tokenizer and calibration_texts")
    gains = calibrate_gains(model, tokenizer, calibration_texts, progress=progress) if needs_calibration else None
    _attach(model, attns, alpha=alpha if init == "blend" else 1.0, gains=gains)
    if getattr(model.config, "_name_or_path", ""):  # what logs and eval records call it (config.json never stores it)
        model.config.name_or_path = f"{model.config._name_or_path}+qknorm-{init}"
    return model


def _attach(model, attns, *, alpha: float, gains=None) -> None:
    eps = _text_config(model).rms_norm_eps
    param = next(model.parameters())
    for i, attn in enumerate(attns):
        for which, proj in ((0, attn.q_proj), (1, attn.k_proj)):
            norm = QKRMSNorm(attn.head_dim, eps, alpha).to(device=param.device, dtype=param.dtype)
            if gains is not None:
                norm.weight.data.copy_(gains[i][which].to(norm.weight.dtype))
            attn.add_module("q_norm" if which == 0 else "k_norm", norm)
            proj.register_forward_hook(norm.projection_hook)


# ---------------------------------------------------------------------------------------------
# Distance from the original at init


@torch.no_grad()
def mean_next_token_kl(original, injected, tokenizer, texts: Sequence[str], *, progress: bool = True) -> float:
    """Mean over texts and positions of KL(original || injected) of next-token distributions (nats)."""
    total, count = 0.0, 0
    device = next(original.parameters()).device
    for text in tqdm(list(texts), desc="next-token KL", disable=not progress, leave=False):
        ids = tokenizer(text, return_tensors="pt")["input_ids"].to(device)
        p = torch.log_softmax(original(input_ids=ids).logits.float(), -1)
        q = torch.log_softmax(injected(input_ids=ids.to(next(injected.parameters()).device)).logits.float().to(device), -1)
        kl = (p.exp() * (p - q)).sum(-1)
        total += kl.sum().item()
        count += kl.numel()
    return total / max(count, 1)


def init_report(original, injected, tokenizer, texts: Sequence[str], *, sink_original: float | None = None,
                progress: bool = True) -> dict:
    """How far the injected model is from the original: next-token KL and Sink Strength change.

    `sink_original` reuses an already measured Sink Strength of `original` on the same texts.
    """
    if sink_original is None:
        sink_original = float(sink_strength(original, tokenizer, texts=list(texts), progress=progress).value)
    s_inj = float(sink_strength(injected, tokenizer, texts=list(texts), progress=progress).value)
    return {
        "mean_kl": mean_next_token_kl(original, injected, tokenizer, texts, progress=progress),
        "sink_strength_original": sink_original,
        "sink_strength_injected": s_inj,
        "sink_strength_change": s_inj - sink_original,
        "n_texts": len(texts),
    }


# ---------------------------------------------------------------------------------------------
# Recovery training filters


def trainable_filter(mode: str) -> Callable[[str, nn.Parameter], bool]:
    """`interventions.training.train_causal_lm` filter: the norm gains, + attention, or all."""
    if mode == "gains":
        return lambda name, p: name.endswith(("q_norm.weight", "k_norm.weight"))
    if mode == "attention":
        return lambda name, p: ".self_attn." in name
    if mode == "all":
        return lambda name, p: True
    raise SinkstudyError(f"unknown trainable mode {mode!r}; choose from {', '.join(TRAINABLE_MODES)}")


# ---------------------------------------------------------------------------------------------
# Checkpoints


def _norm_alpha(model) -> float:
    alphas = {m.alpha for m in model.modules() if isinstance(m, QKRMSNorm)}
    if not alphas:
        raise SinkstudyError("model carries no injected QK-norm; nothing to save with save_injected")
    return alphas.pop()


def checkpoint_format(model) -> str:
    """'qwen3-sibling' where an exact Qwen3 equivalent exists, else 'sinkstudy-hooks'."""
    config = _text_config(model)
    exact = (
        config.model_type in _QWEN3_SIBLINGS
        and _norm_alpha(model) == 1.0
        and not getattr(config, "mlp_bias", False)
    )
    return "qwen3-sibling" if exact else "sinkstudy-hooks"


def qwen3_config_for(config):
    """The Qwen3Config that runs `config`'s (Llama / Mistral / Qwen2) weights plus QK-norm."""
    # lazy: loads transformers, PIL, huggingface_hub
    from transformers import Qwen3Config

    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    fields = dict(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=head_dim,
        hidden_act=config.hidden_act,
        max_position_embeddings=config.max_position_embeddings,
        initializer_range=config.initializer_range,
        rms_norm_eps=config.rms_norm_eps,
        tie_word_embeddings=config.tie_word_embeddings,
        rope_parameters=dict(config.rope_parameters) if config.rope_parameters else None,
        attention_dropout=config.attention_dropout,
        pad_token_id=config.pad_token_id,
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
    )
    if config.model_type == "qwen2":
        # Qwen2 biases q/k/v but not o; Qwen3's attention_bias covers all four (o_proj.bias = 0).
        fields.update(attention_bias=True, use_sliding_window=config.use_sliding_window,
                      sliding_window=config.sliding_window, max_window_layers=config.max_window_layers,
                      layer_types=list(config.layer_types))
    elif config.model_type == "mistral":
        window = config.sliding_window
        # Mistral applies its window to every layer: Qwen3 does the same with max_window_layers=0.
        fields.update(attention_bias=False, use_sliding_window=window is not None,
                      sliding_window=window, max_window_layers=0)
    else:
        fields.update(attention_bias=config.attention_bias, use_sliding_window=False)
    cfg = Qwen3Config(**fields)
    cfg.dtype = getattr(config, "dtype", None)
    return cfg


def _norm_tensors(model) -> dict[str, torch.Tensor]:
    """Every tensor the injection added: gains (and blend_alpha buffers)."""
    return {n: t.detach().contiguous() for n, t in model.state_dict().items() if n.rsplit(".", 2)[-2] in ("q_norm", "k_norm")}


def save_injected(model, path: str | os.PathLike, *, tokenizer=None, metadata: dict | None = None, replace: bool = False) -> Path:
    """Save an injected model atomically (format per `checkpoint_format`), with a JSON sidecar."""
    fmt = checkpoint_format(model)
    alpha = _norm_alpha(model)
    with atomic_output_dir(path, replace=replace) as tmp:
        if fmt == "qwen3-sibling":
            _save_qwen3_sibling(model, tmp)
        else:
            gains = _norm_tensors(model)
            state = {k: v for k, v in model.state_dict().items() if k not in gains}
            model.save_pretrained(tmp, state_dict=state)
            save_file({k: v.cpu() for k, v in gains.items()}, str(tmp / GAINS_FILE), metadata={"format": "pt"})
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        write_json_atomic(tmp / SIDECAR, {
            "format": fmt,
            "source_model_type": _text_config(model).model_type,
            "alpha": alpha,
            "eps": _text_config(model).rms_norm_eps,
            **(metadata or {}),
        })
    return Path(path)


def _save_qwen3_sibling(model, out: Path) -> None:
    to_qwen3_sibling(model).save_pretrained(out)


def to_qwen3_sibling(model):
    """The exact `Qwen3ForCausalLM` twin of an injected Llama / Mistral / Qwen2 (shares its tensors).

    Used for checkpoints ("qwen3-sibling") and to carry injected QK-norm inside a LLaVA build, whose
    text model is then an ordinary Qwen3 (`interventions.adapt.build`).
    """
    # lazy: loads transformers, PIL, huggingface_hub
    from transformers import Qwen3ForCausalLM

    if checkpoint_format(model) != "qwen3-sibling":
        raise SinkstudyError(f"{_text_config(model).model_type} with this injection has no exact Qwen3 twin")
    config = qwen3_config_for(_text_config(model))
    state = dict(model.state_dict())
    for i in range(config.num_hidden_layers if config.attention_bias else 0):
        name = f"model.layers.{i}.self_attn.o_proj.bias"  # Qwen3's attention_bias gives o_proj a bias: zero if absent
        if name not in state:
            weight = state[name.replace("bias", "weight")]
            state[name] = torch.zeros(config.hidden_size, dtype=weight.dtype, device=weight.device)
    return twin_from_state(Qwen3ForCausalLM, config, state, model, what="Qwen3 conversion")


def twin_from_state(model_class, config, state: dict, source, *, what: str):
    """`model_class(config)` holding `state`'s tensors (shared, not copied), behaving like `source`: tied
    embeddings, RoPE buffers, attention implementation, generation config and train/eval mode carried over.
    A tensor missing or left over is a one-line error naming `what`."""
    with torch.device("meta"):
        twin = model_class(config)
    missing, unexpected = twin.load_state_dict(state, strict=False, assign=True)
    missing = [m for m in missing if not (config.tie_word_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise SinkstudyError(f"{what} mismatch: missing {missing[:3]}, unexpected {unexpected[:3]}")
    if config.tie_word_embeddings:
        twin.tie_weights()
    # RoPE's inverse frequencies are non-persistent buffers (not in the state dict): meta until built for real.
    device = next(source.parameters()).device
    twin.model.rotary_emb = type(twin.model.rotary_emb)(config=twin.config).to(device)
    if getattr(source, "generation_config", None) is not None:
        twin.generation_config = source.generation_config
    impl = getattr(_text_config(source), "_attn_implementation", None)
    if impl:
        twin.set_attn_implementation(impl)
    return twin.train(source.training)


def load_injected(path: str | os.PathLike, **from_pretrained_kwargs):
    """Load a checkpoint written by `save_injected` (either format), in eval mode."""
    # lazy: loads transformers, PIL, huggingface_hub
    from transformers import AutoModelForCausalLM

    path = Path(path)
    meta = read_json(path / SIDECAR)
    model = AutoModelForCausalLM.from_pretrained(path, **from_pretrained_kwargs)
    if meta["format"] == "sinkstudy-hooks":
        gains_file = path / GAINS_FILE
        if not gains_file.is_file():
            raise SinkstudyError(f"missing {gains_file}: not a complete sinkstudy-hooks QK-norm checkpoint")
        _attach(model, check_injectable(model), alpha=meta["alpha"])
        gains = load_file(str(gains_file))
        expected = _norm_tensors(model)
        if set(gains) != set(expected):
            raise SinkstudyError(f"{gains_file} does not match the injected norms of {type(model).__name__}")
        model.load_state_dict(gains, strict=False)
    elif meta["format"] != "qwen3-sibling":
        raise SinkstudyError(f"unknown QK-norm checkpoint format {meta['format']!r} in {path / SIDECAR}")
    return model.eval()


def is_injected_checkpoint(path: str | os.PathLike) -> bool:
    return (Path(path) / SIDECAR).is_file()


# ---------------------------------------------------------------------------------------------
# Injected norms carried inside a VLM whose text class has no q_norm/k_norm (hooks + sidecar)

VLM_FORMAT = "sinkstudy-hooks-vlm"


def injected_norms(decoder) -> tuple[dict[str, torch.Tensor], float]:
    """(gain tensors named relative to `decoder`, alpha) of the injected norms in a text decoder."""
    return _norm_tensors(decoder), _norm_alpha(decoder)


def attach_norms(decoder, gains: dict[str, torch.Tensor], alpha: float) -> None:
    """Re-attach injected norms (names relative to `decoder`, as `injected_norms` returns them)."""
    attns = attention_modules(decoder)
    if qk_norm_kind(decoder) != "none":
        raise QKNormError(f"{type(decoder).__name__} already has QK-norm; refusing to attach injected norms")
    _attach(decoder, attns, alpha=alpha)
    expected = _norm_tensors(decoder)
    if set(gains) != set(expected):
        raise SinkstudyError(f"saved QK-norm gains do not match {type(decoder).__name__}: "
                             f"{sorted(set(gains) ^ set(expected))[:3]}")
    decoder.load_state_dict({k: v.to(expected[k].device) for k, v in gains.items()}, strict=False)


def save_vlm_norms(decoder, path: str | os.PathLike, metadata: dict | None = None) -> None:
    """Write the gains of a VLM's injected text-decoder norms beside its checkpoint (inside `path`)."""
    gains, alpha = injected_norms(decoder)
    save_file({k: v.cpu() for k, v in gains.items()}, str(Path(path) / GAINS_FILE), metadata={"format": "pt"})
    write_json_atomic(Path(path) / SIDECAR, {"format": VLM_FORMAT, "source_model_type": _text_config(decoder).model_type,
                                             "alpha": alpha, "eps": _text_config(decoder).rms_norm_eps, **(metadata or {})})


def load_vlm_norms(path: str | os.PathLike, decoder) -> bool:
    """Re-attach the norms `save_vlm_norms` wrote in `path` to `decoder`; False when `path` has none."""
    path = Path(path)
    if not (path / SIDECAR).is_file():
        return False
    meta = read_json(path / SIDECAR)
    if meta.get("format") != VLM_FORMAT:
        raise SinkstudyError(f"{path / SIDECAR} is a {meta.get('format')!r} causal-LM sidecar, not a VLM one")
    attach_norms(decoder, load_file(str(path / GAINS_FILE)), meta["alpha"])
    return True


# Documented bound (docs/qknorm.md): on the sinkstudy.tiny test models (default init, calibration on
# sinkstudy.tiny.DEFAULT_TOKENIZER_TEXTS) scale-preserving measured ~1e-7 nats mean next-token KL,
# identity-gain ~2e-3 (llama, mistral, qwen2). Larger-weight models move both up; see the docs.
SCALE_PRESERVING_KL_BOUND = 1e-4
