"""Events over a real broker: publisher, retained state, watcher (PROTOCOL §3, §4, §9, §10)."""

from __future__ import annotations

import pytest
from harness.jobkit import JobPair
from harness.waiting import wait_until

from mam.runner import publish
from mam.shared.protocol import crypto, names, wire
from mam.shared.transport import mqtt
from mam.shared.transport.mqtt import MqttClient

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


def _inject(broker, topic: str, payload: bytes) -> None:
    with MqttClient(broker.config(), "inject") as client:
        client.connect()
        client.publish(topic, payload)


def test_s3_2_refusals_while_job_completes(broker, pair):
    """§3.2: forged HMAC, stale attempt, wrong schema, non-JSON, 2 MB: each refused; the job completes."""

    watcher = pair.watch()
    pair.wait_subscribed(watcher)
    assert pair.publish("started").returncode == 0
    record = pair.record
    topic = names.events_topic(pair.job_id, broker.topic_root)

    def event(seq: int, **changes) -> dict:
        return wire.Event.build(pair.job_id, seq, "progress", "x", attempt_id=changes.get("attempt_id", 1),
                                dispatch_token=changes.get("token", record["dispatch_token"])).to_dict()

    forged = crypto.sign_event(event(5), "not-the-auth-token-" + "x" * 30)
    stale = crypto.sign_event(event(6, attempt_id=2), record["auth_token"])
    schema = dict(crypto.sign_event(event(7), record["auth_token"]), schema_version=2)
    _inject(broker, topic, wire.canonical(forged))
    _inject(broker, topic, wire.canonical(stale))
    _inject(broker, topic, wire.canonical(schema))
    _inject(broker, topic, b"{not json")
    big_refused_by_broker = False
    try:
        _inject(broker, topic, b"{" + b" " * (2 * 1024 * 1024) + b"}")
    except Exception:  # noqa: BLE001 - nats-server caps payloads at 1 MiB and drops the client
        big_refused_by_broker = broker.name == "nats"
    assert pair.publish("completed").returncode == 0
    assert watcher.wait() == 0, watcher.log()
    log = watcher.log()
    for reason in ("HMAC verify failed", "stale_attempt", "schema_mismatch", "malformed"):
        assert f"refused message: {reason}" in log, reason
    if not big_refused_by_broker:
        assert "larger than" in log or log.count("refused message: malformed") >= 2
    assert [e["event"] for e in watcher.events()] == ["started", "completed"]
    assert pair.record["status"] == "completed"


def test_s10_idle_timeout_exits_2_and_closes_record(pair):
    watcher = pair.watch("--idle-timeout", "1")
    pair.wait_subscribed(watcher)
    assert pair.publish("started").returncode == 0
    assert watcher.wait() == 2, watcher.log()
    record = pair.record
    assert record["status"] == "error" and record["close_reason"] == "deadline_timeout"
    late = pair.publish("completed")
    assert late.returncode == 0  # the runner does not know yet; the hub refuses it
    assert pair.record["status"] == "error"


def test_s10_ack_timeout_without_started_is_agent_blocked(pair):
    watcher = pair.watch("--ack-timeout", "1", "--idle-timeout", "1")
    assert watcher.wait() == 1, watcher.log()
    record = pair.record
    assert record["status"] == "error" and record["close_reason"] == "agent_blocked"


def test_s10_broker_killed_mid_job_watcher_reconnects(broker, pair):
    watcher = pair.watch("--idle-timeout", "30")
    pair.wait_subscribed(watcher)
    assert pair.publish("started").returncode == 0

    wait_until(lambda: watcher.events("started"), what="started to reach the watcher")
    broker.kill()
    broker.restart()
    wait_until(lambda: "reconnected" in watcher.log(), what="the watcher to reconnect")
    assert pair.publish("completed").returncode == 0
    assert watcher.wait() == 0, watcher.log()
    assert pair.record["status"] == "completed"


def test_s10_broker_down_from_start(broker, pair):
    broker.stop()
    first = pair.watch()
    assert first.wait() == 3, first.log()
    assert pair.record["status"] == "pending"
    offline = pair.publish("started", "--attempts", "1")
    assert offline.returncode == 2, offline.stderr
    assert any(line.get("event") == "started" for line in pair.runner.audit(pair.job_id))
    broker.restart()
    watcher = pair.watch()
    pair.wait_subscribed(watcher)
    assert pair.publish("progress").returncode == 0
    assert pair.publish("completed").returncode == 0
    assert watcher.wait() == 0, watcher.log()
    seqs = [e["seq"] for e in watcher.events()]
    assert seqs == sorted(set(seqs)) == [2, 3]
    assert "refused message: duplicate" not in watcher.log()
    assert any(line.get("event") == "seq_gap" for line in pair.hub.audit(pair.job_id))


@pytest.mark.parametrize("send_event", [True, False], ids=["event-after-state", "state-only"])
def test_s4_terminal_state_before_its_event(broker, pair, send_event):
    """§4: brokers do not order messages across topics. A terminal state that
    overtakes its event waits briefly for it (so the event and its exit code are
    shown and mirrored); a state whose event never comes still resolves the job."""

    watcher = pair.watch()
    pair.wait_subscribed(watcher)
    assert pair.publish("started").returncode == 0
    done = publish.record(pair.runner, publish.PublishRequest(pair.job_id, "error", "tests failed"),
                          source="runner", exit_code=5)
    (event_topic, event, _), (state_topic, state, _) = done.messages(broker.topic_root)
    with mqtt.MqttClient(broker.config(), "reorder") as client:
        client.connect()
        client.publish(state_topic, state, retain=True)
        if send_event:
            client.publish(event_topic, event, retain=True)
    assert watcher.wait() == 1, watcher.log()
    record = pair.record
    assert record["status"] == "error"
    if send_event:
        assert [e["event"] for e in watcher.events()] == ["started", "error"]
        assert record["exit_code"] == 5
    else:
        assert [e["event"] for e in watcher.events()] == ["started"]
        assert "resolved from the retained state" in watcher.log()
