"""A report's figures are functions of their inputs: a figure whose inputs, plotting code and matplotlib
version are those of the figure already on disk (its files unchanged since) is not drawn again.

Drawing is most of a report's cost (about 1 s per figure: PNG, SVG and the layout pass), and a rerun of a
study whose results are all reused draws none. Each figure slot (plot function and its
task/pair/metric arguments) keeps one record under OUT/plots/.reuse/: the key it was drawn under, the
function's return value and the sha256 of every file it names. A record is used only when its key matches
and every file still has that content; otherwise the figure is drawn and the record replaced. Keys leave out
what no figure shows: the run's timings and provenance.
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path
from typing import Any, Callable

from sinkstudy.io import json_default, reusable_json, write_json_atomic

_HERE = Path(__file__).resolve().parent
_ROOT = _HERE.parent.parent
# Every module that shapes what a figure shows: evals/sink whole, as its plots read the maps through SinkMaps.
PLOT_CODE = (_HERE / "plots.py", _HERE / "fmt.py", _ROOT / "evals" / "sink", _ROOT / "evals" / "stats.py",
             _ROOT / "interventions" / "adapt" / "trajectory.py", Path(__file__))
UNDRAWN_KEYS = ("timings", "provenance")


def _drawn(value: Any) -> Any:
    """`value` without the keys no figure shows (at any depth)."""
    if isinstance(value, dict):
        return {k: _drawn(v) for k, v in value.items() if k not in UNDRAWN_KEYS}
    if isinstance(value, (list, tuple)):
        return [_drawn(v) for v in value]
    return value


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=json_default).encode()).hexdigest()


def _files(result: Any) -> list[str]:
    """Every file (relative to OUT) a plot function's result names under `path` / `svg`."""
    if isinstance(result, dict):
        own = [result[k] for k in ("path", "svg") if isinstance(result.get(k), str)]
        return own + [f for v in result.values() if isinstance(v, dict) for f in _files(v)]
    return []


@functools.lru_cache(maxsize=1)
def _code_key() -> str:
    import matplotlib

    from sinkstudy.provenance import code_version

    return f"{code_version(*PLOT_CODE)} matplotlib {matplotlib.__version__}"


def reused(fn: Callable) -> Callable:
    """Decorate a plot function `fn(data, *settings, out)` (its result: None or a JSON record naming its files
    by `path`/`svg` relative to `out`, or a mapping of such records) so that it is drawn only when its
    inputs changed. The result is the same JSON either way (a drawn one goes through JSON too)."""

    @functools.wraps(fn)
    def wrapper(*args):
        from sinkstudy.provenance import file_sha256

        out = Path(args[-1])
        slot = out / "plots" / ".reuse" / f"{fn.__name__}-{_digest(list(args[1:-1]))[:12]}.json"
        key = _digest({"figure": fn.__name__, "inputs": _drawn(list(args[:-1])), "code": _code_key()})
        record = reusable_json(slot, key) or {}
        files = record.get("files")
        if "result" in record and isinstance(files, dict) and all((out / f).is_file() and file_sha256(out / f) == h
                                                                  for f, h in files.items()):
            return record["result"]  # else no record, or one that cannot be trusted: draw
        result = fn(*args)
        if result is None:
            return None
        result = json.loads(json.dumps(result, default=json_default))
        write_json_atomic(slot, {"key": key, "result": result, "files": {f: file_sha256(out / f) for f in _files(result)}})
        return result

    return wrapper
