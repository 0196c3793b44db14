"""Benchmark: what the reproducible numeric mode, and the numeric spread's second mode (native-aten-default),
cost against the native one (sinkstudy/numerics.py), all measured in this run, alternating, on this machine.

    python -m benchmarks.numerics [--repeats 1] [--skip-demo] [--steps 3]   (make bench-numerics)

Three workloads, each in a fresh process per mode:
  demo step      training steps of a demo backbone (Qwen2, 4 layers, width 128, 1,024-token vocabulary) on
                 batch 16 x 160 tokens, what the full demo's pretraining and VL stages repeat; s per step
  135M step      training steps (forward, backward, AdamW) of a randomly initialised model of SmolLM2-135M's
                 shape (30 layers, width 576, 49,152-token vocabulary) on batch 4 x 128 tokens: the matrix
                 products of a real backbone; seconds per step after one warm-up step
  demo --quick   `sinkstudy demo --quick` from nothing (empty output and cache, so no step is reused): tiny
                 models, where per-step overheads weigh as much as the arithmetic; wall seconds in all and per stage
The ratios to native are the figures to read. The load average is printed beside them: on a shared
machine, compare only the modes of one run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from sinkstudy.numerics import configure_torch, environment_for

ROOT = Path(__file__).resolve().parents[1]  # the checkout: `python -m benchmarks.X` runs from it
MODES = ("native", "native-aten-default", "reproducible")
# (layers, width, MLP width, heads, kv heads, vocabulary, batch, tokens) per training-step workload
SHAPES = {"demo": (4, 128, 384, 4, 2, 1024, 16, 160), "135M": (30, 576, 1536, 9, 3, 49152, 4, 128)}


def _demo(mode: str, work: Path) -> dict:
    out, cache = work / f"demo-{mode}", work / f"cache-{mode}"
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "experiments.cli", "demo", "--quick", "--quiet", "--numerics", mode, "--out", str(out)],
                   env={**environment_for(mode, dict(os.environ)), "SINKSTUDY_CACHE": str(cache)}, cwd=ROOT, check=True,
                   stdout=subprocess.DEVNULL)
    seconds = time.perf_counter() - t0
    stages = json.loads((out / "summary.json").read_text())["timings"]
    return {"seconds": seconds, "stages": stages}


def _steps(mode: str, shape: str, steps: int) -> float:
    done = subprocess.run([sys.executable, "-m", "benchmarks.numerics", "--one-process", shape, str(steps)],
                          env=environment_for(mode, dict(os.environ)), cwd=ROOT, check=True, capture_output=True, text=True)
    return float(done.stdout.split()[-1])


def _time_steps(shape: str, steps: int) -> float:
    """In this process: seconds per training step of the `shape` model (after one warm-up step)."""
    # lazy: loads torch, transformers, numpy
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    configure_torch()
    torch.set_num_threads(1)  # the reproducible mode's one thread in every mode: the comparison is of kernels, not of cores
    layers, width, mlp, heads, kv, vocab, batch, tokens = SHAPES[shape]
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=width, intermediate_size=mlp, num_hidden_layers=layers,
                                         num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab,
                                         tie_word_embeddings=True))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, vocab, (batch, tokens), generator=torch.Generator().manual_seed(0))
    times = []
    for _ in range(steps + 1):
        t0 = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
    return sum(times[1:]) / steps


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=1, help="alternating runs per mode (default 1)")
    p.add_argument("--steps", type=int, default=3, help="timed training steps of each model shape (default 3)")
    p.add_argument("--skip-demo", action="store_true", help="only the training steps, not demo --quick")
    p.add_argument("--one-process", nargs=2, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one_process is not None:
        shape, steps = args.one_process
        print(f"{_time_steps(shape, int(steps)):.4f}")
        return 0
    print(f"load average at the start: {' '.join(f'{x:.1f}' for x in os.getloadavg())} ({os.cpu_count()} cores)", flush=True)
    demo: dict[str, list[dict]] = {m: [] for m in MODES}
    step: dict[tuple[str, str], list[float]] = {(s, m): [] for s in SHAPES for m in MODES}
    with tempfile.TemporaryDirectory(prefix="bench-numerics-") as tmp:
        for r in range(args.repeats):
            order = MODES if r % 2 == 0 else MODES[::-1]  # alternate which mode goes first
            for shape in SHAPES:
                for mode in order:
                    step[shape, mode].append(_steps(mode, shape, args.steps))
                    print(f"{shape} step, {mode}: {step[shape, mode][-1]:.2f} s", flush=True)
            if not args.skip_demo:
                for mode in order:
                    work = Path(tmp) / f"r{r}"
                    demo[mode].append(_demo(mode, work))
                    print(f"demo --quick, {mode}: {demo[mode][-1]['seconds']:.1f} s", flush=True)
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    print(f"load average at the end: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print("| workload | " + " | ".join(MODES) + " | " + " | ".join(f"{m} / native" for m in MODES[1:]) + " |")
    print("|---" * (1 + 2 * len(MODES) - 1) + "|")

    def row(name: str, values: dict[str, float], fmt: str) -> None:
        print(f"| {name} | " + " | ".join(format(values[m], fmt) for m in MODES) + " | "
              + " | ".join(f"{values[m] / values['native']:.2f}" if values["native"] else "n/a" for m in MODES[1:]) + " |")

    for shape in SHAPES:
        row(f"{shape}-shaped training step, 1 thread (s/step)", {m: mean(step[shape, m]) for m in MODES}, ".2f")
    if not args.skip_demo:
        row("sinkstudy demo --quick, cold (s)", {m: mean([d["seconds"] for d in demo[m]]) for m in MODES}, ".1f")
        for stage in demo["native"][0]["stages"]:
            row(f"demo stage {stage} (step-seconds)", {m: mean([d["stages"].get(stage, 0) for d in demo[m]]) for m in MODES}, ".1f")
    return 0


if __name__ == "__main__":
    sys.exit(main())
