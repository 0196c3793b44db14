"""How many threads a process computes on, so that processes sharing a machine do not fight over its cores.

A process that takes every core while another job runs gets slower, not faster: measured on 2 cores, an eval
of SmolLM2-135M with 3 prompts per task took 3 min 59 s beside another job and 20 s on one thread (the same
scores). Two things cause it: more compute threads than free cores, and OpenMP's idle threads spinning
between parallel regions (libgomp spins before it sleeps), which takes cycles from the other job.

So every computing command takes `--threads N`, whose default is the cores this process may run on (its CPU
affinity) that no other sinkstudy process on this host has claimed, at least one; a study's workers claim one
each (`experiments.study.jobs`), so a command started beside a study takes what is left. A claim is a file
`<cache>/threads/<host>-<pid>` holding the count, removed when its process exits; one whose process is gone
is ignored and removed. $OMP_NUM_THREADS, when the user set it, is the default instead.

The wait policy is OMP_WAIT_POLICY=PASSIVE (idle threads sleep) unless the user chose one. OpenMP reads it
when the runtime loads, that is when torch is first imported: `prepare` sets it (and the thread variables the
BLAS libraries read at load) before that; the `sinkstudy` command calls it first thing. A process that had
loaded torch before keeps the policy it started with, and says so (`wait_policy`). Both the count and the
policy are in every result's provenance (`sinkstudy.provenance.hardware`). Threads change timings, not what
is computed: they are not part of any result's key (the reproducible mode pins one thread itself).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import socket
import sys
from pathlib import Path

from sinkstudy.io import _pid_alive, cache_root, write_text_atomic
from sinkstudy.numerics import _start_environment

POLICY = "OMP_WAIT_POLICY"
# What the libraries read when they load (OpenMP, MKL, OpenBLAS): a process's children and late imports follow it.
COUNT_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
_set_before_torch: list[str] = []  # the policy `prepare` set while torch was not yet loaded


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _claims() -> Path:
    return cache_root() / "threads"


def _mine() -> Path:
    return _claims() / f"{socket.gethostname()}-{os.getpid()}"


def claimed_elsewhere() -> int:
    """Threads claimed by the other live sinkstudy processes on this host (dead ones' claims removed)."""
    host, total = socket.gethostname(), 0
    with contextlib.suppress(OSError):
        for f in _claims().iterdir():
            name, _, pid = f.name.rpartition("-")
            if name != host or not pid.isdigit() or int(pid) == os.getpid():
                continue
            if not _pid_alive(int(pid)):
                with contextlib.suppress(OSError):
                    f.unlink()
                continue
            with contextlib.suppress(OSError, ValueError):
                total += int(f.read_text().strip() or 0)
    return total


def default_threads() -> int:
    """$OMP_NUM_THREADS where the user set it, else the usable cores no other sinkstudy process claims (at least 1)."""
    given = os.environ.get("OMP_NUM_THREADS", "")
    if given.isdigit() and int(given) > 0:
        return int(given)
    return max(1, usable_cores() - claimed_elsewhere())


def prepare(threads: int) -> None:
    """Before torch (and numpy) load: OpenMP's idle threads sleep instead of spinning unless the user chose a policy,
    and the libraries start with `threads` threads."""
    if POLICY not in os.environ:
        os.environ[POLICY] = "PASSIVE"
    if "torch" not in sys.modules:
        _set_before_torch[:] = [os.environ[POLICY]]
    for k in COUNT_ENV:
        os.environ[k] = str(threads)


def apply(threads: int) -> None:
    """This process computes on `threads` intra-op threads from now on, and claims them for as long as it runs."""
    # lazy: loads torch, numpy
    import torch

    torch.set_num_threads(threads)
    claim(threads)


def claim(threads: int) -> None:
    """Record that this process computes on `threads` threads (0: it only waits, e.g. on its workers)."""
    with contextlib.suppress(OSError):  # a read-only cache: no claim, nothing else changes
        write_text_atomic(_mine(), f"{threads}\n")
        if not _registered:
            _registered.append(atexit.register(release))


_registered: list = []


def release() -> None:
    with contextlib.suppress(OSError):
        _mine().unlink()


@contextlib.contextmanager
def for_children(threads: int):
    """Processes started inside (a study's workers) load their libraries with `threads` threads each."""
    saved = {k: os.environ.get(k) for k in COUNT_ENV}
    os.environ.update({k: str(threads) for k in COUNT_ENV})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def wait_policy() -> str | None:
    """The OpenMP wait policy this process's runtime runs with: the one `prepare` set before torch loaded, else the
    one it was started with (None: OpenMP's own default, which spins)."""
    if _set_before_torch:
        return _set_before_torch[0]

    return _start_environment().get(POLICY)


def in_effect() -> dict:
    """What provenance records: the intra-op threads (torch's where loaded) and the wait policy."""
    torch = sys.modules.get("torch")
    count = torch.get_num_threads() if torch is not None else os.environ.get("OMP_NUM_THREADS")
    return {"intra_op": int(count) if count is not None and str(count).isdigit() else None, "wait_policy": wait_policy()}
