"""The dose-response of a study's sink doses (docs/dose.md, "The dose-response study"): per backbone, the change VL
training made (Δ = the VLM LM − the base it was adapted from, points) against the Sink Strength S of that base before
it, over the undosed base and every adapted dose; a least-squares slope with a bootstrap CI, and the causal answer
to "a stronger sink, less loss" read from it.

Convention: the slope is in points of Δ per unit of S; a positive slope means a stronger sink loses less (the
paper's direction). Its CI resamples prompts jointly (one draw of prompt indices for every point's paired
before/after scores, then a refit) and, per point, its training seeds (a dose adapted with several seeds, the undosed
base's control and its seed replicates, or a study repeated over seeds).

The answer is "agrees" (the slope's CI lies above 0), "disagrees" (below 0) or "not established", which it must be
when fewer than MIN_CONCLUSIVE_N prompts or fewer than 3 points (of distinct S) are compared, or when most adapted
models answer in the VL training template (template share at or above COLLAPSE_SHARE: their Δ is read as collapse to
the template, not erosion). A dose that itself costs text skill before VL training is named beside the
answer as a confound.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from evals.stats import MIN_CONCLUSIVE_N, POINTS, ci_side, paired, percentile_ci
from evals.template_share import COLLAPSE_SHARE

AGREES, DISAGREES, OPEN = "agrees", "disagrees", "not established"
MIN_POINTS = 3  # a line through two points has no residual to test: the third point is the first check of linearity
CONVENTION = ("slope = least-squares slope of Δ on S in points of Δ per unit of S (Δ = VLM LM − the base it was adapted "
              "from; S = that base's Sink Strength before VL training); positive = a stronger sink loses less (the "
              "paper's direction); its CI resamples prompts jointly over every point (and training seeds, where several)")
_CHUNK = 500


def _slopes(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least-squares slope of y on x along the last axis (NaN where x does not vary)."""
    xc = x - x.mean(axis=-1, keepdims=True)
    sxx = (xc ** 2).sum(axis=-1)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(sxx > 0, (xc * (y - y.mean(axis=-1, keepdims=True))).sum(axis=-1) / np.where(sxx > 0, sxx, 1), np.nan)


def fit(s, before: tuple, after: tuple, *, n_boot: int, confidence: float, seed: int = 0, present=None) -> dict[str, Any]:
    """The slope of Δ on S with its bootstrap CI. `s`: (K seeds, P points) Sink Strengths; `before`, `after`: each a
    (num, den) pair of (K, P, N prompts) per-prompt scores (a prompt's score = num / den; `evals.stats.paired`), the
    same N prompts for every seed and point; `present` (K, P): which points were trained with which seed (None: every
    one with every seed). Δ[k, p] = 100 (score after − score before); a point's Δ is the mean over its seeds. The point
    fit is scipy's linregress over the P points; each replicate draws N prompt indices once for every point and, per
    point, its seeds with replacement, then refits."""
    # lazy: loads scipy
    from scipy.stats import linregress

    bn, bd, an, ad = (np.asarray(a, dtype=float) for a in (*before, *after))
    k, p, n = bn.shape
    present = np.ones((k, p), dtype=bool) if present is None else np.asarray(present, dtype=bool)
    count = present.sum(0)
    bd, ad = np.where(present[..., None], bd, 1.0), np.where(present[..., None], ad, 1.0)  # absent: 0 / 1, never read
    s = (np.where(present, np.asarray(s, dtype=float), 0.0)).sum(0) / count
    delta = POINTS * (an.sum(-1) / ad.sum(-1) - bn.sum(-1) / bd.sum(-1))  # (K, P)
    y = np.where(present, delta, 0.0).sum(0) / count
    line = linregress(s, y) if np.ptp(s) > 0 else None
    rng = np.random.default_rng(seed)
    seeds_of = [np.flatnonzero(present[:, j]) for j in range(p)]
    dist = []
    for start in range(0, n_boot, _CHUNK):
        b = min(_CHUNK, n_boot - start)
        idx = rng.integers(0, n, size=(b, n))
        score = lambda num, den: np.moveaxis(num[..., idx].sum(-1) / den[..., idx].sum(-1), -1, 0)  # noqa: E731  (b, K, P)
        d = POINTS * (score(an, ad) - score(bn, bd))
        rows = np.arange(b)[:, None]
        points = [d[rows, own[rng.integers(0, len(own), size=(b, len(own)))], j].mean(-1) for j, own in enumerate(seeds_of)]
        dist.append(_slopes(np.broadcast_to(s, (b, p)), np.stack(points, axis=-1)))
    dist = np.concatenate(dist)
    return {"slope": float(line.slope) if line else None, "intercept": float(line.intercept) if line else None,
            "slope_ci": list(percentile_ci(dist, confidence)) if line else [None, None],
            "deltas": [[float(x) if ok else None for x, ok in zip(row, mask)] for row, mask in zip(delta, present)],
            "n_points": p, "n_seeds": int(count.max()), "seeds_per_point": count.tolist(), "n_prompts": n,
            "confidence": confidence, "n_boot": n_boot}


def answer(slope: dict, points: list[dict]) -> dict[str, Any]:
    """The causal answer from a fit (`fit`) and its points ({sink_strength, template_share, text_cost, model} each;
    the adapted models' template shares over every seed): {answer, reason, confounds}."""
    confounds = [f"{pt['model']} costs text skill before VL training (its Δ vs the undosed base has a CI below 0): "
                 "its point mixes the sink with that damage" for pt in points if pt.get("text_cost")]
    known = [pt["template_share"] for pt in points if pt.get("template_share") is not None]
    if len(known) < len(points):
        confounds.append(f"template share not measured for {len(points) - len(known)} of {len(points)} adapted models: "
                         "a collapse to the VL template cannot be ruled out there")
    collapsed = sum(x >= COLLAPSE_SHARE for x in known)
    distinct = {round(pt["sink_strength"], 9) for pt in points}
    ci = slope["slope_ci"]
    if slope["n_prompts"] < MIN_CONCLUSIVE_N:
        verdict, reason = OPEN, f"too few prompts: {slope['n_prompts']} compared, a sign needs at least {MIN_CONCLUSIVE_N}"
    elif len(distinct) < MIN_POINTS or slope["slope"] is None:
        verdict, reason = OPEN, (f"too few points: {len(distinct)} of distinct S, a slope needs at least {MIN_POINTS} "
                                 "(the undosed base and two adapted doses)")
    elif collapsed * 2 > len(points):
        verdict, reason = OPEN, (f"the recipe collapses: {collapsed} of {len(points)} adapted models answer in the VL training "
                                 f"template (template share at or above {COLLAPSE_SHARE:.0%}), so Δ is read as collapse to "
                                 "the template, not erosion")
    else:
        side = ci_side(ci)
        verdict = {1: AGREES, -1: DISAGREES, 0: OPEN}[side]
        reason = {1: "the slope's CI lies above 0: the stronger the sink before VL training, the less text skill it lost",
                  -1: "the slope's CI lies below 0: the stronger the sink before VL training, the more text skill it lost",
                  0: "the slope's CI includes 0"}[side]
        if collapsed:
            confounds.append(f"{collapsed} of {len(points)} adapted models answer in the VL template (share at or above "
                             f"{COLLAPSE_SHARE:.0%}): part of their Δ is collapse, not erosion")
    return {"answer": verdict, "reason": reason, "confounds": list(dict.fromkeys(confounds))}  # once, over seeds too


def _share(model: dict, task: str) -> float | None:
    return ((model.get("template_share") or {}).get(task) or {}).get("share")


def _replicates(entry: dict) -> list[list[tuple[int | None, str, str]]]:
    """Per point (the undosed base, then each adapted dose) its adaptations as (training seed, before label, after
    label): the control and its seed replicates (arms of the control's treatment), each dose and its further seeds."""
    arms = (entry.get("protection") or {}).get("arms") or {}
    control = arms.get("control") or {}
    own = control.get("training_seed")
    undosed = [(own, "base", "vlm")] + [(a.get("training_seed"), "base", a["label"]) for name, a in arms.items()
                                        if name != "control" and a.get("replicate_of") == "control"]
    doses = entry["dose"]["doses"]
    return [undosed] + [[(own, d, f"{d}-vl")] + [(int(seed), d, f"{d}-s{seed}-vl") for seed in e.get("vl_seeds") or {}]
                        for d, e in doses.items() if "vl" in e]


def dose_response(entry: dict, runs: dict, tasks: list[str], kw: dict) -> dict[str, Any] | None:
    """Per task, the dose-response of one pair's summary `entry` (its `models`, `degradation`, `dose` and `protection`
    blocks) with its eval runs by model label (`runs`); None unless at least two doses were adapted. A point's Δ is the
    mean over its training seeds (a dose's `seeds`; the control's seed replicates for the undosed base). Each point
    keeps its per-prompt scores per seed (`per_prompt`) so that a study over several seeds can refit over all of them
    (`over_seeds`)."""
    doses = entry["dose"]["doses"]
    reps = _replicates(entry)
    if len(reps) < 3:
        return None
    seeds = sorted({seed for point in reps for seed, _, _ in point}, key=lambda x: (x is None, x or 0))
    out: dict[str, Any] = {"convention": CONVENTION, "tasks": {}}
    for t in tasks:
        metric = entry["degradation"][t]["metric"]
        flat = [r for point in reps for r in point]
        labels = sorted({label for _, b, a in flat for label in (b, a)})
        docs = sorted(set.intersection(*(set(runs[label].per_doc(t, metric)) for label in labels)))
        arrays = dict(zip(labels, paired(*(runs[label] for label in labels), task=t, metric=metric)))
        shape = (len(seeds), len(reps), len(docs))
        arr = {key: np.zeros(shape) for key in ("before", "before_den", "after", "after_den")}
        present = np.zeros(shape[:2], dtype=bool)
        for j, point in enumerate(reps):
            for seed, b, a in point:
                k = seeds.index(seed)
                present[k, j] = True
                (arr["before"][k, j], arr["before_den"][k, j]), (arr["after"][k, j], arr["after_den"][k, j]) = arrays[b], arrays[a]
        models = [point[0][1] for point in reps]  # each point's before label: "base" or its dose
        s = np.broadcast_to([entry["models"][b]["sink_strength"] for b in models], shape[:2])
        slope = fit(s, (arr["before"], arr["before_den"]), (arr["after"], arr["after_den"]), present=present, **kw)
        points = []
        for j, (point, b) in enumerate(zip(reps, models)):
            dose = doses.get(b)
            change = entry["degradation"][t] if b == "base" else dose["vl"]["degradation"][t]
            shares = [_share(entry["models"][x], t) for _, _, x in point]
            per_seed = [slope["deltas"][seeds.index(seed)][j] for seed, _, _ in point]  # the fit's own Δ per seed
            several = len(point) > 1  # Δ: the mean over the point's seeds (its CI: the one seed's, where only one)
            points.append({"model": b, "level": dose["level"] if dose else None, "sink_strength": entry["models"][b]["sink_strength"],
                           "delta_points": float(np.mean(per_seed)) if several else change["delta_points"],
                           "delta_points_ci": None if several else change["delta_points_ci"], "n": change["n"],
                           "seeds": [seed for seed, _, _ in point], "delta_points_per_seed": per_seed,
                           "template_share": max((x for x in shares if x is not None), default=None),
                           "text_cost": bool(dose and t in dose["text_cost"])})
        out["tasks"][t] = {"metric": metric, "points": points, **slope, **answer(slope, points),
                           "per_prompt": {"doc_ids": docs, "seeds": seeds, "present": present.tolist(),
                                          **{key: value.tolist() for key, value in arr.items()}}}
    return out


def over_seeds(summary: dict) -> None:
    """A study repeated over training seeds (`experiments.study.seeds`): per pair and task whose dose-response every
    seed holds with the same points and prompts, the slope refitted over all seeds' points with a CI resampling
    seeds and prompts, and its answer; stored in the first seed's pair entry as `dose_response.over_seeds`."""
    runs = [summary, *(r["summary"] for r in summary["seeds"]["runs"].values())]
    st = summary["settings"]
    kw = {"n_boot": st["n_boot"], "confidence": st["confidence"], "seed": st["seed"]}
    for p, entry in summary["pairs"].items():
        section = [(r["pairs"].get(p) or {}).get("dose_response") for r in runs]
        if not section[0] or not all(section):
            continue
        pooled = {}
        for t, first in section[0]["tasks"].items():
            each = [sec["tasks"].get(t) for sec in section]
            if not all(each) or any([pt["model"] for pt in e["points"]] != [pt["model"] for pt in first["points"]]
                                    or e["per_prompt"]["doc_ids"] != first["per_prompt"]["doc_ids"] for e in each):
                continue  # seeds that dosed or graded differently cannot be pooled point for point
            arr = {key: np.concatenate([np.array(e["per_prompt"][key]) for e in each])
                   for key in ("before", "before_den", "after", "after_den", "present")}
            s = np.concatenate([np.broadcast_to([pt["sink_strength"] for pt in e["points"]], np.shape(e["per_prompt"]["present"]))
                                for e in each])
            slope = fit(s, (arr["before"], arr["before_den"]), (arr["after"], arr["after_den"]), present=arr["present"], **kw)
            points = [pt for e in each for pt in e["points"]]
            pooled[t] = {**slope, **answer(slope, points), "per_seed": {str(s): e["slope"] for s, e in
                                                                         zip(summary["seeds"]["seeds"], each)}}
        if pooled:
            entry["dose_response"]["over_seeds"] = pooled
