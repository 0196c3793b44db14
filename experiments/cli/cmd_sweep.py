"""`sinkstudy merge-sweep`: a grid of merges on one (base LLM, VLM) pair, measured, with recovery CIs per point,
a summary table and a Pareto plot: the arguments, then `experiments.study.sweep.run_sweep`."""

from __future__ import annotations

import math
from pathlib import Path

from experiments.cli import argtypes, options
from experiments.cli.closing import Summary, cmd, existing
from experiments.report.treatments import format_sweep, pareto_front, text_recovery
from experiments.study import sweep
from interventions.merge import check_mergekit_options
from sinkstudy.checkpoint import local_checkpoint

DEFAULT_SWEEP_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "merge_sweep.yaml"


def register(subparsers) -> None:
    s = subparsers.add_parser("merge-sweep", help="run and measure a grid of merges; recovery CIs and a Pareto plot",
                              description="Run and measure a grid of merges (default: a 9-point grid; "
                              "merge_sweep_full.yaml beside it has 63). The plan (points, what is reused, the "
                              "estimated time) is printed before any work.")
    options.add_pair_options(s)
    s.add_argument("--sweep", default=str(DEFAULT_SWEEP_CONFIG), metavar="YAML",
                   help="the grid: a sweep YAML (default: experiments/configs/merge_sweep.yaml)")
    s.add_argument("--max-points", type=argtypes.positive_int,
                   help="run N points evenly spread over the grid (first and last included; deterministic)")
    options.add_mergekit_options(s)
    options.add_measure_options(s, out="runs/merge-sweep/<base>__<vlm>/<sweep name>")
    s.set_defaults(func=run_sweep)


def run_sweep(args) -> Summary | int:
    options.check_pair_options(args, "merge-sweep")
    sweep.load_sweep(args.sweep)  # every point valid before any work
    mergekit = check_mergekit_options(options.mergekit_options(args))
    m = options.measurement(args)
    out = Path(args.out) if args.out else options.pair_out(args.base, args.vlm, Path(args.sweep).stem, "merge-sweep")
    res = sweep.run_sweep(args.sweep, str(local_checkpoint(args.base)), str(local_checkpoint(args.vlm)), out, m,
                          max_points=args.max_points, mergekit=mergekit, seed=args.seed, n_boot=args.n_boot, confidence=args.confidence,
                          tokenizer=args.tokenizer and str(local_checkpoint(args.tokenizer)), captions=args.captions,
                          force=args.force, progress=not args.quiet, sharing=options.sharing(args))
    rows = res["rows"]
    print(format_sweep(rows))
    print(f"wrote {out / 'summary.json'}, {out / 'summary.md'}, {out / 'pareto.png'}")
    finite = [r for r in rows if math.isfinite(text_recovery(r))]
    best = max(finite, key=text_recovery) if finite else None
    result = (f"{len(rows)} point(s), {len(res['reused'])} reused; Pareto front "
              f"(recovery vs distance to VLM LM): {', '.join(pareto_front(rows)) or 'empty'}"
              + (f"; best mean text recovery {best['name']} {text_recovery(best):.2f}" if best else ""))
    full = DEFAULT_SWEEP_CONFIG.parent / "merge_sweep_full.yaml"
    nxt = ([cmd("sinkstudy", "merge-sweep", "--base", args.base, "--vlm", args.vlm, "--sweep", full, "--max-points", 2 * len(rows))]
           if Path(args.sweep).resolve() == DEFAULT_SWEEP_CONFIG.resolve() else [])
    if best:
        nxt.append(cmd("sinkstudy", "merge", "--method", best["method"], "--base", args.base, "--vlm", args.vlm,
                       *(x for k, v in best["params"].items() if k in ("weight", "density") for x in (f"--{k}", v))))
    return Summary("merge-sweep", result, outputs=existing(out / "summary.md", out / "summary.json", out / "pareto.png"), next=nxt)
