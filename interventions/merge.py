"""Weight merging of a base LLM and a VLM's language model through mergekit.

Every merge runs `mergekit.merge.run_merge` on two same-architecture checkpoints on disk and
writes, beside the merged weights, the exact mergekit YAML it ran (`mergekit_config.yml`, with the
equivalent `mergekit-yaml` command in its header) and `intervention.json` (settings + provenance).

Conventions shared with `interventions.spectral` (TSV, STAR):
- `base` is the base LLM, `vlm` the VLM's extracted LM (a VLM checkpoint is extracted first, into a
  cache). `root`, optional, is their common pretrained ancestor: when given, task-vector methods
  merge both task vectors (base - root, vlm - root) onto it; otherwise the one task vector is
  vlm - base, applied to the base.
- `weight`: linear / slerp: the VLM's share (0 = base, 1 = VLM); task-vector methods: the scale
  of each task vector (lambda). `density`: the fraction of each delta kept (TIES, DARE, breadcrumbs).
- `select`: restrict the merge to some tensors (`Selection`); everything else stays the base's.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Mapping

import yaml

from interventions.outputs import (RESULT_JSON, MergeError, check_disk_space, check_finite_checkpoint, check_pair,
                                   checkpoint_dtype, estimate_output_bytes, language_model_of, replace_side_files,
                                   side_files, write_result)
from interventions.params import Selection, check_number
from sinkstudy.checkpoint import local_checkpoint
from sinkstudy.io import atomic_output_dir, check_output_dir

LOG = logging.getLogger(__name__)

# mergekit 0.1.5 names (mergekit/merge_methods/registry.py).
MERGEKIT_METHODS = ("linear", "slerp", "task_arithmetic", "ties", "dare_ties", "dare_linear", "breadcrumbs", "breadcrumbs_ties")
_SPARSE_METHODS = frozenset({"ties", "dare_ties", "dare_linear", "breadcrumbs", "breadcrumbs_ties"})
# Extra mergekit parameters a user may pass through (`--param key=value`).
PASSTHROUGH_PARAMS = {"gamma", "lambda", "normalize", "rescale", "int8_mask"}
# Numeric pass-through parameters and their ranges (the others are booleans).
_PASSTHROUGH_RANGES = {"gamma": {"lo": 0.0, "hi": 1.0, "hi_open": True}, "lambda": {"lo": 0.0, "hi": 10.0}}

MERGEKIT_YAML = "mergekit_config.yml"


def _selective(value: float, outside: float, selection: Selection | None) -> Any:
    """A mergekit parameter that is `value` on selected tensors and `outside` elsewhere."""
    if selection is None:
        return value
    return [{"filter": f, "value": value} for f in selection.filters()] + [{"value": outside}]


# --------------------------------------------------------------------------- mergekit config

def takes_root(method: str) -> bool:
    """Whether `method` merges task vectors from a common ancestor (`root`): not linear or slerp."""
    return method not in ("linear", "slerp")


def validate_merge_args(method: str, weight: float, density: float | None, select, params: dict | None,
                        root=None) -> Selection | None:
    """Method, ranges and parameter names; returns the parsed selection. Cheap: runs first."""
    if method not in MERGEKIT_METHODS:
        raise MergeError(f"unknown mergekit method {method!r}; choose from {', '.join(MERGEKIT_METHODS)}")
    check_number(f"{method} weight", weight, lo=0.0, hi=1.0 if method in ("linear", "slerp") else 10.0)
    if density is not None:
        if method not in _SPARSE_METHODS:
            raise MergeError(f"{method} has no density parameter")
        check_number("density", density, lo=0.0, hi=1.0, lo_open=True)
    if root is not None and not takes_root(method):
        raise MergeError(f"{method} interpolates base and VLM directly and takes no --root; use a task-vector method "
                         "(task_arithmetic, ties, dare_*, breadcrumbs*, tsv, star) with a root")
    params = dict(params or {})
    unknown = set(params) - PASSTHROUGH_PARAMS
    if unknown:
        raise MergeError(f"unknown merge parameter(s) {', '.join(sorted(unknown))}; allowed: {', '.join(sorted(PASSTHROUGH_PARAMS))}")
    for key, value in params.items():
        if key in _PASSTHROUGH_RANGES:
            check_number(f"{method} {key}", value, **_PASSTHROUGH_RANGES[key])
        elif not isinstance(value, bool):
            raise MergeError(f"{method} {key} must be true or false, got {value!r}")
    return Selection.parse(select) if isinstance(select, str) or select is None else select


def merge_config(
    method: str,
    base: str | os.PathLike,
    vlm: str | os.PathLike,
    *,
    weight: float = 0.5,
    density: float | None = None,
    select: Selection | str | None = None,
    root: str | os.PathLike | None = None,
    params: dict[str, Any] | None = None,
    out_dtype: str | None = None,
) -> dict[str, Any]:
    """The mergekit configuration (a plain dict, as in a mergekit YAML) for one merge.

    Paths are made absolute so the YAML runs from anywhere. Math is float32; the output keeps
    `out_dtype` (default: the base's stored dtype). Unselected tensors get the VLM weight 0 (and
    density 1), which leaves them exactly the base's.
    """
    selection = validate_merge_args(method, weight, density, select, params, root)
    params = dict(params or {})
    base_s, vlm_s = str(Path(base).resolve()), str(Path(vlm).resolve())
    cfg: dict[str, Any] = {"merge_method": method, "dtype": "float32", "out_dtype": out_dtype or checkpoint_dtype(base)}

    if method == "linear":
        cfg["base_model"] = base_s  # linear ignores it in the arithmetic; it fixes the config/tokenizer donor
        cfg["models"] = [
            {"model": base_s, "parameters": {"weight": _selective(1.0 - weight, 1.0, selection)}},
            {"model": vlm_s, "parameters": {"weight": _selective(weight, 0.0, selection)}},
        ]
    elif method == "slerp":
        cfg["base_model"] = base_s
        cfg["models"] = [{"model": base_s}, {"model": vlm_s}]
        cfg["parameters"] = {"t": _selective(weight, 0.0, selection)}
    else:
        def entry(model: str, inside: float, outside: float) -> dict[str, Any]:
            p: dict[str, Any] = {"weight": _selective(inside, outside, selection)}
            if method in _SPARSE_METHODS:
                p["density"] = _selective(density if density is not None else 1.0, 1.0, selection)
            return {"model": model, "parameters": p}

        if root is None:
            cfg["base_model"] = base_s
            cfg["models"] = [entry(vlm_s, weight, 0.0)]
        else:
            cfg["base_model"] = str(Path(root).resolve())
            cfg["models"] = [entry(base_s, weight, 1.0), entry(vlm_s, weight, 0.0)]
        # ties/della default to normalize=true, which cancels the weight of a single task vector
        # (NOTES.md): weights must mean what they say across a sweep.
        cfg["parameters"] = {"normalize": False}
    if params:
        cfg.setdefault("parameters", {}).update(params)
    # mergekit copies config and tokenizer from base_model (without one, from the first element of
    # a set: which model depends on the hash seed). No tokenizer_source: it would rebuild the
    # embeddings to len(tokenizer) (NOTES.md). With a root, run_mergekit_merge puts the base's
    # config and tokenizer back after mergekit (the root has no chat template).
    return cfg


def config_yaml(cfg: dict[str, Any], seed: int | None, base: str | os.PathLike | None = None) -> str:
    """The YAML written beside a merge: runnable as is with `mergekit-yaml`. With a root, the
    header says which files to copy from the base LLM afterwards (what sinkstudy did)."""
    seed_flag = f" --random-seed {seed}" if seed is not None else ""
    header = (
        "# Written by sinkstudy; reproduce these weights with:\n"
        f"#   mergekit-yaml {MERGEKIT_YAML} OUT_DIR{seed_flag}\n"
    )
    if base is not None and Path(cfg["base_model"]) != Path(base).resolve():
        header += (f"# base_model is the common root; sinkstudy then replaced the root's config.json,\n"
                   f"# generation_config.json and tokenizer files by the base LLM's ({Path(base).resolve()}):\n"
                   f"#   see `files` in {RESULT_JSON}\n")
    else:
        header += "# config.json, generation_config.json and the tokenizer come from base_model (the base LLM).\n"
    return header + yaml.safe_dump(cfg, sort_keys=False)


# --------------------------------------------------------------------------- running

def run_mergekit_merge(
    method: str,
    base: str | os.PathLike,
    vlm: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    weight: float = 0.5,
    density: float | None = None,
    select: Selection | str | None = None,
    root: str | os.PathLike | None = None,
    params: dict[str, Any] | None = None,
    seed: int = 0,
    replace: bool = False,
    progress: bool = True,
    request: dict[str, Any] | None = None,
    options: dict[str, Any] | None = None,
) -> Path:
    """Merge base and the VLM's LM with mergekit into `out_dir`; returns `out_dir`.

    All checks (method, parameters, execution options, pair layout, disk space, an existing output: refused unless
    `replace`) run before mergekit; the output is scanned for non-finite tensors before it is moved into place. A VLM
    given as `vlm` is extracted for this merge (`interventions.outputs.language_model_of`).
    `request` (the registry's identity of this intervention) is stored in `intervention.json`.
    `options` go to mergekit's `MergeOptions` as `mergekit-yaml` flags would: cuda, lazy_unpickle,
    low_cpu_memory (recorded beside the request; `cuda` also changes what it computes, and the
    registry's request holds it).
    """
    validate_merge_args(method, weight, density, select, params, root)
    options = check_mergekit_options(options)
    out_dir = check_output_dir(out_dir, replace)
    base_in, vlm_in = base, vlm
    base, root = local_checkpoint(base), (local_checkpoint(root) if root is not None else None)
    with language_model_of(base, vlm, out_dir) as vlm_lm:
        check_pair(base, vlm_lm, root)
        cfg = merge_config(method, base, vlm_lm, weight=weight, density=density, select=select, root=root, params=params)
        check_disk_space(out_dir, estimate_output_bytes(base, cfg["out_dtype"]))
        text = config_yaml(cfg, seed, base)
        with atomic_output_dir(out_dir, replace) as tmp:
            _run_mergekit(cfg, text, tmp, seed, progress, options)
            if root is None:
                files = {f: "base LLM (mergekit base_model)" for f in side_files(tmp)}
            else:  # mergekit took them from the root
                files = {f: "base LLM (copied after mergekit)" for f in replace_side_files(base, tmp)}
            check_finite_checkpoint(tmp)
            write_result(tmp, method=method, base=base_in, vlm=vlm_in, vlm_lm=vlm_lm, root=root, seed=seed,
                         settings={"weight": weight, "density": density, "select": str(select or "") or None, **(params or {})},
                         extra={"mergekit_config": cfg, "mergekit_options": options, "files": {"weights": "mergekit", **files},
                                **({"request": request} if request else {})}, config_file=MERGEKIT_YAML)
    return out_dir


_EXECUTION_OPTIONS = ("cuda", "lazy_unpickle", "low_cpu_memory")


def check_mergekit_options(options: Mapping[str, Any] | None) -> dict[str, bool]:
    """All execution options, known ones checked before any work; --cuda without a GPU is one line."""
    options = dict(options or {})
    unknown = sorted(set(options) - set(_EXECUTION_OPTIONS))
    if unknown:
        raise MergeError(f"unknown mergekit option(s) {', '.join(unknown)}; known: {', '.join(_EXECUTION_OPTIONS)}")
    out = {k: bool(options.get(k, False)) for k in _EXECUTION_OPTIONS}
    if out["cuda"]:
        # lazy: loads torch, numpy
        import torch

        if not torch.cuda.is_available():
            raise MergeError("--cuda: no CUDA device is available here; merge on the CPU (drop --cuda)")
    if out["low_cpu_memory"] and not out["cuda"]:
        raise MergeError("--low-cpu-memory keeps results on the GPU: it needs --cuda")
    return out


def _run_mergekit(cfg: dict[str, Any], yaml_text: str, out: Path, seed: int | None, progress: bool,
                  options: dict[str, bool]) -> None:
    # lazy: loads mergekit, torch, transformers
    from mergekit.config import MergeConfiguration
    from mergekit.merge import MergeOptions, run_merge

    config = MergeConfiguration.model_validate(cfg)
    options = MergeOptions(copy_tokenizer=True, random_seed=seed, quiet=not progress, **options)
    try:
        run_merge(config, str(out), options=options, config_source=yaml_text)
    except (RuntimeError, ValueError) as exc:  # mergekit's own errors become one line
        raise MergeError(f"mergekit {cfg['merge_method']} failed: {str(exc).splitlines()[0]}") from exc


