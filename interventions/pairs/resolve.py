"""Turn a model argument (loaded model, local path or hub id) into a config, failing clearly."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from sinkstudy import SinkstudyError

log = logging.getLogger(__name__)


def is_model(obj) -> bool:
    return hasattr(obj, "state_dict") and hasattr(obj, "config")


def model_id(obj) -> str:
    if is_model(obj):
        return getattr(obj.config, "_name_or_path", "") or f"<{type(obj).__name__} in memory>"
    return os.fspath(obj)


def resolve_dtype(dtype):
    """torch dtype from None (float32), a torch.dtype, or a name like 'bfloat16'."""
    import torch

    if dtype is None:
        return torch.float32
    if isinstance(dtype, str):
        value = getattr(torch, dtype, None)
        if not isinstance(value, torch.dtype):
            raise SinkstudyError(f"unknown dtype {dtype!r}; use float32, bfloat16 or float16")
        return value
    return dtype


def _looks_like_path(name: str) -> bool:
    # Hub ids are "name" or "org/name"; anything else that does not exist is a missing local path.
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or os.sep != "/" and os.sep in name


def load_config(source):
    """AutoConfig for a local dir or hub id; one-line SinkstudyError if it is missing or unreadable."""
    from transformers import AutoConfig

    name = os.fspath(source)
    path = Path(name).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise SinkstudyError(f"{name} has no config.json: not a Hugging Face checkpoint directory")
        name = os.fspath(path)
    elif _looks_like_path(name):
        raise SinkstudyError(f"missing path: {name} does not exist")
    try:
        return AutoConfig.from_pretrained(name)
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
    import json

    from transformers import CONFIG_MAPPING

    from interventions.pairs.archs import NOT_NATIVE, supported_list

    try:
        model_type = json.loads((path / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        return
    if model_type not in CONFIG_MAPPING:
        why = f" ({NOT_NATIVE[model_type]})" if model_type in NOT_NATIVE else ""
        raise SinkstudyError(
            f"unsupported architecture {model_type!r} in {path}{why}; supported VLMs: {supported_list()}; "
            "or any causal LM transformers can load"
        )


_GENERIC_TOKENIZERS = ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_tokenizer(path):
    """The tokenizer saved at `path`, in the class its tokenizer_config.json declares.

    AutoTokenizer forces the model type's own class for some types (qwen2, llava, smolvlm, molmo2...,
    transformers 5.23 MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS): a generic tokenizer saved beside such
    a model would come back with another pre-tokenizer and an extra <|endoftext|> token. A tokenizer saved
    as generic is therefore loaded as generic; everything else goes through AutoTokenizer.
    """
    import json

    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    cfg = Path(os.fspath(path)) / "tokenizer_config.json"
    declared = None
    if cfg.is_file():
        try:
            declared = json.loads(cfg.read_text()).get("tokenizer_class")
        except ValueError:
            pass
    if declared in _GENERIC_TOKENIZERS:
        return PreTrainedTokenizerFast.from_pretrained(os.fspath(path))
    return AutoTokenizer.from_pretrained(os.fspath(path))


def try_load_tokenizer(path):
    """load_tokenizer(path), or None where there is no loadable tokenizer."""
    try:
        return load_tokenizer(path)
    except (OSError, ValueError, TypeError) as exc:
        log.debug("no tokenizer at %s: %s", path, exc)
        return None
