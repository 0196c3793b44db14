"""`sinkstudy eval` (strict-grader evals through lm-eval) and `sinkstudy compare` (paired statistics)."""

from __future__ import annotations

from pathlib import Path

from evals.protocol import BACKENDS
from experiments import argtypes
from experiments.summary import Summary, cmd

# The shipped offline task sets (evals.tasks.SHIPPED_TASKS, kept here so --help stays light): a run with no
# --tasks never needs the hub. The paper's hub tasks are opt-in.
DEFAULT_TASKS = "sinkstudy_ifeval,sinkstudy_gsm"
PAPER_TASKS = "ifeval,gsm8k_cot,bbh_cot_fewshot"


def register(subparsers) -> None:
    p = subparsers.add_parser("eval", help="strict-grader evals of a model through lm-eval (cached per task)",
                              description="Evaluate MODEL (local path or hub id) on lm-eval tasks: by default the shipped "
                              f"offline task sets {DEFAULT_TASKS}; lm-eval's own tasks (e.g. the paper's {PAPER_TASKS}) "
                              "need the hub, or --data TASK=FILE.")
    p.add_argument("model", help="checkpoint path or hub id")
    p.add_argument("--tasks", default=DEFAULT_TASKS,
                   help=f"comma-separated lm-eval task names (default {DEFAULT_TASKS}, offline; hub tasks are opt-in)")
    add_eval_args(p)
    p.add_argument("--tokenizer", default=None, help="tokenizer path/id when it is not beside the model")
    p.add_argument("--out", default=None, help="write the run (results.json + samples/) here")
    p.add_argument("--force", action="store_true", help="replace an existing --out that holds a different run")
    p.add_argument("--cache-dir", default=None, help="per-task result cache (default $SINKSTUDY_CACHE/evals)")
    p.add_argument("--no-cache", action="store_true", help="evaluate even when a cached result exists")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="load the model in this dtype (default float32 on hf; vllm: the checkpoint's)")
    p.add_argument("--device", default=None, help="device for the loaded model (hf backend), e.g. cuda")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_eval)

    c = subparsers.add_parser("compare", help="paired comparison of two eval runs (bootstrap CI, McNemar)",
                              description="Per task and metric: A, B, Δ = B − A in points (score × 100) and Δ / A with "
                              "paired bootstrap CIs (prompts resampled) and McNemar's exact p, on the prompts both runs share. "
                              "--published sets the pair (A = base, B = VLM LM) beside the seed paper's six.")
    c.add_argument("run_a", help="eval run dir (the reference, e.g. the base LLM)")
    c.add_argument("run_b", help="eval run dir (e.g. the VLM's language model)")
    c.add_argument("--tasks", default=None, help="comma-separated subset of tasks")
    c.add_argument("--n-boot", type=argtypes.n_boot, default=10_000, help="bootstrap replicates (>= 1)")
    c.add_argument("--confidence", type=argtypes.confidence, default=0.95)
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--json", default=None, metavar="FILE", help="also write the comparisons as JSON")
    c.add_argument("--published", action="store_true",
                   help="put this pair's IFEval prompt-level strict Δ beside the paper's six pairs and recompute rho over the union")
    sink = c.add_mutually_exclusive_group()
    sink.add_argument("--sink-strength", type=float, default=None, metavar="S", help="--published: Sink Strength S of A (the base)")
    sink.add_argument("--sink-json", default=None, metavar="FILE", help="--published: a sink.json of A from `sinkstudy sink` (logodds metric)")
    c.set_defaults(func=_compare)


def add_eval_args(p, *, prefix: str = "") -> None:
    """How an evaluating command runs lm-eval, the flags of `sinkstudy eval`: --limit, --max-gen-toks,
    --no-chat-template, the batch size, local task data, the backend and the protocol (`add_protocol_args`).
    `prefix` ("eval-") where the command's own --batch-size / --data mean something else (qknorm's recovery
    batch, adaptation data): then they are --eval-batch-size / --eval-data. `eval_kwargs` reads them back."""
    p.add_argument("--limit", type=argtypes.limit, default=None, help="first N docs per task (a fraction < 1: that share)")
    p.add_argument("--no-chat-template", action="store_true", help="prompt without the tokenizer's chat template")
    p.add_argument("--max-gen-toks", type=argtypes.int_at_least(0), default=256, help="generation length; 0 keeps each task's own")
    p.add_argument(f"--{prefix}batch-size", dest="eval_batch_size", type=argtypes.batch_size, default=8,
                   help="eval batch size: an integer, or auto / auto:N (lm-eval detects it)")
    add_protocol_args(p)
    p.add_argument(f"--{prefix}data", dest="eval_data", action="append", default=None, metavar="TASK=FILE",
                   help="local jsonl for a task (repeatable)")
    p.add_argument("--backend", choices=BACKENDS, default="hf",
                   help="hf-continuous: lm-eval's HF backend with continuous-batching greedy generation (docs/evals.md); "
                        "vllm: lm-eval's vLLM backend (GPU)")
    p.add_argument("--backend-args", default=None, metavar="JSON|K=V,...",
                   help="backend constructor arguments as a JSON object or K=V pairs (quote values with commas), "
                        "e.g. tensor_parallel_size=2,data_parallel_size=4,gpu_memory_utilization=0.85")


def eval_kwargs(args) -> dict:
    """run_eval's keyword arguments from the flags of `add_eval_args`, checked (one line on bad input);
    JSON data, so a command can record them in its report."""
    from evals.protocol import check_backend, parse_kwargs

    check_backend(args.backend)
    return {"limit": args.limit, "batch_size": args.eval_batch_size, "apply_chat_template": not args.no_chat_template,
            "max_gen_toks": args.max_gen_toks or None, "data_files": args.eval_data, "backend": args.backend,
            "backend_args": parse_kwargs(args.backend_args, "--backend-args"), **protocol_kwargs(args)}


def check_hub_tasks(tasks, data_files=None) -> None:
    """Tasks whose data comes from the hub (lm-eval's own, without a local --data file) fail at once,
    in one line, when the hub is unreachable (`sinkstudy.hub`), not after the libraries' retries.
    Unknown names are refused first, as such."""
    from evals.lmeval import check_task_names
    from evals.tasks import SHIPPED_TASKS, parse_data_files
    from sinkstudy import SinkstudyError
    from sinkstudy.hub import hub_unreachable

    local = parse_data_files(data_files)
    remote = [t for t in check_task_names(tasks) if t not in SHIPPED_TASKS and t not in local]
    if remote:
        reason = hub_unreachable()
        if reason:
            raise SinkstudyError(f"task(s) {', '.join(remote)} load their data from the Hugging Face hub, which is unreachable "
                                 f"({reason}); use the offline tasks {', '.join(SHIPPED_TASKS)} (the default) "
                                 "or give a local file with --data TASK=FILE")


def add_protocol_args(p) -> None:
    """The eval-protocol flags every evaluating command shares (`evals.protocol` says where each goes);
    each command has its own --batch-size (type `argtypes.batch_size`)."""
    g = p.add_argument_group("eval protocol (handed to lm-eval)")
    g.add_argument("--chat-template-kwargs", default=None, metavar="JSON|K=V,...",
                   help="chat template variables, e.g. '{\"enable_thinking\": false}' for Qwen3 (the paper's protocol)")
    g.add_argument("--system-instruction", default=None, metavar="TEXT", help="a system message before every prompt")
    g.add_argument("--gen-kwargs", default=None, metavar="JSON|K=V,...",
                   help="generation settings over each task's own, e.g. temperature=0,do_sample=false,until=[\"</s>\"]")
    g.add_argument("--num-fewshot", type=argtypes.int_at_least(0), default=None,
                   help="override the tasks' few-shot count (the paper: 0)")
    g.add_argument("--confirm-run-unsafe-code", action="store_true",
                   help="let tasks that execute model-written code run (MBPP)")


def protocol_kwargs(args) -> dict:
    """run_eval's protocol arguments from the flags of `add_protocol_args`, checked (one line on bad input)."""
    from evals.protocol import check_gen_kwargs, check_system_instruction, parse_kwargs

    return {"chat_template_kwargs": parse_kwargs(args.chat_template_kwargs, "--chat-template-kwargs"),
            "system_instruction": check_system_instruction(args.system_instruction),
            "gen_kwargs": check_gen_kwargs(parse_kwargs(args.gen_kwargs, "--gen-kwargs")),
            "num_fewshot": args.num_fewshot,
            "confirm_run_unsafe_code": args.confirm_run_unsafe_code}


def _eval(args) -> Summary | int:
    from evals.lmeval import run_eval
    from experiments.loaders import load_model

    kwargs = eval_kwargs(args)
    check_hub_tasks(args.tasks, kwargs["data_files"])
    run = run_eval(
        args.model, args.tokenizer, tasks=args.tasks, out_dir=args.out, force=args.force, cache_dir=args.cache_dir,
        use_cache=not args.no_cache, device=args.device, dtype=args.dtype, seed=args.seed, loader=load_model,
        **kwargs,
    )
    if run is None:  # a data-parallel worker (accelerate launch): rank 0 prints and writes
        return 0
    print(run.summary())
    if args.out:
        print(f"eval run written to {args.out}")
    keep = args.out or f"runs/eval/{Path(str(args.model).rstrip('/')).name or 'model'}"
    return Summary("eval", f"{args.model}: {headline(run)}" + (f" (first {args.limit} prompts per task)" if args.limit else ""),
                   outputs=[args.out] if args.out else [],
                   next=([] if args.out else [cmd("sinkstudy", "eval", args.model, "--tasks", args.tasks, "--out", keep)])
                   + [cmd("sinkstudy", "compare", "OTHER_RUN", keep)])


def headline(run) -> str:
    """Each requested task's headline score (the paper's metric where the task has one), in one line."""
    from evals.lmeval import HEADLINE_METRICS

    parts = []
    for task in run.tasks:
        metrics = run.metrics(task) if task in run.scores else []
        if metrics:
            metric = HEADLINE_METRICS[task] if HEADLINE_METRICS.get(task) in metrics else metrics[0]
            value = run.scores[task][metric]
            name = metric.removesuffix(",none")
            parts.append(f"{task} {name} {value:.4f}" if isinstance(value, float) else f"{task} {name} {value}")
    return "; ".join(parts) or "no scores"


def _compare(args) -> Summary | int:
    from evals.lmeval import EvalRun
    from evals.stats import compare_runs, format_table
    from sinkstudy.io import write_json_atomic
    from sinkstudy.provenance import provenance

    from sinkstudy import SinkstudyError

    sink = _published_sink(args)  # every input checked before the runs are read
    a, b = EvalRun.load(args.run_a), EvalRun.load(args.run_b)
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()] if args.tasks else None
    if args.tasks is not None and not tasks:
        raise SinkstudyError("--tasks is empty")
    ifeval = _published_task(a, b, tasks) if args.published else None
    for run, path in ((a, args.run_a), (b, args.run_b)):
        missing = [t for t in tasks or [] if t not in run.samples and t not in run.groups]
        if missing:
            raise SinkstudyError(f"run {path} has no task {', '.join(missing)}; it has {', '.join([*run.samples, *run.groups]) or 'none'}")
    comps = compare_runs(a, b, tasks, n_boot=args.n_boot, confidence=args.confidence, seed=args.seed)
    print(f"A = {args.run_a} ({a.model_name})\nB = {args.run_b} ({b.model_name})")
    print(format_table(comps))
    published = None
    if args.published:
        published = _beside_published(args, next(c for c in comps if (c.task, c.metric) == (ifeval, PUBLISHED_METRIC)), sink)
    if args.json:
        write_json_atomic(args.json, {"run_a": args.run_a, "run_b": args.run_b,
                                      "convention": "Δ = B − A in points (score × 100; negative = B lost capability); relative = Δ / A",
                                      "comparisons": [c.as_dict() for c in comps],
                                      "published": published,
                                      "provenance": provenance(model_fingerprints={args.run_a: a.fingerprint, args.run_b: b.fingerprint},
                                                               seeds={"bootstrap": args.seed})})
    first = comps[0] if comps else None
    result = (f"{first.task} {str(first.metric).removesuffix(',none')}: Δ = B − A = {first.delta_points:+.1f} points "
              f"[{first.delta_points_ci[0]:+.1f}, {first.delta_points_ci[1]:+.1f}], n = {first.n}"
              + (f" (+ {len(comps) - 1} more rows above)" if len(comps) > 1 else "") if first else "nothing to compare")
    return Summary("compare", result, outputs=[args.json] if args.json else [],
                   next=[] if args.published else [cmd("sinkstudy", "compare", args.run_a, args.run_b, "--published", "--sink-json",
                                                       "BASE_SINK_JSON")])


PUBLISHED_METRIC = "prompt_level_strict_acc,none"  # the paper's headline: IFEval prompt-level strict


def _published_sink(args) -> float | None:
    """S of run A for --published, from --sink-strength or a sink.json; refuses what cannot be compared."""
    import math

    from sinkstudy import SinkstudyError
    from sinkstudy.io import read_json

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


def _published_task(a, b, tasks) -> str:
    """The one compared task that carries the paper's metric in both runs."""
    from sinkstudy import SinkstudyError

    found = [t for t in (tasks or a.scores) if PUBLISHED_METRIC in a.metrics(t) and PUBLISHED_METRIC in b.metrics(t)]
    if len(found) != 1:
        raise SinkstudyError(f"--published compares IFEval {PUBLISHED_METRIC}: need exactly one compared task with it in both runs, "
                             f"found {', '.join(found) or 'none'}" + (" (narrow with --tasks)" if found else ""))
    return found[0]


def _beside_published(args, c, sink: float) -> dict:
    from experiments.published import PairChange, beside, format_beside

    ours = PairChange(f"this pair ({c.task})", sink, c.delta_points, 100 * c.before, source="ours", delta_points_ci=c.delta_points_ci)
    result = beside([ours], n_boot=args.n_boot, confidence=args.confidence, seed=args.seed)
    print()
    print(format_beside(result))
    return result
