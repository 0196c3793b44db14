"""Every weight intervention in one registry, as data: each `Method` declares its parameters with their
defaults, the check of their values, the code that shapes its result and how it runs.

    apply_intervention("ties", base, vlm, {"weight": 1.0, "density": 0.2}, out_dir, seed=0)
    apply_intervention("star", base, vlm, {"eta": 40}, out_dir)
    apply_intervention("head_restore", base, vlm, {"top_k": 8}, out_dir)
    apply_intervention("sink_dose", base, base, {"shift": -2.0}, out_dir)   # the base itself, its S moved

The families: mergekit merges (`interventions.merge`), TSV and STAR (`interventions.spectral`), the
registered mitigations (`interventions.mitigations`, plug-ins included), the sink dose (`dose`:
`interventions.sink_dose`, one model's Sink Strength moved to a level: the pair's `vlm`, so a backbone is
dosed by giving it as both) and QK-RMSNorm injection into the base (`qknorm`: its own steps,
`interventions.qknorm`; listed here for its parameters). Each post-hoc one writes an HF causal-LM
checkpoint plus `intervention.json` (with the request) to `out_dir`.

The request (`request`, `intervention_request`) is the identity of the result: the fingerprints of every
input model (base, vlm as given — a VLM or its extracted LM —, root), the full settings with the method's
defaults filled in (calibration texts and sink maps by content), the seed, the device where that changes
the numbers (a mergekit merge run with `cuda`; TSV / STAR's `device` setting), and the code that computes
it (the method's modules, mergekit's version, or a plug-in's source). It is written into `intervention.json`
and is the key of the step that applies the method (`experiments.study.pair_steps.Intervene`), which the engine
reuses or refuses; nothing is reused here. Settings are validated (`validate_intervention`) before any model is
read.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from evals.sink.calibration import DEFAULT_SET, resolve_texts
from interventions import sink_dose
from interventions.adapt import code as adapt_code
from interventions.merge import (_SPARSE_METHODS, MERGEKIT_METHODS, PASSTHROUGH_PARAMS, check_mergekit_options,
                                 run_mergekit_merge, validate_merge_args)
from interventions.mitigations import list_mitigations, resolve_config, run_mitigation, source_hash
from interventions.outputs import MergeError
from interventions.qknorm_modes import INIT_MODES, TRAINABLE_MODES
from interventions.spectral import SPECTRAL_METHODS, run_spectral_merge, validate_spectral_args
from sinkstudy.checkpoint import local_checkpoint
from sinkstudy.io import json_default, read_text
from sinkstudy.provenance import file_digest, model_fingerprint, module_code_version, package_versions

POSTHOC = ("mergekit", "spectral", "mitigation", "dose")  # families that change the VLM's language model after the fact
INJECTION = "injection"  # a change to the base before adaptation (its own steps)


@dataclass(frozen=True)
class Method:
    """One intervention: its family, its parameters with their defaults (a default of None: absent unless
    given), their check (every value, no model read, one line on error), the modules whose source shapes
    its result and how it runs (None: it has steps of its own)."""

    name: str
    family: str
    defaults: Mapping[str, Any]
    check: Callable[[dict], None]
    code: tuple[str, ...]
    run: Callable[..., Any] | None = None  # (name, base, vlm, out_dir, params, options, **kw)
    takes_root: bool = False  # merges task vectors from a common ancestor (`root`)
    aliases: Mapping[str, str] = field(default_factory=dict)  # another name of a parameter -> its name
    description: str = ""
    source: Callable[[], str] | None = None  # a plug-in's source hash: part of its identity
    versions: tuple[str, ...] = ()  # packages whose version shapes its result

    def resolve(self, params: Mapping[str, Any] | None) -> dict[str, Any]:
        """The defaults with `params` over them (aliases renamed), checked; None-valued defaults left out."""
        given = dict(params or {})
        for alias, name in self.aliases.items():
            if alias in given:
                if name in given:
                    raise MergeError(f"{self.name}: give {alias} or {name}, not both")
                given[name] = given.pop(alias)
        if "root" in given and given["root"] is not None and not self.takes_root:
            raise MergeError(f"{self.name} interpolates base and VLM directly and takes no --root; use a task-vector method "
                             "(task_arithmetic, ties, dare_*, breadcrumbs*, tsv, star) with a root")
        unknown = sorted(set(given) - set(self.defaults) - _RESERVED)
        if unknown:
            raise MergeError(f"{self.name} has no parameter(s) {', '.join(unknown)}; it takes "
                             f"{', '.join(sorted({*self.defaults, *self.aliases}))}")
        resolved = {k: v for k, v in {**self.defaults, **given}.items() if v is not None}
        self.check({k: v for k, v in resolved.items() if k not in _RESERVED})
        return resolved


_RESERVED = {"sink_maps"}  # set by the caller: a mitigation's sink maps


# --------------------------------------------------------------------------- the families

def _mergekit(name: str) -> Method:
    weight = 0.5 if name in ("linear", "slerp") else 1.0  # linear/slerp: the VLM's share; task vectors: their scale
    density = {"ties": 0.2, "dare_ties": 0.1, "dare_linear": 0.1}.get(name)  # the paper's (TIES keeps 20%, DARE drops 90%)
    defaults = {"weight": weight, **({"density": density} if name in _SPARSE_METHODS else {}), "select": None,
                **({"root": None} if name not in ("linear", "slerp") else {}), **dict.fromkeys(sorted(PASSTHROUGH_PARAMS))}

    def check(p: dict) -> None:
        validate_merge_args(name, p["weight"], p.get("density"), p.get("select"),
                            {k: v for k, v in p.items() if k in PASSTHROUGH_PARAMS}, p.get("root"))

    def run(out_dir, base, vlm, params, options, **kw):
        own = {k: params[k] for k in ("weight", "density", "select", "root") if k in params}
        run_mergekit_merge(name, base, vlm, out_dir, params={k: v for k, v in params.items() if k in PASSTHROUGH_PARAMS},
                           options=options, **own, **kw)

    return Method(name, "mergekit", defaults, check, ("interventions.merge", "interventions.outputs", "interventions.params"),
                  run, takes_root="root" in defaults, description="mergekit", versions=("mergekit",))


def _spectral(name: str) -> Method:
    alias = "alpha" if name == "tsv" else "lambda"
    own = {"k_fraction": None} if name == "tsv" else {"eta": 40.0}
    defaults = {"weight": None, **own, "select": None, "root": None, "device": "cpu"}

    def check(p: dict) -> None:
        validate_spectral_args(name, p.get("weight"), p.get("eta", 40.0), p.get("k_fraction"), p.get("select"), p["device"])

    def run(out_dir, base, vlm, params, options, **kw):
        run_spectral_merge(name, base, vlm, out_dir, **params, **kw)

    return Method(name, "spectral", defaults, check, ("interventions.spectral", "interventions.outputs", "interventions.params"),
                  run, takes_root=True, aliases={alias: "weight"}, description="spectral")


def _mitigation(m) -> Method:
    def check(p: dict) -> None:
        resolve_config(m, {k: v for k, v in p.items() if k != "texts"})
        _check_texts(p.get("texts"))

    def run(out_dir, base, vlm, params, options, **kw):
        own = {k: v for k, v in params.items() if k not in ("texts", "sink_maps")}
        run_mitigation(m.name, base, vlm, out_dir, params=own, sink_maps=params.get("sink_maps"), texts=params.get("texts"), **kw)

    return Method(m.name, "mitigation", {**m.defaults, "texts": None}, check, ("interventions.mitigations", "interventions.outputs"),
                  run, description=f"mitigation: {m.description}", source=lambda: source_hash(m))


SINK_DOSE = Method(sink_dose.NAME, "dose", sink_dose.DEFAULTS, sink_dose.check, sink_dose.CODE, sink_dose.run,
                   description=sink_dose.DESCRIPTION)


def _check_qknorm(p: dict) -> None:
    if p["init"] not in INIT_MODES:
        raise MergeError(f"qknorm init must be one of {', '.join(INIT_MODES)}, got {p['init']!r}")
    if p["trainable"] not in TRAINABLE_MODES:
        raise MergeError(f"qknorm trainable must be one of {', '.join(TRAINABLE_MODES)}, got {p['trainable']!r}")
    for key, low in (("train_steps", 0), ("batch_size", 1), ("seq_len", 2)):
        if isinstance(p[key], bool) or not isinstance(p[key], int) or p[key] < low:
            raise MergeError(f"qknorm {key} must be an integer >= {low}, got {p[key]!r}")
    for key, (lo, hi) in {"lr": (0.0, 1.0), "alpha": (0.0, 1.0)}.items():
        v = p[key]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not lo <= v <= hi or (key == "lr" and v == 0):
            raise MergeError(f"qknorm {key} must be a finite number in {'(' if key == 'lr' else '['}{lo}, {hi}], got {v!r}")
    if not isinstance(p["vl"], bool):
        raise MergeError(f"qknorm vl must be true or false, got {p['vl']!r}")


QKNORM = Method("qknorm", INJECTION,
                {"init": "scale-preserving", "alpha": 0.5, "train_steps": 0, "trainable": "gains", "lr": 1e-3, "batch_size": 8,
                 "seq_len": 128, "vl": False},
                _check_qknorm, ("interventions.qknorm", "interventions.qknorm_modes", *adapt_code.TRAINING),
                description="injection: QK-RMSNorm into the base (+ recovery training, + the study's VL recipe)")


def _check_texts(texts) -> None:
    if texts is None:
        return

    if isinstance(texts, (str, os.PathLike)) and Path(texts).is_file():
        read_text(texts, "texts file")  # a non-UTF-8 file fails here, named
    resolve_texts(texts, DEFAULT_SET)  # a missing file or an unknown set name fails here


def methods() -> dict[str, Method]:
    """Every method by name: mergekit's, the spectral ones, the sink dose, QK-norm injection, then the mitigations (plug-ins
    loaded by now included)."""
    table = {m.name: m for m in [*map(_mergekit, MERGEKIT_METHODS), *map(_spectral, SPECTRAL_METHODS), SINK_DOSE, QKNORM]}
    return table | {name: _mitigation(m) for name, m in list_mitigations().items() if name not in table}


def get_method(name: str) -> Method:
    table = methods()
    if name not in table:
        raise MergeError(f"unknown intervention {name!r}; known: {', '.join(table)}")
    return table[name]


def list_interventions() -> dict[str, str]:
    """name -> what it is, for the post-hoc methods (a change to the VLM's language model)."""
    return {name: m.description for name, m in methods().items() if m.family in POSTHOC}


def format_methods() -> str:
    """Every post-hoc intervention with its parameters and their defaults (a parameter without one: its name)."""
    lines = []
    for name, m in methods().items():
        if m.run is None:
            continue
        params = ", ".join(f"{k}={v!r}" if v is not None else k for k, v in m.defaults.items())
        lines += [f"  {name:<18} {m.description}", f"  {'':<18} parameters: {params}"]
    return "\n".join(lines)


def takes_root(name: str) -> bool:
    """Whether intervention `name` merges task vectors from a common ancestor (`root`)."""
    return get_method(name).takes_root


def validate_intervention(name: str, params: Mapping[str, Any] | None) -> dict[str, Any]:
    """Every parameter name and value of post-hoc intervention `name`, without reading any model: one line on
    error. Returns the settings with the method's defaults filled in."""
    method = get_method(name)
    if method.run is None:
        raise MergeError(f"{name} is not a post-hoc intervention ({method.description})")
    return method.resolve(params)


def execution_options(name: str, mergekit_options: Mapping[str, Any] | None) -> dict[str, bool] | None:
    """How intervention `name` runs (mergekit methods: cuda, lazy_unpickle, low_cpu_memory), checked
    without reading any model; None for the other methods, which refuse mergekit options in one line."""
    if name in MERGEKIT_METHODS:
        return check_mergekit_options(mergekit_options)
    given = [k for k, v in (mergekit_options or {}).items() if v]
    if given:
        raise MergeError(f"mergekit options ({', '.join(given)}) apply to mergekit methods, not {name}"
                         + ("; TSV and STAR take --param device=cuda" if name in SPECTRAL_METHODS else ""))
    return None


# --------------------------------------------------------------------------- identity

def request(name: str, params: Mapping[str, Any] | None, seed: int, models: Mapping[str, str], *,
            sink_maps: Any = None, mergekit_options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The identity of intervention `name` with `params` and `seed` on the models whose fingerprints `models`
    gives ({"base", "vlm"[, "root"]}); `sink_maps` as a mitigation reads them (their fingerprints, files or
    loaded maps: by content); `mergekit_options` as `apply_intervention` takes them (only `cuda` counts)."""
    method = get_method(name)
    params = validate_intervention(name, params)
    public = {k: (os.fspath(v) if isinstance(v, os.PathLike) else v) for k, v in sorted(params.items()) if k not in ("sink_maps", "root")}
    if public.get("select") is not None:
        public["select"] = str(public["select"])
    code = {"sinkstudy": module_code_version(*method.code), **{p: package_versions().get(p) for p in method.versions},
            **({"plugin": method.source()} if method.source else {})}
    out = {"name": name, "params": public, "seed": seed, "models": dict(models), "code": code}
    if method.family == "mergekit" and (mergekit_options or {}).get("cuda"):
        # mergekit on a GPU computes other numbers: its argsort breaks ties in |delta| at a TIES / magnitude
        # cut another way (fp16/bf16 weights tie often), DARE draws its drops from the CUDA generator.
        out["device"] = "cuda"
    texts = params.get("texts")
    if isinstance(texts, (str, os.PathLike)) and Path(texts).is_file():
        out["texts_sha256"] = file_digest(texts)
    if sink_maps:
        out["sink_maps_sha256"] = _digest(sink_maps)
    return out


def intervention_request(name: str, base, vlm, params: Mapping[str, Any] | None, seed: int = 0,
                         revisions: Mapping[str, str] | None = None,
                         mergekit_options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """`request` of intervention `name` on the models at these paths or hub ids; `revisions` ({"base" | "vlm" |
    "root": revision}) pins hub ids, whose fingerprints then name the revision."""
    params = dict(params or {})
    revisions = revisions or {}
    models = {"base": model_fingerprint(base, revisions.get("base")), "vlm": model_fingerprint(vlm, revisions.get("vlm"))}
    if params.get("root") is not None:
        models["root"] = model_fingerprint(params["root"], revisions.get("root"))
    return request(name, params, seed, models, sink_maps=params.get("sink_maps"), mergekit_options=mergekit_options)


def _digest(obj) -> str:
    """Content digest of sink maps given as fingerprints, JSON paths, loaded JSON, SinkMaps or tensors."""
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


def apply_intervention(
    name: str,
    base_path: str | os.PathLike,
    vlm_lm_path: str | os.PathLike,
    params: Mapping[str, Any] | None,
    out_dir: str | os.PathLike,
    *,
    seed: int = 0,
    replace: bool = False,
    progress: bool = True,
    mergekit_options: Mapping[str, Any] | None = None,
) -> Path:
    """Apply post-hoc intervention `name` (see `list_interventions`) to `out_dir` and return it, with its request in
    `intervention.json`; an existing `out_dir` is refused unless `replace` (whether an earlier result is reused is
    decided by the engine that runs this as a step: `experiments.study.pair_steps.Intervene`).

    `mergekit_options` (mergekit methods: cuda, lazy_unpickle, low_cpu_memory) say how mergekit runs,
    recorded in intervention.json; `cuda` also changes what it computes, so it is part of the request
    (a merge made on the CPU is not reused for a `cuda` one, nor the reverse).
    """
    method = get_method(name)
    resolved = validate_intervention(name, params)
    options = execution_options(name, mergekit_options)
    root = resolved.get("root")
    req = intervention_request(name, local_checkpoint(base_path), local_checkpoint(vlm_lm_path),
                               {**resolved, **({"root": local_checkpoint(root)} if root is not None else {})}, seed,
                               mergekit_options=options)
    method.run(out_dir, base_path, vlm_lm_path, resolved, options, seed=seed, replace=replace, progress=progress, request=req)
    return Path(out_dir)
