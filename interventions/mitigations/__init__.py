"""Plug-in registry of mitigations: `(base, vlm_lm, sink_maps, config) -> model`.

A mitigation is a function registered by name; `run_mitigation` does everything around it (checks,
loading the pair, sink maps when it needs them, atomic output with `intervention.json`), so a new
idea is one small function:
    from interventions.mitigations import register_mitigation

    @register_mitigation("scale_sink_heads", defaults={"factor": 1.5}, needs_sink_maps=True)
    def scale_sink_heads(base, vlm_lm, sink_maps, config):
        ...                      # change vlm_lm (a loaded causal LM) in place
        return vlm_lm            # or (vlm_lm, {"json-able": "report"})

Modules inside this package are imported on first use, so a file dropped here registers itself.
`sink_maps` is {"base": SinkMaps, "vlm": SinkMaps, "shift": evals.sink.sink_shift(...)} (None
unless `needs_sink_maps`); `config` is the defaults updated with the user's parameters (every
number must be finite; `validate` checks the rest).

Mitigations may also live outside the package: a file or module loaded with `--plugin` (or a study's
`plugins:`), or a module named in the `sinkstudy.plugins` entry-point group, loaded at the registry's
first use (`sinkstudy.plugins`). A plug-in's source (`source_hash`: the files defining `fn` and
`validate`) is part of the identity of every model it makes
(`interventions.registry.intervention_request`): editing it re-runs the interventions it produced
instead of reusing them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from interventions.outputs import (check_disk_space, check_finite_model, check_pair, estimate_output_bytes,
                                   language_model_of, side_files, write_result)
from interventions.pairs import load_causal_lm
from sinkstudy import SinkstudyError
from sinkstudy.checkpoint import local_checkpoint
from sinkstudy.io import atomic_output_dir, check_output_dir, write_json_atomic
from sinkstudy.plugins import Registry, source_hash as plugin_source_hash


class MitigationError(SinkstudyError):
    pass


@dataclass(frozen=True)
class Mitigation:
    name: str
    fn: Callable[..., Any]
    defaults: dict[str, Any] = field(default_factory=dict)
    needs_sink_maps: bool = False
    description: str = ""
    validate: Callable[[dict[str, Any]], None] | None = None  # raises on bad config, before any loading


_PLUGINS = Registry("mitigation", __name__, MitigationError, key=lambda m: m.fn)
_REGISTRY = _PLUGINS.items


def register_mitigation(name: str, *, defaults: Mapping[str, Any] | None = None, needs_sink_maps: bool = False,
                        description: str | None = None, validate: Callable[[dict[str, Any]], None] | None = None):
    """Decorator: register `fn(base, vlm_lm, sink_maps, config) -> model` under `name`.

    `validate(config)`, optional, raises a one-line error for bad values before anything loads.
    """
    def wrap(fn):
        doc = (fn.__doc__ or "").strip().splitlines()
        _PLUGINS.add(name, Mitigation(name, fn, dict(defaults or {}), needs_sink_maps, description or (doc[0] if doc else ""),
                                      validate))
        return fn

    return wrap


def list_mitigations() -> dict[str, Mitigation]:
    """The package's mitigations, then the `sinkstudy.plugins` entry points' (loaded once per process)."""
    return _PLUGINS.all()


def get_mitigation(name: str) -> Mitigation:
    return _PLUGINS.get(name)


def resolve_config(mitigation: Mitigation, params: Mapping[str, Any] | None) -> dict[str, Any]:
    """Defaults updated by `params`; unknown keys are an error (typos must not pass silently)."""
    return _PLUGINS.resolve(mitigation.name, mitigation.defaults, params, mitigation.validate)


def source_hash(mitigation: Mitigation) -> str:
    """sha256 of the source files that define the plug-in (its function and validator); of the
    compiled code where there is no file (a function defined interactively)."""
    return plugin_source_hash(mitigation.fn, mitigation.validate)


def compute_pair_sink_maps(base_model, vlm_model, tokenizer, *, texts=None, progress: bool = True) -> dict[str, Any]:
    """Sink maps of both models on the same calibration texts, and their shift."""
    # lazy: loads torch, numpy
    from evals.sink import compute_sink_maps, sink_shift

    maps_b = compute_sink_maps(base_model, tokenizer, texts, progress=progress)
    maps_v = compute_sink_maps(vlm_model, tokenizer, texts, progress=progress)
    return {"base": maps_b, "vlm": maps_v, "shift": sink_shift(maps_b, maps_v)}


def _sink_maps_arg(sink_maps: Mapping[str, Any]) -> dict[str, Any]:
    """Accept {"base", "vlm"} as SinkMaps or JSON paths (the shift is added), or a ready dict."""
    # lazy: loads torch, numpy
    from evals.sink import SinkMaps, sink_shift

    out = dict(sink_maps)
    for k in ("base", "vlm"):
        if isinstance(out.get(k), (str, os.PathLike, dict)):  # JSON file or its loaded content
            out[k] = SinkMaps.from_json(out[k])
    if "shift" not in out:
        if not (isinstance(out.get("base"), SinkMaps) and isinstance(out.get("vlm"), SinkMaps)):
            raise MitigationError("sink_maps needs 'base' and 'vlm' sink maps (or a precomputed 'shift')")
        out["shift"] = sink_shift(out["base"], out["vlm"])
    return out


def run_mitigation(
    name: str,
    base: str | os.PathLike,
    vlm: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    params: Mapping[str, Any] | None = None,
    sink_maps: Mapping[str, Any] | None = None,
    texts=None,
    seed: int = 0,
    replace: bool = False,
    progress: bool = True,
    request: dict[str, Any] | None = None,
) -> Path:
    """Apply a registered mitigation to (base, VLM LM) and save the resulting causal LM to `out_dir`.

    Checks (name, parameters, pair layout, disk, existing output) run before any loading. Sink maps
    are computed on `texts` (default: the metric's calibration set) when the mitigation needs them
    and none are given; both maps are saved beside the model for reuse. A model with non-finite
    values is refused before anything is written. `request` goes into `intervention.json`.
    """
    # lazy: loads torch, numpy
    import torch

    mitigation = get_mitigation(name)
    config = resolve_config(mitigation, params)
    out_dir = check_output_dir(out_dir, replace)
    base_dir = local_checkpoint(base)
    with language_model_of(base_dir, vlm, out_dir) as vlm_lm:
        check_pair(base_dir, vlm_lm)
        check_disk_space(out_dir, estimate_output_bytes(vlm_lm))
        torch.manual_seed(seed)
        base_model, tokenizer = load_causal_lm(base_dir, dtype=torch.float32)
        vlm_model, _ = load_causal_lm(vlm_lm, dtype=torch.float32)
        maps = None
        if mitigation.needs_sink_maps:
            maps = _sink_maps_arg(sink_maps) if sink_maps else compute_pair_sink_maps(base_model, vlm_model, tokenizer, texts=texts, progress=progress)
        with torch.no_grad():
            result = mitigation.fn(base_model, vlm_model, maps, config)
        model, report = result if isinstance(result, tuple) else (result, {})
        check_finite_model(model)
        with atomic_output_dir(out_dir, replace) as tmp:
            model.save_pretrained(tmp)
            model_files = side_files(tmp)
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp)
            if maps is not None:
                for k in ("base", "vlm"):
                    if hasattr(maps.get(k), "to_json"):
                        write_json_atomic(tmp / f"sink_maps_{k}.json", maps[k].to_json())
            saved_tokenizer = set(side_files(tmp)) - set(model_files)
            files = {f: ("base LLM tokenizer" if f in saved_tokenizer else "VLM LM (the mitigated model)") for f in side_files(tmp)}
            write_result(tmp, method=name, base=base, vlm=vlm, vlm_lm=vlm_lm, root=None, seed=seed,
                         settings=config, extra={"report": report, "plugin": source_hash(mitigation),
                                                 "files": {"weights": f"mitigation {name}", **files},
                                                 **({"request": request} if request else {})})
    return out_dir
