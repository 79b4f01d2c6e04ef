"""runner/beats.py over the in-memory fake broker (PROTOCOL §12, §17 last bullet): the daemon's
one heartbeat thread beats for every job with its attempt identity, disk and outbox first;
never after a terminal's barrier (the beat in flight holds the job's heartbeat lock); stops
on a terminal, a newer attempt, `timeout_sec` and removal; a broker failure costs nothing."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from harness.fake_mqtt import FakeBroker, FakeClient
from harness.waiting import PATIENCE_S, QUIET_S, wait_until

from mam.runner import barrier, lease, outbox, publish
from mam.runner.heartbeat.beats import Beats
from mam.shared.config import BrokerConfig
from mam.shared.protocol import crypto, names, wire
from mam.shared.store.registry import Contract, Registry

CONFIG = BrokerConfig(hosts=("fake-broker",), topic_root="unit/mam")
JOBS = ("918b0612", "0000aaaa", "0000bbbb")
TOKEN = "0123456789abcdef0123456789abcdef"
NEWER_TOKEN = "fedcba9876543210fedcba9876543210"
AUTH = "auth-token-for-the-unit-tests-0123456789"
BEAT_S = 0.02
"""A beat period short enough to see many beats at once, seconds."""
LONG_S = 3600.0
"""A timeout_sec no test reaches, seconds."""
DRAIN_S = 1.0
REPETITIONS = 50
BEATS_SEEN = 3


def mirrored(root: Path, job_id: str = JOBS[0], attempt_id: int = 1, token: str = TOKEN) -> Registry:
    registry = Registry(root)
    registry.mirror(job_id=job_id, session="gpu-box", attempt_id=attempt_id, dispatch_token=token,
                    auth_token=AUTH, contract=Contract(), origin="hub", source="runner")
    return registry


def started(registry: Registry, job_id: str = JOBS[0]) -> None:
    publish.record(registry, publish.PublishRequest(job_id, "started", attempt_id=1, dispatch_token=TOKEN),
                   source="runner")


def wire_events(broker: FakeBroker, job_id: str) -> list[wire.Event]:
    topic = names.events_topic(job_id, CONFIG.topic_root)
    return [wire.decode(p.payload, "event") for p in list(broker.published) if p.topic == topic]


def beats_of(broker: FakeBroker, job_id: str) -> list[wire.Event]:
    return [e for e in wire_events(broker, job_id) if e.data.get("heartbeat") is True]


@pytest.fixture
def broker() -> FakeBroker:
    return FakeBroker()


@pytest.fixture
def client(broker: FakeBroker) -> FakeClient:
    return broker.client(CONFIG).connect()


def test_s12_one_thread_beats_for_every_job_with_its_attempt_identity(tmp_path, broker, client):
    registry = Registry(tmp_path)
    for job_id in JOBS:
        mirrored(tmp_path, job_id)
        started(registry, job_id)
    beats = Beats(registry, client, drain_s=DRAIN_S)
    try:
        for job_id in JOBS:
            beats.add(job_id, attempt_id=1, dispatch_token=TOKEN, interval_s=BEAT_S, timeout_s=LONG_S)
        wait_until(lambda: all(len(beats_of(broker, j)) >= BEATS_SEEN for j in JOBS), PATIENCE_S, "beats of each job")
        assert [t.name for t in threading.enumerate()].count("mam-beats") == 1
        for job_id in JOBS:
            for beat in beats_of(broker, job_id):
                crypto.verify_event(beat, AUTH)
                assert (beat.event, beat.detail, beat.data["attempt_id"], beat.data["dispatch_token"]) == (
                    "progress", barrier.HEARTBEAT_DETAIL, 1, TOKEN)
            on_disk = [line["seq"] for line in registry.audit(job_id) if line.get("data", {}).get("heartbeat")]
            assert on_disk[:BEATS_SEEN] == [b.seq for b in beats_of(broker, job_id)][:BEATS_SEEN]  # disk first
    finally:
        beats.stop()
    assert all(not slot.kept for slot in outbox.Outbox(tmp_path).scan())  # every beat acknowledged


def test_s12_no_beat_follows_a_terminal_on_disk_or_on_the_wire(tmp_path, broker, client):
    """A terminal published while the job beats every 20 ms, REPETITIONS times: the terminal has
    the highest seq on disk, and on the connection nothing of the job follows it."""
    for i in range(REPETITIONS):
        job_id = f"{i:08x}"
        registry = mirrored(tmp_path / job_id, job_id)
        started(registry, job_id)
        beats = Beats(registry, client, drain_s=DRAIN_S)
        try:
            beats.add(job_id, attempt_id=1, dispatch_token=TOKEN, interval_s=BEAT_S / 4, timeout_s=LONG_S)
            wait_until(lambda: beats_of(broker, job_id), PATIENCE_S, "a first beat")  # noqa: B023
            done = publish.record(registry, publish.PublishRequest(job_id, "completed", attempt_id=1,
                                                                   dispatch_token=TOKEN), source="runner")
            publish.send_on(client, done)
            seqs = [e.seq for e in wire_events(broker, job_id)]
            assert seqs[-1] == done.seq == max(seqs), seqs
            lines = [line for line in registry.audit(job_id) if "seq" in line]
            assert lines[-1]["event"] == "completed" and max(line["seq"] for line in lines) == done.seq
            wait_until(lambda: job_id not in beats.jobs, PATIENCE_S, "the beats to stop")  # noqa: B023
        finally:
            beats.stop()
        assert wire_events(broker, job_id)[-1].event == "completed"


class HeldClient(FakeClient):
    """A fake client whose PUBACKs wait until `release` is set (a slow broker); each awaited
    PUBACK appends "acked" to `log`, in the thread that awaited it."""

    def __init__(self, broker: FakeBroker, log: list[str]) -> None:
        super().__init__(broker, CONFIG, "held", None)
        self.release = threading.Event()
        self.queued = threading.Event()
        self.log = log

    def publish_async(self, topic: str, payload: bytes, *, qos: int = 1, retain: bool = False,
                      timeout_s: float = 5.0) -> Callable[[], None]:
        self.queued.set()
        super().publish(topic, payload, qos=qos, retain=retain, timeout_s=timeout_s)

        def wait_acked() -> None:
            self.release.wait(PATIENCE_S)
            self.log.append("acked")
        return wait_acked


def test_s12_a_terminal_raises_its_barrier_only_after_the_beat_in_flight(tmp_path, broker):
    """The beat holds `<job>.heartbeat.lock` until its PUBACKs: `stop_for_terminal` (which every
    terminal publish runs first) waits for it, so the terminal's seq and wire order come after."""
    registry = mirrored(tmp_path)
    started(registry)
    order: list[str] = []  # "acked" when the beat's PUBACK wait returns, inside the beat (not after it)
    client = HeldClient(broker, order).connect()
    beats = Beats(registry, client, drain_s=DRAIN_S)
    beating = threading.Thread(target=lambda: beats.beat(beats_entry(beats)))
    beating.start()
    wait_until(client.queued.is_set, PATIENCE_S, "the beat handed to the connection")
    raising = threading.Thread(target=lambda: (barrier.stop_for_terminal(registry, JOBS[0], 1, drain_s=DRAIN_S),
                                               order.append("barrier raised")))
    raising.start()
    raising.join(QUIET_S)
    assert raising.is_alive() and order == []  # the terminal waits for the beat in flight
    client.release.set()
    beating.join(PATIENCE_S)
    raising.join(PATIENCE_S)
    assert len(order) >= 2 and set(order[:-1]) == {"acked"} and order[-1] == "barrier raised"
    assert beats.beat(beats_entry(beats)) == "terminal barrier raised"  # and no beat after it


def beats_entry(beats: Beats, job_id: str = JOBS[0], attempt_id: int = 1, token: str = TOKEN,
                timeout_s: float = LONG_S) -> Any:
    """Add `job_id` (a long period: the thread stays idle) and return its entry, for direct `beat` calls."""
    beats.add(job_id, attempt_id=attempt_id, dispatch_token=token, interval_s=LONG_S, timeout_s=timeout_s)
    return beats._jobs[job_id]


def test_s12_beats_stop_on_a_terminal_record_a_newer_attempt_and_timeout_sec(tmp_path, client):
    registry = mirrored(tmp_path)
    started(registry)
    beats = Beats(registry, client, drain_s=DRAIN_S)
    try:
        assert beats.beat(beats_entry(beats)) is None  # a beat
        assert beats.beat(beats_entry(beats, timeout_s=0)) == "timeout_sec reached"
        publish.record(registry, publish.PublishRequest(JOBS[0], "completed"), source="runner")
        assert beats.beat(beats_entry(beats)) == "job is completed"
        registry.mirror(job_id=JOBS[0], session="gpu-box", attempt_id=2, dispatch_token=NEWER_TOKEN,
                        auth_token=AUTH, contract=Contract(), origin="hub", source="runner")
        assert beats.beat(beats_entry(beats)) == "attempt 2 replaced attempt 1"
    finally:
        beats.stop()


def test_s12_a_removed_job_gets_no_more_beats_and_stop_is_idempotent(tmp_path, broker, client):
    registry = mirrored(tmp_path)
    started(registry)
    beats = Beats(registry, client, drain_s=DRAIN_S)
    beats.add(JOBS[0], attempt_id=1, dispatch_token=TOKEN, interval_s=BEAT_S, timeout_s=LONG_S)
    wait_until(lambda: beats_of(broker, JOBS[0]), PATIENCE_S, "a first beat")
    beats.remove(JOBS[0], attempt_id=2)  # another attempt's supervisor ended: not this one
    assert beats.jobs == [JOBS[0]]
    beats.remove(JOBS[0], attempt_id=1)
    seen = len(beats_of(broker, JOBS[0]))
    assert beats.jobs == []
    beats.stop()
    beats.stop()
    assert len(beats_of(broker, JOBS[0])) <= seen + 1  # at most the beat that was in flight
    beats.add(JOBS[0], attempt_id=1, dispatch_token=TOKEN, interval_s=BEAT_S, timeout_s=LONG_S)
    assert beats.jobs == []  # a stopped Beats takes nothing


def test_s17_a_beat_the_broker_does_not_acknowledge_stays_in_the_outbox_and_beats_go_on(tmp_path, broker, client):
    registry = mirrored(tmp_path)
    started(registry)
    broker.down = True
    beats = Beats(registry, client, drain_s=DRAIN_S)
    try:
        beats.add(JOBS[0], attempt_id=1, dispatch_token=TOKEN, interval_s=BEAT_S, timeout_s=LONG_S)
        wait_until(lambda: len([s for s in outbox.Outbox(tmp_path).scan() if s.seq > 1]) >= BEATS_SEEN,
                   PATIENCE_S, "beats kept in the outbox while the broker is down")
        assert beats.jobs == [JOBS[0]]
        broker.down = False
        wait_until(lambda: beats_of(broker, JOBS[0]), PATIENCE_S, "a beat once the broker is back")
    finally:
        beats.stop()


def test_s10_only_an_acknowledged_beat_renews_the_lease_from_when_it_was_sent(tmp_path, broker, client):
    registry = mirrored(tmp_path)
    started(registry)
    acks: list[tuple[str, int, float]] = []
    broker.down = True
    beats = Beats(registry, client, drain_s=DRAIN_S, on_ack=lambda *ack: acks.append(ack))
    try:
        beats.add(JOBS[0], attempt_id=1, dispatch_token=TOKEN, interval_s=BEAT_S, timeout_s=LONG_S)
        wait_until(lambda: len([s for s in outbox.Outbox(tmp_path).scan() if s.seq > 1]) >= BEATS_SEEN,
                   PATIENCE_S, "beats kept in the outbox while the broker is down")
        assert acks == []  # nothing the broker did not acknowledge renews anything
        broker.down = False
        before = lease.now()
        wait_until(lambda: acks, PATIENCE_S, "a renewal once the broker acknowledges a beat")
        job_id, attempt_id, sent_at = acks[0]
        assert (job_id, attempt_id) == (JOBS[0], 1) and before - DRAIN_S <= sent_at <= lease.now()
    finally:
        beats.stop()


def test_s12_beats_go_out_and_renew_the_lease_while_the_disk_flushes_nothing(tmp_path, broker, client, monkeypatch):
    """Every fsync of this process blocks (a disk saturated by another writer, at its worst) while
    an agent's `progress` waits for its flush: the beats still reach the broker, are acknowledged
    and renew the lease, and are on disk (audit line, the record's seq). A beat writes without
    fsync, and the progress flushes after releasing the registry lock, so no beat waits (§12)."""
    registry = mirrored(tmp_path)
    started(registry)
    disk_free = threading.Event()
    flushes_waiting: list[int] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:  # a flush that finishes only when the test lets it
        flushes_waiting.append(fd)
        disk_free.wait(PATIENCE_S)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    progress = threading.Thread(target=publish.record, daemon=True, args=(registry, publish.PublishRequest(
        JOBS[0], "progress", "tests pass", attempt_id=1, dispatch_token=TOKEN)), kwargs={"source": "runner"})
    progress.start()
    wait_until(lambda: flushes_waiting, PATIENCE_S, "the progress waiting for its flush")
    acks: list[tuple[str, int, float]] = []
    beats = Beats(registry, client, drain_s=DRAIN_S, on_ack=lambda *ack: acks.append(ack))
    try:
        beats.add(JOBS[0], attempt_id=1, dispatch_token=TOKEN, interval_s=BEAT_S, timeout_s=LONG_S)
        wait_until(lambda: len(acks) >= BEATS_SEEN, PATIENCE_S, "acknowledged beats while no flush finishes")
        assert progress.is_alive()  # still flushing: the beats went around it
        seqs = [beat.seq for beat in beats_of(broker, JOBS[0])]
        assert seqs == list(range(3, 3 + len(seqs)))  # 2 is the progress's
        assert registry.get(JOBS[0])["last_seq"] >= seqs[-1]
        assert {line["seq"] for line in registry.audit(JOBS[0]) if line.get("event") == "progress"} >= {2, *seqs}
    finally:
        disk_free.set()
        beats.stop()
    progress.join(PATIENCE_S)
    assert not progress.is_alive()


def test_s12_every_other_publish_is_still_flushed_before_the_wire(tmp_path, counted_fsyncs):
    """Only a beat skips the flush: a `progress` an agent publishes, and a terminal, fsync their
    audit line, record and outbox entry before `publish.record` returns (§8, §17)."""
    registry = mirrored(tmp_path)
    started(registry)
    for event in ("progress", "completed"):
        counted_fsyncs.clear()
        publish.record(registry, publish.PublishRequest(JOBS[0], event, attempt_id=1, dispatch_token=TOKEN),
                       source="runner", stop_heartbeat=False)
        assert len(counted_fsyncs) >= 3, event  # audit line, record, outbox entry (and their folders)
