"""Procedurally generated text for the miniature study.

Three kinds of text, all from templates and a seeded RNG (no downloaded data):
- strict-format chats: an ordinary request plus one or two IFEval instructions (upper case, end
  with a phrase, JSON, repeat the request, bullets, quotes, title, no commas, postscript...), with
  a response that follows them, so a tiny LM can learn what the strict graders check;
- GSM-style arithmetic chats whose answers end with `The answer is N.`;
- ordinary text (short stories and plain chats without instructions).

Held-out evaluation prompts use entities the training corpus never shows and are written in the
jsonl schemas of lm-eval's IFEval (`key/prompt/instruction_id_list/kwargs`, graded by lm-eval's own
checkers) and GSM8K (`question/answer` with `#### N`).
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from interventions.adapt.sources import varied_digit_caption
from sinkstudy.io import write_text_atomic

# Entities are split in two: the first part trains, the rest only appears in held-out prompts.
_THINGS = [
    ("fox", "animal", "red", "forest"), ("cat", "animal", "grey", "house"), ("dog", "animal", "brown", "yard"),
    ("owl", "bird", "white", "barn"), ("duck", "bird", "yellow", "pond"), ("frog", "animal", "green", "lake"),
    ("bee", "insect", "gold", "garden"), ("horse", "animal", "black", "field"), ("fish", "animal", "blue", "river"),
    ("apple", "fruit", "red", "tree"), ("lemon", "fruit", "yellow", "market"), ("pear", "fruit", "green", "orchard"),
    ("boat", "vehicle", "white", "harbor"), ("train", "vehicle", "silver", "station"), ("kite", "toy", "orange", "park"),
    ("lamp", "object", "brass", "room"), ("chair", "object", "wooden", "kitchen"), ("clock", "object", "round", "hall"),
    ("goat", "animal", "white", "hill"), ("crow", "bird", "black", "roof"), ("plum", "fruit", "purple", "bowl"),
    ("drum", "toy", "loud", "band"), ("bus", "vehicle", "red", "street"), ("cup", "object", "small", "shelf"),
    ("wolf", "animal", "grey", "mountain"), ("swan", "bird", "white", "canal"), ("peach", "fruit", "soft", "basket"),
    ("tram", "vehicle", "green", "square"), ("ball", "toy", "bouncy", "playground"), ("vase", "object", "glass", "table"),
]
_NAMES = ["Ada", "Tom", "Mia", "Leo", "Zoe", "Sam", "Ivy", "Max", "Eva", "Ben", "Lia", "Noah", "Ruth", "Omar",
          "Nina", "Paul", "Sara", "Hugo", "Lena", "Jack"]
_HELDOUT_SHARE = 0.3
_END_PHRASES = ["Is there anything else I can help with?", "Any other questions?", "Let me know if you have additional questions.",
                "That is all.", "Hope this helps."]
_HELDOUT_END_PHRASES = ["Thank you for reading.", "Have a nice day."]

REPEAT_SUFFIX = (
    "First repeat the request word for word without change, then give your answer (1. do not say any words or "
    "characters before repeating the request; 2. the request you need to repeat does not include this sentence)"
)


@dataclass(frozen=True)
class Split:
    things: list
    names: list
    end_phrases: list


def _splits() -> tuple[Split, Split]:
    cut_t = int(len(_THINGS) * (1 - _HELDOUT_SHARE))
    cut_n = int(len(_NAMES) * (1 - _HELDOUT_SHARE))
    return (Split(_THINGS[:cut_t], _NAMES[:cut_n], _END_PHRASES),
            Split(_THINGS[cut_t:], _NAMES[cut_n:], _HELDOUT_END_PHRASES))


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


# --- ordinary requests: (request, plain response, facts for bullets/JSON) -------------------

def _request(rng: random.Random, split: Split) -> tuple[str, str, dict]:
    name, kind, color, place = rng.choice(split.things)
    person = rng.choice(split.names)
    facts = {"name": name, "kind": kind, "color": color, "home": place}
    style = rng.randrange(4)
    if style == 0:
        req = f"Tell me about the {name}."
        resp = f"The {name} is {_article(color)} {color} {kind}, and it lives in the {place}."
    elif style == 1:
        req = f"Write a short story about {person} and the {name}."
        resp = f"{person} saw {_article(color)} {color} {name} in the {place}. {person} smiled, and the {name} stayed for a while."
    elif style == 2:
        req = f"Where does the {name} live?"
        resp = f"The {name} lives in the {place}, where it is safe and quiet."
    else:
        req = f"Describe the {name} in one sentence."
        resp = f"The {name} is {color}, calm, and easy to find in the {place}."
    return req, resp, facts


# --- IFEval instructions: id -> (prompt text, kwargs, transform(response, facts, request)) -----

def _bullets(n: int) -> Callable:
    def apply(resp, facts, req):
        items = [f"The {facts['name']} is {_article(facts['kind'])} {facts['kind']}.", f"It is {facts['color']}.",
                 f"It lives in the {facts['home']}.", f"People like the {facts['name']}."]
        return "\n".join(f"* {x}" for x in items[:n])
    return apply


def _instruction(iid: str, rng: random.Random, split: Split):
    """(text appended to the request, kwargs dict for lm-eval, response transform)."""
    if iid == "change_case:english_capital":
        return ("Your entire response should be in English, and in all capital letters.", {},
                lambda r, f, q: r.upper())
    if iid == "change_case:english_lowercase":
        return ("Your entire response should be in English, and in all lowercase letters. No capital letters are allowed.",
                {}, lambda r, f, q: r.lower())
    if iid == "startend:end_checker":
        phrase = rng.choice(split.end_phrases)
        return (f"Finish your response with this exact phrase {phrase}. No other words should follow this phrase.",
                {"end_phrase": phrase}, lambda r, f, q: f"{r} {phrase}")
    if iid == "startend:quotation":
        return ("Wrap your entire response with double quotation marks.", {}, lambda r, f, q: f'"{r}"')
    if iid == "detectable_format:title":
        return ("Your answer must contain a title, wrapped in double angular brackets, such as <<poem of joy>>.", {},
                lambda r, f, q: f"<<The {f['name']}>>\n{r}")
    if iid == "punctuation:no_comma":
        return ("In your entire response, refrain from the use of any commas.", {},
                lambda r, f, q: r.replace(", and", " and").replace(",", ""))
    if iid == "detectable_format:number_bullet_lists":
        n = rng.randint(2, 4)
        return (f"Your answer must contain exactly {n} bullet points. Use the markdown bullet points such as:\n"
                "* This is point 1. \n* This is point 2", {"num_bullets": n}, _bullets(n))
    if iid == "detectable_format:json_format":
        keys = rng.sample(["name", "kind", "color", "home"], rng.randint(2, 3))
        hint = ", ".join(keys)
        return (f"Use the keys {hint}. Entire output should be wrapped in JSON format. You can use markdown ticks such as ```.",
                {}, lambda r, f, q: json.dumps({k: f[k] for k in keys}))
    if iid == "detectable_content:postscript":
        return ("At the end of your response, please explicitly add a postscript starting with P.S.",
                {"postscript_marker": "P.S."}, lambda r, f, q: f"{r}\nP.S. I like the {f['name']}.")
    if iid == "detectable_format:constrained_response":
        return ('Answer with one of the following options: ("My answer is yes.", "My answer is no.", "My answer is maybe.")',
                {}, lambda r, f, q: "My answer is yes." if f["kind"] in q else "My answer is no.")
    if iid == "combination:repeat_prompt":
        return (REPEAT_SUFFIX, None, lambda r, f, q: f"{q}\n{r}")
    raise KeyError(iid)


INSTRUCTIONS = [
    "change_case:english_capital", "change_case:english_lowercase", "startend:end_checker", "startend:quotation",
    "detectable_format:title", "punctuation:no_comma", "detectable_format:number_bullet_lists",
    "detectable_format:json_format", "detectable_content:postscript", "detectable_format:constrained_response",
    "combination:repeat_prompt",
]
# Pairs whose transforms compose (the first is applied first): upper/lower case last, wrappers outermost.
_PAIRS = [
    ("startend:end_checker", "change_case:english_capital"), ("detectable_format:title", "change_case:english_lowercase"),
    ("punctuation:no_comma", "startend:end_checker"), ("detectable_content:postscript", "change_case:english_capital"),
    ("punctuation:no_comma", "startend:quotation"), ("detectable_format:title", "punctuation:no_comma"),
]


def ifeval_example(rng: random.Random, split: Split, key: int) -> tuple[dict, str]:
    """One IFEval-schema record and the response that follows every instruction in it."""
    ids = list(rng.choice(_PAIRS)) if rng.random() < 0.3 else [rng.choice(INSTRUCTIONS)]
    req, resp, facts = _request(rng, split)
    if "detectable_format:constrained_response" in ids:
        kind = rng.choice([facts["kind"], rng.choice(["machine", "cloud", "planet"])])
        req = f"Is the {facts['name']} {_article(kind)} {kind}?"
    texts, kwargs = [], []
    for iid in ids:
        text, kw, transform = _instruction(iid, rng, split)
        texts.append(text)
        kwargs.append(kw)
        resp = transform(resp, facts, req)
    prompt = " ".join([req, *texts])
    for i, iid in enumerate(ids):
        if iid == "combination:repeat_prompt":  # the request is what must be repeated
            kwargs[i] = {"prompt_to_repeat": req}
    return {"key": key, "prompt": prompt, "instruction_id_list": ids, "kwargs": kwargs}, resp


def gsm_example(rng: random.Random, split: Split) -> tuple[str, str, int]:
    """(question, step-by-step solution ending `The answer is N.`, N)."""
    person = rng.choice(split.names)
    item = rng.choice(split.things)[0] + "s"
    a, b = rng.randint(2, 9), rng.randint(1, 9)
    op = rng.randrange(3)
    if op == 0:
        q = f"{person} has {a} {item} and gets {b} more. How many {item} does {person} have now?"
        n, work = a + b, f"{person} has {a} {item}. {person} gets {b} more. {a} + {b} = {a + b}."
    elif op == 1:
        a, b = max(a, b), min(a, b)
        q = f"{person} has {a} {item} and gives away {b}. How many {item} are left?"
        n, work = a - b, f"{person} starts with {a} {item}. {person} gives away {b}. {a} - {b} = {a - b}."
    else:
        a, b = rng.randint(2, 5), rng.randint(2, 5)
        q = f"{person} buys {a} bags with {b} {item} in each bag. How many {item} does {person} buy?"
        n, work = a * b, f"There are {a} bags. Each bag has {b} {item}. {a} * {b} = {a * b}."
    return q, f"{work} The answer is {n}.", n


def gsm_user_text(question: str) -> str:
    """The user turn lm-eval's gsm8k-cot (sinkstudy_gsm, zero-shot) builds from a question."""
    return f"Q: {question}\nA:"


def story(rng: random.Random, split: Split) -> str:
    person, other = rng.sample(split.names, 2)
    name, kind, color, place = rng.choice(split.things)
    return (f"{person} walked to the {place} with {other}. They saw {_article(color)} {color} {name} there. "
            f"{other} said that the {name} is {_article(kind)} {kind}. They went home before dark.")


def training_records(n: int, seed: int) -> list[tuple[str, str | None]]:
    """`n` training records: (user, assistant) chats, or (plain text, None) for ordinary text."""
    train, _ = _splits()
    rng = random.Random(seed)
    out: list[tuple[str, str | None]] = []
    for key in range(n):
        r = rng.random()
        if r < 0.55:
            rec, resp = ifeval_example(rng, train, key)
            out.append((rec["prompt"], resp))
        elif r < 0.8:
            q, sol, _ = gsm_example(rng, train)
            out.append((gsm_user_text(q), sol))
        elif r < 0.9:
            req, resp, _ = _request(rng, train)
            out.append((req, resp))
        else:
            out.append((story(rng, train), None))
    return out


def records_jsonl(records: list[tuple[str, str | None]]) -> str:
    """Training records as JSON lines {user, assistant} (assistant null for plain text): the demo's train.jsonl."""
    return "".join(json.dumps({"user": u, "assistant": a}) + "\n" for u, a in records)


def heldout_prompts(n_ifeval: int, n_gsm: int, seed: int) -> tuple[list[dict], list[dict]]:
    """Held-out eval records in lm-eval's IFEval and GSM8K jsonl schemas (unseen entities)."""
    _, held = _splits()
    rng = random.Random(seed + 7919)
    ifeval = [ifeval_example(rng, held, key)[0] for key in range(n_ifeval)]
    gsm = []
    for _ in range(n_gsm):
        q, sol, n = gsm_example(rng, held)
        gsm.append({"question": q, "answer": f"{sol}\n#### {n}"})
    return ifeval, gsm


def tokenizer_texts(records: list[tuple[str, str | None]]) -> list[str]:
    """Raw strings for BPE training: every user/assistant text plus digit captions."""
    texts = [t for rec in records for t in rec if t]
    rng = random.Random(0)
    texts += [" ".join(varied_digit_caption(d, rng)) for d in range(10) for _ in range(5)]
    return texts


def main(argv: list[str] | None = None) -> int:
    """`python -m experiments.demo.corpus OUT.jsonl [--records N] [--seed S]`: the corpus's training chats as
    {user, assistant} lines (assistant null for plain text), the text data `text_replay` reads in studies
    without a build (make study-real). Rewritten only when its content changes."""
    p = argparse.ArgumentParser(prog="python -m experiments.demo.corpus", description=main.__doc__)
    p.add_argument("out", type=Path)
    p.add_argument("--records", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    text = records_jsonl(training_records(args.records, args.seed))
    if not (args.out.is_file() and args.out.read_text(encoding="utf-8") == text):
        write_text_atomic(args.out, text)
    print(f"{args.out}: {args.records} records (seed {args.seed})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
