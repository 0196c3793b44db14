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


def test_a_plugin_loaded_before_the_shipped_modules_cannot_take_a_shipped_name(tmp_path, monkeypatch):
    """Whatever the order of imports: a plug-in that registers before anything listed the registry (so
    before the package's own modules registered) is refused in one line and the shipped entry stays.
    On a package made for the test, so that its modules are imported for the first time here."""
    from sinkstudy import SinkstudyError

    package = tmp_path / "sinkstudy_test_shipping"
    package.mkdir()
    (package / "__init__.py").write_text(textwrap.dedent("""
        from sinkstudy.plugins import Registry
        from sinkstudy import SinkstudyError

        REGISTRY = Registry("idea", __name__, SinkstudyError, key=lambda fn: fn)

        def register(name):
            def wrap(fn):
                REGISTRY.add(name, fn)
                return fn
            return wrap
    """))
    (package / "shipped.py").write_text("from . import register\n\n\n@register('shared')\ndef shipped():\n    pass\n")
    (tmp_path / "taker.py").write_text("from sinkstudy_test_shipping import register\n\n\n@register('shared')\ndef taken():\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        import sinkstudy_test_shipping as shipping

        assert "sinkstudy_test_shipping.shipped" not in sys.modules  # nothing has listed the registry yet
        with pytest.raises(PluginError, match="idea 'shared' is already registered: it ships with sinkstudy "
                                              r"\(sinkstudy_test_shipping.shipped\)") as err:
            load_plugin(str(tmp_path / "taker.py"))
        assert "\n" not in str(err.value)
        assert shipping.REGISTRY.get("shared").__module__ == "sinkstudy_test_shipping.shipped"
        with pytest.raises(SinkstudyError, match="unknown idea 'taken'"):
            shipping.REGISTRY.get("taken")
    finally:
        for name in [m for m in sys.modules if m.startswith("sinkstudy_test_shipping")]:
            del sys.modules[name]


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


def test_isolated_forgets_what_a_block_loaded_and_loading_again_registers_again(tmp_path):
    """The suite's per-test reset (tests/conftest.py): names, loaded files and their modules go, shipped names stay."""
    from interventions.mitigations import list_mitigations
    from interventions.protect import list_protections
    from sinkstudy import plugins

    shipped = (set(list_protections()), set(list_mitigations()))
    path = _write(tmp_path / "isolated_plugin.py", "test_plugin_isolated")
    for _ in range(2):
        with plugins.isolated():
            plugin = load_plugin(str(path))
            assert "test_plugin_isolated" in list_protections() and "test_plugin_isolated_mitigation" in list_mitigations()
        assert (set(list_protections()), set(list_mitigations())) == shipped
        assert plugin.module not in sys.modules and plugin not in plugins.loaded_plugins()
