"""`sinkstudy dose MODEL`: the model's Sink Strength moved to a level by the sink dose (`interventions.sink_dose`),
saved as a checkpoint of its own class: the arguments, then one `Intervene` step through the engine."""

from __future__ import annotations

from pathlib import Path

from evals.sink.calibration import DEFAULT_SET
from experiments.cli import argtypes, options
from experiments.cli.closing import Summary, cmd, existing
from experiments.cli.options import default_out
from experiments.study.graph import Plan, Step
from experiments.study.kinds import Ref
from experiments.study.pair_steps import Intervene
from experiments.study.runner import run_plan
from interventions.registry import validate_intervention
from interventions.sink_dose import HEADS
from sinkstudy.checkpoint import local_checkpoint
from sinkstudy.io import read_json

MODEL_DIR = "model"  # OUT/model: the dosed checkpoint and its intervention.json


def register(subparsers) -> None:
    p = subparsers.add_parser("dose", help="move a model's Sink Strength to a level (a weight-only edit of its query heads)",
                              description="Scale the attention logits of the query heads in MODEL's last layers until its Sink "
                              "Strength (the paper's log-odds S) reaches the level asked; the dosed model goes to OUT/model "
                              "(same class, config and dtype; every other tensor bit-identical), the sink passes tried to "
                              "OUT/model/intervention.json. docs/dose.md.")
    p.add_argument("model", metavar="MODEL", help=f"causal LM: {options.model_forms()}")
    level = p.add_mutually_exclusive_group(required=True)
    level.add_argument("--target", type=argtypes.finite_float, metavar="S", help="the Sink Strength to reach")
    level.add_argument("--shift", type=argtypes.finite_float, metavar="D", help="the change of Sink Strength to reach (S + D)")
    level.add_argument("--scale", type=argtypes.finite_float, metavar="C", help="a fixed logit temperature instead of a level")
    p.add_argument("--heads", choices=HEADS, default=None,
                   help="which query heads of the last layers: all (default) or sink (median log-odds above 0; no QK-norm)")
    p.add_argument("--layers", type=argtypes.positive_int, default=None, help="how many final layers (default: those S reads, 10)")
    p.add_argument("--tolerance", type=argtypes.finite_float, default=None, help="how close to the level S must come (default 0.02)")
    p.add_argument("--calibration", default=None, metavar="SET|FILE",
                   help=f"texts S is measured on: a shipped set (default {DEFAULT_SET}) or a .json/.jsonl/.txt file")
    options.add_model_options(p, dtype="float32: the dtype S is measured in while the dose is searched; the dosed model keeps "
                                       "its own", tokenizer=False)
    options.add_output_options(p, out="runs/dose/<model>-<level>")
    options.add_compute_options(p)
    options.add_progress_options(p)
    p.set_defaults(func=run_dose)


def run_dose(args) -> Summary | int:
    given = {k: getattr(args, k) for k in ("target", "shift", "scale", "heads", "layers", "tolerance", "device", "dtype")
             if getattr(args, k) is not None}
    params = given | ({"texts": args.calibration} if args.calibration else {})
    validate_intervention("sink_dose", params)  # every setting checked before any model is read
    model = str(local_checkpoint(args.model))  # a hub id fetched once, before any output exists
    level = next(f"{k}{given[k]:+g}" if k != "scale" else f"scale{given[k]:g}" for k in ("target", "shift", "scale") if k in given)
    where = [x for x in (args.device, args.dtype) if x not in (None, "cpu", "float32")]  # another device or dtype: another result
    out = Path(args.out) if args.out else default_out("dose", args.model, level, *where)
    lm = out / MODEL_DIR
    step = Step("dose/run", Intervene("sink_dose", Ref(model), Ref(model), params, out=lm), outputs=(lm,))
    run_plan(Plan([step]), out, force=args.force, progress=not args.quiet, guarded=("run",))
    report = read_json(lm / "intervention.json")["report"]
    result = (f"Sink Strength of {args.model} {report['sink_strength_before']:+.3f} -> {report['sink_strength']:+.3f}"
              + (f" (target {report['target']:+.3f})" if report["target"] is not None else "")
              + f": logit scale {report['scale']:.4g} on {len(report['units'])} head(s) of the last {report['layers']} layers")
    print(result)
    print(f"wrote {lm}")
    return Summary("dose", result, outputs=existing(lm),
                   next=[cmd("sinkstudy", "sink", lm), cmd("sinkstudy", "eval", lm), cmd("sinkstudy", "eval", args.model)])
