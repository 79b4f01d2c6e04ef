"""The SHIPPED broker configurations (deploy/nats, deploy/mosquitto) run by
real servers: nats-server from the wheel and Debian's mosquitto.

Each broker is started from the file in deploy/ with only ports, store and
certificate paths changed (for nats through the `MAM_*` variable lines of the
file, for mosquitto by replacing the listener and path lines, each of which
must match exactly once). Clients are `mam.shared.transport.mqtt.MqttClient`.

Covers: authentication (§13 credentials), the topic-root ACLs of the agent and
observer users over the topics of §2 (events §3, state §4, presence §7),
retained messages, MQTT over WebSocket at /mqtt, TLS 1.3 with a private CA and
optional client certificates.
"""

from __future__ import annotations

import os
import queue
import re
import secrets
import socket
import ssl
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from dotenv import dotenv_values
from harness import docker_env
from harness.brokers import free_port
from harness.shipped import (  # noqa: F401 - fixtures
    MOSQUITTO_BIN,
    NATS_BIN,
    REPO,
    ROOT,
    Broker,
    mosquitto_pair,
    nats_embedded,
    nats_plain,
    pki,
    receive,
    start_broker,
    start_mosquitto,
    start_nats,
    stop_broker,
)
from harness.waiting import PATIENCE_S, wait_until

from mam.orchestrator import init as mam_init
from mam.shared.config import broker_config
from mam.shared.protocol import names
from mam.shared.protocol.errors import BrokerError, BrokerUnavailable, PublishTimeout
from mam.shared.transport.mqtt import Message, MqttClient

pytestmark = [pytest.mark.broker, pytest.mark.timeout(60)]


@pytest.fixture(params=["nats", "mosquitto", "embedded"])
def broker(request) -> Broker:
    """Each ACL test runs against both shipped broker configs and the embedded broker of
    `mam-orch broker up` (its observer once could not read `#` nor use /mqtt)."""
    if request.param == "nats":
        return request.getfixturevalue("nats_plain")
    if request.param == "embedded":
        return request.getfixturevalue("nats_embedded")
    return request.getfixturevalue("mosquitto_pair")[0]


def job_id() -> str:
    return secrets.token_hex(4)


# ----------------------------------------------------------------- authentication

def test_anonymous_connection_is_refused(broker: Broker):
    """No anonymous access (§1.2: anonymous access is off; §13: credentials)."""
    with pytest.raises(BrokerUnavailable, match="refused"):
        MqttClient(broker.config(user="", password=""), "anon").connect(timeout_s=5)


@pytest.mark.parametrize("user", ["mam_agent", "mam_observer", "nobody"])
def test_wrong_password_is_refused(broker: Broker, user: str):
    with pytest.raises(BrokerUnavailable, match="refused") as info:
        MqttClient(broker.config(user=user, password="wrong-" + secrets.token_hex(8)), "bad").connect(timeout_s=5)
    assert "wrong-" not in str(info.value)  # the error never shows the password


def test_observer_password_does_not_log_in_as_agent(broker: Broker):
    with pytest.raises(BrokerUnavailable, match="refused"):
        MqttClient(broker.config(user="mam_agent", password=broker.observer_password), "x").connect(timeout_s=5)


# ----------------------------------------------------------------- agent rights

def test_agent_publishes_and_receives_retained_state_under_the_topic_root(broker: Broker):
    """§2/§4: a retained state published by a runner reaches a hub that subscribes later."""
    jid = job_id()
    with broker.client(role="runner") as runner:
        runner.publish(names.state_topic(jid, ROOT), b'{"state": 1}', qos=1, retain=True)
        runner.publish(names.events_topic(jid, ROOT), b'{"event": "completed"}', qos=1, retain=True)
    with broker.client(role="hub") as hub:
        hub.subscribe([(f"{ROOT}/jobs/{jid}/#", 1)])
        got: dict[str, Message] = {}
        wait_until(lambda: _drain(hub, got) and len(got) == 2, what="both retained messages")
        assert all(m.retain for m in got.values())
        assert got[names.state_topic(jid, ROOT)].payload == b'{"state": 1}'
        assert got[names.events_topic(jid, ROOT)].payload == b'{"event": "completed"}'


def _drain(client: MqttClient, into: dict[str, Message]) -> bool:
    while True:
        try:
            message = client.messages.get_nowait()
        except queue.Empty:
            return True
        into[message.topic] = message


def test_agent_cannot_publish_or_read_outside_the_topic_root(broker: Broker):
    """The agent's rights end at the topic root. nats-server refuses the
    subscription (SUBACK 0x80); mosquitto 2.0 grants it but delivers nothing,
    because nobody may publish there: the later marker arrives, the escape never."""
    with broker.client(role="a") as sender, broker.client(role="b") as receiver:
        try:
            receiver.subscribe([("elsewhere/#", 1)])
            refused = False
        except BrokerError as exc:
            assert "refused the subscription" in str(exc)
            refused = True
        assert refused == (broker.kind == "nats")
        receiver.subscribe([(f"{ROOT}/#", 1)])
        try:
            sender.publish("elsewhere/x", b"escaped", qos=1, timeout_s=3)
        except PublishTimeout:
            pass
        sender.publish(names.presence_topic("marker-box", ROOT), b"marker", qos=1)
        seen: list[Message] = []
        receive(receiver, lambda m: m.payload == b"marker", seen=seen)
        assert b"escaped" not in [m.payload for m in seen]


# ----------------------------------------------------------------- observer rights

def test_observer_watches_every_job_and_runner_with_wildcards(broker: Broker):
    """A dashboard sees events (§3) and state (§4) of every job and presence (§7) of every runner."""
    jobs = [job_id(), job_id()]
    with broker.client("mam_observer", role="observer") as observer, broker.client(role="runner") as runner:
        observer.subscribe([(f"{ROOT}/jobs/+/events", 1), (f"{ROOT}/jobs/+/state", 1),
                            (f"{ROOT}/runners/+", 1)])
        expected = set()
        for jid in jobs:
            for topic in (names.events_topic(jid, ROOT), names.state_topic(jid, ROOT)):
                runner.publish(topic, f"payload {topic}".encode(), qos=1)
                expected.add(topic)
        for session in ("gpu-box", "laptop"):
            topic = names.presence_topic(session, ROOT)
            runner.publish(topic, b'{"status": "online"}', qos=1, retain=True)
            expected.add(topic)
        got: set[str] = set()
        wait_until(lambda: _drain_topics(observer, got) >= expected, what=f"observer to see {expected}")


def test_observer_reads_the_whole_root_with_hash(broker: Broker):
    jid = job_id()
    with broker.client("mam_observer", role="observer") as observer, broker.client(role="runner") as runner:
        observer.subscribe([(f"{ROOT}/#", 1)])
        runner.publish(names.events_topic(jid, ROOT), b"e", qos=1)
        receive(observer, lambda m: m.topic == names.events_topic(jid, ROOT))


def _drain_topics(client: MqttClient, into: set[str]) -> set[str]:
    while True:
        try:
            into.add(client.messages.get_nowait().topic)
        except queue.Empty:
            return into


@pytest.mark.parametrize("leaf", ["control", "dispatch", "events"])
def test_nothing_an_observer_publishes_reaches_a_subscriber(broker: Broker, leaf: str):
    """The broker may PUBACK a forbidden PUBLISH silently; a second subscriber
    proves it was dropped: the hub's later marker arrives, the forgery never does,
    and a late subscriber finds no forged retained message (§5, §6)."""
    jid = job_id()
    topic = names.job_topic(jid, leaf, ROOT)
    marker_topic = names.state_topic(jid, ROOT)
    with broker.client(role="hub") as hub, broker.client("mam_observer", role="observer") as observer:
        hub.subscribe([(f"{ROOT}/#", 1)])
        try:
            observer.publish(topic, b"forged", qos=1, retain=True, timeout_s=3)
        except PublishTimeout:
            pass  # refusing to acknowledge is fine too
        hub.publish(marker_topic, b"marker", qos=1, retain=True)
        seen: list[Message] = []
        receive(hub, lambda m: m.payload == b"marker", seen=seen)
        assert b"forged" not in [m.payload for m in seen]
    with broker.client(role="late") as late:
        late.subscribe([(f"{ROOT}/jobs/{jid}/#", 1)])
        seen = []
        receive(late, lambda m: m.payload == b"marker", seen=seen)
        assert b"forged" not in [m.payload for m in seen]


def test_observer_subscription_outside_the_topic_root_gets_nothing(broker: Broker):
    """nats-server refuses it; mosquitto 2.0 grants it but the ACL gives no read."""
    with broker.client("mam_observer") as observer:
        try:
            observer.subscribe([("elsewhere/#", 1)])
            assert broker.kind == "mosquitto"
        except BrokerError as exc:
            assert broker.kind == "nats" and "refused the subscription" in str(exc)


# ----------------------------------------------------------------- WebSocket

def test_mqtt_over_websocket_at_slash_mqtt_receives_job_events(broker: Broker):
    """A dashboard on ws://<broker>:<ws port>/mqtt (paho transport websockets) sees a job's events."""
    jid = job_id()
    cfg = broker.config("mam_observer", port=broker.ws_port, transport="websockets", ws_path="/mqtt")
    with MqttClient(cfg, "dashboard").connect(timeout_s=PATIENCE_S) as dashboard, \
            broker.client(role="runner") as runner:
        dashboard.subscribe([(f"{ROOT}/jobs/+/events", 1)])
        for n in (1, 2):
            runner.publish(names.events_topic(jid, ROOT), f'{{"seq": {n}}}'.encode(), qos=1)
        seen: list[Message] = []
        receive(dashboard, lambda m: m.payload == b'{"seq": 2}', seen=seen)
        mine = [m.payload for m in seen if m.topic == names.events_topic(jid, ROOT)]
        assert mine == [b'{"seq": 1}', b'{"seq": 2}']


def test_websocket_listener_refuses_anonymous_mqtt(broker: Broker):
    cfg = broker.config("", password="", port=broker.ws_port, transport="websockets", ws_path="/mqtt")
    with pytest.raises(BrokerUnavailable, match="refused"):
        MqttClient(cfg, "anon").connect(timeout_s=5)


def test_nats_websocket_speaks_mqtt_only_at_slash_mqtt(nats_plain: Broker):
    """nats-server's websocket listener serves NATS at other paths: an MQTT
    client there gets no CONNACK (what deploy/nats/nats.conf says)."""
    cfg = nats_plain.config("mam_observer", port=nats_plain.ws_port, transport="websockets", ws_path="/")
    with pytest.raises(BrokerUnavailable):
        MqttClient(cfg, "wrongpath").connect(timeout_s=2)


# ----------------------------------------------------------------- TLS

@pytest.fixture(scope="module")
def nats_tls(tmp_path_factory, pki) -> Iterator[Broker]:
    broker = start_nats(tmp_path_factory.mktemp("nats-tls"), tls=True, pki=pki)
    yield broker
    stop_broker(broker.proc)


@pytest.fixture(scope="module")
def nats_mtls(tmp_path_factory, pki) -> Iterator[Broker]:
    broker = start_nats(tmp_path_factory.mktemp("nats-mtls"), tls=True, pki=pki, verify_clients=True)
    yield broker
    stop_broker(broker.proc)


@pytest.fixture(scope="module")
def mosquitto_mtls(tmp_path_factory, pki) -> Iterator[Broker]:
    if not MOSQUITTO_BIN.exists():
        pytest.skip("mosquitto is not installed (/usr/sbin/mosquitto)")
    base, secured = start_mosquitto(tmp_path_factory.mktemp("mosq-mtls"), pki, require_certificate=True)
    yield secured
    stop_broker(base.proc, base.folder)


@pytest.fixture(params=["nats", "mosquitto"])
def tls_broker(request) -> Broker:
    if request.param == "nats":
        return request.getfixturevalue("nats_tls")
    return request.getfixturevalue("mosquitto_pair")[1]


@pytest.fixture(params=["nats", "mosquitto"])
def mtls_broker(request) -> Broker:
    return request.getfixturevalue("nats_mtls" if request.param == "nats" else "mosquitto_mtls")


def _handshake(port: int, cafile: Path, max_version: ssl.TLSVersion | None = None,
               cert: tuple[Path, Path] | None = None) -> str:
    """A raw TLS handshake; returns the negotiated version."""
    context = ssl.create_default_context(cafile=str(cafile))
    if max_version is not None:
        context.maximum_version = max_version
    if cert is not None:
        context.load_cert_chain(str(cert[0]), str(cert[1]))
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
        with context.wrap_socket(raw, server_hostname="localhost") as tls:
            return str(tls.version())


def test_tls_listener_negotiates_tls_1_3_and_authenticates(tls_broker: Broker):
    assert _handshake(tls_broker.mqtt_port, tls_broker.pki.ca) == "TLSv1.3"
    jid = job_id()
    with tls_broker.client(role="runner") as runner, tls_broker.client("mam_observer") as observer:
        observer.subscribe([(f"{ROOT}/jobs/+/events", 1)])
        runner.publish(names.events_topic(jid, ROOT), b"over tls", qos=1)
        receive(observer, lambda m: m.payload == b"over tls")


def test_tls_listener_refuses_tls_1_2(tls_broker: Broker):
    with pytest.raises((ssl.SSLError, ConnectionResetError)):
        _handshake(tls_broker.mqtt_port, tls_broker.pki.ca, max_version=ssl.TLSVersion.TLSv1_2)


# paho leaks the TLS socket of a failed handshake (it never reaches paho's
# client._sock, so mam.shared.transport.mqtt cannot close it): ignore that warning here only.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_client_that_does_not_trust_the_ca_is_refused(tls_broker: Broker):
    with pytest.raises(ssl.SSLCertVerificationError):
        _handshake(tls_broker.mqtt_port, tls_broker.pki.rogue_ca)
    cfg = tls_broker.config(ca_certs=str(tls_broker.pki.rogue_ca))
    with pytest.raises(BrokerUnavailable):
        MqttClient(cfg, "untrusting").connect(timeout_s=5)


def test_tls_listener_still_needs_a_password(tls_broker: Broker):
    with pytest.raises(BrokerUnavailable, match="refused"):
        MqttClient(tls_broker.config(password="wrong"), "x").connect(timeout_s=5)


def test_nats_tls_websocket_serves_mqtt_over_wss(nats_tls: Broker):
    assert _handshake(nats_tls.ws_port, nats_tls.pki.ca) == "TLSv1.3"
    cfg = nats_tls.config("mam_observer", port=nats_tls.ws_port, transport="websockets", ws_path="/mqtt")
    with MqttClient(cfg, "wss").connect(timeout_s=PATIENCE_S) as dashboard:
        dashboard.subscribe([(f"{ROOT}/runners/+", 1)])


def test_client_certificate_required_refuses_a_client_without_one(mtls_broker: Broker):
    with pytest.raises(BrokerUnavailable):
        MqttClient(mtls_broker.config(), "nocert").connect(timeout_s=5)


def test_client_certificate_required_accepts_a_client_with_one(mtls_broker: Broker):
    pki = mtls_broker.pki
    cfg = mtls_broker.config(certfile=str(pki.client_cert), keyfile=str(pki.client_key))
    with MqttClient(cfg, "withcert").connect(timeout_s=PATIENCE_S) as client:
        client.subscribe([(f"{ROOT}/runners/+", 1)])


# ----------------------------------------------------------------- init → broker

def test_init_output_starts_the_shipped_broker_and_its_credentials_work(tmp_path: Path):
    """`mam-orch init --broker-config` → nats-server with nats.env → a client
    configured from .mam.env (§13) connects; the observer password from nats.env
    connects read-only."""


    ws = tmp_path / "ws"
    ws.mkdir()
    conf = tmp_path / "nats.conf"
    mqtt_port = free_port()
    result = subprocess.run([str(REPO / ".venv" / "bin" / "mam-orch"), "init", "--workspace", str(ws),
                             "--broker-config", str(conf), "--broker", "127.0.0.1", "--port", str(mqtt_port)],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    secrets_env = dotenv_values(conf.with_name("nats.env"))
    for value in secrets_env.values():
        assert value and value not in result.stdout + result.stderr
    text = mam_init.set_conf_variables(conf.read_text(), {
        "MAM_WS_PORT": free_port(), "MAM_NATS_PORT": free_port(), "MAM_STORE_DIR": str(tmp_path / "js")})
    conf.write_text(text)
    env = {"PATH": os.environ.get("PATH", ""), **{k: str(v) for k, v in secrets_env.items()}}
    proc = start_broker("nats-server", [str(NATS_BIN), "-c", str(conf)], env, tmp_path / "log", [mqtt_port])
    try:
        cfg = broker_config(environ={"MAM_ENV_FILE": str(ws / ".mam.env")}, warn=False)
        assert cfg.port == mqtt_port and cfg.username == "mam_agent"
        with MqttClient(cfg, "hub").connect(timeout_s=PATIENCE_S) as hub:
            hub.subscribe([(f"{cfg.topic_root}/#", 1)])
        observer = cfg.with_overrides(username="mam_observer", password=secrets_env["MAM_OBSERVER_PASS"])
        with MqttClient(observer, "dash").connect(timeout_s=PATIENCE_S):
            pass
    finally:
        stop_broker(proc)


# ----------------------------------------------------------------- compose files

COMPOSE_FILES = sorted(p for p in (REPO / "deploy").rglob("docker-compose*.yaml")) + \
    sorted((REPO / "tests" / "e2e").glob("docker-compose*.yaml"))


@pytest.mark.parametrize("path", COMPOSE_FILES, ids=lambda p: str(p.relative_to(REPO)))
def test_compose_file_validates(path: Path, tmp_path: Path):
    """Every shipped compose file is valid for the compose installed here, v1 (Debian's
    docker-compose 1.29: no top-level `name:`) or v2."""
    compose = docker_env.compose_command()
    if compose is None:
        pytest.skip("neither docker-compose (v1) nor `docker compose` (v2) is installed")
    env = dict(os.environ)
    for name in ("MAM_BROKER_PASS", "MAM_OBSERVER_PASS", "MAM_HOME_PASS", "MAM_SYS_PASS",
                 "TS_AUTHKEY", "MAM_SESSION", "MAM_DISPATCH_SECRET", "MQTT_PASSWORD"):
        env.setdefault(name, "placeholder-" + name.lower())
    env.setdefault("MAM_E2E_GIT", str(tmp_path))  # the e2e's git server repositories: a host folder
    result = subprocess.run([*compose, "-p", "mam-check", "-f", str(path), "--profile", "plain", "--profile", "tls",
                             "config", "--quiet"], capture_output=True, text=True, env=env, timeout=60,
                            cwd=path.parent)
    assert result.returncode == 0, result.stderr


def test_compose_files_exist_and_name_the_pinned_nats_image():
    """Structural check that runs everywhere (no compose plugin needed)."""
    nats = (REPO / "deploy" / "nats" / "docker-compose.yaml").read_text()
    assert re.search(r"image:\s*nats:2\.12-alpine", nats)
    assert "nats-data:/data" in nats
    assert len(COMPOSE_FILES) >= 4
