"""A whole adaptation run: (inject QK-norm) -> build the VLM -> stages -> save, resumable.

Layout of a run directory OUT:
    request.json        what was asked (base, vision, recipe, data, hooks with their source hashes): only
                        a run of this same request continues in OUT (another is refused: it is not this
                        writer's to replace; the engine running `experiments.study.arms.Adapt` decides that)
    work/<stage>/       the Trainer's checkpoints (resume points) and, once the stage is done,
                        final.safetensors + done.json; removed at the end unless keep_checkpoints
    trajectory.json/.png  Sink Strength (and scores) during training, when asked
    adapt.json          the report: build, round trip, per-stage statistics, provenance
    model/              the result (or `model_dir`): an ordinary HF checkpoint + processor, written
                        atomically at the end; a text-only run writes a causal-LM checkpoint
    snapshots/<stage>-<step>/  the model after that step of a stage with `save_models_at`, saved like model/
A killed run continues with `resume=True` from the newest checkpoint of the unfinished stage and
ends with the weights an uninterrupted run would have (its finished stages are loaded, not trained again).
Whether a finished run is reused is decided by the engine that runs it as a step, never here.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any, Sequence

import torch
from safetensors.torch import load_model, save_model

from evals.sink import compute_sink_maps
from evals.sink.calibration import DEFAULT_SET, resolve_texts
from interventions import qknorm as qk
from interventions.adapt import encoding, sources, stagecache
from interventions.adapt.build import DONOR_TYPES, build_vlm, check_round_trip, load_processor, tower_config
from interventions.adapt.code import RUN as RUN_CODE
from interventions.adapt.config import AdaptConfig, VisionSpec
from interventions.adapt.hooks import TrainingHook
from interventions.adapt.sources import check_spec, spec_identity
from interventions.adapt.trajectory_plot import plot_trajectories
from interventions.pairs import load_causal_lm, save_causal_lm
from interventions.pairs.resolve import load_config
from interventions.qknorm import inject_qk_norm
from sinkstudy import SinkstudyError
from sinkstudy.io import OutputExistsError, read_json, write_json_atomic
from sinkstudy.plugins import source_hash
from sinkstudy.provenance import model_fingerprint, module_code_version, provenance

log = logging.getLogger(__name__)
REQUEST, REPORT, TRAJECTORY = "request.json", "adapt.json", "trajectory.json"


def hook_identity(hook: TrainingHook) -> dict:
    """A hook's name, class, parameters and the hash of its source files (`sinkstudy.plugins.source_hash`
    of `hook.sources()`): part of the request, so editing a hook (a plug-in file) reruns the run."""
    params = hook.identity_params()
    return {"name": hook.name, "class": f"{type(hook).__module__}.{type(hook).__qualname__}",
            "source_sha256": source_hash(*hook.sources()), "params": json.loads(json.dumps(params, default=str))}


def make_request(base, vision: VisionSpec | None, config: AdaptConfig, *, hooks: Sequence[TrainingHook] = (),
                 qknorm: dict | None = None) -> dict:
    cfg = config.to_dict()
    for stage in cfg["stages"]:
        stage["data"] = [spec_identity(s) for s in stage["data"]]
    return json.loads(json.dumps({
        "base": os.fspath(base) if isinstance(base, (str, os.PathLike)) else getattr(base.config, "_name_or_path", "<in memory>"),
        "base_fingerprint": model_fingerprint(base),
        "vision": vision.to_dict() if vision else None,
        "qknorm": qknorm,
        "config": cfg,
        "hooks": [hook_identity(h) for h in hooks],
        # The engine, the sink probe its trajectory runs, the visual world its generated data draws and the
        # generation its self-distilled data runs (`interventions.adapt.code.RUN`): a run from other code is another.
        "code": module_code_version(*RUN_CODE),
    }, default=str))


def check_run_dir(out: Path, request: dict, *, resume: bool) -> str:
    """'new' (nothing in `out`) or 'resume' (an earlier run of `request` in `out`, with `resume`); anything else in
    `out` is refused in one line: this writer never replaces what it was not asked to continue."""
    if not out.exists() or not any(out.iterdir()):
        return "new"
    if not (out / REQUEST).is_file() or read_json(out / REQUEST) != request:
        raise OutputExistsError(f"output {out} already exists and holds no run of this request; choose another out or remove it")
    if not resume:
        raise SinkstudyError(f"output {out} holds a run of the same request; pass --resume to continue it (or --force to start over)")
    return "resume"


def check_inputs(base, vision: VisionSpec | None, config: AdaptConfig, hooks: Sequence[TrainingHook] = ()) -> None:
    """Every input a run reads, checked from configs and file existence (before any work)."""
    names = [s.name for s in config.stages]
    for hook in hooks:
        unknown = [s for s in hook.stages or () if s not in names]
        if unknown:
            raise SinkstudyError(f"hook {hook.name} acts in stage(s) {', '.join(unknown)}, which the recipe does not have; "
                                 f"stages: {', '.join(names)}")
    for stage in config.stages:
        if not stage.data:
            raise SinkstudyError(f"stage {stage.name}: no data; give e.g. --data {stage.name}=digits")
        for spec in stage.data:
            check_spec(spec)
        vision_groups = sorted({"projector", "tower"} & set(stage.trainable))
        if vision is None and vision_groups:
            raise SinkstudyError(f"stage {stage.name} trains {', '.join(vision_groups)}, but a text-only run has no vision side")
    base_config = load_config(base) if isinstance(base, (str, os.PathLike)) else base.config
    for hook in hooks:
        hook.check_base(base_config)
    if vision is not None and vision.kind == "fresh":
        tower_config(vision)
    if vision is not None and vision.kind == "donor" and load_config(vision.source).model_type not in DONOR_TYPES:
        raise SinkstudyError(f"--donor {vision.source}: {load_config(vision.source).model_type!r} is not a supported donor; "
                             f"supported: {', '.join(DONOR_TYPES)}")
    if vision is not None and vision.kind in ("fresh", "donor"):
        load_processor(vision)  # configs and tokenizer files only; e.g. a Qwen-VL processor without torchvision


def adapt(
    base,
    *,
    config: AdaptConfig,
    out: str | os.PathLike,
    vision: VisionSpec | None = None,
    tokenizer=None,
    model_dir: str | os.PathLike | None = None,
    hooks: Sequence[TrainingHook] = (),
    qknorm: dict | None = None,
    resume: bool = False,
    progress: bool = True,
    callbacks: Sequence = (),
    device: str | None = None,
    stage_cache: str | os.PathLike | None = None,
) -> dict:
    """Run every stage of `config` on `base` (a path, hub id or loaded causal LM); returns the report.

    `vision` None trains the causal LM itself on text (the Tülu-style contrast, recovery training).
    `qknorm` ({"init": ..., "alpha": ...}) injects QK-RMSNorm into the base first (calibrated on the
    trajectory's calibration texts). `hooks`: protection plug-ins (interventions.adapt.hooks), part of
    the run's identity. `callbacks`: extra `TrainerCallback`s that only observe (not part of it).
    `device`: "cpu" or "cuda" (default: the GPU when there is one); how it runs, not part of the identity.
    `stage_cache`: a folder of finished stages shared between runs (`interventions.adapt.stagecache`; a study's
    arms share `stagecache.default_root()`): a stage whose key is there is loaded instead of trained (single-process
    runs only).
    """
    out = Path(out)
    model_dir = Path(model_dir) if model_dir else out / "model"
    # lazy: loads transformers, datasets, scipy
    from interventions.adapt.trainer import check_device

    check_inputs(base, vision, config, hooks)
    check_device(device)
    request = make_request(base, vision, config, hooks=hooks, qknorm=qknorm)
    main = _is_main()
    try:
        # Under a multi-process launch rank 0 decides (and writes); the others may already see its request.
        status = check_run_dir(out, request, resume=resume or not main)
    except SinkstudyError:
        if main:
            raise
        status = "resume"  # rank 0 refuses and exits; the launcher stops the others
    if main and status == "new":
        write_json_atomic(out / REQUEST, request)
    fresh = status == "new"  # nothing of an earlier run may be reused (also by other ranks)
    shared = Path(stage_cache) if stage_cache is not None and int(os.environ.get("WORLD_SIZE", "1")) == 1 else None
    return _run(base, tokenizer, vision, config, out, model_dir, hooks, qknorm, progress, main, list(callbacks), fresh, device,
                (shared, request))


def _run(base, tokenizer, vision, config, out, model_dir, hooks, qknorm, progress, main, extra_callbacks, fresh, device,
         shared) -> dict:
    # lazy: loads transformers, datasets, scipy
    from interventions.adapt.trainer import train_stage
    from interventions.adapt.trajectory import SinkProbe, TrajectoryCallback, read_points

    torch.manual_seed(config.seed)
    lm, tok = load_causal_lm(base, tokenizer=tokenizer)
    tok = tokenizer or tok
    if tok is None:
        raise SinkstudyError(f"no tokenizer found for {base}; pass one")
    if qknorm:
        lm = _inject(lm, tok, qknorm, config)
    probe = SinkProbe(tok, config.trajectory, seed=config.seed)
    for hook in hooks:  # architecture changes of the base (the QK-norm sufficiency switch), in list order
        lm = hook.prepare_base(lm, tok, probe.texts) or lm
    sink_maps = _base_sink_maps(lm, tok, probe) if any(h.needs_sink_maps for h in hooks) else None
    if vision is not None:
        built = build_vlm(lm, tok, vision)
        model, processor, tok = built.model, built.processor, built.tokenizer
        round_trip = check_round_trip(model, lm, tok)
        build_report = {**built.report, "round_trip_max_abs_logit_diff": round_trip}
        encoder_args = {"processor": processor, "image_token": built.image_token, "image_wrap": built.image_wrap}
    else:
        model, processor, build_report, encoder_args = lm, None, {"kind": "text-only"}, {}
    model.config.use_cache = False
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id

    offset, stages = 0, []
    traj_path = out / TRAJECTORY
    cache, request = shared
    for k, stage in enumerate(config.stages):
        work = out / "work" / stage.name
        records = [sources.load_records(spec, seed=config.seed, base=base) for spec in stage.data]
        encoder = encoding.Encoder(tok, max_length=config.max_length, loss_on=stage.loss_on, **encoder_args)
        dataset = encoding.EncodedDataset(records, encoder)
        key = stagecache.stage_key(request, hooks, k) if cache else None
        finished = not fresh and (work / "done.json").is_file()
        entry = stagecache.lookup(cache, key) if key and not finished else None
        if entry is not None:  # the same stage, finished by another run: taken as this run's own (its resume path)
            log.info("stage %s: reusing %s", stage.name, entry)
            _, cached_points = stagecache.restore(entry, work)
            known = {p["step"] for p in read_points(traj_path)}
            for point in cached_points:
                if point["step"] not in known:
                    _add_point(traj_path, probe, point)
            finished = True
        if finished:
            load_model(model, str(work / "final.safetensors"))
            stats = read_json(work / "done.json")
        else:
            callbacks = [TrajectoryCallback(probe, traj_path, stage=stage.name, offset=offset, every=config.trajectory.every)] if main else []
            callbacks += extra_callbacks
            stats = train_stage(model, stage, config, dataset, collate_fn=lambda f: encoding.collate(f, pad_id), work_dir=work,
                                tokenizer=tok, hooks=hooks, callbacks=callbacks, sink_maps=sink_maps,
                                calibration=probe.texts if sink_maps is not None else None, resume=not fresh, base=base,
                                progress=progress and main, desc=f"adapt {stage.name}", device=device)
            if main:
                save_model(model, str(work / "final.safetensors"))
                write_json_atomic(work / "done.json", {**stats, "records": len(dataset)})
                if key:
                    names = {s.name for s in config.stages[: k + 1]}
                    stagecache.store(cache, key, work, [p for p in read_points(traj_path) if p["stage"] in names])
        stages.append({**stats, "records": len(dataset), "data": [sources.spec_identity(s) for s in stage.data]})
        offset += stats["steps"]
    if not main:
        return {}
    _save(model, processor, tok, model_dir, vision, qknorm)
    snapshots = _save_snapshots(model, processor, tok, out, config, vision, qknorm)
    points = read_points(traj_path)
    if points:
        plot_trajectories({Path(out).name: points}, out / "trajectory.png")
    report = {
        "base": read_json(out / REQUEST)["base"],
        "model": str(model_dir),
        "build": build_report,
        "qknorm": qknorm,
        "stages": stages,
        "trajectory": {"file": str(traj_path), "points": points} if points else None,
        "snapshots": snapshots,
        "config": read_json(out / REQUEST)["config"],
        "hooks": read_json(out / REQUEST)["hooks"],
        "provenance": provenance(model_fingerprints={"base": read_json(out / REQUEST)["base_fingerprint"],
                                                     "result": model_fingerprint(model_dir)},
                                 seeds={"seed": config.seed}),
    }
    write_json_atomic(out / REPORT, report)
    if not config.keep_checkpoints:
        shutil.rmtree(out / "work", ignore_errors=True)
    return report


def snapshot_dir(out: Path, stage: str, step: int) -> Path:
    return Path(out) / "snapshots" / f"{stage}-{step}"


def _save_snapshots(model, processor, tok, out: Path, config: AdaptConfig, vision, qknorm) -> list[dict]:
    """Each stage's `save_models_at` weights saved as a model of its own (the final model's weights are then gone from
    `model`: call last). Steps count from the run's start, as the trajectory's do."""
    # lazy: loads transformers, datasets, scipy
    from interventions.adapt.trainer import snapshot_file

    saved, offset = [], 0
    for stage in config.stages:
        stats = read_json(out / "work" / stage.name / "done.json")
        for step in stage.save_models_at:
            target = snapshot_dir(out, stage.name, step)
            load_model(model, str(snapshot_file(out / "work" / stage.name, step)))
            _save(model, processor, tok, target, vision, qknorm)
            saved.append({"stage": stage.name, "stage_step": step, "step": offset + step, "model": str(target),
                          "fingerprint": model_fingerprint(target)})
        offset += stats["steps"]
    return saved


def _add_point(path: Path, probe, point: dict) -> None:
    # lazy: loads transformers, scipy, PIL
    from interventions.adapt.trajectory import FORMAT, read_points

    points = sorted(read_points(path) + [point], key=lambda p: p["step"])
    write_json_atomic(path, {"format": FORMAT, "probe": probe.describe(), "points": points})


def _inject(lm, tok, qknorm: dict, config: AdaptConfig):
    unknown = set(qknorm) - {"init", "alpha"}
    if unknown:
        raise SinkstudyError(f"qknorm: unknown option(s) {', '.join(sorted(unknown))}; allowed: init, alpha")

    texts = [t.text for t in resolve_texts(config.trajectory.calibration, DEFAULT_SET)[0]]
    return inject_qk_norm(lm, init=qknorm.get("init", "identity-gain"), calibration_texts=texts, tokenizer=tok,
                          alpha=qknorm.get("alpha", 0.5), progress=False)


def _base_sink_maps(lm, tok, probe):
    return compute_sink_maps(lm, tok, probe.texts, metric=probe.cfg.metric, progress=False)


def _save(model, processor, tok, model_dir: Path, vision, qknorm) -> None:
    # lazy: loads transformers, scipy, PIL
    from interventions.adapt.vlm_io import save_vlm

    model.config.use_cache = True
    if vision is not None:
        save_vlm(model, processor, model_dir, replace=True)
    elif qk.qk_norm_kind(model) == "injected":
        qk.save_injected(model, model_dir, tokenizer=tok, metadata={"qknorm": qknorm}, replace=True)
    else:
        save_causal_lm(model, tok, model_dir, replace=True)


def _is_main() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def run_summary(report: dict) -> dict[str, Any]:
    """The few numbers a CLI prints: per stage steps, final loss (the mean over the last steps, and how
    many) and the stage's mean loss, steps/s, tokens/s; trajectory ends."""
    rows = [{k: s.get(k) for k in ("stage", "steps", "final_loss", "final_loss_steps", "mean_loss", "steps_per_second",
                                   "tokens_per_second", "trainable_params")}
            for s in report["stages"]]
    traj = (report.get("trajectory") or {}).get("points") or []
    return {"stages": rows, "sink_strength": [traj[0]["sink_strength"], traj[-1]["sink_strength"]] if traj else None}
