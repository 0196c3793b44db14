"""One entry point for every weight intervention: mergekit merges, TSV / STAR, registered mitigations.

    apply_intervention("ties", base, vlm, {"weight": 1.0, "density": 0.2}, out_dir, seed=0)
    apply_intervention("star", base, vlm, {"eta": 40}, out_dir)
    apply_intervention("head_restore", base, vlm, {"top_k": 8}, out_dir)

Each writes an HF causal-LM checkpoint plus `intervention.json` (with the request) to `out_dir`.

The request (`intervention_request`) is the identity of the result: the fingerprints of every
input model (base, vlm as given — a VLM or its extracted LM —, root), the full method settings
(calibration texts and sink maps by content), the seed, the device where that changes the numbers
(a mergekit merge run with `cuda`; TSV / STAR's `device` setting), and the code that computes it (the
sinkstudy module, mergekit's version, or a mitigation plug-in's source hash). A finished `out_dir`
made by the same request is reused (resumable sweeps and studies); one made by anything else —
another pair, other settings, edited code — is refused in one line unless `force` replaces it.
Settings are validated (`validate_intervention`) before any model is read.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Mapping

from interventions.merge import PASSTHROUGH_PARAMS, MERGEKIT_METHODS, RESULT_JSON, MergeError, validate_merge_args
from interventions.spectral import SPECTRAL_METHODS, validate_spectral_args

# Per-family parameters (besides the mitigation's own); spectral aliases map to `weight`.
_MERGE_KEYS = {"weight", "density", "select", "root"} | PASSTHROUGH_PARAMS
_SPECTRAL_KEYS = {"tsv": {"weight", "alpha", "k_fraction", "select", "root", "device"},
                  "star": {"weight", "lambda", "eta", "select", "root", "device"}}
_SPECTRAL_ALIAS = {"tsv": "alpha", "star": "lambda"}
_MITIGATION_RESERVED = {"sink_maps", "texts"}
_MERGE_DEFAULT_WEIGHT = 0.5


def list_interventions() -> dict[str, str]:
    """name -> kind ("mergekit", "spectral", "mitigation: <description>")."""
    from interventions.mitigations import list_mitigations

    out = {m: "mergekit" for m in MERGEKIT_METHODS} | {m: "spectral" for m in SPECTRAL_METHODS}
    out |= {n: f"mitigation: {m.description}" for n, m in list_mitigations().items()}
    return out


def takes_root(name: str) -> bool:
    """Whether intervention `name` merges task vectors from a common ancestor (`root`)."""
    from interventions.merge import takes_root as mergekit_takes_root

    return name in SPECTRAL_METHODS or (name in MERGEKIT_METHODS and mergekit_takes_root(name))


def validate_intervention(name: str, params: Mapping[str, Any] | None) -> None:
    """Every parameter name and value of intervention `name` (finite numbers in range, known
    keys, root only where task vectors are merged), without reading any model: one line on error."""
    params = dict(params or {})
    if name in MERGEKIT_METHODS:
        _check_keys(name, params, _MERGE_KEYS)
        validate_merge_args(name, params.get("weight", _MERGE_DEFAULT_WEIGHT), params.get("density"), params.get("select"),
                            {k: v for k, v in params.items() if k in PASSTHROUGH_PARAMS}, params.get("root"))
    elif name in SPECTRAL_METHODS:
        _check_keys(name, params, _SPECTRAL_KEYS[name])
        kw = _spectral_kwargs(name, params)
        validate_spectral_args(name, kw.get("weight"), kw.get("eta", 40.0), kw.get("k_fraction"), kw.get("select"),
                               kw.get("device", "cpu"))
    else:
        from interventions.mitigations import list_mitigations, resolve_config

        mitigation = list_mitigations().get(name)
        if mitigation is None:
            raise MergeError(f"unknown intervention {name!r}; known: {', '.join(list_interventions())}")
        resolve_config(mitigation, {k: v for k, v in params.items() if k not in _MITIGATION_RESERVED})
        texts = params.get("texts")
        if texts is not None:
            from evals.sink.calibration import resolve_texts
            from sinkstudy.io import read_text

            if isinstance(texts, (str, os.PathLike)) and Path(texts).is_file():
                read_text(texts, "texts file")  # a non-UTF-8 file fails here, named
            resolve_texts(texts, "ifeval15")  # a missing file or an unknown set name fails here


def execution_options(name: str, mergekit_options: Mapping[str, Any] | None) -> dict[str, bool] | None:
    """How intervention `name` runs (mergekit methods: cuda, lazy_unpickle, low_cpu_memory), checked
    without reading any model; None for the other methods, which refuse mergekit options in one line."""
    from interventions.merge import check_mergekit_options

    if name in MERGEKIT_METHODS:
        return check_mergekit_options(mergekit_options)
    given = [k for k, v in (mergekit_options or {}).items() if v]
    if given:
        raise MergeError(f"mergekit options ({', '.join(given)}) apply to mergekit methods, not {name}"
                         + ("; TSV and STAR take --param device=cuda" if name in SPECTRAL_METHODS else ""))
    return None


def _spectral_kwargs(name: str, params: Mapping[str, Any]) -> dict[str, Any]:
    """TSV's `alpha` / STAR's `lambda` are aliases of `weight`: one of them at most."""
    kw = dict(params)
    alias = _SPECTRAL_ALIAS[name]
    if alias in kw:
        if "weight" in kw:
            raise MergeError(f"{name}: give {alias} or weight, not both")
        kw["weight"] = kw.pop(alias)
    return kw


def intervention_request(name: str, base, vlm, params: Mapping[str, Any] | None, seed: int = 0,
                         revisions: Mapping[str, str] | None = None,
                         mergekit_options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The identity of intervention `name` on (base, vlm) with `params` and `seed` (module doc); `revisions`
    ({"base" | "vlm" | "root": revision}) pins hub ids, whose fingerprints then name the revision;
    `mergekit_options` as given to `apply_intervention` (of them, only `cuda` changes the numbers)."""
    from sinkstudy.provenance import file_digest, model_fingerprint

    params = dict(params or {})
    validate_intervention(name, params)
    public = {k: (os.fspath(v) if isinstance(v, os.PathLike) else v) for k, v in sorted(params.items())
              if k not in ("sink_maps", "root")}
    if "select" in public and public["select"] is not None:
        public["select"] = str(public["select"])
    revisions = revisions or {}
    models = {"base": model_fingerprint(base, revisions.get("base")), "vlm": model_fingerprint(vlm, revisions.get("vlm"))}
    if params.get("root") is not None:
        models["root"] = model_fingerprint(params["root"], revisions.get("root"))
    request = {"name": name, "params": public, "seed": seed, "models": models, "code": _code_identity(name)}
    if name in MERGEKIT_METHODS and (mergekit_options or {}).get("cuda"):
        # mergekit on a GPU computes other numbers: its argsort breaks ties in |delta| at a TIES / magnitude
        # cut another way (fp16/bf16 weights tie often), DARE draws its drops from the CUDA generator.
        request["device"] = "cuda"
    texts = params.get("texts")
    if isinstance(texts, (str, os.PathLike)) and Path(texts).is_file():
        request["texts_sha256"] = file_digest(texts)
    if params.get("sink_maps"):
        request["sink_maps_sha256"] = _digest(params["sink_maps"])
    return request


def _code_identity(name: str) -> dict[str, str | None]:
    from sinkstudy.provenance import code_version, package_versions

    here = Path(__file__).resolve().parent
    if name in MERGEKIT_METHODS:
        return {"sinkstudy": code_version(here / "merge.py"), "mergekit": package_versions().get("mergekit")}
    if name in SPECTRAL_METHODS:
        return {"sinkstudy": code_version(here / "spectral.py", here / "merge.py")}
    from interventions.mitigations import get_mitigation, source_hash

    return {"sinkstudy": code_version(here / "mitigations" / "__init__.py"), "plugin": source_hash(get_mitigation(name))}


def _digest(obj) -> str:
    """Content digest of sink maps given as JSON paths, loaded JSON, SinkMaps or tensors."""
    from sinkstudy.io import json_default
    from sinkstudy.provenance import file_digest

    def plain(x):
        if isinstance(x, (str, os.PathLike)) and Path(x).is_file():
            return {"file_sha256": file_digest(x)}
        if hasattr(x, "to_json"):
            return x.to_json()
        if isinstance(x, Mapping):
            return {str(k): plain(v) for k, v in x.items()}
        return x

    blob = json.dumps(plain(obj), sort_keys=True, default=json_default)
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def recorded_request(out_dir: str | os.PathLike) -> dict[str, Any] | None:
    """The request stored in a finished intervention's `intervention.json` (None if there is none)."""
    f = Path(out_dir) / RESULT_JSON
    try:
        request = json.loads(f.read_text(encoding="utf-8")).get("request")
    except (OSError, ValueError, AttributeError):
        return None
    return request if isinstance(request, dict) else None


def finished(out_dir: str | os.PathLike, request: Mapping[str, Any]) -> bool:
    """True when `out_dir` holds a finished intervention made by exactly `request`."""
    return recorded_request(out_dir) == dict(request)


def _refusal(out_dir: Path, existing: dict | None, request: dict) -> str:
    if existing is None:
        return f"output {out_dir} exists and holds no finished intervention; pass --force to replace it"
    if existing.get("models") is not None and existing.get("models") != request["models"]:
        which = ", ".join(k for k in sorted(set(existing["models"]) | set(request["models"]))
                          if existing["models"].get(k) != request["models"].get(k))
        return (f"output {out_dir} holds {existing.get('name')} of another pair of models (the content of {which} differs); "
                "choose another --out or pass --force to replace it")
    differ = ", ".join(k for k in sorted(set(existing) | set(request)) if existing.get(k) != request.get(k))
    return f"output {out_dir} exists and was made by another request ({differ} differ); pass --force to replace it"


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

    Holds `out_dir`'s lock from the reuse check to the end: a second writer fails at once.
    `mergekit_options` (mergekit methods: cuda, lazy_unpickle, low_cpu_memory) say how mergekit runs,
    recorded in intervention.json; `cuda` also changes what it computes, so it is part of the request
    (a merge made on the CPU is not reused for a `cuda` one, nor the reverse).
    """
    from interventions.merge import local_checkpoint
    from sinkstudy.io import output_lock

    params = dict(params or {})
    validate_intervention(name, params)
    options = execution_options(name, mergekit_options)
    root = params.get("root")
    request = intervention_request(name, local_checkpoint(base_path), local_checkpoint(vlm_lm_path),
                                   {**params, **({"root": local_checkpoint(root)} if root is not None else {})}, seed,
                                   mergekit_options=options)
    out_dir = Path(out_dir)
    with output_lock(out_dir):
        existing = recorded_request(out_dir)
        if not force and existing == request:
            return out_dir
        if out_dir.exists() and not force:
            raise MergeError(_refusal(out_dir, existing, request))
        _dispatch(name, base_path, vlm_lm_path, params, out_dir, options, seed=seed, force=force, progress=progress,
                  request=request)
    return out_dir


def _dispatch(name: str, base, vlm, params: dict[str, Any], out_dir: Path, options: dict[str, bool] | None, **kw) -> None:
    if name in MERGEKIT_METHODS:
        from interventions.merge import run_mergekit_merge

        mk = {k: params.pop(k) for k in ("weight", "density", "select", "root") if k in params}
        run_mergekit_merge(name, base, vlm, out_dir, params=params, options=options, **mk, **kw)
    elif name in SPECTRAL_METHODS:
        from interventions.spectral import run_spectral_merge

        run_spectral_merge(name, base, vlm, out_dir, **_spectral_kwargs(name, params), **kw)
    else:
        from interventions.mitigations import run_mitigation

        own = {k: v for k, v in params.items() if k not in _MITIGATION_RESERVED}
        run_mitigation(name, base, vlm, out_dir, params=own, sink_maps=params.get("sink_maps"), texts=params.get("texts"), **kw)


def _check_keys(name: str, params: Mapping[str, Any], allowed: set[str]) -> None:
    unknown = set(params) - allowed
    if unknown:
        raise MergeError(f"{name} has no parameter(s) {', '.join(sorted(unknown))}; it takes {', '.join(sorted(allowed))}")
