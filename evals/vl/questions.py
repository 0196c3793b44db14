"""Short-answer questions about the visual world, shared by training data and the held-out VQA eval.

Every question carries a type (what it asks: count, where, colour, shape, yes/no, digit) and a one- or
two-word answer. The format instruction LLaVA-1.5 puts after each short-answer question (`SHORT`) is
added by the caller. `answers(type)` is the type's whole answer set (the uniform chance level).
"""

from __future__ import annotations

import random

from evals.vl.easyvqa import COLOURS, SHAPES
from evals.vl.scenes import COLS, MAX_OBJECTS, ROWS, Scene, location, place_name

SHORT = "Answer the question using a single word or phrase."
TYPES = ("count", "where", "colour", "shape", "yes/no", "digit")
_NUMBERS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")


def answers(kind: str) -> tuple[str, ...]:
    """Every answer a question of this type can have."""
    return {"count": tuple(str(i) for i in range(MAX_OBJECTS + 1)),
            "where": tuple(place_name(r, c) for r in range(len(ROWS)) for c in range(len(COLS))),
            "colour": COLOURS, "shape": SHAPES, "yes/no": ("yes", "no"), "digit": tuple(str(i) for i in range(10))}[kind]


def plural(shape: str) -> str:
    return f"{shape}s"


def number_word(n: int) -> str:
    return _NUMBERS[n]


def scene_questions(s: Scene, rng: random.Random) -> list[tuple[str, str, str]]:
    """(question, answer, type) about scene `s`: one of each type that applies, wordings drawn by `rng`."""
    out = []
    shape = rng.choice(SHAPES)
    colour = rng.choice(COLOURS)
    out.append(rng.choice([
        ("How many shapes are there?", str(len(s.things))),
        ("How many objects are in the image?", str(len(s.things))),
        (f"How many {plural(shape)} are there?", str(s.count(shape=shape))),
        (f"How many {colour} shapes are there?", str(s.count(colour=colour))),
    ]) + ("count",))
    named = [t for t in s.things if s.unique(t)]
    if named:
        t = rng.choice(named)
        out.append((rng.choice([f"Where is the {t.name}?", f"Where is the {t.name} in the image?",
                                f"In which part of the image is the {t.name}?"]), t.place, "where"))
    t = rng.choice(s.things)
    where = location(t.place)
    out.append((rng.choice([f"What color is the {t.shape} {where}?", f"What is the color of the shape {where}?"]), t.colour, "colour"))
    out.append((rng.choice([f"What shape is {where}?", f"What is the {t.colour} shape {where}?"]), t.shape, "shape"))
    ask_colour, ask_shape = (rng.choice(s.things).colour, rng.choice(s.things).shape) if rng.random() < 0.5 else (colour, shape)
    out.append((rng.choice([f"Is there a {ask_colour} {ask_shape}?", f"Does the image contain a {ask_colour} {ask_shape}?"]),
                "yes" if s.count(ask_shape, ask_colour) else "no", "yes/no"))
    return out


def digit_question(rng: random.Random) -> str:
    return rng.choice(["What digit is this?", "Which digit is shown?", "What number is written in the image?"])
