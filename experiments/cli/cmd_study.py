"""`sinkstudy run CONFIG [--jobs N]`, `sinkstudy demo [--out DIR] [--quick | --real] [--jobs N]`, `sinkstudy paper [--dry-run] [--limit N]`,
`sinkstudy report RUN_DIR`."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
from pathlib import Path

import yaml

from experiments.cli import options
from experiments.cli.argtypes import add_plugin_option, load_plugin_options, seed_list
from experiments.cli.closing import Summary, cmd, existing
from experiments.demo.build import quick_overrides
from experiments.demo.study import load_study
from experiments.study.graph import format_records
from experiments.study.jobs import default_jobs
from experiments.study.launch import check_out, launch, step_command
from experiments.study.paper import check_can_run, format_plan, plan
from experiments.study.runner import plan_records, run_step
from sinkstudy import SinkstudyError, threads
from sinkstudy.inputs import planning_only
from sinkstudy.io import read_json

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
DEMO_CONFIG = CONFIG_DIR / "demo.yaml"
DEMO_REAL_CONFIG = CONFIG_DIR / "demo_real.yaml"
PAPER_CONFIG = CONFIG_DIR / "paper_six_pairs.yaml"


def register(subparsers) -> None:
    p = subparsers.add_parser("run", help="run a study config (resumable: finished steps are reused)",
                              description="Run every step of a study, reusing finished ones, then write the summary and report. "
                              "For a scheduler: --plan lists every step as an independent command (`--step ID`) with what it "
                              "reads, writes and runs after; run them in any order that respects `after`, then run the "
                              "config once more to collect the summary and report.")
    p.add_argument("config", help="study YAML, e.g. experiments/configs/demo.yaml")
    one = p.add_mutually_exclusive_group()
    one.add_argument("--plan", nargs="?", const="text", choices=("text", "json"),
                     help="print every step as a command with its inputs, outputs and dependencies (json: one list); run nothing")
    one.add_argument("--step", metavar="STEP_ID", help="run only this step (its dependencies must have finished)")
    add_plugin_option(p)
    _common(p)
    _eval_overrides(p)
    _jobs(p, "1")
    _seeds(p)
    options.add_compute_options(p, study=True)
    p.set_defaults(func=cmd_run)

    p = subparsers.add_parser("demo", help="the embedded miniature study on CPU, offline; report in OUT/report.md",
                              description="The embedded miniature study (experiments/configs/demo.yaml): tiny base LLMs "
                              "pretrained from scratch, LLaVA-adapted on digits, then measured, merged and reported like real "
                              "pairs; report in OUT/report.md (default: the config's out, runs/demo; make demo QUICK=1 "
                              "passes --out runs/demo-quick). docs/study.md.")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--quick", action="store_true", help="fewer steps, smaller models (what the test runs)")
    which.add_argument("--real", action="store_true",
                       help="google/gemma-3-270m adapted like the miniatures (experiments/configs/demo_real.yaml; needs the `real` extra)")
    p.add_argument("--config", default=None, help=argparse.SUPPRESS)
    _common(p)
    _jobs(p, "one per core, at most 4; 1 with --real")
    _seeds(p)
    options.add_compute_options(p, study=True)
    p.set_defaults(func=cmd_demo)

    p = subparsers.add_parser("paper", help="the seed paper's six-pair study (GPU expected)",
                              description="The seed paper's six (base LLM, VLM) pairs from the hub, measured and reported "
                              "(experiments/configs/paper_six_pairs.yaml); --dry-run prints the plan, disk and GPU memory "
                              "offline. Refused without CUDA unless --limit makes it small. docs/study.md.")
    p.add_argument("--dry-run", action="store_true", help="print the plan (models, tasks, merges, disk, GPU memory) offline")
    p.add_argument("--config", default=None, help=f"study YAML (default: {PAPER_CONFIG.relative_to(CONFIG_DIR.parent.parent)})")
    _common(p)
    _eval_overrides(p)
    options.add_compute_options(p, study=True)
    p.set_defaults(func=cmd_paper)

    p = subparsers.add_parser("report", help="re-render a run's report.md / report.html / plots from its summary.json",
                              description="Write RUN_DIR/report.md, report.html and plots/ again from RUN_DIR/summary.json alone "
                              "(no step is run or read): after a change of the report's code, or to render a copied run.")
    p.add_argument("run_dir", metavar="RUN_DIR", help="a study's output directory (holding summary.json)")
    options.add_progress_options(p)
    p.set_defaults(func=cmd_report)


def _common(p) -> None:
    options.add_output_options(p, out="the config's `out`")
    options.add_progress_options(p)


def _seeds(p) -> None:
    p.add_argument("--seeds", type=seed_list, default=None, metavar="S,S,...",
                   help="repeat every training stage with each of these seeds (the first's run in --out, seed N's in "
                        "OUT/seeds/N); the report gives each figure per seed with its spread (default: the config's `seeds`, "
                        "else one run)")


def _jobs(p, default: str) -> None:
    p.add_argument("--jobs", type=_positive, default=None, metavar="N",
                   help=f"run independent steps on N local worker processes, one torch thread each (default: {default})")


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return int(text)


def _eval_overrides(p) -> None:
    """The config's eval and model settings, overridden from the command line (`make ... LIMIT= TASKS= DEVICE= DTYPE=`):
    the same flags as `sinkstudy eval`'s, None keeping the config's."""

    g = p.add_argument_group("overrides of the config's evals and model settings")
    options.add_limit_option(g)
    options.add_task_option(g, default="the config's evals.tasks")
    options.add_model_options(p, device="the config's model.device", dtype="the config's model.dtype", tokenizer=False)


def _overrides(args) -> dict | None:
    """The config overrides of `_eval_overrides`' flags (None: none given)."""
    evals = {k: v for k, v in (("limit", args.limit), ("tasks", args.tasks)) if v is not None}
    model = {k: v for k, v in (("device", args.device), ("dtype", args.dtype)) if v is not None}
    seeds = getattr(args, "seeds", None)
    return {k: v for k, v in (("evals", evals), ("model", model), ("seeds", seeds)) if v} or None


def _check_hub(study) -> None:
    options.check_hub_tasks(study.evals.protocol.tasks, study.evals.protocol.data_files)


def _run(study, args, jobs: int = 1) -> Summary:
    res = launch(study, jobs=jobs, force=args.force, progress=not args.quiet, threads=args.threads or 1,
                 numerics=getattr(args, "numerics", None) or [], argv=args.argv)
    stages = ", ".join(f"{k} {v:.0f}s" for k, v in res["stage_seconds"].items() if v)
    print(f"sinkstudy: {study.name}: report {res['report']} (+ {Path(res['html']).name}); {res['steps']} steps, "
          f"{res['reused']} reused, {res['seconds']:.0f}s" + (f" [{stages}]" if stages else ""))
    nxt = {"demo": [cmd("sinkstudy", "run", CONFIG_DIR / "real_pairs_template.yaml", "--plan"), cmd("sinkstudy", "paper", "--dry-run")],
           "paper": [cmd("sinkstudy", "paper-table")]}.get(args.command, [cmd("sinkstudy", "run", args.config, "--plan")])
    return Summary(args.command, f"study {study.name}: {res['steps']} steps ({res['reused']} reused)"
                   + (f", time by stage: {stages}" if stages else "") + f"; read {Path(res['report']).name} first",
                   outputs=existing(res["report"], res["html"], study.out), next=nxt)


def cmd_run(args) -> Summary | int:
    load_plugin_options(args)  # before the config: its interventions and arms may name a plug-in's
    with planning_only() if args.plan else contextlib.nullcontext():  # a plan reads no input file: they may not exist yet
        study = load_study(args.config, out=args.out, overrides=_overrides(args))
    command = step_command(args.config, args.out, args.plugin, {k: getattr(args, k) for k in ("limit", "tasks", "device", "dtype")})
    if args.numerics and len(args.numerics) > 1 and (args.plan or args.step):
        raise SinkstudyError(f"{'--plan' if args.plan else '--step'} takes one numeric mode's study: run the spread whole, "
                             "or one --numerics mode")
    if study.seeds and (args.plan or args.step):
        raise SinkstudyError(f"{'--plan' if args.plan else '--step'} takes one seed's study, and {study.name} repeats over seeds "
                             f"{','.join(map(str, study.seeds))}: run it whole, or without seeds")
    if args.plan:
        with planning_only():
            steps = plan_records(study, command)
        print(json.dumps(steps, indent=1) if args.plan == "json" else format_records(steps, study.name, command))
        return 0
    _check_hub(study)
    options.check_device(study.model.device)
    if args.step:
        check_out(study, args.force)
        done = run_step(study, args.step, force=args.force, progress=not args.quiet, command=command)
        print(f"sinkstudy: {study.name}: step {done['step']} " + ("reused (finished before; --force re-runs it)" if done["reused"]
                                                                   else f"done in {done['seconds']:.0f}s"))
        return Summary("run --step", f"study {study.name}: step {done['step']} " + ("reused" if done["reused"] else "done"),
                       outputs=[study.out], next=[f"{command} --plan   (the steps left), then {command}   (summary and report)"])
    return _run(study, args, jobs=args.jobs or 1)


def cmd_demo(args) -> Summary | int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    config = Path(args.config or (DEMO_REAL_CONFIG if args.real else DEMO_CONFIG))
    overrides = quick_overrides(yaml.safe_load(config.read_text())) if args.quick else None
    if args.seeds:
        overrides = {**(overrides or {}), "seeds": args.seeds}
    study = load_study(config, out=args.out, overrides=overrides)  # default out: the config's (runs/demo, runs/demo-real)
    if not args.real and args.threads is None:
        threads.apply(1)  # tiny models: one thread per process is fastest (experiments/study/jobs.py)
    jobs = args.jobs or (1 if args.real else default_jobs())
    return _run(study, args, jobs=jobs)


def cmd_paper(args) -> Summary | int:
    study = load_study(args.config or PAPER_CONFIG, out=args.out, overrides=_overrides(args))
    if args.dry_run:
        print(format_plan(plan(study)))
        return 0
    check_can_run(study, args.limit)
    _check_hub(study)
    options.check_device(study.model.device)
    return _run(study, args)


def cmd_report(args) -> Summary:
    from experiments.report.document import write_report  # its figures load numpy and torch: not before the threads are set

    run = Path(args.run_dir)
    if not (run / "summary.json").is_file():
        raise SinkstudyError(f"{run} holds no summary.json: run the study first (sinkstudy run CONFIG)")
    summary = read_json(run / "summary.json")
    try:  # report.md and .html are written last, each whole: a summary that cannot be rendered leaves the old ones
        report = write_report(summary, run)
    except (KeyError, TypeError, AttributeError, IndexError) as exc:
        what = f"it lacks {exc}" if isinstance(exc, KeyError) else f"{type(exc).__name__}: {exc}"
        raise SinkstudyError(f"{run / 'summary.json'} is not a summary this version can render ({what}); run the study "
                             "again to write it (its finished steps are reused)") from None
    return Summary("report", f"{report} re-rendered from {run / 'summary.json'}",
                   outputs=existing(report, report.with_suffix(".html"), run / "plots"))
