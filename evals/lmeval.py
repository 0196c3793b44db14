"""Strict-grader evaluation through lm-eval, in process, offline-ready: `run_eval`.

`run_eval` wraps `lm_eval.simple_evaluate` around an in-process model (`evals.lm_backends`: a loaded model is
evaluated as is, so merged or intervened weights never need writing to disk) and keeps every sample's output and
per-metric pass values (`evals.lm_results`, `evals.eval_run.EvalRun`), so two models can be compared prompt by
prompt (`evals.stats`). Its record names every setting that changes outputs (the protocol knobs of
`evals.protocol`, the tokenizer as prompts see it, dtype, backend and device, lm-eval's version and the code
`EVAL_CODE`). A finished run is reused, or refused as another request's, by the engine that runs it as a step
(`experiments.study.pair_steps.MeasureEval`), never here.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
from typing import Any, Callable

from evals.eval_run import EvalRun
from evals.lm_backends import auto_causal_lm, build_lm, data_parallel, lean_env_info, load_model
from evals.lm_results import task_record
from evals.nltk_offline import ensure_punkt_tab, seed_langdetect
from evals.protocol import HF_BACKENDS, EvalProtocol, check_backend, warn_unset_template_variables
from evals.tasks import SHIPPED_TASKS, TaskSpec, builtin_task_manager, empty_task_manager, resolve_tasks
from sinkstudy import SinkstudyError, __version__
from sinkstudy.checkpoint import is_local_model, load_tokenizer
from sinkstudy.io import read_text
from sinkstudy.provenance import model_fingerprint, module_code_version, package_versions, provenance

log = logging.getLogger(__name__)

OFFLINE_TASKS = tuple(SHIPPED_TASKS)
# The modules whose source shapes an eval's outputs: the key of every eval step, and recorded in each run's settings.
EVAL_CODE = ("evals.lmeval", "evals.lm_backends", "evals.lm_results", "evals.eval_run", "evals.protocol", "evals.tasks",
             "evals.tasks.utils", "evals.nltk_offline", "evals.ifbench", "evals.generate.packed", "evals.generate.loop",
             "evals.generate.hflm")


def run_eval(
    model,
    tokenizer=None,
    *,
    protocol: EvalProtocol | None = None,
    out_dir: str | os.PathLike | None = None,
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

    A path is loaded by `loader(path, device=, dtype=)`
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
    every process takes a share of the prompts; rank 0 gathers, saves and returns the run, the
    other ranks return None. With `out_dir` the run is written there (`EvalRun.save`). Nothing is
    reused here: whether a run is made again is the caller's to decide (`sinkstudy eval` and a study
    run it as a step of `experiments.study.engine`).
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
    distributed = data_parallel(backend)  # this process's device under accelerate launch / torchrun
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
        "code": module_code_version(*EVAL_CODE),
    }
    worker = distributed is not None and not distributed.is_main_process
    log.info("evaluating %s on %s", model_name, ", ".join(s.name for s in specs))
    if is_path and backend in HF_BACKENDS:
        model = load_model(loader or auto_causal_lm, model, distributed.device if distributed else device, dtype)
    with _progress_bars(progress):
        records = evaluate(model, tokenizer, specs, settings, distributed, protocol.confirm_run_unsafe_code)
    if records is None or worker:  # a data-parallel worker: rank 0 holds the gathered results
        return None
    run = EvalRun(
        scores={}, samples={}, settings=settings, fingerprint=fingerprint, model_name=model_name, tasks=[s.name for s in specs],
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
        run.save(out_dir)
    return run


def _device_type(model, device: str | None) -> str:
    """Where the model runs: `device` for a path, the parameters' device for a loaded model."""
    if isinstance(model, (str, os.PathLike)):
        return str(device or "cpu").split(":")[0]
    param = next(iter(model.parameters()), None) if hasattr(model, "parameters") else None
    return param.device.type if param is not None else "cpu"


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


def evaluate(model, tokenizer, specs: list[TaskSpec], settings: dict[str, Any], distributed=None,
              confirm_run_unsafe_code: bool = False) -> dict[str, dict[str, Any]] | None:
    """Run lm-eval once for `specs`; {task: its record (`evals.lm_results.task_record`)}, None on a data-parallel worker."""
    # Before lm-eval imports the IFEval graders (they try a download at import when punkt_tab is missing).
    ensure_punkt_tab()
    seed_langdetect(settings["seed"])
    if confirm_run_unsafe_code:  # the one consent: HF `evaluate`'s code_eval (MBPP) asks for it again
        os.environ.setdefault("HF_ALLOW_CODE_EVAL", "1")
    import lm_eval  # loads torch and transformers: only when an eval runs


    lm = build_lm(model, tokenizer, settings, distributed)
    task_manager = builtin_task_manager() if any(isinstance(s.spec, str) for s in specs) else empty_task_manager()
    gen_kwargs = {**settings["gen_kwargs"], **({"max_gen_toks": settings["max_gen_toks"]} if settings["max_gen_toks"] else {})}
    seed = settings["seed"]
    try:
        with lean_env_info():
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
    return {s.name: task_record(res, s) for s in specs}


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


def _is_processor(obj) -> bool:
    from transformers import ProcessorMixin  # transformers loads torch: not before the command's threads are set

    return isinstance(obj, ProcessorMixin)


def _load_tokenizer(path):
    try:
        return load_tokenizer(os.fspath(path))
    except (OSError, ValueError) as exc:
        raise SinkstudyError(f"no tokenizer could be loaded from {path}: {str(exc).splitlines()[0]}") from exc
