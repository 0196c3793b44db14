"""The one loader for (base LLM, VLM) pairs: the VLM's language model as a causal LM in the base's class.

Public API (see docs/pairs.md): `load_causal_lm`, `load_pair`, `extract_language_model`, `plan_extraction`,
`write_language_model`, `save_causal_lm`, `resolve`, `tensors_of`, `check_same_layout`, `load_tokenizer`,
`weight_diff`, `format_diff_table`, `ModelPair`, `ModelSource`, `ExtractionReport`, `PairMismatchError`.

The names load with the module that defines them, on first use: planning a study or building the command line reads
no weight library.
"""

from importlib import import_module

# `resolve` names a function and the module holding it: bound now, so that `from interventions.pairs import resolve` is
# the function whichever was imported first (the module is light: configs and headers, no weights).
from interventions.pairs.resolve import ModelSource, check_same_layout, resolve

_WHERE = {
    "interventions.pairs.archs": ("SUPPORTED_VLMS",),
    "interventions.pairs.diff": ("diff_summary", "format_diff_table", "weight_diff"),
    "interventions.pairs.extract": ("ExtractionPlan", "ExtractionReport", "extract_language_model", "plan_extraction"),
    "interventions.pairs.layout": ("PairMismatchError",),
    "interventions.pairs.loading": ("ModelPair", "load_causal_lm", "load_pair"),
    "interventions.pairs.tensors": ("tensors_of",),
    "interventions.pairs.writer": ("EXTRACTION_JSON", "DEFAULT_MAX_SHARD_BYTES", "save_causal_lm", "write_language_model"),
    "sinkstudy.checkpoint": ("load_tokenizer",),
}
_MODULE = {name: module for module, names in _WHERE.items() for name in names}
__all__ = [*_MODULE, "ModelSource", "check_same_layout", "resolve"]


def __getattr__(name: str):
    if name not in _MODULE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(_MODULE[name]), name)
