"""Threads that do not fight: every command that computes takes --threads, defaulting to the cores no other
sinkstudy process claims; OpenMP's idle threads sleep (OMP_WAIT_POLICY=PASSIVE, set before torch loads); the
count and the policy are in every result's provenance."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sinkstudy import threads

ROOT = Path(__file__).resolve().parent.parent
NOT_COMPUTING = {"report", "paper-table", "clean"}  # they render or list what is already computed


def test_every_command_that_computes_takes_threads_and_a_numeric_mode():
    from test_cli_options import commands

    for name, parser in commands():
        takes = {opt for a in parser._actions for opt in a.option_strings}
        if name not in NOT_COMPUTING:
            assert {"--threads", "--numerics"} <= takes, f"sinkstudy {name}"


def test_the_default_is_the_cores_no_other_sinkstudy_process_claims(monkeypatch, tmp_path):
    monkeypatch.setenv("SINKSTUDY_CACHE", str(tmp_path))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "usable_cores", lambda: 4)
    assert threads.default_threads() == 4
    claims = tmp_path / "threads"
    claims.mkdir()
    host = __import__("socket").gethostname()
    (claims / f"{host}-{os.getppid()}").write_text("1\n")  # a live process: a study's worker
    (claims / f"other-host-{os.getppid()}").write_text("2\n")  # another machine sharing the cache: not this one's cores
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=60)
    (claims / f"{host}-{dead.pid}").write_text("2\n")  # a killed process's claim: ignored, removed
    assert threads.default_threads() == 3 and not (claims / f"{host}-{dead.pid}").exists()
    threads.claim(2)  # this process's own claim is not another's
    assert threads.default_threads() == 3 and (claims / f"{host}-{os.getpid()}").read_text() == "2\n"
    threads.release()
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # the user's choice wins
    assert threads.default_threads() == 2


def test_a_command_computes_on_its_threads_and_records_them(tmp_path, tokenizer, capsys, own_cache):
    """The thread count is how a step ran, not what it computes (no key of it): a step store of its own, so this run
    is computed here, never reused from another test's."""
    import torch

    from experiments.cli import main
    from sinkstudy.tiny import tiny_causal_lm

    model = tmp_path / "m"
    tiny_causal_lm("qwen2").save_pretrained(model)
    tokenizer.save_pretrained(model)
    capsys.readouterr()
    assert main(["sink", str(model), "--out", str(tmp_path / "s"), "--threads", "2", "--quiet"]) == 0
    assert torch.get_num_threads() == 2 and os.environ["OMP_NUM_THREADS"] == "2"
    record = json.loads((tmp_path / "s" / "steps" / "sink" / "run.json").read_text())
    assert record["provenance"]["hardware"]["threads"]["intra_op"] == 2
    assert main(["sink", str(model), "--threads", "2", "--numerics", "reproducible", "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "reproducible numeric mode computes on one thread" in err
    assert main(["sink", str(model), "--numerics", "native,native-aten-default", "--out", str(tmp_path / "r")]) == 2
    assert "several are for a study" in capsys.readouterr().err and not (tmp_path / "r").exists()


@pytest.mark.slow(seconds=20)
def test_idle_threads_sleep_from_the_start(tmp_path, tokenizer, own_cache):
    """OMP_WAIT_POLICY is read when OpenMP loads (with torch): the command sets it before, and says so."""
    from sinkstudy.tiny import tiny_causal_lm

    model = tmp_path / "m"
    tiny_causal_lm("qwen2").save_pretrained(model)
    tokenizer.save_pretrained(model)
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS")}
    env["PYTHONPATH"] = str(ROOT)
    subprocess.run([sys.executable, "-m", "experiments.cli", "sink", str(model), "--out", str(tmp_path / "s"), "--quiet",
                    "--numerics", "native"], env=env, cwd=tmp_path, check=True, capture_output=True, timeout=300)
    hardware = json.loads((tmp_path / "s" / "steps" / "sink" / "run.json").read_text())["provenance"]["hardware"]
    assert hardware["threads"]["wait_policy"] == "PASSIVE" and hardware["threads"]["intra_op"] >= 1
    assert hardware["env"]["OMP_NUM_THREADS"] == str(hardware["threads"]["intra_op"])


def test_a_studys_workers_start_with_their_own_thread_count(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    for k in ("MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        monkeypatch.delenv(k, raising=False)
    with threads.for_children(1):
        assert {os.environ[k] for k in threads.COUNT_ENV} == {"1"}
    assert os.environ["OMP_NUM_THREADS"] == "4" and "MKL_NUM_THREADS" not in os.environ  # the parent's own, back
