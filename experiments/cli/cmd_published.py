"""`sinkstudy paper-table`: the seed paper's published tables, its statistics recomputed from them."""

from __future__ import annotations

from experiments.cli import options
from experiments.cli.closing import Summary, cmd
from experiments.report.published import PUBLISHED, format_paper_table, load_published, paper_table
from sinkstudy.io import write_json_atomic
from sinkstudy.provenance import provenance


def register(subparsers) -> None:
    p = subparsers.add_parser("paper-table", help="the paper's published six pairs and panel: rho, leave-one-out error, McNemar",
                              description="Recompute the seed paper's statistics from its published tables "
                              "(experiments/data/published_choi2026.yaml): Spearman/Pearson of S against IFEval Δ in "
                              "points and against Δ / base with bootstrap CIs over pairs, the leave-one-pair-out "
                              "predictor's error, and per pair Δ with its CI and McNemar's exact p from the per-prompt counts.")
    options.add_bootstrap_options(p)
    options.add_seed_option(p, "the bootstrap")
    p.add_argument("--tables", default=None, metavar="FILE", help="another tables file in the same format")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the figures as JSON")
    options.add_progress_options(p)
    p.set_defaults(func=run_paper_table)


def run_paper_table(args) -> Summary | int:
    tables = load_published(args.tables or PUBLISHED)
    result = paper_table(tables, n_boot=args.n_boot, confidence=args.confidence, seed=args.seed)
    print(format_paper_table(result))
    if args.json:
        write_json_atomic(args.json, {**result, "provenance": provenance(seeds={"bootstrap": args.seed},
                                                                         settings={"tables": str(args.tables or PUBLISHED)})})
    c = result["correlation"]
    rho = "; ".join(f"Spearman ρ(S, Δ {what}) = {c[key]['spearman']:+.2f} [{c[key]['spearman_ci'][0]:+.2f}, {c[key]['spearman_ci'][1]:+.2f}]"
                    for key, what in (("points", "points"), ("relative", "/ base")))
    return Summary("paper-table", f"the paper's six pairs recomputed: {rho} ({100 * args.confidence:g}% CI over pairs)",
                   outputs=[args.json] if args.json else [],
                   next=[cmd("sinkstudy", "compare", "BASE_EVAL", "VLM_EVAL", "--published", "--sink-json", "BASE_SINK_JSON"),
                         cmd("sinkstudy", "paper", "--dry-run")])
