"""What `sinkstudy qknorm` reports, from its report.json (`experiments.study.qknorm_plans`): the injection's
KL and Sink Strength at init and after recovery training with the paired evals (`format_injection`), or the
arms through one adaptation side by side (`format_arms`). Convention: Δ = after − before in points."""

from __future__ import annotations

from evals.stats import Comparison, few_prompts_note, format_table as paired_table
from experiments.report.fmt import brief as _f, ci_text, num
from sinkstudy.provenance import describe_hardware


def format_injection(report: dict) -> str:
    arm, init, after = report["arm"], report["at_init"], report["after_training"]
    head = f"{'measure (calibration texts)':<34} {'original':>10} {'at init':>10} {'trained':>10}"
    lines = [f"QK-norm {arm} ({report['init'] or 'native'}) on {report['base']}", head, "-" * len(head),
             f"{'Sink Strength':<34} {_f(init['sink_strength_original']):>10} {_f(init['sink_strength_injected']):>10} "
             f"{_f(after and after['sink_strength_injected']):>10}",
             f"{'mean next-token KL vs original':<34} {_f(0.0):>10} {_f(init['mean_kl']):>10} {_f(after and after['mean_kl']):>10}"]
    if report["evals"]:
        evaluated = "trained" if after else "at init"
        lines += ["", f"strict evals: original vs {arm} ({evaluated}); Δ = {arm} − original in points (negative: {arm} lost capability)",
                  paired_table([Comparison(**c) for c in report["evals"]["paired"]], names=("original", arm))]
    return "\n".join(lines)


def format_arms(report: dict) -> str:
    tasks = report["tasks"]
    head = f"{'arm':<28} {'S start':>8} {'S after':>8}" + "".join(
        f" {t[:18] + ' (pts)':>25} {'own base':>9} {'Δ vs own base [95% CI]':>27} {'Δ vs control [95% CI]':>27}" for t in tasks)
    lines = [f"QK-norm arms on {report['base']} through the same adaptation",
             f"computed on: {describe_hardware((report.get('provenance') or {}).get('hardware'))}", report["convention"], "", head,
             "-" * len(head)]
    for name, r in report["arms"].items():
        cells = ""
        for t in tasks:
            e = r["tasks"][t]
            vb, vc = e["vs_own_base"], e.get("vs_control")
            cells += f" {vb['score']:>25.1f} {vb['reference']:>9.1f} {_delta(vb):>27} {(_delta(vc) if vc else '-'):>27}"
        lines.append(f"{name:<28} {r['sink_strength_start']:>8.3f} {r['sink_strength_after']:>8.3f}{cells}")
    lines += ["", "S: Sink Strength of the arm's LM before (start: after any injection) and after adaptation, "
              "on the calibration prompts", f"paper: {report['paper']}"]
    few = few_prompts_note(d["n"] for r in report["arms"].values() for e in r["tasks"].values()
                           for d in (e["vs_own_base"], e.get("vs_control")) if d)
    return "\n".join(lines + ([few] if few else []))


def _delta(d: dict) -> str:
    """Δ with its CI, signed, in points."""
    return f"{num(d['delta'], '+.1f')} {ci_text(d['ci'], '+.1f', '[n/a]')}"
