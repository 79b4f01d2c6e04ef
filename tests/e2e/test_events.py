"""Events over a real broker: publisher, retained state, watcher (PROTOCOL §3, §4, §9, §10)."""

from __future__ import annotations

import pytest

from jobkit import JobPair

pytestmark = pytest.mark.broker


@pytest.fixture
def pair(broker, tmp_path):
    job = JobPair(broker, tmp_path)
    yield job
    job.close()


def test_s3_s4_event_and_retained_state_delivered(pair):
    watcher = pair.watch()
    pair.wait_subscribed(watcher)
    assert pair.publish("started").returncode == 0
    assert pair.publish("progress", "--detail", "half way", "--data", '{"tests": 3}').returncode == 0
    done = pair.publish("completed", "--detail", "all good")
    assert done.returncode == 0, done.stderr
    assert watcher.wait() == 0, watcher.log()
    assert [e["event"] for e in watcher.events()] == ["started", "progress", "completed"]
    assert [e["seq"] for e in watcher.events()] == [1, 2, 3]
    assert watcher.events("progress")[0]["data"]["tests"] == 3
    hub = pair.record
    assert hub["status"] == "completed" and hub["last_seq"] == 3
    runner = pair.runner.get(pair.job_id)
    assert runner["status"] == "completed" and runner["last_seq"] == 3


def test_s4_late_watcher_resolves_from_retained_state(pair):
    for event in ("started", "completed"):
        assert pair.publish(event).returncode == 0
    watcher = pair.watch()
    assert watcher.wait() == 0, watcher.log()
    assert pair.record["status"] == "completed"
