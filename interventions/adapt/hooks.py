"""The seam for training-time protections: a small hook object the adaptation trainer calls.

A hook subclasses `TrainingHook` and overrides what it needs; a list of hooks is an argument of
`interventions.adapt.adapt` / `train_stage`. Once per run, before anything else, `adapt` calls

    check_base(config)         with the base's config (when the base is a path or hub id), before any
                               work: raise a one-line SinkstudyError for a base the hook cannot act on.
    prepare_base(lm, tokenizer, texts)   on the base causal LM before the VLM is built around it (and
                               before its sink maps are measured): return a replacement model (an
                               architecture change such as the QK-norm sufficiency switch) or None.
                               `texts`: the calibration texts (evals.sink CalibrationText).
    changes_architecture()     True when prepare_base returns another class (studies extract the LM in it).

Then per stage, for the hooks whose `stages` (None: every stage) name it, the trainer calls, in order:

    setup(ctx)                 once, before the optimizer exists: choose / freeze parameters
                               (set requires_grad=False: such tensors stay bit-identical), register
                               forward hooks, read ctx.sink_maps. Parameters frozen here are left out
                               of the optimizer, so weight decay cannot move them either.
    dataset(ctx, dataset)      once, after setup: return the stage's training set, e.g. mixed with other
                               data (`interventions.adapt.encoding.MixedDataset`: its own sampler fixes
                               the batch composition); `dataset.encoder` formats records as the
                               stage's own (chat template, labels).
    loss(ctx, model, inputs)   every micro-batch, after the task loss: return a scalar tensor (the
                               mean over this micro-batch) to add, or None. The engine divides it by the
                               accumulation steps, so one optimizer step sees its mean over micro-batches.
                               `inputs` is the batch (input_ids, attention_mask, labels, pixel_values?);
                               text-only rows have no image tokens. Calibration text is yours to run.
    after_backward(ctx)        once per optimizer step, after all micro-batches' backward and BEFORE
                               gradient clipping: edit `p.grad` in place (mask, project).
    after_optimizer_step(ctx)  right after `optimizer.step()`: restore or project parameter values
                               (e.g. keep rows of a matrix bit-identical under AdamW, or project an
                               Adam-normalised update) from what setup stored in ctx.state.
    teardown(ctx)              once after the stage (remove forward hooks); return a JSON-able summary
                               for the run report, or None.

`ctx` is a `HookContext`: the model being trained, its text decoder (`ctx.language_model`), the
tokenizer, the stage and run configs, the base model's sink maps measured once before training (when
any hook sets `needs_sink_maps = True`) with the calibration texts they were measured on, the
global step, and `ctx.log(dict)` for per-step values. A hook's identity (in a run's request, so
editing it reruns the run) is its name, class, `identity_params()` (its settings, and the content of
any data file they name) and `source_hash` of `sources()`: the files defining its class (and
whatever else `sources()` adds).
Under DeepSpeed ZeRO the gradients are partitioned outside `p.grad`: hooks that edit gradients or
parameters are refused there (use DDP or FSDP with `use_orig_params`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class HookContext:
    model: Any
    language_model: Any
    tokenizer: Any
    stage: Any  # interventions.adapt.config.StageConfig
    config: Any  # interventions.adapt.config.AdaptConfig
    sink_maps: Any = None  # evals.sink.SinkMaps of the base on the calibration texts, when requested
    calibration: Any = None  # the calibration texts (evals.sink.CalibrationText) the sink maps were measured on
    step: int = 0  # global optimizer steps done (across stages)
    state: dict = field(default_factory=dict)  # free space for a hook between its calls
    base: Any = None  # the run's base as given (a path, name or model): what a `selfdistill` data spec is made from
    logs: list = field(default_factory=list)

    def log(self, values: dict) -> None:
        self.logs.append({"step": self.step, **values})

    def named_trainable(self) -> dict[str, torch.nn.Parameter]:
        return {n: p for n, p in self.model.named_parameters() if p.requires_grad}


class TrainingHook:
    """Base class: every method is optional. `name` labels the hook in reports and cache keys."""

    name = "hook"
    needs_sink_maps = False
    edits_training = False  # True if after_backward / after_optimizer_step touch tensors (refused under ZeRO)
    stages: list[str] | None = None  # the stages it acts in; None: every stage

    def applies_to(self, stage: str) -> bool:
        return self.stages is None or stage in self.stages

    def sources(self) -> tuple:
        """The objects whose source files define this hook (their hash is part of a run's identity)."""
        return (type(self),)

    def identity_params(self) -> dict:
        """The settings that identify this hook in a run's request (default: its public attributes).
        Override to add what a setting points at, e.g. a data file's content hash."""
        return {k: v for k, v in vars(self).items() if not k.startswith("_")}

    def check_base(self, config) -> None:
        pass

    def prepare_base(self, lm, tokenizer, texts):
        return None

    def changes_architecture(self) -> bool:
        """True when `prepare_base` hands back another model class (the base's vocabulary kept): the
        adapted language model is then extracted in its own class, not checked against the base's."""
        return False

    def setup(self, ctx: HookContext) -> None:
        pass

    def dataset(self, ctx: HookContext, dataset):
        return dataset

    def loss(self, ctx: HookContext, model, inputs: dict) -> torch.Tensor | None:
        return None

    def after_backward(self, ctx: HookContext) -> None:
        pass

    def after_optimizer_step(self, ctx: HookContext) -> None:
        pass

    def teardown(self, ctx: HookContext) -> dict | None:
        return None


class FreezeParameters(TrainingHook):
    """Freeze every trainable parameter whose name matches one of `patterns` (regular expressions).

    The engine's own use of the seam: a stage's `trainable` groups decide what learns; this hook
    then takes named tensors out again (e.g. `re:embed_tokens` to keep the embeddings fixed).
    """

    name = "freeze"

    def __init__(self, patterns: list[str]):
        self.patterns = [re.compile(p) for p in patterns]

    def setup(self, ctx: HookContext) -> None:
        frozen = []
        for n, p in ctx.model.named_parameters():
            if p.requires_grad and any(r.search(n) for r in self.patterns):
                p.requires_grad_(False)
                frozen.append(n)
        ctx.state["frozen"] = frozen

    def teardown(self, ctx: HookContext) -> dict:
        return {"frozen": len(ctx.state.get("frozen", []))}
