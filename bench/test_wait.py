"""Submit → done through the Python API (`mam.Hub.dispatch`, then `job.wait()`), on
loopback with a real nats-server, a real runner daemon, `mam-orch serve` and a trivial
agent (`make bench`; never in CI's `make test`).

Two phases in one run, interleaved job by job: the follower told of the job's writes
(inotify, `shared/store/changes.py`) and the same follower polling every 0.1 s as it
did before. The difference is the time `job.wait()` spent not knowing the job had ended.
Prints p50 and p99 of each and the load; the asserts only guard that the runs happened.
"""

from __future__ import annotations

import time

import pytest
from benchkit import load_note, percentile
from harness.fleet import AGENTS as EXAMPLE_AGENTS
from harness.fleet import Fleet

from mam.orchestrator.api import Hub
from mam.shared.store import changes

ROUNDS = 30  # per phase


@pytest.fixture
def fleet(tmp_path):
    handle = Fleet("loopback", tmp_path)
    yield handle
    handle.close()


def one_job(hub: Hub) -> float:
    started = time.monotonic()
    job = hub.dispatch("0", session="gpu-box")
    outcome = job.wait(timeout_s=60)
    assert outcome.status == "completed", outcome
    return time.monotonic() - started


def test_submit_to_done_told_vs_polled(fleet, monkeypatch):
    fleet.start_runner("gpu-box", EXAMPLE_AGENTS / "exit-agent", "--max-jobs", "4")
    fleet.serve()
    told: list[float] = []
    polled: list[float] = []
    inotify = changes.INotify

    def refused() -> None:
        raise OSError("inotify off for the polled phase")

    with Hub(fleet.hub_ws, embedded=False) as hub:
        one_job(hub)  # warm: imports, the first connection
        for _ in range(ROUNDS):
            monkeypatch.setattr(changes, "INotify", inotify)
            told.append(one_job(hub))
            monkeypatch.setattr(changes, "INotify", refused)
            polled.append(one_job(hub))
    for name, figures in (("told (inotify)", told), ("polled (0.1 s)", polled)):
        print(f"\nsubmit -> done via mam.Hub, {name}: p50 {percentile(figures, 50) * 1000:.1f} ms, "
              f"p99 {percentile(figures, 99) * 1000:.1f} ms; {ROUNDS} jobs; {load_note()}")
    assert len(told) == len(polled) == ROUNDS
