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
        """Drop the watches (idempotent)."""
        if self._inotify is not None:
            self._inotify.close()
            self._inotify = None

    def __enter__(self) -> JobChanges:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close()


__all__ = ["SAFETY_S", "JobChanges"]
