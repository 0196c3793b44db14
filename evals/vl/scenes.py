"""Generated multi-object scenes: a seeded 64x64 picture of 1-4 coloured shapes in a 3x3 grid of places,
with the facts every description, question and answer about it is written from.

`scene(split, index)` is a pure function of its arguments (its own random stream per split and index),
so train and held-out scenes are different pictures by construction and any scene can be redrawn
from its (split, index) alone. Shapes and colours are easy-VQA's (`evals.vl.easyvqa`), sizes small /
large, places named by row and column ("top left", "center", ...). `patch_labels` gives, per square
patch, which object covers most of it (0: background): the tower's dense pretraining target."""

from __future__ import annotations

import random
from dataclasses import dataclass

from evals.vl.easyvqa import COLOURS, SHAPES
from sinkstudy import SinkstudyError

SIZE = 64
SPLITS = ("train", "heldout")
RGB = {"red": (214, 39, 40), "green": (44, 160, 44), "blue": (31, 90, 220), "black": (20, 20, 20),
       "gray": (127, 127, 127), "teal": (0, 128, 128), "brown": (140, 86, 40), "yellow": (230, 200, 20)}
ROWS, COLS = ("top", "middle", "bottom"), ("left", "center", "right")
MAX_OBJECTS = 4
_SALT = {"train": 0x5CE7E, "heldout": 0xE1D0}


@dataclass(frozen=True)
class Thing:
    shape: str
    colour: str
    size: str  # small | large
    row: int
    col: int
    dx: int  # jitter of the centre inside its cell
    dy: int

    @property
    def name(self) -> str:
        return f"{self.colour} {self.shape}"

    @property
    def place(self) -> str:
        return place_name(self.row, self.col)

    def box(self) -> tuple[int, int, int, int]:
        cell = SIZE / 3
        cx, cy = int(cell * (self.col + 0.5)) + self.dx, int(cell * (self.row + 0.5)) + self.dy
        r = 9 if self.size == "large" else 5
        return cx - r, cy - r, cx + r, cy + r


@dataclass(frozen=True)
class Scene:
    split: str
    index: int
    background: tuple[int, int, int]
    things: tuple[Thing, ...]

    def count(self, shape: str | None = None, colour: str | None = None) -> int:
        return sum((shape is None or t.shape == shape) and (colour is None or t.colour == colour) for t in self.things)

    def unique(self, thing: Thing) -> bool:
        """No other object has this one's colour and shape (it can be named without ambiguity)."""
        return self.count(thing.shape, thing.colour) == 1


def place_name(row: int, col: int) -> str:
    if (row, col) == (1, 1):
        return "center"
    if row == 1:
        return COLS[col]
    return ROWS[row] if col == 1 else f"{ROWS[row]} {COLS[col]}"


def location(place: str) -> str:
    """A place as a phrase: "in the top left corner", "on the left", "at the top", "in the center"."""
    if place == "center":
        return "in the center"
    if place in COLS:
        return f"on the {place}"
    if place in ROWS:
        return f"at the {place}"
    return f"in the {place} corner"


def scene(split: str, index: int) -> Scene:
    if split not in SPLITS:
        raise SinkstudyError(f"scene split must be train or heldout, got {split!r}")
    rng = random.Random(_SALT[split] * 1_000_003 + index)
    cells = rng.sample([(r, c) for r in range(3) for c in range(3)], rng.randint(1, MAX_OBJECTS))
    things = tuple(Thing(rng.choice(SHAPES), rng.choice(COLOURS), rng.choice(("small", "large")), r, c,
                         rng.randint(-2, 2), rng.randint(-2, 2)) for r, c in sorted(cells))
    background = tuple(rng.randint(225, 250) for _ in range(3))
    return Scene(split, index, background, things)


def render(s: Scene):
    """The scene as a 64x64 RGB PIL image."""
    # lazy: loads PIL
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (SIZE, SIZE), s.background)
    draw = ImageDraw.Draw(image)
    for t in s.things:
        _draw(draw, t, RGB[t.colour])
    return image


def patch_labels(s: Scene, patch: int) -> list[int]:
    """Per patch (row-major), 1 + the index in `s.things` of the object covering most of the patch, or 0
    where objects cover under a sixteenth of it."""
    # lazy: loads numpy, PIL
    import numpy as np
    from PIL import Image, ImageDraw

    mask = Image.new("L", (SIZE, SIZE), 0)
    draw = ImageDraw.Draw(mask)
    for k, t in enumerate(s.things):
        _draw(draw, t, k + 1)
    m = np.asarray(mask)
    n = SIZE // patch
    out = []
    for r in range(n):
        for c in range(n):
            block = m[r * patch:(r + 1) * patch, c * patch:(c + 1) * patch]
            counts = np.bincount(block.ravel(), minlength=len(s.things) + 1)
            best = int(counts[1:].argmax()) + 1 if len(counts) > 1 else 0
            out.append(best if counts[best] * 16 >= block.size else 0)
    return out


def _draw(draw, t: Thing, fill) -> None:
    x0, y0, x1, y1 = t.box()
    if t.shape == "circle":
        draw.ellipse((x0, y0, x1, y1), fill=fill)
    elif t.shape == "rectangle":
        draw.rectangle((x0, y0 + (x1 - x0) // 5, x1, y1 - (x1 - x0) // 5), fill=fill)
    else:
        draw.polygon([((x0 + x1) // 2, y0), (x1, y1), (x0, y1)], fill=fill)
