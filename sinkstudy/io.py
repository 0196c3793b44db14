"""Atomic, locked, never-overwrite outputs.

Every artefact (checkpoint dir, JSON, PNG, report) is written to a temporary sibling and renamed
into place, so an interrupted run never leaves a half-written result that a rerun would reuse.

- Temporary siblings are named `.NAME.tmp-<pid>-<random>` (replaced outputs briefly
  `.NAME.old-<pid>-<random>`). One whose owner process is dead on this host (and, for a directory,
  whose output lock is free) is stale: it is removed at the next atomic write into the same parent
  and by `sinkstudy clean` (`make clean`).
- A writer holds an exclusive `fcntl.flock` on the sibling `.NAME.lock` while it works on NAME: a
  second writer into the same output fails at once with one line naming the holder's pid.
- Files and directories inside an atomic output follow the umask (safetensors writes 0600 itself).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import math
import os
import re
import shutil
import socket
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator

from sinkstudy import SinkstudyError

try:
    import fcntl
except ImportError:  # not POSIX: outputs are still atomic, but not locked
    fcntl = None


class OutputExistsError(SinkstudyError):
    pass


class OutputLockedError(SinkstudyError):
    pass


class UnreadableFileError(SinkstudyError, ValueError):
    """A file that is not UTF-8 text or not valid JSON (a ValueError, as json.loads raises)."""


def cache_root() -> Path:
    """Where sinkstudy keeps reusable state (eval results, fingerprints, extracted LMs, nltk tables)."""
    return Path(os.environ.get("SINKSTUDY_CACHE", Path.home() / ".cache" / "sinkstudy"))


def check_output_dir(path: str | os.PathLike, force: bool = False) -> Path:
    """Fail before any work if `path` exists and `force` is not set, or if `force` would delete
    a directory that holds the working directory or the home directory."""
    path = Path(path)
    if path.exists() and not force:
        raise OutputExistsError(f"output {path} already exists; pass --force to replace it")
    if force and path.exists():
        check_deletable(path)
    return path


def check_replaceable(path: str | os.PathLike, force: bool, *, not_mine: Callable[[Path], str | None], flag: str = "--out",
                      directory: bool = True) -> Path:
    """Where a command writes its result (`flag`'s value: a directory, or with `directory=False` a file), checked
    before any work. It may be absent, an empty directory, or an earlier result of the same command, recognised by
    the command's own record (`not_mine(path)` is None; else it says what is not the command's). Only such a
    result is ever replaced, and only with `force` (without it, the caller reuses it or refuses). Anything else is
    refused in one line whatever `force` says: `--force` never deletes what the command did not write."""
    path = Path(path)
    for parent in path.parents:  # a file on the way cannot become a folder
        if parent.exists():
            if not parent.is_dir():
                raise OutputExistsError(f"{flag} {path}: {parent} is a file, not a directory; choose another {flag} (nothing was written)")
            break
    if not path.exists():
        return path
    kind = "directory" if directory else "file"
    if path.is_dir() != directory:
        raise OutputExistsError(f"{flag} {path} is a {'file' if directory else 'directory'}, not a {kind}: choose another {flag} "
                                "(nothing was written)")
    if directory and not _holds_a_file(path):
        return path  # empty but for folders, locks and temporaries (what a killed run leaves)
    reason = not_mine(path)
    if reason is not None:
        raise OutputExistsError(f"{flag} {path} holds what this command did not write ({reason}): --force replaces only the "
                                f"command's own earlier result; choose another {flag} (nothing was touched)")
    if force:
        check_deletable(path)
    return path


def _holds_a_file(root: Path) -> bool:
    """Whether a file that is not hidden lies anywhere under `root` (hidden: locks, temporaries and what is in them)."""
    for _, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        if any(not f.startswith(".") for f in filenames):
            return True
    return False


_SLUG = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def check_slug(value: Any, where: str) -> str:
    """A name that becomes a path component: letters, digits, '.', '_', '-', not starting with a
    dot or a dash (no '/', no '..', no hidden names); one line naming `where` otherwise."""
    if not isinstance(value, str) or not _SLUG.fullmatch(value):
        raise SinkstudyError(f"{where}: must be a name of letters, digits, '.', '_' or '-' starting with a letter or digit, got {value!r}")
    return value


def slugify(text: str) -> str:
    """A path component made from free text (a model path, a hub id, settings)."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("._-") or "_"


def check_deletable(path: str | os.PathLike, within: str | os.PathLike | None = None) -> Path:
    """Refuse (one line) to delete `path` when it is a filesystem root, the home directory or
    one holding it, the working directory or one holding it, or (with `within`) not strictly
    inside `within`. Symlinks are resolved first: the check is on what would really go."""
    target = Path(path).resolve()
    protected = [Path.cwd().resolve(), Path.home().resolve()]
    if target == Path(target.anchor) or any(target == p or target in p.parents for p in protected):
        raise SinkstudyError(f"refusing to delete {path}: it is or holds the working or home directory")
    if within is not None:
        root = Path(within).resolve()
        if root not in target.parents:
            raise SinkstudyError(f"refusing to delete {path}: it is not inside {within}")
    return target


def remove_tree(path: str | os.PathLike, within: str | os.PathLike) -> None:
    """Delete the directory `path`, which must lie strictly inside `within` (after resolving)."""
    check_deletable(path, within)
    shutil.rmtree(path)


# --------------------------------------------------------------------------- locks

_HELD: dict[str, list[int]] = {}  # lock file -> [fd, depth]: the lock is re-entrant within a process


def lock_path(path: str | os.PathLike) -> Path:
    path = Path(path)
    return path.parent.resolve() / f".{path.name}.lock"


@contextlib.contextmanager
def output_lock(path: str | os.PathLike, wait: bool = False) -> Iterator[None]:
    """Hold the exclusive lock of output `path` (creating its parent directory); another process
    holding it makes this fail at once with one line naming that process, or with `wait` (a shared
    cache entry that one process makes for all, e.g. a converted checkpoint) wait until it is done."""
    if fcntl is None:
        yield
        return
    lock = lock_path(path)
    key = os.fspath(lock)
    if key in _HELD:
        _HELD[key][1] += 1
        try:
            yield
        finally:
            _HELD[key][1] -= 1
        return
    lock.parent.mkdir(parents=True, exist_ok=True)
    fd = _acquire(lock, path, wait)
    _HELD[key] = [fd, 1]
    try:
        yield
    finally:
        del _HELD[key]
        with contextlib.suppress(FileNotFoundError):
            os.unlink(lock)  # while still holding it: a waiting opener re-checks the inode
        os.close(fd)


def _acquire(lock: Path, path, wait: bool = False) -> int:
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 200).decode(errors="replace").split() or ["unknown"]
            if wait:
                logging.getLogger(__name__).warning("waiting for pid %s, which is writing %s", " on ".join(holder[:2]), path)
                fcntl.flock(fd, fcntl.LOCK_EX)  # the holder unlinks the file it locked: the check below retries then
            else:
                os.close(fd)
                raise OutputLockedError(f"{path} is being written by another sinkstudy process (pid {' on '.join(holder[:2])}); "
                                        "wait for it to finish or choose another output") from None
        try:
            same = os.stat(lock).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:  # not a file its previous holder unlinked while we were opening it
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()} {socket.gethostname()}\n".encode())
            return fd
        os.close(fd)


def _writable_by_us(lock: Path) -> bool:
    """No live writer holds the output: its lock is free, or this process holds it (the rerun of a killed writer,
    about to write the same output: the dead writer's temporary is its to remove)."""
    return os.fspath(lock.parent.resolve() / lock.name) in _HELD or _lock_is_free(lock)


def _lock_is_free(lock: Path) -> bool:
    if fcntl is None or os.fspath(lock) in _HELD:
        return fcntl is None
    try:
        fd = os.open(lock, os.O_RDWR)
    except FileNotFoundError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)  # closing drops the probe's lock
    return True


# --------------------------------------------------------------------------- stale temporaries

# ".NAME.tmp-PID-RANDOM[.SUFFIX]" and ".NAME.old-PID-RANDOM" (tempfile's random part: [a-z0-9_]).
_TEMP = re.compile(r"^\.(?P<name>.+)\.(?:tmp|old)-(?P<pid>\d+)-[a-z0-9_]+(?:\.[A-Za-z0-9]+)?$")
_LOCK = re.compile(r"^\.(?P<name>.+)\.lock$")


def _temp_prefix(path: Path, kind: str) -> str:
    return f".{path.name}.{kind}-{os.getpid()}-"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    return True


def remove_stale_temps(parent: str | os.PathLike, *, recursive: bool = False) -> list[Path]:
    """Remove temporaries under `parent` left by dead writers (and free leftover lock files);
    returns what was removed. A temp dir whose output lock is held is kept whatever its pid."""
    parent = Path(parent)
    removed: list[Path] = []
    try:
        entries = list(os.scandir(parent))
    except (FileNotFoundError, NotADirectoryError, PermissionError):
        return removed
    for entry in entries:
        m = _TEMP.match(entry.name)
        is_dir = entry.is_dir(follow_symlinks=False)
        if m and not _pid_alive(int(m["pid"])) and (not is_dir or _writable_by_us(parent / f".{m['name']}.lock")):
            with contextlib.suppress(FileNotFoundError):
                shutil.rmtree(entry.path) if is_dir else os.unlink(entry.path)
            removed.append(Path(entry.path))
        elif _LOCK.match(entry.name) and entry.is_file(follow_symlinks=False) and _lock_is_free(Path(entry.path)):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)  # a killed holder's file; a new holder re-checks the inode
            removed.append(Path(entry.path))
        elif recursive and is_dir and not m:
            removed += remove_stale_temps(entry.path, recursive=True)
    return removed


# --------------------------------------------------------------------------- atomic writes

@contextlib.contextmanager
def atomic_output_dir(path: str | os.PathLike, replace: bool = False) -> Iterator[Path]:
    """Yield a temp dir beside `path`; on success it replaces `path` in one rename.

    Holds the output's lock throughout. On error the temp dir is removed and any existing `path`
    is left untouched. An existing `path` (one that appeared meanwhile too) is replaced only with `replace`: the
    caller has decided it may be (the engine running a step, a cache entry being filled), never this writer.
    """
    path = check_output_dir(path, replace)
    with output_lock(path):
        check_output_dir(path, replace)
        parent = path.parent
        remove_stale_temps(parent)
        tmp = Path(tempfile.mkdtemp(prefix=_temp_prefix(path, "tmp"), dir=parent))
        try:
            yield tmp
            follow_umask(tmp)
            if path.exists() and not replace:
                raise OutputExistsError(f"output {path} appeared while it was being written; pass --force to replace it")
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if path.exists():
            old = Path(tempfile.mkdtemp(prefix=_temp_prefix(path, "old"), dir=parent))
            os.replace(path, old / path.name)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)


@contextlib.contextmanager
def scratch_dir(path: str | os.PathLike, what: str) -> Iterator[Path]:
    """A temporary folder beside `path` (same filesystem) for `what` a writer needs only while it writes, removed on
    exit; named as every temporary is, so one a killed process leaves goes at the next write beside it (and with
    `sinkstudy clean`)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=_temp_prefix(path.with_name(f"{path.name}-{what}"), "tmp"), dir=path.parent))
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def follow_umask(root: str | os.PathLike) -> None:
    """Give `root` and everything under it the modes a plain create would (mkdtemp makes 0700,
    mkstemp and safetensors 0600, which would make shared results unreadable)."""
    mask = _umask()
    root = Path(root)
    if root.is_file():
        os.chmod(root, (0o777 if root.stat().st_mode & 0o111 else 0o666) & ~mask)
        return
    os.chmod(root, 0o777 & ~mask)
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            if os.path.islink(p):
                continue
            executable = os.path.isdir(p) or os.stat(p).st_mode & 0o111
            os.chmod(p, (0o777 if executable else 0o666) & ~mask)


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temp path beside `path` (same suffix); on success it replaces `path` in one rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(path.parent)
    fd, tmp = tempfile.mkstemp(prefix=_temp_prefix(path, "tmp"), suffix=path.suffix, dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        follow_umask(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    with atomic_file(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return Path(path)


def write_json_atomic(path: str | os.PathLike, obj: Any) -> Path:
    """Strict JSON: NaN/inf (e.g. a relative change over a zero base score) are stored as null."""
    text = json.dumps(_finite(obj), indent=2, default=json_default, allow_nan=False)
    return write_text_atomic(path, text + "\n")


def _finite(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    if hasattr(obj, "tolist") and not isinstance(obj, (str, bytes)):
        return _finite(obj.tolist())
    return obj


def save_figure_atomic(fig, path: str | os.PathLike, **kwargs) -> Path:
    """Save a matplotlib figure atomically (format taken from the suffix)."""
    with atomic_file(path) as tmp:
        fig.savefig(tmp, **kwargs)
    return Path(path)


# --------------------------------------------------------------------------- reading

def read_text(path: str | os.PathLike, what: str = "file") -> str:
    """A UTF-8 text file's content; missing or non-UTF-8 files fail with one line naming them."""
    path = Path(path)
    if not path.is_file():
        raise SinkstudyError(f"{what} {path} does not exist")
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UnreadableFileError(f"{what} {path} is not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start})") from None


def read_json(path: str | os.PathLike) -> Any:
    path = Path(path)
    if not path.is_file():
        raise SinkstudyError(f"missing file: {path}")
    try:
        return json.loads(read_text(path))
    except ValueError as exc:
        raise UnreadableFileError(f"{path} is not valid JSON: {exc}") from None


def json_default(obj: Any) -> Any:
    """`json.dumps(default=...)` for numpy/torch values and paths found in results."""
    # numpy / torch scalars and paths end up in results; store them as plain JSON.
    if hasattr(obj, "tolist"):
        return obj.tolist()
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


def disk_full(exc: BaseException) -> OSError | None:
    """The out-of-space / over-quota error behind `exc` (its cause chain included), if any."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return exc
        text = str(exc)
        if "No space left on device" in text or "Disk quota exceeded" in text or "StorageFull" in text:
            return OSError(errno.ENOSPC, "No space left on device")
        exc = exc.__cause__ or exc.__context__
    return None
