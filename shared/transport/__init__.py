"""The shape of an MQTT connection as the runner and the hub use it (PROTOCOL §2, §7, §10, §13).

`mam.shared.transport.mqtt.MqttClient` satisfies `Transport` structurally; tests use an
in-memory fake with retained messages (`tests/harness/fake_mqtt.py`). Code
that takes a connection types it with `Transport`, so it never depends on paho.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from mam.shared.config import BrokerConfig

Will = tuple[str, bytes, int, bool]
"""A Last Will: (topic, payload, QoS, retain) (§7)."""


class Received(Protocol):
    """One received message; a zero-length payload is a cleared retained topic (§2)."""

    @property
    def topic(self) -> str: ...

    @property
    def payload(self) -> bytes: ...

    @property
    def retain(self) -> bool: ...


class Inbox(Protocol):
    """Where received messages wait (a `queue.Queue`, filled by the network thread)."""

    def get(self, block: bool = True, timeout: float | None = None) -> Received:
        """The next message; raises `queue.Empty` after `timeout` seconds."""
        ...

    def get_nowait(self) -> Received:
        """The next message; raises `queue.Empty` when there is none."""
        ...

    def put(self, item: Any) -> None:
        """Add an item of the reader's own (the hub engine's wake, §14)."""
        ...

    def empty(self) -> bool:
        """True when no message waits."""
        ...


class Transport(Protocol):
    """One MQTT connection (§13): publish with PUBACK, subscribe with SUBACK, a message queue.

    `connected` is set while the connection is up; `reconnected` after every
    reconnect (§10: re-read or re-publish retained state, then clear it).
    """

    @property
    def config(self) -> BrokerConfig: ...

    @property
    def host(self) -> str: ...

    @property
    def messages(self) -> Inbox: ...

    @property
    def connected(self) -> threading.Event: ...

    @property
    def reconnected(self) -> threading.Event: ...

    @property
    def disconnect_count(self) -> int:
        """How many times an established connection was lost or closed (§14 outages)."""
        ...

    def connect(self, timeout_s: float = ...) -> object:
        """Connect (CONNACK within `timeout_s` s). Raises `BrokerUnavailable`."""
        ...

    def subscribe(self, filters: Sequence[tuple[str, int]], *, timeout_s: float = ...) -> None:
        """Subscribe to (filter, QoS) pairs and wait for the SUBACK. Raises `BrokerError`."""
        ...

    def unsubscribe(self, filters: Sequence[str], *, timeout_s: float = ...) -> None:
        """Unsubscribe and wait for the UNSUBACK (retained messages of the subscription,
        sent right after its SUBACK, are then in `messages`). Raises `BrokerError`."""
        ...

    def publish(self, topic: str, payload: bytes, *, qos: int = ..., retain: bool = ...,
                timeout_s: float = ...) -> None:
        """Publish and wait for the PUBACK. Raises `PublishTimeout` / `BrokerError`."""
        ...

    def publish_async(self, topic: str, payload: bytes, *, qos: int = ..., retain: bool = ...,
                      timeout_s: float = ...) -> Callable[[], None]:
        """Queue a publish and return a call that waits for its PUBACK (raises like `publish`)."""
        ...

    def close(self) -> None:
        """A clean DISCONNECT (the broker drops the Last Will); idempotent."""
        ...


TransportFactory = Callable[[BrokerConfig, str, Will | None], Transport]
"""Makes an unconnected `Transport` from (config, role, Last Will), e.g. `MqttClient(cfg, role, will=will)`."""

__all__ = ["Inbox", "Received", "Transport", "TransportFactory", "Will"]
