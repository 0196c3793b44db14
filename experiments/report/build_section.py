"""The report's account of how a study's pairs were built (a build section: the demo's), from the build facts the
summary holds (`experiments.demo.steps.build_facts`): per backbone its recipe, pretraining and VL adaptation, the
corpus, the VL recipe, and the real-scale Sink Strength reference; and, for backbones trained from scratch, where
their S lies and why such miniatures may differ from the paper (`miniature_notes`, said before any answer, so no
one reads their ρ as a test of sinks)."""

from __future__ import annotations

from pathlib import Path

from experiments.report import plots
from experiments.report.findings import trained_backbones
from experiments.report.fmt import missing, num
from experiments.report.results import StudyResults


def _knobs(bb: dict) -> str:
    """What a trained backbone's recipe sets beyond its shape: lr, weight decay, data mix."""
    if bb.get("kind") == "pretrained":
        return f"pretrained: {bb['pretrained']}"
    mix = [f"{k.replace('_share', '').replace('_rate', '')} {bb[k]:g}"
           for k in ("backcopy_share", "retrieval_share", "noise_share", "sprinkle_rate") if bb.get(k)]
    return f"lr {bb['lr']:g}, wd {bb['weight_decay']:g}" + (f", {', '.join(mix)}" if mix else "")


def build_blocks(build: dict, out: Path) -> list[tuple]:
    rows, curves = [], {}
    for bb in build["backbones"]:
        pre, vl = bb["pretrain"], bb["vl"]
        curve = pre.get("sink_curve") or []
        curves[bb["name"]] = curve
        shape = (f"{bb['num_hidden_layers']}x{bb['hidden_size']}, {bb['num_attention_heads']} heads"
                 if bb.get("kind") != "pretrained" else "")
        rows.append([bb["name"], bb.get("family", bb.get("pretrained")), "native" if bb["native_qk_norm"] else "none", shape,
                     _knobs(bb), pre.get("params"), pre.get("steps") or "-",
                     " → ".join(num(curve[i]["S"], ".2f") for i in (0, -1)) if len(curve) > 1 else "-",
                     num(pre.get("final_loss")), num(vl["final_loss"]["stage1"]), num(vl["final_loss"]["stage2"]), vl["text_chats"],
                     ", ".join(f"{step}: {x:+.2f}" for step, x in vl["sink_trajectory"]) or "-",
                     num(vl["heldout"]["digit_accuracy"]), num(vl["heldout"]["answer_ppl"], ".2f")])
    corpus, vl_cfg = build["corpus"], build["vl"]
    trained = any(bb["kind"] == "trained" for bb in build["backbones"])
    backbones = ("Tokenizer: byte-level BPE trained on the corpus. Every backbone is a config entry (a sinkgrow recipe: family, shape, steps, lr, weight decay, data mix; "
                 "docs/sink-growth.md) pretrained from scratch on that corpus through the engine's text path." if trained else
                 "The backbone is a real pretrained LLM (its converted checkpoint, with its family's chat template; "
                 "sinkstudy/real_models.py), not trained on the corpus; the corpus gives its held-out evals and stage 2's text chats.")
    b = [("h", 2, "How the miniature pairs were built" if trained else "How the pair was built"),
         ("p", f"Corpus: {corpus['train_records']} procedurally generated records ({corpus['kinds']['chat']} chats with strict-format "
               f"instructions, arithmetic and plain requests; {corpus['kinds']['plain']} plain stories); held-out evals: "
               f"{corpus['heldout_ifeval']} IFEval-schema prompts and {corpus['heldout_gsm']} GSM-schema problems on entities the "
               f"corpus never shows. {backbones} VL adaptation through the engine: LLaVA "
               "(LlavaForConditionalGeneration, tiny CLIP tower frozen at random init) on scikit-learn's 8x8 digits, "
               f"stage 1 projector ({vl_cfg['stage1_steps']} steps), stage 2 projector+LM ({vl_cfg['stage2_steps']} steps, "
               f"{vl_cfg['text_share']:.0%} of its examples text-only chats from the corpus, as "
               "LLaVA-665K mixes ShareGPT text into its stage 2), loss on answers only. Held-out digit accuracy: the most "
               f"likely of the ten answers 'It is a d.' on {vl_cfg['heldout_images']} unseen images (chance 0.10). S during VL: "
               "the LM's Sink Strength at adaptation steps (stage 1 then stage 2, counted on)."),
         ("table", ["backbone", "family", "QK-norm", "shape", "knobs", "params", "pretrain steps", "S step 0 → end", "pretrain loss",
                    "VL stage-1 loss", "VL stage-2 loss", "text chats in VL", "S during VL (step: S)", "held-out digit acc.",
                    "answer ppl"], rows)]
    plot = plots.pretrain_sink_curves(curves, out)
    if plot:
        b.append(("img", plot, "Sink Strength of each backbone against pretraining steps"))
    refs = build["references"]
    if refs:
        b += [("h", 2, "Real-scale reference"),
              ("table", ["model", "source", "QK-norm", "layers", "S", "mean sink mass"],
               [[r["name"], r["source"], "native" if r["native_qk_norm"] else "none", r["layers"], num(r["sink_strength"]),
                 num(r["mean_mass"])] for r in refs]),
              ("p", "The same Sink Strength (metric, prompts, layers) as the miniatures' S, on a real pretrained LLM: what a "
                    "formed attention sink reads as on this scale. A reference, not a pair (it is not adapted in `make demo`; "
                    "`make demo-real` adapts it).")]
    return b


def miniature_notes(r: StudyResults) -> list[str]:
    """Where the miniatures' S lies, said plainly, beside the real models' S measured the same way, and why a miniature
    may differ from the paper; none without backbones trained from scratch."""
    trained = trained_backbones(r)
    if not trained:
        return []
    vals = [x for x in r.base_strengths(trained) if not missing(x)]
    if not vals:
        return ["No base has a defined Sink Strength."]
    lo, hi = min(vals), max(vals)
    real = "; ".join(f"{x['name']}: S = {x['sink_strength']:+.2f} (mean sink mass {x['mean_mass']:.2f}, {x['layers']} layers)"
                     for x in (r.build or {}).get("references", []))
    if hi > 0:
        head = f"Base S spans {lo:.2f} to {hi:.2f} (span {hi - lo:.2f}); {sum(x > 0 for x in vals)} of {len(vals)} bases have S > 0."
    else:
        head = (f"No miniature base reaches S > 0: base S spans {lo:.2f} to {hi:.2f} (span {hi - lo:.2f}, {len(vals)} backbones). "
                "No training recipe within the demo's budget grows a sink on the calibration prompts (docs/sink-growth.md); "
                "the spread comes from lr, QK-norm and noise knobs and ranks how sharply heads attend to non-BOS keys, "
                "not how strong a sink is (published S 0.24 to 2.36 for 7-8B bases).")
    s_base = r.base_strengths()
    why = ("Why the miniature may differ from the paper: its models have about a million parameters or fewer, pretrained for a few "
           "hundred steps on generated text, its VL task is 8x8 digits, its stage 2 mixes in text-only chats, and "
           + ("no base has a sink (S < 0 throughout), so S here measures attention sharpness rather than the sink the paper "
              "ties to text retention." if s_base and all(not missing(x) and x < 0 for x in s_base) else
              "few pairs decide a rank correlation.") + " The claims below say whether it agrees with the paper.")
    return [head + (f" Real-scale reference, same metric and prompts: {real}." if real else ""), why]
