"""Training-time protection plug-ins: `TrainingHook`s registered by name, constructed from a config.

A protection acts during VL adaptation (`interventions.adapt`), through the engine's hook seam
(`interventions.adapt.hooks`: prepare_base, setup, dataset, loss, after_backward,
after_optimizer_step, teardown). It is a `Protection` subclass registered with defaults and an
optional validator, so a new idea is a small class:

    from interventions.protect import Protection, register_protection, select_heads

    @register_protection("scale_sink_heads_grad", defaults={"heads": {"by": "strength", "top_k": 4}, "factor": 0.1},
                         needs_sink_maps=True)
    class ScaleSinkHeadsGrad(Protection):
        '''Scale the q_proj gradient rows of the sink heads by `factor`.'''
        def setup(self, ctx):
            self.heads = select_heads(ctx.sink_maps, self.config["heads"])
        def after_backward(self, ctx):
            ...

    hooks = [make_protection("scale_sink_heads_grad", {"factor": 0.2})]
    adapt(base, vision=..., config=..., out=..., hooks=hooks)

Every protection takes `stages` (the recipe stages it acts in; None: every stage). `ctx.sink_maps`
(per-layer / per-head sink mass, log-odds on each head's argmax key, the argmax key per text) is
the base's, measured once before training on `ctx.calibration` when `needs_sink_maps` is set.
`select_heads` is the one head-selection rule all protections share (top-k by Sink Strength or by
sink mass, a threshold, an explicit list).

Shipped (modules of this package register themselves on first use, then the `sinkstudy.plugins`
entry points): `freeze_below_sink`, `sink_head_freeze`, `sink_head_qk_projection`,
`sink_preservation_loss`, `text_replay`, and `disable_qk_norm` (the sufficiency switch). Plug-ins
from files or modules: `sinkstudy.plugins.load_plugin`. See docs/protect.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

from interventions.adapt.hooks import TrainingHook
from sinkstudy import SinkstudyError
from sinkstudy.plugins import Registry

COMMON_DEFAULTS = {"stages": None}


class ProtectionError(SinkstudyError):
    """A bad protection name or setting (one line), raised before any work."""


@dataclass(frozen=True)
class ProtectionSpec:
    name: str
    cls: type
    defaults: dict
    description: str
    validate: Callable[[dict], None] | None = None


_PLUGINS = Registry("protection", __name__, ProtectionError, key=lambda spec: spec.cls)
_REGISTRY = _PLUGINS.items


class Protection(TrainingHook):
    """A registered protection: `self.config` is its defaults updated with the given settings
    (validated); `self.stages` comes from `config["stages"]`."""

    def __init__(self, config: Mapping[str, Any] | None = None):
        spec = _PLUGINS.items.get(getattr(type(self), "name", None))
        if spec is None or spec.cls is not type(self):
            raise ProtectionError(f"{type(self).__name__} is not a registered protection (use @register_protection)")
        self.config = resolve_config(spec, config)
        self.stages = self.config["stages"]

    def sources(self) -> tuple:
        # The shared helpers every protection uses are part of its identity besides its own file.
        from interventions.protect import heads, qk  # they import this package: read when a protection asks

        return (type(self), Protection, heads, qk)


def register_protection(name: str, *, defaults: Mapping[str, Any] | None = None, needs_sink_maps: bool = False,
                        edits_training: bool | None = None, description: str | None = None,
                        validate: Callable[[dict], None] | None = None):
    """Class decorator: register a `Protection` subclass under `name`.

    `defaults` lists every setting it takes (plus `stages`); `validate(config)` raises a one-line
    error for bad values before anything loads.
    """
    def wrap(cls):
        if not (isinstance(cls, type) and issubclass(cls, Protection)):
            raise ProtectionError(f"protection {name!r} must be a subclass of interventions.protect.Protection")
        doc = (cls.__doc__ or "").strip().splitlines()
        _PLUGINS.add(name, ProtectionSpec(name, cls, {**COMMON_DEFAULTS, **dict(defaults or {})},
                                          description or (doc[0] if doc else ""), validate))
        cls.name = name
        cls.needs_sink_maps = needs_sink_maps or cls.needs_sink_maps
        if edits_training is not None:
            cls.edits_training = edits_training
        return cls

    return wrap


def list_protections() -> dict[str, ProtectionSpec]:
    """The package's protections, then the `sinkstudy.plugins` entry points' (loaded once per process)."""
    return _PLUGINS.all()


def get_protection(name: str) -> ProtectionSpec:
    return _PLUGINS.get(name)


def _check_stages(config: dict) -> None:
    stages = config["stages"]
    if stages is not None and (not isinstance(stages, list) or not stages or not all(isinstance(s, str) for s in stages)):
        raise SinkstudyError(f"stages must be null or a non-empty list of stage names, got {stages!r}")


def resolve_config(spec: ProtectionSpec, params: Mapping[str, Any] | None) -> dict[str, Any]:
    """Defaults updated by `params`; unknown keys, non-finite numbers, bad `stages` and what the
    protection's `validate` refuses are one-line errors."""
    def validate(config: dict) -> None:
        try:
            _check_stages(config)
            if spec.validate is not None:
                spec.validate(config)
        except SinkstudyError as exc:
            raise ProtectionError(f"protection {spec.name}: {exc}") from None

    return _PLUGINS.resolve(spec.name, spec.defaults, params, validate)


def make_protection(name: str, params: Mapping[str, Any] | None = None) -> Protection:
    """An instance of registered protection `name` with `params` (validated)."""
    return get_protection(name).cls(params)


def validate_protection(name: str, params: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The resolved settings of protection `name`, checked without building anything."""
    return resolve_config(get_protection(name), params)


from interventions.protect.heads import HEAD_STATISTICS, head_statistic, select_heads, validate_heads  # noqa: E402

__all__ = [
    "HEAD_STATISTICS", "Protection", "ProtectionError", "ProtectionSpec", "get_protection", "head_statistic",
    "list_protections", "make_protection", "register_protection", "resolve_config", "select_heads", "validate_heads",
    "validate_protection",
]
