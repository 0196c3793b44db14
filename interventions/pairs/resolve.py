"""Resolve a model argument (loaded model, local path, .gguf file or hub id) once, into a `ModelSource`.

The descriptor carries everything the loaders below need: the config and its kind (VLM or causal LM),
the local checkpoint dir with its validated safetensors files, the checkpoint's dtype and where the
tokenizer is. Files are validated (headers only) when the source is resolved, before any work.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path

from interventions.pairs import archs
from interventions.pairs.layout import compare_layouts
from sinkstudy import SinkstudyError
from sinkstudy.checkpoint import WeightFiles, hub_snapshot, local_model_path, looks_like_path, weight_files

log = logging.getLogger(__name__)


@dataclasses.dataclass
class ModelSource:
    """One model argument, resolved: what it is and where its parts are."""

    id: str  # as given: path, hub id, or "<Class in memory>"
    config: object
    kind: str  # "vlm" or "causal_lm"
    model: object | None = None  # the loaded model, when one was passed in
    path: Path | None = None  # local checkpoint dir (a hub snapshot, or a .gguf file's converted dir)
    weights: WeightFiles | None = None  # validated safetensors files; None for a loaded model or .bin weights

    @property
    def dtype(self):
        """The dtype the weights are stored in (config's `dtype`, else the headers'), float32 if unknown."""
        # lazy: loads torch, numpy
        import torch

        if self.model is not None:
            return self.model.dtype
        declared = getattr(self.config, "dtype", None)
        if isinstance(declared, str):
            declared = getattr(torch, declared, None)
        if isinstance(declared, torch.dtype) and declared.is_floating_point:
            return declared
        stored = self.weights.float_dtype() if self.weights is not None else None
        return getattr(torch, stored) if stored else torch.float32

    @property
    def tokenizer_path(self) -> str | None:
        return os.fspath(self.path) if self.path is not None else None


def resolve(obj, *, weights: bool = True) -> ModelSource:
    """A ModelSource for a loaded model, a local dir, a .gguf file or a hub id (fetched when `weights`).

    One-line SinkstudyError for a missing path, an unreadable config, an unsupported architecture, or
    (with `weights`) missing, truncated or inconsistent weight files.
    """
    if isinstance(obj, ModelSource):
        return obj
    if is_model(obj):
        return ModelSource(model_id(obj), obj.config, archs.classify(obj.config), model=obj)
    name = os.fspath(obj)
    local = local_model_path(name)
    config = load_config(local)
    kind = archs.classify(config)
    path = Path(local).expanduser()
    if not path.exists():
        path = hub_snapshot(name) if weights else None
    return ModelSource(name, config, kind, path=path, weights=weight_files(path) if weights and path else None)


def check_same_layout(a, b, *, names: tuple[str, str] = ("base", "vlm"), ignore_vocab: bool = False) -> None:
    """Raise PairMismatchError naming the first tensor whose presence or shape differs.

    `a`/`b`: loaded models, configs, paths or hub ids (read as configs: no weights), or {name: shape}
    mappings. A VLM is laid out as the causal LM its language model extracts to.
    """
    compare_layouts(_layout_subject(a), _layout_subject(b), names=names, ignore_vocab=ignore_vocab)


def _layout_subject(obj):
    if isinstance(obj, (str, os.PathLike)):
        obj = load_config(local_model_path(obj))
    if hasattr(obj, "model_type") and not hasattr(obj, "state_dict") and archs.classify(obj) == "vlm":
        return archs.plan_target_config(obj)[0]
    return obj


def is_model(obj) -> bool:
    return hasattr(obj, "state_dict") and hasattr(obj, "config")


def model_id(obj) -> str:
    if is_model(obj):
        return getattr(obj.config, "_name_or_path", "") or f"<{type(obj).__name__} in memory>"
    return os.fspath(obj)


def resolve_dtype(dtype):
    """torch dtype from None (float32), a torch.dtype, or a name like 'bfloat16'."""
    # lazy: loads torch, numpy
    import torch

    if dtype is None:
        return torch.float32
    if isinstance(dtype, str):
        value = getattr(torch, dtype, None)
        if not isinstance(value, torch.dtype):
            raise SinkstudyError(f"unknown dtype {dtype!r}; use float32, bfloat16 or float16")
        return value
    return dtype


def load_config(source, revision: str | None = None):
    """AutoConfig for a local dir, .gguf file or hub id (at `revision`); one-line SinkstudyError if it is
    missing or unreadable."""
    # lazy: loads transformers, numpy, PIL
    from transformers import AutoConfig

    name = local_model_path(source)
    path = Path(name).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise SinkstudyError(f"{name} has no config.json: not a Hugging Face checkpoint directory")
        name = os.fspath(path)
    elif looks_like_path(name):
        raise SinkstudyError(f"missing path: {name} does not exist")
    try:
        return AutoConfig.from_pretrained(name, **({"revision": revision} if revision else {}))
    except (OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if path.exists():
            _raise_if_unknown_type(path)
            raise SinkstudyError(f"cannot read the config in {name}: {first}") from exc
        raise SinkstudyError(
            f"cannot load {name!r}: no such local path, and the hub could not resolve it "
            f"(offline? HF_HUB_OFFLINE={os.environ.get('HF_HUB_OFFLINE', '0')}): {first}"
        ) from exc


def _raise_if_unknown_type(path: Path) -> None:
    # lazy: loads transformers, numpy, PIL
    from transformers import CONFIG_MAPPING

    try:
        model_type = json.loads((path / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        return
    if model_type not in CONFIG_MAPPING:
        why = f" ({archs.NOT_NATIVE[model_type]})" if model_type in archs.NOT_NATIVE else ""
        raise SinkstudyError(
            f"unsupported architecture {model_type!r} in {path}{why}; supported VLMs: {archs.supported_list()}; "
            "or any causal LM transformers can load"
        )
