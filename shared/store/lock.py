"""The registry lock of PROTOCOL §8 and §12: an exclusive `fcntl.flock` on one
file, re-entrant within one thread of one process. Not safe on NFS
(docs/registry.md)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
from collections.abc import Iterator
from pathlib import Path

from mam.shared.protocol.errors import RegistryError
from mam.shared.store.fsio import errno_name

LOCK_FILE_MODE = 0o600


class FileLock:
    """An exclusive lock on `path` (created 0600 on first use). No side effects
    in the constructor; the folder must exist when `hold()` is entered."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._local = threading.local()

    @property
    def held(self) -> bool:
        """True when this thread of this process holds the lock."""
        return bool(getattr(self._local, "depth", 0)) and getattr(self._local, "pid", None) == os.getpid()

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """Hold the lock. Re-entrant within one thread of one process; blocks
        until the lock is free; the kernel drops it when the holder dies.

        Raises:
            RegistryError: the lock file cannot be opened or locked.
        """
        local = self._local
        if self.held:
            local.depth += 1
            try:
                yield
            finally:
                local.depth -= 1
            return
        path = self.path
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, LOCK_FILE_MODE)
        except OSError as exc:
            raise RegistryError(f"cannot open the registry lock {path} "
                                f"({errno_name(exc)}: {exc.strerror or exc})") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as exc:
            os.close(fd)
            raise RegistryError(f"cannot lock {path} ({errno_name(exc)}: {exc.strerror or exc})") from exc
        local.depth, local.pid = 1, os.getpid()
        try:
            yield
        finally:
            local.depth = 0
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
