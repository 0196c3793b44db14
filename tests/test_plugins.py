"""Plug-ins from outside the package: a file by path, a module by name, the `sinkstudy.plugins`
entry-point group (a temporary dist-info on sys.path); reloading an edited file; one-line errors;
`--plugin` on the commands. (A plug-in running in a study, and editing it rerunning exactly its
steps: tests/test_protect_study.py.)"""

import sys
import textwrap

import pytest

from sinkstudy.plugins import PluginError, load_entry_points, load_plugin, source_hash

SOURCE = textwrap.dedent('''
    from interventions.mitigations import register_mitigation
    from interventions.protect import Protection, register_protection

    GAIN = {gain}


    @register_protection("{name}", defaults={{"gain": GAIN}})
    class Plugged(Protection):
        """A protection from outside the package."""


    @register_mitigation("{name}_mitigation", defaults={{"gain": GAIN}})
    def plugged(base, vlm_lm, sink_maps, config):
        """A mitigation from outside the package."""
        return vlm_lm
''')


def _write(path, name, gain=1.0):
    path.write_text(SOURCE.format(name=name, gain=gain))
    return path


def _forget(name):
    from interventions import mitigations, protect

    protect._REGISTRY.pop(name, None)
    mitigations._REGISTRY.pop(f"{name}_mitigation", None)


def test_a_file_by_path_registers_both_kinds_and_reloads_when_edited(tmp_path):
    from interventions.mitigations import get_mitigation, source_hash as mitigation_hash
    from interventions.protect import get_protection, make_protection

    name = "test_plugin_by_path"
    try:
        path = _write(tmp_path / "my_plugin.py", name, 1.0)
        plugin = load_plugin(str(path))
        assert plugin.path == str(path.resolve()) and plugin.source == source_hash(sys.modules[plugin.module])
        assert make_protection(name).config["gain"] == 1.0
        first = mitigation_hash(get_mitigation(f"{name}_mitigation"))
        assert first == plugin.source  # the one identity: the file's hash
        assert load_plugin(str(path)) is plugin  # unchanged file: not imported again
        _write(path, name, 2.0)
        again = load_plugin(str(path))  # edited: executed again, re-registration accepted
        assert again.source != plugin.source and make_protection(name).config["gain"] == 2.0
        assert mitigation_hash(get_mitigation(f"{name}_mitigation")) == again.source != first
        assert get_protection(name).cls.__module__ == again.module
    finally:
        _forget(name)


def test_a_module_by_name_and_relative_to_a_base_dir(tmp_path, monkeypatch):
    from interventions.protect import list_protections

    name = "test_plugin_by_module"
    try:
        _write(tmp_path / "sinkstudy_test_mod_plugin.py", name)
        monkeypatch.syspath_prepend(str(tmp_path))
        plugin = load_plugin("sinkstudy_test_mod_plugin")
        assert plugin.module == "sinkstudy_test_mod_plugin" and name in list_protections()
        other = tmp_path / "configs"
        other.mkdir()
        _write(tmp_path / "configs" / "rel_plugin.py", name + "_rel")
        assert load_plugin("rel_plugin.py", base_dir=other).path == str((other / "rel_plugin.py").resolve())
    finally:
        _forget(name)
        _forget(name + "_rel")
        sys.modules.pop("sinkstudy_test_mod_plugin", None)


def test_an_entry_point_from_a_dist_info_on_sys_path(tmp_path, monkeypatch):
    from interventions.mitigations import list_mitigations
    from interventions.protect import list_protections

    name = "test_plugin_entry_point"
    try:
        _write(tmp_path / "sinkstudy_test_ep_plugin.py", name)
        info = tmp_path / "sinkstudy_test_ep-0.1.dist-info"
        info.mkdir()
        (info / "METADATA").write_text("Metadata-Version: 2.1\nName: sinkstudy-test-ep\nVersion: 0.1\n")
        (info / "entry_points.txt").write_text("[sinkstudy.plugins]\nmy_ideas = sinkstudy_test_ep_plugin\n")
        monkeypatch.syspath_prepend(str(tmp_path))
        loaded = load_entry_points()
        assert [p.ref for p in loaded] == ["entry point my_ideas"] and loaded[0].path.endswith("sinkstudy_test_ep_plugin.py")
        assert name in list_protections() and f"{name}_mitigation" in list_mitigations()
        assert load_entry_points() == []  # each entry point once per process
    finally:
        _forget(name)
        sys.modules.pop("sinkstudy_test_ep_plugin", None)


def test_bad_plugins_fail_in_one_line(tmp_path):
    (tmp_path / "broken.py").write_text("raise RuntimeError('boom')\n")
    (tmp_path / "notes.txt").write_text("x")
    for ref, needle in [(str(tmp_path / "missing.py"), "plug-in file not found"),
                        ("no_such_sinkstudy_module", "no such file or importable module"),
                        (str(tmp_path / "broken.py"), "failed to load: RuntimeError: boom"),
                        (str(tmp_path / "notes.txt"), "is not a .py file")]:
        with pytest.raises(PluginError, match=needle) as err:
            load_plugin(ref)
        assert "\n" not in str(err.value)
    _write(tmp_path / "dup.py", "sink_head_freeze")  # a name the package already registered
    with pytest.raises(PluginError, match="'sink_head_freeze' is already registered: it ships with sinkstudy") as err:
        load_plugin(str(tmp_path / "dup.py"))
    assert "\n" not in str(err.value)


TAKERS = {  # a plug-in that registers a shipped name, of each kind
    "protection": ("sink_head_freeze", "interventions.protect", "get_protection",
                   "from interventions.protect import Protection, register_protection\n\n\n"
                   "@register_protection('sink_head_freeze')\nclass Taken(Protection):\n    pass\n"),
    "mitigation": ("head_restore", "interventions.mitigations", "get_mitigation",
                   "from interventions.mitigations import register_mitigation\n\n\n"
                   "@register_mitigation('head_restore')\ndef taken(base, vlm_lm, sink_maps, config):\n    return vlm_lm\n"),
}


def test_a_plugin_loaded_first_in_a_fresh_process_cannot_take_a_shipped_name(tmp_path):
    """Whatever the order of imports: a plug-in loaded before anything listed the registries (so
    before the package's own modules registered) is refused in one line, and the shipped entry stays."""
    import subprocess

    code = "from sinkstudy.plugins import PluginError, load_plugin\n"
    for kind, (name, package, getter, source) in TAKERS.items():
        (tmp_path / f"{kind}.py").write_text(source)
        code += textwrap.dedent(f"""
            try:
                load_plugin({str(tmp_path / f"{kind}.py")!r})
            except PluginError as exc:
                print(exc)
            from {package} import {getter}
            entry = {getter}({name!r})
            print((getattr(entry, "fn", None) or entry.cls).__module__)
        """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 2 * len(TAKERS)
    for (kind, (name, package, _, _)), refusal, owner in zip(TAKERS.items(), lines[::2], lines[1::2]):
        assert f"{kind} {name!r} is already registered: it ships with sinkstudy" in refusal
        assert owner.startswith(package + ".")


def test_plugin_option_on_the_commands(tmp_path, capsys):
    from experiments.cli import main

    name = "test_plugin_cli"
    try:
        path = _write(tmp_path / "cli_plugin.py", name)
        assert main(["mitigate", "--plugin", str(path), "--list"]) == 0
        assert f"{name}_mitigation" in capsys.readouterr().out
        assert main(["adapt", "--base", "b", "--tiny-vision", "--plugin", str(path), "--protect", "list"]) == 0
        assert name in capsys.readouterr().out
        assert main(["adapt", "--base", "b", "--tiny-vision", "--plugin", str(tmp_path / "nope.py")]) == 2
        assert "plug-in file not found" in capsys.readouterr().err
    finally:
        _forget(name)


def test_the_worked_example_in_docs_runs_as_a_plugin(tmp_path, tokenizer):
    """docs/protect.md's example, loaded as a plug-in file: factor 0 keeps the sink heads' rows bit-identical."""
    import copy
    import json
    import re
    from pathlib import Path

    import torch

    from interventions.adapt import adapt, from_dict
    from interventions.pairs import load_causal_lm
    from interventions.protect import _REGISTRY, make_protection
    from sinkstudy.tiny import tiny_causal_lm

    doc = (Path(__file__).resolve().parent.parent / "docs" / "protect.md").read_text()
    code = re.search(r"## A worked example.*?```python\n(.*?)```", doc, re.S).group(1)
    assert 35 <= len(code.strip().splitlines()) <= 60  # a new idea in ~50 lines
    (tmp_path / "my_protection.py").write_text(code)
    try:
        load_plugin(str(tmp_path / "my_protection.py"))
        base = tiny_causal_lm("qwen2", vocab_size=len(tokenizer))
        chats = tmp_path / "chats.jsonl"
        chats.write_text("\n".join(json.dumps({"user": f"Add {i} and 2.", "assistant": f"{i + 2}."}) for i in range(12)))
        cfg = from_dict({"precision": "fp32", "stages": [{"name": "text", "data": [str(chats)], "trainable": ["lm"], "steps": 2,
                                                          "batch_size": 2, "micro_batch_size": 2, "lr": 1e-2, "weight_decay": 0.1}]})
        hook = make_protection("sink_head_slow_lr", {"heads": [[1, 3]], "factor": 0.0})
        report = adapt(copy.deepcopy(base), tokenizer=tokenizer, config=cfg, out=tmp_path / "run", hooks=[hook], progress=False)
        trained, _ = load_causal_lm(report["model"])
        a, b = base.model.layers[1].self_attn, trained.model.layers[1].self_attn
        assert torch.equal(a.q_proj.weight[48:64], b.q_proj.weight[48:64]) and torch.equal(a.k_proj.weight[16:32], b.k_proj.weight[16:32])
        assert not torch.equal(a.q_proj.weight[:48], b.q_proj.weight[:48])
        assert report["stages"][0]["hooks"]["sink_head_slow_lr"]["row_blocks"] == 2
    finally:
        _REGISTRY.pop("sink_head_slow_lr", None)
