"""What the weight interventions' settings share: `check_number` (a finite number in range, one line
otherwise) and `Selection` (which tensors a merge touches)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from interventions.outputs import MergeError

_MODULE_FILTERS = {"attn": "self_attn", "mlp": "mlp"}

@dataclass(frozen=True)
class Selection:
    """Which tensors a merge touches: modules (attn / mlp) and/or decoder layers [first, last].

    Parsed from strings such as "attn", "mlp", "layers:0-3", "attn,layers:0-3". Expressed as
    mergekit `filter` substrings ("self_attn", "layers.2.", "layers.2.self_attn"), matched the way
    mergekit matches them (substring of the tensor name), so our own code selects the same tensors.
    """

    modules: tuple[str, ...] = ()
    layers: tuple[int, int] | None = None

    @classmethod
    def parse(cls, text: str | None) -> "Selection | None":
        if not text:
            return None
        modules: list[str] = []
        layers = None
        for part in (p.strip() for p in text.split(",") if p.strip()):
            m = re.fullmatch(r"layers:(\d+)(?:-(\d+))?", part)
            if m:
                first, last = int(m.group(1)), int(m.group(2) or m.group(1))
                if last < first:
                    raise MergeError(f"bad layer range {part!r}: last layer before first")
                layers = (first, last)
            elif part in _MODULE_FILTERS:
                modules.append(part)
            else:
                raise MergeError(f"bad selection {part!r}: use attn, mlp and/or layers:FIRST-LAST")
        return cls(tuple(modules), layers)

    def filters(self) -> list[str]:
        mods = [_MODULE_FILTERS[m] for m in self.modules]
        if self.layers is None:
            return mods
        layer_keys = [f"layers.{i}." for i in range(self.layers[0], self.layers[1] + 1)]
        return [k + m for k in layer_keys for m in mods] if mods else layer_keys

    def matches(self, tensor_name: str) -> bool:
        return any(f in tensor_name for f in self.filters())

    def __str__(self) -> str:
        parts = list(self.modules) + ([f"layers:{self.layers[0]}-{self.layers[1]}"] if self.layers else [])
        return ",".join(parts)

def check_number(where: str, value, *, lo: float | None = None, hi: float | None = None, lo_open: bool = False,
                 hi_open: bool = False, integer: bool = False) -> None:
    """A setting must be a finite real (an int with `integer`) inside [lo, hi] (open ends as given)."""
    kind = "an integer" if integer else "a finite number"
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok or not math.isfinite(value):
        raise MergeError(f"{where} must be {kind}, got {value!r}")
    if lo is not None and (value < lo or (lo_open and value == lo)) or hi is not None and (value > hi or (hi_open and value == hi)):
        left, right = "(" if lo_open else "[", ")" if hi_open else "]"
        raise MergeError(f"{where} must be in {left}{'-inf' if lo is None else lo}, {'inf' if hi is None else hi}{right}, got {value!r}")
