"""Every command ends with a summary (experiments.cli.closing): the one-line result,
where its outputs are (paths that exist), how long it took, and what to run next (command lines the
CLI parses). Run here over the commands with cheap paths on tiny real models; the demo's is checked
in tests/test_demo.py."""

import json
import re
import shlex
from pathlib import Path

import pytest

from tests.test_merge import _perturbed, _save_model


@pytest.fixture(scope="module")
def pair(tmp_path_factory, tokenizer):
    from sinkstudy.tiny import tiny_causal_lm

    d = tmp_path_factory.mktemp("summary_pair")
    base = tiny_causal_lm("qwen2", seed=0)
    return {"base": _save_model(base, tokenizer, d / "base"), "vlm": _save_model(_perturbed(base, 4), tokenizer, d / "vlm")}


def _closing(capsys, command: str) -> dict:
    """The summary at the end of stdout, parsed; its `next` lines checked against the CLI parser."""
    from experiments.cli import build_parser

    lines = capsys.readouterr().out.rstrip("\n").splitlines()
    head = max(i for i, line in enumerate(lines) if line.startswith(f"── sinkstudy {command}: "))
    block = lines[head:]
    assert block[1].startswith("   outputs:  ") and block[2].startswith("   took:     ")
    assert block[2].split()[-1] in ("s", "min") and float(block[2].split()[1]) >= 0
    nxt = [line[13:].strip() for line in block[3:]]
    assert all(line.startswith("   next:") or line.startswith(" " * 13) for line in block[3:])
    parser = build_parser()
    for step in nxt:
        if step.startswith("sinkstudy "):
            parser.parse_args(shlex.split(step)[1:])  # a real command line (SystemExit on a wrong one)
    outputs = block[1][13:]
    paths = [] if outputs.startswith("none written") else [Path(p) for p in outputs.split(", ")]
    assert all(p.exists() for p in paths), paths
    return {"result": block[0].split(": ", 1)[1], "outputs": paths, "next": nxt}


def test_merge_mitigate_pair_and_sink_end_with_a_summary(pair, tmp_path, capsys):
    from experiments.cli import main

    b, v = str(pair["base"]), str(pair["vlm"])
    assert main(["merge", "--method", "linear", "--base", b, "--vlm", v, "--out", str(tmp_path / "m"), "--no-eval"]) == 0
    s = _closing(capsys, "merge")
    assert s["result"].startswith("linear merge (weight 0.5): written, not measured (--no-eval)")
    # The model folder holds the model (and its card); the measurements would sit beside it.
    assert s["outputs"] == [tmp_path / "m" / "model"] and s["next"][0] == f"sinkstudy eval {tmp_path / 'm' / 'model'}"

    assert main(["mitigate", "head_restore", "--top-k", "1", "--base", b, "--vlm", v, "--out", str(tmp_path / "h"), "--no-eval"]) == 0
    s = _closing(capsys, "mitigate")
    assert "mitigation head_restore" in s["result"] and s["outputs"] == [tmp_path / "h" / "model"]

    assert main(["pair", "diff", "--base", b, "--vlm", v, "--json", str(tmp_path / "d.json")]) == 0
    s = _closing(capsys, "pair diff")
    rows = json.loads((tmp_path / "d.json").read_text())["summary"]
    top = max((r for r in rows if r["rel_change"] is not None), key=lambda r: r["rel_change"])
    assert f"largest relative change {top['rel_change']:.4g} in {top['group']}" in s["result"]
    assert s["outputs"] == [tmp_path / "d.json"]

    assert main(["pair", "extract", "--base", b, "--vlm", v, "--out", str(tmp_path / "lm")]) == 0
    s = _closing(capsys, "pair extract")
    assert s["outputs"] == [tmp_path / "lm"] and "sinkstudy sink " + str(tmp_path / "lm") in s["next"]

    assert main(["sink", b, "--out", str(tmp_path / "s"), "--max-length", "32"]) == 0
    s = _closing(capsys, "sink")
    value = json.loads((tmp_path / "s" / "sink.json").read_text())["value"]
    assert s["result"].startswith(f"Sink Strength [logodds] of {b} = {value:.4f}")
    assert s["outputs"] == [tmp_path / "s" / "sink.json", tmp_path / "s" / "sink_map.png"]


def test_sweep_paper_table_and_clean_end_with_a_summary(pair, tmp_path, fake_measurements, own_cache, capsys):
    import yaml

    from experiments.cli import main

    config = tmp_path / "sweep.yaml"
    config.write_text(yaml.safe_dump({"grid": [{"method": "linear", "weight": [0.2, 0.8]}]}))
    out = tmp_path / "sweep"
    assert main(["merge-sweep", "--base", str(pair["base"]), "--vlm", str(pair["vlm"]), "--sweep", str(config), "--out", str(out)]) == 0
    s = _closing(capsys, "merge-sweep")
    assert s["result"].startswith("2 point(s), 0 reused; Pareto front") and "best mean text recovery linear-w0.2 0.50" in s["result"]
    assert s["outputs"] == [out / "summary.md", out / "summary.json", out / "pareto.png"]
    assert s["next"] == [f"sinkstudy merge --method linear --base {pair['base']} --vlm {pair['vlm']} --weight 0.2"]

    assert main(["paper-table", "--n-boot", "200", "--json", str(tmp_path / "t.json")]) == 0
    s = _closing(capsys, "paper-table")
    rho = json.loads((tmp_path / "t.json").read_text())["correlation"]["points"]["spearman"]
    assert f"Spearman ρ(S, Δ points) = {rho:+.2f}" in s["result"] and s["outputs"] == [tmp_path / "t.json"]

    stale = tmp_path / "runs" / ".model.tmp-999999999-abc"  # a dead writer's temporary
    stale.mkdir(parents=True)
    assert main(["clean", str(tmp_path / "runs")]) == 0
    s = _closing(capsys, "clean")
    assert s["result"].startswith("1 stale temporary") and not stale.exists() and s["outputs"] == []


@pytest.mark.slow
def test_eval_and_compare_end_with_a_summary(pair, tmp_path, capsys):
    from experiments.cli import main

    run = tmp_path / "eval"
    assert main(["eval", str(pair["base"]), "--tasks", "sinkstudy_gsm", "--limit", "2", "--max-gen-toks", "4", "--out", str(run)]) == 0
    s = _closing(capsys, "eval")
    scores = json.loads((run / "results.json").read_text())["scores"]["sinkstudy_gsm"]
    strict, flexible = scores["exact_match,strict-match"], scores["exact_match,flexible-extract"]
    assert s["result"] == (f"{pair['base']}: sinkstudy_gsm exact_match,strict-match {strict:.4f} / exact_match,flexible-extract "
                           f"{flexible:.4f} (first 2 prompts per task)")  # GSM headlines both graders
    assert s["outputs"] == [run] and s["next"] == [f"sinkstudy compare OTHER_RUN {run}"]
    assert main(["compare", str(run), str(run), "--n-boot", "50"]) == 0
    s = _closing(capsys, "compare")
    assert re.match(r"sinkstudy_gsm exact_match,[\w-]+: Δ = B − A = \+0\.0 points \[\+0\.0, \+0\.0\], n = 2", s["result"])
