"""`sinkstudy run CONFIG --plan / --step`: a study split into independent commands for a scheduler.

A tiny real study (one local pair, a mergekit merge and a sink-map mitigation, one shipped task):
the plan lists every step in dependency order; running the steps one by one through the CLI, then
collecting, gives the same summary as a plain run; a step whose dependencies have not finished is
refused in one line before any work.
"""

import json
from pathlib import Path

import pytest
import yaml

from experiments.cli import main as cli_main

pytestmark = pytest.mark.slow

PAIR = "p"
EXPECTED_STEPS = [f"{PAIR}/{s}" for s in (
    "extract", "sink/base", "eval/base", "sink/vlm", "eval/vlm",
    "intervene/lin", "sink/lin", "eval/lin", "intervene/hr", "sink/hr", "eval/hr")]


@pytest.fixture(scope="module")
def config(tmp_path_factory, tokenizer):
    from vlm_factories import save_tiny_vlm, tiny_base

    root = tmp_path_factory.mktemp("plan_study")
    base = root / "base"
    tiny_base("qwen2").save_pretrained(base)
    tokenizer.save_pretrained(base)
    vlm = save_tiny_vlm(root / "vlm", "qwen2_5_vl", tokenizer=tokenizer)
    cfg = {
        "name": "plan",
        "pairs": [{"name": PAIR, "base": str(base), "vlm": str(vlm), "native_qk_norm": False}],
        "sink": {"metric": "logodds", "options": {"batch_size": 8}},
        "evals": {"tasks": ["sinkstudy_gsm"], "limit": 3, "max_gen_toks": 6, "batch_size": 3, "n_boot": 200,
                  "system_instruction": "Answer briefly."},
        "interventions": [{"name": "lin", "method": "linear", "params": {"weight": 0.5}},
                          {"name": "hr", "method": "head_restore", "params": {"top_k": 2}}],
    }
    path = root / "study.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _plan(config, out, capsys) -> list[dict]:
    assert cli_main(["run", str(config), "--out", str(out), "--plan", "json"]) == 0
    return json.loads(capsys.readouterr().out)


def _summary(out: Path) -> dict:
    """summary.json with this run's own paths and timings taken out."""
    text = (out / "summary.json").read_text().replace(str(out), "OUT")
    summary = json.loads(text)
    summary.pop("timings")
    return summary


def test_plan_lists_every_step_in_dependency_order(config, tmp_path, capsys):
    out = tmp_path / "run"
    steps = _plan(config, out, capsys)
    assert [s["id"] for s in steps] == EXPECTED_STEPS
    seen = set()
    for s in steps:
        assert set(s["after"]) <= seen  # every dependency comes earlier
        seen.add(s["id"])
        assert f"--out {out} " in s["command"] and s["command"].endswith(f"--step {s['id']}")
        assert str(out / "steps" / f"{s['id']}.json") in s["outputs"]
    by_id = {s["id"]: s for s in steps}
    assert by_id[f"{PAIR}/extract"]["inputs"] == [str(config.parent / "base"), str(config.parent / "vlm")]
    assert by_id[f"{PAIR}/eval/lin"]["after"] == [f"{PAIR}/intervene/lin"]
    assert by_id[f"{PAIR}/eval/lin"]["inputs"] == [str(config.parent / "base"), str(out / "models" / f"{PAIR}-lin")]  # + the prompts' tokenizer
    # the mitigation reads both sink maps: it runs after the two sink steps
    assert set(by_id[f"{PAIR}/intervene/hr"]["after"]) == {f"{PAIR}/extract", f"{PAIR}/sink/base", f"{PAIR}/sink/vlm"}
    assert by_id[f"{PAIR}/intervene/hr"]["level"] == 3
    assert not out.exists()  # a plan runs nothing and writes nothing
    assert cli_main(["run", str(config), "--out", str(out), "--plan"]) == 0
    text = capsys.readouterr().out
    assert f"--step {PAIR}/sink/hr" in text and "11 steps" in text


def test_steps_one_by_one_then_collect_equal_a_plain_run(config, tmp_path, capsys, monkeypatch):
    plain, stepped = tmp_path / "plain", tmp_path / "stepped"
    # Separate eval caches: the stepped run recomputes every eval instead of reading the plain run's.
    monkeypatch.setenv("SINKSTUDY_CACHE", str(tmp_path / "cache_plain"))
    assert cli_main(["run", str(config), "--out", str(plain), "--quiet"]) == 0
    capsys.readouterr()
    monkeypatch.setenv("SINKSTUDY_CACHE", str(tmp_path / "cache_stepped"))
    steps = _plan(config, stepped, capsys)

    # A step whose dependencies have not run is refused in one line, and nothing is written.
    rc = cli_main(["run", str(config), "--out", str(stepped), "--step", f"{PAIR}/eval/lin"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and f"depends on {PAIR}/intervene/lin" in err and "--step" in err
    assert not (stepped / "steps").exists()

    for s in steps:
        assert cli_main(["run", str(config), "--out", str(stepped), "--step", s["id"], "--quiet"]) == 0
        assert f"step {s['id']} done" in capsys.readouterr().out
    # Again: a finished step is reused, not recomputed.
    assert cli_main(["run", str(config), "--out", str(stepped), "--step", f"{PAIR}/eval/base"]) == 0
    assert "reused" in capsys.readouterr().out
    assert not (stepped / "summary.json").exists()

    assert cli_main(["run", str(config), "--out", str(stepped), "--quiet"]) == 0
    assert f"{len(steps)} steps, {len(steps)} reused" in capsys.readouterr().out
    assert _summary(stepped) == _summary(plain)
    assert _summary(plain)["pairs"][PAIR]["interventions"].keys() == {"lin", "hr"}


def test_unknown_step_names_close_matches(config, tmp_path, capsys):
    rc = cli_main(["run", str(config), "--out", str(tmp_path / "o"), "--step", f"{PAIR}/eval/linn"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and f"no step '{PAIR}/eval/linn'" in err and f"{PAIR}/eval/lin" in err


def test_step_jobs_lock_their_step_and_a_plan_locks_nothing(config, tmp_path, capsys):
    """A --step job holds its own step's lock (a second job of that step fails at once, in one line,
    before any work); it takes no lock on the output directory, and neither does --plan."""
    import subprocess
    import sys

    out = tmp_path / "run"
    hold = ("import sys, time\nfrom sinkstudy.io import output_lock\n"
            "with output_lock(sys.argv[1]):\n    print('held', flush=True)\n    time.sleep(120)\n")

    def holding(path):
        proc = subprocess.Popen([sys.executable, "-c", hold, str(path)], stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "held"
        return proc

    proc = holding(out / "steps" / PAIR / "extract.json")  # another job is running the extract step
    try:
        rc = cli_main(["run", str(config), "--out", str(out), "--step", f"{PAIR}/extract"])
        err = capsys.readouterr().err
        assert rc == 2 and err.count("\n") == 1 and f"pid {proc.pid}" in err
        assert not (out / "models").exists()
    finally:
        proc.kill()
        proc.wait()
    proc = holding(out)  # a plain run holds the directory: a plan still works
    try:
        assert len(_plan(config, out, capsys)) == len(EXPECTED_STEPS)
    finally:
        proc.kill()
        proc.wait()


def test_a_plan_keys_made_models_on_their_steps_records(config, tmp_path, monkeypatch):
    """Planning fingerprints no model at all; a single step keys the checkpoints other steps make (the VLM
    LM, interventions) on those steps' records (the folders may not exist here), its inputs on their content."""
    import experiments.study.engine as engine_mod
    import sinkstudy.provenance
    from experiments.study.config import load_study
    from experiments.study.kinds import step_key
    from experiments.study.runner import engine_for, plan_study

    out = tmp_path / "run"
    read = []
    spy = lambda path, revision=None: read.append(str(path)) or "fp"  # noqa: E731
    monkeypatch.setattr(engine_mod, "model_fingerprint", spy)
    monkeypatch.setattr("experiments.study.kinds.model_fingerprint", spy)
    monkeypatch.setattr(sinkstudy.provenance, "model_fingerprint", spy)
    plan = plan_study(load_study(config, out=out))
    assert not read  # a plan reads nothing
    engine = engine_for(plan.study, plan)
    engine.live = False
    engine.made = {f"{PAIR}/extract": {str(out / "models" / f"{PAIR}-vlm-lm"): "fp-recorded"}}
    ctx = engine_mod.StepContext(engine, {})
    identity = step_key(plan.plan[f"{PAIR}/sink/vlm"].args, ctx)[1]
    assert identity["args"]["model"] == "fp-recorded" and not [p for p in read if p.startswith(str(out))]  # the producer's record
    assert step_key(plan.plan[f"{PAIR}/sink/base"].args, ctx)[1]["args"]["model"] == "fp"  # the base: its content
    assert read and not [p for p in read if p.startswith(str(out))]
