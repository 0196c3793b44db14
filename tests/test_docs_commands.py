"""README.md's and docs/*.md's command examples match the real CLI and Makefile.

Every `sinkstudy ...` (or `-m experiments.cli ...`) command in a shell code block, in a comment of
one, or in inline code, is checked against `experiments.cli.build_parser()`: its sub-command exists
and each option it names is one of that sub-command's options. A concrete line (no synopsis
notation: `[...]`, `A|B`, `...`) is parsed in full by argparse, with the block's own shell
variables expanded, as `sinkstudy` would parse it (values too: numbers, choices, required options).
Every `make X` names a Makefile target, and each `VAR=` it sets is read by the Makefile."""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import itertools
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

from experiments.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_BLOCKS = {"", "bash", "sh", "shell", "console"}
CLI = re.compile(r"(?:^|[\s=;&|(`])(?:sinkstudy|-m experiments\.cli)\s+(?=[a-z-])")
MAKE = re.compile(r"(?:^|[\s;&|(`])make\s+(?=[a-z])")
SYNOPSIS = re.compile(r"[\[\]]|\.\.\.|(?<=\S)\|(?=\S)|\s\|\s")


@dataclass
class Command:
    where: str  # file:line
    text: str  # from `sinkstudy`/`make` on, one logical line
    variables: dict  # the code block's shell variables, for concrete lines
    prose: bool = False  # from a comment or inline code: may name a command without its arguments

    def __str__(self) -> str:
        return f"{self.where}: {self.text}"


def _split_comment(line: str) -> tuple[str, str]:
    """(code, comment) of a shell line: the first `#` outside quotes that starts a word."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i], line[i + 1:]
    return line, ""


def _logical(lines: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """Backslash continuations joined; a synopsis line that starts with `[` continues the last one."""
    out, pending = [], None
    for number, text in lines:
        stripped = text.strip()
        if pending is not None:
            pending = (pending[0], pending[1] + " " + stripped)
        elif stripped.startswith("[") and out:
            out[-1] = (out[-1][0], out[-1][1] + " " + stripped)
            continue
        else:
            pending = (number, stripped)
        if pending[1].endswith("\\"):
            pending = (pending[0], pending[1][:-1].rstrip())
            continue
        out.append(pending)
        pending = None
    if pending is not None:
        out.append(pending)
    return out


def _variables(code_lines: list[str]) -> dict:
    """`NAME=value` and `NAME=(words)` assignments of a block, expanded in order."""
    found: dict = {}
    text = "\n".join(line for line in code_lines if not (CLI.search(line) or MAKE.search(line)))
    for m in re.finditer(r"(?:^|\s)([A-Z][A-Z0-9_]*)=(\((?:[^()]|'[^']*')*\)|\S+)", text):  # an array may span lines
        value = _expand(m.group(2), found)
        found[m.group(1)] = shlex.split(value[1:-1]) if value.startswith("(") else value
    return found


def _expand(text: str, variables: dict) -> str:
    def one(m):
        value = variables.get(m.group(1) or m.group(2))
        if value is None:
            return m.group(0)
        return " ".join(shlex.quote(v) for v in value) if isinstance(value, list) else value

    text = re.sub(r'"\$\{([A-Z_0-9]+)\[@\]\}"()', one, text)  # "${ARRAY[@]}": its words (group 2 empty)
    return re.sub(r"\$\{([A-Z_0-9]+)\}|\$([A-Z_0-9]+)", one, text)


def _commands() -> tuple[list[Command], list[Command]]:
    cli, make = [], []

    def take(where: str, text: str, variables: dict, prose: bool = False):
        """prose: a comment or inline code, where a sentence may go on after the command."""
        for m in CLI.finditer(text):
            # the command ends at a comment, a redirection, the next command; in prose also at `: `
            rest = re.split(r"\s#|\s>\s|\s&&\s|;\s" + (r"|:(?:\s|$)" if prose else ""), text[m.end():])[0]
            cli.append(Command(where, "sinkstudy " + rest.strip(), variables, prose))
        for m in MAKE.finditer(text):
            rest = re.split(r"\s#|;\s|\s&&\s", text[m.end():])[0].strip()
            if prose:  # the target, then the variables set right after it
                words = rest.split()
                rest = " ".join(words[:1] + list(itertools.takewhile(lambda w: "=" in w, words[1:])))
            make.append(Command(where, "make " + rest, variables, prose))

    for doc in DOCS:
        name = doc.relative_to(ROOT)
        lines = doc.read_text(encoding="utf-8").splitlines()
        block, language = None, None
        for number, line in enumerate(lines, 1):
            fence = re.match(r"\s*```(\w*)", line)
            if fence:
                if block is None:
                    block, language = [], fence.group(1)
                else:
                    if language in SHELL_BLOCKS:
                        codes = [(n, _split_comment(t)[0]) for n, t in block]
                        comments = [(n, _split_comment(t)[1]) for n, t in block]
                        variables = _variables([t for _, t in _logical(codes)])
                        for n, t in _logical(codes):
                            take(f"{name}:{n}", t, variables)
                        for n, t in _logical(comments):
                            take(f"{name}:{n}", t, {}, prose=True)
                    block = None
                continue
            if block is not None:
                block.append((number, line))
            else:
                for m in re.finditer(r"`([^`]+)`", line):
                    take(f"{name}:{number}", m.group(1), {}, prose=True)
    return cli, make


CLI_COMMANDS, MAKE_COMMANDS = _commands()


def _subparsers(parser: argparse.ArgumentParser) -> dict:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices
    return {}


def _resolve(tokens: list[str]) -> tuple[argparse.ArgumentParser, list[str], list[str]]:
    """(the sub-command's parser, its path, the tokens after it)."""
    parser, path = _parser(), []
    while tokens and tokens[0] in _subparsers(parser):
        parser = _subparsers(parser)[tokens[0]]
        path.append(tokens.pop(0))
    return parser, path, tokens


@functools.cache
def _parser() -> argparse.ArgumentParser:
    return build_parser()


def cli_problem(command: Command) -> str | None:
    """What is wrong with a documented `sinkstudy` command, or None."""
    text = _expand(command.text, command.variables)
    synopsis = command.prose or bool(SYNOPSIS.search(text))  # prose may name a command without its arguments
    if SYNOPSIS.search(text):  # [--opt X] (--a | --b): the options and values inside
        text = re.sub(r"[\[\]()]", " ", text)
    tokens = shlex.split(text)[1:]
    parser, path, rest = _resolve(list(tokens))
    if not path:
        return f"no such sub-command {rest[:1]} (sinkstudy -h lists them)"
    if _subparsers(parser):
        known = ", ".join(_subparsers(parser))
        if rest and not rest[0].startswith("-"):
            return f"`sinkstudy {' '.join(path)}` has no sub-command {rest[0]} (it has {known})"
        return f"`sinkstudy {' '.join(path)}` needs a sub-command: {known}"
    by_name = {o: a for a in parser._actions for o in a.option_strings}
    for i, token in enumerate(rest):
        if not token.startswith("-") or re.fullmatch(r"-\d.*", token):
            continue
        for name in re.split(r"/(?=-)", token.split("=")[0]):  # --eval/--no-eval: both
            if name not in by_name:
                return f"`sinkstudy {' '.join(path)}` has no option {name}"
        choices = by_name[name].choices
        value = rest[i + 1] if i + 1 < len(rest) else ""
        if choices and value and not value.startswith("-") and not re.fullmatch(r"[A-Z_]+|\.\.\.", value):
            bad = [v for v in value.split("|") if v not in choices]
            if bad:
                return f"`sinkstudy {' '.join(path)} {name}` takes {', '.join(map(str, choices))}, not {', '.join(bad)}"
    if synopsis or "$" in text:
        return None
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            _parser().parse_args(tokens)
        except SystemExit as exc:
            return err.getvalue().strip() or f"argparse exit {exc.code}"
    return None


def _makefile() -> tuple[set, str]:
    text = (ROOT / "Makefile").read_text()
    return set(re.findall(r"^([a-zA-Z][\w.-]*)\s*:(?!=)", text, re.M)), text


@functools.cache
def _target_vars() -> dict[str, set[str]]:
    from test_make import target_vars  # the lists make's own check reads

    return target_vars()


def make_problem(command: Command) -> str | None:
    """What is wrong with a documented `make` command, or None."""
    targets, makefile = _makefile()
    for alternative in re.split(r"\s\|\s", command.text.removeprefix("make ")):  # make a | b | c VAR=...
        words = shlex.split(alternative.replace("[", " ").replace("]", " "))
        names = [w for w in words if "=" not in w and not w.startswith("-")]
        missing = [n for n in names if n not in targets]
        if not names or missing:
            return f"no Makefile target {missing or names} (make help lists them)"
        for var in (w.split("=")[0] for w in words if "=" in w):
            if not re.search(rf"\$[({{]{var}[)}}]", makefile):
                return f"the Makefile never reads {var}"
            refusing = [n for n in names if var not in _target_vars()[n]]
            if refusing:
                return f"make {' '.join(refusing)} does not take {var} (make refuses it)"
    return None


def test_the_docs_show_commands_at_all():
    # the extraction itself: a regression here would silently check nothing
    assert len(CLI_COMMANDS) > 60 and len(MAKE_COMMANDS) > 40
    texts = [c.text for c in CLI_COMMANDS]
    assert any(t.startswith("sinkstudy pair extract --base Qwen/Qwen3-8B") for t in texts)
    assert any(t.startswith("sinkstudy adapt --base Qwen/Qwen2.5-3B-Instruct --donor") for t in texts)  # accelerate -m
    assert any("--out runs/adapt/qwen2-base --resume" in t for t in texts)  # a command continued inside comments
    assert sum(not c.prose and not SYNOPSIS.search(_expand(c.text, c.variables)) for c in CLI_COMMANDS) > 20  # parsed in full


@pytest.mark.parametrize("text, problem", [
    ("sinkstudy pair extrct --base B", "`sinkstudy pair` has no sub-command extrct (it has extract, diff)"),
    ("sinkstudy evaluate M", "no such sub-command ['evaluate']"),
    ("sinkstudy pair", "`sinkstudy pair` needs a sub-command: extract, diff"),
    ("sinkstudy eval M --tasks ifeval --no-such-flag", "`sinkstudy eval` has no option --no-such-flag"),
    ("sinkstudy merge --method ties --base B --vlm V [--eval/--no-evaluation]", "`sinkstudy merge` has no option --no-evaluation"),
    ("sinkstudy sink M [--capture fast|slow]", "`sinkstudy sink --capture` takes fast, eager, not slow"),
    ("sinkstudy eval M --tasks ifeval --batch-size 0", "batch"),
    ("sinkstudy eval --tasks ifeval", "required"),
])
def test_a_wrong_command_is_caught(text, problem):
    found = cli_problem(Command("doc:1", text, {}))
    assert found is not None and problem in found


def test_a_wrong_make_line_is_caught():
    assert make_problem(Command("doc:1", "make no-such-target", {})) == "no Makefile target ['no-such-target'] (make help lists them)"
    assert make_problem(Command("doc:1", "make sink NO_SUCH_VAR=1", {})) == "the Makefile never reads NO_SUCH_VAR"
    assert make_problem(Command("doc:1", "make sink MODEL=m", {})) is None
    assert make_problem(Command("doc:1", "make merge-linear NAME=x", {})) == "make merge-linear does not take NAME (make refuses it)"


@pytest.mark.parametrize("command", CLI_COMMANDS, ids=str)
def test_sinkstudy_command_matches_the_cli(command):
    problem = cli_problem(command)
    assert problem is None, f"{command}: {problem}"


@pytest.mark.parametrize("command", MAKE_COMMANDS, ids=str)
def test_make_command_names_a_target_and_its_variables(command):
    problem = make_problem(command)
    assert problem is None, f"{command}: {problem}"


def test_the_docs_point_only_at_files_of_the_repository():
    """Users have the repository and nothing beside it: every relative link of README.md and docs/*.md names a file
    in it, and no path in the text climbs out of it (`../x`, from the repository root)."""
    root = ROOT.resolve()
    problems = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = doc.read_text()
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:|#", target):
                continue
            path = (doc.parent / target.split("#")[0]).resolve()
            if not path.exists() or root not in (path, *path.parents):
                problems.append(f"{doc.name}: link {target}")
        problems += [f"{doc.name}: {m}" for m in re.findall(r"`\.\./[A-Za-z_][^`]*`", text)]
    assert not problems, problems


def test_the_docs_state_current_facts_without_issue_numbers_or_the_history_of_fixes():
    """Users read the docs without the project's tracker or history: no issue numbers, no 'before / after the fix'."""
    history = re.compile(r"\bissues? ?#?\d|(?<![\w&/])#\d+\b|\b(before|after) the fix\b|\bused to (be|say|print|give|take)\b", re.I)
    problems = [f"{doc.name}:{n}: {line.strip()[:80]}" for doc in DOCS
                for n, line in enumerate(doc.read_text().splitlines(), 1) if history.search(line)]
    assert not problems, problems


def test_the_readmes_paper_tasks_run_at_their_own_generation_caps():
    """`make eval TASKS=ifeval,gsm8k_cot,bbh_cot_fewshot` is "the paper's tasks" only at each task's own cap: the
    default 256 tokens cuts gsm8k_cot's and bbh_cot_fewshot's chains of thought."""
    lines = [line for line in (ROOT / "README.md").read_text().splitlines() if "TASKS=ifeval,gsm8k_cot,bbh_cot_fewshot" in line]
    assert lines and all("--max-gen-toks 0" in line for line in lines)


def test_measured_times_say_when_on_which_cpu_and_in_which_mode():
    """A newcomer read "about 40 min" (14 min on a newer CPU) and "5 to 6 minutes" (12 to 15 on the same machines):
    each figure now says what measured it, or that it was not re-measured."""
    readme = (ROOT / "README.md").read_text()
    assert "about 40 min" not in readme and "5 to 6 minutes" not in readme
    table = readme[readme.index("How long things take"):].split("\n\n")[1].splitlines()
    assert "AMD EPYC" in table[0] and "newer CPU" in table[0]
    assert all("mode" in row for row in table[2:]) and "not re-measured" in readme
    study = (ROOT / "docs" / "study.md").read_text()
    assert "builds six tiny pairs" in study and "three tiny pairs" not in study and "With two pairs (`--quick`)" not in study
    assert "in the native numeric mode, then the default" in study and "it has 105 now" in study
    assert "qwen2.5-coder-0.5b-instruct (a 490 MB extra)" in readme
