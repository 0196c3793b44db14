"""A study's adaptation arms (the `adapt:` section): the control and each protection through the same
VL adaptation on every pair's base, then the same measurements (docs/protect.md).

Steps per pair P and arm A (each keyed by the runner on everything that changes its output):
    P/adapt/A          `interventions.adapt.adapt` of the base with A's protections (same recipe, vision
                       spec, data order and seed for every arm); key: the run's request (base fingerprint,
                       recipe with data identities, vision, each protection's class, settings and source
                       hash, so editing a plug-in reruns exactly the arms that use it) + engine code
    P/adapt/A-extract  the arm's VLM's language model (vocabulary aligned to the base); not for the
                       control, whose VLM is the pair's VLM (the runner's own P/extract)
    P/vlskill/A        held-out digit accuracy of the arm's VLM (the VL skill it learnt)
then P/sink/A and P/eval/A as for every model. `protection_summary` adds, per arm, the paired
comparison against the control (Δ = arm − control in points, `evals.stats.compare`), the VL skill,
the Sink Strength trajectory during adaptation and what each protection reported.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sinkstudy.io import read_json

_HERE = Path(__file__).resolve().parent.parent


def arm_hooks(arm: dict) -> list:
    """The arm's protections, constructed from their settings."""
    from interventions.protect import make_protection

    return [make_protection(p["name"], p["params"]) for p in arm["protections"]]


def arm_request(study, pair: dict, arm: dict) -> tuple[Any, Any, list, dict]:
    """(vision spec, recipe, protection hooks, the run's request) of one arm on one pair."""
    from interventions.adapt.build import VisionSpec
    from interventions.adapt.config import from_dict
    from interventions.adapt.run import make_request

    adapt_cfg = study.adapt
    vision = VisionSpec(**adapt_cfg["vision"])
    recipe = from_dict(adapt_cfg["recipe"])
    hooks = arm_hooks(arm)
    return vision, recipe, hooks, make_request(pair["base"], vision, recipe, hooks=hooks)


def run_dir(study, pair: str, arm: str) -> Path:
    return Path(study.out) / "adapt" / pair / arm


def adapt_step(study, pair: dict, arm: dict, progress: bool) -> dict:
    from interventions.adapt import adapt
    from interventions.adapt.run import REQUEST
    from experiments.study import model_dir
    from sinkstudy.provenance import model_fingerprint

    vision, recipe, hooks, request = arm_request(study, pair, arm)
    out, vlm = run_dir(study, pair["name"], arm["name"]), model_dir(study.out, pair["name"], arm["name"], "vlm")
    # The study owns this run directory: another request there (edited protection, recipe) is replaced;
    # the same unfinished one continues from its last checkpoint.
    stale = (out / REQUEST).is_file() and read_json(out / REQUEST) != request
    report = adapt(pair["base"], vision=vision, config=recipe, out=out, model_dir=vlm, hooks=hooks, resume=True, force=stale,
                   progress=progress)
    return {"path": str(vlm), "fingerprint": model_fingerprint(vlm), "run": str(out), "summary": _adapt_summary(report)}


def _adapt_summary(report: dict) -> dict:
    return {
        "stages": [{k: s.get(k) for k in ("stage", "steps", "final_loss", "steps_per_second", "trainable_params", "hooks")}
                   for s in report["stages"]],
        "trajectory": [{k: p.get(k) for k in ("step", "stage", "sink_strength", "mean_sink_mass", "scores")}
                       for p in (report.get("trajectory") or {}).get("points") or []],
        "round_trip": report["build"].get("round_trip_max_abs_logit_diff"),
        "protections": [{"name": h["name"], "params": h["params"].get("config"), "source": h["source_sha256"]} for h in report["hooks"]],
    }


def vl_skill_step(study, vlm_dir: str) -> dict:
    """Held-out digit accuracy: the digit whose answer "It is a d." the VLM finds most likely."""
    from experiments.demo.vl import digit_accuracy

    probe = study.adapt["vl_eval"]
    return digit_accuracy(Path(vlm_dir), {"heldout_images": probe["heldout"], "seed": probe["seed"]})


def adapt_code_version() -> str:
    from sinkstudy.provenance import code_version

    return code_version(_HERE / "interventions" / "adapt", _HERE / "interventions" / "protect")


def run_arms(runner, study, pair: dict, deps: list[str]) -> dict[str, dict]:
    """Every arm's adaptation step on `pair`: {arm: its step result} (the control's VLM is the pair's VLM)."""
    from experiments.study import arms_of, model_dir

    made = {}
    for arm in arms_of(study, pair["name"]):
        *_, request = arm_request(study, pair, arm)
        spec = {"base": pair["base"], "request": request, "code": adapt_code_version(), "seed": request["config"]["seed"]}
        vlm = model_dir(runner.out, pair["name"], arm["name"], "vlm")
        made[arm["name"]] = runner.run(f"{pair['name']}/adapt/{arm['name']}", spec,
                                       lambda arm=arm: adapt_step(study, pair, arm, runner.progress), deps=deps, outputs=vlm)
    return made


def measure_arms(runner, study, pair: dict, made: dict[str, dict], measure) -> dict[str, dict]:
    """Extract, measure (sink + evals through `measure`) and probe the VL skill of every arm;
    {label: measured model} for the non-control arms, the control's VL skill under "vlm"."""
    from experiments.study import CONTROL_ARM, arms_of, model_dir
    from sinkstudy.provenance import code_version

    p = pair["name"]
    out: dict[str, dict] = {}
    for arm in arms_of(study, p):
        name, step = arm["name"], f"{p}/adapt/{arm['name']}"
        vlm = made[name]["path"]
        skill = None
        if study.adapt["vl_eval"] is not None:
            skill = runner.run(f"{p}/vlskill/{name}", {"probe": study.adapt["vl_eval"], "model": made[name]["fingerprint"],
                                                       "code": code_version(_HERE / "experiments" / "demo" / "vl.py")},
                               lambda vlm=vlm: vl_skill_step(study, vlm), deps=[step])
        info = {"arm": name, "adapt": made[name].get("summary"), "vl_skill": skill,
                "protections": [x["name"] for x in arm["protections"]]}
        if name == CONTROL_ARM:
            out["vlm"] = info
            continue
        lm = model_dir(runner.out, p, name, "vlm", "lm")
        own_class = any(hook.changes_architecture() for hook in arm_hooks(arm))

        def extract(vlm=vlm, lm=lm, own_class=own_class) -> dict:
            from interventions.adapt.build import save_extracted_lm
            from sinkstudy.provenance import model_fingerprint

            save_extracted_lm(vlm, pair["base"], lm, force=True, own_class=own_class)
            return {"path": str(lm), "fingerprint": model_fingerprint(lm)}

        extracted = runner.run(f"{p}/adapt/{name}-extract", {"code": code_version(_HERE / "interventions" / "pairs"), "own_class": own_class}, extract,
                               deps=[step], outputs=lm)
        out[name] = {**measure(runner, study, pair, name, str(lm), deps=[f"{p}/adapt/{name}-extract"],
                               fingerprint=runner.fingerprint(lm, extracted["fingerprint"])),
                     "method": "protection", "arm": info}
    return out


def protection_summary(study, pair: str, results: dict, runs: dict, kw: dict) -> dict[str, Any]:
    """Per arm (the control included): protections, VL skill, S after, trajectory, hook reports, and
    per task the comparison with the control (Δ = arm − control in points, paired bootstrap CI)."""
    from evals.stats import compare

    arms = {}
    for label, r in results.items():
        info = r.get("arm") if label != "vlm" else r.get("control_arm")
        if info is None:
            continue
        entry = {"label": label, "protections": info["protections"], "vl_skill": info["vl_skill"],
                 "sink_strength": r["sink"]["value"], "adapt": info["adapt"]}
        if label != "vlm":
            entry["vs_control"] = {t: compare(runs["vlm"], runs[label], t, **kw).as_dict() for t in study.evals["tasks"]}
        arms[info["arm"]] = entry
    return {"arms": arms, "convention": "vs_control: Δ = arm − control in points (score × 100; positive = the protection kept "
                                        "more text skill than the unprotected adaptation)"}
