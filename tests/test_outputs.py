"""Deletions stay inside the run, one writer per output, killed runs leave nothing behind for long and
outputs follow the umask, on real processes and real checkpoints."""

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from sinkstudy import SinkstudyError


def _code_root() -> str:
    import sinkstudy

    return str(Path(sinkstudy.__file__).resolve().parent.parent)  # the code under test


def _spawn(script: str, *args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": _code_root()}
    return subprocess.Popen([sys.executable, "-c", script, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


HOLD_LOCK = """
import sys
from sinkstudy.io import output_lock
with output_lock(sys.argv[1]):
    print("locked", flush=True)
    sys.stdin.read()
"""

KILLED_WRITER = """
import sys, time
from sinkstudy.io import atomic_output_dir
with atomic_output_dir(sys.argv[1]) as tmp:
    (tmp / "half-written.safetensors").write_bytes(b"x" * 1000)
    print(tmp, flush=True)
    time.sleep(600)
"""


@pytest.fixture(scope="module")
def pair(tmp_path_factory, tokenizer):
    from sinkstudy.tiny import tiny_causal_lm
    from tests.test_merge import _perturbed, _save_model

    d = tmp_path_factory.mktemp("outputs_pair")
    base = tiny_causal_lm("qwen2", seed=0)
    return {"base": _save_model(base, tokenizer, d / "base"), "vlm": _save_model(_perturbed(base, 6), tokenizer, d / "vlm")}


def test_a_second_writer_fails_at_once_naming_the_other_pid(pair, tmp_path, capsys):
    from experiments.cli import main
    from sinkstudy.io import atomic_output_dir

    out = tmp_path / "merged"
    holder = _spawn(HOLD_LOCK, str(out))
    try:
        assert holder.stdout.readline().strip() == "locked"
        merge = ["merge", "--method", "linear", "--base", str(pair["base"]), "--vlm", str(pair["vlm"]), "--out", str(out), "--no-eval"]
        assert main(merge) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"pid {holder.pid}" in err and str(out) in err
        assert main(["eval", str(pair["base"]), "--tasks", "sinkstudy_gsm", "--out", str(out)]) == 2
        assert f"pid {holder.pid}" in capsys.readouterr().err
        with pytest.raises(SinkstudyError, match=f"pid {holder.pid}"):
            with atomic_output_dir(out):
                pass
        assert not out.exists()
    finally:
        holder.communicate("", timeout=60)
    assert main(merge) == 0 and (out / "model" / "model.safetensors").is_file()  # the lock went with its holder
    assert not list(tmp_path.glob(".*"))  # no lock file or temporary left


def test_a_killed_writer_leaves_nothing_after_the_next_write_or_clean(tmp_path, capsys):
    from experiments.cli import main
    from sinkstudy.io import write_json_atomic

    parent = tmp_path / "runs" / "x"
    parent.mkdir(parents=True)
    stale = []
    for name in ("model", "other"):
        writer = _spawn(KILLED_WRITER, str(parent / name))
        tmp = Path(writer.stdout.readline().strip())
        os.kill(writer.pid, signal.SIGKILL)
        writer.communicate(timeout=60)
        assert tmp.is_dir() and tmp.name.startswith(f".{name}.tmp-{writer.pid}-")
        stale.append(tmp)
    mine = parent / f".live.tmp-{os.getpid()}-abc123"  # a live writer's temp dir stays
    mine.mkdir()
    write_json_atomic(parent / "result.json", {"ok": True})  # the next atomic write into the same parent
    assert not any(p.exists() for p in stale) and mine.is_dir()
    assert sorted(p.name for p in parent.iterdir() if not p.name.startswith(".live")) == ["result.json"]

    deep = tmp_path / "runs" / "a" / "b"
    deep.mkdir(parents=True)
    writer = _spawn(KILLED_WRITER, str(deep / "ckpt"))
    tmp = Path(writer.stdout.readline().strip())
    os.kill(writer.pid, signal.SIGKILL)
    writer.communicate(timeout=60)
    assert main(["clean", str(tmp_path / "runs")]) == 0
    assert not tmp.exists() and mine.is_dir() and "removed" in capsys.readouterr().out
    # --no-print-directory: under a parent make (CI runs `make test`) make -n would print "Entering directory" first
    dry = subprocess.run(["make", "-n", "--no-print-directory", "clean"], cwd=_code_root(),
                         capture_output=True, text=True, env={k: v for k, v in os.environ.items()
                                                              if not k.startswith("MAKE")})
    assert " clean" in dry.stdout.splitlines()[0]  # make clean runs `sinkstudy clean` first


@pytest.mark.parametrize("umask", [0o022, 0o002])
def test_outputs_follow_the_umask_safetensors_included(tmp_path, umask):
    from sinkstudy.io import atomic_output_dir, write_json_atomic
    from sinkstudy.tiny import tiny_causal_lm

    old = os.umask(umask)
    try:
        with atomic_output_dir(tmp_path / "ckpt") as tmp:
            tiny_causal_lm("qwen2").save_pretrained(tmp)  # safetensors itself writes 0600
        write_json_atomic(tmp_path / "r.json", {})
    finally:
        os.umask(old)
    for f in [*(tmp_path / "ckpt").iterdir(), tmp_path / "r.json"]:
        assert f.stat().st_mode & 0o777 == 0o666 & ~umask, f.name
    assert (tmp_path / "ckpt").stat().st_mode & 0o777 == 0o777 & ~umask


def test_deletions_stay_inside_the_run_directory(pair, tmp_path, monkeypatch, capsys):
    from experiments.cli import main
    from sinkstudy.io import remove_tree

    run = tmp_path / "run"
    (run / "models" / "x").mkdir(parents=True)
    outside = tmp_path / "precious"
    outside.mkdir()
    for target in (run / "models" / ".." / ".." / "precious", run, outside):
        with pytest.raises(SinkstudyError, match="refusing to delete"):
            remove_tree(target, within=run)
    link = run / "models" / "link"
    link.symlink_to(outside)  # resolved before the check: a link out of the run is outside
    with pytest.raises(SinkstudyError, match="refusing to delete"):
        remove_tree(link, within=run)
    remove_tree(run / "models" / "x", within=run)
    assert outside.is_dir() and not (run / "models" / "x").exists()
    # --force never replaces a directory that holds the working directory (the model goes to OUT/model).
    work = tmp_path / "work" / "model"
    work.mkdir(parents=True)
    (work / "keep.txt").write_text("mine")
    monkeypatch.chdir(work)
    assert main(["merge", "--method", "linear", "--base", str(pair["base"]), "--vlm", str(pair["vlm"]),
                 "--out", "..", "--force", "--no-eval"]) == 2
    assert "refusing to delete" in capsys.readouterr().err and (work / "keep.txt").read_text() == "mine"


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=60)
    return proc.pid


def test_the_rerun_of_a_killed_writer_removes_its_temporary(pair, tmp_path, capsys):
    """A killed `merge` left OUT/.model.tmp-*: the rerun writes OUT/model holding that output's lock, and removes the
    dead writer's temporary; a rerun that reuses every step removes any other one."""
    from experiments.cli import main
    from sinkstudy.io import atomic_output_dir

    out = tmp_path / "m" / "model"
    out.parent.mkdir()
    writer = _spawn(KILLED_WRITER, str(out))
    tmp = Path(writer.stdout.readline().strip())
    os.kill(writer.pid, signal.SIGKILL)
    writer.communicate(timeout=60)
    with atomic_output_dir(out) as new:
        (new / "weights").write_text("whole")
    assert not tmp.exists() and (out / "weights").read_text() == "whole"

    run = tmp_path / "s"
    assert main(["sink", str(pair["base"]), "--out", str(run), "--quiet"]) == 0
    left = run / f".sink.json.tmp-{_dead_pid()}-abc123"
    left.write_text("half")
    assert main(["sink", str(pair["base"]), "--out", str(run), "--quiet"]) == 0
    assert "reused sink/run" in capsys.readouterr().out and not left.exists()


def test_force_replaces_only_the_commands_own_earlier_result(pair, tmp_path, capsys):
    """--force has one meaning: make again and replace what an earlier run of the same command left; a folder another
    command made, or a user's file, is refused whatever --force says, and a file beside the result survives."""
    import json

    from experiments.cli import main

    out = tmp_path / "s"
    sink = ["sink", str(pair["base"]), "--out", str(out), "--quiet"]
    assert main(sink) == 0
    (out / "notes.txt").write_text("mine")
    assert main([*sink, "--metric", "mass"]) == 2 and "made by another request" in capsys.readouterr().err
    assert main([*sink, "--metric", "mass", "--force"]) == 0
    assert json.loads((out / "sink.json").read_text())["metric"] == "mass" and (out / "notes.txt").read_text() == "mine"
    capsys.readouterr()
    assert main(["dose", str(pair["base"]), "--scale", "1.5", "--out", str(out), "--force"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "did not write" in err and "steps/dose/run.json" in err
    assert main(["eval", str(pair["base"]), "--out", str(out / "notes.txt"), "--force"]) == 2
    assert "is a file" in capsys.readouterr().err and (out / "notes.txt").read_text() == "mine"


SLOW_COMMAND = """
import sys, time
import experiments.cli.cmd_clean as clean
from experiments.cli import main

def slow(args):
    print("working", flush=True)
    time.sleep(600)

clean.run_clean = slow
sys.exit(main(["clean"]))
"""


def test_ctrl_c_on_a_running_command_is_one_line_and_exit_130():
    proc = subprocess.Popen([sys.executable, "-c", SLOW_COMMAND], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": _code_root()}, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert proc.stdout.readline().strip() == "working"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and err.count("\n") == 1 and err.startswith("sinkstudy: interrupted"), err


def test_ctrl_c_is_one_line_and_exit_130(monkeypatch, capsys):
    import experiments.cli.cmd_clean as clean
    from experiments.cli import main

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(clean, "run_clean", interrupted)
    assert main(["clean"]) == 130
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "interrupted" in err and "Traceback" not in err


def test_an_output_is_replaceable_only_when_absent_empty_or_the_commands_own(tmp_path):
    from sinkstudy.io import OutputExistsError, check_replaceable

    def mine(p):
        return None if (p / "record.json").is_file() else "no record.json"

    assert check_replaceable(tmp_path / "new" / "out", True, not_mine=mine) == tmp_path / "new" / "out"
    (tmp_path / "empty" / "steps" / "sink").mkdir(parents=True)  # what a killed run leaves: folders, locks, temporaries
    (tmp_path / "empty" / "steps" / "sink" / ".run.json.lock").write_text("")
    (tmp_path / "empty" / ".sink.json.tmp-1-abc").write_text("")
    check_replaceable(tmp_path / "empty", True, not_mine=mine)
    (tmp_path / "own").mkdir()
    (tmp_path / "own" / "record.json").write_text("{}")
    check_replaceable(tmp_path / "own", True, not_mine=mine)
    (tmp_path / "user").mkdir()
    (tmp_path / "user" / "notes.txt").write_text("mine")
    (tmp_path / "file.txt").write_text("mine")
    for path, kw, needle in ((tmp_path / "user", {}, "did not write (no record.json)"),
                             (tmp_path / "file.txt", {}, "is a file, not a directory"),
                             (tmp_path / "file.txt" / "x.json", {"directory": False}, "is a file, not a directory"),
                             (tmp_path / "own", {"directory": False, "flag": "--json"}, "--json"),
                             (tmp_path / "own", {"directory": False}, "is a directory, not a file")):
        with pytest.raises(OutputExistsError, match=re.escape(needle)):
            check_replaceable(path, True, not_mine=mine, **kw)
    assert (tmp_path / "user" / "notes.txt").read_text() == "mine" and (tmp_path / "file.txt").read_text() == "mine"
