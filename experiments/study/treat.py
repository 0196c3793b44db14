"""A pair's treatments as a plan, for `sinkstudy merge`, `mitigate` and `merge-sweep`: the VLM's language
model (extracted when a VLM is given), the measurements of the base and of the VLM LM (the references), then
per treatment its intervention (`interventions.registry`), its measurements and its VL-side proxies. The
steps are the study's own kinds (`experiments.study.pair_steps`), run by the same engine, so a merge made
by a command and the same merge in a study (or in another command's output) are one result.

Layout of OUT (`one=True`: a single treatment, `merge` / `mitigate`):
    vlm-lm/                       the VLM's language model, when a VLM is given
    reference/{base,vlm}/         sink.json (maps) and eval/ of the references
    model/, sink.json, eval/      the treatment (one=True), or points/<name>/... per treatment
    steps/                        the engine's records
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Mapping

from evals.proxies import caption_nll, read_captions, weight_distance
from experiments.report.treatments import measure_summary
from experiments.study.graph import Plan, Step
from experiments.study.kinds import Ref, StepArgs
from experiments.study.pair_steps import Extract, Intervene, Loading, Measurement, measure_steps
from experiments.study.runner import run_plan
from interventions.mitigations import list_mitigations
from interventions.outputs import is_vlm_checkpoint
from interventions.registry import takes_root
from sinkstudy.checkpoint import load_tokenizer
from sinkstudy.io import write_json_atomic
from sinkstudy.provenance import provenance

GROUP = "pair"


@dataclass(frozen=True)
class Treatment:
    """One intervention of a plan: its name (a path component), method, settings and how mergekit runs."""

    name: str
    method: str
    params: Mapping[str, Any] = field(default_factory=dict)
    mergekit: Mapping[str, bool] = field(default_factory=dict)


@dataclass(frozen=True)
class WeightDistance(StepArgs):
    """||W - W_vlm|| / ||W_base - W_vlm||: 0 at the VLM LM, 1 at the base."""

    kind: ClassVar[str] = "weight-distance"
    code: ClassVar[tuple[str, ...]] = ("evals.proxies",)
    model: Ref
    vlm: Ref
    base: Ref

    def run(self, ctx) -> dict:
        return {"weight_distance_to_vlm": weight_distance(self.model.local(), self.vlm.local(), self.base.local())}


@dataclass(frozen=True)
class CaptionNLL(StepArgs):
    """Mean per-token NLL of image captions as plain text (a VL-side proxy)."""

    kind: ClassVar[str] = "caption-nll"
    code: ClassVar[tuple[str, ...]] = ("evals.proxies",)
    model: Ref
    tokenizer: Ref
    captions: Ref
    loading: Loading = Loading()

    def run(self, ctx) -> dict:
        model, _ = self.loading.load(self.model.local())
        return {"caption_nll": caption_nll(model, load_tokenizer(self.tokenizer.local()), read_captions(self.captions.local()))}


@dataclass
class TreatPlan:
    """The plan, and which steps measure what: `refs[label]` and `points[name]` map a role ("sink", "eval",
    "intervene", "distance", "captions") to its step id."""

    plan: Plan
    vlm_lm: Path
    extracted: bool
    refs: dict[str, dict[str, str]]
    points: dict[str, dict[str, str]]
    models: dict[str, Path]


def treat_plan(base: str, vlm: str, treatments: list[Treatment], out: Path, m: Measurement, *, seed: int,
               tokenizer: str | None = None, root: str | None = None, captions: str | None = None, one: bool = False,
               measure: bool = True, keep_models: bool = True) -> TreatPlan:
    """Every step of treating the pair (base, vlm) with `treatments` under `out`, measured as `m` says (`measure`);
    `base`, `vlm`, `root` local checkpoints; `tokenizer` the prompts' (default the base's)."""
    plan, out = Plan(), Path(out)
    base_ref, tok = Ref(str(base)), Ref(str(tokenizer or base))
    extracted = is_vlm_checkpoint(vlm)
    if extracted:
        lm = out / "vlm-lm"
        plan.add(Step(f"{GROUP}/extract", Extract(base_ref, Ref(str(vlm)), None, out=lm), outputs=(lm,)))
        vlm_lm = Ref(str(lm), f"{GROUP}/extract")
    else:
        vlm_lm = Ref(str(vlm))
    caption_ref = Ref(str(captions)) if captions else None
    refs: dict[str, dict[str, str]] = {}
    if measure:
        for label, model in (("base", base_ref), ("vlm", vlm_lm)):
            refs[label] = _measure(plan, m, label, model, tok, out / "reference" / label, caption_ref)
    points = {}
    models = {}
    for t in treatments:
        where = out if one else out / "points" / t.name
        model_dir = where / "model"
        needs_maps = (measure and t.method in list_mitigations() and list_mitigations()[t.method].needs_sink_maps
                      and "texts" not in t.params)  # maps on other texts are the mitigation's own to compute
        maps = {label: Ref(str(out / "reference" / label / "sink.json"), refs[label]["sink"]) for label in ("base", "vlm")} if needs_maps else None
        params = {k: v for k, v in t.params.items() if k != "root"}
        root_path = t.params.get("root") or (root if takes_root(t.method) else None)
        step = plan.add(Step(f"{GROUP}/intervene/{t.name}",
                             Intervene(t.method, base_ref, vlm_lm, params, seed, root=Ref(str(root_path)) if root_path else None,
                                       sink_maps=maps, mergekit=t.mergekit, out=model_dir),
                             outputs=(model_dir,), transient=not keep_models, owner=f"treatment {t.name}")).id
        models[t.name] = model_dir
        points[t.name] = {"intervene": step}
        if measure:
            made = Ref(str(model_dir), step)
            points[t.name] |= _measure(plan, m, t.name, made, tok, where, caption_ref)
            points[t.name]["distance"] = plan.add(Step(f"{GROUP}/distance/{t.name}", WeightDistance(made, vlm_lm, base_ref))).id
    return TreatPlan(plan, Path(vlm_lm.path), extracted, refs, points, models)


def _measure(plan: Plan, m: Measurement, label: str, model: Ref, tok: Ref, where: Path, captions: Ref | None) -> dict[str, str]:
    sink, ev = measure_steps(m, GROUP, label, model, tok, where / "sink.json", where / "eval")
    steps = {"sink": plan.add(sink).id, "eval": plan.add(ev).id}
    if captions is not None:
        steps["captions"] = plan.add(Step(f"{GROUP}/captions/{label}", CaptionNLL(model, tok, captions, m.loading))).id
    return steps


def run_treatments(base: str, vlm: str, treatments: list[Treatment], out: Path, m: Measurement, *, seed: int, n_boot: int,
                   confidence: float, force: bool = False, progress: bool = True, before=None, on_done=None, say=print,
                   sharing: Mapping[str, Any] | None = None, **plan_kw) -> dict:
    """`treat_plan` run through the engine (every step reused when finished, here or, unless `sharing` says not to, in
    any run: `run_plan`'s share and store_root), then each treatment's `measure.json` written beside its model;
    {"plan", "engine", "measured": {name: summary}}."""
    tp = treat_plan(base, vlm, treatments, out, m, seed=seed, **plan_kw)
    engine = run_plan(tp.plan, out, force=force, progress=progress, seed=seed, say=say, guarded=("intervene",),
                      before=(lambda e: before(e, tp)) if before else None, on_done=on_done, **(sharing or {}))
    measured = {}
    if tp.refs and engine.main:
        for name, point in tp.points.items():
            summary = measure_summary(engine.results, tp.refs, point, m.protocol.tasks, n_boot=n_boot, confidence=confidence, seed=seed)
            where = out if plan_kw.get("one") else out / "points" / name
            write_json_atomic(where / "measure.json", {**summary, "provenance": provenance(seed=seed, tasks=list(m.protocol.tasks),
                                                                                       limit=m.protocol.limit)})
            measured[name] = summary
    return {"plan": tp, "engine": engine, "measured": measured}
