"""Seeded VL instruction data in LLaVA-1.5's kinds, generated offline from the visual world (`evals.vl`).

A data spec `{"generated": KIND, "n": N, "split": "train" | "heldout", "seed": S}` (`interventions.adapt.sources`)
gives N records of one kind, each a pure function of (kind, split, seed, index), made on access:
    easyvqa       easy-VQA's own questions (its train split; "heldout": its test split) + the format instruction
    scene_vqa     short-answer questions about a generated scene (count, where, colour, shape, yes/no) + the instruction
    digit_vqa     "What digit is this?" on the 8x8 digits (their seeded split) + the instruction, answered "7"
    caption       a brief caption of a scene (LLaVA's stage-1 pretraining kind)
    detail        a detailed description of a scene, from many openings, sentence frames and orders
    conversation  2-4 turns of questions about a scene answered in full sentences (LLaVA-Instruct "conversation")
    reasoning     counting, comparison and where-is questions answered with their reasoning ("complex reasoning")

Train records use the "train" scenes, easy-VQA's train images and the digits' train split; held-out
records come from disjoint image sets (`evals.vl`), so held-out images never appear in training.
Short-answer questions carry LLaVA-1.5's instruction "Answer the question using a single word or
phrase." (`evals.vl.questions.SHORT`) after the question, as in LLaVA-665K.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from evals.vl import digits, easyvqa, scenes
from evals.vl.questions import SHORT, digit_question, number_word, plural, scene_questions
from sinkstudy import SinkstudyError

KINDS = ("easyvqa", "scene_vqa", "digit_vqa", "caption", "detail", "conversation", "reasoning")
IMAGE = "<image>"

CAPTION_PROMPTS = (
    "Describe the image concisely.", "Provide a brief description of the given image.",
    "Offer a succinct explanation of the picture presented.", "Summarize the visual content of the image.",
    "Give a short and clear explanation of the image.", "Share a concise interpretation of the image provided.",
    "Write a terse but informative summary of the picture.", "Render a clear and concise summary of the image.")
DETAIL_PROMPTS = (
    "Describe the following image in detail.", "Provide a detailed description of the given image.",
    "Give an elaborate explanation of the image you see.", "Share a comprehensive rundown of the presented image.",
    "Explain the various aspects of the image before you.", "Clarify the contents of the displayed image with great detail.",
    "Characterize the image using a well-detailed description.", "Break down the elements of the image in a detailed manner.",
    "Walk through the important details of the image.", "Portray the image with a rich, descriptive narrative.",
    "Narrate the contents of the image with precision.", "Analyze the image in a comprehensive and detailed manner.",
    "Examine the image closely and share its details.", "Write an exhaustive depiction of the given image.")
_SALT = {k: i + 1 for i, k in enumerate(KINDS)}


class GeneratedRows(Sequence):
    """`n` records of one kind, each made when it is read."""

    def __init__(self, kind: str, n: int, split: str = "train", seed: int = 0):
        if kind not in KINDS:
            raise SinkstudyError(f"unknown generated data kind {kind!r}; choose from {', '.join(KINDS)}")
        if split not in ("train", "heldout"):
            raise SinkstudyError(f"generated data split must be train or heldout, got {split!r}")
        self.kind, self.n, self.split, self.seed = kind, n, split, seed
        if kind == "easyvqa":
            pool = easyvqa.questions("train" if split == "train" else "test")
            self._order = random.Random(seed).sample(range(len(pool)), min(n, len(pool)))
            self.n = len(self._order)
        elif kind == "digit_vqa":
            pool = digits.split_indices(split)
            self._order = [pool[i % len(pool)] for i in random.Random(seed).sample(range(len(pool)), len(pool))]

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        if not 0 <= i < self.n:
            raise IndexError(i)
        rng = random.Random((self.seed * 1_000_003 + _SALT[self.kind]) * 1_000_003 + i)
        if self.kind == "easyvqa":
            q, a, path, kind = easyvqa.questions("train" if self.split == "train" else "test")[self._order[i]]
            return _short(path, q[0].upper() + q[1:], a, kind)
        if self.kind == "digit_vqa":
            index = self._order[i % len(self._order)]
            return _short(digits.rgb(index), digit_question(rng), str(digits.label(index)), "digit")
        # scene kinds: a scene per record, drawn from the split's stream at a kind-specific offset
        s = scenes.scene(self.split, (_SALT[self.kind] * 10_000_019 + self.seed * 7919 + i) % 2**31)
        image = scenes.render(s)
        if self.kind == "scene_vqa":
            q, a, kind = rng.choice(scene_questions(s, rng))
            return _short(image, q, a, kind)
        if self.kind == "caption":
            return _chat(image, [(rng.choice(CAPTION_PROMPTS), caption(s, rng))])
        if self.kind == "detail":
            return _chat(image, [(rng.choice(DETAIL_PROMPTS), describe(s, rng))])
        if self.kind == "conversation":
            return _chat(image, conversation(s, rng))
        return _chat(image, [reasoning(s, rng)])


def _short(image, question: str, answer: str, kind: str) -> dict:
    return {"images": [image], "question_type": kind,
            "messages": [{"role": "user", "content": f"{IMAGE}\n{question}\n{SHORT}"}, {"role": "assistant", "content": answer}]}


def _chat(image, turns: list[tuple[str, str]]) -> dict:
    messages = []
    for k, (q, a) in enumerate(turns):
        messages += [{"role": "user", "content": f"{IMAGE}\n{q}" if k == 0 else q}, {"role": "assistant", "content": a}]
    return {"images": [image], "messages": messages}


# --------------------------------------------------------------------------- language about a scene

def _a(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def _thing(t, rng, *, size: bool = True) -> str:
    words = ([t.size] if size and rng.random() < 0.7 else []) + [t.colour, t.shape]
    return f"{_a(words[0])} {' '.join(words)}"


def _count_phrase(n: int, noun: str, rng) -> str:
    word = number_word(n) if rng.random() < 0.7 else str(n)
    return f"{word} {noun if n == 1 else plural(noun)}"


def _listing(parts: list[str]) -> str:
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


def caption(s, rng) -> str:
    parts = [_thing(t, rng, size=False) for t in s.things]
    text = rng.choice(["{} on a plain background.", "{} on a light background.", "A simple picture of {}.", "{}."]).format(_listing(parts))
    return text[0].upper() + text[1:]


def describe(s, rng) -> str:
    things = list(s.things)
    order = rng.choice(["rows", "size", "random"])
    if order == "size":
        things.sort(key=lambda t: t.size != "large")
    elif order == "random":
        rng.shuffle(things)
    n = len(things)
    opening = rng.choice([
        f"The image shows {_count_phrase(n, 'shape', rng)} on a plain, light background.",
        f"This is a simple drawing with {_count_phrase(n, 'object', rng)} placed on a pale background.",
        f"In this picture there {'is' if n == 1 else 'are'} {_count_phrase(n, 'geometric shape', rng)} against a light, uniform background.",
        f"The picture contains {_count_phrase(n, 'colored shape', rng)} arranged on an otherwise empty canvas.",
    ])
    frames = [
        lambda t: f"{scenes.location(t.place).capitalize()} there is {_thing(t, rng)}.",
        lambda t: f"{_thing(t, rng).capitalize()} sits {scenes.location(t.place)}.",
        lambda t: f"{scenes.location(t.place).capitalize()}, you can see {_thing(t, rng)}.",
        lambda t: f"There is {_thing(t, rng)} {scenes.location(t.place)}.",
        lambda t: f"{_thing(t, rng).capitalize()} appears {scenes.location(t.place)} of the image.",
    ]
    body = [rng.choice(frames)(t) for t in things]
    tail = []
    shapes = {sh: s.count(shape=sh) for sh in easyvqa.SHAPES if s.count(shape=sh)}
    if n > 1 and rng.random() < 0.6:
        tail.append("In total, the image contains " + _listing([_count_phrase(k, sh, rng) for sh, k in shapes.items()]) + ".")
    if rng.random() < 0.4:
        tail.append(rng.choice(["The shapes do not overlap.", "Each shape is drawn in a single flat color.",
                                "There is no text or other detail in the image.", "The background is empty apart from the shapes."]))
    return " ".join([opening] + body + tail)


def conversation(s, rng) -> list[tuple[str, str]]:
    n = len(s.things)
    pool = [
        (rng.choice(["How many shapes are in the image?", "How many objects can you see?"]),
         f"There {'is' if n == 1 else 'are'} {_count_phrase(n, 'shape', rng)} in the image: "
         + _listing([_thing(t, rng, size=False) for t in s.things]) + "."),
        (rng.choice(["What colors appear in the image?", "Which colors do the shapes have?"]),
         "The shapes are " + _listing(sorted({t.colour for t in s.things})) + "."),
    ]
    for t in rng.sample(s.things, min(2, n)):
        if s.unique(t):
            pool.append((f"Where is the {t.name}?", rng.choice([
                f"The {t.name} is {scenes.location(t.place)} of the image.", f"It is {scenes.location(t.place)}.",
                f"You can find the {t.name} {scenes.location(t.place)}."])))
        pool.append((f"What is {scenes.location(t.place)}?", f"{_thing(t, rng).capitalize()} is {scenes.location(t.place)}."))
        pool.append((f"Is the {t.shape} {scenes.location(t.place)} large or small?",
                     f"It is {t.size}" + rng.choice([".", f" compared with the size of the picture."])))
    colour, shape = rng.choice(easyvqa.COLOURS), rng.choice(easyvqa.SHAPES)
    present = s.count(shape, colour)
    pool.append((f"Is there {_a(colour)} {colour} {shape} in the image?",
                 f"Yes, there is {_a(colour)} {colour} {shape}." if present else
                 rng.choice([f"No, there is no {colour} {shape} in the image.", f"No. None of the shapes is {_a(colour)} {colour} {shape}."])))
    return rng.sample(pool, min(len(pool), rng.randint(2, 4)))


def reasoning(s, rng) -> tuple[str, str]:
    things = list(s.things)
    choices = ["count"] + (["compare"] if len(things) > 1 else []) + (["relative"] if len(things) > 1 else [])
    kind = rng.choice(choices)
    if kind == "count":
        shape = rng.choice(easyvqa.SHAPES)
        hits = [t for t in things if t.shape == shape]
        q = rng.choice([f"Count the {plural(shape)} in the image and explain how you counted them.",
                        f"How many {plural(shape)} are there? Explain your answer."])
        if not hits:
            a = f"There are no {plural(shape)} in the image. The shapes it contains are " + _listing([_thing(t, rng) for t in things]) + \
                f", and none of them is {_a(shape)} {shape}, so the count is zero."
        else:
            a = "Going through the shapes one by one: " + "; ".join(
                f"{_thing(t, rng)} {scenes.location(t.place)}" for t in things) + \
                f". Of these, {_count_phrase(len(hits), shape, rng)} {'is' if len(hits) == 1 else 'are'} present, so the answer is {len(hits)}."
        return q, a
    a_, b_ = rng.sample(things, 2)
    if kind == "compare":
        q = f"Which is bigger, the {a_.name} or the {b_.name}?" if s.unique(a_) and s.unique(b_) else \
            f"Are there more {plural(a_.shape)} than {plural(b_.shape)} in the image?" if a_.shape != b_.shape else \
            f"How many {plural(a_.shape)} are there, and do they have the same color?"
        if q.startswith("Which"):
            if a_.size == b_.size:
                a = f"Both are {a_.size}: the {a_.name} and the {b_.name} are drawn at about the same size, so neither is clearly bigger."
            else:
                big, small = (a_, b_) if a_.size == "large" else (b_, a_)
                a = f"The {big.name} is bigger. It is a large shape, while the {small.name} is a small one."
        elif q.startswith("Are there"):
            na, nb = s.count(shape=a_.shape), s.count(shape=b_.shape)
            verdict = "Yes" if na > nb else "No"
            a = f"{verdict}. The image has {_count_phrase(na, a_.shape, rng)} and {_count_phrase(nb, b_.shape, rng)}" + \
                (", so the numbers are equal." if na == nb else ".")
        else:
            same = [t for t in things if t.shape == a_.shape]
            colours = sorted({t.colour for t in same})
            a = f"There are {_count_phrase(len(same), a_.shape, rng)}. " + \
                ("They share the same color, " + colours[0] + "." if len(colours) == 1 else "They have different colors: " + _listing(colours) + ".")
        return q, a
    horizontal = a_.col != b_.col and (a_.row == b_.row or rng.random() < 0.5)
    if horizontal:
        q = f"Is the {a_.shape} {scenes.location(a_.place)} to the left of the {b_.shape} {scenes.location(b_.place)}?"
        left = a_.col < b_.col
        a = f"{'Yes' if left else 'No'}. The {a_.name} is in the {scenes.COLS[a_.col]} column and the {b_.name} is in the " \
            f"{scenes.COLS[b_.col]} column, so it is {'to the left of' if left else 'to the right of'} it."
    else:
        q = f"Is the {a_.shape} {scenes.location(a_.place)} above the {b_.shape} {scenes.location(b_.place)}?"
        above = a_.row < b_.row
        if a_.row == b_.row:
            a = f"No. The two shapes are in the same row ({scenes.ROWS[a_.row]}), so neither is above the other."
        else:
            a = f"{'Yes' if above else 'No'}. The {a_.name} is in the {scenes.ROWS[a_.row]} row and the {b_.name} is in the " \
                f"{scenes.ROWS[b_.row]} row, so it is {'above' if above else 'below'} it."
    return q, a


def check(spec: dict) -> None:
    """A `generated` spec's settings, checked before any work (one line)."""
    n = spec.get("n")
    if spec["generated"] not in KINDS:
        raise SinkstudyError(f"unknown generated data kind {spec['generated']!r}; choose from {', '.join(KINDS)}")
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise SinkstudyError(f"generated data {spec['generated']}: n must be a positive integer, got {n!r}")
    if spec.get("split", "train") not in ("train", "heldout"):
        raise SinkstudyError(f"generated data split must be train or heldout, got {spec.get('split')!r}")
