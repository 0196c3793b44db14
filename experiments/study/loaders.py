"""The pair loader, handed to evals: `evals/` measures and never imports `interventions/`, so the
commands that evaluate checkpoints by path pass `load_model` to `evals.lmeval.run_eval` as its
`loader` (a VLM checkpoint yields its language model; a QK-norm-injected checkpoint gets its norms
back; a .gguf is converted once). Tokenizers come from `sinkstudy.checkpoint.load_tokenizer`,
which evals uses itself."""

from __future__ import annotations

from interventions.pairs import load_causal_lm


def load_model(path, *, device: str | None = None, dtype: str | None = None):
    model, _ = load_causal_lm(path, dtype=dtype, device=device or "cpu")
    return model
