"""Progress bars off for a whole command (`--quiet`), the libraries' included.

Our own bars take `progress=`; the libraries' do not all listen: transformers' "Loading weights" /
"Writing model shards" bars, lm-eval's request bars (created with an explicit `disable=False`, which
beats tqdm's TQDM_DISABLE variable) and datasets' bars. All of them are tqdm instances, so `quiet()`
makes every tqdm bar created inside it disabled, and sets the libraries' own switches for any
process started from it. Everything is put back on exit (tests run many commands in one process).
"""

from __future__ import annotations

import contextlib
import functools
import os

# The libraries' own switches, read when they are imported (a worker process started inside `quiet`).
_ENV = {"TQDM_DISABLE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1", "HF_DATASETS_DISABLE_PROGRESS_BARS": "1"}
_DISABLE_POSITION = 10  # `disable` among tqdm.__init__'s positional parameters (iterable, desc, total, ...)


@contextlib.contextmanager
def quiet(enabled: bool = True):
    """Inside, no tqdm progress bar shows (with `enabled`; else nothing changes)."""
    if not enabled:
        yield
        return
    from tqdm import std

    original = std.tqdm.__init__

    @functools.wraps(original)
    def disabled(self, *args, **kwargs):
        if len(args) > _DISABLE_POSITION:
            args = args[:_DISABLE_POSITION] + (True,) + args[_DISABLE_POSITION + 1:]
        else:
            kwargs["disable"] = True
        original(self, *args, **kwargs)

    saved = {k: os.environ.get(k) for k in _ENV}
    std.tqdm.__init__ = disabled
    os.environ.update(_ENV)
    try:
        yield
    finally:
        std.tqdm.__init__ = original
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
