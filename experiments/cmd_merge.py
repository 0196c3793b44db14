"""`sinkstudy merge`, `sinkstudy merge-sweep`, `sinkstudy mitigate`: weight interventions on a
(base LLM, VLM) pair, each measured by Sink Strength and strict evals against base and VLM LM."""

from __future__ import annotations

import argparse
import functools
from pathlib import Path
from typing import Any

from experiments import argtypes

DEFAULT_TASKS = ("sinkstudy_ifeval", "sinkstudy_gsm")
# CLI defaults for sparse methods: the paper's settings (TIES density 0.2, DARE drop 0.9).
PAPER_DENSITY = {"ties": 0.2, "dare_ties": 0.1, "dare_linear": 0.1}
DEFAULT_SWEEP_CONFIG = Path(__file__).resolve().parent / "configs" / "merge_sweep.yaml"


def register(subparsers) -> None:
    from interventions.merge import MERGEKIT_METHODS
    from interventions.spectral import SPECTRAL_METHODS

    m = subparsers.add_parser("merge", help="merge base LLM and VLM LM (mergekit, TSV, STAR), then measure")
    _pair_args(m)
    m.add_argument("--method", required=True, choices=MERGEKIT_METHODS + SPECTRAL_METHODS)
    m.add_argument("--weight", type=argtypes.finite_float,
                   help="linear/slerp: VLM share (default 0.5); task vectors: scale (default 1; STAR 1/T)")
    m.add_argument("--density", type=argtypes.finite_float, help="kept fraction of each delta (ties: default 0.2, dare_*: 0.1, breadcrumbs)")
    m.add_argument("--eta", type=argtypes.finite_float, help="STAR: percent of the nuclear norm kept (default 40)")
    m.add_argument("--select", help="only these tensors: attn, mlp and/or layers:FIRST-LAST (e.g. attn,layers:0-7)")
    m.add_argument("--root", help="common pretrained ancestor: task vectors (base-root, vlm-root) merged onto it "
                                  "(task-vector methods only; config and tokenizer still come from --base)")
    _common_args(m)
    m.set_defaults(func=run_merge)

    s = subparsers.add_parser("merge-sweep", help="run and measure a grid of merges; recovery CIs and a Pareto plot")
    _pair_args(s)
    s.add_argument("--config", default=str(DEFAULT_SWEEP_CONFIG), help="sweep YAML (default: experiments/configs/merge_sweep.yaml)")
    s.add_argument("--max-points", type=argtypes.positive_int, help="run only the first N grid points")
    _eval_args(s)
    s.add_argument("--force", action="store_true", help="redo finished points")
    s.set_defaults(func=run_sweep)

    t = subparsers.add_parser("mitigate", help="apply a registered mitigation (default head_restore), then measure")
    t.add_argument("name", nargs="?", default="head_restore", help="mitigation name (--list shows them)")
    t.add_argument("--list", action="store_true", help="list registered interventions and exit")
    _pair_args(t, required=False)
    t.add_argument("--top-k", type=argtypes.positive_int, help="head_restore: number of heads to restore")
    t.add_argument("--texts", help="calibration texts for the sink maps (shipped set name or file)")
    _common_args(t)
    t.set_defaults(func=run_mitigate)


def _pair_args(p, required: bool = True) -> None:
    p.add_argument("--base", required=required, help="base LLM checkpoint dir")
    p.add_argument("--vlm", required=required, help="VLM checkpoint dir or its extracted language model")


def _eval_args(p) -> None:
    p.add_argument("--out", help="output directory (default: pair-specific, under runs/)")
    p.add_argument("--limit", type=argtypes.limit, help="evaluate only the first N prompts of each task (a fraction < 1: that share)")
    p.add_argument("--tasks", default=",".join(DEFAULT_TASKS), help=f"lm-eval tasks (default {','.join(DEFAULT_TASKS)})")
    p.add_argument("--batch-size", type=argtypes.positive_int, default=8)
    p.add_argument("--max-gen-toks", type=argtypes.positive_int, default=256, help="generation cap per prompt (default 256)")
    p.add_argument("--n-boot", type=argtypes.n_boot, default=2000, help=f"bootstrap replicates for recovery CIs (>= {argtypes.MIN_N_BOOT})")
    p.add_argument("--captions", help="text file (one caption per line): text-only perplexity as a VL-side proxy")
    p.add_argument("--seed", type=int, default=0)


def _common_args(p) -> None:
    _eval_args(p)
    p.add_argument("--param", action="append", default=[], metavar="KEY=VALUE", help="extra parameter (repeatable)")
    p.add_argument("--force", action="store_true", help="replace an existing --out")
    p.add_argument("--eval", dest="eval", action=argparse.BooleanOptionalAction, default=True,
                   help="measure sink strength and strict evals after (default: on)")


def parse_params(items: list[str]) -> dict[str, Any]:
    import yaml

    from sinkstudy import SinkstudyError

    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SinkstudyError(f"bad --param {item!r}: use KEY=VALUE")
        out[key.strip()] = yaml.safe_load(value)  # numbers, booleans and lists typed as in YAML
    return out


# --------------------------------------------------------------------------- measuring

class Measure:
    """Sink Strength + strict evals of checkpoints against the base and the VLM LM (measured once).

    All models are evaluated with the base's tokenizer (the extracted LM shares its vocabulary),
    so prompts are identical and results pair on doc_id. A measurement stored in a directory
    (`sink.json`, `eval/`) is reused only when its key matches: the measured model's fingerprint,
    the tokenizer, the settings and the code versions (`sink_key`; evals key themselves).
    """

    def __init__(self, base: str, vlm_lm: Path, args, ref_dir: Path | None):
        from interventions.pairs import load_tokenizer

        self.base, self.vlm_lm, self.args = base, vlm_lm, args
        self.tasks = [t for t in args.tasks.split(",") if t]
        self.captions = _read_captions(args.captions) if args.captions else None
        self.tokenizer = load_tokenizer(self.base)
        self.ref = {name: self.measure(path, ref_dir / name if ref_dir else None)
                    for name, path in (("base", base), ("vlm", vlm_lm))}

    @functools.cached_property
    def identity(self) -> dict[str, Any]:
        """What every measurement depends on besides the measured model."""
        from evals.lmeval import eval_code_version, tokenizer_fingerprint
        from experiments.runner import sink_code_version
        from sinkstudy.provenance import code_version

        a = self.args
        return {"tokenizer": tokenizer_fingerprint(self.tokenizer), "tasks": self.tasks, "limit": a.limit,
                "batch_size": a.batch_size, "max_gen_toks": a.max_gen_toks, "n_boot": a.n_boot, "seed": a.seed,
                "captions": _digest(self.captions) if self.captions else None,
                "code": [sink_code_version(), eval_code_version(), code_version(__file__)]}

    def sink_key(self, path) -> str:
        from sinkstudy.provenance import model_fingerprint

        ident = self.identity
        return _digest({"model": model_fingerprint(path), **{k: ident[k] for k in ("tokenizer", "captions", "code")}})

    def measure(self, path, out: Path | None) -> dict[str, Any]:
        """Sink Strength (+ caption NLL) and the eval run of one checkpoint; reused from `out` by key."""
        from evals.lmeval import run_eval
        from sinkstudy.io import write_json_atomic

        key = self.sink_key(path)
        cached = out / "sink.json" if out else None
        sink = _reusable(cached, key)
        if sink is None:
            sink = {**self._sink(path), "key": key}
            if cached:
                write_json_atomic(cached, sink)
        # force: the eval dir is a keyed measurement, replaced when the key changes (lm-eval results are cached by key)
        run = run_eval(path, self.tokenizer, tasks=self.tasks, limit=self.args.limit, batch_size=self.args.batch_size,
                       max_gen_toks=self.args.max_gen_toks, out_dir=out / "eval" if out else None, force=True,
                       seed=self.args.seed)
        return {**sink, "run": run}

    def _sink(self, path) -> dict[str, Any]:
        import torch

        from evals.sink import sink_strength
        from interventions.pairs import load_causal_lm

        model, _ = load_causal_lm(path, dtype=torch.float32)
        s = sink_strength(model, self.tokenizer, progress=False)
        nll = caption_nll(model, self.tokenizer, self.captions) if self.captions else None
        return {"sink_strength": s.value, "sink_metric": s.metric, "caption_nll": nll, "captions": self.args.captions}

    def summary(self, point: dict[str, Any]) -> dict[str, Any]:
        """Scores, recovery with CI per task, and the VL-side proxies of one measured checkpoint."""
        from evals.stats import recovery

        b, v, run = self.ref["base"]["run"], self.ref["vlm"]["run"], point["run"]
        tasks = {}
        for task in self.tasks:
            r = recovery(b, v, run, task, n_boot=self.args.n_boot, seed=self.args.seed)
            tasks[task] = {"metric": r.metric, "base": r.base, "vlm": r.vlm, "score": r.intervened,
                           "recovery": _finite(r.recovery), "ci": [_finite(c) for c in r.ci], "n": r.n}
        return {
            "sink_strength": {"base": self.ref["base"]["sink_strength"], "vlm": self.ref["vlm"]["sink_strength"],
                              "value": point["sink_strength"], "metric": point["sink_metric"]},
            "tasks": tasks,
            "caption_nll": {"vlm": self.ref["vlm"]["caption_nll"], "value": point["caption_nll"]} if self.captions else None,
        }


def _digest(obj) -> str:
    import hashlib
    import json

    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:24]


def _reusable(path: Path | None, key: str) -> dict[str, Any] | None:
    """The JSON at `path` when it was written under `key` (None: absent, unreadable or stale)."""
    from sinkstudy import SinkstudyError
    from sinkstudy.io import read_json

    if path is None or not path.is_file():
        return None
    try:
        data = read_json(path)
    except SinkstudyError:
        return None
    return data if isinstance(data, dict) and data.get("key") == key else None


def _finite(x):
    import math

    return None if x is None or not math.isfinite(x) else float(x)


def _fmt(x, spec: str = ".2f") -> str:
    return "n/a" if x is None else format(x, spec)


def _read_captions(path: str) -> list[str]:
    from sinkstudy import SinkstudyError
    from sinkstudy.io import read_text

    p = Path(path)
    lines = [line.strip() for line in read_text(p, "captions file").splitlines() if line.strip()]
    if not lines:
        raise SinkstudyError(f"captions file {p} is empty")
    return lines


def caption_nll(model, tokenizer, captions: list[str]) -> float:
    """Mean per-token NLL of the captions as plain text (exp = text-only caption perplexity)."""
    import torch

    total, count = 0.0, 0
    with torch.no_grad():
        for text in captions:
            ids = tokenizer(text, return_tensors="pt").input_ids
            if ids.shape[1] < 2:
                continue
            loss = model(input_ids=ids, labels=ids).loss
            total += loss.item() * (ids.shape[1] - 1)
            count += ids.shape[1] - 1
    return total / max(count, 1)


def weight_distance(path, vlm_lm, base) -> float:
    """||W - W_vlm|| / ||W_base - W_vlm|| over all float tensors: 0 at the VLM LM, 1 at the base."""
    import torch

    from interventions.spectral import _Tensors

    a, v, b = _Tensors(path), _Tensors(vlm_lm), _Tensors(base)
    num = den = 0.0
    for name in v.names():
        tv = v[name].double()
        num += (a[name].double() - tv).pow(2).sum().item()
        den += (b[name].double() - tv).pow(2).sum().item()
    return float(torch.tensor(num / den).sqrt()) if den else 0.0


def _print_summary(name: str, summary: dict[str, Any]) -> None:
    s = summary["sink_strength"]
    print(f"{name}: Sink Strength ({s['metric']}) {s['value']:.3f}  [base {s['base']:.3f}, VLM LM {s['vlm']:.3f}]")
    for task, t in summary["tasks"].items():
        print(f"  {task:<18} {t['metric']:<32} {t['score']:.3f}  [base {t['base']:.3f}, VLM LM {t['vlm']:.3f}]  "
              f"recovery {_fmt(t['recovery'])} ({_fmt(t['ci'][0])}, {_fmt(t['ci'][1])})")


def _measure_and_write(out: Path, args) -> dict[str, Any]:
    from interventions.merge import local_checkpoint, resolve_lm
    from sinkstudy.io import write_json_atomic
    from sinkstudy.provenance import provenance

    base = local_checkpoint(args.base)
    vlm_lm = resolve_lm(base, args.vlm)
    measure = Measure(base, vlm_lm, args, None)
    summary = measure.summary(measure.measure(out, out))
    summary["weight_distance_to_vlm"] = weight_distance(out, vlm_lm, base)
    write_json_atomic(out / "measure.json", {**summary, "provenance": provenance(seed=args.seed, tasks=measure.tasks, limit=args.limit)})
    _print_summary(out.name, summary)
    return summary


def check_measure_args(args) -> None:
    """The measurement's inputs (task names, captions file), checked before any intervention runs."""
    from evals.lmeval import check_task_names

    if getattr(args, "eval", True):
        check_task_names(args.tasks)
        if args.captions:
            _read_captions(args.captions)


# --------------------------------------------------------------------------- commands

def _check_models(*refs) -> None:
    """Every model argument resolves (local dir, or a hub id fetched once) before any output exists."""
    from interventions.merge import local_checkpoint

    for ref in refs:
        if ref is not None:
            local_checkpoint(ref)


def default_out(base: str, vlm: str, name: str, kind: str = "interventions") -> Path:
    """runs/<kind>/<base>__<vlm>/<name>: a different pair never lands in the same default dir."""
    from sinkstudy.io import slugify

    pair = f"{slugify(Path(str(base).rstrip('/')).name)}__{slugify(Path(str(vlm).rstrip('/')).name)}"
    return Path("runs") / kind / pair / slugify(name)


def run_merge(args) -> int:
    from interventions.registry import apply_intervention, validate_intervention
    from sinkstudy.io import output_lock

    params = parse_params(args.param)
    for key in ("weight", "density", "eta", "select", "root"):
        if getattr(args, key) is not None:
            params[key] = getattr(args, key)
    if args.weight is None and args.method in ("linear", "slerp"):
        params["weight"] = 0.5
    if args.weight is None and args.method not in ("linear", "slerp", "star", "tsv"):  # TSV: alpha defaults to 1
        params["weight"] = 1.0
    if args.density is None and args.method in PAPER_DENSITY:
        params["density"] = PAPER_DENSITY[args.method]
    validate_intervention(args.method, params)
    check_measure_args(args)
    _check_models(args.base, args.vlm, args.root)
    tag = "-".join([args.method] + [f"{k}{v}" for k, v in sorted(params.items()) if k in ("weight", "density", "eta", "select")])
    out = Path(args.out) if args.out else default_out(args.base, args.vlm, tag)
    with output_lock(out):  # the merge and its measurements
        out = apply_intervention(args.method, args.base, args.vlm, params, out, seed=args.seed, force=args.force)
        print(f"wrote {out}")
        if args.eval:
            _measure_and_write(out, args)
    return 0


def run_mitigate(args) -> int:
    from interventions.registry import apply_intervention, list_interventions, validate_intervention
    from sinkstudy import SinkstudyError
    from sinkstudy.io import output_lock

    if args.list:
        for name, kind in list_interventions().items():
            print(f"  {name:<18} {kind}")
        return 0
    if not (args.base and args.vlm):
        raise SinkstudyError("mitigate needs --base and --vlm")
    params = parse_params(args.param)
    if args.top_k is not None:
        params["top_k"] = args.top_k
    if args.texts:
        params["texts"] = args.texts
    validate_intervention(args.name, params)
    check_measure_args(args)
    _check_models(args.base, args.vlm)
    out = Path(args.out) if args.out else default_out(args.base, args.vlm, args.name)
    with output_lock(out):
        out = apply_intervention(args.name, args.base, args.vlm, params, out, seed=args.seed, force=args.force)
        print(f"wrote {out}")
        if args.eval:
            _measure_and_write(out, args)
    return 0


# --------------------------------------------------------------------------- sweep

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


def run_sweep(args) -> int:
    """Each point: intervene (reused when finished), measure (reused when its key matches), summarise."""
    from tqdm.auto import tqdm

    from interventions.merge import local_checkpoint, resolve_lm
    from interventions.registry import apply_intervention, intervention_request, takes_root
    from sinkstudy.io import output_lock, remove_tree, write_json_atomic, write_text_atomic
    from sinkstudy.provenance import model_fingerprint, provenance

    sweep = load_sweep(args.config)  # every point valid before any work
    points = sweep["points"][: args.max_points] if args.max_points else sweep["points"]
    check_measure_args(args)
    out = Path(args.out) if args.out else default_out(args.base, args.vlm, Path(args.config).stem, "merge-sweep")
    root = local_checkpoint(sweep["root"]) if sweep.get("root") else None
    seed = sweep.get("seed", args.seed)
    base = local_checkpoint(args.base)
    vlm_lm = resolve_lm(base, args.vlm)
    pair = {"base": model_fingerprint(base), "vlm": model_fingerprint(local_checkpoint(args.vlm))}
    with output_lock(out):
        _check_sweep_pair(out, pair, args.force)
        write_json_atomic(out / "pair.json", {"models": pair, "base": str(args.base), "vlm": str(args.vlm)})
        measure = Measure(base, vlm_lm, args, out / "reference")
        rows = []
        for pt in tqdm(points, desc="merge sweep"):
            pdir = out / "points" / pt["name"]
            params = point_params(pt, root if takes_root(pt["method"]) else None)
            key = _digest({"request": intervention_request(pt["method"], base, vlm_lm, params, seed), "measure": measure.identity,
                           "references": pair})
            row = None if args.force else _reusable(pdir / "measure.json", key)
            if row is None:
                model_dir = apply_intervention(pt["method"], base, vlm_lm, params, pdir / "model",
                                               seed=seed, force=args.force, progress=False)
                row = {"name": pt["name"], "method": pt["method"], "params": {k: str(v) if k == "root" else v for k, v in params.items()},
                       **measure.summary(measure.measure(model_dir, pdir)),
                       "weight_distance_to_vlm": weight_distance(model_dir, vlm_lm, base), "key": key}
                write_json_atomic(pdir / "measure.json", row)
                if not sweep.get("keep_models", True):
                    remove_tree(model_dir, within=out)  # results stay in measure.json; 7B checkpoints do not fit by dozens
            rows.append(row)
        write_json_atomic(out / "summary.json", {
            "config": str(args.config), "points": rows,
            "provenance": provenance(seed=args.seed, base=pair["base"], vlm=pair["vlm"], tasks=measure.tasks, limit=args.limit,
                                     n_boot=args.n_boot),
        })
        write_text_atomic(out / "summary.md", format_sweep(rows))
        plot_pareto(rows, out / "pareto.png")
    print(format_sweep(rows))
    print(f"wrote {out / 'summary.json'}, {out / 'summary.md'}, {out / 'pareto.png'}")
    return 0


def text_recovery(row: dict[str, Any]) -> float:
    """Mean recovery over the tasks (NaN-free tasks only)."""
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
        cells += [f"{_fmt(r['tasks'][t]['recovery'])} [{_fmt(r['tasks'][t]['ci'][0])}, {_fmt(r['tasks'][t]['ci'][1])}]" for t in tasks]
        cells.append(f"{r['weight_distance_to_vlm']:.3f}")
        lines.append("| " + " | ".join(cells) + " |")
    if rows:
        s = rows[0]["sink_strength"]
        lines.append(f"\nSink Strength: base {s['base']:.3f}, VLM LM {s['vlm']:.3f}. "
                     "Recovery = (merged - VLM) / (base - VLM), 0 = none, 1 = back to base.")
        lines.append(f"Pareto front (recovery vs distance to VLM LM): {', '.join(pareto_front(rows))}")
    return "\n".join(lines) + "\n"


def plot_pareto(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from sinkstudy.io import save_figure_atomic

    with_ppl = any(r.get("caption_nll") for r in rows)
    fig, axes = plt.subplots(1, 2 if with_ppl else 1, figsize=(11 if with_ppl else 6, 4.5), squeeze=False)
    methods = sorted({r["method"] for r in rows})
    colors = {m: plt.cm.tab10(i % 10) for i, m in enumerate(methods)}
    proxies = [("weight_distance_to_vlm", "weight distance to VLM LM (0 = VLM, 1 = base)")]
    if with_ppl:
        proxies.append(("caption_nll", "caption NLL, text-only (lower = closer to VLM)"))
    for ax, (key, label) in zip(axes[0], proxies):
        front = set(pareto_front(rows, key))
        for r in rows:
            x = _proxy(r, key)
            if x is None:
                continue
            ax.scatter(x, text_recovery(r), color=colors[r["method"]], edgecolor="black" if r["name"] in front else "none",
                       s=40, label=r["method"])
        handles, labels = ax.get_legend_handles_labels()
        uniq = dict(zip(labels, handles))
        ax.legend(uniq.values(), uniq.keys(), fontsize=8)
        ax.axhline(0, color="grey", lw=0.5)
        ax.axhline(1, color="grey", lw=0.5, ls="--")
        ax.set_xlabel(label)
        ax.set_ylabel("text recovery (mean over tasks)")
    fig.suptitle("Merges: text recovery vs VL-side proxy (outlined: Pareto front)")
    fig.tight_layout()
    save_figure_atomic(fig, path, dpi=120)
    plt.close(fig)
