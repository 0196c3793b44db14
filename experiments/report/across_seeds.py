"""The report of a study repeated over training seeds (`experiments.study.seeds`) or numeric modes
(`experiments.study.numeric_spread`): every headline figure per run with its spread across runs, and each answer
(`experiments.report.claims`) stated only where every run gives the same one.

A summary with a `seeds` (or `numerics_spread`) section holds the first run's results at its top level and
every other run's summary under the section's `runs`. Headline figures: per pair the base's and the VLM LM's
Sink Strength and Δ = VLM LM − base in points per task; per intervention its recovery of the loss on the
paper's task (0 = VLM LM, 1 = base); per adaptation arm Δ = arm − its control in points; across pairs
ρ(S, Δ points). Spread: the sample standard deviation over runs and the range (max − min).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from experiments.report.claims import OPEN, Claim, claims
from experiments.report.fmt import missing
from experiments.report.results import StudyResults


@dataclass(frozen=True)
class Unit:
    """What the runs of a repeated study differ in, as the report names it."""
    section: str  # the summary's section holding the other runs
    one: str  # "seed": "seed 0", "every seed"
    many: str  # "the seeds disagree"
    heading: str
    key: str  # the section's list of run names


SEEDS = Unit("seeds", "seed", "seeds", "Across training seeds", "seeds")
MODES = Unit("numerics_spread", "numeric mode", "numeric modes", "Across numeric modes", "paths")


def replicated(summary: dict) -> tuple[Unit, dict] | None:
    """(unit, {run name: results}) of a study repeated over seeds or numeric modes, the first run first; None
    for a study run once."""
    for unit in (SEEDS, MODES):
        section = summary.get(unit.section)
        if section:
            names = section[unit.key]
            out = {names[0]: StudyResults.of(summary)}
            for n in names[1:]:
                out[n] = StudyResults.of(section["runs"][str(n)]["summary"])
            return unit, out
    return None


def _names(runs: dict) -> str:
    return ", ".join(map(str, runs))


def _label(unit: Unit, name) -> str:
    return f"{unit.one} {name}"


def _cap(text: str) -> str:
    return text[:1].upper() + text[1:]


def claims_across(runs: dict, unit: Unit = SEEDS) -> list[Claim]:
    """The first run's claims, each kept only where every run answers it the same; otherwise not established,
    with each run's answer."""
    first, *_ = runs
    per_run = {s: {c.claim: c for c in claims(r)} for s, r in runs.items()}
    out = []
    for c in claims(runs[first]):
        answers = {s: (per_run[s].get(c.claim).answer if c.claim in per_run[s] else "not measured") for s in runs}
        if len(set(answers.values())) == 1:
            out.append(Claim(c.claim, c.answer, f"{c.evidence} Every {unit.one} ({_names(runs)}) gives this answer; the numbers "
                                                 f"are {_label(unit, first)}'s."))
        else:
            said = "; ".join(f"{_label(unit, s)}: {a}" for s, a in answers.items())
            out.append(Claim(c.claim, f"{OPEN} (the {unit.many} disagree)",
                             f"{said}. {_cap(_label(unit, first))}'s numbers: {c.evidence}"))
    return out


def figures(r: StudyResults) -> dict[str, float]:
    """The headline figures of one seed's results, by name."""
    t, out = r.paper_task, {}
    for p, e in r.pairs.items():
        out[f"S base, {p}"] = e.models["base"].sink_strength
        out[f"S VLM LM, {p}"] = e.models["vlm"].sink_strength
        for task, c in e.degradation.items():
            out[f"Δ {task} (VLM LM − base, pts), {p}"] = c.delta_points
        for name, per_task in e.interventions.items():
            out[f"recovery {name} {t}, {p}"] = per_task[t].recovery.recovery
        for name, a in e.arms.items():
            if a.vs_control:
                out[f"Δ {t} ({name} − control, pts), {p}"] = a.vs_control[t].delta_points
    for task, corr in r.correlation.items():
        out[f"ρ(S, Δ points) {task}"] = corr.points.spearman
    return out


def spread_rows(runs: dict, unit: Unit = SEEDS) -> tuple[list[str], list[list[str]]]:
    """(header, rows): each headline figure per run, its mean, standard deviation and range across runs."""
    per_run = {s: figures(r) for s, r in runs.items()}
    first = next(iter(per_run.values()))
    header = ["figure", *(_label(unit, s) for s in runs), "mean", "SD", "range"]
    rows = []
    for name in first:
        vals = [per_run[s].get(name) for s in runs]
        finite = [v for v in vals if not missing(v)]
        cells = ["n/a" if missing(v) else f"{v:+.2f}" for v in vals]
        if len(finite) >= 2:
            cells += [f"{statistics.mean(finite):+.2f}", f"{statistics.stdev(finite):.2f}", f"{max(finite) - min(finite):.2f}"]
        else:
            cells += ["n/a"] * 3
        rows.append([name, *cells])
    return header, rows


def replicate_blocks(unit: Unit, runs: dict, summary: dict) -> list[tuple]:
    header, rows = spread_rows(runs, unit)
    others = ", ".join(f"{_label(unit, s)} in {x['out']}" for s, x in summary[unit.section]["runs"].items())
    if unit is SEEDS:
        what = (f"The study ran once per training seed ({_names(runs)}), the data and prompts the same for every seed; "
                f"the other seeds' runs: {others}.")
    else:
        ids = {next(iter(runs)): _numerics_id(summary),
               **{s: _numerics_id(x["summary"]) for s, x in summary[unit.section]["runs"].items()}}
        what = (f"The study ran once per numeric mode ({_names(runs)}: "
                + ", ".join(f"{s} computed as {i}" for s, i in ids.items())
                + f"), config, data, seeds and code the same: the spread is what the kernels alone move, the kind of "
                  f"difference another CPU makes; the other modes' runs: {others}.")
    return [("h", 2, unit.heading),
            ("p", f"{what} Each headline figure per {unit.one}, with the sample standard deviation and the range "
                  f"(max − min) across {unit.many}; an answer above is stated only where every {unit.one} gives "
                  "the same one. S: Sink Strength; Δ in points (score × 100); recovery: share of the loss recovered "
                  "(0 = VLM LM, 1 = base)."),
            ("table", header, rows)]


def _numerics_id(summary: dict) -> str:
    """The numeric identity a run's results were computed with (provenance.hardware.numerics), as recorded."""
    hardware = summary.get("hardware") or []
    ids = sorted({h.get("numerics") for h in (hardware if isinstance(hardware, list) else [hardware]) if h.get("numerics")})
    return " / ".join(ids) or "not recorded"
