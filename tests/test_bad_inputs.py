"""Every bad input, driven through the
real command line in process. Each row must exit 2 with ONE line on stderr naming the problem (no
traceback), before any work, leaving the output tree exactly as it was (hashed before and after).
"""

import errno
import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, tokenizer):
    """Models and files the rows point at (outside the hashed output tree)."""
    import yaml
    from transformers import GPT2Config, GPT2LMHeadModel, GPTNeoXConfig, GPTNeoXForCausalLM

    from evals.eval_run import EvalRun
    from sinkstudy.tiny import tiny_causal_lm
    from tests.test_merge import _perturbed, _save_model

    d = tmp_path_factory.mktemp("bad_inputs")
    base = tiny_causal_lm("qwen2", seed=0)
    p = {"base": _save_model(base, tokenizer, d / "base"), "vlm": _save_model(_perturbed(base, 8), tokenizer, d / "vlm")}

    truncated = shutil.copytree(p["base"], d / "truncated")
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    corrupt = shutil.copytree(p["base"], d / "corrupt")
    data = bytearray((corrupt / "model.safetensors").read_bytes())
    data[8:40] = b"\xff" * 32  # the JSON header is garbage
    (corrupt / "model.safetensors").write_bytes(bytes(data))
    missing = d / "missing_shard"
    base.save_pretrained(missing, max_shard_size="200KB")
    tokenizer.save_pretrained(missing)
    shards = sorted(missing.glob("model-*.safetensors"))
    assert len(shards) > 1
    shards[-1].unlink()
    p.update(truncated=truncated, corrupt=corrupt, missing=missing)

    p["gpt2"] = _save_model(GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=512, n_positions=256)),
                            tokenizer, d / "gpt2")
    p["gpt_neox"] = _save_model(GPTNeoXForCausalLM(GPTNeoXConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                                                 intermediate_size=64, vocab_size=512)), tokenizer, d / "gpt_neox")

    p["latin1"] = d / "latin1.txt"
    p["latin1"].write_bytes("caf\xe9 au lait\n".encode("latin-1"))
    p["captions"] = d / "captions.txt"
    p["captions"].write_text("A cat on a mat.\n")

    run = EvalRun(scores={"t": {"acc,none": 1.0}}, settings={}, fingerprint="x", tasks=["t"],
                  samples={"t": [{"doc_id": 0, "doc_hash": "h", "prompt": "p", "output": "o", "target": "o",
                                  "extracted": {}, "metrics": {"acc,none": 1.0}}]})
    p["run"] = run.save(d / "run")

    def study(name: str, **changes) -> Path:
        cfg = {"name": "s", "pairs": [{"name": "p", "base": str(p["base"]), "vlm": str(p["vlm"])}],
               "evals": {"tasks": ["sinkstudy_gsm"]}, "interventions": [{"name": "ties", "method": "ties", "params": {"density": 0.2}}]}
        f = d / f"{name}.yaml"
        f.write_text(yaml.safe_dump({**cfg, **changes}))
        return f

    p["study_ok"] = study("ok")
    p["study_density"] = study("density", interventions=[{"name": "ties", "method": "ties", "params": {"density": 2}}])
    p["study_task"] = study("task", evals={"tasks": ["sinkstudy_gsm", "nosuch_task"]})
    p["study_mitigation"] = study("mitigation", interventions=[{"name": "m", "method": "no_such_mitigation"}])
    p["study_path"] = study("path", pairs=[{"name": "p", "base": str(d / "no" / "base"), "vlm": str(p["vlm"])}])
    p["study_data"] = study("data", evals={"tasks": ["sinkstudy_gsm"], "data_files": {"sinkstudy_gsm": str(d / "no.jsonl")}})
    p["study_backbone"] = study("backbone", build={"backbones": [{"name": "../../escape", "family": "qwen2", "hidden_size": 32,
                                                                  "num_hidden_layers": 1, "num_attention_heads": 2}]})
    p["study_collision"] = study("collision", pairs=[{"name": "a", "base": str(p["base"]), "vlm": str(p["vlm"])},
                                                     {"name": "a-b", "base": str(p["base"]), "vlm": str(p["vlm"])}],
                                 interventions=[{"name": "b-lin", "method": "linear"}, {"name": "lin", "method": "linear"}])
    p["study_latin1"] = d / "latin1.yaml"
    p["study_latin1"].write_bytes("name: caf\xe9\n".encode("latin-1"))
    p["bad_summary"] = d / "old_run"
    p["bad_summary"].mkdir()
    (p["bad_summary"] / "summary.json").write_text('{"name": "a summary missing what the report reads"}')
    p["sweep_escape"] = d / "sweep_escape.yaml"
    p["sweep_escape"].write_text(yaml.safe_dump({"points": [{"name": "../../escape", "method": "linear", "weight": 0.5}]}))
    return p


def _tree(root: Path) -> dict[str, str]:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames:
            out[os.path.relpath(os.path.join(dirpath, name), root)] = "dir"
        for name in filenames:
            f = os.path.join(dirpath, name)
            out[os.path.relpath(f, root)] = hashlib.sha256(open(f, "rb").read()).hexdigest()
    return out


def _no_space(*args, **kwargs):
    out = Path(args[2])  # _run_mergekit(cfg, yaml_text, out, seed, progress): a write that hits a full disk
    (out / "model-00001-of-00002.safetensors").write_bytes(b"\0" * 1000)
    raise OSError(errno.ENOSPC, "No space left on device", str(out / "model-00002-of-00002.safetensors"))


def _little_disk(monkeypatch):
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**6, 10**6 - 1000, 1000))


MERGE = ["merge", "--base", "{base}", "--vlm", "{vlm}", "--out", "{out}/m", "--no-eval"]
EVAL = ["eval", "{base}", "--tasks", "sinkstudy_gsm", "--out", "{out}/eval"]
SWEEP = ["merge-sweep", "--base", "{base}", "--vlm", "{vlm}", "--out", "{out}/sweep"]

ROWS = [
    # checkpoints (the pairs branch validates every loader path)
    pytest.param(["sink", "{truncated}", "--out", "{out}/s"], "truncated", None, id="truncated-shard"),
    pytest.param(["sink", "{missing}", "--out", "{out}/s"], "model-0000", None, id="missing-shard"),
    pytest.param(["sink", "{corrupt}", "--out", "{out}/s"], "safetensors", None, id="corrupt-safetensors"),
    pytest.param(["merge", "--method", "ties", "--base", "{corrupt}", "--vlm", "{vlm}", "--out", "{out}/m", "--no-eval"],
                 "corrupt safetensors header", None, id="merge-corrupt-safetensors"),
    pytest.param(["merge", "--method", "ties", "--base", "{base}", "--vlm", "{truncated}", "--out", "{out}/m", "--no-eval"],
                 "truncated", None, id="merge-truncated-shard"),
    pytest.param(["merge", "--method", "ties", "--base", "{missing}", "--vlm", "{vlm}", "--out", "{out}/m", "--no-eval"],
                 "missing shard", None, id="merge-missing-shard"),
    # non-UTF-8 text files, named
    pytest.param(["run", "{study_latin1}", "--out", "{out}/run"], "latin1.yaml is not UTF-8", None, id="non-utf8-study"),
    pytest.param([*SWEEP, "--sweep", "{latin1}"], "latin1.txt is not UTF-8", None, id="non-utf8-sweep-config"),
    pytest.param([*MERGE[:-1], "--method", "linear", "--captions", "{latin1}"], "latin1.txt is not UTF-8", None, id="non-utf8-captions"),
    pytest.param(["sink", "{base}", "--calibration", "{latin1}", "--out", "{out}/s"], "latin1.txt is not UTF-8", None, id="non-utf8-sink-texts"),
    pytest.param(["mitigate", "--base", "{base}", "--vlm", "{vlm}", "--calibration", "{latin1}", "--out", "{out}/m", "--no-eval"],
                 "latin1.txt is not UTF-8", None, id="non-utf8-mitigate-texts"),
    pytest.param([*EVAL, "--data", "sinkstudy_gsm={latin1}"], "latin1.txt is not UTF-8", None, id="non-utf8-eval-data"),
    # a full disk, mid-merge and before it
    pytest.param([*MERGE, "--method", "linear"], "disk is full", lambda mp: mp.setattr("interventions.merge._run_mergekit", _no_space),
                 id="disk-full-while-writing"),
    pytest.param([*MERGE, "--method", "linear"], "not enough disk", _little_disk, id="disk-too-small"),
    # numbers
    pytest.param([*EVAL, "--limit", "nan"], "--limit", None, id="eval-limit-nan"),
    pytest.param([*EVAL, "--limit", "0"], "--limit", None, id="eval-limit-0"),
    pytest.param([*EVAL, "--limit", "-3"], "--limit", None, id="eval-limit-negative"),
    pytest.param([*EVAL, "--limit", "2.5"], "--limit", None, id="eval-limit-fractional-count"),
    pytest.param([*MERGE[:-1], "--method", "linear", "--limit", "0"], "--limit", None, id="merge-limit-0-before-merging"),
    pytest.param(["compare", "{run}", "{run}", "--n-boot", "0"], "--n-boot", None, id="compare-n-boot-0"),
    pytest.param([*SWEEP, "--n-boot", "0"], "--n-boot", None, id="sweep-n-boot-0"),
    pytest.param(["compare", "{run}", "{run}", "--tasks", "nosuch"], "no task nosuch", None, id="compare-unknown-task"),
    pytest.param([*SWEEP, "--max-points", "-1"], "--max-points", None, id="sweep-max-points-negative"),
    pytest.param([*SWEEP, "--max-points", "0"], "--max-points", None, id="sweep-max-points-0"),
    pytest.param(["eval", "{base}", "--tasks", "nosuch_task", "--out", "{out}/eval"], "unknown task 'nosuch_task'", None, id="eval-unknown-task"),
    # architectures the sink pass does not support (the stats branch)
    pytest.param(["sink", "{gpt2}", "--out", "{out}/s"], "gpt2", None, id="sink-gpt2"),
    pytest.param(["sink", "{gpt_neox}", "--out", "{out}/s"], "gpt_neox", None, id="sink-gpt-neox"),
    # vLLM requested where it is not installed
    pytest.param([*EVAL, "--backend", "vllm"], "vllm package", None, id="vllm-not-installed"),
    # every numeric setting, before any work
    pytest.param([*MERGE, "--method", "tsv", "--weight", "nan"], "--weight", None, id="tsv-weight-nan"),
    pytest.param([*MERGE, "--method", "tsv", "--param", "alpha=.nan"], "finite", None, id="tsv-alpha-nan"),
    pytest.param([*MERGE, "--method", "star", "--param", "lambda=.inf"], "finite", None, id="star-lambda-inf"),
    pytest.param([*MERGE, "--method", "star", "--eta", "0"], "eta", None, id="star-eta-0"),
    pytest.param([*MERGE, "--method", "ties", "--density", "2"], "density", None, id="ties-density-2"),
    pytest.param([*MERGE, "--method", "linear", "--weight", "1.5"], "weight", None, id="linear-weight-1.5"),
    pytest.param([*MERGE, "--method", "breadcrumbs", "--param", "gamma=1"], "gamma", None, id="breadcrumbs-gamma-1"),
    pytest.param(["mitigate", "--base", "{base}", "--vlm", "{vlm}", "--out", "{out}/m", "--no-eval", "--param", "min_loss=.nan"],
                 "min_loss", None, id="head-restore-min-loss-nan"),
    pytest.param(["mitigate", "--base", "{base}", "--vlm", "{vlm}", "--out", "{out}/m", "--no-eval", "--top-k", "0"],
                 "--top-k", None, id="head-restore-top-k-0"),
    # --root with linear / slerp
    pytest.param([*MERGE, "--method", "slerp", "--root", "{base}"], "takes no --root", None, id="slerp-with-root"),
    # names that would leave the output directory
    pytest.param(["run", "{study_backbone}", "--out", "{out}/run"], "backbones[0].name", None, id="study-backbone-escape"),
    pytest.param([*SWEEP, "--sweep", "{sweep_escape}"], "point name", None, id="sweep-point-escape"),
    pytest.param(["run", "{study_collision}", "--out", "{out}/run"], "would both write", None, id="study-output-collision"),
    # a study config is validated completely when loaded
    pytest.param(["run", "{study_density}", "--out", "{out}/run"], "density", None, id="study-density-2"),
    pytest.param(["run", "{study_task}", "--out", "{out}/run"], "unknown task 'nosuch_task'", None, id="study-unknown-task"),
    pytest.param(["run", "{study_mitigation}", "--out", "{out}/run"], "unknown method 'no_such_mitigation'", None, id="study-unknown-mitigation"),
    pytest.param(["run", "{study_path}", "--out", "{out}/run"], "does not exist", None, id="study-missing-model"),
    pytest.param(["run", "{study_data}", "--out", "{out}/run"], "no.jsonl does not exist", None, id="study-missing-data-file"),
    pytest.param([*EVAL, "--data", "sinkstudy_gsm={out}/no.jsonl"], "no.jsonl", None, id="eval-missing-data-file"),
    # a device this torch cannot run on: one line, not CUDA's assertion or torch's list of device types
    pytest.param(["sink", "{base}", "--device", "cuda", "--out", "{out}/s"], "--device cuda", None, id="sink-device-cuda-without-cuda"),
    pytest.param([*EVAL, "--device", "cuda"], "--device cuda", None, id="eval-device-cuda-without-cuda"),
    pytest.param(["sink", "{base}", "--device", "gpu", "--out", "{out}/s"], "--device gpu: not a device", None, id="sink-device-gpu"),
    # an output where a file is (a directory goes there, or the file's folder would have to be one)
    pytest.param(["sink", "{base}", "--out", "{out}/precious.txt"], "is a file", None, id="sink-out-is-a-file"),
    pytest.param(["dose", "{base}", "--scale", "1.5", "--out", "{out}/precious.txt"], "is a file", None, id="dose-out-is-a-file"),
    pytest.param([*MERGE[:-2], "{out}/precious.txt", "--no-eval", "--method", "linear"], "is a file", None, id="merge-out-is-a-file"),
    pytest.param([*EVAL[:-1], "{out}/precious.txt", "--force"], "is a file", None, id="eval-force-out-is-a-file"),
    pytest.param(["run", "{study_ok}", "--out", "{out}/precious.txt"], "is a file", None, id="study-out-is-a-file"),
    pytest.param(["compare", "{run}", "{run}", "--json", "{out}/precious.txt/x.json"], "is a file", None, id="compare-json-under-a-file"),
    # --force replaces only the command's own earlier result, never a folder or file it did not write
    pytest.param([*EVAL[:-1], "{out}/merged", "--force"], "did not write (no results.json)", None, id="eval-force-foreign-dir"),
    pytest.param(["sink", "{base}", "--out", "{out}/merged", "--force"], "did not write", None, id="sink-force-foreign-dir"),
    pytest.param([*MERGE[:-2], "{out}/merged", "--no-eval", "--method", "linear", "--force"], "did not write", None,
                 id="merge-force-foreign-dir"),
    pytest.param(["pair", "extract", "--base", "{base}", "--vlm", "{vlm}", "--out", "{out}/merged", "--force"], "did not write", None,
                 id="extract-force-foreign-dir"),
    pytest.param(["run", "{study_ok}", "--out", "{out}/merged", "--force"], "did not write", None, id="study-force-foreign-dir"),
    pytest.param(["compare", "{run}", "{run}", "--json", "{out}/precious.txt", "--force"], "not a JSON file", None,
                 id="compare-force-foreign-file"),
    pytest.param(["pair", "diff", "--base", "{base}", "--vlm", "{vlm}", "--json", "{out}/precious.txt", "--force"], "not a JSON file",
                 None, id="diff-force-foreign-file"),
    # a summary written by another version (keys missing): one line, the old report left as it was
    pytest.param(["report", "{bad_summary}"], "not a summary this version can render", None, id="report-summary-missing-keys"),
]


@pytest.mark.parametrize("argv, needle, patch", ROWS)
def test_bad_input_is_one_line_exit_2_and_writes_nothing(argv, needle, patch, inputs, tmp_path, monkeypatch, capsys):
    from experiments.cli import main

    if needle == "vllm package" and __import__("importlib").util.find_spec("vllm") is not None:
        pytest.skip("vllm is installed here")
    if needle == "--device cuda" and __import__("torch").cuda.is_available():
        pytest.skip("a CUDA device is visible here")
    work = tmp_path / "work"
    (work / "out" / "merged").mkdir(parents=True)
    (work / "out" / "merged" / "keep.txt").write_text("an earlier result")  # must survive every row
    (work / "out" / "precious.txt").write_text("a file of the user's")  # and this one
    monkeypatch.chdir(work)  # default outputs (runs/...) land in the hashed tree too
    if patch:
        patch(monkeypatch)
    paths = {k: str(v) for k, v in inputs.items()} | {"out": str(work / "out")}
    before = _tree(work)
    try:
        rc = main([a.format(**paths) for a in argv])
    except SystemExit as exc:  # argparse
        rc = exc.code
    captured = capsys.readouterr()
    err = captured.err
    # The message is one line and the only output: refused before any work (no model loaded, no progress bar).
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2, err
    assert len(lines) == 1 and "error:" in lines[0] and "Traceback" not in err, err
    assert captured.out == "", captured.out
    assert needle in lines[0], lines[0]
    assert _tree(work) == before


def test_the_table_covers_every_item_11_input():
    ids = {p.id for p in ROWS}
    for required in ("truncated-shard", "missing-shard", "corrupt-safetensors", "non-utf8-study", "disk-full-while-writing",
                     "eval-limit-nan", "eval-limit-0", "eval-limit-negative", "compare-n-boot-0", "compare-unknown-task",
                     "sweep-max-points-negative", "sink-gpt2", "sink-gpt-neox", "vllm-not-installed"):
        assert required in ids


def test_disk_full_message_names_the_file_and_leaves_no_temporary(inputs, tmp_path, monkeypatch, capsys):
    from experiments.cli import main

    monkeypatch.setattr("interventions.merge._run_mergekit", _no_space)
    out = tmp_path / "m"
    assert main(["merge", "--method", "linear", "--base", str(inputs["base"]), "--vlm", str(inputs["vlm"]), "--out", str(out),
                 "--no-eval"]) == 2
    err = capsys.readouterr().err
    assert "model-00002-of-00002.safetensors" in err and "rerun" in err
    assert list(tmp_path.iterdir()) == []
    json.dumps(err)  # plain text
