"""What an eval run says about itself, for the commands that read runs back (`sinkstudy eval`, `sinkstudy compare`):
the data each task read when not its default (`data_sources`), whether two runs graded the same prompts
(`check_same_data`), where a run lies (`resolve_run`: an eval dir or a merge / mitigate output's) and its
headline scores in one line (`headline`)."""

from __future__ import annotations

from pathlib import Path

from evals.eval_run import RESULTS_FILE
from evals.tasks import SHIPPED_TASKS, load_task_yaml
from sinkstudy import SinkstudyError
from sinkstudy.provenance import file_sha256


def headline(run) -> str:
    """Each requested task's headline score(s) in one line: the paper's metric, and both strict-match
    and flexible-extract for a task graded both ways (GSM8K-CoT); a task on other data names it."""
    # lazy: loads numpy
    from evals.stats import headline_metrics

    sources = data_sources(run)
    parts = []
    for task in run.tasks:
        if not run.metrics(task):
            continue
        values = [(m.removesuffix(",none"), run.scores[task][m]) for m in headline_metrics(run, task)]
        text = " / ".join(f"{name} {v:.4f}" if isinstance(v, float) else f"{name} {v}" for name, v in values)
        parts.append(f"{task}{f' [data {Path(sources[task]).name}]' if task in sources else ''} {text}")
    return "; ".join(parts) or "no scores"


def data_sources(run) -> dict[str, str]:
    """{task: its data file} for the tasks of `run` whose prompts are not the task's default data
    (the shipped set of a shipped task, the hub's of lm-eval's own); the file is named when the run
    recorded it, else by its sha256."""
    prov = run.provenance or {}
    out = {}
    for task, identity in (prov.get("tasks") or {}).items():
        sha = (identity or {}).get("data_sha256")
        if task in SHIPPED_TASKS:
            default = next(iter(load_task_yaml(SHIPPED_TASKS[task])["dataset_kwargs"]["data_files"].values()))
            if sha is None or sha == file_sha256(default):
                continue
        elif sha is None:
            continue
        out[task] = (prov.get("data_files") or {}).get(task) or f"a local file (sha256 {sha[:12]}…)"
    return out


def resolve_run(path: str) -> Path:
    """An eval run directory: PATH itself, or the run a merge / mitigate output holds (PATH/eval);
    one line naming what is missing otherwise."""
    p = Path(path)
    for candidate in (p, p / "eval"):
        if (candidate / RESULTS_FILE).is_file():
            return candidate
    raise SinkstudyError(f"{path} is not an eval run: no {RESULTS_FILE} in it (nor in {p / 'eval'}); "
                         "give an `sinkstudy eval` output or a merge / mitigate output")


def check_same_data(a, b, tasks) -> None:
    """Two runs of a task on different prompts are not compared: one line saying which --data would
    make them comparable."""
    ids_a, ids_b = (r.provenance.get("tasks") or {} for r in (a, b))
    src_a, src_b = data_sources(a), data_sources(b)
    for task in tasks:
        sha_a, sha_b = ((ids.get(task) or {}).get("data_sha256") for ids in (ids_a, ids_b))
        if task not in ids_a or task not in ids_b or sha_a == sha_b:
            continue
        where = lambda src: src.get(task, "the task's default data")  # noqa: E731
        fix = (f"rerun B with --data {task}={src_a[task]}" if task in src_a and task not in src_b
               else f"rerun A with --data {task}={src_b[task]}" if task in src_b and task not in src_a
               else f"rerun one of them with the other's --data {task}=FILE")
        raise SinkstudyError(f"{task}: A was evaluated on {where(src_a)}, B on {where(src_b)}: not the same prompts; {fix}")
