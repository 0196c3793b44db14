"""`sinkstudy qknorm BASE`: inject QK-RMSNorm -> (recovery training | VL adaptation) -> sink + strict evals.

Without --recipe: the injected model (optionally recovery-trained on text) is compared with the
original BASE on the same calibration texts and eval prompts. With `--native-ok` a backbone that
already has QK-norm goes through the same recipe as the "native" arm instead of being refused.

With --recipe YAML (the paper's negative result, end to end): arms `control` (BASE, no injection),
`injected-<init>` for each --init mode and, with --native NATIVE_BASE (or when BASE itself has
QK-norm), `native`, all through the SAME adaptation (`interventions.adapt`: same tower init, data
order, seed and steps), then Sink Strength and strict evals of each arm's extracted language model,
side by side with paired CIs against the original base and against the control arm.
"""

from __future__ import annotations

import argparse

from experiments.report.fmt import brief as _f
from experiments.cli.closing import Summary, cmd, existing

DEMO_TRAIN_RECORDS = 2000
# Copies of interventions.qknorm's tuples (a test keeps them equal): importing it pulls in torch.
INIT_MODES = ("identity-gain", "scale-preserving", "blend")
TRAINABLE_MODES = ("gains", "attention", "all")


def register(subparsers) -> None:
    from experiments.cli import argtypes, options

    p = subparsers.add_parser("qknorm", help="inject QK-RMSNorm into BASE, optionally recovery-train, measure vs the original")
    p.add_argument("base", metavar="BASE", help=f"base LLM: {options.model_forms()}; Llama, Mistral, Qwen2, Gemma or Gemma2")
    p.add_argument("--init", default="scale-preserving",
                   help="gain initialisation: identity-gain, scale-preserving or blend; with --recipe a comma list (one arm each)")
    p.add_argument("--alpha", type=argtypes.finite_float, default=0.5, help="blend weight for --init blend: (1-a) x + a norm(x) (default 0.5)")
    p.add_argument("--calibration", default=None, metavar="SET|FILE",
                   help="calibration texts for gains, KL and Sink Strength: a shipped set (default ifeval15) or a .json/.jsonl/.txt file")
    p.add_argument("--native-ok", action="store_true", help="measure a native QK-norm backbone (same recipe) instead of refusing it")
    t = p.add_argument_group("training (recovery training on text, or with --recipe the VL adaptation)")
    options.add_train_steps_option(t)
    t.add_argument("--trainable", default="gains", choices=TRAINABLE_MODES, help="what recovery training updates (default gains)")
    t.add_argument("--train-texts", default=None, metavar="FILE",
                   help="recovery training text (.json/.jsonl/.txt); default: the demo corpus (synthetic chats)")
    t.add_argument("--train-lr", type=argtypes.finite_float, default=1e-3, help="recovery learning rate (default 1e-3)")
    t.add_argument("--train-batch-size", type=argtypes.positive_int, default=8, help="recovery batch size (default 8)")
    t.add_argument("--train-seq-len", type=argtypes.int_at_least(2), default=128, help="recovery sequence length (default 128)")
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
    options.add_progress_options(p)
    p.set_defaults(func=main)


def recovery_steps(args) -> int:
    """--train-steps: of recovery training (one text stage), a plain N (0 = no training); with --recipe, each
    [STAGE=]N replaces the recipe's steps of that stage (every stage without STAGE=), as in `sinkstudy adapt`."""
    from sinkstudy import SinkstudyError

    if not args.train_steps:
        return 0
    for value in args.train_steps if args.recipe else args.train_steps[-1:]:
        _, sep, count = value.rpartition("=")
        if sep and not args.recipe:
            raise SinkstudyError(f"--train-steps {value}: recovery training is one stage; give a plain N (STAGE=N is for --recipe's stages)")
        try:
            n = int(count)
        except ValueError:
            raise SinkstudyError(f"--train-steps {value}: not an integer") from None
        if n < 0 or (args.recipe and n < 1):
            raise SinkstudyError(f"--train-steps must be >= {1 if args.recipe else 0}, got {n}")
    return 0 if args.recipe else n


def default_out(args) -> str:
    from pathlib import Path

    name = Path(str(args.base).rstrip('/')).name
    if args.recipe:
        return str(Path("runs") / "qknorm" / f"{name}-adapt")
    return str(Path("runs") / "qknorm" / f"{name}-{args.init}-s{recovery_steps(args)}")


def _validate(args) -> None:
    from pathlib import Path

    from experiments.cli.options import check_hub_tasks, eval_kwargs
    from sinkstudy import SinkstudyError
    from sinkstudy.io import check_output_dir

    recovery_steps(args)
    kwargs = eval_kwargs(args)  # bad eval flags fail before any training
    if args.eval:
        check_hub_tasks(args.tasks, kwargs["data_files"])
    if args.backend == "vllm" and not args.recipe:
        raise SinkstudyError("--backend vllm evaluates checkpoints on disk: only the --recipe arms are; drop it here")
    if not 0.0 <= args.alpha <= 1.0:
        raise SinkstudyError(f"--alpha must be in [0, 1], got {args.alpha}")
    if args.train_texts and not Path(args.train_texts).is_file():
        raise SinkstudyError(f"--train-texts file not found: {args.train_texts}")
    if args.train_data and not args.recipe:
        raise SinkstudyError("--train-data is the adaptation's data (with --recipe); recovery training reads --train-texts")
    inits = [i.strip() for i in args.init.split(",") if i.strip()]
    bad = [i for i in inits if i not in INIT_MODES]
    if bad or not inits or (len(inits) > 1 and not args.recipe):
        raise SinkstudyError(f"--init {args.init}: choose {'a comma list' if args.recipe else 'one'} of {', '.join(INIT_MODES)}")
    if args.recipe:
        if args.vision and args.donor:
            raise SinkstudyError("--vision and --donor: choose one")
        if not (args.resume and Path(args.out).exists()):
            check_output_dir(args.out, args.force)
    else:
        check_output_dir(args.out, args.force)


def main(args) -> Summary | int:
    from experiments.cli.options import eval_tasks

    args.tasks = eval_tasks(args)
    args.out = args.out or default_out(args)
    _validate(args)
    if args.recipe:
        from experiments.study.qknorm_arm import format_arms, run_arms

        args.adapt, args.data = args.recipe, args.train_data  # the names the arms read
        report = run_arms(args)
        print(format_arms(report))
    else:
        report = run_qknorm(args)
        print(format_table(report))
    print(f"wrote {args.out}")
    return _summary(args, report)


def _summary(args, report: dict):
    """One line: Sink Strength and the first task's Δ (per arm with --recipe), with the paper's convention."""
    from pathlib import Path

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


def _texts(arg, default_set: str) -> list[str]:
    from evals.sink.calibration import resolve_texts

    return [t.text for t in resolve_texts(arg, default_set)[0]]


def _train_texts(args, tokenizer) -> list[str]:
    if args.train_texts:
        from evals.sink.calibration import load_texts_file

        return [t.text for t in load_texts_file(args.train_texts)]
    from experiments.demo.corpus import chat, training_records

    return [chat(tokenizer, u, a) if a is not None else u for u, a in training_records(DEMO_TRAIN_RECORDS, args.seed)]


def _precheck(args) -> None:
    """Refuse native / unsupported causal LMs from the config alone (a weightless meta model)."""
    import torch
    from transformers import AutoModelForCausalLM

    from interventions.pairs import archs
    from interventions.pairs.resolve import load_config
    from interventions.qknorm import check_injectable, qk_norm_kind

    config = load_config(args.base)
    if archs.classify(config) != "causal_lm":
        return  # a VLM: its language model is checked once extracted
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    if not (args.native_ok and qk_norm_kind(skeleton) == "native"):
        check_injectable(skeleton)


def run_qknorm(args) -> dict:
    """The whole pipeline; writes model/, evals/, report.json and report.txt under args.out."""
    import copy

    from interventions.pairs import load_causal_lm
    from interventions.qknorm import (
        check_injectable, checkpoint_format, init_report, inject_qk_norm, qk_norm_kind, save_injected, trainable_filter,
    )
    from interventions.training import train_causal_lm
    from sinkstudy import SinkstudyError
    from sinkstudy.io import atomic_output_dir, write_json_atomic, write_text_atomic
    from sinkstudy.provenance import model_fingerprint, provenance

    calibration = _texts(args.calibration, "ifeval15")
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    _precheck(args)
    original, tokenizer = load_causal_lm(args.base, dtype=args.dtype or "float32", device=args.device or "cpu")
    if args.tokenizer:
        from sinkstudy.checkpoint import load_tokenizer

        tokenizer = load_tokenizer(args.tokenizer)
    if tokenizer is None:
        raise SinkstudyError(f"no tokenizer found for {args.base}; pass --tokenizer")
    native = qk_norm_kind(original) == "native"
    if not (native and args.native_ok):
        check_injectable(original)  # refuses native / unsupported before any work
    steps = recovery_steps(args)
    train_texts = _train_texts(args, tokenizer) if steps else None

    candidate = copy.deepcopy(original)
    if not native:
        inject_qk_norm(candidate, init=args.init, calibration_texts=calibration, tokenizer=tokenizer, alpha=args.alpha)
    arm = "native" if native else "injected"
    at_init = init_report(original, candidate, tokenizer, calibration)
    training, after = None, None
    if steps:
        training = train_causal_lm(candidate, tokenizer, train_texts, steps=steps, lr=args.train_lr,
                                   batch_size=args.train_batch_size, seq_len=args.train_seq_len, progress=not args.quiet,
                                   device=args.device,
                                   trainable=trainable_filter(args.trainable), seed=args.seed, desc=f"recovery ({args.trainable})")
        after = init_report(original, candidate, tokenizer, calibration, sink_original=at_init["sink_strength_original"])

    with atomic_output_dir(args.out, force=args.force) as tmp:
        if native:
            candidate.save_pretrained(tmp / "model")
            tokenizer.save_pretrained(tmp / "model")
            fmt = "native"
        else:
            save_injected(candidate, tmp / "model", tokenizer=tokenizer, metadata={"init": args.init, "base": str(args.base)})
            fmt = checkpoint_format(candidate)
        evals = _evaluate(original, candidate, tokenizer, tasks, args, tmp / "evals") if args.eval else None
        report = {
            "base": str(args.base),
            "arm": arm,
            "init": None if native else args.init,
            "alpha": args.alpha if args.init == "blend" and not native else None,
            "checkpoint_format": fmt,
            "at_init": at_init,
            "training": None if training is None else {**training, "trainable": args.trainable,
                                                        "train_texts": args.train_texts or f"demo corpus ({DEMO_TRAIN_RECORDS} records)"},
            "after_training": after,
            "evals": evals,
            "provenance": provenance(
                model_fingerprints={"original": model_fingerprint(original), arm: model_fingerprint(candidate)},
                seeds={"seed": args.seed},
                settings={k: v for k, v in vars(args).items() if k != "func"},
                calibration=args.calibration or "ifeval15",
            ),
        }
        write_json_atomic(tmp / "report.json", report)
        write_text_atomic(tmp / "report.txt", format_table(report) + "\n")
    return report


def _evaluate(original, candidate, tokenizer, tasks, args, out) -> dict:
    """Both models on the same prompts, then paired differences (bootstrap CI, McNemar) per metric."""
    from evals.lmeval import run_eval
    from evals.stats import compare_runs
    from experiments.cli.options import eval_kwargs

    kw = dict(tasks=tasks, seed=args.seed, progress=not args.quiet, **eval_kwargs(args))
    runs = {"original": run_eval(original, tokenizer, out_dir=out / "original", **kw),
            "candidate": run_eval(candidate, tokenizer, out_dir=out / "candidate", **kw)}
    return {"scores": {name: r.scores for name, r in runs.items()},
            "paired": [c.as_dict() for c in compare_runs(runs["original"], runs["candidate"], tasks, seed=args.seed)]}


def format_table(report: dict) -> str:
    from evals.stats import Comparison, format_table as paired_table

    arm, init, after = report["arm"], report["at_init"], report["after_training"]
    head = f"{'measure (calibration texts)':<34} {'original':>10} {'at init':>10} {'trained':>10}"
    lines = [f"QK-norm {arm} ({report['init'] or 'native'}) on {report['base']}", head, "-" * len(head),
             f"{'Sink Strength':<34} {_f(init['sink_strength_original']):>10} {_f(init['sink_strength_injected']):>10} "
             f"{_f(after and after['sink_strength_injected']):>10}",
             f"{'mean next-token KL vs original':<34} {_f(0.0):>10} {_f(init['mean_kl']):>10} {_f(after and after['mean_kl']):>10}"]
    if report["evals"]:
        evaluated = "trained" if after else "at init"
        lines += ["", f"strict evals: original vs {arm} ({evaluated}); Δ = {arm} − original in points (negative: {arm} lost capability)",
                  paired_table([Comparison(**c) for c in report["evals"]["paired"]], names=("original", arm))]
    return "\n".join(lines)
