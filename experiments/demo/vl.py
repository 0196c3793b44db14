"""The demo's VL adaptation: a config of the engine (`interventions.adapt`) on scikit-learn's 8x8 digits.

A tiny CLIP tower (random init: none is pretrained offline; its patch features already separate the
digits linearly) and a new projector around each demo backbone, then LLaVA's two stages: the
projector alone (LM and tower frozen), then projector + LM (tower frozen: training it against a
frozen LM that has never seen captions collapses the image information). Schedules are the
paper's (constant / cosine, 3% warm-up); steps, learning rates and batch sizes come from the demo
config. Loss is on the assistant's answer tokens only. A stage may mix in text-only chats from the
pretraining corpus (`text_share`), as LLaVA-665K mixes ShareGPT conversations into its stage 2. The held-out probe
(`interventions.adapt.probe.digit_skill`, the same any study's arms use) scores the ten answers "It is a d." by
likelihood, formatted by the engine's own encoder.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Sequence

from interventions.adapt.config import VisionSpec, from_dict
from interventions.adapt.probe import digit_skill
from interventions.adapt.sources import load_records
from sinkstudy import SinkstudyError
from sinkstudy.io import remove_tree

DIGIT_QUESTION = "What digit is this?"


def recipe(cfg: dict, records: list[dict], chats: Sequence[tuple[str, str]] = ()):
    """The demo's `build.vl` section as an engine recipe (AdaptConfig) training on `records`, plus,
    in a stage with `text_share`, text-only chats drawn from `chats` (LLaVA-665K's text part)."""
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
    n = round(n_images * share / (1 - share))
    if n > len(chats):
        raise SinkstudyError(f"text_share {share} needs {n} text chats beside {n_images} images; the corpus has {len(chats)}")
    return [{"messages": [{"role": "user", "content": u}, {"role": "assistant", "content": a}]}
            for u, a in random.Random(seed).sample(list(chats), n)]


def vision(cfg: dict):
    return VisionSpec("tiny", tiny=dict(cfg["vision"]), seed=cfg["seed"])


def training_data(cfg: dict) -> dict:
    """The data spec of the digits not held out, asked and answered in varied styles."""
    return {"digits": {"split": "train", "heldout": cfg["heldout_images"], "seed": cfg["seed"], "captions": "varied"}}


def training_records(cfg: dict) -> list[dict]:
    """The records of `training_data`: the VL stages' image chats."""
    records = load_records(training_data(cfg))
    return [records.rows[i] for i in range(len(records))]


def adapt_vl(base_dir: Path, out_dir: Path, cfg: dict, *, work_dir: Path, progress: bool = True,
             chats: Sequence[tuple[str, str]] = ()) -> dict:
    """Build the VLM from the base checkpoint, run both stages, save it (with its processor) to `out_dir`.
    `chats`: (user, assistant) pairs the stages with `text_share` draw their text-only examples from."""
    # lazy: loads torch, numpy
    from interventions.adapt import adapt

    records = training_records(cfg)
    config = recipe(cfg, records, chats)
    if work_dir.exists():  # the step runs to make the VLM anew: an earlier run's folder goes first
        remove_tree(work_dir, within=work_dir.parent)
    report = adapt(base_dir, vision=vision(cfg), config=config, out=work_dir, model_dir=out_dir, progress=progress)
    heldout = digit_skill(out_dir, cfg["heldout_images"], cfg["seed"])
    stages = {s["stage"]: {k: s[k] for k in ("steps", "lr", "trainable_groups", "final_loss", "trainable_params", "steps_per_second")}
              for s in report["stages"]}
    points = (report.get("trajectory") or {}).get("points") or []
    n_text = {st.name: sum(len(d["records"]) for d in st.data[1:]) for st in config.stages}
    return {"stages": stages, "heldout": heldout, "n_train_images": len(records), "n_text_chats": n_text,
            "image_tokens": report["build"]["image_tokens_per_image"], "round_trip": report["build"]["round_trip_max_abs_logit_diff"],
            "sink_trajectory": [(p["step"], p["sink_strength"]) for p in points], "run_dir": str(work_dir)}
