"""runner/presence.py and runner/service.py over the in-memory fake broker: presence
(§7), the Last Will, signals (first = drain, second = stop), the lifecycle, and refusals
that never stop the daemon (§5). No broker process; the only agents are the burst test's `sleep`."""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness.fake_mqtt import FakeBroker, FakeMessage
from harness.waiting import PATIENCE_S, wait_until

from mam.runner import publish, service
from mam.runner.outbox import Outbox
from mam.runner.presence import Presence, SessionBusy
from mam.runner.service import Runner
from mam.runner.settings import RunnerOptions
from mam.runner.trust import V1Trust
from mam.shared.config import BrokerConfig
from mam.shared.protocol import crypto, names, wire
from mam.shared.protocol.errors import BrokerUnavailable, MamError, RegistryError
from mam.shared.store.registry import Contract, Registry

KEYS = crypto.derive_keys("unit-test-dispatch-secret-0123456789abcdef")
SESSION = "gpu-box"
CONFIG = BrokerConfig(hosts=("fake-broker",), topic_root="unit/mam")
TOPIC = names.presence_topic(SESSION, CONFIG.topic_root)
OTHER_RUNNER = "fedcba9876543210fedcba9876543210"


def presence_of(runner_id: str, status: str, keys: crypto.DispatchKeys = KEYS) -> bytes:
    other = Presence(session=SESSION, runner_id=runner_id, trust=V1Trust(keys), max_jobs=1,
                     topic_root=CONFIG.topic_root)
    return other.payload(status, [])


def statuses(broker: FakeBroker, runner_id: str | None = None) -> list[str]:
    """The presence statuses published on the session, in order (optionally of one runner)."""
    found = [wire.decode(p.payload, "presence") for p in broker.on_topic(TOPIC) if p.payload]
    return [p.status for p in found if runner_id is None or p.runner_id == runner_id]


# ------------------------------------------------------------ presence (§7)


def test_s7_presence_is_signed_and_the_last_will_is_a_retained_offline():
    presence = Presence(session=SESSION, runner_id=OTHER_RUNNER, trust=V1Trust(KEYS), max_jobs=3, topic_root="unit/mam")
    decoded = wire.decode(presence.payload("online", ["0000aaaa", "918b0612"]), "presence")
    crypto.verify(decoded, KEYS.sign_key)
    assert (decoded.status, decoded.runner_id, decoded.max_jobs, list(decoded.running)) == (
        "online", OTHER_RUNNER, 3, ["0000aaaa", "918b0612"])
    topic, payload, qos, retain = presence.will()
    assert topic == TOPIC and qos == 1 and retain is True
    will = wire.decode(payload, "presence")
    crypto.verify(will, KEYS.sign_key)
    assert will.status == "offline" and will.extras == {"will": True}  # the hub tells it lost (§7)
    assert wire.decode(presence.payload("offline", []), "presence").extras is None  # a clean stop says no will


def test_s7_publish_refresh_and_nothing_while_disconnected_or_replaced():
    broker = FakeBroker()
    client = broker.client(CONFIG)
    presence = Presence(session=SESSION, runner_id=OTHER_RUNNER, trust=V1Trust(KEYS), max_jobs=1, topic_root="unit/mam")
    presence.publish(client, "online", [])  # not connected yet: nothing, and not announced
    assert broker.published == [] and not presence.announced and not presence.refresh_due(60.0)
    client.connect()
    presence.publish(client, "online", [])
    assert presence.announced and broker.retained[TOPIC]
    assert not presence.refresh_due(60.0, now=presence.published_at + 59.9)
    assert presence.refresh_due(60.0, now=presence.published_at + 60.5)  # (+60.0 can round below 60)
    presence.replaced = True
    presence.publish(client, "offline", [])
    assert statuses(broker) == ["online"]


@pytest.mark.parametrize(("retained", "replace", "busy"), [
    (presence_of(OTHER_RUNNER, "online"), False, True),
    (presence_of(OTHER_RUNNER, "draining"), False, True),
    (presence_of(OTHER_RUNNER, "online"), True, False),  # --replace
    (presence_of(OTHER_RUNNER, "offline"), False, False),
    (presence_of(OTHER_RUNNER, "online", crypto.derive_keys("x" * 40)), False, False),  # forged: ignored
    (None, False, False),  # nobody ever announced the session
])
def test_s7_session_check_at_start(retained, replace, busy):
    broker = FakeBroker()
    if retained is not None:
        broker.retained[TOPIC] = retained
    client = broker.client(CONFIG).connect()
    presence = Presence(session=SESSION, runner_id=names.new_runner_id(), trust=V1Trust(KEYS), max_jobs=1,
                        topic_root="unit/mam")
    if busy:
        with pytest.raises(SessionBusy, match=f"held by another live runner \\({OTHER_RUNNER}"):
            presence.check_session_free(client, wait_s=0.2, replace=replace)
    else:
        presence.check_session_free(client, wait_s=0.2, replace=replace)


def test_s7_only_a_live_presence_of_another_runner_replaces_us():
    presence = Presence(session=SESSION, runner_id=names.new_runner_id(), trust=V1Trust(KEYS), max_jobs=1,
                        topic_root="unit/mam")
    assert not presence.on_message(presence_of(OTHER_RUNNER, "online"), retained=True)  # a re-delivery
    assert not presence.on_message(presence_of(OTHER_RUNNER, "offline"), retained=False)
    assert not presence.on_message(presence.payload("online", []), retained=False)  # our own
    assert not presence.on_message(b"", retained=False)
    assert presence.on_message(presence_of(OTHER_RUNNER, "online"), retained=False)
    assert presence.replaced


# ------------------------------------------------------------ the Runner over the fake broker


@pytest.fixture
def broker() -> FakeBroker:
    return FakeBroker()


def new_runner(broker: FakeBroker, root: Path, argv: tuple[str, ...] = ("true",), **options: object) -> Runner:
    opts = RunnerOptions(session=SESSION, argv=argv, root=root, presence_wait_s=0.05, **options)  # type: ignore[arg-type]
    return Runner(opts, config=CONFIG, trust=V1Trust(KEYS), transport=broker.client)


@pytest.fixture
def served(broker: FakeBroker, tmp_path: Path) -> Iterator[tuple[Runner, list[int]]]:
    """A Runner serving on a thread; shut down (and joined) at the end."""
    runner = new_runner(broker, tmp_path / "ws")
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(runner.serve()), daemon=True)
    thread.start()
    wait_until(lambda: "online" in statuses(broker, runner.runner_id), 5.0, "presence online")
    yield runner, result
    runner.shutdown(timeout_s=5.0)
    thread.join(5.0)
    assert not thread.is_alive()


def test_lifecycle_no_side_effects_before_serve_and_serve_refuses_twice(broker, tmp_path):
    runner = new_runner(broker, tmp_path / "ws")
    assert runner.client is None and not (tmp_path / "ws").exists() and broker.published == []
    runner.shutdown()  # before serve: a no-op
    with runner:
        thread = threading.Thread(target=runner.serve, daemon=True)
        thread.start()
        wait_until(lambda: "online" in statuses(broker, runner.runner_id), 5.0, "presence online")
        with pytest.raises(MamError, match="already"):
            runner.serve()
    thread.join(5.0)  # leaving the `with` shut it down
    assert not thread.is_alive()
    assert statuses(broker, runner.runner_id) == ["online", "offline"]
    assert runner.client is not None and runner.client.closed  # type: ignore[attr-defined]


def test_signals_first_drains_and_serve_restores_the_handlers(broker, tmp_path):
    """Like uvicorn's test_signal.py: the handler is called directly, on the main thread's serve()."""
    runner = new_runner(broker, tmp_path / "ws")
    before = signal.getsignal(signal.SIGTERM)
    seen: list[object] = []

    def first_signal() -> None:
        wait_until(lambda: "online" in statuses(broker, runner.runner_id), 5.0, "presence online")
        seen.append(signal.getsignal(signal.SIGTERM))
        runner.on_signal(signal.SIGTERM)

    helper = threading.Thread(target=first_signal, daemon=True)
    helper.start()
    assert runner.serve() == 0  # drained: no job running, so it exits
    helper.join(5.0)
    assert seen == [runner.on_signal]  # installed while serving
    assert signal.getsignal(signal.SIGTERM) is before and signal.getsignal(signal.SIGINT) is not runner.on_signal
    assert statuses(broker, runner.runner_id) == ["online", "draining", "offline"]


def test_signals_the_second_stops(served, broker, caplog):
    runner, result = served
    caplog.set_level(logging.INFO, "mam.daemon")
    runner.drain()  # a drain that cannot finish would wait for jobs; the second signal stops at once
    runner.on_signal(signal.SIGTERM)
    runner.on_signal(signal.SIGTERM)
    wait_until(lambda: result == [0], 5.0, "serve() to return")
    assert "again: cancelling running jobs and exiting" in caplog.text
    assert statuses(broker, runner.runner_id)[-1] == "offline"


def test_s5_a_refused_dispatch_never_stops_the_daemon(served, broker, caplog):
    runner, result = served
    caplog.set_level(logging.INFO, "mam.daemon")
    sender = broker.client(CONFIG).connect()
    sender.publish(names.dispatch_topic("918b0612", CONFIG.topic_root), b"not json", retain=True)
    wait_until(lambda: "refused dispatch 918b0612: malformed" in caplog.text, 5.0, "the refusal line")
    assert result == [] and runner.running == []


def test_s7_last_will_on_a_lost_connection_and_presence_again_after_the_reconnect(served, broker):
    runner, _ = served
    assert runner.client is not None
    client = runner.client
    broker.drop(client)  # type: ignore[arg-type]
    assert statuses(broker, runner.runner_id)[-1] == "offline"  # the broker published the Last Will
    broker.reconnect(client)  # type: ignore[arg-type]
    wait_until(lambda: statuses(broker, runner.runner_id)[-1] == "online", 5.0, "presence republished")
    assert not client.reconnected.is_set()


def test_s7_a_replaced_runner_drains_and_leaves_the_presence_to_the_new_one(served, broker):
    runner, result = served
    other = broker.client(CONFIG).connect()
    other.publish(TOPIC, presence_of(OTHER_RUNNER, "online"), retain=True)
    wait_until(lambda: result == [0], 5.0, "the replaced runner to exit")
    assert runner.draining
    assert statuses(broker, runner.runner_id) == ["online"]  # neither draining nor offline over the new one
    assert wire.decode(broker.retained[TOPIC], "presence").runner_id == OTHER_RUNNER


# ------------------------------------------------------------ start checks and §17 takes


def signed_dispatch(job_id: str, auth_token: str, *, attempt_id: int = 1) -> wire.Dispatch:
    """A dispatch of `job_id` as a hub publishes it (§5), sealing `auth_token`."""
    token = names.new_dispatch_token()
    sealed = crypto.seal(KEYS.seal_key, job_id=job_id, attempt_id=attempt_id, dispatch_token=token,
                         auth_token=auth_token, brief="echo hi")
    unsigned = wire.Dispatch.build(job_id, SESSION, attempt_id, token, origin="hub", contract=wire.Contract(),
                                   sealed=sealed)
    return wire.decode(wire.encode(crypto.sign(unsigned.to_dict(), KEYS.sign_key)), "dispatch")


def test_fault4_a_workspace_whose_mam_folder_cannot_be_written_refuses_to_start_before_any_presence(
        broker, tmp_path):
    """`.mam/logs` cannot be made (a file is in its way here; the e2e test uses a
    read-only mount and a folder of another user): one RegistryError line (exit 1), nothing published."""
    ws = tmp_path / "ws"
    (ws / ".mam" / "jobs").mkdir(parents=True)
    (ws / ".mam" / "logs").write_text("not a folder")
    runner = new_runner(broker, ws)
    expected = r"^the runner's workspace \(§8\): /\S+/ws/\.mam/logs is not writable \(EEXIST: "
    with pytest.raises(RegistryError, match=expected) as caught:
        runner.serve()
    assert "\n" not in str(caught.value)
    assert broker.published == [] and runner.client is None


def test_s17_a_dispatch_whose_attempt_has_a_retained_state_is_refused_taken(served, broker, caplog):
    """§17: another runner started this attempt (its signed state is retained): not run here."""
    runner, result = served
    caplog.set_level(logging.INFO, "mam.daemon")
    job_id, auth_token = "918b0612", names.new_auth_token()
    dispatch = signed_dispatch(job_id, auth_token)
    snapshot = wire.State.build(job_id, 4, "running", "progress", attempt_id=1,
                                dispatch_token=dispatch.dispatch_token)
    hub = broker.client(CONFIG).connect()
    hub.publish(names.state_topic(job_id, CONFIG.topic_root),
                wire.encode(crypto.sign_event(snapshot.to_dict(), auth_token)), retain=True)
    hub.publish(names.dispatch_topic(job_id, CONFIG.topic_root), wire.encode(dispatch), retain=True)
    wait_until(lambda: f"refused dispatch {job_id}: taken: attempt 1" in caplog.text, 5.0, "the taken refusal")
    assert runner.running == [] and result == []
    assert not (runner.options.root / ".mam" / "jobs" / f"{job_id}.json").exists()
    assert broker.on_topic(names.events_topic(job_id, CONFIG.topic_root)) == []  # no `started`
    assert names.state_topic(job_id, CONFIG.topic_root) not in runner.client.filters  # type: ignore[union-attr]


def test_s7_a_burst_of_takes_is_said_in_one_presence_once_the_inbox_is_empty(broker, tmp_path):
    """Four dispatches waiting at start are taken one after another; the presence that says
    them goes out once, with all four running, not once per take (§7)."""
    hub = broker.client(CONFIG).connect()
    job_ids = [f"0000000{i}" for i in range(4)]
    for job_id in job_ids:
        dispatch = signed_dispatch(job_id, names.new_auth_token())
        hub.publish(names.dispatch_topic(job_id, CONFIG.topic_root), wire.encode(dispatch), retain=True)
    runner = new_runner(broker, tmp_path / "ws", argv=("sleep", "30"), max_jobs=4)
    thread = threading.Thread(target=runner.serve, daemon=True)
    thread.start()
    try:
        wait_until(lambda: any(p.running for p in presences(broker, runner.runner_id)), PATIENCE_S,
                   "a presence with running jobs")
        assert sorted(runner.running) == job_ids
        said = [p.running for p in presences(broker, runner.runner_id)]
        assert said[:2] == [(), tuple(job_ids)], said
    finally:
        runner.shutdown(timeout_s=PATIENCE_S)
        thread.join(PATIENCE_S)
    assert not thread.is_alive()


def test_s7_a_changed_running_set_is_said_within_the_coalesce_bound_while_messages_keep_coming(
        broker, tmp_path, monkeypatch):
    """An inbox that never empties (a flood of junk) delays the presence of a changed running set
    by at most PRESENCE_COALESCE_S; once that passed, the next look publishes it."""
    runner = new_runner(broker, tmp_path / "ws")
    runner.client = client = broker.client(CONFIG).connect()
    client.messages.put(FakeMessage(names.dispatch_topic("0000aaaa", CONFIG.topic_root), b"junk", False))
    clock = [1000.0]
    monkeypatch.setattr(service.time, "monotonic", lambda: clock[0])
    runner._running_changed()
    assert runner.on_tick() is False and presences(broker, runner.runner_id) == []  # a message waits
    clock[0] += service.PRESENCE_COALESCE_S
    assert runner.on_tick() is False and len(presences(broker, runner.runner_id)) == 1
    assert runner.on_tick() is False and len(presences(broker, runner.runner_id)) == 1  # said once


def presences(broker: FakeBroker, runner_id: str) -> list[wire.Presence]:
    """The presences `runner_id` published on the session, in order."""
    found = [wire.decode(p.payload, "presence") for p in broker.on_topic(TOPIC) if p.payload]
    return [p for p in found if p.runner_id == runner_id]


def test_s17_the_state_read_returns_the_retained_state_and_keeps_other_messages_in_order(broker, tmp_path):
    """Messages received while a take reads the job's state are handled afterwards, in order,
    and the state topic is unsubscribed again (no subscription per job accumulates)."""
    runner = new_runner(broker, tmp_path / "ws")
    runner.client = client = broker.client(CONFIG).connect()
    job_id = "918b0612"
    state_topic = names.state_topic(job_id, CONFIG.topic_root)
    broker.retained[state_topic] = b"the retained state"
    others = [names.control_topic(other, CONFIG.topic_root) for other in ("0000aaaa", "0000bbbb")]
    for topic in others:
        client.messages.put(FakeMessage(topic, b"", False))
    assert runner._retained_state(job_id) == b"the retained state"
    assert [m.topic for m in runner._deferred] == others
    assert state_topic not in client.filters
    del broker.retained[state_topic]
    assert runner._retained_state(job_id) is None


def test_s17_a_state_that_cannot_be_read_leaves_the_dispatch_retained_and_nothing_subscribed(
        served, broker, caplog, monkeypatch):
    """No SUBACK for the state topic: the dispatch is not taken now (it comes back after a
    reconnect), and the state topic is not left among the filters re-subscribed at reconnect."""
    runner, result = served
    assert runner.client is not None
    caplog.set_level(logging.INFO, "mam.daemon")
    job_id = "918b0612"
    state_topic = names.state_topic(job_id, CONFIG.topic_root)
    subscribe = runner.client.subscribe

    def no_suback(filters, *, timeout_s=5.0):
        if filters[0][0] == state_topic:
            runner.client.filters.append(state_topic)  # type: ignore[union-attr]  # as MqttClient remembers it
            raise BrokerUnavailable("no SUBACK from fake-broker within 2 s")
        subscribe(filters, timeout_s=timeout_s)

    monkeypatch.setattr(runner.client, "subscribe", no_suback)
    hub = broker.client(CONFIG).connect()
    hub.publish(names.dispatch_topic(job_id, CONFIG.topic_root),
                wire.encode(signed_dispatch(job_id, names.new_auth_token())), retain=True)
    wait_until(lambda: f"dispatch {job_id} not taken now: its retained state could not be read" in caplog.text,
               5.0, "the warning")
    assert runner.running == [] and result == []
    assert state_topic not in runner.client.filters  # type: ignore[union-attr]
    assert names.dispatch_topic(job_id, CONFIG.topic_root) in broker.retained


# ------------------------------------------------------------ §17: a clean end sends the outbox first

def pending_entry(root: Path) -> str:
    """A job of this runner's registry whose `started` is in the outbox, not acknowledged."""
    registry = Registry(root)
    job_id = "918b0612"
    registry.mirror(job_id=job_id, session=SESSION, attempt_id=1, dispatch_token="0" * 32,
                    auth_token="auth-token-for-the-unit-tests-0123456789", contract=Contract(), origin="hub",
                    source="runner")
    publish.record(registry, publish.PublishRequest(job_id, "started", attempt_id=1, dispatch_token="0" * 32),
                   source="runner")
    return job_id


def pending(root: Path) -> list[str]:
    return [slot.job_id for slot in Outbox(root).scan() if not slot.kept]


@pytest.mark.parametrize("broker_back", [True, False])
def test_s17_a_drained_runner_sends_its_outbox_before_it_exits_or_says_what_stays(
        broker, tmp_path, caplog, monkeypatch, broker_back):
    """Drained while the broker acknowledges nothing and an event waits in the outbox: the runner
    says it waits; a broker back within FLUSH_S gets the event and nothing stays; one that is not
    back leaves it, and the runner says which job's events stay for the next start."""
    caplog.set_level(logging.INFO, "mam.daemon")
    monkeypatch.setattr(service, "FLUSH_S", PATIENCE_S if broker_back else 0.3)
    root = tmp_path / "ws"
    runner = new_runner(broker, root)
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(runner.serve()), daemon=True)
    thread.start()
    wait_until(lambda: "online" in statuses(broker, runner.runner_id), 5.0, "presence online")
    broker.down = True
    job_id = pending_entry(root)
    runner.drain()
    if broker_back:
        wait_until(lambda: "unsent event(s) before exiting" in caplog.text, PATIENCE_S, "the runner waiting")
        broker.down = False
    thread.join(PATIENCE_S)
    assert result == [0]
    if broker_back:
        assert pending(root) == [] and broker.on_topic(names.events_topic(job_id, CONFIG.topic_root))
        assert "stay in" not in caplog.text
    else:
        assert pending(root) == [job_id]
        assert f"1 event(s) of job(s) {job_id} not acknowledged by the broker stay in" in caplog.text
