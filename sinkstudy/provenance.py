"""What made a number: package versions, git revision, seeds and model fingerprints."""

from __future__ import annotations

import datetime as _dt
import hashlib
import importlib.metadata
import json
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

_PACKAGES = ("sinkstudy", "torch", "transformers", "mergekit", "lm_eval", "datasets", "scipy", "numpy", "tokenizers", "safetensors")


def package_versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {"python": platform.python_version()}
    for name in _PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name.replace("_", "-"))
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def git_revision() -> str | None:
    here = Path(__file__).resolve().parent.parent
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here, capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    if rev.returncode != 0:
        return None
    return rev.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def provenance(**extra: Any) -> dict[str, Any]:
    """A provenance block to store beside every result."""
    return {
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "versions": package_versions(),
        "sinkstudy_git": git_revision(),
        "host": {"platform": platform.platform(), "cpu_count": os.cpu_count()},
        **extra,
    }


def state_dict_fingerprint(model) -> str:
    """sha256 over names, dtypes, shapes and bytes of a loaded model's parameters and buffers."""
    import torch

    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        t = tensor.detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}\n".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return "sd-sha256:" + h.hexdigest()[:32]


def checkpoint_fingerprint(path: str | os.PathLike) -> str:
    """sha256 of a local checkpoint's weight files, cached by (path, size, mtime).

    A hub id (not a local path) is fingerprinted by its name: pin a revision for exactness.
    """
    p = Path(path)
    if not p.exists():
        return f"hub:{path}"
    if p.is_dir():
        # Weights only: a rewritten README or tokenizer must not invalidate cached eval results.
        files = sorted(p.glob("*.safetensors")) or sorted(p.glob("*.bin")) or sorted(x for x in p.iterdir() if x.is_file())
    else:
        files = [p]
    key_parts = [f"{f.resolve()}|{f.stat().st_size}|{f.stat().st_mtime_ns}" for f in files]
    key = hashlib.sha256("\n".join(key_parts).encode()).hexdigest()
    cache = _load_cache()
    if key in cache:
        return cache[key]
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode())
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 22), b""):
                h.update(chunk)
    fp = "ckpt-sha256:" + h.hexdigest()[:32]
    cache[key] = fp
    _save_cache(cache)
    return fp


def model_fingerprint(model_or_path) -> str:
    if isinstance(model_or_path, (str, os.PathLike)):
        return checkpoint_fingerprint(model_or_path)
    return state_dict_fingerprint(model_or_path)


def _fingerprint_cache() -> Path:
    from sinkstudy.io import cache_root

    return cache_root() / "fingerprints.json"


def _load_cache() -> dict[str, str]:
    try:
        return json.loads(_fingerprint_cache().read_text())
    except (OSError, ValueError):
        return {}


def _save_cache(cache: dict[str, str]) -> None:
    from sinkstudy.io import write_json_atomic

    try:
        write_json_atomic(_fingerprint_cache(), cache)
    except OSError:
        pass  # a read-only home only costs a re-hash next time
