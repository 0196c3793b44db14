"""`sinkstudy adapt`: LLaVA-style VL adaptation of a base LLM (the engine in interventions/adapt).

    sinkstudy adapt --base B (--vision ID|PATH | --donor ID|PATH | --tiny-vision | --scenes-vision | --text-only)
                    --train-data [STAGE=]SPEC ... [--recipe YAML] [--train-steps [STAGE=]N ...]
                    [--out DIR] [--resume] [--force] [--estimate] [--device DEVICE] [--dtype DTYPE]
                    [--protect NAME ... [--protect-param [NAME.]KEY=VALUE ...]] [--plugin FILE.py|MODULE ...]

The recipe is the paper's two stages (--text-only: one "text" stage training the LM) unless --recipe
gives another (docs/adapt.md); --train-data without STAGE= feeds every stage, with it one stage
(replacing that stage's data from the recipe).
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from experiments.cli import options
from experiments.cli.argtypes import add_plugin_option, load_plugin_options
from experiments.cli.closing import Summary, cmd
from experiments.report.adapt_tables import format_adapt
from experiments.report.fmt import brief as _f
from experiments.study.adapt_section import stage_recipe
from experiments.study.arms import Adapt
from experiments.study.graph import Plan, Step
from experiments.study.kinds import Ref
from experiments.study.runner import run_plan
from interventions.adapt import from_dict, load_config, paper_recipe, text_recipe
from interventions.adapt.estimate import estimate, format_estimate
from interventions.qknorm_modes import INIT_MODES
from sinkstudy import SinkstudyError
from sinkstudy.io import read_json


def register(subparsers) -> None:
    p = subparsers.add_parser("adapt", help="VL-adapt a base LLM (LLaVA two stages on HF Trainer), with a Sink Strength trajectory",
                              description="LLaVA-style VL adaptation of --base: a vision side (--vision, --donor, --tiny-vision, "
                              "--scenes-vision, or --text-only), the paper's two stages unless --recipe gives others, data per "
                              "stage from --train-data; the VLM goes to OUT/model, the run (stage table, Sink Strength "
                              "trajectory, checkpoints for --resume) to OUT/run. --protect adds training-time protections "
                              "(docs/protect.md); --estimate prints GPU memory and time without training. docs/adapt.md.")
    p.add_argument("--base", default=None, help=f"base causal LM: {options.model_forms()} (required)")
    options.add_vision_options(p, required=True)
    t = p.add_argument_group("training")
    options.add_train_data_option(t, help="training data")
    options.add_recipe_option(t, help="adaptation recipe (default: the paper's two stages)")
    options.add_train_steps_option(t)
    t.add_argument("--qknorm", metavar="INIT", help=f"inject QK-RMSNorm into the base first ({', '.join(INIT_MODES)})")
    t.add_argument("--protect", action="append", default=[], metavar="NAME",
                   help="a training-time protection (repeatable; `--protect list` lists them; docs/protect.md)")
    t.add_argument("--protect-param", action="append", default=[], metavar="[NAME.]KEY=VALUE",
                   help="a protection setting, VALUE as YAML (NAME. needed with several --protect), e.g. heads='{by: mass, top_k: 8}'")
    t.add_argument("--resume", action="store_true", help="continue an interrupted run in --out from its last checkpoint")
    add_plugin_option(p)
    options.add_model_options(p, dtype="the recipe's precision")
    options.add_output_options(p, out="runs/adapt/<base>[-<protection>...] (the model in OUT/model)")
    e = p.add_argument_group("estimate (nothing trained)")
    e.add_argument("--estimate", action="store_true", help="print GPU memory and time per stage and exit (nothing trained)")
    e.add_argument("--gpu", default="H200", help="GPU for --estimate (H200, H100, A100, L40S; default H200)")
    e.add_argument("--gpus", type=int, default=1, help="number of GPUs for --estimate (default 1)")
    e.add_argument("--tokens-per-example", type=int, default=None, help="--estimate: sequence length (default image tokens + 128)")
    e.add_argument("--examples", action="append", default=[], metavar="[STAGE=]N",
                   help="--estimate: training examples per stage when the data is not counted locally (e.g. stage1=558128)")
    options.add_compute_options(p)
    options.add_progress_options(p)
    p.set_defaults(func=main)


PRECISIONS = {"float32": "fp32", "bfloat16": "bf16"}  # --dtype -> the recipe's precision


def build_request(args):
    """(VisionSpec | None, AdaptConfig) from the command line, validated before any work."""
    if not args.base:
        raise SinkstudyError("adapt needs --base (the base causal LM: hub id or local path)")
    if not (args.vision or args.donor or args.tiny_vision or args.scenes_vision or args.text_only):
        raise SinkstudyError("adapt needs a vision side: --vision ID|PATH, --donor ID|PATH, --tiny-vision, --scenes-vision or --text-only")
    config = load_config(args.recipe) if args.recipe else text_recipe() if args.text_only else paper_recipe()
    names = [s.name for s in config.stages]
    config = from_dict(stage_recipe(config.to_dict(), options.parse_stage_values(args.train_data, names, "train-data"),
                                    options.stage_counts(args.train_steps, names)))
    if args.dtype is not None:  # the weights' dtype in training: fp32, or bf16 autocast (the recipe's `precision`)
        if args.dtype not in PRECISIONS:
            raise SinkstudyError(f"--dtype {args.dtype}: adapt trains in {' or '.join(PRECISIONS)} (the recipe's precision)")
        config.precision = PRECISIONS[args.dtype]
    if args.qknorm and args.qknorm not in INIT_MODES:
        raise SinkstudyError(f"--qknorm {args.qknorm}: choose {', '.join(INIT_MODES)}")
    args.out = args.out or str(options.default_out("adapt", args.base, *args.protect))
    return options.vision_spec(args, config.seed), config


def protections(args) -> list:
    """The --protect hooks with their --protect-param settings, validated before any work."""
    # lazy: loads torch, numpy
    from interventions.protect import get_protection, make_protection

    for name in args.protect:
        get_protection(name)
    params: dict[str, dict] = {name: {} for name in args.protect}
    for item in args.protect_param:
        key, sep, value = item.partition("=")
        name, dot, key = key.rpartition(".") if "." in key else ("", "", key)
        if not sep or not key:
            raise SinkstudyError(f"--protect-param {item}: use [NAME.]KEY=VALUE")
        if not name:
            if len(args.protect) != 1:
                raise SinkstudyError(f"--protect-param {item}: say which protection (NAME.KEY=VALUE) with {len(args.protect)} --protect")
            name = args.protect[0]
        if name not in params:
            raise SinkstudyError(f"--protect-param {item}: {name!r} is not one of the --protect names ({', '.join(args.protect) or 'none'})")
        try:
            params[name][key] = yaml.safe_load(value)
        except yaml.YAMLError:
            raise SinkstudyError(f"--protect-param {item}: VALUE is not valid YAML") from None
    return [make_protection(name, params[name]) for name in args.protect]


def print_protections() -> None:
    # lazy: loads torch, numpy
    from interventions.protect import list_protections

    for name, spec in list_protections().items():
        print(f"  {name:<26} {spec.description}")
        print(f"  {'':<26} settings: " + ", ".join(f"{k}={v!r}" for k, v in spec.defaults.items()))


def main(args) -> Summary | int:
    load_plugin_options(args)
    if args.protect == ["list"]:
        print_protections()
        return 0
    vision, config = build_request(args)
    hooks = protections(args)
    if args.estimate:
        examples = options.stage_counts(args.examples, [s.name for s in config.stages], "examples")
        print(format_estimate(estimate(args.base, vision, config, gpu=args.gpu, world=args.gpus,
                                       tokens_per_example=args.tokens_per_example, examples=examples)))
        return 0
    # lazy: loads torch, numpy
    from interventions.adapt.run import REPORT, check_inputs

    check_inputs(args.base, vision, config, hooks)  # data, tower, stages: before anything is written
    out = Path(args.out)
    step = Step("adapt/run", Adapt(Ref(str(args.base)), config.to_dict(), vision.to_dict() if vision else None,
                                   tuple({"name": h.name, "params": h.config} for h in hooks),
                                   {"init": args.qknorm} if args.qknorm else None,
                                   Ref(str(args.tokenizer)) if args.tokenizer else None, device=args.device or "cpu", run_dir=out / "run",
                                   model_dir=out / "model", resume=args.resume), outputs=(out / "run", out / "model"))
    engine = run_plan(Plan([step]), out, force=args.force, progress=not args.quiet, seed=config.seed, guarded=("run",))
    report = read_json(out / "run" / REPORT) if engine.main and (out / "run" / REPORT).is_file() else None
    if report:
        print(format_adapt(report))
        for stage in report["stages"]:
            for name, summary in (stage.get("hooks") or {}).items():
                print(f"{stage['stage']} {name}: {json.dumps(summary, default=str)}")
        if not any(e["reused"] for e in engine.log):  # a reuse was said by the engine
            print(f"wrote {args.out} (model: {report['model']})")
    if not report:
        return 0  # a data-parallel worker: rank 0 reports
    # lazy: loads torch, numpy
    from interventions.adapt.run import run_summary

    s = run_summary(report)
    steps = ", ".join(f"{r['stage']} {r['steps']} steps (final loss {_f(r['final_loss'])}, the mean of its last "
                      f"{r['final_loss_steps']} step(s))" for r in s["stages"])
    sink = (f"; Sink Strength of the LM {_f(s['sink_strength'][0])} -> {_f(s['sink_strength'][1])}" if s["sink_strength"] else "")
    return Summary("adapt", f"{args.base} adapted: {steps}{sink}", outputs=[args.out, report["model"]],
                   next=[cmd("sinkstudy", "eval", report["model"]), cmd("sinkstudy", "sink", report["model"])])
