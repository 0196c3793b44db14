"""The QK-norm arm end to end: control / injected / native through the same VL adaptation, then
Sink Strength and strict evals of each arm's language model, side by side with paired CIs.

Layout of OUT:
    arms/<arm>/           the arm's adaptation run (interventions.adapt: request, report, trajectory, model/)
    starts/<arm>/         injected arms: the injected base the adaptation starts from
    lms/<arm>/            the arm's extracted language model (what is measured)
    evals/<arm>/, evals/base/   lm-eval runs (per-prompt samples for the paired statistics)
    report.json, report.md, trajectory.png
Every arm uses the same recipe, vision spec (tower and projector seeded alike), data order and seed;
each adaptation run is resumable and reused when finished (`--resume`).

Convention: Δ = after − before in points (score × 100), e.g. Δ vs base = arm − original base; a
negative Δ is lost capability (the paper: IFEval 59.9 → 11 for injected Qwen2.5-3B, Δ ≈ −49).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from experiments.report.fmt import ci_text, num
from sinkstudy import SinkstudyError
from sinkstudy.provenance import describe_hardware


def plan_arms(base: str, inits: list[str], native: str | None, native_ok: bool) -> list[dict]:
    """[{"name", "start" (path), "inject" (init or None)}] from the base's config (no weights read)."""
    import torch
    from transformers import AutoModelForCausalLM

    from interventions.pairs.resolve import load_config
    from interventions.qknorm import check_injectable, qk_norm_kind

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(load_config(base))
    if qk_norm_kind(skeleton) == "native":
        if not native_ok:
            check_injectable(skeleton)  # the one-line refusal, naming --native-ok
        arms = [{"name": "native", "start": base, "inject": None}]
    else:
        check_injectable(skeleton)
        arms = [{"name": "control", "start": base, "inject": None}]
        arms += [{"name": f"injected-{i}", "start": None, "inject": i} for i in inits]
    if native:
        with torch.device("meta"):
            other = AutoModelForCausalLM.from_config(load_config(native))
        if qk_norm_kind(other) != "native":
            raise SinkstudyError(f"--native {native}: this model has no native QK-norm")
        if any(a["name"] == "native" for a in arms):
            raise SinkstudyError("--native: the base itself is the native arm")
        arms.append({"name": "native", "start": native, "inject": None})
    return arms


def recipe(args):
    """(VisionSpec, AdaptConfig) for the arms; stages without data get the digits."""
    from experiments.cli.cmd_adapt import parse_stage_values
    from interventions.adapt import VisionSpec, load_config

    config = load_config(args.adapt)
    names = [s.name for s in config.stages]
    for stage, specs in parse_stage_values(args.data, names, "data").items():
        config.stage(stage).data = list(specs)
    for stage, steps in parse_stage_values(getattr(args, "train_steps", None) or [], names, "train-steps").items():
        config.stage(stage).steps = int(steps[-1])  # checked by the command (experiments.cli.cmd_qknorm.recovery_steps)
    for stage in config.stages:
        stage.data = stage.data or ["digits"]
    if args.vision:
        vision = VisionSpec("fresh", args.vision, seed=config.seed)
    elif args.donor:
        vision = VisionSpec("donor", args.donor, seed=config.seed)
    else:
        vision = VisionSpec("tiny", seed=config.seed)
    return vision, config


def run_arms(args) -> dict[str, Any]:
    """Adapt every arm, extract and measure its LM, compare; writes report.json / report.md."""
    from evals.lmeval import run_eval
    from evals.sink.calibration import resolve_texts
    from experiments.cli.cmd_eval import eval_kwargs
    from experiments.study.loaders import load_model
    from interventions.adapt import adapt
    from interventions.adapt.build import save_extracted_lm
    from interventions.adapt.trajectory import plot_trajectories, read_points
    from interventions.pairs import load_causal_lm
    from sinkstudy.io import write_json_atomic, write_text_atomic
    from sinkstudy.provenance import model_fingerprint, provenance

    out = Path(args.out)
    vision, config = recipe(args)
    inits = [i.strip() for i in args.init.split(",") if i.strip()]
    arms = plan_arms(args.base, inits, args.native, args.native_ok)
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    calibration = [t.text for t in resolve_texts(args.calibration, "ifeval15")[0]]
    if args.force and out.exists():
        shutil.rmtree(out)
    protocol = {**eval_kwargs(args), "dtype": args.dtype, "device": args.device}  # `sinkstudy eval`'s flags, recorded
    eval_kw = dict(tasks=tasks, seed=args.seed, force=True, progress=not getattr(args, "quiet", False), loader=load_model,
                   **protocol)
    results: dict[str, dict] = {}
    for arm in arms:
        name = arm["name"]
        start = arm["start"] or str(_injected_start(args.base, arm["inject"], args.alpha, calibration, out / "starts" / name))
        run = adapt(start, vision=vision, config=config, out=out / "arms" / name, resume=True, progress=True)
        lm_dir = out / "lms" / name
        if not (lm_dir / "config.json").is_file():
            save_extracted_lm(run["model"], start, lm_dir, force=True)
        before, tok = load_causal_lm(start)
        after, _ = load_causal_lm(lm_dir)
        results[name] = {
            "start": start, "inject": arm["inject"], "model": run["model"], "lm": str(lm_dir),
            "sink_strength_start": _sink(before, tok, calibration), "sink_strength_after": _sink(after, tok, calibration),
            "stages": [{k: s.get(k) for k in ("stage", "steps", "final_loss", "steps_per_second")} for s in run["stages"]],
            "round_trip": run["build"].get("round_trip_max_abs_logit_diff"),
            "eval": run_eval(str(lm_dir), tok, out_dir=out / "evals" / name, **eval_kw),
            "trajectory": read_points(out / "arms" / name / "trajectory.json"),
            "fingerprint": model_fingerprint(lm_dir),
        }
    base_runs = {}  # each arm's own base: BASE (control, injected) or the native model
    for arm in arms:
        own = arm["start"] if arm["inject"] is None else args.base
        if own not in base_runs:
            label = "base" if own == args.base else f"{arm['name']}-base"
            base_runs[own] = run_eval(own, None, out_dir=out / "evals" / label, **eval_kw)
        results[arm["name"]]["own_base"] = own
        results[arm["name"]]["own_base_eval"] = base_runs[own]
    report = _report(args, arms, results, tasks, config, vision) | {"eval": protocol}
    report["provenance"] = provenance(model_fingerprints={"base": model_fingerprint(args.base),
                                                          **{a: r["fingerprint"] for a, r in results.items()}},
                                      seeds={"seed": args.seed, "adapt": config.seed})
    trajectories = {a: r["trajectory"] for a, r in results.items() if r["trajectory"]}
    if trajectories:
        plot_trajectories(trajectories, out / "trajectory.png", title=f"Sink Strength during adaptation: {Path(args.base).name}")
        report["trajectory_plot"] = str(out / "trajectory.png")
    write_json_atomic(out / "report.json", report)
    write_text_atomic(out / "report.md", format_arms(report) + "\n")
    return report


def _injected_start(base: str, init: str, alpha: float, calibration: list[str], out: Path) -> Path:
    from interventions.pairs import load_causal_lm
    from interventions.qknorm import inject_qk_norm, save_injected

    if (out / "config.json").is_file():
        return out
    model, tok = load_causal_lm(base)
    inject_qk_norm(model, init=init, calibration_texts=calibration, tokenizer=tok, alpha=alpha, progress=False)
    return save_injected(model, out, tokenizer=tok, metadata={"init": init, "base": base}, force=True)


def _sink(model, tok, texts) -> float:
    from evals.sink import sink_strength

    return float(sink_strength(model, tok, texts=texts, progress=False).value)


def _comparison(c) -> dict:
    """A Comparison as Δ = other − reference in points (evals.stats' convention), with its CI."""
    return {"reference": 100 * c.before, "score": 100 * c.after, "delta": c.delta_points,
            "ci": list(c.delta_points_ci), "mcnemar_p": c.mcnemar_p, "n": c.n, "metric": c.metric}


def _report(args, arms, results, tasks, config, vision) -> dict:
    from evals.lmeval import HEADLINE_METRICS
    from evals.stats import compare

    reference = "control" if "control" in results else None
    rows = {}
    for name, r in results.items():
        per_task = {}
        for task in tasks:
            metric = HEADLINE_METRICS.get(task)
            entry = {"vs_own_base": _comparison(compare(r["own_base_eval"], r["eval"], task, metric, seed=args.seed))}
            if reference and name != reference:
                entry["vs_control"] = _comparison(compare(results[reference]["eval"], r["eval"], task, metric, seed=args.seed))
            per_task[task] = entry
        rows[name] = {k: v for k, v in r.items() if k not in ("eval", "own_base_eval", "trajectory")} | {"tasks": per_task}
    stages = [{"stage": s.name, "steps": s.steps, "epochs": s.epochs, "lr": s.lr, "schedule": s.schedule,
               "trainable": s.trainable, "batch_size": s.batch_size, "data": [str(d) for d in s.data]} for s in config.stages]
    return {"base": args.base, "arms": rows, "tasks": tasks, "recipe": {"file": args.adapt, "seed": config.seed, "stages": stages},
            "vision": vision.to_dict(), "limit": args.limit,
            "convention": "Δ = arm − reference in points (score × 100); negative = lost capability; reference = the arm's "
                          "own base before adaptation (BASE for control and injected arms, the native model for `native`) "
                          "or the control arm; 95% paired bootstrap CI over prompts; McNemar exact p on discordant prompts",
            "paper": "QK-RMSNorm injected into Qwen2.5-3B-Instruct, then the LLaVA two-stage recipe: IFEval 59.9 → 11 (Δ ≈ −49)"}


def format_arms(report: dict) -> str:
    tasks = report["tasks"]
    head = f"{'arm':<28} {'S start':>8} {'S after':>8}" + "".join(
        f" {t[:18] + ' (pts)':>25} {'own base':>9} {'Δ vs own base [95% CI]':>27} {'Δ vs control [95% CI]':>27}" for t in tasks)
    lines = [f"QK-norm arms on {report['base']} through the same adaptation",
             f"computed on: {describe_hardware((report.get('provenance') or {}).get('hardware'))}", report["convention"], "", head,
             "-" * len(head)]
    for name, r in report["arms"].items():
        cells = ""
        for t in tasks:
            e = r["tasks"][t]
            vb, vc = e["vs_own_base"], e.get("vs_control")
            cells += f" {vb['score']:>25.1f} {vb['reference']:>9.1f} {_delta(vb):>27} {(_delta(vc) if vc else '-'):>27}"
        lines.append(f"{name:<28} {r['sink_strength_start']:>8.3f} {r['sink_strength_after']:>8.3f}{cells}")
    lines += ["", "S: Sink Strength of the arm's LM before (start: after any injection) and after adaptation, "
              "on the calibration prompts", f"paper: {report['paper']}"]
    return "\n".join(lines)


def _delta(d: dict) -> str:
    """Δ with its CI, signed, in points."""
    return f"{num(d['delta'], '+.1f')} {ci_text(d['ci'], '+.1f', '[n/a]')}"
