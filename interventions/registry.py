"""One entry point for every weight intervention: mergekit merges, TSV / STAR, registered mitigations.

    apply_intervention("ties", base, vlm, {"weight": 1.0, "density": 0.2}, out_dir, seed=0)
    apply_intervention("star", base, vlm, {"eta": 40}, out_dir)
    apply_intervention("head_restore", base, vlm, {"top_k": 8}, out_dir)

Each writes an HF causal-LM checkpoint plus `intervention.json` (with the request) to `out_dir`.
A finished `out_dir` made by the same request is reused (resumable sweeps and studies); one made
by a different request is refused unless `force`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

from interventions.merge import MERGEKIT_METHODS, RESULT_JSON, MergeError
from interventions.spectral import SPECTRAL_METHODS

# Per-family parameters (besides the mitigation's own); spectral aliases map to `weight`.
_MERGE_KEYS = {"weight", "density", "select", "root", "gamma", "lambda", "normalize", "rescale", "int8_mask"}
_SPECTRAL_KEYS = {"tsv": {"weight", "alpha", "k_fraction", "select", "root", "device"},
                  "star": {"weight", "lambda", "eta", "select", "root", "device"}}
_MITIGATION_RESERVED = {"sink_maps", "texts"}


def list_interventions() -> dict[str, str]:
    """name -> kind ("mergekit", "spectral", "mitigation: <description>")."""
    from interventions.mitigations import list_mitigations

    out = {m: "mergekit" for m in MERGEKIT_METHODS} | {m: "spectral" for m in SPECTRAL_METHODS}
    out |= {n: f"mitigation: {m.description}" for n, m in list_mitigations().items()}
    return out


def _request(name: str, params: Mapping[str, Any], seed: int) -> dict[str, Any]:
    return {"name": name, "params": {k: (os.fspath(v) if isinstance(v, os.PathLike) else v) for k, v in sorted(params.items()) if k != "sink_maps"}, "seed": seed}


def finished(out_dir: str | os.PathLike, name: str, params: Mapping[str, Any] | None = None, seed: int = 0) -> bool:
    """True when `out_dir` holds a finished intervention made by exactly this request."""
    import json

    f = Path(out_dir) / RESULT_JSON
    if not f.is_file():
        return False
    try:
        return json.loads(f.read_text()).get("request") == _request(name, dict(params or {}), seed)
    except ValueError:
        return False


def apply_intervention(
    name: str,
    base_path: str | os.PathLike,
    vlm_lm_path: str | os.PathLike,
    params: Mapping[str, Any] | None,
    out_dir: str | os.PathLike,
    *,
    seed: int = 0,
    force: bool = False,
    progress: bool = True,
    mergekit_options: Mapping[str, Any] | None = None,
) -> Path:
    """Apply intervention `name` (see `list_interventions`) and return the output checkpoint dir.

    `mergekit_options` (mergekit methods: cuda, lazy_unpickle, low_cpu_memory) say how mergekit
    runs, not what it computes: recorded in intervention.json, not part of the request.
    """
    from sinkstudy.io import read_json, write_json_atomic

    params = dict(params or {})
    if any((mergekit_options or {}).values()) and name not in MERGEKIT_METHODS:
        raise MergeError(f"mergekit options ({', '.join(k for k, v in mergekit_options.items() if v)}) apply to mergekit methods, not {name}"
                         + ("; TSV and STAR take --param device=cuda" if name in SPECTRAL_METHODS else ""))
    request = _request(name, params, seed)
    out_dir = Path(out_dir)
    if not force and finished(out_dir, name, params, seed):
        return out_dir
    if out_dir.exists() and not force:
        raise MergeError(f"output {out_dir} exists and was made by another request; pass --force to replace it")

    if name in MERGEKIT_METHODS:
        from interventions.merge import run_mergekit_merge

        _check_keys(name, params, _MERGE_KEYS)
        mk = {k: params.pop(k) for k in ("weight", "density", "select", "root") if k in params}
        run_mergekit_merge(name, base_path, vlm_lm_path, out_dir, params=params, seed=seed, force=force, progress=progress,
                           options=mergekit_options, **mk)
    elif name in SPECTRAL_METHODS:
        from interventions.spectral import run_spectral_merge

        _check_keys(name, params, _SPECTRAL_KEYS[name])
        kw = dict(params)
        alias = kw.pop("alpha", None) if name == "tsv" else kw.pop("lambda", None)
        if alias is not None:
            kw["weight"] = alias
        run_spectral_merge(name, base_path, vlm_lm_path, out_dir, seed=seed, force=force, progress=progress, **kw)
    else:
        from interventions.mitigations import get_mitigation, run_mitigation

        get_mitigation(name)  # unknown names fail here, listing every registered one
        own = {k: v for k, v in params.items() if k not in _MITIGATION_RESERVED}
        run_mitigation(name, base_path, vlm_lm_path, out_dir, params=own, sink_maps=params.get("sink_maps"),
                       texts=params.get("texts"), seed=seed, force=force, progress=progress)
    result = read_json(out_dir / RESULT_JSON)
    write_json_atomic(out_dir / RESULT_JSON, {**result, "request": request})
    return out_dir


def _check_keys(name: str, params: Mapping[str, Any], allowed: set[str]) -> None:
    unknown = set(params) - allowed
    if unknown:
        raise MergeError(f"{name} has no parameter(s) {', '.join(sorted(unknown))}; it takes {', '.join(sorted(allowed))}")
