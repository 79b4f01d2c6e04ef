"""Former home of the shared test helpers, kept so `from helpers import ...` still works.

They live in the `harness` package now: harness.waiting (wait_until, PATIENCE_S),
harness.brokers (free_port, port_accepts, the broker handles) and
harness.workspace (TEST_SECRET, write_env_for, clean_env).
"""

from __future__ import annotations

from harness.brokers import (
    MOSQUITTO,
    MOSQUITTO_PASSWD,
    START_TIMEOUT_S,
    STOP_TIMEOUT_S,
    TEST_TOPIC_ROOT,
    BrokerProcess,
    MosquittoBroker,
    NatsBroker,
    free_port,
    port_accepts,
)
from harness.waiting import PATIENCE_S, wait_until
from harness.workspace import TEST_SECRET, clean_env, write_env_for

__all__ = ["MOSQUITTO", "MOSQUITTO_PASSWD", "PATIENCE_S", "START_TIMEOUT_S", "STOP_TIMEOUT_S", "TEST_SECRET",
           "TEST_TOPIC_ROOT", "BrokerProcess", "MosquittoBroker", "NatsBroker", "clean_env", "free_port",
           "port_accepts", "wait_until", "write_env_for"]
