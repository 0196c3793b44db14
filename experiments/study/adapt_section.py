"""A study's `adapt:` section, typed: the VL recipe every adaptation arm shares (data per stage in it),
the vision side, the VL-skill probe and the arms (the control first), each protection validated by
its registry (`interventions.protect.validate_protection`); one-line errors naming the key."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path

from experiments.study.schema import StudyConfigError, fail, guarded, integer, mapping, relative_file, slug
from interventions.adapt.config import StageConfig, VisionSpec, from_dict, load_config, text_only_twin
from interventions.adapt.probe import PROBES, VQA_DEFAULTS
from interventions.adapt.sources import check_spec
from interventions.registry import QKNORM
from sinkstudy import SinkstudyError

ADAPT_KEYS = {"recipe", "vision", "data", "vl_eval", "arms", "seed"}
ARM_KEYS = {"name", "protection", "params", "protections", "pairs", "notes", "qknorm", "seed", "text_only", "recipe"}
QKNORM_KEYS = {"init", "alpha"}
VISION_KEYS = {"kind", "source", "tiny", "feature_layer"}
CONTROL_ARM = "control"


@dataclass
class Arm:
    """One adaptation arm: its protections ({name, params}), the pairs it runs on (None: every pair),
    QK-RMSNorm injected into the base before the recipe (`qknorm`: {init, alpha}; None: none) and its
    training seed (None: the recipe's), so an arm may differ from the control by any of the three; or
    `text_only` (a data spec): the recipe's LM training on that text instead of the VL data, no vision side
    (`interventions.adapt.config.text_only_twin`), the contrast of the training-trajectory claim; and `recipe`,
    per stage the settings it changes in the study's recipe ({stage2: {lr: 1e-4, steps: 240}}: a calibration grid
    as arms sharing the tower, stage 1 and data; every stage but the data may change, so every arm trains on the
    same records)."""

    name: str
    protections: list[dict] = field(default_factory=list)
    pairs: list[str] | None = None
    notes: str | None = None
    qknorm: dict | None = None
    seed: int | None = None
    text_only: dict | None = None
    recipe: dict | None = None  # {stage: {field: value}}, applied by `arm_recipe`


def arm_recipe(recipe: dict, overrides: dict | None) -> dict:
    """The study's recipe (AdaptConfig.to_dict()) with an arm's per-stage overrides, validated as a whole recipe."""
    if not overrides:
        return recipe
    stages = [{**stage, **overrides.get(stage["name"], {})} for stage in recipe["stages"]]
    return from_dict({**recipe, "stages": stages}).to_dict()


def stage_recipe(recipe: dict, data: dict[str, list] | None = None, steps: dict[str, int] | None = None) -> dict:
    """`recipe` with a command's per-stage data and steps put over it (`arm_recipe`: the same overrides an arm's
    `recipe` gives, validated as a whole recipe)."""
    overrides: dict[str, dict] = {}
    for stage, specs in (data or {}).items():
        overrides.setdefault(stage, {})["data"] = list(specs)
    for stage, n in (steps or {}).items():
        overrides.setdefault(stage, {})["steps"] = n
    return arm_recipe(recipe, overrides)


def _recipe_overrides(raw, recipe: dict, where: str) -> dict | None:
    """An arm's `recipe`: {stage name: {StageConfig field: value}} (data excepted), checked by building the recipe."""
    if raw is None:
        return None
    stages = [s["name"] for s in recipe["stages"]]
    raw = mapping(raw, where, set(stages))
    fields = {f.name for f in dataclasses.fields(StageConfig)} - {"name", "data"}
    out = {}
    for stage, values in raw.items():
        values = mapping(values, f"{where}.{stage}", fields)
        out[stage] = dict(values)
    try:
        arm_recipe(recipe, out)
    except SinkstudyError as exc:
        fail(where, str(exc))
    return out or None


@dataclass
class AdaptSection:
    recipe: dict  # interventions.adapt.config.AdaptConfig.to_dict(), data per stage filled in
    recipe_path: str | None
    vision: dict  # interventions.adapt.build.VisionSpec.to_dict()
    vl_eval: dict | None  # the held-out VL probe ({probe: digits, heldout, seed} or {probe: vqa, ...}); None: no probe
    arms: list[Arm]


def parse_adapt(raw, path: Path | None, pair_names: list[str], where: str, out: Path | None = None) -> AdaptSection:
    cfg = mapping(raw, where, ADAPT_KEYS)
    recipe_raw = cfg.get("recipe")
    try:
        if isinstance(recipe_raw, str):
            recipe = load_config(relative_file(recipe_raw, path))
        elif isinstance(recipe_raw, dict):
            recipe = from_dict(recipe_raw, where=f"{where}.recipe")
        else:
            fail(f"{where}.recipe", "a recipe YAML (docs/adapt.md) or a mapping")
    except SinkstudyError as exc:
        raise StudyConfigError(f"{where}.recipe: {exc}") from None
    if cfg.get("seed") is not None:  # the recipe's training seed, replaced (a study's `seeds` sets it per seed)
        recipe.seed = integer(cfg["seed"], f"{where}.seed", 0)
    names = [s.name for s in recipe.stages]
    data = cfg.get("data")
    if data is not None:
        per_stage = {n: data for n in names} if isinstance(data, list) else mapping(data, f"{where}.data", set(names))
        for stage, specs in per_stage.items():
            recipe.stage(stage).data = list(specs) if isinstance(specs, list) else [specs]
    for stage in recipe.stages:
        if not stage.data:
            fail(f"{where}.data", f"stage {stage.name} has no data")
        for spec in stage.data:
            guarded(check_spec, f"{where}.data", spec)
    vision_raw = cfg.get("vision", "tiny")
    vision_raw = {"kind": vision_raw} if isinstance(vision_raw, str) else mapping(vision_raw, f"{where}.vision", VISION_KEYS)
    try:
        vision = VisionSpec(**{**vision_raw, "seed": recipe.seed}).to_dict()
    except (SinkstudyError, TypeError) as exc:
        fail(f"{where}.vision", str(exc))
    vl_eval = _probe(cfg.get("vl_eval", {"heldout": 200}), recipe, where)
    arms = _arms(cfg.get("arms"), pair_names, names, f"{where}.arms", out, recipe.to_dict())
    for arm in arms:
        if arm.text_only:
            guarded(lambda spec: text_only_twin(recipe, [spec]), f"{where}.arms.{arm.name}.text_only", arm.text_only)
    return AdaptSection(recipe.to_dict(), os.fspath(recipe_raw) if isinstance(recipe_raw, str) else None, vision, vl_eval, arms)


def _probe(vl_eval, recipe, where: str) -> dict | None:
    """The held-out VL probe (`interventions.adapt.probe`): `probe: digits` (default; `heldout` images, which must
    lie inside every stage's held-out digits) or `probe: vqa` (the instruction recipe's held-out VQA: items per
    source `easyvqa`, `scenes`, `digits`, `seed`, `max_new_tokens`; held out of the generated data by construction)."""
    if vl_eval is None:
        return None
    raw = mapping(vl_eval, f"{where}.vl_eval", {"probe", "heldout", "seed", *VQA_DEFAULTS})
    kind = raw.get("probe", "digits")
    if kind not in PROBES:
        fail(f"{where}.vl_eval.probe", f"one of {', '.join(PROBES)}, got {kind!r}")
    if kind == "vqa":
        if "heldout" in raw:
            fail(f"{where}.vl_eval.heldout", "the digit probe's setting; the vqa probe takes easyvqa, scenes and digits (items per source)")
        vl_eval = {"probe": "vqa", **VQA_DEFAULTS, **raw}
        for k in ("easyvqa", "scenes", "digits"):
            integer(vl_eval[k], f"{where}.vl_eval.{k}", 0)
        integer(vl_eval["seed"], f"{where}.vl_eval.seed")
        integer(vl_eval["max_new_tokens"], f"{where}.vl_eval.max_new_tokens", 1)
        if not vl_eval["easyvqa"] + vl_eval["scenes"] + vl_eval["digits"]:
            fail(f"{where}.vl_eval", "the vqa probe needs at least one item")
        return vl_eval
    extra = sorted(set(raw) - {"probe", "heldout", "seed"})
    if extra:
        fail(f"{where}.vl_eval", f"{', '.join(extra)}: settings of the vqa probe (probe: vqa), not of the digit probe")
    vl_eval = {"probe": "digits", "heldout": 200, "seed": recipe.seed, **raw}
    integer(vl_eval["heldout"], f"{where}.vl_eval.heldout", 1)
    integer(vl_eval["seed"], f"{where}.vl_eval.seed")
    for stage in recipe.stages:
        for spec in stage.data:
            opts = {} if spec == "digits" else (spec.get("digits") or {}) if isinstance(spec, dict) and "digits" in spec else None
            if opts is None or opts.get("split", "train") != "train":
                continue
            if vl_eval["heldout"] > opts.get("heldout", 200) or vl_eval["seed"] != opts.get("seed", recipe.seed):
                fail(f"{where}.vl_eval", f"the probe's {vl_eval['heldout']} images (seed {vl_eval['seed']}) must lie inside "
                                         f"stage {stage.name}'s held-out digits ({opts.get('heldout', 200)}, seed "
                                         f"{opts.get('seed', recipe.seed)})")
    return vl_eval


def _qknorm(raw, where: str) -> dict | None:
    """An arm's QK-norm injection ({init, alpha}, the engine's `adapt(qknorm=...)`), checked and defaulted by the
    registry's qknorm method (`interventions.registry`); None: none."""
    if raw is None:
        return None
    raw = mapping(raw, where, QKNORM_KEYS)
    resolved = guarded(QKNORM.resolve, where, raw)
    return {"init": resolved["init"], **({"alpha": raw["alpha"]} if "alpha" in raw else {})}


def _text_only(raw, where: str, out: Path | None) -> dict | None:
    """A text_only arm's data: one spec (string or mapping), checked like the stages' data."""
    if raw is None:
        return None
    return guarded(check_spec, where, _expand_out(raw, out))


def _expand_out(value, out: Path | None):
    """"{out}" in every string of a protection's settings (a data file the study writes), as in every path of the study."""
    if out is None:
        return value
    if isinstance(value, str):
        return value.replace("{out}", os.fspath(out))
    if isinstance(value, dict):
        return {k: _expand_out(v, out) for k, v in value.items()}
    return [_expand_out(v, out) for v in value] if isinstance(value, list) else value


def _arms(raw, pair_names: list[str], stage_names: list[str], where: str, out: Path | None = None,
          recipe: dict | None = None) -> list[Arm]:
    # lazy: loads torch, numpy
    from interventions.protect import validate_protection

    if not isinstance(raw, list) or not raw:
        fail(where, "a non-empty list of arms ({name, protection, params} or {name, protections: [...]})")
    arms, seen = [], set()
    for i, a in enumerate(raw):
        aw = f"{where}[{i}]"
        a = mapping(a, aw, ARM_KEYS)
        name = slug(a.get("name"), f"{aw}.name")
        if name in seen or name in ("base", "vlm"):
            fail(aw, f"arm name {name!r} is a duplicate or reserved (base, vlm)")
        seen.add(name)
        if "protection" in a and "protections" in a:
            fail(aw, "give protection (+ params) or protections, not both")
        if "protection" in a:
            items = [{"name": a["protection"], "params": a.get("params") or {}}]
        else:
            if "params" in a:
                fail(aw, "params go with protection (one), or inside each entry of protections")
            items = a.get("protections") or []
        if not isinstance(items, list):
            fail(f"{aw}.protections", "must be a list of {name, params}")
        protections = []
        for j, item in enumerate(items):
            pw = f"{aw}.protections[{j}]"
            item = {"name": item} if isinstance(item, str) else mapping(item, pw, {"name", "params"})
            params = _expand_out(dict(mapping(item.get("params"), f"{pw}.params")), out)
            resolved = guarded(lambda n: validate_protection(n, params), pw, item.get("name"))
            unknown = [s for s in resolved["stages"] or () if s not in stage_names]
            if unknown:
                fail(pw, f"stage(s) {', '.join(unknown)} not in the recipe ({', '.join(stage_names)})")
            protections.append({"name": item["name"], "params": params})
        qknorm = _qknorm(a.get("qknorm"), f"{aw}.qknorm")
        seed = None if a.get("seed") is None else integer(a["seed"], f"{aw}.seed", 0)
        text_only = _text_only(a.get("text_only"), f"{aw}.text_only", out)
        overrides = _recipe_overrides(a.get("recipe"), recipe, f"{aw}.recipe") if recipe is not None else None
        if name == CONTROL_ARM and (protections or qknorm or text_only):
            fail(aw, "the control arm takes no protection, qknorm or text_only")
        if text_only and (protections or qknorm):
            fail(aw, "a text_only arm is the recipe's LM training on text alone: give it no protection or qknorm")
        if name != CONTROL_ARM and not (protections or qknorm or text_only or seed is not None or overrides):
            fail(aw, f"arm {name!r} differs from the control by nothing: give a protection, qknorm, text_only, seed or recipe")
        only = a.get("pairs")
        if only is not None and (not isinstance(only, list) or not only or any(p not in pair_names for p in only)):
            fail(f"{aw}.pairs", f"a non-empty list of pair names ({', '.join(pair_names)}), got {only!r}")
        arms.append(Arm(name, protections, only, a.get("notes"), qknorm, seed, text_only, overrides))
    if CONTROL_ARM not in seen:
        arms.insert(0, Arm(CONTROL_ARM))
    else:
        control = next(a for a in arms if a.name == CONTROL_ARM)
        if control.pairs is not None:
            fail(where, "the control arm runs on every pair (it makes the pair's VLM): remove its pairs")
        arms.remove(control)
        arms.insert(0, control)
    return arms
