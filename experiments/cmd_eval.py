"""`sinkstudy eval` (strict-grader evals through lm-eval) and `sinkstudy compare` (paired statistics)."""

from __future__ import annotations

from experiments import argtypes

DEFAULT_TASKS = "ifeval,gsm8k_cot,bbh_cot_fewshot"  # evals.lmeval.DEFAULT_TASKS, kept here so --help stays light


def register(subparsers) -> None:
    p = subparsers.add_parser("eval", help="strict-grader evals of a model through lm-eval (cached per task)",
                              description="Evaluate MODEL (local path or hub id) on lm-eval tasks. Offline, use the "
                              "shipped task sets sinkstudy_ifeval,sinkstudy_gsm or --data TASK=FILE.")
    p.add_argument("model", help="checkpoint path or hub id")
    p.add_argument("--tasks", default=DEFAULT_TASKS, help=f"comma-separated lm-eval task names (default {DEFAULT_TASKS})")
    p.add_argument("--limit", type=argtypes.limit, default=None, help="first N docs per task (a fraction < 1: that share)")
    p.add_argument("--batch-size", type=argtypes.positive_int, default=8)
    p.add_argument("--no-chat-template", action="store_true", help="prompt without the tokenizer's chat template")
    p.add_argument("--max-gen-toks", type=argtypes.int_at_least(0), default=256, help="generation length; 0 keeps each task's own")
    p.add_argument("--num-fewshot", type=argtypes.int_at_least(0), default=None, help="override the tasks' few-shot count")
    p.add_argument("--data", action="append", default=None, metavar="TASK=FILE", help="local jsonl for a task (repeatable)")
    p.add_argument("--tokenizer", default=None, help="tokenizer path/id when it is not beside the model")
    p.add_argument("--out", default=None, help="write the run (results.json + samples/) here")
    p.add_argument("--force", action="store_true", help="replace an existing --out that holds a different run")
    p.add_argument("--cache-dir", default=None, help="per-task result cache (default $SINKSTUDY_CACHE/evals)")
    p.add_argument("--no-cache", action="store_true", help="evaluate even when a cached result exists")
    p.add_argument("--backend", choices=("hf", "vllm"), default="hf", help="vllm: lm-eval's vLLM backend (GPU)")
    p.add_argument("--backend-args", default=None, metavar="K=V,...",
                   help="extra backend arguments, e.g. tensor_parallel_size=2,data_parallel_size=1")
    p.add_argument("--device", default=None, help="device for the loaded model (hf backend), e.g. cuda")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_eval)

    c = subparsers.add_parser("compare", help="paired comparison of two eval runs (bootstrap CI, McNemar)",
                              description="Per task and metric: A, B, A-B and (A-B)/A with paired bootstrap CIs "
                              "(prompts resampled) and McNemar's exact p, on the prompts both runs share.")
    c.add_argument("run_a", help="eval run dir (the reference, e.g. the base LLM)")
    c.add_argument("run_b", help="eval run dir (e.g. the VLM's language model)")
    c.add_argument("--tasks", default=None, help="comma-separated subset of tasks")
    c.add_argument("--n-boot", type=argtypes.n_boot, default=10_000, help="bootstrap replicates (>= 1)")
    c.add_argument("--confidence", type=argtypes.confidence, default=0.95)
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--json", default=None, metavar="FILE", help="also write the comparisons as JSON")
    c.set_defaults(func=_compare)


def _backend_args(text: str | None) -> dict:
    import json

    from sinkstudy import SinkstudyError

    out = {}
    for part in filter(None, (text or "").split(",")):
        key, sep, value = part.partition("=")
        if not sep:
            raise SinkstudyError(f"backend argument {part!r} is not KEY=VALUE")
        try:
            out[key.strip()] = json.loads(value)
        except ValueError:
            out[key.strip()] = value
    return out


def _eval(args) -> int:
    from evals.lmeval import run_eval

    run = run_eval(
        args.model, args.tokenizer, tasks=args.tasks, limit=args.limit, batch_size=args.batch_size,
        apply_chat_template=not args.no_chat_template, max_gen_toks=args.max_gen_toks or None,
        num_fewshot=args.num_fewshot, data_files=args.data, out_dir=args.out, force=args.force,
        cache_dir=args.cache_dir, use_cache=not args.no_cache, backend=args.backend,
        backend_args=_backend_args(args.backend_args), device=args.device, seed=args.seed,
    )
    print(run.summary())
    if args.out:
        print(f"eval run written to {args.out}")
    return 0


def _compare(args) -> int:
    from evals.lmeval import EvalRun
    from evals.stats import compare_runs, format_table
    from sinkstudy.io import write_json_atomic
    from sinkstudy.provenance import provenance

    from sinkstudy import SinkstudyError

    a, b = EvalRun.load(args.run_a), EvalRun.load(args.run_b)
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()] if args.tasks else None
    if args.tasks is not None and not tasks:
        raise SinkstudyError("--tasks is empty")
    for run, path in ((a, args.run_a), (b, args.run_b)):
        missing = [t for t in tasks or [] if t not in run.samples and t not in run.groups]
        if missing:
            raise SinkstudyError(f"run {path} has no task {', '.join(missing)}; it has {', '.join([*run.samples, *run.groups]) or 'none'}")
    comps = compare_runs(a, b, tasks, n_boot=args.n_boot, confidence=args.confidence, seed=args.seed)
    print(f"A = {args.run_a} ({a.model_name})\nB = {args.run_b} ({b.model_name})")
    print(format_table(comps))
    if args.json:
        write_json_atomic(args.json, {"run_a": args.run_a, "run_b": args.run_b, "comparisons": [c.as_dict() for c in comps],
                                      "provenance": provenance(model_fingerprints={args.run_a: a.fingerprint, args.run_b: b.fingerprint},
                                                               seeds={"bootstrap": args.seed})})
    return 0
