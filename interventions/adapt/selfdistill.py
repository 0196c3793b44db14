"""Self-distilled text chats: the base's own greedy replies to neutral prompts, the VL recipe's text share.

Text mixed into VL training (LLaVA-665K's ShareGPT part, `text_replay`, the text-only contrast) should hold
the base's text skill without teaching it anything new: replies written by the base itself, to prompts
drawn from no eval set (`neutral_prompts`: everyday topics in plain request forms, no format constraints),
teach it only what it already says. A data spec `{"selfdistill": "base", "prompts": N, "max_new_tokens": M}`
(`interventions.adapt.sources`; "base" is the run's base, or name any model) gives one chat per prompt. A
reply that reaches M tokens without ending is cut back to its last whole sentence (`cut_at_sentence`), so its
end-of-turn follows a finished sentence, not a broken one; a cut reply with no whole sentence is left out.
Measured on SmolLM2-135M-Instruct: at 512 tokens only 60 of 200 replies end by themselves (at 192, 13), so
dropping the cut ones would make the text share a third of what the recipe states. Each chat records whether
its reply was cut (`cut`). The replies are generated once per base (greedy, chat template on, `evals.generate`)
and cached under a key of the base's fingerprint, the prompts, the settings and this code.
"""

from __future__ import annotations

import json
import os
import random
import re
from pathlib import Path

from tqdm import tqdm

from interventions.pairs import load_causal_lm
from sinkstudy import SinkstudyError
from sinkstudy.io import cache_root, output_lock, write_text_atomic
from sinkstudy.keys import key
from sinkstudy.provenance import model_fingerprint, module_code_version

# The reply budget: SmolLM2-135M-Instruct's replies to these prompts mostly run past it (60 of 200 end within 512
# tokens); the others are cut back to their last whole sentence.
DEFAULTS = {"prompts": 200, "max_new_tokens": 512}
_SENTENCE_END = re.compile(r"[.!?][\"')\]]*(?=\s)")
_LIST_MARKER = re.compile(r"\s*(\d+|[a-zA-Z])\.")  # "2." opening a list item ends no sentence
_TOPICS = (
    "the water cycle", "how bees make honey", "the history of bicycles", "why the sky is blue", "how a library is organised",
    "the life of a lighthouse keeper", "how bread rises", "the planet Mars", "how trains run on time", "the origin of chess",
    "how plants grow from seeds", "the role of a museum curator", "how rainbows form", "the invention of paper",
    "why cats purr", "how a compass works", "the seasons of the year", "how volcanoes form", "the job of a firefighter",
    "how people learned to sail", "the moon's phases", "how a refrigerator keeps food cold", "the history of tea",
    "why leaves change color in autumn", "how birds migrate", "the work of a beekeeper", "how clouds are made",
    "the first airplanes", "how a post office works", "why we need sleep", "the life cycle of a butterfly",
    "how glass is made", "the Great Wall of China", "how a bridge carries weight", "the habits of penguins",
    "how coffee is grown", "the story of the printing press", "how earthquakes happen", "the duties of a librarian",
    "how tides work", "the history of the calendar", "how a garden can attract birds", "the deserts of the world",
    "how recycling works", "the first maps", "how an orchestra is arranged", "the life of whales", "how soap cleans",
    "the wonders of coral reefs", "how a city gets its water",
)
_FORMS = (
    "Tell me about {}.", "What do you know about {}?", "Can you explain {} to me?", "I'm curious about {}. What can you tell me?",
    "Give me an overview of {}.", "What is interesting about {}?", "Could you describe {}?", "Help me understand {}.",
)


def neutral_prompts(n: int) -> list[str]:
    """`n` prompts: topic x request form, in a fixed shuffled order (the first n of the same list for any n)."""
    pool = [form.format(topic) for topic in _TOPICS for form in _FORMS]
    if not 1 <= n <= len(pool):
        raise SinkstudyError(f"selfdistill: prompts must be between 1 and {len(pool)}, got {n}")
    random.Random(0).shuffle(pool)
    return pool[:n]


def settings_of(spec: dict) -> dict:
    return {**DEFAULTS, **{k: spec[k] for k in DEFAULTS if k in spec}}


def check(spec: dict) -> None:
    s = settings_of(spec)
    for k, v in s.items():
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise SinkstudyError(f"selfdistill: {k} must be a positive integer, got {v!r}")
    neutral_prompts(s["prompts"])
    if not isinstance(spec["selfdistill"], str) or not spec["selfdistill"]:
        raise SinkstudyError("selfdistill: name the model whose replies to use (\"base\": the run's base)")


# The modules that write the replies: part of their key.
CODE = ("interventions.adapt.selfdistill", "evals.generate.packed", "evals.generate.loop")


def cache_dir() -> Path:
    """Where the replies are kept: `<cache>/selfdistill` (`sinkstudy.io.cache_root`), the input of the steps that
    adapt on them."""
    return cache_root() / "selfdistill"


def cache_key(fingerprint: str, settings: dict) -> str:
    return key({"model": fingerprint, "prompts": neutral_prompts(settings["prompts"]), "settings": settings,
                "code": module_code_version(*CODE)})


def records(base, spec: dict) -> list[dict]:
    """The chats of a `selfdistill` spec for the run's `base` (a path, name or loaded causal LM)."""
    source = base if spec["selfdistill"] == "base" else spec["selfdistill"]
    settings = settings_of(spec)
    path = cache_dir() / f"{cache_key(model_fingerprint(source), settings)}.jsonl"
    if not path.is_file():
        with output_lock(Path(f"{path}.make"), wait=True):  # one process generates; the others wait and reuse it
            if not path.is_file():
                rows = generate(source, settings)
                write_text_atomic(path, "".join(json.dumps(r) + "\n" for r in rows))
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def generate(model_or_path, settings: dict, *, progress: bool = True) -> list[dict]:
    """Greedy replies of the model (chat template on) to the neutral prompts; replies cut at the budget left out.
    A bar counts the replies (200 take about 11 min on 2 CPU cores for SmolLM2-135M)."""
    # lazy: loads torch, transformers, numpy
    import torch
    from evals.generate.loop import Prompt, greedy_generate

    model, tok = (load_causal_lm(model_or_path) if isinstance(model_or_path, (str, os.PathLike)) else (model_or_path, None))
    if tok is None:
        raise SinkstudyError("selfdistill: a loaded base needs its tokenizer; pass the base as a path or name")
    prompts = neutral_prompts(settings["prompts"])
    ids = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True) for p in prompts]
    ids = [x["input_ids"] if isinstance(x, dict) or hasattr(x, "keys") else x for x in ids]
    eos = [tok.eos_token_id] + ([tok.convert_tokens_to_ids("<end_of_turn>")] if "<end_of_turn>" in tok.get_vocab() else [])
    with torch.no_grad(), tqdm(total=len(ids), desc="self-distilled replies", unit="reply", disable=not progress) as bar:
        out = greedy_generate(model.eval(), [Prompt(x, settings["max_new_tokens"]) for x in ids], batch_size=16, eos_token_ids=eos,
                              on_done=lambda i: bar.update(1))
    rows = []
    for prompt, toks in zip(prompts, out):
        ended = bool(toks) and toks[-1] in eos
        reply = tok.decode(toks[:-1] if ended else toks, skip_special_tokens=True).strip()
        reply = reply if ended else cut_at_sentence(reply)
        if reply:
            rows.append({"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": reply}],
                         "cut": not ended})
    if not rows:
        raise SinkstudyError(f"selfdistill: no reply holds a whole sentence within {settings['max_new_tokens']} tokens")
    return rows


def cut_at_sentence(text: str) -> str:
    """`text` up to its last whole sentence (a ., ! or ? followed by white space, closing quotes or brackets kept);
    "" when it holds none. The end of the text counts as white space only where generation ended by itself."""
    ends = [m.end() for m in _SENTENCE_END.finditer(text + " ") if not _LIST_MARKER.fullmatch(_line_before(text, m.end()))]
    return text[:ends[-1]].rstrip() if ends else ""


def _line_before(text: str, end: int) -> str:
    return text[text.rfind("\n", 0, end) + 1:end]
