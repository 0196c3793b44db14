"""Growing attention sinks by training: a Bigram-Backcopy data mix, backbone recipes, S-vs-steps.

The demo's tiny bases never formed an attention sink (S about -3.3 after 300 steps). This module
holds what docs/sink-growth.md measured about changing that, as code the demo config can point at:
- `bigram_backcopy_texts`: Guo et al. (2024)'s Bigram-Backcopy task written in words the demo
  tokenizer encodes as one token each: a fixed bigram table (each word has a few likely
  successors), plus trigger words after which the next word copies the word before the trigger.
  Most positions need no context, so the heads that solve the copy have nothing to do elsewhere.
- `retrieval_texts`: sequences where context matters only at rare positions, each by one kind of
  retrieval (induction, key-value look-up, backcopy), for heads that have a specialised job;
- `with_noise`: a span of random tokens put before a share of the chats (same sequence), so that
  averaging the whole context hurts and heads must select;
- `sprinkle_noise`: random tokens between the words of each user turn, so that a bag of the request
  is noisy too;
- `mixed_texts` / `training_mix`: the demo's chat texts plus a share of synthetic sequences, and a
  recipe's whole training mix (the corpus itself is not changed; the mix is formed at training time).
- `RECIPES`: the backbone spread (family, depth, heads, lr, weight decay, data mix).
- `grow`: trains one recipe with the project's optimisation loop and measures Sink Strength (and
  sink mass) at checkpoints, giving the S-vs-steps curve.

All sinks here are grown by training from a random init; no weight is set by hand.
"""

from __future__ import annotations

import random
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Callable, Sequence

from experiments.demo.backbones import build_backbone
from sinkstudy import SinkstudyError


# --------------------------------------------------------------------------- data

def single_token_words(tokenizer, n: int) -> list[str]:
    """The first `n` lower-case words (sorted) that the tokenizer encodes, after a space, as one token."""
    words = []
    for piece in sorted(tokenizer.get_vocab()):
        word = piece[1:]
        if piece.startswith("Ġ") and len(word) > 2 and word.isalpha() and word.islower():
            if len(tokenizer(" " + word, add_special_tokens=False)["input_ids"]) == 1:
                words.append(word)
                if len(words) == n:
                    return words
    raise SinkstudyError(f"the tokenizer has only {len(words)} single-token lower-case words; {n} needed")


@dataclass(frozen=True)
class BackcopyTask:
    """Bigram-Backcopy settings (Guo et al. 2024 use 3 triggers and a sparse bigram table)."""

    vocab: int = 64
    successors: int = 4
    triggers: int = 3
    length: int = 64  # words per sequence (BOS is added by the tokenizer)
    p_trigger: float = 0.15
    table_seed: int = 1234  # the bigram table and triggers: fixed across runs, so held-out texts share them

    def texts(self, tokenizer, n: int, seed: int) -> list[str]:
        return bigram_backcopy_texts(tokenizer, n, seed, self)


def bigram_backcopy_texts(tokenizer, n: int, seed: int, task: BackcopyTask = BackcopyTask()) -> list[str]:
    """`n` Bigram-Backcopy sequences as space-separated words (one token per word)."""
    words = single_token_words(tokenizer, task.vocab + task.triggers)
    table_rng = random.Random(task.table_seed)
    table_rng.shuffle(words)
    triggers, plain = set(words[: task.triggers]), words[task.triggers:]
    trigger_list = words[: task.triggers]
    table = {w: table_rng.sample(plain, task.successors) for w in plain}
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        seq = [rng.choice(plain)]
        while len(seq) < task.length:
            if seq[-1] in triggers:
                seq.append(seq[-2] if len(seq) >= 2 else rng.choice(plain))  # the copy: the word before the trigger
            elif rng.random() < task.p_trigger:
                seq.append(rng.choice(trigger_list))
            else:
                seq.append(rng.choice(table[seq[-1]]))
        out.append(" " + " ".join(seq))  # leading space: the first word is the same single token as elsewhere
    return out


@dataclass(frozen=True)
class RetrievalTask:
    """Sequences whose context is needed only at rare positions, each by one kind of retrieval.

    Filler is a bigram walk (next word from the current word alone, so most positions need no
    context). Each sequence is one kind: `induction` (spans of the sequence repeated later: once
    a span's first word recurs, its continuation is copied), `kv` (`key: value;` records, filler,
    then `key= value` look-ups) or `backcopy` (the Bigram-Backcopy triggers). The point is heads
    that have a job only at those positions and a reason to do nothing elsewhere.
    """

    vocab: int = 160
    successors: int = 4
    length: int = 64  # words per sequence, roughly
    span: int = 6  # induction span length
    copies: int = 3  # induction spans per sequence
    records: int = 6  # kv records per sequence
    lookups: int = 3  # kv look-ups per sequence
    table_seed: int = 4321

    def texts(self, tokenizer, n: int, seed: int) -> list[str]:
        return retrieval_texts(tokenizer, n, seed, self)


def retrieval_texts(tokenizer, n: int, seed: int, task: RetrievalTask = RetrievalTask()) -> list[str]:
    """`n` retrieval sequences (kinds in rotation), one token per word, `:`, `;` and `=` as markers."""
    words = single_token_words(tokenizer, task.vocab)
    table_rng = random.Random(task.table_seed)
    table = {w: table_rng.sample(words, task.successors) for w in words}
    rng = random.Random(seed)

    def walk(k: int, start: str | None = None) -> list[str]:
        seq = [start or rng.choice(words)]
        while len(seq) < k:
            seq.append(rng.choice(table[seq[-1]]))
        return seq

    backcopy = BackcopyTask(length=task.length, table_seed=task.table_seed)
    out = []
    for i in range(n):
        kind = ("induction", "kv", "backcopy")[i % 3]
        if kind == "backcopy":
            out.append(bigram_backcopy_texts(tokenizer, 1, rng.randrange(2**31), backcopy)[0])
            continue
        if kind == "induction":
            seq = walk(task.length // 2)
            for _ in range(task.copies):
                start = rng.randrange(len(seq) - task.span)
                seq += walk(rng.randint(3, 8), rng.choice(table[seq[-1]])) + seq[start:start + task.span]
            out.append(" " + " ".join(seq))
            continue
        keys = rng.sample(words, task.records)
        pairs = {k: rng.choice(words) for k in keys}
        parts = [f"{k}: {v};" for k, v in pairs.items()]
        filler = walk(task.length - 3 * task.records - 3 * task.lookups)
        looks = [f"{k}= {pairs[k]}" for k in rng.sample(keys, task.lookups)]
        out.append(" " + " ".join(parts + filler[: len(filler) // 2] + looks[:1] + filler[len(filler) // 2:] + looks[1:]))
    return out


def _plain_ids(tokenizer) -> list[int]:
    special = set(tokenizer.all_special_ids)
    return [i for i in range(len(tokenizer)) if i not in special]


def noise_document(tokenizer, rng: random.Random, length: int) -> str:
    """An irrelevant span: `length` tokens drawn uniformly from the non-special vocabulary, as text."""
    ids = _plain_ids(tokenizer)
    return tokenizer.decode([rng.choice(ids) for _ in range(length)])


def with_noise(texts: Sequence[str], tokenizer, share: float, length: tuple[int, int], seed: int) -> list[str]:
    """`texts` with an irrelevant noise span put before a `share` of them (same sequence, after BOS).

    Averaging the whole context then mixes in noise, so heads must select; what a head selects
    when nothing in view is relevant is the question.
    """
    if not 0 <= share <= 1:
        raise SinkstudyError(f"noise share must be in [0, 1], got {share}")
    rng = random.Random(seed)
    return [noise_document(tokenizer, rng, rng.randint(*length)) + "\n" + t if rng.random() < share else t for t in texts]


def sprinkle_noise(texts: Sequence[str], tokenizer, rate: float, seed: int) -> list[str]:
    """Random vocabulary tokens inserted between the words of each chat's user turn (assistant turns stay clean).

    After each word, another noise token follows with probability `rate` (so on average
    rate / (1 - rate) per word). A bag of the request then carries noise too, so a head that
    has nothing specific to fetch does better parking than averaging. Texts that do not start
    with the tokenizer's user turn are left as they are.
    """
    if not 0 <= rate < 1:
        raise SinkstudyError(f"sprinkle rate must be in [0, 1), got {rate}")
    turn = tokenizer.apply_chat_template([{"role": "user", "content": "\x00"}], tokenize=False)
    prefix, suffix = turn.removeprefix(tokenizer.bos_token or "").split("\x00")
    pieces = [p for p in (tokenizer.decode([i]).strip() for i in _plain_ids(tokenizer)) if p]
    rng = random.Random(seed)
    out = []
    for text in texts:
        if not (text.startswith(prefix) and suffix in text[len(prefix):]):
            out.append(text)
            continue
        user, rest = text[len(prefix):].split(suffix, 1)
        words = []
        for word in user.split(" "):
            words.append(word)
            while rng.random() < rate:
                words.append(rng.choice(pieces))
        out.append(prefix + " ".join(words) + suffix + rest)
    return out


def mixed_texts(texts: Sequence[str], tokenizer, share: float, seed: int, task=BackcopyTask()) -> list[str]:
    """`texts` plus `task`'s sequences (Bigram-Backcopy by default) making up `share` of the result (0 <= share < 1)."""
    if not 0 <= share < 1:
        raise SinkstudyError(f"{type(task).__name__} share must be in [0, 1), got {share}")
    n = round(len(texts) * share / (1 - share))
    return list(texts) + (task.texts(tokenizer, n, seed) if n else [])


# --------------------------------------------------------------------------- recipes

@dataclass(frozen=True)
class Recipe:
    """One backbone: architecture (a demo backbone spec) plus its pretraining knobs."""

    name: str
    family: str = "qwen2"
    hidden_size: int = 128
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    steps: int = 300
    lr: float = 3e-3
    weight_decay: float = 0.0
    batch_size: int = 16
    seq_len: int = 160
    backcopy_share: float = 0.0
    retrieval_share: float = 0.0  # RetrievalTask sequences, as a share of the mix they join (after Bigram-Backcopy)
    noise_share: float = 0.0  # share of chat texts with a noise span put before them
    noise_tokens: tuple[int, int] = (20, 60)  # noise span length range, in tokens
    sprinkle_rate: float = 0.0  # noise tokens inserted between user-turn words (sprinkle_noise)
    seed: int = 0
    notes: str = ""

    def backbone_spec(self) -> dict:
        """The spec `experiments.demo.backbones.build_backbone` takes."""
        keys = ("name", "family", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "seed")
        return {k: getattr(self, k) for k in keys}

    def to_json(self) -> dict:
        return asdict(self)


RECIPES: dict[str, Recipe] = {r.name: r for r in [
    # Chat backbones at the demo's budget (300 steps, batch 16, length 160), one knob changed each.
    Recipe("qwen2-demo", notes="the demo's qwen2 base as configured today"),
    Recipe("qwen3-demo", family="qwen3", notes="native per-head QK-norm"),
    Recipe("llama-demo", family="llama", notes="no q/k/v biases: BOS attention is attention's only constant"),
    Recipe("qwen2-wd1", weight_decay=1.0, notes="weight decay (Gu et al.: strengthens sinks)"),
    Recipe("qwen2-bb30", backcopy_share=0.3, notes="30% Bigram-Backcopy sequences mixed into the chat text"),
    Recipe("qwen2-deep", num_hidden_layers=8, hidden_size=64, num_key_value_heads=4, notes="depth 8 at width 64"),
    Recipe("qwen3-lr1e-2", family="qwen3", lr=1e-2, weight_decay=0.1, notes="larger lr (QK-norm keeps it stable)"),
    Recipe("qwen2-lr1e-2", lr=1e-2, weight_decay=0.1, notes="larger lr without QK-norm: attention logits blow up"),
    # Second attempt (docs/sink-growth.md): heads with a reason to do nothing. 8 heads of 16 dims, lr 2e-2 with
    # QK-norm, 2 layers so that 400 steps fit the budget; noise spans before 70% of the chats, and noise
    # inside the user turns. The sink forms in the last layer, on the template's first tokens and on BOS.
    Recipe("qwen3-2l-lr2e-2", family="qwen3", num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=8,
           steps=400, lr=2e-2, weight_decay=0.1, notes="control for the two below: same model and training, no noise"),
    Recipe("qwen3-2l-noise", family="qwen3", num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=8,
           steps=400, lr=2e-2, weight_decay=0.1, noise_share=0.7,
           notes="random-token spans (20-60 tokens) before 70% of the chats: averaging the context hurts"),
    Recipe("qwen3-2l-sprinkle", family="qwen3", num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=8,
           steps=400, lr=2e-2, weight_decay=0.1, noise_share=0.7, sprinkle_rate=0.3,
           notes="plus random tokens between the words of each user turn: a bag of the request is noisy too"),
    Recipe("qwen3-2l-sprinkle6", family="qwen3", num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=8,
           steps=400, lr=2e-2, weight_decay=0.1, noise_share=0.7, sprinkle_rate=0.6,
           notes="more noise in the user turns (1.5 noise tokens per word on average)"),
    Recipe("qwen3-2l-sprinkle-150", family="qwen3", num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=8,
           steps=150, lr=2e-2, weight_decay=0.1, noise_share=0.7, sprinkle_rate=0.3,
           notes="the same, stopped at 150 steps: S peaks early and falls as chat training recruits the parked heads"),
    Recipe("qwen2-retrieval", num_attention_heads=8, num_key_value_heads=8, weight_decay=0.1, retrieval_share=0.3,
           notes="30% induction / key-value / backcopy sequences, 8 heads: specialised heads"),
    # The one setting that grows a BOS sink in this budget, in its own domain: 1 layer, Bigram-Backcopy.
    Recipe("bb-1layer", num_hidden_layers=1, hidden_size=64, num_attention_heads=2, num_key_value_heads=2,
           steps=400, lr=1e-2, seq_len=80, backcopy_share=0.97,
           notes="Guo et al.'s setting: S rises on Bigram-Backcopy text, not on the chat calibration prompts"),
]}
CHAT_RECIPES = [name for name in RECIPES if name != "bb-1layer"]


def get_recipe(name: str, **overrides) -> Recipe:
    if name not in RECIPES:
        raise SinkstudyError(f"unknown sink recipe {name!r}; known: {', '.join(RECIPES)}")
    return replace(RECIPES[name], **overrides)


def training_mix(recipe: Recipe, tokenizer, texts: Sequence[str]) -> list[str]:
    """The recipe's training texts: noise inside user turns, noise spans before a share of the chats, then
    the synthetic sequences mixed in."""
    out = sprinkle_noise(texts, tokenizer, recipe.sprinkle_rate, recipe.seed) if recipe.sprinkle_rate else list(texts)
    if recipe.noise_share:
        out = with_noise(out, tokenizer, recipe.noise_share, recipe.noise_tokens, recipe.seed)
    if recipe.backcopy_share:
        out = mixed_texts(out, tokenizer, recipe.backcopy_share, recipe.seed)
    if recipe.retrieval_share:
        out = mixed_texts(out, tokenizer, recipe.retrieval_share, recipe.seed, RetrievalTask())
    return out


# --------------------------------------------------------------------------- training with a curve

@dataclass
class GrowResult:
    recipe: Recipe
    curve: list[dict] = field(default_factory=list)  # per checkpoint: step, S, mass, argmax_is_sink, seconds
    train_seconds: float = 0.0
    final_loss: float | None = None
    tokens: int = 0

    def to_json(self) -> dict:
        return {"recipe": self.recipe.to_json(), "curve": self.curve, "train_seconds": self.train_seconds,
                "final_loss": self.final_loss, "tokens": self.tokens}


def sink_point(model, tokenizer, texts=None, **options) -> dict:
    """S (the project's default log-odds metric) plus sink mass and the share of heads whose argmax key is BOS."""
    # lazy: loads torch, numpy
    from evals.sink import sink_strength

    s = sink_strength(model, tokenizer, texts=texts, progress=False, batch_size=8, **options)
    return {"S": s.value, "mass": float(s.maps.mass.mean()), "argmax_is_sink": float(s.maps.argmax_is_sink.mean()),
            "S_per_layer": s.details["median_per_layer"]}


def grow(recipe: Recipe, tokenizer, texts: Sequence[str], *, checkpoints: Sequence[int] = (),
         measure: Callable | None = None, progress: bool = False):
    """Build and train one recipe's model; measure at each step in `checkpoints` (0 = at init).

    `measure(model)` returns a dict (default: `sink_point` on the default calibration set).
    Returns (model, GrowResult). The wall time excludes the measurements.
    """
    # lazy: loads torch, transformers, numpy
    import torch
    from transformers import TrainerCallback
    from interventions.training import train_causal_lm

    measure = measure or (lambda m: sink_point(m, tokenizer))
    model = build_backbone(recipe.backbone_spec(), tokenizer)
    train_texts = training_mix(recipe, tokenizer, texts)
    result = GrowResult(recipe)
    marks = set(checkpoints)
    measuring = [0.0]

    def record(step: int) -> None:
        t0 = time.perf_counter()
        was_training = model.training
        model.eval()
        with torch.no_grad():
            point = measure(model)
        model.train(was_training)
        measuring[0] += time.perf_counter() - t0
        result.curve.append({"step": step, **point})

    class Checkpoints(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            if 0 in marks:
                record(0)

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step in marks:
                record(state.global_step)

    start = time.perf_counter()
    stats = train_causal_lm(model, tokenizer, train_texts, steps=recipe.steps, lr=recipe.lr, batch_size=recipe.batch_size,
                            seq_len=recipe.seq_len, weight_decay=recipe.weight_decay, seed=recipe.seed,
                            progress=progress, desc=f"grow {recipe.name}", callbacks=[Checkpoints()])
    result.train_seconds = time.perf_counter() - start - measuring[0]
    result.final_loss, result.tokens = stats["final_loss"], stats["tokens"]
    return model, result


def heldout_chat_loss(model, tokenizer, texts: Sequence[str], seq_len: int = 160, batch_size: int = 32) -> float:
    """Mean next-token loss (nats per predicted token) on `texts`, pads excluded."""
    # lazy: loads torch, numpy
    import torch
    from interventions.adapt import encoding

    encoder = encoding.Encoder(tokenizer, max_length=seq_len, loss_on="all")
    features = [encoder({"text": t}) for t in texts]
    features = [f for f in features if len(f["input_ids"]) >= 2]
    total = count = 0.0
    model.eval()
    with torch.no_grad():
        for i in range(0, len(features), batch_size):
            batch = encoding.collate(features[i:i + batch_size], tokenizer.pad_token_id)
            n = int((batch["labels"][:, 1:] != -100).sum())
            total += float(model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"]).loss) * n
            count += n
    return total / count
