"""Study configs: a YAML file says which pairs, which sink metric, which strict evals and which
interventions; `load_study` validates it completely (one-line errors, before any work) and fills
defaults: keys, names that become path components (slugs; no two outputs of the runner may share a
directory), every intervention's settings (`interventions.registry.validate_intervention`), task
names, the sink metric and texts, and local inputs (model paths, data files) that the study does
not build itself.

Schema (every key but `name` and `pairs`/`build` optional; unknown keys are errors):

    name: demo                      # used for the default output dir runs/<name>
    out: runs/demo                  # results; "{out}" in any path below expands to it
    seed: 0
    keep_models: true               # false: delete each intervention's checkpoint once measured
    build: {...}                    # the embedded demo only: build the pairs (experiments.demo)
    pairs:                          # derived from build.backbones when omitted
      - {name, base, vlm, root?, native_qk_norm?, params_b?: {base, vlm}, published?: {sink_strength, ifeval_delta},
         base_revision?, vlm_revision?, root_revision?}   # or revision: {base, vlm, root}: hub ids pinned to a commit
    sink: {metric: logodds, texts: null, params: {}, options: {}}
    evals: {tasks: [...], data_files: {task: path}, limit, batch_size (int | auto | auto:N), max_gen_toks,
            apply_chat_template, chat_template_kwargs: {...}, system_instruction, gen_kwargs: {...},
            num_fewshot, confirm_run_unsafe_code, backend: hf | hf-continuous | vllm, backend_args: {...}, n_boot, confidence}
    interventions:
      - {name: ties-0.2, method: ties, params: {weight: 1.0, density: 0.2}}
      - {name: qknorm, method: qknorm, params: {init: scale-preserving, train_steps: 0, vl: true}}
      - {include: paper_merges.yaml}   # a merge-sweep file's `points`
    plugins: [my_idea.py, my_pkg.ideas]   # plug-in files (relative: cwd, then the config's folder) or modules
    adapt:                          # VL adaptation arms made by the study (docs/protect.md); pairs then give no vlm:
      recipe: adapt/demo_digits.yaml  #   the control arm's VLM is the pair's VLM
      vision: tiny                  # tiny | {kind: tiny|fresh|donor, source, tiny: {...}, feature_layer}
      data: {stage1: [digits], stage2: [digits]}   # per stage (a list: every stage); default: the recipe's
      vl_eval: {heldout: 200}       # held-out digit accuracy of each arm's VLM (digits recipes); null: none
      arms:
        - {name: control}                       # no protection (added when missing)
        - {name: freeze, protection: freeze_below_sink, params: {threshold: 0.3}}
        - {name: mix, protections: [{name: text_replay, params: {...}}, {name: sink_head_freeze}], pairs: [p1]}
    model: {dtype: float32, device: null}
    protocol: {...}                 # free-form description (printed in reports)
    report: {title: ...}
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from experiments.schema import StudyConfigError, deep_merge  # noqa: F401  (both are part of this module's API)
from sinkstudy import SinkstudyError


TOP_KEYS = {"name", "out", "seed", "keep_models", "build", "pairs", "sink", "evals", "interventions", "model", "protocol", "report",
            "plugins", "adapt"}
ADAPT_KEYS = {"recipe", "vision", "data", "vl_eval", "arms"}
ARM_KEYS = {"name", "protection", "params", "protections", "pairs", "notes"}
VISION_KEYS = {"kind", "source", "tiny", "feature_layer"}
CONTROL_ARM = "control"
MODEL_ROLES = ("base", "vlm", "root")
PAIR_KEYS = {"name", *MODEL_ROLES, *(f"{r}_revision" for r in MODEL_ROLES), "revision", "native_qk_norm", "params_b",
             "published", "notes"}
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
    plugins: list = None  # the plug-ins loaded for this study (sinkstudy.plugins.Plugin)
    adapt: dict | None = None  # the adaptation arms, normalised (`_check_adapt`)

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
    """A name that becomes a path component (sinkstudy.io.check_slug)."""
    from sinkstudy.io import check_slug

    try:
        return check_slug(value, where)
    except SinkstudyError as exc:
        raise StudyConfigError(str(exc)) from None


def model_dir(out: str | os.PathLike, *parts: str) -> Path:
    """OUT/models/<part>-<part>...: where the runner (and the demo build) puts a checkpoint."""
    return Path(out) / "models" / "-".join(parts)


def load_study(path: str | os.PathLike, *, out: str | os.PathLike | None = None, overrides: dict | None = None) -> Study:
    """Read and validate a study YAML; `out` replaces its output dir, `overrides` are merged on top."""
    import yaml

    from sinkstudy.io import read_text

    path = Path(path)
    if not path.is_file():
        raise StudyConfigError(f"study config {path} does not exist")
    try:
        raw = yaml.safe_load(read_text(path, "study config"))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark else ""
        raise StudyConfigError(f"{path}: not valid YAML{where}") from None
    if overrides:
        raw = deep_merge(raw if isinstance(raw, dict) else {}, overrides)
        tasks, files = (overrides.get("evals") or {}).get("tasks"), (raw.get("evals") or {}).get("data_files")
        if tasks is not None and isinstance(files, dict):  # other tasks instead: their data files go with them
            names = {t.strip() for t in (tasks.split(",") if isinstance(tasks, str) else tasks)}
            raw["evals"]["data_files"] = {t: f for t, f in files.items() if t in names}
    return validate(raw, path=path, out=out)


def validate(raw: Any, *, path: Path | None = None, out: str | os.PathLike | None = None) -> Study:
    where = os.fspath(path) if path else "study config"
    cfg = _mapping(raw, where, TOP_KEYS)
    name = _name(cfg.get("name"), f"{where}: name")
    out_dir = Path(out) if out is not None else Path(cfg.get("out") or f"runs/{name}")
    seed = _int(cfg.get("seed", 0), f"{where}: seed")
    keep_models = cfg.get("keep_models", True)
    if not isinstance(keep_models, bool):
        _fail(f"{where}: keep_models", "must be true or false")

    plugins = _load_plugins(cfg.get("plugins"), path, f"{where}: plugins")
    build = cfg.get("build")
    if build is not None:
        from experiments.demo.build import validate_build

        build = validate_build(build, f"{where}: build")
        for i, b in enumerate(build["backbones"]):
            _name(b["name"], f"{where}: build.backbones[{i}].name")

    pairs_raw = cfg.get("pairs")
    if pairs_raw is None and build is not None:
        pairs_raw = [{"name": b["name"], "base": f"{{out}}/models/{b['name']}-base", "vlm": f"{{out}}/models/{b['name']}-vlm",
                      "native_qk_norm": b["native_qk_norm"]} for b in build["backbones"]]
    if not isinstance(pairs_raw, list) or not pairs_raw:
        _fail(where, "pairs must be a non-empty list (or give a build section that makes them)")
    adapting = cfg.get("adapt") is not None
    pairs, seen = [], set()
    for i, p in enumerate(pairs_raw):
        pw = f"{where}: pairs[{i}]"
        p = dict(_mapping(p, pw, PAIR_KEYS))
        pname = _name(p.get("name"), f"{pw}.name")
        if pname in seen:
            _fail(pw, f"duplicate pair name {pname!r}")
        seen.add(pname)
        if adapting:  # the study makes the pair's VLM: its control arm
            if p.get("vlm") is not None and build is None:
                _fail(pw, "with an adapt section the study makes each pair's VLM (its control arm): remove vlm")
            p["vlm"] = os.fspath(model_dir(out_dir, pname, CONTROL_ARM, "vlm"))
        for k in ("base", "vlm"):
            if not isinstance(p.get(k), str) or not p[k]:
                _fail(pw, f"{k} must be a hub id or a path")
        _mapping(p.get("published"), f"{pw}.published", PUBLISHED_KEYS)
        _mapping(p.get("params_b"), f"{pw}.params_b", {"base", "vlm"})
        p["revision"] = _revisions(p, pw)
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
    adapt = _check_adapt(cfg.get("adapt"), path, [p["name"] for p in pairs], f"{where}: adapt") if adapting else None
    study = Study(path, copy.deepcopy(raw), name, out_dir, seed, keep_models, build, pairs, sink, evals, interventions, model,
                  protocol, dict(report), plugins, adapt)
    for p in study.pairs:
        for k in MODEL_ROLES:
            if isinstance(p.get(k), str):
                p[k] = study.expand(p[k])
    study.evals["data_files"] = {t: study.expand(f) for t, f in study.evals["data_files"].items()}
    _check_outputs_distinct(study, where)
    _check_local_inputs(study, where)
    return study


def _revisions(p: dict, where: str) -> dict[str, str]:
    """{role: revision} of a pair's hub models, from `revision: {base, vlm, root}` and/or `<role>_revision`
    (one form per role); the pair keeps only the mapping."""
    out = dict(_mapping(p.pop("revision", None), f"{where}.revision", set(MODEL_ROLES)))
    for role in MODEL_ROLES:
        key = f"{role}_revision"
        if key in p:
            if role in out:
                _fail(where, f"{key} and revision.{role} both given; use one")
            out[role] = p.pop(key)
    for role, rev in out.items():
        if not isinstance(rev, str) or not rev.strip() or rev != rev.strip():
            _fail(f"{where}.{role}_revision", f"must be a hub revision (commit, branch or tag), got {rev!r}")
        if not p.get(role):
            _fail(where, f"{role}_revision given without a {role}")
    return out


def _check_outputs_distinct(study: Study, where: str) -> None:
    """No two things the runner writes may share a checkpoint dir or a result label (e.g. pair
    "a" with intervention "b-c" and pair "a-b" with intervention "c" both make models/a-b-c)."""
    owners: dict[Path, str] = {}

    def claim(path: Path, what: str) -> None:
        if path in owners:
            _fail(where, f"{what} and {owners[path]} would both write {path}; rename one")
        owners[path] = what

    for b in (study.build or {}).get("backbones", []):
        claim(model_dir(study.out, b["name"], "base"), f"backbone {b['name']}")
        claim(model_dir(study.out, b["name"], "vlm"), f"backbone {b['name']}")
    for p in study.pairs:
        claim(model_dir(study.out, p["name"], "vlm", "lm"), f"pair {p['name']}")
        labels = {"base", "vlm"}
        for arm in arms_of(study, p["name"]):
            what = f"pair {p['name']} arm {arm['name']}"
            claim(model_dir(study.out, p["name"], arm["name"], "vlm"), what)
            if arm["name"] != CONTROL_ARM:
                claim(model_dir(study.out, p["name"], arm["name"], "vlm", "lm"), what)
                if arm["name"] in labels:
                    _fail(where, f"{what}: result label {arm['name']!r} is used twice in pair {p['name']}")
                labels.add(arm["name"])
        for iv in study.interventions:
            what = f"pair {p['name']} intervention {iv['name']}"
            if iv["method"] == "qknorm":
                claim(model_dir(study.out, p["name"], iv["name"], "base"), what)
                mine = [iv["name"]]
                if iv["params"].get("vl"):
                    claim(model_dir(study.out, p["name"], iv["name"], "vlm"), what)
                    claim(model_dir(study.out, p["name"], iv["name"], "vlm", "lm"), what)
                    mine.append(f"{iv['name']}-vl")
            else:
                claim(model_dir(study.out, p["name"], iv["name"]), what)
                mine = [iv["name"]]
            clash = labels.intersection(mine)
            if clash:
                _fail(where, f"{what}: result label {sorted(clash)[0]!r} is used twice in pair {p['name']}")
            labels.update(mine)


def _local_input(study: Study, path: str) -> bool:
    """A path (not a hub id "org/name") that the study does not build itself (under OUT)."""
    p = Path(path).expanduser()
    looks_local = path.startswith((".", "/", "~")) or path.count("/") > 1 or p.exists()
    made = study.build is not None or study.adapt is not None  # the study writes these checkpoints under OUT
    built = made and (p.resolve() == Path(study.out).resolve() or Path(study.out).resolve() in p.resolve().parents)
    return looks_local and not built


def _check_local_inputs(study: Study, where: str) -> None:
    """Model paths, data files and calibration texts that must exist before the run starts."""
    from sinkstudy.checkpoint import looks_like_path

    for p in study.pairs:
        for k in MODEL_ROLES:
            v = p.get(k)
            if v and _local_input(study, v) and not Path(v).expanduser().exists():
                _fail(where, f"pair {p['name']}: {k} {v} does not exist")
        for k in p["revision"]:
            if looks_like_path(p[k]) or Path(p[k]).expanduser().exists():
                _fail(where, f"pair {p['name']}: {k}_revision pins a hub id, but {k} {p[k]} is a local path")
    for task, f in study.evals["data_files"].items():
        if _local_input(study, f):
            from sinkstudy.io import read_text

            try:
                read_text(Path(f).expanduser(), f"evals.data_files.{task}")
            except SinkstudyError as exc:
                _fail(where, str(exc))
    if study.sink["texts"] is not None:
        from evals.sink.calibration import resolve_texts
        from evals.sink.metrics import get_metric

        try:
            resolve_texts(study.sink["texts"], get_metric(study.sink["metric"]).calibration)
        except SinkstudyError as exc:
            _fail(f"{where}: sink.texts", str(exc))


def _expand_includes(items, path: Path | None, where: str) -> list:
    """`{include: FILE}` entries are replaced by FILE's `points` (the merge-sweep format:
    name, method and the method's parameters in one mapping), relative to the config's directory."""
    import yaml

    from sinkstudy.io import read_text

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
            try:
                loaded = yaml.safe_load(read_text(f, "include"))
            except yaml.YAMLError:
                _fail(where, f"include {item['include']} is not valid YAML")
            points = loaded.get("points") if isinstance(loaded, dict) else None
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
    from evals.lmeval import check_limit, check_task_names

    try:
        check_limit(ev["limit"])
    except SinkstudyError as exc:
        _fail(f"{where}.limit", str(exc))
    try:
        check_task_names(tasks)  # shipped names at once; others against lm-eval's (cached) index
    except SinkstudyError as exc:
        _fail(f"{where}.tasks", str(exc))
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
        _check_qknorm(iv["params"], f"{where}.params", has_build)
        return
    from interventions.registry import list_interventions, validate_intervention

    known = list_interventions()
    if method not in known:
        _fail(f"{where}.method", f"unknown method {method!r}; known: qknorm, {', '.join(sorted(known))}")
    try:
        validate_intervention(method, iv["params"])  # the pair's root is added by the runner where it applies
    except SinkstudyError as exc:
        _fail(f"{where}.params", str(exc))


def _check_qknorm(params: dict, where: str, has_build: bool) -> None:
    import math

    from interventions.qknorm import INIT_MODES, TRAINABLE_MODES

    unknown = sorted(set(params) - QKNORM_PARAMS)
    if unknown:
        _fail(where, f"qknorm has no parameter(s) {', '.join(unknown)}; it takes {', '.join(sorted(QKNORM_PARAMS))}")
    if params.get("vl") and not has_build:
        _fail(f"{where}.vl", "VL re-training after injection needs the demo's build section (the digits recipe)")
    if "init" in params and params["init"] not in INIT_MODES:
        _fail(f"{where}.init", f"must be one of {', '.join(INIT_MODES)}, got {params['init']!r}")
    if "trainable" in params and params["trainable"] not in TRAINABLE_MODES:
        _fail(f"{where}.trainable", f"must be one of {', '.join(TRAINABLE_MODES)}, got {params['trainable']!r}")
    if "train_steps" in params:
        _int(params["train_steps"], f"{where}.train_steps", 0)
    for key, (lo, hi) in {"lr": (0.0, 1.0), "alpha": (0.0, 1.0)}.items():
        v = params.get(key)
        if key in params and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
                              or not lo <= v <= hi or (key == "lr" and v == 0)):
            _fail(f"{where}.{key}", f"must be a finite number in {'(' if key == 'lr' else '['}{lo}, {hi}], got {v!r}")
    if "vl" in params and not isinstance(params["vl"], bool):
        _fail(f"{where}.vl", "must be true or false")


def arms_of(study: Study, pair: str) -> list[dict]:
    """The adaptation arms that run on `pair` (the control arm first); none without an adapt section."""
    if study.adapt is None:
        return []
    return [a for a in study.adapt["arms"] if a["pairs"] is None or pair in a["pairs"]]


def _relative_file(value: str, path: Path | None) -> Path:
    """A file named in a config: as given (cwd), else relative to the config's folder."""
    f = Path(value).expanduser()
    if not f.is_absolute() and not f.exists() and path is not None:
        f = path.parent / f
    return f


def _load_plugins(value, path: Path | None, where: str) -> list:
    """Import the study's plug-ins (before its interventions and arms are validated)."""
    from sinkstudy.plugins import load_plugin

    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        _fail(where, "must be a list of plug-in files or module names")
    try:
        return [load_plugin(v, base_dir=path.parent if path else None) for v in value]
    except SinkstudyError as exc:
        raise StudyConfigError(f"{where}: {exc}") from None


def _check_adapt(raw, path: Path | None, pair_names: list[str], where: str) -> dict:
    """The adapt section, normalised: the recipe as a mapping (data per stage in it), the vision spec,
    the VL probe and the arms (control first), every protection validated by its registry."""
    from interventions.adapt.build import VisionSpec
    from interventions.adapt.config import from_dict, load_config

    cfg = _mapping(raw, where, ADAPT_KEYS)
    recipe_raw = cfg.get("recipe")
    try:
        if isinstance(recipe_raw, str):
            recipe = load_config(_relative_file(recipe_raw, path))
        elif isinstance(recipe_raw, dict):
            recipe = from_dict(recipe_raw, where=f"{where}.recipe")
        else:
            _fail(f"{where}.recipe", "a recipe YAML (docs/adapt.md) or a mapping")
    except SinkstudyError as exc:
        raise StudyConfigError(f"{where}.recipe: {exc}") from None
    names = [s.name for s in recipe.stages]
    data = cfg.get("data")
    if data is not None:
        per_stage = {n: data for n in names} if isinstance(data, list) else _mapping(data, f"{where}.data", set(names))
        for stage, specs in per_stage.items():
            recipe.stage(stage).data = list(specs) if isinstance(specs, list) else [specs]
    from interventions.adapt.data import check_spec

    for stage in recipe.stages:
        if not stage.data:
            _fail(f"{where}.data", f"stage {stage.name} has no data")
        for spec in stage.data:
            try:
                check_spec(spec)
            except SinkstudyError as exc:
                _fail(f"{where}.data", str(exc))
    vision_raw = cfg.get("vision", "tiny")
    vision_raw = {"kind": vision_raw} if isinstance(vision_raw, str) else _mapping(vision_raw, f"{where}.vision", VISION_KEYS)
    try:
        vision = VisionSpec(**{**vision_raw, "seed": recipe.seed}).to_dict()
    except (SinkstudyError, TypeError) as exc:
        _fail(f"{where}.vision", str(exc))
    vl_eval = cfg.get("vl_eval", {"heldout": 200})
    if vl_eval is not None:
        vl_eval = {"heldout": 200, "seed": recipe.seed, **_mapping(vl_eval, f"{where}.vl_eval", {"heldout", "seed"})}
        _int(vl_eval["heldout"], f"{where}.vl_eval.heldout", 1)
        _int(vl_eval["seed"], f"{where}.vl_eval.seed")
        for stage in recipe.stages:  # the probe's images must be held out of every stage's digits
            for spec in stage.data:
                opts = {} if spec == "digits" else (spec.get("digits") or {}) if isinstance(spec, dict) and "digits" in spec else None
                if opts is None or opts.get("split", "train") != "train":
                    continue
                if vl_eval["heldout"] > opts.get("heldout", 200) or vl_eval["seed"] != opts.get("seed", recipe.seed):
                    _fail(f"{where}.vl_eval", f"the probe's {vl_eval['heldout']} images (seed {vl_eval['seed']}) must lie inside "
                                              f"stage {stage.name}'s held-out digits ({opts.get('heldout', 200)}, seed "
                                              f"{opts.get('seed', recipe.seed)})")
    arms = _check_arms(cfg.get("arms"), pair_names, names, f"{where}.arms")
    return {"recipe": recipe.to_dict(), "recipe_path": os.fspath(recipe_raw) if isinstance(recipe_raw, str) else None,
            "vision": vision, "vl_eval": vl_eval, "arms": arms}


def _check_arms(raw, pair_names: list[str], stage_names: list[str], where: str) -> list[dict]:
    from interventions.protect import validate_protection

    if not isinstance(raw, list) or not raw:
        _fail(where, "a non-empty list of arms ({name, protection, params} or {name, protections: [...]})")
    arms, seen = [], set()
    for i, a in enumerate(raw):
        aw = f"{where}[{i}]"
        a = _mapping(a, aw, ARM_KEYS)
        name = _name(a.get("name"), f"{aw}.name")
        if name in seen or name in ("base", "vlm"):
            _fail(aw, f"arm name {name!r} is a duplicate or reserved (base, vlm)")
        seen.add(name)
        if "protection" in a and "protections" in a:
            _fail(aw, "give protection (+ params) or protections, not both")
        if "protection" in a:
            items = [{"name": a["protection"], "params": a.get("params") or {}}]
        else:
            if "params" in a:
                _fail(aw, "params go with protection (one), or inside each entry of protections")
            items = a.get("protections") or []
        if not isinstance(items, list):
            _fail(f"{aw}.protections", "must be a list of {name, params}")
        protections = []
        for j, item in enumerate(items):
            pw = f"{aw}.protections[{j}]"
            item = {"name": item} if isinstance(item, str) else _mapping(item, pw, {"name", "params"})
            params = dict(_mapping(item.get("params"), f"{pw}.params", set(item.get("params") or {})))
            try:
                resolved = validate_protection(item.get("name"), params)
            except SinkstudyError as exc:
                _fail(pw, str(exc))
            unknown = [s for s in resolved["stages"] or () if s not in stage_names]
            if unknown:
                _fail(pw, f"stage(s) {', '.join(unknown)} not in the recipe ({', '.join(stage_names)})")
            protections.append({"name": item["name"], "params": params})
        if name == CONTROL_ARM and protections:
            _fail(aw, "the control arm takes no protection")
        if name != CONTROL_ARM and not protections:
            _fail(aw, f"arm {name!r} names no protection (only the control arm has none)")
        only = a.get("pairs")
        if only is not None:
            if not isinstance(only, list) or not only or any(p not in pair_names for p in only):
                _fail(f"{aw}.pairs", f"a non-empty list of pair names ({', '.join(pair_names)}), got {only!r}")
        arms.append({"name": name, "protections": protections, "pairs": only, "notes": a.get("notes")})
    if CONTROL_ARM not in seen:
        arms.insert(0, {"name": CONTROL_ARM, "protections": [], "pairs": None, "notes": None})
    else:
        control = next(a for a in arms if a["name"] == CONTROL_ARM)
        if control["pairs"] is not None:
            _fail(where, "the control arm runs on every pair (it makes the pair's VLM): remove its pairs")
        arms.remove(control)
        arms.insert(0, control)
    return arms
