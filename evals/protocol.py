"""The evaluation protocol's knobs, parsed and checked once, handed to lm-eval's own mechanisms.

lm-eval renders every prompt and runs every generation; sinkstudy only turns CLI strings and
study-config values into the arguments lm-eval takes:

    chat_template_kwargs  -> HFLM / VLLM `chat_template_args`: keyword arguments of the tokenizer's
                             chat template, e.g. {"enable_thinking": false} for Qwen3 (templates
                             that do not read a variable ignore it)
    system_instruction    -> simple_evaluate(system_instruction=...): a system message (or, without
                             a chat template, a prefix) before every prompt
    gen_kwargs            -> simple_evaluate(gen_kwargs=...): merged over each task's generation_kwargs
                             (max_gen_toks has its own setting)
    batch_size            -> an integer, or lm-eval's adaptive "auto" / "auto:N" (hf, vllm)
    backend_args          -> the HFLM / VLLM constructor (e.g. tensor_parallel_size, data_parallel_size,
                             gpu_memory_utilization, max_model_len, max_batch_size)

CLI strings are a JSON object or KEY=VALUE pairs split the way lm-eval's own CLI splits
`--model_args` (commas inside quotes, brackets and braces stay: `stop="a,b",sizes=[1,2]`).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import re
from typing import Any, Mapping

from sinkstudy import SinkstudyError

log = logging.getLogger(__name__)

BACKENDS = ("hf", "hf-continuous", "vllm")
# The backends that run lm-eval's HFLM on a model loaded in this process (hf-continuous: HFLM with
# sinkstudy's continuous-batching greedy loop, evals.generate).
HF_BACKENDS = ("hf", "hf-continuous")
# Constructor arguments sinkstudy sets itself: each has its own setting (CLI flag / study evals key).
_RESERVED_BACKEND_ARGS = {
    "pretrained": "the model argument", "tokenizer": "--tokenizer", "batch_size": "--batch-size (evals.batch_size)",
    "chat_template_args": "--chat-template-kwargs (evals.chat_template_kwargs)",
    "enable_thinking": "--chat-template-kwargs '{\"enable_thinking\": false}' (evals.chat_template_kwargs)",
    "dtype": "--dtype (model.dtype)", "seed": "--seed (seed)", "device": "--device (model.device)",
}
_RESERVED_GEN_KWARGS = {"max_gen_toks": "--max-gen-toks (evals.max_gen_toks)"}
_AUTO_BATCH = re.compile(r"^auto(:[0-9]*\.?[0-9]+)?$")


def parse_kwargs(text: str | Mapping[str, Any] | None, what: str) -> dict[str, Any]:
    """A JSON object, or KEY=VALUE[,KEY=VALUE...] split and typed by lm-eval's CLI parser."""
    if text is None:
        return {}
    if isinstance(text, Mapping):
        return check_mapping(text, what)
    text = text.strip()
    if not text:
        return {}
    from lm_eval._cli.utils import handle_cli_value_string, split_top_level

    if text.startswith("{"):
        try:
            value = json.loads(text)
        except ValueError as exc:
            raise SinkstudyError(f"{what}: not a valid JSON object ({exc}); use double quotes for JSON strings") from None
        return check_mapping(value, what)
    out = {}
    for item in split_top_level(text):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise SinkstudyError(f"{what}: {item!r} is not KEY=VALUE (quote values that contain commas: key=\"a,b\")")
        out[key.strip()] = handle_cli_value_string(value.strip())
    return out


def check_mapping(value: Any, what: str) -> dict[str, Any]:
    """A mapping with string keys whose values survive JSON (they go into cache keys and results)."""
    if not isinstance(value, Mapping):
        raise SinkstudyError(f"{what} must be a mapping of names to values, got {type(value).__name__}")
    bad = [k for k in value if not isinstance(k, str) or not k]
    if bad:
        raise SinkstudyError(f"{what}: keys must be non-empty names, got {bad[0]!r}")
    try:
        json.dumps(dict(value), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise SinkstudyError(f"{what}: values must be JSON data (strings, numbers, booleans, lists, mappings): {exc}") from None
    return dict(value)


def check_batch_size(value: Any) -> int | str:
    """An integer >= 1, or lm-eval's adaptive "auto" / "auto:N" (N: how often to re-detect)."""
    if isinstance(value, str):
        text = value.strip()
        if _AUTO_BATCH.match(text):
            return text
        if text.isdigit():
            value = int(text)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SinkstudyError(f"batch size must be an integer >= 1, 'auto' or 'auto:N', got {value!r}")
    return value


def check_backend(backend: str) -> None:
    """A known backend whose package is installed (vLLM is optional), before any work."""
    if backend not in BACKENDS:
        raise SinkstudyError(f"unknown backend {backend!r}; choose from {', '.join(BACKENDS)}")
    if backend == "vllm" and importlib.util.find_spec("vllm") is None:
        raise SinkstudyError("the vllm backend needs the vllm package, which is not installed here "
                             "(pip install vllm on a CUDA machine), or use --backend hf")


def check_backend_batch_size(backend: str, batch_size: int | str) -> None:
    """hf-continuous keeps `batch_size` rows decoding: it takes a number, not lm-eval's "auto"."""
    if backend == "hf-continuous" and not isinstance(batch_size, int):
        raise SinkstudyError(f"the hf-continuous backend needs an integer batch size, got {batch_size!r}")


def check_backend_args(args: Mapping[str, Any] | None) -> dict[str, Any]:
    args = check_mapping(args or {}, "backend args")
    for key, use in _RESERVED_BACKEND_ARGS.items():
        if key in args:
            raise SinkstudyError(f"backend args: {key!r} is set by sinkstudy; use {use}")
    return args


def check_gen_kwargs(kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    kwargs = check_mapping(kwargs or {}, "generation kwargs")
    for key, use in _RESERVED_GEN_KWARGS.items():
        if key in kwargs:
            raise SinkstudyError(f"generation kwargs: set {key} with {use}")
    return kwargs


def check_system_instruction(text: Any) -> str | None:
    if text is None:
        return None
    if not isinstance(text, str) or not text.strip():
        raise SinkstudyError(f"system instruction must be non-empty text, got {text!r}")
    return text


def warn_unset_template_variables(tokenizer, chat_template_kwargs: Mapping[str, Any], model_name: str) -> None:
    """A chat template that branches on `enable_thinking` renders its own default when none is given
    (Qwen3: thinking on, and the strict graders then read the reasoning block)."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):
        template = " ".join(template.values())
    if "enable_thinking" in template and "enable_thinking" not in chat_template_kwargs:
        log.warning("the chat template of %s reads enable_thinking and none was given, so it renders its own default; "
                    "the paper's protocol passes --chat-template-kwargs '{\"enable_thinking\": false}'", model_name)
