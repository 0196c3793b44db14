"""A study as a plan: the typed config in, a `StudyPlan` out (the steps, and which of them measure which
model). Making the plan runs nothing and reads no weights (only the config of a base whose QK-norm the
study does not state, for a QK-norm intervention); it fails in one line when two of its steps would write
one output (`experiments.study.graph`).

Steps, in plan order: the steps the study's build section hands over (`Build.steps`: no other code here
knows what a build makes), then per pair P: the control arm's training (`P/adapt/control`, the `adapt:`
section, `experiments.study.arms`), `P/extract` (the VLM's language model), `P/sink|eval/L` for the base
and the VLM LM, the control's VL skill and the models it kept, each `interventions:` entry through the step
builder of its kind (`BUILDERS`, keyed by `experiments.study.methods.kind`: a post-hoc method on the VLM LM, or
QK-norm injected into the base, re-adapted with the build's VL recipe with `vl: true`), each sink dose of the base
(`dose:`, `experiments.study.doses`), then each other arm: its training, VL skill, language model and kept models.
Every treated model is measured by the same two steps (`PairPlan.measure`), and every adapted model, arm
or re-adapted QK-norm base, reaches them through one builder (`PairPlan.adapted`). A model the plan makes
is read through a `Ref` naming the step that writes it (`Plan.maker`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from experiments.study import arms
from experiments.study.arms import VLSkill
from experiments.study.config import model_dir
from experiments.study.doses import plan_doses
from experiments.study.graph import Plan, Step
from experiments.study.kinds import Ref
from experiments.study.methods import INJECTION, POSTHOC, kind
from experiments.study.pair_steps import (Extract, ExtractAdapted, InjectQKNorm, Intervene, Loading, Measurement,
                                          measure_steps, native_qk_norm, texts_ref)
from experiments.study.template import TrainingOpenings, training_data
from interventions.mitigations import list_mitigations
from interventions.registry import takes_root
from sinkstudy import SinkstudyError


@dataclass
class Measured:
    """A model the study measures: its label in the pair, checkpoint, method, and the steps that measure it."""

    label: str
    path: str
    method: str | None
    sink: str  # step ids
    eval: str
    arm: dict | None = None  # adaptation arms: {"arm", "protections", "adapt" (step id), "vl_skill" (step id or None)}
    vl_skill: str | None = None  # the step that scores its VL skill (an arm's VLM, or the LM put back into the pair's VLM)
    snapshot: dict | None = None  # a model kept during an arm's training: {"arm", "stage", "stage_step", "adapt" (step id)}


@dataclass
class StudyPlan:
    study: Any
    plan: Plan
    models: dict[str, dict[str, Measured]] = field(default_factory=dict)  # pair -> label -> Measured, in report order
    openings: str | None = None  # the step that reads the VL training answers' openings (template share)


def measurement(study) -> Measurement:
    """How the study measures every model: its sink section, eval protocol, seed and model settings."""
    s = study.sink
    return Measurement(s.metric, texts_ref(s.texts), s.params, s.options, study.evals.protocol, study.seed,
                       Loading(study.model.dtype, study.model.device))


def sink_file(study, pair: str, label: str) -> Path:
    return study.out / "sink" / pair / f"{label}.json"


def eval_dir(study, pair: str, label: str) -> Path:
    return study.out / "evals" / pair / label


class PairPlan:
    """Adds one pair's steps to `plan`."""

    def __init__(self, study, plan: Plan, pair):
        self.study, self.plan, self.pair = study, plan, pair
        self.measurement = measurement(study)
        self.models: dict[str, Measured] = {}
        self.lm_dir = model_dir(study.out, pair.name, "vlm", "lm")

    def add(self, step: Step) -> str:
        return self.plan.add(step).id

    def ref(self, path) -> Ref:
        """A model of the pair: made by a step of the plan, or an input (a pinned hub id at its revision)."""
        path = str(path)
        pinned = next((rev for role, rev in self.pair.revision.items() if getattr(self.pair, role) == path), None)
        return Ref(path, self.plan.maker(path), pinned)

    def extract(self) -> str:
        """P/extract: the VLM's language model in the base's class."""
        pair = self.pair
        return self.add(Step(f"{pair.name}/extract", Extract(self.ref(pair.base), self.ref(pair.vlm), self.study.model.dtype,
                                                              out=self.lm_dir), outputs=(self.lm_dir,), owner=f"pair {pair.name}"))

    def measure(self, label: str, model: Ref, *, method: str | None = None, arm: dict | None = None,
                owner: str | None = None) -> Measured:
        """P/sink/L and P/eval/L of `model`, prompted through the base's tokenizer."""
        study, p = self.study, self.pair.name
        sink, ev = measure_steps(self.measurement, p, label, model, self.ref(self.pair.base), sink_file(study, p, label),
                                 eval_dir(study, p, label), owner=owner or f"pair {p}")
        self.models[label] = Measured(label, model.path, method, self.add(sink), self.add(ev), arm)
        return self.models[label]

    def adapted(self, label: str, vlm: Path, lm: Path, start: str, *, extract_id: str, method: str, own_class: bool = False,
                arm: dict | None = None, owner: str) -> Measured:
        """An adapted model's language model (extracted against the base it started from) and its measurements."""
        ex = self.add(Step(extract_id, ExtractAdapted(self.ref(vlm), self.ref(start), own_class, out=lm), outputs=(lm,), owner=owner))
        return self.measure(label, Ref(str(lm), ex), method=method, arm=arm, owner=owner)

    # ----------------------------------------------------------------------- interventions, by kind

    def posthoc(self, iv) -> None:
        """A registered intervention on (base, VLM LM): merges from the pair's root where it has one, mitigations with
        both sink maps; deleted once measured with keep_models: false."""
        study, pair, p = self.study, self.pair, self.pair.name
        params = {k: v for k, v in iv.params.items() if k != "root"}
        root_path = iv.params.get("root") or (pair.root if takes_root(iv.method) else None)  # task vectors from the common ancestor
        root = self.ref(root_path) if root_path else None
        mitigation = list_mitigations().get(iv.method)
        maps = ({label: Ref(str(sink_file(study, p, label)), f"{p}/sink/{label}") for label in ("base", "vlm")}
                if mitigation is not None and mitigation.needs_sink_maps else None)
        out_dir = model_dir(study.out, p, iv.name)
        owner = f"pair {p} intervention {iv.name}"
        made = self.add(Step(f"{p}/intervene/{iv.name}",
                             Intervene(iv.method, self.ref(pair.base), Ref(str(self.lm_dir), f"{p}/extract"), params, study.seed,
                                       root=root, sink_maps=maps, out=out_dir),
                             outputs=(out_dir,), owner=owner, transient=not study.keep_models))
        treated = self.measure(iv.name, Ref(str(out_dir), made), method=iv.method, owner=owner)
        if study.adapt is not None and study.adapt.vl_eval is not None:  # its VL cost: the LM back in the pair's VLM
            treated.vl_skill = self.add(Step(f"{p}/vlskill/{iv.name}", VLSkill(self.ref(pair.vlm), study.adapt.vl_eval,
                                                                               Ref(str(out_dir), made)), owner=owner))

    def injection(self, iv) -> None:
        """QK-RMSNorm injected into the base (pairs without native QK-norm), measured; with `vl: true` the
        injected base re-adapted with the build's VL recipe, its language model measured as `<name>-vl`."""
        study, pair, p = self.study, self.pair, self.pair.name
        if native_qk_norm(self.ref(pair.base), pair.native_qk_norm):
            return
        params = iv.params
        base_out, owner = model_dir(study.out, p, iv.name, "base"), f"pair {p} intervention {iv.name}"
        training_text = study.build.training_text(study.out) if study.build is not None and params["train_steps"] else None
        if params["train_steps"] and training_text is None:
            raise SinkstudyError(f"{owner}: qknorm train_steps needs training text: only a study with a build section has a corpus")
        args = InjectQKNorm(self.ref(pair.base), params["init"], params["alpha"], self.measurement.texts, _calibration_set(study),
                            train_steps=params["train_steps"], trainable=params["trainable"], lr=params["lr"],
                            batch_size=params["batch_size"], seq_len=params["seq_len"],
                            training_text=Ref(str(training_text), self.plan.maker(training_text)) if training_text else None,
                            seed=study.seed, loading=self.measurement.loading, out=base_out)
        made = self.add(Step(f"{p}/intervene/{iv.name}", args, outputs=(base_out,), owner=owner))
        self.measure(iv.name, Ref(str(base_out), made), method="qknorm", owner=owner)
        if params["vl"]:
            vlm_out = model_dir(study.out, p, iv.name, "vlm")
            self.add(study.build.vl_adaptation(f"{p}/intervene/{iv.name}-vl", Ref(str(base_out), made), vlm_out, study.out, owner=owner))
            self.adapted(f"{iv.name}-vl", vlm_out, model_dir(study.out, p, iv.name, "vlm", "lm"), str(base_out),
                         extract_id=f"{p}/intervene/{iv.name}-vl-extract", method="qknorm+vl", owner=owner)


def _calibration_set(study) -> str:
    """The calibration set of the study's sink metric (what S is measured on when `sink.texts` names none)."""
    # lazy: loads torch, numpy
    from evals.sink.metrics import get_metric

    return get_metric(study.sink.metric).calibration


# Step builders of the `interventions:` entries, by `experiments.study.methods.kind`.
BUILDERS: dict[str, Callable[[PairPlan, Any], None]] = {POSTHOC: PairPlan.posthoc, INJECTION: PairPlan.injection}


def plan_study(study) -> StudyPlan:
    """Every step of `study` in dependency order, checked (`experiments.study.graph.Plan`), and what each measures."""
    out = StudyPlan(study, Plan())
    if study.build is not None:
        out.plan.extend(study.build.steps(study.out, measurement(study)))
    # What the models' eval answers are checked against (template share): the VL recipe the pairs' VLMs trained with
    if study.adapt is not None:
        out.openings = out.plan.add(Step("adapt/openings", TrainingOpenings(training_data(study.adapt.recipe),
                                                                            study.adapt.recipe["seed"]))).id
    elif study.build is not None:
        out.openings = out.plan.add(study.build.openings()).id
    for pair in study.pairs:
        pp = PairPlan(study, out.plan, pair)
        arms_here = study.arms_of(pair.name) if study.adapt is not None else []
        if arms_here:
            arms.check_arms(pp)
        # The control arm makes the pair's VLM, measured first; each other arm's steps follow its training, so a
        # sequential run finishes arm after arm.
        control = arms.adapt_step(pp, arms_here[0]) if arms_here else None
        pp.extract()
        pp.measure("base", pp.ref(pair.base))
        pp.measure("vlm", Ref(str(pp.lm_dir), f"{pair.name}/extract"))
        if control:
            arms.measure_arm(pp, arms_here[0], control)
            arms.measure_snapshots(pp, arms_here[0], control)
        for iv in study.interventions:
            BUILDERS[kind(iv.method)](pp, iv)
        if study.dose:
            plan_doses(pp)
        for arm in arms_here[1:]:
            step = arms.adapt_step(pp, arm)
            arms.measure_arm(pp, arm, step)
            arms.measure_snapshots(pp, arm, step)
        out.models[pair.name] = pp.models
    return out
