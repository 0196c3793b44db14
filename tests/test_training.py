"""Text training through the adaptation engine really learns, respects the trainable filter, is
seeded, and lets a callback see the model at chosen steps."""

import pytest
import torch

from interventions.training import train_causal_lm
from sinkstudy import SinkstudyError
from sinkstudy.tiny import tiny_causal_lm

TEXTS = ["The answer is 8.", "Write in upper case: HELLO WORLD.", "def add(a, b): return a + b"] * 4


def test_loss_decreases_and_frozen_params_stay(tokenizer):
    model = tiny_causal_lm("qwen2", vocab_size=len(tokenizer))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    stats = train_causal_lm(model, tokenizer, TEXTS, steps=30, lr=3e-3, batch_size=4,
                            trainable=lambda n, p: "embed" not in n, progress=False)
    assert stats["losses"][-1] < stats["losses"][0] - 0.5
    after = dict(model.named_parameters())
    assert torch.equal(after["model.embed_tokens.weight"], before["model.embed_tokens.weight"])
    assert not torch.equal(after["model.layers.0.self_attn.q_proj.weight"], before["model.layers.0.self_attn.q_proj.weight"])
    assert all(p.requires_grad for p in model.parameters()) and not model.training


def test_same_seed_same_weights(tokenizer):
    runs = []
    for _ in range(2):
        model = tiny_causal_lm("llama", vocab_size=len(tokenizer))
        train_causal_lm(model, tokenizer, TEXTS, steps=3, batch_size=2, seed=5, progress=False)
        runs.append(model.lm_head.weight.detach().clone())
    assert torch.equal(runs[0], runs[1])


def test_empty_filter_is_refused(tokenizer):
    model = tiny_causal_lm("llama", vocab_size=len(tokenizer))
    with pytest.raises(SinkstudyError, match="selected no parameters"):
        train_causal_lm(model, tokenizer, TEXTS, steps=1, trainable=lambda n, p: False, progress=False)


def test_callbacks_see_the_model_at_each_step(tokenizer):
    from transformers import TrainerCallback

    class Watch(TrainerCallback):
        seen = []

        def on_step_end(self, args, state, control, model=None, **kw):
            self.seen.append((state.global_step, float(model.lm_head.weight.detach().abs().sum())))

    model = tiny_causal_lm("qwen2", vocab_size=len(tokenizer))
    train_causal_lm(model, tokenizer, TEXTS, steps=3, batch_size=2, progress=False, callbacks=[Watch()])
    assert [s for s, _ in Watch.seen] == [1, 2, 3] and len({w for _, w in Watch.seen}) == 3
