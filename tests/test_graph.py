"""The plan as data and the engine that runs it, on steps that write real files: a plan refuses what
would not hold together when a step joins it; a whole run reuses finished steps and re-runs what changed;
a transient step's output (keep_models: false) is removed once its readers finished and made again only
when one of them has to run; a single step runs only once the steps it reads have finished; a step's key
is its kind, arguments (inputs by content) and code, so another run directory reuses it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pytest

from experiments.study.engine import Engine
from experiments.study.graph import Plan, PlanError, Step
from experiments.study.kinds import Ref, StepArgs, location, step_key


@dataclass(frozen=True)
class Make(StepArgs):
    kind: ClassVar[str] = "test-make"
    text: str
    calls: list = location()
    out: Path = location()

    def run(self, ctx):
        self.calls.append("make")
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "w.txt").write_text(self.text)
        return {"path": str(self.out)}


@dataclass(frozen=True)
class Read(StepArgs):
    kind: ClassVar[str] = "test-read"
    model: Ref
    setting: int
    name: str
    calls: list = location()
    out: Path = location()

    def run(self, ctx):
        self.calls.append(self.name)
        assert (Path(self.model.path) / "w.txt").read_text() == "weights"  # a reader always finds its input
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.out.write_text(self.model.fingerprint(ctx))
        return {"value": self.name, "file": str(self.out)}


@dataclass(frozen=True)
class Bare(StepArgs):
    kind: ClassVar[str] = "test-bare"
    value: int = 0

    def run(self, ctx):
        return {}


pytestmark = pytest.mark.usefixtures("own_cache")  # finished steps are found by key across run directories


def _plan(root, calls: list, reader_setting: int = 0, transient: bool = True) -> Plan:
    made = root / "models" / "m"
    model = Ref(str(made), "g/make/m")
    return Plan([Step("g/make/m", Make("weights", calls=calls, out=made), outputs=(made,), transient=transient, owner="maker"),
                 Step("g/sink/m", Read(model, reader_setting, name="sink", calls=calls, out=root / "out" / "sink"),
                      outputs=(root / "out" / "sink",)),
                 Step("g/eval/m", Read(model, 0, name="eval", calls=calls, out=root / "out" / "eval"), outputs=(root / "out" / "eval",))])


def _engine(plan, out, **kw) -> Engine:
    return Engine(plan, out, config={"path": None, "content": {"name": "t"}}, seed=0, progress=False, **kw)


def test_a_plan_refuses_duplicate_ids_late_dependencies_and_shared_outputs(tmp_path):
    a = Step("p/a/x", Bare(), outputs=(tmp_path / "m",), owner="pair p intervention x")
    with pytest.raises(PlanError, match=r"pair p intervention y: step p/a/x is used twice \(also by pair p intervention x\)"):
        Plan([a, Step("p/a/x", Bare(), owner="pair p intervention y")])
    with pytest.raises(PlanError, match="depends on steps that did not run before it: p/b/x"):
        Plan([Step("p/c/x", Bare(), deps=("p/b/x",)), Step("p/b/x", Bare())])
    with pytest.raises(PlanError, match=f"pair q and pair p intervention x would both write {tmp_path / 'm'}; rename one"):
        Plan([a, Step("q/extract", Bare(), outputs=(tmp_path / "." / "m",), owner="pair q")])
    reader = Read(Ref("org/base"), 0, name="r", calls=[], out=tmp_path / "n")
    plan = Plan([a, Step("p/b/x", reader, deps=("p/a/x",), outputs=(tmp_path / "n",))])
    records = plan.records(lambda i: tmp_path / "steps" / f"{i}.json", "sinkstudy run C")
    assert [(r["id"], r["level"], r["after"]) for r in records] == [("p/a/x", 1, []), ("p/b/x", 2, ["p/a/x"])]
    assert records[1]["inputs"] == ["org/base", str(tmp_path / "m")]  # what it reads from outside, then its deps' outputs
    assert records[1]["outputs"] == [str(tmp_path / "n"), str(tmp_path / "steps" / "p/b/x.json")]
    assert records[1]["command"] == "sinkstudy run C --step p/b/x"
    # what a step's arguments read from another step makes it run after that step
    made = Plan([a, Step("p/c/x", Read(Ref(str(tmp_path / "m"), "p/a/x"), 0, name="c", calls=[], out=tmp_path / "c"))])
    assert made["p/c/x"].deps == ("p/a/x",) and made.maker(tmp_path / "m") == "p/a/x"


def test_a_key_holds_the_arguments_inputs_by_content_and_no_location(tmp_path):
    m1, m2 = tmp_path / "m1", tmp_path / "m2"
    for m in (m1, m2):
        m.mkdir()
        (m / "w.txt").write_text("weights")
    engine = _engine(Plan(), tmp_path)
    from experiments.study.engine import StepContext

    ctx = StepContext(engine, {})
    key = lambda args: step_key(args, ctx)[0]  # noqa: E731
    # the same content elsewhere, written elsewhere, counted elsewhere: one key
    assert key(Read(Ref(str(m1)), 0, name="a", calls=[], out=tmp_path / "x")) == key(Read(Ref(str(m2)), 0, name="a", calls=[1], out=tmp_path / "y"))
    assert key(Read(Ref(str(m1)), 0, name="a", calls=[], out=tmp_path / "x")) != key(Read(Ref(str(m1)), 1, name="a", calls=[], out=tmp_path / "x"))
    (m2 / "w.txt").write_text("other weights")
    assert key(Read(Ref(str(m1)), 0, name="a", calls=[], out=tmp_path / "x")) != key(Read(Ref(str(m2)), 0, name="a", calls=[], out=tmp_path / "x"))
    assert step_key(Bare(), ctx)[1]["code"].startswith("code-sha256:")

    @dataclass(frozen=True)
    class WithPath(StepArgs):
        kind: ClassVar[str] = "test-path"
        where: Path

    with pytest.raises(TypeError, match="make it a Ref"):
        key(WithPath(tmp_path))  # a path would tie the result to where it was made


def test_a_whole_run_reuses_finished_steps_and_removes_transient_outputs_once_read(tmp_path):
    calls: list[str] = []
    engine = _engine(_plan(tmp_path, calls), tmp_path)
    engine.run_all()
    assert calls == ["make", "sink", "eval"] and not (tmp_path / "models" / "m").exists()  # read by both, then removed
    record = json.loads((tmp_path / "steps" / "g" / "sink" / "m.json").read_text())
    made = json.loads((tmp_path / "steps" / "g" / "make" / "m.json").read_text())["outputs"][str(tmp_path / "models" / "m")]
    assert record["identity"]["args"] == {"model": made, "setting": 0, "name": "sink"} and made.startswith("ckpt-sha256:")  # from disk
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
    _engine(plan, tmp_path).run_all()  # the made model is removed: a single step can still key its readers
    assert not (tmp_path / "models" / "m").exists()
    single = _engine(plan, tmp_path)
    assert single.run_one("g/eval/m")["reused"]  # the same key as the whole run's: reused


def test_another_run_directory_reuses_a_finished_step_as_a_copy(tmp_path):
    calls: list[str] = []
    first, second = tmp_path / "first", tmp_path / "second"
    _engine(_plan(first, calls, transient=False), first).run_all()
    assert calls == ["make", "sink", "eval"]
    calls.clear()
    engine = _engine(_plan(second, calls, transient=False), second)
    results = engine.run_all()
    assert calls == [] and all(e["reused"] for e in engine.log)  # the same keys: nothing computed again
    assert (second / "models" / "m" / "w.txt").read_text() == "weights"  # the outputs copied in
    assert results["g/make/m"]["path"] == str(second / "models" / "m")  # the result names this run's copy
    record = json.loads((second / "steps" / "g" / "make" / "m.json").read_text())
    assert record["reused_from"] == str((first / "steps" / "g" / "make" / "m.json").resolve())
    # a run that replaced its step under another key no longer vouches for the old one
    (first / "models" / "m" / "w.txt").write_text("weights")
    _engine(_plan(first, calls, reader_setting=5, transient=False), first, force=True).run_all()
    third = tmp_path / "third"
    calls.clear()
    _engine(_plan(third, calls, reader_setting=0, transient=False), third).run_all()
    assert calls == []  # make and eval from first's rerun, sink (setting 0) from second's copy


def test_a_commands_out_refuses_what_another_request_made_and_remeasures(tmp_path):
    calls: list[str] = []
    _engine(_plan(tmp_path, calls, transient=False), tmp_path, guarded=("sink",)).run_all()
    with pytest.raises(Exception, match=r"holds g/sink/m made by another request \(setting differ\); pass --force"):
        _engine(_plan(tmp_path, calls, reader_setting=1, transient=False), tmp_path, guarded=("sink",)).run_all()
    _engine(_plan(tmp_path, calls, reader_setting=1, transient=False), tmp_path, guarded=("make",)).run_all()  # a measurement: re-run
    _engine(_plan(tmp_path, calls, reader_setting=2, transient=False), tmp_path, guarded=("sink",), force=True).run_all()


def test_a_kinds_key_follows_the_file_holding_its_body(tmp_path):
    """An edit to the module that defines a step's body changes its key (so the step reruns), even when the
    modules its kind names are unchanged."""
    import importlib.util
    import sys

    from experiments.study.kinds import step_key

    source = ("from dataclasses import dataclass\nfrom experiments.study.kinds import StepArgs\n\n"
              "@dataclass(frozen=True)\nclass Double(StepArgs):\n    kind = 'double'\n    x: int = 1\n\n"
              "    def run(self, ctx):\n        return {'y': 2 * self.x}  # BODY\n")

    def key_of(text: str, name: str) -> str:
        path = tmp_path / name / "my_kind.py"
        path.parent.mkdir()
        path.write_text(text)
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # as an import does: dataclasses and inspect look the module up there
        try:
            spec.loader.exec_module(module)
            return step_key(module.Double(3), None)[0]
        finally:
            del sys.modules[name]

    same = key_of(source, "kind_a")
    assert key_of(source, "kind_b") == same  # the same source: the same key, wherever the file lies
    assert key_of(source.replace("2 * self.x", "3 * self.x"), "kind_c") != same
