"""Benchmark: the engine's label-only logits vs the standard full-logit loss, one training step on CPU.

    python -m benchmarks.adapt_loss [--vocab 32000 151936 262144] [--threads 1]

Each (loss, vocabulary) case runs in a fresh subprocess (peak memory = peak resident set during the
measured step minus the resident set before it, as `benchmarks.sink_pass` measures). A step = forward +
backward of a small Qwen2 (d=64, 2 layers) on 4 chats of 256 tokens whose last 15% are assistant
targets (LLaVA-like: most tokens are prompt and image). Time: best of `--repeat` after a warm-up.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from sinkstudy.memory import PeakRSS
from sinkstudy.tiny import tiny_causal_lm

BATCH, LENGTH, ANSWER_SHARE = 4, 256, 0.15


def run_case(loss: str, vocab: int, repeat: int) -> dict:
    # lazy: loads torch, transformers, datasets
    import torch
    from interventions.adapt.trainer import label_only_loss

    model = tiny_causal_lm("qwen2", vocab_size=vocab).train()
    ids = torch.randint(8, vocab, (BATCH, LENGTH), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[:, : int(LENGTH * (1 - ANSWER_SHARE))] = -100
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

    def step():
        model.zero_grad(set_to_none=True)
        out = label_only_loss(model, batch, labels)[0] if loss == "label-only" else model(**batch, labels=labels).loss
        out.backward()
        return float(out)

    step()  # warm-up
    times, peak_kb, value = [], 0, None
    for _ in range(repeat):
        with PeakRSS() as peak:
            t0 = time.perf_counter()
            value = step()
            times.append(time.perf_counter() - t0)
        peak_kb = max(peak_kb, peak.kib)
    return {"loss": loss, "vocab": vocab, "time_s": min(times), "peak_mib": peak_kb / 1024, "value": value, "peak_exact": peak.exact}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.adapt_loss", description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, nargs="+", default=[32000, 151936, 262144])
    parser.add_argument("--threads", type=int, default=1, help="torch threads per case (1 = stable on shared CPUs)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--case", nargs=2, metavar=("LOSS", "VOCAB"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.case:
        # lazy: loads torch, numpy
        import torch

        torch.set_num_threads(args.threads)
        print(json.dumps(run_case(args.case[0], int(args.case[1]), args.repeat)))
        return 0
    print(f"one training step: qwen2 d=64 x 2 layers, batch {BATCH} x {LENGTH} tokens, {int(ANSWER_SHARE * 100)}% targets, "
          f"float32, CPU, {args.threads} thread(s)")
    print(f"{'vocab':>8} {'label-only s':>13} {'full s':>8} {'speed-up':>9} {'label MiB':>10} {'full MiB':>9} {'mem ratio':>10} {'|loss diff|':>12}")
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    for vocab in args.vocab:
        res = {}
        for loss in ("label-only", "full"):
            out = subprocess.run([sys.executable, "-m", "benchmarks.adapt_loss", "--case", loss, str(vocab), "--threads",
                                  str(args.threads), "--repeat", str(args.repeat)], capture_output=True, text=True, env=env)
            if out.returncode != 0:
                print(out.stderr[-2000:], file=sys.stderr)
                return 1
            res[loss] = json.loads(out.stdout.strip().splitlines()[-1])
        a, b = res["label-only"], res["full"]
        print(f"{vocab:>8} {a['time_s']:>13.3f} {b['time_s']:>8.3f} {b['time_s'] / a['time_s']:>8.1f}x {a['peak_mib']:>10.1f} "
              f"{b['peak_mib']:>9.1f} {b['peak_mib'] / max(a['peak_mib'], 0.1):>9.1f}x {abs(a['value'] - b['value']):>12.2e}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
