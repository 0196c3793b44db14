"""Calibration texts: the shipped sets, user files, and tokenisation (optionally via chat template)."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Sequence, Union

from sinkstudy import SinkstudyError

# The calibration texts wherever none are named (the paper's S, QK-norm gains, doses, the training trajectory).
DEFAULT_SET = "ifeval15"
SHIPPED_SETS = {
    DEFAULT_SET: "ifeval15.json",  # 15 short IFEval-style prompts: the paper metric's default
    "passages64": "passages64.json",  # 64 English + code passages of 128-512 tokens: mass metrics
}


@dataclass(frozen=True)
class CalibrationText:
    id: str
    text: str


TextsArg = Union[None, str, os.PathLike, Sequence[Union[str, CalibrationText, dict]]]


def load_set(name: str) -> list[CalibrationText]:
    if name not in SHIPPED_SETS:
        raise SinkstudyError(f"unknown calibration set {name!r}; shipped sets: {', '.join(SHIPPED_SETS)}")
    raw = json.loads(resources.files("evals.sink").joinpath("data", SHIPPED_SETS[name]).read_text(encoding="utf-8"))
    return [CalibrationText(t["id"], t["text"]) for t in raw["texts"]]


def load_texts_file(path: str | os.PathLike) -> list[CalibrationText]:
    """Read texts from .json (list of strings / {"id","text"} or {"texts": [...]}), .jsonl, or .txt (one per line)."""
    path = Path(path)
    if not path.is_file():
        raise SinkstudyError(f"texts file not found: {path}")
    content = path.read_text(encoding="utf-8")
    try:
        if path.suffix == ".json":
            items = json.loads(content)
            items = items["texts"] if isinstance(items, dict) else items
        elif path.suffix == ".jsonl":
            items = [json.loads(line) for line in content.splitlines() if line.strip()]
        else:
            items = [line for line in content.splitlines() if line.strip()]
    except (ValueError, KeyError, TypeError) as exc:
        raise SinkstudyError(f"cannot parse texts file {path}: {exc}") from None
    texts = _normalise(items, prefix=path.stem)
    if not texts:
        raise SinkstudyError(f"texts file {path} holds no texts")
    return texts


def resolve_texts(texts: TextsArg, default_set: str) -> tuple[list[CalibrationText], str]:
    """Texts and a source label: None -> `default_set`; a shipped set name; a file path; or a list."""
    if texts is None:
        return load_set(default_set), default_set
    if isinstance(texts, (str, os.PathLike)):
        if str(texts) in SHIPPED_SETS:
            return load_set(str(texts)), str(texts)
        if Path(texts).suffix in (".json", ".jsonl", ".txt") or Path(texts).exists():
            return load_texts_file(texts), str(texts)
        raise SinkstudyError(f"unknown calibration set {str(texts)!r}; shipped sets: {', '.join(SHIPPED_SETS)} (or pass a file)")
    out = _normalise(list(texts), prefix="text")
    if not out:
        raise SinkstudyError("no calibration texts given")
    return out, "custom"


def _normalise(items: list, prefix: str) -> list[CalibrationText]:
    out = []
    for i, item in enumerate(items):
        if isinstance(item, CalibrationText):
            out.append(item)
        elif isinstance(item, str):
            out.append(CalibrationText(f"{prefix}-{i:03d}", item))
        elif isinstance(item, dict) and isinstance(item.get("text"), str):
            out.append(CalibrationText(str(item.get("id", f"{prefix}-{i:03d}")), item["text"]))
        else:
            raise SinkstudyError(f"calibration text #{i} is neither a string nor a {{'id', 'text'}} object")
        if not out[-1].text.strip():
            raise SinkstudyError(f"calibration text {out[-1].id} is empty")
    return out


def texts_fingerprint(texts: Sequence[CalibrationText]) -> str:
    h = hashlib.sha256(json.dumps([[t.id, t.text] for t in texts]).encode("utf-8"))
    return "sha256:" + h.hexdigest()[:32]


def encode_texts(tokenizer, texts: Sequence[CalibrationText], *, apply_chat_template: bool, max_length: int) -> list[list[int]]:
    """Token ids per text, truncated to `max_length`.

    With the chat template each text becomes one user turn plus the generation prompt, as lm-eval
    does for the paper's chat-template evals; the template supplies any BOS itself.
    """
    ids = []
    for t in texts:
        if apply_chat_template:
            prompt = tokenizer.apply_chat_template([{"role": "user", "content": t.text}], tokenize=False, add_generation_prompt=True)
            seq = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        else:
            seq = tokenizer(t.text, add_special_tokens=True)["input_ids"]
        ids.append(list(seq[:max_length]))
    return ids
