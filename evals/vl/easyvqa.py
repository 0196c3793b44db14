"""easy-VQA (PyPI `easy-vqa` 1.0, MIT licence, Victor Zhou): 64x64 images of one coloured shape and
short-answer questions about them, read offline from the installed package.

Its train split (4,000 images, 38,575 questions) and test split (1,000 images, 9,673 questions) are
separate image sets; `questions(split)` gives (question, answer, image path, question type) with the
type read off the answer: "shape" (circle / rectangle / triangle), "colour" (8 colours) or "yes/no".
Test images whose file equals a train image's (the generator can draw the same scene twice) are
left out of the test split, so a held-out question never shows a training image."""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path

from sinkstudy import SinkstudyError

SHAPES = ("circle", "rectangle", "triangle")
COLOURS = ("red", "green", "blue", "black", "gray", "teal", "brown", "yellow")
SPLITS = ("train", "test")


def data_dir() -> Path:
    try:
        import easy_vqa  # its absence is said in one line
    except ImportError:
        raise SinkstudyError("easy-VQA is not installed: pip install easy-vqa==1.0") from None
    return Path(easy_vqa.__file__).parent / "data"


def question_type(answer: str) -> str:
    return "shape" if answer in SHAPES else "colour" if answer in COLOURS else "yes/no"


@functools.lru_cache(maxsize=2)
def questions(split: str) -> tuple[tuple[str, str, str, str], ...]:
    """(question, answer, image path, type) of `split`; the test split without images a train image equals."""
    if split not in SPLITS:
        raise SinkstudyError(f"easy-VQA split must be train or test, got {split!r}")
    root = data_dir() / split
    rows = json.loads((root / "questions.json").read_text(encoding="utf-8"))
    dropped = _test_images_seen_in_train() if split == "test" else frozenset()
    return tuple((q, a, str(root / "images" / f"{i}.png"), question_type(a)) for q, a, i in rows if i not in dropped)


@functools.lru_cache(maxsize=1)
def _test_images_seen_in_train() -> frozenset:
    def digests(split):
        folder = data_dir() / split / "images"
        return {int(p.stem): hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.glob("*.png")}

    train = set(digests("train").values())
    return frozenset(i for i, d in digests("test").items() if d in train)
