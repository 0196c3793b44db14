"""Atomic, never-overwrite outputs.

Every artefact (checkpoint dir, JSON, PNG, report) is written to a temporary sibling and renamed
into place, so an interrupted run never leaves a half-written result that a rerun would reuse.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator

from sinkstudy import SinkstudyError


class OutputExistsError(SinkstudyError):
    pass


def cache_root() -> Path:
    """Where sinkstudy keeps reusable state (eval results, fingerprints, extracted LMs, nltk tables)."""
    return Path(os.environ.get("SINKSTUDY_CACHE", Path.home() / ".cache" / "sinkstudy"))


def check_output_dir(path: str | os.PathLike, force: bool = False) -> Path:
    """Fail before any work if `path` exists and `force` is not set."""
    path = Path(path)
    if path.exists() and not force:
        raise OutputExistsError(f"output {path} already exists; pass --force to replace it")
    return path


@contextlib.contextmanager
def atomic_output_dir(path: str | os.PathLike, force: bool = False) -> Iterator[Path]:
    """Yield a temp dir beside `path`; on success it replaces `path` in one rename.

    On error the temp dir is removed and any existing `path` is left untouched.
    """
    path = check_output_dir(path, force)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp's 0700 would make shared results unreadable
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if path.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{path.name}.old-", dir=path.parent))
        os.replace(path, old / path.name)
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, path)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temp path beside `path` (same suffix); on success it replaces `path` in one rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=path.suffix, dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp creates 0600
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    with atomic_file(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return Path(path)


def write_json_atomic(path: str | os.PathLike, obj: Any) -> Path:
    """Strict JSON: NaN/inf (e.g. a relative change over a zero base score) are stored as null."""
    text = json.dumps(_finite(obj), indent=2, default=json_default, allow_nan=False)
    return write_text_atomic(path, text + "\n")


def _finite(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    if hasattr(obj, "tolist") and not isinstance(obj, (str, bytes)):
        return _finite(obj.tolist())
    return obj


def save_figure_atomic(fig, path: str | os.PathLike, **kwargs) -> Path:
    """Save a matplotlib figure atomically (format taken from the suffix)."""
    with atomic_file(path) as tmp:
        fig.savefig(tmp, **kwargs)
    return Path(path)


def read_json(path: str | os.PathLike) -> Any:
    path = Path(path)
    if not path.is_file():
        raise SinkstudyError(f"missing file: {path}")
    return json.loads(path.read_text(encoding="utf-8"))


def json_default(obj: Any) -> Any:
    """`json.dumps(default=...)` for numpy/torch values and paths found in results."""
    # numpy / torch scalars and paths end up in results; store them as plain JSON.
    if hasattr(obj, "tolist"):
        return obj.tolist()
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")
