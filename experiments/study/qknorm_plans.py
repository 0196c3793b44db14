"""`sinkstudy qknorm` as plans of the study's step kinds, run by the same engine.

`recovery_plan`: QK-RMSNorm injected into BASE (or, a native QK-norm base with `native_ok`, kept as it is),
optionally recovery-trained on text, compared with the original on calibration texts (KL, Sink Strength)
and on the same eval prompts. Layout: OUT/model, OUT/evals/{original,candidate}, OUT/report.json, .txt.

`arms_plan`: the paper's negative result end to end: arms `control` (BASE), `injected-<init>` per init and
`native` (BASE itself when it has QK-norm, or another base with it), all through the SAME adaptation
(recipe, vision spec, data order, seed), then Sink Strength and strict evals of each arm's language model
against its own base and against the control. Layout: OUT/starts/<arm> (injected bases), OUT/arms/<arm>
(the adaptation runs), OUT/lms/<arm> (what is measured), OUT/sink, OUT/evals/<arm>, OUT/report.json, .md.

Convention: Δ = after − before in points (score × 100), e.g. Δ vs base = arm − original base; a negative Δ
is lost capability (the paper: IFEval 59.9 → 11 for injected Qwen2.5-3B, Δ ≈ −49).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from evals.eval_run import HEADLINE_METRICS, EvalRun
from evals.protocol import EvalProtocol
from evals.sink.calibration import DEFAULT_SET
from experiments.study.adapt_section import stage_recipe
from experiments.study.arms import Adapt
from experiments.study.graph import Plan, Step
from experiments.study.kinds import Ref
from experiments.study.pair_steps import ExtractAdapted, InjectQKNorm, Loading, MeasureEval, MeasureSink, texts_ref
from experiments.study.runner import run_plan
from interventions.adapt.config import VisionSpec
from interventions.pairs import archs
from interventions.pairs.resolve import load_config
from sinkstudy import SinkstudyError
from sinkstudy.io import write_json_atomic, write_text_atomic
from sinkstudy.provenance import model_fingerprint, provenance

GROUP = "qknorm"


def native(base: str, native_ok: bool) -> bool:
    """Whether `base` has QK-norm of its own, from its config alone (a weightless meta model); a base that can
    take no injection is refused in one line (a native one unless `native_ok`). A VLM is checked once extracted."""
    # lazy: loads torch, transformers, numpy
    import torch
    from transformers import AutoModelForCausalLM
    from interventions.qknorm import check_injectable, qk_norm_kind

    config = load_config(base)
    if archs.classify(config) != "causal_lm":
        return False
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    is_native = qk_norm_kind(skeleton) == "native"
    if not (native_ok and is_native):
        check_injectable(skeleton)
    return is_native


# --------------------------------------------------------------------------- injection and recovery training

@dataclass(frozen=True)
class Recovery:
    """What `recovery_plan` makes: the injection, and the two eval runs (None: no evals)."""

    plan: Plan
    inject: str
    evals: dict[str, str] | None


def recovery_plan(base: str, out: Path, args: InjectQKNorm, protocol: EvalProtocol | None, *, tokenizer: str | None = None,
                  before: list[Step] = ()) -> Recovery:
    """`args` (its base and output filled in here) then, with a `protocol`, the original's and the candidate's
    evals on the same prompts; `before`: steps that make what `args` reads (its training text)."""
    plan = Plan(before)
    model = out / "model"
    inject = plan.add(Step(f"{GROUP}/inject", dataclasses.replace(args, base=Ref(str(base)), out=model), outputs=(model,))).id
    evals = None
    if protocol is not None:
        tok = Ref(str(tokenizer or base))
        evals = {}
        for label, ref in (("original", Ref(str(base))), ("candidate", Ref(str(model), inject))):
            where = out / "evals" / label
            evals[label] = plan.add(Step(f"{GROUP}/eval/{label}", MeasureEval(ref, tok, protocol, args.seed, args.loading, out=where),
                                         outputs=(where,))).id
    return Recovery(plan, inject, evals)


def recovery_report(results: dict[str, dict], r: Recovery, args: InjectQKNorm, *, base: str, training_text: str) -> dict:
    """report.json of an injection: the KL and S at init and after training, the paired evals (Δ = candidate −
    original in points, bootstrap CI, McNemar)."""
    # lazy: loads numpy
    from evals.stats import compare_runs

    made = results[r.inject]
    report = made["report"]
    evals = None
    if r.evals:
        runs = {label: EvalRun.load(results[step]["dir"]) for label, step in r.evals.items()}
        tasks = list(runs["original"].tasks)
        evals = {"scores": {label: run.scores for label, run in runs.items()},
                 "paired": [c.as_dict() for c in compare_runs(runs["original"], runs["candidate"], tasks, seed=args.seed)]}
    is_native = args.init is None
    return {"base": base, "arm": "native" if is_native else "injected", "init": args.init,
            "alpha": args.alpha if args.init == "blend" else None, "checkpoint_format": made["checkpoint_format"],
            "at_init": report["init"],
            "training": {**report["training"], "trainable": args.trainable, "train_texts": training_text} if "training" in report else None,
            "after_training": report.get("after_training"), "evals": evals}


# --------------------------------------------------------------------------- arms through one adaptation

@dataclass(frozen=True)
class Arms:
    """What `arms_plan` makes: per arm its steps by role ("start", "adapt", "extract", "sink_start", "sink", "eval"),
    and per own base its eval step."""

    plan: Plan
    arms: dict[str, dict[str, Any]]
    own_bases: dict[str, str]


def arms_plan(base: str, inits: list[str], native_base: str | None, native_ok: bool, out: Path, *, recipe: dict,
              vision: dict | None, protocol: EvalProtocol, calibration, alpha: float, seed: int,
              loading: Loading = Loading()) -> Arms:
    """Every arm's steps: the injected starts, the adaptations (one recipe and vision spec), the language models,
    their S before and after, their evals and their own bases' evals."""
    texts = texts_ref(calibration)
    if native(base, native_ok):
        arms = [("native", base, None)]
    else:
        arms = [("control", base, None)] + [(f"injected-{i}", None, i) for i in inits]
    if native_base:
        if not native(native_base, True):
            raise SinkstudyError(f"--native {native_base}: this model has no native QK-norm")
        if any(name == "native" for name, _, _ in arms):
            raise SinkstudyError("--native: the base itself is the native arm")
        arms.append(("native", native_base, None))
    plan, steps, own_bases = Plan(), {}, {}
    for name, start, init in arms:
        s: dict[str, Any] = {"inject": init, "own_base": start if init is None else base}
        if init is not None:
            where = out / "starts" / name
            s["start"] = plan.add(Step(f"{GROUP}/inject/{name}", InjectQKNorm(Ref(str(base)), init, alpha, texts, DEFAULT_SET,
                                                                                 seed=seed, loading=loading, out=where),
                                       outputs=(where,))).id
            start_ref = Ref(str(where), s["start"])
        else:
            start_ref = Ref(str(start))
        s["start_path"] = start_ref.path
        run, vlm, lm = out / "arms" / name, out / "arms" / name / "model", out / "lms" / name
        s["adapt"] = plan.add(Step(f"{GROUP}/adapt/{name}", Adapt(start_ref, recipe, vision, run_dir=run, model_dir=vlm),
                                   outputs=(run,))).id  # the run: its report and trajectory, the model inside it
        s["extract"] = plan.add(Step(f"{GROUP}/extract/{name}", ExtractAdapted(Ref(str(vlm), s["adapt"]), start_ref, out=lm),
                                     outputs=(lm,))).id
        lm_ref = Ref(str(lm), s["extract"])
        for role, model, label in (("sink_start", start_ref, f"{name}-start"), ("sink", lm_ref, name)):
            f = out / "sink" / f"{label}.json"
            s[role] = plan.add(Step(f"{GROUP}/sink/{label}", MeasureSink(model, start_ref, texts=texts, loading=loading, out=f),
                                    outputs=(f,))).id
        where = out / "evals" / name
        s["eval"] = plan.add(Step(f"{GROUP}/eval/{name}", MeasureEval(lm_ref, start_ref, protocol, seed, loading, out=where), outputs=(where,))).id
        s["run"], s["lm"] = str(run), str(lm)
        steps[name] = s
    for name, s in steps.items():
        own = s["own_base"]
        if own not in own_bases:
            label = "base" if own == base else f"{name}-base"
            where = out / "evals" / label
            own_bases[own] = plan.add(Step(f"{GROUP}/eval/{label}", MeasureEval(Ref(str(own)), Ref(str(own)), protocol, seed, loading,
                                                                                out=where),
                                           outputs=(where,))).id
    return Arms(plan, steps, own_bases)


def arms_report(results: dict[str, dict], a: Arms, *, base: str, recipe_file: str | None, recipe: dict, vision: dict | None,
                protocol: EvalProtocol, seed: int) -> dict:
    """report.json of the arms: per arm its S before and after adaptation, its stages, and per task Δ vs its own
    base and vs the control (points, paired bootstrap CI, McNemar)."""
    # lazy: loads numpy
    from evals.stats import compare

    runs = {name: EvalRun.load(results[s["eval"]]["dir"]) for name, s in a.arms.items()}
    own = {b: EvalRun.load(results[step]["dir"]) for b, step in a.own_bases.items()}
    tasks = list(protocol.tasks)
    reference = "control" if "control" in a.arms else None
    rows = {}
    for name, s in a.arms.items():
        per_task = {}
        for task in tasks:
            metric = HEADLINE_METRICS.get(task)
            entry = {"vs_own_base": _comparison(compare(own[s["own_base"]], runs[name], task, metric, seed=seed))}
            if reference and name != reference:
                entry["vs_control"] = _comparison(compare(runs[reference], runs[name], task, metric, seed=seed))
            per_task[task] = entry
        adapted = results[s["adapt"]]
        rows[name] = {"start": s["start_path"], "inject": s["inject"], "model": adapted["path"], "lm": s["lm"],
                      "sink_strength_start": results[s["sink_start"]]["value"], "sink_strength_after": results[s["sink"]]["value"],
                      "stages": [{k: st.get(k) for k in ("stage", "steps", "final_loss", "steps_per_second")}
                                 for st in adapted["summary"]["stages"]],
                      "round_trip": adapted["summary"]["round_trip"], "fingerprint": results[s["extract"]]["fingerprint"],
                      "own_base": s["own_base"], "tasks": per_task}
    stages = [{"stage": st["name"], "steps": st["steps"], "epochs": st.get("epochs"), "lr": st["lr"], "schedule": st.get("schedule"),
               "trainable": st.get("trainable"), "batch_size": st.get("batch_size"), "data": [str(d) for d in st["data"]]}
              for st in recipe["stages"]]
    return {"base": base, "arms": rows, "tasks": tasks, "recipe": {"file": recipe_file, "seed": recipe["seed"], "stages": stages},
            "vision": vision, "limit": protocol.limit, "eval": protocol.as_dict(),
            "convention": "Δ = arm − reference in points (score × 100); negative = lost capability; reference = the arm's "
                          "own base before adaptation (BASE for control and injected arms, the native model for `native`) "
                          "or the control arm; 95% paired bootstrap CI over prompts; McNemar exact p on discordant prompts",
            "paper": "QK-RMSNorm injected into Qwen2.5-3B-Instruct, then the LLaVA two-stage recipe: IFEval 59.9 → 11 (Δ ≈ −49)"}


def _comparison(c) -> dict:
    """A Comparison as Δ = other − reference in points (evals.stats' convention), with its CI."""
    return {"reference": 100 * c.before, "score": 100 * c.after, "delta": c.delta_points,
            "ci": list(c.delta_points_ci), "mcnemar_p": c.mcnemar_p, "n": c.n, "metric": c.metric}


def trajectories(a: Arms) -> dict[str, list[dict]]:
    """Each arm's Sink Strength during its adaptation (the run's trajectory.json), where it was recorded."""
    # lazy: loads torch, transformers, scipy
    from interventions.adapt.trajectory import read_points

    found = {name: read_points(Path(s["run"]) / "trajectory.json") for name, s in a.arms.items()}
    return {name: points for name, points in found.items() if points}


def recovery_text(steps: int, train_texts: str | None, default: Callable[[], Step]) -> tuple[list[Step], Ref | None]:
    """(the steps that make the recovery text, its Ref): `train_texts`, else what the step `default()` writes (its one
    output); none without recovery steps."""
    if not steps:
        return [], None
    if train_texts:
        return [], Ref(str(train_texts))
    step = default()
    return [step], Ref(str(step.outputs[0]), step.id)


def arms_recipe(recipe: dict, data: dict[str, list], steps: dict[str, int], vision: VisionSpec | None) -> tuple[dict, dict]:
    """(vision, recipe) of the arms as dicts: `recipe` (an AdaptConfig as a dict) with a command's per-stage data and
    steps (`experiments.study.adapt_section.stage_recipe`), the stages given no data on the digits; the vision side
    `vision`, else a tiny tower."""
    recipe = stage_recipe(recipe, {**{s["name"]: ["digits"] for s in recipe["stages"] if not s.get("data")}, **data}, steps)
    return (vision or VisionSpec("tiny", seed=recipe["seed"])).to_dict(), recipe


def run_recovery(base: str, out: Path, args: InjectQKNorm, protocol: EvalProtocol | None, *, training_text: str, force: bool = False,
                 progress: bool = True, sharing: Mapping[str, Any] | None = None, **plan_kw) -> dict:
    """`recovery_plan` run through the engine (`sharing`: `run_plan`'s share and store_root); report.json and report.txt
    written in `out`."""
    # lazy: loads numpy
    from experiments.report.qknorm_tables import format_injection

    r = recovery_plan(base, out, args, protocol, **plan_kw)
    engine = run_plan(r.plan, out, force=force, progress=progress, seed=args.seed, guarded=("inject",), **(sharing or {}))
    report = recovery_report(engine.results, r, args, base=base, training_text=training_text)
    texts = args.texts.path if isinstance(args.texts, Ref) else args.texts or DEFAULT_SET
    report["provenance"] = provenance(seeds={"seed": args.seed}, calibration=texts,
                                      model_fingerprints={"original": model_fingerprint(base), report["arm"]: engine.results[r.inject]["fingerprint"]})
    write_json_atomic(out / "report.json", report)
    write_text_atomic(out / "report.txt", format_injection(report) + "\n")
    return report


def run_arms(base: str, inits: list[str], native_base: str | None, native_ok: bool, out: Path, *, recipe_file: str | None,
             force: bool = False, progress: bool = True, sharing: Mapping[str, Any] | None = None, **plan_kw) -> dict:
    """`arms_plan` run through the engine (`sharing`: `run_plan`'s share and store_root); report.json, report.md and the
    S trajectories (trajectory.png) in `out`."""
    # lazy: loads torch, numpy
    from experiments.report.qknorm_tables import format_arms
    from interventions.adapt.trajectory_plot import plot_trajectories

    a = arms_plan(base, inits, native_base, native_ok, out, **plan_kw)
    engine = run_plan(a.plan, out, force=force, progress=progress, seed=plan_kw["seed"], guarded=("inject", "adapt"), **(sharing or {}))
    report = arms_report(engine.results, a, base=base, recipe_file=recipe_file, recipe=plan_kw["recipe"], vision=plan_kw["vision"],
                         protocol=plan_kw["protocol"], seed=plan_kw["seed"])
    report["provenance"] = provenance(model_fingerprints={"base": model_fingerprint(base), **{n: r["fingerprint"] for n, r in report["arms"].items()}},
                                      seeds={"seed": plan_kw["seed"], "adapt": plan_kw["recipe"]["seed"]})
    found = trajectories(a)
    if found:
        plot_trajectories(found, out / "trajectory.png", title=f"Sink Strength during adaptation: {Path(base).name}")
        report["trajectory_plot"] = str(out / "trajectory.png")
    write_json_atomic(out / "report.json", report)
    write_text_atomic(out / "report.md", format_arms(report) + "\n")
    return report
