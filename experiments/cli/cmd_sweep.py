"""`sinkstudy merge-sweep`: run and measure a grid of merges on one (base LLM, VLM) pair, with
recovery CIs per point, a summary table and a Pareto plot (text recovery vs VL-side proxies)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from experiments.cli import argtypes
from experiments.cli.cmd_merge import (
    RECOVERY_CONVENTION,
    Measure,
    check_measure_args,
    check_pair_args,
    default_out,
    digest,
    measure_args,
    mergekit_args,
    mergekit_options,
    pair_args,
    weight_distance,
)
from experiments.report.fmt import ci_text, num
from experiments.cli.closing import Summary, cmd, existing, format_duration
from sinkstudy.io import reusable_json

DEFAULT_SWEEP_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "merge_sweep.yaml"


def register(subparsers) -> None:
    s = subparsers.add_parser("merge-sweep", help="run and measure a grid of merges; recovery CIs and a Pareto plot",
                              description="Run and measure a grid of merges (default: a 9-point grid; "
                              "merge_sweep_full.yaml beside it has 63). The plan (points, what is reused, the "
                              "estimated time) is printed before any work.")
    pair_args(s)
    s.add_argument("--sweep", default=str(DEFAULT_SWEEP_CONFIG), metavar="YAML",
                   help="the grid: a sweep YAML (default: experiments/configs/merge_sweep.yaml)")
    s.add_argument("--max-points", type=argtypes.positive_int,
                   help="run N points evenly spread over the grid (first and last included; deterministic)")
    mergekit_args(s)
    measure_args(s, out="runs/merge-sweep/<base>__<vlm>/<sweep name>", force="redo finished points")
    s.set_defaults(func=run_sweep)


def load_sweep(path: str | Path) -> dict[str, Any]:
    """Read and validate a sweep YAML: `grid` entries expand list-valued keys (cartesian product),
    `points` are named single settings; returns {"points": [{"name", "method", **params}], ...settings}.
    Point names (path components) must be slugs; every point's settings are validated (with the
    sweep's `root` where the method takes one) before any work."""
    import itertools

    import yaml

    from interventions.registry import list_interventions, takes_root, validate_intervention
    from sinkstudy import SinkstudyError
    from sinkstudy.io import check_slug, read_text

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


def format_plan(points: list[dict[str, Any]], total: int, reused: set[str], seconds_per_point: float | None) -> str:
    """What the sweep will do, before it does it: the points, which are reused, the estimated time."""
    todo = [pt for pt in points if pt["name"] not in reused]
    head = f"merge sweep plan: {len(points)} point(s)" + (f" of {total}, evenly spread over the grid" if len(points) < total else "")
    lines = [f"{head}: {len(todo)} to run, {len(points) - len(todo)} reused"]
    lines += [f"  {'reused' if pt['name'] in reused else 'run':<7}{pt['name']}" for pt in points]
    if not todo:
        lines.append("estimated time: seconds (every point is reused)")
    elif seconds_per_point is None:
        lines.append("estimated time: printed once the base and VLM LM references are measured (a point ≈ one merge + one such measurement)")
    else:
        lines.append(f"estimated time: {len(todo)} × ~{format_duration(seconds_per_point)} ≈ {format_duration(len(todo) * seconds_per_point)}")
    return "\n".join(lines)


def _recorded_seconds(out: Path) -> float | None:
    """Mean time of a point measured before in this sweep directory (its measure.json's `seconds`)."""
    import statistics

    from sinkstudy import SinkstudyError
    from sinkstudy.io import read_json

    times = []
    for path in sorted(out.glob("points/*/measure.json")):
        try:
            seconds = read_json(path).get("seconds")
        except (SinkstudyError, AttributeError):
            continue
        if isinstance(seconds, (int, float)) and seconds >= 0:
            times.append(float(seconds))
    return statistics.mean(times) if times else None


def point_params(pt: dict[str, Any], root=None) -> dict[str, Any]:
    return {k: v for k, v in pt.items() if k not in ("name", "method")} | ({"root": root} if root is not None else {})


def _check_sweep_pair(out: Path, pair: dict[str, str], force: bool) -> None:
    """A sweep dir belongs to one (base, VLM) pair: another pair is refused unless --force."""
    from sinkstudy import SinkstudyError
    from sinkstudy.io import read_json

    recorded = read_json(out / "pair.json").get("models") if (out / "pair.json").is_file() else None
    used = (out / "summary.json").exists() or (out / "points").exists() or (out / "reference").exists()
    if (recorded != pair if recorded is not None else used) and not force:
        raise SinkstudyError(f"{out} holds a sweep of another (base, VLM) pair; choose another --out or pass --force to redo it")


def run_sweep(args) -> Summary | int:
    """Plan (printed first), then each point: intervene (reused when finished), measure (reused when
    its key matches), summarise."""
    import math
    import time

    from tqdm.auto import tqdm

    from interventions.merge import MERGEKIT_METHODS, check_mergekit_options, local_checkpoint, resolve_lm
    from interventions.registry import apply_intervention, intervention_request, takes_root
    from sinkstudy.io import output_lock, remove_tree, write_json_atomic, write_text_atomic
    from sinkstudy.provenance import model_fingerprint, provenance

    check_pair_args(args, "merge-sweep")
    sweep = load_sweep(args.sweep)  # every point valid before any work
    points = spread(sweep["points"], args.max_points)
    options = check_mergekit_options(mergekit_options(args))

    def options_for(method: str) -> dict[str, bool] | None:  # the mergekit points' (the others run as they do)
        return options if method in MERGEKIT_METHODS else None

    check_measure_args(args)
    out = Path(args.out) if args.out else default_out(args.base, args.vlm, Path(args.sweep).stem, "merge-sweep")
    root = local_checkpoint(sweep["root"]) if sweep.get("root") else None
    seed = sweep.get("seed", args.seed)
    base = local_checkpoint(args.base)
    vlm_lm = resolve_lm(base, args.vlm)
    pair = {"base": model_fingerprint(base), "vlm": model_fingerprint(local_checkpoint(args.vlm))}
    with output_lock(out):
        _check_sweep_pair(out, pair, args.force)
        write_json_atomic(out / "pair.json", {"models": pair, "base": str(args.base), "vlm": str(args.vlm)})
        measure = Measure(base, vlm_lm, args, out / "reference")
        keys, finished = {}, {}
        for pt in points:
            params = point_params(pt, root if takes_root(pt["method"]) else None)
            keys[pt["name"]] = digest({"request": intervention_request(pt["method"], base, vlm_lm, params, seed,
                                                                       mergekit_options=options_for(pt["method"])),
                                       "measure": measure.identity, "references": pair})
            row = None if args.force else reusable_json(out / "points" / pt["name"] / "measure.json", keys[pt["name"]])
            if row is not None:
                finished[pt["name"]] = row
        recorded = _recorded_seconds(out)
        print(format_plan(points, len(sweep["points"]), set(finished), recorded), flush=True)
        todo = len(points) - len(finished)
        start = time.perf_counter()
        measure.ref  # the base and VLM LM references, measured (or reused) once
        ref_seconds = time.perf_counter() - start
        if todo and recorded is None and ref_seconds >= 1:
            print(f"references measured in {format_duration(ref_seconds)}: estimated time {todo} × "
                  f"~{format_duration(ref_seconds / 2)} ≈ {format_duration(todo * ref_seconds / 2)} (merges not included)", flush=True)
        rows = []
        for pt in tqdm(points, desc="merge sweep", disable=args.quiet):
            pdir = out / "points" / pt["name"]
            params = point_params(pt, root if takes_root(pt["method"]) else None)
            key = keys[pt["name"]]
            row = finished.get(pt["name"])
            if row is None:
                started = time.perf_counter()
                model_dir = apply_intervention(pt["method"], base, vlm_lm, params, pdir / "model", seed=seed, force=args.force,
                                               progress=not args.quiet, mergekit_options=options_for(pt["method"]))
                row = {"name": pt["name"], "method": pt["method"], "params": {k: str(v) if k == "root" else v for k, v in params.items()},
                       **measure.summary(measure.measure(model_dir, pdir)),
                       "weight_distance_to_vlm": weight_distance(model_dir, vlm_lm, base), "key": key,
                       "seconds": time.perf_counter() - started}  # unrounded: a fast point still has a time
                write_json_atomic(pdir / "measure.json", row)
                if not sweep.get("keep_models", True):
                    remove_tree(model_dir, within=out)  # results stay in measure.json; 7B checkpoints do not fit by dozens
            rows.append(row)
        write_json_atomic(out / "summary.json", {
            "sweep": str(args.sweep), "points": rows,
            "provenance": provenance(seed=args.seed, base=pair["base"], vlm=pair["vlm"], tasks=measure.tasks, limit=args.limit,
                                     n_boot=args.n_boot),
        })
        write_text_atomic(out / "summary.md", format_sweep(rows))
        plot_pareto(rows, out / "pareto.png")
    print(format_sweep(rows))
    print(f"wrote {out / 'summary.json'}, {out / 'summary.md'}, {out / 'pareto.png'}")
    finite = [r for r in rows if math.isfinite(text_recovery(r))]
    best = max(finite, key=text_recovery) if finite else None
    result = (f"{len(rows)} point(s), {sum(1 for pt in points if pt['name'] in finished)} reused; Pareto front "
              f"(recovery vs distance to VLM LM): {', '.join(pareto_front(rows)) or 'empty'}"
              + (f"; best mean text recovery {best['name']} {text_recovery(best):.2f}" if best else ""))
    full = DEFAULT_SWEEP_CONFIG.parent / "merge_sweep_full.yaml"
    nxt = ([cmd("sinkstudy", "merge-sweep", "--base", args.base, "--vlm", args.vlm, "--sweep", full, "--max-points", 2 * len(points))]
           if Path(args.sweep).resolve() == DEFAULT_SWEEP_CONFIG.resolve() else [])
    return Summary("merge-sweep", result, outputs=existing(out / "summary.md", out / "summary.json", out / "pareto.png"),
                   next=nxt + [cmd("sinkstudy", "merge", "--method", best["method"], "--base", args.base, "--vlm", args.vlm,
                                   *(x for k, v in best["params"].items() if k in ("weight", "density") for x in (f"--{k}", v)))]
                   if best else nxt)


def text_recovery(row: dict[str, Any]) -> float:
    """Mean recovery over the tasks that have one (a loss to recover, a defined ratio); NaN: none has."""
    vals = [t["recovery"] for t in row["tasks"].values() if t["recovery"] is not None]
    return sum(vals) / len(vals) if vals else float("nan")


def _proxy(row: dict[str, Any], key: str):
    return row[key] if key == "weight_distance_to_vlm" else (row.get(key) or {}).get("value")


def pareto_front(rows: list[dict[str, Any]], key: str = "weight_distance_to_vlm") -> list[str]:
    """Names of points no other point beats on both: higher text recovery, lower VL proxy `key`
    (weight distance to the VLM LM, or caption NLL)."""
    import math

    pts = [(r["name"], text_recovery(r), _proxy(r, key)) for r in rows]
    pts = [p for p in pts if math.isfinite(p[1]) and p[2] is not None]  # undefined recovery: off the front
    return [n for n, rec, d in pts
            if not any((r2 >= rec and d2 <= d) and (r2 > rec or d2 < d) for _, r2, d2 in pts)]


def format_sweep(rows: list[dict[str, Any]]) -> str:
    tasks = list(rows[0]["tasks"]) if rows else []
    head = ["point", "S"] + [f"{t} recovery [CI]" for t in tasks] + ["dist to VLM"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["name"], f"{r['sink_strength']['value']:.3f}"]
        cells += [_cell(r["tasks"][t]) for t in tasks]
        cells.append(f"{r['weight_distance_to_vlm']:.3f}")
        lines.append("| " + " | ".join(cells) + " |")
    if rows:
        s = rows[0]["sink_strength"]
        lines.append(f"\nSink Strength: base {s['base']:.3f}, VLM LM {s['vlm']:.3f}. {RECOVERY_CONVENTION}.")
        lines.append(f"Pareto front (recovery vs distance to VLM LM): {', '.join(pareto_front(rows))}")
    return "\n".join(lines) + "\n"


def _cell(t: dict[str, Any]) -> str:
    """A task's recovery [CI] (the headline metric), or "no loss to recover"."""
    if t.get("status", "recovery") != "recovery":
        return t["status"]
    return f"{num(t['recovery'], '.2f')} {ci_text(t['ci'], '.2f', '[n/a, n/a]')}"


def plot_pareto(rows: list[dict[str, Any]], path: Path) -> dict[str, Any]:
    """Text recovery (mean over the tasks with a loss) against each VL-side proxy, the Pareto front
    outlined; a point without any loss to recover is left out and counted in the title. Returns what
    it drew (points and axis ranges)."""
    import math

    from evals.sink.plot import axis_facts, pyplot
    from sinkstudy.io import save_figure_atomic

    plt = pyplot()
    with_ppl = any(r.get("caption_nll") for r in rows)
    fig, axes = plt.subplots(1, 2 if with_ppl else 1, figsize=(11 if with_ppl else 6, 4.5), squeeze=False)
    methods = sorted({r["method"] for r in rows})
    colors = {m: plt.cm.tab10(i % 10) for i, m in enumerate(methods)}
    proxies = [("weight_distance_to_vlm", "weight distance to VLM LM (0 = VLM, 1 = base)")]
    if with_ppl:
        proxies.append(("caption_nll", "caption NLL, text-only (lower = closer to VLM)"))
    drawn = []
    for ax, (key, label) in zip(axes[0], proxies):
        front = set(pareto_front(rows, key))
        for r in rows:
            x, y = _proxy(r, key), text_recovery(r)
            if x is None or not math.isfinite(y):
                continue
            ax.scatter(x, y, color=colors[r["method"]], edgecolor="black" if r["name"] in front else "none", s=40, label=r["method"])
            drawn.append({"proxy": key, "name": r["name"], "x": x, "y": y})
        handles, labels = ax.get_legend_handles_labels()
        if handles:
            uniq = dict(zip(labels, handles))
            ax.legend(uniq.values(), uniq.keys(), fontsize=8)
        else:
            ax.text(0.5, 0.5, "no loss to recover on any task", ha="center", va="center", transform=ax.transAxes, color="grey")
        ax.axhline(0, color="grey", lw=0.5)
        ax.axhline(1, color="grey", lw=0.5, ls="--")
        ax.set_xlabel(label)
        ax.set_ylabel("text recovery (mean over tasks with a loss)")
    without = sum(1 for r in rows if not math.isfinite(text_recovery(r)))
    fig.suptitle("Merges: text recovery vs VL-side proxy (outlined: Pareto front)"
                 + (f"; {without} point(s) without a loss to recover left out" if without else ""), fontsize=10)
    fig.tight_layout()
    save_figure_atomic(fig, path, dpi=120)
    facts = {"points": drawn, "axes": [axis_facts(ax) for ax in axes[0]]}  # as drawn: read after the save, no draw of its own
    plt.close(fig)
    return facts
