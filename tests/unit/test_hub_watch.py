"""PROTOCOL §6 and §10 on the hub without a broker: the watcher's clocks and
exit codes, and the hub's close (record first, then dispatch cleared and a
signed cancel published), with a recording stand-in for the MQTT client."""

from __future__ import annotations

import io
import json
import queue
import threading
import time

import pytest
from harness.fake_mqtt import FakeBroker
from harness.waiting import PATIENCE_S, QUIET_S, wait_until
from harness.workspace import TEST_SECRET

from mam.orchestrator.control import cancel_owed, close_remote
from mam.orchestrator.follow import print_events
from mam.orchestrator.mirror import BrokerLink
from mam.orchestrator.watch import PROOF_LOOK_S, Watcher, WatchOptions
from mam.shared.config import BrokerConfig
from mam.shared.protocol import crypto, names, wire
from mam.shared.protocol.errors import BrokerError, ExitCode
from mam.shared.store.registry import Contract, Registry
from mam.shared.transport.mqtt import Message

TS = "2026-06-20T14:49:30Z"
KEYS = crypto.derive_keys(TEST_SECRET)


class RecordingClient:
    """The slice of `MqttClient` the hub uses: publish, subscribe, messages, connected."""

    def __init__(self, *, fail_publish: bool = False) -> None:
        self.config = BrokerConfig()
        self.messages: queue.Queue[Message] = queue.Queue()
        self.connected = threading.Event()
        self.connected.set()
        self.published: list[tuple[str, bytes, bool]] = []
        self.subscribed: list[str] = []
        self.fail_publish = fail_publish

    def publish(self, topic: str, payload: bytes, retain: bool = False) -> None:
        if self.fail_publish:
            raise BrokerError("no PUBACK")
        self.published.append((topic, payload, retain))

    def subscribe(self, topics) -> None:
        self.subscribed += [topic for topic, _qos in topics]

    def close(self) -> None:
        self.connected.clear()


def deliver(client, record, seq, name, **data):
    body = {"schema_version": 1, "seq": seq, "job_id": record["job_id"], "event": name, "timestamp": TS,
            "detail": "", "data": {"attempt_id": record["attempt_id"],
                                   "dispatch_token": record["dispatch_token"], **data}}
    raw = wire.encode(crypto.sign_event(body, record["auth_token"]))
    client.messages.put(Message(names.events_topic(record["job_id"], client.config.topic_root), raw, False))


@pytest.fixture
def reg(tmp_path):
    return Registry(tmp_path)


def watch(reg, record, client, **options):
    opts = WatchOptions(remote=True, **options)
    return Watcher(reg, record["job_id"], client=client, keys=KEYS, options=opts, out=io.StringIO())


def leaves(client):
    return [topic.rsplit("/", 1)[1] for topic, _payload, _retain in client.published]


def test_s10_no_started_within_ack_is_agent_blocked_exit_1(reg):
    rec = reg.register(session="gpu-box")
    client = RecordingClient()
    assert watch(reg, rec, client, ack_timeout_s=0.2, idle_timeout_s=0.2,
                 ack_only_before_first=True).run() == ExitCode.ERROR
    after = reg.get(rec["job_id"])
    assert after["status"] == "error" and after["close_reason"] == "agent_blocked"
    assert leaves(client) == ["dispatch", "control"]  # dispatch cleared, then the cancel (§10)
    control = wire.decode(client.published[1][1], "control")
    crypto.verify(control.to_dict(), KEYS.sign_key)
    assert control.attempt_id == rec["attempt_id"] and client.published[1][2] is True


def test_s10_silence_after_started_is_deadline_timeout_exit_2(reg):
    rec = reg.register(session="gpu-box")
    client = RecordingClient()
    deliver(client, rec, 1, "started")
    assert watch(reg, rec, client, ack_timeout_s=5, idle_timeout_s=0.3).run() == ExitCode.TIMEOUT
    after = reg.get(rec["job_id"])
    assert after["close_reason"] == "deadline_timeout" and after["last_seq"] == 1
    assert leaves(client) == ["dispatch", "control"]  # started cleared the dispatch (§17), then the cancel


def test_s10_terminal_event_ends_the_watch_with_its_exit_code(reg):
    rec = reg.register(session="gpu-box", contract=Contract(heartbeat_sec=5))
    client = RecordingClient()
    for seq, name in ((1, "started"), (2, "progress"), (3, "completed")):
        deliver(client, rec, seq, name, **({"exit_code": 0} if name == "completed" else {}))
    w = watch(reg, rec, client)
    assert w.run() == ExitCode.COMPLETED
    assert [json.loads(line)["seq"] for line in w.out.getvalue().splitlines()] == [1, 2, 3]
    assert reg.get(rec["job_id"])["status"] == "completed"
    assert client.published == [(names.dispatch_topic(rec["job_id"], client.config.topic_root), b"", True)]


def test_s10_a_job_already_terminal_is_answered_from_disk(reg):
    rec = reg.register(session="gpu-box")
    reg.close(rec["job_id"], "cancelled")
    client = RecordingClient()
    assert watch(reg, rec, client).run() == ExitCode.CANCELLED and client.subscribed == []


def test_s10_an_ended_jobs_events_are_printed_from_its_audit_log_and_nothing_else(reg):
    rec = reg.register(session="gpu-box", contract=Contract(heartbeat_sec=5))
    client = RecordingClient()
    for seq, name in ((1, "started"), (2, "completed")):
        deliver(client, rec, seq, name, **({"exit_code": 0} if name == "completed" else {}))
    watched = watch(reg, rec, client)
    assert watched.run() == ExitCode.COMPLETED
    with reg.audit_path(rec["job_id"]).open("ab") as audit:  # what a follower must not print as events
        audit.write(b"not json\n" + json.dumps({"schema_version": 1, "job_id": "0badf00d", "seq": 9,
                                                "event": "completed"}).encode() + b"\n[1, 2]\n{\"seq\": ")
    out = io.StringIO()
    print_events(reg, rec["job_id"], out)
    assert out.getvalue() == watched.out.getvalue()  # what the watch printed while it ran
    assert rec["dispatch_token"] not in out.getvalue() and '"dispatch_token": "<set>"' in out.getvalue()


def test_s10_close_remote_goes_terminal_first_even_when_the_broker_fails(reg, caplog):
    rec = reg.register(session="gpu-box")
    closed = close_remote(reg, RecordingClient(fail_publish=True), KEYS, rec["job_id"], "deadline_timeout")
    assert closed["status"] == "error" and "the cancel was not published" in caplog.text
    assert cancel_owed(closed)
    again = close_remote(reg, None, KEYS, rec["job_id"], "agent_blocked")
    assert again == reg.get(rec["job_id"]) and again["close_reason"] == "deadline_timeout"


def test_s10_hub_only_close_without_a_client_or_keys(reg, caplog):
    rec = reg.register(session="gpu-box")
    closed = close_remote(reg, None, None, rec["job_id"], "cancelled")
    assert closed["status"] == "cancelled" and "on the hub only" in caplog.text


def test_s10_cancel_owed_only_for_the_hubs_own_decisions(reg):
    rec = reg.register(session="gpu-box")
    assert not cancel_owed(rec)
    started = reg.record_event(rec["job_id"], event="started", attempt_id=1, dispatch_token=rec["dispatch_token"],
                               build=lambda seq: {"seq": seq})
    assert started[0] == 1
    ended = reg.transition(rec["job_id"], "error", source="runner", attempt_id=1,
                           dispatch_token=rec["dispatch_token"], exit_code=3)
    assert not cancel_owed(ended)  # its runner reported it


# ------------------------------------------------------------ §10: the hub proves its own link first

def test_s10_a_silence_is_judged_only_once_the_hubs_own_link_is_proven_past_it(reg):
    """Past the idle deadline, a hub whose link is not proven alive after that deadline (a silent
    partition its connection has not noticed) closes nothing; the same silence with the proof
    closes the job `deadline_timeout`. The proof is asked for the idle deadline itself."""
    rec = reg.register(session="gpu-box")
    client = RecordingClient()
    watcher = watch(reg, rec, client, ack_timeout_s=5, idle_timeout_s=1)
    watcher.start_clocks(100.0, rec)
    deliver(client, rec, 1, "started")
    message = client.messages.get_nowait()
    watcher.handle(message.topic, message.payload)
    asked: list[float] = []
    deadline = watcher.last_alive + watcher.idle_s
    assert watcher.tick(deadline + 60, poll=False, proven=lambda moment: asked.append(moment) or False) is None
    assert asked == [deadline] and reg.get(rec["job_id"])["status"] == "running"
    assert watcher.tick(deadline + 60, poll=False, proven=lambda moment: True) == ExitCode.TIMEOUT
    assert reg.get(rec["job_id"])["close_reason"] == "deadline_timeout"


class CountingQueue(queue.Queue):  # type: ignore[type-arg]
    """A queue that counts the waits for a message (`get` with a timeout): the watch's looks."""

    def __init__(self) -> None:
        super().__init__()
        self.waits = 0

    def get(self, block: bool = True, timeout: float | None = None):  # type: ignore[no-untyped-def]
        if block and timeout is not None:
            self.waits += 1
        return super().get(block, timeout)


class HeldProbeClient(RecordingClient):
    """A client whose probes (`publish_async`) are acknowledged only once `release` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.messages = CountingQueue()
        self.release = threading.Event()

    def publish_async(self, topic: str, payload: bytes, *, retain: bool = False, timeout_s: float = 5.0):
        self.published.append((topic, payload, retain))

        def wait_acked() -> None:
            if not self.release.wait(PATIENCE_S):
                raise BrokerError("no PUBACK")
        return wait_acked


def test_s10_a_watch_waiting_for_its_links_proof_looks_again_at_the_services_pace(reg):
    """Past the idle deadline with the probe's PUBACK on the way, the watch looks again every
    PROOF_LOOK_S, not in a tight loop; the proof then closes the job `deadline_timeout`."""
    rec = reg.register(session="gpu-box")
    client = HeldProbeClient()
    deliver(client, rec, 1, "started")
    watcher = watch(reg, rec, client, ack_timeout_s=5, idle_timeout_s=0.2)
    codes: list[int] = []
    running = threading.Thread(target=lambda: codes.append(watcher.run()))
    running.start()
    try:
        wait_until(lambda: "probe" in leaves(client), PATIENCE_S, "the link probe")
        looks = client.messages.waits
        running.join(QUIET_S)
        assert running.is_alive() and reg.get(rec["job_id"])["status"] == "running"  # no proof: no close
        assert client.messages.waits - looks <= QUIET_S / PROOF_LOOK_S + 2
    finally:
        client.release.set()
        running.join(PATIENCE_S)
    assert codes == [ExitCode.TIMEOUT] and reg.get(rec["job_id"])["close_reason"] == "deadline_timeout"


def test_s10_the_link_is_proven_by_an_acknowledged_probe_sent_after_the_moment():
    """`BrokerLink.proven` asks for a probe (zero-length, QoS 1, not retained, on `hub/probe`); its
    PUBACK proves the link from when it was sent. A broker that acknowledges nothing proves nothing."""
    broker = FakeBroker()
    client = broker.client(BrokerConfig(topic_root="unit/mam")).connect()
    link = BrokerLink(client, names.hub_probe_topic("unit/mam"))
    try:
        moment = time.monotonic()
        assert not link.proven(moment, link.proven_at)
        wait_until(lambda: link.proven_at >= moment, PATIENCE_S, "an acknowledged probe")
        probes = broker.on_topic("unit/mam/hub/probe")
        assert probes and all(p.payload == b"" and not p.retain for p in probes)
        assert link.proven(moment, link.proven_at)
        broker.down = True
        later = time.monotonic()
        assert not link.proven(later, link.proven_at)
        with pytest.raises(AssertionError):
            wait_until(lambda: link.proven_at >= later, QUIET_S, "a proof from a broker that acks nothing")
    finally:
        link.close()
    unprobed = BrokerLink(RecordingClient(), "unit/mam/hub/probe")  # a client that cannot publish: always proven
    assert unprobed.proven(time.monotonic(), unprobed.proven_at)
