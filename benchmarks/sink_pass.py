"""Benchmark: the fast sink pass against HF's eager `output_attentions=True` forward (the peer) and a
plain SDPA forward (the floor): time and peak memory on CPU, as ratios measured in the same run.

    python -m benchmarks.sink_pass [--lengths 512 1024 2048 4096] [--threads 1] [--repeat 2] [--quick]

Three configurations per sequence length T, all the decoder (`model.base_model`) on the same ids:
  fast   `capture_layer_stats(method="fast")`: every layer's sink statistics, SDPA for the outputs
  eager  transformers' eager attention with `output_attentions=True`: what one runs to read sinks
         off HF's attention maps (the maps only; no statistics computed from them)
  sdpa   the same forward with SDPA and nothing captured: the floor a sink pass can reach
Each (configuration, T) runs in a fresh subprocess and prints one progress line as it finishes:
peak memory is the process's peak resident set size during the measured call minus its resident
size just before it (Linux: VmHWM reset through /proc/self/clear_refs; elsewhere ru_maxrss), so
torch's allocations are all counted. Time is the best of `--repeat` calls after a warm-up call on a
short sequence. `--quick` (CI): T = 128 and 256, one call each.
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

MODEL = dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
             head_dim=32, max_position_embeddings=8192)
VOCAB = 1024
LENGTHS = (512, 1024, 2048, 4096)
QUICK_LENGTHS = (128, 256)
METHODS = {"fast": "fast sink pass", "eager": "HF eager output_attentions", "sdpa": "plain SDPA forward (floor)"}


def _forward(method: str, model, ids, mask):
    """One call of configuration `method`; returns what it produced (kept alive until measured)."""
    # lazy: loads torch, numpy
    from evals.sink.capture import _attn_implementation, capture_layer_stats

    if method == "fast":
        return capture_layer_stats(model, input_ids=ids, attention_mask=mask, method="fast")
    position_ids = (mask.long().cumsum(-1) - 1).clamp(min=0)  # as the sink pass positions them
    inputs = dict(input_ids=ids, attention_mask=mask, position_ids=position_ids, use_cache=False)
    with _attn_implementation(model, "eager" if method == "eager" else "sdpa"):
        out = model.base_model(**inputs, output_attentions=method == "eager")
    if method == "eager" and len(out.attentions) != len(model.base_model.layers):
        raise RuntimeError("eager forward returned no attention maps")
    return out


def run_case(method: str, length: int, repeat: int) -> dict:
    # lazy: loads torch, numpy
    import torch

    if method not in METHODS:
        raise ValueError(f"unknown configuration {method!r}; choose {', '.join(METHODS)}")
    model = tiny_causal_lm("llama", vocab_size=VOCAB, **MODEL)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(8, VOCAB, (1, length), generator=gen)
    mask = torch.ones_like(ids)
    with torch.no_grad():
        _forward(method, model, ids[:, :32], mask[:, :32])  # warm-up
        times = []
        peak_kb = None
        for _ in range(repeat):
            with PeakRSS() as peak:
                t0 = time.perf_counter()
                result = _forward(method, model, ids, mask)
                times.append(time.perf_counter() - t0)
            peak_kb = max(peak_kb or 0, peak.kib)
            del result
    return {"method": method, "length": length, "time_s": min(times), "peak_mib": peak_kb / 1024,
            "peak_exact": peak.exact, "threads": torch.get_num_threads()}


def _ratio(a: float, b: float, floor: float = 0.0) -> str:
    return f"{a / max(b, floor):.1f}x" if max(b, floor) > 0 else "n/a"


def format_table(rows: dict[int, dict[str, dict]]) -> str:
    """Per T: the three times and peaks, and the two ratios of the fast pass (peer / fast, fast / floor)."""
    head = (f"{'T':>6} | {'fast s':>8} {'eager s':>8} {'sdpa s':>8} {'eager/fast':>11} {'fast/sdpa':>10} | "
            f"{'fast MiB':>9} {'eager MiB':>10} {'sdpa MiB':>9} {'eager/fast':>11} {'fast/sdpa':>10}")
    lines = [head, "-" * len(head)]
    for length, r in rows.items():
        f, e, s = r["fast"], r["eager"], r["sdpa"]
        # Peaks under 0.1 MiB are page-granularity noise: ratios use 0.1 MiB as their floor.
        lines.append(f"{length:>6} | {f['time_s']:>8.3f} {e['time_s']:>8.3f} {s['time_s']:>8.3f} "
                     f"{_ratio(e['time_s'], f['time_s']):>11} {_ratio(f['time_s'], s['time_s']):>10} | "
                     f"{f['peak_mib']:>9.1f} {e['peak_mib']:>10.1f} {s['peak_mib']:>9.1f} "
                     f"{_ratio(e['peak_mib'], f['peak_mib'], 0.1):>11} {_ratio(f['peak_mib'], s['peak_mib'], 0.1):>10}")
    lines.append("eager/fast: how many times faster / leaner the sink pass is than HF's eager output_attentions forward; "
                 "fast/sdpa: its cost over a plain SDPA forward (1.0x = free). Ratios from this run only.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sink_pass", description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=None, help=f"sequence lengths (default {' '.join(map(str, LENGTHS))})")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per case (1 = stable on shared CPUs)")
    parser.add_argument("--repeat", type=int, default=None, help="timed calls per case, best kept (default 2; --quick 1)")
    parser.add_argument("--quick", action="store_true", help=f"CI: T = {' '.join(map(str, QUICK_LENGTHS))}, one call each")
    parser.add_argument("--case", nargs=2, metavar=("METHOD", "T"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    repeat = args.repeat or (1 if args.quick else 2)
    if args.case:
        # lazy: loads torch, numpy
        import torch

        torch.set_num_threads(args.threads)
        print(json.dumps(run_case(args.case[0], int(args.case[1]), repeat)))
        return 0
    lengths = args.lengths or list(QUICK_LENGTHS if args.quick else LENGTHS)
    print(f"model: llama {MODEL['num_hidden_layers']} layers, d={MODEL['hidden_size']}, {MODEL['num_attention_heads']} heads "
          f"({MODEL['num_key_value_heads']} KV), float32, CPU, {args.threads} thread(s); best of {repeat} call(s); "
          f"each case in its own process", flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    rows: dict[int, dict[str, dict]] = {}
    total, done = len(lengths) * len(METHODS), 0
    for length in lengths:
        for method, what in METHODS.items():
            out = subprocess.run([sys.executable, "-m", "benchmarks.sink_pass", "--case", method, str(length),
                                  "--threads", str(args.threads), "--repeat", str(repeat)],
                                 capture_output=True, text=True, env=env)
            if out.returncode != 0:
                print(out.stderr[-2000:], file=sys.stderr)
                return 1
            res = rows.setdefault(length, {})[method] = json.loads(out.stdout.strip().splitlines()[-1])
            done += 1
            print(f"[{done:>2}/{total}] T={length:<5} {method:<5} ({what}): {res['time_s']:.3f} s, "
                  f"peak {res['peak_mib']:.1f} MiB", flush=True)
    print(format_table(rows))
    if not all(r["peak_exact"] for case in rows.values() for r in case.values()):
        print("note: /proc/self/clear_refs unavailable; peaks are process-lifetime ru_maxrss deltas")
    return 0


if __name__ == "__main__":
    sys.exit(main())
