"""`sinkstudy eval` (strict-grader evals through lm-eval) and `sinkstudy compare` (paired statistics)."""

from __future__ import annotations

import math
import os
from pathlib import Path

from evals.eval_run import RESULTS_FILE, SAMPLES_DIR, EvalRun
from evals.runs import check_same_data, data_sources, headline, resolve_run
from experiments.cli import argtypes, options
from experiments.cli.closing import Summary, cmd
from experiments.cli.options import DEFAULT_TASKS, PAPER_TASKS, check_hub_tasks, eval_protocol
from experiments.report.published import PUBLISHED_METRIC, beside_run, published_task
from experiments.study.graph import Plan, Step
from experiments.study.kinds import Ref
from experiments.study.pair_steps import Loading, MeasureEval
from experiments.study.runner import run_plan
from sinkstudy import SinkstudyError
from sinkstudy.io import check_output_dir, check_replaceable, read_json, write_json_atomic
from sinkstudy.provenance import provenance


def register(subparsers) -> None:
    p = subparsers.add_parser("eval", help="strict-grader evals of a model through lm-eval (a finished run is reused)",
                              description="Evaluate MODEL (local path or hub id) on lm-eval tasks: by default the shipped "
                              f"offline task sets {DEFAULT_TASKS}; lm-eval's own tasks (e.g. the paper's {PAPER_TASKS}) "
                              "need the hub, or --data TASK=FILE. The run (results.json + samples/) is written to --out "
                              "(default runs/eval/<model>); a rerun with the same settings reuses it, another run with the same settings "
                              "(a study's eval of the same model) is reused too.")
    p.add_argument("model", help=f"the model: {options.model_forms()}")
    options.add_eval_options(p)
    options.add_model_options(p, dtype="float32 on hf, the checkpoint's on vllm")
    options.add_output_options(p, out="runs/eval/<model>", cache=True)
    options.add_seed_option(p, "lm-eval's sampling and few-shot choice")
    options.add_compute_options(p)
    options.add_progress_options(p)
    p.set_defaults(func=_eval)

    c = subparsers.add_parser("compare", help="paired comparison of two eval runs (bootstrap CI, McNemar)",
                              description="Per task and metric: A, B, Δ = B − A in points (score × 100) and Δ / A with "
                              "paired bootstrap CIs (prompts resampled) and McNemar's exact p, on the prompts both runs share. "
                              "A run is an `eval` output, or a merge / mitigate output holding one (OUT/eval). "
                              "--published sets the pair (A = base, B = VLM LM) beside the seed paper's six.")
    c.add_argument("run_a", help="eval run dir (the reference, e.g. the base LLM)")
    c.add_argument("run_b", help="eval run dir (e.g. the VLM's language model)")
    options.add_task_option(c, default="every task both runs hold")
    options.add_bootstrap_options(c)
    options.add_seed_option(c, "the bootstrap")
    c.add_argument("--json", default=None, metavar="FILE", help="also write the comparisons as JSON")
    options.add_force_option(c, "--json")
    c.add_argument("--published", action="store_true",
                   help="put this pair's IFEval prompt-level strict Δ beside the paper's six pairs and recompute rho over "
                        "the union (left out, with a one-line warning, when the task or prompts differ from the paper's)")
    sink = c.add_mutually_exclusive_group()
    sink.add_argument("--sink-strength", type=argtypes.finite_float, default=None, metavar="S",
                      help="--published: Sink Strength S of A (the base)")
    sink.add_argument("--sink-json", default=None, metavar="FILE", help="--published: a sink.json of A from `sinkstudy sink` (logodds metric)")
    options.add_compute_options(c)
    options.add_progress_options(c)
    c.set_defaults(func=_compare)


def _eval(args) -> Summary | int:
    """The eval as one step (`experiments.study.pair_steps.MeasureEval`) through the engine: reused when this --out (or,
    without --no-cache, another run) finished it, refused when other settings made the run in --out."""
    protocol = eval_protocol(args)
    check_hub_tasks(protocol.tasks, protocol.data_files)
    out = Path(args.out) if args.out else options.default_out("eval", args.model)
    dtype = args.dtype or (None if protocol.backend == "vllm" else "float32")  # None: vLLM's "auto", the checkpoint's own
    step = Step("eval/run", MeasureEval(Ref(str(args.model)), Ref(str(args.tokenizer or args.model)), protocol, args.seed,
                                        Loading(dtype, args.device), out=out), outputs=(out,))
    engine = run_plan(Plan([step]), out, force=args.force, progress=not args.quiet, guarded=("run",), not_mine=_not_an_eval_run,
                      **options.sharing(args))
    if not engine.main:  # a data-parallel worker (accelerate launch): rank 0 prints and writes
        return 0
    run = EvalRun.load(out)
    for task, source in data_sources(run).items():  # the run header: a task on other data says so
        print(f"{task}: prompts from {source}, not the task's default data")
    print(run.summary())
    if not engine.log[0]["reused"]:  # a reuse was said by the engine
        print(f"eval run written to {out}")
    limited = f" (first {args.limit} prompts per task)" if args.limit else ""
    capped = _cap_note(protocol)
    if capped:
        print(capped)
    return Summary("eval", f"{args.model}: {headline(run)}{limited}" + (f"; {capped}" if capped else ""), outputs=[out],
                   next=[cmd("sinkstudy", "compare", "OTHER_RUN", out)])


def _cap_note(protocol) -> str | None:
    """A run at the default generation cap says so: a task whose own cap is longer (gsm8k_cot, bbh_cot_fewshot) is
    cut short, so its scores are not the task's reference ones."""
    if protocol.max_gen_toks != options.PROTOCOL.max_gen_toks:
        return None
    return (f"generation capped at {protocol.max_gen_toks} tokens per prompt (the default); --max-gen-toks 0 keeps each task's "
            "own cap, as the paper's tasks need")


def _not_an_eval_run(path: Path) -> str | None:
    """None when `path` is an eval run (its results, samples and step record) and nothing else (--force replaces it
    whole); else what is not one."""
    if not (path / RESULTS_FILE).is_file():
        return f"no {RESULTS_FILE}"
    other = sorted(n for n in os.listdir(path) if not n.startswith(".") and n not in (RESULTS_FILE, SAMPLES_DIR, "steps"))
    return f"{', '.join(other[:3])}{' ...' if len(other) > 3 else ''} beside its {RESULTS_FILE}" if other else None


COMPARE_KEYS = ("run_a", "run_b", "comparisons", "provenance")  # what `compare --json` writes: its record


def _compare(args) -> Summary | int:
    # lazy: loads numpy
    from evals.stats import compare_runs, format_table

    if args.json:  # only an earlier `compare --json` is replaced, and only with --force

        check_replaceable(args.json, args.force, flag="--json", directory=False,
                          not_mine=lambda f: options.json_made_with(f, COMPARE_KEYS, "compare"))
        check_output_dir(args.json, args.force)
    sink = _published_sink(args)  # every input checked before the runs are read
    dir_a, dir_b = resolve_run(args.run_a), resolve_run(args.run_b)
    a, b = EvalRun.load(dir_a), EvalRun.load(dir_b)
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()] if args.tasks else None
    if args.tasks is not None and not tasks:
        raise SinkstudyError("--tasks is empty")
    ifeval = published_task(a, b, tasks) if args.published else None
    for run, path in ((a, dir_a), (b, dir_b)):
        missing = [t for t in tasks or [] if t not in run.samples and t not in run.groups]
        if missing:
            raise SinkstudyError(f"run {path} has no task {', '.join(missing)}; it has {', '.join([*run.samples, *run.groups]) or 'none'}")
    check_same_data(a, b, tasks or [t for t in a.scores if t in b.scores])
    comps = compare_runs(a, b, tasks, n_boot=args.n_boot, confidence=args.confidence, seed=args.seed)
    print(f"A = {dir_a} ({a.model_name})\nB = {dir_b} ({b.model_name})")
    print(format_table(comps))
    published = None
    if args.published:
        published = beside_run(next(c for c in comps if (c.task, c.metric) == (ifeval, PUBLISHED_METRIC)), sink, a,
                               n_boot=args.n_boot, confidence=args.confidence, seed=args.seed)
    if args.json:
        write_json_atomic(args.json, {"run_a": str(dir_a), "run_b": str(dir_b),
                                      "convention": "Δ = B − A in points (score × 100; negative = B lost capability); relative = Δ / A",
                                      "comparisons": [c.as_dict() for c in comps],
                                      "published": published,
                                      "provenance": provenance(model_fingerprints={str(dir_a): a.fingerprint, str(dir_b): b.fingerprint},
                                                               seeds={"bootstrap": args.seed})})
    first = comps[0] if comps else None
    result = (f"{first.task} {str(first.metric).removesuffix(',none')}: Δ = B − A = {first.delta_points:+.1f} points "
              f"[{first.delta_points_ci[0]:+.1f}, {first.delta_points_ci[1]:+.1f}], n = {first.n}"
              + (f" (+ {len(comps) - 1} more rows above)" if len(comps) > 1 else "") if first else "nothing to compare")
    return Summary("compare", result, outputs=[args.json] if args.json else [],
                   next=[] if args.published else [cmd("sinkstudy", "compare", args.run_a, args.run_b, "--published", "--sink-json",
                                                       "BASE_SINK_JSON")])


def _published_sink(args) -> float | None:
    """S of run A for --published, from --sink-strength or a sink.json; refuses what cannot be compared."""
    if not args.published:
        if args.sink_strength is not None or args.sink_json:
            raise SinkstudyError("--sink-strength / --sink-json only apply with --published")
        return None
    if args.sink_json:
        try:
            data = read_json(args.sink_json)
        except (OSError, ValueError, SinkstudyError) as exc:
            raise SinkstudyError(f"cannot read --sink-json {args.sink_json}: {exc}") from None
        metric = data.get("metric") if isinstance(data, dict) else None
        if metric != "logodds":
            raise SinkstudyError(f"--sink-json {args.sink_json}: not a logodds sink.json (metric {metric!r}); the paper's S is the logodds metric")
        value = data.get("value")
    elif args.sink_strength is not None:
        value = args.sink_strength
    else:
        raise SinkstudyError("--published needs the base's Sink Strength: --sink-strength S or --sink-json FILE")
    if not isinstance(value, (int, float)) or not math.isfinite(value):
        raise SinkstudyError(f"the Sink Strength must be a finite number, got {value!r}")
    return float(value)


