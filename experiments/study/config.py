"""Study configs: a YAML file says which pairs, which sink metric, which strict evals and which
interventions; `load_study` reads it into a typed `Study` (its sections dataclasses whose fields
carry their checks, `experiments.study.schema`), validated completely (one-line errors, before any work):
keys, names that become path components (slugs), every intervention's settings
(`experiments.study.methods`), task names, the sink metric and texts, and local inputs (model paths, data
files) that the study does not build itself. The schema, key by key: docs/study.md. That no two of
the study's steps write one output is a check on its plan (`experiments.study.pipeline.plan_study`).
"""

from __future__ import annotations

import copy
import dataclasses
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable

import yaml

from evals.protocol import DEFAULT_CONFIDENCE, DEFAULT_N_BOOT, EvalProtocol
from evals.sink.calibration import resolve_texts
from evals.task_names import check_task_names
from experiments.study.adapt_section import CONTROL_ARM, AdaptSection, Arm, parse_adapt  # noqa: F401  (part of this module's API)
from experiments.study.dose_section import parse_doses
from experiments.study.methods import check_method
from experiments.study.schema import (StudyConfigError, boolean, checked, deep_merge, fail, guarded, integer,  # noqa: F401
                                mapping, parse, relative_file, slug)
from sinkstudy import SinkstudyError
from sinkstudy.checkpoint import looks_like_path
from sinkstudy.inputs import inputs_checked
from sinkstudy.io import read_text
from sinkstudy.plugins import load_plugin

MODEL_ROLES = ("base", "vlm", "root")
BuildReader = Callable[[Any, str], Any]  # (a build section as written, where it is) -> what hands the plan its steps
PUBLISHED_KEYS = {"sink_strength", "ifeval_delta", "ifeval_base", "ifeval_vlm", "source"}


# --------------------------------------------------------------------------- field checks

def _must_map(value, where: str) -> dict:
    if not isinstance(value, dict):
        fail(where, "must be a mapping")
    return value


def _confidence(value, where: str) -> float:
    if not isinstance(value, float) or not 0 < value < 1:
        fail(where, f"must be a number in (0, 1), got {value!r}")
    return value


# --------------------------------------------------------------------------- sections

@dataclass
class Sink:
    """`sink:` how Sink Strength is measured (docs/sink.md)."""

    metric: str = "logodds"
    texts: Any = None  # a shipped calibration set's name or a file; None: the metric's own
    params: dict = checked(factory=dict, check=_must_map)
    options: dict = checked(factory=dict, check=_must_map)

    def check(self, where: str) -> None:
        # lazy: loads torch, numpy
        from evals.sink.metrics import get_metric

        guarded(get_metric, where, self.metric)


@dataclass
class Evals:
    """`evals:` the strict evals: the protocol (`evals.protocol.EvalProtocol`: every key but n_boot and
    confidence, each keying every eval step) and the bootstrap of the statistics."""

    protocol: EvalProtocol
    n_boot: int = DEFAULT_N_BOOT
    confidence: float = DEFAULT_CONFIDENCE


def _evals(raw, where: str) -> Evals:
    # its keys named once, plainly, each unknown one with the key it most likely misspells
    cfg = dict(mapping(raw, where, {f.name for f in dataclasses.fields(EvalProtocol)} | {"n_boot", "confidence"}))
    n_boot = integer(cfg.pop("n_boot", Evals.n_boot), f"{where}.n_boot", 100)
    confidence = _confidence(cfg.pop("confidence", Evals.confidence), f"{where}.confidence")
    try:
        protocol = EvalProtocol.build(cfg, name=lambda f: f"{where}.{f}")
    except SinkstudyError as exc:
        raise StudyConfigError(str(exc)) from None
    guarded(check_task_names, f"{where}.tasks", protocol.tasks)  # shipped names at once; others against lm-eval's (cached) index
    return Evals(protocol, n_boot, confidence)


@dataclass
class ModelSettings:
    """`model:` the dtype and device every model is loaded in."""

    dtype: str = checked("float32", lambda v, w: v if v in ("float32", "bfloat16", "float16") else
                         fail(w, f"must be float32, bfloat16 or float16, got {v!r}"))
    device: str | None = None


@dataclass
class ReportSettings:
    title: str | None = None
    notes: str | None = None
    # {title: report path}: related reports the report links to near its top (paths as `out` is written)
    see_also: dict = checked(factory=dict, check=lambda v, w: _see_also(v, w))


def _see_also(value, where: str) -> dict:
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) and v for k, v in value.items()):
        fail(where, f"a mapping of link titles to report paths, got {value!r}")
    return dict(value)


@dataclass
class Intervention:
    """One `interventions:` entry: a method of `experiments.study.methods` and its settings."""

    name: str
    method: str
    params: dict = field(default_factory=dict)
    notes: str | None = None


@dataclass
class Pair:
    """One (base LLM, VLM) pair; `revision` pins its hub ids ({role: commit})."""

    name: str
    base: str
    vlm: str
    root: str | None = None
    revision: dict = field(default_factory=dict)
    native_qk_norm: bool | None = None
    params_b: dict | None = None
    published: dict | None = None
    notes: str | None = None


def _checked_section(cls, raw, where: str):
    section = parse(cls, raw, where)
    if hasattr(section, "check"):
        section.check(where)
    return section


# --------------------------------------------------------------------------- the study

@dataclass
class Study:
    """A validated study config: `raw` as written, the other fields typed with defaults filled in."""

    path: Path | None
    raw: dict
    name: str
    out: Path
    seed: int
    keep_models: bool
    build: Any  # a build section (the demo's `experiments.demo.build.Build`): the steps that make its pairs; None
    pairs: list[Pair]
    sink: Sink
    evals: Evals
    interventions: list[Intervention]
    model: ModelSettings
    protocol: dict
    report: ReportSettings
    plugins: list = field(default_factory=list)  # the plug-ins loaded for this study (sinkstudy.plugins.Plugin)
    adapt: AdaptSection | None = None
    seeds: list[int] | None = None  # training seeds to repeat the study over (experiments.study.seeds); None: once
    dose: list = field(default_factory=list)  # the bases' sink doses (experiments.study.doses.Dose)
    build_reader: Any = None  # what read `build` (`validate`'s reader): a study repeated over seeds reads it again per seed

    def expand(self, value: str) -> str:
        return value.replace("{out}", os.fspath(self.out))

    def arms_of(self, pair: str) -> list[Arm]:
        """The adaptation arms that run on `pair` (the control arm first); none without an adapt section."""
        return [] if self.adapt is None else [a for a in self.adapt.arms if a.pairs is None or pair in a.pairs]


TOP_KEYS = {f.name for f in fields(Study)} - {"path", "raw", "build_reader"}
PAIR_KEYS = {f.name for f in fields(Pair)} | {f"{r}_revision" for r in MODEL_ROLES}  # <role>_revision: a form of `revision`
INTERVENTION_KEYS = {f.name for f in fields(Intervention)}


def model_dir(out: str | os.PathLike, *parts: str) -> Path:
    """OUT/models/<part>-<part>...: where the study's steps (and the demo build) put a checkpoint."""
    return Path(out) / "models" / "-".join(parts)


def load_study(path: str | os.PathLike, *, out: str | os.PathLike | None = None, overrides: dict | None = None,
               build: BuildReader | None = None) -> Study:
    """Read and validate a study YAML; `out` replaces its output dir, `overrides` are merged on top; `build` reads
    its build section (`validate`)."""
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
    return validate(raw, path=path, out=out, build=build)


def _seeds(raw, where: str) -> list[int] | None:
    """`seeds`: distinct training seeds (integers >= 0), at least two; None: the study runs once."""
    if raw is None:
        return None
    if not isinstance(raw, list) or len(raw) < 2:
        fail(where, f"a list of at least two training seeds, e.g. [0, 1, 2], got {raw!r}")
    seeds = [integer(x, where, 0) for x in raw]
    if len(set(seeds)) != len(seeds):
        fail(where, f"seeds must be distinct, got {raw!r}")
    return seeds


def validate(raw: Any, *, path: Path | None = None, out: str | os.PathLike | None = None, build: BuildReader | None = None) -> Study:
    """`raw` as a typed `Study`. A `build:` section (the steps that make the pairs) is read by `build`, handed over
    by what knows that section's kind (`experiments.demo.build.read_build` for the demo's): the study never imports it."""
    where = os.fspath(path) if path else "study config"
    cfg = mapping(raw, where, TOP_KEYS)
    name = slug(cfg.get("name"), f"{where}: name")
    out_dir = Path(out) if out is not None else Path(cfg.get("out") or f"runs/{name}")
    seed = integer(cfg.get("seed", 0), f"{where}: seed")
    keep_models = boolean(cfg.get("keep_models", True), f"{where}: keep_models")

    plugins = _load_plugins(cfg.get("plugins"), path, f"{where}: plugins")
    reader, build = build, cfg.get("build")
    if build is not None:
        if reader is None:
            fail(f"{where}: build", "no reader for a build section was given (sinkstudy run / demo read the demo's)")
        build = reader(build, f"{where}: build")
        for i, b in enumerate(build.backbones):
            slug(b["name"], f"{where}: build.backbones[{i}].name")

    pairs_raw = cfg.get("pairs")
    if pairs_raw is None and build is not None:
        pairs_raw = build.pair_entries()
    if not isinstance(pairs_raw, list) or not pairs_raw:
        fail(where, "pairs must be a non-empty list (or give a build section that makes them)")
    adapting = cfg.get("adapt") is not None
    pairs = _pairs(pairs_raw, where, out_dir, adapting=adapting, built=build is not None)

    sink = _checked_section(Sink, cfg.get("sink"), f"{where}: sink")
    evals = _evals(cfg.get("evals"), f"{where}: evals")
    interventions = _interventions(cfg.get("interventions") or [], path, where, vl=build is not None)
    model = _checked_section(ModelSettings, cfg.get("model"), f"{where}: model")
    protocol = cfg.get("protocol") or {}
    if not isinstance(protocol, dict):
        fail(f"{where}: protocol", "must be a mapping")
    report = parse(ReportSettings, cfg.get("report"), f"{where}: report")
    adapt = parse_adapt(cfg.get("adapt"), path, [p.name for p in pairs], f"{where}: adapt", out_dir) if adapting else None
    seeds = _seeds(cfg.get("seeds"), f"{where}: seeds")
    dose = []
    if cfg.get("dose") is not None:
        taken = {iv.name for iv in interventions} | {a.name for a in (adapt.arms if adapt else [])}
        dose = parse_doses(cfg["dose"], f"{where}: dose", sink.texts, taken, [p.name for p in pairs])
    study = Study(path, copy.deepcopy(raw), name, out_dir, seed, keep_models, build, pairs, sink, evals, interventions, model,
                  protocol, report, plugins, adapt, seeds, dose, reader)
    for p in study.pairs:
        for role in MODEL_ROLES:
            if isinstance(getattr(p, role), str):
                setattr(p, role, study.expand(getattr(p, role)))
    files = {t: study.expand(f) for t, f in study.evals.protocol.data_files.items()}
    study.evals.protocol = dataclasses.replace(study.evals.protocol, data_files=files)
    _check_local_inputs(study, where)
    return study


def _pairs(items: list, where: str, out_dir: Path, *, adapting: bool, built: bool) -> list[Pair]:
    pairs, seen = [], set()
    for i, p in enumerate(items):
        pw = f"{where}: pairs[{i}]"
        p = dict(mapping(p, pw, PAIR_KEYS))
        pname = slug(p.get("name"), f"{pw}.name")
        if pname in seen:
            fail(pw, f"duplicate pair name {pname!r}")
        seen.add(pname)
        if adapting:  # the study makes the pair's VLM: its control arm
            if p.get("vlm") is not None and not built:
                fail(pw, "with an adapt section the study makes each pair's VLM (its control arm): remove vlm")
            p["vlm"] = os.fspath(model_dir(out_dir, pname, CONTROL_ARM, "vlm"))
        for k in ("base", "vlm"):
            if not isinstance(p.get(k), str) or not p[k]:
                fail(pw, f"{k} must be a hub id or a path")
        mapping(p.get("published"), f"{pw}.published", PUBLISHED_KEYS)
        mapping(p.get("params_b"), f"{pw}.params_b", {"base", "vlm"})
        p["revision"] = _revisions(p, pw)
        pairs.append(Pair(**p))
    return pairs


def _revisions(p: dict, where: str) -> dict[str, str]:
    """{role: revision} of a pair's hub models, from `revision: {base, vlm, root}` and/or `<role>_revision`
    (one form per role); the pair keeps only the mapping."""
    out = dict(mapping(p.pop("revision", None), f"{where}.revision", set(MODEL_ROLES)))
    for role in MODEL_ROLES:
        key = f"{role}_revision"
        if key in p:
            if role in out:
                fail(where, f"{key} and revision.{role} both given; use one")
            out[role] = p.pop(key)
    for role, rev in out.items():
        if not isinstance(rev, str) or not rev.strip() or rev != rev.strip():
            fail(f"{where}.{role}_revision", f"must be a hub revision (commit, branch or tag), got {rev!r}")
        if not p.get(role):
            fail(where, f"{role}_revision given without a {role}")
    return out


def _interventions(items, path: Path | None, where: str, *, vl: bool) -> list[Intervention]:
    out, seen = [], set()
    for i, iv in enumerate(_expand_includes(items, path, f"{where}: interventions")):
        iw = f"{where}: interventions[{i}]"
        iv = dict(mapping(iv, iw, INTERVENTION_KEYS))
        iname = slug(iv.get("name"), f"{iw}.name")
        if iname in seen or iname in ("base", "vlm"):
            fail(iw, f"intervention name {iname!r} is a duplicate or reserved (base, vlm)")
        seen.add(iname)
        params = dict(mapping(iv.get("params"), f"{iw}.params"))
        resolved = check_method(iv.get("method"), params, iw, vl_recipe=vl)  # the method's defaults filled in
        out.append(Intervention(iname, iv["method"], resolved, iv.get("notes")))
    return out


def _local_input(study: Study, path: str) -> bool:
    """A path (not a hub id "org/name") that the study does not build itself (under OUT)."""
    p = Path(path).expanduser()
    looks_local = path.startswith((".", "/", "~")) or path.count("/") > 1 or p.exists()
    made = study.build is not None or study.adapt is not None  # the study writes these checkpoints under OUT
    built = made and (p.resolve() == Path(study.out).resolve() or Path(study.out).resolve() in p.resolve().parents)
    return looks_local and not built


def _check_local_inputs(study: Study, where: str) -> None:
    """Model paths, data files and calibration texts that must exist before the run starts (a plan reads none)."""
    if not inputs_checked():
        return
    for p in study.pairs:
        for k in MODEL_ROLES:
            v = getattr(p, k)
            if v and _local_input(study, v) and not Path(v).expanduser().exists():
                fail(where, f"pair {p.name}: {k} {v} does not exist")
        for k in p.revision:
            if looks_like_path(getattr(p, k)) or Path(getattr(p, k)).expanduser().exists():
                fail(where, f"pair {p.name}: {k}_revision pins a hub id, but {k} {getattr(p, k)} is a local path")
    for task, f in study.evals.protocol.data_files.items():
        if _local_input(study, f):
            guarded(lambda x: read_text(Path(x).expanduser(), f"evals.data_files.{task}"), where, f)
    if study.sink.texts is not None:
        # lazy: loads torch, numpy
        from evals.sink.metrics import get_metric

        guarded(lambda t: resolve_texts(t, get_metric(study.sink.metric).calibration), f"{where}: sink.texts", study.sink.texts)


# The shipped configs: an `include:` of a config copied elsewhere (real_pairs_template.yaml's paper_merges.yaml) is
# still found among them.
SHIPPED_CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def _include_file(value: str, path: Path | None) -> tuple[Path | None, list[Path]]:
    """(the file an `include:` names, or None; where it was looked for): as given (the working directory), beside the
    config, among the shipped configs."""
    given = Path(str(value)).expanduser()
    places = [given] if given.is_absolute() else [given, *([path.parent / given] if path else []), SHIPPED_CONFIGS / given]
    return next((f for f in places if f.is_file()), None), places


def _expand_includes(items, path: Path | None, where: str) -> list:
    """`{include: FILE}` entries are replaced by FILE's `points` (the merge-sweep format:
    name, method and the method's parameters in one mapping); FILE as given, beside the config or shipped."""
    if not isinstance(items, list):
        fail(where, "must be a list")
    out = []
    for item in items:
        if isinstance(item, dict) and set(item) == {"include"}:
            f, places = _include_file(item["include"], path)
            if f is None:
                fail(where, f"include {item['include']} not found; looked for {', '.join(map(str, dict.fromkeys(places)))} "
                            "(copy it beside the config, or give its path)")
            try:
                loaded = yaml.safe_load(read_text(f, "include"))
            except yaml.YAMLError:
                fail(where, f"include {item['include']} is not valid YAML")
            points = loaded.get("points") if isinstance(loaded, dict) else None
            if not isinstance(points, list):
                fail(where, f"include {item['include']} has no `points` list")
            out += [{"name": pt.get("name"), "method": pt.get("method"),
                     "params": {k: v for k, v in pt.items() if k not in ("name", "method")}} for pt in points]
        else:
            out.append(item)
    return out


def _load_plugins(value, path: Path | None, where: str) -> list:
    """Import the study's plug-ins (before its interventions and arms are validated)."""
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        fail(where, "must be a list of plug-in files or module names")
    try:
        return [load_plugin(v, base_dir=path.parent if path else None) for v in value]
    except SinkstudyError as exc:
        raise StudyConfigError(f"{where}: {exc}") from None
