"""What `sinkstudy adapt` prints, from its run report (`interventions.adapt.run.run_summary`): one row per stage and
the language model's Sink Strength before and after."""

from __future__ import annotations

from experiments.report.fmt import brief as _f


COLUMNS = (("stage", 10), ("steps", 6), ("final loss (N)", 16), ("mean loss", 10), ("steps/s", 8), ("tokens/s", 9), ("trainable", 11))


def format_adapt(report: dict) -> str:
    """Per stage: steps, final loss over its last N steps, mean loss, throughput, trainable parameters; S before and
    after. One header per value (the first left-aligned, the others right-aligned under theirs)."""
    # lazy: loads torch, numpy
    from interventions.adapt.run import run_summary

    def row(values) -> str:
        return " ".join(f"{v:<{w}}" if i == 0 else f"{v:>{w}}" for i, (v, (_, w)) in enumerate(zip(values, COLUMNS)))

    s = run_summary(report)
    lines = [row(name for name, _ in COLUMNS)]
    for r in s["stages"]:
        lines.append(row([r["stage"], r["steps"], f"{_f(r['final_loss'])} ({r.get('final_loss_steps') or '-'})", _f(r.get("mean_loss")),
                          _f(r["steps_per_second"]), _f(r["tokens_per_second"]), f"{r['trainable_params']:,}"]))
    lines.append("final loss: the mean over the stage's last N steps; mean loss: over the whole stage")
    if s["sink_strength"]:
        lines.append(f"Sink Strength of the LM: {_f(s['sink_strength'][0])} before -> {_f(s['sink_strength'][1])} after")
    return "\n".join(lines)
