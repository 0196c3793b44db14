"""The one causal-LM fine-tuning loop: demo pretraining, QK-norm recovery training, LM stages.

Deliberately small (no Trainer): CPU runs of a few hundred steps on tiny models, reproducible by
seed, with a trainable-parameter filter so "norm gains only" or "attention only" runs are one line.
"""

from __future__ import annotations

import math
import random
from typing import Callable, Sequence

import torch
from tqdm.auto import tqdm

from sinkstudy import SinkstudyError

TrainableFilter = Callable[[str, torch.nn.Parameter], bool]


def encode_texts(tokenizer, texts: Sequence[str], seq_len: int) -> list[torch.Tensor]:
    """Token ids per text (tokenizer adds BOS as it does at eval time), truncated to seq_len."""
    ids = tokenizer(list(texts), add_special_tokens=True, truncation=True, max_length=seq_len)["input_ids"]
    return [torch.tensor(x, dtype=torch.long) for x in ids if len(x) >= 2]


def _batch(examples: list[torch.Tensor], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    width = max(len(x) for x in examples)
    input_ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, x in enumerate(examples):
        input_ids[row, : len(x)] = x
        attention_mask[row, : len(x)] = 1
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    return input_ids, attention_mask, labels


def train_causal_lm(
    model,
    tokenizer,
    texts: Sequence[str],
    *,
    steps: int,
    lr: float = 1e-3,
    batch_size: int = 8,
    seq_len: int = 128,
    trainable: TrainableFilter | None = None,
    weight_decay: float = 0.0,
    warmup_steps: int | None = None,
    seed: int = 0,
    progress: bool = True,
    desc: str = "train",
) -> dict:
    """Next-token training on `texts` (one example per text, right-padded, pads masked out).

    See `optimize` for the optimiser, schedule and the `trainable` filter.
    """
    examples = encode_texts(tokenizer, texts, seq_len)
    if not examples:
        raise SinkstudyError("no training text: every text tokenised to fewer than 2 tokens")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def next_batch(rng: random.Random) -> dict:
        input_ids, attention_mask, labels = _batch(rng.sample(examples, min(batch_size, len(examples))), pad_id)
        return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}

    stats = optimize(model, next_batch, steps=steps, lr=lr, trainable=trainable, weight_decay=weight_decay,
                     warmup_steps=warmup_steps, seed=seed, progress=progress, desc=desc)
    return {**stats, "batch_size": batch_size, "seq_len": seq_len}


def optimize(
    model,
    next_batch: Callable[[random.Random], dict],
    *,
    steps: int,
    lr: float,
    trainable: TrainableFilter | None = None,
    weight_decay: float = 0.0,
    warmup_steps: int | None = None,
    seed: int = 0,
    progress: bool = True,
    desc: str = "train",
) -> dict:
    """The loop every fine-tune shares: `steps` AdamW updates with linear warm-up and cosine decay.

    `next_batch(rng)` returns the model's forward kwargs, labels included (text-only or with
    `pixel_values`). `trainable(name, param)` picks the parameters that learn; the others are frozen
    for the run and their `requires_grad` restored afterwards. Returns the loss curve and counts;
    the model is left in eval mode.
    """
    if steps < 0:
        raise SinkstudyError(f"steps must be >= 0, got {steps}")
    named = list(model.named_parameters())
    previous = {name: p.requires_grad for name, p in named}
    chosen = [p for name, p in named if trainable is None or trainable(name, p)]
    if not chosen:
        raise SinkstudyError("the trainable filter selected no parameters")
    chosen_ids = {id(p) for p in chosen}
    for _, p in named:
        p.requires_grad_(id(p) in chosen_ids)

    torch.manual_seed(seed)
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(chosen, lr=lr, weight_decay=weight_decay)
    warmup = warmup_steps if warmup_steps is not None else max(1, steps // 20)

    def lr_factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    losses: list[float] = []
    tokens = 0
    model.train()
    try:
        bar = tqdm(range(steps), desc=desc, disable=not progress, leave=False)
        for _ in bar:
            batch = next_batch(rng)
            loss = model(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(chosen, 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
            tokens += int(batch["attention_mask"].sum()) if "attention_mask" in batch else batch["input_ids"].numel()
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
    finally:
        model.eval()
        for name, p in named:
            p.requires_grad_(previous[name])
    return {
        "steps": steps,
        "losses": losses,
        "final_loss": sum(losses[-10:]) / len(losses[-10:]) if losses else None,
        "tokens": tokens,
        "trainable_params": sum(p.numel() for p in chosen),
        "lr": lr,
        "seed": seed,
    }
