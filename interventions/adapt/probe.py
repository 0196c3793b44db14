"""The held-out VL skill of a VLM the engine saved: which of "It is a 0." ... "It is a 9." it finds most likely
for held-out digits (`evals.vqa.choice_accuracy`), the prompts encoded by the engine's own encoder, as it
trained on them. Any study's arms (`vl_eval`) and the demo's build measure it."""

from __future__ import annotations

from pathlib import Path


def digit_skill(vlm_dir: Path, heldout: int, seed: int) -> dict:
    """Held-out digit accuracy of a saved VLM (`evals.vqa.choice_accuracy` over "It is a 0." ... "It is a 9.",
    prompts encoded as the adaptation engine trained them), and the true answer's token NLL and perplexity."""
    from evals.vqa import choice_accuracy
    from interventions.adapt.build import load_vlm
    from interventions.adapt.data import Encoder, collate, digits_records

    vlm, processor = load_vlm(vlm_dir)
    tok = processor.tokenizer
    encoder = Encoder(tok, processor=processor, image_token=processor.image_token)
    records = digits_records("heldout", n_heldout=heldout, seed=seed)
    result = choice_accuracy(vlm, records, [f"It is a {d}." for d in range(10)], encoder, lambda f: collate(f, tok.pad_token_id))
    return {"digit_accuracy": result.pop("accuracy"), **result}
