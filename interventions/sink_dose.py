"""Sink dose: a weight-only edit that moves a causal LM's Sink Strength S to a chosen level.

The edit is a temperature on the attention logits of chosen query heads in the layers S reads (the metric's
last K layers): head h's logits q_h . k become c * q_h . k. It scales that head's query, so the keys, values
and every other head stay as they were:
- without QK-norm (Llama, Mistral, Qwen2): the head's head_dim rows of q_proj and its bias (RoPE is linear, so
  the rotated query scales too); with grouped-query attention the shared k_proj is left alone;
- with per-head QK-norm (Qwen3, Gemma-3: one gain vector of head_dim shared by a layer's heads) the layer's
  q_norm gain, which scales all its heads at once (q_proj rows would be normalised away); Gemma stores w and
  applies 1 + w, so w becomes c (1 + w) - 1.
c > 1 sharpens attention onto each head's argmax key (the sink, in a sink head), raising S; c < 1 flattens it.
Every other tensor stays bit-identical and the model keeps its class, config, state-dict keys and stored dtype
(the edited tensors are rounded to it before S is measured, so the S reported is the saved model's): an ordinary
checkpoint every tool applies to.

The dose is one of `scale` (c itself), `target` (the S to reach) or `shift` (the S to reach, relative to the
model's own: target = S + shift). For a level, c is bracketed by doubling / halving and then found by false
position on log c, one sink pass on the calibration texts per try, to within `tolerance`. `heads`: "all"
(every query head of the last `layers` layers) or "sink" (only those whose median log-odds on the calibration
texts is above 0: most of their queries put more than half their attention on the argmax key; per-head query
projections only).

    from interventions.registry import apply_intervention
    apply_intervention("sink_dose", base, base, {"target": 2.5}, "runs/dose/base-s2.5")   # the model itself, dosed
    apply_intervention("sink_dose", base, base, {"shift": -2.0}, "runs/dose/base-minus2")  # two below its own S

The registry (`interventions.registry`) lists it with `DEFAULTS`, `check` and `CODE` (the modules whose source is
part of a dosed model's identity: this one, the Sink Strength it solves for, the output helpers) and runs `run`.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Mapping

from evals.sink import MEASURE_CODE
from evals.sink.calibration import DEFAULT_SET, resolve_texts
from interventions.outputs import (check_disk_space, check_finite_model, check_pair, checkpoint_dtype,
                                   estimate_output_bytes, language_model_of, side_files, write_result)
from interventions.pairs import load_causal_lm
from interventions.params import check_number
from sinkstudy import SinkstudyError
from sinkstudy.checkpoint import load_tokenizer, local_checkpoint
from sinkstudy.io import atomic_output_dir, check_output_dir, read_text

NAME = "sink_dose"
HEADS = ("all", "sink")
LEVELS = ("target", "shift", "scale")  # one of them is the dose
# device / dtype: where and in what S is measured while the temperature is searched (the saved model keeps its own dtype)
DEFAULTS: dict[str, Any] = {"target": None, "shift": None, "scale": None, "heads": "all", "layers": None, "tolerance": 0.02,
                            "texts": None, "device": "cpu", "dtype": "float32"}
DTYPES = ("float32", "bfloat16", "float16")
DESCRIPTION = ("dose: moves the model's Sink Strength to `target` (or by `shift` from its own, or by a logit temperature `scale`) "
               "in its last layers' heads")
CODE = ("interventions.sink_dose", *MEASURE_CODE, "interventions.outputs")
SCALE_RANGE = (1 / 64, 64.0)  # the temperatures searched for a target; beyond them attention is uniform or one-hot
MAX_PASSES = 24


class DoseError(SinkstudyError):
    pass


def check(params: Mapping[str, Any] | None) -> dict[str, Any]:
    """The dose's settings, complete and checked without reading any model (one line on error)."""
    unknown = set(params or {}) - set(DEFAULTS)
    if unknown:
        raise DoseError(f"{NAME} has no parameter(s) {', '.join(sorted(unknown))}; it takes {', '.join(sorted(DEFAULTS))}")
    cfg = {**DEFAULTS, **(params or {})}
    if sum(cfg[k] is not None for k in LEVELS) != 1:
        raise DoseError(f"{NAME} takes one of target (the Sink Strength to reach), shift (the change of S to reach) "
                        "or scale (a logit temperature)")
    for key in ("target", "shift"):
        if cfg[key] is not None:
            check_number(f"{NAME} {key}", cfg[key], lo=-20.0, hi=20.0)
    if cfg["scale"] is not None:
        check_number(f"{NAME} scale", cfg["scale"], lo=SCALE_RANGE[0], hi=SCALE_RANGE[1])
    check_number(f"{NAME} tolerance", cfg["tolerance"], lo=1e-4, hi=1.0)
    if cfg["layers"] is not None:
        check_number(f"{NAME} layers", cfg["layers"], lo=1, integer=True)
    if cfg["heads"] not in HEADS:
        raise DoseError(f"{NAME} heads must be one of {', '.join(HEADS)}, got {cfg['heads']!r}")
    if cfg["dtype"] not in DTYPES:
        raise DoseError(f"{NAME} dtype must be one of {', '.join(DTYPES)}, got {cfg['dtype']!r}")
    if not isinstance(cfg["device"], str) or cfg["device"].split(":")[0] not in ("cpu", "cuda"):
        raise DoseError(f"{NAME} device must be cpu or cuda[:N], got {cfg['device']!r}")
    if cfg["texts"] is not None:
        texts = cfg["texts"]
        if isinstance(texts, (str, os.PathLike)) and Path(texts).is_file():
            read_text(texts, "texts file")  # a non-UTF-8 file fails here, named
        resolve_texts(texts, DEFAULT_SET)  # a missing file or an unknown set name fails here
        cfg["texts"] = os.fspath(texts) if isinstance(texts, os.PathLike) else texts
    return cfg


# --------------------------------------------------------------------------- the edit

class Temperature:
    """Per-head logit temperature on chosen (layer, head) units of a loaded model, set from its original weights
    each time (`set(c)`), so repeated tries never compound rounding; each edited value rounded to `stored` (the
    checkpoint's dtype), so the model measured is the one saved."""

    def __init__(self, model, units: list[tuple[int, int]], stored=None):
        # lazy: loads torch, numpy
        import torch

        self.stored = stored
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.n_heads = cfg.num_attention_heads
        layers = model.get_decoder().layers
        self.units = sorted(set(units))
        self.targets = []  # (tensor, rows or None, gemma-style 1 + w, original values)
        for layer in sorted({ly for ly, _ in self.units}):
            attn = layers[layer].self_attn
            heads = [h for ly, h in self.units if ly == layer]
            norm = getattr(attn, "q_norm", None)
            if norm is not None:
                if norm.weight.numel() != attn.head_dim or len(heads) != self.n_heads:
                    raise DoseError(f"layer {layer}'s q_norm gain is shared by its {self.n_heads} heads: "
                                    f"{NAME} scales all of a QK-norm layer's heads or none (heads=all)")
                self._add(norm.weight, None, type(norm).__name__.startswith("Gemma"))
                continue
            hd = attn.head_dim
            for h in heads:
                rows = slice(h * hd, (h + 1) * hd)
                self._add(attn.q_proj.weight, rows, False)
                if attn.q_proj.bias is not None:
                    self._add(attn.q_proj.bias, rows, False)
        self._torch = torch

    def _add(self, tensor, rows, one_plus: bool) -> None:
        view = tensor.data if rows is None else tensor.data[rows]
        self.targets.append((tensor, rows, one_plus, view.detach().clone()))

    def set(self, scale: float) -> None:
        with self._torch.no_grad():
            for tensor, rows, one_plus, orig in self.targets:
                new = (orig + 1.0) * scale - 1.0 if one_plus else orig * scale
                if self.stored is not None:
                    new = new.to(self.stored).to(orig.dtype)
                if rows is None:
                    tensor.data.copy_(new)
                else:
                    tensor.data[rows] = new


def qk_norm_layers(model) -> bool:
    layers = model.get_decoder().layers
    return any(getattr(ly.self_attn, "q_norm", None) is not None for ly in layers)


def select_units(model, heads: str, layers: int, maps=None) -> list[tuple[int, int]]:
    """The (layer, head) units a dose scales: the last `layers` layers' heads ("all"), or those of them whose
    median log-odds on the calibration maps is above 0 ("sink")."""
    # lazy: loads torch, numpy
    import torch

    n_layers = len(model.get_decoder().layers)
    n_heads = (model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config).num_attention_heads
    first = max(0, n_layers - layers)
    if heads == "all":
        return [(ly, h) for ly in range(first, n_layers) for h in range(n_heads)]
    if qk_norm_layers(model):
        raise DoseError(f"{NAME} heads=sink needs per-head query projections; this model's QK-norm gain is shared by each "
                        "layer's heads: use heads=all")
    median = torch.nanmedian(maps.logodds.double(), dim=-1).values  # (L, H)
    units = [(ly, h) for ly in range(first, n_layers) for h in range(n_heads) if median[ly, h] > 0]
    if not units:
        raise DoseError(f"{NAME} heads=sink: no head of the last {layers} layers has a median log-odds above 0 (no sink heads)")
    return units


# --------------------------------------------------------------------------- solving for a target S

def measure(model, tokenizer, texts):
    """(S, sink maps) of the model as it stands: the default metric (the paper's S) on `texts`."""
    # lazy: loads torch, numpy
    from evals.sink import compute_sink_maps, strength_from_maps

    maps = compute_sink_maps(model, tokenizer, texts, progress=False)
    return strength_from_maps(maps).value, maps


def solve_scale(strength, target: float, s1: float, tolerance: float, log=None) -> tuple[float, float, list[list[float]]]:
    """The scale c with |strength(c) - target| <= tolerance: bracketed from c = 1 (where S = s1) by doubling or
    halving, then found by false position on log c (the Illinois variant: S is close to linear in log c, so a few
    sink passes do). Returns (c, S at c, [[c, S], ...] every try)."""
    trace = [[1.0, s1]]

    def f(x: float) -> float:
        s = strength(2.0 ** x)
        trace.append([2.0 ** x, s])
        if log:
            log(2.0 ** x, s)
        return s - target

    if abs(s1 - target) <= tolerance:
        return 1.0, s1, trace
    step = 1.0 if target > s1 else -1.0
    a, fa = 0.0, s1 - target
    while True:  # bracket: a on the start's side of the target, b past it
        b = a + step
        if not SCALE_RANGE[0] <= 2.0 ** b <= SCALE_RANGE[1]:
            reached = [s for _, s in trace]
            raise DoseError(f"{NAME}: Sink Strength {target:+.3f} is out of reach of these heads (S spans {min(reached):+.3f} to "
                            f"{max(reached):+.3f} for logit scales {SCALE_RANGE[0]:g} to {SCALE_RANGE[1]:g})")
        fb = f(b)
        if abs(fb) <= tolerance:
            return 2.0 ** b, fb + target, trace
        if (fb > 0) != (fa > 0):
            break
        a, fa = b, fb
    side = 0
    for _ in range(MAX_PASSES):
        x = b - fb * (b - a) / (fb - fa)
        fx = f(x)
        if abs(fx) <= tolerance:
            return 2.0 ** x, fx + target, trace
        if (fx > 0) == (fb > 0):  # x replaces b; a stays: halve its weight when it stays twice (Illinois)
            b, fb = x, fx
            if side == -1:
                fa /= 2
            side = -1
        else:
            a, fa = x, fx
            if side == 1:
                fb /= 2
            side = 1
    raise DoseError(f"{NAME}: no scale within tolerance {tolerance} of S {target:+.3f} after {len(trace)} sink passes "
                    f"(closest: S {min(trace, key=lambda t: abs(t[1] - target))[1]:+.3f}); S may not be monotone here")


def dose_model(model, tokenizer, cfg: Mapping[str, Any], *, stored=None, log=None) -> dict[str, Any]:
    """Apply the dose `cfg` (validated) to a loaded model in place, the edited values representable in `stored`
    (a torch dtype; None: the model's); returns the report (units, scale, S before and after)."""
    # lazy: loads torch, numpy
    from evals.sink.metrics import DEFAULT_METRIC, get_metric

    layers = cfg["layers"] or get_metric(DEFAULT_METRIC).params["last_layers"]  # default: the layers S reads
    s0, maps = measure(model, tokenizer, cfg["texts"])
    units = select_units(model, cfg["heads"], layers, maps)
    temperature = Temperature(model, units, stored)

    def strength(c: float) -> float:
        temperature.set(c)
        return measure(model, tokenizer, cfg["texts"])[0]

    target = cfg["target"] if cfg["shift"] is None else s0 + cfg["shift"]
    if cfg["scale"] is not None:
        scale, s, trace = cfg["scale"], strength(cfg["scale"]), None
    else:
        scale, s, trace = solve_scale(strength, float(target), s0, cfg["tolerance"], log)
    temperature.set(scale)
    return {"sink_strength_before": s0, "sink_strength": s, "scale": scale, "target": target, "layers": layers,
            "heads": cfg["heads"], "units": [list(u) for u in temperature.units], "tries": trace,
            "edited": "q_norm gain per layer" if qk_norm_layers(model) else "q_proj rows (and bias) per query head"}


# --------------------------------------------------------------------------- the registered intervention

def run(out_dir: str | os.PathLike, base, vlm, params: Mapping[str, Any], options=None, *, seed: int = 0, replace: bool = False,
        progress: bool = True, request: dict[str, Any] | None = None) -> Path:
    """Dose the pair's `vlm` (its language model; give the base as both to dose a backbone itself), measured with the
    base's tokenizer, and save it to `out_dir` with `intervention.json` (the request and the report)."""
    # lazy: loads torch, numpy
    import torch

    cfg = check(params)
    out_dir = check_output_dir(out_dir, replace)
    base_dir = local_checkpoint(base)
    with language_model_of(base_dir, vlm, out_dir) as model_dir:
        check_pair(base_dir, model_dir)
        check_disk_space(out_dir, estimate_output_bytes(model_dir))
        tokenizer = load_tokenizer(base_dir)  # S is measured as the pair's other measurements are: with the base's tokenizer
        stored = getattr(torch, checkpoint_dtype(model_dir))
        # measured in `dtype` on `device`, edited values rounded to `stored`
        model, _ = load_causal_lm(model_dir, dtype=getattr(torch, cfg["dtype"]), device=cfg["device"])
        logger = logging.getLogger(__name__)
        with torch.no_grad():
            report = dose_model(model, tokenizer, cfg, stored=stored,
                                log=(lambda c, s: logger.info("%s: scale %.4g -> S %+.4f", NAME, c, s)))
        check_finite_model(model)
        with atomic_output_dir(out_dir, replace) as tmp:
            model.to("cpu", stored).save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            write_result(tmp, method=NAME, base=base, vlm=vlm, vlm_lm=model_dir, root=None, seed=seed, settings=cfg,
                         extra={"report": report, "files": {"weights": f"{NAME} of the VLM LM", **{f: "base LLM tokenizer / config"
                                                                                                    for f in side_files(tmp)}},
                                **({"request": request} if request else {})})
    return out_dir
