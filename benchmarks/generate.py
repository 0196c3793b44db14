"""Benchmark: eval generation throughput of the hf-continuous backend against lm-eval's HF backend with
its defaults and plain HF `model.generate` at the same batch size, all measured in one run.

    python -m benchmarks.generate --model MODEL [--tasks T1,T2] [--limit N] [--batch-size 16]
                                   [--max-gen-toks N] [--threads N] [--quick]

The same prompts (lm-eval's own requests for the tasks: chat template applied, each task's `until`
strings and max_gen_toks) go through three generators:
  default  `run_eval(backend="hf")` at batch size 1: lm-eval's HFLM with its defaults
  anchor   `model.generate` on length-sorted batches of --batch-size prompts (left padding, HF's own
           `stop_strings` and EOS): plain HF generation at our batch size
  ours     `run_eval(backend="hf-continuous")` at --batch-size
Throughput is the tokens lm-eval's default generated for these prompts (each row up to and including
its stop) over each generator's wall time of generation (lm-eval's task building and grading left
out), so the ratios are ratios of wall time on the same work; the same over this process's CPU time
is printed beside it (on a machine shared with other jobs the load drifts between the three runs,
and CPU time follows it less than wall time does). The report gives both ratios, the
share of prompts whose output text is identical to the default's, the score difference per task
and metric (ours − default, in points), and for every prompt that differs where the two token
streams part: the batch-1 logits of the two tokens there (a near tie) and whether our loop at batch
size 1 reproduces the default's output. The machine's load average is printed before and after.
`--quick` (CI): 3 prompts per task, max_gen_toks 48, batch size 4.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from dataclasses import dataclass, field

from evals.lmeval import run_eval
from sinkstudy import SinkstudyError
from sinkstudy.checkpoint import load_tokenizer, local_model_path

SHIPPED = "sinkstudy_ifeval,sinkstudy_gsm"


@dataclass
class Measured:
    """One generator's run: wall time of generation, per-context tokens and texts, scores."""

    seconds: float = 0.0
    cpu_seconds: float = 0.0  # this process's CPU time: on a shared machine, steadier than wall time
    steps: int = 0  # decode forwards (one new token per row)
    rows: int = 0  # rows over all decode forwards
    tokens: dict[tuple, list[int]] = field(default_factory=dict)  # prompt ids -> generated ids
    requests: list[tuple] = field(default_factory=list)  # (context, gen_kwargs) as lm-eval sent them
    run: object = None


@contextlib.contextmanager
def _probe(measured: Measured):
    """Time the outermost generate_until call and record each prompt's generated tokens."""
    # lazy: loads lm_eval, torch, transformers
    import evals.generate.hflm as hflm_mod
    from lm_eval.models.huggingface import HFLM

    saved = {(HFLM, "generate_until"): HFLM.generate_until, (hflm_mod.ContinuousHFLM, "generate_until"): hflm_mod.ContinuousHFLM.generate_until,
             (HFLM, "_model_generate"): HFLM._model_generate, (hflm_mod, "greedy_generate"): hflm_mod.greedy_generate}
    depth = [0]

    def timed(original):
        def generate_until(self, requests, disable_tqdm=False):
            depth[0] += 1
            t, c = time.perf_counter(), time.process_time()
            try:
                return original(self, requests, disable_tqdm)
            finally:
                depth[0] -= 1
                if depth[0] == 0:
                    measured.seconds += time.perf_counter() - t
                    measured.cpu_seconds += time.process_time() - c
                    measured.requests += [r.args for r in requests]
        return generate_until

    def model_generate(self, context, max_length, stop, **kw):
        out = saved[(HFLM, "_model_generate")](self, context, max_length, stop, **kw)
        for row_in, row_out in zip(context.tolist(), out.tolist()):  # batch size 1 here: no padding
            measured.tokens[tuple(row_in)] = row_out[len(row_in):]
        return out

    def greedy_generate(model, prompts, **kw):
        out = saved[(hflm_mod, "greedy_generate")](model, prompts, **kw)
        measured.tokens.update({tuple(p.ids): toks for p, toks in zip(prompts, out)})
        return out

    HFLM.generate_until = timed(saved[(HFLM, "generate_until")])
    hflm_mod.ContinuousHFLM.generate_until = timed(saved[(hflm_mod.ContinuousHFLM, "generate_until")])
    HFLM._model_generate = model_generate
    hflm_mod.greedy_generate = greedy_generate
    try:
        yield measured
    finally:
        for (owner, name), value in saved.items():
            setattr(owner, name, value)


@contextlib.contextmanager
def _count_steps(model, measured: Measured):
    """Count decode forwards and their rows (a forward of one new token per row)."""
    def hook(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None and ids.shape[1] == 1:
            measured.steps += 1
            measured.rows += ids.shape[0]

    handle = model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


def run_lm_eval(model, tokenizer, tasks: str, limit, max_gen_toks, backend: str, batch_size: int) -> Measured:
    measured = Measured()
    with _probe(measured), _count_steps(model, measured):
        measured.run = run_eval(model, tokenizer, tasks=tasks, limit=limit, max_gen_toks=max_gen_toks, batch_size=batch_size,
                                backend=backend, progress=False)
    return measured


def run_hf_generate(model, tokenizer, requests: list[tuple], batch_size: int) -> Measured:
    """The anchor: `model.generate` on length-sorted batches, grouped by generation settings."""
    # lazy: loads lm_eval, torch, transformers
    import torch
    from lm_eval.models.huggingface import HFLM
    from evals.generate.hflm import greedy_plan

    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)  # lm-eval's encoding of the contexts
    eos_text = lm.tok_decode(lm.eot_token_id, skip_special_tokens=False)
    groups: dict[tuple, list[str]] = {}
    for context, gen_kwargs in requests:
        until, max_gen_toks = greedy_plan(gen_kwargs, lm.max_gen_toks, eos_text)
        groups.setdefault((tuple(until), max_gen_toks), []).append(context)
    measured = Measured(requests=list(requests))
    t, c = time.perf_counter(), time.process_time()
    with torch.inference_mode(), _count_steps(model, measured):
        for (until, max_gen_toks), contexts in groups.items():
            contexts.sort(key=lambda c: -len(lm.tok_encode(c)))
            for k in range(0, len(contexts), batch_size):
                ids, mask = lm.tok_batch_encode(contexts[k:k + batch_size], left_truncate_len=lm.max_length - max_gen_toks)
                model.generate(input_ids=ids.to(lm.device), attention_mask=mask.to(lm.device), max_new_tokens=max_gen_toks,
                               do_sample=False, stop_strings=[s for s in until if s], tokenizer=tokenizer,
                               pad_token_id=tokenizer.pad_token_id)
    measured.seconds, measured.cpu_seconds = time.perf_counter() - t, time.process_time() - c
    return measured


def compare_outputs(default, ours) -> tuple[int, int, list[tuple[str, int]], list[str]]:
    """(identical, total, the differing (task, doc_id), score-difference lines) of two EvalRuns."""
    same = total = 0
    differing = []
    for task, rows in default.samples.items():
        mine = {s["doc_id"]: s for s in ours.samples[task]}
        for s in rows:
            total += 1
            if mine[s["doc_id"]]["output"] == s["output"]:
                same += 1
            else:
                differing.append((task, s["doc_id"]))
    lines = []
    for task, metrics in default.scores.items():
        for m in default.metrics(task):
            a, b = metrics[m], ours.scores[task][m]
            if isinstance(a, (int, float)) and isinstance(b, (int, float)):
                lines.append(f"  {task:<20} {m:<32} default {100 * a:6.2f}  ours {100 * b:6.2f}  Δ {100 * (b - a):+6.2f} points")
    return same, total, differing, lines


def divergence(model, prompt_ids: list[int], reference: list[int], other: list[int]) -> str:
    """Where two greedy token streams of one prompt part, and the batch-1 logits of both tokens there."""
    # lazy: loads torch, numpy
    import torch

    k = next((i for i, (a, b) in enumerate(zip(reference, other)) if a != b), None)
    if k is None:
        return f"same tokens up to {min(len(reference), len(other))}, lengths {len(reference)} vs {len(other)}"
    ids = torch.tensor([list(prompt_ids) + reference[:k]], device=next(model.parameters()).device)
    with torch.inference_mode():
        logits = model(input_ids=ids).logits[0, -1].float()
    a, b = float(logits[reference[k]]), float(logits[other[k]])
    return (f"token {k}: default {reference[k]} (logit {a:.5f}) vs ours {other[k]} (logit {b:.5f}), "
            f"gap {a - b:.2e}, top logit {float(logits.max()):.3f}")


def _warm_up(model, tokenizer) -> None:
    """One short untimed generation through each path, so that no measured run pays first-call costs."""
    # lazy: loads torch, transformers, numpy
    import torch
    from evals.generate.loop import Prompt, greedy_generate

    ids = tokenizer("Warm-up: count to three.", return_tensors="pt").input_ids
    with torch.inference_mode():
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
                       pad_token_id=tokenizer.pad_token_id)
    greedy_generate(model, [Prompt(ids[0].tolist(), 4)] * 2, batch_size=2)


def _load_average() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.generate", description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="checkpoint dir, .gguf file or registered name")
    parser.add_argument("--tasks", default=SHIPPED, help=f"lm-eval tasks (default {SHIPPED})")
    parser.add_argument("--limit", type=int, default=None, help="first N prompts per task (default: all)")
    parser.add_argument("--batch-size", type=int, default=None, help="ours and the anchor (default 16; --quick 4)")
    parser.add_argument("--max-gen-toks", type=int, default=None, help="override every task's max_gen_toks (default: the task's own)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    parser.add_argument("--quick", action="store_true", help="CI: 3 prompts per task, max_gen_toks 48, batch size 4")
    args = parser.parse_args(argv)
    limit = args.limit or (3 if args.quick else None)
    max_gen_toks = args.max_gen_toks or (48 if args.quick else None)
    batch_size = args.batch_size or (4 if args.quick else 16)

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    # lazy: loads torch, transformers, numpy
    import torch
    from transformers import AutoModelForCausalLM

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        path = local_model_path(args.model)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        tokenizer = load_tokenizer(path)
    except (SinkstudyError, OSError, ValueError) as exc:
        print(f"bench-eval: cannot load {args.model}: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}", file=sys.stderr)
        return 2
    print(f"model: {args.model} ({type(model).__name__}, {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters, float32, "
          f"{model.config._attn_implementation}); tasks {args.tasks}, limit {limit or 'all'}, max_gen_toks "
          f"{max_gen_toks or 'each task' + chr(39) + 's own'}; batch size {batch_size}; torch threads {torch.get_num_threads()}, "
          f"{os.cpu_count()} CPUs", flush=True)
    print(f"load average (1, 5, 15 min) before: {_load_average()}", flush=True)

    _warm_up(model, tokenizer)
    ours = run_lm_eval(model, tokenizer, args.tasks, limit, max_gen_toks, "hf-continuous", batch_size)
    print(f"ours (hf-continuous, batch {batch_size}): {ours.seconds:.1f} s, CPU {ours.cpu_seconds:.1f} s   [load {_load_average()}]", flush=True)
    anchor = run_hf_generate(model, tokenizer, ours.requests, batch_size)
    print(f"anchor (HF model.generate, batch {batch_size}): {anchor.seconds:.1f} s, CPU {anchor.cpu_seconds:.1f} s   [load {_load_average()}]", flush=True)
    default = run_lm_eval(model, tokenizer, args.tasks, limit, max_gen_toks, "hf", 1)
    print(f"default (lm-eval HFLM, batch 1): {default.seconds:.1f} s, CPU {default.cpu_seconds:.1f} s   [load {_load_average()}]", flush=True)

    tokens = sum(len(t) for t in default.tokens.values())
    same, total, differing, score_lines = compare_outputs(default.run, ours.run)
    print(f"\n{total} prompts, {tokens} tokens generated by lm-eval's default (ours generated {sum(len(t) for t in ours.tokens.values())})")
    print(f"{'generator':<40} {'wall s':>8} {'tokens/s':>9} {'CPU s':>8} {'tokens/CPU s':>13} {'decode steps':>13} {'rows/step':>10}")
    for name, m in (("lm-eval HFLM defaults (batch 1)", default), (f"HF model.generate, batch {batch_size}", anchor),
                    (f"ours: hf-continuous, batch {batch_size}", ours)):
        print(f"{name:<40} {m.seconds:8.1f} {tokens / m.seconds:9.2f} {m.cpu_seconds:8.1f} {tokens / m.cpu_seconds:13.2f} "
              f"{m.steps:13d} {m.rows / max(m.steps, 1):10.2f}")
    print(f"ours / HF generate at batch {batch_size}: {anchor.seconds / ours.seconds:.2f}x (tokens/s), "
          f"{anchor.cpu_seconds / ours.cpu_seconds:.2f}x (tokens/CPU s)")
    print(f"ours / lm-eval default: {default.seconds / ours.seconds:.2f}x (tokens/s), "
          f"{default.cpu_seconds / ours.cpu_seconds:.2f}x (tokens/CPU s)")
    print(f"identical outputs vs lm-eval default: {same}/{total} ({100 * same / total:.1f}%)")
    print("scores (ours − default, points):")
    print("\n".join(score_lines))
    _lengths(model, tokenizer, default)
    if differing:
        _explain(model, tokenizer, default, ours, differing)
    print(f"load average (1, 5, 15 min) after: {_load_average()}")
    return 0


def _requests_of(model, tokenizer, default: Measured):
    """{(task, doc_id): (prompt ids, until, max_gen_toks)} of the default run, as HFLM encoded them."""
    # lazy: loads lm_eval, torch, transformers
    from lm_eval.models.huggingface import HFLM
    from evals.generate.hflm import greedy_plan

    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=1)
    eos_text = lm.tok_decode(lm.eot_token_id, skip_special_tokens=False)
    gen_kwargs_of = dict(default.requests)  # context -> its generation kwargs
    out = {}
    for task, rows in default.run.samples.items():
        for s in rows:
            until, max_gen_toks = greedy_plan(gen_kwargs_of[s["prompt"]], lm.max_gen_toks, eos_text)
            ids = lm.tok_batch_encode([s["prompt"]], left_truncate_len=lm.max_length - max_gen_toks)[0][0].tolist()
            out[task, s["doc_id"]] = ids, until, max_gen_toks
    return out


def _lengths(model, tokenizer, default: Measured) -> None:
    """Answer lengths per task (what a shorter max_gen_toks would cut)."""
    by_task: dict[str, list[tuple[int, int]]] = {}
    for (task, _), (ids, _, max_gen_toks) in _requests_of(model, tokenizer, default).items():
        by_task.setdefault(task, []).append((len(default.tokens[tuple(ids)]), max_gen_toks))
    print("answer lengths of lm-eval's default (tokens):")
    for task, rows in by_task.items():
        n = [k for k, _ in rows]
        print(f"  {task:<20} mean {sum(n) / len(n):7.1f}  longest {max(n):5d}  at max_gen_toks: "
              f"{sum(k >= m for k, m in rows)}/{len(rows)} (max_gen_toks {sorted({m for _, m in rows})})")


def _explain(model, tokenizer, default: Measured, ours: Measured, differing: list[tuple[str, int]]) -> None:
    """For each differing prompt: where the streams part, and our loop's output at batch size 1."""
    # lazy: loads lm_eval, torch, transformers
    from evals.generate.hflm import stop_test
    from evals.generate.loop import Prompt, greedy_generate

    eos = model.generation_config.eos_token_id
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    requests = _requests_of(model, tokenizer, default)
    print("differing prompts:")
    for task, doc_id in differing:
        ids, until, max_gen_toks = requests[task, doc_id]
        ref, mine = default.tokens[tuple(ids)], ours.tokens[tuple(ids)]
        alone = greedy_generate(model, [Prompt(ids, max_gen_toks, stop_test(tokenizer, until))], batch_size=1, eos_token_ids=eos)[0]
        print(f"  {task} doc {doc_id}: {divergence(model, ids, ref, mine)}; our loop at batch size 1 "
              f"{'reproduces' if alone == ref else 'does NOT reproduce'} the default's tokens")


if __name__ == "__main__":
    sys.exit(main())
