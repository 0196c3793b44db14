"""`sinkstudy qknorm BASE`: inject QK-RMSNorm -> (recovery training | VL adaptation) -> sink + strict evals:
the arguments, then `experiments.study.qknorm_plans` (`run_recovery`, or with --recipe `run_arms`).

Without --recipe: the injected model (optionally recovery-trained on text) is compared with the
original BASE on the same calibration texts and eval prompts. With `--native-ok` a backbone that
already has QK-norm goes through the same recipe as the "native" arm instead of being refused.

With --recipe YAML (the paper's negative result, end to end): arms `control` (BASE, no injection),
`injected-<init>` for each --init mode and, with --native NATIVE_BASE (or when BASE itself has
QK-norm), `native`, all through the SAME adaptation, then Sink Strength and strict evals of each arm's
extracted language model, side by side with paired CIs against the original base and against the control arm.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from evals.sink.calibration import DEFAULT_SET
from experiments.cli import argtypes, options
from experiments.cli.closing import Summary, cmd, existing
from experiments.cli.options import check_hub_tasks, default_out as out_for, eval_protocol, sharing
from experiments.demo.steps import RECOVERY_RECORDS, recovery_chats
from experiments.report.fmt import brief as _f
from experiments.study.kinds import Ref
from experiments.study.pair_steps import InjectQKNorm, Loading, texts_ref
from experiments.study.qknorm_plans import GROUP, arms_recipe, native, recovery_text, run_arms, run_recovery
from interventions.adapt import load_config
from interventions.qknorm_modes import INIT_MODES, TRAINABLE_MODES
from interventions.registry import QKNORM
from sinkstudy import SinkstudyError

def register(subparsers) -> None:
    d = QKNORM.defaults
    p = subparsers.add_parser("qknorm", help="inject QK-RMSNorm into BASE, optionally recovery-train, measure vs the original",
                              description="Inject QK-RMSNorm into BASE (--init), optionally recovery-train it on text "
                              "(--train-steps), then measure it against the original: KL, Sink Strength and the strict evals "
                              "with paired CIs (OUT/report.txt). With --recipe, the paper's experiment instead: control, "
                              "injected (one arm per --init) and native (--native) arms through one VL adaptation, side by "
                              "side (OUT/report.md). docs/qknorm.md.")
    p.add_argument("base", metavar="BASE", help=f"base LLM: {options.model_forms()}; Llama, Mistral, Qwen2, Gemma or Gemma2")
    p.add_argument("--init", default=d["init"],
                   help=f"gain initialisation: {', '.join(INIT_MODES)}; with --recipe a comma list (one arm each) (default {d['init']})")
    p.add_argument("--alpha", type=argtypes.finite_float, default=d["alpha"],
                   help=f"blend weight for --init blend: (1-a) x + a norm(x) (default {d['alpha']})")
    p.add_argument("--calibration", default=None, metavar="SET|FILE",
                   help=f"calibration texts for gains, KL and Sink Strength: a shipped set (default {DEFAULT_SET}) or a .json/.jsonl/.txt file")
    p.add_argument("--native-ok", action="store_true", help="measure a native QK-norm backbone (same recipe) instead of refusing it")
    t = p.add_argument_group("training (recovery training on text, or with --recipe the VL adaptation)")
    options.add_train_steps_option(t)
    t.add_argument("--trainable", default=d["trainable"], choices=TRAINABLE_MODES,
                   help=f"what recovery training updates (default {d['trainable']})")
    t.add_argument("--train-texts", default=None, metavar="FILE",
                   help="recovery training text (.json/.jsonl/.txt); default: the demo corpus (synthetic chats)")
    t.add_argument("--train-lr", type=argtypes.finite_float, default=d["lr"], help=f"recovery learning rate (default {d['lr']})")
    t.add_argument("--train-batch-size", type=argtypes.positive_int, default=d["batch_size"],
                   help=f"recovery batch size (default {d['batch_size']})")
    t.add_argument("--train-seq-len", type=argtypes.int_at_least(2), default=d["seq_len"],
                   help=f"recovery sequence length (default {d['seq_len']})")
    options.add_recipe_option(t, help="run the arms (control, injected per --init, native) through this VL adaptation recipe "
                              "(YAML, docs/adapt.md) instead of recovery training")
    options.add_vision_options(t, required=False)
    options.add_train_data_option(t, help="--recipe: training data per stage (default digits)")
    t.add_argument("--native", metavar="BASE", default=None,
                   help="--recipe: a base with native QK-norm (same shape family) run through the same adaptation as arm `native`")
    t.add_argument("--resume", action="store_true", help="--recipe: continue the arms in an existing --out")
    p.add_argument("--eval", dest="eval", action=argparse.BooleanOptionalAction, default=True,
                   help="the strict evals (--no-eval: sink and KL only)")
    options.add_eval_options(p)
    options.add_model_options(p)
    options.add_output_options(p, out="runs/qknorm/<base>-<init>-s<steps>, or <base>-adapt with --recipe", cache=True)
    options.add_seed_option(p, "training and evals")
    options.add_compute_options(p)
    options.add_progress_options(p)
    p.set_defaults(func=main)


def default_out(args) -> str:
    """runs/qknorm/<base>-<init>-s<steps>, or <base>-adapt with --recipe (the base as `options.model_label` names it)."""
    return str(out_for("qknorm", args.base, *(["adapt"] if args.recipe else [args.init, f"s{options.recovery_steps(args.train_steps)}"])))


def _validate(args):
    """Every input checked before any work; the eval protocol (None with --no-eval)."""
    if args.recipe:
        options.check_counts(args.train_steps)  # each [STAGE=]N; the stages are the recipe's, read below
    else:
        options.recovery_steps(args.train_steps)  # a plain N: STAGE=N is for --recipe's stages
    protocol = eval_protocol(args)  # bad eval flags fail before any training
    if args.eval:
        check_hub_tasks(protocol.tasks, protocol.data_files)
    if protocol.backend == "vllm" and not args.recipe:
        raise SinkstudyError("--backend vllm evaluates checkpoints on disk: only the --recipe arms are; drop it here")
    if args.train_texts and not Path(args.train_texts).is_file():
        raise SinkstudyError(f"--train-texts file not found: {args.train_texts}")
    if args.train_data and not args.recipe:
        raise SinkstudyError("--train-data is the adaptation's data (with --recipe); recovery training reads --train-texts")
    inits = [i.strip() for i in args.init.split(",") if i.strip()]
    if not inits or (len(inits) > 1 and not args.recipe):
        raise SinkstudyError(f"--init {args.init}: choose {'a comma list' if args.recipe else 'one'} of {', '.join(INIT_MODES)}")
    for init in inits:
        QKNORM.resolve({"init": init, "alpha": args.alpha, "trainable": args.trainable, "lr": args.train_lr,
                        "batch_size": args.train_batch_size, "seq_len": args.train_seq_len})
    if args.recipe and args.vision and args.donor:
        raise SinkstudyError("--vision and --donor: choose one")
    return protocol if args.eval else None


def main(args) -> Summary | int:
    protocol = _validate(args)
    args.out = args.out or default_out(args)
    out = Path(args.out)
    loading = Loading(args.dtype or "float32", args.device)
    if args.recipe:
        # lazy: loads numpy
        from experiments.report.qknorm_tables import format_arms

        vision, recipe = _arms_recipe(args)
        report = run_arms(args.base, [i.strip() for i in args.init.split(",") if i.strip()], args.native, args.native_ok, out,
                          recipe_file=args.recipe, force=args.force, progress=not args.quiet, recipe=recipe, vision=vision,
                          protocol=protocol or _no_eval(), calibration=args.calibration, alpha=args.alpha, seed=args.seed,
                          loading=loading, sharing=sharing(args))
        print(format_arms(report))
    else:
        # lazy: loads numpy
        from experiments.report.qknorm_tables import format_injection

        steps = options.recovery_steps(args.train_steps)
        before, text = recovery_text(steps, args.train_texts, lambda: recovery_chats(f"{GROUP}/text", out / "recovery.jsonl", args.seed))
        args_ = _inject_args(args, native(args.base, args.native_ok), steps, text, loading)
        report = run_recovery(args.base, out, args_, protocol, before=before, tokenizer=args.tokenizer, force=args.force,
                              progress=not args.quiet,
                              training_text=args.train_texts or f"demo corpus ({RECOVERY_RECORDS} records)", sharing=sharing(args))
        print(format_injection(report))
    print(f"wrote {args.out}")
    return _summary(args, report)


def _no_eval():
    raise SinkstudyError("--recipe measures each arm by its evals: drop --no-eval")


def _inject_args(args, is_native: bool, steps: int, text, loading):
    return InjectQKNorm(Ref(str(args.base)), None if is_native else args.init, args.alpha, texts_ref(args.calibration),
                        tokenizer=Ref(str(args.tokenizer)) if args.tokenizer else None, train_steps=steps, trainable=args.trainable,
                        lr=args.train_lr, batch_size=args.train_batch_size, seq_len=args.train_seq_len, training_text=text,
                        seed=args.seed, loading=loading, out=Path(args.out) / "model")


def _arms_recipe(args) -> tuple[dict, dict]:
    """The arms' (vision, recipe) from --recipe with --train-data and --train-steps per stage, --vision / --donor."""
    config = load_config(args.recipe)
    names = [s.name for s in config.stages]
    return arms_recipe(config.to_dict(), options.parse_stage_values(args.train_data, names, "train-data"),
                       options.stage_counts(args.train_steps, names), options.vision_spec(args, config.seed))


def _summary(args, report: dict):
    """One line: Sink Strength and the first task's Δ (per arm with --recipe), with the paper's convention."""
    out = Path(args.out)
    if args.recipe:
        task = report["tasks"][0] if report["tasks"] else None
        deltas = [f"{name} {_f(row['tasks'][task]['vs_own_base']['delta'])}" for name, row in report["arms"].items()] if task else []
        result = (f"{task}: Δ = arm − its own base, points: {', '.join(deltas)}" if deltas else f"{len(report['arms'])} arm(s) adapted")
        return Summary("qknorm", result, outputs=existing(out / "report.md", out / "report.json", out),
                       next=[cmd("make", "protect-study")])  # the protection study on the demo's backbones (made first if missing)
    init, after = report["at_init"], report["after_training"]
    result = (f"Sink Strength {_f(init['sink_strength_original'])} original -> {_f(init['sink_strength_injected'])} {report['arm']}"
              + (f" -> {_f(after['sink_strength_injected'])} trained" if after else ""))
    paired = (report["evals"] or {}).get("paired") or []
    if paired:
        c = paired[0]
        result += (f"; {c['task']} Δ = {report['arm']} − original = {c['delta_points']:+.1f} points "
                   f"[{c['delta_points_ci'][0]:+.1f}, {c['delta_points_ci'][1]:+.1f}]")
    return Summary("qknorm", result, outputs=existing(out / "report.txt", out / "model", out / "evals"),
                   next=[cmd("sinkstudy", "qknorm", args.base, "--recipe", "experiments/configs/adapt/demo_digits.yaml",
                             "--init", args.init), cmd("sinkstudy", "sink", out / "model")])
