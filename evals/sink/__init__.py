"""Attention-sink measurement: sink maps, Sink Strength metrics, shift between models, plots.

    from evals.sink import compute_sink_maps, sink_strength, sink_shift, plot_sink_map

The names load with the submodule that defines them, on first use: `evals.sink.calibration` (the shipped sets,
`DEFAULT_SET`) is read by modules that never load torch, which the capture and measurement modules do.
"""

from importlib import import_module

_WHERE = {
    "evals.sink.calibration": ("SHIPPED_SETS", "DEFAULT_SET", "CalibrationText", "load_set", "load_texts_file"),
    "evals.sink.capture": ("check_supported_config",),
    "evals.sink.maps": ("SinkMaps",),
    "evals.sink.measure": ("compute_sink_maps", "sink_strength"),
    "evals.sink.metrics": ("DEFAULT_METRIC", "SINK_METRICS", "SinkMetric", "SinkStrength", "get_metric", "strength_from_maps"),
    "evals.sink.plot": ("plot_sink_map", "plot_sink_shift"),
    "evals.sink.shift": ("sink_shift",),
}
_MODULE = {name: module for module, names in _WHERE.items() for name in names}
__all__ = [*_MODULE, "MEASURE_CODE"]
# The modules a sink measurement runs: part of the key of every result that measures S (its plots are not).
MEASURE_CODE = tuple(f"{__name__}.{m}" for m in ("calibration", "capture", "maps", "measure", "metrics"))


def __getattr__(name: str):
    if name not in _MODULE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(_MODULE[name]), name)
