"""One machine, one answer: the demo's pipeline (tokenizer, pretraining from scratch, LLaVA adaptation,
extraction, sink pass, strict evals, paired statistics) run twice, once in one process (`--jobs 1`) and
once on two worker processes (`--jobs 2`, what the demo picks on two cores), writes byte-identical weights
and the same summary, number for number. (Across machines the numbers may differ: every result records
the hardware that computed it, tests/test_foundation.py.)"""

import hashlib
import json

import pytest
import yaml


def _tiny_demo_config(path):
    """The demo's config, `--quick`'s shrinking, then smaller still: one backbone (a qwen3), a few steps."""
    from experiments.cli.cmd_study import DEMO_CONFIG
    from experiments.demo.build import quick_overrides
    from experiments.study.schema import deep_merge

    raw = yaml.safe_load(DEMO_CONFIG.read_text())
    quick = quick_overrides(raw)
    quick["build"]["backbones"] = [dict(b, steps=6, hidden_size=32, seq_len=64, batch_size=4)
                                   for b in quick["build"]["backbones"][1:2]]  # a qwen3: its steps still split over 2 workers
    config = deep_merge(deep_merge(raw, quick), {
        "build": {"corpus": {"train_records": 300, "heldout_ifeval": 4, "heldout_gsm": 3}, "pretrain": {"curve_every": 3},
                  "vl": {"heldout_images": 10, "stage1": {"steps": 2, "batch_size": 4}, "stage2": {"steps": 3, "batch_size": 4},
                         "trajectory_every": 2}},
        "evals": {"max_gen_toks": 8, "n_boot": 100}, "interventions": []})
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return config


def _weights(out):
    return {str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(out.rglob("*.safetensors"))}


def _numbers(out):
    summary = json.loads((out / "summary.json").read_text())
    summary.pop("timings")  # wall time, the one thing allowed to differ
    return json.loads(json.dumps(summary).replace(str(out), "OUT"))


@pytest.mark.slow
def test_demo_pipeline_twice_with_1_and_2_jobs_gives_the_same_bytes(tmp_path, monkeypatch):
    from experiments.cli import main

    config = _tiny_demo_config(tmp_path / "tiny.yaml")
    one, two = tmp_path / "jobs1", tmp_path / "jobs2"
    for jobs, out in ((1, one), (2, two)):
        if jobs == 2:  # the workers' glibc fills fresh and freed memory with a pattern: a read of uninitialised memory shows
            monkeypatch.setenv("MALLOC_PERTURB_", "165")
        assert main(["demo", "--config", str(tmp_path / "tiny.yaml"), "--jobs", str(jobs), "--quiet", "--out", str(out)]) == 0
    assert not (one / "logs").exists() and len(list((two / "logs").glob("worker-*.log"))) == 2  # really 1 vs 2 processes

    weights = _weights(one)
    names = [b["name"] for b in config["build"]["backbones"]]
    assert {f"models/{n}-{kind}/model.safetensors" for n in names for kind in ("base", "vlm")} <= set(weights)
    assert weights == _weights(two)
    numbers = _numbers(one)
    assert list(numbers["pairs"]) == names and all(isinstance(e["models"]["base"]["sink_strength"], float)
                                                    for e in numbers["pairs"].values())
    assert numbers["hardware"] and numbers == _numbers(two)
