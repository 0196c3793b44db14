"""Benchmark: fast sink pass vs eager `output_attentions=True`, time and peak memory on CPU.

    python -m evals.sink.bench [--lengths 256 1024 4096] [--threads 1]

Each (method, length) case runs in a fresh subprocess: peak memory is the process's peak resident
set size during the measured call minus its resident size just before it (Linux: VmHWM reset
through /proc/self/clear_refs; elsewhere ru_maxrss), so torch's allocations are all counted.
Time is the best of `--repeat` calls after one warm-up call on a short sequence.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

MODEL = dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
             head_dim=32, max_position_embeddings=8192)
VOCAB = 1024


def _rss_kb(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        return True
    except OSError:
        return False


def run_case(method: str, length: int, repeat: int) -> dict:
    import torch

    from evals.sink.capture import capture_layer_stats
    from sinkstudy.tiny import tiny_causal_lm

    model = tiny_causal_lm("llama", vocab_size=VOCAB, **MODEL)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(8, VOCAB, (1, length), generator=gen)
    mask = torch.ones_like(ids)
    capture_layer_stats(model, input_ids=ids[:, :32], attention_mask=mask[:, :32], method=method)  # warm-up
    times = []
    peak_kb = None
    for _ in range(repeat):
        exact = _reset_peak()
        before = _rss_kb("VmRSS") if exact else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        t0 = time.perf_counter()
        layers = capture_layer_stats(model, input_ids=ids, attention_mask=mask, method=method)
        times.append(time.perf_counter() - t0)
        after = _rss_kb("VmHWM") if exact else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        peak_kb = max(peak_kb or 0, after - before)
        del layers
    return {"method": method, "length": length, "time_s": min(times), "peak_mib": peak_kb / 1024,
            "peak_exact": exact, "threads": torch.get_num_threads()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m evals.sink.bench", description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--threads", type=int, default=1, help="torch threads per case (1 = stable on shared CPUs)")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--case", nargs=2, metavar=("METHOD", "T"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.case:
        import torch

        torch.set_num_threads(args.threads)
        print(json.dumps(run_case(args.case[0], int(args.case[1]), args.repeat)))
        return 0
    print(f"model: llama {MODEL['num_hidden_layers']} layers, d={MODEL['hidden_size']}, "
          f"{MODEL['num_attention_heads']} heads ({MODEL['num_key_value_heads']} KV), float32, CPU, {args.threads} thread(s)")
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    rows = []
    for length in args.lengths:
        res = {}
        for method in ("fast", "eager"):
            out = subprocess.run([sys.executable, "-m", "evals.sink.bench", "--case", method, str(length),
                                  "--threads", str(args.threads), "--repeat", str(args.repeat)],
                                 capture_output=True, text=True, env=env)
            if out.returncode != 0:
                print(out.stderr[-2000:], file=sys.stderr)
                return 1
            res[method] = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append(res)
        f, e = res["fast"], res["eager"]
        if len(rows) == 1:
            print(f"{'T':>6} {'fast s':>9} {'eager s':>9} {'speed-up':>9} {'fast MiB':>9} {'eager MiB':>10} {'mem ratio':>10}")
        print(f"{length:>6} {f['time_s']:>9.3f} {e['time_s']:>9.3f} {e['time_s'] / f['time_s']:>8.1f}x "
              f"{f['peak_mib']:>9.1f} {e['peak_mib']:>10.1f} {e['peak_mib'] / max(f['peak_mib'], 0.1):>9.1f}x", flush=True)
    if not all(r["fast"]["peak_exact"] for r in rows):
        print("note: /proc/self/clear_refs unavailable; peaks are process-lifetime ru_maxrss deltas")
    return 0


if __name__ == "__main__":
    sys.exit(main())
