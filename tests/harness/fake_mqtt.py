"""An in-memory MQTT broker and client for broker-free unit tests (model: dramatiq's StubBroker).

`FakeClient` satisfies `mam.shared.transport.Transport`. `FakeBroker` keeps
retained messages (a zero-length retained publish clears the topic, §2),
delivers a topic's retained message right after a matching subscribe (flagged
`retain=True`), routes live messages to every matching subscriber
(`retain=False`), and publishes a client's Last Will when it is dropped
without a clean DISCONNECT (`drop()`, §7). Nothing leaves the process.
Where a real broker fits, use the `broker` fixture instead.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from paho.mqtt.client import topic_matches_sub

from mam.shared.config import BrokerConfig
from mam.shared.protocol.errors import BrokerUnavailable, PublishTimeout
from mam.shared.transport import Will


@dataclass(frozen=True)
class FakeMessage:
    """One message as a subscriber receives it (`Received`)."""

    topic: str
    payload: bytes
    retain: bool


@dataclass(frozen=True)
class Published:
    """One message as a client published it, for assertions."""

    client_id: str
    topic: str
    payload: bytes
    retain: bool


@dataclass
class FakeBroker:
    """The broker: retained store, subscriptions, and the log of every publish.

    Attributes:
        retained: topic -> payload of the retained messages.
        published: every publish, in order (Last Wills included, client id `will:<id>`).
        down: while True, connect raises `BrokerUnavailable` and publish `PublishTimeout`.
    """

    retained: dict[str, bytes] = field(default_factory=dict)
    published: list[Published] = field(default_factory=list)
    down: bool = False
    _clients: list[FakeClient] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def client(self, config: BrokerConfig | None = None, role: str = "test", will: Will | None = None) -> FakeClient:
        """A new, unconnected client (the `TransportFactory` shape: pass `broker.client`)."""
        return FakeClient(self, config or BrokerConfig(), role, will)

    def _route(self, sender: str, topic: str, payload: bytes, retain: bool) -> None:
        with self._lock:
            self.published.append(Published(sender, topic, payload, retain))
            if retain:
                if payload:
                    self.retained[topic] = payload
                else:
                    self.retained.pop(topic, None)
            targets = [c for c in self._clients if c.connected.is_set() and c.matches(topic)]
        for target in targets:
            target.messages.put(FakeMessage(topic, payload, False))

    def drop(self, client: FakeClient) -> None:
        """The connection of `client` is lost (no DISCONNECT): its Last Will is published (§7)."""
        with self._lock:
            if client in self._clients:
                self._clients.remove(client)
        client.connected.clear()
        if client.will is not None:
            topic, payload, _qos, retain = client.will
            self._route(f"will:{client.client_id}", topic, payload, retain)

    def reconnect(self, client: FakeClient) -> None:
        """Bring a dropped client back, re-subscribed, with `reconnected` set (§10)."""
        client.connected.set()
        with self._lock:
            self._clients.append(client)
        client.reconnected.set()
        for pattern in list(client.filters):
            client.deliver_retained(pattern)

    def on_topic(self, topic: str) -> list[Published]:
        """Every publish on `topic`, in order."""
        return [p for p in self.published if p.topic == topic]


class FakeClient:
    """An MQTT client of a `FakeBroker` (satisfies `Transport`)."""

    _count = 0

    def __init__(self, broker: FakeBroker, config: BrokerConfig, role: str, will: Will | None) -> None:
        FakeClient._count += 1
        self.broker = broker
        self.config = config
        self.role = role
        self.will = will
        self.client_id = f"fake-{role}-{FakeClient._count}"
        self.host = "fake-broker"
        self.messages: queue.Queue[FakeMessage] = queue.Queue()
        self.connected = threading.Event()
        self.reconnected = threading.Event()
        self.filters: list[str] = []
        self.closed = False
        self.disconnect_count = 0

    def connect(self, timeout_s: float = 10.0) -> FakeClient:
        if self.broker.down:
            raise BrokerUnavailable("fake broker is down")
        self.connected.set()
        with self.broker._lock:
            self.broker._clients.append(self)
        return self

    def matches(self, topic: str) -> bool:
        return any(topic_matches_sub(pattern, topic) for pattern in self.filters)

    def deliver_retained(self, pattern: str) -> None:
        with self.broker._lock:
            found = [(t, p) for t, p in self.broker.retained.items() if topic_matches_sub(pattern, t)]
        for topic, payload in found:
            self.messages.put(FakeMessage(topic, payload, True))

    def subscribe(self, filters: Sequence[tuple[str, int]], *, timeout_s: float = 5.0) -> None:
        for pattern, _qos in filters:
            if pattern not in self.filters:
                self.filters.append(pattern)
            self.deliver_retained(pattern)

    def unsubscribe(self, filters: Sequence[str], *, timeout_s: float = 5.0) -> None:
        if self.broker.down or not self.connected.is_set():
            raise BrokerUnavailable("fake broker: no UNSUBACK")
        self.filters = [pattern for pattern in self.filters if pattern not in filters]

    def publish(self, topic: str, payload: bytes, *, qos: int = 1, retain: bool = False,
                timeout_s: float = 5.0) -> None:
        if self.broker.down or not self.connected.is_set():
            raise PublishTimeout(f"fake broker: no PUBACK for {topic}")
        self.broker._route(self.client_id, topic, payload, retain)

    def publish_async(self, topic: str, payload: bytes, *, qos: int = 1, retain: bool = False,
                      timeout_s: float = 5.0) -> Callable[[], None]:
        try:
            self.publish(topic, payload, qos=qos, retain=retain, timeout_s=timeout_s)
        except PublishTimeout as exc:
            failure = exc

            def fail() -> None:
                raise failure
            return fail
        return lambda: None

    def close(self) -> None:
        """A clean DISCONNECT: the Last Will is discarded."""
        self.closed = True
        if self.connected.is_set():
            self.disconnect_count += 1
        self.connected.clear()
        with self.broker._lock:
            if self in self.broker._clients:
                self.broker._clients.remove(self)
