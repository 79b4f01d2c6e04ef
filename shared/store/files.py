"""The files of a registry (PROTOCOL §8): its paths, folders (0700, made on the
first write), the lock (`fcntl.flock`, re-entrant per thread) and `group()`, the
hub service's group commit (docs/registry.md "Durability"). `Registry` builds on it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

from mam.shared.protocol import names
from mam.shared.protocol.errors import RegistryError
from mam.shared.store.fsio import atomic_write, commit_staged, errno_name, stage_write, sync_paths
from mam.shared.store.lock import FileLock
from mam.shared.store.records import dumps

log = logging.getLogger("mam.registry")

Flush = Literal["locked", "after", "none"]
FLUSHES: tuple[Flush, ...] = ("locked", "after", "none")

REMEMBERED_JOBS = 20_000  # job ids whose paths and folders are remembered; then forgotten all at once
RECORD_TEMP_RE = re.compile(r"^\.[0-9a-f]{8}\.json\.[a-z0-9_]+\.tmp$")
"""A record's temp file (`fsio.atomic_write`, `fsio.stage_write`: `.<job_id>.json.<random>.tmp`)."""
VIEW_TEMP_RE = re.compile(r"^\.(?:status|meta)\.json\.[a-z0-9_]+\.tmp$")
"""A view's temp file beside a job's logs (`.status.json.<random>.tmp`, `.meta.json.<random>.tmp`)."""


class RegistryFiles:
    """Paths, folders, lock and group commit of the registry rooted at `root` (§8)."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self._lock = FileLock(names.lock_path(self.root))
        self._made: set[str] = set()  # "" (the base folders) and job ids whose folders exist
        self._paths: dict[str, Path] = {}
        self._group: set[Path] | None = None  # files written inside `group()`, fsynced at its end
        self._group_thread = 0
        # records written inside `group()`, read from here until its end: the group holds the
        # lock, so no other writer can have replaced them (the service reads a job's record
        # again for its state right after its event's write)
        self._group_records: dict[Path, bytes] = {}
        # files a "locked" group writes whole (records, views): target -> (temp, durable),
        # put in place once at its end, each once however often the group wrote it
        self._staged: dict[Path, tuple[str, bool]] | None = None

    # -------------------------------------------------------------- paths

    def record_path(self, job_id: str) -> Path:
        """`<root>/.mam/jobs/<job_id>.json` (remembered: the hub service reads thousands a second)."""
        path = self._paths.get(job_id)
        if path is None:
            if len(self._paths) >= REMEMBERED_JOBS:
                self._paths.clear()
            path = self._paths[job_id] = names.record_path(self.root, job_id)
        return path

    def logs_dir(self, job_id: str) -> Path:
        """`<root>/.mam/logs/<job_id>`."""
        return names.job_logs_dir(self.root, job_id)

    def audit_path(self, job_id: str) -> Path:
        """`<root>/.mam/logs/<job_id>/events.ndjson`."""
        return self.logs_dir(job_id) / "events.ndjson"

    def _ensure_dirs(self, job_id: str | None = None) -> None:
        # A folder made (or found) once by this object is not made again: the hub
        # service takes the lock and appends thousands of times a second (docs/registry.md).
        key = job_id or ""
        if key in self._made:
            return
        try:
            folders = [names.mam_dir(self.root), names.jobs_dir(self.root)]
            if job_id is not None:
                folders += [self.logs_dir(job_id).parent, self.logs_dir(job_id)]
            for folder in folders:  # one by one, so every level gets 0700, not just the last
                folder.mkdir(mode=0o700, parents=folder == folders[0], exist_ok=True)
        except OSError as exc:
            raise RegistryError(f"cannot create the registry folders under {names.mam_dir(self.root)} "
                                f"({errno_name(exc)}: {exc.strerror or exc})") from exc
        if len(self._made) >= REMEMBERED_JOBS:
            self._made.clear()
        self._made.add(key)

    # --------------------------------------------------------------- lock

    @contextlib.contextmanager
    def lock(self) -> Iterator[None]:
        """Hold the registry lock (`fcntl.flock` on `.mam/jobs/.lock`, §8), made
        0700 folders first. Re-entrant within one thread of one process; callers
        may group several calls in `with registry.lock():` (the §12 barrier does).

        Raises:
            RegistryError: the folders cannot be made, or the lock file opened or locked.
        """
        if not self._lock.held:
            self._ensure_dirs()
        with self._lock.hold():
            yield

    @contextlib.contextmanager
    def group(self, *, flush: Flush = "locked") -> Iterator[None]:
        """Hold the lock; commits inside skip their fsyncs, and the group flushes every
        file they wrote together (`fsio.sync_paths`) as `flush` says (docs/registry.md
        "Durability"). Nested (or in another thread): a lock, the outer group flushes.

        Args:
            flush: "locked": at the group's end, still holding the lock (the hub service's
                pass over its backlog). "after": once the lock is released, before this
                returns (a runner's progress: the lock is held for no flush, so a beat never
                waits behind one, §12). "none": nothing, the writes are left to the page
                cache (a runner's beat: a SIGKILL loses nothing, a power loss may lose it).
        Raises:
            RegistryError: as `lock`, or an fsync failed (the writes are then visible, not durable).
        """
        if flush not in FLUSHES:
            raise ValueError(f"flush must be one of {', '.join(FLUSHES)}, not {flush!r}")
        files: set[Path] = set()
        staged: dict[Path, tuple[str, bool]] = {}
        with self.lock():
            if self._group is not None:
                yield
                return
            self._group, self._group_thread = files, threading.get_ident()
            self._staged = staged if flush == "locked" else None
            try:
                yield
            finally:
                self._group = self._staged = None
                self._group_records.clear()
                if (files or staged) and flush == "locked":
                    commit_staged(files, staged, what=f"registry {self.root}")
        if files and flush == "after":
            sync_paths(files, what=f"registry {self.root}")

    def sweep_temps(self) -> int:
        """Remove the temp files a killed writer left: records' in `jobs/` (`RECORD_TEMP_RE`)
        and views' in each job's logs folder (`VIEW_TEMP_RE`). They are looked for without
        the lock and removed under it: every writer of a record or a view holds it while its
        temp file exists (§8), so one still there then is a stopped writer's. A service
        killed inside a pass leaves that pass's (docs/registry.md "Durability"). Other files
        there (the hub's copy of a job's output, its own temp files) are not the lock's.

        Returns:
            how many were removed (0 when there is no registry yet).
        Raises:
            RegistryError: as `lock`, or `jobs/` cannot be listed.
        """
        jobs, logs = names.jobs_dir(self.root), names.logs_dir(self.root)
        if not jobs.is_dir():
            return 0
        try:
            found = [jobs / name for name in os.listdir(jobs) if RECORD_TEMP_RE.match(name)]
        except OSError as exc:
            raise RegistryError(f"cannot list {jobs} ({errno_name(exc)}: {exc.strerror or exc})") from exc
        for job_dir in _listed(logs):
            if names.JOB_ID_RE.match(job_dir):  # a job's logs folder is named by its id
                found += [logs / job_dir / name for name in _listed(logs / job_dir) if VIEW_TEMP_RE.match(name)]
        if not found:
            return 0
        removed = 0
        with self.lock():
            for path in found:
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    continue
                except OSError as exc:  # a folder so named, a file we may not remove: said, left
                    log.warning("cannot remove %s (%s: %s)", path, errno_name(exc), exc.strerror or exc)
                    continue
                removed += 1
        return removed

    def deferred(self, path: Path) -> bool:
        """True (and `path` noted) inside this thread's `group()`: the caller skips its fsync."""
        if not self._in_group():
            return False
        assert self._group is not None
        self._group.add(path)
        return True

    def _in_group(self) -> bool:
        return self._group is not None and self._group_thread == threading.get_ident()

    def written_in_group(self, path: Path) -> bytes | None:
        """The bytes this thread's `group()` wrote to `path`, None outside a group or when it wrote none."""
        return self._group_records.get(path) if self._in_group() else None

    def note_written(self, path: Path, data: bytes) -> None:
        """`data` is now at `path` (written inside this thread's `group()`: read back from memory)."""
        if self._in_group():
            self._group_records[path] = data

    def put(self, path: Path, data: bytes, *, what: str, durable: bool = True) -> None:
        """Write `data` over `path` whole (`fsio.atomic_write`), within this thread's group
        as it says: a "locked" group stages it and puts it in place at its end, after its
        bytes are on disk; another group writes it now and fsyncs it at its end.

        Raises:
            RegistryError: the write failed; `path` is unchanged.
        """
        if not self._in_group():
            atomic_write(path, data, what=what, durable=durable)
            return
        if self._staged is None:
            atomic_write(path, data, what=what, durable=False)
            if durable:
                assert self._group is not None
                self._group.add(path)
            return
        tmp = stage_write(path, data, what=what)
        before = self._staged.get(path)
        if before is not None:  # written again in this group: only the newest goes in place
            with contextlib.suppress(OSError):
                os.unlink(before[0])
        self._staged[path] = (tmp, durable or (before is not None and before[1]))

    def _write_side(self, job_id: str, name: str, obj: dict[str, Any]) -> None:
        # meta/status are views of the record; the record is the truth, so a failure here only warns
        try:
            self.put(self.logs_dir(job_id) / name, dumps(obj), what=f"job {job_id}", durable=False)
        except RegistryError as exc:
            log.warning("%s", exc)


def _listed(folder: Path) -> list[str]:
    """`folder`'s entry names, or none when it cannot be listed (absent, not a folder, a job's
    logs removed meanwhile)."""
    try:
        return os.listdir(folder)
    except OSError:
        return []
