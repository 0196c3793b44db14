"""The shared infrastructure: atomic outputs, provenance, tiny builders, CLI front door."""

import json
import os
import subprocess
import sys

import pytest
import torch

from sinkstudy import SinkstudyError
from sinkstudy.io import atomic_output_dir, write_json_atomic
from sinkstudy.provenance import checkpoint_fingerprint, provenance, state_dict_fingerprint
from sinkstudy.tiny import tiny_causal_lm


def test_atomic_output_dir_refuses_existing_and_keeps_it_on_failure(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("old")
    with pytest.raises(SinkstudyError, match="already exists"):
        with atomic_output_dir(out):
            pass
    with pytest.raises(RuntimeError):
        with atomic_output_dir(out, replace=True) as tmp:
            (tmp / "new.txt").write_text("new")
            raise RuntimeError("boom")
    assert (out / "keep.txt").read_text() == "old"
    assert not (out / "new.txt").exists()
    with atomic_output_dir(out, replace=True) as tmp:
        (tmp / "new.txt").write_text("new")
    assert (out / "new.txt").read_text() == "new" and not (out / "keep.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temp dirs left behind


def test_json_atomic_roundtrip_with_tensors(tmp_path):
    path = write_json_atomic(tmp_path / "r.json", {"x": torch.tensor([1.5, 2.0]), "p": tmp_path})
    assert json.loads(path.read_text())["x"] == [1.5, 2.0]


def test_tokenizer_adds_bos_and_chat_template_roundtrips(tokenizer, tokenizer_dir):
    from transformers import AutoTokenizer

    ids = tokenizer("hello world")["input_ids"]
    assert ids[0] == tokenizer.bos_token_id
    reloaded = AutoTokenizer.from_pretrained(tokenizer_dir)
    assert reloaded("hello world")["input_ids"] == ids
    text = reloaded.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|bos|><|user|>") and text.endswith("<|assistant|>\n")


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "gemma3_text", "olmo2"])
def test_tiny_families_build_and_fingerprint_changes_with_weights(family, tmp_path):
    model = tiny_causal_lm(family, seed=0)
    fp = state_dict_fingerprint(model)
    assert fp == state_dict_fingerprint(tiny_causal_lm(family, seed=0))
    assert fp != state_dict_fingerprint(tiny_causal_lm(family, seed=1))
    model.save_pretrained(tmp_path)
    assert checkpoint_fingerprint(tmp_path) == checkpoint_fingerprint(tmp_path)


def test_provenance_lists_versions():
    prov = provenance(seed=3)
    assert prov["seed"] == 3 and prov["versions"]["torch"] and prov["versions"]["transformers"].startswith("5.")


def test_provenance_names_the_hardware_and_torch_settings_that_computed_a_result(tmp_path, monkeypatch):
    """CPU model and the ISA flags that select kernels, torch's threads (read at each call), its kernel level and
    math libraries (as torch reports them), variables that change them; the distinct ones across records, one line."""
    from sinkstudy.provenance import describe_hardware, recorded_hardware

    hw = provenance()["hardware"]
    cpuinfo = open("/proc/cpuinfo").read() if os.path.isfile("/proc/cpuinfo") else ""
    if "model name" in cpuinfo:
        assert hw["cpu"] == cpuinfo.split("model name")[1].split(":", 1)[1].splitlines()[0].strip()
        flags = set(cpuinfo.split("\nflags")[1].split(":", 1)[1].splitlines()[0].split())
        assert set(hw["cpu_flags"]) == flags & {"avx", "avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "sse4_2", "f16c",
                                                  "avx512bw", "avx512vl", "avx512_vnni", "avx512_fp16", "avx_vnni",
                                                  "amx_tile", "amx_int8", "amx_fp16"}
    t = hw["torch"]
    assert (t["threads"], t["interop_threads"]) == (torch.get_num_threads(), torch.get_num_interop_threads())
    assert t["cpu_capability"] == torch.backends.cpu.get_cpu_capability() and t["cpu_capability"] in torch.__config__.show()
    assert t["blas"] and f"BLAS_INFO={t['blas']}" in torch.__config__.show()
    assert (t["onednn"] is not None) is torch.backends.mkldnn.is_available()
    assert (hw["cuda"] is None) is (not torch.cuda.is_available())
    torch.set_num_threads(t["threads"] + 1)  # threads are read live (the suite restores them)
    monkeypatch.setenv("MKL_CBWR", "COMPATIBLE")
    other = provenance()["hardware"]
    assert other["torch"]["threads"] == t["threads"] + 1 and other["env"] == {**hw["env"], "MKL_CBWR": "COMPATIBLE"}

    for name, h in (("a", hw), ("b", other), ("c", hw)):
        (tmp_path / f"{name}.json").write_text(json.dumps({"result": 1, "provenance": {"hardware": h}}))
    (tmp_path / "d.json").write_text("{not json")
    assert recorded_hardware(tmp_path.glob("*.json")) == [hw, other]
    line = describe_hardware([hw, other])
    assert "\n" not in line and line.count(" | ") == 1 and f"{t['threads'] + 1} thread(s)" in line and "MKL_CBWR=COMPATIBLE" in line
    assert describe_hardware(None) == "not recorded"


def test_cli_help_lists_commands():
    out = subprocess.run([sys.executable, "-m", "experiments.cli", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "sinkstudy" in out.stdout


def test_failed_atomic_write_keeps_old_file_and_no_temp(tmp_path):
    from sinkstudy.io import write_text_atomic

    from sinkstudy.io import atomic_file

    target = write_text_atomic(tmp_path / "a.json", "old")
    with pytest.raises(RuntimeError):
        with atomic_file(target) as tmp:
            tmp.write_text("half-written")
            raise RuntimeError("interrupted")
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["a.json"]
    assert target.stat().st_mode & 0o044  # readable by group/others under the default umask


def test_json_is_strict_nan_becomes_null(tmp_path):
    import numpy as np

    path = write_json_atomic(tmp_path / "r.json", {"rel": float("nan"), "arr": np.array([1.0, np.inf]), "ok": 0.5})
    assert json.loads(path.read_text(), parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}")) == {
        "rel": None, "arr": [1.0, None], "ok": 0.5}
