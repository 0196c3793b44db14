"""Benchmark: what the engine adds to a training step — one step with a protection and the S-trajectory
callback against a plain HF `Trainer` step on the same model, batch and data.

    python -m benchmarks.adapt_overhead [--model smollm2-135m-instruct] [--steps 22] [--warmup 2]

Three cases, each on a freshly loaded model, text-only (the language model is what a protection touches):
  hf-trainer     `transformers.Trainer` with the model's own full-logit loss, AdamW, the same batches
  engine         `interventions.adapt.train_stage` (label-only logits, the hook seam), no hook
  engine+hooks   the same with `sink_head_freeze` (top 4 sink heads, rows restored after every step) and
                 the S-trajectory callback every `--every` steps (a sink pass over 15 prompts each time)
Time: wall seconds per optimizer step over the steps after `--warmup` (trajectory passes included).
The ratio against hf-trainer is the figure to read; the engine's target is ≤ 1.1x.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.utils import logging as hf_logging

from evals.sink import compute_sink_maps
from interventions.adapt import encoding, sources
from interventions.adapt.config import from_dict
from interventions.adapt.trajectory import SinkProbe, TrajectoryCallback
from interventions.pairs import load_causal_lm
from interventions.protect import make_protection
from sinkstudy import real_models, real_weights
from sinkstudy.progress import quiet


class _Clock(TrainerCallback):
    """Wall time from the end of step `warmup` to the end of the last step (runs after every other callback)."""

    def __init__(self, warmup: int):
        self.warmup, self.start, self.end, self.last = warmup, None, None, 0

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.warmup:
            self.start = time.perf_counter()
        self.end, self.last = time.perf_counter(), state.global_step

    def per_step(self) -> float:
        return (self.end - self.start) / (self.last - self.warmup)


def _chats(n: int) -> list[dict]:
    words = "the a sink head attends to first token while the model reads long answers about birds rivers and stones".split()
    out = []
    for i in range(n):
        answer = " ".join(words[(i + k) % len(words)] for k in range(60))
        out.append({"messages": [{"role": "user", "content": f"Write sixty words about item {i}."},
                                 {"role": "assistant", "content": answer}]})
    return out


def run(model_path: str, steps: int, warmup: int, every: int, batch: int, threads: int) -> dict[str, float]:
    # lazy: loads datasets
    from interventions.adapt.trainer import train_stage

    torch.set_num_threads(threads)
    cfg = from_dict({"precision": "fp32", "seed": 0, "max_length": 256, "trajectory": {"every": every},
                     "stages": [{"name": "stage2", "data": [{"records": _chats(batch * steps)}], "trainable": ["lm"],
                                 "steps": steps, "batch_size": batch, "micro_batch_size": batch, "lr": 2e-5}]})
    stage, times = cfg.stages[0], {}
    for case in ("hf-trainer", "engine", "engine+hooks"):
        torch.manual_seed(0)
        lm, tok = load_causal_lm(model_path)
        lm.config.use_cache = False
        dataset = encoding.EncodedDataset([sources.load_records(stage.data[0])], encoding.Encoder(tok, max_length=256))
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        collate = lambda f: encoding.collate(f, pad)  # noqa: E731
        clock = _Clock(warmup)
        with tempfile.TemporaryDirectory() as work:
            if case == "hf-trainer":
                args = TrainingArguments(output_dir=work, per_device_train_batch_size=batch, max_steps=steps, learning_rate=2e-5,
                                         lr_scheduler_type="constant", logging_strategy="no", save_strategy="no", report_to=[],
                                         disable_tqdm=True, use_cpu=True, seed=0, remove_unused_columns=False, dataloader_num_workers=0)
                Trainer(model=lm.train(), args=args, train_dataset=dataset, data_collator=collate, callbacks=[clock]).train()
            else:
                hooks, callbacks, maps, texts = [], [], None, None
                if case == "engine+hooks":
                    probe = SinkProbe(tok, cfg.trajectory)
                    texts = probe.texts
                    maps = compute_sink_maps(lm, tok, texts, progress=False)
                    hooks = [make_protection("sink_head_freeze", {"heads": {"by": "strength", "top_k": 4}})]
                    callbacks = [TrajectoryCallback(probe, Path(work) / "trajectory.json", stage=stage.name, offset=0, every=every)]
                train_stage(lm, stage, cfg, dataset, collate_fn=collate, work_dir=Path(work) / "stage", tokenizer=tok, hooks=hooks,
                            callbacks=[*callbacks, clock], sink_maps=maps, calibration=texts, progress=False, device="cpu")
        times[case] = clock.per_step()
        print(f"{case:>14}: {times[case]:.3f} s/step", flush=True)
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.adapt_overhead", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="a causal LM: real-model name, path or hub id")
    parser.add_argument("--steps", type=int, default=22)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--every", type=int, default=10, help="trajectory every N steps (the study recipes' value)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    if not 0 < args.warmup < args.steps:
        parser.error("--warmup must lie between 0 and --steps")
    model = str(real_weights.chat_checkpoint(args.model)) if real_models.is_registered(args.model) else args.model
    print(f"one optimizer step, text-only: {args.model}, batch {args.batch} chats (<= 256 tokens), float32, CPU, "
          f"{args.threads} thread(s); s/step over steps {args.warmup + 1}..{args.steps}")

    hf_logging.set_verbosity_error()  # the Trainer's closing metrics line
    with quiet():
        t = run(model, args.steps, args.warmup, args.every, args.batch, args.threads)
    base = t["hf-trainer"]
    print(f"engine / hf-trainer: {t['engine'] / base:.2f}x; engine + sink_head_freeze + S every {args.every} steps / "
          f"hf-trainer: {t['engine+hooks'] / base:.2f}x (target <= 1.10x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
