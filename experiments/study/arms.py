"""A study's adaptation arms (the `adapt:` section): the control and each protection through the same
VL adaptation on every pair's base, then the same measurements (docs/protect.md).

Steps per pair P and arm A (each keyed by the engine on everything that changes its output):
    P/adapt/A          `interventions.adapt.adapt` of the base with A's protections (same recipe, vision
                       spec, data order and seed for every arm); key: the run's request (base fingerprint,
                       recipe with data identities, vision, each protection's class, settings and source
                       hash, so editing a plug-in reruns exactly the arms that use it) + engine code
    P/vlskill/A        held-out digit accuracy of the arm's VLM (the VL skill it learnt)
    P/adapt/A-extract  the arm's VLM's language model (vocabulary aligned to the base; `PairPlan.adapted`,
                       as for every adapted model) and its sink and eval steps; not for the control,
                       whose VLM is the pair's VLM (P/extract)
`protection_summary` adds, per arm, the paired comparison against the control (Δ = arm − control in
points, `evals.stats.compare`), the VL skill, the Sink Strength trajectory during adaptation and what
each protection reported.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Mapping

from experiments.study.adapt_section import CONTROL_ARM, arm_recipe
from experiments.study.config import model_dir
from experiments.study.graph import Step
from experiments.study.kinds import Ref, StepArgs, location
from interventions.adapt.code import VL_WORLD
from interventions.adapt.config import VisionSpec, from_dict, text_only_twin
from interventions.adapt.probe import vl_skill
from interventions.pairs.resolve import load_config
from sinkstudy import SinkstudyError
from sinkstudy.checkpoint import load_tokenizer
from sinkstudy.io import read_json, remove_tree
from sinkstudy.provenance import code_version, model_fingerprint

REPLAY = "text_replay"  # the protection every sink-specific one is also set against


def make_hooks(protections) -> list:
    """Protection hooks constructed from their settings ([{name, params}])."""
    # lazy: loads torch, numpy
    from interventions.protect import make_protection

    return [make_protection(p["name"], p["params"]) for p in protections]


def protect_code_version() -> str:
    """The protections' shared machinery (the adaptation engine's own code is in its request). Each protection's
    own module is left out: the request carries the source hash of the protections a run uses, so editing one
    reruns exactly the runs that use it."""
    # lazy: loads torch, numpy
    from interventions.protect import list_protections

    protect = Path(importlib.util.find_spec("interventions.protect").origin).parent
    plugin_files = {Path(inspect.getsourcefile(spec.cls)).resolve() for spec in list_protections().values()}
    return code_version(*sorted(f for f in protect.rglob("*.py") if "__pycache__" not in f.parts and f.resolve() not in plugin_files))


@dataclass(frozen=True)
class Adapt(StepArgs):
    """`interventions.adapt.adapt` of `base` with `recipe` (an AdaptConfig as a dict), `vision` (a VisionSpec as a
    dict; None: the recipe's LM stages on text alone), protections ([{name, params}]) and QK-RMSNorm injected
    first (`qknorm`: {init, alpha}); keyed by the run's request: the base's content, recipe with data identities,
    vision, each protection's class, settings and source hash (so editing a plug-in reruns exactly the runs that
    use it), the engine's code."""

    kind: ClassVar[str] = "adapt"
    base: Ref
    recipe: Mapping[str, Any]
    vision: Mapping[str, Any] | None = None
    protections: tuple = ()
    qknorm: Mapping[str, Any] | None = None
    tokenizer: Ref | None = None
    device: str | None = location(None)
    run_dir: Path = location()
    model_dir: Path | None = location(None)  # None: run_dir/model
    share_stages: bool = location(False)  # finished stages shared between runs (`interventions.adapt.stagecache`)
    resume: bool = location(True)  # an unfinished run of this request in `run_dir` continues (else refused)

    def parts(self):
        """(VisionSpec or None, AdaptConfig, hooks) this step runs."""
        return (VisionSpec(**self.vision) if self.vision is not None else None), from_dict(dict(self.recipe)), make_hooks(self.protections)

    def identity(self, ctx) -> dict:
        # lazy: loads torch, numpy
        from interventions.adapt.run import make_request

        vision, recipe, hooks = self.parts()
        request = make_request(self.base.local(), vision, recipe, hooks=hooks, qknorm=self.qknorm)
        request.pop("base")  # where the base lies is not what it is
        request["base_fingerprint"] = self.base.fingerprint(ctx)
        sources = [h.pop("source_sha256") for h in request["hooks"]]  # code, like the engine's: an edit reruns, never refuses
        request["code"] = {"engine": request["code"], "hooks": sources, "protect": protect_code_version()}
        return {**request, "tokenizer": self.tokenizer.fingerprint(ctx) if self.tokenizer else None}

    @property
    def seed(self) -> int:
        return self.recipe["seed"]

    def run(self, ctx) -> dict:
        # lazy: loads torch, numpy
        from interventions.adapt import adapt
        from interventions.adapt.run import REQUEST, make_request
        from interventions.adapt.stagecache import default_root

        vision, recipe, hooks = self.parts()
        out, vlm = Path(self.run_dir), Path(self.model_dir or Path(self.run_dir) / "model")
        request = make_request(self.base.local(), vision, recipe, hooks=hooks, qknorm=self.qknorm)
        # The engine runs this step to make it: a run of this request left in its folder continues (with `resume`),
        # anything else there (another request's run, or this one's with --force) is started over.
        same = (out / REQUEST).is_file() and read_json(out / REQUEST) == request
        if out.exists() and (ctx.engine.force or not same):
            remove_tree(out, within=out.parent)
        report = adapt(self.base.local(), vision=vision, config=recipe, out=out, model_dir=vlm, hooks=hooks, qknorm=self.qknorm,
                       resume=self.resume, progress=ctx.progress, device=self.device,
                       tokenizer=load_tokenizer(self.tokenizer.local()) if self.tokenizer else None,
                       stage_cache=default_root() if self.share_stages else None)
        if not report:
            return {}  # a data-parallel worker: rank 0 reports
        return {"path": str(vlm), "fingerprint": model_fingerprint(vlm), "run": str(out), "summary": adapt_summary(report)}


def adapt_summary(report: dict) -> dict:
    return {
        "stages": [{k: s.get(k) for k in ("stage", "steps", "final_loss", "steps_per_second", "trainable_params", "hooks")}
                   for s in report["stages"]],
        "trajectory": [{k: p.get(k) for k in ("step", "stage", "sink_strength", "mean_sink_mass", "scores")}
                       for p in (report.get("trajectory") or {}).get("points") or []],
        "round_trip": report["build"].get("round_trip_max_abs_logit_diff"),
        "snapshots": [{k: x[k] for k in ("stage", "stage_step", "step")} for x in report.get("snapshots") or []],
        "protections": [{"name": h["name"], "params": h["params"].get("config"), "source": h["source_sha256"]} for h in report["hooks"]],
    }


@dataclass(frozen=True)
class VLSkill(StepArgs):
    """Held-out VL skill of a VLM under the study's probe (`interventions.adapt.probe.vl_skill`: the digit probe, or
    the instruction recipe's held-out VQA); with `lm`, that causal LM put in place of the VLM's own first (a merged
    or mitigated LM scored with the tower and projector of the VLM it came from)."""

    kind: ClassVar[str] = "vl-skill"
    code: ClassVar[tuple[str, ...]] = ("evals.vqa", *VL_WORLD, "interventions.adapt.probe", "interventions.adapt.sources",
                                       "interventions.adapt.encoding", "interventions.adapt.vlm_io", "interventions.adapt.build")
    model: Ref
    probe: Mapping[str, Any]  # the study's vl_eval: {probe: digits, heldout, seed} or {probe: vqa, ...}
    lm: Ref | None = None

    def run(self, ctx) -> dict:
        return vl_skill(Path(self.model.local()), dict(self.probe), self.lm.local() if self.lm is not None else None)


def arm_step(study, pair, arm, base: Ref) -> Adapt:
    """The adaptation of one arm on one pair: the study's recipe and vision side with the arm's seed (which
    draws the tower and projector init too), protections and QK-norm; a text-only arm trains the recipe's LM
    stages on its text."""
    seed = study.adapt.recipe["seed"] if arm.seed is None else arm.seed
    recipe = from_dict({**arm_recipe(study.adapt.recipe, arm.recipe), "seed": seed})
    if arm.text_only:  # the recipe's LM training on text alone: no vision side
        recipe, vision = text_only_twin(recipe, [arm.text_only]), None
    else:
        vision = VisionSpec(**{**study.adapt.vision, "seed": seed}).to_dict()
    return Adapt(base, recipe.to_dict(), vision, tuple(arm.protections), arm.qknorm, run_dir=run_dir(study, pair.name, arm.name),
                 model_dir=model_dir(study.out, pair.name, arm.name, "vlm"), share_stages=True)


def run_dir(study, pair: str, arm: str) -> Path:
    return Path(study.out) / "adapt" / pair / arm


def check_arms(pp) -> None:
    """Refuse, before any step runs, an arm whose protection cannot run on its pair's base (e.g.
    `disable_qk_norm` on a backbone without native QK-norm), in one line naming the arm. Bases the study
    builds, or that are not on disk (hub ids), are checked by the adaptation itself."""
    study, pair = pp.study, pp.pair
    if not (Path(pair.base) / "config.json").is_file():
        return
    config = None
    for arm in study.arms_of(pair.name):
        if arm.qknorm or not arm.protections:
            continue  # an injected base is made by a step
        config = config or load_config(pair.base)
        for hook in make_hooks(arm.protections):
            try:
                hook.check_base(config)
            except SinkstudyError as exc:
                raise SinkstudyError(f"pair {pair.name} arm {arm.name}: {exc}") from None


def adapt_step(pp, arm) -> str:
    """One arm's adaptation step on the pair of `pp` (experiments.study.pipeline.PairPlan); its step id."""
    study, pair = pp.study, pp.pair
    args = arm_step(study, pair, arm, pp.ref(pair.base))
    return pp.add(Step(f"{pair.name}/adapt/{arm.name}", args, outputs=(args.model_dir, args.run_dir),
                       owner=f"pair {pair.name} arm {arm.name}"))


def measure_arm(pp, arm, step: str) -> None:
    """Probe the arm's VL skill; extract and measure its language model unless it is the control (the pair's VLM LM,
    measured as `vlm`). `step`: the arm's adaptation step."""
    study, pair, p = pp.study, pp.pair, pp.pair.name
    vlm, owner = model_dir(study.out, p, arm.name, "vlm"), f"pair {p} arm {arm.name}"
    skill = None
    if study.adapt.vl_eval is not None and not arm.text_only:
        skill = pp.add(Step(f"{p}/vlskill/{arm.name}", VLSkill(Ref(str(vlm), step), study.adapt.vl_eval), owner=owner))
    info = {"arm": arm.name, "protections": [x["name"] for x in arm.protections], "qknorm": arm.qknorm, "seed": arm.seed,
            "text_only": arm.text_only, "adapt": step, "vl_skill": skill}
    if arm.name == CONTROL_ARM:
        pp.models["vlm"].arm, pp.models["vlm"].vl_skill = info, skill
    elif arm.text_only:  # the run wrote a causal LM: nothing to extract
        pp.measure(arm.name, Ref(str(vlm), step), method="protection", arm=info, owner=owner)
    else:
        pp.adapted(arm.name, vlm, model_dir(study.out, p, arm.name, "vlm", "lm"), pair.base, extract_id=f"{p}/adapt/{arm.name}-extract",
                   method="protection", own_class=own_class(arm), arm=info, owner=owner).vl_skill = skill


def own_class(arm) -> bool:
    """An injected QK-norm (or a protection that changes the architecture) is not in the base's class: such an arm's
    LM is extracted in the class the engine trained."""
    return bool(arm.qknorm) or any(hook.changes_architecture() for hook in make_hooks(arm.protections))


def snapshot_label(arm: str, stage: str, step: int) -> str:
    return f"{arm}-{stage}-{step}"


def measure_snapshots(pp, arm, step: str) -> None:
    """The models the arm kept during training (a stage's `save_models_at`): each measured like the arm's final model
    (VL skill, language model, S, evals), under `<arm>-<stage>-<step>`; not arms themselves (no comparison with the
    control), the points of a calibration (`experiments.study.calibration`). `step`: the arm's adaptation step."""
    # lazy: loads torch, numpy
    from interventions.adapt.run import snapshot_dir

    study, pair, p = pp.study, pp.pair, pp.pair.name
    args, owner = arm_step(study, pair, arm, pp.ref(pair.base)), f"pair {p} arm {arm.name}"
    for stage in args.parts()[1].stages:
        for kept in stage.save_models_at:
            label = snapshot_label(arm.name, stage.name, kept)
            vlm = snapshot_dir(args.run_dir, stage.name, kept)
            skill = None
            if study.adapt.vl_eval is not None and not arm.text_only:
                skill = pp.add(Step(f"{p}/vlskill/{label}", VLSkill(Ref(str(vlm), step), study.adapt.vl_eval), owner=owner))
            if arm.text_only:
                measured = pp.measure(label, Ref(str(vlm), step), method="snapshot", owner=owner)
            else:
                measured = pp.adapted(label, vlm, model_dir(study.out, p, label, "vlm", "lm"), pair.base,
                                      extract_id=f"{p}/adapt/{label}-extract", method="snapshot", own_class=own_class(arm), owner=owner)
            measured.vl_skill = skill
            measured.snapshot = {"arm": arm.name, "stage": stage.name, "stage_step": kept, "adapt": step}


def treatment(arm) -> str:
    """What an arm does besides its seed (arms with the same treatment are seed replicates of one another)."""
    return json.dumps({"protections": arm.protections, "qknorm": arm.qknorm, "text_only": arm.text_only, "recipe": arm.recipe},
                      sort_keys=True)


def replicates(study, pair: str) -> dict[str, dict]:
    """Per arm on `pair`: its training seed, the first arm of its treatment (`replicate_of`: the name its seeds
    are reported under) and its control: the untreated arm of the same seed (else the control)."""
    arms = study.arms_of(pair)
    seed = {a.name: study.adapt.recipe["seed"] if a.seed is None else a.seed for a in arms}
    untreated = treatment(arms[0])  # the control's
    first: dict[str, str] = {}
    out = {}
    for a in arms:
        leader = first.setdefault(treatment(a), a.name)
        control = next((c.name for c in arms if treatment(c) == untreated and seed[c.name] == seed[a.name]), CONTROL_ARM)
        if treatment(a) == untreated:
            control = CONTROL_ARM  # a control replicate is set against the control: the seed's own effect
        out[a.name] = {"training_seed": seed[a.name], "replicate_of": leader, "control": control}
    return out


def protection_summary(study, pair: str, models: dict, results: dict[str, dict], runs: dict, kw: dict) -> dict[str, Any]:
    """Per arm (the control included): protections, VL skill, S after, trajectory, hook reports, and per task the
    comparison with its control (Δ = arm − control in points, paired bootstrap CI): the untreated arm of the same
    training seed, so a seed replicate of an arm is set against the control of its seed; an untreated replicate
    (the control on another seed) against the control, and against the base (its own degradation)."""
    # lazy: loads numpy
    from evals.stats import compare

    arms = {}
    labels = {m.arm["arm"]: label for label, m in models.items() if m.arm is not None}
    for label, m in models.items():
        if m.arm is None:
            continue
        info = m.arm
        entry = {"label": label, "protections": info["protections"], "qknorm": info.get("qknorm"), "seed": info.get("seed"),
                 "text_only": info.get("text_only"),
                 "vl_skill": results[info["vl_skill"]] if info["vl_skill"] else None,
                 "sink_strength": results[m.sink]["value"], "adapt": results[info["adapt"]].get("summary")}
        arms[info["arm"]] = entry
    reps = replicates(study, pair)
    for name, entry in arms.items():
        entry.update(reps[name])
        if name == CONTROL_ARM:
            continue
        control = runs[labels[entry["control"]]]
        entry["vs_control"] = {t: compare(control, runs[entry["label"]], t, **kw).as_dict() for t in study.evals.protocol.tasks}
        if entry["control"] == CONTROL_ARM and entry["replicate_of"] == CONTROL_ARM:
            entry["vs_base"] = {t: compare(runs["base"], runs[entry["label"]], t, **kw).as_dict() for t in study.evals.protocol.tasks}
        # The baseline a sink-specific protection must beat: text replay on the same seed.
        replay = next((r for r, e in arms.items() if e["protections"] == [REPLAY] and reps[r]["training_seed"] == entry["training_seed"]), None)
        if replay and entry["protections"] and entry["protections"] != [REPLAY]:
            entry["replay"] = replay
            entry["vs_replay"] = {t: compare(runs[labels[replay]], runs[entry["label"]], t, **kw).as_dict() for t in study.evals.protocol.tasks}
    return {"arms": arms, "convention": "vs_control: Δ = arm − its control in points (score × 100; the control: the unprotected "
                                        "adaptation with the arm's training seed; positive = the arm kept more text skill)"}


