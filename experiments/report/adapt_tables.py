"""What `sinkstudy adapt` prints, from its run report (`interventions.adapt.run.run_summary`): one row per stage and
the language model's Sink Strength before and after."""

from __future__ import annotations

from experiments.report.fmt import brief as _f


def format_adapt(report: dict) -> str:
    """Per stage: steps, final and mean loss, throughput, trainable parameters; S before and after."""
    from interventions.adapt.run import run_summary

    s = run_summary(report)
    lines = [f"{'stage':<10} {'steps':>6} {'final loss':>11} {'(last N)':>8} {'mean loss':>10} {'steps/s':>8} {'tokens/s':>9} "
             f"{'trainable':>11}"]
    for r in s["stages"]:
        lines.append(f"{r['stage']:<10} {r['steps']:>6} {_f(r['final_loss']):>11} {r.get('final_loss_steps') or '-':>8} "
                     f"{_f(r.get('mean_loss')):>10} {_f(r['steps_per_second']):>8} {_f(r['tokens_per_second']):>9} "
                     f"{r['trainable_params']:>11,}")
    lines.append("final loss: the mean over the stage's last N steps; mean loss: over the whole stage")
    if s["sink_strength"]:
        lines.append(f"Sink Strength of the LM: {_f(s['sink_strength'][0])} before -> {_f(s['sink_strength'][1])} after")
    return "\n".join(lines)
