"""Adaptation recipes: per-stage settings with the paper's defaults, read from YAML or built in code.

The paper's LLaVA recipe (PAPER.md, "QK-norm injection recipe"): stage 1 trains the projector only
(lr 1e-4, constant after a 3% warm-up), stage 2 the language model and the projector (lr 2e-5,
cosine after a 3% warm-up); effective batch 128, weight decay 0, gradient clip 1.0, bf16, one epoch
each. `paper_recipe()` returns exactly that; a YAML file or keyword overrides change any field.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from evals.protocol import EvalProtocol
from evals.sink.calibration import DEFAULT_SET
from sinkstudy import SinkstudyError

SCHEDULES = ("constant", "cosine", "linear")
PRECISIONS = ("auto", "bf16", "fp32")
LOSS_ON = ("assistant", "all")
# Named parameter groups a stage can train (see interventions.adapt.build.parameter_groups), plus
# "re:<regex>" patterns over parameter names.
GROUPS = ("projector", "lm", "tower", "embeddings")


class AdaptConfigError(SinkstudyError):
    """An invalid adaptation recipe (one line naming the field)."""


@dataclass
class StageConfig:
    """One training stage. `batch_size` is the effective batch (micro batch x accumulation x devices)."""

    name: str
    data: list = field(default_factory=list)  # data specs (see interventions.adapt.sources.load_records)
    trainable: list[str] = field(default_factory=lambda: ["projector"])
    lr: float = 1e-4
    schedule: str = "constant"
    warmup_ratio: float = 0.03
    batch_size: int = 128
    micro_batch_size: int = 16
    epochs: float = 1.0
    steps: int | None = None  # overrides epochs when set
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    save_steps: int | None = None  # Trainer checkpoints every N steps (resume points); None: none
    loss_on: str = "assistant"
    # Steps of this stage after which the whole model is kept as a model of its own (OUT/snapshots/<stage>-<step>):
    # one run gives the models at several lengths of the same schedule (a calibration's Δ against steps)
    save_models_at: list[int] = field(default_factory=list)
    # A learning rate of its own for a named group ({projector: 2e-3}): the group's parameters start from it and follow
    # the stage's schedule; every other trained parameter takes `lr`. A new projector may learn faster than the LM.
    group_lr: dict[str, float] = field(default_factory=dict)

    def accumulation(self, world_size: int = 1) -> int:
        """Gradient accumulation steps giving `batch_size` from `micro_batch_size` on `world_size` devices."""
        per_step = self.micro_batch_size * world_size
        if self.batch_size % per_step:
            raise AdaptConfigError(f"stage {self.name}: batch_size {self.batch_size} is not a multiple of "
                                   f"micro_batch_size {self.micro_batch_size} x {world_size} device(s)")
        return self.batch_size // per_step


@dataclass
class TrajectoryConfig:
    """Sink Strength (and optionally a strict eval) of the language model every `every` steps."""

    every: int | None = None  # None: only before and after each stage
    calibration: str = DEFAULT_SET
    metric: str = "logodds"
    eval_tasks: list[str] = field(default_factory=list)  # e.g. ["sinkstudy_ifeval"]; empty: sink only
    eval_limit: int | None = 20
    eval_max_gen_toks: int = EvalProtocol.max_gen_toks  # the eval protocol's default; 0: each task's own
    eval_data_files: dict[str, str] = field(default_factory=dict)


@dataclass
class AdaptConfig:
    stages: list[StageConfig]
    seed: int = 0
    precision: str = "auto"  # auto: bf16 autocast where the device supports it, else fp32
    gradient_checkpointing: bool = False
    max_length: int = 2048
    dataloader_workers: int = 0
    log_every: int = 1
    deepspeed: str | None = None  # a DeepSpeed JSON (experiments/configs/accelerate/deepspeed_zero2.json)
    fsdp: str | None = None  # an FSDP JSON for the Trainer's fsdp_config (experiments/configs/accelerate/fsdp.json)
    trajectory: TrajectoryConfig = field(default_factory=TrajectoryConfig)
    keep_checkpoints: bool = False

    def stage(self, name: str) -> StageConfig:
        for s in self.stages:
            if s.name == name:
                return s
        raise AdaptConfigError(f"no stage named {name!r}; stages: {', '.join(s.name for s in self.stages)}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def paper_recipe(**overrides) -> AdaptConfig:
    """The paper's two LLaVA stages (no data: the caller adds it)."""
    stages = [
        StageConfig("stage1", trainable=["projector"], lr=1e-4, schedule="constant"),
        StageConfig("stage2", trainable=["projector", "lm"], lr=2e-5, schedule="cosine"),
    ]
    return from_dict({"stages": [dataclasses.asdict(s) for s in stages], **overrides})


def text_recipe(**stage_overrides) -> AdaptConfig:
    """One text-only stage that trains the whole language model (pretraining, recovery, the Tülu contrast)."""
    stage = {"name": "text", "trainable": ["lm"], "lr": 2e-5, "schedule": "cosine", **stage_overrides}
    return from_dict({"stages": [stage]})


def text_only_twin(config: AdaptConfig, data: list) -> AdaptConfig:
    """The recipe's language-model training on text alone: every stage that trains the LM, with the same
    steps, lr, schedule and batch, on `data` and without the vision-side groups; stages that train only
    the vision side are dropped (with no images they train nothing). The contrast of the paper's
    training-trajectory claim: VL training against text training of the same length."""
    stages = []
    for stage in config.stages:
        if "lm" not in stage.trainable:
            continue
        trainable = [g for g in stage.trainable if g not in ("projector", "tower")]
        group_lr = {g: lr for g, lr in stage.group_lr.items() if g in trainable}
        stages.append({**dataclasses.asdict(stage), "data": list(data), "trainable": trainable, "group_lr": group_lr})
    if not stages:
        raise AdaptConfigError("the recipe has no stage that trains the language model: nothing for a text-only twin to train")
    return from_dict({**config.to_dict(), "stages": stages})


def load_config(path: str | os.PathLike, overrides: dict | None = None) -> AdaptConfig:
    """An adaptation recipe from YAML (missing fields take the paper's values), then `overrides`."""
    p = Path(path)
    if not p.is_file():
        raise AdaptConfigError(f"adapt config not found: {p}")
    try:
        raw = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as exc:
        raise AdaptConfigError(f"cannot parse {p}: {str(exc).splitlines()[0]}") from None
    if not isinstance(raw, dict):
        raise AdaptConfigError(f"{p}: the top level must be a mapping")
    for key in ("deepspeed", "fsdp"):  # relative paths are relative to the YAML file
        if isinstance(raw.get(key), str) and not Path(raw[key]).is_absolute():
            raw[key] = str((p.parent / raw[key]).resolve())
    return from_dict(_merge(raw, overrides or {}), where=str(p))


def from_dict(raw: dict, where: str = "adapt config") -> AdaptConfig:
    """Validate a recipe mapping; stages named stage1/stage2 start from the paper's values."""
    raw = dict(raw)
    unknown = sorted(set(raw) - {f.name for f in dataclasses.fields(AdaptConfig)})
    if unknown:
        raise AdaptConfigError(f"{where}: unknown key(s) {', '.join(unknown)}")
    stages_raw = raw.pop("stages", None)
    if stages_raw is None:
        stages_raw = [{"name": "stage1"}, {"name": "stage2"}]
    if isinstance(stages_raw, dict):  # {stage1: {...}, stage2: {...}}
        stages_raw = [{"name": k, **(v or {})} for k, v in stages_raw.items()]
    if not isinstance(stages_raw, list) or not stages_raw:
        raise AdaptConfigError(f"{where}.stages: must be a non-empty list or mapping")
    traj_raw = raw.pop("trajectory", None) or {}
    if not isinstance(traj_raw, dict):
        raise AdaptConfigError(f"{where}.trajectory: must be a mapping")
    bad = sorted(set(traj_raw) - {f.name for f in dataclasses.fields(TrajectoryConfig)})
    if bad:
        raise AdaptConfigError(f"{where}.trajectory: unknown key(s) {', '.join(bad)}")
    stages = [_stage(s, f"{where}.stages[{i}]") for i, s in enumerate(stages_raw)]
    names = [s.name for s in stages]
    if len(set(names)) != len(names):
        raise AdaptConfigError(f"{where}.stages: duplicate stage names {names}")
    cfg = AdaptConfig(stages=stages, trajectory=TrajectoryConfig(**traj_raw), **raw)
    _check_top(cfg, where)
    return cfg


_PAPER_STAGES = {
    "stage1": {"trainable": ["projector"], "lr": 1e-4, "schedule": "constant"},
    "stage2": {"trainable": ["projector", "lm"], "lr": 2e-5, "schedule": "cosine"},
}


def _stage(raw, where: str) -> StageConfig:
    if not isinstance(raw, dict) or not isinstance(raw.get("name"), str) or not raw["name"]:
        raise AdaptConfigError(f"{where}: a stage is a mapping with a non-empty `name`")
    unknown = sorted(set(raw) - {f.name for f in dataclasses.fields(StageConfig)})
    if unknown:
        raise AdaptConfigError(f"{where}: unknown key(s) {', '.join(unknown)}")
    values = {**_PAPER_STAGES.get(raw["name"], {}), **raw}
    if isinstance(values.get("data"), (str, dict)):
        values["data"] = [values["data"]]
    if isinstance(values.get("trainable"), str):
        values["trainable"] = [values["trainable"]]
    stage = StageConfig(**values)
    w = f"{where} ({stage.name})"
    for k in ("lr", "warmup_ratio", "weight_decay", "max_grad_norm", "epochs"):
        v = getattr(stage, k)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
            raise AdaptConfigError(f"{w}.{k}: must be a finite number >= 0, got {v!r}")
    if stage.lr <= 0 or stage.warmup_ratio >= 1:
        raise AdaptConfigError(f"{w}: lr must be > 0 and warmup_ratio < 1")
    for k in ("batch_size", "micro_batch_size"):
        if not _pos_int(getattr(stage, k)):
            raise AdaptConfigError(f"{w}.{k}: must be a positive integer, got {getattr(stage, k)!r}")
    for k in ("steps", "save_steps"):
        if getattr(stage, k) is not None and not _pos_int(getattr(stage, k)):
            raise AdaptConfigError(f"{w}.{k}: must be a positive integer or null, got {getattr(stage, k)!r}")
    if not isinstance(stage.save_models_at, list) or not all(_pos_int(n) for n in stage.save_models_at) \
            or sorted(set(stage.save_models_at)) != stage.save_models_at:
        raise AdaptConfigError(f"{w}.save_models_at: an increasing list of positive step numbers, got {stage.save_models_at!r}")
    if stage.steps is not None and stage.save_models_at and stage.save_models_at[-1] >= stage.steps:
        raise AdaptConfigError(f"{w}.save_models_at: {stage.save_models_at[-1]} is not before the stage's last step "
                               f"({stage.steps}: the run's own model)")
    if not isinstance(stage.group_lr, dict):
        raise AdaptConfigError(f"{w}.group_lr: a mapping of group names to learning rates, got {stage.group_lr!r}")
    for g, v in stage.group_lr.items():
        if g not in stage.trainable or g.startswith("re:"):
            raise AdaptConfigError(f"{w}.group_lr: {g!r} is not a named group the stage trains ({', '.join(stage.trainable)})")
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v <= 0:
            raise AdaptConfigError(f"{w}.group_lr.{g}: must be a finite number > 0, got {v!r}")
    if stage.steps is None and stage.epochs <= 0:
        raise AdaptConfigError(f"{w}: set steps or epochs > 0")
    if stage.schedule not in SCHEDULES:
        raise AdaptConfigError(f"{w}.schedule: {stage.schedule!r}; choose from {', '.join(SCHEDULES)}")
    if stage.loss_on not in LOSS_ON:
        raise AdaptConfigError(f"{w}.loss_on: {stage.loss_on!r}; choose from {', '.join(LOSS_ON)}")
    if not stage.trainable:
        raise AdaptConfigError(f"{w}.trainable: name at least one group ({', '.join(GROUPS)}) or re:<pattern>")
    for g in stage.trainable:
        if not isinstance(g, str) or (g not in GROUPS and not g.startswith("re:")):
            raise AdaptConfigError(f"{w}.trainable: unknown group {g!r}; groups: {', '.join(GROUPS)}, or re:<regex>")
        if g.startswith("re:"):
            try:
                re.compile(g[3:])
            except re.error as exc:
                raise AdaptConfigError(f"{w}.trainable: bad pattern {g!r}: {exc}") from None
    stage.accumulation()
    return stage


def _check_top(cfg: AdaptConfig, where: str) -> None:
    if cfg.precision not in PRECISIONS:
        raise AdaptConfigError(f"{where}.precision: {cfg.precision!r}; choose from {', '.join(PRECISIONS)}")
    for k in ("max_length", "log_every"):
        if not _pos_int(getattr(cfg, k)):
            raise AdaptConfigError(f"{where}.{k}: must be a positive integer")
    if not isinstance(cfg.seed, int) or isinstance(cfg.seed, bool):
        raise AdaptConfigError(f"{where}.seed: must be an integer")
    if cfg.deepspeed and cfg.fsdp:
        raise AdaptConfigError(f"{where}: choose deepspeed or fsdp, not both")
    for k in ("deepspeed", "fsdp"):
        v = getattr(cfg, k)
        if v is not None and not Path(v).is_file():
            raise AdaptConfigError(f"{where}.{k}: file not found: {v}")
    t = cfg.trajectory
    if t.every is not None and not _pos_int(t.every):
        raise AdaptConfigError(f"{where}.trajectory.every: must be a positive integer or null")
    if t.eval_limit is not None and not _pos_int(t.eval_limit):
        raise AdaptConfigError(f"{where}.trajectory.eval_limit: must be a positive integer or null")


def _pos_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def _merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


# --------------------------------------------------------------------------- the vision side

VISION_KINDS = ("fresh", "donor", "tiny", "scenes")  # how `interventions.adapt.build` makes the tower and projector
TINY_DEFAULTS = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "image_size": 8, "patch_size": 4}


@dataclass
class VisionSpec:
    """Where the vision side comes from. `source`: tower (fresh) or VLM (donor) hub id / path."""

    kind: str
    source: str | None = None
    tiny: dict = field(default_factory=dict)  # tiny tower shape (TINY_DEFAULTS); scenes: tower settings
    feature_layer: int | None = None  # fresh: default -2 (CLIP, LLaVA-1.5) / -1 (SigLIP)
    seed: int = 0  # projector (and tiny tower) initialisation

    def __post_init__(self):
        if self.kind not in VISION_KINDS:
            raise SinkstudyError(f"unknown vision kind {self.kind!r}; choose from {', '.join(VISION_KINDS)}")
        if self.kind in ("fresh", "donor") and not self.source:
            raise SinkstudyError(f"vision kind {self.kind!r} needs a source (hub id or local path)")
        if self.kind == "scenes":
            from interventions.adapt.tower import settings_of  # the tower's module loads torch

            settings_of(self.tiny)
            return
        unknown = set(self.tiny) - set(TINY_DEFAULTS) - {"intermediate_size"}
        if unknown:
            raise SinkstudyError(f"unknown tiny tower key(s) {', '.join(sorted(unknown))}; allowed: {', '.join(TINY_DEFAULTS)}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
