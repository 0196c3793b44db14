"""Scale-out seams that run on CPU: mergekit's execution options on `sinkstudy merge` (how mergekit
runs, recorded beside the merge; of them only --cuda changes what it computes, so only --cuda is part
of the merge's identity) and their one-line refusals; the GPU check script's shape. The GPU paths
themselves run in scripts/gpu_check.sh."""

import json
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from experiments.cli import main as cli_main

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def pair(tmp_path_factory, tokenizer):
    from sinkstudy.tiny import tiny_causal_lm

    d = tmp_path_factory.mktemp("scaleout_pair")
    for name, seed in (("base", 1), ("vlm", 2)):
        tiny_causal_lm("llama", seed=seed).save_pretrained(d / name)
        tokenizer.save_pretrained(d / name)
    return d / "base", d / "vlm"


def test_lazy_unpickle_merge_is_identical_and_recorded(pair, tmp_path, capsys):
    base, vlm = pair
    common = ["merge", "--method", "linear", "--weight", "0.3", "--base", str(base), "--vlm", str(vlm), "--no-eval"]
    assert cli_main([*common, "--out", str(tmp_path / "plain")]) == 0
    assert cli_main([*common, "--out", str(tmp_path / "lazy"), "--lazy-unpickle", "--force"]) == 0  # made again, not reused
    plain_dir, lazy_dir = tmp_path / "plain" / "model", tmp_path / "lazy" / "model"
    a, b = load_file(str(plain_dir / "model.safetensors")), load_file(str(lazy_dir / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    info = json.loads((lazy_dir / "intervention.json").read_text())
    assert info["mergekit_options"] == {"cuda": False, "lazy_unpickle": True, "low_cpu_memory": False}
    # how mergekit ran is not part of what was asked: the plain merge's request is the same
    plain = json.loads((plain_dir / "intervention.json").read_text())
    assert plain["request"] == info["request"]


def test_a_cpu_merge_is_not_reused_for_a_cuda_one(pair, tmp_path):
    """mergekit on a GPU keeps other entries at a TIES / magnitude cut (its argsort breaks ties another way) and
    draws DARE's drops from the CUDA generator: --cuda is part of the request, the other options are not."""
    from experiments.study.kinds import Ref, step_key
    from experiments.study.pair_steps import Intervene
    from interventions.registry import intervention_request

    base, vlm = pair
    params = {"weight": 1.0, "density": 0.2}
    cpu = intervention_request("ties", base, vlm, params)
    assert intervention_request("ties", base, vlm, params, mergekit_options={"lazy_unpickle": True}) == cpu
    cuda = intervention_request("ties", base, vlm, params, mergekit_options={"cuda": True, "low_cpu_memory": True})
    assert cuda == {**cpu, "device": "cuda"}
    step = lambda options: Intervene("ties", Ref(str(base)), Ref(str(vlm)), params, mergekit=options, out=tmp_path / "m")  # noqa: E731
    assert step_key(step({}), None)[0] == step_key(step({"lazy_unpickle": True}), None)[0]
    assert step_key(step({"cuda": True}), None)[0] != step_key(step({}), None)[0]  # never reused for the other


@pytest.mark.parametrize("extra, needle", [
    (["--cuda"], "--cuda: no CUDA device is available here"),
    (["--low-cpu-memory"], "--low-cpu-memory keeps results on the GPU: it needs --cuda"),
])
def test_mergekit_options_refused_in_one_line_before_work(pair, tmp_path, capsys, extra, needle):
    if extra == ["--cuda"] and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    base, vlm = pair
    out = tmp_path / "m"
    rc = cli_main(["merge", "--method", "linear", "--base", str(base), "--vlm", str(vlm), "--no-eval", "--out", str(out), *extra])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and needle in err and not out.exists()


def test_mergekit_options_on_a_mitigation_are_refused():
    from interventions.merge import MergeError
    from interventions.registry import apply_intervention

    with pytest.raises(MergeError, match="apply to mergekit methods, not head_restore"):
        apply_intervention("head_restore", "b", "v", {}, "/nonexistent/out", mergekit_options={"cuda": True})


def test_gpu_check_script_parses_and_refuses_without_a_gpu(tmp_path):
    import sys

    script = ROOT / "scripts" / "gpu_check.sh"
    assert script.stat().st_mode & 0o111 and subprocess.run(["bash", "-n", str(script)]).returncode == 0
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: run the script itself")
    r = subprocess.run([str(script), str(tmp_path / "out")], capture_output=True, text=True, timeout=300,
                       env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable, "HOME": str(tmp_path)})
    assert r.returncode == 1 and r.stdout.strip() == f"no CUDA device visible to {sys.executable}: this check needs one GPU"


def test_the_gpu_merge_check_places_differences_relative_to_the_top_k_cut(tmp_path):
    """scripts/gpu_check.py same-weights on two merges that keep different members of a tie across the cut (distance
    0) and differ once more far below it (distance 3): the diagnostic the CUDA-vs-CPU merge comparison reports."""
    import importlib.util

    from safetensors.torch import save_file

    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    delta = torch.tensor([5.0, 4.0, 3.0, 3.0, 2.0, 1.0])  # density 0.5 keeps 3: ranks 0, 1 and one of the two 3s
    kept_a, kept_b = torch.tensor([1, 1, 1, 0, 0, 0.0]), torch.tensor([1, 1, 0, 1, 0, 1.0])
    for name, t in (("base", torch.zeros(6)), ("vlm", delta), ("a", delta * kept_a), ("b", delta * kept_b)):
        (tmp_path / name).mkdir()
        save_file({"w": t}, str(tmp_path / name / "model.safetensors"))
    out = gpu_check.same_weights(tmp_path / "a", tmp_path / "b", (tmp_path / "base", tmp_path / "vlm"), 0.5)
    assert out["max_abs_diff"] == 3.0 and not out["bit_identical"]
    assert (out["elements_differing"], out["differing_at_the_cut"], out["max_rank_distance_from_the_cut"]) == (3, 2, 3)
