"""LLaVA-style vision-language adaptation of a demo backbone on scikit-learn's 8x8 digits.

A `LlavaForConditionalGeneration` gets the backbone as its text model (text_config = the
backbone's config, weights copied) and a small CLIP vision tower. Two stages, as LLaVA trains:
1. alignment: only the projector learns; the LM and the vision tower are frozen (LLaVA freezes a
   pretrained CLIP; ours stays at its random init, whose patch features already separate the
   digits linearly. Training the tower here against a frozen LM that has never seen captions
   collapses the image information: the loss is all caption wording, which image-independent
   features fit best);
2. visual instruction tuning: projector + the whole LM learn, the vision tower stays frozen.
Loss is on the assistant's answer tokens only. The result is saved as an HF LLaVA checkpoint
with a `LlavaProcessor`, so the pair loader reads it like a hub VLM.
"""

from __future__ import annotations

import math
import random
from pathlib import Path

from sinkstudy.io import atomic_output_dir

IMAGE_TOKEN = "<|image|>"
# Parameter-name prefixes each stage may train.
TRAINABLE = {
    "projector": ("model.multi_modal_projector.",),
    "vision+projector": ("model.vision_tower.", "model.multi_modal_projector."),
    "projector+lm": ("model.multi_modal_projector.", "model.language_model.", "lm_head."),
    "all": ("model.", "lm_head."),
}
# LLaVA's split: the vision tower never learns (see the module docstring).
STAGE_TRAINABLE = {"stage1": "projector", "stage2": "projector+lm"}


def digits_split(n_heldout: int, seed: int):
    """scikit-learn's bundled digits as float tensors (N, 3, 8, 8) in [-1, 1], split train/held-out."""
    import numpy as np
    import torch
    from sklearn.datasets import load_digits

    data = load_digits()
    order = np.random.default_rng(seed).permutation(len(data.target))
    images = torch.tensor(data.images[order] / 16.0 * 2 - 1, dtype=torch.float32).unsqueeze(1).repeat(1, 3, 1, 1)
    labels = data.target[order].tolist()
    return (images[n_heldout:], labels[n_heldout:]), (images[:n_heldout], labels[:n_heldout])


def build_vlm(base, tokenizer, vision: dict):
    """A LLaVA model whose language model starts as a copy of `base` (a causal LM)."""
    import torch
    from transformers import CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration

    n_patches = (vision["image_size"] // vision["patch_size"]) ** 2
    config = LlavaConfig(
        text_config=base.config.to_dict(),
        vision_config=CLIPVisionConfig(
            hidden_size=vision["hidden_size"], intermediate_size=2 * vision["hidden_size"],
            num_hidden_layers=vision["num_hidden_layers"], num_attention_heads=vision["num_attention_heads"],
            image_size=vision["image_size"], patch_size=vision["patch_size"], num_channels=3,
        ),
        image_token_index=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        image_seq_length=n_patches,
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",  # drop CLS: one LM token per patch
    )
    torch.manual_seed(vision.get("seed", 0))
    vlm = LlavaForConditionalGeneration(config)
    vlm.model.language_model.load_state_dict(base.model.state_dict())
    vlm.lm_head.load_state_dict(base.lm_head.state_dict())
    vlm.config.text_config.tie_word_embeddings = base.config.tie_word_embeddings
    return vlm.float()


def _examples(tokenizer, images, labels, n_patches: int, seed: int):
    """(input_ids, labels) per image: a VQA/caption chat with the answer tokens as targets."""
    from experiments.demo.corpus import digit_caption

    rng = random.Random(seed)
    out = []
    for img, label in zip(images, labels):
        question, answer = digit_caption(label, rng)
        out.append((img, *encode_turn(tokenizer, question, answer, n_patches)))
    return out


def encode_turn(tokenizer, question: str, answer: str, n_patches: int):
    """Token ids of one image chat and its label mask (-100 on everything but the answer)."""
    import torch

    user = IMAGE_TOKEN * n_patches + "\n" + question
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": user}], tokenize=False, add_generation_prompt=True)
    p_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    a_ids = tokenizer(answer + tokenizer.eos_token, add_special_tokens=False)["input_ids"]
    ids = torch.tensor(p_ids + a_ids)
    labels = torch.tensor([-100] * len(p_ids) + a_ids)
    return ids, labels


def _collate(batch, pad_id: int):
    import torch

    width = max(len(ids) for _, ids, _ in batch)
    input_ids = torch.full((len(batch), width), pad_id)
    labels = torch.full((len(batch), width), -100)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, (_, ids, lab) in enumerate(batch):
        input_ids[row, : len(ids)], labels[row, : len(ids)], mask[row, : len(ids)] = ids, lab, 1
    return torch.stack([img for img, _, _ in batch]), input_ids, mask, labels


def train_stage(vlm, examples, *, trainable: str, steps: int, lr: float, batch_size: int, seed: int, pad_id: int,
                progress: bool, desc: str) -> dict:
    """One LLaVA stage through the project's shared loop, on the parameters `trainable` selects."""
    from interventions.training import optimize

    select = TRAINABLE[trainable]

    def next_batch(rng: random.Random) -> dict:
        pixels, ids, mask, labels = _collate(rng.sample(examples, min(batch_size, len(examples))), pad_id)
        return {"input_ids": ids, "attention_mask": mask, "pixel_values": pixels, "labels": labels}

    stats = optimize(vlm, next_batch, steps=steps, lr=lr, trainable=lambda name, p: name.startswith(select),
                     seed=seed, progress=progress, desc=desc)
    return {"steps": steps, "lr": lr, "trainable": trainable, "final_loss": stats["final_loss"],
            "trainable_params": stats["trainable_params"]}


def digit_accuracy(vlm, tokenizer, images, labels, n_patches: int) -> dict:
    """Held-out VL proxy: pick the digit whose answer "It is a d." has the highest likelihood;
    also the mean answer-token NLL of the true answer (caption perplexity = exp of it)."""
    import torch

    pad_id = tokenizer.pad_token_id
    correct, nll_true = 0, []
    with torch.no_grad():
        for img, label in zip(images, labels):
            batch = [(img, *encode_turn(tokenizer, "What digit is this?", f"It is a {d}.", n_patches)) for d in range(10)]
            pixels, ids, mask, lab = _collate(batch, pad_id)
            logits = vlm(input_ids=ids, attention_mask=mask, pixel_values=pixels).logits[:, :-1]
            target = lab[:, 1:]
            logp = torch.log_softmax(logits.float(), -1).gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1)
            score = (logp * (target != -100)).sum(-1)
            correct += int(score.argmax()) == label
            nll_true.append(float(-score[label] / (target[label] != -100).sum()))
    mean_nll = sum(nll_true) / len(nll_true)
    return {"digit_accuracy": correct / len(labels), "answer_nll": mean_nll, "answer_ppl": math.exp(mean_nll),
            "n_images": len(labels)}


def adapt_vl(base_dir: Path, out_dir: Path, cfg: dict, *, force: bool = False, progress: bool = True) -> dict:
    """Build the VLM from the base checkpoint, run both LLaVA stages, save it with its processor."""
    import torch
    from transformers import AutoModelForCausalLM, LlavaProcessor
    from transformers import CLIPImageProcessorPil as CLIPImageProcessor  # no torchvision needed

    from interventions.pairs import load_tokenizer

    tokenizer = load_tokenizer(base_dir)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    vlm = build_vlm(base, tokenizer, cfg["vision"])
    n_patches = vlm.config.image_seq_length
    (tr_img, tr_lab), (ho_img, ho_lab) = digits_split(cfg["heldout_images"], cfg["seed"])
    examples = _examples(tokenizer, tr_img, tr_lab, n_patches, cfg["seed"])
    stages = {}
    for key, default in STAGE_TRAINABLE.items():
        s = cfg[key]
        stages[key] = train_stage(vlm, examples, trainable=s.get("trainable", default), steps=s["steps"], lr=s["lr"], batch_size=s["batch_size"],
                                  seed=cfg["seed"], pad_id=tokenizer.pad_token_id, progress=progress, desc=f"VL {key} {base_dir.name}")
    heldout = digit_accuracy(vlm, tokenizer, ho_img, ho_lab, n_patches)
    processor = LlavaProcessor(
        image_processor=CLIPImageProcessor(size={"shortest_edge": cfg["vision"]["image_size"]},
                                           crop_size={"height": cfg["vision"]["image_size"], "width": cfg["vision"]["image_size"]},
                                           image_mean=[0.5] * 3, image_std=[0.5] * 3),
        tokenizer=tokenizer, patch_size=cfg["vision"]["patch_size"], vision_feature_select_strategy="default",
        num_additional_image_tokens=1,  # CLIP's CLS, which "default" drops: n_patches placeholders, as the model expects
        image_token=IMAGE_TOKEN, chat_template=tokenizer.chat_template,
    )
    vlm.generation_config.eos_token_id = tokenizer.eos_token_id
    vlm.generation_config.pad_token_id = tokenizer.pad_token_id
    with atomic_output_dir(out_dir, force=force) as tmp:
        vlm.save_pretrained(tmp)
        processor.save_pretrained(tmp)
    return {"stages": stages, "heldout": heldout, "n_train_images": len(tr_lab), "image_tokens": n_patches}
