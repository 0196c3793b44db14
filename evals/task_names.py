"""Task names checked before any work, each unknown one refused in one line with a suggestion only where one is
close: a typo of a shipped task, or of one of lm-eval's ~15k names (`lm_eval ls tasks` lists them), never whatever
is least unlike a name that resembles none ("nonexistent" is not a misspelt "injongointent").

Kept apart from `evals.tasks` and `evals.lmeval`, whose source is part of every eval's cache key: a better message
must not make every finished eval run again.
"""

from __future__ import annotations

import difflib
from typing import Iterable

from evals.tasks import SHIPPED_TASKS, UnknownTaskError, parse_task_list

# How alike a name must be to be offered: shipped tasks are few and sinkstudy's own; lm-eval's many names make loose
# matches meaningless ("gsm8k_cott" -> gsm8k_cot at 0.95, "nonexistent" -> injongointent at 0.67).
SHIPPED_CUTOFF, LM_EVAL_CUTOFF = 0.6, 0.85


def suggestion(name: str, lm_eval_names: Iterable[str]) -> str:
    """"; did you mean: a, b?" for an unknown task name, shipped tasks first; "" when nothing is close."""
    close = difflib.get_close_matches(name, list(SHIPPED_TASKS), n=3, cutoff=SHIPPED_CUTOFF)
    close += [c for c in difflib.get_close_matches(name, list(lm_eval_names), n=3, cutoff=LM_EVAL_CUTOFF) if c not in close]
    return f"; did you mean: {', '.join(close)}?" if close else ""


def check_task_names(tasks: str | Iterable[str]) -> list[str]:
    """`evals.lmeval.check_task_names` (tags refused, lm-eval's index built once), an unknown name said as above."""
    from evals.lmeval import check_task_names as check, lm_eval_task_kinds

    names = parse_task_list(tasks)
    other = [n for n in names if n not in SHIPPED_TASKS]
    kinds = lm_eval_task_kinds() if other else {}
    for name in other:
        if name not in kinds:
            raise UnknownTaskError(f"unknown task {name!r}: not a shipped task ({', '.join(SHIPPED_TASKS)}) nor one of lm-eval's "
                                   f"{len(kinds)} tasks, groups and tags{suggestion(name, kinds)}")
    return check(names)
