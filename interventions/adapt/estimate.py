"""GPU memory and time per stage of an adaptation, from parameter counts (a paper-dry-style estimate).

Nothing is downloaded but configs; the model is laid out on the meta device to count the parameters
of each group and of what each stage trains. Assumptions (printed with the numbers):
- memory per GPU: Trainer with bf16 autocast keeps fp32 weights (4 B/param), fp32 gradients and two
  fp32 AdamW moments for trainable parameters (4 + 8 B); DeepSpeed ZeRO-2 over N GPUs keeps bf16
  weights (2 B) and partitions bf16 gradients (2 B) and the fp32 master copy + moments (12 B) by N;
- activations: 34 * b * T * d bytes per decoder layer (Korthikanti et al. 2022, bf16, fused attention:
  no T^2 term); with gradient checkpointing 2 * b * T * d per layer plus one layer's full set;
  logits only at label positions (the engine's loss): `answer_share` * b * T * vocab * 6 bytes;
- time: 2 FLOPs per parameter and token forward; backward 2 per LM parameter (activation gradients,
  needed whenever something at or below the LM trains) + 2 per trainable parameter; checkpointing adds a
  forward; the frozen tower runs forward only, on `image_tokens` patches per example; throughput =
  `mfu` x the GPU's dense bf16 peak;
- T = `tokens_per_example` (default: the build's image tokens + 128 text tokens).
"""

from __future__ import annotations

import math
from typing import Any

from interventions.adapt.config import AdaptConfig, VisionSpec
from interventions.adapt.sources import load_records, parse_spec
from interventions.pairs.resolve import load_config
from sinkstudy import SinkstudyError

GPUS = {  # memory (GB), dense bf16 peak (TFLOP/s)
    "H200": (141, 989),
    "H100": (80, 989),
    "A100": (80, 312),
    "L40S": (48, 362),
}


def skeleton(base, vision: VisionSpec | None):
    """The model to train, on the meta device (no weights): for counting parameters per group.
    `base`: a path / hub id, a config, or a loaded causal LM."""
    # lazy: loads torch, transformers, numpy
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, LlavaForConditionalGeneration
    from interventions.adapt.build import llava_config, tower_config

    base_config = base if hasattr(base, "model_type") else base.config if hasattr(base, "config") else load_config(base)
    with torch.device("meta"):
        if vision is None:
            return AutoModelForCausalLM.from_config(base_config), None
        if vision.kind == "donor":
            return AutoModelForImageTextToText.from_config(load_config(vision.source)), None
        vision_config, family = tower_config(vision)
        config, info = llava_config(base_config, vision_config, family, vision, 0, base_config.vocab_size)
        return LlavaForConditionalGeneration(config), info["image_tokens_per_image"]


def estimate(base, vision: VisionSpec | None, config: AdaptConfig, *, gpu: str = "H200", world: int = 1,
             tokens_per_example: int | None = None, answer_share: float = 0.3, mfu: float = 0.4,
             examples: dict[str, int] | None = None) -> dict[str, Any]:
    """Per stage: trainable parameters, memory per GPU (GB) by kind, seconds per step, total hours."""
    # lazy: loads torch, transformers, datasets
    from interventions.adapt.vlm_io import parameter_groups
    from interventions.adapt.trainer import select_trainable

    if gpu not in GPUS:
        raise SinkstudyError(f"unknown GPU {gpu!r}; known: {', '.join(GPUS)}")
    model, image_tokens = skeleton(base, vision)
    image_tokens = image_tokens if image_tokens is not None else (0 if vision is None else 576)
    T = tokens_per_example or image_tokens + 128
    text = model.config.get_text_config()
    d, L, V = text.hidden_size, text.num_hidden_layers, text.vocab_size
    sizes = {n: p.numel() for n, p in model.named_parameters()}
    groups = parameter_groups(model)
    count = lambda names: sum(sizes[n] for n in names)  # noqa: E731
    p_all, p_lm, p_tower = count(sizes), count(groups["lm"]), count(groups["tower"])
    p_lm_compute = p_lm - count(groups["embeddings"])  # embedding lookups cost no matmul
    mem_gb, peak_tflops = GPUS[gpu]
    zero = bool(config.deepspeed)
    stages = []
    for stage in config.stages:
        trainable = select_trainable(model, stage.trainable)
        p_t = count(trainable)
        b = stage.micro_batch_size
        if zero:
            weights, grads, optim = 2 * p_all, 2 * p_t / world, 12 * p_t / world
        else:
            weights, grads, optim = 4 * p_all, 4 * p_t, 8 * p_t
        per_layer = 34 * b * T * d
        acts = (2 * b * T * d * L + per_layer) if config.gradient_checkpointing else per_layer * L
        logits = answer_share * b * T * V * 6
        total = weights + grads + optim + acts + logits
        lm_trains_or_below = bool(trainable - groups["tower"])
        flops_tok = 2 * p_lm_compute + (2 * p_lm_compute if lm_trains_or_below else 0) + 2 * (p_t - count(trainable & groups["embeddings"]))
        if config.gradient_checkpointing:
            flops_tok += 2 * p_lm_compute
        flops_step = stage.batch_size * (T * flops_tok + image_tokens * 2 * p_tower)
        step_s = flops_step / (world * peak_tflops * 1e12 * mfu)
        n_examples = (examples or {}).get(stage.name) or _count_examples(stage)
        steps = stage.steps or (math.ceil(n_examples * stage.epochs / stage.batch_size) if n_examples else None)
        stages.append({
            "stage": stage.name, "trainable_params": p_t, "micro_batch": b,
            "accumulation": stage.batch_size // (b * world) if stage.batch_size % (b * world) == 0 else None,
            "memory_gb": {"weights": weights / 1e9, "gradients": grads / 1e9, "optimizer": optim / 1e9,
                          "activations": acts / 1e9, "logits": logits / 1e9, "total": total / 1e9},
            "fits": total / 1e9 <= mem_gb * 0.92,
            "seconds_per_step": step_s, "steps": steps, "examples": n_examples,
            "hours": steps * step_s / 3600 if steps else None,
        })
    return {"gpu": gpu, "gpu_memory_gb": mem_gb, "world": world, "deepspeed_zero2": zero,
            "gradient_checkpointing": config.gradient_checkpointing, "tokens_per_example": T, "image_tokens": image_tokens,
            "answer_share": answer_share, "mfu": mfu, "params": {"total": p_all, "lm": p_lm, "tower": p_tower,
                                                                   "projector": count(groups["projector"])},
            "stages": stages}


def _count_examples(stage) -> int | None:
    """Records of the stage's data when counting is cheap (JSON files, digits, in-memory); else None."""
    total = 0
    for spec in stage.data:
        s = parse_spec(spec)
        if "hf" in s:
            return None
        total += len(load_records(s))
    return total or None


def format_estimate(e: dict) -> str:
    p = e["params"]
    lines = [f"adaptation estimate on {e['world']} x {e['gpu']} ({e['gpu_memory_gb']} GB, bf16 peak x MFU {e['mfu']})"
             f"{', DeepSpeed ZeRO-2' if e['deepspeed_zero2'] else ''}{', gradient checkpointing' if e['gradient_checkpointing'] else ''}",
             f"parameters: total {p['total'] / 1e9:.3f} B (LM {p['lm'] / 1e9:.3f} B, tower {p['tower'] / 1e6:.1f} M, "
             f"projector {p['projector'] / 1e6:.1f} M); {e['tokens_per_example']} tokens per example "
             f"({e['image_tokens']} image tokens), {int(e['answer_share'] * 100)}% of them answer tokens", "",
             f"{'stage':<10} {'trainable':>11} {'micro x acc':>11} {'weights':>8} {'grads':>7} {'optim':>7} {'acts':>7} "
             f"{'logits':>7} {'total GB':>9} {'s/step':>8} {'steps':>7} {'hours':>7}"]
    for s in e["stages"]:
        m = s["memory_gb"]
        acc = f"{s['micro_batch']} x {s['accumulation'] or '?'}"
        hours = f"{s['hours']:.1f}" if s["hours"] is not None else "?"
        lines.append(f"{s['stage']:<10} {s['trainable_params'] / 1e6:>9.1f} M {acc:>11} {m['weights']:>8.1f} {m['gradients']:>7.1f} "
                     f"{m['optimizer']:>7.1f} {m['activations']:>7.1f} {m['logits']:>7.1f} {m['total']:>9.1f}"
                     f"{'' if s['fits'] else '!'} {s['seconds_per_step']:>8.3f} {s['steps'] or '?':>7} {hours:>7}")
    if not all(s["fits"] for s in e["stages"]):
        lines += ["", "! = more than 92% of the GPU's memory: lower micro_batch_size (accumulation keeps the batch), turn on "
                  "gradient_checkpointing, or use DeepSpeed ZeRO-2 over more GPUs."]
    lines += ["", "Assumptions: see interventions/adapt/estimate.py (fp32 master weights + AdamW; 34·b·T·d activation bytes per layer; "
              "logits at answer tokens only; 6 FLOPs/param/token when the LM trains, 4 when only the projector does)."]
    return "\n".join(lines)
