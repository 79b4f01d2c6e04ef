"""Crash-safe file primitives, one of each (PROTOCOL §8): atomic write,
fsynced line append, size-capped read.

Every file written here is mode 0600: records, audit logs, `.mam.env` and
broker configs may hold secrets. Callers choose the error class a failure
raises, so a registry write fails with `RegistryError` and a config write
with `ConfigError`.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import tempfile
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from mam.shared.protocol.errors import MamError, RegistryError


def errno_name(exc: OSError) -> str:
    """The symbolic errno of `exc` (`ENOSPC`), or its type name when it has none."""
    return errno.errorcode.get(exc.errno or 0, type(exc).__name__)


MAX_SUN_PATH_BYTES = 100
"""A socket path this long or longer is reached through /proc/self/fd (AF_UNIX allows 108 bytes)."""


def unix_address(path: Path) -> tuple[str, int | None]:
    """The address to bind/connect a unix socket at `path`, and a directory fd to close
    afterwards (None when the path is short enough to use as it is)."""
    if len(os.fsencode(str(path))) < MAX_SUN_PATH_BYTES:
        return str(path), None
    fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    return f"/proc/self/fd/{fd}/{path.name}", fd


RACY_MTIME_NS = 1_000_000_000
"""An mtime younger than this (1 s) is not trusted to mark a version: file systems stamp
with a coarse clock, so a second change within one tick can keep the same mtime."""


def settled_mtime_ns(st: os.stat_result, now_ns: int | None = None) -> int | None:
    """`st`'s mtime (ns) when it is old enough to mark a version, else None ("racy", as
    git calls it): a caller that caches by mtime looks again rather than remember it.

    Args:
        st: a stat result of the file or folder.
        now_ns: the wall clock in ns (default: now).
    """
    now = time.time_ns() if now_ns is None else now_ns
    return st.st_mtime_ns if now - st.st_mtime_ns >= RACY_MTIME_NS else None


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes, *, what: str, error: type[MamError] = RegistryError,
                 durable: bool = True) -> None:
    """Write `data` to `path` with mode 0600: temp file in the same folder,
    flush, fsync, `os.replace`, fsync of the folder (§8).

    Args:
        path: the target file; its folder must exist.
        data: the whole new content.
        what: names the file in the error message ("job 0a1b2c3d").
        error: the `MamError` subclass raised on failure.
        durable: False skips both fsyncs, for views rebuilt from a durable file (a reader
            still sees the old or the new content, never a mix; a power loss may lose the write).
    Raises:
        error: the write failed; `path` is unchanged and no temp file is left.
    """
    tmp: str | None = None
    try:
        tmp = _write_temp(path, data, durable=durable)
        os.replace(tmp, path)
        tmp = None
        if durable:
            _fsync_dir(path.parent)
    except OSError as exc:
        raise _unwritten(error, what, path, exc) from exc
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def _write_temp(path: Path, data: bytes, *, durable: bool) -> str:
    """`data` in a new 0600 temp file beside `path` (fsynced when `durable`); its name.
    Raises OSError, with no temp file left."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            os.fchmod(handle.fileno(), 0o600)
            handle.write(data)
            handle.flush()
            if durable:
                os.fsync(handle.fileno())
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return tmp


def stage_write(path: Path, data: bytes, *, what: str) -> str:
    """`data` in a new 0600 temp file beside `path`, not synced and not yet in place: the
    first half of `atomic_write`, for a group that puts many in place at once
    (`commit_staged`). Returns the temp file's name.

    Raises:
        RegistryError: the write failed; no temp file is left.
    """
    try:
        return _write_temp(path, data, durable=False)
    except OSError as exc:
        raise _unwritten(RegistryError, what, path, exc) from exc


def _unwritten(error: type[MamError], what: str, path: Path, exc: OSError) -> MamError:
    """The one-line error of a whole-file write that failed, `path` left as it was."""
    return error(f"{what}: cannot write {path} ({errno_name(exc)}: {exc.strerror or exc}); "
                 "the previous file is unchanged")


SYNC_THREADS = 16  # fsyncs issued at once by `sync_paths`: the file system commits them together
INLINE_SYNCS = 4
"""At most this many fsyncs in a step of `sync_paths` are issued one after another by the
caller: handing them to the pool costs more CPU than it saves (docs/benchmarks.md)."""

_sync_pool: ThreadPoolExecutor | None = None
_sync_pool_lock = threading.Lock()


def _forget_sync_pool() -> None:
    global _sync_pool
    _sync_pool = None  # a forked child has none of its parent's threads


os.register_at_fork(after_in_child=_forget_sync_pool)


def _pool() -> ThreadPoolExecutor:
    """The process's fsync threads, started on first use and kept: not one set per commit."""
    global _sync_pool
    with _sync_pool_lock:
        if _sync_pool is None:
            _sync_pool = ThreadPoolExecutor(SYNC_THREADS, thread_name_prefix="mam-fsync")
        return _sync_pool


def _fsync_path(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return  # replaced or removed since: its successor was synced by whoever wrote it
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_all(paths: list[Path]) -> None:
    if len(paths) <= INLINE_SYNCS:
        for path in paths:
            _fsync_path(path)
    else:
        list(_pool().map(_fsync_path, paths))


def sync_paths(files: Iterable[Path], *, what: str) -> None:
    """fsync every file of `files`, many at once (the file system groups them into few
    journal commits), then each of their folders (the renames): the group commit of
    `Registry.group`. A few are synced by the caller itself; more by the process's
    fsync threads (`SYNC_THREADS`, kept between calls).

    Raises:
        RegistryError: an fsync failed.
    """
    files = sorted(set(files))
    try:
        _fsync_all(files)
        _fsync_all(sorted({path.parent for path in files}))
    except OSError as exc:
        raise RegistryError(f"{what}: cannot fsync ({errno_name(exc)}: {exc.strerror or exc})") from exc


def commit_staged(files: Iterable[Path], staged: Mapping[Path, tuple[str, bool]], *, what: str) -> None:
    """A group commit that writes each file once: fsync `files` (appended to in place) and
    the temp files of `staged` (target -> (temp, durable)) that are durable, many at once;
    then rename every staged temp over its target; then fsync every folder touched. A
    durable target never takes a temp whose bytes are not on disk yet: a reader sees its
    new bytes only once they are durable, and its rename starts no writeback of its own
    (ext4's `auto_da_alloc`). A view (not durable) is renamed without an fsync.

    Raises:
        RegistryError: an fsync or a rename failed (what could be put in place still is).
    """
    failure: OSError | None = None
    try:
        _fsync_all(sorted(set(files) | {Path(tmp) for tmp, durable in staged.values() if durable}))
    except OSError as exc:
        failure = exc
    for path, (tmp, _) in staged.items():
        try:
            os.replace(tmp, path)
        except OSError as exc:
            failure = failure or exc
            with contextlib.suppress(OSError):
                os.unlink(tmp)
    try:
        _fsync_all(sorted({path.parent for path in files} | {path.parent for path in staged}))
    except OSError as exc:
        failure = failure or exc
    if failure is not None:
        raise RegistryError(f"{what}: cannot commit ({errno_name(failure)}: {failure.strerror or failure})") \
            from failure


WRITE_PROBE_PREFIX = ".write-probe."
"""The probe file `check_writable` creates and removes (the pid follows)."""


def check_writable(folder: Path, *, what: str, error: type[MamError] = RegistryError) -> None:
    """Make `folder` (0700, with its parents) if missing, then create, fsync and
    remove a probe file in it: a read-only mount, a full disk or a folder we may
    not write to fails here, not in the middle of a job.

    Raises:
        error: one line naming `what`, the folder and the errno (EROFS, EACCES, ENOSPC).
    """
    probe = folder / f"{WRITE_PROBE_PREFIX}{os.getpid()}"
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, b"probe\n")
            os.fsync(fd)
        finally:
            os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(probe)
        raise error(f"{what}: {folder} is not writable ({errno_name(exc)}: {exc.strerror or exc})") from exc


def json_line(obj: Any) -> bytes:
    """`obj` as one compact, key-sorted JSON line (UTF-8, ending in a newline)."""
    return (json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False) + "\n").encode("utf-8")


def append_line(path: Path, obj: Mapping[str, Any], *, what: str) -> None:
    """Append `obj` as one JSON line to `path` (0600) and fsync it (§8); see `append_lines`.

    Raises:
        RegistryError: the append failed.
    """
    append_lines(path, [obj], what=what)


def append_lines(path: Path, objs: Sequence[Mapping[str, Any]], *, what: str, sync: bool = True) -> None:
    """Append each of `objs` as one JSON line to `path` (0600) with ONE write and
    ONE fsync (§8): a transaction's lines cost one fsync, not one each. `sync=False`
    skips the fsync (the hub's lines that change no status, docs/registry.md): the
    line survives the process, not a power loss.

    A torn last line left by a crash is closed with a newline first, so the
    new lines stay readable. On failure the file is cut back to its old size.

    Raises:
        RegistryError: the append failed.
    """
    data = b"".join(json_line(obj) for obj in objs)
    fd = -1
    size = None
    try:
        fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":
            data = b"\n" + data
        view = memoryview(data)
        while view:
            written = os.write(fd, view)
            view = view[written:]
        if sync:
            os.fsync(fd)
    except OSError as exc:
        if fd >= 0 and size is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, size)
        raise RegistryError(
            f"{what}: cannot append to {path} ({errno_name(exc)}: {exc.strerror or exc})") from exc
    finally:
        if fd >= 0:
            os.close(fd)


def read_capped(path: str | os.PathLike[str], max_bytes: int) -> bytes:
    """Read a whole file that must not exceed `max_bytes`, without reading more.

    Raises:
        OSError: the file cannot be opened or read.
        OverflowError: it is larger than `max_bytes`.
    """
    with open(path, "rb") as handle:
        raw = handle.read(max_bytes + 1)
    if len(raw) > max_bytes:
        raise OverflowError(f"larger than {max_bytes} bytes")
    return raw


def read_json_object(path: str | os.PathLike[str], max_bytes: int) -> dict[str, Any]:
    """Read a small JSON object file (pid files, barriers, agent files).

    Raises:
        OSError: the file cannot be read.
        ValueError: larger than `max_bytes`, not UTF-8, not JSON, or not an object.
    """
    try:
        obj = json.loads(read_capped(path, max_bytes).decode("utf-8"))
    except OverflowError as exc:
        raise ValueError(str(exc)) from None
    if not isinstance(obj, dict):
        raise ValueError("not a JSON object")
    return obj


def read_json_lines(path: Path, *, what: str) -> list[dict[str, Any]]:
    """Every line of `path` as a dict, oldest first ([] when it does not exist); a line
    that is not a JSON object (a torn write) becomes `{"event": "unreadable_line", "line": n}`.

    Raises:
        RegistryError: the file exists but cannot be read.
    """
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise RegistryError(f"{what}: cannot read {path} ({errno_name(exc)}: {exc.strerror or exc})") from exc
    out: list[dict[str, Any]] = []
    for n, line in enumerate(raw.split(b"\n"), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            obj = None
        out.append(obj if isinstance(obj, dict) else {"event": "unreadable_line", "line": n})
    return out


def move_aside(path: Path, stamp: str) -> Path:
    """Rename a corrupt `path` to `<name>.corrupt-<stamp>` (never over an earlier copy).

    Raises:
        RegistryError: the rename failed.
    """
    aside = path.with_name(f"{path.name}.corrupt-{stamp}")
    n = 1
    while aside.exists():
        aside = path.with_name(f"{path.name}.corrupt-{stamp}-{n}")
        n += 1
    try:
        os.rename(path, aside)
    except OSError as exc:
        raise RegistryError(f"record {path} is corrupt and cannot be moved aside "
                            f"({errno_name(exc)}: {exc.strerror or exc})") from exc
    return aside
