"""Benchmark: what the reproducible numeric mode costs against the native one (sinkstudy/numerics.py), both
measured in this run, alternating, on this machine.

    python -m experiments.demo.bench_numerics [--repeats 1] [--skip-demo] [--steps 3]   (make bench-numerics)

Two workloads, each in a fresh process per mode:
  demo --quick   `sinkstudy demo --quick` from nothing (empty output and cache, so no step is reused): tiny
                 models, where per-step overheads weigh as much as the arithmetic; wall seconds in all and per stage
  135M step      training steps (forward, backward, AdamW) of a randomly initialised model of SmolLM2-135M's
                 shape (30 layers, width 576, 49,152-token vocabulary) on batch 4 x 128 tokens: the matrix
                 products of a real backbone; seconds per step after one warm-up step
The ratio reproducible / native is the figure to read. The load average is printed beside it: on a shared
machine, compare only the two modes of one run.
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

ROOT = Path(__file__).resolve().parents[2]
MODES = ("native", "reproducible")


def _demo(mode: str, work: Path) -> dict:
    out, cache = work / f"demo-{mode}", work / f"cache-{mode}"
    env = {k: v for k, v in os.environ.items() if k != "SINKSTUDY_NUMERICS"}
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "experiments.cli", "demo", "--quick", "--quiet", "--numerics", mode, "--out", str(out)],
                   env={**env, "SINKSTUDY_CACHE": str(cache)}, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    seconds = time.perf_counter() - t0
    stages = json.loads((out / "summary.json").read_text())["timings"]
    return {"seconds": seconds, "stages": stages}


def _steps(mode: str, steps: int) -> float:
    from sinkstudy.numerics import pinned_environment

    env = {k: v for k, v in os.environ.items() if k != "SINKSTUDY_NUMERICS"}
    if mode == "reproducible":
        env = pinned_environment(env)
    else:
        env["SINKSTUDY_NUMERICS"] = "native"
    done = subprocess.run([sys.executable, "-m", "experiments.demo.bench_numerics", "--one-process", str(steps)], env=env,
                          cwd=ROOT, check=True, capture_output=True, text=True)
    return float(done.stdout.split()[-1])


def _time_steps(steps: int) -> float:
    """In this process: seconds per training step of the 135M-shaped model (after one warm-up step)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from sinkstudy.numerics import configure_torch

    configure_torch()
    if os.environ.get("SINKSTUDY_NUMERICS") == "native":
        torch.set_num_threads(1)  # the reproducible mode's one thread: the comparison is of kernels, not of cores
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                                         num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 49152, (4, 128), generator=torch.Generator().manual_seed(0))
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
    p.add_argument("--steps", type=int, default=3, help="timed training steps of the 135M-shaped model (default 3)")
    p.add_argument("--skip-demo", action="store_true", help="only the 135M training step")
    p.add_argument("--one-process", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one_process is not None:
        print(f"{_time_steps(args.one_process):.4f}")
        return 0
    print(f"load average at the start: {' '.join(f'{x:.1f}' for x in os.getloadavg())} ({os.cpu_count()} cores)", flush=True)
    demo: dict[str, list[dict]] = {m: [] for m in MODES}
    step: dict[str, list[float]] = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory(prefix="bench-numerics-") as tmp:
        for r in range(args.repeats):
            order = MODES if r % 2 == 0 else MODES[::-1]  # alternate which mode goes first
            for mode in order:
                step[mode].append(_steps(mode, args.steps))
                print(f"135M step, {mode}: {step[mode][-1]:.2f} s", flush=True)
            if not args.skip_demo:
                for mode in order:
                    work = Path(tmp) / f"r{r}"
                    demo[mode].append(_demo(mode, work))
                    print(f"demo --quick, {mode}: {demo[mode][-1]['seconds']:.1f} s", flush=True)
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    print(f"load average at the end: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print("| workload | native | reproducible | ratio (reproducible / native) |\n|---|---|---|---|")
    n, r = mean(step["native"]), mean(step["reproducible"])
    print(f"| 135M-shaped training step, 1 thread (s/step) | {n:.2f} | {r:.2f} | {r / n:.2f} |")
    if not args.skip_demo:
        n, r = mean([d["seconds"] for d in demo["native"]]), mean([d["seconds"] for d in demo["reproducible"]])
        print(f"| sinkstudy demo --quick, cold (s) | {n:.1f} | {r:.1f} | {r / n:.2f} |")
        for stage in demo["native"][0]["stages"]:
            n = mean([d["stages"].get(stage, 0) for d in demo["native"]])
            r = mean([d["stages"].get(stage, 0) for d in demo["reproducible"]])
            if n:
                print(f"| demo stage {stage} (step-seconds) | {n:.1f} | {r:.1f} | {r / n:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
