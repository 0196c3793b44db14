"""One execution path: a merge made by `sinkstudy merge` and the same merge of the same pair inside a study are
one result: the study finds the command's finished step by its key and copies it in, computing nothing."""

import json

import pytest
import torch
import yaml

pytestmark = pytest.mark.slow


def test_a_study_reuses_the_merge_a_command_made(tmp_path, tokenizer, own_cache, capsys):
    from safetensors.torch import load_file
    from vlm_factories import save_tiny_vlm, tiny_base

    from experiments.cli import main
    from experiments.study.config import load_study
    from experiments.study.runner import run_study

    base = tmp_path / "base"
    tiny_base("qwen2").save_pretrained(base)
    tokenizer.save_pretrained(base)
    vlm = save_tiny_vlm(tmp_path / "vlm", "qwen2_5_vl", tokenizer=tokenizer)
    merged = tmp_path / "merge"
    assert main(["merge", "--method", "ties", "--weight", "1.0", "--density", "0.5", "--base", str(base), "--vlm", str(vlm),
                 "--out", str(merged), "--no-eval", "--quiet"]) == 0

    cfg = {"name": "reuse", "pairs": [{"name": "p", "base": str(base), "vlm": str(vlm), "native_qk_norm": False}],
           "evals": {"tasks": ["sinkstudy_gsm"], "limit": 2, "max_gen_toks": 4, "batch_size": 2, "n_boot": 100},
           "interventions": [{"name": "t", "method": "ties", "params": {"weight": 1.0, "density": 0.5}},
                             {"name": "t2", "method": "ties", "params": {"weight": 1.0, "density": 0.4}}]}
    (tmp_path / "study.yaml").write_text(yaml.safe_dump(cfg))
    out = tmp_path / "study"
    log = {e["step"]: e["reused"] for e in run_study(load_study(tmp_path / "study.yaml", out=out), progress=False)["log"]}
    assert log["p/intervene/t"] and not log["p/intervene/t2"]  # the same merge reused; another density made afresh
    record = json.loads((out / "steps" / "p" / "intervene" / "t.json").read_text())
    assert record["reused_from"] == str((merged / "steps" / "pair" / "intervene" / "treatment.json").resolve())
    mine, theirs = load_file(out / "models" / "p-t" / "model.safetensors"), load_file(merged / "model" / "model.safetensors")
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
