"""The demo's VL adaptation: a config of the engine (`interventions.adapt`) on scikit-learn's 8x8 digits.

A tiny CLIP tower (random init: none is pretrained offline; its patch features already separate the
digits linearly) and a new projector around each demo backbone, then LLaVA's two stages: the
projector alone (LM and tower frozen), then projector + LM (tower frozen: training it against a
frozen LM that has never seen captions collapses the image information). Schedules are the
paper's (constant / cosine, 3% warm-up); steps, learning rates and batch sizes come from the demo
config. Loss is on the assistant's answer tokens only. The held-out probe scores the ten answers
"It is a d." by likelihood, formatted by the engine's own encoder.
"""

from __future__ import annotations

import math
from pathlib import Path

DIGIT_QUESTION = "What digit is this?"


def recipe(cfg: dict, records: list[dict]):
    """The demo's `build.vl` section as an engine recipe (AdaptConfig) training on `records`."""
    from interventions.adapt.config import from_dict

    stages = []
    for name in ("stage1", "stage2"):
        s = cfg[name]
        stages.append({"name": name, "data": [{"records": records}], "steps": s["steps"], "lr": s["lr"],
                       "batch_size": s["batch_size"], "micro_batch_size": s["batch_size"],
                       **({"trainable": s["trainable"]} if "trainable" in s else {})})
    return from_dict({"seed": cfg["seed"], "precision": "fp32", "stages": stages,
                      "trajectory": {"every": cfg.get("trajectory_every")}})


def vision(cfg: dict):
    from interventions.adapt.build import VisionSpec

    return VisionSpec("tiny", tiny=dict(cfg["vision"]), seed=cfg["seed"])


def training_records(cfg: dict) -> list[dict]:
    """The digits not held out, as chats with the demo corpus's varied questions and captions."""
    from experiments.demo.corpus import digit_caption
    from interventions.adapt.data import digits_records

    return digits_records("train", n_heldout=cfg["heldout_images"], seed=cfg["seed"], captions=digit_caption)


def adapt_vl(base_dir: Path, out_dir: Path, cfg: dict, *, work_dir: Path, progress: bool = True) -> dict:
    """Build the VLM from the base checkpoint, run both stages, save it (with its processor) to `out_dir`."""
    from interventions.adapt import adapt

    records = training_records(cfg)
    config = recipe(cfg, records)
    report = adapt(base_dir, vision=vision(cfg), config=config, out=work_dir, model_dir=out_dir, force=True, progress=progress)
    heldout = digit_accuracy(out_dir, cfg)
    stages = {s["stage"]: {k: s[k] for k in ("steps", "lr", "trainable_groups", "final_loss", "trainable_params", "steps_per_second")}
              for s in report["stages"]}
    points = (report.get("trajectory") or {}).get("points") or []
    return {"stages": stages, "heldout": heldout, "n_train_images": len(records),
            "image_tokens": report["build"]["image_tokens_per_image"], "round_trip": report["build"]["round_trip_max_abs_logit_diff"],
            "sink_trajectory": [(p["step"], p["sink_strength"]) for p in points], "run_dir": str(work_dir)}


def digit_accuracy(vlm_dir: Path, cfg: dict) -> dict:
    """Held-out VL proxy: the digit whose answer "It is a d." is most likely; also the mean answer-token
    NLL of the true answer (caption perplexity = exp of it)."""
    import torch

    from interventions.adapt.build import load_vlm
    from interventions.adapt.data import Encoder, collate, digits_records

    vlm, processor = load_vlm(vlm_dir)
    tok = processor.tokenizer
    encoder = Encoder(tok, processor=processor, image_token=processor.image_token)
    held = digits_records("heldout", n_heldout=cfg["heldout_images"], seed=cfg["seed"])
    correct, nll_true = 0, []
    with torch.no_grad():
        for rec in held:
            user = rec["messages"][0]["content"]
            feats = [encoder({"images": rec["images"], "messages": [{"role": "user", "content": user},
                                                                    {"role": "assistant", "content": f"It is a {d}."}]})
                     for d in range(10)]
            batch = collate(feats, tok.pad_token_id)
            labels = batch.pop("labels")
            logits = vlm(**batch).logits[:, :-1]
            target = labels[:, 1:]
            logp = torch.log_softmax(logits.float(), -1).gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1)
            score = (logp * (target != -100)).sum(-1)
            correct += int(score.argmax()) == rec["label"]
            nll_true.append(float(-score[rec["label"]] / (target[rec["label"]] != -100).sum()))
    mean_nll = sum(nll_true) / len(nll_true)
    return {"digit_accuracy": correct / len(held), "answer_nll": mean_nll, "answer_ppl": math.exp(mean_nll), "n_images": len(held)}
