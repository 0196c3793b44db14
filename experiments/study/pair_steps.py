"""The steps that make and measure the models of a pair, for studies and single commands alike: extract the
VLM's language model, Sink maps + Strength of a model, its strict evals through lm-eval, a registered
intervention, QK-RMSNorm injection (and recovery training), an adapted VLM's language model. Each kind is a
frozen dataclass of arguments (`experiments.study.kinds`): what its body reads, keyed by content; `Ref`s
name the models and files it reads, `location()`s where it writes. `Measurement` says how every model of a
plan is measured, and `measure_steps` adds the two steps that measure one.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Mapping

from evals.lmeval import EVAL_CODE, run_eval
from evals.protocol import EvalProtocol
from evals.sink import MEASURE_CODE
from evals.sink.calibration import DEFAULT_SET, resolve_texts
from evals.tasks import SHIPPED_TASKS, shipped_task_digest
from experiments.study.graph import Step
from experiments.study.kinds import Ref, StepArgs, keyed, location
from experiments.study.loaders import load_model
from interventions.adapt import code as adapt_code
from interventions.pairs import load_causal_lm, plan_extraction, resolve, write_language_model
from interventions.pairs.resolve import load_config
from interventions.pairs.writer import DEFAULT_MAX_SHARD_BYTES  # its module loads tqdm, not a weight library
from interventions.registry import QKNORM, apply_intervention, request
from sinkstudy import SinkstudyError
from sinkstudy.checkpoint import load_tokenizer, try_load_tokenizer
from sinkstudy.io import atomic_output_dir, read_json, write_json_atomic
from sinkstudy.provenance import file_digest, model_fingerprint, package_versions, provenance

# The modules the streamed extraction runs (`experiments.study.kinds.code_identity`).
PAIRS_CODE = ("interventions.pairs.layout", "interventions.pairs.archs", "interventions.pairs.resolve", "interventions.pairs.tensors",
              "interventions.pairs.extract", "interventions.pairs.writer")


@dataclass(frozen=True)
class Loading:
    """How models are loaded: dtype and device."""

    dtype: str = "float32"
    device: str | None = None

    def load(self, path: str):
        """(model, tokenizer or None) of the checkpoint at `path`, as the pair loader reads it."""
        # lazy: loads torch, numpy
        import torch

        return load_causal_lm(path, dtype=getattr(torch, self.dtype), device=self.device or "cpu")


def texts_ref(texts) -> Ref | str | None:
    """Calibration texts as a step reads them: a file by content, a shipped set by name, None: the default set."""
    if isinstance(texts, (str, os.PathLike)) and Path(texts).expanduser().is_file():
        return Ref(os.fspath(texts))
    return texts


def _texts(texts, default_set: str) -> list[str]:
    return [t.text for t in resolve_texts(texts.path if isinstance(texts, Ref) else texts, default_set)[0]]


def _tokenizer(model_tokenizer, tokenizer: Ref | None):
    """The model's own tokenizer, unless another is named (the base's: the prompts every model of a pair sees)."""
    return load_tokenizer(tokenizer.local()) if tokenizer is not None else model_tokenizer


# --------------------------------------------------------------------------- the VLM's language model

@dataclass(frozen=True)
class Extract(StepArgs):
    """The VLM's language model in the base's class and vocabulary, streamed disk to disk in `dtype` in shards of at
    most `max_shard_bytes`: about one shard in memory; the vision tower is never read or built (`sinkstudy pair
    extract`, and every pair's extraction in a study)."""

    kind: ClassVar[str] = "extract"
    code: ClassVar[tuple[str, ...]] = PAIRS_CODE
    base: Ref
    vlm: Ref
    dtype: str | None  # None: the VLM's stored dtype
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES
    out: Path = location()

    def run(self, ctx) -> dict:
        base = resolve(self.base.local())
        if base.kind != "causal_lm":
            raise SinkstudyError(f"the base must be a causal LM, got a {base.config.model_type} VLM: {base.id}")
        plan = plan_extraction(self.vlm.local(), base)  # every check before any weight is read
        report = plan.report.to_dict()
        extra = {"base": self.base.path, "vlm": self.vlm.path, "dtype": self.dtype, "base_fingerprint": self.base.fingerprint(ctx),
                 "vlm_fingerprint": self.vlm.fingerprint(ctx), "extraction": report}
        write_language_model(plan, self.out, tokenizer=try_load_tokenizer(base.tokenizer_path or self.base.local()),
                             dtype=self.dtype, replace=True, max_shard_bytes=self.max_shard_bytes, extra=extra, progress=ctx.progress)
        return {"path": str(self.out), "report": report, "fingerprint": model_fingerprint(self.out)}


@dataclass(frozen=True)
class ExtractAdapted(StepArgs):
    """An adapted VLM's language model, extracted against the base it started from (`own_class`: in the class
    the adaptation trained, where it changed the base's: an injected QK-norm, a protection's architecture)."""

    kind: ClassVar[str] = "extract-adapted"
    code: ClassVar[tuple[str, ...]] = (*PAIRS_CODE, "interventions.pairs.loading", "interventions.adapt.vlm_io", "interventions.qknorm")
    vlm: Ref
    start: Ref
    own_class: bool = False
    out: Path = location()

    def run(self, ctx) -> dict:
        # lazy: loads torch, transformers, scipy
        from interventions.adapt.vlm_io import save_extracted_lm

        save_extracted_lm(self.vlm.local(), self.start.local(), self.out, replace=True, own_class=self.own_class)
        return {"path": str(self.out), "fingerprint": model_fingerprint(self.out)}


# --------------------------------------------------------------------------- measurements

@dataclass(frozen=True)
class MeasureSink(StepArgs):
    """Sink maps and Sink Strength of a model on calibration texts."""

    kind: ClassVar[str] = "sink"
    code: ClassVar[tuple[str, ...]] = MEASURE_CODE
    model: Ref
    tokenizer: Ref | None  # when the model has none: the base's
    metric: str = "logodds"
    texts: Ref | str | None = None  # None: the metric's own calibration set
    params: Mapping[str, Any] = field(default_factory=dict)
    options: Mapping[str, Any] = field(default_factory=dict)
    loading: Loading = Loading()
    out: Path = location()  # the maps, as JSON

    def run(self, ctx) -> dict:
        # lazy: loads torch, numpy
        from evals.sink import compute_sink_maps, strength_from_maps

        model, tok = self.loading.load(self.model.local())
        tok = tok if tok is not None else _tokenizer(None, self.tokenizer)
        texts = self.texts.path if isinstance(self.texts, Ref) else self.texts
        maps = compute_sink_maps(model, tok, texts, metric=self.metric, progress=ctx.progress, **self.options)
        strength = strength_from_maps(maps, self.metric, **self.params)
        write_json_atomic(self.out, maps.to_json())
        details = {k: v for k, v in strength.details.items() if k != "median_per_layer"}
        return {"value": strength.value, "metric": strength.metric, "details": details,
                "median_per_layer": strength.details.get("median_per_layer"), "mean_mass": float(maps.mass.mean()),
                "maps": str(self.out)}


@dataclass(frozen=True)
class SinkMap(StepArgs):
    """A model's sink maps in full (`sinkstudy sink`): Sink Strength under a named metric, the maps as JSON
    (`sink.json`, with provenance) and the heat map of the statistic the metric reads (`sink_map.png`; a
    random-embedding control's beside it for the robustness metric)."""

    kind: ClassVar[str] = "sink-map"
    code: ClassVar[tuple[str, ...]] = MEASURE_CODE
    model: Ref
    tokenizer: Ref | None  # None: the model's own
    metric: str
    texts: Ref | str | None
    params: Mapping[str, Any] = field(default_factory=dict)
    capture: str = "fast"
    batch_size: int = 1
    max_length: int = 512
    loading: Loading = Loading()
    out: Path = location()  # a folder: sink.json, sink_map.png

    def run(self, ctx) -> dict:
        # lazy: loads torch, numpy
        from evals.sink import plot_sink_map, sink_strength

        model, tok = self.loading.load(self.model.local())
        tok = _tokenizer(tok, self.tokenizer)
        if tok is None:
            raise SinkstudyError(f"no tokenizer found for {self.model.path}; pass --tokenizer")
        texts = self.texts.path if isinstance(self.texts, Ref) else self.texts
        result = sink_strength(model, tok, self.metric, texts, method=self.capture, batch_size=self.batch_size,
                               max_length=self.max_length, progress=ctx.progress, **self.params)
        maps = result.maps
        data = {"model": self.model.path, **result.to_json(),
                "provenance": provenance(model=self.model.path, model_fingerprint=self.model.fingerprint(ctx), dtype=self.loading.dtype,
                                         seeds={"noise_seed": result.details["params"].get("noise_seed")},
                                         settings={**maps.settings, "metric_params": result.details["params"]})}
        write_json_atomic(self.out / "sink.json", data)
        name = Path(self.model.path.rstrip("/")).name
        # The map shows the statistic the metric reads (log-odds for S, else the sink mass).
        plot_sink_map(maps, self.out / "sink_map.png", metric=self.metric, title=f"{name}: {self.metric} ({maps.settings['calibration']})")
        if result.noise_maps is not None:
            plot_sink_map(result.noise_maps, self.out / "sink_map_noise.png", metric=self.metric, title=f"{name}: random embeddings")
        return {"value": result.value, "metric": result.metric, "file": str(self.out / "sink.json")}


@dataclass(frozen=True)
class MeasureEval(StepArgs):
    """Strict evals of a model through lm-eval, prompted through `tokenizer` (the base's for every model of a
    pair, so runs pair on doc_id; `sinkstudy eval`: the model's own); keyed by the models' content, the protocol
    (a task's data by content: a local file's and the shipped tasks' own), the seed, dtype and device, the eval
    code and lm-eval's version. Writes the run (`evals.eval_run.EvalRun`: results.json, samples/) into `out`."""

    kind: ClassVar[str] = "eval"
    code: ClassVar[tuple[str, ...]] = EVAL_CODE
    model: Ref
    tokenizer: Ref
    protocol: EvalProtocol
    seed: int = 0
    loading: Loading = Loading()
    out: Path = location()

    def identity(self, ctx) -> dict:
        out = keyed(self, ctx)
        files = self.protocol.data_files
        out["protocol"]["data_files"] = {t: file_digest(f) if Path(f).is_file() else f"missing:{f}" for t, f in files.items()}
        out["shipped_tasks"] = {t: shipped_task_digest(t) for t in self.protocol.tasks if t in SHIPPED_TASKS}
        out["lm_eval"] = package_versions().get("lm_eval")  # lm-eval's own tasks and graders come with its version
        return out

    def run(self, ctx) -> dict:
        run = run_eval(self.model.local(), self.tokenizer.local(), protocol=self.protocol, out_dir=self.out,
                       device=self.loading.device, dtype=self.loading.dtype, seed=self.seed, progress=ctx.progress, loader=load_model)
        if run is None:
            return {}  # a data-parallel worker: rank 0 writes the run
        return {"dir": str(self.out), "scores": run.scores, "fingerprint": run.fingerprint}


@dataclass(frozen=True)
class Measurement:
    """How every model of a plan is measured: Sink Strength's metric, texts and settings, the eval protocol,
    the seed and how models are loaded."""

    metric: str = "logodds"
    texts: Ref | str | None = None
    params: Mapping[str, Any] = field(default_factory=dict)
    options: Mapping[str, Any] = field(default_factory=dict)
    protocol: EvalProtocol = EvalProtocol()
    seed: int = 0
    loading: Loading = Loading()

    def sink(self, model: Ref, tokenizer: Ref | None, out: Path) -> MeasureSink:
        return MeasureSink(model, tokenizer, self.metric, self.texts, self.params, self.options, self.loading, out=out)

    def eval(self, model: Ref, tokenizer: Ref, out: Path) -> MeasureEval:
        return MeasureEval(model, tokenizer, self.protocol, self.seed, self.loading, out=out)


def measure_steps(m: Measurement, group: str, label: str, model: Ref, tokenizer: Ref, sink_out: Path, eval_out: Path, *,
                  deps: tuple[str, ...] = (), owner: str = "") -> tuple[Step, Step]:
    """`<group>/sink/<label>` and `<group>/eval/<label>`: the two steps that measure `model`."""
    return (Step(f"{group}/sink/{label}", m.sink(model, tokenizer, sink_out), deps, (sink_out,), owner=owner),
            Step(f"{group}/eval/{label}", m.eval(model, tokenizer, eval_out), deps, (eval_out,), owner=owner))


# --------------------------------------------------------------------------- treatments

@dataclass(frozen=True)
class Intervene(StepArgs):
    """A registered intervention (`interventions.registry`: merges, spectral merges, mitigations) on (base, VLM
    LM); keyed by the registry's request: the inputs' content, every setting, the seed and the method's code
    (a plug-in's source included)."""

    kind: ClassVar[str] = "intervene"
    method: str
    base: Ref
    vlm: Ref
    params: Mapping[str, Any] = field(default_factory=dict)
    seed: int = 0
    root: Ref | None = None  # the common pretrained ancestor, for task-vector methods
    sink_maps: Mapping[str, Ref] | None = None  # {"base", "vlm"}: the maps a mitigation reads
    mergekit: Mapping[str, bool] = field(default_factory=dict)  # how mergekit runs (only `cuda` changes the numbers)
    out: Path = location()

    def identity(self, ctx) -> dict:
        models = {"base": self.base.fingerprint(ctx), "vlm": self.vlm.fingerprint(ctx),
                  **({"root": self.root.fingerprint(ctx)} if self.root is not None else {})}
        maps = {k: r.fingerprint(ctx) for k, r in self.sink_maps.items()} if self.sink_maps else None
        return request(self.method, self._params(local=False), self.seed, models, sink_maps=maps, mergekit_options=self.mergekit)

    def _params(self, *, local: bool) -> dict:
        params = dict(self.params)
        if self.root is not None:
            params["root"] = self.root.local() if local else self.root.path
        if self.sink_maps and local:
            params["sink_maps"] = {k: r.local() for k, r in self.sink_maps.items()}
        return params

    def run(self, ctx) -> dict:
        out = apply_intervention(self.method, self.base.local(), self.vlm.local(), self._params(local=True), self.out,
                                 seed=self.seed, replace=True, progress=ctx.progress, mergekit_options=dict(self.mergekit) or None)
        info = read_json(Path(out) / "intervention.json") if (Path(out) / "intervention.json").is_file() else {}
        return {"path": str(out), "fingerprint": model_fingerprint(out), "info": {k: v for k, v in info.items() if k != "provenance"}}


@dataclass(frozen=True)
class InjectQKNorm(StepArgs):
    """QK-RMSNorm injected into the base (`init`; None: a base with QK-norm of its own, kept as it is), compared
    with it on calibration texts (next-token KL, Sink Strength); with `train_steps`, the parameters `trainable`
    names then trained on `training_text` to recover, and compared again."""

    kind: ClassVar[str] = "qknorm"
    code: ClassVar[tuple[str, ...]] = ("interventions.qknorm", "interventions.qknorm_modes", *adapt_code.TRAINING, *MEASURE_CODE)
    base: Ref
    init: str | None = QKNORM.defaults["init"]  # the registry's defaults (interventions.registry.QKNORM), written once
    alpha: float = QKNORM.defaults["alpha"]
    texts: Ref | str | None = None  # calibration texts (gains, KL, S); None: `default_texts`
    default_texts: str = DEFAULT_SET
    tokenizer: Ref | None = None  # None: the base's own
    train_steps: int = QKNORM.defaults["train_steps"]
    trainable: str = QKNORM.defaults["trainable"]
    lr: float = QKNORM.defaults["lr"]
    batch_size: int = QKNORM.defaults["batch_size"]
    seq_len: int = QKNORM.defaults["seq_len"]
    training_text: Ref | None = None  # `interventions.training.read_training_texts`
    seed: int = 0
    loading: Loading = Loading()
    out: Path = location()

    def run(self, ctx) -> dict:
        # lazy: loads torch, numpy
        from interventions.qknorm import checkpoint_format, init_report, inject_qk_norm, qk_norm_kind, save_injected, trainable_filter
        from interventions.training import read_training_texts, train_causal_lm

        model, tok = self.loading.load(self.base.local())
        tok = _tokenizer(tok, self.tokenizer)
        if tok is None:
            raise SinkstudyError(f"no tokenizer found for {self.base.path}; pass one")
        texts = _texts(self.texts, self.default_texts)
        native = self.init is None
        if native and qk_norm_kind(model) != "native":
            raise SinkstudyError(f"{self.base.path} has no QK-norm of its own to keep")
        candidate = copy.deepcopy(model)
        if not native:
            inject_qk_norm(candidate, init=self.init, calibration_texts=texts, tokenizer=tok, alpha=self.alpha, progress=ctx.progress)
        report: dict[str, Any] = {"init": init_report(model, candidate, tok, texts, progress=ctx.progress)}
        if self.train_steps:
            if self.training_text is None:
                raise SinkstudyError("QK-norm recovery training needs training text")
            stats = train_causal_lm(candidate, tok, read_training_texts(self.training_text.local(), tok), steps=self.train_steps,
                                    lr=self.lr, batch_size=self.batch_size, seq_len=self.seq_len, device=self.loading.device,
                                    trainable=trainable_filter(self.trainable), seed=self.seed, progress=ctx.progress,
                                    desc=f"recovery ({self.trainable})")
            report["training"] = stats
            report["after_training"] = init_report(model, candidate, tok, texts, progress=ctx.progress,
                                                   sink_original=report["init"]["sink_strength_original"])
        if native:
            with atomic_output_dir(self.out, replace=True) as tmp:
                candidate.save_pretrained(tmp)
                tok.save_pretrained(tmp)
        else:
            save_injected(candidate, self.out, tokenizer=tok, metadata={"init": self.init, "alpha": self.alpha}, replace=True)
        return {"path": str(self.out), "fingerprint": model_fingerprint(self.out), "report": report,
                "checkpoint_format": "native" if native else checkpoint_format(candidate)}


def native_qk_norm(base: Ref, stated: bool | None) -> bool:
    """Whether a base has QK-norm of its own: `stated` (a study's `native_qk_norm`), else its model type."""
    if stated is not None:
        return bool(stated)

    cfg = load_config(base.path, revision=base.revision)
    return getattr(cfg, "model_type", "") in ("qwen3", "gemma3_text", "olmo2", "olmo3")


