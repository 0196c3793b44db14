"""Layer x head heat-maps of sink mass (one model) or of its change between two models, as PNG."""

from __future__ import annotations

import os
from pathlib import Path

from evals.sink.maps import SinkMaps


def _figure(panels, title: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), squeeze=False)
    for ax, (data, label, cmap, vmin, vmax) in zip(axes[0], panels):
        im = ax.imshow(data.T.numpy(), aspect="auto", origin="lower", cmap=cmap, vmin=vmin, vmax=vmax, interpolation="nearest")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("layer")
        ax.set_ylabel("head")
        ax.set_title(label, fontsize=9)
        fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig, plt


def _name(maps: SinkMaps, fallback: str) -> str:
    return Path(maps.model.get("name_or_path") or fallback).name or fallback


def plot_sink_map(maps: SinkMaps, path: str | os.PathLike, *, title: str | None = None) -> Path:
    """Heat-map of mean sink mass per (layer, head)."""
    from sinkstudy.io import save_figure_atomic

    fig, plt = _figure([(maps.mass, f"sink mass (position {maps.settings['sink_position']})", "viridis", 0.0, 1.0)],
                       title or f"{_name(maps, 'model')}: {maps.settings['calibration']}")
    try:
        return save_figure_atomic(fig, path, dpi=120)
    finally:
        plt.close(fig)


def plot_sink_shift(maps_a: SinkMaps, maps_b: SinkMaps, path: str | os.PathLike, *, title: str | None = None) -> Path:
    """Three panels: A's map, B's map and B - A (diverging colours)."""
    from sinkstudy.io import save_figure_atomic
    from evals.sink.shift import sink_shift

    delta = sink_shift(maps_a, maps_b)["delta"]
    bound = max(float(delta.abs().max()), 1e-6)
    name_a, name_b = _name(maps_a, "A"), _name(maps_b, "B")
    fig, plt = _figure(
        [(maps_a.mass, name_a, "viridis", 0.0, 1.0), (maps_b.mass, name_b, "viridis", 0.0, 1.0),
         (delta, f"{name_b} - {name_a}", "RdBu_r", -bound, bound)],
        title or "sink mass shift",
    )
    try:
        return save_figure_atomic(fig, path, dpi=120)
    finally:
        plt.close(fig)
