"""The SHIPPED broker configurations under a large fleet and a broker crash
(PROTOCOL §2, §4, §7), with real nats-server and
mosquitto started from deploy/ (tests/harness/shipped.py).

- Fault 6: with mosquitto's default `max_queued_messages` (1,000), 2,000 retained
  presences were listed by `mam-orch runners` as 1,020, exit 0, no warning. The
  shipped limits list them all, and `runners` warns when what it received may be
  incomplete (a broker queue limit, fewer than its previous count).
- Fault 10: mosquitto saved its store every 60 s, so a crash lost a completed
  job's retained state; the shipped config saves it within about a second.
- A hub behind a burst: nats-server caps a session's unacknowledged QoS 1
  deliveries at `max_ack_pending` while giving each subscription a window of
  that size; at the default (1,024) the hub's five subscriptions overran it and
  what went over came only as redeliveries after `ack_wait` (30 s late).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness.shipped import (  # noqa: F401 - fixtures
    MOSQUITTO_BIN,
    ROOT,
    Broker,
    mosquitto_pair,
    nats_plain,
    pki,
    receive,
    start_broker,
    start_mosquitto,
    stop_broker,
)
from harness.waiting import PATIENCE_S, wait_until
from harness.workspace import clean_env
from paho.mqtt import client as paho
from paho.mqtt.enums import CallbackAPIVersion

from mam.orchestrator.service import service_filters
from mam.shared.config import write_env_file
from mam.shared.protocol import crypto, names, wire

pytestmark = [pytest.mark.broker, pytest.mark.e2e, pytest.mark.timeout(6 * PATIENCE_S)]

SECRET = "limits-test-dispatch-secret-0123456789"
FLEET = 2000  # runners: twice mosquitto's default max_queued_messages
REMOVED = 10  # runners cleared between two `runners` runs
OLD_QUEUE_COUNT = 1020  # what the default queue (1000) plus in-flight window (20) let through
# Mosquitto saves its store every second now; 60 s (the fault) never reaches the disk in this time.
STORE_SAVED_WITHIN_S = PATIENCE_S / 2
# Events and as many states published while the hub reads nothing: 3,000 deliveries
# held unacknowledged, about three times nats-server's default session window.
BURST = 1500
KEEPALIVE_S = 60


@pytest.fixture(params=["nats", "mosquitto"])
def shipped(request) -> Broker:
    if request.param == "nats":
        return request.getfixturevalue("nats_plain")
    return request.getfixturevalue("mosquitto_pair")[0]


def _hub(path: Path, broker: Broker) -> Path:
    path.mkdir(parents=True)
    cfg = broker.config("mam_agent")
    write_env_file(path / ".mam.env", {
        "MQTT_BROKER": cfg.host, "MQTT_PORT": str(cfg.port), "MQTT_USERNAME": cfg.username,
        "MQTT_PASSWORD": cfg.password, "MAM_TOPIC_ROOT": cfg.topic_root, "MAM_DISPATCH_SECRET": SECRET})
    return path


def _sessions(prefix: str) -> list[str]:
    return [f"{prefix}-{n:05d}" for n in range(FLEET)]


def _presence(session: str, keys: crypto.DispatchKeys) -> bytes:
    presence = wire.Presence.build(session, "ab" * 16, "online", host="limits-test", version="0",
                                   max_jobs=1)
    return wire.encode(crypto.sign(presence.to_dict(), keys.sign_key))


def _retain(broker: Broker, messages: list[tuple[str, bytes]]) -> None:
    """Publish retained QoS 1 messages, each acknowledged (b"" clears the topic)."""
    with broker.client(role="fleet") as client:
        for topic, payload in messages:
            client.publish(topic, payload, qos=1, retain=True)


@pytest.fixture
def fleet(shipped: Broker, request) -> Iterator[tuple[Broker, list[str]]]:
    """FLEET signed retained presences on `shipped`; cleared afterwards (the broker is shared)."""
    sessions = _sessions(f"lim{request.node.callspec.id}")
    keys = crypto.derive_keys(SECRET)
    _retain(shipped, [(names.presence_topic(s, ROOT), _presence(s, keys)) for s in sessions])
    yield shipped, sessions
    _retain(shipped, [(names.presence_topic(s, ROOT), b"") for s in sessions])


def _runners(hub: Path) -> tuple[list[str], str]:
    result = subprocess.run([sys.executable, "-m", "mam.orchestrator.cli", "runners", "--json",
                             "--workspace", str(hub)], env=clean_env(), capture_output=True, text=True,
                            timeout=PATIENCE_S)
    assert result.returncode == 0, result.stderr
    return [json.loads(line)["session"] for line in result.stdout.splitlines() if line.strip()], result.stderr


def test_fault6_runners_lists_all_2000_retained_presences_and_warns_when_fewer_than_before(fleet, tmp_path):
    broker, sessions = fleet
    hub = _hub(tmp_path / "hub", broker)
    listed, stderr = _runners(hub)
    assert sorted(listed) == sessions
    assert "WARNING" not in stderr
    _retain(broker, [(names.presence_topic(s, ROOT), b"") for s in sessions[:REMOVED]])
    listed, stderr = _runners(hub)
    assert len(listed) == FLEET - REMOVED
    assert "may be incomplete" in stderr and f"the previous `runners` received {FLEET}" in stderr
    listed, stderr = _runners(hub)  # said once: the new count is the one kept
    assert len(listed) == FLEET - REMOVED and "WARNING" not in stderr


def test_fault6_a_default_mosquitto_queue_cuts_the_list_and_runners_says_so(pki, tmp_path):
    """The fault itself, on mosquitto with its default queue: 1,020 of 2,000, now with a warning."""
    if not MOSQUITTO_BIN.exists():
        pytest.skip("mosquitto is not installed (/usr/sbin/mosquitto)")
    base, _ = start_mosquitto(tmp_path / "mosq", pki, changes={"max_queued_messages 200000\n": ""})
    try:
        keys = crypto.derive_keys(SECRET)
        _retain(base, [(names.presence_topic(s, ROOT), _presence(s, keys)) for s in _sessions("old")])
        listed, stderr = _runners(_hub(tmp_path / "hub", base))
        assert len(listed) == OLD_QUEUE_COUNT
        assert f"received {OLD_QUEUE_COUNT} runner presences" in stderr and "broker queue limit" in stderr
    finally:
        stop_broker(base.proc, base.folder)


def test_fault10_mosquitto_crash_keeps_a_completed_jobs_retained_state(pki, tmp_path):
    """A retained terminal state reaches mosquitto's store within a second or two, so
    a SIGKILL after that keeps it (the shipped 60 s autosave lost it, 2 of 2)."""
    if not MOSQUITTO_BIN.exists():
        pytest.skip("mosquitto is not installed (/usr/sbin/mosquitto)")
    base, secured = start_mosquitto(tmp_path / "mosq", pki)
    assert base.folder is not None and base.proc is not None
    store = base.folder / "data" / "mosquitto.db"
    topic = names.state_topic("0a1b2c3d", ROOT)
    payload = b'{"status": "completed", "marker": "fault10-' + tmp_path.name.encode() + b'"}'
    try:
        _retain(base, [(topic, payload)])
        wait_until(lambda: store.exists() and payload in store.read_bytes(), STORE_SAVED_WITHIN_S,
                   "mosquitto to save the retained state in its store")
        base.proc.send_signal(signal.SIGKILL)
        base.proc.wait(PATIENCE_S)
        base.proc = start_broker("mosquitto", [str(MOSQUITTO_BIN), "-c", str(base.folder / "mosquitto.conf")],
                                 clean_env(), tmp_path / "restarted.log",
                                 [base.mqtt_port, secured.mqtt_port, base.ws_port])
        with base.client(role="hub") as hub:
            hub.subscribe([(topic, 1)])
            message = receive(hub, lambda m: m.topic == topic)
            assert message.payload == payload and message.retain
    finally:
        stop_broker(base.proc, base.folder)


class HeldHub:
    """A paho session with the hub service's subscriptions whose network thread blocks on
    its first delivery until `release()`: nothing more is read or acknowledged meanwhile,
    as when the hub falls behind. Records each payload's first delivery and its DUP flag."""

    def __init__(self, broker: Broker) -> None:
        self.release_event = threading.Event()
        self.first: dict[bytes, bool] = {}  # payload -> DUP flag of its first delivery
        self.redelivered = 0
        self._lock = threading.Lock()
        cfg = broker.config()
        self.client = paho.Client(CallbackAPIVersion.VERSION2, client_id="deploytest-held-hub")
        self.client.username_pw_set(cfg.username, cfg.password)
        self.client.on_message = self._on_message
        subscribed = threading.Event()
        self.client.on_subscribe = lambda *_: subscribed.set()
        self.client.connect(cfg.hosts[0], cfg.port, KEEPALIVE_S)
        self.client.loop_start()
        self.client.subscribe(service_filters(ROOT))
        assert subscribed.wait(PATIENCE_S), "no SUBACK"

    def _on_message(self, client, userdata, msg) -> None:
        self.release_event.wait(PATIENCE_S)
        with self._lock:
            if msg.payload in self.first:
                self.redelivered += 1
            else:
                self.first[msg.payload] = bool(msg.dup)

    def count(self) -> int:
        with self._lock:
            return len(self.first)

    def close(self) -> None:
        self.release_event.set()
        self.client.disconnect()
        self.client.loop_stop()


def test_a_hub_behind_a_burst_gets_every_event_and_state_without_waiting_for_a_redelivery(shipped):
    hub = HeldHub(shipped)
    try:
        with shipped.client(role="burst") as runner:
            acks = []
            for n in range(BURST):
                job = f"{n:08x}"
                acks.append(runner.publish_async(names.events_topic(job, ROOT), f"event {n}".encode()))
                acks.append(runner.publish_async(names.state_topic(job, ROOT), f"state {n}".encode()))
            for ack in acks:  # all of them stored by the broker while the hub reads nothing
                ack()
        hub.release_event.set()
        wait_until(lambda: hub.count() == 2 * BURST, what=f"all {2 * BURST} deliveries at the held hub")
        late = sorted(payload.decode() for payload, dup in hub.first.items() if dup)
        assert not late, (f"{len(late)} of {2 * BURST} first reached the hub as redeliveries after the "
                          f"broker's ack_wait (e.g. {late[:3]}): its session window dropped them")
    finally:
        hub.close()
        with shipped.client(role="burst-clear") as clearing:  # the broker is shared: no retained states left
            for n in range(BURST):
                clearing.publish(names.state_topic(f"{n:08x}", ROOT), b"", qos=1, retain=True)
