"""`sinkstudy pair extract` and `sinkstudy pair diff`: the VLM's language model in the base LLM's class."""

from __future__ import annotations


def register(subparsers) -> None:
    pair = subparsers.add_parser("pair", help="extract a VLM's language model / diff it against its base LLM")
    sub = pair.add_subparsers(dest="pair_command", metavar="SUBCOMMAND", required=True)

    ext = sub.add_parser("extract", help="write the VLM's language model as a causal-LM checkpoint in the base's class")
    _common(ext)
    ext.add_argument("--out", required=True, help="output checkpoint directory")
    ext.add_argument("--force", action="store_true", help="replace an existing --out")
    ext.set_defaults(func=run_extract)

    diff = sub.add_parser("diff", help="per-layer relative weight change ||W_vlm - W_base|| / ||W_base||")
    _common(diff)
    diff.add_argument("--json", metavar="FILE", help="also write every tensor's row and the summary as JSON")
    diff.add_argument("--force", action="store_true", help="replace an existing --json file")
    diff.set_defaults(func=run_diff)


def _common(p) -> None:
    p.add_argument("--base", required=True, help="base LLM: hub id or local path")
    p.add_argument("--vlm", required=True, help="VLM (or an already-extracted language model): hub id or local path")
    p.add_argument("--dtype", default="float32", help="float32 (default), bfloat16 or float16")
    p.add_argument("--device", default="cpu", help="torch device for the models (default cpu)")


def _provenance_extra(args, report) -> dict:
    from sinkstudy.provenance import model_fingerprint

    return {
        "base": args.base, "vlm": args.vlm, "dtype": args.dtype,
        "base_fingerprint": model_fingerprint(args.base), "vlm_fingerprint": model_fingerprint(args.vlm),
        "extraction": report.to_dict(),
    }


def run_extract(args) -> int:
    from interventions.pairs import load_pair, save_causal_lm
    from sinkstudy.io import check_output_dir

    check_output_dir(args.out, args.force)  # before any loading
    pair = load_pair(args.base, args.vlm, dtype=args.dtype, device=args.device)
    print(pair.report.summary())
    out = save_causal_lm(pair.vlm_lm, pair.tokenizer, args.out, force=args.force,
                         extra=_provenance_extra(args, pair.report))
    print(f"wrote {out}")
    return 0


def run_diff(args) -> int:
    from interventions.pairs import diff_summary, format_diff_table, load_pair, weight_diff
    from sinkstudy.io import check_output_dir, write_json_atomic
    from sinkstudy.provenance import provenance

    if args.json:
        check_output_dir(args.json, args.force)  # before any loading
    pair = load_pair(args.base, args.vlm, dtype=args.dtype, device=args.device)
    print(pair.report.summary())
    rows = weight_diff(pair.base, pair.vlm_lm, progress=True)
    print("relative change ||W_vlm - W_base|| / ||W_base|| per layer and group ('-': outside the layers)")
    print(format_diff_table(rows))
    if args.json:
        write_json_atomic(args.json, {
            "base": args.base, "vlm": args.vlm,
            "summary": diff_summary(rows), "rows": rows,
            "provenance": provenance(**_provenance_extra(args, pair.report)),
        })
        print(f"wrote {args.json}")
    return 0
