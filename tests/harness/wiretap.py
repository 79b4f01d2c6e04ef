"""The wire tap of a fleet (harness/fleet.py), run as a script: `python wiretap.py WORKSPACE READY_TIMEOUT_S`.

A hub-side MQTT client with the workspace's `.mam.env`: prints
`{"ready": true}` once subscribed to ROOT/#, then every message under the
topic root as a JSON line `{"topic", "retain", "payload_b64"}`, and publishes
what it reads on stdin (`{"topic", "payload_b64", "retain"}` lines, each
answered with `{"published": topic}` or `{"published": null, "publish_error"}`).
It imports only `mam.*`, since it runs outside pytest (also inside a namespace).
"""

from __future__ import annotations

import base64
import json
import os
import queue
import sys
import threading
from pathlib import Path
from typing import Any

from mam.orchestrator.broker import embedded as broker
from mam.shared import config
from mam.shared.transport import mqtt

QUEUE_POLL_S = 1.0


def main(workspace: str, ready_timeout_s: float) -> int:
    """Subscribe to ROOT/# and print every message; publish what stdin asks (see module doc).
    `ready_timeout_s`: how long the broker may take to accept the tap."""
    cfg = config.broker_config(workspace=Path(workspace))
    broker.wait_mqtt_ready(cfg, timeout_s=ready_timeout_s)
    client = mqtt.MqttClient(cfg, "tap").connect()
    client.subscribe([(f"{cfg.topic_root}/#", 1)])
    lock = threading.Lock()

    def emit(obj: dict[str, Any]) -> None:
        with lock:
            sys.stdout.write(json.dumps(obj) + "\n")
            sys.stdout.flush()

    def publisher() -> None:
        for line in sys.stdin:
            try:
                req = json.loads(line)
                client.publish(req["topic"], base64.b64decode(req["payload_b64"]), retain=bool(req["retain"]))
                emit({"published": req["topic"]})
            except Exception as exc:  # report, keep tapping
                emit({"published": None, "publish_error": f"{type(exc).__name__}: {exc}"})
        os._exit(0)  # stdin closed: the test is done

    threading.Thread(target=publisher, daemon=True).start()
    emit({"ready": True})
    while True:
        try:
            message = client.messages.get(timeout=QUEUE_POLL_S)
        except queue.Empty:
            continue
        emit({"topic": message.topic, "retain": bool(message.retain),
              "payload_b64": base64.b64encode(message.payload).decode()})


if __name__ == "__main__":
    if len(sys.argv) != 3:
        print("usage: wiretap.py WORKSPACE READY_TIMEOUT_S", file=sys.stderr)
        sys.exit(64)
    sys.exit(main(sys.argv[1], float(sys.argv[2])))
