"""docs/ARCHITECTURE.md has one row per module of the tree, and no row for a module that is gone.

A row is `| package | `path inside the package` | contract |`; a sub-package's `__init__` is `dir/`.
A top-level package `__init__` that holds only its docstring needs no row; the demo's files
(experiments/demo/, owned by the demo) are covered by its `demo/` row."""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("sinkstudy", "evals", "interventions", "experiments", "benchmarks", "scripts")
COVERED_BY_PACKAGE_ROW = ("experiments/demo/",)


def _python_files() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
        files = out.split()
    except (OSError, subprocess.CalledProcessError):  # not a git checkout (an unpacked sdist)
        files = [str(p.relative_to(ROOT)) for p in ROOT.rglob("*.py") if "__pycache__" not in p.parts]
    return sorted(f for f in files if f.split("/")[0] in PACKAGES and (ROOT / f).is_file())


def _rows() -> set[tuple[str, str]]:
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8")
    return {(m.group(1), m.group(2)) for m in re.finditer(r"^\| (\w+) \| `([\w/]+)` \|", text, re.M)}


def _key(path: str) -> tuple[str, str] | None:
    """(package, module key) of a file, or None when it needs no row."""
    package, _, rest = path.partition("/")
    if any(path.startswith(d) and path != d + "__init__.py" for d in COVERED_BY_PACKAGE_ROW):
        return None
    rest = rest.removesuffix(".py")
    if rest == "__init__":
        body = ast.parse((ROOT / path).read_text(encoding="utf-8")).body
        bare = all(isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant) for n in body)
        return None if bare and package != "sinkstudy" else (package, "__init__")
    return package, rest.removesuffix("__init__")  # a sub-package: `dir/`


def test_every_module_has_a_row():
    rows = _rows()
    missing = [f for f in _python_files() if _key(f) is not None and _key(f) not in rows]
    assert not missing, f"docs/ARCHITECTURE.md has no row for {missing}"


def test_every_row_names_a_module_that_exists():
    stale = [f"{package}/{key}" for package, key in _rows()
             if not (ROOT / package / (key + "__init__.py" if key.endswith("/") else key + ".py")).is_file()]
    assert not stale, f"docs/ARCHITECTURE.md has rows for modules that do not exist: {stale}"


def test_the_rule_reads_the_tree():
    # the parsing itself: a regression here would silently check nothing
    rows, files = _rows(), _python_files()
    assert len(rows) > 60 and len(files) > 80
    assert ("evals", "sink/measure") in rows and _key("evals/sink/measure.py") == ("evals", "sink/measure")
    assert _key("interventions/protect/__init__.py") == ("interventions", "protect/")
    assert _key("evals/__init__.py") is None and _key("sinkstudy/__init__.py") == ("sinkstudy", "__init__")
