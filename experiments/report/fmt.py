"""Numbers, intervals and durations as text, the same way in every report, table, progress and closing line."""

from __future__ import annotations

import math


def missing(x) -> bool:
    """None or NaN: a value a summary could not define (e.g. Δ/base over a zero base score)."""
    return x is None or (isinstance(x, float) and math.isnan(x))


def finite_or_none(x) -> float | None:
    """A finite number as float; None for anything JSON cannot hold as a number (None, NaN, ±inf)."""
    return float(x) if isinstance(x, (int, float)) and math.isfinite(x) else None


def num(x, spec: str = ".3f", none: str = "n/a") -> str:
    """A number by `spec` (`none` when missing; -0.0 printed as 0.0); anything not a number as is."""
    if missing(x):
        return none
    return format(x or 0.0, spec) if isinstance(x, (int, float)) and not isinstance(x, bool) else str(x)


def brief(x) -> str:
    """Four significant digits, "-" when missing: the commands' tables and closing lines."""
    return num(x, ".4g", "-")


def ci_text(ci, spec: str = ".3f", none: str = "") -> str:
    """"[lo, hi]", or `none` when the interval is missing or undefined."""
    if not ci or any(missing(v) for v in ci):
        return none
    return f"[{format(ci[0] or 0.0, spec)}, {format(ci[1] or 0.0, spec)}]"


def with_ci(x, ci, spec: str = ".3f") -> str:
    return f"{num(x, spec)} {ci_text(ci, spec)}".strip()


def points(score) -> str:
    """A score in [0, 1] printed in points."""
    return "n/a" if missing(score) else f"{100 * score:.1f}"


def format_duration(seconds: float) -> str:
    """12.3 s, 47 s, 3 min 05 s, 2 h 07 min."""
    if seconds < 10:
        return f"{seconds:.1f} s"
    if seconds < 60:
        return f"{seconds:.0f} s"
    minutes, secs = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {secs:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


def format_clock(seconds: float) -> str:
    """A stopwatch reading for progress lines: 0:07, 3:05, 127:40 (minutes:seconds)."""
    minutes, secs = divmod(round(seconds), 60)
    return f"{minutes}:{secs:02d}"
