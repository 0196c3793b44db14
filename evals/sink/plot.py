"""Sink figures from SinkMaps, on scales with a fixed meaning, as PNG + SVG.

Per (layer, head) a map shows the statistic the chosen Sink Strength reads: for `logodds` the
median log-odds of attention on the head's argmax key (diverging colours centred on 0, one
symmetric range ±B shared by every map of a figure, B from the data and written on it), for every
other metric the mean attention on the sink position on its whole range 0..1 (so noise never looks
dramatic). A shift panel (B − A) has its own symmetric range from the data, written in its title so
a small shift is never read on the maps' scale. Each plot returns what it drew (colour
ranges, axis ranges, per-layer values) so callers and tests can check that a figure follows its data.
No axis uses matplotlib's offset notation (`pyplot` turns it off for every figure of the package).
"""

from __future__ import annotations

import math
import os
import textwrap
import warnings
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from evals.sink.maps import SinkMaps
from sinkstudy.io import save_figure_atomic

LOGODDS = "logodds"
ANNOTATE_CELLS = 128  # maps with at most this many (layer, head) cells carry their values as text


def head_values(maps: SinkMaps, metric: str = "mass") -> tuple[torch.Tensor, str, str]:
    """(L, H) values a map of `metric` shows, their label and their kind (LOGODDS or "mass"). Log-odds
    maps need per-query log-odds (absent when omitted from a large JSON): then the mass map is shown
    and the label says so."""
    if metric == LOGODDS and maps.logodds is not None:
        return (torch.from_numpy(_nanmedian(maps.logodds.double().numpy(), axis=-1)), "median log-odds on the head's argmax key",
                LOGODDS)
    label = f"sink mass (attention on position {maps.settings.get('sink_position', 0)})"
    return maps.mass.double(), label + (" (no per-query log-odds stored)" if metric == LOGODDS else ""), "mass"


def layer_profile(maps: SinkMaps, metric: str = "mass") -> list[float]:
    """One value per layer: the median log-odds over heads and queries (logodds), else the mean mass over heads."""
    if metric == LOGODDS and maps.logodds is not None:
        return [float(_nanmedian(maps.logodds[i].double().numpy(), axis=None)) for i in range(maps.num_layers)]
    return [float(v) for v in maps.mass.double().mean(-1)]


def _nanmedian(x: np.ndarray, axis):
    """numpy's nanmedian (the midpoint of the middle pair, as S takes it); NaN without a warning where all are NaN."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.nanmedian(x, axis=axis)


def _finite(values: list[torch.Tensor]) -> torch.Tensor:
    flat = torch.cat([v.flatten() for v in values])
    return flat[torch.isfinite(flat)]


MASS_RANGE = (0.0, 1.0)


def colour_range(values: list[torch.Tensor], diverging: bool) -> tuple[float, float]:
    """One shared colour range for these maps: ±max|x| when diverging (log-odds; at least ±1e-6),
    else the mass's whole range 0..1."""
    if not diverging:
        return MASS_RANGE
    flat = _finite(values)
    bound = max(float(flat.abs().max()), 1e-6) if flat.numel() else 1.0
    return -bound, bound


def axis_facts(ax) -> dict[str, Any]:
    """An axis's ranges and the offset text matplotlib shows (always empty here), as drawn: the figure is drawn
    first only if the axis changed since its last draw (read after saving, as save_png_svg's `on_drawn` does,
    this costs no draw of its own)."""
    if ax.stale:
        ax.figure.canvas.draw()
    return {"xlim": tuple(float(x) for x in ax.get_xlim()), "ylim": tuple(float(y) for y in ax.get_ylim()),
            "offset": [ax.xaxis.get_offset_text().get_text(), ax.yaxis.get_offset_text().get_text()]}


def pyplot():
    # lazy: loads matplotlib, PIL
    import matplotlib

    matplotlib.use("Agg")
    # lazy: loads matplotlib, PIL
    import matplotlib.pyplot as plt

    # Numbers read as they are: no "1e−8 −6e−4" in an axis corner (offset or multiplier) for S ≈ −0.0006.
    plt.rcParams.update({"axes.formatter.useoffset": False, "axes.formatter.limits": (-8, 8)})
    return plt


def save_png_svg(fig, path: str | os.PathLike, on_drawn: Callable[[Any], None] | None = None, *, bottom: float = 0.0) -> list[Path]:
    """Write the figure as PATH (.png) and beside it as .svg, atomically; close it. `on_drawn(fig)` runs between
    the two, when the figure is laid out and drawn: what it reads off the axes (axis_facts) is what was drawn,
    without a draw of its own (each draw is about a quarter of a figure's cost). `bottom`: the share of the height
    kept below the axes for a footer (the layout does not count figure texts)."""
    path = Path(path)
    try:
        fig.tight_layout(rect=(0, bottom, 1, 1))
        png = save_figure_atomic(fig, path.with_suffix(".png"), dpi=120)
        if on_drawn is not None:
            on_drawn(fig)
        return [png, save_figure_atomic(fig, path.with_suffix(".svg"))]
    finally:
        pyplot().close(fig)


FOOTER_POINTS = 7  # the note's font size


def _heatmaps(panels: list[dict[str, Any]], title: str, note: str):
    """(figure, the share of its height its footer takes): the note wrapped to the figure's width, below the axes."""
    # lazy: loads matplotlib, PIL
    from matplotlib.ticker import MaxNLocator

    plt = pyplot()
    width, height = 4.2 * len(panels), 3.8
    fig, axes = plt.subplots(1, len(panels), figsize=(width, height), squeeze=False)
    for ax, p in zip(axes[0], panels):
        im = ax.imshow(p["data"].T.numpy(), aspect="auto", origin="lower", cmap=p["cmap"], vmin=p["vmin"], vmax=p["vmax"],
                       interpolation="nearest")
        p["clipped"] = _clipped(p)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("layer")
        ax.set_ylabel("head")
        ax.set_title(p["label"], fontsize=9)
        fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04, extend=p["clipped"])
        if p["data"].numel() <= ANNOTATE_CELLS:  # a miniature's few heads: the values themselves, as well as colours
            for (layer, head), v in np.ndenumerate(p["data"].numpy()):
                ax.text(layer, head, "" if math.isnan(v) else f"{v:.2f}", ha="center", va="center", fontsize=6, color=_ink(v, p))
    fig.suptitle(title, fontsize=10)
    lines = textwrap.wrap(note, int(width * 72 / (FOOTER_POINTS * 0.55)))  # a character is about 0.55 of the font size wide
    fig.text(0.5, 0.01, "\n".join(lines), ha="center", va="bottom", fontsize=FOOTER_POINTS, color="dimgrey")
    return fig, (len(lines) * FOOTER_POINTS * 1.3 / 72 + 0.05) / height


def _clipped(panel: dict[str, Any]) -> str:
    """matplotlib's colour-bar `extend`: which ends the data pass (drawn as arrows on the bar)."""
    flat = _finite([panel["data"]])
    low = bool(flat.numel()) and float(flat.min()) < panel["vmin"] - 1e-12
    high = bool(flat.numel()) and float(flat.max()) > panel["vmax"] + 1e-12
    return {(False, False): "neither", (True, False): "min", (False, True): "max", (True, True): "both"}[(low, high)]


def _ink(v: float, panel: dict[str, Any]) -> str:
    """Black or white text, whichever reads on the cell's colour (its position in the colour range)."""
    lo, hi = panel["vmin"], panel["vmax"]
    t = 0.5 if hi <= lo or math.isnan(v) else (v - lo) / (hi - lo)
    dark = (t < 0.3 or t > 0.7) if panel["cmap"] in ("RdBu_r", "PuOr_r") else t < 0.6  # viridis is dark at its low end
    return "white" if dark else "black"


def _name(maps: SinkMaps, fallback: str) -> str:
    return Path(maps.model.get("name_or_path") or fallback).name or fallback


def _panel(data: torch.Tensor, label: str, cmap: str, rng: tuple[float, float]) -> dict[str, Any]:
    return {"data": data, "label": label, "cmap": cmap, "vmin": rng[0], "vmax": rng[1]}


def _range_note(kind: str, rng: tuple[float, float], values: list[torch.Tensor], shift: tuple[float, float] | None = None) -> str:
    flat = _finite(values)
    data = f"; values {float(flat.min()):.2f} to {float(flat.max()):.2f}" if flat.numel() else ""
    if kind == LOGODDS:
        note = (f"log-odds colour range ±{rng[1]:.2f}, shared by the maps (symmetric about 0; > 0: most attention on one key"
                f"{data})")
    else:
        note = f"mass colour range 0 to 1 (the whole range{data})"
    if shift:
        note += f"; shift colour range ±{shift[1]:.3g} (its own, from the data)"
    return note


def _facts(panels: list[dict[str, Any]], paths: list[Path], note: str) -> dict[str, Any]:
    return {"paths": paths, "note": note,
            "panels": [{"label": p["label"], "vmin": p["vmin"], "vmax": p["vmax"], "cmap": p["cmap"], "clipped": p["clipped"],
                        "data_min": float(_finite([p["data"]]).min()) if _finite([p["data"]]).numel() else math.nan,
                        "data_max": float(_finite([p["data"]]).max()) if _finite([p["data"]]).numel() else math.nan}
                       for p in panels]}


def plot_sink_map(maps: SinkMaps, path: str | os.PathLike, *, metric: str = "mass", title: str | None = None) -> dict[str, Any]:
    """Heat-map of one model's per-(layer, head) sink statistic for `metric`; returns what it drew."""
    values, label, kind = head_values(maps, metric)
    rng = colour_range([values], diverging=kind == LOGODDS)
    panels = [_panel(values, label, "RdBu_r" if kind == LOGODDS else "viridis", rng)]
    note = _range_note(kind, rng, [values])
    fig, bottom = _heatmaps(panels, title or f"{_name(maps, 'model')}: {maps.settings['calibration']}", note)
    return _facts(panels, save_png_svg(fig, path, bottom=bottom), note)


def plot_sink_shift(maps_a: SinkMaps, maps_b: SinkMaps, path: str | os.PathLike, *, metric: str = "mass",
                    title: str | None = None, names: tuple[str, str] | None = None) -> dict[str, Any]:
    """Three panels: A's map, B's map (one colour range for both) and B − A (diverging, its own
    symmetric range from the data, stated in its title); returns what it drew."""
    (a, label, kind), (b, _, kind_b) = head_values(maps_a, metric), head_values(maps_b, metric)
    if kind_b != kind:  # one of the two stored no per-query log-odds: compare like with like
        (a, label, kind), (b, _, _) = head_values(maps_a, "mass"), head_values(maps_b, "mass")
        label += " (no per-query log-odds stored)"
    rng = colour_range([a, b], diverging=kind == LOGODDS)
    shift = colour_range([b - a], diverging=True)
    name_a, name_b = names or (_name(maps_a, "A"), _name(maps_b, "B"))
    cmap = "RdBu_r" if kind == LOGODDS else "viridis"
    panels = [_panel(a, f"{name_a}: {label}", cmap, rng), _panel(b, name_b, cmap, rng),
              _panel(b - a, f"{name_b} − {name_a} (colour range ±{shift[1]:.2g})", "PuOr_r", shift)]
    note = _range_note(kind, rng, [a, b], shift)
    fig, bottom = _heatmaps(panels, title or "sink shift", note)
    return _facts(panels, save_png_svg(fig, path, bottom=bottom), note)


def plot_layer_profiles(series: dict[str, SinkMaps], path: str | os.PathLike, *, metric: str = "mass",
                        title: str = "sink profile per layer", emphasise: tuple[str, ...] = ()) -> dict[str, Any]:
    """One line per model: the per-layer sink statistic (`layer_profile`); `emphasise` names drawn bold."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4))
    # lazy: loads matplotlib, PIL
    from matplotlib.ticker import MaxNLocator

    # One statistic for every line: mass where any model's maps stored no per-query log-odds.
    logodds = metric == LOGODDS and all(m.logodds is not None for m in series.values())
    lines = {name: layer_profile(maps, LOGODDS if logodds else "mass") for name, maps in series.items()}
    for name, ys in lines.items():
        bold = name in emphasise
        ax.plot(range(len(ys)), ys, marker="o", ms=4 if bold else 2.5, lw=2.0 if bold else 0.9, alpha=1.0 if bold else 0.75, label=name)
    ylabel = "median log-odds on the argmax key" if logodds else "mean sink mass over heads"
    values = [y for ys in lines.values() for y in ys if not math.isnan(y)]
    if logodds and values and min(values) <= 0 <= max(values):  # only where it does not squash the lines
        ax.axhline(0, color="grey", lw=0.7)

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("layer")
    ax.set_ylabel(ylabel)
    if not logodds:
        ax.set_ylim(*MASS_RANGE)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    facts: dict[str, Any] = {}
    paths = save_png_svg(fig, path, on_drawn=lambda _: facts.update(axis_facts(ax)))
    return {"paths": paths, "lines": lines, "ylabel": ylabel, "axes": facts}
