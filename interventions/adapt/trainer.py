"""One training stage on HF `Trainer`: trainable groups, label-only logits, protection hooks, resume.

`AdaptTrainer` changes three things in `Trainer`:
- the loss: the model computes logits only where a label exists (`logits_to_keep` = a boolean mask
  of the positions whose next token is a target; transformers flattens them to (N, vocab)), and the
  cross-entropy is summed over those and divided by the number of targets in the whole accumulated
  batch, which is what the full-logit loss computes (tested) at a fraction of the memory and time for
  a large vocabulary;
- hooks (`interventions.adapt.hooks`): their loss terms are added, `after_backward` runs before
  gradient clipping, `after_optimizer_step` right after the optimizer step;
- progress: one tqdm bar with loss, learning rate and tokens/s instead of Trainer's log lines.
Everything else (AdamW, schedules, accumulation, bf16, gradient checkpointing, checkpoints and exact
resume, DeepSpeed / FSDP through `accelerate launch`) is the Trainer's own.
"""

from __future__ import annotations

import logging
import os
import re
import time
from pathlib import Path
from typing import Callable, Sequence

import torch
from safetensors.torch import load_model, save_model
from tqdm.auto import tqdm
from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_callback import PrinterCallback, ProgressCallback
from transformers.trainer_utils import get_last_checkpoint

from interventions.adapt.config import AdaptConfig, StageConfig
from interventions.adapt.hooks import HookContext, TrainingHook
from interventions.adapt.vlm_io import language_model, parameter_groups
from sinkstudy import SinkstudyError

log = logging.getLogger(__name__)
STATE_FILE = "sinkstudy_state.safetensors"
_SCHEDULERS = {"constant": "constant_with_warmup", "cosine": "cosine", "linear": "linear"}
TrainableFilter = Callable[[str, torch.nn.Parameter], bool]


class AdaptTrainer(Trainer):
    def __init__(self, *args, hooks: Sequence[tuple[TrainingHook, HookContext]] = (), group_lr: dict[str, float] | None = None,
                 **kwargs):
        super().__init__(*args, **kwargs)
        self.hooks = list(hooks)
        self.group_lr = dict(group_lr or {})  # parameter name -> its own initial lr (StageConfig.group_lr, resolved)
        # The loss below is normalised over the accumulated batch's targets: the Trainer must count them.
        self.model_accepts_loss_kwargs = True
        self.loss_is_scaled_for_ga = True
        self._loss_shifts_labels = True  # targets are the next tokens: count labels[:, 1:]

    def create_optimizer(self, model=None):
        """Trainer's AdamW groups (decay / no decay), each split by the initial lr of `group_lr`; without it, Trainer's own."""
        if self.optimizer is not None or not self.group_lr:
            return super().create_optimizer(model)
        opt_model = self.model if model is None else model
        decay = set(self.get_decay_parameter_names(opt_model))
        groups: dict[tuple, list] = {}
        for n, p in opt_model.named_parameters():
            if p.requires_grad:
                groups.setdefault((self.group_lr.get(n, self.args.learning_rate), n in decay), []).append(p)
        cls, kwargs = self.get_optimizer_cls_and_kwargs(self.args, opt_model)
        self.optimizer = cls([{"params": ps, "lr": lr, "weight_decay": self.args.weight_decay if decays else 0.0}
                              for (lr, decays), ps in groups.items()], **kwargs)
        return self.optimizer

    def _get_train_sampler(self, train_dataset=None):
        # A dataset that fixes its own order (MixedDataset: the share of each source in every batch)
        # brings its sampler; it is deterministic in (seed, epoch), so resume skips the same batches.
        dataset = train_dataset if train_dataset is not None else self.train_dataset
        if callable(getattr(dataset, "sampler", None)):
            return dataset.sampler(self.args.seed)
        return super()._get_train_sampler(train_dataset)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        inputs = dict(inputs)
        labels = inputs.pop("labels")
        loss, outputs = label_only_loss(model, inputs, labels, num_items_in_batch)
        if self.args.average_tokens_across_devices and num_items_in_batch is not None:
            loss = loss * self.accelerator.num_processes  # count is summed over devices; gradients are averaged
        for hook, ctx in self.hooks:
            term = hook.loss(ctx, model, {**inputs, "labels": labels})
            if term is not None:
                loss = loss + term / self.current_gradient_accumulation_steps
        return (loss, outputs) if return_outputs else loss

    # Checkpoints hold the model's runtime state dict (safetensors). The Trainer's own round trip
    # (save_pretrained, then load_state_dict) misses every tensor of models whose on-disk names
    # differ from the runtime ones (LLaVA in transformers 5.x), which silently broke exact resume.
    def _save(self, output_dir=None, state_dict=None):
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            return super()._save(output_dir, state_dict)

        output_dir = Path(output_dir or self.args.output_dir)
        if self.args.should_save:
            output_dir.mkdir(parents=True, exist_ok=True)
            save_model(self.accelerator.unwrap_model(self.model), str(output_dir / STATE_FILE))
            torch.save(self.args, output_dir / "training_args.bin")

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        state = Path(resume_from_checkpoint) / STATE_FILE
        if self.is_deepspeed_enabled or self.is_fsdp_enabled or not state.is_file():
            return super()._load_from_checkpoint(resume_from_checkpoint, model)

        load_model(self.accelerator.unwrap_model(model if model is not None else self.model), str(state), strict=True)

    def _clip_grad_norm(self, model):
        self._after_backward()
        return super()._clip_grad_norm(model)

    def _get_grad_norm(self, model, grad_norm=None):
        if grad_norm is None:  # max_grad_norm == 0: no clipping, hooks still run before the step
            self._after_backward()
        return super()._get_grad_norm(model, grad_norm)

    def _after_backward(self) -> None:
        for hook, ctx in self.hooks:
            ctx.step = self.state.global_step
            hook.after_backward(ctx)


def label_only_loss(model, inputs: dict, labels: torch.Tensor, num_items=None):
    """(next-token cross-entropy summed over label positions / `num_items`, outputs), with logits
    computed only where a label exists. `num_items` defaults to this batch's number of targets."""
    targets_next = labels[:, 1:]
    keep = torch.zeros_like(labels, dtype=torch.bool)
    keep[:, :-1] = targets_next != -100
    outputs = model(**inputs, logits_to_keep=keep, use_cache=False)
    logits = outputs.logits
    if logits.dim() != 2:
        raise SinkstudyError(f"{type(model).__name__} ignores a boolean logits_to_keep (transformers too old?): "
                             "cannot compute label-only logits")
    targets = targets_next[keep[:, :-1]]
    count = num_items if num_items is not None else targets.numel()
    return torch.nn.functional.cross_entropy(logits.float(), targets, reduction="sum") / max(count, 1), outputs


class _HookSteps(TrainerCallback):
    def __init__(self, hooks):
        self.hooks = hooks

    def on_step_begin(self, args, state, control, **kwargs):
        for _, ctx in self.hooks:  # loss() of this step's micro-batches sees the right step (also after a resume)
            ctx.step = state.global_step

    def on_optimizer_step(self, args, state, control, **kwargs):
        for hook, ctx in self.hooks:
            ctx.step = state.global_step + 1
            hook.after_optimizer_step(ctx)


def snapshot_file(work_dir: Path, step: int) -> Path:
    return Path(work_dir) / f"snapshot-{step}.safetensors"


class _Snapshots(TrainerCallback):
    """The whole model's weights after each step of `steps` (the stage's `save_models_at`), in `work_dir`; a resumed
    stage keeps the snapshots it already wrote (exact resume: the same weights)."""

    def __init__(self, model, steps: Sequence[int], work_dir: Path, main: bool):
        self.model, self.steps, self.work_dir, self.main = model, set(steps), Path(work_dir), main

    def on_step_end(self, args, state, control, **kwargs):
        target = snapshot_file(self.work_dir, state.global_step)
        if self.main and state.global_step in self.steps and not target.is_file():
            tmp = target.with_name(f".{target.name}.tmp")
            save_model(self.model, str(tmp))
            tmp.replace(target)


class _Progress(TrainerCallback):
    """A tqdm bar per stage with loss, learning rate and tokens/s; keeps the loss curve."""

    def __init__(self, desc: str, enabled: bool):
        self.desc, self.enabled = desc, enabled
        self.bar = None
        self.losses: list[float] = []
        self.t0 = self.tokens0 = None

    def on_train_begin(self, args, state, control, **kwargs):
        self.bar = tqdm(total=state.max_steps, initial=state.global_step, desc=self.desc, disable=not self.enabled, leave=False)
        self.t0, self.tokens0 = time.perf_counter(), state.num_input_tokens_seen

    def on_step_end(self, args, state, control, **kwargs):
        self.bar.update(state.global_step - self.bar.n)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses.append(float(logs["loss"]))
            rate = (state.num_input_tokens_seen - self.tokens0) / max(time.perf_counter() - self.t0, 1e-9)
            self.bar.set_postfix(loss=f"{logs['loss']:.3f}", lr=f"{logs.get('learning_rate', 0):.2e}", tok_s=f"{rate:.0f}")

    def on_train_end(self, args, state, control, **kwargs):
        self.bar.close()


def select_trainable(model, groups: Sequence[str] | TrainableFilter) -> set[str]:
    """Parameter names a stage trains: named groups and re:<pattern>, or a filter function."""
    named = dict(model.named_parameters())
    if callable(groups):
        return {n for n, p in named.items() if groups(n, p)}
    available = parameter_groups(model)
    chosen: set[str] = set()
    for g in groups:
        if g.startswith("re:"):
            pattern = re.compile(g[3:])
            hit = {n for n in named if pattern.search(n)}
        else:
            hit = available[g]
        if not hit:
            raise SinkstudyError(f"trainable group {g!r} matches no parameter of {type(model).__name__}")
        chosen |= hit
    return chosen


def group_lrs(model, stage: StageConfig) -> dict[str, float]:
    """{parameter name: lr} for the parameters of the stage's `group_lr` groups (a later group wins where two overlap)."""
    if not stage.group_lr:
        return {}
    groups = parameter_groups(model)
    return {name: lr for group, lr in stage.group_lr.items() for name in sorted(groups[group])}


def precision_flags(precision: str) -> dict:
    if precision == "auto":
        precision = "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "fp32"
    if precision == "bf16" and not (torch.cuda.is_available() and torch.cuda.is_bf16_supported()):
        raise SinkstudyError("precision bf16 needs a CUDA device with bf16 support; use precision: fp32 (or auto)")
    return {"bf16": precision == "bf16"}


def last_checkpoint(work_dir: Path) -> str | None:
    return get_last_checkpoint(str(work_dir)) if Path(work_dir).is_dir() else None


def train_stage(
    model,
    stage: StageConfig,
    config: AdaptConfig,
    dataset,
    *,
    collate_fn,
    work_dir: Path,
    tokenizer=None,
    trainable: TrainableFilter | None = None,
    hooks: Sequence[TrainingHook] = (),
    callbacks: Sequence[TrainerCallback] = (),
    sink_maps=None,
    calibration=None,
    resume: bool = False,
    progress: bool = True,
    desc: str | None = None,
    device: str | None = None,
    base=None,
) -> dict:
    """Train `model` in place for one stage; returns its statistics. The model is left in eval mode
    with every parameter's requires_grad as before.

    `trainable` (a filter function) replaces the stage's named groups. With `resume`, training
    continues from the newest Trainer checkpoint in `work_dir`, ending with the weights an
    uninterrupted run would have (same data order, RNG, optimizer and scheduler state). `hooks`
    whose `stages` leave this stage out are not called; `sink_maps` and `calibration` (the texts they
    were measured on) reach the others' context, and `base` (the run's base argument) too. `device`: "cpu" or "cuda" (`check_device`); None:
    the GPU when there is one.
    """
    if len(dataset) == 0:
        raise SinkstudyError(f"stage {stage.name}: no training records")
    named = dict(model.named_parameters())
    previous = {n: p.requires_grad for n, p in named.items()}
    chosen = select_trainable(model, trainable if trainable is not None else stage.trainable)
    if not chosen:
        raise SinkstudyError(f"stage {stage.name}: the trainable filter selected no parameters")
    for n, p in named.items():
        p.requires_grad_(n in chosen)
    hooks = [h for h in hooks if h.applies_to(stage.name)]
    contexts = [(h, HookContext(model=model, language_model=language_model(model), tokenizer=tokenizer, stage=stage,
                                config=config, sink_maps=sink_maps, calibration=calibration, base=base)) for h in hooks]
    world = _world_size()
    try:
        for hook, ctx in contexts:
            hook.setup(ctx)
        for hook, ctx in contexts:
            dataset = hook.dataset(ctx, dataset)
        if config.deepspeed and any(h.edits_training for h in hooks):
            raise SinkstudyError(f"hook(s) {', '.join(h.name for h in hooks if h.edits_training)} edit gradients or weights, "
                                 "which DeepSpeed ZeRO partitions away from p.grad; run them without deepspeed")
        trained = [p for p in model.parameters() if p.requires_grad]
        if not trained:
            raise SinkstudyError(f"stage {stage.name}: nothing left to train after the hooks' set-up")
        args = _arguments(stage, config, work_dir, world, check_device(device))
        bar = _Progress(desc or f"adapt {stage.name}", progress)
        snapshots = [_Snapshots(model, stage.save_models_at, work_dir, _rank() == 0)] if stage.save_models_at else []
        trainer = AdaptTrainer(model=model, args=args, train_dataset=dataset, data_collator=collate_fn, group_lr=group_lrs(model, stage),
                               hooks=contexts, callbacks=[bar, _HookSteps(contexts), *snapshots, *callbacks])

        trainer.remove_callback(ProgressCallback)
        trainer.remove_callback(PrinterCallback)
        checkpoint = last_checkpoint(work_dir) if resume else None
        t0 = time.perf_counter()
        out = trainer.train(resume_from_checkpoint=checkpoint)
        seconds = time.perf_counter() - t0
        summaries = {h.name: h.teardown(ctx) for h, ctx in contexts}
    finally:
        model.eval()
        for n, p in named.items():
            p.requires_grad_(previous[n])
    state = trainer.state
    steps_run = state.global_step - (int(Path(checkpoint).name.split("-")[-1]) if checkpoint else 0)
    tokens = state.num_input_tokens_seen
    return {
        "stage": stage.name,
        "steps": state.global_step,
        "resumed_from": checkpoint,
        "losses": bar.losses,
        **final_loss(bar.losses, state.global_step, config.log_every),
        "mean_loss": out.training_loss,  # the stage's mean (Trainer's training_loss), not where it ended
        "tokens": tokens,
        "trainable_params": sum(p.numel() for p in trained),
        "trainable_groups": list(stage.trainable) if trainable is None else "custom filter",
        "lr": stage.lr,
        "schedule": stage.schedule,
        "effective_batch": stage.micro_batch_size * args.gradient_accumulation_steps * world,
        "processes": world,  # data-parallel ranks (the effective batch is the same on any number)
        "seconds": round(seconds, 3),
        "steps_per_second": round(steps_run / seconds, 3) if seconds > 0 else None,
        "tokens_per_second": round(tokens / seconds, 1) if seconds > 0 and not checkpoint else None,
        "hooks": {k: v for k, v in summaries.items() if v is not None},
        "hook_logs": {h.name: ctx.logs for h, ctx in contexts if ctx.logs},
    }


FINAL_WINDOW = (0.1, 10)  # final_loss: the mean over the last tenth of the steps, at least 1 and at most 10 steps


def final_loss(losses: Sequence[float], steps: int, log_every: int) -> dict:
    """{"final_loss": mean of the logged losses over the stage's last steps, "final_loss_steps": how
    many steps that covers}: where training ended, not the stage's mean (`mean_loss`)."""
    if not losses:
        return {"final_loss": None, "final_loss_steps": 0}
    window = max(1, min(FINAL_WINDOW[1], round(FINAL_WINDOW[0] * steps)))
    entries = min(len(losses), max(1, -(-window // max(1, log_every))))
    return {"final_loss": sum(losses[-entries:]) / entries, "final_loss_steps": min(steps, entries * max(1, log_every))}


def _world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def check_device(device: str | None) -> str:
    """Where training runs: "cpu" or "cuda" (None: cuda when available); one line for anything else."""
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda"):
        raise SinkstudyError(f"device {device!r}: training runs on cpu or cuda (choose the GPUs with CUDA_VISIBLE_DEVICES)")
    if device == "cuda" and not torch.cuda.is_available():
        raise SinkstudyError("device cuda: no CUDA device is available here; train on the CPU (--device cpu)")
    return device


def _arguments(stage: StageConfig, config: AdaptConfig, work_dir: Path, world: int, device: str) -> TrainingArguments:
    steps = {"max_steps": stage.steps} if stage.steps else {"num_train_epochs": stage.epochs}
    save = {"save_strategy": "steps", "save_steps": stage.save_steps, "save_total_limit": 2} if stage.save_steps else {"save_strategy": "no"}
    extra = {}
    if config.gradient_checkpointing:
        # transformers >= 5.x names it activation checkpointing (the old name is a deprecated alias).
        name = "activation_checkpointing" if "activation_checkpointing" in TrainingArguments.__dataclass_fields__ else "gradient_checkpointing"
        extra.update({name: True, f"{name}_kwargs": {"use_reentrant": False}})
    if config.deepspeed:
        extra["deepspeed"] = config.deepspeed
    if config.fsdp:
        extra.update(fsdp=True, fsdp_config=config.fsdp)
    return TrainingArguments(
        output_dir=str(work_dir),
        per_device_train_batch_size=stage.micro_batch_size,
        gradient_accumulation_steps=stage.accumulation(world),
        learning_rate=stage.lr,
        lr_scheduler_type=_SCHEDULERS[stage.schedule],
        warmup_steps=stage.warmup_ratio,  # < 1: a share of the total steps
        weight_decay=stage.weight_decay,
        max_grad_norm=stage.max_grad_norm,
        optim="adamw_torch",
        seed=config.seed,
        data_seed=config.seed,
        logging_steps=config.log_every,
        logging_first_step=True,
        report_to="none",
        disable_tqdm=True,
        remove_unused_columns=False,
        dataloader_num_workers=config.dataloader_workers,
        include_num_input_tokens_seen="non_padding",
        use_cpu=device == "cpu",
        ddp_find_unused_parameters=True if world > 1 else None,
        **precision_flags(config.precision),
        **steps,
        **save,
        **extra,
    )
