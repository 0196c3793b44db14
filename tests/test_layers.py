"""The layers of the tree, read from its imports (every `import` statement, at module level or inside a function,
and the modules a lazily loading package names): they point down only (sinkstudy < evals, interventions <
experiments < benchmarks; evals never imports interventions; nothing imports a benchmark), no module imports itself
back through others (anywhere in the tree), no two sub-packages import each other, nothing but the command line
imports the embedded demo (the demo hands its build section and texts over through it), building the command line
loads no numeric library (its threads are set before), each default is written once, and no file in `experiments/`
outgrows one concept (about 450 lines)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("sinkstudy", "evals", "interventions", "experiments", "benchmarks")
BELOW = {"sinkstudy": set(), "evals": {"sinkstudy"}, "interventions": {"sinkstudy", "evals"},
         "experiments": {"sinkstudy", "evals", "interventions"},
         "benchmarks": {"sinkstudy", "evals", "interventions", "experiments"}}  # nothing imports a benchmark
DEMO = "experiments.demo"
COMPOSER = "experiments.cli"  # the one place that hands the demo to the study (its build section, its default texts)
MAX_LINES = 450


def _modules() -> dict[str, Path]:
    out = {}
    for f in ROOT.rglob("*.py"):
        rel = f.relative_to(ROOT)
        if rel.parts[0] in PACKAGES and ".venv" not in rel.parts:
            name = ".".join(rel.with_suffix("").parts)
            out[name.removesuffix(".__init__")] = f
    return out


def _imports(modules: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the modules of the tree it imports (a name resolved to the longest module it names)."""
    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for m, f in modules.items():
        deps = set()
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    pkg = m if f.name == "__init__.py" else m.rpartition(".")[0]
                    for _ in range(node.level - 1):
                        pkg = pkg.rpartition(".")[0]
                    base = f"{pkg}.{base}" if base else pkg
                # `from pkg import sub` reads the submodule, not what pkg/__init__ defines (a package is
                # always initialised before its submodules, so that implicit edge is no arrow of the drawing)
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            elif isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["_WHERE"]:
                names = [k.value for k in node.value.keys]  # a package whose names load with their modules on first use
            else:
                continue
            deps |= {r for n in names if (r := resolve(n)) and r != m}
        graph[m] = deps
    return graph


def _unit(module: str) -> str:
    """The sub-package a module belongs to (`experiments.study`, `evals.generate`), or the package's own module."""
    return ".".join(module.split(".")[:2])


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in list(graph):
        if v not in index:
            visit(v)
    return found


def test_imports_point_down_only():
    graph = _imports(_modules())
    up = [f"{m} -> {d}" for m, deps in graph.items() for d in deps
          if d.split(".")[0] != m.split(".")[0] and d.split(".")[0] not in BELOW[m.split(".")[0]]]
    assert not up, up


def test_experiments_import_each_other_without_a_circle():
    graph = _imports(_modules())
    sub = {m: {d for d in deps if d.startswith("experiments")} for m, deps in graph.items() if m.startswith("experiments")}
    assert not _circles(sub)
    # the rule reads the tree: an added back edge is a circle it finds
    assert _circles({**sub, "experiments.study.graph": sub["experiments.study.graph"] | {"experiments.study.runner"}})


def test_no_module_of_the_tree_imports_itself_back():
    """No circle anywhere (function-level imports included): sinkstudy's checkpoint, provenance, real_models
    and real_weights among them."""
    graph = _imports(_modules())
    assert not _circles(graph)
    assert "sinkstudy.real_models" in graph["sinkstudy.checkpoint"] and not graph["sinkstudy.real_models"] & {
        "sinkstudy.checkpoint", "sinkstudy.provenance", "sinkstudy.real_weights"}
    # a function-level import back from the table to the checkpoint helpers is a circle the rule finds
    assert _circles({**graph, "sinkstudy.real_models": graph["sinkstudy.real_models"] | {"sinkstudy.checkpoint"}})
    # a submodule importing a name its package re-exports is one too
    assert _circles(graph | {"interventions.pairs.archs": {"interventions.pairs"}})


def test_sub_packages_import_each_other_without_a_circle():
    """Sub-packages (and a package's own modules) import each other one way only: the study renders through the report
    (which reads summary.json and never the study), the demo a config of the study, protections on the adaptation
    engine, the generation loop below the lm-eval bridge's backends."""
    graph = _imports(_modules())
    units: dict[str, set[str]] = {}
    for m, deps in graph.items():
        units.setdefault(_unit(m), set()).update(_unit(d) for d in deps if _unit(d) != _unit(m))
    assert not _circles(units), _circles(units)
    # the rule reads the tree: a back edge between two sub-packages is a circle it finds
    for low, high in (("experiments.report", "experiments.study"), ("experiments.study", "experiments.demo"),
                      ("interventions.adapt", "interventions.protect"), ("evals.generate", "evals.lm_backends")):
        assert low in units[high] and _circles({**units, low: units[low] | {high}})


def test_no_command_module_imports_another():
    """A `cmd_*` module holds its command's arguments and a call: what two commands share lives below them."""
    graph = _imports(_modules())
    cmds = {m for m in graph if m.startswith("experiments.cli.cmd_")}
    assert len(cmds) > 5
    shared = [f"{m} -> {d}" for m in cmds for d in graph[m] if d in cmds]
    assert not shared, shared


def test_nothing_but_the_command_line_imports_the_demo():
    """The demo is a config of the study: only the command line, which composes the two, names it."""
    graph = _imports(_modules())
    leaks = [f"{m} -> {d}" for m, deps in graph.items() for d in deps
             if d.startswith(DEMO) and not m.startswith((DEMO, COMPOSER))]
    assert not leaks, leaks


def test_no_file_in_experiments_outgrows_one_concept():
    long = {str(f.relative_to(ROOT)): n for f in (ROOT / "experiments").rglob("*.py")
            if (n := len(f.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert not long, long


def test_each_default_is_written_once():
    """The calibration set read where none is named and the QK-norm inits: one constant each, read from its home."""
    homes = {'"ifeval15"': "evals/sink/calibration.py", '"identity-gain", "scale-preserving"': "interventions/qknorm_modes.py"}
    for text, home in homes.items():
        where = sorted(str(f.relative_to(ROOT)) for f in _modules().values() if text in f.read_text(encoding="utf-8"))
        assert where == [home], (text, where)


def test_building_the_command_line_loads_no_numeric_library():
    """`sinkstudy --help` is instant and a command sets its threads before torch, numpy or their kin load: every
    command module keeps such imports inside the functions that compute."""
    import subprocess
    import sys

    code = ("import sys, experiments.cli as cli; cli.build_parser(); "
            "print(' '.join(m for m in ('torch', 'numpy', 'transformers', 'lm_eval', 'mergekit', 'scipy', 'matplotlib') "
            "if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert done.stdout.split() == []
