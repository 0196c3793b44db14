"""The demo's VL adaptation: a config of the engine (`interventions.adapt`) on scikit-learn's 8x8 digits.

A tiny CLIP tower (random init: none is pretrained offline; its patch features already separate the
digits linearly) and a new projector around each demo backbone, then LLaVA's two stages: the
projector alone (LM and tower frozen), then projector + LM (tower frozen: training it against a
frozen LM that has never seen captions collapses the image information). Schedules are the
paper's (constant / cosine, 3% warm-up); steps, learning rates and batch sizes come from the demo
config. Loss is on the assistant's answer tokens only. A stage may mix in text-only chats from the
pretraining corpus (`text_share`), as LLaVA-665K mixes ShareGPT conversations into its stage 2. The held-out probe scores the ten answers
"It is a d." by likelihood, formatted by the engine's own encoder.
"""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Sequence

DIGIT_QUESTION = "What digit is this?"


def recipe(cfg: dict, records: list[dict], chats: Sequence[tuple[str, str]] = ()):
    """The demo's `build.vl` section as an engine recipe (AdaptConfig) training on `records`, plus,
    in a stage with `text_share`, text-only chats drawn from `chats` (LLaVA-665K's text part)."""
    from interventions.adapt.config import from_dict

    stages = []
    for name in ("stage1", "stage2"):
        s = cfg[name]
        data = [{"records": records}]
        if s.get("text_share"):
            data.append({"records": text_records(chats, len(records), s["text_share"], cfg["seed"])})
        stages.append({"name": name, "data": data, "steps": s["steps"], "lr": s["lr"],
                       "batch_size": s["batch_size"], "micro_batch_size": s["batch_size"],
                       **({"trainable": s["trainable"]} if "trainable" in s else {})})
    return from_dict({"seed": cfg["seed"], "precision": "fp32", "stages": stages,
                      "trajectory": {"every": cfg.get("trajectory_every")}})


def text_records(chats: Sequence[tuple[str, str]], n_images: int, share: float, seed: int) -> list[dict]:
    """Text-only chats making up `share` of a stage beside `n_images` image records (sampled with `seed`)."""
    from sinkstudy import SinkstudyError

    n = round(n_images * share / (1 - share))
    if n > len(chats):
        raise SinkstudyError(f"text_share {share} needs {n} text chats beside {n_images} images; the corpus has {len(chats)}")
    return [{"messages": [{"role": "user", "content": u}, {"role": "assistant", "content": a}]}
            for u, a in random.Random(seed).sample(list(chats), n)]


def vision(cfg: dict):
    from interventions.adapt.build import VisionSpec

    return VisionSpec("tiny", tiny=dict(cfg["vision"]), seed=cfg["seed"])


def training_records(cfg: dict) -> list[dict]:
    """The digits not held out, as chats with the demo corpus's varied questions and captions."""
    from experiments.demo.corpus import digit_caption
    from interventions.adapt.data import digits_records

    return digits_records("train", n_heldout=cfg["heldout_images"], seed=cfg["seed"], captions=digit_caption)


def adapt_vl(base_dir: Path, out_dir: Path, cfg: dict, *, work_dir: Path, progress: bool = True,
             chats: Sequence[tuple[str, str]] = ()) -> dict:
    """Build the VLM from the base checkpoint, run both stages, save it (with its processor) to `out_dir`.
    `chats`: (user, assistant) pairs the stages with `text_share` draw their text-only examples from."""
    from interventions.adapt import adapt

    records = training_records(cfg)
    config = recipe(cfg, records, chats)
    report = adapt(base_dir, vision=vision(cfg), config=config, out=work_dir, model_dir=out_dir, force=True, progress=progress)
    heldout = digit_accuracy(out_dir, cfg)
    stages = {s["stage"]: {k: s[k] for k in ("steps", "lr", "trainable_groups", "final_loss", "trainable_params", "steps_per_second")}
              for s in report["stages"]}
    points = (report.get("trajectory") or {}).get("points") or []
    n_text = {st.name: sum(len(d["records"]) for d in st.data[1:]) for st in config.stages}
    return {"stages": stages, "heldout": heldout, "n_train_images": len(records), "n_text_chats": n_text,
            "image_tokens": report["build"]["image_tokens_per_image"], "round_trip": report["build"]["round_trip_max_abs_logit_diff"],
            "sink_trajectory": [(p["step"], p["sink_strength"]) for p in points], "run_dir": str(work_dir)}


IMAGES_PER_PASS = 8  # 80 rows a forward pass: the prefixes batch well; a 262k vocabulary's tail logits stay ~0.5 GB


def digit_accuracy(vlm_dir: Path, cfg: dict) -> dict:
    """Held-out VL proxy: the digit whose answer "It is a d." is most likely (logits computed on the answer
    tokens only); also the mean answer-token NLL of the true answer (caption perplexity = exp of it)."""
    import torch

    from interventions.adapt.build import load_vlm
    from interventions.adapt.data import Encoder, collate, digits_records

    vlm, processor = load_vlm(vlm_dir)
    tok = processor.tokenizer
    encoder = Encoder(tok, processor=processor, image_token=processor.image_token)
    held = digits_records("heldout", n_heldout=cfg["heldout_images"], seed=cfg["seed"])
    correct, nll_true = 0, []
    with torch.no_grad():
        for start in range(0, len(held), IMAGES_PER_PASS):
            chunk = held[start:start + IMAGES_PER_PASS]
            feats = [encoder({"images": rec["images"], "messages": [rec["messages"][0], {"role": "assistant", "content": f"It is a {d}."}]})
                     for rec in chunk for d in range(10)]
            score, n_tokens = answer_logprobs(vlm, collate(feats, tok.pad_token_id), rows_per_image=10)
            for rec, s, n in zip(chunk, score.view(-1, 10), n_tokens.view(-1, 10)):
                correct += int(s.argmax()) == rec["label"]
                nll_true.append(float(-s[rec["label"]] / n[rec["label"]]))
    mean_nll = sum(nll_true) / len(nll_true)
    return {"digit_accuracy": correct / len(held), "answer_nll": mean_nll, "answer_ppl": math.exp(mean_nll), "n_images": len(held)}


def answer_logprobs(vlm, batch: dict, rows_per_image: int):
    """(summed log-probability of each row's answer tokens, their count) for rows that come `rows_per_image` to an
    image, with one text up to where their answers differ: that prefix (image and question, most of each row) runs
    once per image and its KV cache serves each of the image's rows, a fraction of the work of scoring rows whole."""
    import inspect

    import torch
    from transformers import DynamicCache

    ids, mask, labels = batch["input_ids"], batch["attention_mask"], batch["labels"]
    rows = len(ids)
    shared = ((ids == ids[:1]) & (mask == 1)).all(0).long().cumprod(0)
    cut = max(1, min(int(shared.sum()), ids.shape[1] - 1))  # the continuation keeps at least one token
    firsts = slice(None, None, rows_per_image)
    images = {k: v.reshape(rows, -1, *v.shape[1:])[firsts].flatten(0, 1) for k, v in batch.items()
              if k not in ("input_ids", "attention_mask", "labels")}
    # position t's logits score token t+1: the prefix's last position scores each row's first differing token
    scored = torch.zeros_like(labels, dtype=torch.bool)
    scored[:, :-1] = labels[:, 1:] != -100
    cache = DynamicCache(config=vlm.config)
    cache_kw = "cache" if "cache" in inspect.signature(vlm.forward).parameters else "past_key_values"  # renamed in 5.25
    head = vlm(input_ids=ids[firsts, :cut], attention_mask=mask[firsts, :cut], **images, use_cache=True,
               **{cache_kw: cache}, logits_to_keep=scored[firsts, :cut])
    cache.batch_repeat_interleave(rows_per_image)
    tail = vlm(input_ids=ids[:, cut:], attention_mask=mask, use_cache=True, **{cache_kw: cache}, logits_to_keep=scored[:, cut:])
    positions = scored[0, :cut].nonzero()[:, 0]  # the prefix's scored positions, the same in every row
    head_logp = torch.log_softmax(head.logits.float(), -1).view(-1, len(positions), head.logits.shape[-1])
    image_of = torch.arange(rows) // rows_per_image
    head_part = head_logp[image_of[:, None], torch.arange(len(positions))[None], labels[:, positions + 1]]
    tail_logp = torch.log_softmax(tail.logits.float(), -1).gather(-1, labels[:, cut + 1:][scored[:, cut:-1]].unsqueeze(-1)).squeeze(-1)
    row_of = scored[:, cut:].nonzero()[:, 0]
    score = head_part.sum(1).index_add_(0, row_of, tail_logp)
    n_tokens = torch.full((rows,), float(len(positions))).index_add_(0, row_of, torch.ones_like(tail_logp))
    return score, n_tokens
