"""The evaluation protocol: `EvalProtocol`, one record of how a model is evaluated, built from the
command line, a study's `evals:` section or its defaults in one place (`EvalProtocol.build`), each
default written once (its fields'), each value checked once; `evals.lmeval.run_eval` runs it.

lm-eval renders every prompt and runs every generation; sinkstudy only turns CLI strings and
study-config values into the arguments lm-eval takes:

    chat_template_kwargs  -> HFLM / VLLM `chat_template_args`: keyword arguments of the tokenizer's
                             chat template, e.g. {"enable_thinking": false} for Qwen3 (templates
                             that do not read a variable ignore it)
    system_instruction    -> simple_evaluate(system_instruction=...): a system message (or, without
                             a chat template, a prefix) before every prompt
    gen_kwargs            -> simple_evaluate(gen_kwargs=...): merged over each task's generation_kwargs
                             (max_gen_toks has its own setting)
    max_gen_toks          -> the generation cap per prompt; 0 keeps each task's own length
    batch_size            -> an integer, or lm-eval's adaptive "auto" / "auto:N" (hf, vllm)
    backend_args          -> the HFLM / VLLM constructor (e.g. tensor_parallel_size, data_parallel_size,
                             gpu_memory_utilization, max_model_len, max_batch_size)

CLI strings are a JSON object or KEY=VALUE pairs split the way lm-eval's own CLI splits
`--model_args` (commas inside quotes, brackets and braces stay: `stop="a,b",sizes=[1,2]`).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

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
    if not isinstance(text, str):
        return check_mapping(text, what)
    text = text.strip()
    if not text:
        return {}
    # lazy: loads lm_eval
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


# --------------------------------------------------------------------------- the protocol

# The shipped offline task sets (evals.tasks.SHIPPED_TASKS): a run that names no tasks never needs the hub.
DEFAULT_TASKS = ("sinkstudy_ifeval", "sinkstudy_gsm")
# The paired bootstrap of every statistic on the evals (evals.stats): replicates and confidence, on the command
# line and in a study alike.
DEFAULT_N_BOOT = 10_000
DEFAULT_CONFIDENCE = 0.95


@dataclass(frozen=True)
class EvalProtocol:
    """How models are evaluated; every field changes the outputs. Build it with `EvalProtocol.build`."""

    tasks: tuple[str, ...] = DEFAULT_TASKS
    data_files: Mapping[str, str] = field(default_factory=dict)  # {task: local jsonl} in place of its default data
    limit: int | float | None = None  # the first N prompts of each task (a fraction < 1: that share)
    batch_size: int | str = 8
    max_gen_toks: int = 256  # generation cap per prompt; 0 keeps each task's own length
    apply_chat_template: bool = True
    num_fewshot: int | None = None  # None: each task's own
    chat_template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    system_instruction: str | None = None
    gen_kwargs: Mapping[str, Any] = field(default_factory=dict)
    confirm_run_unsafe_code: bool = False
    backend: str = "hf"
    backend_args: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def build(cls, values: Mapping[str, Any] | None = None, *, name: Callable[[str], str] = lambda f: f) -> "EvalProtocol":
        """The defaults, with `values` checked and put over them; one line on bad input, naming the setting as
        `name(field)` does (a flag, a YAML key)."""
        known = {f.name for f in dataclasses.fields(cls)}
        given = dict(values or {})
        unknown = sorted(set(given) - known)
        if unknown:
            raise SinkstudyError(f"unknown eval setting(s) {', '.join(map(name, unknown))}; known: {', '.join(map(name, sorted(known)))}")
        checked = {key: _CHECKS[key](value, name(key)) for key, value in given.items()}
        protocol = cls(**checked)
        extra = sorted(set(protocol.data_files) - set(protocol.tasks))
        if extra:
            raise SinkstudyError(f"{name('data_files')} names task(s) not evaluated: {', '.join(extra)}")
        try:
            check_backend_batch_size(protocol.backend, protocol.batch_size)
        except SinkstudyError as exc:
            raise SinkstudyError(f"{name('batch_size')}: {exc}") from None
        return protocol

    def replace(self, **values) -> "EvalProtocol":
        """This protocol with `values` checked and put over it."""
        return self.build({**self.as_dict(), **values})

    def as_dict(self) -> dict[str, Any]:
        """JSON data (tasks a list, mappings plain dicts): what results and summaries record."""
        return json.loads(json.dumps(dataclasses.asdict(self), default=list))


# Settings other than the model, tasks and prompts that change outputs: two runs compared with
# different ones mix model and setting effects (`evals.stats.compare_runs` warns).
COMPARABLE_SETTINGS = tuple(f.name for f in dataclasses.fields(EvalProtocol) if f.name not in ("tasks", "data_files")) + ("seed",)


def _tasks(value, what: str) -> tuple[str, ...]:
    names = [t.strip() for t in value.split(",")] if isinstance(value, str) else value
    if not isinstance(names, (list, tuple)) or not all(isinstance(t, str) for t in names) or not [t for t in names if t]:
        raise SinkstudyError(f"{what}: must be a non-empty list of lm-eval task names, got {value!r}")
    return tuple(t for t in names if t)


def _data_files(value, what: str) -> dict[str, str]:
    """{task: file}, or TASK=FILE items (a string, or a list of them)."""
    if isinstance(value, str):
        value = [value]
    if isinstance(value, (list, tuple)):
        out = {}
        for item in value:
            task, sep, path = str(item).partition("=")
            if not sep or not task or not path:
                raise SinkstudyError(f"{what}: {item!r} is not TASK=FILE")
            out[task] = path
        return out
    if not isinstance(value, Mapping) or not all(isinstance(k, str) and isinstance(v, str) and v for k, v in value.items()):
        raise SinkstudyError(f"{what}: must be a mapping {{task: jsonl path}}, got {value!r}")
    return dict(value)


def check_limit(limit, what: str = "limit") -> int | float | None:
    """`limit`: None, a positive finite count, or a fraction in (0, 1)."""
    if limit is None:
        return None
    if isinstance(limit, bool) or not isinstance(limit, (int, float)) or not math.isfinite(limit) or limit <= 0:
        raise SinkstudyError(f"{what} must be a positive number of prompts (or a fraction below 1), got {limit!r}")
    if isinstance(limit, float) and limit >= 1 and not limit.is_integer():
        raise SinkstudyError(f"{what} above 1 must be a whole number of prompts, got {limit!r}")
    return limit


def _count(low: int, note: str = "", nullable: bool = False):
    def check(value, what: str):
        if nullable and value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise SinkstudyError(f"{what}: must be an integer >= {low}{note}, got {value!r}")
        return value
    return check


def _flag(value, what: str) -> bool:
    if not isinstance(value, bool):
        raise SinkstudyError(f"{what}: must be true or false, got {value!r}")
    return value


def _backend(value, what: str) -> str:
    if value not in BACKENDS:  # installed or not is checked when a run starts (check_backend), not by a plan
        raise SinkstudyError(f"{what}: must be one of {', '.join(BACKENDS)}, got {value!r}")
    return value


def _prefixed(check: Callable[[Any], Any]) -> Callable[[Any, str], Any]:
    """A check whose message does not name the setting, named."""
    def named(value, what: str):
        try:
            return check(value)
        except SinkstudyError as exc:
            raise SinkstudyError(f"{what}: {exc}") from None
    return named


_CHECKS: dict[str, Callable[[Any, str], Any]] = {
    "tasks": _tasks,
    "data_files": _data_files,
    "limit": check_limit,
    "batch_size": _prefixed(check_batch_size),
    "max_gen_toks": _count(0, " (0: each task's own length)"),
    "apply_chat_template": _flag,
    "num_fewshot": _count(0, nullable=True),
    "chat_template_kwargs": lambda v, what: parse_kwargs(v, what),
    "system_instruction": _prefixed(check_system_instruction),
    "gen_kwargs": lambda v, what: _prefixed(check_gen_kwargs)(parse_kwargs(v, what), what),
    "confirm_run_unsafe_code": _flag,
    "backend": _backend,
    "backend_args": lambda v, what: _prefixed(check_backend_args)(parse_kwargs(v, what), what),
}
