"""A grid of merges on one (base LLM, VLM) pair (`sinkstudy merge-sweep`): the sweep config (`load_sweep`,
`spread`), then every point through `experiments.study.treat` (one plan, the engine's reuse), the plan
printed before any work, and the sweep's summary, table and Pareto plot (`experiments.report.treatments`).

A sweep YAML has `grid` entries, whose list-valued keys expand as a cartesian product, and/or named
`points`; `root` (a common pretrained ancestor for the task-vector methods), `seed` and `keep_models`
apply to every point.
"""

from __future__ import annotations

import itertools
import json
import statistics
import time
from pathlib import Path
from typing import Any, Mapping

import yaml

from experiments.report.fmt import format_duration
from experiments.report.treatments import format_plan, format_sweep, plot_pareto
from experiments.study.treat import GROUP, Treatment, run_treatments
from interventions.merge import MERGEKIT_METHODS
from interventions.registry import list_interventions, takes_root, validate_intervention
from sinkstudy import SinkstudyError
from sinkstudy.checkpoint import local_checkpoint
from sinkstudy.io import check_slug, read_text, write_json_atomic, write_text_atomic
from sinkstudy.provenance import provenance


def load_sweep(path: str | Path) -> dict[str, Any]:
    """Read and validate a sweep YAML: `grid` entries expand list-valued keys (cartesian product),
    `points` are named single settings; returns {"points": [{"name", "method", **params}], ...settings}.
    Point names (path components) must be slugs; every point's settings are validated (with the
    sweep's `root` where the method takes one) before any work."""
    p = Path(path)
    try:
        cfg = yaml.safe_load(read_text(p, "sweep config")) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        raise SinkstudyError(f"{p}: not valid YAML{f' (line {mark.line + 1})' if mark else ''}") from None
    if not isinstance(cfg, dict):
        raise SinkstudyError(f"{p}: a sweep config is a mapping with grid and/or points")
    points = []
    for entry in cfg.get("grid") or []:
        if not isinstance(entry, dict) or "method" not in entry:
            raise SinkstudyError(f"{p}: grid entry without a method: {entry}")
        keys = [k for k in entry if k != "method"]
        values = [v if isinstance(v, list) else [v] for v in (entry[k] for k in keys)]
        for combo in itertools.product(*values):
            params = dict(zip(keys, combo))
            name = "-".join([entry["method"]] + [f"{k[0]}{v}" for k, v in params.items()])
            points.append({"name": name, "method": entry["method"], **params})
    for entry in cfg.get("points") or []:
        if not isinstance(entry, dict) or "method" not in entry or "name" not in entry:
            raise SinkstudyError(f"{p}: a point needs a name and a method: {entry}")
        points.append(dict(entry))
    names = [pt["name"] for pt in points]
    if len(set(names)) != len(names):
        raise SinkstudyError(f"{p}: duplicate point names")
    if not points:
        raise SinkstudyError(f"{p}: no grid or points")
    known = list_interventions()
    root = cfg.get("root")
    for pt in points:
        check_slug(pt["name"], f"{p}: point name")
        if pt["method"] not in known:
            raise SinkstudyError(f"{p}: point {pt['name']}: unknown method {pt['method']!r}")
        try:
            validate_intervention(pt["method"], point_params(pt, root if takes_root(pt["method"]) else None))
        except SinkstudyError as exc:
            raise SinkstudyError(f"{p}: point {pt['name']}: {exc}") from None
    return {**{k: v for k, v in cfg.items() if k not in ("grid", "points")}, "points": points}


def spread(points: list, n: int | None) -> list:
    """`n` of `points` evenly spread over their order (first and last included); all when n is None
    or covers them. Deterministic: the same grid and n always give the same points."""
    if n is None or n >= len(points):
        return list(points)
    if n == 1:
        return [points[(len(points) - 1) // 2]]
    step = (len(points) - 1) / (n - 1)  # >= 1: the picked indices are distinct and increasing
    return [points[int(i * step + 0.5)] for i in range(n)]


def point_params(pt: dict[str, Any], root=None) -> dict[str, Any]:
    return {k: v for k, v in pt.items() if k not in ("name", "method")} | ({"root": root} if root is not None else {})


def run_sweep(sweep_file: str | Path, base: str, vlm: str, out: Path, m, *, max_points: int | None, mergekit: dict, seed: int,
              n_boot: int, confidence: float, tokenizer: str | None = None, captions: str | None = None, force: bool = False,
              progress: bool = True, say=print, sharing: Mapping[str, Any] | None = None) -> dict:
    """Every point of the sweep (`max_points` of them evenly spread) treated and measured, the plan said first;
    summary.json, summary.md and pareto.png written in `out`. Returns {"rows", "points", "total", "reused"}."""
    sweep = load_sweep(sweep_file)  # every point valid before any work
    points = spread(sweep["points"], max_points)
    seed = sweep.get("seed", seed)
    root = str(local_checkpoint(sweep["root"])) if sweep.get("root") else None
    treatments = [Treatment(pt["name"], pt["method"], point_params(pt), mergekit if pt["method"] in MERGEKIT_METHODS else {})
                  for pt in points]
    reused: set[str] = set()
    started = time.perf_counter()

    def announce(engine, tp) -> None:
        reused.update(name for name, steps in tp.points.items() if all(engine.finished(s) for s in steps.values()))
        say(format_plan(points, len(sweep["points"]), reused, _recorded_seconds(engine, tp)))

    def on_done(step_id: str, seconds: float, was_reused: bool) -> None:
        todo = len(points) - len(reused)
        if step_id == f"{GROUP}/eval/vlm" and todo and not was_reused:
            ref_seconds = time.perf_counter() - started
            say(f"references measured in {format_duration(ref_seconds)}: estimated time {todo} × ~{format_duration(ref_seconds / 2)} "
                f"≈ {format_duration(todo * ref_seconds / 2)} (merges not included)")

    done = run_treatments(base, vlm, treatments, out, m, seed=seed, n_boot=n_boot, confidence=confidence, force=force,
                          progress=progress, before=announce, on_done=on_done, say=say, sharing=sharing, tokenizer=tokenizer, root=root,
                          captions=captions, keep_models=sweep.get("keep_models", True))
    rows = []
    for pt in points:
        row = done["measured"][pt["name"]]
        rows.append({"name": pt["name"], "method": pt["method"],
                     "params": {k: str(v) if k == "root" else v for k, v in point_params(pt, root).items()}, **row})
    write_json_atomic(out / "summary.json", {
        "sweep": str(sweep_file), "points": rows,
        "provenance": provenance(seed=seed, tasks=list(m.protocol.tasks), limit=m.protocol.limit, n_boot=n_boot),
    })
    write_text_atomic(out / "summary.md", format_sweep(rows))
    plot_pareto(rows, out / "pareto.png")
    return {"rows": rows, "points": points, "total": len(sweep["points"]), "reused": reused}


def _recorded_seconds(engine, tp) -> float | None:
    """Mean time of a point finished before in this sweep directory (the sum of its steps' recorded seconds)."""
    times = []
    for steps in tp.points.values():
        try:
            times.append(sum(json.loads(engine.record_path(s).read_text(encoding="utf-8"))["seconds"] for s in steps.values()))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return statistics.mean(times) if times else None
