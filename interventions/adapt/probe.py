"""The held-out VL skill of a VLM the engine saved, by one of two probes (a study's `vl_eval`):
- digits: which of "It is a 0." ... "It is a 9." it finds most likely for held-out digits
  (`evals.vqa.choice_accuracy`), the prompts encoded by the engine's own encoder, as it trained on them
  (the digits recipe's probe; the demo's build measures it too);
- vqa: the held-out short-answer VQA of the instruction recipe (`evals.vqa.vqa_accuracy`: greedy answers,
  normalised exact match, per question type with its chance).

`lm`: a causal LM put in place of the VLM's language model first (`interventions.adapt.build.implant_lm`),
so a merged or mitigated LM is scored with the tower and projector it was trained with."""

from __future__ import annotations

from pathlib import Path

from evals.vqa import choice_accuracy, heldout_items, vqa_accuracy
from interventions.adapt.sources import digits_records
from interventions.pairs import load_causal_lm

PROBES = ("digits", "vqa")
# The held-out VQA's defaults: items per source (evals.vqa.heldout_items), greedy answer budget
VQA_DEFAULTS = {"easyvqa": 120, "scenes": 120, "digits": 60, "seed": 0, "max_new_tokens": 8}


def digit_skill(vlm_dir: Path, heldout: int, seed: int, *, loaded=None) -> dict:
    """Held-out digit accuracy of a saved VLM (`evals.vqa.choice_accuracy` over "It is a 0." ... "It is a 9.",
    prompts encoded as the adaptation engine trained them), and the true answer's token NLL and perplexity.
    `loaded`: the (VLM, processor) already in memory."""
    # lazy: loads torch, transformers, scipy
    from interventions.adapt.vlm_io import load_vlm
    from interventions.adapt.encoding import Encoder, collate

    vlm, processor = loaded or load_vlm(vlm_dir)
    tok = processor.tokenizer
    encoder = Encoder(tok, processor=processor, image_token=processor.image_token)
    records = digits_records("heldout", n_heldout=heldout, seed=seed)
    result = choice_accuracy(vlm, records, [f"It is a {d}." for d in range(10)], encoder, lambda f: collate(f, tok.pad_token_id))
    return {"digit_accuracy": result.pop("accuracy"), **result}


def vqa_skill(vlm, processor, settings: dict) -> dict:
    """Held-out VQA accuracy of a loaded VLM: overall, and per question type with its chance (uniform over the
    type's answers) and the commonest answer's share (`evals.vqa.score`)."""
    s = {**VQA_DEFAULTS, **settings}
    items = heldout_items(s["easyvqa"], s["scenes"], s["digits"], s["seed"])
    result, answers = vqa_accuracy(vlm, processor, items, max_new_tokens=s["max_new_tokens"])
    return {**result.as_dict(), "examples": [{"question": it.question, "answer": it.answer, "reply": a}
                                             for it, a in list(zip(items, answers))[:5]]}


def vl_skill(vlm_dir, probe: dict, lm_dir=None) -> dict:
    """The VLM's held-out VL skill under `probe` ({"probe": "digits", "heldout", "seed"} or {"probe": "vqa", ...
    VQA_DEFAULTS' keys}), with `lm_dir`'s causal LM in place of its own when given. The result always carries
    `probe` and `accuracy` (a share in [0, 1])."""
    # lazy: loads torch, transformers, scipy
    from interventions.adapt.vlm_io import implant_lm, load_vlm

    loaded = load_vlm(vlm_dir)
    if lm_dir is not None:
        lm, _ = load_causal_lm(str(lm_dir))
        implant_lm(loaded[0], lm)
    if probe["probe"] == "digits":
        out = digit_skill(Path(vlm_dir), probe["heldout"], probe["seed"], loaded=loaded)
        return {"probe": "digits", "accuracy": out["digit_accuracy"], **out}
    out = vqa_skill(*loaded, {k: v for k, v in probe.items() if k != "probe"})
    return {"probe": "vqa", **out}
