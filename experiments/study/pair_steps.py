"""The bodies of a pair's steps and the settings that key them: extract the VLM's language model,
Sink maps + Strength of a model, its strict evals through lm-eval, a registered intervention, and
QK-norm injection. Each body reads its inputs and writes its outputs; `experiments.study.pipeline` places
them in the plan. A model's identity in a pair (`pair_fingerprint`) is its content for a local path
and `hub:<id>@<revision>` for a hub id the study pins.
"""

from __future__ import annotations

import copy
import os
from dataclasses import asdict
from pathlib import Path

from sinkstudy import SinkstudyError
from sinkstudy.checkpoint import load_tokenizer
from sinkstudy.io import read_json, write_json_atomic
from sinkstudy.provenance import code_version, model_fingerprint

ROOT = Path(__file__).resolve().parent.parent.parent


def sink_code_version() -> str:
    """The sink measurement code (evals/sink): part of every sink result's key."""
    return code_version(ROOT / "evals" / "sink")


# --------------------------------------------------------------------------- a pair's models

def pinned(pair, path) -> str | None:
    """The revision the study pins `path` to (`base_revision`..., for the pair's hub ids), else None."""
    return next((rev for role, rev in pair.revision.items() if getattr(pair, role) == path), None)


def pair_fingerprint(pair, path) -> str:
    """A model's identity in `pair`'s steps: content for a local path, `hub:<id>@<revision>` for a hub id
    the study pins, `hub:<id>` otherwise."""
    return model_fingerprint(path, revision=pinned(pair, path))


def loadable(pair, path) -> str:
    """What loaders read for `path`: itself, or for a pinned hub id its snapshot at that revision (fetched
    once, when a step body needs it; never by a plan)."""
    from sinkstudy.checkpoint import local_checkpoint

    revision = pinned(pair, path)
    return path if revision is None else os.fspath(local_checkpoint(path, revision))


def native_qk_norm(pair) -> bool:
    """Whether the pair's base has QK-norm of its own: the config's `native_qk_norm`, else its model type."""
    if pair.native_qk_norm is not None:
        return bool(pair.native_qk_norm)
    from interventions.pairs.resolve import load_config

    cfg = load_config(pair.base, revision=pinned(pair, pair.base))
    return getattr(cfg, "model_type", "") in ("qwen3", "gemma3_text", "olmo2", "olmo3")


def sink_file(study, pair: str, label: str) -> Path:
    return study.out / "sink" / pair / f"{label}.json"


def eval_dir(study, pair: str, label: str) -> Path:
    return study.out / "evals" / pair / label


def _dtype(study):
    import torch

    return getattr(torch, study.model.dtype)


def _load(path: str, study):
    from interventions.pairs import load_causal_lm

    return load_causal_lm(path, dtype=_dtype(study), device=study.model.device or "cpu")


# --------------------------------------------------------------------------- settings (keys)

def sink_spec(study, path: str, fingerprint: str) -> dict:
    return {"sink": asdict(study.sink), "path": path, "model": fingerprint, "dtype": study.model.dtype, "code": sink_code_version()}


def eval_step_spec(study, path: str, fingerprint: str) -> dict:
    from evals.lmeval import eval_code_version

    return {"evals": eval_spec(study), "path": path, "model": fingerprint, "code": eval_code_version()}


def eval_spec(study) -> dict:
    spec = {k: v for k, v in asdict(study.evals).items() if k not in ("n_boot", "confidence")}
    spec["data_files"] = {t: _file_digest(f) for t, f in spec["data_files"].items()}
    return {**spec, "seed": study.seed, "device": study.model.device, "dtype": study.model.dtype}


def _file_digest(path: str) -> str:
    from sinkstudy.provenance import file_digest

    return file_digest(path) if Path(path).is_file() else f"missing:{path}"


# --------------------------------------------------------------------------- bodies

def extract_step(pair, lm_dir: Path, study, progress: bool = False) -> dict:
    """The VLM's language model in the base's class and vocabulary, streamed disk to disk in the study's
    dtype: about one shard in memory; the vision tower is never read or built."""
    from interventions.pairs import plan_extraction, resolve, write_language_model
    from sinkstudy.checkpoint import try_load_tokenizer

    base = resolve(loadable(pair, pair.base))
    if base.kind != "causal_lm":
        raise SinkstudyError(f"pair {pair.name}: the base must be a causal LM, got a {base.config.model_type} VLM: {base.id}")
    plan = plan_extraction(loadable(pair, pair.vlm), base)  # every check before any weight is read
    report = plan.report.to_dict()
    write_language_model(plan, lm_dir, tokenizer=try_load_tokenizer(base.tokenizer_path), dtype=_dtype(study), force=True,
                         extra={"extraction": report, "vlm": pair.vlm}, progress=progress)
    fps = {pair.base: pair_fingerprint(pair, pair.base), pair.vlm: pair_fingerprint(pair, pair.vlm),
           str(lm_dir): model_fingerprint(lm_dir)}
    return {"path": str(lm_dir), "report": report, "fingerprints": fps}


def sink_step(study, pair, label: str, path: str, progress: bool) -> dict:
    from evals.sink import compute_sink_maps, strength_from_maps

    model, tok = _load(loadable(pair, path), study)
    if tok is None:
        tok = load_tokenizer(loadable(pair, pair.base))
    sink = study.sink
    maps = compute_sink_maps(model, tok, sink.texts, metric=sink.metric, progress=progress, **sink.options)
    strength = strength_from_maps(maps, sink.metric, **sink.params)
    maps_file = sink_file(study, pair.name, label)
    write_json_atomic(maps_file, maps.to_json())
    details = {k: v for k, v in strength.details.items() if k != "median_per_layer"}
    return {"value": strength.value, "metric": strength.metric, "details": details,
            "median_per_layer": strength.details.get("median_per_layer"), "mean_mass": float(maps.mass.mean()),
            "maps": str(maps_file), "path": path, "fingerprint": pair_fingerprint(pair, path)}


def eval_step(study, pair, label: str, path: str, progress: bool) -> dict:
    from evals.lmeval import run_eval
    from experiments.study.loaders import load_model

    ev = study.evals
    out_dir = eval_dir(study, pair.name, label)
    # Every model is prompted through the base's tokenizer and chat template, so runs pair on doc_id.
    # The path is loaded (in the study's dtype) only when something is left to evaluate.
    protocol = {k: getattr(ev, k) for k in ("limit", "batch_size", "apply_chat_template", "chat_template_kwargs", "system_instruction",
                                            "max_gen_toks", "gen_kwargs", "num_fewshot", "confirm_run_unsafe_code", "backend",
                                            "backend_args")}
    run = run_eval(loadable(pair, path), load_tokenizer(loadable(pair, pair.base)), tasks=ev.tasks,
                   data_files=ev.data_files or None, out_dir=out_dir, force=True, device=study.model.device,
                   dtype=study.model.dtype, seed=study.seed, progress=progress, loader=load_model, **protocol)
    return {"dir": str(out_dir), "scores": run.scores, "path": path, "fingerprint": run.fingerprint}


def intervene_step(study, pair, method: str, params: dict, lm_dir: Path, out_dir: Path, progress: bool) -> dict:
    from interventions.registry import apply_intervention

    params = {**params, **({"root": loadable(pair, params["root"])} if params.get("root") else {})}
    out = apply_intervention(method, loadable(pair, pair.base), lm_dir, params, out_dir, seed=study.seed, force=True,
                             progress=progress)
    info = read_json(Path(out) / "intervention.json") if (Path(out) / "intervention.json").is_file() else {}
    return {"path": str(out), "fingerprint": model_fingerprint(out), "info": {k: v for k, v in info.items() if k != "provenance"}}


def qknorm_step(study, pair, params: dict, out_dir: Path, progress: bool) -> dict:
    """QK-RMSNorm injected into the base; with `train_steps`, its `trainable` parameters then trained on
    the study's text (the demo corpus) to recover."""
    from interventions.qknorm import init_report, inject_qk_norm, save_injected, trainable_filter

    model, tok = _load(loadable(pair, pair.base), study)
    tok = tok or load_tokenizer(loadable(pair, pair.base))
    texts = _calibration_texts(study)
    injected = inject_qk_norm(copy.deepcopy(model), init=params["init"], calibration_texts=texts, tokenizer=tok,
                              **({"alpha": params["alpha"]} if "alpha" in params else {}))
    report = {"init": init_report(model, injected, tok, texts, progress=progress)}
    if params["train_steps"]:
        from interventions.training import train_causal_lm

        if study.build is None:
            raise SinkstudyError("qknorm train_steps needs training text: only the demo (build section) has a corpus")
        stats = train_causal_lm(injected, tok, study.build.training_texts(study.out, tok), steps=params["train_steps"],
                                lr=params["lr"], trainable=trainable_filter(params["trainable"]), seed=study.seed,
                                progress=progress, desc=f"qknorm recovery {pair.name}")
        stats.pop("losses", None)
        report["training"] = stats
        report["after_training"] = init_report(model, injected, tok, texts, progress=progress)
    save_injected(injected, out_dir, tokenizer=tok, metadata={"params": params}, force=True)
    return {"path": str(out_dir), "fingerprint": model_fingerprint(out_dir), "report": report}


def _calibration_texts(study) -> list[str]:
    from evals.sink.calibration import resolve_texts
    from evals.sink.metrics import get_metric

    return [t.text for t in resolve_texts(study.sink.texts, get_metric(study.sink.metric).calibration)[0]]


def extract_arm_step(vlm: str, start: str, lm: Path, own_class: bool) -> dict:
    """An adapted arm's language model, extracted against the base it started from (`own_class`: in the
    class the engine trained, where a protection changed the base's)."""
    from interventions.adapt.build import save_extracted_lm

    save_extracted_lm(vlm, start, lm, force=True, own_class=own_class)
    return {"path": str(lm), "fingerprint": model_fingerprint(lm)}
