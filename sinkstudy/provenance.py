"""What made a number: package versions, git revision, seeds, model fingerprints and code versions.

Model identity (`model_fingerprint`), the key of every cached result:
- a local checkpoint directory: sha256 over the content of every top-level file that can change
  what the model computes or how it is prompted — weights, config.json, generation_config.json,
  tokenizer files and chat template, processor configs, QK-norm sidecars, and anything else a
  loader might read — except the result and provenance files in `FINGERPRINT_EXCLUDE` (and hidden
  files: locks, temporaries, .gitattributes). Sub-directories are not read by loaders and are
  skipped (cmd_merge keeps its `eval/` measurements there).
- a single file (a .gguf): its content.
- a registered real LLM's name (`sinkstudy.real_models`): `real:<name>@sha256:...`, its GGUF's content.
- a hub id that is not a local path: `hub:<id>`, `hub:<id>@<revision>` with a revision. Only a
  pinned revision (a commit) identifies weights; a branch name can move under the same key.
- a loaded model: its state dict (names, dtypes, shapes, bytes), its config (minus the load path,
  the transformers version and the tie flag, whose effect is already in the state dict), the
  attention implementation and its generation config.
Files of 1 MiB or more are hashed once per (resolved path, size, mtime_ns, ctime_ns, inode,
device) and the digest cached under the sinkstudy cache: ctime changes on every write and every
`touch`/`os.utime`, so restoring an edit with the old mtime is caught. Smaller files are re-hashed.

Hardware (`hardware()`, in every provenance block): training amplifies floating-point differences
between machines, so a result records what computed it: the CPU model and the ISA flags that select
different kernels (AVX2 / AVX-512 / AMX / FMA...), torch's thread counts, its CPU kernel level and
BLAS / oneDNN backends, environment variables that change them, and the CUDA device when present; and
the threads it computed on with OpenMP's wait policy (`sinkstudy.threads.in_effect`: they explain its time).
The static part is read once per process; thread counts are read at each call.
"""

from __future__ import annotations

import datetime as _dt
import fnmatch
import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterable

from sinkstudy import real_models
from sinkstudy.io import cache_root, write_json_atomic
from sinkstudy.numerics import KERNEL_ENV, PINNED_ENV, identity
from sinkstudy.threads import in_effect

_PACKAGES = ("sinkstudy", "torch", "transformers", "mergekit", "lm_eval", "datasets", "scipy", "numpy", "tokenizers", "safetensors")

# Files of a checkpoint dir that record results or provenance and never change outputs.
FINGERPRINT_EXCLUDE = (
    "intervention.json",          # interventions.merge.RESULT_JSON: settings, request, provenance
    "sinkstudy_extraction.json",  # interventions.pairs.EXTRACTION_JSON: extraction provenance
    "mergekit_config.yml",        # the merge recipe (its outcome is in the weights)
    "measure.json", "sink.json",  # cmd_merge measurements written beside a merged model
    "sink_maps_*.json",           # head_restore's calibration maps, saved for reuse
    "README*", "*.md", "LICENSE*", "NOTICE*", "USE_POLICY*",
    ".*",                         # hidden: .gitattributes, locks, temporaries
)
_HASH_CACHE_MIN_BYTES = 1 << 20
# Config keys of a loaded model that do not change what it computes (see the module doc).
_VOLATILE_CONFIG_KEYS = ("_name_or_path", "transformers_version", "tie_word_embeddings")


def package_versions() -> dict[str, str | None]:
    return dict(_package_versions())


@functools.lru_cache(maxsize=1)
def _package_versions() -> dict[str, str | None]:
    # once per process: each metadata lookup scans every installed distribution (~70 ms for the list)
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
        "hardware": hardware(),
        **extra,
    }


# --------------------------------------------------------------------------- hardware

# /proc/cpuinfo flags that select different kernels (and so different rounding) in BLAS, oneDNN and ATen.
NUMERIC_CPU_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
                     "avx512_fp16", "avx_vnni", "amx_tile", "amx_bf16", "amx_int8", "amx_fp16",
                     "asimd", "asimdhp", "sve", "sve2", "bf16", "i8mm")  # the last six: Arm's "Features"
# Environment variables that change threads or the kernels chosen.
NUMERIC_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", *KERNEL_ENV, "CUBLAS_WORKSPACE_CONFIG",
               "GLIBC_TUNABLES")


def hardware() -> dict[str, Any]:
    """What computed a result: CPU, torch's threads and kernels, CUDA device (see the module doc).
    torch's part only where torch is loaded (a result made without it did not use it)."""
    out = {**_cpu(), "numerics": identity(), "threads": in_effect(),
           "env": {k: os.environ[k] for k in NUMERIC_ENV if k in os.environ}}
    torch = sys.modules.get("torch")
    if torch is not None:
        out["torch"] = {"threads": torch.get_num_threads(), "interop_threads": torch.get_num_interop_threads(), **_torch_build(),
                        "float32_matmul_precision": torch.get_float32_matmul_precision(),
                        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled()}
        out["cuda"] = _cuda()
    return out


@functools.lru_cache(maxsize=1)
def _cpu() -> dict[str, Any]:
    info: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                key = key.strip()
                if not key and info:  # the first processor's block is enough
                    break
                info.setdefault(key, value.strip())
    except OSError:  # not Linux
        pass
    flags = set((info.get("flags") or info.get("Features") or "").split())
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    return {"machine": platform.machine(),
            "cpu": info.get("model name") or info.get("Model") or platform.processor() or None,
            "cpu_flags": [f for f in NUMERIC_CPU_FLAGS if f in flags],
            "cpu_count": os.cpu_count(), "cpus_usable": usable}


@functools.lru_cache(maxsize=1)
def _torch_build() -> dict[str, Any]:
    """torch's CPU kernel level and math libraries, from torch.__config__.show()."""
    # lazy: loads torch, numpy
    import torch

    shown = torch.__config__.show()
    settings = dict(re.findall(r"(\w+)=([^,\n]*)", shown.split("Build settings:", 1)[1])) if "Build settings:" in shown else {}

    def line(pattern: str) -> str | None:
        m = re.search(pattern, shown)
        return m.group(1).strip() if m else None

    return {"cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "blas": settings.get("BLAS_INFO"), "lapack": settings.get("LAPACK_INFO"),
            "mkl": line(r"Math Kernel Library Version ([\w.]+)") if torch.backends.mkl.is_available() else None,
            "onednn": line(r"MKL-DNN (v[^\s]+)") if torch.backends.mkldnn.is_available() else None,
            "onednn_enabled": bool(torch.backends.mkldnn.enabled), "openmp": line(r"- OpenMP (\d+)")}


def _cuda() -> dict[str, Any] | None:
    # lazy: loads torch, numpy
    import torch

    if not torch.cuda.is_available():
        return None
    index = torch.cuda.current_device()
    major, minor = torch.cuda.get_device_capability(index)
    return {"device": torch.cuda.get_device_name(index), "capability": f"{major}.{minor}", "count": torch.cuda.device_count(),
            "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
            "tf32_matmul": torch.backends.cuda.matmul.allow_tf32, "tf32_cudnn": torch.backends.cudnn.allow_tf32}


def describe_hardware(hw: dict | list | None) -> str:
    """One line per machine setting, joined by ' | ' (a list: the distinct ones a set of results came from)."""
    entries = hw if isinstance(hw, list) else [hw] if hw else []
    if not entries:
        return "not recorded"
    parts = []
    for h in entries:
        text = f"{h.get('cpu') or h.get('machine') or 'unknown CPU'} ({', '.join(h.get('cpu_flags') or []) or 'no listed flags'}; " \
               f"{h.get('cpus_usable')} of {h.get('cpu_count')} cores)"
        t = h.get("torch")
        if t:
            text += (f"; torch {t['threads']} thread(s), {t['interop_threads']} inter-op, kernels {t['cpu_capability']}, "
                     f"BLAS {t['blas'] or '?'}" + (f", oneDNN {t['onednn']}" if t.get("onednn") and t.get("onednn_enabled") else ""))
        policy = (h.get("threads") or {}).get("wait_policy")
        if policy:
            text += f"; OpenMP wait policy {policy}"
        if h.get("cuda"):
            text += f"; CUDA {h['cuda']['device']}"
        mode = h.get("numerics")
        if mode:
            text += f"; numeric mode {mode}"
        env = {k: v for k, v in (h.get("env") or {}).items() if not (mode or "").startswith("reproducible") or k not in PINNED_ENV}
        if env:  # in the reproducible mode, the variables it sets are its name's
            text += "; " + " ".join(f"{k}={v}" for k, v in env.items())
        parts.append(text)
    return " | ".join(parts)


def recorded_hardware(record_files: Iterable[str | os.PathLike]) -> list[dict]:
    """The distinct `provenance.hardware` entries of these JSON records (e.g. a study's step records:
    the machines and thread settings its results came from), in the order of the sorted paths."""
    seen: list[dict] = []
    for f in sorted(map(Path, record_files)):
        try:
            hw = (json.loads(f.read_text(encoding="utf-8")).get("provenance") or {}).get("hardware")
        except (OSError, ValueError, AttributeError):
            continue
        if hw and hw not in seen:
            seen.append(hw)
    return seen


def code_version(*paths: str | os.PathLike) -> str:
    """sha256 over the source files at `paths` (files, or directories read recursively without
    caches and hidden files) and, outside the native mode, the numeric mode in effect
    (`sinkstudy.numerics.identity`: the same source computes other numbers on other kernels): part of the
    key of every result that code shapes."""
    mode = identity()
    h = hashlib.sha256(b"" if mode == "native" else mode.encode())
    for root in map(Path, paths):
        files = [root] if root.is_file() else sorted(
            f for f in root.rglob("*") if f.is_file() and "__pycache__" not in f.parts
            and not any(part.startswith(".") for part in f.relative_to(root).parts))
        for f in files:
            h.update(f"{root.name}/{f.relative_to(root) if f != root else ''}\n".encode())
            h.update(f.read_bytes())
    return "code-sha256:" + h.hexdigest()[:24]


def module_file(name: str) -> Path:
    """The source file of importable module `name` (a dotted name; a package: its `__init__` alone, never the folder:
    what a result's key names is the modules its code runs), found through the import system, so a module's identity
    follows it wherever it lives."""
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        raise ValueError(f"{name!r} is not an importable module")
    return Path(spec.origin)


def module_code_version(*modules: str) -> str:
    """`code_version` of the source files of importable `modules` (`module_file`)."""
    return code_version(*map(module_file, modules))


def state_dict_fingerprint(model) -> str:
    """sha256 over names, dtypes, shapes and bytes of a loaded model's parameters and buffers."""
    h = hashlib.sha256()
    _hash_state_dict(h, model)
    return "sd-sha256:" + h.hexdigest()[:32]


def _hash_state_dict(h, model) -> None:
    # lazy: loads torch, numpy
    import torch

    for name, tensor in sorted(model.state_dict().items()):
        t = tensor.detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}\n".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")


def loaded_model_fingerprint(model) -> str:
    """A loaded model: state dict + config + attention implementation + generation config."""
    h = hashlib.sha256()
    _hash_state_dict(h, model)
    config = getattr(model, "config", None)
    if config is not None:
        h.update(json.dumps(_without_volatile(config.to_dict()), sort_keys=True, default=str).encode())
        h.update(str(getattr(config, "_attn_implementation", None)).encode())
    generation = getattr(model, "generation_config", None)
    if generation is not None:
        h.update(json.dumps(_without_volatile(generation.to_dict()), sort_keys=True, default=str).encode())
    return "sd-sha256:" + h.hexdigest()[:32]


def _without_volatile(obj):
    if isinstance(obj, dict):
        return {k: _without_volatile(v) for k, v in obj.items() if k not in _VOLATILE_CONFIG_KEYS}
    return obj


def fingerprinted_files(path: str | os.PathLike) -> list[Path]:
    """The files of a checkpoint dir its fingerprint covers (see FINGERPRINT_EXCLUDE)."""
    return sorted(f for f in Path(path).iterdir()
                  if f.is_file() and not any(fnmatch.fnmatchcase(f.name, pat) for pat in FINGERPRINT_EXCLUDE))


def checkpoint_fingerprint(path: str | os.PathLike, revision: str | None = None) -> str:
    """The content fingerprint of a local checkpoint dir or file; `hub:<id>[@revision]` otherwise."""
    p = Path(path).expanduser()
    if not p.exists():
        if real_models.is_registered(path):
            return real_models.fingerprint(os.fspath(path))
        return f"hub:{os.fspath(path)}" + (f"@{revision}" if revision else "")
    files = fingerprinted_files(p) if p.is_dir() else [p]
    cache = _load_cache()
    h = hashlib.sha256()
    changed = False
    for f in files:
        digest, fresh = _file_digest(f, cache)
        changed |= fresh
        h.update(f"{f.name}\0{digest}\n".encode())
    if changed:
        _save_cache(cache)
    return "ckpt-sha256:" + h.hexdigest()[:32]


def _file_digest(f: Path, cache: dict[str, Any]) -> tuple[str, bool]:
    """(sha256 of f, whether the cache gained an entry)."""
    st = f.stat()
    if st.st_size < _HASH_CACHE_MIN_BYTES:
        return file_sha256(f), False
    resolved = os.fspath(f.resolve())
    stamp = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]
    hit = cache.get(resolved)
    if isinstance(hit, dict) and hit.get("stat") == stamp:
        return hit["sha256"], False
    digest = file_sha256(f)
    cache[resolved] = {"stat": stamp, "sha256": digest}
    return digest, True


def file_sha256(f: str | os.PathLike) -> str:
    """sha256 (hex) of one file's content, read in 4 MiB chunks."""
    h = hashlib.sha256()
    with open(f, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def model_fingerprint(model_or_path, revision: str | None = None) -> str:
    """Identity of a model (a path, hub id or loaded model): see the module doc."""
    if isinstance(model_or_path, (str, os.PathLike)):
        return checkpoint_fingerprint(model_or_path, revision)
    return loaded_model_fingerprint(model_or_path)


def file_digest(path: str | os.PathLike) -> str:
    """sha256 of one file's content (data files, calibration texts): short form for keys."""
    return file_sha256(path)[:24]


def _fingerprint_cache() -> Path:
    return cache_root() / "fingerprints.json"


def _load_cache() -> dict[str, Any]:
    try:
        cache = json.loads(_fingerprint_cache().read_text())
    except (OSError, ValueError):
        return {}
    return cache if isinstance(cache, dict) else {}


def _save_cache(cache: dict[str, Any]) -> None:
    try:
        write_json_atomic(_fingerprint_cache(), cache)
    except OSError:
        pass  # a read-only home only costs a re-hash next time
