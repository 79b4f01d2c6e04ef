"""§13 fail-over along MQTT_BROKER and §10 re-subscribe in `mam.shared.transport.mqtt.MqttClient`,
driven through its paho callbacks with a stand-in paho client (no network, no broker).
The same behaviour against a real three-node cluster: tests/e2e/test_cluster.py."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from harness.waiting import PATIENCE_S, wait_until

from mam.shared.config import BrokerConfig
from mam.shared.transport import mqtt

pytestmark = pytest.mark.timeout(30)

SUBACK_OK = 1  # granted QoS 1


class StandIn:
    """What MqttClient touches on paho's client from its callbacks: `_host`, `subscribe`."""

    def __init__(self, host: str) -> None:
        self._host = host
        self.subscribed: list[list[tuple[str, int]]] = []

    def subscribe(self, filters: list[tuple[str, int]]) -> tuple[int, int]:
        self.subscribed.append(list(filters))
        return 0, len(self.subscribed)


def connected_client(hosts: tuple[str, ...]) -> tuple[mqtt.MqttClient, Any]:
    """A client that is connected (once) to hosts[0], as `connect()` leaves it."""
    client = mqtt.MqttClient(BrokerConfig(hosts=hosts), "test")
    paho = StandIn(hosts[0])
    client._client, client._host, client._connect_count = paho, hosts[0], 1  # type: ignore[assignment]
    client.connected.set()
    return client, paho


def test_s13_a_lost_connection_and_each_failed_attempt_move_to_the_next_host_round_robin():
    client, paho = connected_client(("nats-1", "nats-2", "nats-3"))
    client._on_disconnect(paho, None, None, "connection lost")
    assert (paho._host, client.host) == ("nats-2", "nats-2")
    client._next_host(paho, None)  # paho's on_connect_fail: nats-2 refused the TCP connection
    assert paho._host == "nats-3"
    client._on_disconnect(paho, None, None, "closed before CONNACK")  # a node without JetStream leaders
    assert paho._host == "nats-1"


def test_s13_one_host_first_connect_and_close_do_not_rotate():
    single, paho = connected_client(("hub",))
    single._on_disconnect(paho, None, None, "connection lost")
    assert paho._host == "hub"
    fresh = mqtt.MqttClient(BrokerConfig(hosts=("a", "b")), "test")
    other = StandIn("a")
    fresh._host = "a"
    fresh._on_disconnect(other, None, None, "refused")  # connect() itself walks the list
    assert other._host == "a"
    closing, paho2 = connected_client(("a", "b"))
    closing._closed = True
    closing._on_disconnect(paho2, None, None, "closed by us")
    assert paho2._host == "a"


def test_s10_a_refused_resubscribe_after_a_reconnect_is_sent_again_until_accepted():
    client, paho = connected_client(("nats-1", "nats-2"))
    client._filters = {"root/jobs/+/dispatch": 1, "root/runners/x": 1}
    client._resubscribe(paho, list(client._filters.items()))
    client._on_subscribe(paho, None, 1, [SUBACK_OK, mqtt.SUBACK_FAILURE])
    wait_until(lambda: len(paho.subscribed) == 2, PATIENCE_S, "the refused filter to be sent again")
    assert paho.subscribed[1] == [("root/runners/x", 1)]
    client._on_subscribe(paho, None, 2, [SUBACK_OK])
    assert client._resubscribing == {} and client._subacked == {}


def test_s10_a_filter_unsubscribed_meanwhile_is_not_sent_again():
    client, paho = connected_client(("nats-1", "nats-2"))
    client._resubscribe(paho, [("gone/#", 1)])
    assert paho.subscribed == []


def test_s13_a_failover_list_caps_the_reconnect_backoff_at_2_s():
    """One broker: paho's backoff doubles 1, 2, 4, 8 s. A fail-over list: at most 2 s between
    two nodes (a cluster node electing leaders holds a CONNECT for up to 5 s before failing it)."""
    assert mqtt.reconnect_max_delay_s(("hub",)) == 8
    assert mqtt.reconnect_max_delay_s(("nats-1", "nats-2", "nats-3")) == 2
    for hosts, cap in ((("hub",), 8), (("nats-1", "nats-2"), 2)):
        paho = mqtt.MqttClient(BrokerConfig(hosts=hosts), "test")._new_paho()
        assert (paho._reconnect_min_delay, paho._reconnect_max_delay) == (1, cap)


class Reason:
    is_failure = False


def test_s10_a_reconnect_while_waiting_for_a_suback_ends_the_wait_and_resends_the_filters():
    client, paho = connected_client(("nats-1", "nats-2"))
    client.resubscribe_again_s = ()
    outcome: list[object] = []

    def subscribe() -> None:
        try:
            client.subscribe([("root/jobs/+/events", 1)], timeout_s=PATIENCE_S)
            outcome.append("subscribed")
        except mqtt.BrokerUnavailable as exc:
            outcome.append(exc)

    waiting = threading.Thread(target=subscribe)
    waiting.start()
    wait_until(lambda: len(paho.subscribed) == 1, PATIENCE_S, "the SUBSCRIBE to be sent")
    client._on_disconnect(paho, None, None, "connection lost")  # its SUBACK never comes
    client._on_connect(paho, None, None, Reason())
    waiting.join(2 * PATIENCE_S)
    assert outcome == ["subscribed"]  # at once, not BrokerUnavailable after PATIENCE_S
    assert paho.subscribed[-1] == [("root/jobs/+/events", 1)]  # the new connection sent it again
    assert client._filters == {"root/jobs/+/events": 1}


def test_s10_no_suback_and_no_reconnect_is_broker_unavailable():
    client, _paho = connected_client(("nats-1",))
    with pytest.raises(mqtt.BrokerUnavailable, match="no SUBACK"):
        client.subscribe([("root/runners/+", 1)], timeout_s=0.2)


class Publishing(StandIn):
    """paho's `publish`, every message given the same mid (as paho does once its mids wrap)."""

    def publish(self, topic: str, payload: bytes, qos: int = 1, retain: bool = False) -> Any:
        return type("Info", (), {"rc": mqtt.MQTTErrorCode.MQTT_ERR_SUCCESS, "mid": 7})()


def test_s10_a_puback_that_comes_after_its_wait_gave_up_acknowledges_no_later_publish():
    """A beat (or a hub probe) that timed out, then its late PUBACK: the next publish that gets
    the same mid must wait for its own PUBACK, not take the old one for it (§10 "Leases")."""
    client = mqtt.MqttClient(BrokerConfig(hosts=("h1",)), "test")
    client._client, client._host = Publishing("h1"), "h1"  # type: ignore[assignment]
    client.connected.set()
    with pytest.raises(mqtt.PublishTimeout):
        client.publish_async("t", b"x", timeout_s=0.01)()
    client._on_publish(None, None, 7)  # the late PUBACK of the abandoned message
    with pytest.raises(mqtt.PublishTimeout):
        client.publish_async("t", b"y", timeout_s=0.01)()
    client._on_publish(None, None, 7)  # ...then this message's own, though its wait gave up too
    wait = client.publish_async("t", b"z", timeout_s=PATIENCE_S)
    threading.Timer(0.05, client._on_publish, args=(None, None, 7)).start()
    wait()  # acknowledged by its own PUBACK


def test_s10_a_puback_whose_waiter_was_never_called_acknowledges_no_later_publish():
    """A caller may drop a publish_async waiter (a beat sent while the link is down, a batch
    whose first waiter raised): its PUBACK still comes. The next message paho gives the same
    mid must wait for its own PUBACK, not return on the old one; a PUBACK that comes before
    its own waiter is called still counts."""
    client = mqtt.MqttClient(BrokerConfig(hosts=("h1",)), "test")
    client._client, client._host = Publishing("h1"), "h1"  # type: ignore[assignment]
    client.connected.set()
    client.publish_async("t", b"dropped")  # never waited for
    client._on_publish(None, None, 7)  # ...its PUBACK
    with pytest.raises(mqtt.PublishTimeout):
        client.publish_async("t", b"next", timeout_s=0.01)()
    early = client.publish_async("t", b"early", timeout_s=PATIENCE_S)
    client._on_publish(None, None, 7)  # its PUBACK, before anyone waits
    early()
