"""EmbeddedService.ensure (PROTOCOL §14 "One hub process") when another process held the hub
lock at the instant this one tried, and let go of it before it could be seen serving (its own
job ended): this process looks again and starts the engine, instead of exit 64 (a CI flake of
tests/e2e/test_queue.py with 30 dispatch processes)."""

from __future__ import annotations

import threading

import pytest

from mam.orchestrator import service as service_mod
from mam.orchestrator.hublock import ServiceRunning

pytestmark = pytest.mark.timeout(60)


class FakeHub:
    class registry:  # noqa: N801 - the attribute the engine reads
        root = "/nonexistent-hub-root"


def test_a_lock_let_go_meanwhile_is_taken_on_the_next_look(monkeypatch):
    tries: list[int] = []
    stop = threading.Event()

    class Engine:
        def __init__(self, hub, quiet):
            self.ready = threading.Event()

        def run(self):
            tries.append(1)
            if len(tries) == 1:
                raise ServiceRunning("a hub service already runs for x (pid unknown, lock y)")
            self.ready.set()
            stop.wait(30)

    monkeypatch.setattr(service_mod, "HubService", Engine)
    monkeypatch.setattr(service_mod, "service_pid", lambda root: None)  # the holder let go at once
    embedded = service_mod.EmbeddedService(FakeHub())  # type: ignore[arg-type]
    try:
        assert embedded.ensure() is True and len(tries) == 2
    finally:
        stop.set()


def test_a_lock_still_held_means_another_engine_serves(monkeypatch):
    class Engine:
        def __init__(self, hub, quiet):
            self.ready = threading.Event()

        def run(self):
            raise ServiceRunning("a hub service already runs")

    held = iter([None, 4242])
    monkeypatch.setattr(service_mod, "HubService", Engine)
    monkeypatch.setattr(service_mod, "service_pid", lambda root: next(held))
    assert service_mod.EmbeddedService(FakeHub()).ensure() is False  # type: ignore[arg-type]
