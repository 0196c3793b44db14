"""The model lm-eval evaluates, built in process: lm-eval's `HFLM` around a loaded model (or sinkstudy's
`ContinuousHFLM`, the `hf-continuous` backend), or its `VLLM` on a checkpoint path (`build_lm`); a path loaded by
the caller's loader only when something is left to evaluate (`load_model`, default `auto_causal_lm`); data
parallelism under `accelerate launch` / torchrun (`data_parallel`); an lm_head that differs from the tied
embeddings kept (`guard_tied_weights`); and lm-eval's per-run environment report replaced by its cheap fields
while we evaluate (`lean_env_info`: the one patch of lm-eval, undone on exit).

torch, transformers, accelerate and lm-eval are imported inside the functions: this module is read by
`evals.lmeval`, which the command line reaches before the threads are set up.
"""

from __future__ import annotations

import contextlib
import logging
import os

from evals.protocol import HF_BACKENDS
from sinkstudy import SinkstudyError
from sinkstudy.checkpoint import local_model_path
from sinkstudy.provenance import package_versions

log = logging.getLogger("evals.lmeval")


def auto_causal_lm(path: str, *, device: str | None = None, dtype: str | None = None):
    # lazy: loads torch, transformers, numpy
    import torch
    from transformers import AutoModelForCausalLM

    torch_dtype = "auto" if dtype == "auto" else getattr(torch, dtype or "float32")
    return AutoModelForCausalLM.from_pretrained(local_model_path(path), dtype=torch_dtype).to(device or "cpu")


def load_model(loader, path, device=None, dtype=None):
    """`loader(path, device=, dtype=)` -> a causal LM in eval mode; its errors become one line."""
    try:
        model = loader(os.fspath(path), device=str(device) if device is not None else None, dtype=dtype)
    except (OSError, ValueError) as exc:
        raise SinkstudyError(f"cannot load a causal LM from {path}: {str(exc).splitlines()[0]}") from exc
    return model.eval()


def data_parallel(backend: str):
    """The accelerate state when this process is one of several (accelerate launch / torchrun) on an hf backend."""
    if backend not in HF_BACKENDS or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None
    # lazy: loads torch, numpy, accelerate
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
    # lazy: loads torch, numpy
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
def lean_env_info():
    """lm-eval's `add_env_info` runs `pip list` and torch's collect_env on every `simple_evaluate` (about 0.9 s,
    more than a small eval); no record keeps that block (each carries sinkstudy's own provenance), so within our
    call it stores lm-eval's cheap fields only. Its `git_hash` is the working directory's commit, not the code's
    (sinkstudy's provenance has that), and outside a git repository git prints "fatal: not a git repository" on
    every eval: not collected either."""
    # lazy: loads lm_eval, datasets, numpy
    import lm_eval.evaluator as evaluator

    def lean(storage: dict) -> None:
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


def build_lm(model, tokenizer, settings, distributed=None):
    if settings["backend"] == "vllm":
        # lazy: loads lm_eval
        from lm_eval.models.vllm_causallms import VLLM

        model = local_model_path(model)  # a .gguf file or a registered real LLM's name: its converted checkpoint
        args = {"pretrained": model, "tokenizer": getattr(tokenizer, "name_or_path", None) or model,
                "batch_size": settings["batch_size"], "seed": settings["seed"], "dtype": settings["dtype"],
                "chat_template_args": dict(settings["chat_template_kwargs"]), **settings["backend_args"]}
        return VLLM(**args)
    # lazy: loads lm_eval, torch, transformers
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
