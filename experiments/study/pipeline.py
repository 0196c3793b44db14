"""A study as a plan: the typed config in, a `StudyPlan` out (the steps, and which of them measure
which model). Making the plan runs nothing and reads no weights (only the config of a base whose QK-norm
the study does not state, for a QK-norm intervention); it fails in one line when two of its steps would
write one output (`experiments.study.graph`).

Steps, in plan order: the steps the study's build section hands over (the demo's `Build.steps`: no
other code here knows the demo), then per pair P: its adaptation arms' training (`P/adapt/A`, the
`adapt:` section, `experiments.study.arms`), `P/extract` (the VLM's language model), `P/sink|eval/L`
for the base and the VLM LM, each `interventions:` entry through the step builder of its kind
(`BUILDERS`, keyed by `experiments.study.methods.kind`: a post-hoc method on the VLM LM, or QK-norm injected
into the base, re-adapted with the build's VL recipe with `vl: true`), then each arm's VL skill and
language model. Every treated model is measured by the same two steps (`PairPlan.measure`), and every
adapted model, arm or re-adapted QK-norm base, reaches them through one builder (`PairPlan.adapted`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from experiments.study import arms as protection, pair_steps as bodies
from experiments.study.graph import Plan, Step
from experiments.study.methods import INJECTION, POSTHOC, QKNORM_DEFAULTS, kind
from experiments.study.config import model_dir
from sinkstudy.provenance import code_version

ROOT = bodies.ROOT


@dataclass
class Measured:
    """A model the study measures: its label in the pair, checkpoint, method, and the steps that measure it."""

    label: str
    path: str
    method: str | None
    sink: str  # step ids
    eval: str
    arm: dict | None = None  # adaptation arms: {"arm", "protections", "adapt" (step id), "vl_skill" (step id or None)}


@dataclass
class StudyPlan:
    study: Any
    plan: Plan
    models: dict[str, dict[str, Measured]] = field(default_factory=dict)  # pair -> label -> Measured, in report order


class PairPlan:
    """Adds one pair's steps to `plan`; `deps`: the steps that make the pair's models (the build's)."""

    def __init__(self, study, plan: Plan, pair, deps: list[str]):
        self.study, self.plan, self.pair, self.deps = study, plan, pair, list(deps)
        self.models: dict[str, Measured] = {}
        self.lm_dir = model_dir(study.out, pair.name, "vlm", "lm")

    def add(self, step: Step) -> str:
        return self.plan.add(step).id

    def extract(self, vlm_deps: list[str]) -> str:
        """P/extract: the VLM's language model in the base's class (`vlm_deps`: steps that make the VLM)."""
        study, pair, lm_dir = self.study, self.pair, self.lm_dir
        spec = lambda ctx: {"base": pair.base, "vlm": pair.vlm, "dtype": study.model.dtype,  # noqa: E731
                            "models": {"base": bodies.pair_fingerprint(pair, pair.base), "vlm": bodies.pair_fingerprint(pair, pair.vlm)},
                            "code": code_version(ROOT / "interventions" / "pairs")}
        return self.add(Step(f"{pair.name}/extract", spec, (*self.deps, *vlm_deps), (lm_dir,),
                             lambda ctx: bodies.extract_step(pair, lm_dir, study, ctx.progress), reads=(pair.base, pair.vlm),
                             owner=f"pair {pair.name}"))

    def measure(self, label: str, path: str, deps: list[str], *, made_by: str | None = None, method: str | None = None,
                arm: dict | None = None, owner: str | None = None) -> Measured:
        """P/sink/L and P/eval/L of the model at `path`, keyed on its fingerprint (`made_by`: the step that made
        it; otherwise an input of the study)."""
        study, pair, p = self.study, self.pair, self.pair.name
        fingerprint: Callable = (lambda ctx: ctx.fingerprint(path, made_by)) if made_by else (lambda ctx: bodies.pair_fingerprint(pair, path))
        owner = owner or f"pair {p}"
        sink = self.add(Step(f"{p}/sink/{label}", lambda ctx: bodies.sink_spec(study, path, fingerprint(ctx)), tuple(deps),
                             (bodies.sink_file(study, p, label),), lambda ctx: bodies.sink_step(study, pair, label, path, ctx.progress),
                             reads=(path,), owner=owner))
        ev = self.add(Step(f"{p}/eval/{label}", lambda ctx: bodies.eval_step_spec(study, path, fingerprint(ctx)), tuple(deps),
                           (bodies.eval_dir(study, p, label),), lambda ctx: bodies.eval_step(study, pair, label, path, ctx.progress),
                           reads=(path,), owner=owner))
        self.models[label] = Measured(label, path, method, sink, ev, arm)
        return self.models[label]

    def adapted(self, label: str, adapt_step: str, vlm: Path, lm: Path, start: str, *, extract_id: str, method: str,
                own_class: bool = False, arm: dict | None = None, owner: str) -> Measured:
        """An adapted model's language model (extracted against the base it started from) and its measurements."""
        spec = {"code": code_version(ROOT / "interventions" / "pairs"), "own_class": own_class}
        ex = self.add(Step(extract_id, spec, (adapt_step,), (lm,), lambda ctx: bodies.extract_arm_step(vlm, start, lm, own_class),
                           reads=(start,), owner=owner))
        return self.measure(label, str(lm), [ex], made_by=ex, method=method, arm=arm, owner=owner)

    # ----------------------------------------------------------------------- interventions, by kind

    def posthoc(self, iv) -> None:
        """A registered intervention on (base, VLM LM): merges from the pair's root where it has one, mitigations with
        both sink maps; deleted once measured with keep_models: false."""
        from interventions.registry import intervention_request, takes_root

        study, pair, p, lm_dir = self.study, self.pair, self.pair.name, self.lm_dir
        params, deps = dict(iv.params), [f"{p}/extract", *self.deps]
        if pair.root and takes_root(iv.method):
            params.setdefault("root", pair.root)  # task vectors from the common pretrained ancestor
        if _needs_sink_maps(iv.method):
            params["sink_maps"] = {label: str(bodies.sink_file(study, p, label)) for label in ("base", "vlm")}
            deps += [f"{p}/sink/base", f"{p}/sink/vlm"]
        out_dir = model_dir(study.out, p, iv.name)
        # Input fingerprints, full settings, seed and the intervention's code (a plug-in's source).
        pins = {r: rev for r, rev in pair.revision.items() if r != "vlm"}  # the request's vlm is the extracted LM
        owner = f"pair {p} intervention {iv.name}"
        made = self.add(Step(f"{p}/intervene/{iv.name}",
                             lambda ctx: intervention_request(iv.method, pair.base, lm_dir, params, study.seed, revisions=pins),
                             tuple(deps), (out_dir,),
                             lambda ctx: bodies.intervene_step(study, pair, iv.method, params, lm_dir, out_dir, ctx.progress),
                             reads=(pair.base, *([params["root"]] if params.get("root") else [])), owner=owner,
                             transient=not study.keep_models))
        self.measure(iv.name, str(out_dir), [made], made_by=made, method=iv.method, owner=owner)

    def injection(self, iv) -> None:
        """QK-RMSNorm injected into the base (pairs without native QK-norm), measured; with `vl: true` the
        injected base re-adapted with the build's VL recipe, its language model measured as `<name>-vl`."""
        study, pair, p = self.study, self.pair, self.pair.name
        if bodies.native_qk_norm(pair):
            return
        params = {**QKNORM_DEFAULTS, **iv.params}
        base_out, owner = model_dir(study.out, p, iv.name, "base"), f"pair {p} intervention {iv.name}"
        spec = lambda ctx: {"qknorm": params, "seed": study.seed, "base": bodies.pair_fingerprint(pair, pair.base),  # noqa: E731
                            "code": code_version(ROOT / "interventions" / "qknorm.py", ROOT / "interventions" / "training.py",
                                                 ROOT / "interventions" / "adapt")}
        made = self.add(Step(f"{p}/intervene/{iv.name}", spec, tuple(self.deps), (base_out,),
                             lambda ctx: bodies.qknorm_step(study, pair, params, base_out, ctx.progress), reads=(pair.base,), owner=owner))
        self.measure(iv.name, str(base_out), [made], made_by=made, method="qknorm", owner=owner)
        if params["vl"]:
            vlm_out = model_dir(study.out, p, iv.name, "vlm")
            vl = self.add(study.build.vl_adaptation(f"{p}/intervene/{iv.name}-vl", base_out, vlm_out, study.out, deps=(made,), owner=owner))
            self.adapted(f"{iv.name}-vl", vl, vlm_out, model_dir(study.out, p, iv.name, "vlm", "lm"), str(base_out),
                         extract_id=f"{p}/intervene/{iv.name}-vl-extract", method="qknorm+vl", owner=owner)


# Step builders of the `interventions:` entries, by `experiments.study.methods.kind`.
BUILDERS: dict[str, Callable[[PairPlan, Any], None]] = {POSTHOC: PairPlan.posthoc, INJECTION: PairPlan.injection}


def _needs_sink_maps(method: str) -> bool:
    from interventions.mitigations import list_mitigations

    m = list_mitigations().get(method)
    return bool(m and m.needs_sink_maps)


def plan_study(study) -> StudyPlan:
    """Every step of `study` in dependency order, checked (`experiments.study.graph.Plan`), and what each measures."""
    out = StudyPlan(study, Plan())
    if study.build is not None:
        out.plan.extend(study.build.steps(study.out, asdict(study.sink)))
    for pair in study.pairs:
        pp = PairPlan(study, out.plan, pair, study.build.makes(pair.name) if study.build is not None else [])
        if study.adapt is not None:
            protection.check_arms(pp)
        arms = protection.adapt_steps(pp) if study.adapt is not None else {}  # the control arm makes the pair's VLM
        pp.extract(vlm_deps=[arms[protection.CONTROL_ARM]] if arms else [])
        pp.measure("base", pair.base, pp.deps[:1])
        pp.measure("vlm", str(pp.lm_dir), [f"{pair.name}/extract"], made_by=f"{pair.name}/extract")
        for iv in study.interventions:
            BUILDERS[kind(iv.method)](pp, iv)
        if arms:
            protection.measure_arms(pp, arms)
        out.models[pair.name] = pp.models
    return out
