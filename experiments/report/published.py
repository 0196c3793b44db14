"""The seed paper's published tables as data, checked on load, and other pairs set beside them.

The tables (`experiments/data/published_choi2026.yaml`): the six pairs (S, IFEval Δ, base and VLM
scores, per-prompt counts, the paper's leave-one-out predictions), the 17-pair panel and the
paper's own summary figures. Convention as everywhere in sinkstudy: Δ = VLM LM − base in points
(negative = capability lost), relative = Δ / base score; the paper's direction in it is ρ > 0.
"""

from __future__ import annotations

import math
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import yaml

from evals.protocol import DEFAULT_CONFIDENCE, DEFAULT_N_BOOT
from experiments.report.fmt import ci_text, num
from sinkstudy import SinkstudyError

PUBLISHED = Path(__file__).resolve().parent.parent / "data" / "published_choi2026.yaml"
COUNT_KEYS = ("both_pass", "lost", "gained", "both_fail")
_PAIR_KEYS = {"vlm", "base", "qk_norm", "moe", "sink_strength", "ifeval_delta", "ifeval_base", "ifeval_vlm", "counts", "loo_prediction"}
CONVENTION_LINE = ("Δ = VLM LM − base, IFEval prompt-level strict, in points (negative = capability lost); "
                   "Δ / base = relative change. The paper's direction in this convention: ρ > 0 (a stronger sink, less loss).")
_REPORTED_KEYS = {"spearman_points", "spearman_relative", "panel_spearman_points", "loo_mae", "loo_mae_mean"}


@dataclass(frozen=True)
class PairChange:
    """One pair's Sink Strength of the base and its IFEval change; scores in points."""

    name: str
    sink_strength: float
    delta_points: float  # VLM LM − base
    before_points: float | None = None  # the base's score; None where not published
    source: str = "published"
    delta_points_ci: tuple[float, float] | None = None

    @property
    def relative(self) -> float:
        return math.nan if not self.before_points else self.delta_points / self.before_points


@dataclass(frozen=True)
class PublishedPair:
    vlm: str
    base: str
    sink_strength: float
    ifeval_delta: float
    qk_norm: str | None = None
    moe: bool = False
    ifeval_base: float | None = None
    ifeval_vlm: float | None = None
    counts: dict[str, int] | None = None
    loo_prediction: float | None = None

    def change(self) -> PairChange:
        return PairChange(self.vlm, self.sink_strength, self.ifeval_delta, self.ifeval_base)


@dataclass(frozen=True)
class PublishedTables:
    source: str
    metric: str
    n_prompts: int
    reported: dict[str, float]
    six: tuple[PublishedPair, ...]
    panel_extra: tuple[PublishedPair, ...] = field(default=())
    qknorm_injection: dict[str, Any] = field(default_factory=dict)  # base, ifeval_base, ifeval_after (points)
    merges: dict[str, Any] = field(default_factory=dict)  # tried, recovered_ifeval

    @property
    def panel(self) -> tuple[PublishedPair, ...]:
        return self.six + self.panel_extra


def load_published(path: str | Path = PUBLISHED) -> PublishedTables:
    """Read the tables and check that they hold together (counts, scores and Δ agree), else one line."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
        n = int(raw["n_prompts"])
        reported = {k: float(v) for k, v in raw["reported"].items()}
        six = tuple(_pair(r, f"{path.name}: six_pairs[{i}]") for i, r in enumerate(raw["six_pairs"]))
        extra = tuple(_pair(r, f"{path.name}: panel_extra[{i}]") for i, r in enumerate(raw.get("panel_extra") or []))
        tables = PublishedTables(str(raw["source"]), str(raw["metric"]), n, reported, six, extra,
                                 dict(raw.get("qknorm_injection") or {}), dict(raw.get("merges") or {}))
    except (OSError, KeyError, TypeError, ValueError, yaml.YAMLError) as exc:
        raise SinkstudyError(f"cannot read the published tables {path}: {type(exc).__name__}: {exc}") from None
    if set(reported) != _REPORTED_KEYS:
        raise SinkstudyError(f"{path.name}: reported must hold exactly {', '.join(sorted(_REPORTED_KEYS))}")
    for i, p in enumerate(six):
        _check(p, n, f"{path.name}: six_pairs[{i}] ({p.vlm})")
    return tables


def _pair(row: dict, where: str) -> PublishedPair:
    unknown = set(row) - _PAIR_KEYS
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {', '.join(sorted(unknown))}")
    return PublishedPair(**row)


def _check(p: PublishedPair, n: int, where: str) -> None:
    """Every six-pair row carries scores and counts that reproduce each other to their rounding."""
    if p.counts is None or p.ifeval_base is None or p.ifeval_vlm is None or p.loo_prediction is None:
        raise SinkstudyError(f"{where}: a six-pair row needs ifeval_base, ifeval_vlm, counts and loo_prediction")
    if set(p.counts) != set(COUNT_KEYS) or sum(p.counts.values()) != n:
        raise SinkstudyError(f"{where}: counts must be {', '.join(COUNT_KEYS)} summing to {n}, got {p.counts}")
    base = 100 * (p.counts["both_pass"] + p.counts["lost"]) / n
    vlm = 100 * (p.counts["both_pass"] + p.counts["gained"]) / n
    if abs(base - p.ifeval_base) > 0.006 or abs(vlm - p.ifeval_vlm) > 0.006 or abs(p.ifeval_vlm - p.ifeval_base - p.ifeval_delta) > 0.051:
        raise SinkstudyError(f"{where}: counts give base {base:.2f} and VLM {vlm:.2f}, table says {p.ifeval_base} / {p.ifeval_vlm} "
                             f"(delta {p.ifeval_delta})")


# --------------------------------------------------------------------------- statistics


def correlate(changes: Sequence[PairChange], **kw):
    """`evals.stats.sink_correlation` over these pairs (S vs Δ points and vs Δ / base)."""
    # lazy: loads numpy
    from evals.stats import sink_correlation

    return sink_correlation([c.sink_strength for c in changes], [c.delta_points for c in changes],
                            [c.relative for c in changes], **kw)


def paper_table(tables: PublishedTables | None = None, *, n_boot: int = DEFAULT_N_BOOT, confidence: float = DEFAULT_CONFIDENCE, seed: int = 0) -> dict[str, Any]:
    """Everything `sinkstudy paper-table` prints, recomputed from the tables.

    Per pair: Δ from the per-prompt counts with its paired bootstrap CI and McNemar's exact p
    (`evals.stats.compare` on outcomes rebuilt from the counts). Across the six: ρ on Δ points and
    on Δ / base (table values) with CIs over pairs; the leave-one-pair-out linear predictor of Δ
    from S against predicting the mean. Across the 17-pair panel: ρ on Δ points (no base scores).
    """
    # lazy: loads numpy
    from evals.stats import compare, correlation, leave_one_out, outcomes_from_counts

    t = tables or load_published()
    kw = dict(n_boot=n_boot, confidence=confidence, seed=seed)
    loo = leave_one_out([p.sink_strength for p in t.six], [p.ifeval_delta for p in t.six])
    rows = []
    for i, p in enumerate(t.six):
        c = compare(*outcomes_from_counts(*(p.counts[k] for k in COUNT_KEYS)), **kw)
        rows.append({**asdict(p), "relative": p.change().relative, "counts_delta_points": c.delta_points,
                     "counts_delta_points_ci": c.delta_points_ci, "mcnemar_p": c.mcnemar_p,
                     "loo_recomputed": loo.predictions[i], "loo_mean": loo.mean_predictions[i]})
    panel = t.panel
    return {
        "source": t.source, "metric": t.metric, "n_prompts": t.n_prompts, "convention": CONVENTION_LINE, "reported": t.reported, "six": rows,
        "correlation": correlate([p.change() for p in t.six], **kw).as_dict(),
        "leave_one_out": loo.as_dict(),
        "panel": {"pairs": [asdict(p) for p in panel],
                  "correlation": correlation([p.sink_strength for p in panel], [p.ifeval_delta for p in panel], **kw).as_dict()},
        "confidence": confidence, "n_boot": n_boot, "seed": seed,
    }


def beside(ours: Sequence[PairChange], tables: PublishedTables | None = None, *, union: bool = True, **kw) -> dict[str, Any]:
    """Our pairs beside the published six: ρ over the six alone and over the union, both conventions
    (`union` False: ours measured otherwise than the paper, so no ρ over the union; "union" is None)."""
    t = tables or load_published()
    published = [p.change() for p in t.six]
    pairs = published + list(ours)
    bad = [c.name for c in ours if not (math.isfinite(c.sink_strength) and math.isfinite(c.delta_points) and math.isfinite(c.relative))]
    if bad:
        raise SinkstudyError(f"pair(s) {', '.join(bad)}: S, Δ and Δ / base must all be defined to join the published pairs")
    return {"convention": CONVENTION_LINE, "pairs": [asdict(c) | {"relative": c.relative} for c in pairs],
            "published": correlate(published, **kw).as_dict(), "union": correlate(pairs, **kw).as_dict() if union else None,
            "reported": t.reported}


# --------------------------------------------------------------------------- text


def rho_lines(corr: dict[str, Any], reported: dict[str, float] | None = None, label: str = "") -> list[str]:
    """Two lines: ρ and r on Δ points and on Δ / base with their CIs, the paper's figure beside each."""
    lines = []
    for key, what, paper in (("points", "Δ points", "spearman_points"), ("relative", "Δ / base", "spearman_relative")):
        c = corr[key]
        ref = f" (paper {reported[paper]:+.3f})" if reported else ""
        lines.append(f"{label}Spearman ρ(S, {what:<8}) = {num(c['spearman'], '+.3f')} {ci_text(c['spearman_ci'], '+.3f', '[n/a]')}{ref}; "
                     f"Pearson r = {num(c['pearson'], '+.3f')} {ci_text(c['pearson_ci'], '+.3f', '[n/a]')}; n = {c['n']} pairs")
    return lines



def format_paper_table(d: dict[str, Any]) -> str:
    rep, conf = d["reported"], f"{d['confidence']:.0%}"
    head = (f"{'VLM':<20} {'base LLM':<22} {'QK-norm':<10} {'S':>6} {'base':>6} {'VLM':>6} {'Δ pts':>6} {'Δ/base':>7} "
            f"{'Δ from counts [' + conf + ' CI]':>28} {'lost':>5} {'gained':>6} {'McNemar p':>10} {'LOO pred (paper)':>17}")
    lines = [f"Published six pairs: {d['source']}; {d['metric']}, {d['n_prompts']} prompts", CONVENTION_LINE,
             "lost / gained: prompts only the base / only the VLM LM passes; LOO pred: this toolkit's leave-one-pair-out "
             "linear prediction of Δ from S (the paper's Table 10 in parentheses).", "", head, "-" * len(head)]
    for r in d["six"]:
        lines.append(f"{r['vlm']:<20} {r['base']:<22} {r['qk_norm'] or '?':<10} {r['sink_strength']:>+6.2f} {r['ifeval_base']:>6.2f} "
                     f"{r['ifeval_vlm']:>6.2f} {r['ifeval_delta']:>+6.1f} {r['relative']:>+7.3f} "
                     f"{num(r['counts_delta_points'], '+.2f') + ' ' + ci_text(r['counts_delta_points_ci'], '+.2f', '[n/a]'):>28} {r['counts']['lost']:>5} "
                     f"{r['counts']['gained']:>6} {r['mcnemar_p']:>10.2g} {r['loo_recomputed']:>+8.2f} ({r['loo_prediction']:+.2f})")
    loo = d["leave_one_out"]
    lines += ["", *rho_lines(d["correlation"], rep),
              f"CIs: {conf} percentile bootstrap over pairs ({d['n_boot']} replicates, seed {d['seed']}).",
              f"Leave-one-pair-out predictor of Δ points from S: mean abs error {loo['mae']:.2f} (linear fit on the other "
              f"{loo['n'] - 1}) vs {loo['mae_mean']:.2f} (their mean); paper {rep['loo_mae']:.2f} vs {rep['loo_mae_mean']:.2f} "
              "(from unrounded values; the table's rounding explains the difference).",
              ""]
    pc = d["panel"]["correlation"]
    lines.append(f"{len(d['panel']['pairs'])}-pair panel: Spearman ρ(S, Δ points) = {pc['spearman']:+.3f} {ci_text(pc['spearman_ci'], '+.3f', '[n/a]')} "
                 f"(paper {rep['panel_spearman_points']:+.2f}); Pearson r = {pc['pearson']:+.3f} {ci_text(pc['pearson_ci'], '+.3f', '[n/a]')}")
    return "\n".join(lines)


def format_beside(d: dict[str, Any]) -> str:
    head = f"{'pair':<32} {'source':<10} {'S':>6} {'base':>6} {'Δ pts':>7} {'Δ/base':>7}"
    lines = [CONVENTION_LINE, head, "-" * len(head)]
    for r in d["pairs"]:
        ci = f" {ci_text(r['delta_points_ci'], '+.2f', '[n/a]')}" if r.get("delta_points_ci") else ""
        lines.append(f"{r['name'][:32]:<32} {r['source']:<10} {r['sink_strength']:>+6.2f} {num(r['before_points'], '.2f'):>6} "
                     f"{r['delta_points']:>+7.2f} {num(r['relative'], '+.3f'):>7}{ci}")
    lines += ["", *rho_lines(d["published"], d["reported"], "published six:  ")]
    lines += rho_lines(d["union"], None, "with ours:      ") if d["union"] else ["with ours:      not recomputed (ours is not measured as the paper's)"]
    return "\n".join(lines)


PUBLISHED_METRIC = "prompt_level_strict_acc,none"  # the paper's headline: IFEval prompt-level strict


def published_task(a, b, tasks) -> str:
    """The one compared task that carries the paper's metric in both runs."""
    found = [t for t in (tasks or a.scores) if PUBLISHED_METRIC in a.metrics(t) and PUBLISHED_METRIC in b.metrics(t)]
    if len(found) != 1:
        raise SinkstudyError(f"--published compares IFEval {PUBLISHED_METRIC}: need exactly one compared task with it in both runs, "
                             f"found {', '.join(found) or 'none'}" + (" (narrow with --tasks)" if found else ""))
    return found[0]


def published_mismatch(c, run, tables) -> list[str]:
    """How this comparison differs from the paper's IFEval measurement (task, prompt count, limit); empty: it does not."""
    out = []
    if c.task != "ifeval":
        out.append(f"task {c.task}, not ifeval")
    if c.n != tables.n_prompts:
        out.append(f"{c.n} prompts, not {tables.n_prompts}")
    if (run.settings or {}).get("limit") is not None:
        out.append(f"--limit {run.settings['limit']}")
    return out


def beside_run(c, sink: float, run, *, n_boot: int, confidence: float, seed: int) -> dict:
    """One compared pair (`c`: IFEval prompt-level strict, base -> VLM LM; `sink`: the base's S) beside the paper's six,
    printed; rho over the union only where it was measured as the paper measured (else a one-line warning)."""
    tables = load_published()
    differs = published_mismatch(c, run, tables)
    if differs:
        print(f"sinkstudy: warning: not the paper's measurement ({'; '.join(differs)}): this pair is shown beside the "
              "paper's six, and rho is not recomputed with it", file=sys.stderr)
    ours = PairChange(f"this pair ({c.task})", sink, c.delta_points, 100 * c.before, source="ours", delta_points_ci=c.delta_points_ci)
    result = beside([ours], tables, union=not differs, n_boot=n_boot, confidence=confidence, seed=seed)
    print()
    print(format_beside(result))
    return {**result, "not_comparable": differs}
