"""Data parallel as a regression test: `accelerate launch --multi_gpu --num_processes 2` of `sinkstudy adapt`
and of `sinkstudy eval` on tiny models gives the single-process outputs bit for bit: the same weights (the
effective batch kept by gradient accumulation), the same losses and Sink Strength trajectory, the same samples
and scores. On a machine without GPUs that launch runs two CPU processes over gloo, the code path of a GPU
launch (`--cpu --num_processes 2` would run ONE process: accelerate's multi-CPU launch needs mpirun), so the
tests check that two ranks really ran."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from evals.eval_run import EvalRun
from experiments.cli import main as cli_main
from sinkstudy.tiny import tiny_causal_lm

ROOT = Path(__file__).resolve().parent.parent
LAUNCH = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
          "--mixed_precision", "no", "--dynamo_backend", "no"]
RECIPE = """\
seed: 0
precision: fp32
stages:
  stage1: {steps: 2, batch_size: 4, micro_batch_size: 2, lr: 1.0e-3}
  stage2: {steps: 2, batch_size: 4, micro_batch_size: 2, lr: 1.0e-3}
trajectory: {every: 2}
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(args, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    # HF_HOME: no user accelerate config can change the launch; the flags above say everything.
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(ROOT),
               HF_HOME=str(tmp_path / "hf"), SINKSTUDY_CACHE=str(tmp_path / "cache"))
    # A port of its own: launches in other test processes run at the same time (accelerate's default is one port).
    port = ["--main_process_port", str(_free_port())]
    run = subprocess.run([*LAUNCH, *port, "-m", "experiments.cli", *args], capture_output=True, text=True, cwd=ROOT, env=env, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    return run


@pytest.fixture(scope="module")
def base(tmp_path_factory, tokenizer):
    path = tmp_path_factory.mktemp("dp_base")
    tiny_causal_lm("llama", seed=3).save_pretrained(path)  # llama: AutoTokenizer keeps the saved tokenizer's class
    tokenizer.save_pretrained(path)
    return path


def _weights(model_dir):
    return {p.name: p.read_bytes() for p in sorted(Path(model_dir).glob("*.safetensors"))}


@pytest.mark.slow(seconds=30)
def test_adapt_under_accelerate_launch_equals_one_process(base, tmp_path):
    (tmp_path / "recipe.yaml").write_text(RECIPE)
    args = ["adapt", "--base", str(base), "--tiny-vision", "--train-data", "digits", "--recipe", str(tmp_path / "recipe.yaml"), "--quiet"]
    _launch([*args, "--out", str(tmp_path / "dp")], tmp_path)
    assert cli_main([*args, "--out", str(tmp_path / "one")]) == 0
    dp, one = (json.loads((tmp_path / run / "run" / "adapt.json").read_text()) for run in ("dp", "one"))
    assert [s["processes"] for s in dp["stages"]] == [2, 2] and [s["processes"] for s in one["stages"]] == [1, 1]
    assert [s["effective_batch"] for s in dp["stages"]] == [s["effective_batch"] for s in one["stages"]] == [4, 4]
    assert [s["losses"] for s in dp["stages"]] == [s["losses"] for s in one["stages"]]
    assert dp["trajectory"]["points"] == one["trajectory"]["points"]
    weights = _weights(tmp_path / "dp" / "model")
    assert weights and weights == _weights(tmp_path / "one" / "model")
    assert weights != _weights(base)  # it trained


@pytest.mark.slow(seconds=30)
@pytest.mark.parametrize("backend", ["hf", "hf-continuous"])
def test_eval_under_accelerate_launch_equals_one_process(base, tmp_path, backend):
    """The two processes split the prompts; rank 0 gathers and writes the run one process writes (hf at batch 1:
    no padding effects; hf-continuous's texts do not depend on the batch)."""
    args = ["eval", str(base), "--tasks", "sinkstudy_gsm", "--limit", "5", "--batch-size", "1" if backend == "hf" else "3",
            "--max-gen-toks", "6", "--backend", backend]
    dp = _launch([*args, "--out", str(tmp_path / "dp"), "--cache-dir", str(tmp_path / "c_dp")], tmp_path)
    assert "Building contexts for sinkstudy_gsm on rank 1" in dp.stderr  # lm-eval split the prompts
    assert dp.stdout.count("eval run written to") == 1  # rank 0 alone reports and writes
    assert cli_main([*args, "--out", str(tmp_path / "one"), "--cache-dir", str(tmp_path / "c_one")]) == 0
    a, b = EvalRun.load(tmp_path / "dp"), EvalRun.load(tmp_path / "one")
    assert a.samples == b.samples and a.scores == b.scores
    assert [s["doc_id"] for s in a.samples["sinkstudy_gsm"]] == list(range(5))


def test_a_command_that_joined_a_process_group_leaves_it_before_exiting(tmp_path):
    """A rank that exits still in its gloo group can abort at interpreter shutdown (SIGABRT: gloo's threads outlive
    the group), failing a launch whose work was done. In a fresh interpreter (no group leaks into this one): join a
    one-rank gloo group, run a command, and the group is gone when `main` returns."""
    script = f"""
import torch.distributed as dist
from experiments.cli import main
dist.init_process_group("gloo", init_method={(tmp_path / 'store').as_uri()!r}, rank=0, world_size=1)
code = main(["paper-table", "--n-boot", "10", "--quiet"])
print("exit", code, "still in the group:", dist.is_initialized())
"""
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().splitlines()[-1] == "exit 0 still in the group: False"
