"""A broker-free stand-in for the hub's `MqttClient` and a signed `started` event, for unit
tests of the hub service, its HTTP API and its scale rules (no broker, no network)."""

from __future__ import annotations

import queue
import threading
from typing import Any

from mam.shared.config import BrokerConfig
from mam.shared.protocol import crypto, wire
from mam.shared.transport.mqtt import Message

TS = "2026-06-20T14:49:30Z"


class RecordingClient:
    """The slice of `MqttClient` the hub uses: publish, subscribe, messages, connected."""

    def __init__(self) -> None:
        self.config = BrokerConfig()
        self.messages: queue.Queue[Message] = queue.Queue()
        self.connected = threading.Event()
        self.connected.set()
        self.published: list[tuple[str, bytes, bool]] = []

    def publish(self, topic: str, payload: bytes, retain: bool = False) -> None:
        self.published.append((topic, payload, retain))


def started(record: Any) -> bytes:
    """The signed `started` event (seq 1, §3) of the record's current attempt."""
    return event(record, 1, "started")


def event(record: Any, seq: int, name: str, **data: Any) -> bytes:
    """A signed event `name` (§3) of the record's current attempt, with `data` added."""
    body = {"schema_version": 1, "seq": seq, "job_id": record["job_id"], "event": name, "timestamp": TS,
            "detail": "", "data": {"attempt_id": record["attempt_id"], "dispatch_token": record["dispatch_token"],
                                   **data}}
    return wire.encode(crypto.sign_event(body, record["auth_token"]))
