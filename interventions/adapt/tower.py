"""A vision tower that sees the recipe's images: a small CLIP vision model pretrained here, in its own
cached step, then frozen in every adaptation (LLaVA's CLIP is pretrained apart from the LM too).

Pretraining is supervised, from the facts the images are drawn from: on the last layer's patch tokens
(the features a LLaVA projector receives: CLS dropped) a linear head names, per patch, the object
covering it (background or shape x colour x size: `evals.vl.scenes.patch_labels`), and linear heads on
their mean give the object count of a scene, easy-VQA's shape and colour, and the digit. The training
images are the train splits only (scenes "train", easy-VQA "train", the digits' train split); the
held-out splits measure it (`probe`): a logistic-regression probe per attribute on the concatenated
patch features, fitted on train images and scored on held-out ones.

`pretrained_tower(settings)` returns the checkpoint folder (`CLIPVisionModel` + its PIL image
processor + `tower.json` with the losses and the probe), trained once and cached under a key of the
settings and this code (`<cache>/towers/<key>`, `sinkstudy.io.cache_root`); `VisionSpec("scenes")` builds a LLaVA around it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from evals.vl import digits, easyvqa, scenes
from evals.vl.easyvqa import COLOURS, SHAPES, questions
from evals.vl.scenes import MAX_OBJECTS
from sinkstudy import SinkstudyError
from sinkstudy.io import atomic_output_dir, cache_root, output_lock
from sinkstudy.keys import key
from sinkstudy.provenance import module_code_version

DEFAULTS = {"hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4, "intermediate_size": 512,
            "image_size": 64, "patch_size": 16, "scenes": 6000, "steps": 800, "batch_size": 64, "lr": 1e-3,
            "weight_decay": 0.01, "seed": 0, "per_source": None}  # per_source: cap on easy-VQA and digit images (tests)
_SIZES = ("small", "large")
ATTRIBUTES = ("count", "shape", "colour", "digit")  # the global heads (and the probe's attributes)


@dataclasses.dataclass
class TowerImages:
    """uint8 images (N, 3, S, S) with their targets; -100 where an attribute does not apply."""

    pixels: torch.Tensor
    targets: dict[str, torch.Tensor]


def settings_of(overrides: dict | None = None) -> dict:
    unknown = set(overrides or {}) - set(DEFAULTS)
    if unknown:
        raise SinkstudyError(f"unknown tower setting(s) {', '.join(sorted(unknown))}; allowed: {', '.join(DEFAULTS)}")
    s = {**DEFAULTS, **(overrides or {})}
    if s["per_source"] is not None and (not isinstance(s["per_source"], int) or s["per_source"] < 1):
        raise SinkstudyError(f"tower per_source must be a positive integer or null, got {s['per_source']!r}")
    if s["image_size"] % s["patch_size"]:
        raise SinkstudyError(f"tower image_size {s['image_size']} is not a multiple of patch_size {s['patch_size']}")
    return s


# The tower's own code and the modules that draw its images (not the questions asked about them): part of its key.
CODE = ("interventions.adapt.tower", "evals.vl.scenes", "evals.vl.easyvqa", "evals.vl.digits")


def tower_key(settings: dict) -> str:
    return key({"settings": settings, "code": module_code_version(*CODE)})


def cache_dir() -> Path:
    """Where pretrained towers are kept: `<cache>/towers` (`sinkstudy.io.cache_root`), the input of the steps that
    build a VLM around one."""
    return cache_root() / "towers"


def pretrained_tower(overrides: dict | None = None, *, progress: bool = True) -> Path:
    """The cached tower for these settings, pretrained (and probed) first when missing, with a progress bar (a minute
    or more on CPU: `--quiet` hides it)."""
    settings = settings_of(overrides)
    out = cache_dir() / tower_key(settings)
    if (out / "tower.json").is_file():
        return out
    with output_lock(Path(f"{out}.make"), wait=True):  # one process trains; the others wait and reuse it
        if (out / "tower.json").is_file():
            return out
        model, processor, report = pretrain(settings, progress=progress)
        logging.getLogger(__name__).info("probing the tower on held-out images")
        report["probe"] = probe(model, processor, settings)
        with atomic_output_dir(out, replace=True) as tmp:
            model.save_pretrained(tmp)
            processor.save_pretrained(tmp)
            (tmp / "tower.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return out


def tower_report(path: str | os.PathLike) -> dict:
    return json.loads((Path(path) / "tower.json").read_text(encoding="utf-8"))


def image_processor(settings: dict):
    from transformers import CLIPImageProcessorPil  # no torchvision needed

    size = settings["image_size"]
    return CLIPImageProcessorPil(size={"shortest_edge": size}, crop_size={"height": size, "width": size},
                                 image_mean=[0.5] * 3, image_std=[0.5] * 3, resample=0)  # nearest: keeps the digits' pixels


def vision_config(settings: dict):
    # lazy: loads transformers, PIL, huggingface_hub
    from transformers import CLIPVisionConfig

    return CLIPVisionConfig(**{k: settings[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                                           "intermediate_size", "image_size", "patch_size")}, num_channels=3)


# --------------------------------------------------------------------------- images and targets

def images(split: str, settings: dict, *, n_scenes: int | None = None) -> TowerImages:
    """The tower's images of `split` ("train" or "heldout"): scenes, easy-VQA's images, the digits."""
    size, patch = settings["image_size"], settings["patch_size"]
    pix, rows = [], []
    n = n_scenes if n_scenes is not None else (settings["scenes"] if split == "train" else settings["scenes"] // 8)
    for i in range(n):
        s = scenes.scene(split, i)
        pix.append(_array(scenes.render(s), size))
        things = s.things
        cls = [0 if k == 0 else 1 + _thing_class(things[k - 1]) for k in scenes.patch_labels(s, patch)]
        rows.append({"count": len(things) - 1, "patches": cls})
    cap = settings["per_source"]
    for path, known in list(_easyvqa_labels("train" if split == "train" else "test").items())[:cap]:
        pix.append(_array(path, size))
        rows.append(known)
    upscale = size // 8
    for i in digits.split_indices(split)[:cap]:
        pix.append(_array(digits.rgb(i, upscale), size))
        rows.append({"digit": digits.label(i)})
    n_patches = (size // patch) ** 2
    targets = {a: torch.tensor([r.get(a, -100) for r in rows]) for a in ATTRIBUTES}
    targets["patches"] = torch.tensor([r.get("patches", [-100] * n_patches) for r in rows])
    return TowerImages(torch.from_numpy(np.stack(pix)).permute(0, 3, 1, 2).contiguous(), targets)


def _thing_class(t) -> int:
    return (SHAPES.index(t.shape) * len(COLOURS) + COLOURS.index(t.colour)) * len(_SIZES) + _SIZES.index(t.size)


def _easyvqa_labels(split: str) -> dict[str, dict]:
    """Shape and colour of each easy-VQA image that a question names them for ("what color is ...")."""
    out: dict[str, dict] = {}
    for _, answer, path, kind in questions(split):
        if kind == "shape":
            out.setdefault(path, {})["shape"] = SHAPES.index(answer)
        elif kind == "colour":
            out.setdefault(path, {})["colour"] = COLOURS.index(answer)
    return out


def _array(image, size: int):
    # lazy: loads PIL
    from PIL import Image

    im = Image.open(image).convert("RGB") if isinstance(image, (str, os.PathLike)) else \
        Image.fromarray(image) if isinstance(image, np.ndarray) else image
    if im.size != (size, size):
        im = im.resize((size, size), Image.NEAREST)
    return np.asarray(im, dtype=np.uint8)


# --------------------------------------------------------------------------- pretraining

class _Heads(torch.nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.patches = torch.nn.Linear(d, 1 + len(SHAPES) * len(COLOURS) * len(_SIZES))
        self.count = torch.nn.Linear(d, MAX_OBJECTS)
        self.shape = torch.nn.Linear(d, len(SHAPES))
        self.colour = torch.nn.Linear(d, len(COLOURS))
        self.digit = torch.nn.Linear(d, 10)


def features(model, pixels_uint8: torch.Tensor) -> torch.Tensor:
    """The last layer's patch tokens (CLS dropped): what a LLaVA projector receives from this tower."""
    x = (pixels_uint8.float() / 255 - 0.5) / 0.5
    return model(pixel_values=x).last_hidden_state[:, 1:]


def pretrain(settings: dict, *, progress: bool = False):
    """(CLIPVisionModel, image processor, report) trained on the train images with the heads above."""
    # lazy: loads transformers, PIL, huggingface_hub
    from transformers import CLIPVisionModel

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(settings["seed"])
        model = CLIPVisionModel(vision_config(settings))
        heads = _Heads(settings["hidden_size"])
        data = images("train", settings)
        g = torch.Generator().manual_seed(settings["seed"])
        params = list(model.parameters()) + list(heads.parameters())
        opt = torch.optim.AdamW(params, lr=settings["lr"], weight_decay=settings["weight_decay"])
        steps = settings["steps"]
        warm = max(1, steps // 20)  # 5% linear warm-up, then cosine to 0
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: min(1.0, (k + 1) / warm) * 0.5 * (1 + math.cos(math.pi * k / steps)))
        model.train()
        losses, t0 = [], time.perf_counter()
        n = len(data.pixels)
        for step in tqdm(range(steps), desc="tower pretraining", unit="step", disable=not progress):
            idx = torch.randint(n, (settings["batch_size"],), generator=g)
            loss = _loss(model, heads, data.pixels[idx], {k: v[idx] for k, v in data.targets.items()})
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            losses.append(loss.item())
    model.eval()
    tail = losses[-max(1, steps // 20):]
    report = {"settings": settings, "images": n, "final_loss": sum(tail) / len(tail), "first_loss": losses[0],
              "seconds": round(time.perf_counter() - t0, 1)}
    return model, image_processor(settings), report


def _loss(model, heads: _Heads, pixels, targets) -> torch.Tensor:
    f = torch.nn.functional
    tokens = features(model, pixels)
    pooled = tokens.mean(1)
    loss = f.cross_entropy(heads.patches(tokens).flatten(0, 1), targets["patches"].flatten(), ignore_index=-100) \
        if (targets["patches"] != -100).any() else tokens.sum() * 0
    for a in ATTRIBUTES:
        if (targets[a] != -100).any():
            loss = loss + f.cross_entropy(getattr(heads, a)(pooled), targets[a], ignore_index=-100)
    return loss


# --------------------------------------------------------------------------- linear probe

@torch.no_grad()
def probe(model, processor, settings: dict) -> dict:
    """Held-out accuracy of a linear probe per attribute (count, shape, colour, digit) on the concatenated
    patch features, with the chance level (the held-out majority class's share)."""
    # lazy: loads sklearn, scipy
    from sklearn.linear_model import LogisticRegression

    train, held = images("train", settings, n_scenes=settings["scenes"] // 2), images("heldout", settings)
    f_train, f_held = _flat(model, train.pixels), _flat(model, held.pixels)
    out = {}
    for a in ATTRIBUTES:
        tr, he = train.targets[a] != -100, held.targets[a] != -100
        clf = LogisticRegression(max_iter=2000, C=1.0).fit(f_train[tr], train.targets[a][tr].numpy())
        y = held.targets[a][he].numpy()
        counts = torch.bincount(held.targets[a][he])
        out[a] = {"accuracy": float((clf.predict(f_held[he]) == y).mean()), "n": int(he.sum()),
                  "chance": float(counts.max() / counts.sum())}
    return out


def _flat(model, pixels, batch: int = 256):
    chunks = [features(model, pixels[i:i + batch]).flatten(1) for i in range(0, len(pixels), batch)]
    return torch.cat(chunks).numpy()
