"""Step kinds: every step takes one frozen dataclass of arguments, its identity and its body's input in one.

A kind subclasses `StepArgs`: its fields are what the body reads, `run(ctx)` is the body, `code` names the
modules whose source shapes the result (found through the import system, so a moved file keeps its
identity honest) and `kind` names it in records. The engine keys a step on `identity(args)`: every field
walked, except the locations marked `location()` (where the step writes, how it shows progress, cache
directories: nothing that changes the result), with every model or file the step reads (`Ref`) replaced
by its content fingerprint. No path, no study and no dependency's key enters a key, so the same step made
by two commands (a `sinkstudy merge` and a study's merge of the same models) has one key and one result.
A kind whose identity lies elsewhere (a plug-in's source, a request recorded beside its output) overrides
`identity`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass, field
from typing import Any, ClassVar, Iterator, Mapping


UNKEYED = {"keyed": False}


def location(default: Any = dataclasses.MISSING, **kw) -> Any:
    """A field that says where a step writes or how it runs without changing its result: not in its key;
    keyword-only (given by name, after the arguments)."""
    if default is not dataclasses.MISSING:
        kw["default"] = default
    return field(metadata=UNKEYED, kw_only=True, **kw)


@dataclass(frozen=True)
class Ref:
    """A model or file a step reads, keyed by its content: `made_by` names the step of the plan that writes
    it (its fingerprint then comes from that step, read from disk or from its record), `revision` pins a
    hub id."""

    path: str
    made_by: str | None = None
    revision: str | None = None

    def fingerprint(self, ctx) -> str:
        from sinkstudy.provenance import model_fingerprint

        if self.made_by is not None:
            return ctx.fingerprint(self.path, self.made_by)
        return model_fingerprint(self.path, revision=self.revision)

    def local(self) -> str:
        """What loaders read: the path itself, or a pinned hub id's snapshot at its revision (fetched once,
        when a body needs it; never by a plan)."""
        if self.revision is None:
            return self.path
        from sinkstudy.checkpoint import local_checkpoint

        return os.fspath(local_checkpoint(self.path, self.revision))


def ref(path: str | os.PathLike | None, made_by: str | None = None, revision: str | None = None) -> Ref | None:
    return None if path is None else Ref(os.fspath(path), made_by, revision)


class StepArgs:
    """The arguments of one kind of step (subclasses are frozen dataclasses)."""

    kind: ClassVar[str] = ""
    code: ClassVar[tuple[str, ...]] = ()  # dotted module or package names whose source shapes the result

    def run(self, ctx) -> dict:
        raise NotImplementedError

    def identity(self, ctx) -> dict:
        """What the result depends on besides the code: the fields, inputs by content."""
        return keyed(self, ctx)


def keyed(value: Any, ctx) -> Any:
    """`value` as JSON data for a key: dataclass fields but locations, `Ref`s as fingerprints."""
    if isinstance(value, Ref):
        return value.fingerprint(ctx)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: keyed(getattr(value, f.name), ctx) for f in dataclasses.fields(value) if f.metadata.get("keyed", True)}
    if isinstance(value, Mapping):
        return {str(k): keyed(v, ctx) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [keyed(v, ctx) for v in value]
    if isinstance(value, os.PathLike):
        # A path in a key would tie the result to where it was made: inputs are Refs, outputs locations.
        raise TypeError(f"a path ({value}) in a step's identity: make it a Ref (an input) or a location() (an output)")
    return value


def refs(value: Any) -> Iterator[Ref]:
    """Every `Ref` among `value`'s fields (locations included: a step reads what they name too)."""
    if isinstance(value, Ref):
        yield value
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            yield from refs(getattr(value, f.name))
    elif isinstance(value, Mapping):
        for v in value.values():
            yield from refs(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from refs(v)


def step_key(args: StepArgs, ctx) -> tuple[str, dict]:
    """(key, identity) of a step with arguments `args`: the kind, its identity and its code (the modules it names
    and the file holding its body: an edit to the body reruns the step)."""
    import inspect
    from pathlib import Path

    from sinkstudy.provenance import code_version, module_code_version

    body = inspect.getsourcefile(type(args))
    identity = {"kind": args.kind, "args": args.identity(ctx), "code": module_code_version(*args.code),
                "body": code_version(Path(body)) if body else None}
    blob = json.dumps(identity, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:24], identity
