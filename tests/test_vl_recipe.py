"""The VL instruction recipe's data and measures: generated records of every kind are deterministic, carry
their format instruction and encode with answer-only labels; held-out images never appear in training;
the self-distilled text share is keyed and refused in one line when it cannot be made; template share and
the held-out VQA score follow their stated definitions; the lm-eval VQA task loads its docs."""

import hashlib

import numpy as np
import pytest

from evals import template_share as ts
from evals import vqa
from evals.vl import digits, easyvqa, scenes
from evals.vl.questions import SHORT
from interventions.adapt import encoding, generated, selfdistill, sources
from interventions.adapt.build import build_vlm
from interventions.adapt.config import VisionSpec
from sinkstudy import SinkstudyError
from sinkstudy.tiny import tiny_causal_lm

TINY = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "image_size": 64, "patch_size": 16}


def _pixels(image) -> str:
    from PIL import Image

    if isinstance(image, np.ndarray):
        image = Image.fromarray(image)
    elif not hasattr(image, "convert"):
        image = Image.open(image)
    return hashlib.sha256(np.asarray(image.convert("RGB")).tobytes()).hexdigest()


def test_generated_records_are_deterministic_per_seed_and_kind():
    for kind in generated.KINDS:
        a, b = generated.GeneratedRows(kind, 6, seed=0), generated.GeneratedRows(kind, 6, seed=0)
        assert [r["messages"] for r in a] == [r["messages"] for r in b]
        assert [_pixels(r["images"][0]) for r in a] == [_pixels(r["images"][0]) for r in b]
        other = generated.GeneratedRows(kind, 6, seed=1)
        assert [r["messages"] for r in a] != [r["messages"] for r in other], kind


def test_short_answers_carry_the_format_instruction_and_long_kinds_do_not():
    for kind in ("easyvqa", "scene_vqa", "digit_vqa"):
        for r in generated.GeneratedRows(kind, 20):
            assert r["messages"][0]["content"].endswith(f"\n{SHORT}")
            assert len(r["messages"][1]["content"].split()) <= 2
    for kind in ("caption", "detail", "conversation", "reasoning"):
        rows = list(generated.GeneratedRows(kind, 20))
        assert not any(SHORT in m["content"] for r in rows for m in r["messages"])
        lengths = {len(m["content"].split()) for r in rows for m in r["messages"] if m["role"] == "assistant"}
        assert max(lengths) > 8 and len(lengths) > 5, kind  # answers of varied length
    conv = list(generated.GeneratedRows("conversation", 30))
    assert {len(r["messages"]) // 2 for r in conv} >= {2, 3, 4}  # multi-turn, 2-4 exchanges


def test_heldout_images_never_appear_in_training():
    train = set()
    for kind in generated.KINDS:
        train |= {_pixels(r["images"][0]) for r in generated.GeneratedRows(kind, 150 if kind != "easyvqa" else 400)}
    train |= {hashlib.sha256(np.asarray(digits.rgb(i)).tobytes()).hexdigest() for i in digits.split_indices("train")}
    folder = easyvqa.data_dir() / "train" / "images"
    train_files = {hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.glob("*.png")}
    items = vqa.heldout_items()
    assert {it.source for it in items} == {"easyvqa", "scenes", "digits"}
    for it in items:
        if it.source == "easyvqa":
            assert hashlib.sha256(open(it.image, "rb").read()).hexdigest() not in train_files
        assert _pixels(it.image) not in train, it.key
    # the digits' held-out split is the one the engine holds out
    assert not set(digits.split_indices("heldout")) & set(digits.split_indices("train"))


def test_every_kind_encodes_with_answer_only_labels(tokenizer):
    built = build_vlm(tiny_causal_lm("qwen2", vocab_size=len(tokenizer)), tokenizer, VisionSpec("tiny", tiny=TINY))
    enc = encoding.Encoder(built.tokenizer, processor=built.processor, image_token=built.image_token)
    for kind in generated.KINDS:
        records = sources.load_records({"generated": kind, "n": 3})
        assert len(records) == 3
        r = records[0]
        out = enc(r)
        labelled = built.tokenizer.decode([t for t in out["labels"].tolist() if t != -100])
        answers = [m["content"] for m in r["messages"] if m["role"] == "assistant"]
        assert all(a in labelled for a in answers) and SHORT not in labelled
        assert int((out["input_ids"] == enc.image_token_id).sum()) == 16  # 64x64 image, 16-pixel patches


def test_bad_generated_and_selfdistill_specs_fail_in_one_line():
    for spec, words in [({"generated": "poems", "n": 3}, "unknown generated data kind"),
                        ({"generated": "detail", "n": 0}, "n must be a positive integer"),
                        ({"generated": "detail", "n": 3, "split": "test"}, "train or heldout"),
                        ({"selfdistill": "base", "prompts": 0}, "prompts must be a positive integer"),
                        ({"selfdistill": "base", "prompts": 100000}, "between 1 and"),
                        ({"selfdistill": "base", "max_new_tokens": "many"}, "positive integer")]:
        with pytest.raises(SinkstudyError, match=words) as err:
            sources.check_spec(spec)
        assert "\n" not in str(err.value)
    with pytest.raises(SinkstudyError, match="needs the run's base"):
        sources.load_records({"selfdistill": "base", "prompts": 2})


def test_neutral_prompts_are_stable_and_carry_no_format_constraint():
    a = selfdistill.neutral_prompts(50)
    assert a == selfdistill.neutral_prompts(200)[:50] and len(set(a)) == 50
    banned = ("words", "sentence", "paragraph", "bullet", "json", "title", "capital", "lowercase", "quotation", "comma")
    assert not any(b in p.lower() for p in selfdistill.neutral_prompts(400) for b in banned)


def test_selfdistill_key_covers_model_prompts_and_settings():
    s = selfdistill.settings_of({"selfdistill": "base"})
    k = selfdistill.cache_key("fp-a", s)
    assert k != selfdistill.cache_key("fp-b", s)
    assert k != selfdistill.cache_key("fp-a", {**s, "prompts": s["prompts"] - 1})
    assert k != selfdistill.cache_key("fp-a", {**s, "max_new_tokens": 7})


def test_selfdistill_cuts_unended_replies_at_their_last_sentence_and_refuses_when_none_holds_one(tmp_path, tokenizer,
                                                                                                      monkeypatch):
    assert selfdistill.cut_at_sentence("Bees make honey. They fly to") == "Bees make honey."
    assert selfdistill.cut_at_sentence('He said "stop." Then 3.5 times') == 'He said "stop."'
    assert selfdistill.cut_at_sentence("1. First item.\n2. Second") == "1. First item."  # a list marker ends nothing
    assert selfdistill.cut_at_sentence("no sentence ends here") == ""
    monkeypatch.setenv("SINKSTUDY_CACHE", str(tmp_path / "cache"))
    base = tmp_path / "base"
    tiny_causal_lm("qwen2", vocab_size=len(tokenizer)).save_pretrained(base)
    tokenizer.save_pretrained(base)
    with pytest.raises(SinkstudyError, match="no reply holds a whole sentence within 1 tokens"):
        sources.load_records({"selfdistill": "base", "prompts": 3, "max_new_tokens": 1}, base=str(base))
    assert not list((tmp_path / "cache").rglob("*.jsonl"))  # nothing cached for a failed run


def test_template_share_definition():
    openings = ts.openings(["It is a 7.", "yes", "top left", "The image shows two shapes on a light background."])
    assert openings.matches("It is a 3, I think.") and openings.matches("Yes.") and openings.matches("Top left")
    assert openings.matches("the IMAGE shows, two circles")
    assert not openings.matches("Yes, and here is a long essay about rivers.")  # opens with a short answer, goes on
    assert not openings.matches("It is raining today.")  # "it is raining today" is not "it is a 7"
    share = ts.template_share(["It is a 5.", "Rivers are long.", "yes", "No idea"], openings)
    assert (share.share, share.templated, share.n) == (0.5, 2, 4)


def test_vqa_normalisation_and_per_type_score():
    assert vqa.normalise("Three.") == "3" and vqa.normalise("The top left corner") == "top left"
    assert vqa.normalise("Grey") == "gray" and vqa.normalise("a Circle!") == "circle"
    items = [vqa.Item(None, "q", a, t, "scenes", str(k)) for k, (a, t) in enumerate(
        [("3", "count"), ("2", "count"), ("top left", "where"), ("yes", "yes/no"), ("yes", "yes/no")])]
    s = vqa.score(["three", "4", "the top left", "Yes.", "no"], items)
    assert s.accuracy == pytest.approx(3 / 5)
    assert s.by_type["count"] == {"accuracy": 0.5, "n": 2, "chance": 1 / 5, "majority": 0.5}
    assert s.by_type["where"]["chance"] == pytest.approx(1 / 9) and s.by_type["yes/no"]["majority"] == 1.0


def test_heldout_items_cover_each_type_and_redraw_from_their_keys():
    items = vqa.heldout_items(20, 25, 10, seed=3)
    assert len(items) == 55
    assert {it.type for it in items} == {"count", "where", "colour", "shape", "yes/no", "digit"}
    for it in items[::7]:
        assert _pixels(vqa.image_of(it.key)) == _pixels(it.image)
    assert [it.question for it in vqa.heldout_items(20, 25, 10, seed=3)] == [it.question for it in items]


def test_scene_facts_match_the_picture():
    s = scenes.scene("heldout", 5)
    image = np.asarray(scenes.render(s))
    for t in s.things:
        x0, y0, x1, y1 = t.box()
        cx, cy = (x0 + x1) // 2, (y0 + y1) // 2 + (2 if t.shape == "triangle" else 0)
        assert tuple(image[cy, cx]) == scenes.RGB[t.colour], t
    labels = scenes.patch_labels(s, 16)
    assert set(labels) - {0} == set(range(1, len(s.things) + 1))


def test_the_lm_eval_vqa_task_reads_the_heldout_items(monkeypatch):
    from lm_eval.tasks import TaskManager, get_task_dict

    from evals.tasks import TASKS_DIR

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    task = get_task_dict(["sinkstudy_vqa"], TaskManager(include_path=str(TASKS_DIR), include_defaults=False))["sinkstudy_vqa"]
    docs = list(task.test_docs())
    items = vqa.heldout_items()
    assert [d["question"] for d in docs] == [it.question for it in items]
    assert task.doc_to_text(docs[0]) == items[0].prompt
    assert _pixels(task.doc_to_image(docs[5])[0]) == _pixels(items[5].image)
    assert task.process_results(docs[0], [f"{docs[0]['answer'].capitalize()}."]) == {"exact_match": 1.0}


def test_vqa_answers_a_saved_vlm_from_the_prompt_training_formats(tmp_path, tokenizer):
    from interventions.adapt.vlm_io import load_vlm, save_vlm

    built = build_vlm(tiny_causal_lm("qwen2", vocab_size=len(tokenizer)), tokenizer, VisionSpec("tiny", tiny=TINY))
    save_vlm(built, built.processor, tmp_path / "vlm")
    model, processor = load_vlm(tmp_path / "vlm")
    items = vqa.heldout_items(2, 5, 2)
    # the eval's prompt tokens are the engine's for the same user turn (the training format)
    enc = encoding.Encoder(built.tokenizer, processor=built.processor, image_token=built.image_token)
    record = {"images": [items[0].image], "messages": [{"role": "user", "content": items[0].prompt}, {"role": "assistant", "content": "x"}]}
    user = items[0].prompt.replace("<image>", processor.image_token)
    text = processor.tokenizer.apply_chat_template([{"role": "user", "content": user}], tokenize=False, add_generation_prompt=True)
    ids = processor(text=[text], images=[vqa._rgb(items[0].image)], return_tensors="pt", add_special_tokens=False)["input_ids"][0].tolist()
    assert enc(record)["input_ids"].tolist()[:len(ids)] == ids
    result, answers = vqa.vqa_accuracy(model, processor, items, batch_size=4, max_new_tokens=3)
    assert len(answers) == len(items) == result.n and all(isinstance(a, str) for a in answers)


def _vlm_dir(tmp_path, tokenizer, name: str):
    from interventions.adapt.vlm_io import save_vlm

    built = build_vlm(tiny_causal_lm("qwen2", vocab_size=len(tokenizer)), tokenizer, VisionSpec("tiny", tiny=TINY))
    save_vlm(built, built.processor, tmp_path / name)
    return tmp_path / name


def _lm_eval_vqa(vlm_dir, n: int) -> list[str]:
    import lm_eval
    from lm_eval.tasks import TaskManager

    from evals.tasks import TASKS_DIR

    out = lm_eval.simple_evaluate(model="hf-multimodal", model_args=f"pretrained={vlm_dir},dtype=float32", tasks=["sinkstudy_vqa"],
                                  apply_chat_template=True, limit=n, batch_size=1, device="cpu", log_samples=True,
                                  task_manager=TaskManager(include_path=str(TASKS_DIR), include_defaults=False))
    return [s["resps"][0][0].split("\n")[0].strip() for s in sorted(out["samples"]["sinkstudy_vqa"], key=lambda s: s["doc_id"])]


def test_the_lm_eval_vqa_task_runs_on_a_saved_vlm_with_its_chat_template_and_agrees_item_for_item(tmp_path, tokenizer,
                                                                                                 monkeypatch):
    """`lm_eval --model hf-multimodal ... --tasks sinkstudy_vqa --apply_chat_template` on a recipe-built VLM: its saved
    chat template renders lm-eval's content parts (image, text) as the training prompt, and every item's greedy answer
    equals `evals.vqa`'s for the same VLM, for a tokenizer that adds no BOS when it encodes (SmolLM2's, Qwen's: the chat
    template writes it)."""
    import copy

    from interventions.adapt.vlm_io import load_vlm

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    plain = copy.deepcopy(tokenizer)
    plain.backend_tokenizer.post_processor = None  # encodes without a BOS of its own
    vlm_dir = _vlm_dir(tmp_path, plain, "vlm")
    model, processor = load_vlm(vlm_dir)
    user = [{"role": "user", "content": "Say hi."}]
    assert processor.apply_chat_template(user, tokenize=False) == plain.apply_chat_template(user, tokenize=False)
    as_parts = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "\nWhat is it?"}]}]
    as_text = [{"role": "user", "content": f"{processor.image_token}\nWhat is it?"}]
    assert processor.apply_chat_template(as_parts, tokenize=False) == processor.apply_chat_template(as_text, tokenize=False)
    n = 8
    ours = vqa.generate_answers(model, processor, vqa.heldout_items()[:n], batch_size=1)
    assert _lm_eval_vqa(vlm_dir, n) == [o.split("\n")[0].strip() for o in ours]
    assert len(set(ours)) > 1  # answers that differ between items: the comparison is not of one constant


def test_lm_eval_multimodal_adds_a_second_bos_for_a_tokenizer_that_adds_one(tmp_path, tokenizer):
    """lm-eval 0.4.13's hf-multimodal encodes the chat-templated prompt with the processor's default special tokens (its
    own TODO): a tokenizer that adds a BOS when it encodes (Gemma's) then sees two. docs/adapt.md says so; this test
    notices when lm-eval changes."""
    from PIL import Image
    from lm_eval.models.hf_vlms import HFMultimodalLM

    vlm_dir = _vlm_dir(tmp_path, tokenizer, "vlm-bos")
    lm = HFMultimodalLM(pretrained=str(vlm_dir), dtype="float32", batch_size=1, device="cpu")
    text = lm.processor.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi"}]}],
                                            tokenize=False, add_generation_prompt=True)
    image = Image.new("RGB", (64, 64))
    theirs = lm.tok_batch_multimodal_encode([text], [[image]])["input_ids"][0].tolist()
    ours = lm.processor(text=[text], images=[image], add_special_tokens=False)["input_ids"][0]
    assert theirs == [tokenizer.bos_token_id] + list(ours) and ours[0] == tokenizer.bos_token_id
