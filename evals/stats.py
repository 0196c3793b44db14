"""Paired statistics for two (or three) models evaluated on the same prompts, and across pairs.

Convention, everywhere a number is stored or printed: Δ = after − before, in points (score × 100),
so a negative Δ is capability lost; relative = Δ / before (a fraction, undefined when before = 0).
In a base -> VLM comparison `before` is the base LLM and `after` the VLM's language model. The
seed paper's direction in this convention: ρ(S, Δ points) = +0.971 and ρ(S, Δ/before) = +0.794
over its six pairs (a stronger sink, less loss; `experiments/data/` holds its tables).

Inputs are `EvalRun`s (with a task and metric; samples are paired on doc_id and checked by
doc_hash), {doc_id: value} mappings, or plain per-doc arrays aligned by position. A per-doc value
is a pass (bool / 0-1 / float) or, for instruction-level IFEval metrics, a list of passes: a score
is then sum(passes) / count(passes), so resampling prompts keeps a prompt's instructions together.

Bootstrap CIs resample prompts with replacement (percentile method); ratios (relative change,
recovery) are computed inside each replicate. Replicates where a ratio is undefined (zero
denominator) are dropped from its CI and their share is reported. McNemar's exact test
(scipy.stats.binomtest on the discordant counts) needs per-prompt binary outcomes, or the counts.
Across pairs: Spearman / Pearson with CIs from resampling pairs, and a leave-one-pair-out linear
predictor (scipy.stats.linregress), and the difference of two groups' means (pairs resampled within each
group). Each result is a dataclass whose `as_dict` is what summaries store and whose `from_dict` reads it
back; `ci_side` says which side of 0 an interval lies on, `comparison_side` the same for a comparison of
fewer than MIN_CONCLUSIVE_N prompts, which decides nothing (no rank-based paired test can reach 5% there;
a percentile bootstrap of 3 prompts that all flipped reads [−100, −100]).
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, fields
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from evals.eval_run import HEADLINE_METRICS
from evals.protocol import COMPARABLE_SETTINGS, DEFAULT_CONFIDENCE, DEFAULT_N_BOOT  # noqa: F401  (the bootstrap's defaults, part of this module's API)
from sinkstudy import SinkstudyError

log = logging.getLogger(__name__)

_CHUNK = 1_000  # replicates per vectorised batch: bounds memory at n_docs * _CHUNK indices
CONVENTION = "Δ = after − before in points (score × 100; negative = capability lost); relative = Δ / before"
POINTS = 100.0
# The fewest prompts a paired comparison needs to decide a sign: with 5, even all of them changing the same way gives a
# two-sided exact sign test p = 2 * 0.5**5 = 0.0625 (the Wilcoxon signed-rank test has the same floor).
MIN_CONCLUSIVE_N = 6


def ci_side(ci) -> int:
    """Which side of 0 a confidence interval lies on: +1 above, -1 below, 0 when it includes 0 or is undefined
    (missing, or an end that is None / NaN). Every verdict on a sign reads it here."""
    if not ci or any(v is None or not np.isfinite(v) for v in ci):
        return 0
    return 1 if ci[0] > 0 else -1 if ci[1] < 0 else 0


def comparison_side(c) -> int:
    """`ci_side` of a comparison's Δ points, 0 (undecided) where it compared fewer than MIN_CONCLUSIVE_N prompts."""
    return ci_side(c.delta_points_ci) if c.n >= MIN_CONCLUSIVE_N else 0


def _tuples(cls, d: Mapping[str, Any]):
    """A statistics record from its `as_dict` form (JSON turns its CI tuples into lists)."""
    return cls(**{f.name: tuple(d[f.name]) if f.name.endswith("ci") and d.get(f.name) is not None else d[f.name]
                  for f in fields(cls) if f.name in d})


@dataclass
class Comparison:
    """`after` against `before` on the same prompts (see the module docstring for the convention)."""

    task: str | None
    metric: str | None
    n: int
    before: float  # score in [0, 1], lm-eval's scale
    after: float
    delta_points: float  # 100 * (after - before): negative = capability lost
    delta_points_ci: tuple[float, float]
    delta_relative: float  # (after - before) / before
    delta_relative_ci: tuple[float, float]
    delta_relative_undefined: float  # share of replicates with before = 0 (dropped from the CI)
    mcnemar_p: float | None
    lost: int | None  # prompts passed before and failed after
    gained: int | None  # prompts failed before and passed after
    confidence: float
    n_boot: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Comparison":
        return _tuples(cls, d)


RECOVERED = "recovery"
NO_LOSS = "no loss to recover"  # the loss's CI lies at or above 0: the VLM LM lost nothing
LOSS_UNCLEAR = "loss not established, recovery not measurable"  # the CI includes a loss: a ratio of it would divide noise
TOO_FEW = f"too few prompts for any conclusion (fewer than {MIN_CONCLUSIVE_N})"


@dataclass
class Recovery:
    """How much of the base -> VLM LM loss an intervention wins back. A recovery is a number only
    where there is a loss: the paired CI of Δ = VLM LM − base (points) lies below 0 over at least
    MIN_CONCLUSIVE_N prompts. Otherwise `recovery` and `ci` are None and `status` says why: NO_LOSS (the CI
    lies at or above 0), LOSS_UNCLEAR (it includes a loss: not established) or TOO_FEW (too few prompts)."""

    task: str | None
    metric: str | None
    n: int
    base: float
    vlm: float
    intervened: float
    recovery: float | None  # (intervened - vlm) / (base - vlm): 0 = no recovery, 1 = back to base
    ci: tuple[float | None, float | None]
    confidence: float
    n_boot: int
    undefined: float  # share of replicates with base == vlm
    loss_points: float  # Δ = VLM LM − base in points (negative = the loss to recover)
    loss_points_ci: tuple[float, float]
    status: str  # RECOVERED, NO_LOSS, LOSS_UNCLEAR or TOO_FEW
    # Δ = intervened − each input, in points, with CIs from the same replicates: below both where both lie below 0
    vs_base_points: float | None = None
    vs_base_ci: tuple[float, float] | None = None
    vs_vlm_points: float | None = None
    vs_vlm_ci: tuple[float, float] | None = None

    @property
    def below_both(self) -> bool:
        """Scored below the base and below the VLM LM, each CI below 0, over enough prompts to decide."""
        return self.n >= MIN_CONCLUSIVE_N and ci_side(self.vs_base_ci) < 0 and ci_side(self.vs_vlm_ci) < 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Recovery":
        return _tuples(cls, d)


@dataclass
class Correlation:
    """One relation between Sink Strength and a change, across pairs; CIs resample pairs."""

    n: int
    spearman: float
    spearman_p: float
    spearman_ci: tuple[float, float]
    pearson: float
    pearson_p: float
    pearson_ci: tuple[float, float]
    ci_undefined: float  # share of replicates where a coefficient is undefined (a constant resample)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Correlation":
        return _tuples(cls, d)


@dataclass
class SinkCorrelation:
    """S against Δ in points and against Δ / before, over the same pairs and the same resamples."""

    n: int
    points: Correlation  # S vs Δ points
    relative: Correlation  # S vs Δ / before
    confidence: float
    n_boot: int
    convention: str = CONVENTION

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "SinkCorrelation":
        return cls(n=d["n"], points=Correlation.from_dict(d["points"]), relative=Correlation.from_dict(d["relative"]),
                   confidence=d["confidence"], n_boot=d["n_boot"], convention=d.get("convention", CONVENTION))


@dataclass
class LeaveOneOut:
    """Leave-one-pair-out prediction of y from x: a linear fit on the other pairs vs their mean."""

    n: int
    predictions: list[float]  # linear fit on the other n - 1 pairs, evaluated at the left-out x
    mean_predictions: list[float]  # the other pairs' mean y
    mae: float  # mean absolute error of `predictions`
    mae_mean: float  # mean absolute error of `mean_predictions`

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


# ----------------------------------------------------------------------------- per-doc values


def _is_run(x) -> bool:
    return hasattr(x, "per_doc") and hasattr(x, "samples")


def _default_metric(run, task: str) -> str:
    metrics = run.metrics(task)
    if not metrics:
        raise SinkstudyError(f"run has no scores for task {task!r}")
    return HEADLINE_METRICS[task] if HEADLINE_METRICS.get(task) in metrics else metrics[0]


def headline_metrics(run, task: str) -> list[str]:
    """The metrics `task` is reported by: its headline (`_default_metric`), and for a task graded both
    strictly and flexibly (GSM8K-CoT: strict-match and flexible-extract) both, strict first."""
    head = _default_metric(run, task)
    name, _, flt = head.partition(",")
    strict = f"{name},strict-match"
    return [strict, head] if flt == "flexible-extract" and strict in run.metrics(task) else [head]


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


def mcnemar_exact(before, after) -> tuple[float, int, int]:
    """Exact two-sided McNemar p-value on paired binary outcomes: (p, lost, gained)."""
    a, b = np.asarray(before, dtype=bool), np.asarray(after, dtype=bool)
    if a.shape != b.shape:
        raise SinkstudyError(f"McNemar needs paired outcomes of equal length, got {a.shape} and {b.shape}")
    lost, gained = int(np.sum(a & ~b)), int(np.sum(~a & b))
    return mcnemar_counts(lost, gained), lost, gained


def mcnemar_counts(lost: int, gained: int) -> float:
    """Exact two-sided McNemar p-value from the discordant counts (binomial test at 1/2)."""
    # lazy: loads scipy
    from scipy.stats import binomtest

    if min(lost, gained) < 0 or int(lost) != lost or int(gained) != gained:
        raise SinkstudyError(f"discordant counts must be non-negative integers, got {lost} and {gained}")
    n = int(lost) + int(gained)
    return 1.0 if n == 0 else float(binomtest(int(lost), n, 0.5).pvalue)


def outcomes_from_counts(both_pass: int, lost: int, gained: int, both_fail: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-prompt (before, after) pass arrays with these counts: all a paired statistic needs."""
    counts = (both_pass, lost, gained, both_fail)
    if any(int(c) != c or c < 0 for c in counts):
        raise SinkstudyError(f"per-prompt counts must be non-negative integers, got {counts}")
    before = np.repeat([True, True, False, False], counts)
    after = np.repeat([True, False, True, False], counts)
    return before, after


def bootstrap_distribution(stat: Callable[..., np.ndarray], arrays: Sequence[np.ndarray], n_boot: int, seed: int) -> np.ndarray:
    """`stat` over `n_boot` paired resamples of the rows of `arrays` (all the same length).

    `stat(*resampled)` receives arrays of shape (batch, n) and returns shape (batch,) or (batch, k).
    Hand-rolled rather than scipy.stats.bootstrap because ratio statistics must survive
    replicates where they are undefined (scipy's percentile would turn them all into NaN).
    """
    if int(n_boot) != n_boot or n_boot < 1:
        raise SinkstudyError(f"the number of bootstrap replicates must be an integer >= 1, got {n_boot}")
    n = len(arrays[0])
    rng = np.random.default_rng(seed)
    out = []
    for start in range(0, n_boot, _CHUNK):
        idx = rng.integers(0, n, size=(min(_CHUNK, n_boot - start), n))
        out.append(np.asarray(stat(*(a[idx] for a in arrays))))
    return np.concatenate(out, axis=0)


def percentile_ci(dist: np.ndarray, confidence: float) -> tuple[float, float]:
    if not 0 < confidence < 1:
        raise SinkstudyError(f"confidence must be in (0, 1), got {confidence}")
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


def compare(before, after, task: str | None = None, metric: str | None = None, *, n_boot: int = DEFAULT_N_BOOT,
            confidence: float = DEFAULT_CONFIDENCE, seed: int = 0) -> Comparison:
    """Change from `before` to `after` on the same prompts: Δ points and Δ / before with paired CIs, McNemar."""
    if _is_run(before) and task is not None:
        metric = metric or _default_metric(before, task)
    (na, da), (nb, db) = paired(before, after, task=task, metric=metric)
    sa, sb = float(_score(na, da)), float(_score(nb, db))

    def stat(na, da, nb, db):
        a, b = _score(na, da), _score(nb, db)
        return np.stack([POINTS * (b - a), _ratio(b - a, a)], axis=-1)

    dist = bootstrap_distribution(stat, [na, da, nb, db], n_boot, seed)
    binary = (_binary((na, da)), _binary((nb, db)))
    p, lost, gained = mcnemar_exact(*binary) if binary[0] is not None and binary[1] is not None else (None, None, None)
    return Comparison(
        task=task, metric=metric, n=len(na), before=sa, after=sb, delta_points=POINTS * (sb - sa),
        delta_points_ci=percentile_ci(dist[:, 0], confidence),
        delta_relative=float(_ratio(np.float64(sb - sa), np.float64(sa))), delta_relative_ci=percentile_ci(dist[:, 1], confidence),
        delta_relative_undefined=float(np.mean(~np.isfinite(dist[:, 1]))),
        mcnemar_p=p, lost=lost, gained=gained, confidence=confidence, n_boot=n_boot,
    )


def compare_runs(before, after, tasks: Sequence[str] | None = None, **kwargs) -> list[Comparison]:
    """`compare` for every task and metric two EvalRuns share (their sample-level metrics)."""
    if tasks is None:  # every scored task both runs hold samples for (a group pools its subtasks)
        tasks = [t for t in before.scores if t in after.scores and _has_docs(before, t) and _has_docs(after, t)]
    tasks = list(tasks)
    differing = [k for k in COMPARABLE_SETTINGS if before.settings.get(k) != after.settings.get(k)]
    if differing:
        log.warning("the two runs differ in %s: differences mix model and setting effects", ", ".join(differing))
    if not tasks:
        raise SinkstudyError("the two runs share no task with samples")
    out = []
    for task in tasks:
        metrics = [m for m in before.metrics(task) if m in after.metrics(task) and any(m in s["metrics"] for s in before.docs(task).values())]
        out += [compare(before, after, task, m, **kwargs) for m in metrics]
    return out


def _has_docs(run, task: str) -> bool:
    return task in run.samples or task in run.groups


def recovery(base, vlm, intervened, task: str | None = None, metric: str | None = None, *,
             n_boot: int = DEFAULT_N_BOOT, confidence: float = DEFAULT_CONFIDENCE, seed: int = 0) -> Recovery:
    """(intervened - vlm) / (base - vlm) on the same prompts, its CI from within-replicate ratios;
    None ("no loss to recover") unless the base -> VLM LM loss is significant (`Recovery`)."""
    if _is_run(base) and task is not None:
        metric = metric or _default_metric(base, task)
    arrays = paired(base, vlm, intervened, task=task, metric=metric)
    s_base, s_vlm, s_int = (float(_score(n, d)) for n, d in arrays)

    def stat(nb, db, nv, dv, ni, di):
        b, v, i = _score(nb, db), _score(nv, dv), _score(ni, di)
        return _ratio(i - v, b - v)

    def both(nb, db, nv, dv, ni, di):  # the loss CI from the same replicates as `compare(base, vlm)` draws
        b, v, i = _score(nb, db), _score(nv, dv), _score(ni, di)
        return np.stack([stat(nb, db, nv, dv, ni, di), POINTS * (v - b), POINTS * (i - b), POINTS * (i - v)], axis=-1)

    flat = [a for nd in arrays for a in nd]
    dist = bootstrap_distribution(both, flat, n_boot, seed)
    loss_ci = percentile_ci(dist[:, 1], confidence)
    n = len(flat[0])
    side = ci_side(loss_ci) if n >= MIN_CONCLUSIVE_N else None
    status = TOO_FEW if side is None else RECOVERED if side < 0 else NO_LOSS if loss_ci[0] >= 0 else LOSS_UNCLEAR
    lost = status == RECOVERED
    return Recovery(
        task=task, metric=metric, n=n, base=s_base, vlm=s_vlm, intervened=s_int,
        recovery=float(_ratio(np.float64(s_int - s_vlm), np.float64(s_base - s_vlm))) if lost else None,
        ci=percentile_ci(dist[:, 0], confidence) if lost else (None, None), confidence=confidence, n_boot=n_boot,
        undefined=float(np.mean(~np.isfinite(dist[:, 0]))), loss_points=POINTS * (s_vlm - s_base),
        loss_points_ci=loss_ci, status=status,
        vs_base_points=POINTS * (s_int - s_base), vs_base_ci=percentile_ci(dist[:, 2], confidence),
        vs_vlm_points=POINTS * (s_int - s_vlm), vs_vlm_ci=percentile_ci(dist[:, 3], confidence),
    )


@dataclass
class GroupDifference:
    """mean(a) − mean(b) over two groups of pairs, its CI from resampling the pairs of each group separately."""

    n_a: int
    n_b: int
    mean_a: float
    mean_b: float
    difference: float
    ci: tuple[float, float]  # NaN where a group has one pair (nothing to resample: no CI over pairs)
    confidence: float
    n_boot: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def group_difference(a: Sequence[float], b: Sequence[float], *, n_boot: int = DEFAULT_N_BOOT, confidence: float = DEFAULT_CONFIDENCE,
                     seed: int = 0) -> GroupDifference:
    """E.g. the mean Δ/base of backbones with native QK-norm minus that of backbones without; the pair is the unit."""
    xa, xb = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if xa.ndim != 1 or xb.ndim != 1 or not len(xa) or not len(xb) or not (np.isfinite(xa).all() and np.isfinite(xb).all()):
        raise SinkstudyError(f"group_difference needs two non-empty groups of finite values, got {list(xa)} and {list(xb)}")
    mean = lambda rows: rows.mean(axis=-1)  # noqa: E731
    dist = bootstrap_distribution(mean, [xa], n_boot, seed) - bootstrap_distribution(mean, [xb], n_boot, seed + 1)
    ci = percentile_ci(dist, confidence) if len(xa) > 1 and len(xb) > 1 else (float("nan"), float("nan"))
    return GroupDifference(n_a=len(xa), n_b=len(xb), mean_a=float(xa.mean()), mean_b=float(xb.mean()),
                           difference=float(xa.mean() - xb.mean()), ci=ci, confidence=confidence, n_boot=n_boot)


def correlation(x: Sequence[float], y: Sequence[float], *, n_boot: int = DEFAULT_N_BOOT, confidence: float = DEFAULT_CONFIDENCE,
                seed: int = 0) -> Correlation:
    """Spearman and Pearson of y on x over pairs, with CIs from resampling pairs."""
    xs, (ys,) = _pairs_of(x, [y])
    dist = bootstrap_distribution(_coefficients, [xs, ys], n_boot, seed)
    return _correlation(xs, ys, dist, confidence)


def sink_correlation(sink_strengths: Sequence[float], delta_points: Sequence[float], delta_relative: Sequence[float], *,
                     n_boot: int = DEFAULT_N_BOOT, confidence: float = DEFAULT_CONFIDENCE, seed: int = 0) -> SinkCorrelation:
    """Spearman and Pearson of Sink Strength against Δ points and against Δ / before, over pairs.

    One value per pair in each sequence, in the module's convention (Δ = after − before: the
    paper's direction is ρ > 0 in both). Both relations use the same pair resamples for their CIs.
    """
    x, ys = _pairs_of(sink_strengths, [delta_points, delta_relative])
    dist = bootstrap_distribution(lambda xs, yp, yr: np.concatenate([_coefficients(xs, yp), _coefficients(xs, yr)], axis=-1),
                                  [x, *ys], n_boot, seed)
    points, relative = (_correlation(x, y, dist[:, 2 * i:2 * i + 2], confidence) for i, y in enumerate(ys))
    return SinkCorrelation(n=len(x), points=points, relative=relative, confidence=confidence, n_boot=n_boot)


def _pairs_of(x, ys) -> tuple[np.ndarray, list[np.ndarray]]:
    xs, ys = np.asarray(x, dtype=float), [np.asarray(y, dtype=float) for y in ys]
    if xs.ndim != 1 or any(y.shape != xs.shape for y in ys):
        raise SinkstudyError(f"need one value per pair in each sequence, got shapes {[xs.shape, *(y.shape for y in ys)]}")
    finite = int(np.sum(np.isfinite(xs) & np.logical_and.reduce([np.isfinite(y) for y in ys])))
    if len(xs) < 3 or finite < len(xs):
        raise SinkstudyError(f"correlation needs at least 3 pairs, all finite; got {len(xs)} pairs, {finite} finite")
    return _tied(xs), [_tied(y) for y in ys]


TIE_TOLERANCE = 1e-9  # relative: far above float rounding, far below any difference a score can show


def _tied(values: np.ndarray) -> np.ndarray:
    """Values equal up to float rounding made equal, so ranks tie them: two pairs that each lost 11 of 120
    prompts have Δ = 100 * (72/120 - 83/120) and 100 * (58/120 - 69/120), which differ in the last bits
    (-9.166666666666668 vs -9.166666666666663) and would otherwise rank apart. Each value within the tolerance
    of the smallest member of its run of close values takes that member's value."""
    out = values.copy()
    order = np.argsort(values, kind="stable")
    anchor = None
    for i in order:
        v = values[i]
        if anchor is not None and v - anchor <= TIE_TOLERANCE * max(1.0, abs(anchor)):
            out[i] = anchor
        else:
            anchor = v
    return out


def _coefficients(xs: np.ndarray, ys: np.ndarray) -> np.ndarray:
    """(replicates, [spearman, pearson]) for resampled rows: Spearman = Pearson of ranks (ties averaged)."""
    # lazy: loads scipy
    from scipy.stats import rankdata

    return np.stack([_rowwise_pearson(rankdata(xs, axis=-1), rankdata(ys, axis=-1)), _rowwise_pearson(xs, ys)], axis=-1)


def _correlation(x: np.ndarray, y: np.ndarray, dist: np.ndarray, confidence: float) -> Correlation:
    """Correlation from the point estimates (scipy) and a (replicates, [spearman, pearson]) bootstrap."""
    # lazy: loads scipy
    from scipy.stats import pearsonr, spearmanr

    rho, r = spearmanr(x, y), pearsonr(x, y)
    return Correlation(n=len(x), spearman=float(rho.statistic), spearman_p=float(rho.pvalue),
                       spearman_ci=percentile_ci(dist[:, 0], confidence), pearson=float(r.statistic),
                       pearson_p=float(r.pvalue), pearson_ci=percentile_ci(dist[:, 1], confidence),
                       ci_undefined=float(np.mean(~np.isfinite(dist).all(axis=-1))))


def _rowwise_pearson(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    xc = x - x.mean(axis=-1, keepdims=True)
    yc = y - y.mean(axis=-1, keepdims=True)
    return _ratio((xc * yc).sum(axis=-1), np.sqrt((xc**2).sum(axis=-1) * (yc**2).sum(axis=-1)))


def leave_one_out(x: Sequence[float], y: Sequence[float]) -> LeaveOneOut:
    """Leave-one-pair-out: predict each y from a least-squares line through the other pairs, and
    from their mean; mean absolute errors of both (the paper's predictor of Δ from S)."""
    # lazy: loads scipy
    from scipy.stats import linregress

    xs, ys = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if xs.ndim != 1 or xs.shape != ys.shape or len(xs) < 3 or not (np.isfinite(xs).all() and np.isfinite(ys).all()):
        raise SinkstudyError(f"leave-one-out needs at least 3 finite (x, y) pairs of equal length, got shapes {xs.shape}, {ys.shape}")
    linear, mean = [], []
    for i in range(len(xs)):
        keep = np.arange(len(xs)) != i
        if np.ptp(xs[keep]) == 0:
            raise SinkstudyError(f"leaving out pair {i} leaves pairs of equal x: no line to fit")
        fit = linregress(xs[keep], ys[keep])
        linear.append(float(fit.intercept + fit.slope * xs[i]))
        mean.append(float(ys[keep].mean()))
    return LeaveOneOut(n=len(xs), predictions=linear, mean_predictions=mean,
                       mae=float(np.mean(np.abs(np.array(linear) - ys))), mae_mean=float(np.mean(np.abs(np.array(mean) - ys))))


def format_table(comparisons: Sequence[Comparison], names: tuple[str, str] = ("A", "B")) -> str:
    """A plain-text table per task and metric: A and B in points, Δ = B − A with CI, Δ / A with CI,
    the discordant prompts and McNemar's p; the convention is the table's first line."""
    a, b = names
    head = (f"{'task':<26} {'metric':<32} {'n':>5} {a[:8]:>8} {b[:8]:>8} {'Δ pts':>7} {'CI':>17} {'Δ/' + a[:6]:>8} {'CI':>17} "
            f"{'lost':>5} {'gained':>6} {'McNemar p':>10}")
    num = lambda x, spec: "n/a" if x is None or not np.isfinite(x) else format(x, spec)  # noqa: E731  (Δ/A of a zero A)
    ci = lambda t, spec: f"[{num(t[0], spec)},{num(t[1], spec)}]"  # noqa: E731
    rows = [f"Δ = {b} − {a} in points (score × 100; negative = {b} lost capability); Δ/{a} = Δ / {a} (relative); "
            f"lost / gained = prompts only {a} / only {b} passes", head, "-" * len(head)]
    for c in comparisons:
        p = "-" if c.mcnemar_p is None else f"{c.mcnemar_p:.3g}"
        lost, gained = ("-", "-") if c.lost is None else (c.lost, c.gained)
        rows.append(f"{(c.task or '')[:26]:<26} {(c.metric or '')[:32]:<32} {c.n:>5} {POINTS * c.before:>8.2f} {POINTS * c.after:>8.2f} "
                    f"{num(c.delta_points, '+.2f'):>7} {ci(c.delta_points_ci, '+.2f'):>17} {num(c.delta_relative, '+.3f'):>8} "
                    f"{ci(c.delta_relative_ci, '+.3f'):>17} {lost:>5} {gained:>6} {p:>10}")
    note = few_prompts_note(c.n for c in comparisons)
    return "\n".join(rows + ([note] if note else []))


def few_prompts_note(ns: Iterable[int]) -> str | None:
    """The line a table of paired comparisons ends with where one compared fewer than MIN_CONCLUSIVE_N prompts
    (a small run, e.g. --limit 3): its Δ and CIs decide nothing."""
    few = sorted({n for n in ns if n < MIN_CONCLUSIVE_N})
    return f"{' or '.join(map(str, few))} prompts per comparison: {TOO_FEW}" if few else None
