"""Helpers of the speed benchmarks (bench/test_speed.py): a wire clock, the
paho floor script, percentiles and the machine's load, all measured in the
same run as the figures they are compared with.

`WireClock` is one hub-side MQTT client (paho, real broker) that stamps, with
one monotonic clock, the arrival of every dispatch and of every `started`
event (PROTOCOL §5, §11): dispatch → `started` is the difference of two
stamps taken by the same subscriber, so its own delivery delay cancels out.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import paho.mqtt.client as paho
from paho.mqtt.enums import CallbackAPIVersion

HERE = Path(__file__).resolve().parent
FLOOR_SCRIPT = HERE / "floor_publish.py"
AGENTS = HERE / "agents"
CONNECT_TIMEOUT_S = 10.0
KEEPALIVE_S = 30
FLOOR_TIMEOUT_S = 30.0
FLOOR_JOB_ID = "ffffffff"  # a job id no benchmark dispatches: the floor's topics
BYTES_PER_MB = 1024 * 1024


def percentile(values: list[float], pct: float) -> float:
    """Nearest-rank percentile (`pct` in 0-100) of a non-empty list."""
    ordered = sorted(values)
    rank = max(1, math.ceil(pct / 100 * len(ordered)))
    return ordered[rank - 1]


def load_note() -> str:
    """The 1/5/15-minute load averages and the CPU count, for printing next to figures."""
    one, five, fifteen = os.getloadavg()
    return f"load {one:.2f} {five:.2f} {fifteen:.2f}, {os.cpu_count()} cores"


class WireClock:
    """Stamps dispatches and `started` events per job id as they arrive (see the module docstring)."""

    def __init__(self, values: dict[str, str]) -> None:
        self.root = values["MAM_TOPIC_ROOT"]
        self.dispatched: dict[str, float] = {}
        self.started: dict[str, float] = {}
        self._cond = threading.Condition()
        self._subscribed = threading.Event()
        self.client = paho.Client(CallbackAPIVersion.VERSION2, client_id=f"bench-clock-{os.getpid()}")
        self.client.username_pw_set(values["MQTT_USERNAME"], values["MQTT_PASSWORD"])
        self.client.on_connect = self._on_connect
        self.client.on_subscribe = lambda *args: self._subscribed.set()
        self.client.on_message = self._on_message
        self.client.connect(values["MQTT_BROKER"], int(values["MQTT_PORT"]), KEEPALIVE_S)
        self.client.loop_start()
        if not self._subscribed.wait(CONNECT_TIMEOUT_S):
            self.close()
            raise AssertionError("the bench wire clock did not subscribe")

    def _on_connect(self, client: Any, userdata: Any, flags: Any, reason: Any, props: Any) -> None:
        client.subscribe([(f"{self.root}/jobs/+/dispatch", 1), (f"{self.root}/jobs/+/events", 1)])

    def _on_message(self, client: Any, userdata: Any, msg: Any) -> None:
        now = time.perf_counter()
        if not msg.payload:
            return
        parts = msg.topic.split("/")
        job_id, kind = parts[-2], parts[-1]
        with self._cond:
            if kind == "dispatch":
                self.dispatched.setdefault(job_id, now)
            elif json.loads(msg.payload).get("event") == "started":
                self.started.setdefault(job_id, now)
            self._cond.notify_all()

    def count_started(self) -> int:
        with self._cond:
            return len(self.started)

    def latency_s(self, job_id: str) -> float | None:
        """Seconds from the dispatch's arrival to its `started` event's, None until both arrived."""
        with self._cond:
            if job_id in self.dispatched and job_id in self.started:
                return self.started[job_id] - self.dispatched[job_id]
            return None

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def run_floor(values: dict[str, str]) -> float:
    """Run the minimal paho script once (a fresh interpreter); its wall time in seconds."""
    argv = [sys.executable, str(FLOOR_SCRIPT), values["MQTT_BROKER"], values["MQTT_PORT"],
            values["MQTT_USERNAME"], values["MQTT_PASSWORD"], f"{values['MAM_TOPIC_ROOT']}/jobs/{FLOOR_JOB_ID}"]
    start = time.perf_counter()
    result = subprocess.run(argv, capture_output=True, text=True, timeout=FLOOR_TIMEOUT_S)
    elapsed = time.perf_counter() - start
    assert result.returncode == 0, f"the floor script failed: {result.stderr[-2000:]}"
    return elapsed


def clear_floor_state(values: dict[str, str]) -> None:
    """Remove the retained state the floor script left (an empty retained message)."""
    client = paho.Client(CallbackAPIVersion.VERSION2, client_id=f"bench-clear-{os.getpid()}")
    client.username_pw_set(values["MQTT_USERNAME"], values["MQTT_PASSWORD"])
    client.connect(values["MQTT_BROKER"], int(values["MQTT_PORT"]), KEEPALIVE_S)
    client.loop_start()
    info = client.publish(f"{values['MAM_TOPIC_ROOT']}/jobs/{FLOOR_JOB_ID}/state", b"", qos=1, retain=True)
    info.wait_for_publish(CONNECT_TIMEOUT_S)
    client.disconnect()
    client.loop_stop()
