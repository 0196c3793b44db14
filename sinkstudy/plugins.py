"""Plug-ins from outside the package: a Python file, an importable module, or the `sinkstudy.plugins`
entry-point group.

A plug-in is ordinary Python that registers what it defines when imported: training-time protections
(`interventions.protect.register_protection`) and post-hoc mitigations
(`interventions.mitigations.register_mitigation`), any number of each. Ways in:
    sinkstudy adapt ... --plugin path/to/my_idea.py      # a file (also: mitigate, run)
    sinkstudy run study.yaml --plugin my_package.ideas   # an importable module
    plugins: [my_idea.py, my_package.ideas]              # in a study config
    [project.entry-points."sinkstudy.plugins"]           # a distribution's pyproject.toml: loaded by
    my_ideas = "my_package.ideas"                        # the registries at their first use

An entry point names a module (imported) or a callable (called with no arguments). A file is
imported under a name derived from its resolved path; loading it again after it was edited
re-executes it (registries accept a re-registration from the same module), and an unchanged file
is not re-imported.

`source_hash(*objects)` is the one identity of plug-in code: sha256 over the source files that
define the given functions, classes or modules (compiled code where there is no file). It enters
the cache key of every result a plug-in shapes, so editing a plug-in reruns exactly those.

Plumbing: this module imports nothing above `sinkstudy`.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import inspect
import marshal
import math
import os
import pkgutil
import sys
import weakref
from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, Iterable, Iterator

from sinkstudy import SinkstudyError

ENTRY_POINT_GROUP = "sinkstudy.plugins"
_FILE_MODULE_PREFIX = "sinkstudy_plugin_"


class PluginError(SinkstudyError):
    """A plug-in that cannot be found or fails on import (one line naming it)."""


@dataclass(frozen=True)
class Plugin:
    ref: str  # as given: a path, a module name, or "entry point NAME"
    module: str  # the module it was imported as
    path: str | None  # its source file, where it has one
    source: str  # source_hash of the module when it was loaded


_FILES: dict[str, Plugin] = {}  # resolved path -> the loaded plug-in
_ENTRY_POINTS: dict[str, Plugin] = {}  # entry point name -> the loaded plug-in
_REGISTRIES: "weakref.WeakSet[Registry]" = weakref.WeakSet()  # every live registry, for `isolated`


def is_file_ref(ref: str) -> bool:
    """A reference that names a file (ends in .py, holds a path separator, or exists) rather than a module."""
    return ref.endswith(".py") or os.sep in ref or "/" in ref or Path(ref).is_file()


def load_plugin(ref: str | os.PathLike, *, base_dir: str | os.PathLike | None = None) -> Plugin:
    """Import the plug-in file or module `ref`; a relative file is looked up in the working directory,
    then in `base_dir` (e.g. a study config's folder)."""
    ref = os.fspath(ref)
    if not isinstance(ref, str) or not ref.strip():
        raise PluginError(f"plug-in reference must be a file path or a module name, got {ref!r}")
    if is_file_ref(ref):
        return _load_file(_find_file(ref, base_dir), ref)
    try:
        module = importlib.import_module(ref)
    except ModuleNotFoundError as exc:
        if exc.name and ref.startswith(exc.name):
            raise PluginError(f"plug-in {ref!r}: no such file or importable module") from None
        raise PluginError(f"plug-in {ref!r} failed to import: {exc}") from None
    except Exception as exc:  # a plug-in's own error: named, one line
        raise PluginError(f"plug-in {ref!r} failed to import: {type(exc).__name__}: {exc}") from None
    return Plugin(ref, module.__name__, getattr(module, "__file__", None), source_hash(module))


def load_plugins(refs: Iterable[str | os.PathLike], *, base_dir: str | os.PathLike | None = None) -> list[Plugin]:
    return [load_plugin(r, base_dir=base_dir) for r in refs]


def _find_file(ref: str, base_dir) -> Path:
    path = Path(ref).expanduser()
    if not path.is_absolute() and not path.is_file() and base_dir is not None:
        path = Path(base_dir) / path
    if not path.is_file():
        raise PluginError(f"plug-in file not found: {ref}")
    if path.suffix != ".py":
        raise PluginError(f"plug-in file {ref} is not a .py file")
    return path.resolve()


def _load_file(path: Path, ref: str) -> Plugin:
    digest = _file_digest(path)
    loaded = _FILES.get(str(path))
    if loaded is not None and loaded.source == digest and loaded.module in sys.modules:
        return loaded
    stem = "".join(c if c.isalnum() else "_" for c in path.stem)
    name = f"{_FILE_MODULE_PREFIX}{stem}_{hashlib.sha256(str(path).encode()).hexdigest()[:10]}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look the module up while it executes
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        sys.modules.pop(name, None)
        raise PluginError(f"plug-in {ref} failed to load: {type(exc).__name__}: {exc}") from None
    plugin = Plugin(ref, name, str(path), digest)
    _FILES[str(path)] = plugin
    return plugin


def load_entry_points() -> list[Plugin]:
    """Load every not yet loaded entry point of the `sinkstudy.plugins` group; returns those loaded now."""
    new = []
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in _ENTRY_POINTS:
            continue
        try:
            obj = ep.load()
            if callable(obj) and not inspect.ismodule(obj):
                obj()
        except Exception as exc:
            raise PluginError(f"entry point {ep.name} = {ep.value} ({ENTRY_POINT_GROUP}) failed to load: "
                              f"{type(exc).__name__}: {exc}") from None
        module = sys.modules.get(ep.module)
        plugin = Plugin(f"entry point {ep.name}", ep.module, getattr(module, "__file__", None), source_hash(module or obj))
        _ENTRY_POINTS[ep.name] = plugin
        new.append(plugin)
    return new


def loaded_plugins() -> list[Plugin]:
    """Every plug-in loaded from a file or an entry point in this process."""
    return list(_FILES.values()) + list(_ENTRY_POINTS.values())


@contextlib.contextmanager
def isolated() -> Iterator[None]:
    """On exit, forget every plug-in loaded and every name registered inside the block (the test
    suite runs each test in one): registries, loaded files and entry points, and the modules of the
    forgotten entries, so loading them again registers them again. Shipped names stay."""
    saved = {id(r): dict(r.items) for r in _REGISTRIES}
    flags = {id(r): r.entry_points_loaded for r in _REGISTRIES}
    files, entry_points, modules = dict(_FILES), dict(_ENTRY_POINTS), set(sys.modules)
    try:
        yield
    finally:
        for r in _REGISTRIES:
            before = saved.get(id(r), {})
            dropped = {r._module(e) for n, e in r.items.items() if not r._is_shipped(e) and before.get(n) is not e}
            kept = {n: e for n, e in r.items.items() if r._is_shipped(e) and n not in before}
            r.items.clear()
            r.items.update({**before, **kept})
            r.entry_points_loaded = flags.get(id(r), False)
            for name in dropped - modules:
                sys.modules.pop(name, None)
        for live, old in ((_FILES, files), (_ENTRY_POINTS, entry_points)):
            for name in set(live) - set(old):
                if live[name].module not in modules:
                    sys.modules.pop(live[name].module, None)
            live.clear()
            live.update(old)


def source_hash(*objects: Any) -> str:
    """'plugin-sha256:<24 hex>' over the source files defining `objects` (functions, classes,
    modules; None is skipped), each file once, in order; compiled code where no file exists."""
    h = hashlib.sha256()
    seen: set[str] = set()
    for obj in objects:
        if obj is None:
            continue
        try:
            source = inspect.getsourcefile(obj)
        except TypeError:  # a builtin, or a class defined interactively
            source = None
        if source and os.path.isfile(source):
            if source not in seen:
                seen.add(source)
                h.update(Path(source).read_bytes())
        elif hasattr(obj, "__code__"):
            h.update(marshal.dumps(obj.__code__))
        else:
            h.update(f"{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', repr(obj))}".encode())
    return "plugin-sha256:" + h.hexdigest()[:24]


def _file_digest(path: Path) -> str:
    return "plugin-sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()[:24]


def same_module_reloaded(old: Any, new: Any) -> bool:
    """Whether `new` replaces `old` because their module was loaded again (an edited plug-in file)."""
    return getattr(old, "__module__", None) == getattr(new, "__module__", None) and \
        getattr(old, "__qualname__", None) == getattr(new, "__qualname__", None)


class Registry:
    """Named plug-ins of one kind (mitigations, protections): the registering package's own modules
    are imported at first use, then the `sinkstudy.plugins` entry points; `items` maps name -> entry.

    The shipped names come first whatever the order of imports: a registration from outside the
    package imports the package's own modules before it is accepted, and a shipped name is never
    taken by a plug-in (one-line error). `key(entry)` is the registered function or class:
    registering a name again is an error unless it is the same object or the same one from a
    plug-in file loaded again after an edit.
    """

    def __init__(self, kind: str, package: str, error: type, key):
        self.kind, self.package, self.error, self.key = kind, package, error, key
        self.items: dict[str, Any] = {}
        self.shipped_loaded = False
        self.entry_points_loaded = False
        _REGISTRIES.add(self)

    def _module(self, entry: Any) -> str:
        return getattr(self.key(entry), "__module__", None) or "?"

    def _is_shipped(self, entry: Any) -> bool:
        module = self._module(entry)
        return module == self.package or module.startswith(self.package + ".")

    def load_shipped(self) -> None:
        """Import the package's own modules once; each registers what it ships."""
        if self.shipped_loaded:
            return

        self.shipped_loaded = True  # first: the modules' registrations come back through `add`
        try:
            package = importlib.import_module(self.package)
            for mod in pkgutil.iter_modules(package.__path__):
                importlib.import_module(f"{self.package}.{mod.name}")
        except BaseException:
            self.shipped_loaded = False
            raise

    def add(self, name: str, entry: Any) -> None:
        shipped = self._is_shipped(entry)
        if not shipped:
            self.load_shipped()  # a plug-in registers only after every shipped name is taken
        old = self.items.get(name)
        if old is not None and self.key(old) is not self.key(entry):
            if self._is_shipped(old) and not shipped:
                raise self.error(f"{self.kind} {name!r} is already registered: it ships with sinkstudy "
                                 f"({self._module(old)}); a plug-in must use another name")
            if not same_module_reloaded(self.key(old), self.key(entry)):
                raise self.error(f"{self.kind} {name!r} is already registered (by {self._module(old)})")
        self.items[name] = entry

    def all(self) -> dict[str, Any]:
        self.load_shipped()
        if not self.entry_points_loaded:
            load_entry_points()
            self.entry_points_loaded = True
        return dict(sorted(self.items.items()))

    def get(self, name: str) -> Any:
        registry = self.all()
        if name not in registry:
            raise self.error(f"unknown {self.kind} {name!r}; registered: {', '.join(registry) or 'none'}")
        return registry[name]

    def resolve(self, name: str, defaults: dict, params, validate=None) -> dict[str, Any]:
        """`defaults` updated by `params`: unknown keys (typos must not pass silently), non-finite
        numbers and whatever `validate(config)` refuses are one-line errors."""
        params = dict(params or {})
        unknown = set(params) - set(defaults)
        if unknown:
            raise self.error(f"{self.kind} {name} has no parameter(s) {', '.join(sorted(unknown))}; "
                             f"it takes {', '.join(defaults) or 'none'}")
        config = {**defaults, **params}
        for key, value in config.items():
            if isinstance(value, float) and not math.isfinite(value):
                raise self.error(f"{self.kind} {name}: {key} must be a finite number, got {value!r}")
        if validate is not None:
            validate(config)
        return config
