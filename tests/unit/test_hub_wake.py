"""PROTOCOL §14 "One hub process": a job queued by another process wakes the engine at once.
The datagram socket `.mam/run/hub.wake` (0600), its reader and sender, a path too long for
AF_UNIX, a sender with nobody listening, hostile datagrams; the engine folds wakes into one
inbox item; a bad MAM_HUB_SCAN_S is one line."""

from __future__ import annotations

import socket
import threading

import pytest
from harness.hubclient import RecordingClient
from harness.waiting import wait_until
from harness.workspace import TEST_SECRET

from mam.orchestrator import wake
from mam.orchestrator.hub import open_hub
from mam.orchestrator.service import WAKE, HubService
from mam.shared.config import write_env_file
from mam.shared.protocol.errors import ConfigError
from mam.shared.store.fsio import MAX_SUN_PATH_BYTES

pytestmark = pytest.mark.timeout(30)


def listening(root) -> tuple[wake.Waker, list[int]]:
    woken: list[int] = []
    lock = threading.Lock()

    def on_wake() -> None:
        with lock:
            woken.append(1)

    waker = wake.Waker(root, on_wake)
    assert waker.start()
    return waker, woken


def test_s14_a_wake_reaches_the_engine_and_the_socket_is_private_and_removed(tmp_path):
    waker, woken = listening(tmp_path)
    try:
        assert wake.wake_path(tmp_path).stat().st_mode & 0o777 == 0o600
        wake.wake_engine(tmp_path)
        wait_until(lambda: woken, 5.0, "the wake")
    finally:
        waker.stop()
    assert not wake.wake_path(tmp_path).exists()
    wake.wake_engine(tmp_path)  # nobody listens any more: nothing happens, nothing raised


def test_s14_a_workspace_deeper_than_af_unix_allows_still_wakes(tmp_path):
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    assert len(str(wake.wake_path(deep))) > MAX_SUN_PATH_BYTES
    waker, woken = listening(deep)
    try:
        wake.wake_engine(deep)
        wait_until(lambda: woken, 5.0, "the wake")
    finally:
        waker.stop()


def test_s14_a_stale_socket_file_of_a_crashed_engine_is_replaced(tmp_path):
    path = wake.wake_path(tmp_path)
    path.parent.mkdir(parents=True)
    path.write_bytes(b"left by a kill -9")
    waker, woken = listening(tmp_path)
    try:
        wake.wake_engine(tmp_path)
        wait_until(lambda: woken, 5.0, "the wake")
    finally:
        waker.stop()


def test_s14_hostile_datagrams_only_wake(tmp_path):
    waker, woken = listening(tmp_path)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            for payload in (b"\xff" * 60_000, b'{"job_id": "../../etc"}', b"\x00"):
                sock.sendto(payload, str(wake.wake_path(tmp_path)))
        wait_until(lambda: len(woken) == 3, 5.0, "three wakes")
    finally:
        waker.stop()


def test_s14_wakes_fold_into_one_inbox_item_and_a_bad_scan_interval_is_one_line(tmp_path, monkeypatch):
    write_env_file(tmp_path / ".mam.env", {"MAM_DISPATCH_SECRET": TEST_SECRET}, overwrite=True)
    service = HubService(open_hub(tmp_path))
    client = service.client = RecordingClient()  # type: ignore[assignment]
    for _ in range(5):
        service.wake()
    assert client.messages.qsize() == 1 and client.messages.get_nowait() is WAKE
    monkeypatch.setenv("MAM_HUB_SCAN_S", "0")
    with pytest.raises(ConfigError, match="MAM_HUB_SCAN_S=0.0 is out of range"):
        HubService(open_hub(tmp_path))
