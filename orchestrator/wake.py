"""Waking the hub engine (PROTOCOL §14 "One hub process"): a job queued by another process
(`dispatch`, `POST /api/jobs`, `mam.Hub`) is seen at once, not at the engine's next registry
scan (every `SCAN_S`, which stays as the safety net).

The engine holding the hub lock listens on a unix datagram socket, `.mam/run/hub.wake`
(0600 in the 0700 run folder); `wake_engine` sends it an empty datagram and never waits or
fails: with no engine listening (none runs, or an older one) nothing happens and the scan
finds the job. A datagram carries nothing: it only says "look now", so a stranger who could
write to the socket could only make the engine scan early.

    waker = Waker(root, on_wake=lambda: inbox.put(WAKE)); waker.start() ... waker.stop()
    wake_engine(root)   # after registering a queued job
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
from collections.abc import Callable
from pathlib import Path

from mam.shared.protocol import names
from mam.shared.store.fsio import unix_address

log = logging.getLogger("mam.serve")

WAKE_NAME = "hub.wake"
RUN_DIR_MODE = 0o700
MAX_DATAGRAM_BYTES = 64
"""A wake carries nothing; a bigger datagram is read and dropped all the same."""
STOP_LOOK_S = 0.5
"""How often the waker's thread looks whether it was stopped (s)."""

__all__ = ["Waker", "wake_engine", "wake_path"]


def wake_path(root: Path) -> Path:
    """`<root>/.mam/run/hub.wake`."""
    return names.run_dir(root) / WAKE_NAME


def wake_engine(root: Path) -> None:
    """Tell the engine serving `root`'s registry to look now. Never raises, never blocks."""
    try:
        address, fd = unix_address(wake_path(root))
    except OSError:
        return  # no run folder: no engine ever listened here
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.setblocking(False)
            sock.sendto(b"", address)
    except OSError:  # nobody listens (ENOENT, ECONNREFUSED), or its queue is full (EAGAIN): the scan finds it
        pass
    finally:
        if fd is not None:
            os.close(fd)


class Waker:
    """The engine's end: a thread reading `.mam/run/hub.wake`, calling `on_wake` per datagram.

    Only the holder of the hub lock runs one (so removing a stale socket file is safe).

    Args:
        root: the registry root; on_wake: called in the waker's thread (make it cheap).
    """

    def __init__(self, root: Path, on_wake: Callable[[], None]) -> None:
        self.root = root
        self.path = wake_path(root)
        self.on_wake = on_wake
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()

    def start(self) -> bool:
        """Listen; False (logged) when the socket cannot be made: the scan alone then finds jobs."""
        try:
            self.path.parent.mkdir(mode=RUN_DIR_MODE, parents=True, exist_ok=True)
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()  # a crashed engine's: the lock says none listens on it
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            address, fd = unix_address(self.path)
            try:
                old = os.umask(0o177)
                try:
                    sock.bind(address)
                finally:
                    os.umask(old)
            finally:
                if fd is not None:
                    os.close(fd)
        except OSError as exc:
            log.warning("hub wake socket %s not made (%s): queued jobs are found by the registry scan",
                        self.path, exc.strerror or exc)
            return False
        sock.settimeout(STOP_LOOK_S)
        self._sock = sock
        self._thread = threading.Thread(target=self._run, name="mam-hub-wake", daemon=True)
        self._thread.start()
        return True

    def _run(self) -> None:
        sock = self._sock
        assert sock is not None
        while not self._stopping.is_set():
            try:
                sock.recv(MAX_DATAGRAM_BYTES)
            except TimeoutError:
                continue
            except OSError:
                return  # closed by `stop`
            if not self._stopping.is_set():
                self.on_wake()

    def stop(self) -> None:
        """Stop listening and remove the socket file."""
        self._stopping.set()
        if self._thread is not None:
            wake_engine(self.root)  # its recv returns now, not at its next look
            self._thread.join(2 * STOP_LOOK_S)
        if self._sock is not None:
            self._sock.close()
            with contextlib.suppress(OSError):
                self.path.unlink()
