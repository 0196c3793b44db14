"""A cached result is reused only for the same model, tokenizer, settings and code.

A model's identity covers every file of its checkpoint that changes outputs (weights, config,
generation config, tokenizer, chat template, sidecars), not the result files written beside it;
a restored mtime does not hide an edit; an eval, the engine's sink/eval steps, a merge's
measurements and plug-in-made models all re-run when any of these change. A step's code is the code it runs:
the modules its kind names and its own body, never a benchmark or a plot; editing one kind's body reruns
exactly that kind's steps.
"""

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch

from sinkstudy.provenance import model_fingerprint
from tests.test_merge import _perturbed, _save_model


@pytest.fixture
def ckpt(tmp_path, tokenizer):
    from sinkstudy.tiny import tiny_causal_lm

    return _save_model(tiny_causal_lm("qwen2", seed=0), tokenizer, tmp_path / "model")


def _edit_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text())
    for key, value in changes.items():
        target = data
        *parents, leaf = key.split(".")
        for p in parents:
            target = target[p]
        target[leaf] = value
    path.write_text(json.dumps(data, indent=2))


def test_fingerprint_covers_every_file_that_changes_outputs_and_no_result_file(ckpt):
    fp = model_fingerprint(ckpt)
    edits = {
        "config.json": lambda p: _edit_json(p, **{"rope_parameters.rope_theta": 1e6}),
        "generation_config.json": lambda p: _edit_json(p, repetition_penalty=1.3),
        "tokenizer_config.json": lambda p: _edit_json(p, padding_side="left"),
        "tokenizer.json": lambda p: p.write_text(p.read_text().replace('"<|end|>"', '"<|stop|>"')),
        "chat_template.jinja": lambda p: p.write_text(p.read_text().replace("<|assistant|>", "<|bot|>")),
        "sinkstudy_qknorm.json": lambda p: p.write_text('{"format": "hooks"}'),
        "preprocessor_config.json": lambda p: p.write_text('{"size": 8}'),
    }
    for name, edit in edits.items():
        f = ckpt / name
        before = f.read_bytes() if f.exists() else None
        edit(f)
        assert model_fingerprint(ckpt) != fp, f"an edit of {name} kept the fingerprint"
        f.write_bytes(before) if before is not None else f.unlink()
        assert model_fingerprint(ckpt) == fp, name
    # Results and provenance written beside a model are not part of it.
    for name in ("intervention.json", "sinkstudy_extraction.json", "mergekit_config.yml", "measure.json", "sink.json",
                 "sink_maps_base.json", "README.md", ".gitattributes", ".model.lock"):
        (ckpt / name).write_text("{}")
    (ckpt / "eval").mkdir()
    (ckpt / "eval" / "results.json").write_text("{}")
    assert model_fingerprint(ckpt) == fp


def test_restoring_the_old_mtime_does_not_hide_an_edit(ckpt, monkeypatch):
    import sinkstudy.provenance as prov

    monkeypatch.setattr(prov, "_HASH_CACHE_MIN_BYTES", 0, raising=False)  # every file goes through the hash cache
    weights = ckpt / "model.safetensors"
    fp = model_fingerprint(ckpt)
    hashed = []
    real = prov.file_sha256
    monkeypatch.setattr(prov, "file_sha256", lambda f: hashed.append(f.name) or real(f))
    assert model_fingerprint(ckpt) == fp and hashed == []  # unchanged files come from the cache
    st = weights.stat()
    data = bytearray(weights.read_bytes())
    data[-3] ^= 0x01  # one bit of the last tensor, same size
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert weights.stat().st_mtime_ns == st.st_mtime_ns and weights.stat().st_size == st.st_size
    assert model_fingerprint(ckpt) != fp


def test_loaded_model_identity_covers_config_and_generation_config():
    from sinkstudy.tiny import tiny_causal_lm

    model = tiny_causal_lm("qwen2", seed=0)
    fp = model_fingerprint(model)
    model.config.rope_parameters["rope_theta"] = 1e6
    assert model_fingerprint(model) != fp
    model.config.rope_parameters["rope_theta"] = 10000.0
    assert model_fingerprint(model) == fp
    model.generation_config.repetition_penalty = 1.3
    assert model_fingerprint(model) != fp
    model.generation_config.repetition_penalty = None
    model.config.tie_word_embeddings = not model.config.tie_word_embeddings  # its effect is in the state dict
    assert model_fingerprint(model) == fp


def test_hub_ids_carry_their_revision():
    assert model_fingerprint("org/model") == "hub:org/model"
    assert model_fingerprint("org/model", revision="0123abc") == "hub:org/model@0123abc"


@pytest.mark.slow
def test_an_eval_step_reruns_when_config_generation_config_template_or_code_change(ckpt, tmp_path, monkeypatch, own_cache):
    """`sinkstudy eval` (one engine step) is made again exactly when the model's files or the eval code change."""
    from evals import lmeval
    from experiments.cli import main

    calls = []
    real = lmeval.evaluate

    def counting(model, tokenizer, specs, settings, *rest):
        calls.append([s.name for s in specs])
        return real(model, tokenizer, specs, settings, *rest)

    monkeypatch.setattr(lmeval, "evaluate", counting)
    runs = iter(range(100))

    def evaluate() -> int:  # each into an --out of its own: a finished step with the same key is found by it all the same
        return main(["eval", str(ckpt), "--tasks", "sinkstudy_gsm", "--limit", "2", "--max-gen-toks", "4", "--batch-size", "2",
                     "--quiet", "--out", str(tmp_path / f"eval-{next(runs)}")])

    assert evaluate() == 0 and evaluate() == 0
    assert len(calls) == 1  # reused
    _edit_json(ckpt / "config.json", **{"rope_parameters.rope_theta": 1e6})
    assert evaluate() == 0 and len(calls) == 2, "a config.json edit reused stale scores"
    _edit_json(ckpt / "generation_config.json", repetition_penalty=1.3)
    assert evaluate() == 0 and len(calls) == 3, "a generation_config.json edit reused stale scores"
    template = ckpt / "chat_template.jinja"
    template.write_text(template.read_text().replace("<|assistant|>\n", "<|assistant|>\nAnswer: "))
    assert evaluate() == 0 and len(calls) == 4, "a chat template edit reused stale scores"
    import experiments.study.kinds as kinds

    code = kinds.module_code_version
    monkeypatch.setattr(kinds, "module_code_version", lambda *m: "code-sha256:grader-fix" if "evals.tasks.utils" in m else code(*m))
    assert evaluate() == 0 and len(calls) == 5, "an edit of the eval code reused stale scores"
    assert evaluate() == 0 and len(calls) == 5


def test_runner_sink_and_eval_steps_key_on_fingerprint_and_sink_code(ckpt, tmp_path, monkeypatch, tokenizer, own_cache):
    import sinkstudy.provenance
    from experiments.study.config import validate
    from experiments.study.graph import Plan
    from experiments.study.kinds import Ref
    from experiments.study.pair_steps import MeasureEval, MeasureSink
    from experiments.study.pipeline import PairPlan, StudyPlan
    from experiments.study.runner import engine_for

    vlm = _save_model(_perturbed(__import__("sinkstudy.tiny", fromlist=["x"]).tiny_causal_lm("qwen2", seed=0), 3), tokenizer,
                      tmp_path / "vlm")
    study = validate({"name": "t", "out": str(tmp_path / "run"), "pairs": [{"name": "p", "base": str(ckpt), "vlm": str(vlm)}],
                      "evals": {"tasks": ["sinkstudy_gsm"]}})
    counts = {"sink": 0, "eval": 0}

    def stub(kind):
        def fn(self, ctx):
            counts[kind] += 1
            if kind == "sink":  # what the real steps leave (a step whose output has gone is re-run)
                self.out.parent.mkdir(parents=True, exist_ok=True)
                self.out.write_text("{}")
            else:
                self.out.mkdir(parents=True, exist_ok=True)
            return {"value": 0.0}
        return fn

    monkeypatch.setattr(MeasureSink, "run", stub("sink"))
    monkeypatch.setattr(MeasureEval, "run", stub("eval"))

    def run():
        plan = StudyPlan(study, Plan())
        PairPlan(study, plan.plan, study.pairs[0]).measure("base", Ref(str(ckpt)))
        engine_for(study, plan, progress=False).run_all()

    run()
    run()
    assert counts == {"sink": 1, "eval": 1}
    _edit_json(ckpt / "generation_config.json", repetition_penalty=1.3)  # same path, another model
    run()
    assert counts == {"sink": 2, "eval": 2}, "the runner reused results of a model whose files changed"
    code = sinkstudy.provenance.module_code_version
    monkeypatch.setattr("experiments.study.kinds.module_code_version",
                        lambda *m: "code-sha256:edited" if "evals.sink.measure" in m else code(*m))
    run()
    assert counts == {"sink": 3, "eval": 2}, "an edit of the sink code reused old sink results"


def test_merge_measurements_key_on_model_captions_content_and_dtype(ckpt, tmp_path, monkeypatch, tokenizer, own_cache):
    """What `sinkstudy merge` measures (the references, their caption NLL) is keyed on each model's content, the
    captions' content and the loading dtype: measured once, then reused, and measured again exactly where one changed."""
    from experiments.study.pair_steps import Loading, MeasureEval, MeasureSink, Measurement
    from experiments.study.runner import run_plan
    from experiments.study.treat import CaptionNLL, treat_plan
    from sinkstudy.tiny import tiny_causal_lm

    vlm = _save_model(_perturbed(tiny_causal_lm("qwen2", seed=0), 3), tokenizer, tmp_path / "vlm")
    captions = tmp_path / "captions.txt"
    captions.write_text("A cat on a mat.\nTwo dogs in the park.\n")
    measured = []

    def stub(kind):
        def fn(self, ctx):
            measured.append((kind, Path(self.model.path).name))
            if kind == "eval":
                self.out.mkdir(parents=True, exist_ok=True)
            elif kind == "sink":
                self.out.parent.mkdir(parents=True, exist_ok=True)
                self.out.write_text("{}")
            return {"value": 0.0, "caption_nll": 1.0}
        return fn

    monkeypatch.setattr(MeasureSink, "run", stub("sink"))
    monkeypatch.setattr(MeasureEval, "run", stub("eval"))
    monkeypatch.setattr(CaptionNLL, "run", stub("captions"))
    out = tmp_path / "m"

    def measure(dtype="float32"):
        measured.clear()
        tp = treat_plan(str(ckpt), str(vlm), [], out, Measurement(loading=Loading(dtype)), seed=0, captions=str(captions))
        run_plan(tp.plan, out, progress=False, say=lambda line: None)
        return sorted(measured)

    assert measure() == sorted((k, m) for k in ("sink", "eval", "captions") for m in (ckpt.name, "vlm"))
    assert measure() == []  # reused
    captions.write_text("A cat on a mat.\nThree birds on a wire.\n")  # same file name, other captions
    assert measure() == [("captions", ckpt.name), ("captions", "vlm")], "caption NLL reused for other captions"
    _edit_json(vlm / "config.json", **{"rope_parameters.rope_theta": 1e6})
    assert measure() == [("captions", "vlm"), ("eval", "vlm"), ("sink", "vlm")], "a model whose config changed was not measured again"
    assert len(measure("bfloat16")) == 6, "measurements reused across dtypes"


PLUGIN = '''
from interventions.mitigations import register_mitigation


@register_mitigation("test_scale_head_plugin", defaults={})
def scale(base, vlm_lm, sink_maps, config):
    """Scale the output head (a test plug-in)."""
    vlm_lm.lm_head.weight.mul_(FACTOR)
    return vlm_lm
'''


def _load_plugin(path: Path, factor: float) -> None:
    from interventions.mitigations import _REGISTRY

    path.write_text(PLUGIN.replace("FACTOR", str(factor)))
    _REGISTRY.pop("test_scale_head_plugin", None)
    spec = importlib.util.spec_from_file_location(f"sinkstudy_test_plugin_{int(factor)}", path)
    spec.loader.exec_module(importlib.util.module_from_spec(spec))


def test_editing_a_plugin_reruns_what_it_made(tmp_path, tokenizer):
    from safetensors.torch import load_file

    from interventions.mitigations import _REGISTRY
    from interventions.registry import apply_intervention, intervention_request
    from sinkstudy.tiny import tiny_causal_lm

    base_model = tiny_causal_lm("qwen2", seed=0)
    base = _save_model(base_model, tokenizer, tmp_path / "base")
    vlm = _save_model(_perturbed(base_model, 4), tokenizer, tmp_path / "vlm")
    plugin, out = tmp_path / "my_plugin.py", tmp_path / "out"
    head = load_file(str(vlm / "model.safetensors"))["lm_head.weight"]
    try:
        _load_plugin(plugin, 2.0)
        apply_intervention("test_scale_head_plugin", base, vlm, {}, out, progress=False)
        torch.testing.assert_close(load_file(str(out / "model.safetensors"))["lm_head.weight"], 2.0 * head)
        first = intervention_request("test_scale_head_plugin", base, vlm, {})
        assert json.loads((out / "intervention.json").read_text())["request"]["code"]["plugin"].startswith("plugin-sha256:")
        _load_plugin(plugin, 3.0)
        assert intervention_request("test_scale_head_plugin", base, vlm, {})["code"] != first["code"]  # another step key
        apply_intervention("test_scale_head_plugin", base, vlm, {}, out, replace=True, progress=False)
        torch.testing.assert_close(load_file(str(out / "model.safetensors"))["lm_head.weight"], 3.0 * head)
        # through the command (`make mitigate NAME=... PLUGIN=file.py`), an edited plug-in reruns without --force
        from experiments.cli import main

        _REGISTRY.pop("test_scale_head_plugin", None)  # registered above from another module name
        cli = tmp_path / "cli"
        argv = ["mitigate", "test_scale_head_plugin", "--plugin", str(plugin), "--base", str(base), "--vlm", str(vlm),
                "--out", str(cli), "--no-eval", "--quiet"]
        assert main(argv) == 0
        torch.testing.assert_close(load_file(str(cli / "model" / "model.safetensors"))["lm_head.weight"], 3.0 * head)
        plugin.write_text(PLUGIN.replace("FACTOR", "4.0"))
        assert main(argv) == 0
        torch.testing.assert_close(load_file(str(cli / "model" / "model.safetensors"))["lm_head.weight"], 4.0 * head)
    finally:
        _REGISTRY.pop("test_scale_head_plugin", None)


# ----------------------------------------------------------------------------- code identity: the code a step runs

ROOT = Path(__file__).resolve().parent.parent
DRAWN = ("evals/sink/plot.py", "interventions/adapt/trajectory_plot.py", "experiments/report/plots.py")  # the figures


def _kinds() -> list[type]:
    """Every step kind of the tree (each module of `experiments` imported)."""
    import importlib
    import pkgutil

    import experiments
    from experiments.study.kinds import StepArgs

    for m in pkgutil.walk_packages(experiments.__path__, "experiments."):
        if not m.name.endswith("__main__"):
            importlib.import_module(m.name)

    def below(c):
        for s in c.__subclasses__():
            yield s
            yield from below(s)

    return sorted({k for k in below(StepArgs) if k.__module__.startswith("experiments.")}, key=lambda k: k.kind)


def _code(kinds) -> dict[str, dict]:
    from experiments.study.kinds import code_identity

    return {k.kind: code_identity(k) for k in kinds}


def _editing(monkeypatch, edited: dict[Path, "Callable[[str], str]"]) -> None:
    """Every source file read (as the kinds' identities read them) with `edited[path](text)` in place of `path`'s text."""
    edited = {Path(p).resolve(): fn for p, fn in edited.items()}
    text, raw = Path.read_text, Path.read_bytes
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: edited.get(self.resolve(), str)(text(self, *a, **k)))
    monkeypatch.setattr(Path, "read_bytes", lambda self: edited[self.resolve()](raw(self).decode()).encode()
                        if self.resolve() in edited else raw(self))


def test_editing_a_benchmark_or_a_plot_changes_no_step_key(monkeypatch):
    """No kind runs a benchmark or draws a figure: editing any of them leaves every step's code (and so every key) as
    it was, while an edit of a module a kind runs is seen."""
    kinds = _kinds()
    assert {"sink", "sink-map", "eval", "extract", "intervene", "qknorm", "adapt", "vl-skill", "template-openings"} <= {k.kind for k in kinds}
    before = _code(kinds)
    touched = [*ROOT.glob("benchmarks/*.py"), *(ROOT / f for f in DRAWN)]
    assert len(touched) == 8 + len(DRAWN)
    with monkeypatch.context() as m:
        _editing(m, {f: lambda t: t + "\n# an edit\n" for f in touched})
        assert _code(kinds) == before
    with monkeypatch.context() as m:
        _editing(m, {ROOT / "evals" / "sink" / "measure.py": lambda t: t + "\n# an edit\n"})
        after = _code(kinds)
    runs_it = {k.kind for k in kinds if "evals.sink.measure" in k.code}
    assert {k for k in before if before[k] != after[k]} == runs_it >= {"sink", "sink-map", "qknorm", "demo-reference"}


def test_editing_one_kinds_body_changes_exactly_its_keys(monkeypatch):
    """Seven kinds share experiments/study/pair_steps.py: an edit of one's body changes that kind's code alone; an edit of
    what several use (the `Loading` they load models with) changes exactly theirs."""
    from experiments.study.pair_steps import MeasureSink

    kinds = _kinds()
    before = _code(kinds)
    here = Path(importlib.util.find_spec(MeasureSink.__module__).origin)
    line = "strength = strength_from_maps(maps, self.metric, **self.params)"
    assert line in here.read_text()
    with monkeypatch.context() as m:
        _editing(m, {here: lambda t: t.replace(line, line + "  # an edit")})
        after = _code(kinds)
    assert [k for k in before if before[k] != after[k]] == ["sink"]
    doc = '"""How models are loaded: dtype and device."""'
    with monkeypatch.context() as m:
        _editing(m, {here: lambda t: t.replace(doc, doc + "  # an edit")})
        after = _code(kinds)
    assert sorted(k for k in before if before[k] != after[k]) == ["eval", "qknorm", "sink", "sink-map"]
