"""One option vocabulary. Every sub-command's parser is walked: a flag name has one
meaning (action, destination, value type, default, choices, arity) on every command that takes it;
a command that runs lm-eval takes the shared groups whole (evals, model loading, output and
caching); every command takes --quiet."""

import argparse

import pytest

from experiments.cli import build_parser

EVAL_GROUP = {"--tasks", "--limit", "--max-gen-toks", "--batch-size", "--no-chat-template", "--data", "--backend", "--backend-args",
              "--chat-template-kwargs", "--system-instruction", "--gen-kwargs", "--num-fewshot", "--confirm-run-unsafe-code"}
MODEL_GROUP = {"--dtype", "--device", "--tokenizer"}
OUTPUT_GROUP = {"--out", "--force", "--no-cache", "--cache-dir"}
# A lower bound: the commands that run lm-eval themselves (the classification below must find them).
EVALUATING = {"eval", "merge", "mitigate", "merge-sweep", "qknorm"}
# Flags only the eval group defines: a command taking one of them runs lm-eval.
EVAL_ONLY = EVAL_GROUP - {"--tasks", "--limit"}


def commands(parser=None, prefix=()):
    """(name, parser) of every leaf sub-command, e.g. ("pair extract", ...)."""
    parser = parser or build_parser()
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield " ".join(prefix), parser
        return
    for name, sub in subs[0].choices.items():
        yield from commands(sub, (*prefix, name))


def meaning(action) -> tuple:
    """What a flag does, independent of its help text (types compared by name: a factory makes one per command)."""
    kind = action.type
    return (type(action).__name__, action.dest, None if kind is None else f"{kind.__module__}.{kind.__name__}",
            repr(action.default), tuple(action.choices) if action.choices else None, action.nargs, repr(action.const),
            action.required)


def flags(parser) -> dict[str, argparse.Action]:
    return {opt: a for a in parser._actions for opt in a.option_strings if opt.startswith("--") and opt not in ("--help",)}


def test_the_walk_finds_every_command():
    names = {name for name, _ in commands()}
    assert EVALUATING | {"sink", "adapt", "compare", "run", "demo", "paper", "paper-table", "clean", "pair extract", "pair diff"} <= names


def test_one_flag_one_meaning_on_every_command():
    seen: dict[str, tuple[str, tuple]] = {}
    clashes = []
    for name, parser in commands():
        for opt, action in flags(parser).items():
            m = meaning(action)
            first = seen.setdefault(opt, (name, m))
            if first[1] != m:
                clashes.append(f"{opt}: `{first[0]}` {first[1]} vs `{name}` {m}")
    assert not clashes, "\n".join(clashes)


def test_commands_that_evaluate_take_the_shared_groups_whole():
    evaluating = set()
    for name, parser in commands():
        takes = set(flags(parser))
        if takes & EVAL_ONLY:
            evaluating.add(name)
            lacks = (EVAL_GROUP | MODEL_GROUP | OUTPUT_GROUP | {"--quiet", "--seed"}) - takes
            assert not lacks, f"sinkstudy {name} evaluates but lacks {', '.join(sorted(lacks))}"
    assert EVALUATING <= evaluating, f"not taking the eval group: {EVALUATING - evaluating}"


def test_every_command_takes_quiet_and_study_commands_take_the_overrides():
    parsers = dict(commands())
    for name, parser in parsers.items():
        assert "--quiet" in flags(parser), f"sinkstudy {name} has no --quiet"
    for name in ("run", "paper"):
        assert {"--limit", "--tasks", "--device", "--dtype", "--out", "--force"} <= set(flags(parsers[name])), name


def test_training_options_are_named_as_such():
    """qknorm and adapt name their training settings --train-*; the bare names keep eval's meaning."""
    parsers = dict(commands())
    for name in ("adapt", "qknorm"):
        takes = flags(parsers[name])
        assert {"--train-data", "--train-steps", "--recipe"} <= set(takes), name
        assert takes.get("--data") is None or takes["--data"].dest == "eval_data"
    assert {"--train-lr", "--train-batch-size", "--train-seq-len"} <= set(flags(parsers["qknorm"]))
    assert flags(parsers["qknorm"])["--batch-size"].dest == flags(parsers["eval"])["--batch-size"].dest


@pytest.mark.parametrize("argv", [["mitigate", "--list"], ["adapt", "--protect", "list"]])
def test_listing_needs_no_models(argv, capsys):
    """`mitigate --list` and `adapt --protect list` work alone, as listings should."""
    from experiments.cli import main

    assert main(argv) == 0
    assert "head_restore" in capsys.readouterr().out if argv[0] == "mitigate" else True


@pytest.mark.parametrize("command, needs", [("merge --method linear", "needs --base and --vlm"), ("mitigate --vlm V", "needs --base"),
                                            ("merge-sweep", "needs --base"), ("pair diff --base B", "needs --vlm"),
                                            ("adapt --tiny-vision", "needs --base"), ("adapt --base B", "needs a vision side")])
def test_required_inputs_are_refused_in_one_line(command, needs, capsys):
    from experiments.cli import main

    assert main(command.split()) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needs in err, err


def test_a_model_argument_says_a_real_llms_name_works_and_each_seed_says_what_it_seeds():
    from sinkstudy.real_models import REGISTRY

    model_args = {"model", "base"}  # sink / eval MODEL, qknorm BASE, and every --base
    for name, parser in commands():
        for action in parser._actions:
            if action.dest in model_args and (action.option_strings or action.dest == "model" or name == "qknorm"):
                assert all(n in (action.help or "") for n in REGISTRY), f"sinkstudy {name} {action.dest}: {action.help}"
    seeds = {name: next(a.help for a in p._actions if a.dest == "seed") for name, p in commands()
             if any(a.dest == "seed" for a in p._actions)}
    assert "merge" in seeds["merge"] and "merge" not in seeds["mitigate"] and "mitigation" in seeds["mitigate"]
