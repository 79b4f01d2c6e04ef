"""The floor of the `mam-runner publish` benchmark: a minimal paho script that
publishes one QoS 1 event and one retained QoS 1 state, waits for both PUBACKs
and disconnects. Run as a fresh interpreter, like the CLI it is compared with.

    python floor_publish.py HOST PORT USER PASSWORD TOPIC_PREFIX
"""

import json
import os
import sys
import time

import paho.mqtt.client as paho
from paho.mqtt.enums import CallbackAPIVersion

KEEPALIVE_S = 30
PUBACK_TIMEOUT_S = 10.0
QOS = 1


def main() -> None:
    host, port, user, password, prefix = sys.argv[1:6]
    client = paho.Client(CallbackAPIVersion.VERSION2, client_id=f"bench-floor-{os.getpid()}")
    client.username_pw_set(user, password)
    client.connect(host, int(port), KEEPALIVE_S)
    client.loop_start()
    body = {"job_id": prefix.rsplit("/", 1)[-1], "seq": 1, "event": "progress", "detail": "floor",
            "ts": time.time(), "attempt_id": 1, "dispatch_token": "0" * 32, "sig": "0" * 64}
    event = client.publish(f"{prefix}/events", json.dumps(body).encode(), qos=QOS)
    state = client.publish(f"{prefix}/state", json.dumps({**body, "status": "running"}).encode(), qos=QOS, retain=True)
    event.wait_for_publish(PUBACK_TIMEOUT_S)
    state.wait_for_publish(PUBACK_TIMEOUT_S)
    client.disconnect()
    client.loop_stop()


if __name__ == "__main__":
    main()
