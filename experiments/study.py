"""Study configs: a YAML file says which pairs, which sink metric, which strict evals and which
interventions; `load_study` validates it (one-line errors, before any work) and fills defaults.

Schema (every key but `name` and `pairs`/`build` optional; unknown keys are errors):

    name: demo                      # used for the default output dir runs/<name>
    out: runs/demo                  # results; "{out}" in any path below expands to it
    seed: 0
    keep_models: true               # false: delete each intervention's checkpoint once measured
    build: {...}                    # the embedded demo only: build the pairs (experiments.demo)
    pairs:                          # derived from build.backbones when omitted
      - {name, base, vlm, root?, native_qk_norm?, params_b?: {base, vlm}, published?: {sink_strength, ifeval_delta}}
    sink: {metric: logodds, texts: null, params: {}, options: {}}
    evals: {tasks: [...], data_files: {task: path}, limit, batch_size (int | auto | auto:N), max_gen_toks,
            apply_chat_template, chat_template_kwargs: {...}, system_instruction, gen_kwargs: {...},
            num_fewshot, confirm_run_unsafe_code, backend: hf | vllm, backend_args: {...}, n_boot, confidence}
    interventions:
      - {name: ties-0.2, method: ties, params: {weight: 1.0, density: 0.2}}
      - {name: qknorm, method: qknorm, params: {init: scale-preserving, train_steps: 0, vl: true}}
      - {include: paper_merges.yaml}   # a merge-sweep file's `points`
    model: {dtype: float32, device: null}
    protocol: {...}                 # free-form description (printed in reports)
    report: {title: ...}
"""

from __future__ import annotations

import copy
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sinkstudy import SinkstudyError


class StudyConfigError(SinkstudyError):
    pass


TOP_KEYS = {"name", "out", "seed", "keep_models", "build", "pairs", "sink", "evals", "interventions", "model", "protocol", "report"}
PAIR_KEYS = {"name", "base", "vlm", "root", "native_qk_norm", "params_b", "published", "notes"}
PUBLISHED_KEYS = {"sink_strength", "ifeval_delta", "ifeval_base", "ifeval_vlm", "source"}
SINK_KEYS = {"metric", "texts", "params", "options"}
EVAL_KEYS = {"tasks", "data_files", "limit", "batch_size", "max_gen_toks", "apply_chat_template", "num_fewshot",
             "n_boot", "confidence", "chat_template_kwargs", "system_instruction", "gen_kwargs", "confirm_run_unsafe_code",
             "backend", "backend_args"}
INTERVENTION_KEYS = {"name", "method", "params", "notes"}
QKNORM_PARAMS = {"init", "train_steps", "trainable", "lr", "vl", "alpha"}
MODEL_KEYS = {"dtype", "device"}
REPORT_KEYS = {"title", "notes"}

DEFAULT_SINK = {"metric": "logodds", "texts": None, "params": {}, "options": {}}
DEFAULT_EVALS = {"tasks": ["sinkstudy_ifeval", "sinkstudy_gsm"], "data_files": {}, "limit": None, "batch_size": 8,
                 "max_gen_toks": 256, "apply_chat_template": True, "num_fewshot": None, "n_boot": 2000,
                 "confidence": 0.95, "chat_template_kwargs": {}, "system_instruction": None, "gen_kwargs": {},
                 "confirm_run_unsafe_code": False, "backend": "hf", "backend_args": {}}
DEFAULT_MODEL = {"dtype": "float32", "device": None}
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


@dataclass
class Study:
    """A validated study config: `raw` as written, the other fields with defaults filled in."""

    path: Path | None
    raw: dict
    name: str
    out: Path
    seed: int
    keep_models: bool
    build: dict | None
    pairs: list[dict]
    sink: dict
    evals: dict
    interventions: list[dict]
    model: dict
    protocol: dict
    report: dict

    def expand(self, value: str) -> str:
        return value.replace("{out}", os.fspath(self.out))


def _fail(where: str, msg: str):
    raise StudyConfigError(f"{where}: {msg}")


def _mapping(value, where: str, allowed: set[str]) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        _fail(where, f"must be a mapping, got {type(value).__name__}")
    unknown = sorted(set(value) - allowed)
    if unknown:
        _fail(where, f"unknown key(s) {', '.join(map(str, unknown))}; allowed: {', '.join(sorted(allowed))}")
    return value


def _int(value, where: str, minimum: int = 0, allow_none: bool = False):
    if value is None and allow_none:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        _fail(where, f"must be an integer >= {minimum}, got {value!r}")
    return value


def _name(value, where: str) -> str:
    if not isinstance(value, str) or not _NAME.match(value):
        _fail(where, f"must be a name of letters, digits, '.', '_' or '-', got {value!r}")
    return value


def load_study(path: str | os.PathLike, *, out: str | os.PathLike | None = None, overrides: dict | None = None) -> Study:
    """Read and validate a study YAML; `out` replaces its output dir, `overrides` are merged on top."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise StudyConfigError(f"study config {path} does not exist")
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark else ""
        raise StudyConfigError(f"{path}: not valid YAML{where}") from None
    if overrides:
        raw = deep_merge(raw if isinstance(raw, dict) else {}, overrides)
    return validate(raw, path=path, out=out)


def deep_merge(a: dict, b: dict) -> dict:
    """`b` merged into a copy of `a` (nested mappings merged, everything else replaced)."""
    out = copy.deepcopy(a)
    for k, v in b.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


def validate(raw: Any, *, path: Path | None = None, out: str | os.PathLike | None = None) -> Study:
    where = os.fspath(path) if path else "study config"
    cfg = _mapping(raw, where, TOP_KEYS)
    name = _name(cfg.get("name"), f"{where}: name")
    out_dir = Path(out) if out is not None else Path(cfg.get("out") or f"runs/{name}")
    seed = _int(cfg.get("seed", 0), f"{where}: seed")
    keep_models = cfg.get("keep_models", True)
    if not isinstance(keep_models, bool):
        _fail(f"{where}: keep_models", "must be true or false")

    build = cfg.get("build")
    if build is not None:
        from experiments.demo.build import validate_build

        build = validate_build(build, f"{where}: build")

    pairs_raw = cfg.get("pairs")
    if pairs_raw is None and build is not None:
        pairs_raw = [{"name": b["name"], "base": f"{{out}}/models/{b['name']}-base", "vlm": f"{{out}}/models/{b['name']}-vlm",
                      "native_qk_norm": b["family"] in ("qwen3",)} for b in build["backbones"]]
    if not isinstance(pairs_raw, list) or not pairs_raw:
        _fail(where, "pairs must be a non-empty list (or give a build section that makes them)")
    pairs, seen = [], set()
    for i, p in enumerate(pairs_raw):
        pw = f"{where}: pairs[{i}]"
        p = dict(_mapping(p, pw, PAIR_KEYS))
        pname = _name(p.get("name"), f"{pw}.name")
        if pname in seen:
            _fail(pw, f"duplicate pair name {pname!r}")
        seen.add(pname)
        for k in ("base", "vlm"):
            if not isinstance(p.get(k), str) or not p[k]:
                _fail(pw, f"{k} must be a hub id or a path")
        _mapping(p.get("published"), f"{pw}.published", PUBLISHED_KEYS)
        _mapping(p.get("params_b"), f"{pw}.params_b", {"base", "vlm"})
        pairs.append(p)

    sink = {**DEFAULT_SINK, **_mapping(cfg.get("sink"), f"{where}: sink", SINK_KEYS)}
    _check_sink(sink, f"{where}: sink")
    evals = {**DEFAULT_EVALS, **_mapping(cfg.get("evals"), f"{where}: evals", EVAL_KEYS)}
    _check_evals(evals, f"{where}: evals")

    interventions, seen = [], set()
    for i, iv in enumerate(_expand_includes(cfg.get("interventions") or [], path, f"{where}: interventions")):
        iw = f"{where}: interventions[{i}]"
        iv = dict(_mapping(iv, iw, INTERVENTION_KEYS))
        iname = _name(iv.get("name"), f"{iw}.name")
        if iname in seen or iname in ("base", "vlm"):
            _fail(iw, f"intervention name {iname!r} is a duplicate or reserved (base, vlm)")
        seen.add(iname)
        iv["params"] = dict(_mapping(iv.get("params"), f"{iw}.params", set(iv.get("params") or {})))
        _check_method(iv, iw, build is not None)
        interventions.append(iv)

    model = {**DEFAULT_MODEL, **_mapping(cfg.get("model"), f"{where}: model", MODEL_KEYS)}
    if model["dtype"] not in ("float32", "bfloat16", "float16"):
        _fail(f"{where}: model.dtype", f"must be float32, bfloat16 or float16, got {model['dtype']!r}")
    protocol = cfg.get("protocol") or {}
    if not isinstance(protocol, dict):
        _fail(f"{where}: protocol", "must be a mapping")
    report = _mapping(cfg.get("report"), f"{where}: report", REPORT_KEYS)
    study = Study(path, copy.deepcopy(raw), name, out_dir, seed, keep_models, build, pairs, sink, evals, interventions, model,
                  protocol, dict(report))
    for p in study.pairs:
        for k in ("base", "vlm"):
            p[k] = study.expand(p[k])
    study.evals["data_files"] = {t: study.expand(f) for t, f in study.evals["data_files"].items()}
    return study


def _expand_includes(items, path: Path | None, where: str) -> list:
    """`{include: FILE}` entries are replaced by FILE's `points` (the merge-sweep format:
    name, method and the method's parameters in one mapping), relative to the config's directory."""
    import yaml

    if not isinstance(items, list):
        _fail(where, "must be a list")
    out = []
    for item in items:
        if isinstance(item, dict) and set(item) == {"include"}:
            f = Path(item["include"])
            if not f.is_absolute() and path is not None and not f.exists():
                f = path.parent / f
            if not f.is_file():
                _fail(where, f"include {item['include']} does not exist")
            points = (yaml.safe_load(f.read_text(encoding="utf-8")) or {}).get("points")
            if not isinstance(points, list):
                _fail(where, f"include {item['include']} has no `points` list")
            out += [{"name": pt.get("name"), "method": pt.get("method"),
                     "params": {k: v for k, v in pt.items() if k not in ("name", "method")}} for pt in points]
        else:
            out.append(item)
    return out


def _check_sink(sink: dict, where: str) -> None:
    from evals.sink.metrics import get_metric

    try:
        get_metric(sink["metric"])
    except SinkstudyError as exc:
        _fail(where, str(exc))
    for k in ("params", "options"):
        if not isinstance(sink[k], dict):
            _fail(f"{where}.{k}", "must be a mapping")


def _check_evals(ev: dict, where: str) -> None:
    tasks = ev["tasks"]
    if isinstance(tasks, str):
        tasks = ev["tasks"] = [t.strip() for t in tasks.split(",") if t.strip()]
    if not isinstance(tasks, list) or not tasks or not all(isinstance(t, str) for t in tasks):
        _fail(f"{where}.tasks", "must be a non-empty list of lm-eval task names")
    if not isinstance(ev["data_files"], dict):
        _fail(f"{where}.data_files", "must be a mapping {task: jsonl path}")
    extra = sorted(set(ev["data_files"]) - set(tasks))
    if extra:
        _fail(f"{where}.data_files", f"names task(s) not in tasks: {', '.join(extra)}")
    _protocol(ev, where)
    _int(ev["max_gen_toks"], f"{where}.max_gen_toks", 1, allow_none=True)
    _int(ev["num_fewshot"], f"{where}.num_fewshot", 0, allow_none=True)
    _int(ev["n_boot"], f"{where}.n_boot", 100)
    if ev["limit"] is not None and (not isinstance(ev["limit"], (int, float)) or isinstance(ev["limit"], bool) or ev["limit"] <= 0):
        _fail(f"{where}.limit", f"must be a positive number or null, got {ev['limit']!r}")
    if not isinstance(ev["apply_chat_template"], bool):
        _fail(f"{where}.apply_chat_template", "must be true or false")
    if not isinstance(ev["confidence"], float) or not 0 < ev["confidence"] < 1:
        _fail(f"{where}.confidence", f"must be a number in (0, 1), got {ev['confidence']!r}")


def _protocol(ev: dict, where: str) -> None:
    """The eval-protocol keys, checked by the same functions the CLI uses (evals.protocol)."""
    from evals import protocol

    checks = {"batch_size": protocol.check_batch_size, "system_instruction": protocol.check_system_instruction,
              "gen_kwargs": protocol.check_gen_kwargs, "backend_args": protocol.check_backend_args,
              "chat_template_kwargs": lambda v: protocol.check_mapping(v, "chat template kwargs")}
    for key, check in checks.items():
        try:
            ev[key] = check(ev[key])
        except SinkstudyError as exc:
            _fail(f"{where}.{key}", str(exc))
    if ev["backend"] not in protocol.BACKENDS:  # installed or not is checked when a run starts, not by --plan
        _fail(f"{where}.backend", f"must be one of {', '.join(protocol.BACKENDS)}, got {ev['backend']!r}")
    if not isinstance(ev["confirm_run_unsafe_code"], bool):
        _fail(f"{where}.confirm_run_unsafe_code", "must be true or false")


def _check_method(iv: dict, where: str, has_build: bool) -> None:
    method = iv.get("method")
    if method == "qknorm":
        unknown = sorted(set(iv["params"]) - QKNORM_PARAMS)
        if unknown:
            _fail(f"{where}.params", f"qknorm has no parameter(s) {', '.join(unknown)}; it takes {', '.join(sorted(QKNORM_PARAMS))}")
        if iv["params"].get("vl") and not has_build:
            _fail(f"{where}.params.vl", "VL re-training after injection needs the demo's build section (the digits recipe)")
        return
    from interventions.registry import list_interventions

    known = list_interventions()
    if method not in known:
        _fail(f"{where}.method", f"unknown method {method!r}; known: qknorm, {', '.join(sorted(known))}")
