"""Task names checked before any work, each unknown one refused in one line with a suggestion only where one is
close: a typo of a shipped task, or of one of lm-eval's ~15k names (`lm_eval ls tasks` lists them), never whatever
is least unlike a name that resembles none ("nonexistent" is not a misspelt "injongointent").

Kept apart from `evals.tasks` and `evals.lmeval`, whose source is part of every eval step's key: a better message
must not make every finished eval run again.
"""

from __future__ import annotations

import contextlib
import difflib
import hashlib
import json
from typing import Iterable

from evals.tasks import SHIPPED_TASKS, UnknownTaskError, builtin_task_manager, parse_task_list
from sinkstudy import SinkstudyError
from sinkstudy.io import cache_root, write_json_atomic
from sinkstudy.provenance import package_versions

# How alike a name must be to be offered: shipped tasks are few and sinkstudy's own; lm-eval's many names make loose
# matches meaningless ("gsm8k_cott" -> gsm8k_cot at 0.95, "nonexistent" -> injongointent at 0.67).
SHIPPED_CUTOFF, LM_EVAL_CUTOFF = 0.6, 0.85


def suggestion(name: str, lm_eval_names: Iterable[str]) -> str:
    """"; did you mean: a, b?" for an unknown task name, shipped tasks first; "" when nothing is close."""
    close = difflib.get_close_matches(name, list(SHIPPED_TASKS), n=3, cutoff=SHIPPED_CUTOFF)
    close += [c for c in difflib.get_close_matches(name, list(lm_eval_names), n=3, cutoff=LM_EVAL_CUTOFF) if c not in close]
    return f"; did you mean: {', '.join(close)}?" if close else ""


def check_task_names(tasks: str | Iterable[str]) -> list[str]:
    """Fail in one line on an unknown task name, or an lm-eval tag, before any work; shipped tasks need nothing else,
    other names are looked up in lm-eval's index (`lm_eval_task_kinds`). Returns the parsed names."""
    names = parse_task_list(tasks)
    other = [n for n in names if n not in SHIPPED_TASKS]
    kinds = lm_eval_task_kinds() if other else {}
    for name in other:
        if name not in kinds:
            raise UnknownTaskError(f"unknown task {name!r}: not a shipped task ({', '.join(SHIPPED_TASKS)}) nor one of lm-eval's "
                                   f"{len(kinds)} tasks, groups and tags{suggestion(name, kinds)}")
        if kinds[name] == "tag":
            raise SinkstudyError(f"{name!r} is an lm-eval tag, not a task or group; name its tasks instead")
    return names


def lm_eval_task_kinds() -> dict[str, str]:
    """{task, group or tag name: kind} of lm-eval's built-in index (built once per lm-eval version, ~13 s, then kept in
    the sinkstudy cache)."""
    import lm_eval  # only to name its version's index: a task outside the shipped ones is being checked

    version = package_versions().get("lm_eval")
    f = cache_root() / f"lm_eval_tasks-{version}-{hashlib.sha256(lm_eval.__file__.encode()).hexdigest()[:8]}.json"
    try:
        cached = json.loads(f.read_text(encoding="utf-8"))
        if isinstance(cached, dict) and cached:
            return cached
    except (OSError, ValueError):
        pass  # absent or damaged: rebuilt
    kinds = {name: entry.kind.name.lower() for name, entry in builtin_task_manager().task_index.items()}
    with contextlib.suppress(OSError):
        write_json_atomic(f, kinds)
    return kinds
