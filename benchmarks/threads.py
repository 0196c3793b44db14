"""Benchmark: compute threads on a shared machine (sinkstudy/threads.py). Training steps of a randomly initialised
model on 1 and 2 threads, alone and beside a second job (another process running the same steps on one thread),
with OpenMP's idle threads sleeping (OMP_WAIT_POLICY=PASSIVE, sinkstudy's default) or spinning (ACTIVE).

    python -m benchmarks.threads [--steps 2] [--shape 135M|demo]   (make bench-threads; QUICK=1: demo shape)

Each case runs in a fresh process (OpenMP reads its settings when it loads) after one warm-up step. Printed:
seconds per step per case, then the ratios to read: 2 threads against 1 alone and beside the job, beside the job
against alone, spinning against sleeping beside the job. The machine's other load moves every figure: compare only
the cases of one run, and run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.numerics import SHAPES

ROOT = Path(__file__).resolve().parents[1]  # the checkout: `python -m benchmarks.X` runs from it
CASES = [(1, "PASSIVE", False), (2, "PASSIVE", False), (1, "PASSIVE", True), (2, "PASSIVE", True), (1, "ACTIVE", True),
         (2, "ACTIVE", True)]  # (threads, wait policy, beside a second job)


def _env(threads: int, policy: str) -> dict:
    return {**os.environ, "OMP_WAIT_POLICY": policy, **{k: str(threads) for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}}


def _one(shape: str, steps: int, threads: int, policy: str) -> float:
    done = subprocess.run([sys.executable, "-m", "benchmarks.threads", "--one-process", shape, str(steps)],
                          env=_env(threads, policy), cwd=ROOT, check=True, capture_output=True, text=True)
    return float(done.stdout.split()[-1])


def _case(shape: str, steps: int, threads: int, policy: str, busy: bool) -> float:
    job = subprocess.Popen([sys.executable, "-m", "benchmarks.threads", "--one-process", shape, "0"],
                           env=_env(1, "PASSIVE"), cwd=ROOT, stdout=subprocess.DEVNULL) if busy else None
    try:
        return _one(shape, steps, threads, policy)
    finally:
        if job is not None:
            job.kill()
            job.wait()


def _time_steps(shape: str, steps: int) -> float:
    """In this process: seconds per training step (after a warm-up step); `steps` 0: steps until killed (the job)."""
    # lazy: loads torch, transformers, numpy
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    layers, width, mlp, heads, kv, vocab, batch, tokens = SHAPES[shape]
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=width, intermediate_size=mlp, num_hidden_layers=layers,
                                         num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab,
                                         tie_word_embeddings=True))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, vocab, (batch, tokens), generator=torch.Generator().manual_seed(0))
    times, k = [], 0
    while steps == 0 or k <= steps:
        t0 = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
        k += 1
    return sum(times[1:]) / steps


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=2, help="timed training steps per case (default 2)")
    p.add_argument("--shape", choices=sorted(SHAPES), default="135M", help="the model's shape (benchmarks.numerics.SHAPES; default 135M)")
    p.add_argument("--one-process", nargs=2, metavar=("SHAPE", "STEPS"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one_process:
        print(f"{_time_steps(args.one_process[0], int(args.one_process[1])):.4f}")
        return 0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(f"{args.shape}-shaped training steps, {args.steps} per case; {cores} usable cores; load average "
          f"{os.getloadavg()[0]:.2f} at the start")
    seconds = {}
    for threads, policy, busy in CASES:
        seconds[threads, policy, busy] = s = _case(args.shape, args.steps, threads, policy, busy)
        print(f"  {threads} thread(s), {policy:<7} {'beside a second job' if busy else 'alone':<20} {s:8.3f} s/step", flush=True)

    def ratio(a, b) -> str:
        return f"{seconds[a] / seconds[b]:.2f}"

    print("ratios (time / time):")
    print(f"  2 vs 1 thread(s), alone:                  {ratio((2, 'PASSIVE', False), (1, 'PASSIVE', False))}")
    print(f"  2 vs 1 thread(s), beside a job:           {ratio((2, 'PASSIVE', True), (1, 'PASSIVE', True))}")
    for n in (1, 2):
        print(f"  beside a job vs alone, {n} thread(s):       {ratio((n, 'PASSIVE', True), (n, 'PASSIVE', False))}")
        print(f"  spinning vs sleeping beside a job, {n} thr.: {ratio((n, 'ACTIVE', True), (n, 'PASSIVE', True))}")
    print(f"load average {os.getloadavg()[0]:.2f} at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
