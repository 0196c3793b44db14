"""Functions the shipped task YAMLs name with `!function utils.X`.

lm-eval loads this file by path (beside the YAMLs), both under its own CLI
(`lm_eval --include_path evals/tasks --tasks sinkstudy_ifeval`) and in sinkstudy's runs, so it
imports nothing from sinkstudy that it cannot do without. The IFEval graders are lm-eval's own,
delegated to; `load_jsonl` reads a task's local data files relative to this directory, so the
YAMLs work from any working directory.
"""

from __future__ import annotations

from pathlib import Path

_HERE = Path(__file__).resolve().parent


def load_jsonl(data_files=None, **_metadata):
    """lm-eval `custom_dataset`: {split: jsonl path} -> DatasetDict (relative paths from this dir).

    lm-eval calls it with the task's metadata and dataset_kwargs as keyword arguments.
    """
    import datasets

    if not data_files:
        raise ValueError("a sinkstudy task needs dataset_kwargs.data_files ({split: jsonl path})")
    files = {split: str(_HERE / f) for split, f in data_files.items()}  # an absolute f stays as it is
    return datasets.load_dataset("json", data_files=files)


def _ifeval():
    """lm-eval's IFEval graders, made to work offline and deterministically on first use."""
    try:  # sinkstudy installed: its NLTK tables stop lm-eval's import-time punkt_tab download
        from evals.nltk_offline import ensure_punkt_tab
    except ImportError:
        pass
    else:
        ensure_punkt_tab()
    from langdetect import DetectorFactory

    if DetectorFactory.seed is None:  # three checkers detect languages; lm-eval never seeds them
        DetectorFactory.seed = 0
    from lm_eval.tasks.ifeval import utils

    return utils


def process_results(doc, results):
    return _ifeval().process_results(doc, results)


def agg_inst_level_acc(items):
    return _ifeval().agg_inst_level_acc(items)
