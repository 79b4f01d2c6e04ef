"""`mam.shared.transport.mqtt` against real brokers (nats-server and mosquitto): QoS 1,
retained state (§2, §4), reconnect and re-subscribe (§10), fail-over and
retries (§13), the observer's read-only rights, and secrets kept out of text."""

from __future__ import annotations

import datetime
import ipaddress
import logging
import queue
import signal
import socket
import time

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from harness.brokers import NatsBroker, free_port
from harness.procs import stopped
from harness.waiting import PATIENCE_S, wait_until

from mam.shared.config import BrokerConfig
from mam.shared.protocol import names
from mam.shared.protocol.errors import BrokerError, BrokerUnavailable, PublishTimeout
from mam.shared.transport import mqtt

pytestmark = [pytest.mark.broker, pytest.mark.e2e]

JOB = "0123abcd"
ASYNC_LOST_PUBACK_S = 0.5  # no broker: this PUBACK never comes


def _next(client: mqtt.MqttClient, timeout_s: float = PATIENCE_S) -> mqtt.Message:
    return client.messages.get(timeout=timeout_s)


def _no_delay(client: mqtt.MqttClient) -> bool:
    """True when the client's TCP socket (under a websocket too) has TCP_NODELAY set."""
    sock = client._paho().socket()
    raw = getattr(sock, "_socket", sock)
    return bool(raw.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))


def _drain_until(client: mqtt.MqttClient, payload: bytes, timeout_s: float = PATIENCE_S) -> list[bytes]:
    """Every payload received up to and including `payload` (a sentinel), in order."""
    seen: list[bytes] = []
    deadline = time.monotonic() + timeout_s
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise AssertionError(f"sentinel {payload!r} not received; got {seen!r}")
        try:
            msg = client.messages.get(timeout=remaining)
        except queue.Empty:
            continue
        seen.append(msg.payload)
        if msg.payload == payload:
            return seen


def test_qos1_publish_gets_puback_and_reaches_subscriber(broker):
    """§2: QoS 1 publish returns only after the PUBACK; the subscriber receives it."""
    topic = names.events_topic(JOB, broker.topic_root)
    with mqtt.MqttClient(broker.config(), "hub") as sub, mqtt.MqttClient(broker.config(), "runner") as pub:
        sub.subscribe([(topic, mqtt.QOS_AT_LEAST_ONCE)])
        pub.publish(topic, b'{"seq": 1}', qos=mqtt.QOS_AT_LEAST_ONCE)
        msg = _next(sub)
    assert msg == mqtt.Message(topic=topic, payload=b'{"seq": 1}', retain=False)
    assert sub.client_id.startswith("test-hub-") and pub.client_id.startswith("test-runner-")


def test_retained_state_reaches_late_subscriber_and_clears(broker):
    """§2/§4: a retained message is delivered to a subscriber that comes later;
    a zero-length retained publish clears it."""
    topic = names.state_topic(JOB, broker.topic_root)
    mqtt.publish_with_retry(broker.config(), "runner", [(topic, b'{"state": 1}', True)])
    with mqtt.MqttClient(broker.config(user="observer"), "observer") as late:
        late.subscribe([(names.all_jobs_filter(broker.topic_root), 1)])
        msg = _next(late)
    assert (msg.topic, msg.payload, msg.retain) == (topic, b'{"state": 1}', True)

    mqtt.publish_with_retry(broker.config(), "hub", [(topic, b"", True)])
    sentinel = names.events_topic(JOB, broker.topic_root)
    mqtt.publish_with_retry(broker.config(), "hub", [(sentinel, b"end", True)])
    with mqtt.MqttClient(broker.config(), "hub") as later:
        later.subscribe([(names.all_jobs_filter(broker.topic_root), 1)])
        got = [_next(later)]
        # the cleared state topic must not come back: only the sentinel is retained
        assert [(m.topic, m.payload) for m in got] == [(sentinel, b"end")]
        with pytest.raises(queue.Empty):
            later.messages.get_nowait()


def test_speed_packets_leave_at_once_tcp_nodelay(broker):
    """Paho leaves Nagle on, so a packet sent while the previous one awaits
    its TCP ACK (the runner's SUBSCRIBE of the §17 state read right after the dispatch's PUBACK,
    a state after its event) waited for the broker's delayed ACK (~40 ms a take). Every
    connection sets TCP_NODELAY."""
    with mqtt.MqttClient(broker.config(), "runner") as client:
        assert _no_delay(client)


def test_reconnect_after_broker_crash_resubscribes_and_logs(broker, caplog):
    """§10 broker loss: after SIGKILL and restart the client reconnects by itself,
    logs `reconnected`, sets `reconnected`, and its subscription works again."""
    caplog.set_level(logging.INFO, logger="mam.mqtt")
    topic = names.presence_topic("gpu-box", broker.topic_root)
    sub = mqtt.MqttClient(broker.config(), "hub").connect()
    try:
        sub.subscribe([(topic, 1)])
        broker.kill()
        wait_until(lambda: not sub.connected.is_set(), what="the client to notice the crash")
        broker.restart()
        wait_until(sub.reconnected.is_set, what="the client to reconnect")
        assert sub.connected.is_set() and sub.reconnect_count == 1
        assert _no_delay(sub)  # the new socket too
        assert any("reconnected" in r.getMessage() for r in caplog.records)

        def delivered() -> bool:  # the re-SUBSCRIBE may still be in flight: publish until it lands
            mqtt.publish_with_retry(broker.config(), "runner", [(topic, b"online", False)])
            try:
                return sub.messages.get(timeout=0.5).payload == b"online"
            except queue.Empty:
                return False

        wait_until(delivered, what="a message through the re-subscribed filter")
    finally:
        sub.close()
    sub.close()  # idempotent


def test_s10_after_a_reconnect_filters_are_subscribed_again_later_so_retained_messages_come_again(broker):
    """A NATS cluster electing leaders may answer a re-SUBSCRIBE late or never, or store a retained
    dispatch only after the new subscription looked: the client subscribes again after
    `resubscribe_again_s`, and the broker hands the retained message over once more (§10)."""
    topic = names.dispatch_topic("0a1b2c3d", broker.topic_root)
    mqtt.publish_with_retry(broker.config(), "hub", [(topic, b"dispatch", True)])
    sub = mqtt.MqttClient(broker.config(), "runner", resubscribe_again_s=(0.5,)).connect()
    try:
        sub.subscribe([(topic, 1)])
        assert sub.messages.get(timeout=PATIENCE_S).retain
        # another connection with the same client id: the broker closes ours, which reconnects
        with mqtt.MqttClient(broker.config(), "thief", client_id=sub.client_id) as thief:
            thief.connect()
        wait_until(sub.reconnected.is_set, what="the client to reconnect")
        retained = []
        wait_until(lambda: retained.extend(m for m in _drain(sub) if m.retain) or len(retained) >= 2,
                   what="the retained message at the re-subscribe and again after resubscribe_again_s")
        assert {m.payload for m in retained} == {b"dispatch"}
    finally:
        sub.close()


def _drain(client: mqtt.MqttClient) -> list[mqtt.Message]:
    out = []
    while True:
        try:
            out.append(client.messages.get_nowait())
        except queue.Empty:
            return out


def test_broker_unavailable_when_nothing_listens():
    """§13: nothing on the port → BrokerUnavailable at once, naming host:port and the reason."""
    port = free_port()
    config = BrokerConfig(hosts=("127.0.0.1",), port=port, username="u", password="s3cret-never-shown")
    with pytest.raises(BrokerUnavailable) as info:
        mqtt.MqttClient(config, "hub").connect()
    text = str(info.value)
    assert f"127.0.0.1:{port}" in text and "connection refused" in text  # refused, not the CONNACK deadline
    assert "s3cret-never-shown" not in text and "\n" not in text


def test_wrong_password_is_refused_without_showing_it(broker, caplog):
    """§13: bad credentials → BrokerUnavailable naming the refusal; the password is
    nowhere: exception text, repr of config and client, log records."""
    caplog.set_level(logging.DEBUG)
    config = broker.config(password="wrong-password-xyz")
    client = mqtt.MqttClient(config, "hub")
    with pytest.raises(BrokerUnavailable) as info:
        client.connect(timeout_s=5)
    text = str(info.value)
    assert "refused" in text and f":{broker.mqtt_port}" in text
    for shown in (text, repr(config), str(config), repr(client), caplog.text):
        assert "wrong-password-xyz" not in shown
        assert broker.agent_password not in shown
    client.close()


def test_failover_to_second_host_when_first_is_down(broker):
    """§13: MQTT_BROKER is a fail-over list tried in order; the first host is down."""
    config = broker.config(hosts=("127.0.0.2", "127.0.0.1"))  # nothing listens on 127.0.0.2
    with mqtt.MqttClient(config, "hub") as client:
        assert client.host == "127.0.0.1" and client.connected.is_set()
        topic = names.events_topic(JOB, broker.topic_root)
        client.subscribe([(topic, 1)])
        client.publish(topic, b"via-second")
        assert _next(client).payload == b"via-second"


def test_publish_with_retry_reports_broker_unavailable_and_backs_off(broker):
    """§13/§9: with the broker down every attempt fails; the caller gets
    BrokerUnavailable (publish exits 2/3) after delays 0.5, 1.0 s."""
    broker.stop()
    delays: list[float] = []
    with pytest.raises(BrokerUnavailable):
        mqtt.publish_with_retry(broker.config(), "publish",
                                [(names.events_topic(JOB, broker.topic_root), b"x", False)],
                                attempts=3, sleep=delays.append)
    assert delays == [0.5, 1.0]
    assert [mqtt.retry_delay_s(a) for a in (1, 2, 3, 4, 5, 6)] == [0.5, 1.0, 2.0, 4.0, 8.0, 8.0]


def test_publish_with_retry_succeeds_when_broker_returns_exactly_once(broker):
    """§13: attempt 1 finds no broker, the broker returns during the back-off,
    attempt 2 delivers every message once, in order."""
    topic = names.events_topic(JOB, broker.topic_root)
    broker.stop()
    delays: list[float] = []

    def back_off(delay_s: float) -> None:
        delays.append(delay_s)
        broker.restart()

    mqtt.publish_with_retry(broker.config(), "publish",
                            [(topic, b"one", True), (topic, b"two", True)], attempts=3, sleep=back_off)
    assert delays == [0.5]
    with mqtt.MqttClient(broker.config(), "hub") as sub:
        sub.subscribe([(topic, 1)])
        assert _next(sub).payload == b"two"  # the retained copy is the last one


def test_publish_async_keeps_call_order_and_its_waiter_raises_like_publish(broker):
    """§2, §13: `publish_async` queues and returns; its waiter returns once the PUBACK came,
    the wire order is the call order, and without a broker the waiter raises PublishTimeout."""
    topic = names.events_topic(JOB, broker.topic_root)
    with mqtt.MqttClient(broker.config(), "hub") as sub, mqtt.MqttClient(broker.config(), "runner") as pub:
        sub.subscribe([(topic, mqtt.QOS_AT_LEAST_ONCE)])
        first = pub.publish_async(topic, b"first", timeout_s=PATIENCE_S)
        pub.publish(topic, b"second", timeout_s=PATIENCE_S)
        first()
        assert _drain_until(sub, b"second") == [b"first", b"second"]
        broker.kill()
        wait_until(lambda: not pub.connected.is_set(), what="the publisher to notice the crash")
        lost = pub.publish_async(topic, b"third", timeout_s=ASYNC_LOST_PUBACK_S)
        with pytest.raises(PublishTimeout):
            lost()


def test_message_queued_while_disconnected_is_never_resent_after_close(broker):
    """§13: paho queues a publish made while disconnected; closing the client
    drops that queue, so the retry with a new client is the only copy on the wire."""
    topic = names.events_topic(JOB, broker.topic_root)
    old = mqtt.MqttClient(broker.config(), "publish").connect()
    broker.kill()
    wait_until(lambda: not old.connected.is_set(), what="the publisher to notice the crash")
    with pytest.raises(BrokerUnavailable):
        old._publish(topic, b"payload", 1, False, 2.0, fail_on_disconnect=True)()
    old_paho = old._client
    assert old_paho is not None and len(old_paho._out_messages) == 1  # the hazard is real
    old.close()
    assert old_paho._thread is None  # no network thread left that could reconnect and resend

    broker.restart()
    with mqtt.MqttClient(broker.config(), "hub") as sub:
        sub.subscribe([(topic, 1)])
        mqtt.publish_with_retry(broker.config(), "publish", [(topic, b"payload", False)])
        mqtt.publish_with_retry(broker.config(), "publish", [(topic, b"sentinel", False)])
        assert _drain_until(sub, b"sentinel") == [b"payload", b"sentinel"]


def test_observer_reads_but_cannot_publish(broker):
    """§1.2: mam_observer may subscribe under the topic root and
    nothing it publishes reaches other clients."""
    topic = names.control_topic(JOB, broker.topic_root)
    with mqtt.MqttClient(broker.config(), "hub") as agent, \
            mqtt.MqttClient(broker.config(user="observer"), "observer") as observer:
        agent.subscribe([(topic, 1)])
        observer.subscribe([(topic, 1)])
        try:
            observer.publish(topic, b"forged-cancel", retain=True, timeout_s=2)
        except BrokerError:
            pass  # refusing outright is as good as dropping it
        mqtt.publish_with_retry(broker.config(), "hub", [(topic, b"sentinel", False)])
        assert _drain_until(agent, b"sentinel") == [b"sentinel"]
        assert _drain_until(observer, b"sentinel")[-1] == b"sentinel"
    with mqtt.MqttClient(broker.config(), "hub") as late:
        late.subscribe([(topic, 1)])
        with pytest.raises(queue.Empty):  # nothing retained by the observer
            late.messages.get(timeout=0.5)


def test_nats_observer_subscription_outside_root_is_refused(nats_broker):
    """The observer's subscribe rights end at the topic root: SUBACK failure → BrokerError."""
    with mqtt.MqttClient(nats_broker.config(user="observer"), "observer") as observer:
        with pytest.raises(BrokerError, match="refused the subscription"):
            observer.subscribe([("other/root/#", 1)])


def test_nats_observer_reads_a_topic_root_with_a_dot(tmp_path):
    """nats-server maps MQTT '.' to '//' in subjects; the observer's rights follow that mapping."""

    handle = NatsBroker(tmp_path, topic_root="fleet/v1.2").start()
    try:
        topic = names.state_topic(JOB, handle.topic_root)
        with mqtt.MqttClient(handle.config(user="observer"), "observer") as observer:
            observer.subscribe([(names.all_jobs_filter(handle.topic_root), 1)])
            mqtt.publish_with_retry(handle.config(), "runner", [(topic, b"dotted", False)])
            assert _next(observer).payload == b"dotted"
    finally:
        handle.stop()


def test_nats_mqtt_over_websocket(nats_broker):
    """§1.3: MQTT over WebSocket on path /mqtt of the websocket listener."""
    config = nats_broker.config(transport="websockets", port=nats_broker.ws_port, ws_path="/mqtt")
    topic = names.events_topic(JOB, nats_broker.topic_root)
    with mqtt.MqttClient(config, "dashboard") as client:
        assert _no_delay(client)
        client.subscribe([(topic, 1)])
        client.publish(topic, b"over-ws")
        assert _next(client).payload == b"over-ws"


def test_last_will_is_published_when_the_client_dies(broker):
    """§7: the retained Last Will is published when a client vanishes without DISCONNECT."""
    topic = names.presence_topic("gpu-box", broker.topic_root)
    with mqtt.MqttClient(broker.config(), "hub") as hub:
        hub.subscribe([(topic, 1)])
        runner = mqtt.MqttClient(broker.config(keepalive_s=1), "runner",
                                 will=(topic, b"offline", 1, True)).connect()
        runner._client._sock.close()  # simulate a crash: the socket goes away, no DISCONNECT
        assert _next(hub, 15).payload == b"offline"
        runner.close()


def test_publish_timeout_when_broker_hangs(broker):
    """§13: a broker that accepts but never acknowledges → PublishTimeout after the deadline."""
    topic = names.events_topic(JOB, broker.topic_root)
    with mqtt.MqttClient(broker.config(), "runner") as client:
        broker.proc.send_signal(signal.SIGSTOP)
        try:
            # on a busy machine a thread of the broker runs on (and acknowledges) until the stop reaches it
            wait_until(lambda: stopped(broker.proc.pid), what="every thread of the broker to be stopped")
            with pytest.raises(PublishTimeout):
                client.publish(topic, b"x", timeout_s=0.5)
        finally:
            broker.proc.send_signal(signal.SIGCONT)


def test_message_repr_hides_payload():
    """Payloads may carry auth tokens: Message repr shows only the size."""
    msg = mqtt.Message(topic="t", payload=b"auth_token=secret", retain=False)
    assert "secret" not in repr(msg) and "17 bytes" in repr(msg)
    assert mqtt.new_client_id("hermes", "hub").startswith("hermes-hub-")
    assert mqtt.new_client_id("hermes", "hub") != mqtt.new_client_id("hermes", "hub")


def _write_pki(directory):
    """A CA, a server certificate for 127.0.0.1 and a client certificate (PEM files)."""


    now = datetime.datetime.now(datetime.UTC)

    def cert(subject, key, issuer, issuer_key, *, ca=False, server=False):
        builder = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
                   .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if server:
            builder = builder.add_extension(x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            builder = builder.add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        elif not ca:
            builder = builder.add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        return builder.sign(issuer_key, hashes.SHA256())

    paths = {}
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = cert("mam-test-ca", ca_key, "mam-test-ca", ca_key, ca=True)
    for name, key, crt in [("ca", ca_key, ca)] + [
            (n, k, cert(n, k, "mam-test-ca", ca_key, server=(n == "server")))
            for n, k in (("server", ec.generate_private_key(ec.SECP256R1())),
                         ("client", ec.generate_private_key(ec.SECP256R1())))]:
        (directory / f"{name}.crt").write_bytes(crt.public_bytes(serialization.Encoding.PEM))
        (directory / f"{name}.key").write_bytes(key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
        paths[name] = (str(directory / f"{name}.crt"), str(directory / f"{name}.key"))
    return paths


def test_mutual_tls_with_mosquitto(mosquitto_broker, tmp_path):
    """§13: MQTT_TLS with MQTT_CA_CERTS, MQTT_CERTFILE and MQTT_KEYFILE (mTLS); a client
    without a certificate or trusting another CA is refused."""
    pki = _write_pki(tmp_path)
    tls_port = free_port()
    conf = mosquitto_broker.config_path
    conf.write_text(conf.read_text() + "\n".join([
        f"listener {tls_port} 127.0.0.1",
        f"cafile {pki['ca'][0]}", f"certfile {pki['server'][0]}", f"keyfile {pki['server'][1]}",
        "require_certificate true", "tls_version tlsv1.2", ""]))
    mosquitto_broker.restart()
    base = mosquitto_broker.config(port=tls_port, tls=True, ca_certs=pki["ca"][0])
    good = base.with_overrides(certfile=pki["client"][0], keyfile=pki["client"][1])
    topic = names.events_topic(JOB, mosquitto_broker.topic_root)
    with mqtt.MqttClient(good, "runner") as client:
        client.subscribe([(topic, 1)])
        client.publish(topic, b"over-mtls")
        assert _next(client).payload == b"over-mtls"
    with pytest.raises(BrokerUnavailable):  # no client certificate
        mqtt.MqttClient(base, "runner").connect(timeout_s=5)
    with pytest.raises(BrokerUnavailable):  # server certificate not trusted by the system CAs
        mqtt.MqttClient(good.with_overrides(ca_certs=""), "runner").connect(timeout_s=5)
