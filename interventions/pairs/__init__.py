"""The one loader for (base LLM, VLM) pairs: the VLM's language model as a causal LM in the base's class.

Public API (see docs/pairs.md): `load_causal_lm`, `load_pair`, `extract_language_model`, `plan_extraction`,
`write_language_model`, `save_causal_lm`, `resolve`, `tensors_of`, `check_same_layout`, `load_tokenizer`,
`weight_diff`, `format_diff_table`, `ModelPair`, `ModelSource`, `ExtractionReport`, `PairMismatchError`.
"""

from interventions.pairs.archs import SUPPORTED_VLMS
from interventions.pairs.diff import diff_summary, format_diff_table, weight_diff
from interventions.pairs.extract import ExtractionPlan, ExtractionReport, extract_language_model, plan_extraction
from interventions.pairs.layout import PairMismatchError
from interventions.pairs.loading import ModelPair, load_causal_lm, load_pair
from interventions.pairs.resolve import ModelSource, check_same_layout, resolve
from interventions.pairs.tensors import tensors_of
from interventions.pairs.writer import EXTRACTION_JSON, save_causal_lm, write_language_model
from sinkstudy.checkpoint import load_tokenizer

__all__ = [
    "SUPPORTED_VLMS", "EXTRACTION_JSON", "ExtractionPlan", "ExtractionReport", "ModelPair", "ModelSource",
    "PairMismatchError", "check_same_layout", "diff_summary", "extract_language_model", "format_diff_table",
    "load_causal_lm", "load_pair", "load_tokenizer", "plan_extraction", "resolve", "save_causal_lm", "tensors_of",
    "weight_diff", "write_language_model",
]
