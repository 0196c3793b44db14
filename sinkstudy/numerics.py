"""The numeric mode a process computes in: `reproducible` pins every CPU code path that picks its
kernels by the processor, so a study gives the same numbers on any x86-64 CPU; `native` leaves each
library to pick the fastest path for this machine (docs/numerics.md has the measurements).

What `reproducible` pins, and why each (measured by hashing each piece's output with one path pinned at a time):
- MKL_CBWR=COMPATIBLE: MKL's code branch documented to give the same results on Intel and non-Intel
  processors. Its ISA branches (AVX2, AVX512) are Intel-only: on AMD, MKL reads MKL_CBWR=AVX2 as AUTO.
  fp32 matmul and linear layers go to MKL's sgemm.
- ATEN_CPU_CAPABILITY=default: ATen's kernels (softmax, norms, SiLU, AdamW's update, random normal
  init) built for the x86-64 baseline, where AVX2 / AVX-512 builds reorder and fuse (FMA) arithmetic.
- oneDNN and NNPACK off (`torch.backends.mkldnn.enabled`, `torch.backends.nnpack.set_flags(False)`): conv2d
  (a vision tower's patch embedding) and GELU otherwise run oneDNN's kernels, generated for the CPU's ISA at
  run time, and a conv2d without a gradient on a batch of 16 or more runs NNPACK's, chosen by the CPU's ISA.
- one intra-op thread (OMP_NUM_THREADS, MKL_NUM_THREADS, OPENBLAS_NUM_THREADS, `torch.set_num_threads`):
  parallel reductions split the work by thread count, so the machine's core count would move sums.
- GLIBC_TUNABLES glibc.cpu.hwcaps=-AVX2,-FMA,-FMA4: glibc's libm runs FMA variants of exp/log/pow on
  CPUs that have FMA (Python's math, numpy's float64 exp/log, scipy); masked, every x86-64 runs the SSE2 ones.
- NPY_DISABLE_CPU_FEATURES and OPENBLAS_CORETYPE=Nehalem: numpy's SIMD loops and OpenBLAS's kernels
  (numpy / scipy linear algebra) at the x86-64-v2 baseline numpy requires, not at the CPU's.
- torch's CPU sqrt, asin, acos and atan (float32 and float64) go to MKL's vector math in its high-accuracy
  mode, which is not correctly rounded and whose bits follow the hardware even on MKL's COMPATIBLE branch
  (the same CPU model gave other bits under an emulator, every other function the same): the mode
  registers numpy's kernels for them (`PORTABLE_KERNELS`; sqrt is IEEE's correctly rounded one), so
  AdamW's update (exp_avg_sq.sqrt()) is the same everywhere.

glibc and the libraries read these when they load, so a process is in the mode only if it was started
with them: `enter` re-executes the program with them set (the `sinkstudy` command does this before it
imports torch); worker processes inherit them and call `configure_torch`. CUDA kernels are not pinned.

`native-aten-default` is the native mode with ATen's kernels built for the x86-64 baseline
(ATEN_CPU_CAPABILITY=default) instead of this CPU's AVX2 / AVX-512 ones: a second numeric path, the kind of
difference another CPU makes, at a fraction of the reproducible mode's cost. A study run on two paths
(`--numerics native,native-aten-default`, experiments.study.numeric_spread) measures how far the numeric path
moves its figures and states an answer only where both paths give it.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import sys
import warnings

from sinkstudy import SinkstudyError

MODES = ("reproducible", "native", "native-aten-default")
# The environment each non-reproducible mode is started with (what it pins on top of the native mode).
NATIVE_PATHS = {"native": {}, "native-aten-default": {"ATEN_CPU_CAPABILITY": "default"}}
# Variables that choose kernels (not threads): set when a native-mode process starts, they name its identity.
KERNEL_ENV = ("MKL_CBWR", "MKL_ENABLE_INSTRUCTIONS", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA",
              "NPY_DISABLE_CPU_FEATURES", "OPENBLAS_CORETYPE")
ENV = "SINKSTUDY_NUMERICS"  # the mode a command runs in when its --numerics is not given
THREADS = 1
_HWCAPS = "glibc.cpu.hwcaps=-AVX2,-FMA,-FMA4"
PINNED_ENV = {
    "MKL_CBWR": "COMPATIBLE",
    "ATEN_CPU_CAPABILITY": "default",
    "OMP_NUM_THREADS": str(THREADS),
    "MKL_NUM_THREADS": str(THREADS),
    "OPENBLAS_NUM_THREADS": str(THREADS),
    "NPY_DISABLE_CPU_FEATURES": "X86_V3 X86_V4 AVX512_ICL AVX512_SPR",
    "OPENBLAS_CORETYPE": "Nehalem",
    "GLIBC_TUNABLES": _HWCAPS,
}
# The mode's identity: part of every result key (sinkstudy.provenance.code_version), so a result computed
# in one mode is never reused in the other, and a change of what the mode pins recomputes everything.
# torch ops on CPU whose own kernels (MKL's vector math) give hardware-dependent bits: numpy's ufunc for each
PORTABLE_KERNELS = {"sqrt": "sqrt", "asin": "arcsin", "acos": "arccos", "atan": "arctan"}
_PINS = {"env": PINNED_ENV, "onednn": False, "nnpack": False, "threads": THREADS, "kernels": PORTABLE_KERNELS}
_registered: list = []  # the torch.library.Library holding the portable kernels (registered once per process)
REPRODUCIBLE_ID = "reproducible-" + hashlib.sha256(json.dumps(_PINS, sort_keys=True).encode()).hexdigest()[:8]


def requested(flag: str | list[str] | None, default: str) -> str:
    """The mode a command computes in: its --numerics flag (of several paths, the first: the others run as
    processes of their own), else $SINKSTUDY_NUMERICS, else its default."""
    mode = (flag[0] if isinstance(flag, list) else flag) or os.environ.get(ENV) or default
    if mode not in MODES:
        raise SinkstudyError(f"{ENV}={mode!r}: the numeric mode is one of {', '.join(MODES)}")
    return mode


def path_list(text: str) -> list[str]:
    """`--numerics`'s value: one mode, or two or more distinct ones separated by commas (a numeric spread)."""
    paths = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [p for p in paths if p not in MODES]
    if not paths or unknown:
        raise ValueError(f"unknown numeric mode {', '.join(map(repr, unknown or [text]))}: one of {', '.join(MODES)}, "
                         "or several separated by commas")
    if len(set(paths)) != len(paths):
        raise ValueError(f"each numeric mode once, got {text!r}")
    return paths


def environment_for(mode: str, env: dict[str, str]) -> dict[str, str]:
    """The environment to start a process in `mode` with, from `env` (this process's, whatever mode it is in):
    every variable some mode sets is cleared first, so a native child of a reproducible parent runs native;
    the user's other variables (MKL_ENABLE_INSTRUCTIONS, ONEDNN_MAX_CPU_ISA, other glibc tunables) are kept."""
    set_by_modes = set(PINNED_ENV) | {k for path in NATIVE_PATHS.values() for k in path} | {ENV}
    clean = {k: v for k, v in env.items() if k not in set_by_modes}
    tunables = [t for t in env.get("GLIBC_TUNABLES", "").split(":") if t and t != _HWCAPS]
    if tunables:
        clean["GLIBC_TUNABLES"] = ":".join(tunables)
    return _with_mode(mode, clean)


def _with_mode(mode: str, env: dict[str, str]) -> dict[str, str]:
    """`env` with `mode`'s variables set on top (whatever else it holds is kept)."""
    return pinned_environment(env) if mode == "reproducible" else {**env, **NATIVE_PATHS[mode], ENV: mode}


@functools.lru_cache(maxsize=1)
def _start_environment() -> dict[str, str]:
    """The environment this process was started with (what glibc and the libraries read), not os.environ now."""
    try:
        with open("/proc/self/environ", "rb") as fh:
            items = fh.read().split(b"\0")
    except OSError:  # not Linux
        return dict(os.environ)
    return dict(item.decode(errors="replace").partition("=")[::2] for item in items if b"=" in item)


def _pinned(env: dict[str, str]) -> bool:
    return all((_HWCAPS in env.get(k, "").split(":")) if k == "GLIBC_TUNABLES" else env.get(k) == v
               for k, v in PINNED_ENV.items())


def pinned_environment(env: dict[str, str]) -> dict[str, str]:
    """`env` with the mode's variables set (glibc tunables the user set are kept beside the mask)."""
    tunables = [t for t in env.get("GLIBC_TUNABLES", "").split(":") if t and not t.startswith("glibc.cpu.hwcaps=")]
    return {**env, **PINNED_ENV, "GLIBC_TUNABLES": ":".join(tunables + [_HWCAPS]), ENV: "reproducible"}


def enter(mode: str, *, reexec: bool) -> None:
    """Make this process compute in `mode`. For `reproducible` when the process was not started with the
    pinned environment: re-execute the same command line with it (`reexec`, before torch or numpy are
    imported), else refuse in one line (a process cannot switch once its libraries are loaded)."""
    os.environ[ENV] = mode
    if _started_in(mode):
        return
    if not reexec or "torch" in sys.modules or "numpy" in sys.modules:
        raise SinkstudyError(f"the {mode} numeric mode is set when a process starts: run the sinkstudy command "
                             "(it restarts itself with the mode's environment), or pass --numerics native")
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], _with_mode(mode, dict(os.environ)))


def _started_in(mode: str) -> bool:
    start = _start_environment()
    if mode == "reproducible":
        return _pinned(start)
    return all(start.get(k) == v for k, v in NATIVE_PATHS[mode].items())


def configure_torch() -> None:
    """torch's part of the mode, in every process that computes (the CLI's and each worker): one intra-op
    thread, no oneDNN, no NNPACK, the portable kernels. Nothing in `native`."""
    if current() != "reproducible":
        return
    # lazy: loads torch, numpy
    import torch

    torch.set_num_threads(THREADS)
    torch.backends.mkldnn.enabled = False
    torch.backends.nnpack.set_flags(False)
    if not _registered:
        _registered.append(_register_portable_kernels(torch))


def _register_portable_kernels(torch):
    """aten's functional, in-place and out= forms of each PORTABLE_KERNELS op on CPU, computed by numpy (autograd
    still applies the op's own derivative above the CPU kernel). Half and bfloat16 go through float32,
    integers through the default float dtype, as torch's own kernels promote them."""
    # lazy: loads numpy
    import numpy as np

    def portable(ufunc):
        def compute(t):
            out_dtype = t.dtype if t.is_floating_point() or t.is_complex() else torch.get_default_dtype()
            work = t.detach().resolve_conj().resolve_neg()
            work = work.float() if work.dtype in (torch.float16, torch.bfloat16) or not (work.is_floating_point() or work.is_complex()) \
                else work
            result = torch.from_numpy(np.asarray(ufunc(work.numpy())))
            return result.to(out_dtype) if result.dtype != out_dtype else result

        def out_form(t, *, out):
            result = compute(t)
            out.resize_(result.shape)
            return out.copy_(result)

        return compute, lambda t: t.copy_(compute(t)), out_form

    lib = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():  # "Overriding a previously registered kernel": the point
        warnings.simplefilter("ignore")
        for op, name in PORTABLE_KERNELS.items():
            functional, inplace, out_form = portable(getattr(np, name))
            lib.impl(op, functional, "CPU")
            lib.impl(f"{op}_", inplace, "CPU")
            lib.impl(f"{op}.out", out_form, "CPU")
    return lib


def current() -> str:
    """`reproducible` when this process was started with the pinned environment; `native-aten-default` when it
    was asked for and started with ATen's baseline kernels; else `native`."""
    asked = os.environ.get(ENV)
    if asked not in NATIVE_PATHS and _pinned(_start_environment()):
        return "reproducible"
    return asked if asked in NATIVE_PATHS and _started_in(asked) else "native"


def identity() -> str:
    """The mode in effect, as it enters result keys and provenance: `reproducible-<pins hash>` when the process
    was started pinned and torch (where loaded) runs without oneDNN and NNPACK, on the portable kernels; else
    `native`, naming the kernel-choosing variables it was started with (`native[ATEN_CPU_CAPABILITY=default]`)."""
    if current() != "reproducible":
        return _native_identity()
    torch = sys.modules.get("torch")
    if torch is not None and (not _registered or torch.backends.mkldnn.enabled or torch._C._get_nnpack_enabled()):
        return _native_identity()  # started pinned, but torch's part was never applied (configure_torch)
    return REPRODUCIBLE_ID


def _native_identity() -> str:
    return native_identity(_start_environment())


def native_identity(env: dict[str, str]) -> str:
    """The identity of a native-mode process started with `env`: `native`, or with the kernel-choosing variables
    it holds, e.g. `native[ATEN_CPU_CAPABILITY=default]` (other kernels, other numbers, so another key). A shell
    may preset one machine-wide (OPENBLAS_CORETYPE): what to expect of a process is derived from its environment."""
    chosen = [f"{k}={env[k]}" for k in KERNEL_ENV if env.get(k)]
    hwcaps = [t for t in env.get("GLIBC_TUNABLES", "").split(":") if t.startswith("glibc.cpu.hwcaps=")]
    return "native" + "".join(f"[{x}]" for x in chosen + hwcaps)
