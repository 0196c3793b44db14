"""The locally pretrained tower: trained once per settings and code and reused from its cache, probed on
held-out images, and built into a LLaVA unchanged (its weights frozen in the VLM as cached, the round trip
exact). The tiny settings here test the path; the real tower's probe is docs/adapt.md's."""

import pytest
import torch

from interventions.adapt import tower
from interventions.adapt.build import build_vlm, check_round_trip
from interventions.adapt.config import VisionSpec
from sinkstudy import SinkstudyError
from sinkstudy.tiny import tiny_causal_lm

pytestmark = pytest.mark.slow

SMALL = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 64,
         "steps": 3, "scenes": 48, "per_source": 24, "batch_size": 8}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SINKSTUDY_CACHE", str(tmp_path))
    return tmp_path


def test_pretrained_tower_is_cached_probed_and_keyed(cache):
    path = tower.pretrained_tower(SMALL)
    report = tower.tower_report(path)
    assert set(report["probe"]) == {"count", "shape", "colour", "digit"}
    assert all(0 <= p["accuracy"] <= 1 and p["n"] > 0 for p in report["probe"].values())
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert tower.pretrained_tower(SMALL) == path and (path / "model.safetensors").stat().st_mtime_ns == stamp  # reused
    assert tower.tower_key(tower.settings_of(SMALL)) != tower.tower_key(tower.settings_of({**SMALL, "seed": 1}))
    with pytest.raises(SinkstudyError, match="unknown tower setting"):
        tower.settings_of({"layers": 3})


def test_scenes_vision_builds_a_llava_around_the_cached_tower(cache, tokenizer):
    from transformers import CLIPVisionModel

    base = tiny_causal_lm("qwen2", vocab_size=len(tokenizer))
    built = build_vlm(base, tokenizer, VisionSpec("scenes", tiny=SMALL))
    assert built.report["kind"] == "scenes" and built.report["image_tokens_per_image"] == 16
    assert built.report["vision_feature_layer"] == -1 and "tower_probe" in built.report
    check_round_trip(built.model, base, built.tokenizer)
    cached = CLIPVisionModel.from_pretrained(tower.pretrained_tower(SMALL)).state_dict()
    cached = {k.removeprefix("vision_model."): v for k, v in cached.items()}
    inside = {k.removeprefix("vision_model."): v for k, v in built.model.model.vision_tower.state_dict().items()}
    assert cached.keys() == inside.keys() and all(torch.equal(cached[k], inside[k]) for k in cached)
