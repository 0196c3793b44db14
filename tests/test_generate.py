"""The hf-continuous eval backend (evals/generate) on real tiny models: the same texts as lm-eval's HFLM
at its default batch size 1 for prompts with until strings and max_gen_toks, whatever the batch size;
finished rows leaving the batch (or being replaced) leave the other rows' tokens unchanged; the packed
cache keeps each row's keys and values through removals; non-greedy requests go through HFLM's own
loop; the backend is a distinct step key with the same outputs through run_eval; bad input is refused
in one line before any work."""

from pathlib import Path

import pytest
import torch
from lm_eval.api.instance import Instance
from lm_eval.models.huggingface import HFLM

from evals.generate import Prompt, greedy_generate
from evals.generate.hflm import ContinuousHFLM
from evals.generate.packed import PackedKV
from sinkstudy import SinkstudyError
from sinkstudy.tiny import tiny_causal_lm

CONTEXTS = ["the cat sat on", "a b c d e f g h", "hello world, this is a longer prompt about nothing much at all", "x",
            "one two three", "the quick brown fox"]
GEN_KWARGS = [dict(until=["e"], max_gen_toks=20), dict(until=[], max_gen_toks=30), dict(until=["ab", "\n"], max_gen_toks=25, do_sample=False),
              dict(until=[], max_gen_toks=7), dict(until=["zz"], max_gen_toks=40), dict(until="t", max_gen_toks=12, temperature=0.0)]


def _requests(contexts=CONTEXTS, gen_kwargs=GEN_KWARGS):
    return [Instance(request_type="generate_until", doc={}, arguments=(c, dict(k)), idx=i)
            for i, (c, k) in enumerate(zip(contexts, gen_kwargs))]


# A sliding window of 5 tokens in the first layer: prompts and answers run past it.
MODELS = {"qwen2": {}, "gemma3_text": dict(sliding_window=5, layer_types=["sliding_attention", "full_attention"])}


@pytest.fixture(scope="module", params=list(MODELS))
def model(request):
    return tiny_causal_lm(request.param, seed=0, **MODELS[request.param])


def test_texts_equal_hflm_at_batch_size_1_for_every_batch_size(model, tokenizer):
    reference = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=1, device="cpu").generate_until(_requests(), disable_tqdm=True)
    assert len(set(reference)) == len(reference) and all(reference)  # distinct, non-empty: the comparison can fail
    assert "e" not in reference[0] and len(reference[3]) < len(reference[1])  # until and max_gen_toks did act
    for batch_size in (1, 2, 4):
        lm = ContinuousHFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, device="cpu")
        assert lm.generate_until(_requests(), disable_tqdm=True) == reference


def _prompts(tokenizer, budgets):
    return [Prompt(tokenizer(c).input_ids, n) for c, n in zip(CONTEXTS, budgets)]


def test_rows_leaving_or_replaced_do_not_change_the_other_rows(model, tokenizer):
    alone = [greedy_generate(model, [p], batch_size=1)[0] for p in _prompts(tokenizer, [40] * 6)]
    assert [len(t) for t in alone] == [40] * 6
    # Rows end after 3..40 tokens: slots are refilled while prompts wait, then rows leave the batch.
    for budgets in ([3, 40, 9, 40, 1, 17], [40, 2, 40, 5, 40, 40]):
        for batch_size in (2, 3, 6):
            together = greedy_generate(model, _prompts(tokenizer, budgets), batch_size=batch_size)
            assert together == [t[:n] for t, n in zip(alone, budgets)], (budgets, batch_size)


def test_eos_and_stop_end_a_row_with_their_token_included(model, tokenizer):
    (full,) = greedy_generate(model, [Prompt(tokenizer("the cat sat on").input_ids, 30)], batch_size=1)
    eos = full[5]
    (ended,) = greedy_generate(model, [Prompt(tokenizer("the cat sat on").input_ids, 30)], batch_size=1, eos_token_ids=[eos])
    assert ended == full[:full.index(eos) + 1] and len(ended) <= 6
    seen = []
    stopped = greedy_generate(model, [Prompt(tokenizer("the cat sat on").input_ids, 30, lambda toks: seen.append(len(toks)) or len(toks) == 4)],
                              batch_size=1)
    assert stopped == [full[:4]] and seen == [1, 2, 3, 4]


def test_packed_cache_keeps_each_rows_keys_through_removal_and_refill():
    def prefill(length, fill):
        from transformers.cache_utils import Cache, DynamicLayer

        cache = Cache(layers=[DynamicLayer()])  # one layer, 2 heads, head dim 3
        kv = torch.full((1, 2, length, 3), float(fill))
        cache.update(kv, -kv, 0)
        return cache

    kv = PackedKV(num_layers=1, slots=3)
    for slot, (length, fill) in enumerate([(4, 1), (6, 2), (2, 3)]):
        kv.insert(slot, prefill(length, fill), length)
    assert kv.lengths == [4, 6, 2] and kv.width == 6

    def row(slot):
        n = kv.lengths[slot]
        return kv.keys[0][slot, :, kv.end - n:kv.end], kv.values[0][slot, :, kv.end - n:kv.end]

    kv.remove(1)  # the last row moves into slot 1; the window shrinks to the longest remaining row
    assert kv.rows == 2 and kv.lengths == [4, 2] and kv.width == 4
    assert torch.equal(row(1)[0], torch.full((2, 2, 3), 3.0)) and torch.equal(row(1)[1], torch.full((2, 2, 3), -3.0))
    assert torch.equal(row(0)[0], torch.full((2, 4, 3), 1.0))
    kv.insert(0, prefill(9, 4), 9)  # a longer prompt than the window: re-laid out, the other row intact
    assert kv.lengths == [9, 2] and kv.width == 9
    assert torch.equal(row(0)[0], torch.full((2, 9, 3), 4.0)) and torch.equal(row(1)[0], torch.full((2, 2, 3), 3.0))
    mask, positions = kv.step_inputs("cpu")
    assert positions.tolist() == [[9], [2]]
    assert mask.tolist() == [[1] * 10, [0] * 7 + [1] * 3]


def test_sampling_requests_go_through_hflms_own_loop(tokenizer):
    model = tiny_causal_lm("qwen2", seed=0)
    sampled = [dict(until=[], max_gen_toks=12, do_sample=True, temperature=1.0)] * 2
    requests = _requests(CONTEXTS[:3], sampled + [GEN_KWARGS[0]])
    torch.manual_seed(0)  # HFLM's loop at our batch size runs the sampled requests first, from this seed
    reference = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=4, device="cpu").generate_until(requests[:2], disable_tqdm=True)
    reference += HFLM(pretrained=model, tokenizer=tokenizer, batch_size=1, device="cpu").generate_until(requests[2:], disable_tqdm=True)
    torch.manual_seed(0)
    ours = ContinuousHFLM(pretrained=model, tokenizer=tokenizer, batch_size=4, device="cpu").generate_until(requests, disable_tqdm=True)
    assert ours == reference
    torch.manual_seed(1)
    assert ContinuousHFLM(pretrained=model, tokenizer=tokenizer, batch_size=4, device="cpu").generate_until(requests, disable_tqdm=True)[:2] != ours[:2]


def test_models_and_settings_it_cannot_run_exactly_are_refused_in_one_line(tokenizer):
    model = tiny_causal_lm("qwen2", seed=0)
    model.generation_config.repetition_penalty = 1.3
    with pytest.raises(SinkstudyError, match="repetition_penalty=1.3.*use --backend hf"):
        ContinuousHFLM(pretrained=model, tokenizer=tokenizer, batch_size=2, device="cpu")
    from evals.lmeval import run_eval

    with pytest.raises(SinkstudyError, match="hf-continuous backend needs an integer batch size, got 'auto'"):
        run_eval(tiny_causal_lm("qwen2", seed=0), tokenizer, tasks="sinkstudy_gsm", backend="hf-continuous", batch_size="auto")


@pytest.mark.slow
def test_run_eval_backends_have_their_own_step_keys_and_the_same_samples(tokenizer):
    from evals.lmeval import run_eval
    from evals.protocol import EvalProtocol
    from experiments.study.kinds import Ref, step_key
    from experiments.study.pair_steps import MeasureEval

    model = tiny_causal_lm("qwen2", seed=0)
    kw = dict(tasks="sinkstudy_ifeval,sinkstudy_gsm", limit=4, max_gen_toks=16, progress=False)
    runs = {b: run_eval(model, tokenizer, backend=b, batch_size=n, **kw) for b, n in (("hf", 1), ("hf-continuous", 3))}
    hf, ours = runs["hf"], runs["hf-continuous"]
    assert hf.settings["backend"] == "hf" and ours.settings["backend"] == "hf-continuous"
    keys = {b: step_key(MeasureEval(Ref("org/m"), Ref("org/m"), EvalProtocol(backend=b), out=Path("eval")), None)[0] for b in runs}
    assert keys["hf"] != keys["hf-continuous"]  # an eval step on one backend is never reused for the other
    # HFLM at its default batch size 1 and ours at 3 give the same texts, hence the same scores.
    assert {t: [s["output"] for s in rows] for t, rows in hf.samples.items()} == \
           {t: [s["output"] for s in rows] for t, rows in ours.samples.items()}
    assert hf.scores == ours.scores


def test_bench_divergence_names_the_first_differing_token_and_its_batch1_logit_gap(tokenizer):
    from benchmarks.generate import divergence

    model = tiny_causal_lm("qwen2", seed=0)
    ids = tokenizer("the cat sat on").input_ids
    (greedy,) = greedy_generate(model, [Prompt(ids, 8)], batch_size=1)
    other = greedy[:3] + [(greedy[3] + 1) % 512] + greedy[4:]
    text = divergence(model, ids, greedy, other)
    assert text.startswith(f"token 3: default {greedy[3]} ") and f"vs ours {other[3]} " in text
    gap = float(text.split("gap ")[1].split(",")[0])
    assert gap > 0  # the default's token is the batch-1 argmax
    assert divergence(model, ids, greedy, greedy[:5]).startswith("same tokens up to 5")


@pytest.mark.slow
def test_bench_runs_end_to_end_on_a_tiny_checkpoint(tokenizer, tmp_path, capsys):
    from benchmarks.generate import main

    tiny_causal_lm("llama", seed=3).save_pretrained(tmp_path / "m")
    tokenizer.save_pretrained(tmp_path / "m")
    assert main(["--model", str(tmp_path / "m"), "--quick", "--limit", "2", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "ours / HF generate at batch 4: " in out and "ours / lm-eval default: " in out
    assert "identical outputs vs lm-eval default: 4/4 (100.0%)" in out
    assert "load average (1, 5, 15 min) before: " in out and "answer lengths of lm-eval's default" in out
    assert main(["--model", str(tmp_path / "missing")]) == 2
    assert "cannot load" in capsys.readouterr().err
