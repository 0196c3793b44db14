"""`sinkstudy sink MODEL`: per-layer sink-mass table, Sink Strength, JSON + heat-map PNG: the arguments, then one
`experiments.study.pair_steps.SinkMap` step through the engine."""

from __future__ import annotations

from pathlib import Path

from evals.sink.calibration import resolve_texts
from experiments.cli import argtypes, options
from experiments.cli.closing import Summary, cmd, existing
from experiments.cli.options import default_out as out_for
from experiments.study.graph import Plan, Step
from experiments.study.kinds import Ref
from experiments.study.pair_steps import Loading, SinkMap, texts_ref
from experiments.study.runner import run_plan
from interventions.pairs import archs
from interventions.pairs.resolve import load_config
from sinkstudy import SinkstudyError
from sinkstudy.io import read_json, read_text

RESULT_JSON = "sink.json"
MAP_PNG = "sink_map.png"


def register(subparsers) -> None:
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
    options.add_compute_options(p)
    options.add_progress_options(p)
    p.set_defaults(func=run_sink)


def default_out(model: str, metric: str) -> Path:
    return out_for("sink", model, metric)


def run_sink(args) -> Summary | int:
    # lazy: loads torch, numpy
    from evals.sink import DEFAULT_METRIC, get_metric

    # Every input is checked before the model is loaded.
    spec = get_metric(args.metric or DEFAULT_METRIC)
    if args.calibration:
        if Path(args.calibration).is_file():
            read_text(args.calibration, "calibration file")  # names a non-UTF-8 file
    _, source = resolve_texts(args.calibration, spec.calibration)  # fail now on a missing or malformed file
    params = {k: v for k, v in (("last_layers", args.last_layers), ("argmax", args.argmax), ("noise_seed", args.noise_seed))
              if v is not None}
    stray = set(params) - set(spec.params)
    if stray:
        raise SinkstudyError(f"--{sorted(stray)[0].replace('_', '-')} does not apply to metric {spec.name}")
    _check_architecture(args.model)
    out = Path(args.out) if args.out else default_out(args.model, spec.name)
    step = Step("sink/run", SinkMap(Ref(str(args.model)), Ref(str(args.tokenizer)) if args.tokenizer else None, spec.name,
                                    texts_ref(args.calibration), params, args.capture, args.sink_batch_size, args.max_length,
                                    Loading(args.dtype or "float32", args.device), out=out),
                outputs=(out / RESULT_JSON, out / MAP_PNG))
    engine = run_plan(Plan([step]), out, force=args.force, progress=not args.quiet, guarded=("run",))
    data = read_json(out / RESULT_JSON)
    if not engine.log[0]["reused"]:
        _print_maps(data)
    print(f"Sink Strength [{data['metric']}] = {data['value']:.4f}" if data["value"] is not None else f"Sink Strength [{data['metric']}] = n/a")
    if not engine.log[0]["reused"]:  # a reuse was said by the engine
        print(f"wrote {out / RESULT_JSON} and {out / MAP_PNG}")
    return _summary(args, data, out, source)


def _print_maps(data: dict) -> None:
    """The per-layer table and the heads whose most-attended key is not the sink."""
    # lazy: loads torch, numpy
    from evals.sink import SinkMaps

    maps = SinkMaps.from_json(data["maps"])
    print(f"sink mass per layer (position {maps.settings['sink_position']}, {len(maps.text_ids)} texts from "
          f"{maps.settings['calibration']}, queries from position {maps.settings['skip_queries']})")
    print(maps.format_table())
    off = maps.off_sink_heads()
    if off:
        shown = ", ".join(f"L{layer}H{head}->{pos}" for layer, head, pos in off[:16])
        print(f"heads whose most-attended key is not position {maps.settings['sink_position']}: {shown}"
              + (f" ... ({len(off)} in all)" if len(off) > 16 else ""))


def _check_architecture(model: str) -> None:
    """Refuse an architecture the sink pass cannot measure from its config, before any weights load
    (a VLM is measured as the causal LM its language model extracts to)."""
    # lazy: loads torch, numpy
    from evals.sink import check_supported_config

    config = load_config(model)
    if archs.classify(config) == "vlm":
        config = archs.plan_target_config(config)[0]
    check_supported_config(config)


def _summary(args, data: dict, out: Path, source: str) -> Summary:
    value = data["value"]
    shown = "n/a" if value is None else f"{value:.4f}"
    return Summary("sink", f"Sink Strength [{data['metric']}] of {args.model} = {shown} "
                   f"({len(data['maps']['text_ids'])} texts from {source})",
                   outputs=existing(out / RESULT_JSON, out / MAP_PNG, out / "sink_map_noise.png"),
                   next=[cmd("sinkstudy", "eval", args.model)]
                   + ([cmd("sinkstudy", "compare", "BASE_EVAL", "VLM_EVAL", "--published", "--sink-json", out / RESULT_JSON)]
                      if data["metric"] == "logodds" else []))
