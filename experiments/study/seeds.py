"""A study repeated over training seeds (`seeds: [0, 1, 2]` in its YAML, `--seeds 0,1,2` on the command line).

Floating-point differences are amplified by training, so one training seed is one draw. With `seeds`, the
study runs once per seed with every *training* seed set to it (`reseed`: the study's `seed`, the build's
pretraining and VL seeds, every backbone's, the adaptation recipe's); the data stay the same (the corpus,
held-out prompts, the adaptation arms' own seeds), so every seed is graded on the same prompts. The first
seed's run is the study's own output directory; seed N's is `<out>/seeds/N` (a study of its own, with its
summary and report). The first seed's summary.json then gains a `seeds` section holding every other seed's
summary, from which its report gives each headline figure per seed with the across-seed spread, and states
an answer only where every seed gives the same one (`experiments.report.document`).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Callable

from experiments.study.config import validate
from sinkstudy.io import read_json, write_json_atomic


def reseed(raw: dict, seed: int) -> dict:
    """The study config `raw` with every training seed set to `seed` (and no `seeds` key)."""
    out = copy.deepcopy(raw)
    out.pop("seeds", None)
    out["seed"] = seed
    build = out.get("build")
    if isinstance(build, dict):
        build["pretrain"] = {**(build.get("pretrain") or {}), "seed": seed}
        build["backbones"] = [{**b, "seed": seed} if isinstance(b, dict) else b for b in build.get("backbones") or []]
        build["vl"] = {**(build.get("vl") or {}), "seed": seed}
    if isinstance(out.get("adapt"), dict):
        out["adapt"]["seed"] = seed
    return out


def seed_dir(out: Path, seeds: list[int], seed: int) -> Path:
    return Path(out) if seed == seeds[0] else Path(out) / "seeds" / str(seed)


def run_seeds(study, run_one: Callable) -> dict:
    """Run `study` once per seed of `study.seeds` (`run_one(study) -> result`), the first seed first; then attach
    every other seed's summary to the first's and re-render its report. Returns the first seed's result."""
    # lazy: loads torch, numpy
    from experiments.report.document import write_report
    from experiments.study.dose_response import over_seeds

    if not study.seeds:
        return run_one(study)
    runs = {}
    for seed in study.seeds:
        sub = validate(reseed(study.raw, seed), path=study.path, out=seed_dir(study.out, study.seeds, seed), build=study.build_reader)
        sub.plugins = study.plugins
        runs[seed] = run_one(sub)
    first = Path(study.out)
    summary = read_json(first / "summary.json")
    summary["seeds"] = {"seeds": list(study.seeds), "note": "training seeds; data and prompts the same for every seed",
                        "runs": {str(s): {"out": str(seed_dir(first, study.seeds, s)),
                                          "summary": _lean(read_json(seed_dir(first, study.seeds, s) / "summary.json"))}
                                 for s in study.seeds[1:]}}
    over_seeds(summary)  # the dose-response's slope refitted over every seed's points
    write_json_atomic(first / "summary.json", summary)
    write_report(summary, first)
    return runs[study.seeds[0]]


def _lean(summary: dict) -> dict:
    """A seed's summary without what the first seed's report never reads from it."""
    return {k: v for k, v in summary.items() if k not in ("seeds", "hardware")}
