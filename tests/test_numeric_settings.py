"""Every numeric setting of every method and mitigation is checked (finite, in
range) by one function before any work, and no model with non-finite tensors is ever saved."""

import math

import pytest
import torch

from interventions.merge import MergeError
from sinkstudy import SinkstudyError
from tests.test_merge import _perturbed, _save_model

NAN, INF = math.nan, math.inf

BAD = [
    ("linear", {"weight": NAN}), ("linear", {"weight": 1.5}), ("linear", {"weight": -0.1}), ("slerp", {"weight": INF}),
    ("task_arithmetic", {"weight": NAN}), ("ties", {"density": 2}), ("ties", {"density": 0}), ("ties", {"density": NAN}),
    ("dare_ties", {"density": -0.5}), ("dare_linear", {"weight": 11}), ("breadcrumbs", {"gamma": 1.0}),
    ("breadcrumbs_ties", {"gamma": NAN}), ("ties", {"lambda": INF}), ("ties", {"normalize": "yes"}), ("ties", {"weight": True}),
    ("tsv", {"weight": NAN}), ("tsv", {"alpha": INF}), ("tsv", {"alpha": -1}), ("tsv", {"k_fraction": 0}),
    ("tsv", {"k_fraction": NAN}), ("tsv", {"device": "tpu"}), ("tsv", {"alpha": 1.0, "weight": 1.0}),
    ("star", {"weight": NAN}), ("star", {"lambda": INF}), ("star", {"eta": 0}), ("star", {"eta": 150}), ("star", {"eta": NAN}),
    ("head_restore", {"top_k": 0}), ("head_restore", {"top_k": 2.5}), ("head_restore", {"min_loss": NAN}),
    ("head_restore", {"min_loss": -1.0}), ("linear", {"root": "/some/root"}), ("no_such_method", {}),
]


@pytest.mark.parametrize("name, params", BAD, ids=[f"{n}-{p}" for n, p in BAD])
def test_validate_intervention_refuses_in_one_line(name, params):
    from interventions.registry import validate_intervention

    with pytest.raises(SinkstudyError) as err:
        validate_intervention(name, params)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("name, params", [("linear", {"weight": 0.0}), ("ties", {"weight": 1.0, "density": 1.0}),
                                          ("breadcrumbs", {"density": 0.9, "gamma": 0.01}), ("tsv", {"alpha": 0.5, "k_fraction": 1.0}),
                                          ("star", {"eta": 100, "lambda": 1.0}), ("head_restore", {"top_k": 1, "min_loss": 0}),
                                          ("ties", {"root": "/some/root", "density": 0.2})])
def test_validate_intervention_accepts_the_edges(name, params):
    from interventions.registry import validate_intervention

    validate_intervention(name, params)


@pytest.fixture(scope="module")
def pair(tmp_path_factory, tokenizer):
    from sinkstudy.tiny import tiny_causal_lm

    d = tmp_path_factory.mktemp("numeric_pair")
    base = tiny_causal_lm("qwen2", seed=0)
    vlm = _perturbed(base, 9)
    poisoned = _perturbed(base, 9)
    with torch.no_grad():
        poisoned.model.layers[1].mlp.up_proj.weight[0, 0] = INF  # a broken input checkpoint
    return {"base": _save_model(base, tokenizer, d / "base"), "vlm": _save_model(vlm, tokenizer, d / "vlm"),
            "poisoned": _save_model(poisoned, tokenizer, d / "poisoned")}


@pytest.mark.parametrize("name, params", [("tsv", {"alpha": NAN}), ("star", {"lambda": NAN}), ("ties", {"density": 2})])
def test_bad_settings_never_reach_the_merge(pair, tmp_path, name, params):
    from interventions.registry import apply_intervention

    with pytest.raises(SinkstudyError):
        apply_intervention(name, pair["base"], pair["vlm"], params, tmp_path / "out", progress=False)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name, params", [("linear", {"weight": 0.5}), ("tsv", {"alpha": 1.0}), ("star", {"eta": 40})])
def test_a_merge_with_non_finite_results_is_not_saved(pair, tmp_path, name, params):
    from interventions.registry import apply_intervention

    with pytest.raises(MergeError, match="non-finite values in model.layers.1.mlp.up_proj.weight"):
        apply_intervention(name, pair["base"], pair["poisoned"], params, tmp_path / "out", progress=False)
    assert list(tmp_path.iterdir()) == []  # nothing moved into place, no temporary left


def test_a_mitigation_that_makes_nan_is_not_saved(pair, tmp_path):
    from interventions.mitigations import _REGISTRY, register_mitigation, run_mitigation

    @register_mitigation("test_nan_plugin", defaults={})
    def broken(base, vlm_lm, sink_maps, config):
        """Divide by zero (a test plug-in)."""
        vlm_lm.lm_head.weight.div_(0.0)
        return vlm_lm

    try:
        with pytest.raises(MergeError, match="non-finite values in lm_head.weight"):
            run_mitigation("test_nan_plugin", pair["base"], pair["vlm"], tmp_path / "out", progress=False)
        assert list(tmp_path.iterdir()) == []
    finally:
        _REGISTRY.pop("test_nan_plugin", None)
