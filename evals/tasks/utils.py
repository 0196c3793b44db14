"""Functions the shipped task YAMLs name with `!function utils.X`.

lm-eval loads this file by path (beside the YAMLs), both under its own CLI
(`lm_eval --include_path evals/tasks --tasks sinkstudy_ifeval`) and in sinkstudy's runs, so it
imports nothing from sinkstudy that it cannot do without (IFBench's graders excepted: they need
`evals.ifbench` to run offline). The IFEval graders are lm-eval's own, IFBench's are IFBench's own,
delegated to; `load_jsonl` reads a task's local data files relative to this directory (or inside an
installed package, `pkg:PACKAGE/PATH`), so the YAMLs work from any working directory.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from evals.ifbench import NEEDS_NLTK_DATA, grade
from evals.vl.questions import SHORT
from evals.vqa import heldout_items, image_of, normalise

_HERE = Path(__file__).resolve().parent
PACKAGE_PREFIX = "pkg:"


def data_path(f: str) -> str:
    """A task's data file: absolute, relative to this directory, or `pkg:PACKAGE/PATH` inside an installed package."""
    if f.startswith(PACKAGE_PREFIX):
        package, _, rel = f[len(PACKAGE_PREFIX):].partition("/")
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(f"data file {f}: the package {package!r} is not installed")
        return str(Path(spec.submodule_search_locations[0]) / rel)
    return str(_HERE / f)  # an absolute f stays as it is


def load_jsonl(data_files=None, **_metadata):
    """lm-eval `custom_dataset`: {split: jsonl path} -> DatasetDict (paths as `data_path` reads them).

    lm-eval calls it with the task's metadata and dataset_kwargs as keyword arguments.
    """
    # lazy: loads datasets, numpy, huggingface_hub
    import datasets

    if not data_files:
        raise ValueError("a sinkstudy task needs dataset_kwargs.data_files ({split: jsonl path})")
    return datasets.load_dataset("json", data_files={split: data_path(f) for split, f in data_files.items()})


def _ifeval():
    """lm-eval's IFEval graders, made to work offline and deterministically on first use."""
    try:  # sinkstudy installed: its NLTK tables stop lm-eval's import-time punkt_tab download
        from evals.nltk_offline import ensure_punkt_tab
    except ImportError:
        pass
    else:
        ensure_punkt_tab()
    # lazy: loads langdetect
    from langdetect import DetectorFactory

    if DetectorFactory.seed is None:  # three checkers detect languages; lm-eval never seeds them
        DetectorFactory.seed = 0
    # lazy: loads lm_eval, datasets, numpy
    from lm_eval.tasks.ifeval import utils

    return utils


def process_results(doc, results):
    return _ifeval().process_results(doc, results)


def agg_inst_level_acc(items):
    return _ifeval().agg_inst_level_acc(items)


def load_ifbench(data_files=None, **metadata):
    """IFBench's prompts less those whose verifiers need NLTK data that no package ships (`evals.ifbench`)."""
    return load_jsonl(data_files, **metadata).filter(lambda doc: not set(doc["instruction_id_list"]) & set(NEEDS_NLTK_DATA))


def process_results_ifbench(doc, results):
    return grade(doc, results[0])


# --------------------------------------------------------------------------- sinkstudy_vqa (hf-multimodal)

def load_vqa(n_easyvqa=120, n_scenes=120, n_digits=60, seed=0, **_metadata):
    """lm-eval `custom_dataset`: the held-out VQA items (`evals.vqa.heldout_items`), images named by key."""
    # lazy: loads datasets, numpy, huggingface_hub
    import datasets

    items = heldout_items(n_easyvqa, n_scenes, n_digits, seed)
    rows = [{"question": it.question, "answer": it.answer, "type": it.type, "source": it.source, "image": it.key} for it in items]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def vqa_image(doc):
    """The doc's image, redrawn from its key (an easy-VQA file, a held-out scene, a digit)."""
    return [image_of(doc["image"])]


def vqa_prompt(doc):
    return f"<image>\n{doc['question']}\n{SHORT}"


def vqa_process(doc, results):
    """Normalised exact match (`evals.vqa.normalise`), overall and under the question's type."""
    return {"exact_match": float(normalise(results[0]) == normalise(doc["answer"]))}
