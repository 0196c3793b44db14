"""`sinkstudy sink MODEL`: per-layer sink-mass table, Sink Strength, JSON + heat-map PNG."""

from __future__ import annotations

import re
from pathlib import Path

from experiments.summary import Summary, cmd, existing

RESULT_JSON = "sink.json"
MAP_PNG = "sink_map.png"


def register(subparsers) -> None:
    p = subparsers.add_parser("sink", help="sink maps and Sink Strength of a model (default: the paper's log-odds S)")
    p.add_argument("model", metavar="MODEL", help="causal LM or VLM: hub id or local path")
    p.add_argument("--texts", metavar="FILE", help="calibration texts: a file (.json/.jsonl/.txt one per line) or a shipped set (ifeval15, passages64); default: the metric's set")
    p.add_argument("--metric", default=None, help="logodds (default), mass, ratio@EPS (e.g. ratio@0.3), robustness")
    p.add_argument("--out", metavar="DIR", help=f"output dir for {RESULT_JSON} and {MAP_PNG} (default runs/sink/<model>-<metric>)")
    p.add_argument("--force", action="store_true", help="replace an existing --out")
    p.add_argument("--method", choices=("fast", "eager"), default="fast", help="fast hooked pass (default) or eager output_attentions")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--last-layers", type=int, help="logodds: number of final layers (default 10)")
    p.add_argument("--argmax", choices=("head", "query"), help="logodds: argmax key per head (default) or per query")
    p.add_argument("--noise-seed", type=int, help="robustness: seed of the random embeddings (default 0)")
    p.add_argument("--dtype", default="float32", help="model dtype: float32 (default), bfloat16, float16. fast: statistics in float32 "
                   "from the model's q and k; eager: the model's own attention probabilities, in this dtype")
    p.add_argument("--device", default="cpu")
    p.set_defaults(func=run_sink)


def default_out(model: str, metric: str) -> Path:
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(model.rstrip("/")).name or model)
    return Path("runs") / "sink" / f"{name}-{re.sub(r'[^A-Za-z0-9_.-]+', '_', metric)}"


def run_sink(args) -> Summary | int:
    from evals.sink import DEFAULT_METRIC, get_metric
    from evals.sink.calibration import resolve_texts
    from sinkstudy import SinkstudyError
    from sinkstudy.io import check_output_dir, output_lock, read_text

    # Every input is checked before the model is loaded.
    spec = get_metric(args.metric or DEFAULT_METRIC)
    if args.texts:
        if Path(args.texts).is_file():
            read_text(args.texts, "texts file")  # names a non-UTF-8 file
        resolve_texts(args.texts, spec.calibration)  # fail now on a missing or malformed file
    params = {k: v for k, v in (("last_layers", args.last_layers), ("argmax", args.argmax), ("noise_seed", args.noise_seed))
              if v is not None}
    stray = set(params) - set(spec.params)
    if stray:
        raise SinkstudyError(f"--{sorted(stray)[0].replace('_', '-')} does not apply to metric {spec.name}")
    if args.batch_size < 1 or args.max_length < 2:
        raise SinkstudyError("--batch-size must be >= 1 and --max-length >= 2")
    out = Path(args.out) if args.out else default_out(args.model, spec.name)
    check_output_dir(out, args.force)
    _check_architecture(args.model)

    from interventions.pairs import load_causal_lm

    model, tokenizer = load_causal_lm(args.model, dtype=args.dtype, device=args.device)
    if tokenizer is None:
        raise SinkstudyError(f"no tokenizer found for {args.model}")
    with output_lock(out):  # a second writer into the same --out fails at once
        return _measure_and_write(args, spec, params, model, tokenizer, out)


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


def _measure_and_write(args, spec, params, model, tokenizer, out: Path) -> Summary | int:
    from evals.sink import plot_sink_map, sink_strength
    from sinkstudy.io import atomic_output_dir, write_json_atomic
    from sinkstudy.provenance import model_fingerprint, provenance

    result = sink_strength(model, tokenizer, spec.name, args.texts, method=args.method,
                           batch_size=args.batch_size, max_length=args.max_length, progress=True, **params)
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
    with atomic_output_dir(out, force=args.force) as tmp:
        write_json_atomic(tmp / RESULT_JSON, {
            "model": args.model,
            **result.to_json(),
            "provenance": provenance(model=args.model, model_fingerprint=model_fingerprint(args.model), dtype=args.dtype,
                                     seeds={"noise_seed": params.get("noise_seed", spec.params.get("noise_seed"))},
                                     settings={**maps.settings, "metric_params": result.details["params"]}),
        })
        plot_sink_map(maps, tmp / MAP_PNG, title=f"{Path(args.model).name}: sink mass ({maps.settings['calibration']})")
        if result.noise_maps is not None:
            plot_sink_map(result.noise_maps, tmp / "sink_map_noise.png", title=f"{Path(args.model).name}: random embeddings")
    print(f"wrote {out / RESULT_JSON} and {out / MAP_PNG}")
    return Summary("sink", f"Sink Strength [{result.metric}] of {args.model} = {result.value:.4f} "
                   f"({len(maps.text_ids)} texts from {maps.settings['calibration']})",
                   outputs=existing(out / RESULT_JSON, out / MAP_PNG, out / "sink_map_noise.png"),
                   next=[cmd("sinkstudy", "eval", args.model)]
                   + ([cmd("sinkstudy", "compare", "BASE_EVAL", "VLM_EVAL", "--published", "--sink-json", out / RESULT_JSON)]
                      if result.metric == "logodds" else []))
