"""What a study's `interventions:` entries can name, in one table: every method's kind and the check
of its settings. `interventions.registry` holds the post-hoc methods (mergekit and spectral merges,
registered mitigations: a change to the VLM's language model); `qknorm` injects QK-RMSNorm into the
base (optionally recovery-trained, then re-adapted with the study's VL recipe: `vl: true`). The step
builders (`experiments.study.pipeline`) dispatch on `kind`, never on a method's name."""

from __future__ import annotations

import math

from experiments.study.schema import fail, guarded, integer

POSTHOC, INJECTION = "posthoc", "injection"
QKNORM = "qknorm"
QKNORM_PARAMS = {"init", "train_steps", "trainable", "lr", "vl", "alpha"}
QKNORM_DEFAULTS = {"init": "scale-preserving", "train_steps": 0, "trainable": "all", "lr": 1e-3, "vl": False}


def known() -> dict[str, str]:
    """name -> what it is, every method a study may name."""
    from interventions.registry import list_interventions

    return {QKNORM: "injection: QK-RMSNorm into the base (+ recovery training, + the study's VL recipe)", **list_interventions()}


def kind(method: str) -> str:
    return INJECTION if method == QKNORM else POSTHOC


def check_method(method, params: dict, where: str, *, vl_recipe: bool) -> None:
    """`method` is known and `params` are its settings (every value, before any model is read); `vl_recipe`:
    the study has a VL recipe for `vl: true` (the demo's build section)."""
    names = known()
    if method not in names:
        others = sorted(n for n in names if n != QKNORM)
        fail(f"{where}.method", f"unknown method {method!r}; known: {QKNORM}, {', '.join(others)}")
    if kind(method) == INJECTION:
        check_qknorm(params, f"{where}.params", vl_recipe)
        return
    from interventions.registry import validate_intervention

    guarded(lambda p: validate_intervention(method, p), f"{where}.params", params)  # the pair's root is added where it applies


def check_qknorm(params: dict, where: str, vl_recipe: bool) -> None:
    from interventions.qknorm import INIT_MODES, TRAINABLE_MODES

    unknown = sorted(set(params) - QKNORM_PARAMS)
    if unknown:
        fail(where, f"qknorm has no parameter(s) {', '.join(unknown)}; it takes {', '.join(sorted(QKNORM_PARAMS))}")
    if params.get("vl") and not vl_recipe:
        fail(f"{where}.vl", "VL re-training after injection needs the demo's build section (the digits recipe)")
    if "init" in params and params["init"] not in INIT_MODES:
        fail(f"{where}.init", f"must be one of {', '.join(INIT_MODES)}, got {params['init']!r}")
    if "trainable" in params and params["trainable"] not in TRAINABLE_MODES:
        fail(f"{where}.trainable", f"must be one of {', '.join(TRAINABLE_MODES)}, got {params['trainable']!r}")
    if "train_steps" in params:
        integer(params["train_steps"], f"{where}.train_steps", 0)
    for key, (lo, hi) in {"lr": (0.0, 1.0), "alpha": (0.0, 1.0)}.items():
        v = params.get(key)
        if key in params and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
                              or not lo <= v <= hi or (key == "lr" and v == 0)):
            fail(f"{where}.{key}", f"must be a finite number in {'(' if key == 'lr' else '['}{lo}, {hi}], got {v!r}")
    if "vl" in params and not isinstance(params["vl"], bool):
        fail(f"{where}.vl", "must be true or false")
