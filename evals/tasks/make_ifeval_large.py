"""Generate `sinkstudy_ifeval_large.jsonl`: 400 IFEval-style prompts from IFEval's own verifiable instructions.

Each prompt is one of the base requests below followed by 1-3 of lm-eval's IFEval instructions
(`lm_eval.tasks.ifeval.instructions_registry`), never two that IFEval marks as conflicting. The instruction
text is the checker's own `build_description(**kwargs)`, and the kwargs are read back with
`get_instruction_args()`, so every prompt says exactly what its grader checks. Deterministic: a fixed seed
and fixed lists, no hub; tests/test_graders.py checks the shipped file equals this script's output.

Sized for 135M-270M models (a score at the floor cannot degrade): every instruction family appears as the
first instruction of 16 prompts; the kwargs ask for what a short answer can do (word, sentence and paragraph
counts a ~300-token reply meets), and keywords come from the request's own topic.

    python -m evals.tasks.make_ifeval_large [--check]
"""

from __future__ import annotations

import copy
import json
import random
import sys
from pathlib import Path

from evals.nltk_offline import ensure_punkt_tab
from sinkstudy.io import write_text_atomic

OUT = Path(__file__).resolve().parent / "sinkstudy_ifeval_large.jsonl"
N_PROMPTS = 400
SEED = 2026
FIRST_KEY = 10_000
N_INSTRUCTIONS = (1, 2, 3)
N_WEIGHTS = (0.45, 0.35, 0.20)

# Varied everyday requests, each with words of its topic (keywords to include, repeat or avoid).
REQUESTS = [
    ("Write a short note to a neighbour asking to borrow a ladder.", ["ladder", "weekend", "garden"]),
    ("Describe a sunrise over the sea.", ["light", "waves", "horizon"]),
    ("Give some tips for keeping a kitchen tidy.", ["counter", "dishes", "shelf"]),
    ("Explain how a bicycle works to a ten-year-old.", ["pedals", "chain", "wheel"]),
    ("Write a product description for a waterproof hiking jacket.", ["hood", "rain", "zipper"]),
    ("Tell a short story about a lost cat finding its way home.", ["whiskers", "street", "door"]),
    ("Write an email to a colleague proposing a lunch meeting next week.", ["lunch", "Tuesday", "agenda"]),
    ("Summarise why people enjoy gardening.", ["soil", "seeds", "flowers"]),
    ("Describe your ideal weekend morning.", ["coffee", "breakfast", "newspaper"]),
    ("Explain what a library offers to its visitors.", ["books", "librarian", "quiet"]),
    ("Write a review of a small neighbourhood bakery.", ["bread", "croissant", "oven"]),
    ("Give advice to someone starting to learn the guitar.", ["chords", "practice", "strings"]),
    ("Describe a busy train station at rush hour.", ["platform", "commuters", "announcement"]),
    ("Write a thank-you message to a teacher at the end of the school year.", ["lessons", "patience", "class"]),
    ("Explain how rain forms.", ["clouds", "droplets", "water"]),
    ("Write a short speech welcoming new members to a chess club.", ["chess", "tournament", "board"]),
    ("Describe the taste of a ripe summer peach.", ["sweet", "juice", "summer"]),
    ("Give reasons why walking is good for your health.", ["heart", "steps", "fresh"]),
    ("Write an advertisement for a second-hand sofa.", ["sofa", "cushions", "price"]),
    ("Explain how to make a cup of tea.", ["kettle", "teapot", "milk"]),
    ("Describe a quiet evening at home.", ["lamp", "blanket", "evening"]),
    ("Write a letter to the city council asking for a new bus stop.", ["bus", "residents", "safety"]),
    ("Tell a short story about a robot that learns to paint.", ["robot", "canvas", "colours"]),
    ("Give tips for a first visit to a museum.", ["tickets", "gallery", "map"]),
    ("Explain why the sky looks blue.", ["sunlight", "air", "blue"]),
    ("Write a short blog post about learning to swim as an adult.", ["pool", "breath", "lessons"]),
    ("Describe a market square on a Saturday morning.", ["stalls", "vegetables", "crowd"]),
    ("Give advice for keeping houseplants alive.", ["watering", "sunlight", "leaves"]),
    ("Write an invitation to a birthday picnic in the park.", ["picnic", "cake", "blanket"]),
    ("Explain what makes a good friend.", ["trust", "kindness", "listen"]),
    ("Describe a thunderstorm from inside a cosy room.", ["thunder", "window", "lightning"]),
    ("Write a short poem about autumn leaves.", ["leaves", "autumn", "wind"]),
    ("Give tips for saving money on groceries.", ["budget", "list", "discount"]),
    ("Explain how a refrigerator keeps food cold.", ["fridge", "cold", "food"]),
    ("Write a review of a film you would like to see.", ["actors", "plot", "ending"]),
    ("Describe a walk through a pine forest.", ["trees", "path", "birds"]),
    ("Write a message to a friend who has just moved to a new city.", ["city", "apartment", "visit"]),
    ("Explain why sleep matters for students.", ["sleep", "memory", "exams"]),
    ("Give instructions for planting a tomato seedling.", ["tomato", "pot", "soil"]),
    ("Describe the view from the top of a hill.", ["valley", "village", "sky"]),
]
# For the one instruction that asks for a fixed yes/no/maybe answer.
QUESTIONS = [
    "Is it a good idea to drink water before breakfast?",
    "Can a cat learn its own name?",
    "Should children learn to cook at school?",
    "Is it easier to learn to read music than to read a new language?",
    "Would a city be quieter if everyone rode bicycles?",
    "Is a short walk after dinner good for you?",
    "Can you grow basil on a windowsill?",
    "Should libraries stay open late on weekdays?",
    "Is it worth learning to touch-type?",
    "Can a small balcony garden feed a family?",
    "Is tea better than coffee in the afternoon?",
    "Should every town have a public swimming pool?",
    "Can dogs tell when their owners are sad?",
    "Is it rude to read a book at a family dinner?",
    "Would you enjoy living on a houseboat?",
    "Is winter the best season for hiking?",
    "Should homework be banned for young children?",
    "Can music help you concentrate?",
]
FIRST_WORDS = ["today", "however", "first", "finally", "sometimes", "yesterday", "often", "there"]
# Questions, as IFEval's own: the checker's text puts a period after the phrase.
END_PHRASES = ["Any other questions?", "Is there anything else I can help with?", "Does that answer your question?", "What do you think?"]
LANGUAGES = ["fr", "es", "de", "it", "pt"]


def _kwargs(iid: str, rng: random.Random, topic: list[str]) -> dict:
    """kwargs for one instruction, in ranges a short answer can meet."""
    relation = rng.choice(("less than", "at least"))
    if iid == "keywords:existence":
        return {"keywords": sorted(rng.sample(topic, rng.choice((1, 2))))}  # the checker sorts them
    if iid == "keywords:frequency":
        return {"keyword": rng.choice(topic), "frequency": rng.randint(1, 3), "relation": relation}
    if iid == "keywords:forbidden_words":
        return {"forbidden_words": sorted(rng.sample(topic, rng.choice((1, 2))))}
    if iid == "keywords:letter_frequency":  # a rare letter kept rare, or a common one used often
        if relation == "less than":
            return {"letter": rng.choice("bfgkpvwy"), "let_frequency": rng.randint(3, 8), "let_relation": relation}
        return {"letter": rng.choice("aeinorst"), "let_frequency": rng.randint(3, 10), "let_relation": relation}
    if iid == "language:response_language":
        return {"language": rng.choice(LANGUAGES)}
    if iid == "length_constraints:number_sentences":
        return {"num_sentences": rng.randint(3, 8) if relation == "less than" else rng.randint(2, 5), "relation": relation}
    if iid == "length_constraints:number_paragraphs":
        return {"num_paragraphs": rng.randint(2, 4)}
    if iid == "length_constraints:number_words":
        return {"num_words": rng.choice((40, 60, 80, 100, 150)) if relation == "less than" else rng.choice((20, 30, 50, 80)),
                "relation": relation}
    if iid == "length_constraints:nth_paragraph_first_word":
        n = rng.randint(2, 3)
        return {"num_paragraphs": n, "nth_paragraph": rng.randint(1, n), "first_word": rng.choice(FIRST_WORDS)}
    if iid == "detectable_content:number_placeholders":
        return {"num_placeholders": rng.randint(1, 3)}
    if iid == "detectable_content:postscript":
        return {"postscript_marker": rng.choice(("P.S.", "P.P.S"))}
    if iid == "detectable_format:number_bullet_lists":
        return {"num_bullets": rng.randint(2, 5)}
    if iid == "detectable_format:number_highlighted_sections":
        return {"num_highlights": rng.randint(1, 3)}
    if iid == "detectable_format:multiple_sections":
        return {"section_spliter": rng.choice(("Section", "SECTION", "Part")), "num_sections": rng.randint(2, 3)}
    if iid == "startend:end_checker":
        return {"end_phrase": rng.choice(END_PHRASES)}
    if iid == "change_case:capital_word_frequency":
        return {"capital_frequency": rng.randint(2, 5), "capital_relation": relation}  # "less than 1" would forbid "I"
    return {}  # the checkers without arguments (and repeat_prompt, filled in once the prompt is known)


def _registry():
    ensure_punkt_tab()  # before lm-eval's IFEval modules are imported (they try a download when Punkt is missing)
    # lazy: loads lm_eval, datasets, numpy
    from lm_eval.tasks.ifeval import instructions_registry

    conflicts = instructions_registry.conflict_make(copy.deepcopy(instructions_registry.INSTRUCTION_CONFLICTS))
    return instructions_registry.INSTRUCTION_DICT, conflicts


def _describe(checkers, iid: str, kwargs: dict) -> str:
    """The checker's own instruction text; its arguments read back must equal `kwargs` (nothing left to chance)."""
    checker = checkers[iid](iid)
    text = checker.build_description(**kwargs)
    args = checker.get_instruction_args() or {}
    if args != kwargs:
        raise AssertionError(f"{iid}: build_description({kwargs}) reads back as {args}")
    return text if text.rstrip().endswith((".", "?", "!")) else text.rstrip() + "."


def generate() -> list[dict]:
    checkers, conflicts = _registry()
    families = sorted(checkers)
    rng = random.Random(SEED)
    rows, seen = [], set()
    for i in range(N_PROMPTS):
        first = families[i % len(families)]  # every family leads N_PROMPTS / len(families) prompts
        row = _draw(rng, checkers, conflicts, families, first)
        while row["prompt"] in seen:  # every prompt distinct: draw again
            row = _draw(rng, checkers, conflicts, families, first)
        seen.add(row["prompt"])
        rows.append({"key": FIRST_KEY + i, **row})
    return rows


def _draw(rng: random.Random, checkers, conflicts, families: list[str], first: str) -> dict:
    """One prompt led by instruction family `first`."""
    alone = first == "detectable_format:constrained_response"  # IFEval: it conflicts with every other instruction
    n = 1 if alone else rng.choices(N_INSTRUCTIONS, N_WEIGHTS)[0]
    chosen = [first]
    while len(chosen) < n:
        free = [f for f in families if not any(f in conflicts[c] or c in conflicts[f] for c in chosen)]
        if not free:
            break
        chosen.append(rng.choice(free))
    chosen.sort(key=lambda f: f == "combination:repeat_prompt")  # it repeats everything before it: last
    request, topic = (rng.choice(QUESTIONS), []) if alone else rng.choice(REQUESTS)
    parts, kwargs = [request], []
    for iid in chosen:
        kw = {"prompt_to_repeat": " ".join(parts)} if iid == "combination:repeat_prompt" else _kwargs(iid, rng, topic)
        parts.append(_describe(checkers, iid, kw))
        kwargs.append(kw)
    return {"prompt": " ".join(parts), "instruction_id_list": chosen, "kwargs": kwargs}


def render(rows: list[dict]) -> str:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    text = render(generate())
    if "--check" in args:
        same = OUT.is_file() and OUT.read_text(encoding="utf-8") == text
        print(f"{OUT.name}: {'up to date' if same else 'differs from the generator output'}")
        return 0 if same else 1

    write_text_atomic(OUT, text)
    print(f"wrote {OUT} ({N_PROMPTS} prompts)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
