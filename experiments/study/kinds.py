"""Step kinds: every step takes one frozen dataclass of arguments, its identity and its body's input in one.

A kind subclasses `StepArgs`: its fields are what the body reads, `run(ctx)` is the body, `code` names the
modules it runs besides its own body (found through the import system, so a moved file keeps its identity
honest; modules, never a package's folder: a benchmark or a plot beside them is no part of any result) and
`kind` names it in records. Its code identity is those modules and its own body: the class and the definitions
of its module it uses (`code_identity`), so two kinds in one file have identities of their own. The engine keys a step on `identity(args)`: every field
walked, except the locations marked `location()` (where the step writes, how it shows progress, cache
directories: nothing that changes the result), with every model or file the step reads (`Ref`) replaced
by its content fingerprint. No path, no study and no dependency's key enters a key, so the same step made
by two commands (a `sinkstudy merge` and a study's merge of the same models) has one key and one result.
A kind whose identity lies elsewhere (a plug-in's source, a request recorded beside its output) overrides
`identity`.
"""

from __future__ import annotations

import ast
import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Iterator, Mapping

from sinkstudy import keys
from sinkstudy.checkpoint import local_checkpoint
from sinkstudy.provenance import model_fingerprint, module_code_version, module_file


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
        if self.made_by is not None:
            return ctx.fingerprint(self.path, self.made_by)
        return model_fingerprint(self.path, revision=self.revision)

    def local(self) -> str:
        """What loaders read: the path itself, or a pinned hub id's snapshot at its revision (fetched once,
        when a body needs it; never by a plan)."""
        if self.revision is None:
            return self.path
        return os.fspath(local_checkpoint(self.path, self.revision))


def ref(path: str | os.PathLike | None, made_by: str | None = None, revision: str | None = None) -> Ref | None:
    return None if path is None else Ref(os.fspath(path), made_by, revision)


class StepArgs:
    """The arguments of one kind of step (subclasses are frozen dataclasses)."""

    kind: ClassVar[str] = ""
    code: ClassVar[tuple[str, ...]] = ()  # dotted names of the modules it runs besides its own body

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
    """(key, identity) of a step with arguments `args`: the kind, its identity and its code (`code_identity`)."""
    identity = {"kind": args.kind, "args": args.identity(ctx), **code_identity(type(args))}
    return keys.key(identity), identity


def code_identity(kind: type) -> dict[str, str]:
    """The code a step of `kind` runs, by content: each module its `code` names (a package names its `__init__`
    alone: a kind names the modules it runs, never a folder holding others, a benchmark or a plot), and its own body
    (`own_source`): editing one kind's body reruns that kind's steps and no other's."""
    return {"code": module_code_version(*kind.code), "body": "body-sha256:" + keys.key(own_source(kind))}


def own_source(kind: type) -> str:
    """The source of `kind`'s class and of every definition of its module the class uses, directly or through another
    (a helper function, a shared dataclass, a constant); never the module's other kinds."""
    text = module_text(module_file(kind.__module__))
    tree = ast.parse(text)
    defs: dict[str, ast.stmt] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defs[node.name] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(target, ast.Name):
                    defs[target.id] = node
    used, todo = set(), [kind.__name__]
    while todo:
        name = todo.pop()
        if name in used or name not in defs:
            continue
        used.add(name)
        todo += [n.id for n in ast.walk(defs[name]) if isinstance(n, ast.Name)]
    nodes = sorted({id(defs[n]): defs[n] for n in used}.values(), key=lambda n: n.lineno)
    return "\n".join(ast.get_source_segment(text, n) for n in nodes)


def module_text(path: Path) -> str:
    """A module's source as a kind's identity reads it."""
    return path.read_text(encoding="utf-8")
