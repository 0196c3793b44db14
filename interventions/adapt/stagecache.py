"""Finished stages shared between adaptation runs, keyed by everything that shapes them.

Arms of a protection study differ in what they do in stage 2 (a protection, replayed text), while their
stage 1 (the projector alone, same base, seed, data and settings) is the same computation. A run given a
`stage_cache` folder (a study's arms: `default_root()`, `<cache>/stages` beside every other reusable result)
looks each stage up there before training it, and stores it there once trained: a cache whose entries are the
input of the step that adapts, keyed by the one key helper (`sinkstudy.keys.key`):

    <stage_cache>/<key>/final.safetensors   the whole model after the stage
                        done.json           the stage's statistics (as in the run's work/<stage>/done.json)
                        points.json         the S-trajectory points measured up to the stage's end
                        snapshot-<n>.safetensors  the model after step n, for each step of the stage's save_models_at

The key of stage k is a hash of the run's request (`interventions.adapt.run.make_request`: base and its
fingerprint, vision side, QK-norm injection, engine code, recipe with data content hashes) with the
recipe cut after stage k and only the hooks that act in stages 1..k or change the base before training
(`prepare_base`). Reusing a stage is the engine's resume path (load the stage's weights, go on with the
next stage), which ends bit-identical to an uninterrupted run (tests/test_adapt_train.py). Entries are
written whole (a temporary folder renamed into place); a second writer of the same key keeps the first.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Sequence

from interventions.adapt.hooks import TrainingHook
from sinkstudy.io import cache_root, read_json, write_json_atomic
from sinkstudy import keys

WEIGHTS, STATS, POINTS = "final.safetensors", "done.json", "points.json"
SNAPSHOTS = "snapshot-*.safetensors"  # interventions.adapt.trainer.snapshot_file


def shapes(hook: TrainingHook, stage_names: Sequence[str]) -> bool:
    """True when `hook` can change what stages `stage_names` compute."""
    return any(hook.applies_to(n) for n in stage_names) or type(hook).prepare_base is not TrainingHook.prepare_base


def default_root() -> Path:
    """Where finished stages are shared between runs: `<cache>/stages` (`sinkstudy.io.cache_root`)."""
    return cache_root() / "stages"


def stage_key(request: dict, hooks: Sequence[TrainingHook], k: int) -> str:
    """The key of the run's stage k (0-based): its request cut after stage k, with the hooks that shape stages 0..k.
    The base counts by its fingerprint, not its path: the same weights linked elsewhere (each study links its inputs
    under its own folder) train the same stages."""
    stages = request["config"]["stages"][: k + 1]
    names = [s["name"] for s in stages]
    cut = {**{f: v for f, v in request.items() if f != "base"}, "config": {**request["config"], "stages": stages},
           "hooks": [ident for hook, ident in zip(hooks, request["hooks"]) if shapes(hook, names)]}
    return keys.key(cut)


def lookup(cache: Path, key: str) -> Path | None:
    entry = Path(cache) / key
    return entry if all((entry / f).is_file() for f in (WEIGHTS, STATS, POINTS)) else None


def store(cache: Path, key: str, work: Path, points: list[dict]) -> None:
    """Copy a finished stage (`work` holds final.safetensors and done.json) into the cache under `key`."""
    cache = Path(cache)
    if lookup(cache, key):
        return
    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=cache))
    try:
        shutil.copyfile(work / WEIGHTS, tmp / WEIGHTS)  # a copy: the run may rewrite its own file
        shutil.copyfile(work / STATS, tmp / STATS)
        for snapshot in work.glob(SNAPSHOTS):
            shutil.copyfile(snapshot, tmp / snapshot.name)
        write_json_atomic(tmp / POINTS, {"points": points})
        try:
            os.rename(tmp, cache / key)
        except OSError:  # another run stored the same stage first
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def restore(entry: Path, work: Path) -> tuple[dict, list[dict]]:
    """Put a cached stage into the run's `work` folder (as if the run had trained it); (stats, points)."""
    work.mkdir(parents=True, exist_ok=True)
    _link_or_copy(entry / WEIGHTS, work / WEIGHTS)
    for snapshot in entry.glob(SNAPSHOTS):
        _link_or_copy(snapshot, work / snapshot.name)
    stats = read_json(entry / STATS)
    write_json_atomic(work / STATS, stats)
    return stats, read_json(entry / POINTS)["points"]


def _link_or_copy(src: Path, dst: Path) -> None:
    if dst.exists():
        dst.unlink()
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)
