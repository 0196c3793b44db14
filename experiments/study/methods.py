"""What a study's `interventions:` entries may name: every method of `interventions.registry`, whose
parameters, defaults and checks are declared there. Its family says which step builder places it
(`experiments.study.pipeline.BUILDERS`): a post-hoc method changes the VLM's language model; QK-norm
injection changes the base, optionally recovery-trained, then re-adapted with the study's VL recipe
(`vl: true`)."""

from __future__ import annotations

from experiments.study.schema import fail, guarded
from interventions.registry import get_method, methods

POSTHOC, INJECTION = "posthoc", "injection"


def kind(method: str) -> str:
    return INJECTION if get_method(method).family == INJECTION else POSTHOC


def check_method(method, params: dict, where: str, *, vl_recipe: bool) -> dict:
    """`method` is known and `params` are its settings (every value, before any model is read); `vl_recipe`:
    the study has a VL recipe for `vl: true` (its build section). Returns the settings, defaults filled in."""
    table = methods()
    if method not in table:
        fail(f"{where}.method", f"unknown method {method!r}; known: {', '.join(table)}")
    resolved = guarded(table[method].resolve, f"{where}.params", params)
    if resolved.get("vl") and not vl_recipe:
        fail(f"{where}.params.vl", "VL re-training after injection needs the study's build section (its VL recipe)")
    return resolved
