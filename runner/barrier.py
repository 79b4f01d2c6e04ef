"""The §12 barrier between a job's heartbeats and its terminal event, and the
stop of its detached timer (started by `heartbeat.timer.start_timer`): a terminal
publish raises the barrier and stops the timer; every beat checks the barrier,
so no beat follows a terminal.

Files, all under `<root>/.mam/jobs/` (names from `mam.shared.protocol.names`):

- `<job>.heartbeat.barrier`: written by a terminal publish under the registry
  (seq) lock before it takes its own seq; a beat checks it under the same lock,
  so a beat either took its seq before the terminal or is refused. It names the
  attempt, so a later attempt's timer is not stopped by it.
- `<job>.heartbeat.pid`: the running timer (pid, create time, attempt), used to
  signal it; a pid whose create time changed is not our timer.
- `<job>.heartbeat.lock`: serialises start, replacement and stop (`flock`).
  The timer itself never takes it, so stopping never waits on an exiting timer.

The timer stops on: a terminal record or barrier, a newer attempt, the
job's `timeout_sec`, and within one period after the watched process is gone.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mam.shared.config import env_float
from mam.shared.protocol import names
from mam.shared.protocol.codes import TERMINAL_STATUSES
from mam.shared.protocol.errors import MamError, RegistryError
from mam.shared.store.fsio import atomic_write, read_json_object
from mam.shared.store.registry import Registry

if TYPE_CHECKING:  # psutil is loaded lazily below (publish fast path)
    import psutil

log = logging.getLogger("mam.heartbeat")

AGENT_CLI_NAMES = frozenset({"claude", "codex", "gemini", "aider", "opencode"})
DEFAULT_DRAIN_S = 1.0
HEARTBEAT_DETAIL = "heartbeat"
FILE_MAX_BYTES = 4096
"""Largest accepted pid or barrier file."""
DRAIN_HIGH_S = 60.0
"""Highest accepted MAM_HEARTBEAT_DRAIN_S."""
STOP_POLL_S = 0.01
"""How often a stopping timer is looked at."""
KILL_WAIT_S = 5.0
"""How long a SIGKILLed timer may take to go."""


@dataclass(frozen=True)
class WatchedProcess:
    """A process identified by pid and create time (so pid reuse reads as gone)."""

    pid: int
    create_time: float

    @classmethod
    def of(cls, pid: int) -> WatchedProcess:
        """Capture `pid` now.

        Raises:
            MamError: no such process.
        """
        import psutil  # lazy: psutil only where a process is looked at (publish fast path)

        try:
            return cls(pid, psutil.Process(pid).create_time())
        except (psutil.NoSuchProcess, ValueError):
            raise MamError(f"--watch-pid {pid}: no such process") from None

    def alive(self) -> bool:
        """True while the same process (same create time) runs and is not a zombie."""
        import psutil  # lazy: psutil only where a process is looked at (publish fast path)

        try:
            proc = psutil.Process(self.pid)
            return proc.create_time() == self.create_time and proc.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False


def _names_of(proc: psutil.Process) -> set[str]:
    found = set()
    with contextlib.suppress(Exception):
        found.add(proc.name())
    with contextlib.suppress(Exception):
        found.update(os.path.basename(part) for part in proc.cmdline()[:2])
    return found


def default_watch_pid() -> int:
    """The process a `publish --heartbeat` watches by default (§12): the nearest
    ancestor whose name (or argv[0]/argv[1], for node-based CLIs) is a known
    agent CLI, else the parent of the publishing command.
    """
    import psutil  # lazy: psutil only where a process is looked at (publish fast path)

    parent = os.getppid()
    with contextlib.suppress(psutil.Error):
        for proc in psutil.Process(os.getpid()).parents():
            if _names_of(proc) & AGENT_CLI_NAMES:
                return proc.pid
    return parent


# ------------------------------------------------------------------ files

def write_json_0600(path: Path, obj: dict[str, Any]) -> None:
    # not fsynced: barrier and pid file speak to live timers; a power loss leaves none
    atomic_write(path, json.dumps(obj, sort_keys=True).encode(), what=path.name, durable=False)


def read_json(path: Path) -> dict[str, Any] | None:
    """A timer file (pid, barrier) as an object; None when absent, unreadable or not an object."""
    try:
        return read_json_object(path, FILE_MAX_BYTES)
    except (OSError, ValueError):
        return None


def barrier_attempt(root: Path, job_id: str) -> int:
    """The attempt a barrier was raised for, or 0 when there is none."""
    data = read_json(names.heartbeat_path(root, job_id, "barrier"))
    value = data.get("attempt_id") if data else None
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def record_stop_reason(registry: Registry, job_id: str, attempt_id: int, dispatch_token: str) -> str | None:
    """Why the record says an attempt gets no more beats (§12): unreadable, replaced by a newer
    attempt, or terminal; None when it may beat on. Shared by the daemon's beats and the timer."""
    try:
        record = registry.get(job_id)
    except RegistryError as exc:
        return f"record unreadable ({exc})"
    if record["attempt_id"] != attempt_id or record["dispatch_token"] != dispatch_token:
        return f"attempt {record['attempt_id']} replaced attempt {attempt_id}"
    if record["status"] in TERMINAL_STATUSES:
        return f"job is {record['status']}"
    return None


@contextlib.contextmanager
def lifecycle_lock(root: Path, job_id: str) -> Iterator[None]:
    """Hold `<job>.heartbeat.lock` (§12): start, replace and stop are serialised."""
    path = names.heartbeat_path(root, job_id, "lock")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _timer_process(root: Path, job_id: str) -> tuple[WatchedProcess, dict[str, Any]] | None:
    info = read_json(names.heartbeat_path(root, job_id, "pid"))
    if not info:
        return None
    pid, created = info.get("pid"), info.get("create_time")
    if not isinstance(pid, int) or not isinstance(created, (int, float)):
        return None
    proc = WatchedProcess(pid, float(created))
    return (proc, info) if proc.alive() else None


def stop_timer_locked(root: Path, job_id: str, drain_s: float) -> bool:
    """Signal the recorded timer, wait up to `drain_s`, then SIGKILL it.
    Caller holds the lifecycle lock. Returns True if a live timer was stopped."""
    found = _timer_process(root, job_id)
    pid_path = names.heartbeat_path(root, job_id, "pid")
    if found is None:
        pid_path.unlink(missing_ok=True)
        return False
    proc, _ = found
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + drain_s
    while proc.alive() and time.monotonic() < deadline:
        time.sleep(STOP_POLL_S)
    if proc.alive():
        # a beat still on the wire is cancelled, never allowed to trail the terminal
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
        kill_deadline = time.monotonic() + KILL_WAIT_S
        while proc.alive() and time.monotonic() < kill_deadline:
            time.sleep(STOP_POLL_S)
    pid_path.unlink(missing_ok=True)
    return True


def drain_s_setting() -> float:
    """MAM_HEARTBEAT_DRAIN_S (default 1 s, §12)."""
    return env_float("MAM_HEARTBEAT_DRAIN_S", DEFAULT_DRAIN_S, low=0.0, high=DRAIN_HIGH_S)


def stop_for_terminal(registry: Registry, job_id: str, attempt_id: int, *, drain_s: float | None = None) -> None:
    """The first half of a terminal publish (§12): raise the attempt's barrier
    under the seq lock, then stop the timer (drain, then kill). The caller
    takes its own seq only after this returns.

    Args:
        registry: the host's `Registry`.
        job_id: the job; attempt_id: the attempt ending.
        drain_s: how long the timer may take to exit (default MAM_HEARTBEAT_DRAIN_S).
    Raises:
        RegistryError: the barrier could not be written (the timer is stopped all the same).
    """
    drain = drain_s_setting() if drain_s is None else drain_s
    root = registry.root
    refused: RegistryError | None = None
    with lifecycle_lock(root, job_id):
        with registry.lock():
            if barrier_attempt(root, job_id) < attempt_id:
                try:
                    write_json_0600(names.heartbeat_path(root, job_id, "barrier"),
                                     {"attempt_id": attempt_id, "raised_at": time.time()})
                except RegistryError as exc:  # a full disk: the timer is still stopped, then we say so
                    refused = exc
        stop_timer_locked(root, job_id, drain)
    if refused is not None:
        raise refused
