"""What lm-eval's `simple_evaluate` returns, read into sinkstudy's run record: per requested task (a group with its
subtasks) the scores, versions and one sample per document with its prompt, output, extracted answers and
per-metric values (`task_record`; lm-eval logs one entry per document and filter, folded here into one)."""

from __future__ import annotations

import json
from typing import Any, Mapping

from evals.tasks import TaskSpec
from sinkstudy.io import json_default


def task_record(res: dict[str, Any], spec: TaskSpec) -> dict[str, Any]:
    """Scores, versions and per-doc samples of one requested task (a group brings its subtasks)."""
    names = [spec.name, *_subtasks(res.get("group_subtasks", {}), spec.name)]
    results = {**res["results"], **res.get("groups", {})}
    scores, samples = {}, {}
    for name in names:
        if name in results:
            scores[name] = {k: (None if v == "N/A" else v) for k, v in results[name].items() if "," in k}
        if name in res.get("samples", {}):
            samples[name] = merge_samples(res["samples"][name])
    return {
        "task": spec.name,
        "scores": json.loads(json.dumps(scores, default=json_default)),
        "samples": json.loads(json.dumps(samples, default=json_default)),
        "versions": {n: res["versions"].get(n) for n in names if n in res["versions"]},
        "higher_is_better": {n: res["higher_is_better"][n] for n in names if n in res.get("higher_is_better", {})},
        "n_samples": {n: res["n-samples"][n] for n in names if n in res.get("n-samples", {})},
        "groups": {n: list(res["group_subtasks"][n]) for n in names if res.get("group_subtasks", {}).get(n)},
    }


def _subtasks(group_subtasks: Mapping[str, list[str]], name: str) -> list[str]:
    out = []
    for child in group_subtasks.get(name, []):
        out += [child, *_subtasks(group_subtasks, child)]
    return out


def merge_samples(raw: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """lm-eval logs one entry per (doc, filter); fold them into one record per doc."""
    by_doc: dict[int, dict[str, Any]] = {}
    for s in raw:
        rec = by_doc.setdefault(s["doc_id"], {
            "doc_id": s["doc_id"],
            "doc_hash": s["doc_hash"],
            "prompt": prompt_text(s["arguments"]),
            "output": s["resps"][0][0] if s["resps"] and s["resps"][0] else "",
            "target": s["target"],
            "extracted": {},
            "metrics": {},
        })
        flt = s["filter"]
        fr = s["filtered_resps"][0] if s["filtered_resps"] else None
        rec["extracted"][flt] = fr[0] if isinstance(fr, list) and len(fr) == 1 else fr
        for m in s["metrics"]:
            rec["metrics"][f"{m},{flt}"] = s[m]
    return [by_doc[k] for k in sorted(by_doc)]


def prompt_text(arguments) -> str:
    first = arguments[0]
    if isinstance(first, dict):  # some lm-eval versions log {"gen_args_0": {"arg_0": ..., "arg_1": ...}}
        first = next(iter(first.values()))
        return first.get("arg_0", "") if isinstance(first, dict) else str(first)
    return first[0] if isinstance(first, (list, tuple)) else str(first)
