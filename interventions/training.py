"""Next-token training of a causal LM on text through the adaptation engine (HF Trainer): demo
pretraining and QK-norm recovery training. One call = one text-only stage of `interventions.adapt`
(AdamW, linear warm-up then cosine decay, clip 1.0), with a trainable-parameter filter so "norm gains
only" or "attention only" runs are one line.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Callable, Sequence

import torch

from evals.sink.calibration import load_texts_file
from interventions.adapt import encoding, sources
from interventions.adapt.config import from_dict
from sinkstudy import SinkstudyError
from sinkstudy.io import read_text

TrainableFilter = Callable[[str, torch.nn.Parameter], bool]


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
    callbacks: Sequence = (),
    device: str | None = None,
) -> dict:
    """`steps` optimizer steps of next-token loss on every token of `texts` (one example per text,
    tokenised with the tokenizer's special tokens, cut to `seq_len`; batches reshuffled each epoch).

    `trainable(name, param)` picks the parameters that learn (default: all); the others stay
    bit-identical. Warm-up: `warmup_steps` (default steps // 20, at least 1). `callbacks`: HF
    `TrainerCallback`s (e.g. measure the model at chosen steps in `on_step_end`, which receives
    `model`). `device`: where training runs (`interventions.adapt.trainer.check_device`). Returns the
    loss curve and counts; the model is left in eval mode with its
    requires_grad flags as before.
    """
    # lazy: loads transformers, datasets, scipy
    from interventions.adapt.trainer import train_stage

    if steps < 1:
        raise SinkstudyError(f"steps must be >= 1, got {steps}")
    records = [{"text": t} for t in texts]
    encoder = encoding.Encoder(tokenizer, max_length=seq_len, loss_on="all")
    usable = [r for r in records if len(encoder(r)["input_ids"]) >= 2]
    if not usable:
        raise SinkstudyError("no training text: every text tokenised to fewer than 2 tokens")
    warmup = warmup_steps if warmup_steps is not None else max(1, steps // 20)
    config = from_dict({"seed": seed, "max_length": seq_len, "precision": "fp32", "stages": [{
        "name": desc.replace(" ", "-") or "text", "trainable": ["lm"], "lr": lr, "schedule": "cosine",
        "warmup_ratio": min(warmup / steps, 0.999), "batch_size": batch_size, "micro_batch_size": batch_size,
        "steps": steps, "weight_decay": weight_decay, "loss_on": "all"}]})
    stage = config.stages[0]
    dataset = encoding.EncodedDataset([sources.Records(usable, "texts", None, "")], encoder)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    with tempfile.TemporaryDirectory(prefix="sinkstudy-train-") as work:
        stats = train_stage(model, stage, config, dataset, collate_fn=lambda f: encoding.collate(f, pad_id), work_dir=Path(work),
                            tokenizer=tokenizer, trainable=trainable, callbacks=callbacks, progress=progress, desc=desc,
                            device=device)
    return {"steps": stats["steps"], "losses": stats["losses"], "final_loss": stats["final_loss"],
            "final_loss_steps": stats["final_loss_steps"], "mean_loss": stats["mean_loss"], "tokens": stats["tokens"],
            "trainable_params": stats["trainable_params"], "lr": lr, "seed": seed, "batch_size": batch_size, "seq_len": seq_len,
            "steps_per_second": stats["steps_per_second"]}


def chat_text(tokenizer, user: str, assistant: str) -> str:
    """A training text in the tokenizer's chat template, without the leading BOS the training loop adds."""
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}], tokenize=False
    )
    return text.removeprefix(tokenizer.bos_token or "")


def read_training_texts(path, tokenizer) -> list[str]:
    """Training strings from a file: a .jsonl of chats ({"user", "assistant"}: in the tokenizer's chat template;
    an assistant of null: the user text alone, plain text), else texts as calibration files hold them
    (`evals.sink.calibration.load_texts_file`: .json, .jsonl of {"text"}, .txt one per line)."""
    if str(path).endswith(".jsonl"):
        rows = [json.loads(line) for line in read_text(path, "training text").splitlines() if line.strip()]
        if rows and all(isinstance(r, dict) and "user" in r for r in rows):
            return [chat_text(tokenizer, r["user"], r["assistant"]) if r.get("assistant") is not None else r["user"] for r in rows]
    return [t.text for t in load_texts_file(path)]
