"""Whether inputs on disk are checked now: not while a study is only planned.

`sinkstudy run CONFIG --plan` lists the steps without reading any input file, so a plan can be made before
the files exist (the study-real inputs are written by `make study-real` just before the run). Every check of
an input's existence asks `inputs_checked()`; the run itself checks them all when it starts (and each step
reads its own when it runs), still before any work.
"""

from __future__ import annotations

import contextlib
import contextvars

_CHECKED = contextvars.ContextVar("sinkstudy_inputs_checked", default=True)


def inputs_checked() -> bool:
    return _CHECKED.get()


@contextlib.contextmanager
def planning_only():
    """Inside, input files are not looked for (a plan reads none)."""
    token = _CHECKED.set(False)
    try:
        yield
    finally:
        _CHECKED.reset(token)
