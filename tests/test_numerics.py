"""The reproducible numeric mode (sinkstudy/numerics.py): a study gives the same numbers whatever kernels the
CPU would pick. One machine stands in for two: its native settings, and a machine without AVX2 and FMA as far
as environment variables can make one (ATen's baseline kernels, MKL and oneDNN capped at AVX, glibc's libm
without its FMA variants). In the reproducible mode the smallest study that pretrains, VL-trains, merges,
measures S and evaluates gives the same weights and summary under both; in the native mode the same pair of
settings already gives other pretrained weights (so the comparison can fail)."""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from sinkstudy import SinkstudyError, numerics

ROOT = Path(__file__).resolve().parent.parent
NO_AVX2 = {"ATEN_CPU_CAPABILITY": "default", "MKL_ENABLE_INSTRUCTIONS": "AVX", "ONEDNN_MAX_CPU_ISA": "AVX",
           "GLIBC_TUNABLES": "glibc.cpu.hwcaps=-AVX2,-FMA"}


def test_the_mode_comes_from_the_flag_then_the_environment_then_the_command(monkeypatch):
    monkeypatch.delenv(numerics.ENV, raising=False)
    assert numerics.requested(None, "reproducible") == "reproducible"
    monkeypatch.setenv(numerics.ENV, "native")
    assert numerics.requested(None, "reproducible") == "native"
    assert numerics.requested("reproducible", "native") == "reproducible"
    monkeypatch.setenv(numerics.ENV, "fast")
    with pytest.raises(SinkstudyError, match="SINKSTUDY_NUMERICS='fast'.*reproducible, native") as err:
        numerics.requested(None, "native")
    assert "\n" not in str(err.value)


def test_numeric_modes_parse_as_one_or_a_distinct_list_and_bad_ones_fail_in_one_line(capsys):
    from experiments.cli import main

    assert numerics.path_list("native") == ["native"]
    assert numerics.path_list("native, native-aten-default") == ["native", "native-aten-default"]
    for bad, needle in (("fast", "unknown numeric mode 'fast'"), ("native,native", "each numeric mode once"), (",", "unknown")):
        with pytest.raises(ValueError, match=needle):
            numerics.path_list(bad)
    with pytest.raises(SystemExit) as exited:  # argparse's exit, with its one line
        main(["demo", "--quick", "--numerics", "native,native", "--out", "never-made"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "each numeric mode once" in err and not Path("never-made").exists()


def test_a_spread_refuses_seeds_and_a_plan_in_one_line_before_any_work(capsys, tmp_path):
    from experiments.cli import main

    out = tmp_path / "out"
    assert main(["demo", "--quick", "--numerics", "native,native-aten-default", "--seeds", "0,1", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "spread one of the two at a time" in err and not out.exists()
    config = ROOT / "experiments" / "configs" / "demo.yaml"
    assert main(["run", str(config), "--numerics", "native,native-aten-default", "--plan", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "one --numerics mode" in err and not out.exists()


def test_a_child_in_another_mode_starts_without_this_modes_variables():
    parent = numerics.pinned_environment({"HOME": "/h", "GLIBC_TUNABLES": "glibc.malloc.arena_max=2", "ONEDNN_MAX_CPU_ISA": "AVX"})
    native = numerics.environment_for("native", parent)
    assert not (set(numerics.PINNED_ENV) - {"GLIBC_TUNABLES"}) & set(native)
    assert native["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2" and native["HOME"] == "/h" and native[numerics.ENV] == "native"
    assert native["ONEDNN_MAX_CPU_ISA"] == "AVX"  # the user's own setting, which no mode sets, stays
    aten = numerics.environment_for("native-aten-default", parent)
    assert aten["ATEN_CPU_CAPABILITY"] == "default" and "MKL_CBWR" not in aten and aten[numerics.ENV] == "native-aten-default"
    assert numerics.environment_for("reproducible", native) == numerics.pinned_environment(
        {k: v for k, v in native.items() if k != numerics.ENV})


def test_the_pinned_environment_keeps_the_users_other_glibc_tunables():
    env = numerics.pinned_environment({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.cpu.hwcaps=-AVX512F",
                                       "ATEN_CPU_CAPABILITY": "avx512", "HOME": "/h"})
    assert env["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2:glibc.cpu.hwcaps=-AVX2,-FMA,-FMA4"
    assert env["ATEN_CPU_CAPABILITY"] == "default" and env["HOME"] == "/h" and env[numerics.ENV] == "reproducible"


def test_a_process_started_without_the_mode_cannot_enter_it_in_place(capsys):
    """torch is loaded here: the CLI called in-process refuses in one line, before any work."""
    from experiments.cli import main

    with pytest.raises(SinkstudyError, match="set when a process starts"):
        numerics.enter("reproducible", reexec=True)
    assert main(["demo", "--quick", "--numerics", "reproducible", "--out", "never-made"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--numerics native" in err and not Path("never-made").exists()


def _probe(env: dict) -> dict:
    code = ("import json, numpy as np, torch; from sinkstudy import numerics, provenance; numerics.configure_torch(); "
            "x = torch.linspace(0.1, 9.0, 4099)[::3]; "
            "h = provenance.hardware(); print(json.dumps({'id': numerics.identity(), 'code': provenance.code_version(provenance.__file__), "
            "'threads': torch.get_num_threads(), 'onednn': torch.backends.mkldnn.enabled, 'cap': torch.backends.cpu.get_cpu_capability(), "
            "'line': provenance.describe_hardware(h), 'sqrt_numpy': int((x.sqrt() != torch.from_numpy(np.sqrt(x.numpy()))).sum())}))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=ROOT, check=True)
    return json.loads(out.stdout)


def _shell() -> dict:
    """The environment a process started from this shell gets, in the native mode: whatever kernel variables the
    shell presets stay (a machine may set OPENBLAS_CORETYPE for every process); a pinned shell's are dropped."""
    env = {k: v for k, v in os.environ.items() if k != numerics.ENV}
    return numerics.environment_for("native", env) if numerics._pinned(env) else env


def _check_identities() -> None:
    base = _shell()
    native, pinned = _probe(base), _probe(numerics.pinned_environment(base))
    assert native["id"] == numerics.native_identity(base) and pinned["id"] == numerics.REPRODUCIBLE_ID
    assert native["code"] != pinned["code"]  # a result computed in one mode is never reused in the other
    assert (pinned["threads"], pinned["onednn"], pinned["cap"]) == (1, False, "DEFAULT")
    # torch's sqrt is numpy's, IEEE's correctly rounded one (MKL's vector math's bits follow the hardware)
    assert pinned["sqrt_numpy"] == 0
    assert f"numeric mode {numerics.REPRODUCIBLE_ID}" in pinned["line"] and "MKL_CBWR" not in pinned["line"]
    assert f"numeric mode {native['id']}" in native["line"]
    # another kernel choice in the native mode is another identity, so another key
    aten_env = {**base, **numerics.NATIVE_PATHS["native-aten-default"], numerics.ENV: "native-aten-default"}
    aten = _probe(aten_env)
    assert aten["id"] == numerics.native_identity(aten_env) and "[ATEN_CPU_CAPABILITY=default]" in aten["id"]
    assert aten["cap"] == "DEFAULT" and len({native["code"], pinned["code"], aten["code"]}) == 3


def test_the_mode_is_in_every_result_key_and_names_itself_in_the_hardware_line():
    _check_identities()


def test_the_identity_checks_hold_whatever_kernel_variables_the_shell_presets(monkeypatch):
    """Some hosts export OPENBLAS_CORETYPE machine-wide: a native process started there names it in its identity
    (other kernels, other numbers), the reproducible mode pins it over, and the checks expect what they derive."""
    monkeypatch.setenv("OPENBLAS_CORETYPE", "Haswell")
    assert numerics.native_identity(_shell()) == "native[OPENBLAS_CORETYPE=Haswell]"
    _check_identities()


# ------------------------------------------------------------------------------------------- end to end

def _config(path: Path) -> Path:
    """The demo, shrunk to one backbone and a few steps of each stage, with one merge."""
    from experiments.cli.cmd_study import DEMO_CONFIG
    from experiments.demo.build import quick_overrides
    from experiments.study.schema import deep_merge

    raw = yaml.safe_load(DEMO_CONFIG.read_text())
    quick = quick_overrides(raw)
    quick["build"]["backbones"] = [dict(b, steps=4, hidden_size=32, seq_len=64, batch_size=4) for b in quick["build"]["backbones"] if b["name"] == "qwen3"]
    config = deep_merge(deep_merge(raw, quick), {
        "build": {"corpus": {"train_records": 200, "heldout_ifeval": 3, "heldout_gsm": 2}, "pretrain": {"curve_every": 2},
                  "vl": {"heldout_images": 10, "stage1": {"steps": 2, "batch_size": 4}, "stage2": {"steps": 2, "batch_size": 4},
                         "trajectory_every": 2}},
        "evals": {"max_gen_toks": 8, "n_boot": 100},
        "interventions": [{"name": "linear", "method": "linear", "params": {"weight": 0.5}}]})
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def _start(out: Path, extra_env: dict, code: str, *args: str) -> subprocess.Popen:
    """A process running `code` with a sinkstudy cache of its own (the step store would otherwise hand the second
    run the first one's results)."""
    cache = out.parent / f"{out.name}-cache"
    cache.mkdir(parents=True)
    (cache / "lm-eval-index").symlink_to(Path(os.environ["SINKSTUDY_CACHE"]) / "lm-eval-index")  # built once (conftest)
    env = {**{k: v for k, v in os.environ.items() if k != numerics.ENV}, **extra_env, "SINKSTUDY_CACHE": str(cache)}
    return subprocess.Popen([sys.executable, *code.split(), *args], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


# `sinkstudy demo` as a command: the way into the reproducible mode (it restarts itself with the mode's environment)
DEMO = "-m experiments.cli demo --numerics reproducible --jobs 1 --quiet --config"
# the native mode's control, up to the pretrained backbone: the steps one by one, in one process on one thread
PRETRAIN = ["-c", "import sys, torch; from experiments.demo.study import load_study; from experiments.study.runner import run_step; "
            "torch.set_num_threads(1); study = load_study(sys.argv[1], out=sys.argv[2]); "
            "[run_step(study, s, progress=False) for s in ('build/corpus', 'build/tokenizer', 'build/pretrain/qwen3')]"]


def _finish(proc: subprocess.Popen) -> None:
    output, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, output[-3000:]


def _weights(out: Path) -> dict[str, str]:
    return {str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(out.rglob("*.safetensors"))}


def _numbers(out: Path) -> dict:
    """summary.json without what is allowed to differ: wall times and the machine settings that computed it."""
    summary = json.loads((out / "summary.json").read_text())
    summary.pop("timings")
    hardware = summary.pop("hardware")
    return json.loads(json.dumps(summary).replace(str(out), "OUT")), hardware


@pytest.mark.slow(seconds=100)
def test_the_reproducible_mode_gives_the_same_study_on_two_isa_levels_and_the_native_mode_does_not(tmp_path):
    config = _config(tmp_path / "study.yaml")
    runs = {level: _start(tmp_path / f"reproducible-{level}", env, DEMO, str(config), "--out", str(tmp_path / f"reproducible-{level}"))
            for level, env in (("native", {}), ("no-avx2", NO_AVX2))}
    for proc in runs.values():
        _finish(proc)
    one, two = tmp_path / "reproducible-native", tmp_path / "reproducible-no-avx2"
    weights = _weights(one)
    assert {"models/qwen3-base/model.safetensors", "models/qwen3-vlm/model.safetensors"} <= set(weights)
    assert any("linear" in name for name in weights)  # the merge ran
    assert weights == _weights(two)
    (numbers, hw_one), (other, hw_two) = _numbers(one), _numbers(two)
    assert numbers["pairs"]["qwen3"]["models"]["base"]["sink_strength"] == other["pairs"]["qwen3"]["models"]["base"]["sink_strength"]
    assert numbers == other
    assert {h["numerics"] for h in hw_one + hw_two} == {numerics.REPRODUCIBLE_ID}
    assert hw_one != hw_two  # the runs did see different settings (MKL_ENABLE_INSTRUCTIONS, ONEDNN_MAX_CPU_ISA)

    # The negative control: the native mode, the same two settings, up to the pretrained backbone.
    controls = {level: tmp_path / f"native-{level}" for level in ("native", "no-avx2")}
    procs = [_start(controls[level], env, "", *PRETRAIN, str(config), str(controls[level]))
             for level, env in (("native", {}), ("no-avx2", NO_AVX2))]
    for proc in procs:
        _finish(proc)
    base = "models/qwen3-base/model.safetensors"
    assert _weights(controls["native"])[base] != _weights(controls["no-avx2"])[base]


@pytest.mark.slow(seconds=70)
def test_a_study_on_two_numeric_modes_runs_each_in_its_own_mode_and_reports_the_spread(tmp_path):
    config = _config(tmp_path / "study.yaml")
    out = tmp_path / "spread"
    _finish(_start(out, {}, "-m experiments.cli demo --jobs 1 --quiet --numerics native,native-aten-default --config",
                   str(config), "--out", str(out)))
    other = out / "numerics" / "native-aten-default"
    summary = json.loads((out / "summary.json").read_text())
    section = summary["numerics_spread"]
    assert section["paths"] == ["native", "native-aten-default"] and section["runs"]["native-aten-default"]["out"] == str(other)
    started = {k: v for k, v in os.environ.items() if k != numerics.ENV}  # as _start hands it on
    assert {h["numerics"] for h in summary["hardware"]} == {numerics.native_identity(started)}
    assert {h["numerics"] for h in json.loads((other / "summary.json").read_text())["hardware"]} == {
        numerics.native_identity(numerics.environment_for("native-aten-default", started))}
    base = "models/qwen3-base/model.safetensors"
    assert _weights(out)[base] != _weights(other)[base]  # the second mode computed its own, other weights
    report = (out / "report.md").read_text()
    assert "## Across numeric modes" in report and "native-aten-default computed as native[ATEN_CPU_CAPABILITY=default]" in report
