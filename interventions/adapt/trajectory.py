"""Sink Strength during training (the paper's Table 14 view): a Trainer callback.

Every `every` optimizer steps (and before and after each stage) `SinkProbe` measures, on the live
modules of the model being trained (no copy of the weights), the Sink Strength of its language model
on the calibration prompts with the fast sink pass (`evals.sink`), and optionally a small strict eval
(`evals.lmeval.run_eval` with a limit) of the same weights seen as a causal LM. Points go to
`trajectory.json` (rewritten atomically after each point, so a killed run keeps what it measured);
`interventions.adapt.trajectory_plot` draws them.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

from evals.eval_run import HEADLINE_METRICS
from evals.lmeval import run_eval
from evals.sink import compute_sink_maps, strength_from_maps
from evals.sink.calibration import DEFAULT_SET, resolve_texts
from evals.sink.metrics import get_metric
from interventions.adapt.vlm_io import causal_view, language_model
from sinkstudy.io import read_json, write_json_atomic

FORMAT = "sinkstudy.trajectory/1"


class SinkProbe:
    """Measure one trajectory point of a (training) model without copying its weights."""

    def __init__(self, tokenizer, trajectory, *, seed: int = 0):
        self.tokenizer, self.cfg, self.seed = tokenizer, trajectory, seed
        get_metric(trajectory.metric)  # one-line error for an unknown metric, before training
        self.texts, self.source = resolve_texts(trajectory.calibration, DEFAULT_SET)

    def __call__(self, model) -> dict[str, Any]:
        was = model.training
        model.eval()
        try:
            with torch.no_grad():
                maps = compute_sink_maps(language_model(model), self.tokenizer, self.texts, metric=self.cfg.metric, progress=False)
            strength = strength_from_maps(maps, self.cfg.metric)
            point: dict[str, Any] = {"sink_strength": _num(strength.value), "mean_sink_mass": float(maps.mass.mean())}
            if self.cfg.eval_tasks:
                run = run_eval(causal_view(model), self.tokenizer, tasks=self.cfg.eval_tasks, limit=self.cfg.eval_limit,
                               max_gen_toks=self.cfg.eval_max_gen_toks, data_files=self.cfg.eval_data_files or None,
                               seed=self.seed, progress=False, use_cache=False)
                point["scores"] = {t: run.scores.get(t, {}).get(HEADLINE_METRICS.get(t, ""), None) for t in self.cfg.eval_tasks}
        finally:
            model.train(was)
        return point

    def describe(self) -> dict:
        return {"calibration": self.source, "metric": self.cfg.metric, "eval_tasks": list(self.cfg.eval_tasks),
                "eval_limit": self.cfg.eval_limit}


class TrajectoryCallback(TrainerCallback):
    """Records a point at stage start, every `every` steps, and at stage end into `path`."""

    def __init__(self, probe: SinkProbe, path: Path, *, stage: str, offset: int, every: int | None, write: bool = True):
        self.probe, self.path, self.stage, self.offset, self.every, self.write = probe, Path(path), stage, offset, every, write

    def _points(self) -> list[dict]:
        return read_json(self.path)["points"] if self.path.is_file() else []

    def _record(self, model, stage_step: int) -> None:
        points = self._points()
        step = self.offset + stage_step
        if any(p["step"] == step for p in points):
            return  # measured already (end of the previous stage, or before an interruption)
        point = {"step": step, "stage": self.stage, "stage_step": stage_step, **self.probe(model)}
        if self.write:
            write_json_atomic(self.path, {"format": FORMAT, "probe": self.probe.describe(),
                                          "points": sorted(points + [point], key=lambda p: p["step"])})

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        # A resumed stage drops points it is about to measure again.
        points = self._points()
        kept = [p for p in points if not (p["stage"] == self.stage and p["stage_step"] > state.global_step)]
        if self.write and len(kept) != len(points):
            write_json_atomic(self.path, {"format": FORMAT, "probe": self.probe.describe(), "points": kept})
        self._record(model, state.global_step)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if self.every and state.global_step % self.every == 0:
            self._record(model, state.global_step)

    def on_train_end(self, args, state, control, model=None, **kwargs):
        self._record(model, state.global_step)


def read_points(path) -> list[dict]:
    return read_json(path)["points"] if Path(path).is_file() else []


def _num(x):
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else float(x)
