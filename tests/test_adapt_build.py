"""VLMs built around a base LLM: the language model inside gives the base's logits on text (fresh,
tiny, donor; tied and untied heads; injected QK-norm as a Qwen3 twin or carried as hooks), the
tower / projector come from where they should, and the saved checkpoint reads like a hub VLM."""

import numpy as np
import pytest
import torch

from interventions.adapt.build import build_vlm, check_round_trip, donor_model
from interventions.adapt.config import VisionSpec
from interventions.adapt.vlm_io import causal_view, extract_lm, load_vlm, parameter_groups, save_extracted_lm, save_vlm
from sinkstudy import SinkstudyError
from sinkstudy.tiny import tiny_causal_lm

TINY = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "patch_size": 4}
TEXTS = ["The answer is 8.", "Write your answer in upper case letters only."]


def _logits(model, tok, text="Describe the image. The image shows the digit seven."):
    ids = tok([text], return_tensors="pt")["input_ids"]
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama", "gemma3_text"])
def test_tiny_llava_keeps_the_base_text_function(tokenizer, family):
    base = tiny_causal_lm(family, vocab_size=len(tokenizer), tie_word_embeddings=family == "gemma3_text")
    built = build_vlm(base, tokenizer, VisionSpec("tiny", tiny=TINY))
    vlm = built.model
    assert check_round_trip(vlm, base, tokenizer, TEXTS) <= 1e-5
    assert vlm.config.text_config.model_type == family and built.report["image_tokens_per_image"] == 4
    tied = vlm.get_output_embeddings().weight is vlm.get_input_embeddings().weight
    assert tied == (family == "gemma3_text")
    # Copied, not shared: training the VLM cannot move the base.
    assert vlm.get_input_embeddings().weight.data_ptr() != base.get_input_embeddings().weight.data_ptr()
    # The causal view shares the VLM's modules (the trajectory's evals run on live weights).
    view = causal_view(vlm)
    assert view.model is vlm.get_decoder() and torch.allclose(_logits(view, tokenizer), _logits(base, tokenizer), atol=1e-5)
    groups = parameter_groups(vlm)
    assert groups["projector"] and groups["tower"] and not (groups["projector"] & groups["tower"]) and not (groups["lm"] & groups["tower"])
    assert set(dict(vlm.named_parameters())) == groups["lm"] | groups["projector"] | groups["tower"]


@pytest.mark.parametrize("tied", [True, False])
def test_rows_past_the_base_vocabulary_are_the_base_rows_mean(tokenizer, tied):
    """A tiny/fresh LLaVA is created without initialising its tensors; the rows the base lacks (an added
    image token) must not keep that memory (it made runs of one arm differ on one machine)."""
    n = len(tokenizer) - 2  # the base knows all but the last two tokens
    base = tiny_causal_lm("llama", vocab_size=n, tie_word_embeddings=tied)
    vlm = build_vlm(base, tokenizer, VisionSpec("tiny", tiny=TINY)).model
    for built, original in ((vlm.get_input_embeddings().weight, base.get_input_embeddings().weight),
                            (vlm.get_output_embeddings().weight, base.get_output_embeddings().weight)):
        assert built.shape[0] == len(tokenizer) and torch.equal(built[:n], original)
        assert torch.equal(built[n:], original.mean(0, keepdim=True).expand(2, -1))


def test_projector_and_tiny_tower_are_seeded_identically_across_bases(tokenizer):
    a = build_vlm(tiny_causal_lm("qwen2", vocab_size=len(tokenizer), seed=1), tokenizer, VisionSpec("tiny", tiny=TINY, seed=3)).model
    b = build_vlm(tiny_causal_lm("qwen2", vocab_size=len(tokenizer), seed=2), tokenizer, VisionSpec("tiny", tiny=TINY, seed=3)).model
    c = build_vlm(tiny_causal_lm("qwen2", vocab_size=len(tokenizer), seed=1), tokenizer, VisionSpec("tiny", tiny=TINY, seed=4)).model
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    vision = [k for k in sa if "vision_tower" in k or "multi_modal_projector" in k]
    assert all(torch.equal(sa[k], sb[k]) for k in vision)
    assert not all(torch.equal(sa[k], sc[k]) for k in vision)


@pytest.mark.parametrize("family", ["clip", "siglip"])
def test_fresh_build_takes_a_local_tower_and_its_image_processor(tmp_path, tokenizer, family):
    from transformers import (CLIPImageProcessorPil, CLIPVisionConfig, CLIPVisionModel, SiglipImageProcessorPil,
                              SiglipVisionConfig, SiglipVisionModel)

    shape = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=8, patch_size=4)
    if family == "clip":
        tower, proc = CLIPVisionModel(CLIPVisionConfig(**shape)), CLIPImageProcessorPil(size={"shortest_edge": 8}, crop_size={"height": 8, "width": 8})
    else:
        tower, proc = SiglipVisionModel(SiglipVisionConfig(**shape)), SiglipImageProcessorPil(size={"height": 8, "width": 8})
    tower.save_pretrained(tmp_path / "tower")
    proc.save_pretrained(tmp_path / "tower")
    base = tiny_causal_lm("qwen2", vocab_size=len(tokenizer))
    built = build_vlm(base, tokenizer, VisionSpec("fresh", str(tmp_path / "tower")))
    check_round_trip(built.model, base, tokenizer, TEXTS)
    r = built.report
    assert (r["vision_feature_select_strategy"], r["vision_feature_layer"]) == (("default", -2) if family == "clip" else ("full", -1))
    assert r["image_tokens_per_image"] == 4
    ours = built.model.model.vision_tower.state_dict()
    theirs = {k.removeprefix("vision_model."): v for k, v in tower.state_dict().items()}
    assert all(torch.equal(v, theirs[k.removeprefix("vision_model.")]) for k, v in ours.items())
    assert type(built.processor.image_processor).__name__ == type(proc).__name__


def test_fresh_build_refuses_a_non_vision_tower(tmp_path, tokenizer):
    base = tiny_causal_lm("qwen2", vocab_size=len(tokenizer))
    base.save_pretrained(tmp_path / "lm")
    with pytest.raises(SinkstudyError, match="CLIP or SigLIP"):
        build_vlm(base, tokenizer, VisionSpec("fresh", str(tmp_path / "lm")))
    with pytest.raises(SinkstudyError, match="does not exist"):
        build_vlm(base, tokenizer, VisionSpec("fresh", str(tmp_path / "missing")))


def _donor_tokenizer(tokenizer):
    """The base tokenizer with the donor's 8 added tokens (ids 512..519; 514 is the image token)."""
    import copy

    tok = copy.deepcopy(tokenizer)
    tok.add_tokens(["<|vlm_0|>", "<|vlm_1|>", "<image>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>",
                    "<|vlm_6|>", "<|vlm_7|>"], special_tokens=True)
    assert tok.convert_tokens_to_ids("<image>") == 514
    return tok


def _llava_donor(tmp_path, tok):
    from transformers import CLIPImageProcessorPil, LlavaProcessor
    from vlm_factories import tiny_vlm

    donor = tiny_vlm("llava", "qwen2", seed=5)
    donor.save_pretrained(tmp_path / "donor")
    LlavaProcessor(image_processor=CLIPImageProcessorPil(size={"shortest_edge": 8}, crop_size={"height": 8, "width": 8},
                                                         image_mean=[0.5] * 3, image_std=[0.5] * 3),
                   tokenizer=tok, patch_size=4, vision_feature_select_strategy="default", num_additional_image_tokens=1,
                   image_token="<image>", chat_template=tok.chat_template).save_pretrained(tmp_path / "donor")
    return donor


def test_donor_keeps_tower_projector_and_added_rows_and_takes_the_base_lm(tmp_path, tokenizer):
    from vlm_factories import tiny_base

    tok = _donor_tokenizer(tokenizer)
    donor = _llava_donor(tmp_path, tok)
    base = tiny_base("qwen2")  # 512 rows; the donor has 520
    built = build_vlm(base, tok, VisionSpec("donor", str(tmp_path / "donor")))
    vlm = built.model
    check_round_trip(vlm, base, tok, TEXTS)
    ds, vs = donor.state_dict(), vlm.state_dict()
    for k in ds:
        if "vision_tower" in k or "multi_modal_projector" in k:
            assert torch.equal(ds[k], vs[k]), k
    emb = vlm.get_input_embeddings().weight
    assert emb.shape[0] == 520 and torch.equal(emb[:512], base.get_input_embeddings().weight)
    assert torch.equal(emb[512:], donor.get_input_embeddings().weight[512:])
    assert built.image_token == "<image>"


def test_qwen25_vl_donor_model_round_trip(tokenizer):
    """Qwen2.5-VL (the paper's donor): its merger and tower stay, M-RoPE on text equals the base's 1D RoPE.
    (Its processor needs torchvision, not installed here: the model side is tested alone.)"""
    from vlm_factories import tiny_base, tiny_vlm

    donor = tiny_vlm("qwen2_5_vl", seed=5)
    base = tiny_base("qwen2")
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        donor.save_pretrained(d)
        state = {k.removeprefix("model."): v for k, v in base.state_dict().items() if k.startswith("model.")}
        vlm, report = donor_model(base, state, d)
    check_round_trip(vlm, base, tokenizer, TEXTS)
    assert torch.equal(vlm.model.visual.merger.mlp[0].weight, donor.model.visual.merger.mlp[0].weight)
    groups = parameter_groups(vlm)
    assert groups["projector"] and all(".merger." in n for n in groups["projector"]) and not (groups["projector"] & groups["tower"])


def test_donor_with_another_architecture_is_refused(tmp_path, tokenizer):
    from vlm_factories import tiny_base

    tok = _donor_tokenizer(tokenizer)
    _llava_donor(tmp_path, tok)
    with pytest.raises(SinkstudyError, match="language model is qwen2, the base is llama"):
        build_vlm(tiny_base("llama"), tok, VisionSpec("donor", str(tmp_path / "donor")))


def test_saved_vlm_reads_like_a_hub_vlm(tmp_path, tokenizer):
    """The pair loader extracts the saved VLM's language model = the base (before any training)."""
    from interventions.pairs import load_pair

    base = tiny_causal_lm("qwen2", vocab_size=len(tokenizer))
    base.save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    built = build_vlm(base, tokenizer, VisionSpec("tiny", tiny=TINY))
    save_vlm(built, built.processor, tmp_path / "vlm")
    pair = load_pair(tmp_path / "base", tmp_path / "vlm")
    assert torch.allclose(_logits(pair.vlm_lm, tokenizer), _logits(pair.base, tokenizer), atol=1e-5)
    vlm, processor = load_vlm(tmp_path / "vlm")
    enc = processor(images=np.zeros((8, 8, 3), np.uint8), text=processor.image_token + "\nWhat digit is this?", return_tensors="pt")
    assert int((enc["input_ids"] == vlm.config.image_token_id).sum()) == vlm.config.image_seq_length == 4


def test_injected_qknorm_inside_llava_is_an_exact_qwen3_twin(tokenizer, tmp_path):
    from interventions.qknorm import inject_qk_norm, qk_norm_kind

    base = tiny_causal_lm("qwen2", vocab_size=len(tokenizer))
    injected = inject_qk_norm(base, init="identity-gain", progress=False)
    built = build_vlm(injected, tokenizer, VisionSpec("tiny", tiny=TINY))
    assert built.model.config.text_config.model_type == "qwen3" and built.report["qk_norm"] == "native"
    check_round_trip(built.model, injected, tokenizer, TEXTS)
    save_vlm(built, built.processor, tmp_path / "vlm")  # an ordinary checkpoint: no sidecar
    assert not (tmp_path / "vlm" / "sinkstudy_qknorm.json").exists()
    lm, _ = extract_lm(tmp_path / "vlm")
    assert qk_norm_kind(lm) == "native" and torch.allclose(_logits(lm, tokenizer), _logits(injected, tokenizer), atol=1e-5)


def test_injected_norms_without_a_twin_are_carried_as_hooks_and_round_trip(tmp_path, tokenizer):
    """A blend injection (no Qwen3 twin) inside a donor VLM: hooks on the decoder + sidecar; load_vlm
    and extraction re-attach them; a reader that ignores the sidecar would get other logits."""
    from interventions.pairs import extract_language_model, load_causal_lm
    from interventions.qknorm import inject_qk_norm, qk_norm_kind
    from vlm_factories import tiny_base

    tok = _donor_tokenizer(tokenizer)
    _llava_donor(tmp_path, tok)
    injected = inject_qk_norm(tiny_base("qwen2"), init="blend", alpha=0.7, calibration_texts=TEXTS, tokenizer=tok, progress=False)
    with torch.no_grad():
        for m in injected.modules():  # non-trivial gains, so a dropped norm shows
            if hasattr(m, "blend_alpha"):
                m.weight.mul_(1.5)
    built = build_vlm(injected, tok, VisionSpec("donor", str(tmp_path / "donor")))
    assert built.report["qk_norm"].startswith("injected, carried")
    check_round_trip(built.model, injected, tok, TEXTS)
    save_vlm(built, built.processor, tmp_path / "vlm")
    assert (tmp_path / "vlm" / "sinkstudy_qknorm.json").is_file()
    reloaded, _ = load_vlm(tmp_path / "vlm")
    check_round_trip(reloaded, injected, tok, TEXTS)
    save_extracted_lm(tmp_path / "vlm", injected, tmp_path / "lm")
    lm, _ = load_causal_lm(tmp_path / "lm")
    assert qk_norm_kind(lm) == "injected"
    assert torch.allclose(_logits(lm, tok), _logits(injected, tok), atol=1e-5)
    plain, _ = extract_language_model(tmp_path / "vlm", injected)
    assert not torch.allclose(_logits(plain, tok), _logits(injected, tok), atol=1e-3)
