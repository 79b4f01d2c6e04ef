"""Telling a reader of one job's files that they changed (docs/registry.md "Followers").

`JobChanges` holds an inotify watch on the job's logs folder (its audit log and the
hub's copies of its output, appended in place) and on the records folder (its record,
which `atomic_write` replaces by a rename), so that `job.wait()`, `job.events()`,
`dispatch`'s follow and `logs --follow` wake when something was written instead of
polling. A follower still looks every `safety_s` for what no watch shows (a service
that died). Where inotify cannot be used (not Linux, the watch limit reached), `wait`
sleeps the poll interval instead, as before.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from pathlib import Path
from types import TracebackType

from inotify_simple import INotify, flags

from mam.shared.protocol import names

log = logging.getLogger("mam.registry")

SAFETY_S = 1.0
"""Told of writes, a follower still looks this often, seconds (what no watch shows: a service gone)."""
RECORD_FLAGS = flags.MOVED_TO | flags.CLOSE_WRITE
LOGS_FLAGS = flags.MODIFY | flags.CREATE | flags.MOVED_TO
COALESCE_MS = 20
"""After the first event, how long `JobsWatch.changed` lets more gather before reading, ms."""


_closing: queue.SimpleQueue[INotify] | None = None
_closing_lock = threading.Lock()


def _close_later(inotify: INotify) -> None:
    """Close `inotify` on the process's one closer thread (started on first use).

    Closing an inotify instance waits for the kernel's SRCU grace period (about 8 ms on an
    idle machine), which the follower's caller, `job.wait()` returning, need not pay.
    Its watches go with it; until then the kernel may queue events nobody reads."""
    global _closing
    with _closing_lock:
        if _closing is None:
            _closing = queue.SimpleQueue()
            threading.Thread(target=_closer, args=(_closing,), name="inotify-closer", daemon=True).start()
        _closing.put(inotify)


def _closer(instances: queue.SimpleQueue[INotify]) -> None:
    while True:
        inotify = instances.get()
        try:
            inotify.close()
        except OSError as exc:  # a closer thread never dies: the next instance is still closed
            log.debug("an inotify instance did not close: %s", exc)


def _forget_closer() -> None:
    global _closing, _closing_lock
    _closing = None  # a forked child has no closer thread: its first close starts one
    _closing_lock = threading.Lock()  # another thread may have held it at the fork


os.register_at_fork(after_in_child=_forget_closer)


class JobChanges:
    """Wakes on writes to one job's record or logs (see the module docstring).

    Args:
        root: the registry's root; job_id: the job.
        poll_s: without inotify, or while the job's logs folder does not exist yet, how
            long one `wait` sleeps at most, seconds.
    """

    def __init__(self, root: Path, job_id: str, poll_s: float) -> None:
        self.poll_s = poll_s
        self._record = f"{names.validate_job_id(job_id)}.json"
        self._logs = names.job_logs_dir(root, job_id)
        self._logs_wd: int | None = None
        self._inotify: INotify | None = None
        try:
            self._inotify = INotify()
            self._records_wd = self._inotify.add_watch(names.jobs_dir(root), RECORD_FLAGS)
        except OSError as exc:
            log.debug("job %s: its files are polled every %g s (no inotify watch: %s)", job_id, poll_s, exc)
            self.close()
        self._watch_logs()

    @property
    def told(self) -> bool:
        """True while both folders are watched: `wait` returns on a write, not on a clock."""
        return self._inotify is not None and self._logs_wd is not None

    def wait(self, timeout_s: float) -> None:
        """Return once the job's record or logs changed, or after `timeout_s` seconds (at most
        `poll_s` while not `told`). A change made before the call is seen by the caller's read
        after the previous `wait`, so nothing is missed between the two."""
        deadline = time.monotonic() + timeout_s
        self._watch_logs()
        while (left := deadline - time.monotonic()) > 0:
            if self._inotify is None:
                time.sleep(min(left, self.poll_s))
                return
            limit = left if self._logs_wd is not None else min(left, self.poll_s)
            events = self._inotify.read(timeout=max(1, int(limit * 1000)))
            if not events and self._logs_wd is None:
                return  # the logs folder may exist now: the caller reads, and waits again
            if any(event.wd != self._records_wd or event.name == self._record for event in events):
                return

    def _watch_logs(self) -> None:
        if self._inotify is None or self._logs_wd is not None:
            return
        try:
            self._logs_wd = self._inotify.add_watch(self._logs, LOGS_FLAGS)
        except FileNotFoundError:
            pass  # not made yet: polled until it is
        except OSError as exc:
            log.debug("job %s: its logs are polled (no inotify watch: %s)", self._logs.name, exc)
            self.close()

    def close(self) -> None:
        """Drop the watches (idempotent); the instance is closed off the caller's thread
        (`_close_later`)."""
        if self._inotify is not None:
            inotify, self._inotify = self._inotify, None
            _close_later(inotify)

    def __enter__(self) -> JobChanges:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close()


class JobsWatch:
    """Which jobs' records or logs changed, for one reader of many jobs (the dashboard's live
    feed): an inotify watch on `.mam/jobs/` (a record's rename names its job), on `.mam/logs/`
    (a new job's folder) and on the logs folder of each job the reader `follow`s.

    `changed` returns the job ids written since the last call, or None when the reader must
    look at every job: inotify is unavailable, its queue overflowed, or a job's folder could
    not be watched (the per-user limit).

    Args:
        root: the registry's root.
        logs: watch the logs folders too (False: records only, the hub engine's scan).
    """

    def __init__(self, root: Path, *, logs: bool = True) -> None:
        self._root, self._logs_root = root, names.logs_dir(root)
        self._folders: dict[int, str] = {}  # watch descriptor → the job whose logs folder it is
        self._watched: dict[str, int] = {}
        self._missed = False  # a change may have gone unseen: the next `changed` says look at all
        self._inotify: INotify | None = None
        try:
            self._inotify = INotify()
            for folder in (names.jobs_dir(root), self._logs_root):  # a new hub has neither yet
                folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            self._records_wd = self._inotify.add_watch(names.jobs_dir(root), RECORD_FLAGS)
            self._logs_root_wd = self._inotify.add_watch(self._logs_root, flags.CREATE) if logs else -1
        except OSError as exc:
            log.debug("the live feed looks at every job (no inotify watch: %s)", exc)
            self.close()

    def follow(self, job_id: str) -> None:
        """Watch `job_id`'s logs folder too (its audit log and output); idempotent."""
        if self._inotify is None or job_id in self._watched:
            return
        try:
            wd = self._inotify.add_watch(names.job_logs_dir(self._root, job_id), LOGS_FLAGS)
        except FileNotFoundError:
            return  # made later: its CREATE names it
        except OSError as exc:
            log.debug("job %s: its logs are not watched (%s)", job_id, exc)
            self._missed = True
            return
        self._folders[wd] = job_id
        self._watched[job_id] = wd

    def unfollow(self, job_id: str) -> None:
        """Stop watching `job_id`'s logs folder (an ended job); its record stays watched."""
        wd = self._watched.pop(job_id, None)
        if wd is not None and self._inotify is not None:
            self._folders.pop(wd, None)
            try:
                self._inotify.rm_watch(wd)
            except OSError:
                pass  # the folder is gone: the kernel dropped the watch

    def changed(self, timeout_s: float) -> set[str] | None:
        """The jobs written since the last call, waiting up to `timeout_s` seconds for the
        first; None: look at every job (see the class docstring)."""
        if self._inotify is None:
            time.sleep(timeout_s)
            return None
        out: set[str] = set()
        for event in self._inotify.read(timeout=max(0, int(timeout_s * 1000)), read_delay=COALESCE_MS):
            if event.mask & flags.Q_OVERFLOW:
                self._missed = True
            elif event.wd == self._records_wd:
                job_id = event.name.removesuffix(".json")
                if event.name.endswith(".json") and names.JOB_ID_RE.fullmatch(job_id):  # not a temp file
                    out.add(job_id)
            elif event.wd == self._logs_root_wd:
                if names.JOB_ID_RE.fullmatch(event.name):
                    out.add(event.name)  # a new job's folder: the reader follows it
            elif (job_id := self._folders.get(event.wd)) is not None:
                out.add(job_id)
        if self._missed:
            self._missed = False
            return None
        return out

    def close(self) -> None:
        """Drop the watches (idempotent)."""
        if self._inotify is not None:
            self._inotify.close()
            self._inotify = None

    def __enter__(self) -> JobsWatch:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close()


__all__ = ["SAFETY_S", "JobChanges", "JobsWatch"]
