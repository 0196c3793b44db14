"""Study configs: validation errors are one line and raised before any work; the shipped configs
validate; the paper dry run prints all six pairs offline; the paper run refuses without CUDA."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from experiments.demo.study import validate  # the study's validate, with the demo's build section read
from experiments.study.config import StudyConfigError, deep_merge, load_study

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "experiments" / "configs"

MINIMAL = {
    "name": "t",
    "pairs": [{"name": "p", "base": "some/base", "vlm": "some/vlm"}],
    "evals": {"tasks": ["sinkstudy_ifeval"]},
    "interventions": [{"name": "lin", "method": "linear", "params": {"weight": 0.5}}],
}


def _err(raw) -> str:
    with pytest.raises(StudyConfigError) as exc:
        validate(raw)
    msg = str(exc.value)
    assert "\n" not in msg
    return msg


def test_minimal_config_fills_defaults():
    s = validate(MINIMAL)
    assert s.out == Path("runs/t")
    assert s.sink.metric == "logodds"
    assert s.evals.protocol.batch_size == 8 and s.evals.protocol.apply_chat_template is True
    assert s.interventions[0].params == {"weight": 0.5}
    assert s.keep_models is True


@pytest.mark.parametrize("patch, needle", [
    ({"colour": 1}, "unknown key(s) colour"),
    ({"name": "bad name!"}, "name"),
    ({"pairs": []}, "pairs must be a non-empty list"),
    ({"pairs": [{"name": "p", "base": "b"}]}, "vlm must be a hub id or a path"),
    ({"pairs": [{"name": "p", "base": "b", "vlm": "v", "published": {"S": 1}}]}, "unknown key(s) S"),
    ({"evals": {"tasks": ["x"], "batch_size": 0}}, "evals.batch_size: batch size must be an integer >= 1"),
    ({"evals": {"tasks": ["x"], "data_files": {"y": "f.jsonl"}}}, "names task(s) not evaluated: y"),
    ({"evals": {"tasks": ["x"], "limit": -3}}, "evals.limit"),
    ({"sink": {"metric": "nope"}}, "unknown sink metric 'nope'"),
    ({"interventions": [{"name": "m", "method": "frobnicate"}]}, "unknown method 'frobnicate'"),
    ({"interventions": [{"name": "base", "method": "linear"}]}, "reserved"),
    ({"interventions": [{"name": "q", "method": "qknorm", "params": {"vl": True}}]}, "needs the study's build section"),
    ({"interventions": [{"name": "q", "method": "qknorm", "params": {"gain": 2}}]}, "qknorm has no parameter(s) gain"),
    ({"model": {"dtype": "int4"}}, "model.dtype"),
    ({"keep_models": "yes"}, "keep_models"),
])
def test_validation_errors_are_one_line(patch, needle):
    assert needle in _err({**MINIMAL, **patch})


_TINY_BACKBONE = {"family": "qwen2", "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2}


@pytest.mark.parametrize("patch, needle", [
    # what would fail hours into a run fails at load
    ({"interventions": [{"name": "t", "method": "ties", "params": {"density": 2}}]}, "interventions[0].params: density must be in (0.0, 1.0]"),
    ({"interventions": [{"name": "t", "method": "tsv", "params": {"alpha": float("nan")}}]}, "must be a finite number"),
    ({"interventions": [{"name": "s", "method": "star", "params": {"eta": 0}}]}, "eta"),
    ({"interventions": [{"name": "h", "method": "head_restore", "params": {"top_k": 0}}]}, "top_k"),
    ({"interventions": [{"name": "q", "method": "qknorm", "params": {"lr": float("nan")}}]}, "qknorm lr"),
    ({"interventions": [{"name": "q", "method": "qknorm", "params": {"init": "magic"}}]}, "qknorm init"),
    ({"evals": {"tasks": ["sinkstudy_gsm", "nosuch_task_xyz"]}}, "unknown task 'nosuch_task_xyz'"),
    ({"evals": {"tasks": ["sinkstudy_gsm"], "limit": float("nan")}}, "evals.limit"),
    ({"pairs": [{"name": "p", "base": "./missing/base", "vlm": "org/vlm"}]}, "base ./missing/base does not exist"),
    ({"pairs": [{"name": "p", "base": "org/base", "vlm": "org/vlm", "root": "/no/such/root"}]}, "root /no/such/root does not exist"),
    ({"evals": {"tasks": ["sinkstudy_gsm"], "data_files": {"sinkstudy_gsm": "./missing.jsonl"}}}, "missing.jsonl does not exist"),
    ({"sink": {"texts": "./missing_texts.txt"}}, "sink.texts"),
    # names that become path components are slugs; no two outputs share a directory
    ({"name": "../../x"}, "name: must be a name"),
    ({"pairs": [{"name": "..", "base": "org/b", "vlm": "org/v"}]}, "pairs[0].name"),
    ({"interventions": [{"name": "../../..", "method": "linear"}]}, "interventions[0].name"),
    ({"interventions": [{"name": "lin\n", "method": "linear"}]}, "interventions[0].name"),
    ({"build": {"backbones": [{"name": "../../escape", **_TINY_BACKBONE}]}}, "build.backbones[0].name"),
])
def test_load_validates_settings_tasks_inputs_and_names(patch, needle):
    assert needle in _err({**MINIMAL, **patch})


@pytest.mark.parametrize("patch, needle", [
    # no two outputs share a directory, no two steps a name: a check on the plan, before any work
    ({"pairs": [{"name": "a", "base": "org/b", "vlm": "org/v"}, {"name": "a-b", "base": "org/b", "vlm": "org/v"}],
      "interventions": [{"name": "b-lin", "method": "linear"}, {"name": "lin", "method": "linear"}]}, "would both write"),
    ({"interventions": [{"name": "vlm-lm", "method": "linear"}]}, "would both write"),
    ({"build": {"backbones": [{"name": "p", **_TINY_BACKBONE}]}, "pairs": [{"name": "p", "base": "o/b", "vlm": "o/v", "native_qk_norm": False}],
      "interventions": [{"name": "q", "method": "qknorm", "params": {"vl": True}}, {"name": "q-vl", "method": "linear"}]},
     "used twice"),
])
def test_the_plan_refuses_two_steps_with_one_output_or_name(patch, needle):
    from experiments.study.graph import PlanError
    from experiments.study.pipeline import plan_study

    study = validate({**MINIMAL, **patch})
    with pytest.raises(PlanError) as exc:
        plan_study(study)
    assert needle in str(exc.value) and "\n" not in str(exc.value)


def test_a_pair_root_reaches_only_methods_that_take_one():
    from interventions.registry import takes_root

    assert [m for m in ("linear", "slerp", "ties", "task_arithmetic", "tsv", "star", "head_restore") if takes_root(m)] == [
        "ties", "task_arithmetic", "tsv", "star"]
    study = validate({**MINIMAL, "pairs": [{"name": "p", "base": "org/b", "vlm": "org/v", "root": "org/r"}]})
    assert study.pairs[0].root == "org/r" and study.interventions[0].method == "linear"


def test_build_section_errors():
    bad = {"name": "d", "build": {"backbones": [{"name": "a", "family": "gpt2", "hidden_size": 64, "num_hidden_layers": 2,
                                                "num_attention_heads": 4}]}}
    assert "family: must be one of" in _err(bad)
    bad["build"]["backbones"][0].update(family="qwen2", hidden_size=66)
    assert "not divisible" in _err(bad)
    assert "unknown key(s) steps_" in _err({"name": "d", "build": {"pretrain": {"steps_": 3}, "backbones": []}})


def test_bad_yaml_and_missing_file(tmp_path):
    f = tmp_path / "s.yaml"
    f.write_text("name: [unclosed\n")
    with pytest.raises(StudyConfigError, match="not valid YAML"):
        load_study(f)
    with pytest.raises(StudyConfigError, match="does not exist"):
        load_study(tmp_path / "missing.yaml")


def test_cli_reports_config_error_in_one_line(tmp_path, capsys):
    """In-process: the command's exit code and stderr (the `python -m experiments.cli` seam: the paper dry run below)."""
    from experiments.cli import main

    f = tmp_path / "s.yaml"
    f.write_text(yaml.safe_dump({**MINIMAL, "evals": {"tasks": ["x"], "batch_size": "big"}}))
    assert main(["run", str(f), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.strip().count("\n") == 0 and "evals.batch_size" in err
    assert not (tmp_path / "out").exists()  # refused before any work


def test_shipped_configs_validate():
    from experiments.demo.study import load_study as load_demo

    demo = load_demo(CONFIGS / "demo.yaml")
    assert [p.name for p in demo.pairs] == [b["name"] for b in demo.build.backbones]  # one pair per backbone
    assert [p.native_qk_norm for p in demo.pairs] == [b["family"] == "qwen3" for b in demo.build.backbones]
    assert demo.evals.protocol.data_files["sinkstudy_ifeval"] == "runs/demo/data/heldout_ifeval.jsonl"
    template = load_study(CONFIGS / "real_pairs_template.yaml")
    assert {p.vlm for p in template.pairs} >= {"Qwen/Qwen2.5-VL-7B-Instruct", "llava-hf/llava-1.5-7b-hf"}
    paper = load_study(CONFIGS / "paper_six_pairs.yaml")
    assert len(paper.pairs) == 6
    # The merge grid comes from the merge module's file: seven methods, the paper's parameters.
    grid = {i.name: i for i in paper.interventions}
    assert grid["star"].params == {"eta": 40, "device": "cpu"} and grid["dare"].params["density"] == 0.1  # defaults filled
    assert {p.published["ifeval_delta"] for p in paper.pairs} == {-5.4, -1.8, -9.6, -8.9, -7.9, -18.7}


def test_deep_merge_keeps_siblings():
    assert deep_merge({"a": {"b": 1, "c": 2}, "l": [1]}, {"a": {"b": 3}, "l": [2]}) == {"a": {"b": 3, "c": 2}, "l": [2]}


def test_paper_dry_run_prints_all_six_pairs_offline():
    import os

    env = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PATH": "/usr/bin:/bin", "SINKSTUDY_CACHE": os.environ["SINKSTUDY_CACHE"]}
    r = subprocess.run([sys.executable, "-m", "experiments.cli", "paper", "--dry-run"], capture_output=True, text=True,
                       cwd=ROOT, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    for vlm in ("Qwen/Qwen3-VL-8B-Instruct", "OpenGVLab/InternVL3_5-8B-HF", "Qwen/Qwen2.5-VL-7B-Instruct",
                "OpenGVLab/InternVL3-8B-hf", "llava-hf/llava-onevision-qwen2-7b-ov-hf", "allenai/Molmo2-O-7B"):
        assert vlm in r.stdout
    for needle in ("ifeval, eq_bench, gsm8k_cot, gpqa_diamond_cot_zeroshot, mmlu, boolq, mbpp, mmlu_pro",
                   "chat template kwargs {enable_thinking: false}", "tsv", "star", "ties", "dare_ties", "estimated disk", "estimated GPU memory", "-18.7"):
        assert needle in r.stdout


def test_paper_plan_estimates_follow_parameter_counts():
    from experiments.study.paper import BYTES_PER_PARAM, GPU_OVERHEAD, plan

    study = load_study(CONFIGS / "paper_six_pairs.yaml")
    e = plan(study)["estimates"]
    assert e["gpu_gb"] == pytest.approx(8.2 * BYTES_PER_PARAM * GPU_OVERHEAD)  # largest base LLM: Qwen3-8B
    sizes = {}
    for p in study.pairs:
        sizes[p.base], sizes[p.vlm] = p.params_b["base"], p.params_b["vlm"]
        if p.root:
            sizes[p.root] = p.params_b["base"]
    assert e["download_gb"] == pytest.approx(sum(sizes.values()) * BYTES_PER_PARAM)


def test_paper_refuses_without_cuda_unless_limited(capsys):
    import torch

    from experiments.cli import main

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert main(["paper"]) == 2
    err = capsys.readouterr().err
    assert "needs a CUDA GPU" in err and "--limit" in err


def test_runner_reuses_keyed_steps_and_reruns_what_changed(tmp_path, own_cache):
    import json
    from dataclasses import dataclass
    from typing import ClassVar

    from experiments.study.engine import Engine
    from experiments.study.graph import Plan, Step
    from experiments.study.kinds import Ref, StepArgs, location

    study = validate({**MINIMAL, "out": str(tmp_path)})
    calls = []

    @dataclass(frozen=True)
    class Write(StepArgs):
        kind: ClassVar[str] = "test-write"
        name: str
        value: int
        reads: Ref | None = None
        out: Path = location()

        def run(self, ctx):
            calls.append(self.name)
            self.out.mkdir(exist_ok=True)
            (self.out / "v").write_text(f"{self.value} {self.reads and self.reads.fingerprint(ctx)}")
            return {"value": self.value}

    def run_all(a_value, b_value):
        a, b, c = (tmp_path / n for n in "abc")
        r = Engine(Plan([Step("p/a/x", Write("a", a_value, out=a), outputs=(a,)),
                         Step("p/b/x", Write("b", b_value, Ref(str(a), "p/a/x"), out=b), outputs=(b,)),
                         Step("p/c/x", Write("c", 0, Ref(str(b), "p/b/x"), out=c), outputs=(c,))]),
                   study.out, config={"path": None, "content": study.raw}, seed=study.seed, progress=False)
        r.run_all()
        return r

    run_all(1, 1)
    assert calls == ["a", "b", "c"]
    saved = json.loads((tmp_path / "steps" / "p" / "b" / "x.json").read_text())
    assert saved["key"] and saved["provenance"]["config"]["content"]["name"] == "t" and saved["provenance"]["seeds"] == {"study": 0}
    calls.clear()
    r = run_all(1, 1)
    assert calls == [] and all(e["reused"] for e in r.log)
    run_all(1, 2)  # b's settings changed: b and what reads it re-run, a is reused
    assert calls == ["b", "c"]
    calls.clear()
    run_all(2, 2)  # the first step changed: everything downstream re-runs
    assert calls == ["a", "b", "c"]
    calls.clear()
    import shutil

    shutil.rmtree(tmp_path / "a")  # a step whose output has gone runs again; the same content keeps b and c
    run_all(2, 2)
    assert calls == ["a"]
    with pytest.raises(Exception, match="did not run"):
        Plan([Step("p/d/x", Write("d", 0, out=tmp_path / "d"), deps=("p/zzz/x",))])


@pytest.mark.parametrize("pair, needle", [
    ({"base_revision": "abc", "revision": {"base": "def"}}, "base_revision and revision.base both given"),
    ({"root_revision": "abc"}, "root_revision given without a root"),
    ({"vlm_revision": 7}, "must be a hub revision"),
    ({"revision": {"tokenizer": "abc"}}, "unknown key(s) tokenizer"),
    ({"base": "/no/such/dir", "base_revision": "abc"}, "does not exist"),
    ({"base": ".", "base_revision": "abc"}, "base_revision pins a hub id, but base . is a local path"),
])
def test_pair_revisions_are_checked(pair, needle):
    assert needle in _err({**MINIMAL, "pairs": [{**MINIMAL["pairs"][0], **pair}]})


def test_pair_revisions_normalise_to_one_mapping():
    one = validate({**MINIMAL, "pairs": [{**MINIMAL["pairs"][0], "base_revision": "abc", "revision": {"vlm": "v1"}}]})
    assert one.pairs[0].revision == {"base": "abc", "vlm": "v1"} and not hasattr(one.pairs[0], "base_revision")
    assert validate(MINIMAL).pairs[0].revision == {}


@pytest.mark.slow
def test_a_pinned_hub_base_is_loaded_and_keyed_at_its_revision(tmp_path, tokenizer, monkeypatch):
    """A hub id with base_revision: every step loads the snapshot at that commit (not the branch head),
    and the keys and records name the revision (`hub:<id>@<commit>`)."""
    import json

    import huggingface_hub.constants

    from experiments.cli import main
    from sinkstudy.provenance import model_fingerprint
    from sinkstudy.tiny import tiny_causal_lm
    from vlm_factories import save_tiny_vlm

    repo, pinned, head = "tiny-org/tiny-base", "a" * 40, "b" * 40
    cache = tmp_path / "hub"
    storage = cache / "models--tiny-org--tiny-base"
    for seed, commit in ((0, pinned), (1, head)):  # two commits of one repo; main points at the newer
        tiny_causal_lm("qwen2", seed=seed).save_pretrained(storage / "snapshots" / commit)
        tokenizer.save_pretrained(storage / "snapshots" / commit)
    (storage / "refs").mkdir()
    (storage / "refs" / "main").write_text(head)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))  # offline: the cache is the hub

    vlm = save_tiny_vlm(tmp_path / "vlm", "qwen2_5_vl", tokenizer=tokenizer)
    config = tmp_path / "study.yaml"
    config.write_text(yaml.safe_dump({
        "name": "pinned", "pairs": [{"name": "p", "base": repo, "base_revision": pinned, "vlm": str(vlm), "native_qk_norm": False}],
        "sink": {"options": {"batch_size": 8}},
        "evals": {"tasks": ["sinkstudy_gsm"], "limit": 2, "max_gen_toks": 4, "batch_size": 2, "n_boot": 200},
        "interventions": [{"name": "lin", "method": "linear", "params": {"weight": 0.5}}]}))
    out = tmp_path / "run"
    assert main(["run", str(config), "--out", str(out), "--quiet"]) == 0

    def step(name):
        return json.loads((out / "steps" / "p" / f"{name}.json").read_text())

    pinned_id = f"hub:{repo}@{pinned}"
    at_pin, at_head = (model_fingerprint(storage / "snapshots" / c) for c in (pinned, head))
    assert at_pin != at_head
    assert step("extract")["provenance"]["model_fingerprints"][repo] == pinned_id
    assert step("extract")["identity"]["args"]["base"] == pinned_id
    assert step("sink/base")["identity"]["args"]["model"] == pinned_id
    assert step("eval/base")["result"]["fingerprint"] == at_pin  # the weights at the pinned commit were evaluated
    assert step("intervene/lin")["identity"]["args"]["models"]["base"] == pinned_id
    merged = json.loads((out / "models" / "p-lin" / "intervention.json").read_text())
    assert merged["provenance"]["fingerprints"]["base"] == at_pin  # and merged


def test_a_test_runs_in_an_empty_folder_of_its_own_never_the_checkout():
    """`make demo` first (the README's order) leaves runs/demo in the checkout: a test that ran there would read
    it (protect.yaml's inputs) and write its own runs/ beside it. Every test starts in an empty folder instead."""
    here = Path.cwd().resolve()
    assert here != ROOT.resolve() and ROOT.resolve() not in here.parents and not any(here.iterdir())


@pytest.mark.parametrize("config", ["study_real_quick.yaml", "protect.yaml"])
def test_a_plan_reads_no_input_file_and_a_run_checks_them_before_any_work(config, tmp_path, capsys):
    """study-real's text-replay chats are written by `make study-real` just before the run, and the protection study
    reads the demo's models and data: from a clean tree neither exists, yet the plan is made (and writes nothing);
    a run stops in one line before any work."""
    from experiments.cli import main

    out = tmp_path / "out"
    assert main(["run", str(CONFIGS / config), "--plan", "--out", str(out)]) == 0
    assert "--step" in capsys.readouterr().out and not out.exists()
    assert main(["run", str(CONFIGS / config), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and ("not found" in err or "does not exist" in err) and not out.exists()


def test_a_build_section_is_read_by_the_reader_its_loader_hands_over():
    """The study never imports the demo: the demo's build section is read by the reader the demo's loader hands over
    (`experiments.demo.study`, what `sinkstudy run` / `demo` load configs with); without one it is one line."""
    with pytest.raises(StudyConfigError, match=r"demo.yaml: build: no reader for a build section"):
        load_study(CONFIGS / "demo.yaml")


@pytest.mark.parametrize("config", ["demo.yaml", "demo_real.yaml"])
def test_inputs_the_plan_makes_itself_are_checked_when_the_step_that_reads_them_runs(config, tmp_path, monkeypatch, capsys):
    """demo.yaml (make study's default CONFIG) evaluates on held-out files its own build/corpus step writes: the run
    starts, it does not stop at load on files that do not exist yet."""
    import experiments.study.launch as launch
    from experiments.cli import main
    from sinkstudy import SinkstudyError

    started = []

    def run_study(study, **kw):
        started.append(study.name)
        raise SinkstudyError("stopped here: the steps would run now")

    monkeypatch.setattr(launch, "run_study", run_study)
    out = tmp_path / "out"
    assert main(["run", str(CONFIGS / config), "--out", str(out), "--numerics", "native"]) == 2
    assert started and "stopped here" in capsys.readouterr().err and not (out / "data").exists()


def test_the_template_works_when_copied_and_a_missing_include_says_where_it_looked(tmp_path):
    """real_pairs_template.yaml copied elsewhere (its header says: copy, edit) still finds its shipped include."""
    import shutil

    mine = tmp_path / "my_study.yaml"
    shutil.copy(CONFIGS / "real_pairs_template.yaml", mine)
    study = load_study(mine, out=tmp_path / "out")
    assert any(i.name.startswith("ties") or i.method == "ties" for i in study.interventions)
    mine.write_text(mine.read_text().replace("paper_merges.yaml", "my_merges.yaml"))
    with pytest.raises(StudyConfigError) as exc:
        load_study(mine, out=tmp_path / "out")
    msg = str(exc.value)
    assert "\n" not in msg and "include my_merges.yaml not found; looked for my_merges.yaml" in msg
    assert str(tmp_path / "my_merges.yaml") in msg and str(CONFIGS / "my_merges.yaml") in msg


def test_a_misspelt_evals_key_is_named_once_with_the_key_it_misspells():
    msg = _err({**MINIMAL, "evals": {"tasks": ["sinkstudy_ifeval"], "max_gen_tok": 8}})
    assert "unknown key(s) max_gen_tok (did you mean max_gen_toks?); allowed: " in msg
    assert msg.count("evals") == 1 and "max_gen_toks," in msg  # the known keys bare, not each prefixed with where
