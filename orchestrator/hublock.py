"""The hub service's lock (PROTOCOL §14 "One hub process"): an exclusive
`fcntl.flock` on `.mam/hub.lock`, holding the service's pid. `mam-orch serve`
takes it for its whole life (the kernel drops it when the process dies, even
by SIGKILL); every other command asks `service_pid(root)` whether a service
runs, to follow a job through it instead of opening a broker connection.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from mam.shared.protocol import names
from mam.shared.protocol.errors import RegistryError, UsageError
from mam.shared.store.fsio import errno_name

LOCK_FILE_MODE = 0o600
PID_MAX_BYTES = 32  # a pid and a newline


def _read_pid(fd: int) -> int | None:
    os.lseek(fd, 0, os.SEEK_SET)
    text = os.read(fd, PID_MAX_BYTES).decode("ascii", "replace").strip()
    return int(text) if text.isdigit() else None


def _open(root: Path) -> int:
    path = names.hub_lock_path(root)
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, LOCK_FILE_MODE)
    except OSError as exc:
        raise RegistryError(f"cannot open the hub lock {path} ({errno_name(exc)}: {exc.strerror or exc})") from exc


class ServiceRunning(UsageError):
    """Another process holds the registry's hub lock (exit 64 for `serve`)."""


class HubLock:
    """`.mam/hub.lock` of one registry root, held by the one service (§14)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.path = names.hub_lock_path(self.root)
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock and write this process's pid into it.

        Raises:
            ServiceRunning: another service holds it (exit 64), naming its pid.
            RegistryError: the lock file cannot be opened.
        """
        fd = _open(self.root)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = _read_pid(fd)
            os.close(fd)
            raise ServiceRunning(f"a hub service already runs for {self.root} (pid {pid if pid else 'unknown'}, "
                             f"lock {self.path}); stop it first or use another --workspace") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode("ascii"), 0)
        self._fd = fd

    def release(self) -> None:
        """Empty the pid and drop the lock (idempotent)."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            os.ftruncate(fd, 0)
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)


def service_pid(root: Path) -> int | None:
    """The pid of the live service of `root` (its lock is held), else None.

    Never creates anything: no `.mam` folder means no service.
    """
    path = names.hub_lock_path(Path(root))
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return _read_pid(fd) or -1  # held: a service runs (its pid not yet written: -1)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)
