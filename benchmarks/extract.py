"""Benchmark: streamed language-model extraction vs the full-VLM load, peak memory and time on CPU.

    python -m benchmarks.extract [--layers 16] [--workdir DIR] [--max-shard-size-mb 1024]

Builds a random-weight, Qwen2.5-VL-shaped VLM of >= 1B parameters in bfloat16, saved in several shards,
then extracts its language model twice, each time in a fresh subprocess: the streamed path
(`plan_extraction` + `write_language_model`) and the old path (load the whole VLM with
`from_pretrained`, extract in memory, `save_pretrained`). Peak memory is the subprocess's peak resident
set size (VmHWM, which counts memory-mapped file pages it touched), printed as a ratio to the language
model's bytes in the checkpoint dtype; "above start" subtracts the resident size after imports. The
model and outputs are deleted at the end unless --keep.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from interventions.pairs import extract_language_model, plan_extraction, save_causal_lm, write_language_model
from sinkstudy.checkpoint import weight_files
from sinkstudy.memory import rss_kib

TEXT = dict(hidden_size=1536, intermediate_size=8960, num_attention_heads=12, num_key_value_heads=2,
            vocab_size=151936, max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=False)
VISION = dict(depth=4, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=1536, patch_size=14,
              spatial_merge_size=2, temporal_patch_size=2, window_size=112, fullatt_block_indexes=[3])


def vlm_config(layers: int):
    # lazy: loads transformers, numpy, PIL
    from transformers import Qwen2_5_VLConfig

    rope = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]}  # sums to head_dim / 2 = 64
    text = dict(TEXT, num_hidden_layers=layers, rope_parameters=rope)
    return Qwen2_5_VLConfig(text_config=text, vision_config=VISION, tie_word_embeddings=False)


def base_config(layers: int):
    # lazy: loads transformers, numpy, PIL
    from transformers import Qwen2Config

    return Qwen2Config(**TEXT, num_hidden_layers=layers, rope_parameters={"rope_type": "default", "rope_theta": 1e6})


def build(path: Path, layers: int, shard_mb: int) -> dict:
    """Save a random bf16 VLM in shards; returns its parameter counts."""
    # lazy: loads torch, transformers, numpy
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(vlm_config(layers)).to(torch.bfloat16)
    total = sum(p.numel() for p in model.parameters())
    lm = sum(p.numel() for p in model.get_decoder().parameters()) + model.lm_head.weight.numel()
    model.save_pretrained(path, max_shard_size=f"{shard_mb}MB")
    return {"params": total, "lm_params": lm}


def streamed(vlm: Path, out: Path, layers: int, shard_mb: int) -> None:
    write_language_model(plan_extraction(vlm, base_config(layers)), out, max_shard_bytes=shard_mb << 20)


def full_load(vlm: Path, out: Path, layers: int, shard_mb: int) -> None:
    """The pre-streaming path: the whole VLM (vision tower included) in memory, then the LM saved."""
    # lazy: loads torch, transformers, numpy
    import torch
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(vlm, dtype=torch.bfloat16)
    lm, _ = extract_language_model(model, base_config(layers), dtype=torch.bfloat16)
    save_causal_lm(lm, None, out)


def run_case(path: str, vlm: str, out: str, layers: int, shard_mb: int) -> dict:
    # lazy: loads torch, numpy
    import torch

    torch.set_num_threads(1)
    start = rss_kib("VmRSS")
    t0 = time.perf_counter()
    {"streamed": streamed, "full_load": full_load}[path](Path(vlm), Path(out), layers, shard_mb)
    return {"path": path, "seconds": time.perf_counter() - t0, "peak_kib": rss_kib("VmHWM"), "start_kib": start}


def lm_bytes(out: Path) -> int:
    return sum(t.nbytes for t in weight_files(out).tensors.values())


def _subprocess(*args: str) -> dict:
    proc = subprocess.run([sys.executable, "-m", "benchmarks.extract", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"benchmark step failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.extract", description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=16, help="text layers (16: 1.2B-parameter language model)")
    parser.add_argument("--max-shard-size-mb", type=int, default=1024, help="shard size of the VLM and the outputs")
    parser.add_argument("--workdir", help="where to build the model (default: a temp dir; needs ~8 GB free)")
    parser.add_argument("--keep", action="store_true", help="keep the built VLM and outputs")
    parser.add_argument("--build", metavar="DIR", help=argparse.SUPPRESS)
    parser.add_argument("--case", nargs=3, metavar=("PATH", "VLM", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.build:
        print(json.dumps(build(Path(args.build), args.layers, args.max_shard_size_mb)))
        return 0
    if args.case:
        print(json.dumps(run_case(*args.case, args.layers, args.max_shard_size_mb)))
        return 0

    work = Path(args.workdir or tempfile.mkdtemp(prefix="sinkstudy-bench-extract-"))
    common = ["--layers", str(args.layers), "--max-shard-size-mb", str(args.max_shard_size_mb)]
    try:
        t0 = time.perf_counter()
        sizes = _subprocess("--build", str(work / "vlm"), *common)
        shards = len(list((work / "vlm").glob("*.safetensors")))
        print(f"built a random bf16 Qwen2.5-VL-shaped VLM: {sizes['params'] / 1e9:.2f}B parameters "
              f"({sizes['lm_params'] / 1e9:.2f}B language model), {shards} shards, {time.perf_counter() - t0:.0f} s")
        rows = []
        for path in ("streamed", "full_load"):
            out = work / f"lm-{path}"
            rows.append(_subprocess("--case", path, str(work / "vlm"), str(out), *common))
            rows[-1]["lm_bytes"] = lm_bytes(out)
            if not args.keep:
                shutil.rmtree(out)  # disk: each output is the size of the language model
        lm = rows[0]["lm_bytes"]
        print(f"language model: {lm / 2**30:.2f} GiB in bfloat16; output shards <= {args.max_shard_size_mb} MiB")
        print(f"{'path':<11}{'time s':>8}{'peak GiB':>10}{'peak / LM':>11}{'above start / LM':>18}")
        for r in rows:
            peak, start = r["peak_kib"] * 1024, r["start_kib"] * 1024
            print(f"{r['path']:<11}{r['seconds']:>8.1f}{peak / 2**30:>10.2f}{peak / lm:>11.2f}{(peak - start) / lm:>18.2f}")
        s, f = rows
        print(f"streamed / full load: peak {s['peak_kib'] / f['peak_kib']:.2f}x, time {s['seconds'] / f['seconds']:.2f}x "
              f"(target: streamed peak / LM <= 1.1)")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
