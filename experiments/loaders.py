"""The pair loader, handed to evals: `evals/` measures and never imports `interventions/`, so the
commands that evaluate checkpoints by path pass these to `evals.lmeval.run_eval` (a VLM checkpoint
yields its language model; a QK-norm-injected checkpoint gets its norms back; a generic tokenizer
keeps its class)."""

from __future__ import annotations


def load_model(path, *, device: str | None = None, dtype: str | None = None):
    from interventions.pairs import load_causal_lm

    model, _ = load_causal_lm(path, dtype=dtype, device=device or "cpu")
    return model


def load_tokenizer(path):
    from interventions.pairs import load_tokenizer as pair_tokenizer

    return pair_tokenizer(path)


def eval_loaders() -> dict:
    """run_eval's `loader` and `tokenizer_loader` arguments."""
    return {"loader": load_model, "tokenizer_loader": load_tokenizer}
