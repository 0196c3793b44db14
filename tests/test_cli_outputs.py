"""What a user meets: numbers named for what they are (no recovery
without a loss, GSM by both graders, final vs mean loss), data identity visible (a run on other
data says so; `compare` names the --data that would make two runs comparable), and outputs where a
user looks (a merge's folder is a run `compare` reads; the extracted VLM LM is named; `eval` writes
to a default --out and reuses it as `sink` does)."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from evals.eval_run import EvalRun

STRICT, FLEX = "exact_match,strict-match", "exact_match,flexible-extract"


def _run(path: Path, passes: dict, task="sinkstudy_gsm", data_file=None, sha="shipped") -> Path:
    """An eval run of `task` with per-metric passes, recording where its prompts came from."""
    from evals.tasks import SHIPPED_TASKS, load_task_yaml
    from sinkstudy.provenance import file_sha256

    n = len(next(iter(passes.values())))
    samples = [{"doc_id": i, "doc_hash": f"{sha}-{i}", "prompt": f"p{i}", "output": "", "target": "", "extracted": {},
                "metrics": {m: bool(v[i]) for m, v in passes.items()}} for i in range(n)]
    default = next(iter(load_task_yaml(SHIPPED_TASKS[task])["dataset_kwargs"]["data_files"].values())) if task in SHIPPED_TASKS else None
    used = data_file or default
    prov = {"tasks": {task: {"task": task, "version": 1, "data_sha256": file_sha256(used) if used else None}},
            "data_files": {task: used}}
    EvalRun(scores={task: {m: float(np.mean(v)) for m, v in passes.items()}}, samples={task: samples}, settings={}, fingerprint=path.name,
            model_name=path.name, tasks=[task], provenance=prov).save(path)
    return path


# --------------------------------------------------------------------------- numbers

def test_recovery_is_a_number_only_where_there_is_a_loss_to_recover():
    """`merge --method ties --limit 2` printed "recovery 1.00" where the VLM had *gained* (0.0 -> 0.5)."""
    from evals.stats import NO_LOSS, recovery

    base, vlm, merged = np.array([0, 0] * 20), np.array([1, 0] * 20), np.array([0, 0] * 20)
    gained = recovery(base, vlm, merged, n_boot=500)
    assert gained.recovery is None and gained.ci == (None, None) and gained.status == NO_LOSS == "no loss to recover"
    assert gained.loss_points == pytest.approx(50.0) and gained.loss_points_ci[0] > 0
    assert json.loads(json.dumps(gained.as_dict()))["recovery"] is None  # in every JSON: null, with the status beside it
    lost = recovery(vlm, base, np.array([1, 0] * 10 + [0, 0] * 10), n_boot=500)  # base 50 -> VLM 0, merged 25
    assert lost.status == "recovery" and lost.recovery == pytest.approx(0.5) and lost.loss_points_ci[1] < 0


def test_merge_lines_say_no_loss_to_recover_and_name_gsm_by_both_graders():
    from experiments.cli.cmd_merge import _summary
    from experiments.report.treatments import recovery_text

    row = {"metric": FLEX, "base": 0.0, "vlm": 0.5, "score": 0.0, "recovery": None, "ci": [None, None], "status": "no loss to recover",
           "loss_points": 50.0, "loss_points_ci": [20.0, 80.0], "n": 2}
    assert recovery_text(row) == "no loss to recover (Δ VLM LM − base +50.0 points [+20.0, +80.0])"
    strict = {**row, "metric": STRICT, "status": "recovery", "recovery": 0.25, "ci": [0.1, 0.4]}
    measured = {"sink_strength": {"value": 1.0, "base": 1.2, "vlm": 0.4}, "tasks": {"sinkstudy_gsm": {**row, "also": {STRICT: strict}}}}

    class Args:
        base, vlm = "b", "v"

    result = _summary("merge", "ties merge", Path("/nonexistent"), measured, Args, None).result
    assert "sinkstudy_gsm exact_match,flexible-extract no loss to recover" in result
    assert "sinkstudy_gsm exact_match,strict-match recovery 0.25 [0.10, 0.40]" in result and "recovery 1.00" not in result


def test_eval_headline_names_both_gsm_graders_and_other_data(tmp_path):
    from evals.runs import data_sources, headline

    shipped = EvalRun.load(_run(tmp_path / "a", {STRICT: [1, 0, 0, 0], FLEX: [1, 1, 0, 0]}))
    assert headline(shipped) == "sinkstudy_gsm exact_match,strict-match 0.2500 / exact_match,flexible-extract 0.5000"
    assert data_sources(shipped) == {}
    mine = tmp_path / "heldout_gsm.jsonl"
    mine.write_text('{"question": "1+1?", "answer": "#### 2"}\n')
    other = EvalRun.load(_run(tmp_path / "b", {STRICT: [1, 0], FLEX: [1, 0]}, data_file=str(mine), sha="mine"))
    assert data_sources(other) == {"sinkstudy_gsm": str(mine)}
    assert headline(other).startswith("sinkstudy_gsm [data heldout_gsm.jsonl] exact_match,strict-match 0.5000")


def test_final_loss_is_the_mean_of_the_last_steps():
    from interventions.adapt.trainer import final_loss

    losses = [float(x) for x in range(100, 0, -1)]  # one logged loss per step, falling
    got = final_loss(losses, 100, 1)
    assert got == {"final_loss": pytest.approx(np.mean(losses[-10:])), "final_loss_steps": 10}
    assert got["final_loss"] < np.mean(losses)  # not the stage's mean
    assert final_loss(losses[:10], 10, 1) == {"final_loss": 91.0, "final_loss_steps": 1}
    assert final_loss([5.0, 4.0, 3.0], 40, 20) == {"final_loss": 3.0, "final_loss_steps": 20}  # logged every 20 steps
    assert final_loss([], 0, 1) == {"final_loss": None, "final_loss_steps": 0}


# --------------------------------------------------------------------------- data identity

def test_compare_of_two_datasets_names_the_data_that_would_make_them_comparable(tmp_path, capsys):
    """The demo's held-out sinkstudy_ifeval against a plain eval's shipped set: `compare` names the --data that makes them comparable."""
    from experiments.cli import main

    held = tmp_path / "heldout.jsonl"
    held.write_text("{}\n")
    demo = _run(tmp_path / "demo_base", {"prompt_level_strict_acc,none": [1, 0, 1]}, task="sinkstudy_ifeval",
                data_file=str(held), sha="held")
    plain = _run(tmp_path / "plain_vlm", {"prompt_level_strict_acc,none": [1, 0, 0]}, task="sinkstudy_ifeval")
    assert main(["compare", str(demo), str(plain), "--n-boot", "50"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"A was evaluated on {held}, B on the task's default data" in err
    assert f"rerun B with --data sinkstudy_ifeval={held}" in err


# --------------------------------------------------------------------------- outputs

def test_compare_reads_a_merge_output_folder(tmp_path, capsys):
    from experiments.cli import main

    base = _run(tmp_path / "base_eval", {STRICT: [1, 1, 0, 0], FLEX: [1, 1, 1, 0]})
    merge_out = tmp_path / "merge"
    _run(merge_out / "eval", {STRICT: [1, 0, 0, 0], FLEX: [1, 1, 0, 0]})
    (merge_out / "model").mkdir()
    assert main(["compare", str(base), str(merge_out), "--n-boot", "50"]) == 0
    assert f"B = {merge_out / 'eval'}" in capsys.readouterr().out
    assert main(["compare", str(base), str(tmp_path / "model_only"), "--n-boot", "50"]) == 2
    assert "is not an eval run: no results.json" in capsys.readouterr().err


def test_merge_of_a_vlm_names_its_extracted_language_model(tmp_path, tokenizer, monkeypatch, capsys):
    from vlm_factories import save_tiny_vlm, tiny_base

    from experiments.cli import main

    monkeypatch.setenv("SINKSTUDY_CACHE", str(tmp_path / "cache"))
    base = tmp_path / "base"
    tiny_base("qwen2").save_pretrained(base)
    tokenizer.save_pretrained(base)
    vlm = save_tiny_vlm(tmp_path / "vlm", "qwen2_5_vl", tokenizer=tokenizer, dtype=torch.bfloat16)
    out = tmp_path / "m"
    assert main(["merge", "--method", "linear", "--base", str(base), "--vlm", str(vlm), "--out", str(out), "--no-eval", "--quiet"]) == 0
    printed = capsys.readouterr().out
    lm = out / "vlm-lm"  # extracted once by the plan's first step (another merge of the pair reuses it)
    assert f"the VLM's language model (in the base's architecture): {lm}" in printed and (lm / "config.json").is_file()
    outputs = next(line for line in printed.splitlines() if line.startswith("   outputs:"))
    assert str(lm) in outputs and str(out / "model") in outputs
    assert f"`{lm}`" in (out / "model" / "README.md").read_text()


@pytest.mark.slow
def test_eval_writes_to_its_default_out_and_reuses_it(tmp_path, tokenizer, monkeypatch, capsys):
    """`eval` without --out shares `sink`'s rule: it writes runs/<command>/<model> and a rerun reuses it."""
    from experiments.cli import main
    from sinkstudy.tiny import tiny_causal_lm

    model = tmp_path / "tiny-llama"
    tiny_causal_lm("llama").save_pretrained(model)
    tokenizer.save_pretrained(model)
    monkeypatch.chdir(tmp_path)
    argv = ["eval", str(model), "--tasks", "sinkstudy_gsm", "--limit", "1", "--max-gen-toks", "4", "--no-chat-template",
            "--cache-dir", str(tmp_path / "cache"), "--quiet"]
    assert main(argv) == 0
    from experiments.cli.options import default_out

    default = tmp_path / default_out("eval", model)
    assert default.name.startswith("tiny-llama-")  # the model's folder and a digest of where it lies
    assert (default / "results.json").is_file() and f"eval run written to {default_out('eval', model)}" in capsys.readouterr().out
    before = (default / "results.json").read_bytes()
    assert main(argv) == 0 and (default / "results.json").read_bytes() == before  # the same run: reused
    assert main([*argv[:-1], "--max-gen-toks", "5"]) == 2  # another run into it: one line, as `sink` refuses
    assert "holds eval/run made by another request (protocol differ); pass --force" in capsys.readouterr().err


def test_a_merge_below_both_of_its_inputs_says_so_and_few_prompts_say_they_decide_nothing():
    from evals.stats import recovery
    from experiments.report.treatments import recovery_row as row_of, recovery_text

    base, vlm = np.array([1] * 30 + [0] * 10), np.array([1] * 20 + [0] * 20)
    text = recovery_text(row_of(recovery(base, vlm, np.array([1] * 5 + [0] * 35), n_boot=2000)))
    assert text.startswith("recovery -1.50 [") and "; below both inputs (Δ vs base -62.5 [" in text and "vs VLM LM -37.5 [" in text
    assert "below both" not in recovery_text(row_of(recovery(base, vlm, np.array([1] * 25 + [0] * 15), n_boot=2000)))
    few = recovery_text(row_of(recovery(np.ones(3), np.zeros(3), np.zeros(3), n_boot=200)))  # 3 prompts, all lost
    assert few == "too few prompts for any conclusion (fewer than 6) (Δ VLM LM − base -100.0 points [-100.0, -100.0])"



def test_default_outputs_are_unique_per_input(tmp_path, tokenizer, capsys):
    """Every saved model lives in OUT/model: `sink` of two doses' models (the dose's `next:` line, no --out) lands in
    two folders, each named by the folder above `model` and a digest of where it lies, never refused as another
    request's (nor replaced by following that hint with --force)."""
    from experiments.cli import main
    from experiments.cli.options import default_out, model_label, pair_out
    from sinkstudy.tiny import tiny_causal_lm

    models = [tmp_path / "runs" / "dose" / run / "model" for run in ("a-scale1.5", "b-scale1.5")]
    for seed, m in enumerate(models):
        tiny_causal_lm("qwen2", seed=seed).save_pretrained(m)
        tokenizer.save_pretrained(m)
    for m in models:
        assert main(["sink", str(m), "--quiet"]) == 0, capsys.readouterr().err
    made = sorted(p.name for p in Path("runs/sink").iterdir())
    assert len(made) == 2 and made[0].startswith("a-scale1.5-") and made[1].startswith("b-scale1.5-")
    assert model_label(models[0]) != model_label(tmp_path / "elsewhere" / "a-scale1.5" / "model")  # the same name elsewhere
    assert len({default_out("adapt", m) for m in models}) == len({pair_out(m, models[1], "linear") for m in models}) == 2
    assert default_out("pair", models[0], "lm").name.endswith("-lm")
    assert model_label("Qwen/Qwen2.5-7B-Instruct") == "Qwen_Qwen2.5-7B-Instruct"  # a hub id keeps its organisation
    assert model_label("smollm2-135m-instruct") == "smollm2-135m-instruct"


# --------------------------------------------------------------------------- what a newcomer reads

def test_an_unknown_task_is_suggested_only_a_close_name(capsys):
    """`eval --tasks nonexistent` suggested lm-eval's "injongointent"; a typo still gets its task."""
    from evals.task_names import suggestion
    from experiments.cli import main

    names = ["injongointent", "ifeval", "ifeval_es", "gsm8k_cot", "gsm8k_cot_llama"]
    assert suggestion("nonexistent", names) == ""
    assert suggestion("gsm8k_cott", names) == "; did you mean: gsm8k_cot?"
    assert suggestion("sinkstudy_ifevl", names).startswith("; did you mean: sinkstudy_ifeval")
    assert main(["eval", "some-org/some-model", "--tasks", "nonexistent"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown task 'nonexistent': not a shipped task" in err and "did you mean" not in err


def test_a_near_miss_of_a_real_llms_name_is_named(capsys):
    from experiments.cli import main

    assert main(["sink", "smollm2-135m"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "did you mean smollm2-135m-instruct?" in err
    assert main(["merge", "--method", "linear", "--base", "gemma-3-27", "--vlm", "x/y"]) == 2
    assert "did you mean gemma-3-270m?" in capsys.readouterr().err


def test_the_adapt_table_has_one_header_per_value():
    from experiments.report.adapt_tables import COLUMNS, format_adapt

    stage = {"stage": "stage2", "steps": 200, "final_loss": 1.2, "final_loss_steps": 20, "mean_loss": 1.9,
             "steps_per_second": 0.5, "tokens_per_second": None, "trainable_params": 12345678}
    header, row = format_adapt({"stages": [stage]}).splitlines()[:2]
    values = ["stage2", "200", "1.2 (20)", "1.9", "0.5", "-", "12,345,678"]
    assert len(values) == len(COLUMNS)
    ends = [header.index(name) + len(name) for name, _ in COLUMNS]
    assert [row.index(v, (ends[i - 1] if i else 0)) + len(v) for i, v in enumerate(values)][1:] == ends[1:]  # right-aligned under each


def test_a_reused_sink_run_says_reused_not_wrote(tmp_path, tokenizer, own_cache, capsys):
    from experiments.cli import main
    from sinkstudy.tiny import tiny_causal_lm

    model = tmp_path / "m"
    tiny_causal_lm("qwen2").save_pretrained(model)
    tokenizer.save_pretrained(model)
    argv = ["sink", str(model), "--out", str(tmp_path / "s"), "--quiet"]
    assert main(argv) == 0 and "wrote " in capsys.readouterr().out
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "reused sink/run" in printed and "wrote " not in printed


def test_an_eval_at_the_default_cap_says_so(tmp_path, monkeypatch, capsys):
    """The paper's tasks have caps of their own (gsm8k_cot, bbh_cot_fewshot): at the 256-token default the output says so."""
    import experiments.study.pair_steps
    from experiments.cli import main

    run = EvalRun.load(_run(tmp_path / "r", {STRICT: [1, 0], FLEX: [1, 1]}))
    monkeypatch.setattr(experiments.study.pair_steps, "run_eval", lambda *a, out_dir, **kw: run.save(out_dir) and run)
    assert main(["eval", "some-org/some-model", "--tasks", "sinkstudy_gsm", "--out", str(tmp_path / "e")]) == 0
    printed = capsys.readouterr().out
    assert "generation capped at 256 tokens per prompt (the default); --max-gen-toks 0 keeps each task's own cap" in printed
    assert main(["eval", "some-org/some-model", "--tasks", "sinkstudy_gsm", "--max-gen-toks", "0", "--out", str(tmp_path / "f")]) == 0
    assert "capped" not in capsys.readouterr().out


def test_every_command_describes_itself_and_force_means_one_thing():
    from test_cli_options import commands

    forces = set()
    for name, parser in commands():
        assert parser.description, f"sinkstudy {name} --help has no description"
        forces |= {a.help.replace("--json", "--out") for a in parser._actions if "--force" in a.option_strings}
    assert len(forces) == 1 and "anything else there is refused, never deleted" in forces.pop()


def test_adapt_runs_on_the_cpu_unless_told_otherwise(tmp_path, monkeypatch):
    """Every command defaults to the CPU; adapt took a GPU when there was one."""
    import experiments.cli.cmd_adapt as cmd_adapt
    from experiments.cli import main
    from sinkstudy import SinkstudyError

    planned = []

    def run_plan(plan, out, **kw):
        planned.append(next(iter(plan)).args)
        raise SinkstudyError("planned")

    monkeypatch.setattr(cmd_adapt, "run_plan", run_plan)
    monkeypatch.setattr("interventions.adapt.run.check_inputs", lambda *a, **kw: None)
    assert main(["adapt", "--base", "some-org/base", "--tiny-vision", "--train-data", "digits", "--out", str(tmp_path / "a")]) == 2
    assert planned[0].device == "cpu"


def test_a_step_reused_from_a_run_made_elsewhere_with_relative_paths_brings_its_outputs(tmp_path, tokenizer, own_cache,
                                                                                         monkeypatch, capsys):
    """A default --out is relative (runs/...): a run started in another folder that reuses it, and a third reusing
    that one, each get the outputs, not a record of outputs they do not have."""
    import json

    from experiments.cli import main
    from sinkstudy.tiny import tiny_causal_lm

    model = tmp_path / "m"
    tiny_causal_lm("qwen2", seed=3).save_pretrained(model)
    tokenizer.save_pretrained(model)
    for where in ("one", "two", "three"):
        (tmp_path / where).mkdir()
        monkeypatch.chdir(tmp_path / where)
        assert main(["sink", str(model), "--quiet"]) == 0, capsys.readouterr().err
        made = next(Path("runs/sink").iterdir())
        assert json.loads((made / "sink.json").read_text())["metric"] == "logodds" and (made / "sink_map.png").is_file()
    assert "reused sink/run (made by an earlier run" in capsys.readouterr().out
