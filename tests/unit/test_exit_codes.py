"""§9 exit codes: one mapping from a terminal hub record to the exit code, the same for
`mam-orch watch` (`Watcher.run`), `mam-orch dispatch` (the follower of the hub engine)
and `mam.Hub` (`Outcome.exit_code`), for every terminal status and close reason."""

from __future__ import annotations

import io

import pytest
from harness.fake_mqtt import FakeBroker

from mam.orchestrator import watch
from mam.orchestrator.api import outcome_of
from mam.orchestrator.follow import Follower
from mam.orchestrator.watch import Watcher, WatchOptions
from mam.shared.protocol.codes import JobStatus
from mam.shared.protocol.errors import ExitCode
from mam.shared.store.records import exit_code_of, moved
from mam.shared.store.registry import Registry

pytestmark = pytest.mark.timeout(60)

TABLE = [  # (status, close_reason) -> exit code (docs/protocol.md §9)
    (JobStatus.COMPLETED, None, ExitCode.COMPLETED),
    (JobStatus.ERROR, None, ExitCode.ERROR),  # the runner's own error
    (JobStatus.ERROR, "agent_blocked", ExitCode.ERROR),
    (JobStatus.ERROR, "deadline_timeout", ExitCode.TIMEOUT),
    (JobStatus.ERROR, "runner_lost", ExitCode.TIMEOUT),
    (JobStatus.ERROR, "queue_timeout", ExitCode.TIMEOUT),
    (JobStatus.CANCELLED, "cancelled", ExitCode.CANCELLED),
]


def ended(reg: Registry, status: str, close_reason: str | None) -> str:
    job_id = reg.register(session="gpu-box")["job_id"]
    with reg.transaction(job_id) as txn:
        txn.update(moved(txn.record, status, close_reason=close_reason), source="operator", reason="test")
    return job_id


@pytest.mark.parametrize(("status", "close_reason", "code"), TABLE)
def test_s9_watch_dispatch_and_the_api_exit_alike(tmp_path, monkeypatch, status, close_reason, code):
    monkeypatch.setattr(watch, "LATE_READ_S", 0.05)  # the re-attached watch's read of retained messages
    reg = Registry(tmp_path)
    job_id = ended(reg, status, close_reason)
    record = reg.get(job_id)
    client = FakeBroker().client()
    client.connect()
    watched = Watcher(reg, job_id, client=client, out=io.StringIO(), options=WatchOptions(remote=True)).run()
    followed = Follower(reg, job_id, out=io.StringIO()).follow()
    api = outcome_of(record, reg.audit(job_id)).exit_code
    assert (exit_code_of(record), watched, followed, api) == (code, code, code, code)
