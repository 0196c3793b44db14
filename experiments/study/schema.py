"""What every config reader in `experiments` shares: the one-line config error, the merge of overrides
into a config, and typed sections: a dataclass whose fields carry their own check
(`checked(default, check)`), read from a mapping by `parse` (unknown keys refused, defaults filled,
each field checked where it is declared). Its own module so that the study schema
(`experiments.study.config`) and the demo's build section (`experiments.demo.build`) both import it
without importing each other."""

from __future__ import annotations

import copy
import dataclasses
import difflib
from pathlib import Path
from typing import Any, Callable, NoReturn, TypeVar

from sinkstudy import SinkstudyError
from sinkstudy.io import check_slug

T = TypeVar("T")


class StudyConfigError(SinkstudyError):
    pass


def deep_merge(a: dict, b: dict) -> dict:
    """`b` merged into a copy of `a` (nested mappings merged, everything else replaced)."""
    out = copy.deepcopy(a)
    for k, v in b.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


def fail(where: str, msg: str) -> NoReturn:
    raise StudyConfigError(f"{where}: {msg}")


def mapping(value, where: str, allowed: set[str] | None = None) -> dict:
    """`value` as a mapping (None: empty) whose keys are all in `allowed` (None: any)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        fail(where, f"must be a mapping, got {type(value).__name__}")
    unknown = sorted(set(value) - allowed, key=str) if allowed is not None else []
    if unknown:
        fail(where, f"unknown key(s) {', '.join(did_you_mean(str(k), allowed) for k in unknown)}; allowed: {', '.join(sorted(allowed))}")
    return value


def did_you_mean(name: str, known) -> str:
    """`name`, with the known name it most likely misspells: "max_gen_tok (did you mean max_gen_toks?)"."""
    close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.6)
    return f"{name} (did you mean {close[0]}?)" if close else name


def integer(value, where: str, minimum: int = 0, allow_none: bool = False):
    if value is None and allow_none:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        fail(where, f"must be an integer >= {minimum}, got {value!r}")
    return value


def boolean(value, where: str) -> bool:
    if not isinstance(value, bool):
        fail(where, "must be true or false")
    return value


def slug(value, where: str) -> str:
    """A name that becomes a path component (sinkstudy.io.check_slug)."""
    try:
        return check_slug(value, where)
    except SinkstudyError as exc:
        raise StudyConfigError(str(exc)) from None


def relative_file(value: str, config: Path | None) -> Path:
    """A file named in a config: as given (cwd), else relative to the config's folder."""
    f = Path(value).expanduser()
    if not f.is_absolute() and not f.exists() and config is not None:
        f = config.parent / f
    return f


def guarded(check: Callable[[Any], Any], where: str, value):
    """`check(value)` with its SinkstudyError turned into this field's one-line config error."""
    try:
        return check(value)
    except SinkstudyError as exc:
        fail(where, str(exc))


def checked(default: Any = dataclasses.MISSING, check: Callable[[Any, str], Any] | None = None, *,
            factory: Callable[[], Any] | None = None):
    """A section field whose value `check(value, where)` validates (and may normalise) when `parse` reads it."""
    kw = {"default_factory": factory} if factory is not None else {"default": default}
    return dataclasses.field(metadata={"check": check}, **kw)


def parse(cls: type[T], raw, where: str) -> T:
    """Section `cls` from the mapping `raw` (None: every default): keys outside its fields are refused,
    missing ones take their defaults, and each field's check runs in declaration order, naming
    `<where>.<field>` in its error."""
    given = mapping(raw, where, {f.name for f in dataclasses.fields(cls)})
    values = {}
    for f in dataclasses.fields(cls):
        if f.name in given:
            value = given[f.name]
        elif f.default is not dataclasses.MISSING:
            value = copy.deepcopy(f.default)
        elif f.default_factory is not dataclasses.MISSING:
            value = f.default_factory()
        else:
            fail(where, f"{f.name} is missing")
        check = f.metadata.get("check")
        values[f.name] = check(value, f"{where}.{f.name}") if check else value
    return cls(**values)


def as_dict(section) -> dict:
    """A section as the plain mapping its step specs and records hold."""
    return dataclasses.asdict(section)
