"""A study's `summary.json` read back as typed records: the statistics as `evals.stats`' own
`Comparison`, `Recovery` and `SinkCorrelation`, per pair, model and arm. The report, its answers and findings
read these (`StudyResults.of(summary)`), never the JSON's nested keys; the figures take the JSON as is."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from evals.stats import Comparison, Recovery, SinkCorrelation


def vl_accuracy(skill: dict | None) -> float | None:
    """The held-out VL accuracy of a VL-skill result (either probe; a digit probe's of an older summary)."""
    skill = skill or {}
    return skill.get("accuracy", skill.get("digit_accuracy"))


@dataclass
class ModelResult:
    path: str | None
    sink_strength: float
    mean_mass: float | None
    sink_maps: str | None
    scores: dict
    method: str | None  # None: the base and the VLM LM; qknorm, qknorm+vl, protection, or a registered method
    template_share: dict | None = None  # per task: {share, n, templated, examples} (experiments.study.template)
    vl_skill: dict | None = None  # held-out VL skill (its own VLM's, or its LM's put back into the pair's VLM)


@dataclass
class Effect:
    """One treated model against the pair, per task: recovery of the loss, Δ against the base and against the VLM LM."""

    recovery: Recovery
    vs_base: Comparison
    vs_vlm: Comparison


@dataclass
class ArmResult:
    label: str  # the model's label in the pair (the control's: vlm)
    protections: list[str]
    vl_skill: dict | None
    sink_strength: float
    adapt: dict | None  # stages, trajectory, hook reports
    vs_control: dict[str, Comparison] | None  # per task, Δ = arm − control; None for the control
    qknorm: dict | None = None  # QK-norm injected before the recipe ({init, alpha})
    seed: int | None = None  # the arm's training seed (None: the recipe's)
    text_only: dict | None = None  # the data of a text-only arm (the recipe's LM training without images)
    training_seed: int | None = None  # the seed the arm trained with (its own, else the recipe's)
    replicate_of: str | None = None  # the first arm of the same treatment (its seeds are reported under that name)
    control: str | None = None  # the arm vs_control is measured against (the untreated arm of the same seed)
    vs_base: dict[str, Comparison] | None = None  # an untreated replicate's own degradation, per task
    replay: str | None = None  # the text-replay arm of the same seed a protection is also set against
    vs_replay: dict[str, Comparison] | None = None  # per task, Δ = arm − that replay arm

    def changes(self) -> str:
        """What the arm changes against the control, in words ("none" for the control)."""
        parts = list(self.protections) + ([f"qknorm {self.qknorm['init']}"] if self.qknorm else []) + \
            (["text only"] if self.text_only else []) + ([f"seed {self.seed}"] if self.seed is not None else [])
        return ", ".join(parts) or "none"


@dataclass
class PairResult:
    name: str
    models: dict[str, ModelResult]
    degradation: dict[str, Comparison]  # per task, base -> VLM LM
    interventions: dict[str, dict[str, Effect]]  # label -> task -> Effect
    arms: dict[str, ArmResult] = field(default_factory=dict)
    examples: list = field(default_factory=list)
    published: dict | None = None
    native_qk_norm: bool | None = None
    vl_cost: dict[str, dict] = field(default_factory=dict)  # label -> {accuracy, vlm_accuracy, delta_points}

    def method(self, label: str) -> str | None:
        return self.models[label].method


@dataclass
class StudyResults:
    name: str
    tasks: list[str]
    headline: dict[str, str | None]
    pairs: dict[str, PairResult]
    correlation: dict[str, SinkCorrelation]
    correlation_note: str | None = None
    timings: dict[str, float] = field(default_factory=dict)
    settings: dict[str, Any] = field(default_factory=dict)  # what the study was set to (title, metric, protocol...)
    build: dict | None = None  # the demo's build facts (experiments.demo.steps.build_facts)
    versions: dict[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, summary: dict) -> "StudyResults":
        pairs = {p: _pair(p, e) for p, e in summary["pairs"].items()}
        return cls(summary["study"], list(summary["tasks"]), dict(summary["headline"]), pairs,
                   {t: SinkCorrelation.from_dict(c) for t, c in (summary.get("correlation") or {}).items()},
                   summary.get("correlation_note"), dict(summary.get("timings") or {}), dict(summary.get("settings") or {}),
                   summary.get("build"), dict((summary.get("provenance") or {}).get("versions") or {}))

    @property
    def paper_task(self) -> str:
        """The task set beside the paper's IFEval figures: the study's IFEval-like task, else its first."""
        return next((t for t in self.tasks if "ifeval" in t), self.tasks[0])

    def base_strengths(self, only=None) -> list[float]:
        return [e.models["base"].sink_strength for p, e in self.pairs.items() if only is None or p in only]


def _pair(name: str, e: dict) -> PairResult:
    models = {label: ModelResult(m.get("path"), m["sink_strength"], m.get("mean_mass"), m.get("sink_maps"), m.get("scores") or {},
                                 m.get("method"), m.get("template_share"), m.get("vl_skill")) for label, m in e["models"].items()}
    effects = {label: {t: Effect(Recovery.from_dict(x["recovery"]), Comparison.from_dict(x["vs_base"]), Comparison.from_dict(x["vs_vlm"]))
                       for t, x in per_task.items()} for label, per_task in e["interventions"].items()}
    arms = {arm: ArmResult(a["label"], list(a["protections"]), a.get("vl_skill"), a["sink_strength"], a.get("adapt"),
                           {t: Comparison.from_dict(c) for t, c in a["vs_control"].items()} if a.get("vs_control") else None,
                           a.get("qknorm"), a.get("seed"), a.get("text_only"), a.get("training_seed"), a.get("replicate_of"),
                           a.get("control"),
                           {t: Comparison.from_dict(c) for t, c in a["vs_base"].items()} if a.get("vs_base") else None,
                           a.get("replay"),
                           {t: Comparison.from_dict(c) for t, c in a["vs_replay"].items()} if a.get("vs_replay") else None)
            for arm, a in ((e.get("protection") or {}).get("arms") or {}).items()}
    return PairResult(name, models, {t: Comparison.from_dict(c) for t, c in e["degradation"].items()}, effects, arms,
                      list(e.get("examples") or []), e.get("published"), e.get("native_qk_norm"), dict(e.get("vl_cost") or {}))
