"""Build a VLM around a base causal LM: a fresh LLaVA, a donor VLM's tower + projector, or a tiny tower.

- fresh: `LlavaForConditionalGeneration` with text_config = the base's own config, a CLIP or SigLIP
  vision tower (hub id or local path: its weights and image processor) and a new 2-layer GELU
  projector (LLaVA-1.5). CLIP features come from the second-to-last layer without CLS (LLaVA-1.5's
  "default"), SigLIP's from the last layer, all patches ("full").
- donor: an existing VLM whose language model has the base's architecture (Qwen2-VL / Qwen2.5-VL or a
  LLaVA): its tower and projector (merger) stay, its language model takes the base's weights; rows
  the donor adds to the vocabulary (image tokens) keep the donor's values.
- tiny: a small randomly initialised CLIP tower built locally (tests, the demo).
- scenes: a small CLIP tower pretrained here on the recipe's images (`interventions.adapt.tower`, cached),
  whose last layer's patch features linearly decode shape, colour, count and digit.

The language model inside the result gives the base's logits on text (`check_round_trip`). The
result saves as an ordinary HF checkpoint + processor (`interventions.adapt.vlm_io`), read like a hub VLM by
`interventions.pairs`.

Injected QK-norm (`interventions.qknorm`): a LLaVA build takes the injected base as its exact Qwen3
twin (text_config = Qwen3Config; an ordinary checkpoint). Where no twin exists (Gemma, blend
injections) or the donor's text class has no q_norm, the norms are carried as forward hooks on the
VLM's text decoder plus a sidecar (`qknorm.save_vlm_norms`); `vlm_io.load_vlm` and `vlm_io.extract_lm` re-attach them.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
from pathlib import Path
from typing import Any

import torch

from interventions import qknorm
from interventions.adapt.config import TINY_DEFAULTS, VisionSpec
from interventions.adapt.tower import pretrained_tower, settings_of, tower_report, vision_config
from interventions.pairs import check_same_layout
from interventions.pairs.archs import plan_target_config
from interventions.pairs.resolve import load_config
from sinkstudy import SinkstudyError

log = logging.getLogger(__name__)

# Image placeholder tokens a tokenizer may already have (first found is used); else "<image>" is added.
IMAGE_TOKEN_CANDIDATES = ("<image>", "<|image|>", "<|image_pad|>", "<image_soft_token>")
DONOR_TYPES = ("qwen2_vl", "qwen2_5_vl", "llava")
# Text wrapped around a donor's expanded image tokens (what its own chat template writes).
_IMAGE_WRAP = {"qwen2_vl": ("<|vision_start|>", "<|vision_end|>"), "qwen2_5_vl": ("<|vision_start|>", "<|vision_end|>")}


@dataclasses.dataclass
class Built:
    """A VLM ready to train, with what the data pipeline needs to format its inputs."""

    model: Any
    processor: Any  # saves beside the model; its image processor prepares pixels
    tokenizer: Any
    image_token: str  # the placeholder the text carries, expanded per image (see data.py)
    image_wrap: tuple[str, str]  # text around the expanded tokens (Qwen-VL vision start/end)
    report: dict


# --------------------------------------------------------------------------- entry point

def build_vlm(base, tokenizer, vision: VisionSpec) -> Built:
    """A VLM whose language model starts as `base` (a loaded causal LM, possibly QK-norm injected)."""
    tokenizer = copy.deepcopy(tokenizer)  # a fresh build may add its image token
    image_token, added = _image_token(tokenizer) if vision.kind != "donor" else (None, False)
    lm, carried = base, None
    if qknorm.qk_norm_kind(base) == "injected":
        if vision.kind != "donor" and qknorm.checkpoint_format(base) == "qwen3-sibling":
            lm = qknorm.to_qwen3_sibling(base)  # exact: an ordinary Qwen3 text model
        else:
            carried = qknorm.injected_norms(base.model)
    state = {k.removeprefix("model."): v for k, v in lm.state_dict().items()
             if k.startswith("model.") and (carried is None or k.removeprefix("model.") not in carried[0])}
    if vision.kind == "donor":
        built = _donor(lm, state, tokenizer, vision)
    else:
        built = _llava(lm, state, tokenizer, vision, image_token)
    if carried is not None:
        qknorm.attach_norms(built.model.get_decoder(), *carried)
    built.report.update(image_token=built.image_token, image_token_added=added,
                        qk_norm="injected, carried as hooks + sidecar" if carried is not None
                        else qknorm.qk_norm_kind(built.model.get_decoder()))
    built.model.to(next(base.parameters()).dtype)
    return built


# --------------------------------------------------------------------------- fresh / tiny LLaVA

def _llava(lm, state: dict, tokenizer, vision: VisionSpec, image_token: str) -> Built:
    # lazy: loads transformers, PIL, huggingface_hub
    from transformers import LlavaForConditionalGeneration, LlavaProcessor
    from transformers.initialization import no_init_weights

    vision_config, family = tower_config(vision)
    vocab = max(lm.config.vocab_size, len(tokenizer))
    config, info = llava_config(lm.config, vision_config, family, vision, tokenizer.convert_tokens_to_ids(image_token), vocab)
    with no_init_weights():  # every tensor is set below
        vlm = LlavaForConditionalGeneration(config)
    load_language_model(vlm, lm, state, vocab, own_rows=False)  # its rows are uninitialised memory
    tower_state, image_processor = _tower_weights(vision, vision_config)
    missing, unexpected = vlm.model.vision_tower.load_state_dict(_tower_names(tower_state, vlm.model.vision_tower), strict=False)
    if missing or unexpected:
        raise SinkstudyError(f"vision tower {vision.source or 'tiny'} does not fit: missing {missing[:3]}, unexpected {unexpected[:3]}")
    _init_projector(vlm.model.multi_modal_projector, vision.seed)
    vlm.eval()
    template = multimodal_chat_template(tokenizer.chat_template, image_token)
    tokenizer.chat_template = template  # one template file per checkpoint: the tokenizer and the processor share it
    processor = LlavaProcessor(
        image_processor=image_processor, tokenizer=tokenizer, patch_size=vision_config.patch_size,
        vision_feature_select_strategy=info["vision_feature_select_strategy"], num_additional_image_tokens=info["cls_tokens"],
        image_token=image_token, chat_template=template,
    )
    _generation_defaults(vlm, tokenizer)
    report = {"kind": vision.kind, "source": vision.source, "tower": family, **info, "vocab_size": vocab,
              "text_model_type": config.text_config.model_type}
    if vision.kind == "scenes":  # what the frozen tower sees: its linear probe on held-out images

        report["tower_probe"] = tower_report(pretrained_tower(vision.tiny))["probe"]
    return Built(vlm, processor, tokenizer, image_token, ("", ""), report)


# Rewrites each message whose content is a list of parts ({"type": "image"} / {"type": "text", "text": ...}, what
# multimodal clients such as lm-eval's hf-multimodal send) into one string, images as the image token, before the
# text model's own template reads `messages`: the template of a text LLM renders only string contents.
_PARTS_TO_TEXT = """{%- set ns = namespace(messages=[]) -%}
{%- for message in messages -%}
{%- if message['content'] is string -%}{%- set ns.messages = ns.messages + [message] -%}
{%- else -%}{%- set text = namespace(value='') -%}
{%- for part in message['content'] -%}
{%- if part['type'] == 'image' -%}{%- set text.value = text.value + IMAGE_TOKEN -%}
{%- elif part['type'] == 'text' -%}{%- set text.value = text.value + part['text'] -%}{%- endif -%}
{%- endfor -%}
{%- set ns.messages = ns.messages + [{'role': message['role'], 'content': text.value}] -%}
{%- endif -%}
{%- endfor -%}
{%- set messages = ns.messages -%}
"""


def multimodal_chat_template(template: str | None, image_token: str) -> str | None:
    """The base's chat template, reading content given as parts too (images as `image_token`); string contents render
    exactly as before. None stays None (a base without a template)."""
    if template is None or template.startswith(_PARTS_TO_TEXT.split("\n")[0]):
        return template
    return _PARTS_TO_TEXT.replace("IMAGE_TOKEN", repr(image_token)) + template


def llava_config(text_config, vision_config, family: str, vision: VisionSpec, image_token_index: int, vocab: int):
    """(LlavaConfig, facts) for a fresh/tiny build: LLaVA-1.5 feature choice, 2-layer GELU projector."""
    # lazy: loads transformers, PIL, huggingface_hub
    from transformers import LlavaConfig

    strategy = "full" if family == "siglip" else "default"
    # A hub CLIP: LLaVA-1.5's second-to-last layer; the tiny and scenes towers (whose pretraining heads read
    # the last layer) and SigLIP: the last.
    layer = vision.feature_layer if vision.feature_layer is not None else (-2 if vision.kind == "fresh" and family == "clip" else -1)
    cls_tokens = 1 if family == "clip" else 0
    n_image_tokens = (vision_config.image_size // vision_config.patch_size) ** 2 + (cls_tokens if strategy == "full" else 0)
    text = text_config.__class__.from_dict({**text_config.to_dict(), "vocab_size": vocab})
    config = LlavaConfig(text_config=text, vision_config=vision_config, image_token_index=image_token_index,
                         image_seq_length=n_image_tokens, vision_feature_layer=layer, vision_feature_select_strategy=strategy,
                         projector_hidden_act="gelu", tie_word_embeddings=text_config.tie_word_embeddings)
    config.text_config.tie_word_embeddings = text_config.tie_word_embeddings
    info = {"vision_feature_layer": layer, "vision_feature_select_strategy": strategy, "cls_tokens": cls_tokens,
            "image_tokens_per_image": n_image_tokens}
    return config, info


def tower_config(vision: VisionSpec):
    """(vision config, 'clip' | 'siglip') of a fresh or tiny tower, from configs only."""
    # lazy: loads transformers, PIL, huggingface_hub
    from transformers import CLIPVisionConfig

    if vision.kind == "tiny":
        t = {**TINY_DEFAULTS, **vision.tiny}
        return CLIPVisionConfig(hidden_size=t["hidden_size"], intermediate_size=t.get("intermediate_size", 2 * t["hidden_size"]),
                                num_hidden_layers=t["num_hidden_layers"], num_attention_heads=t["num_attention_heads"],
                                image_size=t["image_size"], patch_size=t["patch_size"], num_channels=3), "clip"
    if vision.kind == "scenes":
        return vision_config(settings_of(vision.tiny)), "clip"

    cfg = load_config(vision.source)  # one-line error for a missing path / offline hub id
    family = "siglip" if "siglip" in cfg.model_type else "clip" if "clip" in cfg.model_type else None
    if family is None:
        raise SinkstudyError(f"--vision {vision.source}: a CLIP or SigLIP model is needed, got model_type {cfg.model_type!r}")
    return getattr(cfg, "vision_config", cfg), family


def _tower_weights(vision: VisionSpec, vision_config):
    """(tower state dict, image processor): seeded random for tiny, the checkpoint's for fresh."""
    # lazy: loads transformers, PIL, huggingface_hub
    from transformers import AutoModel, CLIPVisionModel

    if vision.kind == "tiny":
        from transformers import CLIPImageProcessorPil  # no torchvision needed

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(vision.seed)
            state = CLIPVisionModel(vision_config).state_dict()
        size = vision_config.image_size
        proc = CLIPImageProcessorPil(size={"shortest_edge": size}, crop_size={"height": size, "width": size},
                                     image_mean=[0.5] * 3, image_std=[0.5] * 3)
        return state, proc
    if vision.kind == "scenes":
        # lazy: loads transformers, PIL, huggingface_hub
        from transformers import AutoImageProcessor

        path = pretrained_tower(vision.tiny)
        return CLIPVisionModel.from_pretrained(path, dtype=torch.float32).state_dict(), AutoImageProcessor.from_pretrained(path)
    model = AutoModel.from_pretrained(vision.source, dtype=torch.float32)
    return getattr(model, "vision_model", model).state_dict(), load_processor(vision)


def load_processor(vision: VisionSpec):
    """The image processor of a fresh tower, or a donor's whole processor; one line if it cannot load."""
    # lazy: loads transformers, PIL, huggingface_hub
    from transformers import AutoImageProcessor, AutoProcessor

    flag = "--vision" if vision.kind == "fresh" else "--donor"
    try:
        proc = (AutoImageProcessor if vision.kind == "fresh" else AutoProcessor).from_pretrained(vision.source)
    except (OSError, ValueError, ImportError, AttributeError) as exc:
        # Qwen-VL processors need torchvision (their video processor): `pip install torchvision`.
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise SinkstudyError(f"{flag} {vision.source}: cannot load its processor: {first}") from None
    if vision.kind == "donor" and not hasattr(proc, "image_processor"):
        raise SinkstudyError(f"{flag} {vision.source}: no image processor saved there (processor_config.json / preprocessor_config.json)")
    return proc


def _tower_names(state: dict, tower) -> dict:
    """`state` under the tower's own names (with or without the `vision_model.` level, by class/version)."""
    nested = any(k.startswith("vision_model.") for k in tower.state_dict())
    flat = {k.removeprefix("vision_model."): v for k, v in state.items()}
    return {f"vision_model.{k}": v for k, v in flat.items()} if nested else flat


def _init_projector(projector, seed: int) -> None:
    """PyTorch's default Linear init (what LLaVA-1.5's code uses), from `seed`, identical across arms."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for m in projector.modules():
            if isinstance(m, torch.nn.Linear):
                m.reset_parameters()


# --------------------------------------------------------------------------- donor

def _donor(lm, state: dict, tokenizer, vision: VisionSpec) -> Built:
    vlm, report = donor_model(lm, state, vision.source)
    processor = load_processor(vision)
    image_token = processor.image_token
    expected = getattr(vlm.config, "image_token_id", None)
    expected = expected if expected is not None else vlm.config.image_token_index
    if tokenizer.convert_tokens_to_ids(image_token) != expected:
        raise SinkstudyError(f"--donor {vision.source}: the base tokenizer maps {image_token!r} to "
                             f"{tokenizer.convert_tokens_to_ids(image_token)}, the donor expects {expected}")
    processor.tokenizer = tokenizer
    processor.chat_template = tokenizer.chat_template
    _generation_defaults(vlm, tokenizer)
    return Built(vlm, processor, tokenizer, image_token, _IMAGE_WRAP.get(report["donor_type"], ("", "")), report)


def donor_model(lm, state: dict, source: str):
    """(donor VLM with the base's language model, report): tower and projector stay the donor's.

    `state` is the base decoder's state (names without "model."); rows the donor adds past the
    base vocabulary keep the donor's values.
    """
    # lazy: loads transformers, PIL, huggingface_hub
    from transformers import AutoModelForImageTextToText

    config = load_config(source)
    if config.model_type not in DONOR_TYPES:
        raise SinkstudyError(f"--donor {source}: {config.model_type!r} is not a supported donor; supported: {', '.join(DONOR_TYPES)}")
    target, text_config, _ = plan_target_config(config)
    if target.model_type != lm.config.model_type:
        raise SinkstudyError(f"--donor {source}: its language model is {target.model_type}, the base is {lm.config.model_type}")
    check_same_layout(lm.config, target, names=("base", "donor"), ignore_vocab=True)
    vlm = AutoModelForImageTextToText.from_pretrained(source, dtype=torch.float32)
    tc = vlm.config.get_text_config()
    # The base's position and norm constants (M-RoPE on text-only input is 1D RoPE with the same theta).
    theta = (lm.config.rope_parameters or {}).get("rope_theta")
    if theta is not None and isinstance(tc.rope_parameters, dict):
        tc.rope_parameters["rope_theta"] = theta
    tc.rms_norm_eps = lm.config.rms_norm_eps
    vocab = max(vlm.get_input_embeddings().weight.shape[0], lm.config.vocab_size)
    load_language_model(vlm, lm, state, vocab)
    report = {"kind": "donor", "source": source, "donor_type": config.model_type, "vocab_size": vocab,
              "text_model_type": text_config.model_type}
    return vlm.eval(), report


# --------------------------------------------------------------------------- shared pieces

def load_language_model(vlm, lm, state: dict, vocab: int, own_rows: bool = True) -> None:
    """Copy the causal LM's decoder (`state`, names without "model.") and head into the VLM's.

    Rows past the base vocabulary keep the VLM's own values where it has trained ones (`own_rows`, a
    donor); else they are the base rows' mean. Values are copied, never shared: training the VLM
    leaves `lm` untouched.
    """
    decoder = vlm.get_decoder()
    if decoder.embed_tokens.weight.shape[0] != vocab:
        vlm.resize_token_embeddings(vocab, mean_resizing=False)
    donor_embed, donor_head = (decoder.embed_tokens.weight.detach(), vlm.get_output_embeddings().weight.detach()) if own_rows \
        else (None, None)
    state = {**state, "embed_tokens.weight": _vocab_rows(state["embed_tokens.weight"], donor_embed, vocab)}
    head = _vocab_rows(lm.get_output_embeddings().weight.detach(), donor_head, vocab)
    tied = bool(lm.config.tie_word_embeddings)
    text = vlm.config.get_text_config()
    for c in {id(c): c for c in (vlm.config, text)}.values():
        c.tie_word_embeddings = tied
    text.vocab_size = vocab
    with torch.no_grad():
        decoder.load_state_dict(state, strict=True)
        out = vlm.get_output_embeddings()
        if tied:
            out.weight = decoder.embed_tokens.weight
        else:
            if out.weight is decoder.embed_tokens.weight:
                out.weight = torch.nn.Parameter(torch.empty_like(head))
            out.weight.copy_(head)


def _vocab_rows(base_rows: torch.Tensor, donor_rows: torch.Tensor | None, vocab: int) -> torch.Tensor:
    """`vocab` rows: the base's first, then the donor's own (image tokens), else the base rows' mean."""
    n = base_rows.shape[0]
    if vocab <= n:
        return base_rows[:vocab].clone()
    usable = donor_rows is not None and donor_rows.shape[0] >= vocab and not donor_rows.is_meta
    extra = donor_rows[n:vocab] if usable else None
    if extra is None:
        extra = base_rows.float().mean(0, keepdim=True).expand(vocab - n, -1).to(base_rows.dtype)
    return torch.cat([base_rows, extra.to(base_rows.dtype)]).clone()


def _image_token(tokenizer) -> tuple[str, bool]:
    vocab = tokenizer.get_vocab()
    for tok in IMAGE_TOKEN_CANDIDATES:
        if tok in vocab:
            return tok, False
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]}, replace_extra_special_tokens=False)
    return "<image>", True


def _generation_defaults(vlm, tokenizer) -> None:
    gc = vlm.generation_config
    gc.eos_token_id, gc.pad_token_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    if tokenizer.bos_token_id is not None:
        gc.bos_token_id = tokenizer.bos_token_id


@torch.no_grad()
def check_round_trip(vlm, base, tokenizer, texts=("The answer is 8.", "Describe the image in one sentence."), atol: float = 1e-5) -> float:
    """Max |logit difference| of the VLM's language model vs `base` on text; raises above `atol` times the
    largest |logit| (at least 1): fp32 rounding grows with logit size (a real 18-layer LM: ~2e-5 at |logit| ~ 30)."""
    worst, scale = 0.0, 1.0
    rows = base.config.vocab_size
    for text in texts:
        ids = tokenizer(text, return_tensors="pt")["input_ids"].to(next(vlm.parameters()).device)
        a = vlm(input_ids=ids).logits[..., :rows].float()
        b = base(input_ids=ids.to(next(base.parameters()).device)).logits.float().to(a.device)
        worst, scale = max(worst, float((a - b).abs().max())), max(scale, float(b.abs().max()))
    if worst > atol * scale:
        raise SinkstudyError(f"logits round trip failed: the VLM's language model differs from the base by {worst:.3g} "
                             f"(> {atol} x max |logit| {scale:.3g})")
    return worst
