"""Sink growth: the Bigram-Backcopy data is what it claims, and training really grows a BOS sink."""

import pytest

from experiments.demo import corpus, sinkgrow
from sinkstudy import SinkstudyError


@pytest.fixture(scope="module")
def demo_tokenizer():
    from sinkstudy.tiny import train_bpe_tokenizer

    return train_bpe_tokenizer(corpus.tokenizer_texts(corpus.training_records(1500, 0)), vocab_size=768)


def test_backcopy_copies_the_word_before_each_trigger(demo_tokenizer):
    task = sinkgrow.BackcopyTask(length=40)
    texts = sinkgrow.bigram_backcopy_texts(demo_tokenizer, 50, seed=3, task=task)
    words = set(sinkgrow.single_token_words(demo_tokenizer, task.vocab + task.triggers))
    successors: dict[str, set[str]] = {}
    trigger_positions = 0
    for text in texts:
        seq = text.split()
        assert len(seq) == task.length and set(seq) <= words
        # one token per word, plus the BOS the tokenizer adds
        assert len(demo_tokenizer(text)["input_ids"]) == task.length + 1
        for i in range(1, len(seq) - 1):
            succ = successors.setdefault(seq[i], set())
            succ.add(seq[i + 1])
    triggers = {w for w, nxt in successors.items() if len(nxt) > task.successors + task.triggers}
    assert len(triggers) == task.triggers  # only triggers are followed by arbitrary words
    for text in texts:
        seq = text.split()
        for i in range(1, len(seq) - 1):
            if seq[i] in triggers and seq[i - 1] not in triggers:
                assert seq[i + 1] == seq[i - 1]
                trigger_positions += 1
    assert trigger_positions > 100
    # the table is fixed by table_seed: with another sampling seed, each plain word still has at most
    # `successors` plain successors across both samples
    other = sinkgrow.bigram_backcopy_texts(demo_tokenizer, 50, seed=4, task=task)
    plain_next: dict[str, set[str]] = {}
    for text in texts + other:
        seq = text.split()
        for i in range(1, len(seq) - 1):
            if seq[i] not in triggers and seq[i - 1] not in triggers and seq[i + 1] not in triggers:
                plain_next.setdefault(seq[i], set()).add(seq[i + 1])
    assert max(len(v) for v in plain_next.values()) == task.successors


def test_mixed_texts_share_and_bad_share(demo_tokenizer):
    chats = ["hello there"] * 30
    mixed = sinkgrow.mixed_texts(chats, demo_tokenizer, 0.25, seed=0)
    assert mixed[:30] == chats and len(mixed) == 40
    with pytest.raises(SinkstudyError, match="share"):
        sinkgrow.mixed_texts(chats, demo_tokenizer, 1.0, seed=0)


def test_retrieval_texts_each_kind_is_answerable_from_context(demo_tokenizer):
    task = sinkgrow.RetrievalTask()
    texts = sinkgrow.retrieval_texts(demo_tokenizer, 30, seed=5, task=task)
    words = set(sinkgrow.single_token_words(demo_tokenizer, task.vocab))
    kv = [t for t in texts if ":" in t]
    induction = texts[0::3]
    assert len(kv) == 10 and texts[1] in kv
    for text in kv:
        # every look-up `key= value` returns the value of the record `key: value;`
        records = dict(r.strip().split(": ") for r in text.split(";")[:-1] if ": " in r)
        assert len(records) == task.records and set(records) | set(records.values()) <= words
        looks = [w for w in text.split() if w.endswith("=")]
        assert len(looks) == task.lookups
        for i, w in enumerate(text.split()):
            if w.endswith("="):
                assert text.split()[i + 1] == records[w[:-1]]
    for text in induction:
        seq = text.split()
        assert set(seq) <= words
        assert len(demo_tokenizer(text)["input_ids"]) == len(seq) + 1  # one token per word, plus BOS
        # the last `span` words are a copy of an earlier span
        tail = seq[-task.span:]
        assert any(seq[i:i + task.span] == tail for i in range(len(seq) - 2 * task.span))
    with pytest.raises(SinkstudyError, match="RetrievalTask share"):
        sinkgrow.mixed_texts(["x"], demo_tokenizer, -0.1, seed=0, task=task)


def test_with_noise_puts_noise_before_the_chosen_share(demo_tokenizer):
    chats = [f"<|user|>\nhello {i}<|end|>\n" for i in range(200)]
    noisy = sinkgrow.with_noise(chats, demo_tokenizer, 0.5, (20, 30), seed=1)
    changed = [(n, c) for n, c in zip(noisy, chats) if n != c]
    assert 70 < len(changed) < 130  # about half
    for n, c in changed:
        assert n.endswith("\n" + c)
        assert len(demo_tokenizer(n.removesuffix(c), add_special_tokens=False)["input_ids"]) >= 10
    assert sinkgrow.with_noise(chats, demo_tokenizer, 0.0, (20, 30), seed=1) == chats
    recipe = sinkgrow.Recipe("x", noise_share=1.0, retrieval_share=0.2)
    mix = sinkgrow.training_mix(recipe, demo_tokenizer, chats)
    assert len(mix) == 250 and all(m != c and m.endswith(c) for m, c in zip(mix, chats))
    with pytest.raises(SinkstudyError, match="noise share"):
        sinkgrow.with_noise(chats, demo_tokenizer, 1.5, (20, 30), seed=1)


def test_sprinkle_noise_only_touches_user_turns(demo_tokenizer):
    from interventions.training import chat_text

    records = corpus.training_records(300, 0)
    texts = [chat_text(demo_tokenizer, u, a) if a is not None else u for u, a in records]
    noisy = sinkgrow.sprinkle_noise(texts, demo_tokenizer, 0.5, seed=2)
    inserted = words = 0
    for (user, assistant), clean, text in zip(records, texts, noisy):
        if assistant is None:
            assert text == clean  # plain text has no user turn
            continue
        assert text.endswith(clean[clean.index(user) + len(user):])  # the assistant turn is untouched
        got = text.split("\n", 1)[1].split("<|end|>")[0].split(" ")
        it = iter(got)
        assert all(w in it for w in user.split(" "))  # the request's words, in order, with noise between
        inserted += len(got) - len(user.split(" "))
        words += len(user.split(" "))
    assert 0.8 < inserted / words < 1.2  # rate / (1 - rate) = 1 noise token per word on average
    assert sinkgrow.sprinkle_noise(texts, demo_tokenizer, 0.0, seed=2) == texts
    with pytest.raises(SinkstudyError, match="sprinkle rate"):
        sinkgrow.sprinkle_noise(texts, demo_tokenizer, 1.0, seed=2)


@pytest.mark.slow(seconds=45)
def test_recipe_grows_a_bos_sink_in_its_domain(demo_tokenizer):
    """Guo et al.'s setting: a 1-layer model on Bigram-Backcopy parks attention on BOS as it trains.

    Measured with the project's default S (median log-odds on each head's argmax key) on held-out
    Bigram-Backcopy text: it starts at uniform attention and must rise, with sink mass, by training.
    """
    recipe = sinkgrow.get_recipe("bb-1layer", backcopy_share=0.0)  # Bigram-Backcopy text only
    train = sinkgrow.bigram_backcopy_texts(demo_tokenizer, 4000, seed=0)
    held_out = sinkgrow.bigram_backcopy_texts(demo_tokenizer, 15, seed=777, task=sinkgrow.BackcopyTask(length=48))

    def measure(model):
        return sinkgrow.sink_point(model, demo_tokenizer, texts=held_out, apply_chat_template=False)

    _, res = sinkgrow.grow(recipe, demo_tokenizer, train, checkpoints=(0, 200, 400), measure=measure)
    start, middle, end = res.curve
    assert [p["step"] for p in res.curve] == [0, 200, 400]
    assert abs(start["S"] + 3.2) < 0.3  # near-uniform causal attention at init (logit of ~1/26)
    assert end["S"] > start["S"] + 0.4, res.curve  # seeds 0-2 measured +0.53 to +0.87
    assert middle["S"] > start["S"]
    assert end["mass"] > start["mass"] + 0.03, res.curve
    assert end["argmax_is_sink"] > 0.9  # the argmax key of (almost) every head is BOS
