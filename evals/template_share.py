"""Template share: the fraction of a model's eval answers that open like a VL training answer.

A VL recipe whose answers share a template can teach the LM to answer *every* prompt that way (a collapse:
"It is a d." to an essay prompt); a strict-grader loss then measures the template, not erosion. The share
tells the two apart. Definition (`N` = 4 words):

- words(text): the text lower-cased, every run of characters other than letters and digits a separator,
  every number (digits or a number word up to twelve) written "#" ("It is a 7." and "It is a 3." share a template);
- the openings of the training answers: words(a)[:N] for each VL training answer a of at least N words,
  and the whole words(a) of each shorter one ("yes", "top left", "7");
- an eval answer *opens like a training answer* when words(answer)[:N] is an opening of a long training
  answer, or words(answer) is exactly a short training answer;
- template share = those answers / all eval answers.

Only the answers of image records count as training answers (the text-only share is the base's own
replies). `openings(answers)` builds the set once per recipe; `template_share(outputs, openings)`
scores any model's eval outputs against it (`EvalRun.samples[task][i]["output"]`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Iterable

N_WORDS = 4
# At or above this share a model's text loss is read as collapse to the VL template, not erosion (the erosion
# regime's recipe keeps its control below it).
COLLAPSE_SHARE = 0.10
_SEP = re.compile(r"[^0-9a-z]+")


_NUMBER_WORDS = frozenset(("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve"))


def words(text: str) -> tuple[str, ...]:
    return tuple("#" if w.isdigit() or w in _NUMBER_WORDS else w for w in _SEP.split(text.lower()) if w)


@dataclass(frozen=True)
class Openings:
    """The openings of a set of training answers (see the module doc)."""

    long: frozenset
    short: frozenset
    n_words: int = N_WORDS
    n_answers: int = 0

    def matches(self, text: str) -> bool:
        w = words(text)
        return w[:self.n_words] in self.long if len(w) >= self.n_words else w in self.short

    def as_dict(self) -> dict:
        """JSON form: each opening as its words joined by spaces, sorted."""
        return {"long": sorted(" ".join(w) for w in self.long), "short": sorted(" ".join(w) for w in self.short),
                "n_words": self.n_words, "n_answers": self.n_answers}

    @classmethod
    def from_dict(cls, d: dict) -> "Openings":
        return cls(frozenset(tuple(x.split()) for x in d["long"]), frozenset(tuple(x.split()) for x in d["short"]),
                   d["n_words"], d["n_answers"])


def openings(answers: Iterable[str], n_words: int = N_WORDS) -> Openings:
    long, short, n = set(), set(), 0
    for a in answers:
        w = words(a)
        n += 1
        if len(w) >= n_words:
            long.add(w[:n_words])
        elif w:
            short.add(w)
    return Openings(frozenset(long), frozenset(short), n_words, n)


@dataclass
class TemplateShare:
    share: float
    n: int
    templated: int
    examples: list[str] = field(default_factory=list)  # up to 5 templated answers, as they were

    def as_dict(self) -> dict:
        return {"share": self.share, "n": self.n, "templated": self.templated, "examples": self.examples}


def template_share(outputs: Iterable[str], opening_set: Openings) -> TemplateShare:
    outputs = list(outputs)
    hits = [o for o in outputs if opening_set.matches(o)]
    return TemplateShare(len(hits) / len(outputs) if outputs else 0.0, len(outputs), len(hits), [h[:120] for h in hits[:5]])
