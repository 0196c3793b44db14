"""Greedy generation with continuous batching: up to `batch_size` prompts decode together, a finished
row leaves the batch at once and the next prompt takes its slot.

Each prompt is prefilled alone, exactly as `model.generate` does at batch 1 (a fresh `DynamicCache`,
no attention mask, positions 0..L-1, logits of the last position only), so its first token is
the one batch-1 generation picks; its cache then joins the batch (`PackedKV`). A decode step feeds
every row its newest token at its own position under a padding mask, takes the argmax of the
float32 logits, and ends a row after an EOS id, when its `stop` says so, or at `max_new_tokens`.
Later tokens can differ from batch-1 decoding only through batch-shape numerics (a matrix product
over several rows, attention under a padding mask), which matters only where two logits nearly tie.
"""

from __future__ import annotations

import inspect
from collections import deque
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

from evals.generate.packed import PackedKV


@dataclass
class Prompt:
    """One generation: the prompt's token ids, a token budget, and an optional stop test that is
    called with the tokens generated so far after each new token."""

    ids: Sequence[int]
    max_new_tokens: int
    stop: Callable[[list[int]], bool] | None = None


def unsupported_reason(model) -> str | None:
    """Why `greedy_generate` cannot run `model` (None when it can): it needs a decoder-only model
    whose KV cache is plain attention layers (full or sliding window)."""
    config = model.config
    if getattr(config, "is_encoder_decoder", False):
        return f"{type(model).__name__} is an encoder-decoder model"
    if "position_ids" not in inspect.signature(model.forward).parameters:
        return f"{type(model).__name__}.forward takes no position_ids"
    layers = DynamicCache(config=config).layers
    odd = sorted({type(layer).__name__ for layer in layers if type(layer) not in (DynamicLayer, DynamicSlidingWindowLayer)})
    if odd or not layers:
        return f"{type(model).__name__}'s cache holds {', '.join(odd) or 'no attention'} layers, not plain attention"
    return None


def greedy_generate(model, prompts: Sequence[Prompt], *, batch_size: int, eos_token_ids: Sequence[int] = (),
                    on_done: Callable[[int], None] | None = None) -> list[list[int]]:
    """The generated tokens of each prompt, its final token (EOS or the one completing a stop)
    included. Prompts enter the batch in the given order; `on_done(i)` is called as prompt i ends."""
    forward = inspect.signature(model.forward).parameters
    cache_kw = "cache" if "cache" in forward else "past_key_values"  # transformers 5.25 renamed it
    keep = {"logits_to_keep": 1} if "logits_to_keep" in forward else {}
    device = next(model.parameters()).device
    eos = set(eos_token_ids)
    out: list[list[int]] = [[] for _ in prompts]
    pending = deque(i for i, p in enumerate(prompts) if p.max_new_tokens > 0)

    def finished(i: int) -> bool:
        p, toks = prompts[i], out[i]
        done = toks[-1] in eos or len(toks) >= p.max_new_tokens or (p.stop is not None and p.stop(toks))
        if done and on_done is not None:
            on_done(i)
        return done

    def next_row():
        """Prefill pending prompts until one needs more than its first token: (index, cache) or None."""
        while pending:
            i = pending.popleft()
            ids = torch.tensor([list(prompts[i].ids)], device=device)
            cache = DynamicCache(config=model.config)
            logits = model(input_ids=ids, position_ids=torch.arange(ids.shape[1], device=device)[None],
                           use_cache=True, **{cache_kw: cache}, **keep).logits
            out[i].append(int(logits[0, -1].float().argmax()))
            if not finished(i):
                return i, cache
        return None

    kv = PackedKV(len(DynamicCache(config=model.config).layers), min(batch_size, len(pending)))
    rows: list[int] = []  # the prompt index in each slot
    with torch.inference_mode():
        while True:
            while len(rows) < kv.slots and (row := next_row()) is not None:
                kv.insert(len(rows), row[1], len(prompts[row[0]].ids))
                rows.append(row[0])
            if not rows:
                return out
            mask, positions = kv.step_inputs(device)
            tokens = torch.tensor([[out[i][-1]] for i in rows], device=device)
            logits = model(input_ids=tokens, attention_mask=mask, position_ids=positions, use_cache=True,
                           **{cache_kw: kv.cache}, **keep).logits
            kv.advance()
            for i, t in zip(rows, logits[:, -1].float().argmax(-1).tolist()):
                out[i].append(t)
            for slot in reversed(range(len(rows))):  # descending: a removal moves only an already-seen row
                if not finished(rows[slot]):
                    continue
                row = next_row()
                if row is not None:
                    kv.insert(slot, row[1], len(prompts[row[0]].ids))
                    rows[slot] = row[0]
                else:
                    kv.remove(slot)
                    rows[slot] = rows[-1]
                    rows.pop()
