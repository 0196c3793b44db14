"""`sinkstudy sink MODEL`: per-layer sink-mass table, Sink Strength, JSON + heat-map PNG."""

from __future__ import annotations

from pathlib import Path

from experiments.cli.closing import Summary, cmd, existing

RESULT_JSON = "sink.json"
MAP_PNG = "sink_map.png"


def register(subparsers) -> None:
    from experiments.cli import argtypes, options

    p = subparsers.add_parser("sink", help="sink maps and Sink Strength of a model (default: the paper's log-odds S)",
                              description="Per-layer sink table, Sink Strength, sink.json and a heat map of the metric's "
                              "statistic, written to --out (default runs/sink/<model>-<metric>); a rerun with the same "
                              "settings reuses it.")
    p.add_argument("model", metavar="MODEL", help=f"causal LM or VLM: {options.model_forms()}")
    p.add_argument("--metric", default=None, help="logodds (default), mass, ratio@EPS (e.g. ratio@0.3), robustness")
    p.add_argument("--calibration", default=None, metavar="SET|FILE",
                   help="calibration texts: a shipped set (ifeval15, passages64) or a file (.json/.jsonl/.txt one per line); "
                        "default: the metric's set")
    p.add_argument("--capture", choices=("fast", "eager"), default="fast",
                   help="how attention is read: the fast hooked pass (default) or eager output_attentions")
    p.add_argument("--sink-batch-size", type=argtypes.positive_int, default=1, metavar="N", help="calibration texts per forward pass (default 1)")
    p.add_argument("--max-length", type=argtypes.int_at_least(2), default=512, metavar="N", help="tokens per calibration text (default 512)")
    p.add_argument("--last-layers", type=argtypes.positive_int, help="logodds: number of final layers (default 10)")
    p.add_argument("--argmax", choices=("head", "query"), help="logodds: argmax key per head (default) or per query")
    p.add_argument("--noise-seed", type=int, help="robustness: seed of the random embeddings (default 0)")
    options.add_model_options(p, dtype="float32; fast: statistics in float32 from the model's q and k, eager: the model's own "
                                       "attention probabilities in this dtype")
    options.add_output_options(p, out="runs/sink/<model>-<metric>")
    options.add_progress_options(p)
    p.set_defaults(func=run_sink)


def default_out(model: str, metric: str) -> Path:
    from experiments.cli.options import default_out as out_for

    return out_for("sink", model, metric)


def run_sink(args) -> Summary | int:
    from evals.sink import DEFAULT_METRIC, get_metric
    from evals.sink.calibration import resolve_texts
    from sinkstudy import SinkstudyError
    from sinkstudy.io import check_output_dir, output_lock, read_text

    # Every input is checked before the model is loaded.
    spec = get_metric(args.metric or DEFAULT_METRIC)
    if args.calibration:
        if Path(args.calibration).is_file():
            read_text(args.calibration, "calibration file")  # names a non-UTF-8 file
    texts, source = resolve_texts(args.calibration, spec.calibration)  # fail now on a missing or malformed file
    params = {k: v for k, v in (("last_layers", args.last_layers), ("argmax", args.argmax), ("noise_seed", args.noise_seed))
              if v is not None}
    stray = set(params) - set(spec.params)
    if stray:
        raise SinkstudyError(f"--{sorted(stray)[0].replace('_', '-')} does not apply to metric {spec.name}")
    out = Path(args.out) if args.out else default_out(args.model, spec.name)
    key = _key(args, spec.name, params, texts)
    previous = _finished(out, key, args.force)
    if previous is not None:
        print(f"reusing finished sink run {out} (same model and settings; --force measures again)")
        return _summary(args, previous, out, source)
    check_output_dir(out, args.force)
    _check_architecture(args.model)

    from interventions.pairs import load_causal_lm

    model, tokenizer = load_causal_lm(args.model, dtype=args.dtype or "float32", device=args.device or "cpu")
    if args.tokenizer:
        from sinkstudy.checkpoint import load_tokenizer

        tokenizer = load_tokenizer(args.tokenizer)
    if tokenizer is None:
        raise SinkstudyError(f"no tokenizer found for {args.model}; pass --tokenizer")
    with output_lock(out):  # a second writer into the same --out fails at once
        return _measure_and_write(args, spec, params, model, tokenizer, out, key)


def _key(args, metric: str, params: dict, texts) -> str:
    """What a sink run's result depends on: the model's (and tokenizer's) content, the metric and its
    parameters, the calibration texts, how attention is read, dtype, device type and the code."""
    import hashlib
    import json

    from evals.sink.calibration import texts_fingerprint
    from sinkstudy.provenance import code_version, model_fingerprint

    import evals.sink

    identity = {"model": model_fingerprint(args.model), "tokenizer": model_fingerprint(args.tokenizer) if args.tokenizer else None,
                "metric": metric, "params": params, "texts": texts_fingerprint(texts), "capture": args.capture,
                "batch_size": args.sink_batch_size, "max_length": args.max_length, "dtype": args.dtype or "float32",
                "device": str(args.device or "cpu").split(":")[0], "code": code_version(Path(evals.sink.__file__).parent)}
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:24]


def _finished(out: Path, key: str, force: bool) -> dict | None:
    """The sink.json in `out` when it was measured with `key` (reused); None when there is nothing to
    reuse or `force`. Another run's output is refused in one line, as `sinkstudy eval` refuses one."""
    from sinkstudy import SinkstudyError
    from sinkstudy.io import read_json

    found = out / RESULT_JSON
    if force or not found.is_file():
        return None
    try:
        data = read_json(found)
    except SinkstudyError:
        data = None
    if isinstance(data, dict) and data.get("key") == key:
        return data
    raise SinkstudyError(f"output {out} holds a different sink run; pass --force to replace it")


def _check_architecture(model: str) -> None:
    """Refuse an architecture the sink pass cannot measure from its config, before any weights load
    (a VLM is measured as the causal LM its language model extracts to)."""
    from evals.sink import check_supported_config
    from interventions.pairs import archs
    from interventions.pairs.resolve import load_config

    config = load_config(model)
    if archs.classify(config) == "vlm":
        config = archs.plan_target_config(config)[0]
    check_supported_config(config)


def _measure_and_write(args, spec, params, model, tokenizer, out: Path, key: str) -> Summary | int:
    from evals.sink import plot_sink_map, sink_strength
    from sinkstudy.io import atomic_output_dir, write_json_atomic
    from sinkstudy.provenance import model_fingerprint, provenance

    result = sink_strength(model, tokenizer, spec.name, args.calibration, method=args.capture, batch_size=args.sink_batch_size,
                           max_length=args.max_length, progress=not args.quiet, **params)
    maps = result.maps
    print(f"sink mass per layer (position {maps.settings['sink_position']}, {len(maps.text_ids)} texts from "
          f"{maps.settings['calibration']}, queries from position {maps.settings['skip_queries']})")
    print(maps.format_table())
    off = maps.off_sink_heads()
    if off:
        shown = ", ".join(f"L{layer}H{head}->{pos}" for layer, head, pos in off[:16])
        print(f"heads whose most-attended key is not position {maps.settings['sink_position']}: {shown}"
              + (f" ... ({len(off)} in all)" if len(off) > 16 else ""))
    print(f"Sink Strength [{result.metric}] = {result.value:.4f}")
    name = Path(str(args.model).rstrip("/")).name
    with atomic_output_dir(out, force=args.force) as tmp:
        data = {"model": args.model, **result.to_json(), "key": key,
                "provenance": provenance(model=args.model, model_fingerprint=model_fingerprint(args.model), dtype=args.dtype or "float32",
                                         seeds={"noise_seed": params.get("noise_seed", spec.params.get("noise_seed"))},
                                         settings={**maps.settings, "metric_params": result.details["params"]})}
        write_json_atomic(tmp / RESULT_JSON, data)
        # The map shows the statistic the metric reads (log-odds for S, else the sink mass).
        plot_sink_map(maps, tmp / MAP_PNG, metric=spec.name, title=f"{name}: {spec.name} ({maps.settings['calibration']})")
        if result.noise_maps is not None:
            plot_sink_map(result.noise_maps, tmp / "sink_map_noise.png", metric=spec.name, title=f"{name}: random embeddings")
    print(f"wrote {out / RESULT_JSON} and {out / MAP_PNG}")
    return _summary(args, data, out, maps.settings["calibration"])


def _summary(args, data: dict, out: Path, source: str) -> Summary:
    value = data["value"]
    shown = "n/a" if value is None else f"{value:.4f}"
    return Summary("sink", f"Sink Strength [{data['metric']}] of {args.model} = {shown} "
                   f"({len(data['maps']['text_ids'])} texts from {source})",
                   outputs=existing(out / RESULT_JSON, out / MAP_PNG, out / "sink_map_noise.png"),
                   next=[cmd("sinkstudy", "eval", args.model)]
                   + ([cmd("sinkstudy", "compare", "BASE_EVAL", "VLM_EVAL", "--published", "--sink-json", out / RESULT_JSON)]
                      if data["metric"] == "logodds" else []))
