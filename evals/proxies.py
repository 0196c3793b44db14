"""VL-side proxies of a treated language model, beside its text skill: how far its weights moved from the
VLM's language model toward the base (`weight_distance`), and the text-only perplexity of image captions
(`caption_nll`, from a captions file `read_captions` reads)."""

from __future__ import annotations

import os
from pathlib import Path

from sinkstudy import SinkstudyError
from sinkstudy.checkpoint import TensorReader, weight_files
from sinkstudy.io import read_text


def read_captions(path: str | os.PathLike) -> list[str]:
    """One caption per non-empty line; an empty file is one line of error."""
    p = Path(path)
    lines = [line.strip() for line in read_text(p, "captions file").splitlines() if line.strip()]
    if not lines:
        raise SinkstudyError(f"captions file {p} is empty")
    return lines


def caption_nll(model, tokenizer, captions: list[str]) -> float:
    """Mean per-token NLL of the captions as plain text (exp = text-only caption perplexity)."""
    # lazy: loads torch, numpy
    import torch

    total, count = 0.0, 0
    with torch.no_grad():
        for text in captions:
            ids = tokenizer(text, return_tensors="pt").input_ids.to(model.device)
            if ids.shape[1] < 2:
                continue
            loss = model(input_ids=ids, labels=ids).loss
            total += loss.item() * (ids.shape[1] - 1)
            count += ids.shape[1] - 1
    return total / max(count, 1)


def weight_distance(path, vlm_lm, base) -> float:
    """||W - W_vlm|| / ||W_base - W_vlm|| over all float tensors of three checkpoints with one layout: 0 at the
    VLM LM, 1 at the base."""
    # lazy: loads torch, numpy
    import torch

    def reader(p):
        files = weight_files(p)
        if files is None:
            raise SinkstudyError(f"{p}: no safetensors weights to compare")
        return TensorReader(files)

    a, v, b = reader(path), reader(vlm_lm), reader(base)
    num = den = 0.0
    for name in v.files.tensors:
        tv = v.get(name).double()
        num += (a.get(name).double() - tv).pow(2).sum().item()
        den += (b.get(name).double() - tv).pow(2).sum().item()
    return float(torch.tensor(num / den).sqrt()) if den else 0.0
