"""The Sink Strength trajectories of adaptation runs drawn: S (and each strict score, where measured) against the
optimizer step, one line per arm, stage starts dashed (`plot_trajectories`). A figure, outside every result's
identity: drawing it differently makes no run again."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from evals.sink.plot import axis_facts, pyplot
from sinkstudy.io import save_figure_atomic


def plot_trajectories(arms: dict[str, list[dict]], path, *, title: str = "Sink Strength during adaptation",
                      svg: bool = False) -> dict[str, Any]:
    """S (and each strict score, where measured) vs global step, one line per arm; stage starts dashed.
    With `svg`, an .svg beside the PNG as well. Returns {"path", "svg" (or None), "axes": each panel's
    ranges} (numbers on the axes as they are: no offset notation)."""
    plt = pyplot()
    tasks = sorted({t for pts in arms.values() for p in pts for t in (p.get("scores") or {})})
    fig, axes = plt.subplots(1, 1 + len(tasks), figsize=(5 * (1 + len(tasks)), 3.6), squeeze=False)
    for arm, pts in arms.items():
        pts = sorted(pts, key=lambda p: p["step"])
        axes[0][0].plot([p["step"] for p in pts], [_nan(p["sink_strength"]) for p in pts], marker="o", ms=3, label=arm)
        for ax, task in zip(axes[0][1:], tasks):
            sc = [(p["step"], p["scores"][task]) for p in pts if (p.get("scores") or {}).get(task) is not None]
            ax.plot([s for s, _ in sc], [100 * v for _, v in sc], marker="o", ms=3, label=arm)
    starts = sorted({p["step"] for pts in arms.values() for p in pts if p.get("stage_step") == 0 and p["step"] > 0})
    for ax, ylabel in zip(axes[0], ["Sink Strength S (median log-odds)"] + [f"{t} (points)" for t in tasks]):
        for s in starts:
            ax.axvline(s, color="grey", ls="--", lw=0.8)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    out = save_figure_atomic(fig, path, dpi=120)
    facts = [axis_facts(ax) for ax in axes[0]]  # as drawn: read after the save, no draw of its own
    second = save_figure_atomic(fig, Path(path).with_suffix(".svg")) if svg else None
    plt.close(fig)
    return {"path": out, "svg": second, "axes": facts}


def _nan(x):
    return math.nan if x is None else x
