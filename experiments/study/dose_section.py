"""A study's `dose:` section, typed: each pair's base with its Sink Strength moved by `interventions.sink_dose`
(docs/dose.md; its steps and summary: `experiments.study.doses`).

    dose: [-2, -1, 1, 2]                                        # shifts of S from each pair's own base
    dose: [{target: 0.5}, {name: half, scale: 0.5, heads: sink}]  # any sink_dose settings (one level each)
    dose: [{shift: -2, heads: sink, pairs: [smollm2]}, {shift: -2, pairs: [gemma]}]  # per-pair settings
    dose: [{shift: -2, seeds: [1]}]                              # adapted again with training seed 1

A dose is named from its level unless `name` is given: dose-minus2, dose-plus1, dose-to0.5, dose-x0.5. It doses every
pair unless `pairs` names some; a name repeats only on pairs that do not share it. `seeds`: training seeds its
adaptation runs with besides the control's (the dose-response then resamples each point's seeds too).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from experiments.study.schema import fail, guarded, integer, mapping, slug
from interventions.registry import SINK_DOSE
from interventions.sink_dose import LEVELS


@dataclass(frozen=True)
class Dose:
    """One dose: its name (a path component) and its sink_dose settings, defaults filled in."""

    name: str
    params: dict
    pairs: tuple[str, ...] | None = None  # None: every pair
    seeds: tuple[int, ...] = ()  # training seeds of further adaptations of this dose (besides the control's)

    def doses(self, pair: str) -> bool:
        return self.pairs is None or pair in self.pairs

    @property
    def level(self) -> tuple[str, float]:
        return next((k, self.params[k]) for k in LEVELS if k in self.params)


def _name(params: dict) -> str:
    key, value = next((k, params[k]) for k in LEVELS if params.get(k) is not None)
    shown = f"{abs(value):g}"
    if key == "scale":
        return f"dose-x{shown}"
    sign = "minus" if value < 0 else "plus" if key == "shift" else ""
    return f"dose-{'to' if key == 'target' else ''}{sign}{shown}"


def parse_doses(raw, where: str, texts: Any, taken: set[str], pair_names: list[str]) -> list[Dose]:
    """The `dose:` list: a number is a shift of S from the pair's base, a mapping any sink_dose settings (+ `name`,
    `pairs`: some of `pair_names`). S is solved on the study's calibration texts (`texts`, the sink section's) unless a
    dose names its own; a name may not be an intervention's or an arm's (`taken`)."""
    if not isinstance(raw, list) or not raw:
        fail(where, "a non-empty list of doses: numbers (shifts of S from each base) or sink_dose settings")
    doses, seen = [], set()
    for i, item in enumerate(raw):
        dw = f"{where}[{i}]"
        if isinstance(item, (int, float)) and not isinstance(item, bool):
            item = {"shift": item}
        item = dict(mapping(item, dw, {*SINK_DOSE.defaults, "name", "pairs", "seeds"}))
        name, only, seeds = item.pop("name", None), item.pop("pairs", None), item.pop("seeds", [])
        if not isinstance(seeds, list) or len(set(map(str, seeds))) != len(seeds):
            fail(f"{dw}.seeds", f"a list of distinct training seeds, got {seeds!r}")
        seeds = [integer(x, f"{dw}.seeds", 0) for x in seeds]
        if only is not None and (not isinstance(only, list) or not only
                                 or not all(isinstance(x, str) and x in pair_names for x in only)):
            fail(f"{dw}.pairs", f"a non-empty list of pair names ({', '.join(pair_names)}), got {only!r}")
        if texts is not None:
            item.setdefault("texts", texts)
        params = guarded(SINK_DOSE.resolve, dw, item)
        name = slug(name if name is not None else _name(params), f"{dw}.name")
        mine = {(p, name) for p in (only or pair_names)}
        if mine & seen or name in taken or name in ("base", "vlm"):
            fail(dw, f"dose name {name!r} is a duplicate, reserved (base, vlm) or an intervention's / arm's name")
        seen |= mine
        doses.append(Dose(name, params, tuple(only) if only is not None else None, tuple(seeds)))
    return doses
