"""The eval protocol's knobs reach what lm-eval renders and runs, on a real tiny model:
chat-template kwargs and the system instruction in the rendered prompt, batch auto detected by
HFLM itself, values with commas through the CLI, the vLLM-missing refusal, every knob in the
results and the cache key; the shipped tasks run by lm-eval's own CLI give sinkstudy's numbers; evals
imports nothing above it. (Data-parallel evaluation: tests/test_data_parallel.py.)"""

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from evals import lmeval
from evals.eval_run import EvalRun
from evals.lmeval import run_eval
from evals.protocol import check_batch_size, parse_kwargs
from experiments.cli import main as cli_main
from sinkstudy import SinkstudyError
from sinkstudy.tiny import CHAT_TEMPLATE, tiny_causal_lm

ROOT = Path(__file__).resolve().parent.parent
TASKS_DIR = ROOT / "evals" / "tasks"
QUICK = dict(tasks="sinkstudy_ifeval", limit=2, max_gen_toks=3, batch_size=2, progress=False)
# Qwen3-style: with enable_thinking false, an empty reasoning block opens the answer.
THINK_TEMPLATE = CHAT_TEMPLATE.replace(
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}",
    "{% if add_generation_prompt %}<|assistant|>\n{% if enable_thinking is defined and enable_thinking is false %}"
    "<think>\n\n</think>\n\n{% endif %}{% endif %}")


@pytest.fixture(scope="module")
def model():
    return tiny_causal_lm("llama", seed=3)


def _eval_key(settings: dict) -> str:
    """The key of an eval step (`experiments.study.pair_steps.MeasureEval`) under a run's recorded protocol knobs."""
    from evals.protocol import EvalProtocol
    from experiments.study.kinds import Ref, step_key
    from experiments.study.pair_steps import MeasureEval

    protocol = EvalProtocol(**{k: settings[k] for k in ("limit", "max_gen_toks", "batch_size", "chat_template_kwargs",
                                                         "system_instruction", "gen_kwargs", "backend", "backend_args")})
    return step_key(MeasureEval(Ref("org/model"), Ref("org/model"), protocol, out=Path("eval")), None)[0]


def _prompts(run, task="sinkstudy_ifeval"):
    return [s["prompt"] for s in run.samples[task]]


# ----------------------------------------------------------------------------- parsing


@pytest.mark.parametrize("text, expected", [
    ('{"enable_thinking": false}', {"enable_thinking": False}),
    ("enable_thinking=false", {"enable_thinking": False}),
    ('tensor_parallel_size=2,gpu_memory_utilization=0.85,max_model_len=4096',
     {"tensor_parallel_size": 2, "gpu_memory_utilization": 0.85, "max_model_len": 4096}),
    # commas inside quotes, brackets and braces survive (lm-eval's own splitter)
    ('stop="a,b",until=["</s>","x,y"],extra={"k": 1, "j": 2},name=plain', {"stop": "a,b", "until": ["</s>", "x,y"],
                                                                           "extra": {"k": 1, "j": 2}, "name": "plain"}),
    ('{"chat_template_args": {"a": [1, 2]}, "x": "p,q"}', {"chat_template_args": {"a": [1, 2]}, "x": "p,q"}),
    ("", {}),
])
def test_kwargs_strings_parse_with_commas_inside_values(text, expected):
    assert parse_kwargs(text, "--backend-args") == expected


@pytest.mark.parametrize("text, needle", [
    ("tensor_parallel_size", "is not KEY=VALUE"),
    ("{'single': 'quotes'}", "not a valid JSON object"),
    ('["a", "b"]', "is not KEY=VALUE"),
])
def test_bad_kwargs_strings_fail_in_one_line(text, needle):
    with pytest.raises(SinkstudyError, match=needle) as exc:
        parse_kwargs(text, "--backend-args")
    assert "\n" not in str(exc.value)


def test_batch_size_accepts_integers_and_lm_eval_auto():
    assert check_batch_size("auto") == "auto" and check_batch_size("auto:4") == "auto:4" and check_batch_size("8") == 8
    for bad in (0, "auto:", "big", True, 1.5):
        with pytest.raises(SinkstudyError, match="batch size must be"):
            check_batch_size(bad)


# ----------------------------------------------------------------------------- knobs reach the prompt


def test_chat_template_kwargs_reach_the_rendered_prompt(model, tokenizer):
    import copy

    think = copy.deepcopy(tokenizer)
    think.chat_template = THINK_TEMPLATE
    default = run_eval(model, think, **QUICK)
    off = run_eval(model, think, chat_template_kwargs={"enable_thinking": False}, **QUICK)
    for a, b in zip(_prompts(default), _prompts(off)):
        assert a.endswith("<|assistant|>\n") and b == a + "<think>\n\n</think>\n\n"
    assert off.settings["chat_template_kwargs"] == {"enable_thinking": False}  # recorded with the results
    assert _eval_key(off.settings) != _eval_key(default.settings)  # and part of the eval step's key
    # A template that does not read the variable renders exactly as without it (the paper config
    # sets it for all six pairs; only the Qwen3 bases' templates read it).
    plain = run_eval(model, tokenizer, chat_template_kwargs={"enable_thinking": False}, **QUICK)
    assert _prompts(plain) == _prompts(default)


def test_unset_thinking_variable_is_warned_about(model, tokenizer, caplog):
    import copy

    think = copy.deepcopy(tokenizer)
    think.chat_template = THINK_TEMPLATE
    run_eval(model, think, **QUICK)
    assert "reads enable_thinking and none was given" in caplog.text


def test_system_instruction_reaches_the_rendered_prompt(model, tokenizer):
    run = run_eval(model, tokenizer, system_instruction="Answer in one short line.", **QUICK)
    for p in _prompts(run):
        assert p.startswith("<|bos|><|system|>\nAnswer in one short line.<|end|>\n<|user|>\n")
    assert run.settings["system_instruction"] == "Answer in one short line."
    bare = run_eval(model, tokenizer, apply_chat_template=False, system_instruction="SYS:", **QUICK)
    assert all(p.startswith("SYS:") for p in _prompts(bare))  # without a chat template: lm-eval's prefix


def test_gen_kwargs_reach_generation(model, tokenizer):
    free = run_eval(model, tokenizer, **{**QUICK, "max_gen_toks": 12})
    outputs = [s["output"] for s in free.samples["sinkstudy_ifeval"]]
    # a stop string cut at the first occurrence of a character the free output contains
    stop = next(ch for ch in outputs[0][1:] if ch.strip())
    cut = run_eval(model, tokenizer, gen_kwargs={"until": [stop]}, **{**QUICK, "max_gen_toks": 12})
    assert cut.samples["sinkstudy_ifeval"][0]["output"] == outputs[0][: outputs[0].index(stop)]
    assert cut.settings["gen_kwargs"] == {"until": [stop]}
    with pytest.raises(SinkstudyError, match="set max_gen_toks with --max-gen-toks"):
        run_eval(model, tokenizer, gen_kwargs={"max_gen_toks": 5}, **QUICK)


def test_batch_auto_is_detected_by_hflm(model, tokenizer, monkeypatch):
    from lm_eval.models.huggingface import HFLM

    detected = []
    real = HFLM._detect_batch_size

    def spy(self, *a, **k):
        detected.append(real(self, *a, **k))
        return detected[-1]

    monkeypatch.setattr(HFLM, "_detect_batch_size", spy)
    # max_length bounds the probe batch lm-eval runs to find the largest batch that fits
    auto = run_eval(model, tokenizer, backend_args={"max_batch_size": 2, "max_length": 128},
                    **{**QUICK, "batch_size": "auto"})
    assert detected == [2] and auto.settings["batch_size"] == "auto"
    fixed = run_eval(model, tokenizer, backend_args={"max_length": 128}, **QUICK)
    assert [s["output"] for s in auto.samples["sinkstudy_ifeval"]] == [s["output"] for s in fixed.samples["sinkstudy_ifeval"]]


def test_reserved_backend_args_point_to_their_own_setting(model, tokenizer):
    with pytest.raises(SinkstudyError, match="use --chat-template-kwargs"):
        run_eval(model, tokenizer, backend_args={"chat_template_args": {"x": 1}}, **QUICK)
    with pytest.raises(SinkstudyError, match="use --batch-size"):
        run_eval(model, tokenizer, backend_args={"batch_size": 4}, **QUICK)


# ----------------------------------------------------------------------------- CLI


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer):
    # llama: AutoTokenizer keeps the saved tokenizer's class (it forces its own for qwen2), so
    # lm-eval's CLI and sinkstudy read the same tokenizer.
    path = tmp_path_factory.mktemp("tiny_llama")
    tiny_causal_lm("llama", seed=3).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_cli_protocol_flags_with_commas_are_recorded(model_dir, tmp_path, capsys):
    out = tmp_path / "run"
    rc = cli_main(["eval", str(model_dir), "--tasks", "sinkstudy_gsm", "--limit", "2", "--max-gen-toks", "4",
                   "--batch-size", "2", "--chat-template-kwargs", '{"enable_thinking": false}',
                   "--system-instruction", "Think, then answer.", "--gen-kwargs", 'until=["Q:","x,y"]',
                   "--backend-args", 'max_length=256,revision="main,unused"', "--out", str(out), "--cache-dir", str(tmp_path / "c")])
    assert rc == 0, capsys.readouterr().err
    settings = EvalRun.load(out).settings
    assert settings["chat_template_kwargs"] == {"enable_thinking": False}
    assert settings["system_instruction"] == "Think, then answer."
    assert settings["gen_kwargs"] == {"until": ["Q:", "x,y"]}
    assert settings["backend_args"] == {"max_length": 256, "revision": "main,unused"}
    assert settings["dtype"] == "float32"
    assert "Think, then answer." in EvalRun.load(out).samples["sinkstudy_gsm"][0]["prompt"]


@pytest.mark.parametrize("argv, needle", [
    (["--backend", "vllm"], "needs the vllm package"),
    (["--chat-template-kwargs", "{bad json}"], "--chat-template-kwargs: not a valid JSON object"),
    (["--gen-kwargs", "temperature"], "--gen-kwargs: 'temperature' is not KEY=VALUE"),
    (["--backend-args", "pretrained=other"], "'pretrained' is set by sinkstudy"),
])
def test_cli_bad_protocol_input_is_one_line_before_any_work(model_dir, tmp_path, capsys, argv, needle):
    import importlib.util

    if argv[:2] == ["--backend", "vllm"] and importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm is installed here")
    out = tmp_path / "run"
    rc = cli_main(["eval", str(model_dir), "--tasks", "sinkstudy_gsm", "--out", str(out), "--cache-dir", str(tmp_path / "c"), *argv])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and needle in err
    assert not out.exists() and not (tmp_path / "c").exists()


def test_merge_and_qknorm_take_the_protocol_flags():
    from experiments.cli import build_parser

    parser = build_parser()
    for argv in (["merge", "--method", "linear", "--base", "b", "--vlm", "v"], ["mitigate", "--base", "b", "--vlm", "v"],
                 ["merge-sweep", "--base", "b", "--vlm", "v"], ["qknorm", "b"]):
        args = parser.parse_args([*argv, "--chat-template-kwargs", "enable_thinking=false", "--system-instruction", "S",
                                  "--gen-kwargs", "temperature=0", "--num-fewshot", "0"])
        from experiments.cli.options import eval_protocol

        protocol = eval_protocol(args)
        assert (dict(protocol.chat_template_kwargs), protocol.system_instruction, dict(protocol.gen_kwargs), protocol.num_fewshot,
                protocol.confirm_run_unsafe_code) == ({"enable_thinking": False}, "S", {"temperature": 0}, 0, False)


# ----------------------------------------------------------------------------- lm-eval's own CLI


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(ROOT), **extra)
    return env


@pytest.mark.slow(seconds=60)
def test_lm_eval_cli_runs_the_shipped_task_and_agrees_with_sinkstudy(model_dir, tmp_path, capsys):
    """`lm_eval --include_path evals/tasks --tasks sinkstudy_ifeval` from another working directory:
    same prompts, same outputs, same aggregate as `sinkstudy eval` with the same settings."""
    limit, toks = 8, 24
    r = subprocess.run([sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args", f"pretrained={model_dir}",
                        "--include_path", str(TASKS_DIR), "--tasks", "sinkstudy_ifeval", "--limit", str(limit),
                        "--batch_size", "4", "--device", "cpu", "--apply_chat_template", "--gen_kwargs", f"max_gen_toks={toks}",
                        "--output_path", str(tmp_path / "lm_eval"), "--log_samples"],
                       capture_output=True, text=True, cwd=tmp_path, env=_env(), timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    (results_file,) = (tmp_path / "lm_eval").rglob("results_*.json")
    (samples_file,) = (tmp_path / "lm_eval").rglob("samples_sinkstudy_ifeval_*.jsonl")
    theirs = json.loads(results_file.read_text())["results"]["sinkstudy_ifeval"]
    their_samples = sorted((json.loads(line) for line in samples_file.read_text().splitlines()), key=lambda s: s["doc_id"])

    out = tmp_path / "ours"
    assert cli_main(["eval", str(model_dir), "--tasks", "sinkstudy_ifeval", "--limit", str(limit), "--batch-size", "4",
                     "--max-gen-toks", str(toks), "--out", str(out), "--cache-dir", str(tmp_path / "c")]) == 0
    ours = EvalRun.load(out)
    assert [s["resps"][0][0] for s in their_samples] == [s["output"] for s in ours.samples["sinkstudy_ifeval"]]
    assert [s["arguments"]["gen_args_0"]["arg_0"] for s in their_samples] == _prompts(ours)
    for metric in ours.metrics("sinkstudy_ifeval"):
        assert theirs[metric] == pytest.approx(ours.scores["sinkstudy_ifeval"][metric])
    # the random model still satisfies some instructions: the aggregate compared is not all zeros
    assert ours.scores["sinkstudy_ifeval"]["inst_level_loose_acc,none"] > 0


# ----------------------------------------------------------------------------- loading and layering


def test_a_path_loads_through_the_callers_loader(model_dir, tokenizer):
    from evals.lm_backends import auto_causal_lm

    calls = []

    def loader(path, *, device=None, dtype=None):
        calls.append((path, device, dtype))
        return auto_causal_lm(path, device=device, dtype=dtype)

    first = run_eval(model_dir, tokenizer, loader=loader, dtype="bfloat16", **QUICK)
    assert calls == [(str(model_dir), None, "bfloat16")] and first.settings["dtype"] == "bfloat16"


def test_evals_imports_nothing_from_the_layers_above():
    above = ("interventions", "experiments")
    for f in (ROOT / "evals").rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not [n for n in names if n.split(".")[0] in above], f"{f.relative_to(ROOT)} imports {names}"


@pytest.mark.slow
def test_paper_config_runs_the_papers_tasks_all_known_to_lm_eval():
    from evals.eval_run import HEADLINE_METRICS
    from experiments.study.config import load_study

    study = load_study(ROOT / "experiments" / "configs" / "paper_six_pairs.yaml")
    ev = study.evals.protocol
    assert ev.tasks == ("ifeval", "eq_bench", "gsm8k_cot", "gpqa_diamond_cot_zeroshot", "mmlu", "boolq", "mbpp", "mmlu_pro")
    assert ev.chat_template_kwargs == {"enable_thinking": False} and ev.num_fewshot == 0 and ev.batch_size == 8
    assert ev.confirm_run_unsafe_code is True  # mbpp runs generated code
    specs = lmeval.resolve_tasks(ev.tasks)  # lm-eval's own index: each a task or group, none a tag
    assert [s.name for s in specs] == list(ev.tasks)
    assert {s.name for s in specs if s.is_group} == {"mmlu", "mmlu_pro"}
    assert all(HEADLINE_METRICS.get(t) for t in ev.tasks)


@pytest.mark.parametrize("patch, needle", [
    ({"chat_template_kwargs": ["enable_thinking"]}, "evals.chat_template_kwargs must be a mapping"),
    ({"gen_kwargs": {"max_gen_toks": 5}}, "evals.gen_kwargs: generation kwargs: set max_gen_toks with --max-gen-toks (evals.max_gen_toks)"),
    ({"backend": "tgi"}, "evals.backend: must be one of hf, hf-continuous, vllm"),
    ({"backend_args": {"pretrained": "x"}}, "evals.backend_args: backend args: 'pretrained' is set by sinkstudy"),
    ({"system_instruction": ""}, "evals.system_instruction: system instruction must be non-empty text"),
    ({"confirm_run_unsafe_code": "yes"}, "evals.confirm_run_unsafe_code: must be true or false"),
    ({"batch_size": "auto:"}, "evals.batch_size: batch size must be an integer >= 1, 'auto' or 'auto:N'"),
])
def test_study_evals_protocol_keys_are_checked_in_one_line(patch, needle):
    from experiments.study.config import StudyConfigError, validate

    raw = {"name": "t", "pairs": [{"name": "p", "base": "a/b", "vlm": "c/d"}], "evals": {"tasks": ["sinkstudy_gsm"], **patch}}
    with pytest.raises(StudyConfigError) as exc:
        validate(raw)
    assert needle in str(exc.value) and "\n" not in str(exc.value)
    ok = validate({**raw, "evals": {"tasks": ["sinkstudy_gsm"], "batch_size": "auto:2", "gen_kwargs": {"temperature": 0}}})
    assert ok.evals.protocol.batch_size == "auto:2" and ok.evals.protocol.chat_template_kwargs == {}


def test_study_with_vllm_plans_anywhere_and_runs_only_where_installed(tmp_path, capsys):
    import importlib.util

    import yaml

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm is installed here")
    cfg = tmp_path / "s.yaml"
    cfg.write_text(yaml.safe_dump({"name": "v", "pairs": [{"name": "p", "base": "a/b", "vlm": "c/d", "native_qk_norm": True}],
                                   "evals": {"tasks": ["sinkstudy_gsm"], "backend": "vllm", "batch_size": "auto",
                                             "backend_args": {"tensor_parallel_size": 2}}}))
    out = tmp_path / "out"
    assert cli_main(["run", str(cfg), "--out", str(out), "--plan"]) == 0
    assert "--step p/eval/vlm" in capsys.readouterr().out
    for extra in ([], ["--step", "p/extract"]):
        assert cli_main(["run", str(cfg), "--out", str(out), *extra]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "needs the vllm package" in err
    assert not out.exists()
