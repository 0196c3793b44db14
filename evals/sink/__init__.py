"""Attention-sink measurement: sink maps, Sink Strength metrics, shift between models, plots.

    from evals.sink import compute_sink_maps, sink_strength, sink_shift, plot_sink_map
"""

from evals.sink.calibration import SHIPPED_SETS, CalibrationText, load_set, load_texts_file
from evals.sink.capture import check_supported_config
from evals.sink.maps import SinkMaps
from evals.sink.measure import compute_sink_maps, sink_strength
from evals.sink.metrics import DEFAULT_METRIC, SINK_METRICS, SinkMetric, SinkStrength, get_metric, strength_from_maps
from evals.sink.plot import plot_sink_map, plot_sink_shift
from evals.sink.shift import sink_shift

__all__ = [
    "SHIPPED_SETS", "CalibrationText", "load_set", "load_texts_file",
    "SinkMaps", "check_supported_config", "compute_sink_maps",
    "DEFAULT_METRIC", "SINK_METRICS", "SinkMetric", "SinkStrength", "get_metric", "sink_strength", "strength_from_maps",
    "sink_shift", "plot_sink_map", "plot_sink_shift",
]
