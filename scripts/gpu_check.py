"""The measuring parts of scripts/gpu_check.sh (one CUDA GPU). Each sub-command prints one JSON
line the shell script puts in its closing table; none of this is a test dependency.

    python scripts/gpu_check.py sink [--lengths 512 2048 4096]   fast sink pass vs eager, 8B shape, bf16
        [--device cpu --small]                                  (the CPU smoke run: a 2-layer shape)
    python scripts/gpu_check.py tiny DIR [--hidden 256]          a small random Llama + tokenizer on disk
    python scripts/gpu_check.py same-outputs RUN_A RUN_B         per-prompt output agreement of two eval runs
    python scripts/gpu_check.py same-weights DIR_A DIR_B         max |a - b| over two checkpoints' tensors
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

# Qwen3-8B's shape (36 layers, d 4096, 32 query / 8 KV heads of 128, MLP 12288), random weights.
SHAPE_8B = dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, max_position_embeddings=8192, vocab_size=151936)
SHAPE_SMALL = dict(SHAPE_8B, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=64, vocab_size=4096)


def sink(lengths: list[int], repeat: int, device: str = "cuda", small: bool = False) -> dict:
    """Time and peak GPU memory of one sink-statistics pass, fast (SDPA + chunked log-sum-exp) vs
    eager output_attentions, per length; ratios eager / fast. On the CPU (the smoke run) the memory
    figures are 0: only the plumbing and the times are checked."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from evals.sink.capture import capture_layer_stats

    cuda = device.startswith("cuda")
    shape = SHAPE_SMALL if small else SHAPE_8B
    torch.manual_seed(0)
    config = AutoConfig.for_model("qwen3", **shape)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    weights_gib = torch.cuda.memory_allocated() / 2**30 if cuda else 0.0
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    rows = []
    for length in lengths:
        ids = torch.randint(8, shape["vocab_size"], (1, length), device=device)
        mask = torch.ones_like(ids)
        row = {"T": length}
        for method in ("fast", "eager"):
            capture_layer_stats(model, input_ids=ids[:, :64], attention_mask=mask[:, :64], method=method)  # warm-up
            sync()
            times = []
            for _ in range(repeat):
                if cuda:
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated() if cuda else 0
                t0 = time.perf_counter()
                layers = capture_layer_stats(model, input_ids=ids, attention_mask=mask, method=method)
                sync()
                times.append(time.perf_counter() - t0)
                peak = (torch.cuda.max_memory_allocated() - base) / 2**30 if cuda else 0.0
                del layers
            row[method] = {"seconds": min(times), "peak_gib": peak}
        row["time_ratio"] = row["eager"]["seconds"] / row["fast"]["seconds"]
        row["memory_ratio"] = row["eager"]["peak_gib"] / max(row["fast"]["peak_gib"], 1e-3)
        rows.append(row)
        print(f"T={length}: fast {row['fast']['seconds']:.3f} s {row['fast']['peak_gib']:.2f} GiB, eager "
              f"{row['eager']['seconds']:.3f} s {row['eager']['peak_gib']:.2f} GiB -> time x{row['time_ratio']:.1f}, "
              f"memory x{row['memory_ratio']:.1f}", file=sys.stderr, flush=True)
    return {"weights_gib": weights_gib, "device": torch.cuda.get_device_name() if cuda else device,
            "shape": "2-layer small shape" if small else "8B shape", "rows": rows}


def tiny(out: Path, hidden: int, layers: int, seed: int) -> dict:
    """A random Llama whose attention suits every vLLM backend (head_dim 128) + the local tokenizer."""
    from sinkstudy.tiny import tiny_causal_lm, train_bpe_tokenizer

    heads = max(hidden // 128, 1)
    model = tiny_causal_lm("llama", seed=seed, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                           num_attention_heads=heads, num_key_value_heads=heads, head_dim=128)
    model.save_pretrained(out)
    train_bpe_tokenizer().save_pretrained(out)
    return {"path": str(out), "parameters": sum(p.numel() for p in model.parameters())}


def same_outputs(a: Path, b: Path) -> dict:
    from evals.eval_run import EvalRun

    ra, rb = EvalRun.load(a), EvalRun.load(b)
    same = total = 0
    for task, rows in ra.samples.items():
        other = {s["doc_id"]: s for s in rb.samples.get(task, [])}
        for s in rows:
            if s["doc_id"] in other:
                total += 1
                same += s["output"] == other[s["doc_id"]]["output"]
    return {"same": same, "total": total, "scores_a": ra.scores, "scores_b": rb.scores}


def _tensors(folder: Path) -> dict:
    from safetensors.torch import load_file

    found = {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    if not found:
        sys.exit(f"same-weights: no *.safetensors in {folder}")
    return found


def same_weights(a: Path, b: Path, pair: tuple[Path, Path] | None = None, density: float | None = None) -> dict:
    """max |a - b| over two checkpoints' tensors. With the merged pair (BASE, VLM) and a TIES/magnitude density:
    where the merges differ, how far each element's |VLM - BASE| ranks from the tensor's top-k cut. Distance 0 is
    a tie that straddles the cut (equal |delta| kept by one merge, dropped by the other: a sort's tie-breaking);
    a small distance, a near-tie ranked differently; a large one, a difference the cut does not explain."""
    import torch

    ta, tb = _tensors(a), _tensors(b)
    if ta.keys() != tb.keys():
        return {"max_abs_diff": None, "note": "different tensor names"}
    differing = [k for k in ta if not torch.equal(ta[k], tb[k])]
    diff = max(((ta[k].double() - tb[k].double()).abs().max().item() for k in differing), default=0.0)
    out = {"max_abs_diff": diff, "tensors": len(ta), "bit_identical": not differing}
    if pair is not None and density is not None:
        base, vlm = _tensors(pair[0]), _tensors(pair[1])
        elements = at_cut = farthest = 0
        for k in differing:
            delta = (vlm[k].float() - base[k].float()).abs().reshape(-1)
            distance = _ranks_from_cut(delta, (ta[k] != tb[k]).reshape(-1), max(1, int(density * delta.numel())))
            elements += distance.numel()
            at_cut += int((distance == 0).sum())
            farthest = max(farthest, int(distance.max()))
        out.update(tensors_differing=differing[:8], n_tensors_differing=len(differing), elements_differing=elements,
                   differing_at_the_cut=at_cut, max_rank_distance_from_the_cut=farthest)
    return out


def _ranks_from_cut(delta, where, keep: int):
    """For each element of `delta` selected by `where`: 0 when its value's tie group straddles the top-`keep` cut,
    else the ranks between the group and the cut (ranks from the top, 0-based; kept: 0 .. keep - 1)."""
    import torch

    ascending = delta.sort().values
    values, n = delta[where], delta.numel()
    greater = n - torch.searchsorted(ascending, values, right=True)  # the group's first rank
    end = n - torch.searchsorted(ascending, values, right=False)  # one past its last rank
    return torch.where(end <= keep, keep - end + 1, torch.where(greater >= keep, greater - keep + 1, 0))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="scripts/gpu_check.py")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("sink")
    s.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 4096])
    s.add_argument("--repeat", type=int, default=2)
    s.add_argument("--device", default="cuda")
    s.add_argument("--small", action="store_true", help="a 2-layer shape (the CPU smoke run)")
    t = sub.add_parser("tiny")
    t.add_argument("out", type=Path)
    t.add_argument("--hidden", type=int, default=256)
    t.add_argument("--layers", type=int, default=2)
    t.add_argument("--seed", type=int, default=0)
    o = sub.add_parser("same-outputs")
    o.add_argument("a", type=Path)
    o.add_argument("b", type=Path)
    w = sub.add_parser("same-weights")
    w.add_argument("a", type=Path)
    w.add_argument("b", type=Path)
    w.add_argument("--pair", type=Path, nargs=2, metavar=("BASE", "VLM"), help="the merged pair: explain differences at the top-k cut")
    w.add_argument("--density", type=float)
    args = p.parse_args(argv)
    if args.cmd == "sink":
        out = sink(args.lengths, args.repeat, args.device, args.small)
    elif args.cmd == "tiny":
        out = tiny(args.out, args.hidden, args.layers, args.seed)
    elif args.cmd == "same-outputs":
        out = same_outputs(args.a, args.b)
    else:
        out = same_weights(args.a, args.b, args.pair, args.density)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
