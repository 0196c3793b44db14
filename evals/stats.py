"""Paired statistics for two (or three) models evaluated on the same prompts.

Inputs are `EvalRun`s (with a task and metric; samples are paired on doc_id and checked by
doc_hash), {doc_id: value} mappings, or plain per-doc arrays aligned by position. A per-doc value
is a pass (bool / 0-1 / float) or, for instruction-level IFEval metrics, a list of passes: a score
is then sum(passes) / count(passes), so resampling prompts keeps a prompt's instructions together.

Bootstrap CIs resample prompts with replacement (percentile method); ratios (relative
degradation, recovery) are computed inside each replicate. Replicates where a ratio is undefined
(zero denominator) are dropped from its CI and their share is reported. McNemar's exact test
(scipy.stats.binomtest on the discordant counts) needs per-prompt binary outcomes.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from sinkstudy import SinkstudyError

log = logging.getLogger(__name__)

DEFAULT_N_BOOT = 10_000
_CHUNK = 1_000
# Settings that change outputs for the same model; keep them equal across compared runs.
_COMPARABLE_SETTINGS = ("limit", "batch_size", "apply_chat_template", "max_gen_toks", "num_fewshot", "seed")  # replicates per vectorised batch: bounds memory at n_docs * _CHUNK indices


@dataclass
class Comparison:
    task: str | None
    metric: str | None
    n: int
    base: float
    other: float
    abs_diff: float  # base - other: positive means `other` lost capability
    rel_degradation: float  # (base - other) / base
    abs_ci: tuple[float, float]
    rel_ci: tuple[float, float]
    mcnemar_p: float | None
    base_only: int | None  # prompts base passes and other fails
    other_only: int | None
    confidence: float
    n_boot: int
    rel_undefined: float  # share of replicates with base score 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Recovery:
    task: str | None
    metric: str | None
    n: int
    base: float
    vlm: float
    intervened: float
    recovery: float  # (intervened - vlm) / (base - vlm): 0 = no recovery, 1 = back to base
    ci: tuple[float, float]
    confidence: float
    n_boot: int
    undefined: float  # share of replicates with base == vlm

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Correlation:
    n: int
    spearman: float
    spearman_p: float
    spearman_ci: tuple[float, float]
    pearson: float
    pearson_p: float
    pearson_ci: tuple[float, float]
    confidence: float
    n_boot: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


# ----------------------------------------------------------------------------- per-doc values


def _is_run(x) -> bool:
    return hasattr(x, "per_doc") and hasattr(x, "samples")


def _default_metric(run, task: str) -> str:
    from evals.lmeval import HEADLINE_METRICS

    metrics = run.metrics(task)
    if not metrics:
        raise SinkstudyError(f"run has no scores for task {task!r}")
    return HEADLINE_METRICS[task] if HEADLINE_METRICS.get(task) in metrics else metrics[0]


def _as_keyed(x, task: str | None, metric: str | None) -> tuple[dict[Any, Any], dict[Any, str] | None]:
    """{key: value} plus {key: doc_hash} when known."""
    if _is_run(x):
        if task is None:
            raise SinkstudyError("comparing EvalRuns needs a task name")
        metric = metric or _default_metric(x, task)
        values = x.per_doc(task, metric)
        hashes = {k: s.get("doc_hash") for k, s in x.docs(task).items()}
        return values, hashes
    if isinstance(x, Mapping):
        return dict(x), None
    return dict(enumerate(list(x))), None


def _num_den(values: Sequence[Any]) -> tuple[np.ndarray, np.ndarray]:
    num, den = np.empty(len(values)), np.empty(len(values))
    for i, v in enumerate(values):
        if isinstance(v, (list, tuple, np.ndarray)):
            num[i], den[i] = float(np.sum(v)), float(len(v))
        elif v is None:
            raise SinkstudyError("a per-doc value is missing (None)")
        else:
            num[i], den[i] = float(v), 1.0
    return num, den


def paired(*runs, task: str | None = None, metric: str | None = None) -> list[tuple[np.ndarray, np.ndarray]]:
    """Align per-doc values of several runs on their shared docs; return (num, den) per run.

    EvalRuns must agree on each shared doc's hash (the same prompt), else this fails.
    """
    keyed = [_as_keyed(r, task, metric) for r in runs]
    keys = set(keyed[0][0])
    for values, _ in keyed[1:]:
        keys &= set(values)
    if not keys:
        raise SinkstudyError(f"no shared prompts to pair{f' for task {task!r}' if task else ''}")
    keys = sorted(keys)
    hashed = [h for _, h in keyed if h is not None]
    for h in hashed[1:]:
        bad = [k for k in keys if h.get(k) != hashed[0].get(k)]
        if bad:
            raise SinkstudyError(f"runs disagree on the prompt of {len(bad)} doc(s) (first doc_id {bad[0]}): not the same data")
    if any(len(v) != len(keys) for v, _ in keyed):
        log.warning("pairing on %d shared docs out of %s", len(keys), [len(v) for v, _ in keyed])
    return [_num_den([values[k] for k in keys]) for values, _ in keyed]


def _binary(nd: tuple[np.ndarray, np.ndarray]) -> np.ndarray | None:
    num, den = nd
    if np.all(den == 1) and np.all((num == 0) | (num == 1)):
        return num.astype(bool)
    return None


# ----------------------------------------------------------------------------- primitives


def mcnemar_exact(base, other) -> tuple[float, int, int]:
    """Exact two-sided McNemar p-value on paired binary outcomes: (p, base_only, other_only)."""
    from scipy.stats import binomtest

    a, b = np.asarray(base, dtype=bool), np.asarray(other, dtype=bool)
    if a.shape != b.shape:
        raise SinkstudyError(f"McNemar needs paired outcomes of equal length, got {a.shape} and {b.shape}")
    base_only, other_only = int(np.sum(a & ~b)), int(np.sum(~a & b))
    n = base_only + other_only
    p = 1.0 if n == 0 else float(binomtest(base_only, n, 0.5).pvalue)
    return p, base_only, other_only


def bootstrap_distribution(stat: Callable[..., np.ndarray], arrays: Sequence[np.ndarray], n_boot: int, seed: int) -> np.ndarray:
    """`stat` over `n_boot` paired resamples of the rows of `arrays` (all the same length).

    `stat(*resampled)` receives arrays of shape (batch, n) and returns shape (batch,) or (batch, k).
    Hand-rolled rather than scipy.stats.bootstrap because ratio statistics must survive
    replicates where they are undefined (scipy's percentile would turn them all into NaN).
    """
    n = len(arrays[0])
    rng = np.random.default_rng(seed)
    out = []
    for start in range(0, n_boot, _CHUNK):
        idx = rng.integers(0, n, size=(min(_CHUNK, n_boot - start), n))
        out.append(np.asarray(stat(*(a[idx] for a in arrays))))
    return np.concatenate(out, axis=0)


def percentile_ci(dist: np.ndarray, confidence: float) -> tuple[float, float]:
    finite = dist[np.isfinite(dist)]
    if finite.size == 0:
        return (float("nan"), float("nan"))
    alpha = (1 - confidence) / 2
    lo, hi = np.percentile(finite, [100 * alpha, 100 * (1 - alpha)])
    return float(lo), float(hi)


def _score(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    return num.sum(axis=-1) / den.sum(axis=-1)


def _ratio(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(b != 0, a / np.where(b != 0, b, 1), np.nan)


# ----------------------------------------------------------------------------- public API


def compare(base, other, task: str | None = None, metric: str | None = None, *, n_boot: int = DEFAULT_N_BOOT,
            confidence: float = 0.95, seed: int = 0) -> Comparison:
    """Degradation of `other` relative to `base` on the same prompts, with paired CIs and McNemar."""
    if _is_run(base) and task is not None:
        metric = metric or _default_metric(base, task)
    (na, da), (nb, db) = paired(base, other, task=task, metric=metric)
    sa, sb = float(_score(na, da)), float(_score(nb, db))

    def stat(na, da, nb, db):
        a, b = _score(na, da), _score(nb, db)
        return np.stack([a - b, _ratio(a - b, a)], axis=-1)

    dist = bootstrap_distribution(stat, [na, da, nb, db], n_boot, seed)
    binary = (_binary((na, da)), _binary((nb, db)))
    p, base_only, other_only = mcnemar_exact(*binary) if binary[0] is not None and binary[1] is not None else (None, None, None)
    return Comparison(
        task=task, metric=metric, n=len(na), base=sa, other=sb, abs_diff=sa - sb,
        rel_degradation=float(_ratio(np.float64(sa - sb), np.float64(sa))),
        abs_ci=percentile_ci(dist[:, 0], confidence), rel_ci=percentile_ci(dist[:, 1], confidence),
        mcnemar_p=p, base_only=base_only, other_only=other_only, confidence=confidence, n_boot=n_boot,
        rel_undefined=float(np.mean(~np.isfinite(dist[:, 1]))),
    )


def compare_runs(base, other, tasks: Sequence[str] | None = None, **kwargs) -> list[Comparison]:
    """`compare` for every task and metric two EvalRuns share (their sample-level metrics)."""
    if tasks is None:  # every scored task both runs hold samples for (a group pools its subtasks)
        tasks = [t for t in base.scores if t in other.scores and _has_docs(base, t) and _has_docs(other, t)]
    tasks = list(tasks)
    differing = [k for k in _COMPARABLE_SETTINGS if base.settings.get(k) != other.settings.get(k)]
    if differing:
        log.warning("the two runs differ in %s: differences mix model and setting effects", ", ".join(differing))
    if not tasks:
        raise SinkstudyError("the two runs share no task with samples")
    out = []
    for task in tasks:
        metrics = [m for m in base.metrics(task) if m in other.metrics(task) and any(m in s["metrics"] for s in base.docs(task).values())]
        out += [compare(base, other, task, m, **kwargs) for m in metrics]
    return out


def _has_docs(run, task: str) -> bool:
    return task in run.samples or task in run.groups


def recovery(base, vlm, intervened, task: str | None = None, metric: str | None = None, *,
             n_boot: int = DEFAULT_N_BOOT, confidence: float = 0.95, seed: int = 0) -> Recovery:
    """(intervened - vlm) / (base - vlm) on the same prompts, its CI from within-replicate ratios."""
    if _is_run(base) and task is not None:
        metric = metric or _default_metric(base, task)
    arrays = paired(base, vlm, intervened, task=task, metric=metric)
    s_base, s_vlm, s_int = (float(_score(n, d)) for n, d in arrays)

    def stat(nb, db, nv, dv, ni, di):
        b, v, i = _score(nb, db), _score(nv, dv), _score(ni, di)
        return _ratio(i - v, b - v)

    flat = [a for nd in arrays for a in nd]
    dist = bootstrap_distribution(stat, flat, n_boot, seed)
    return Recovery(
        task=task, metric=metric, n=len(flat[0]), base=s_base, vlm=s_vlm, intervened=s_int,
        recovery=float(_ratio(np.float64(s_int - s_vlm), np.float64(s_base - s_vlm))),
        ci=percentile_ci(dist, confidence), confidence=confidence, n_boot=n_boot,
        undefined=float(np.mean(~np.isfinite(dist))),
    )


def sink_correlation(sink_strengths: Sequence[float], degradations: Sequence[float | Comparison], *,
                     n_boot: int = DEFAULT_N_BOOT, confidence: float = 0.95, seed: int = 0) -> Correlation:
    """Spearman and Pearson between Sink Strength and relative degradation over a set of pairs.

    CIs resample pairs; degradations may be `Comparison`s (their rel_degradation is used).
    """
    from scipy.stats import pearsonr, rankdata, spearmanr

    x = np.asarray(sink_strengths, dtype=float)
    y = np.asarray([d.rel_degradation if isinstance(d, Comparison) else d for d in degradations], dtype=float)
    if x.shape != y.shape or x.ndim != 1:
        raise SinkstudyError(f"need one sink strength per degradation, got {x.shape} and {y.shape}")
    finite = int((np.isfinite(x) & np.isfinite(y)).sum())
    if len(x) < 3 or finite < len(x):
        raise SinkstudyError(f"correlation needs at least 3 pairs, all finite; got {len(x)} pairs, {finite} finite")
    rho = spearmanr(x, y)
    r = pearsonr(x, y)

    def stat(xs, ys):
        both = np.stack([_rowwise_pearson(xs, ys), _rowwise_pearson(rankdata(xs, axis=-1), rankdata(ys, axis=-1))], axis=-1)
        return both

    dist = bootstrap_distribution(stat, [x, y], n_boot, seed)
    return Correlation(
        n=len(x), spearman=float(rho.statistic), spearman_p=float(rho.pvalue), spearman_ci=percentile_ci(dist[:, 1], confidence),
        pearson=float(r.statistic), pearson_p=float(r.pvalue), pearson_ci=percentile_ci(dist[:, 0], confidence),
        confidence=confidence, n_boot=n_boot,
    )


def _rowwise_pearson(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    xc = x - x.mean(axis=-1, keepdims=True)
    yc = y - y.mean(axis=-1, keepdims=True)
    return _ratio((xc * yc).sum(axis=-1), np.sqrt((xc**2).sum(axis=-1) * (yc**2).sum(axis=-1)))


def format_table(comparisons: Sequence[Comparison], names: tuple[str, str] = ("A", "B")) -> str:
    """A plain-text table: task, metric, A, B, A-B with CI, relative degradation with CI, McNemar p."""
    a, b = names
    head = f"{'task':<26} {'metric':<32} {'n':>5} {a[:8]:>8} {b[:8]:>8} {'A-B':>8} {'CI':>17} {'rel':>8} {'CI':>17} {'McNemar p':>10}"
    rows = [head, "-" * len(head)]
    num = lambda x: "n/a" if x is None or not np.isfinite(x) else f"{x:+.3f}"  # noqa: E731  (rel. of a zero base)
    ci = lambda t: f"[{num(t[0])},{num(t[1])}]"  # noqa: E731
    for c in comparisons:
        p = "-" if c.mcnemar_p is None else f"{c.mcnemar_p:.3g}"
        rows.append(f"{(c.task or '')[:26]:<26} {(c.metric or '')[:32]:<32} {c.n:>5} {c.base:>8.3f} {c.other:>8.3f} "
                    f"{num(c.abs_diff):>8} {ci(c.abs_ci):>17} {num(c.rel_degradation):>8} {ci(c.rel_ci):>17} {p:>10}")
    return "\n".join(rows)
