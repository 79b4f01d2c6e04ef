"""runner/outbox.py over the in-memory fake broker (PROTOCOL §17): entries on disk until
PUBACK, re-sent per job in seq order, states never older than the retained one, kept
terminal entries re-published after a reconnect, the caps, bad files, and the daemon's
re-send at start and after a reconnect. No broker process, no agent process."""

from __future__ import annotations

import json
import logging
import os
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from harness.fake_mqtt import FakeBroker, FakeClient
from harness.waiting import PATIENCE_S, QUIET_S, wait_until

from mam.runner import outbox, publish
from mam.runner.outbox import Outbox, Resender
from mam.runner.service import Runner
from mam.runner.settings import RunnerOptions
from mam.runner.trust import V1Trust
from mam.shared.config import BrokerConfig
from mam.shared.protocol import crypto, names, wire
from mam.shared.protocol.errors import PublishTimeout
from mam.shared.store.registry import Contract, Registry

ROOT_TOPIC = "unit/mam"
CONFIG = BrokerConfig(hosts=("fake-broker",), topic_root=ROOT_TOPIC)
JOB = "918b0612"
OTHER_JOB = "0000aaaa"
TOKEN = "0123456789abcdef0123456789abcdef"
AUTH = "auth-token-for-the-unit-tests-0123456789"
KEYS = crypto.derive_keys("unit-test-dispatch-secret-0123456789abcdef")


def mirrored(root: Path, job_id: str = JOB, attempt_id: int = 1) -> Registry:
    registry = Registry(root)
    registry.mirror(job_id=job_id, session="gpu-box", attempt_id=attempt_id, dispatch_token=TOKEN,
                    auth_token=AUTH, contract=Contract())
    return registry


def record(registry: Registry, event: str, job_id: str = JOB, **kwargs: object) -> publish.Published:
    request = publish.PublishRequest(job_id=job_id, event=event, detail="", attempt_id=None, dispatch_token=None)
    return publish.record(registry, request, source="runner", stop_heartbeat=False, **kwargs)  # type: ignore[arg-type]


def connected(broker: FakeBroker):
    return broker.client(CONFIG).connect()


def sent(broker: FakeBroker) -> list[tuple[str, int, bool]]:
    """(leaf, seq, retain) of every event/state publish, in order."""
    out = []
    for p in broker.published:
        parsed = names.parse_job_topic(p.topic, ROOT_TOPIC)
        if parsed and parsed[1] in ("events", "state") and p.payload:
            out.append((parsed[1], json.loads(p.payload)["seq"], p.retain))
    return out


def entry_names(root: Path) -> list[str]:
    folder = names.outbox_dir(root)
    return sorted(os.listdir(folder)) if folder.exists() else []


# ------------------------------------------------------------ put and acknowledge


def test_s17_a_publish_is_kept_0600_with_only_the_signed_messages_until_its_pubacks(tmp_path):
    registry = mirrored(tmp_path)
    started = record(registry, "started")
    assert started.entry == names.outbox_entry_path(tmp_path, JOB, 1, 1)
    assert stat.S_IMODE(started.entry.stat().st_mode) == 0o600
    assert stat.S_IMODE(names.outbox_dir(tmp_path).stat().st_mode) == 0o700
    raw = started.entry.read_text()
    assert AUTH not in raw  # nothing beyond what the signed messages carry
    assert json.loads(raw) == {"event": started.event, "state": started.state}
    crypto.verify_event(wire.from_dict(json.loads(raw)["state"], "state").to_dict(), AUTH)
    broker = FakeBroker()
    publish.send_on(connected(broker), started)
    assert entry_names(tmp_path) == []  # acknowledged: removed
    done = record(registry, "completed", exit_code=0)
    publish.send_on(connected(broker), done)
    assert entry_names(tmp_path) == [f"{JOB}.1.2.kept.json"]  # a terminal entry is kept for re-publishing


def test_s17_a_failed_send_leaves_the_entry(tmp_path):
    registry = mirrored(tmp_path)
    started = record(registry, "started")
    broker = FakeBroker()
    client = connected(broker)
    broker.down = True
    with pytest.raises(Exception, match="no PUBACK"):
        publish.send_on(client, started)
    assert entry_names(tmp_path) == [f"{JOB}.1.1.json"]


class PipelinedClient(FakeClient):
    """A fake client that logs ("queued", leaf) per publish handed to it and ("acked", leaf)
    per PUBACK awaited; the PUBACK of `fail_leaf` times out."""

    def __init__(self, broker: FakeBroker, fail_leaf: str = "") -> None:
        super().__init__(broker, CONFIG, "pipelined", None)
        self.log: list[tuple[str, str]] = []
        self.fail_leaf = fail_leaf

    def publish_async(self, topic: str, payload: bytes, *, qos: int = 1, retain: bool = False,
                      timeout_s: float = 5.0) -> Callable[[], None]:
        leaf = topic.rsplit("/", 1)[-1]
        self.log.append(("queued", leaf))
        self.broker._route(self.client_id, topic, payload, retain)

        def wait_acked() -> None:
            if leaf == self.fail_leaf:
                raise PublishTimeout(f"no PUBACK for {topic}")
            self.log.append(("acked", leaf))
        return wait_acked


def test_s17_a_send_queues_event_and_state_before_awaiting_their_pubacks(tmp_path):
    registry = mirrored(tmp_path)
    client = PipelinedClient(FakeBroker()).connect()
    publish.send_on(client, record(registry, "started"))
    assert client.log == [("queued", "events"), ("queued", "state"), ("acked", "events"), ("acked", "state")]
    assert entry_names(tmp_path) == []
    late = PipelinedClient(FakeBroker(), fail_leaf="events").connect()
    with pytest.raises(PublishTimeout):
        publish.send_on(late, record(registry, "progress"))
    assert late.log == [("queued", "events"), ("queued", "state")]
    assert entry_names(tmp_path) == [f"{JOB}.1.2.json"]  # kept for the re-send (§17)


def test_s17_at_the_cap_progress_is_not_kept_but_started_and_terminal_are(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(outbox, "OUTBOX_MAX_PENDING", 1)
    registry = mirrored(tmp_path)
    assert record(registry, "started").entry is not None
    assert record(registry, "progress").entry is None
    assert "not kept for re-sending: the outbox holds 1 entries (the cap)" in caplog.text
    assert record(registry, "completed", exit_code=0).entry is not None
    assert entry_names(tmp_path) == [f"{JOB}.1.1.json", f"{JOB}.1.3.json"]


def test_s17_an_outbox_that_cannot_be_written_never_stops_the_publish(tmp_path, caplog):
    registry = mirrored(tmp_path)
    names.outbox_dir(tmp_path).write_text("not a folder")  # every write below it fails, also as root
    started = record(registry, "started")
    assert started.entry is None and started.seq == 1
    assert f"job {JOB} seq 1 not kept for re-sending" in caplog.text
    publish.send_on(connected(FakeBroker()), started)  # still sent once


# ------------------------------------------------------------ re-send


def test_s17_resend_per_job_in_seq_order_with_only_the_newest_state(tmp_path):
    registry = mirrored(tmp_path)
    mirrored(tmp_path, OTHER_JOB)
    for event in ("started", "progress", "progress"):
        record(registry, event)
    record(registry, "started", job_id=OTHER_JOB)
    record(registry, "completed", job_id=OTHER_JOB, exit_code=0)
    broker = FakeBroker()
    done = Outbox(tmp_path).resend(connected(broker), registry.get)
    assert (done.sent, done.jobs, done.failed) == (5, 2, False)
    assert sent(broker) == [
        ("events", 1, False), ("events", 2, True), ("state", 2, True),  # 0000aaaa
        ("events", 1, False), ("events", 2, False), ("events", 3, False), ("state", 3, True),  # 918b0612
    ]
    assert entry_names(tmp_path) == [f"{OTHER_JOB}.1.2.kept.json"]


def test_s17_an_older_state_is_never_resent_over_a_newer_one(tmp_path):
    registry = mirrored(tmp_path)
    old = record(registry, "progress")
    newer = record(registry, "progress")
    broker = FakeBroker()
    publish.send_on(connected(broker), newer)  # seq 2 acknowledged; seq 1 left over
    broker.published.clear()
    Outbox(tmp_path).resend(connected(broker), registry.get)
    assert sent(broker) == [("events", old.seq, False)]
    assert entry_names(tmp_path) == []


def test_s17_a_broker_failure_ends_the_pass_and_keeps_the_rest(tmp_path):
    registry = mirrored(tmp_path)
    record(registry, "started")
    record(registry, "progress")
    broker = FakeBroker()
    client = connected(broker)
    broker.down = True
    assert Outbox(tmp_path).resend(client, registry.get).failed
    assert entry_names(tmp_path) == [f"{JOB}.1.1.json", f"{JOB}.1.2.json"]
    broker.down = False
    assert Outbox(tmp_path).resend(client, registry.get).sent == 2
    assert entry_names(tmp_path) == []


def test_s17_a_sweep_leaves_young_entries_and_kept_ones_to_their_writer_and_the_reconnect(tmp_path):
    registry = mirrored(tmp_path)
    started = record(registry, "started")
    publish.send_on(connected(FakeBroker()), record(registry, "completed", exit_code=0))
    broker = FakeBroker()
    box = Outbox(tmp_path)
    now = started.entry.stat().st_mtime + 1.0
    assert box.resend(connected(broker), registry.get, settle_s=10.0, with_kept=False, now=now).sent == 0
    assert broker.published == []
    assert box.resend(connected(broker), registry.get, settle_s=10.0, with_kept=False, now=now + 10.0).sent == 1


def test_s17_fault10_kept_terminal_entries_are_republished_until_they_expire(tmp_path):
    registry = mirrored(tmp_path)
    publish.send_on(connected(FakeBroker()), record(registry, "started"))
    publish.send_on(connected(FakeBroker()), record(registry, "completed", exit_code=0), )
    box = Outbox(tmp_path)
    broker = FakeBroker()
    box.resend(connected(broker), registry.get)
    assert sent(broker) == [("events", 2, True), ("state", 2, True)]  # same seq: receivers drop the duplicate
    assert entry_names(tmp_path) == [f"{JOB}.1.2.kept.json"]  # still kept
    box.resend(connected(broker), registry.get, now=time.time() + outbox.KEEP_TERMINAL_S + 1.0)
    assert entry_names(tmp_path) == []


def test_s17_kept_entries_beyond_the_cap_go_oldest_first(tmp_path, monkeypatch):
    monkeypatch.setattr(outbox, "OUTBOX_MAX_KEPT", 1)
    for job_id in (JOB, OTHER_JOB):
        registry = mirrored(tmp_path, job_id)
        publish.send_on(connected(FakeBroker()), record(registry, "completed", job_id=job_id, exit_code=0))
    first = names.outbox_entry_path(tmp_path, JOB, 1, 1, kept=True)
    os.utime(first, (time.time() - 5.0, time.time() - 5.0))
    Outbox(tmp_path).resend(connected(FakeBroker()), Registry(tmp_path).get)
    assert entry_names(tmp_path) == [f"{OTHER_JOB}.1.1.kept.json"]


def test_s17_a_kept_terminal_of_an_older_attempt_is_dropped_not_republished(tmp_path):
    registry = mirrored(tmp_path)
    publish.send_on(connected(FakeBroker()), record(registry, "completed", exit_code=0))
    mirrored(tmp_path, attempt_id=2)  # a redispatch reached this runner
    broker = FakeBroker()
    Outbox(tmp_path).resend(connected(broker), registry.get)
    assert broker.published == [] and entry_names(tmp_path) == []


def test_s17_an_unreadable_entry_is_set_aside_and_the_rest_is_sent(tmp_path, caplog):
    registry = mirrored(tmp_path)
    record(registry, "started")
    bad = names.outbox_entry_path(tmp_path, OTHER_JOB, 1, 1)
    bad.write_text('{"event": {}, "state": {}}')
    broker = FakeBroker()
    assert Outbox(tmp_path).resend(connected(broker), registry.get).sent == 1
    assert f"outbox entry {bad.name} is unreadable" in caplog.text
    assert entry_names(tmp_path) == [bad.name + ".bad"]


# ------------------------------------------------------------ the daemon


def test_s17_resender_passes_only_while_connected_and_again_on_wake(tmp_path):
    registry = mirrored(tmp_path)
    record(registry, "started")
    broker = FakeBroker()
    client = broker.client(CONFIG)  # not connected yet
    resender = Resender(Outbox(tmp_path), client, registry.get, sweep_s=0.05)
    resender.start()
    try:
        client.connect()
        resender.wake()
        wait_until(lambda: entry_names(tmp_path) == [], 5.0, "the entry re-sent")
    finally:
        resender.stop()
    assert sent(broker) == [("events", 1, False), ("state", 1, True)]


def test_s17_resender_at_start_leaves_kept_terminals_a_reconnect_republishes_them(tmp_path):
    """A restarted runner does not repeat its finished jobs' terminals; a reconnect does (a
    broker that lost its retained messages gets them back, §17)."""
    registry = mirrored(tmp_path)
    publish.send_on(connected(FakeBroker()), record(registry, "completed", exit_code=0))
    broker = FakeBroker()
    resender = Resender(Outbox(tmp_path), connected(broker), registry.get, sweep_s=0.05)
    resender.start()
    try:
        wait_until(lambda: resender._now_due is False, 5.0, "the first pass")
        assert broker.published == []
        resender.wake()
        wait_until(lambda: sent(broker) == [("events", 1, True), ("state", 1, True)], 5.0, "the re-publish")
    finally:
        resender.stop()


def test_s17_a_reconnect_republishes_kept_terminals_at_once_and_again_later(tmp_path):
    """A NATS cluster electing leaders PUBACKs a retained message it could not store, while the
    hub may not be subscribed yet: the kept terminal goes out again after `kept_again_s`."""
    registry = mirrored(tmp_path)
    publish.send_on(connected(FakeBroker()), record(registry, "completed", exit_code=0))
    broker = FakeBroker()
    resender = Resender(Outbox(tmp_path), connected(broker), registry.get, sweep_s=60.0, kept_again_s=(0.2,))
    resender.start()
    once = [("events", 1, True), ("state", 1, True)]
    try:
        wait_until(lambda: resender._now_due is False, 5.0, "the first pass")
        resender.wake()
        wait_until(lambda: sent(broker) == once * 2 and not resender._kept_at, 5.0, "the later re-publish")
    finally:
        resender.stop()
    assert sent(broker) == once * 2  # at the reconnect and once more, not every sweep


def test_s17_the_daemon_resends_at_start_and_republishes_kept_terminals_after_a_reconnect(tmp_path):
    """What a `publish` left (exit 2) goes out when the runner starts; after a reconnect the
    acknowledged terminal is published again with the same seq (§17: for a broker that lost retained messages)."""
    root = tmp_path / "ws"
    registry = mirrored(root)
    record(registry, "started")
    record(registry, "completed", exit_code=0)  # the broker was down: both entries left
    broker = FakeBroker()
    opts = RunnerOptions(session="gpu-box", argv=("true",), root=root, presence_wait_s=0.05)
    runner = Runner(opts, config=CONFIG, trust=V1Trust(KEYS), transport=broker.client)
    thread = threading.Thread(target=runner.serve, daemon=True)
    thread.start()
    try:
        wait_until(lambda: entry_names(root) == [f"{JOB}.1.2.kept.json"], 5.0, "the outbox re-sent at start")
        assert sent(broker) == [("events", 1, False), ("events", 2, True), ("state", 2, True)]
        broker.published.clear()
        assert runner.client is not None
        broker.drop(runner.client)  # type: ignore[arg-type]
        broker.reconnect(runner.client)  # type: ignore[arg-type]
        wait_until(lambda: ("state", 2, True) in sent(broker), 5.0, "the kept terminal state re-published")
        assert broker.retained[names.state_topic(JOB, ROOT_TOPIC)]
    finally:
        runner.shutdown(timeout_s=5.0)
        thread.join(5.0)
    assert not thread.is_alive()


def test_s17_outbox_names_round_trip():
    path = names.outbox_entry_path(Path("/w"), JOB, 3, 12, kept=True)
    assert path == Path("/w/.mam/outbox/918b0612.3.12.kept.json")
    assert names.parse_outbox_name(path.name) == (JOB, 3, 12, True)
    assert names.parse_outbox_name(f"{JOB}.3.12.json") == (JOB, 3, 12, False)
    for bad in (f"{JOB}.0.1.json", f"{JOB}.1.0.json", f".{JOB}.1.1.json.x.tmp", f"{JOB}.1.1.json.bad", "x.1.1.json"):
        assert names.parse_outbox_name(bad) is None


def test_s17_logging_never_names_a_secret(tmp_path, caplog):
    caplog.set_level(logging.DEBUG)
    registry = mirrored(tmp_path)
    record(registry, "started")
    Outbox(tmp_path).resend(connected(FakeBroker()), registry.get)
    assert AUTH not in caplog.text


# ------------------------------------------------------------ wire order (§3.2 rule 6)


def _send_in_thread(client, published: publish.Published) -> tuple[threading.Thread, list[BaseException]]:
    failed: list[BaseException] = []

    def send() -> None:
        try:
            publish.send_on(client, published)
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            failed.append(exc)

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return thread, failed


@pytest.mark.timeout(60)
def test_s3_a_job_s_higher_seq_sent_first_from_another_thread_waits_for_the_lower_one(tmp_path):
    """The hub drops an event whose seq is not above the highest it accepted: a permission
    request recorded as seq 2 by the socket's thread must not lose the race to a progress
    event recorded as seq 3 by the supervisor's."""
    registry = mirrored(tmp_path)
    started = record(registry, "started")
    asked = record(registry, "progress", handed_on=True)  # to the socket's sending thread
    later = record(registry, "progress")
    broker = FakeBroker()
    client = connected(broker)
    publish.send_on(client, started)
    thread, failed = _send_in_thread(client, later)
    thread.join(QUIET_S)  # an absence: a busy machine can only make it pass wrongly
    assert thread.is_alive() and sent(broker) == [("events", 1, False), ("state", 1, True)]
    publish.send_on(client, asked)
    thread.join(PATIENCE_S)
    assert not failed and not thread.is_alive()
    assert sent(broker)[2:] == [("events", 2, False), ("state", 2, True), ("events", 3, False), ("state", 3, True)]
    assert entry_names(tmp_path) == []


@pytest.mark.timeout(60)
def test_s3_a_send_that_failed_gives_its_turn_to_the_next_seq(tmp_path, monkeypatch):
    monkeypatch.setattr(publish, "TURN_WAIT_S", PATIENCE_S)
    registry = mirrored(tmp_path)
    started, progress = record(registry, "started", handed_on=True), record(registry, "progress")
    broker = FakeBroker()
    client = connected(broker)
    broker.down = True
    with pytest.raises(Exception, match="no PUBACK"):
        publish.send_on(client, started)
    broker.down = False
    thread, failed = _send_in_thread(client, progress)
    thread.join(PATIENCE_S)
    assert not failed and not thread.is_alive()
    assert ("events", 2, False) in sent(broker)


@pytest.mark.timeout(60)
def test_s3_a_lower_seq_never_sent_holds_the_next_one_only_so_long_and_is_named(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(publish, "TURN_WAIT_S", 0.2)
    registry = mirrored(tmp_path)
    record(registry, "started", handed_on=True)  # handed on, then dropped: never sent
    progress = record(registry, "progress")
    broker = FakeBroker()
    publish.send_on(connected(broker), progress)
    assert sent(broker) == [("events", 2, False), ("state", 2, True)]
    assert f"job {JOB}: seq 2 goes out without waiting any longer for seq 1, recorded but not sent" in caplog.text
    again = record(registry, "progress")
    caplog.clear()
    publish.send_on(connected(broker), again)  # seq 1 is forgotten: no second wait
    assert "without waiting" not in caplog.text
