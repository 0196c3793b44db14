"""One model's eval run as a record: `EvalRun` (per task the scores, every sample's prompt, output and per-metric
values, the settings and provenance), written to and read from a folder (`results.json` + `samples/<task>.jsonl`),
and the number each task is reported by (`HEADLINE_METRICS`). `evals.lmeval.run_eval` makes one; `evals.stats`
compares two prompt by prompt.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sinkstudy import SinkstudyError
from sinkstudy.io import atomic_output_dir, json_default, read_json, write_json_atomic, write_text_atomic

# The number each task is reported by (seed paper: IFEval prompt-level strict; GSM8K-CoT and
# GPQA-CoT flexible-extract; EQ-Bench its score; the controls their lm-eval default metric).
HEADLINE_METRICS = {
    "ifeval": "prompt_level_strict_acc,none",
    "sinkstudy_ifeval": "prompt_level_strict_acc,none",
    "sinkstudy_ifeval_large": "prompt_level_strict_acc,none",
    "sinkstudy_ifbench": "prompt_level_strict_acc,none",
    "gsm8k_cot": "exact_match,flexible-extract",
    "sinkstudy_gsm": "exact_match,flexible-extract",
    "bbh_cot_fewshot": "exact_match,get-answer",
    "eq_bench": "eqbench,none",
    "gpqa_diamond_cot_zeroshot": "exact_match,flexible-extract",
    "mmlu": "acc,none",
    "boolq": "acc,none",
    "mbpp": "pass_at_1,none",
    "mmlu_pro": "exact_match,custom-extract",
}
RESULTS_FILE = "results.json"
SAMPLES_DIR = "samples"


@dataclass
class EvalRun:
    """One model evaluated on a set of tasks.

    scores:  {task: {"metric,filter": value, "metric_stderr,filter": value or None}}
    samples: {task: [{"doc_id", "doc_hash", "prompt", "output", "target", "extracted": {filter: str},
                      "metrics": {"metric,filter": bool | float | list[bool]}}]}
    """

    scores: dict[str, dict[str, Any]]
    samples: dict[str, list[dict[str, Any]]]
    settings: dict[str, Any]
    fingerprint: str
    model_name: str = ""
    tasks: list[str] = field(default_factory=list)
    versions: dict[str, Any] = field(default_factory=dict)
    higher_is_better: dict[str, dict[str, bool]] = field(default_factory=dict)
    groups: dict[str, list[str]] = field(default_factory=dict)  # group -> its subtasks (e.g. BBH)
    provenance: dict[str, Any] = field(default_factory=dict)

    def metrics(self, task: str) -> list[str]:
        """The metric keys of a task ("metric,filter"), stderr keys left out."""
        return [k for k in self.scores.get(task, {}) if "_stderr," not in k]

    def docs(self, task: str) -> dict[Any, dict[str, Any]]:
        """{key: sample} of a task; a group pools its subtasks' samples under "subtask/doc_id" keys."""
        if task in self.samples:
            return {s["doc_id"]: s for s in self.samples[task]}
        if task in self.groups:
            pooled = {}
            for sub in self.groups[task]:
                pooled.update({f"{sub}/{k}": s for k, s in self.docs(sub).items()})
            return pooled
        raise SinkstudyError(f"run has no samples for task {task!r}; it has {', '.join([*self.samples, *self.groups]) or 'none'}")

    def per_doc(self, task: str, metric: str) -> dict[Any, Any]:
        """{doc key: per-sample value} of one metric (doc_id; "subtask/doc_id" for a group)."""
        out = {k: s["metrics"][metric] for k, s in self.docs(task).items() if metric in s["metrics"]}
        if not out:
            raise SinkstudyError(f"task {task!r} has no per-sample metric {metric!r}; it has {', '.join(self.metrics(task))}")
        return out

    def save(self, path: str | os.PathLike) -> Path:
        """Write samples/<task>.jsonl, then results.json (scores, settings, provenance), into the folder `path`, each
        whole (an earlier run's replaced); anything else there (a command's step records) is left as it is."""
        path = Path(path)
        with atomic_output_dir(path / SAMPLES_DIR, replace=True) as tmp:
            for task, rows in self.samples.items():
                text = "".join(json.dumps(r, default=json_default, ensure_ascii=False) + "\n" for r in rows)
                write_text_atomic(tmp / f"{task}.jsonl", text)
        write_json_atomic(path / RESULTS_FILE, self._header())
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> "EvalRun":
        path = Path(path)
        header = read_json(path / RESULTS_FILE)
        samples = {}
        for task in header["sample_tasks"]:
            f = path / SAMPLES_DIR / f"{task}.jsonl"
            if not f.is_file():
                raise SinkstudyError(f"eval run {path} is missing {f.relative_to(path)}")
            samples[task] = [json.loads(line) for line in f.read_text(encoding="utf-8").splitlines() if line]
        fields = {k: header.get(k) for k in ("scores", "settings", "fingerprint", "model_name", "tasks", "versions", "higher_is_better",
                                             "groups", "provenance")}
        return cls(samples=samples, **fields)

    def _header(self) -> dict[str, Any]:
        return {
            "model_name": self.model_name,
            "fingerprint": self.fingerprint,
            "tasks": self.tasks,
            "scores": self.scores,
            "versions": self.versions,
            "higher_is_better": self.higher_is_better,
            "groups": self.groups,
            "settings": self.settings,
            "sample_tasks": list(self.samples),
            "provenance": self.provenance,
        }

    def summary(self) -> str:
        lines = [f"{self.model_name or self.fingerprint}"]
        for task, metrics in self.scores.items():
            for m in self.metrics(task):
                err = metrics.get(m.replace(",", "_stderr,", 1))
                lines.append(f"  {task:<28} {m:<36} {_fmt(metrics[m])}" + (f" ± {_fmt(err)}" if isinstance(err, float) else ""))
        return "\n".join(lines)


def _fmt(v: Any) -> str:
    return f"{v:.4f}" if isinstance(v, float) else str(v)


def _fmt(v: Any) -> str:
    return f"{v:.4f}" if isinstance(v, float) else str(v)
