"""`sinkstudy pair extract` and `sinkstudy pair diff`: the VLM's language model in the base LLM's class.

Both stream: `extract` writes the language model shard by shard (never the vision tower, never the whole
model in memory), `diff` reads one tensor of each model at a time.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from experiments.cli import options
from experiments.cli.closing import Summary, cmd
from experiments.cli.options import add_pair_options, check_pair_options, default_out, json_made_with
from experiments.study.graph import Plan, Step
from experiments.study.kinds import Ref
from experiments.study.pair_steps import Extract
from experiments.study.runner import run_plan
from interventions.pairs import (EXTRACTION_JSON, ExtractionReport, diff_summary, format_diff_table, plan_extraction,
                                 resolve, tensors_of, weight_diff)
from interventions.pairs.resolve import resolve_dtype
from sinkstudy.io import check_output_dir, check_replaceable, write_json_atomic
from sinkstudy.provenance import model_fingerprint, provenance

def register(subparsers) -> None:
    pair = subparsers.add_parser("pair", help="extract a VLM's language model / diff it against its base LLM")
    sub = pair.add_subparsers(dest="pair_command", metavar="SUBCOMMAND", required=True)

    ext = sub.add_parser("extract", help="write the VLM's language model as a causal-LM checkpoint in the base's class",
                         description="Write the language model of --vlm as a causal-LM checkpoint in --base's class, shard by "
                         "shard (never the vision tower, never the whole model in memory), to --out (default "
                         "runs/pair/<vlm>-lm), with sinkstudy_extraction.json saying what was mapped. docs/pairs.md.")
    _common(ext)
    options.add_model_options(ext, device=None, dtype="the VLM checkpoint's own, e.g. bfloat16", tokenizer=False)
    ext.add_argument("--max-shard-size", default="1GB", type=_bytes,
                     help="largest output shard, e.g. 1GB or 500MB (peak memory is about one shard; default 1GB)")
    options.add_output_options(ext, out="runs/pair/<vlm>-lm")
    options.add_compute_options(ext)
    options.add_progress_options(ext)
    ext.set_defaults(func=run_extract)

    diff = sub.add_parser("diff", help="per-layer relative weight change ||W_vlm - W_base|| / ||W_base||",
                          description="What VL training changed: per layer and group, the relative change ||W_vlm - W_base|| "
                          "/ ||W_base|| of the VLM's language model against --base, one tensor of each at a time; --json "
                          "writes every tensor's row. docs/pairs.md.")
    _common(diff)
    options.add_model_options(diff, dtype="as stored; the sums are float32/float64 either way", tokenizer=False)
    diff.add_argument("--json", metavar="FILE", help="also write every tensor's row and the summary as JSON")
    options.add_force_option(diff, "--json")
    options.add_compute_options(diff)
    options.add_progress_options(diff)
    diff.set_defaults(func=run_diff)


def _common(p) -> None:
    add_pair_options(p)


DIFF_KEYS = ("base", "vlm", "summary", "rows", "provenance")  # what `pair diff --json` writes: its record


def _bytes(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?)B?\s*", text.upper())
    if not m or float(m.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 1GB, 500MB)")
    return int(float(m.group(1)) * {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[m.group(2)])


def run_extract(args) -> Summary | int:
    """The extraction as one step (`experiments.study.pair_steps.Extract`) through the engine: reused when this --out
    (or, from the same models, another run) holds it, refused when other settings made the one in --out."""
    check_pair_options(args, "pair extract")
    out = Path(args.out or default_out("pair", args.vlm, "lm"))
    if args.dtype is not None:
        resolve_dtype(args.dtype)
    step = Step("pair/extract", Extract(Ref(str(args.base)), Ref(str(args.vlm)), args.dtype, args.max_shard_size, out=out), outputs=(out,))
    engine = run_plan(Plan([step]), out, force=args.force, progress=not args.quiet, guarded=("extract",),
                      not_mine=lambda p: None if (p / EXTRACTION_JSON).is_file() else f"no {EXTRACTION_JSON}")
    report = ExtractionReport(**engine.results[step.id]["report"])
    print(report.summary())
    if not engine.log[0]["reused"]:  # a reuse was said by the engine
        print(f"wrote {out}")
    return Summary("pair extract", f"{report.source_arch} -> {report.target_class}: the language model of {args.vlm} "
                   f"in {args.base}'s architecture", outputs=[out],
                   next=[cmd("sinkstudy", "pair", "diff", "--base", args.base, "--vlm", args.vlm),
                         cmd("sinkstudy", "sink", out), cmd("sinkstudy", "eval", out)])


def run_diff(args) -> Summary | int:
    check_pair_options(args, "pair diff")
    if args.json:  # before any loading: only an earlier `pair diff --json` is replaced, and only with --force
        check_replaceable(args.json, args.force, flag="--json", directory=False,
                          not_mine=lambda f: json_made_with(f, DIFF_KEYS, "pair diff"))
        check_output_dir(args.json, args.force)
    dtype = resolve_dtype(args.dtype) if args.dtype else None
    base = resolve(args.base)
    plan = plan_extraction(args.vlm, base)
    print(plan.report.summary())
    rows = weight_diff(tensors_of(base), plan.tensors, dtype=dtype, device=args.device, progress=not args.quiet)
    print("relative change ||W_vlm - W_base|| / ||W_base|| per layer and group ('-': outside the layers)")
    print(format_diff_table(rows))
    if args.json:
        write_json_atomic(args.json, {
            "base": args.base, "vlm": args.vlm,
            "summary": diff_summary(rows), "rows": rows,
            "provenance": provenance(base=args.base, vlm=args.vlm, dtype=args.dtype, base_fingerprint=model_fingerprint(args.base),
                                     vlm_fingerprint=model_fingerprint(args.vlm), extraction=plan.report.to_dict()),
        })
        print(f"wrote {args.json}")
    changed = [r for r in diff_summary(rows) if r["rel_change"] is not None]
    top = max(changed, key=lambda r: r["rel_change"], default=None)
    where = f"layer {top['layer']}" if top and top["layer"] is not None else "the tensors outside the layers"
    result = (f"largest relative change {top['rel_change']:.4g} in {top['group']} of {where}" if top
              else "no tensor to compare") + f" ({len(rows)} tensors)"
    return Summary("pair diff", result, outputs=[args.json] if args.json else [],
                   next=[cmd("sinkstudy", "pair", "extract", "--base", args.base, "--vlm", args.vlm)]
                   + ([] if args.json else [cmd("sinkstudy", "pair", "diff", "--base", args.base, "--vlm", args.vlm, "--json", "diff.json")]))
