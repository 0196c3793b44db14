"""Compare two causal LMs' tensor layouts before any heavy work.

A layout is {tensor name: shape}, with attention projections shown split into heads
(heads, head_dim, in) so that a different head layout with the same total width is still caught.
Configs are laid out on the meta device: no memory, no weights read. This module is the bottom of
the package: it knows causal LMs only (VLMs are translated to one by `archs`).
"""

from __future__ import annotations

import re
from typing import Mapping

from sinkstudy import SinkstudyError


class PairMismatchError(SinkstudyError):
    """The two language models cannot be diffed or merged tensor by tensor."""


VOCAB_TENSORS = ("model.embed_tokens.weight", "lm_head.weight")
_PROJ = re.compile(r"\.self_attn\.([qkvo])_proj\.(weight|bias)$")


def layout(obj) -> dict[str, tuple]:
    """{name: shape} of a causal LM, a causal-LM config, or a {name: shape/tensor} mapping.

    Paths, hub ids and VLMs are resolved one level up (`resolve.check_same_layout`).
    """
    if isinstance(obj, Mapping):
        return {k: tuple(getattr(v, "shape", v)) for k, v in obj.items()}
    if hasattr(obj, "state_dict"):
        shapes = {k: tuple(v.shape) for k, v in obj.state_dict().items()}
        return _split_heads(shapes, obj.config)
    if hasattr(obj, "model_type"):
        return _split_heads(_meta_shapes(obj), obj)
    raise TypeError(f"cannot lay out {type(obj).__name__}")


def compare_layouts(a, b, *, names: tuple[str, str] = ("base", "vlm"), ignore_vocab: bool = False) -> None:
    """Raise PairMismatchError naming the first tensor whose presence or shape differs."""
    la, lb = layout(a), layout(b)
    na, nb = names
    for name, shape in la.items():
        if ignore_vocab and name in VOCAB_TENSORS:
            continue
        if name not in lb:
            raise PairMismatchError(f"layout mismatch at {name}: {na} {_fmt(shape)} vs {nb} (missing)")
        if lb[name] != shape:
            raise PairMismatchError(f"layout mismatch at {name}: {na} {_fmt(shape)} vs {nb} {_fmt(lb[name])}")
    for name, shape in lb.items():
        if name not in la and not (ignore_vocab and name in VOCAB_TENSORS):
            raise PairMismatchError(f"layout mismatch at {name}: {na} (missing) vs {nb} {_fmt(shape)}")


def _meta_shapes(config) -> dict[str, tuple]:
    # lazy: loads torch, transformers, numpy
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if getattr(config, "tie_word_embeddings", False):
        shapes.setdefault("lm_head.weight", shapes["model.embed_tokens.weight"])
    return shapes


def _split_heads(shapes: dict[str, tuple], config) -> dict[str, tuple]:
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    n_q = getattr(cfg, "num_attention_heads", None)
    if not n_q:
        return shapes
    n_kv = getattr(cfg, "num_key_value_heads", None) or n_q
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_q
    out = {}
    for name, shape in shapes.items():
        m = _PROJ.search(name)
        if m and m.group(1) in "qkv":
            heads = n_q if m.group(1) == "q" else n_kv
            shape = (heads, head_dim, *shape[1:]) if shape[0] == heads * head_dim else shape
        elif m and m.group(2) == "weight" and len(shape) == 2 and shape[1] == n_q * head_dim:
            shape = (shape[0], n_q, head_dim)
        out[name] = shape
    return out


def _fmt(shape: tuple) -> str:
    return "(" + ", ".join(str(s) for s in shape) + ")"
