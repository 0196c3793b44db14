"""The plan as data and the engine that runs it, on steps that write real files: a plan refuses what
would not hold together when a step joins it; a whole run reuses finished steps and re-runs what changed;
a transient step's output (keep_models: false) is removed once its readers finished and made again only
when one of them has to run; a single step runs only once the steps it reads have finished."""

from __future__ import annotations

import json

import pytest

from experiments.study.engine import Engine, StepContext
from experiments.study.graph import Plan, PlanError, Step


def _plan(tmp_path, calls: list, reader_setting: int = 0) -> Plan:
    made = tmp_path / "models" / "m"

    def make(ctx):
        from sinkstudy.provenance import model_fingerprint

        calls.append("make")
        made.mkdir(parents=True, exist_ok=True)
        (made / "w.txt").write_text("weights")
        return {"path": str(made), "fingerprint": model_fingerprint(made)}  # as every step that makes a model records it

    def read(name):
        def fn(ctx):
            calls.append(name)
            assert (made / "w.txt").read_text() == "weights"  # a reader always finds its input
            out = tmp_path / "out" / name
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(ctx.fingerprint(made, "g/make/m"))
            return {"value": name}
        return fn

    spec = lambda setting: lambda ctx: {"model": ctx.fingerprint(made, "g/make/m"), "setting": setting}  # noqa: E731
    return Plan([Step("g/make/m", {"k": 1}, outputs=(made,), run=make, transient=True, owner="maker"),
                 Step("g/sink/m", spec(reader_setting), deps=("g/make/m",), outputs=(tmp_path / "out" / "sink",), run=read("sink")),
                 Step("g/eval/m", spec(0), deps=("g/make/m",), outputs=(tmp_path / "out" / "eval",), run=read("eval"))])


def _engine(plan, tmp_path, **kw) -> Engine:
    return Engine(plan, tmp_path, config={"path": None, "content": {"name": "t"}}, seed=0, progress=False, **kw)


def test_a_plan_refuses_duplicate_ids_late_dependencies_and_shared_outputs(tmp_path):
    a = Step("p/a/x", {}, outputs=(tmp_path / "m",), run=lambda ctx: {}, owner="pair p intervention x")
    with pytest.raises(PlanError, match=r"pair p intervention y: step p/a/x is used twice \(also by pair p intervention x\)"):
        Plan([a, Step("p/a/x", {}, owner="pair p intervention y")])
    with pytest.raises(PlanError, match="depends on steps that did not run before it: p/b/x"):
        Plan([Step("p/c/x", {}, deps=("p/b/x",)), Step("p/b/x", {})])
    with pytest.raises(PlanError, match=f"pair q and pair p intervention x would both write {tmp_path / 'm'}; rename one"):
        Plan([a, Step("q/extract", {}, outputs=(tmp_path / "." / "m",), owner="pair q")])
    plan = Plan([a, Step("p/b/x", {}, deps=("p/a/x",), outputs=(tmp_path / "n",), reads=("org/base",))])
    records = plan.records(lambda i: tmp_path / "steps" / f"{i}.json", "sinkstudy run C")
    assert [(r["id"], r["level"], r["after"]) for r in records] == [("p/a/x", 1, []), ("p/b/x", 2, ["p/a/x"])]
    assert records[1]["inputs"] == ["org/base", str(tmp_path / "m")]  # what it reads from outside, then its deps' outputs
    assert records[1]["outputs"] == [str(tmp_path / "n"), str(tmp_path / "steps" / "p/b/x.json")]
    assert records[1]["command"] == "sinkstudy run C --step p/b/x"


def test_a_whole_run_reuses_finished_steps_and_removes_transient_outputs_once_read(tmp_path):
    calls: list[str] = []
    engine = _engine(_plan(tmp_path, calls), tmp_path)
    engine.run_all()
    assert calls == ["make", "sink", "eval"] and not (tmp_path / "models" / "m").exists()  # read by both, then removed
    record = json.loads((tmp_path / "steps" / "g" / "sink" / "m.json").read_text())
    made = json.loads((tmp_path / "steps" / "g" / "make" / "m.json").read_text())["result"]["fingerprint"]
    assert record["spec"] == {"model": made, "setting": 0} and made.startswith("ckpt-sha256:")  # read from disk in a whole run
    assert record["provenance"]["step"] == "g/sink/m" and record["provenance"]["seeds"] == {"study": 0}

    calls.clear()
    again = _engine(_plan(tmp_path, calls), tmp_path)
    again.run_all()
    assert calls == [] and all(e["reused"] for e in again.log)  # nothing needs the removed model

    _engine(_plan(tmp_path, calls, reader_setting=1), tmp_path).run_all()  # one reader changed: the model is made again for it
    assert calls == ["make", "sink"] and not (tmp_path / "models" / "m").exists()


def test_one_step_runs_once_the_steps_it_reads_have_finished(tmp_path):
    calls: list[str] = []
    with pytest.raises(Exception, match=r"step g/sink/m depends on g/make/m, not finished: run `sinkstudy run C --step g/make/m` first"):
        _engine(_plan(tmp_path, calls), tmp_path).run_one("g/sink/m", command="sinkstudy run C")
    assert calls == [] and not (tmp_path / "steps").exists()
    assert not _engine(_plan(tmp_path, calls), tmp_path).run_one("g/make/m")["reused"]
    done = _engine(_plan(tmp_path, calls), tmp_path).run_one("g/sink/m")
    assert not done["reused"] and calls == ["make", "sink"]
    assert _engine(_plan(tmp_path, calls), tmp_path).run_one("g/sink/m")["reused"]
    forced = _engine(_plan(tmp_path, calls), tmp_path, force=True).run_one("g/sink/m")
    assert not forced["reused"] and calls == ["make", "sink", "sink"]


def test_a_single_step_keys_a_made_model_on_its_producers_record(tmp_path):
    calls: list[str] = []
    plan = _plan(tmp_path, calls)
    whole = _engine(plan, tmp_path)
    whole.run_all()  # the made model is removed: a single step can still key its readers
    single = _engine(plan, tmp_path)
    single.live = False
    assert plan["g/eval/m"].spec(StepContext(single, {"g/make/m": {"fingerprint": "recorded"}}))["model"] == "recorded"
    assert single.run_one("g/eval/m")["reused"]  # the same key as the whole run's: reused
