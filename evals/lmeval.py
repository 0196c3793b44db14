"""Strict-grader evaluation through lm-eval, in process, offline-ready, cached per task.

`run_eval` wraps `lm_eval.simple_evaluate` around an in-process `HFLM` (a loaded model is
evaluated as is: merged or intervened weights never need writing to disk) and keeps every
sample's output and per-metric pass values, so two models can be compared prompt by prompt
(`evals.stats`). Results are cached per task under a key made of the model fingerprint (every
file of a checkpoint that changes outputs, or a loaded model's weights + configs: see
`sinkstudy.provenance`), the task (name, version, data file hash), the tokenizer as prompts see it
(vocabulary, pipeline, special tokens, chat template), every setting that changes outputs (the
protocol knobs of `evals.protocol` included: chat-template kwargs, system instruction, generation
kwargs, batch size, dtype, backend and device), the lm-eval version, and the toolkit's own version
(sinkstudy's version plus a hash of the source files that shape eval outputs: this module,
evals/protocol.py, evals/tasks/, evals/nltk_offline.py, the hf-continuous generation loop in evals/generate/).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from sinkstudy import SinkstudyError, __version__
from sinkstudy.checkpoint import is_local_model, local_model_path
from sinkstudy.io import (atomic_output_dir, cache_root, check_output_dir, json_default, output_lock, read_json, read_text,
                          write_json_atomic, write_text_atomic)
from sinkstudy.provenance import code_version, model_fingerprint, package_versions, provenance

from evals.protocol import HF_BACKENDS, EvalProtocol, check_backend, warn_unset_template_variables
from evals.tasks import (SHIPPED_TASKS, TaskSpec, UnknownTaskError, builtin_task_manager, close_matches, empty_task_manager,
                         parse_task_list, resolve_tasks)

log = logging.getLogger(__name__)

# The number each task is reported by (seed paper: IFEval prompt-level strict; GSM8K-CoT and
# GPQA-CoT flexible-extract; EQ-Bench its score; the controls their lm-eval default metric).
HEADLINE_METRICS = {
    "ifeval": "prompt_level_strict_acc,none",
    "sinkstudy_ifeval": "prompt_level_strict_acc,none",
    "sinkstudy_ifeval_large": "prompt_level_strict_acc,none",
    "sinkstudy_ifbench": "prompt_level_strict_acc,none",
    "gsm8k_cot": "exact_match,flexible-extract",
    "sinkstudy_gsm": "exact_match,flexible-extract",
    "bbh_cot_fewshot": "exact_match,get-answer",
    "eq_bench": "eqbench,none",
    "gpqa_diamond_cot_zeroshot": "exact_match,flexible-extract",
    "mmlu": "acc,none",
    "boolq": "acc,none",
    "mbpp": "pass_at_1,none",
    "mmlu_pro": "exact_match,custom-extract",
}
OFFLINE_TASKS = tuple(SHIPPED_TASKS)
RESULTS_FILE = "results.json"
SAMPLES_DIR = "samples"
# Bumped when the cached record layout changes, so old cache entries are not misread.
_RECORD_FORMAT = 2
_EVALS_DIR = Path(__file__).resolve().parent
# The source files that shape eval outputs: part of every cache key (eval_code_version).
EVAL_CODE = (_EVALS_DIR / "lmeval.py", _EVALS_DIR / "protocol.py", _EVALS_DIR / "tasks", _EVALS_DIR / "nltk_offline.py",
             *(_EVALS_DIR / "generate" / f for f in ("packed.py", "loop.py", "hflm.py")))


def eval_code_version() -> str:
    return code_version(*EVAL_CODE)


@dataclass
class EvalRun:
    """One model evaluated on a set of tasks.

    scores:  {task: {"metric,filter": value, "metric_stderr,filter": value or None}}
    samples: {task: [{"doc_id", "doc_hash", "prompt", "output", "target", "extracted": {filter: str},
                      "metrics": {"metric,filter": bool | float | list[bool]}}]}
    """

    scores: dict[str, dict[str, Any]]
    samples: dict[str, list[dict[str, Any]]]
    settings: dict[str, Any]
    fingerprint: str
    model_name: str = ""
    tasks: list[str] = field(default_factory=list)
    versions: dict[str, Any] = field(default_factory=dict)
    cache_keys: dict[str, str] = field(default_factory=dict)
    higher_is_better: dict[str, dict[str, bool]] = field(default_factory=dict)
    groups: dict[str, list[str]] = field(default_factory=dict)  # group -> its subtasks (e.g. BBH)
    provenance: dict[str, Any] = field(default_factory=dict)

    def metrics(self, task: str) -> list[str]:
        """The metric keys of a task ("metric,filter"), stderr keys left out."""
        return [k for k in self.scores.get(task, {}) if "_stderr," not in k]

    def docs(self, task: str) -> dict[Any, dict[str, Any]]:
        """{key: sample} of a task; a group pools its subtasks' samples under "subtask/doc_id" keys."""
        if task in self.samples:
            return {s["doc_id"]: s for s in self.samples[task]}
        if task in self.groups:
            pooled = {}
            for sub in self.groups[task]:
                pooled.update({f"{sub}/{k}": s for k, s in self.docs(sub).items()})
            return pooled
        raise SinkstudyError(f"run has no samples for task {task!r}; it has {', '.join([*self.samples, *self.groups]) or 'none'}")

    def per_doc(self, task: str, metric: str) -> dict[Any, Any]:
        """{doc key: per-sample value} of one metric (doc_id; "subtask/doc_id" for a group)."""
        out = {k: s["metrics"][metric] for k, s in self.docs(task).items() if metric in s["metrics"]}
        if not out:
            raise SinkstudyError(f"task {task!r} has no per-sample metric {metric!r}; it has {', '.join(self.metrics(task))}")
        return out

    def save(self, path: str | os.PathLike, force: bool = False) -> Path:
        """Write results.json (scores, settings, provenance) and samples/<task>.jsonl atomically."""
        with atomic_output_dir(path, force=force) as tmp:
            write_json_atomic(tmp / RESULTS_FILE, self._header())
            for task, rows in self.samples.items():
                text = "".join(json.dumps(r, default=json_default, ensure_ascii=False) + "\n" for r in rows)
                write_text_atomic(tmp / SAMPLES_DIR / f"{task}.jsonl", text)
        return Path(path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "EvalRun":
        path = Path(path)
        header = read_json(path / RESULTS_FILE)
        samples = {}
        for task in header["sample_tasks"]:
            f = path / SAMPLES_DIR / f"{task}.jsonl"
            if not f.is_file():
                raise SinkstudyError(f"eval run {path} is missing {f.relative_to(path)}")
            samples[task] = [json.loads(line) for line in f.read_text(encoding="utf-8").splitlines() if line]
        fields = {k: header.get(k) for k in ("scores", "settings", "fingerprint", "model_name", "tasks", "versions", "cache_keys", "higher_is_better", "groups", "provenance")}
        return cls(samples=samples, **fields)

    def _header(self) -> dict[str, Any]:
        return {
            "model_name": self.model_name,
            "fingerprint": self.fingerprint,
            "tasks": self.tasks,
            "scores": self.scores,
            "versions": self.versions,
            "higher_is_better": self.higher_is_better,
            "groups": self.groups,
            "settings": self.settings,
            "cache_keys": self.cache_keys,
            "sample_tasks": list(self.samples),
            "provenance": self.provenance,
        }

    def summary(self) -> str:
        lines = [f"{self.model_name or self.fingerprint}"]
        for task, metrics in self.scores.items():
            for m in self.metrics(task):
                err = metrics.get(m.replace(",", "_stderr,", 1))
                lines.append(f"  {task:<28} {m:<36} {_fmt(metrics[m])}" + (f" ± {_fmt(err)}" if isinstance(err, float) else ""))
        return "\n".join(lines)


def _fmt(v: Any) -> str:
    return f"{v:.4f}" if isinstance(v, float) else str(v)


def default_cache_dir() -> Path:
    return cache_root() / "evals"


def run_eval(
    model,
    tokenizer=None,
    *,
    protocol: EvalProtocol | None = None,
    out_dir: str | os.PathLike | None = None,
    force: bool = False,
    cache_dir: str | os.PathLike | None = None,
    use_cache: bool = True,
    device: str | None = None,
    dtype: str | None = None,
    loader: Callable[..., Any] | None = None,
    seed: int = 0,
    progress: bool = True,
    **settings,
) -> EvalRun | None:
    """Evaluate `model` (a loaded HF causal LM, or a path / hub id) on lm-eval tasks as `protocol` says
    (`evals.protocol.EvalProtocol`, default its defaults), with keyword `settings` (its fields: `tasks=...`,
    `limit=...`; a mapping given as None: empty) put over it.

    The protocol's knobs go to lm-eval's own mechanisms: `chat_template_kwargs` to the chat template (e.g.
    {"enable_thinking": False} for Qwen3), `system_instruction` as a system message, `gen_kwargs` over each
    task's generation settings, `batch_size` an integer or "auto" / "auto:N". `max_gen_toks=0` keeps each
    task's own generation length; `num_fewshot` overrides every task's shot count; `confirm_run_unsafe_code`
    lets tasks that execute model code (MBPP) run. `data_files` ({task: path} or "task=path" specs) swaps a
    task's data for a local jsonl in the task's own format.

    A path is loaded only when something is left to evaluate, by `loader(path, device=, dtype=)`
    (default: `AutoModelForCausalLM`; callers pass the pair loader, which also reads VLM and
    QK-norm-injected checkpoints), in `dtype` (default float32), on `device`; its tokenizer by
    `sinkstudy.checkpoint.load_tokenizer` (a generic tokenizer keeps its class). A loaded model is
    evaluated where it is.
    `backend="hf-continuous"` is HFLM with sinkstudy's greedy generation loop (`evals.generate`):
    `batch_size` rows decode together, a finished row's slot goes to the next prompt; outputs are
    those of HFLM at batch size 1 up to batch-shape numerics (docs/evals.md).
    With `backend="vllm"` the model must be a path or hub id; `backend_args` go to lm-eval's VLLM
    (tensor_parallel_size, data_parallel_size, gpu_memory_utilization, ...) or HFLM.
    Under `accelerate launch` / torchrun (WORLD_SIZE > 1) the hf backends evaluate data-parallel:
    every process takes a share of the prompts; rank 0 gathers, caches, saves and returns the
    run, the other ranks return None.
    """
    empty_when_none = ("data_files", "chat_template_kwargs", "gen_kwargs", "backend_args")
    settings = {k: v for k, v in settings.items() if v is not None or k not in empty_when_none}
    protocol = (protocol or EvalProtocol()).replace(**settings) if settings else (protocol or EvalProtocol())
    backend, batch_size = protocol.backend, protocol.batch_size
    check_backend(backend)
    specs = resolve_tasks(list(protocol.tasks), dict(protocol.data_files) or None)
    for s in specs:
        if s.data_file:
            read_text(s.data_file, f"data file of task {s.name}")  # a non-UTF-8 file fails now, not inside lm-eval
    out_dir = Path(out_dir) if out_dir is not None else None
    if out_dir is not None and out_dir.exists() and not force and not (out_dir / RESULTS_FILE).is_file():
        check_output_dir(out_dir)  # raises: exists and is not an eval run

    is_path = isinstance(model, (str, os.PathLike))
    model_name = os.fspath(model) if is_path else getattr(getattr(model, "config", None), "_name_or_path", "") or type(model).__name__
    if backend == "vllm" and not is_path:
        raise SinkstudyError("the vllm backend loads weights itself: pass a checkpoint path or hub id, not a loaded model")
    if is_path and not is_local_model(model) and os.environ.get("HF_HUB_OFFLINE") == "1":
        raise SinkstudyError(f"model {model_name} is not a local path and the hub is offline (HF_HUB_OFFLINE=1)")
    if is_path and tokenizer is None:
        tokenizer = _load_tokenizer(model)
    if tokenizer is None:
        raise SinkstudyError(f"model {model_name!r} has no tokenizer: pass tokenizer= (the LLM's, or a processor's .tokenizer)")
    if isinstance(tokenizer, (str, os.PathLike)):
        tokenizer = _load_tokenizer(tokenizer)
    if _is_processor(tokenizer):
        tokenizer = tokenizer.tokenizer  # HFLM needs the text tokenizer, not the processor
    if protocol.apply_chat_template and not getattr(tokenizer, "chat_template", None):
        raise SinkstudyError(f"tokenizer of {model_name!r} has no chat template; pass apply_chat_template=False (--no-chat-template)")
    if protocol.apply_chat_template:
        warn_unset_template_variables(tokenizer, protocol.chat_template_kwargs, model_name)

    fingerprint = model_fingerprint(model)
    distributed = _data_parallel(backend)  # this process's device under accelerate launch / torchrun
    settings = {
        "limit": protocol.limit,
        "batch_size": batch_size,
        "apply_chat_template": protocol.apply_chat_template,
        "max_gen_toks": protocol.max_gen_toks,
        "num_fewshot": protocol.num_fewshot,
        "chat_template_kwargs": dict(protocol.chat_template_kwargs),
        "system_instruction": protocol.system_instruction,
        "gen_kwargs": dict(protocol.gen_kwargs),
        # A loaded model's dtype is in its fingerprint; vLLM's "auto" is the checkpoint's own.
        "dtype": (dtype or ("auto" if backend == "vllm" else "float32")) if is_path else None,
        "backend": backend,
        "backend_args": dict(protocol.backend_args),
        "device": "cuda" if backend == "vllm" else _device_type(model, distributed.device if distributed else device),
        "seed": seed,
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "lm_eval": package_versions().get("lm_eval"),
        "sinkstudy": __version__,
        "code": eval_code_version(),
    }
    keys = {s.name: cache_key(fingerprint, s, settings) for s in specs}
    # Held from the reuse check to the save: a second eval into the same --out fails at once. A
    # data-parallel worker takes no lock (rank 0 holds it for the run) and makes the same reuse
    # decisions as rank 0, so both enter lm-eval's collectives together, but only reads: rank 0
    # gathers, caches and saves.
    worker = distributed is not None and not distributed.is_main_process
    with output_lock(out_dir) if out_dir is not None and not worker else contextlib.nullcontext():
        if out_dir is not None and (out_dir / RESULTS_FILE).is_file() and not force:
            previous = EvalRun.load(out_dir)
            if previous.cache_keys == keys:
                log.info("reusing finished eval run %s", out_dir)
                return None if worker else previous
            raise SinkstudyError(f"output {out_dir} holds a different eval run; pass --force to replace it")

        cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        records = {s.name: _read_cache(cache_dir, keys[s.name]) if use_cache else None for s in specs}
        todo = [s for s in specs if records[s.name] is None]
        if todo:
            log.info("evaluating %s on %s", model_name, ", ".join(s.name for s in todo))
            if is_path and backend in HF_BACKENDS:  # loaded only now: a fully cached rerun never loads weights
                model = _load_model(loader or _auto_causal_lm, model, distributed.device if distributed else device, dtype)
            with _progress_bars(progress):
                fresh = _evaluate(model, tokenizer, todo, settings, distributed, protocol.confirm_run_unsafe_code)
            if fresh is None:  # a data-parallel worker: rank 0 holds the gathered results
                return None
            for s in todo:
                records[s.name] = fresh[s.name]
                if use_cache:
                    write_json_atomic(cache_dir / f"{keys[s.name]}.json", {"key": keys[s.name], "identity": s.identity(), **fresh[s.name]})
        if worker:
            return None

        run = EvalRun(
            scores={}, samples={}, settings=settings, fingerprint=fingerprint, model_name=model_name,
            tasks=[s.name for s in specs], cache_keys=keys,
            provenance=provenance(model_fingerprints={model_name: fingerprint}, seeds={"seed": seed},
                                  tasks={s.name: s.identity() for s in specs},
                                  data_files={s.name: s.data_file for s in specs}),  # where each task's prompts came from
        )
        for s in specs:
            rec = records[s.name]
            run.scores.update(rec["scores"])
            run.samples.update(rec["samples"])
            run.versions.update(rec["versions"])
            run.higher_is_better.update(rec["higher_is_better"])
            run.groups.update(rec["groups"])
        if out_dir is not None:
            run.save(out_dir, force=force)
        return run


def _device_type(model, device: str | None) -> str:
    """Where the model runs: `device` for a path, the parameters' device for a loaded model."""
    if isinstance(model, (str, os.PathLike)):
        return str(device or "cpu").split(":")[0]
    param = next(iter(model.parameters()), None) if hasattr(model, "parameters") else None
    return param.device.type if param is not None else "cpu"


def check_task_names(tasks: str | Iterable[str]) -> list[str]:
    """Fail in one line on an unknown task name before any work. Shipped tasks need nothing else;
    other names are looked up in lm-eval's task index (built once per lm-eval version, ~13 s,
    then cached under the sinkstudy cache). Returns the parsed names."""
    names = parse_task_list(tasks)
    other = [n for n in names if n not in SHIPPED_TASKS]
    if other:
        kinds = lm_eval_task_kinds()
        for name in other:
            if name not in kinds:
                raise UnknownTaskError(f"unknown task {name!r}{close_matches(name, [*SHIPPED_TASKS, *kinds])}")
            if kinds[name] == "tag":
                raise SinkstudyError(f"{name!r} is an lm-eval tag, not a task or group; name its tasks instead")
    return names


def lm_eval_task_kinds() -> dict[str, str]:
    """{task, group or tag name: kind} of lm-eval's built-in index, cached per lm-eval version."""
    import lm_eval

    version = package_versions().get("lm_eval")
    f = cache_root() / f"lm_eval_tasks-{version}-{hashlib.sha256(lm_eval.__file__.encode()).hexdigest()[:8]}.json"
    try:
        cached = json.loads(f.read_text(encoding="utf-8"))
        if isinstance(cached, dict) and cached:
            return cached
    except (OSError, ValueError):
        pass  # absent or damaged: rebuilt
    kinds = {name: entry.kind.name.lower() for name, entry in builtin_task_manager().task_index.items()}
    with contextlib.suppress(OSError):
        write_json_atomic(f, kinds)
    return kinds


def cache_key(fingerprint: str, spec: TaskSpec, settings: Mapping[str, Any]) -> str:
    """Model fingerprint + task identity + every output-changing setting (tokenizer, code version...)."""
    blob = json.dumps({"format": _RECORD_FORMAT, "model": fingerprint, **spec.identity(), "settings": settings}, sort_keys=True, default=str)
    return f"{spec.name}-{hashlib.sha256(blob.encode()).hexdigest()[:24]}"


def tokenizer_fingerprint(tokenizer) -> str:
    """What changes the prompts a model sees: vocabulary, the fast tokenizer's whole pipeline
    (normalizer, pre-tokenizer, merges, post-processor with its BOS/EOS rules, added tokens),
    special tokens, BOS/EOS flags, chat template and padding side."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    parts = {
        "vocab": sorted(tokenizer.get_vocab().items()),
        "pipeline": backend.to_str() if hasattr(backend, "to_str") else None,
        "special": {k: str(v) for k, v in sorted(getattr(tokenizer, "special_tokens_map", {}).items())},
        "flags": {k: getattr(tokenizer, k, None) for k in ("add_bos_token", "add_eos_token", "clean_up_tokenization_spaces")},
        "chat_template": getattr(tokenizer, "chat_template", None),
        "padding_side": getattr(tokenizer, "padding_side", None),
    }
    return "tok-sha256:" + hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:24]


def _read_cache(cache_dir: Path, key: str) -> dict[str, Any] | None:
    path = cache_dir / f"{key}.json"
    if not path.is_file():
        return None
    try:
        rec = read_json(path)
    except (ValueError, OSError):
        return None  # a damaged entry is simply recomputed
    if rec.get("key") != key:
        return None
    log.info("reusing cached eval %s", path)
    return rec


def _is_processor(obj) -> bool:
    from transformers import ProcessorMixin

    return isinstance(obj, ProcessorMixin)


def _load_tokenizer(path):
    from sinkstudy.checkpoint import load_tokenizer

    try:
        return load_tokenizer(os.fspath(path))
    except (OSError, ValueError) as exc:
        raise SinkstudyError(f"no tokenizer could be loaded from {path}: {str(exc).splitlines()[0]}") from exc


def _auto_causal_lm(path: str, *, device: str | None = None, dtype: str | None = None):
    import torch
    from transformers import AutoModelForCausalLM

    from sinkstudy.checkpoint import local_model_path

    torch_dtype = "auto" if dtype == "auto" else getattr(torch, dtype or "float32")
    return AutoModelForCausalLM.from_pretrained(local_model_path(path), dtype=torch_dtype).to(device or "cpu")


def _load_model(loader, path, device=None, dtype=None):
    """`loader(path, device=, dtype=)` -> a causal LM in eval mode; its errors become one line."""
    try:
        model = loader(os.fspath(path), device=str(device) if device is not None else None, dtype=dtype)
    except (OSError, ValueError) as exc:
        raise SinkstudyError(f"cannot load a causal LM from {path}: {str(exc).splitlines()[0]}") from exc
    return model.eval()


def _data_parallel(backend: str):
    """The accelerate state when this process is one of several (accelerate launch / torchrun) on an hf backend."""
    if backend not in HF_BACKENDS or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None
    import torch
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=not torch.cuda.is_available())  # CPU processes (torchrun) join over gloo
    return accelerator if accelerator.num_processes > 1 else None


def guard_tied_weights(model) -> bool:
    """Stop HFLM's `model.tie_weights()` from overwriting an lm_head that differs from the embeddings.

    When the config says the two are tied but the tensors differ (an lm_head-only intervention,
    a merge that treated them separately), set the flag to match the weights. Returns True when
    the flag was changed.
    """
    import torch

    out, inp = model.get_output_embeddings(), model.get_input_embeddings()
    if out is None or inp is None:
        return False
    configs = {id(c): c for c in (model.config, model.config.get_text_config())}.values()
    if not any(getattr(c, "tie_word_embeddings", False) for c in configs):
        return False
    if out.weight is inp.weight or (out.weight.shape == inp.weight.shape and torch.equal(out.weight, inp.weight)):
        return False
    for c in configs:
        c.tie_word_embeddings = False
    log.warning("lm_head differs from the input embeddings although the config ties them: untied the config flag so evaluation keeps this lm_head")
    return True


@contextlib.contextmanager
def _progress_bars(enabled: bool):
    """progress=False quiets lm-eval's info logging (a level already higher, `--quiet`'s, stays); its request bars
    are its own (tqdm reads TQDM_DISABLE only at import), so they still show."""
    logger = logging.getLogger("lm_eval")
    old = logger.level
    if not enabled:
        logger.setLevel(max(logger.getEffectiveLevel(), logging.WARNING))
    try:
        yield
    finally:
        logger.setLevel(old)


def _evaluate(model, tokenizer, specs: list[TaskSpec], settings: dict[str, Any], distributed=None,
              confirm_run_unsafe_code: bool = False) -> dict[str, dict[str, Any]] | None:
    """Run lm-eval once for `specs`; return one cache record per spec (None on a data-parallel worker)."""
    from evals.nltk_offline import ensure_punkt_tab, seed_langdetect

    # Before lm-eval imports the IFEval graders (they try a download at import when punkt_tab is missing).
    ensure_punkt_tab()
    seed_langdetect(settings["seed"])
    if confirm_run_unsafe_code:  # the one consent: HF `evaluate`'s code_eval (MBPP) asks for it again
        os.environ.setdefault("HF_ALLOW_CODE_EVAL", "1")
    import lm_eval

    lm = _build_lm(model, tokenizer, settings, distributed)
    task_manager = builtin_task_manager() if any(isinstance(s.spec, str) for s in specs) else empty_task_manager()
    gen_kwargs = {**settings["gen_kwargs"], **({"max_gen_toks": settings["max_gen_toks"]} if settings["max_gen_toks"] else {})}
    seed = settings["seed"]
    try:
        with _lean_env_info():
            res = lm_eval.simple_evaluate(
                model=lm,
                tasks=[s.spec for s in specs],
                task_manager=task_manager,
                limit=settings["limit"],
                num_fewshot=settings["num_fewshot"],
                log_samples=True,
                apply_chat_template=settings["apply_chat_template"],
                system_instruction=settings["system_instruction"],
                gen_kwargs=gen_kwargs or None,
                confirm_run_unsafe_code=confirm_run_unsafe_code,
                random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed, fewshot_random_seed=seed,
                verbosity=None,
            )
    except (ConnectionError, OSError) as exc:
        names = ", ".join(s.name for s in specs if isinstance(s.spec, str))
        raise SinkstudyError(
            f"lm-eval could not load data for {names or 'the tasks'} ({type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}); offline, pass a local "
            f"file with --data TASK=FILE or use the shipped tasks {', '.join(OFFLINE_TASKS)}"
        ) from exc
    if res is None:
        return None
    return {s.name: _record(res, s) for s in specs}


@contextlib.contextmanager
def _lean_env_info():
    """lm-eval's `add_env_info` runs `pip list` and torch's collect_env on every `simple_evaluate` (about 0.9 s,
    more than a small eval); no record keeps that block (each carries sinkstudy's own provenance), so within our
    call it stores lm-eval's cheap fields only. Its `git_hash` is the working directory's commit, not the code's
    (sinkstudy's provenance has that), and outside a git repository git prints "fatal: not a git repository" on
    every eval: not collected either."""
    import lm_eval.evaluator as evaluator

    def lean(storage: dict) -> None:
        from sinkstudy.provenance import package_versions

        versions = package_versions()
        storage.update({"pretty_env_info": "not collected (sinkstudy records its own provenance)",
                        "transformers_version": versions["transformers"], "lm_eval_version": versions["lm_eval"]})

    seams = {"add_env_info": lean, "get_git_commit_hash": lambda: None}
    saved = {name: getattr(evaluator, name) for name in seams if hasattr(evaluator, name)}  # another lm-eval: what it has
    for name in saved:
        setattr(evaluator, name, seams[name])
    try:
        yield
    finally:
        for name, original in saved.items():
            setattr(evaluator, name, original)


def _build_lm(model, tokenizer, settings, distributed=None):
    if settings["backend"] == "vllm":
        from lm_eval.models.vllm_causallms import VLLM

        model = local_model_path(model)  # a .gguf file or a registered real LLM's name: its converted checkpoint
        args = {"pretrained": model, "tokenizer": getattr(tokenizer, "name_or_path", None) or model,
                "batch_size": settings["batch_size"], "seed": settings["seed"], "dtype": settings["dtype"],
                "chat_template_args": dict(settings["chat_template_kwargs"]), **settings["backend_args"]}
        return VLLM(**args)
    from lm_eval.models.huggingface import HFLM

    from evals.generate.hflm import ContinuousHFLM

    guard_tied_weights(model)
    lm_class = ContinuousHFLM if settings["backend"] == "hf-continuous" else HFLM
    lm = lm_class(pretrained=model, tokenizer=tokenizer, batch_size=settings["batch_size"],
              chat_template_args=dict(settings["chat_template_kwargs"]), **settings["backend_args"])
    if distributed is not None:
        # HFLM sets up data parallelism only for models it loads itself; these are the attributes
        # its own accelerate path sets, so lm-eval shards the requests and gathers on rank 0.
        lm.accelerator, lm._device = distributed, distributed.device
        lm._rank, lm._world_size = distributed.process_index, distributed.num_processes
    return lm


def _record(res: dict[str, Any], spec: TaskSpec) -> dict[str, Any]:
    """Scores, versions and per-doc samples of one requested task (a group brings its subtasks)."""
    names = [spec.name, *_subtasks(res.get("group_subtasks", {}), spec.name)]
    results = {**res["results"], **res.get("groups", {})}
    scores, samples = {}, {}
    for name in names:
        if name in results:
            scores[name] = {k: (None if v == "N/A" else v) for k, v in results[name].items() if "," in k}
        if name in res.get("samples", {}):
            samples[name] = _merge_samples(res["samples"][name])
    return {
        "task": spec.name,
        "scores": json.loads(json.dumps(scores, default=json_default)),
        "samples": json.loads(json.dumps(samples, default=json_default)),
        "versions": {n: res["versions"].get(n) for n in names if n in res["versions"]},
        "higher_is_better": {n: res["higher_is_better"][n] for n in names if n in res.get("higher_is_better", {})},
        "n_samples": {n: res["n-samples"][n] for n in names if n in res.get("n-samples", {})},
        "groups": {n: list(res["group_subtasks"][n]) for n in names if res.get("group_subtasks", {}).get(n)},
    }


def _subtasks(group_subtasks: Mapping[str, list[str]], name: str) -> list[str]:
    out = []
    for child in group_subtasks.get(name, []):
        out += [child, *_subtasks(group_subtasks, child)]
    return out


def _merge_samples(raw: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """lm-eval logs one entry per (doc, filter); fold them into one record per doc."""
    by_doc: dict[int, dict[str, Any]] = {}
    for s in raw:
        rec = by_doc.setdefault(s["doc_id"], {
            "doc_id": s["doc_id"],
            "doc_hash": s["doc_hash"],
            "prompt": _prompt_text(s["arguments"]),
            "output": s["resps"][0][0] if s["resps"] and s["resps"][0] else "",
            "target": s["target"],
            "extracted": {},
            "metrics": {},
        })
        flt = s["filter"]
        fr = s["filtered_resps"][0] if s["filtered_resps"] else None
        rec["extracted"][flt] = fr[0] if isinstance(fr, list) and len(fr) == 1 else fr
        for m in s["metrics"]:
            rec["metrics"][f"{m},{flt}"] = s[m]
    return [by_doc[k] for k in sorted(by_doc)]


def _prompt_text(arguments) -> str:
    first = arguments[0]
    if isinstance(first, dict):  # some lm-eval versions log {"gen_args_0": {"arg_0": ..., "arg_1": ...}}
        first = next(iter(first.values()))
        return first.get("arg_0", "") if isinstance(first, dict) else str(first)
    return first[0] if isinstance(first, (list, tuple)) else str(first)
