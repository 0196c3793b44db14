"""A quiet command (`--quiet`): no progress bars and no library chatter, the libraries' included.

Our own bars take `progress=`; the libraries' do not all listen: transformers' "Loading weights" /
"Writing model shards" bars, lm-eval's request bars (created with an explicit `disable=False`, which
beats tqdm's TQDM_DISABLE variable) and datasets' bars. All of them are tqdm instances, so `quiet()`
makes every tqdm bar created inside it disabled, and sets the libraries' own switches for any
process started from it.

The libraries also log on every call what does not concern a sinkstudy command: lm-eval warns per
eval that an in-memory model must not be launched via accelerate, that `do_sample=True` is needed
for non-greedy decoding and how to pass `--metadata`; mergekit logs each merge's stages at INFO (some
through the root logger); transformers notes deprecations. Inside `quiet()` those loggers keep only
errors, their Python warnings are ignored, and the root logger keeps warnings and errors: sinkstudy's
own warnings (a model without a sink, a refused setting) still show. Everything is put back on exit
(tests run many commands in one process).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import warnings

from tqdm import std

# The libraries' own switches, read when they are first imported (inside `quiet`, or in a worker process started from it).
_ENV = {"TQDM_DISABLE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1", "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
        "TRANSFORMERS_VERBOSITY": "error", "DATASETS_VERBOSITY": "error", "LMEVAL_LOG_LEVEL": "ERROR"}
_DISABLE_POSITION = 10  # `disable` among tqdm.__init__'s positional parameters (iterable, desc, total, ...)
# Loggers (and their children) of the libraries a command drives; lm-eval logs under both spellings.
LIBRARIES = ("lm_eval", "lm-eval", "mergekit", "transformers", "datasets", "accelerate", "huggingface_hub", "peft")


@contextlib.contextmanager
def quiet(enabled: bool = True):
    """Inside, no tqdm progress bar shows and the libraries log only errors (with `enabled`; else nothing changes)."""
    if not enabled:
        yield
        return

    original = std.tqdm.__init__

    @functools.wraps(original)
    def disabled(self, *args, **kwargs):
        if len(args) > _DISABLE_POSITION:
            args = args[:_DISABLE_POSITION] + (True,) + args[_DISABLE_POSITION + 1:]
        else:
            kwargs["disable"] = True
        original(self, *args, **kwargs)

    saved = {k: os.environ.get(k) for k in _ENV}
    loggers = [logging.getLogger(name) for name in ("", *LIBRARIES)]
    levels = [logger.level for logger in loggers]
    std.tqdm.__init__ = disabled
    os.environ.update(_ENV)
    for logger in loggers:  # a level set on the library's top logger covers its modules' loggers (unless they set one)
        logger.setLevel(max(logger.getEffectiveLevel(), logging.WARNING if logger.name == "root" else logging.ERROR))
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", module=rf"({'|'.join(n.replace('-', '_') for n in LIBRARIES)})(\.|$)")
            yield
    finally:
        std.tqdm.__init__ = original
        for logger, level in zip(loggers, levels):
            # A library first imported inside configured its logger from our environment: its own default back.
            logger.setLevel(level or (logging.WARNING if logger.handlers and logger.name != "root" else logging.NOTSET))
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
