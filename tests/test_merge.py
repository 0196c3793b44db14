"""mergekit merges on tiny same-architecture pairs: each method's arithmetic on real tensors."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from experiments.cli.options import pair_out
from sinkstudy import SinkstudyError


def _save_model(model, tokenizer, path: Path) -> Path:
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _perturbed(model, seed: int, scale: float = 0.05):
    """A copy of `model` with every weight moved by seeded Gaussian noise (the 'VLM LM')."""
    import copy

    gen = torch.Generator().manual_seed(seed)
    other = copy.deepcopy(model)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen))
    return other


@pytest.fixture(scope="module")
def trio(tmp_path_factory, tokenizer):
    """root (pretrained ancestor), base LLM = root + noise, VLM LM = root + other noise; on disk."""
    from sinkstudy.tiny import tiny_causal_lm

    d = tmp_path_factory.mktemp("merge_pair")
    root = tiny_causal_lm("qwen2", seed=0)
    base = _perturbed(root, 1)
    vlm = _perturbed(root, 2)
    return {name: _save_model(m, tokenizer, d / name) for name, m in (("root", root), ("base", base), ("vlm", vlm))}


def _w(path: Path) -> dict:
    return load_file(str(path / "model.safetensors"))


Q = "model.layers.0.self_attn.q_proj.weight"
UP = "model.layers.1.mlp.up_proj.weight"
EMB = "model.embed_tokens.weight"


def test_linear_is_weighted_average(trio, tmp_path):
    from interventions.merge import MERGEKIT_YAML, RESULT_JSON, run_mergekit_merge

    out = run_mergekit_merge("linear", trio["base"], trio["vlm"], tmp_path / "m", weight=0.3, progress=False)
    b, v, m = _w(trio["base"]), _w(trio["vlm"]), _w(out)
    assert set(m) == set(b)
    for name in (Q, UP, EMB, "model.norm.weight"):
        torch.testing.assert_close(m[name], 0.7 * b[name] + 0.3 * v[name], rtol=1e-5, atol=1e-6)
    assert (out / MERGEKIT_YAML).is_file() and (out / RESULT_JSON).is_file()
    assert (out / "tokenizer.json").is_file() and (out / "config.json").is_file()


def test_a_gguf_base_is_converted_and_merged(trio, tmp_path, tokenizer):
    """A .gguf base goes through sinkstudy.checkpoint's conversion: the merge mixes its real tensors."""
    pytest.importorskip("gguf")
    import json

    from gguf_factory import save_tiny_gguf
    from interventions.merge import RESULT_JSON, run_mergekit_merge
    from sinkstudy.provenance import model_fingerprint
    from transformers import AutoModelForCausalLM

    base_model = AutoModelForCausalLM.from_pretrained(trio["base"])
    gguf = save_tiny_gguf(tmp_path / "base.gguf", base_model, tokenizer)
    out = run_mergekit_merge("linear", gguf, trio["vlm"], tmp_path / "m", weight=0.3, progress=False)
    b, v, m = _w(trio["base"]), _w(trio["vlm"]), _w(out)
    for name in (Q, UP, EMB):
        torch.testing.assert_close(m[name], 0.7 * b[name] + 0.3 * v[name], rtol=1e-5, atol=1e-6)
    record = json.loads((out / RESULT_JSON).read_text())
    assert record["models"]["base"] == str(gguf)
    assert record["provenance"]["fingerprints"]["base"] == model_fingerprint(gguf)  # the file the user gave


def test_task_arithmetic_adds_scaled_delta(trio, tmp_path):
    from interventions.merge import run_mergekit_merge

    out = run_mergekit_merge("task_arithmetic", trio["base"], trio["vlm"], tmp_path / "m", weight=0.6, progress=False)
    b, v, m = _w(trio["base"]), _w(trio["vlm"]), _w(out)
    for name in (Q, UP, EMB):
        torch.testing.assert_close(m[name], b[name] + 0.6 * (v[name] - b[name]), rtol=1e-5, atol=1e-6)


def test_task_arithmetic_with_root_adds_both_task_vectors(trio, tmp_path):
    from interventions.merge import run_mergekit_merge

    out = run_mergekit_merge("task_arithmetic", trio["base"], trio["vlm"], tmp_path / "m", weight=1.0, root=trio["root"], progress=False)
    r, b, v, m = _w(trio["root"]), _w(trio["base"]), _w(trio["vlm"]), _w(out)
    torch.testing.assert_close(m[Q], r[Q] + (b[Q] - r[Q]) + (v[Q] - r[Q]), rtol=1e-5, atol=1e-6)


def _trim(delta: torch.Tensor, density: float) -> torch.Tensor:
    k = int(density * delta.numel())
    thresh = delta.abs().flatten().sort(descending=True).values[k - 1]
    return delta * (delta.abs() >= thresh)


def test_ties_trims_to_density_and_elects_signs(trio, tmp_path):
    from interventions.merge import run_mergekit_merge

    density, w = 0.2, 0.8
    out = run_mergekit_merge("ties", trio["base"], trio["vlm"], tmp_path / "m", weight=w, density=density,
                             root=trio["root"], progress=False)
    r, b, v, m = _w(trio["root"]), _w(trio["base"]), _w(trio["vlm"]), _w(out)
    for name in (Q, UP):
        t1, t2 = w * _trim(b[name] - r[name], density), w * _trim(v[name] - r[name], density)
        elected = torch.where(t1 + t2 >= 0, 1.0, -1.0)
        expected = r[name] + t1 * (t1.sign() == elected) + t2 * (t2.sign() == elected)
        torch.testing.assert_close(m[name], expected, rtol=1e-5, atol=1e-6)
        # Conflicting signs happen on this pair, so the election is really exercised.
        assert ((t1 * t2) < 0).any()
    # Single task vector: TIES keeps exactly the top `density` share of the delta.
    out1 = run_mergekit_merge("ties", trio["base"], trio["vlm"], tmp_path / "m1", weight=1.0, density=density, progress=False)
    delta = _w(out1)[UP] - b[UP]
    assert (delta != 0).sum().item() == int(density * delta.numel())


def test_dare_rescales_kept_deltas(trio, tmp_path):
    """DARE drops with prob 1-p and rescales the survivors; mergekit 0.1.5 rescales to the delta's
    L1 norm, a factor equal to 1/p in expectation (checked), the same factor on every kept entry."""
    from interventions.merge import run_mergekit_merge

    p = 0.5
    out = run_mergekit_merge("dare_linear", trio["base"], trio["vlm"], tmp_path / "m", weight=1.0, density=p, seed=3, progress=False)
    b, v, m = _w(trio["base"]), _w(trio["vlm"]), _w(out)
    delta, merged = v[EMB] - b[EMB], m[EMB] - b[EMB]
    kept = merged != 0
    frac = kept.float().mean().item()
    assert abs(frac - p) < 0.02  # 32768 Bernoulli(0.5) draws: sd 0.003
    # One factor c for every kept entry: the L1 norm of the delta over that of the kept part.
    c = delta.abs().sum() / delta[kept].abs().sum()
    torch.testing.assert_close(merged[kept], c * delta[kept], rtol=0, atol=1e-6)
    assert abs(c.item() - 1 / p) / (1 / p) < 0.03
    # Seeded: same seed, same drops; another seed, other drops.
    again = run_mergekit_merge("dare_linear", trio["base"], trio["vlm"], tmp_path / "m2", weight=1.0, density=p, seed=3, progress=False)
    other = run_mergekit_merge("dare_linear", trio["base"], trio["vlm"], tmp_path / "m3", weight=1.0, density=p, seed=4, progress=False)
    assert torch.equal(_w(again)[EMB], m[EMB])
    assert not torch.equal(_w(other)[EMB], m[EMB])


@pytest.mark.parametrize("method, density", [("dare_ties", 0.5), ("linear", None)])
def test_emitted_yaml_reproduces_weights_through_mergekit_cli(trio, tmp_path, method, density):
    from interventions.merge import MERGEKIT_YAML, run_mergekit_merge

    out = run_mergekit_merge(method, trio["base"], trio["vlm"], tmp_path / "m", weight=0.7, density=density, seed=11, progress=False)
    text = (out / MERGEKIT_YAML).read_text()
    assert "--random-seed 11" in text
    # mergekit-yaml's own entry point (the console script's target), run in process to spare a start-up.
    from mergekit.scripts.run_yaml import main as mergekit_yaml

    again = tmp_path / "again"
    mergekit_yaml([str(out / MERGEKIT_YAML), str(again), "--random-seed", "11", "--quiet"], standalone_mode=False)
    ours, theirs = _w(out), _w(again)
    assert set(ours) == set(theirs)
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name


@pytest.mark.parametrize("method", ["slerp", "breadcrumbs", "dare_ties"])
def test_other_methods_run_and_move_toward_vlm(trio, tmp_path, method):
    from interventions.merge import run_mergekit_merge

    density = None if method == "slerp" else 0.8
    out = run_mergekit_merge(method, trio["base"], trio["vlm"], tmp_path / "m", weight=0.5, density=density, progress=False)
    b, v, m = _w(trio["base"]), _w(trio["vlm"]), _w(out)
    assert (m[UP] - v[UP]).norm() < (b[UP] - v[UP]).norm()
    assert not torch.equal(m[UP], b[UP])


def test_selective_merge_leaves_unselected_untouched(trio, tmp_path):
    from interventions.merge import run_mergekit_merge

    out = run_mergekit_merge("linear", trio["base"], trio["vlm"], tmp_path / "m", weight=0.5, select="attn,layers:0-0", progress=False)
    b, v, m = _w(trio["base"]), _w(trio["vlm"]), _w(out)
    changed = []
    for name in b:
        if name.startswith("model.layers.0.self_attn."):
            torch.testing.assert_close(m[name], 0.5 * (b[name] + v[name]), rtol=1e-5, atol=1e-6)
            changed.append(name)
        else:
            assert torch.equal(m[name], b[name]), name
    assert len(changed) == 7  # q/k/v weight+bias and o_proj in Qwen2

    out2 = run_mergekit_merge("task_arithmetic", trio["base"], trio["vlm"], tmp_path / "m2", weight=1.0, select="mlp", progress=False)
    m2 = _w(out2)
    for name in b:
        if ".mlp." in name:
            torch.testing.assert_close(m2[name], v[name], rtol=0, atol=1e-6)
        else:
            assert torch.equal(m2[name], b[name]), name


def test_selection_parsing_and_filters():
    from interventions.merge import MergeError, Selection

    s = Selection.parse("mlp,layers:1-2")
    assert s.filters() == ["layers.1.mlp", "layers.2.mlp"]
    assert s.matches("model.layers.2.mlp.up_proj.weight") and not s.matches("model.layers.12.mlp.up_proj.weight")
    assert Selection.parse("layers:3").filters() == ["layers.3."]
    with pytest.raises(MergeError, match="bad selection"):
        Selection.parse("heads")


def test_mismatched_pair_gives_the_pair_loader_error(trio, tmp_path, tokenizer):
    from interventions.pairs import PairMismatchError
    from interventions.merge import run_mergekit_merge
    from sinkstudy.tiny import tiny_causal_lm

    other = _save_model(tiny_causal_lm("qwen2", intermediate_size=96), tokenizer, tmp_path / "other")
    with pytest.raises(PairMismatchError) as err:
        run_mergekit_merge("ties", trio["base"], other, tmp_path / "m", density=0.5, progress=False)
    assert "\n" not in str(err.value)
    assert not (tmp_path / "m").exists()


def test_bad_input_refused_before_work(trio, tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    from interventions.merge import MergeError, estimate_output_bytes, run_mergekit_merge

    with pytest.raises(MergeError, match="no density"):
        run_mergekit_merge("linear", trio["base"], trio["vlm"], tmp_path / "m", density=0.5)
    with pytest.raises(MergeError, match="unknown mergekit method"):
        run_mergekit_merge("nonsense", trio["base"], trio["vlm"], tmp_path / "m")
    with pytest.raises(SinkstudyError, match="does not exist"):
        run_mergekit_merge("linear", tmp_path / "missing", trio["vlm"], tmp_path / "m")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(SinkstudyError, match="cannot fetch no-such-org/no-such-model from the hub") as err:
        run_mergekit_merge("linear", trio["base"], "no-such-org/no-such-model", tmp_path / "m")
    assert "\n" not in str(err.value)
    # The estimate is the base's tensor bytes (float32 here), from the safetensors headers.
    n_params = sum(t.numel() for t in _w(trio["base"]).values())
    assert estimate_output_bytes(trio["base"]) == 4 * n_params
    assert estimate_output_bytes(trio["base"], "bfloat16") == 2 * n_params
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**6, 10**6 - 1000, 1000))
    with pytest.raises(MergeError, match="not enough disk"):
        run_mergekit_merge("linear", trio["base"], trio["vlm"], tmp_path / "m")
    assert not (tmp_path / "m").exists()
    monkeypatch.undo()
    existing = tmp_path / "exists"
    existing.mkdir()
    (existing / "keep.txt").write_text("x")
    with pytest.raises(SinkstudyError, match="already exists"):
        run_mergekit_merge("linear", trio["base"], trio["vlm"], existing)
    assert (existing / "keep.txt").read_text() == "x"


def test_vlm_checkpoint_is_extracted_then_merged(tmp_path, tokenizer, monkeypatch):
    """A VLM checkpoint as `vlm`: its LM is streamed into a temporary folder beside the output (in the VLM's stored
    dtype, never built in memory), merged, and removed: the merge of the extracted LM, bit for bit."""
    from vlm_factories import save_tiny_vlm, tiny_base

    from interventions.merge import run_mergekit_merge

    def no_in_memory_lm(*args, **kwargs):
        raise AssertionError("the VLM's language model was built in memory")

    monkeypatch.setattr("interventions.pairs.extract.build_causal_lm", no_in_memory_lm)
    monkeypatch.setattr("interventions.pairs.loading.build_causal_lm", no_in_memory_lm)
    base = _save_model(tiny_base("qwen2"), tokenizer, tmp_path / "base")
    vlm = save_tiny_vlm(tmp_path / "vlm", "qwen2_5_vl", tokenizer=tokenizer, dtype=torch.bfloat16)
    out = run_mergekit_merge("linear", base, vlm, tmp_path / "merges" / "m", weight=1.0, progress=False)
    assert sorted(p.name for p in (tmp_path / "merges").iterdir()) == ["m"]  # the extraction lived only while the merge ran
    recorded = json.loads((out / "intervention.json").read_text())
    assert recorded["models"]["vlm"] == str(vlm) and recorded["provenance"]["fingerprints"]["vlm_lm"].startswith("ckpt-sha256:")
    from interventions.pairs import plan_extraction, write_language_model

    lm_dir = tmp_path / "lm"
    write_language_model(plan_extraction(vlm, base), lm_dir)
    lm, m = _w(lm_dir), _w(out)
    assert set(m) == set(lm) and {t.dtype for t in lm.values()} == {torch.bfloat16}
    for name in m:  # float32 like the base; the bf16 values exactly
        assert m[name].dtype == torch.float32
        torch.testing.assert_close(m[name], lm[name].float(), rtol=0, atol=0)


def test_apply_intervention_writes_its_request_and_never_reuses_nor_replaces_unasked(trio, tmp_path):
    """The registry applies a method and records its request; reuse is the engine's (`Intervene`): an existing output
    is refused unless `replace`."""
    from interventions.merge import RESULT_JSON
    from interventions.registry import apply_intervention, intervention_request, list_interventions
    from sinkstudy.io import OutputExistsError

    kinds = list_interventions()
    assert kinds["ties"] == "mergekit" and kinds["star"] == "spectral" and kinds["head_restore"].startswith("mitigation")
    out = apply_intervention("ties", trio["base"], trio["vlm"], {"weight": 1.0, "density": 0.2}, tmp_path / "t", progress=False)
    recorded = json.loads((out / RESULT_JSON).read_text())["request"]
    assert recorded == intervention_request("ties", trio["base"], trio["vlm"], {"weight": 1.0, "density": 0.2})
    before = _w(out)
    with pytest.raises(OutputExistsError, match="already exists"):
        apply_intervention("ties", trio["base"], trio["vlm"], {"weight": 1.0, "density": 0.5}, out)
    assert all(torch.equal(before[k], v) for k, v in _w(out).items())
    from interventions.merge import MergeError

    with pytest.raises(MergeError, match="no parameter"):
        apply_intervention("star", trio["base"], trio["vlm"], {"density": 0.5}, tmp_path / "s")
    s = apply_intervention("tsv", trio["base"], trio["vlm"], {"alpha": 0.5}, tmp_path / "s", progress=False)
    b, v, m = _w(trio["base"]), _w(trio["vlm"]), _w(s)
    torch.testing.assert_close(m[UP], b[UP] + 0.5 * (v[UP] - b[UP]), rtol=0, atol=2e-5)


def test_cli_merge_and_mitigate_list(trio, tmp_path, capsys):
    from experiments.cli import main

    out = tmp_path / "cli"
    assert main(["merge", "--method", "task_arithmetic", "--weight", "0.25", "--base", str(trio["base"]), "--vlm", str(trio["vlm"]),
                 "--out", str(out), "--no-eval", "--select", "mlp"]) == 0
    b, v, m = _w(trio["base"]), _w(trio["vlm"]), _w(out / "model")  # the model in OUT/model, measurements beside
    card = (out / "model" / "README.md").read_text()
    title = next(line for line in card.splitlines() if line.startswith("# "))
    assert title == "# task_arithmetic of base and the language model of vlm" and ".tmp" not in card
    assert "weight 0.25" in card and "select mlp" in card
    torch.testing.assert_close(m[UP], b[UP] + 0.25 * (v[UP] - b[UP]), rtol=0, atol=1e-6)
    assert torch.equal(m[Q], b[Q])
    assert main(["mitigate", "--list"]) == 0
    assert "head_restore" in capsys.readouterr().out
    assert main(["merge", "--method", "ties", "--base", str(trio["base"]), "--vlm", str(trio["vlm"]), "--out", str(out), "--no-eval"]) == 2
    assert "another request" in capsys.readouterr().err
    assert main(["merge", "--method", "ties", "--param", "gama=0.1", "--base", str(trio["base"]), "--vlm", str(trio["vlm"]),
                 "--out", str(tmp_path / "x"), "--no-eval"]) == 2


def test_sweep_configs_expand_and_pareto_front():
    from experiments.cli.cmd_sweep import DEFAULT_SWEEP_CONFIG
    from experiments.report.treatments import pareto_front
    from experiments.study.sweep import load_sweep

    small = load_sweep(DEFAULT_SWEEP_CONFIG)["points"]  # the default: small enough to run as it is
    assert len(small) <= 9 and {p["method"] for p in small} == {"linear", "ties", "dare_ties"}
    grid = load_sweep(DEFAULT_SWEEP_CONFIG.parent / "merge_sweep_full.yaml")["points"]
    assert len(grid) == 9 + 27 + 27
    assert {p["density"] for p in grid if p["method"] == "ties"} == {0.2, 0.5, 0.8}
    assert sorted({p["weight"] for p in grid if p["method"] == "linear"}) == [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9]
    paper = {p["name"]: p for p in load_sweep(DEFAULT_SWEEP_CONFIG.parent / "paper_merges.yaml")["points"]}
    assert paper["dare"] == {"name": "dare", "method": "dare_ties", "weight": 1.0, "density": 0.1}
    assert paper["star"]["eta"] == 40 and paper["tsv"]["alpha"] == 1.0 and paper["ties"]["density"] == 0.2
    assert paper["mix95"]["weight"] == 0.95 and paper["uniform"]["weight"] == 0.5

    def row(name, rec, dist):
        return {"name": name, "tasks": {"t": {"recovery": rec}}, "weight_distance_to_vlm": dist}

    rows = [row("a", 0.5, 0.5), row("b", 0.4, 0.6), row("c", 0.9, 0.9), row("d", 0.1, 0.1), row("e", None, 0.0)]
    assert pareto_front(rows) == ["a", "c", "d"]  # e: recovery undefined, off the front


def test_max_points_keeps_an_even_deterministic_spread_over_the_grid():
    from experiments.cli.cmd_sweep import DEFAULT_SWEEP_CONFIG
    from experiments.study.sweep import load_sweep, spread

    grid = load_sweep(DEFAULT_SWEEP_CONFIG.parent / "merge_sweep_full.yaml")["points"]
    assert [p["name"] for p in spread(grid, 3)] == [grid[0]["name"], grid[31]["name"], grid[62]["name"]]
    assert [p["method"] for p in spread(grid, 3)] == ["linear", "ties", "dare_ties"]  # not the first 3 (all linear)
    assert spread(list(range(63)), 5) == [0, 16, 31, 47, 62]
    assert spread(list(range(10)), 1) == [4] and spread(list(range(4)), 9) == [0, 1, 2, 3] and spread([1, 2], None) == [1, 2]
    for n in range(1, 64):
        picked = spread(list(range(63)), n)
        gaps = {b - a for a, b in zip(picked, picked[1:])}
        assert len(picked) == n and picked == sorted(set(picked)) and (n < 2 or max(gaps) - min(gaps) <= 1)
        assert picked == spread(list(range(63)), n)


def test_sweep_summary_table_and_plot(tmp_path):
    from experiments.report.treatments import format_sweep, plot_pareto

    def row(name, method, rec, dist, nll):
        return {"name": name, "method": method, "weight_distance_to_vlm": dist, "caption_nll": {"value": nll},
                "sink_strength": {"value": 1.0, "base": 1.2, "vlm": 0.4},
                "tasks": {"t": {"recovery": rec, "ci": [None if rec is None else rec - 0.1, None if rec is None else rec + 0.1]}}}

    rows = [row("lin", "linear", 0.3, 0.5, 2.0), row("ties", "ties", None, 0.2, 2.5), row("star", "star", 0.6, 0.7, 1.9)]
    table = format_sweep(rows)
    assert "| lin | 1.000 | 0.30 [0.20, 0.40] | 0.500 |" in table and "n/a [n/a, n/a]" in table
    assert "Pareto front (recovery vs distance to VLM LM): lin, star" in table
    plot_pareto(rows, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 10_000


# --------------------------------------------------------------------------- outputs of other inputs never reused

def _variant(src: Path, dst: Path, rope_theta: float, template_word: str, extra_file: str | None = None) -> Path:
    """A copy of checkpoint `src` whose config and chat template say where they came from."""
    import json
    import shutil

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["rope_parameters"]["rope_theta"] = rope_theta
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    template = dst / "chat_template.jinja"
    template.write_text(template.read_text().replace("<|assistant|>", f"<|assistant|>{template_word}"))
    if extra_file:
        (dst / extra_file).write_text("{}")
    return dst


def _donor(out: Path) -> tuple[float, str]:
    import json

    theta = json.loads((out / "config.json").read_text())["rope_parameters"]["rope_theta"]
    return theta, (out / "chat_template.jinja").read_text()


LINEAR_SCRIPT = """
import sys, torch
torch.set_num_threads(1)
from interventions.merge import run_mergekit_merge
base, vlms, outs = sys.argv[1], sys.argv[2].split(","), sys.argv[3].split(",")
for vlm, out in zip(vlms, outs):
    run_mergekit_merge("linear", base, vlm, out, weight=0.5, progress=False)
"""


def test_linear_merge_takes_config_and_tokenizer_from_the_base_whatever_the_hash_seed(trio, tmp_path):
    """mergekit copies config and tokenizer from base_model, else from the first model of a set
    (hash-seed order): the linear merge names the base LLM as base_model."""
    import os
    import subprocess
    import sys

    import interventions

    base = _variant(trio["base"], tmp_path / "base", 10000.0, "")
    vlms = [_variant(trio["vlm"], tmp_path / f"vlm{i}", 500000.0, " [VLM]") for i in range(4)]
    root = Path(interventions.__file__).resolve().parent.parent  # the code under test
    procs = []
    for seed in ("1", "2"):
        outs = [tmp_path / f"out-{seed}-{i}" for i in range(len(vlms))]
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(root)}
        procs.append((outs, subprocess.Popen([sys.executable, "-c", LINEAR_SCRIPT, str(base), ",".join(map(str, vlms)),
                                              ",".join(map(str, outs))], env=env, cwd=root, stderr=subprocess.PIPE, text=True)))
    for outs, proc in procs:
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-2000:]
        for out in outs:
            assert _donor(out) == _donor(base), f"{out.name}: config/tokenizer not the base LLM's"


def test_root_is_refused_for_linear_and_slerp(trio, tmp_path, capsys):
    from experiments.cli import main
    from interventions.merge import MergeError, run_mergekit_merge

    for method in ("linear", "slerp"):
        with pytest.raises(MergeError, match="takes no --root"):
            run_mergekit_merge(method, trio["base"], trio["vlm"], tmp_path / "m", root=trio["root"], progress=False)
        assert main(["merge", "--method", method, "--base", str(trio["base"]), "--vlm", str(trio["vlm"]), "--root", str(trio["root"]),
                     "--out", str(tmp_path / "cli"), "--no-eval"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "takes no --root" in err
    assert not (tmp_path / "m").exists() and not (tmp_path / "cli").exists()


def test_root_merge_takes_config_and_tokenizer_from_the_base_and_says_so(trio, tmp_path):
    import json

    from interventions.merge import MERGEKIT_YAML, RESULT_JSON, run_mergekit_merge

    base = _variant(trio["base"], tmp_path / "base", 10000.0, "")
    root = _variant(trio["root"], tmp_path / "root", 20000.0, " [pretrained]", extra_file="added_tokens.json")
    out = run_mergekit_merge("ties", base, trio["vlm"], tmp_path / "m", weight=1.0, density=0.5, root=root, progress=False)
    assert _donor(out) == _donor(base)
    assert not (out / "added_tokens.json").exists()  # a root-only tokenizer file does not survive
    files = json.loads((out / RESULT_JSON).read_text())["files"]
    assert files["config.json"].startswith("base LLM") and files["chat_template.jinja"].startswith("base LLM")
    assert files["weights"] == "mergekit"
    assert "base LLM" in (out / MERGEKIT_YAML).read_text().split("merge_method")[0]
    # Without a root, the donor is mergekit's base_model (the base LLM) and intervention.json says so.
    plain = run_mergekit_merge("ties", base, trio["vlm"], tmp_path / "p", weight=1.0, density=0.5, progress=False)
    assert _donor(plain) == _donor(base)
    assert json.loads((plain / RESULT_JSON).read_text())["files"]["config.json"] == "base LLM (mergekit base_model)"


def test_a_different_pair_into_the_same_out_is_refused_never_reused(trio, tmp_path, monkeypatch, capsys):
    from experiments.cli import main
    from interventions.registry import apply_intervention
    from sinkstudy.io import OutputExistsError

    out = apply_intervention("linear", trio["base"], trio["vlm"], {"weight": 0.5}, tmp_path / "o", progress=False)
    before = _w(out)
    with pytest.raises(OutputExistsError, match="already exists") as err:
        apply_intervention("linear", trio["base"], trio["root"], {"weight": 0.5}, out, progress=False)
    assert "\n" not in str(err.value)
    assert all(torch.equal(before[k], v) for k, v in _w(out).items())
    apply_intervention("linear", trio["base"], trio["root"], {"weight": 0.5}, out, replace=True, progress=False)
    b, r, m = _w(trio["base"]), _w(trio["root"]), _w(out)
    torch.testing.assert_close(m[UP], 0.5 * (b[UP] + r[UP]), rtol=1e-5, atol=1e-6)
    # Default outputs are pair-specific: two pairs never meet in one directory.
    monkeypatch.chdir(tmp_path)
    for vlm in ("vlm", "root"):
        assert main(["merge", "--method", "linear", "--base", str(trio["base"]), "--vlm", str(trio[vlm]), "--no-eval"]) == 0
    made = sorted(str(p.relative_to(tmp_path)) for p in (tmp_path / "runs").glob("interventions/*/*"))
    assert made == sorted(str(pair_out(trio["base"], trio[vlm], "linear-weight0.5")) for vlm in ("vlm", "root"))


def test_the_default_out_is_named_by_every_setting_given(trio, tmp_path, monkeypatch, capsys):
    """mitigate's --top-k and --param, merge's --param and --root each name the default folder: another setting lands
    beside the first, never refused as another request in the first one's folder; the same request is reused."""
    from experiments.cli import main

    monkeypatch.chdir(tmp_path)
    pair = ["--base", str(trio["base"]), "--vlm", str(trio["vlm"]), "--no-eval", "--quiet"]
    for argv in (["mitigate", "--top-k", "1"], ["mitigate", "--param", "top_k=2"],
                 ["merge", "--method", "ties", "--param", "density=0.3"],
                 ["merge", "--method", "ties", "--param", "density=0.3", "--root", str(trio["root"])]):
        assert main(argv + pair) == 0, capsys.readouterr().err
    pair_dir = pair_out(trio["base"], trio["vlm"], "x").parent
    made = sorted(p.name for p in (tmp_path / pair_dir).iterdir())
    assert made == ["head_restore-top_k1", "head_restore-top_k2", "ties-density0.3-rootroot-weight1.0", "ties-density0.3-weight1.0"]
    capsys.readouterr()
    assert main(["mitigate", "--param", "top_k=1"] + pair) == 0  # the --top-k 1 request, spelt as a parameter
    printed = capsys.readouterr().out
    assert "reused pair/intervene/treatment" in printed and "wrote" not in printed
    assert len(list((tmp_path / pair_dir).iterdir())) == 4
    # a mergekit merge on the GPU computes other numbers (its own request): its own folder too (no GPU needed to name it)
    from experiments.cli.cmd_merge import settings_name
    from interventions.registry import validate_intervention

    given = {"density": 0.3}
    names = [settings_name("ties", validate_intervention("ties", given), given, {"cuda": cuda}, 0) for cuda in (False, True)]
    assert names == ["ties-density0.3-weight1.0", "ties-density0.3-devicecuda-weight1.0"]


def test_sweep_reuses_points_only_for_the_same_pair_and_deletes_inside_its_dir(trio, tmp_path, fake_measurements, own_cache, capsys):
    import yaml

    from experiments.cli import main
    from experiments.study.sweep import load_sweep
    from sinkstudy import SinkstudyError

    config = tmp_path / "sweep.yaml"
    config.write_text(yaml.safe_dump({"keep_models": False, "grid": [{"method": "linear", "weight": [0.2, 0.8]}]}))
    out = tmp_path / "sweep"

    def sweep(vlm, *extra):
        fake_measurements.clear()
        args = ["merge-sweep", "--base", str(trio["base"]), "--vlm", str(trio[vlm]), "--sweep", str(config), "--out", str(out), *extra]
        return main(args)

    assert sweep("vlm") == 0 and fake_measurements == ["linear-w0.2", "linear-w0.8"]
    assert not list(out.glob("points/*/model"))  # keep_models: false, removed inside the sweep dir
    capsys.readouterr()
    assert sweep("vlm") == 0 and fake_measurements == []  # same pair and settings: reused
    printed = capsys.readouterr().out
    assert "merge sweep plan: 2 point(s): 0 to run, 2 reused" in printed and "reused pair/intervene/linear-w0.2" in printed
    assert sweep("root") == 2 and fake_measurements == []  # another pair: refused, not reused
    assert "made by another request (models differ)" in capsys.readouterr().err
    assert sweep("root", "--force") == 0 and fake_measurements == ["linear-w0.2", "linear-w0.8"]
    with pytest.raises(SinkstudyError, match="point name"):
        config.write_text(yaml.safe_dump({"points": [{"name": "../../escape", "method": "linear", "weight": 0.5}]}))
        load_sweep(config)


def test_sweep_prints_its_plan_before_any_work_and_runs_the_spread(trio, tmp_path, monkeypatch, fake_measurements, own_cache, capsys):
    import yaml

    import experiments.study.pair_steps as pair_steps
    import experiments.study.sweep as sweep
    from experiments.cli import main

    events = []  # the merge step's and the sweep's own calls, in order
    monkeypatch.setattr(pair_steps, "apply_intervention", lambda method, b, v, params, out, **k: events.append(f"work {out.parent.name}") or
                        _copy_model(b, out))
    plan = sweep.format_plan
    monkeypatch.setattr(sweep, "format_plan", lambda *a: events.append("plan") or plan(*a))
    config = tmp_path / "sweep.yaml"
    config.write_text(yaml.safe_dump({"grid": [{"method": "linear", "weight": [0.1, 0.3, 0.5, 0.7, 0.9]}]}))
    out = tmp_path / "sweep"
    args = ["merge-sweep", "--base", str(trio["base"]), "--vlm", str(trio["vlm"]), "--sweep", str(config), "--out", str(out)]
    assert main([*args, "--max-points", "3"]) == 0
    assert events == ["plan", "work linear-w0.1", "work linear-w0.5", "work linear-w0.9"]
    printed = capsys.readouterr().out
    assert "merge sweep plan: 3 point(s) of 5, evenly spread over the grid: 3 to run, 0 reused" in printed
    assert "printed once the base and VLM LM references are measured" in printed  # no timing known yet
    events.clear()
    assert main(args) == 0  # all 5: the 3 finished are reused, the estimate comes from their recorded times
    assert events == ["plan", "work linear-w0.3", "work linear-w0.7"]
    printed = capsys.readouterr().out
    assert "5 point(s): 2 to run, 3 reused" in printed and "  reused linear-w0.5" in printed and "  run    linear-w0.3" in printed
    assert "estimated time: 2 × ~" in printed


def _copy_model(src, out):
    import shutil

    shutil.copytree(src, out, dirs_exist_ok=True)
    return out


def test_sweep_mergekit_options_reach_the_mergekit_points_only(trio, tmp_path, fake_measurements, own_cache):
    """`merge-sweep --lazy-unpickle` runs mergekit's points with it (recorded beside each) and the
    TSV point as it runs: a sweep mixing mergekit and spectral methods is not refused mid-way."""
    import json

    import yaml

    from experiments.cli import main

    config = tmp_path / "sweep.yaml"
    config.write_text(yaml.safe_dump({"points": [{"name": "lin", "method": "linear", "weight": 0.5},
                                                 {"name": "tsv", "method": "tsv", "alpha": 1.0}]}))
    out = tmp_path / "sweep"
    assert main(["merge-sweep", "--base", str(trio["base"]), "--vlm", str(trio["vlm"]), "--sweep", str(config),
                 "--out", str(out), "--lazy-unpickle"]) == 0
    lin = json.loads((out / "points" / "lin" / "model" / "intervention.json").read_text())
    assert lin["mergekit_options"] == {"cuda": False, "lazy_unpickle": True, "low_cpu_memory": False}
    assert "mergekit_options" not in json.loads((out / "points" / "tsv" / "model" / "intervention.json").read_text())


def test_a_merge_setting_given_as_param_is_the_merge_s_not_replaced_by_its_default(trio, tmp_path):
    """`make merge-linear PARAMS="weight=0.3"` hands on --param weight=0.3: the merge uses 0.3, not linear's default 0.5."""
    from experiments.cli import main

    out = tmp_path / "w"
    assert main(["merge", "--method", "linear", "--param", "weight=0.3", "--base", str(trio["base"]), "--vlm", str(trio["vlm"]),
                 "--out", str(out), "--no-eval"]) == 0
    b, v, m = _w(trio["base"]), _w(trio["vlm"]), _w(out / "model")
    torch.testing.assert_close(m[UP], 0.7 * b[UP] + 0.3 * v[UP], rtol=0, atol=1e-6)
