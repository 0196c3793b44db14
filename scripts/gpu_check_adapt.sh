#!/usr/bin/env bash
# GPU check of the VL adaptation engine (issue 13.8), for one H200 (any CUDA GPU with >= 80 GB works).
#
# 20 optimizer steps of stage 2 (LM + projector, lr 2e-5 cosine, effective batch 128 = 16 x 8 accumulation,
# bf16 autocast, gradient checkpointing) on a real-shape model built from configs with random weights:
# Qwen2.5-3B-Instruct's shape (3.09 B) inside a LLaVA with a CLIP ViT-L/14-336-shaped tower (576 image
# tokens per image), on the digits (upscaled to 336 px) as image chats. Prints tokens/s, steps/s, peak GPU
# memory and the Sink Strength trajectory points (steps 0, 10, 20), and compares them with
# `sinkstudy adapt --estimate` for the same shape. Never a test dependency; run it from a clean checkout:
#
#     bash scripts/gpu_check_adapt.sh            # 2 min 45 s on an H200 (measured 2026-12-04)
#
# On a GPU machine without network: build the wheels where PyPI is reachable (scripts/gpu_wheels.sh),
# copy the checkout with .whl/ over and run this there; it installs .whl/ into /tmp/site without an
# index for the machine's python3 and its CUDA torch (scripts/gpu_site.sh; docs/adapt.md). Elsewhere it
# uses the current python if it already has torch (CUDA) + the project's dependencies; otherwise it
# creates .venv-gpu and installs the project there (needs PyPI).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_site.sh
PY=${PYTHON:-python3}
# GPU_CHECK_SMOKE=1 runs the same code on CPU with tiny shapes (to check the script without a GPU).
# CUDA first: without it the check stops after importing torch alone.
NEED_CUDA='import os, torch
assert os.environ.get("GPU_CHECK_SMOKE") == "1" or torch.cuda.is_available(), "no CUDA device"
import transformers, accelerate, lm_eval, mergekit'
if ! why=$("$PY" -c "$NEED_CUDA" 2>&1); then
    if [ "$GPU_WHEELS" = 1 ]; then  # no network there: say what is missing instead of trying PyPI
        echo "gpu_check_adapt: $PY with .whl/ cannot run the check: $(tail -n 1 <<< "$why")" >&2; exit 2
    fi
    if [ ! -x .venv-gpu/bin/python ] || ! .venv-gpu/bin/python -c "$NEED_CUDA" 2>/dev/null; then
        echo "gpu_check_adapt: installing the project into .venv-gpu (torch with CUDA from PyPI)" >&2
        [ -x .venv-gpu/bin/python ] || "$PY" -m venv .venv-gpu
        .venv-gpu/bin/python -m pip install -q --upgrade pip
        .venv-gpu/bin/python -m pip install -q "torch>=2.4" || { echo "gpu_check_adapt: pip install torch failed (offline?)" >&2; exit 2; }
        .venv-gpu/bin/python -m pip install -q -e . || { echo "gpu_check_adapt: pip install -e . failed" >&2; exit 2; }
    fi
    PY=.venv-gpu/bin/python
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec "$PY" - <<'EOF'
import json
import os
import tempfile
import time
from pathlib import Path

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from interventions.adapt import VisionSpec, build_vlm, from_dict
from interventions.adapt import data
from interventions.adapt.estimate import estimate
from interventions.adapt.trainer import train_stage
from interventions.adapt.trajectory import SinkProbe, TrajectoryCallback
from sinkstudy.tiny import train_bpe_tokenizer

SMOKE = os.environ.get("GPU_CHECK_SMOKE") == "1"
assert SMOKE or torch.cuda.is_available(), "no CUDA device"
device = "cpu" if SMOKE else "cuda"
t0 = time.perf_counter()
tok = train_bpe_tokenizer(vocab_size=512)  # a local tokenizer: ids < 512 of the 151,936-row vocabulary
shape = dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2,
             vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=32768, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
             bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
tower = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16, image_size=336, patch_size=14)
batch, micro, steps, every = 128, 16, 20, 10
if SMOKE:
    shape.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=1024)
    tower.update(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28)
    batch, micro, steps, every = 4, 2, 2, 1
with torch.device(device):
    torch.manual_seed(0)
    base = Qwen2ForCausalLM(Qwen2Config(**shape))
    built = build_vlm(base, tok, VisionSpec("tiny", tiny=tower))
del base
vlm = built.model
n_params = sum(p.numel() for p in vlm.parameters())
print(f"built LLaVA(Qwen2.5-3B shape + CLIP-L/336 shape): {n_params / 1e9:.3f} B parameters, "
      f"{built.report['image_tokens_per_image']} image tokens, {time.perf_counter() - t0:.0f} s", flush=True)

config = from_dict({"precision": "fp32" if SMOKE else "bf16", "gradient_checkpointing": True, "seed": 0, "log_every": 1,
                    "dataloader_workers": 0 if SMOKE else 4, "trajectory": {"every": every},
                    "stages": [{"name": "stage2", "data": ["digits"], "trainable": ["projector", "lm"], "lr": 2e-5,
                                "schedule": "cosine", "batch_size": batch, "micro_batch_size": micro, "steps": steps}]})
stage = config.stages[0]
encoder = data.Encoder(built.tokenizer, processor=built.processor, image_token=built.image_token, max_length=2048)
dataset = data.EncodedDataset([data.load_records("digits")], encoder)


class TimedProbe(SinkProbe):
    seconds = 0.0

    def __call__(self, model):
        t = time.perf_counter()
        try:
            return super().__call__(model)
        finally:
            TimedProbe.seconds += time.perf_counter() - t


work = Path(tempfile.mkdtemp(prefix="gpu-check-adapt-"))
probe = TimedProbe(built.tokenizer, config.trajectory)
callback = TrajectoryCallback(probe, work / "trajectory.json", stage="stage2", offset=0, every=every)
if not SMOKE:
    torch.cuda.reset_peak_memory_stats()
stats = train_stage(vlm, stage, config, dataset, collate_fn=lambda f: data.collate(f, built.tokenizer.pad_token_id),
                    work_dir=work / "stage2", tokenizer=built.tokenizer, callbacks=[callback], progress=True)
train_s = stats["seconds"] - TimedProbe.seconds
points = json.loads((work / "trajectory.json").read_text())["points"]
peak = 0.0 if SMOKE else torch.cuda.max_memory_allocated() / 2**30
print(f"\n{'CPU smoke run' if SMOKE else torch.cuda.get_device_name()}: {stats['steps']} steps in {train_s:.1f} s of training "
      f"(+ {TimedProbe.seconds:.1f} s for {len(points)} trajectory points)")
print(f"tokens/s (non-padding, training only): {stats['tokens'] / train_s:,.0f}; steps/s: {stats['steps'] / train_s:.3f}; "
      f"tokens per step: {stats['tokens'] / stats['steps']:,.0f}")
print(f"peak GPU memory (torch allocated): {peak:.1f} GiB; loss {stats['losses'][0]:.3f} -> {stats['final_loss']:.3f}")
for p in points:
    print(f"S at step {p['step']:>3}: {p['sink_strength']:+.3f} (mean sink mass {p['mean_sink_mass']:.3f})")
est = estimate(Qwen2Config(**shape), VisionSpec("tiny", tiny=tower), config, tokens_per_example=stats["tokens"] // (stats["steps"] * batch))
s = est["stages"][0]
print(f"estimate for the same shape: {s['memory_gb']['total']:.1f} GB, {s['seconds_per_step']:.2f} s/step "
      f"(measured {train_s / stats['steps']:.2f} s/step, {peak * 2**30 / 1e9:.1f} GB)")
print(f"total {time.perf_counter() - t0:.0f} s")
EOF
