"""The one loader for (base LLM, VLM) pairs: the VLM's language model as a causal LM in the base's class.

Public API (see docs/pairs.md): `load_causal_lm`, `extract_language_model`, `load_pair`, `save_causal_lm`,
`check_same_layout`, `load_tokenizer`, `weight_diff`, `format_diff_table`, `ModelPair`, `ExtractionReport`, `PairMismatchError`.
"""

from interventions.pairs.archs import SUPPORTED_VLMS
from interventions.pairs.diff import diff_summary, format_diff_table, weight_diff
from interventions.pairs.extract import ExtractionReport, extract_language_model
from interventions.pairs.layout import PairMismatchError, check_same_layout
from interventions.pairs.loading import EXTRACTION_JSON, ModelPair, load_causal_lm, load_pair, save_causal_lm
from interventions.pairs.resolve import load_tokenizer

__all__ = [
    "SUPPORTED_VLMS", "EXTRACTION_JSON", "ExtractionReport", "ModelPair", "PairMismatchError",
    "check_same_layout", "diff_summary", "extract_language_model", "format_diff_table", "load_causal_lm",
    "load_pair", "load_tokenizer", "save_causal_lm", "weight_diff",
]
