"""`sinkstudy merge`, `sinkstudy mitigate`: a weight intervention on a (base LLM, VLM) pair, measured by Sink
Strength and strict evals against the base and the VLM LM: the arguments, then `experiments.study.treat`."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from experiments.cli import argtypes, options
from experiments.cli.closing import Summary, cmd, existing
from experiments.report.treatments import format_measure, recoveries
from experiments.study.treat import Treatment, run_treatments
from interventions.merge import MERGEKIT_METHODS
from interventions.registry import execution_options, format_methods, validate_intervention
from interventions.spectral import SPECTRAL_METHODS
from sinkstudy.checkpoint import local_checkpoint

MODEL_DIR = "model"  # OUT/model: the checkpoint and its card; the measurements sit beside it in OUT


def register(subparsers) -> None:
    m = subparsers.add_parser("merge", help="merge base LLM and VLM LM (mergekit, TSV, STAR), then measure",
                              description="Merge the base LLM with the VLM's language model into OUT/model (the checkpoint "
                              "and its card), then measure it beside: OUT/measure.json, OUT/sink.json, OUT/eval.")
    options.add_pair_options(m)
    m.add_argument("--method", required=True, choices=MERGEKIT_METHODS + SPECTRAL_METHODS)
    m.add_argument("--weight", type=argtypes.finite_float,
                   help="linear/slerp: the VLM's share; task vectors: their scale (defaults per method: mitigate --list)")
    m.add_argument("--density", type=argtypes.finite_float, help="kept fraction of each delta (ties, dare_*, breadcrumbs)")
    m.add_argument("--eta", type=argtypes.finite_float, help="STAR: percent of the nuclear norm kept")
    m.add_argument("--select", help="only these tensors: attn, mlp and/or layers:FIRST-LAST (e.g. attn,layers:0-7)")
    m.add_argument("--root", help="common pretrained ancestor: task vectors (base-root, vlm-root) merged onto it "
                                  "(task-vector methods only; config and tokenizer still come from --base)")
    options.add_mergekit_options(m)
    _common_args(m, out="runs/interventions/<base>__<vlm>/<method and every setting given>")
    m.set_defaults(func=run_merge)

    t = subparsers.add_parser("mitigate", help="apply a registered mitigation (default head_restore), then measure",
                              description="Apply a mitigation to the pair into OUT/model, then measure it beside "
                              "(OUT/measure.json, OUT/sink.json, OUT/eval). --list works alone.")
    t.add_argument("name", nargs="?", default="head_restore", help="mitigation name (--list shows them)")
    t.add_argument("--list", action="store_true", help="list every intervention with its parameters and defaults, and exit")
    options.add_pair_options(t)
    t.add_argument("--top-k", type=argtypes.positive_int, help="head_restore: number of heads to restore")
    t.add_argument("--calibration", default=None, metavar="SET|FILE", help="calibration texts for the sink maps (shipped set name or file)")
    argtypes.add_plugin_option(t)
    _common_args(t, out="runs/interventions/<base>__<vlm>/<name and every setting given>", seed="any random draw of the mitigation, the evals and the bootstrap")
    t.set_defaults(func=run_mitigate)


def _common_args(p, *, out: str, seed: str | None = None) -> None:
    options.add_measure_options(p, out=out, **({"seed": seed} if seed else {}))
    p.add_argument("--param", action="append", default=[], metavar="KEY=VALUE", help="extra parameter (repeatable)")
    p.add_argument("--eval", dest="eval", action=argparse.BooleanOptionalAction, default=True,
                   help="measure sink strength and strict evals after (default: on)")


def run_merge(args) -> Summary | int:
    options.check_pair_options(args, "merge")
    params = options.parse_params(args.param) | {k: getattr(args, k) for k in ("weight", "density", "eta", "select", "root")
                                                 if getattr(args, k) is not None}
    return _treat(args, "merge", args.method, params, options.mergekit_options(args))


def run_mitigate(args) -> Summary | int:
    argtypes.load_plugin_options(args)
    if args.list:
        print(format_methods())
        return 0
    options.check_pair_options(args, "mitigate")
    params = options.parse_params(args.param) | ({"top_k": args.top_k} if args.top_k is not None else {}) \
        | ({"texts": args.calibration} if args.calibration else {})
    return _treat(args, "mitigate", args.name, params, {})


def _treat(args, command: str, method: str, params: dict, mergekit: dict) -> Summary:
    """Check everything, then treat the pair (`experiments.study.treat.run_treatments`)."""
    resolved = validate_intervention(method, params)
    execution = execution_options(method, mergekit) or {}
    m = options.measurement(args)
    base, vlm = local_checkpoint(args.base), local_checkpoint(args.vlm)  # hub ids fetched once, before any output exists
    root = local_checkpoint(params["root"]) if params.get("root") else None
    out = Path(args.out) if args.out else options.pair_out(args.base, args.vlm, settings_name(method, resolved, params, execution, args.seed))
    params = {k: v for k, v in params.items() if k != "root"}
    # one step name whatever the method: another treatment into this --out is another request of it, never beside it
    done = run_treatments(str(base), str(vlm), [Treatment("treatment", method, params, execution)], out, m, seed=args.seed,
                          n_boot=args.n_boot, confidence=args.confidence, force=args.force, progress=not args.quiet,
                          sharing=options.sharing(args), tokenizer=args.tokenizer and str(local_checkpoint(args.tokenizer)),
                          root=str(root) if root else None,
                          captions=args.captions, one=True, measure=args.eval)
    tp = done["plan"]
    if not any(e["reused"] for e in done["engine"].log if e["step"].endswith("/intervene/treatment")):  # a reuse was said
        print(f"wrote {tp.models['treatment']}")
    if tp.extracted:
        print(f"the VLM's language model (in the base's architecture): {tp.vlm_lm}")
    measured = done["measured"].get("treatment")
    if measured is not None:
        print(format_measure(out.name, measured))
    shown = {k: v for k, v in resolved.items() if k != "root"}
    what = f"{method} merge ({', '.join(f'{k} {v}' for k, v in sorted(shown.items()))})" if command == "merge" else f"mitigation {method}"
    return _summary(command, what, out, measured, args, tp.vlm_lm if tp.extracted else None)


def settings_name(method: str, resolved: dict, given: dict, execution: dict, seed: int) -> str:
    """A folder name from the method and every setting that changes its result: each one `given`, the main ones
    (weight, density, eta) at their `resolved` values even when not given, a mergekit merge on the GPU as device
    cuda (as TSV / STAR's device=cuda), a root or texts file by its name, the seed unless 0."""
    named = {k: v for k, v in resolved.items() if k in given or k in ("weight", "density", "eta")}
    named |= {"device": "cuda"} if execution.get("cuda") else {}
    parts = [method] + [f"{k}{Path(str(v).rstrip('/')).name if k in ('root', 'texts') else v}" for k, v in sorted(named.items())]
    return "-".join(parts + ([f"seed{seed}"] if seed else []))


def _summary(command: str, what: str, out: Path, measured: dict[str, Any] | None, args, extracted: Path | None):
    """The closing summary of merge / mitigate: Sink Strength and each task's recovery with its CI
    (or "no loss to recover"), every headline metric named; the extracted VLM LM among the outputs."""
    if measured is None:
        result = f"{what}: written, not measured (--no-eval)"
    else:
        s = measured["sink_strength"]
        result = (f"{what}: Sink Strength {s['value']:.3f} (base {s['base']:.3f}, VLM LM {s['vlm']:.3f}); "
                  + "; ".join(recoveries(measured)) + " (recovery = (merged − VLM LM) / (base − VLM LM): 0 none, 1 back to base)")
    model = out / MODEL_DIR
    nxt = [cmd("sinkstudy", "eval", model)] if measured is None else []
    nxt.append(cmd("sinkstudy", "merge-sweep", "--base", args.base, "--vlm", args.vlm) if command == "merge"
               else cmd("sinkstudy", "mitigate", "--list"))
    return Summary(command, result, outputs=existing(model, out / "measure.json", out / "eval", extracted), next=nxt)
