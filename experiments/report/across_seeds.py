"""The report of a study repeated over training seeds (`experiments.study.seeds`): every headline figure per seed
with its across-seed spread, and each claim or verdict stated only where every seed gives the same answer.

A summary with a `seeds` section holds the first seed's results at its top level and every other seed's
summary under `seeds.runs`. Headline figures: per pair the base's and the VLM LM's Sink Strength and
Δ = VLM LM − base in points per task; per intervention its recovery of the loss on the paper's task (0 =
VLM LM, 1 = base); per adaptation arm Δ = arm − its control in points; across pairs ρ(S, Δ points).
Spread: the sample standard deviation over seeds and the range (max − min).
"""

from __future__ import annotations

import statistics

from experiments.report.claims import OPEN, Claim, claims
from experiments.report.fmt import missing
from experiments.report.results import StudyResults


def seeded(summary: dict) -> dict[int, StudyResults] | None:
    """{seed: results} of a multi-seed summary, the first seed first; None for a one-seed study."""
    section = summary.get("seeds")
    if not section:
        return None
    seeds = section["seeds"]
    out = {seeds[0]: StudyResults.of(summary)}
    for s in seeds[1:]:
        out[s] = StudyResults.of(section["runs"][str(s)]["summary"])
    return out


def _seed_list(runs: dict) -> str:
    return ", ".join(map(str, runs))


def claims_across(runs: dict[int, StudyResults]) -> list[Claim]:
    """The first seed's claims, each kept only where every seed answers it the same; otherwise not established,
    with each seed's answer."""
    first, *_ = runs
    per_seed = {s: {c.claim: c for c in claims(r)} for s, r in runs.items()}
    out = []
    for c in claims(runs[first]):
        answers = {s: (per_seed[s].get(c.claim).answer if c.claim in per_seed[s] else "not measured") for s in runs}
        if len(set(answers.values())) == 1:
            out.append(Claim(c.claim, c.answer, f"{c.evidence} Every seed ({_seed_list(runs)}) gives this answer; the numbers "
                                                 f"are seed {first}'s."))
        else:
            said = "; ".join(f"seed {s}: {a}" for s, a in answers.items())
            out.append(Claim(c.claim, f"{OPEN} (the seeds disagree)", f"{said}. Seed {first}'s numbers: {c.evidence}"))
    return out


def verdicts_across(runs: dict[int, StudyResults], verdicts) -> list[str]:
    """The first seed's verdict lines ("Question? answer: numbers"), each stated only where every seed gives it."""
    def split(line: str) -> tuple[str, str]:
        question, _, rest = line.partition("? ")
        return question, rest.split(":", 1)[0]

    first, *_ = runs
    per_seed = {s: dict(split(line) for line in verdicts(r) if "? " in line) for s, r in runs.items()}
    out = []
    for line in verdicts(runs[first]):
        if "? " not in line:  # a statement, not a question: its figures are the first seed's
            out.append(f"{line} (Seed {first}'s figures; every seed's: Across training seeds.)")
            continue
        question, answer = split(line)
        answers = {s: per_seed[s].get(question, "not measured") for s in runs}
        if len(set(answers.values())) == 1:
            out.append(f"{line} Every seed ({_seed_list(runs)}) gives this answer.")
        else:
            said = "; ".join(f"seed {s}: {a}" for s, a in answers.items())
            out.append(f"{question}? {OPEN} (the seeds disagree: {said}). Seed {first}: {line.partition('? ')[2]}")
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


def spread_rows(runs: dict[int, StudyResults]) -> tuple[list[str], list[list[str]]]:
    """(header, rows): each headline figure per seed, its mean, standard deviation and range across seeds."""
    per_seed = {s: figures(r) for s, r in runs.items()}
    first = next(iter(per_seed.values()))
    header = ["figure", *(f"seed {s}" for s in runs), "mean", "SD", "range"]
    rows = []
    for name in first:
        vals = [per_seed[s].get(name) for s in runs]
        finite = [v for v in vals if not missing(v)]
        cells = ["n/a" if missing(v) else f"{v:+.2f}" for v in vals]
        if len(finite) >= 2:
            cells += [f"{statistics.mean(finite):+.2f}", f"{statistics.stdev(finite):.2f}", f"{max(finite) - min(finite):.2f}"]
        else:
            cells += ["n/a"] * 3
        rows.append([name, *cells])
    return header, rows


def seed_blocks(runs: dict[int, StudyResults], summary: dict) -> list[tuple]:
    header, rows = spread_rows(runs)
    others = ", ".join(f"seed {s} in {x['out']}" for s, x in summary["seeds"]["runs"].items())
    return [("h", 2, "Across training seeds"),
            ("p", f"The study ran once per training seed ({_seed_list(runs)}), the data and prompts the same for every seed; "
                  f"the other seeds' runs: {others}. Each headline "
                  "figure per seed, with the sample standard deviation and the range (max − min) across seeds; a claim or "
                  "verdict above is stated only where every seed gives the same answer. S: Sink Strength; Δ in points "
                  "(score × 100); recovery: share of the loss recovered (0 = VLM LM, 1 = base)."),
            ("table", header, rows)]
