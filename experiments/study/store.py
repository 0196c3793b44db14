"""Finished steps shared between runs: `<cache>/steps/<key>.json` (or the root a command's `--cache-dir` names)
names the record and outputs a step with that key left in some run directory, so another run (a study, a
`sinkstudy merge`, an eval, a sweep) that plans the same step reuses it instead of computing it again.

A step's key covers everything its result depends on (`experiments.study.kinds`), so a finished step is
the same wherever it ran. An entry is used only while the run it names still holds it: its record under
the same key and every output in place (a rerun there under another key, or a deleted run, makes it
stale). Reusing copies the outputs into the reusing run: large files as hard links (outputs are written
whole, through temporaries, never edited in place, so the two copies cannot drift), the rest as copies,
each output moved into place atomically; the paths in the result are rewritten to the new outputs.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from sinkstudy.io import atomic_file, atomic_output_dir, cache_root, write_json_atomic

LINK_BYTES = 1 << 20  # files at least this large are hard-linked where the filesystem allows


def default_root() -> Path:
    """Where finished steps are shared: `<cache>/steps` (`sinkstudy.io.cache_root`)."""
    return cache_root() / "steps"


def _entry_path(root: Path | None, key: str) -> Path:
    return Path(root or default_root()) / f"{key}.json"


def register(key: str, record: Path, outputs: list[str], root: Path | None = None) -> None:
    """Note under `root` (default `default_root()`) that `record` (a step's record, holding `key`) and `outputs` are a
    finished step."""
    try:
        write_json_atomic(_entry_path(root, key), {"key": key, "record": os.fspath(Path(record).resolve()),
                                              "outputs": [os.fspath(Path(o).resolve()) for o in outputs]})
    except OSError:
        pass  # a read-only cache only costs sharing


def lookup(key: str, root: Path | None = None) -> dict | None:
    """{"record": the finished step's record, "outputs": its output paths} of a step with `key` finished in
    some run and still there (noted under `root`), else None."""
    try:
        entry = json.loads(_entry_path(root, key).read_text(encoding="utf-8"))
        record = json.loads(Path(entry["record"]).read_text(encoding="utf-8"))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not isinstance(record, dict) or record.get("key") != key or not all(Path(o).exists() for o in entry["outputs"]):
        return None
    return {"record": record, "record_path": entry["record"], "outputs": entry["outputs"]}


def adopt(found: dict, outputs: tuple[Path, ...], *, copy: bool = True) -> tuple[dict, dict[str, str]]:
    """Copy a found step's outputs to this step's `outputs` (same order; `copy=False`: only say where they
    would go); (its result with paths rewritten, {output: fingerprint})."""
    record = found["record"]
    # The record names its outputs as its run wrote them (relative to that run's working directory, which need not
    # be this one's); the entry lists the same outputs resolved, in the same order.
    written = list(record.get("outputs") or {})
    moves, made = {}, {}
    for i, (src, dst) in enumerate(zip(found["outputs"], outputs)):
        dst = Path(dst)
        if copy and os.path.realpath(src) != os.path.realpath(dst):
            _copy(Path(src), dst)
        moves[src] = os.fspath(dst)
        if i < len(written):
            moves[written[i]] = os.fspath(dst)
            made[os.fspath(dst)] = record["outputs"][written[i]]
    return _rewrite(record["result"], moves), made


def _copy(src: Path, dst: Path) -> None:
    if src.is_dir():
        with atomic_output_dir(dst, replace=True) as tmp:
            shutil.rmtree(tmp)
            shutil.copytree(src, tmp, copy_function=_link_or_copy, symlinks=True)
    else:
        with atomic_file(dst) as tmp:
            _link_or_copy(src, tmp)


def _link_or_copy(src, dst) -> None:
    if os.path.getsize(src) >= LINK_BYTES:
        try:
            if os.path.lexists(dst):
                os.remove(dst)
            os.link(src, dst)
            return
        except OSError:
            pass  # another filesystem, or links not allowed: a copy
    shutil.copy2(src, dst)


def _rewrite(value: Any, moves: dict[str, str]) -> Any:
    """`value` with every string (and mapping key) that is a moved path, or lies under one, moved."""
    if isinstance(value, str):
        for old, new in moves.items():
            if value == old or value.startswith(old.rstrip("/") + "/"):
                return new + value[len(old):]
        return value
    if isinstance(value, dict):
        return {_rewrite(k, moves): _rewrite(v, moves) for k, v in value.items()}
    if isinstance(value, list):
        return [_rewrite(v, moves) for v in value]
    return value
