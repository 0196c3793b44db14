"""Held-out VQA: short-answer questions on images no training record shows, scored by greedy generation and
normalised exact match, per question type, with each type's chance.

The items (`heldout_items`) come from the held-out halves of the visual world (`evals.vl`): easy-VQA's
test split (shape, colour, yes/no), held-out scenes (count, where, colour, shape, yes/no) and the digits'
held-out split (digit). Each question carries LLaVA-1.5's format instruction, as the training's
short-answer questions do. `normalise` lower-cases, drops punctuation and articles and writes number
words as digits ("Three." -> "3", "the top left" -> "top left", "grey" -> "gray"); an answer is right when
it equals the reference after that. Chance per type: uniform over the type's answer set
(`evals.vl.questions.answers`) and the majority answer's share among the items, both reported.

`vqa_accuracy(model, processor, items)` scores a saved LLaVA-style VLM (loaded by the caller); the same
items run under lm-eval as the `sinkstudy_vqa` task (`evals/tasks/sinkstudy_vqa.yaml`, model hf-multimodal).
`choice_accuracy` scores closed-set questions by likelihood instead of generation (a study's held-out digit
probe: which of "It is a 0." ... "It is a 9." the VLM finds most likely), the answers' prefix computed once
per image (`answer_logprobs`).
"""

from __future__ import annotations

import inspect
import math
import random
import re
from collections import Counter
from dataclasses import dataclass
from typing import Callable

from evals.vl import digits, easyvqa, scenes
from evals.vl.questions import SHORT, answers, digit_question, scene_questions

_NUMBERS = {w: str(i) for i, w in enumerate(("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"))}
_SYNONYMS = {"grey": "gray", "square": "rectangle", "centre": "center", "middle": "center"}
_ARTICLES = {"a", "an", "the"}


@dataclass(frozen=True)
class Item:
    image: object  # a path, PIL image or HxWx3 uint8 array
    question: str
    answer: str
    type: str
    source: str  # easyvqa | scenes | digits
    key: str  # identifies the image: easy-VQA's file, "scene:heldout:<i>", "digit:<index>"

    @property
    def prompt(self) -> str:
        return f"<image>\n{self.question}\n{SHORT}"


def heldout_items(n_easyvqa: int = 120, n_scenes: int = 120, n_digits: int = 60, seed: int = 0) -> list[Item]:
    """The held-out questions: a seeded sample of easy-VQA's test split, one question per held-out scene
    (types in turn), and held-out digits."""
    rng = random.Random(seed)
    pool = easyvqa.questions("test")
    items = [Item(p, q[0].upper() + q[1:], a, t, "easyvqa", p) for q, a, p, t in (pool[i] for i in rng.sample(range(len(pool)), n_easyvqa))]
    kinds = ("count", "where", "colour", "shape", "yes/no")
    i = 0
    while sum(it.source == "scenes" for it in items) < n_scenes:
        s = scenes.scene("heldout", i)
        want = kinds[sum(it.source == "scenes" for it in items) % len(kinds)]
        asked = [x for x in scene_questions(s, rng) if x[2] == want]
        if asked:
            q, a, t = asked[0]
            items.append(Item(scenes.render(s), q, a, t, "scenes", f"scene:heldout:{i}"))
        i += 1
    for index in digits.split_indices("heldout")[:n_digits]:
        items.append(Item(digits.rgb(index), digit_question(rng), str(digits.label(index)), "digit", "digits", f"digit:{index}"))
    return items


def normalise(text: str) -> str:
    w = [x for x in re.split(r"[^0-9a-z]+", text.lower()) if x]
    w = [_NUMBERS.get(x, _SYNONYMS.get(x, x)) for x in w if x not in _ARTICLES]
    if w and w[-1] == "corner":
        w = w[:-1]
    return " ".join(w)


@dataclass
class VQAScore:
    accuracy: float
    n: int
    by_type: dict  # type -> {accuracy, n, chance (uniform), majority (the commonest answer's share)}

    def as_dict(self) -> dict:
        return {"accuracy": self.accuracy, "n": self.n, "by_type": self.by_type}


def score(predictions: list[str], items: list[Item]) -> VQAScore:
    right = [normalise(p) == normalise(it.answer) for p, it in zip(predictions, items, strict=True)]
    by_type = {}
    for t in sorted({it.type for it in items}):
        idx = [k for k, it in enumerate(items) if it.type == t]
        counts = Counter(normalise(items[k].answer) for k in idx)
        by_type[t] = {"accuracy": sum(right[k] for k in idx) / len(idx), "n": len(idx),
                      "chance": 1 / len(answers(t)), "majority": max(counts.values()) / len(idx)}
    return VQAScore(sum(right) / len(right) if right else 0.0, len(right), by_type)


def generate_answers(model, processor, items: list[Item], *, batch_size: int = 16, max_new_tokens: int = 8) -> list[str]:
    """Greedy answers of a LLaVA-style VLM (its processor's chat template and image processor)."""
    # lazy: loads torch, numpy
    import torch

    tok = processor.tokenizer
    side, tok.padding_side = tok.padding_side, "left"
    out = []
    try:
        for start in range(0, len(items), batch_size):
            chunk = items[start:start + batch_size]
            # "<image>" marks the image (the training data's convention); the processor expands its own token
            texts = [tok.apply_chat_template([{"role": "user", "content": it.prompt.replace("<image>", processor.image_token)}],
                                             tokenize=False, add_generation_prompt=True) for it in chunk]
            # the chat template writes the special tokens itself (as the training encoder does)
            inputs = processor(text=texts, images=[_rgb(it.image) for it in chunk], padding=True, return_tensors="pt",
                               add_special_tokens=False)
            with torch.no_grad():
                gen = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                                     pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)
            out += tok.batch_decode(gen[:, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    finally:
        tok.padding_side = side
    return [o.strip() for o in out]


def vqa_accuracy(model, processor, items: list[Item] | None = None, **kw) -> tuple[VQAScore, list[str]]:
    """(score, answers) of a VLM on the held-out items (default `heldout_items()`)."""
    items = heldout_items() if items is None else items
    predictions = generate_answers(model, processor, items, **kw)
    return score(predictions, items), predictions


def image_of(key: str):
    """An item's image from its key: an easy-VQA file path, "scene:<split>:<i>" or "digit:<index>"."""
    kind, _, rest = key.partition(":")
    if kind == "scene":
        split, _, index = rest.partition(":")
        return scenes.render(scenes.scene(split, int(index)))
    if kind == "digit":
        return _rgb(digits.rgb(int(rest)))
    return _rgb(key)


def _rgb(image):
    # lazy: loads numpy, PIL
    import numpy as np
    from PIL import Image

    if isinstance(image, np.ndarray):
        return Image.fromarray(image).convert("RGB")
    return image.convert("RGB") if hasattr(image, "convert") else Image.open(image).convert("RGB")


# --------------------------------------------------------------------------- answers by likelihood

def choice_accuracy(model, records: list[dict], choices: list[str], encode: Callable[[dict], dict],
                    collate: Callable[[list[dict]], dict], *, images_per_pass: int = 8) -> dict:
    """Held-out VL skill by likelihood: per record (its `images`, its question as `messages[0]`, its `label` an
    index into `choices`) the answer the VLM finds most likely (the summed log-probability of its tokens), the
    share of records answered right, and the mean answer-token NLL of the right answer (exp: its perplexity).
    `encode` turns a record with an assistant answer into model features and `collate` batches them: the
    caller's, so the prompts read as the model was trained on. `images_per_pass` images (each with every
    choice) share one forward pass."""
    # lazy: loads torch, numpy
    import torch

    correct, nll_true = 0, []
    k = len(choices)
    with torch.no_grad():
        for start in range(0, len(records), images_per_pass):
            chunk = records[start:start + images_per_pass]
            feats = [encode({"images": rec["images"], "messages": [rec["messages"][0], {"role": "assistant", "content": answer}]})
                     for rec in chunk for answer in choices]
            score, n_tokens = answer_logprobs(model, collate(feats), rows_per_image=k)
            for rec, s, n in zip(chunk, score.view(-1, k), n_tokens.view(-1, k)):
                correct += int(s.argmax()) == rec["label"]
                nll_true.append(float(-s[rec["label"]] / n[rec["label"]]))
    mean_nll = sum(nll_true) / len(nll_true)
    return {"accuracy": correct / len(records), "answer_nll": mean_nll, "answer_ppl": math.exp(mean_nll), "n_images": len(records)}


def answer_logprobs(vlm, batch: dict, rows_per_image: int):
    """(summed log-probability of each row's answer tokens, their count) for rows that come `rows_per_image` to an
    image, with one text up to where their answers differ: that prefix (image and question, most of each row) runs
    once per image and its KV cache serves each of the image's rows, a fraction of the work of scoring rows whole."""
    # lazy: loads torch, transformers, numpy
    import torch
    from transformers import DynamicCache

    ids, mask, labels = batch["input_ids"], batch["attention_mask"], batch["labels"]
    rows = len(ids)
    shared = ((ids == ids[:1]) & (mask == 1)).all(0).long().cumprod(0)
    cut = max(1, min(int(shared.sum()), ids.shape[1] - 1))  # the continuation keeps at least one token
    firsts = slice(None, None, rows_per_image)
    images = {k: v.reshape(rows, -1, *v.shape[1:])[firsts].flatten(0, 1) for k, v in batch.items()
              if k not in ("input_ids", "attention_mask", "labels")}
    # position t's logits score token t+1: the prefix's last position scores each row's first differing token
    scored = torch.zeros_like(labels, dtype=torch.bool)
    scored[:, :-1] = labels[:, 1:] != -100
    cache = DynamicCache(config=vlm.config)
    cache_kw = "cache" if "cache" in inspect.signature(vlm.forward).parameters else "past_key_values"  # renamed in 5.25
    head = vlm(input_ids=ids[firsts, :cut], attention_mask=mask[firsts, :cut], **images, use_cache=True,
               **{cache_kw: cache}, logits_to_keep=scored[firsts, :cut])
    cache.batch_repeat_interleave(rows_per_image)
    tail = vlm(input_ids=ids[:, cut:], attention_mask=mask, use_cache=True, **{cache_kw: cache}, logits_to_keep=scored[:, cut:])
    positions = scored[0, :cut].nonzero()[:, 0]  # the prefix's scored positions, the same in every row
    head_logp = torch.log_softmax(head.logits.float(), -1).view(-1, len(positions), head.logits.shape[-1])
    image_of = torch.arange(rows) // rows_per_image
    head_part = head_logp[image_of[:, None], torch.arange(len(positions))[None], labels[:, positions + 1]]
    tail_logp = torch.log_softmax(tail.logits.float(), -1).gather(-1, labels[:, cut + 1:][scored[:, cut:-1]].unsqueeze(-1)).squeeze(-1)
    row_of = scored[:, cut:].nonzero()[:, 0]
    score = head_part.sum(1).index_add_(0, row_of, tail_logp)
    n_tokens = torch.full((rows,), float(len(positions))).index_add_(0, row_of, torch.ones_like(tail_logp))
    return score, n_tokens
