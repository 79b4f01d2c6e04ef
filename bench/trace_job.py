"""Where one job's time goes on the wire, point by point (docs/benchmarks.md). Not a test:
run it by hand,

    .venv/bin/python bench/trace_job.py [--jobs 30]

The side-by-side bench's mam side: a real nats-server, `mam-orch serve`, `mam-runner run
--exec "bash -s"` and `mam.Hub` in this process, jobs one at a time. An observer subscribed
to the jobs' dispatch, events and state topics stamps each message's arrival; the client
stamps `Hub.dispatch()` and `job.wait()` returning. It prints, for each point, p50 and p90
in ms after the call to `Hub.dispatch`, and how many jobs reached it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "tests")]

import paho.mqtt.client as paho  # noqa: E402
from bench_queue import start_serve, stop  # noqa: E402
from bench_side_by_side import LABEL, start_runner  # noqa: E402
from benchkit import CONNECT_TIMEOUT_S, KEEPALIVE_S, percentile  # noqa: E402
from harness.brokers import NatsBroker  # noqa: E402
from harness.runnersim import hub_workspace  # noqa: E402
from paho.mqtt.enums import CallbackAPIVersion  # noqa: E402

from mam import Hub  # noqa: E402
from mam.shared.config import read_env_file  # noqa: E402

DEFAULT_JOBS = 30
JOB_TIMEOUT_S = 60.0
STATE_WAIT_S = 5.0
MS_PER_S = 1000.0
POINTS = ("dispatch() returned", "dispatch on the wire", "dispatch cleared", "started event", "running state",
          "completed event", "completed state", "wait() returned")


class Observer:
    """Stamps (time.monotonic) the first arrival of each wire point of every job."""

    def __init__(self, values: dict[str, str]) -> None:
        self.root = values["MAM_TOPIC_ROOT"]
        self.seen: dict[str, dict[str, float]] = {}
        self._cond = threading.Condition()
        self._subscribed = threading.Event()
        self.client = paho.Client(CallbackAPIVersion.VERSION2, client_id=f"bench-trace-{os.getpid()}")
        self.client.username_pw_set(values["MQTT_USERNAME"], values["MQTT_PASSWORD"])
        # QoS 0: nats-server makes no JetStream consumer for it, so the observer loads the broker little
        self.client.on_connect = lambda client, *_: client.subscribe(
            [(f"{self.root}/jobs/+/{leaf}", 0) for leaf in ("dispatch", "events", "state")])
        self.client.on_subscribe = lambda *_: self._subscribed.set()
        self.client.on_message = self._on_message
        self.client.connect(values["MQTT_BROKER"], int(values["MQTT_PORT"]), KEEPALIVE_S)
        self.client.loop_start()
        if not self._subscribed.wait(CONNECT_TIMEOUT_S):
            raise SystemExit("the observer did not subscribe")

    def stamp(self, job_id: str, point: str, at: float | None = None) -> None:
        with self._cond:
            self.seen.setdefault(job_id, {}).setdefault(point, time.monotonic() if at is None else at)
            self._cond.notify_all()

    def wait_for(self, job_id: str, point: str, timeout_s: float) -> None:
        """Until `point` of `job_id` was seen, or `timeout_s` seconds passed."""
        with self._cond:
            self._cond.wait_for(lambda: point in self.seen.get(job_id, {}), timeout_s)

    def _on_message(self, client: Any, userdata: Any, msg: Any) -> None:
        now = time.monotonic()
        job_id, leaf = msg.topic.split("/")[-2:]
        if leaf == "dispatch":
            self.stamp(job_id, "dispatch on the wire" if msg.payload else "dispatch cleared", now)
            return
        if not msg.payload:
            return
        body = json.loads(msg.payload)
        if leaf == "events" and body.get("event") in ("started", "completed"):
            self.stamp(job_id, f"{body['event']} event", now)
        elif leaf == "state" and body.get("status") in ("running", "completed"):
            self.stamp(job_id, f"{body['status']} state", now)

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=DEFAULT_JOBS)
    args = parser.parse_args()
    for key in [k for k in os.environ if k.startswith(("MQTT_", "MAM_"))]:
        del os.environ[key]  # the hub workspace's .mam.env decides, as in the side-by-side bench
    offsets: dict[str, list[float]] = {point: [] for point in POINTS}
    with tempfile.TemporaryDirectory(prefix="mam-trace-") as tmp:
        base = Path(tmp)
        broker = NatsBroker(base / "nats").start()
        procs = []
        try:
            hub = hub_workspace(broker, base)
            procs = [start_runner(broker, base / "runner"), start_serve(hub)]
            observer = Observer(read_env_file(hub / ".mam.env"))
            try:
                with Hub(workspace=hub, embedded=False) as api:
                    for i in range(args.jobs + 1):
                        submitted = time.monotonic()
                        job = api.dispatch("true", labels=[LABEL])
                        observer.stamp(job.id, "dispatch() returned")
                        job.wait(JOB_TIMEOUT_S)
                        observer.stamp(job.id, "wait() returned")
                        observer.wait_for(job.id, "completed state", STATE_WAIT_S)  # a quiet wire next
                        if i == 0:
                            continue  # the first job warms imports and connections: not counted
                        for point, at in observer.seen.get(job.id, {}).items():
                            offsets[point].append(at - submitted)
            finally:
                observer.close()
        finally:
            stop(*procs)
            broker.stop()
    print(f"{args.jobs} jobs one at a time, ms after the call to Hub.dispatch; load {os.getloadavg()[0]:.2f}")
    print(f"{'point':24} {'p50':>7} {'p90':>7} {'jobs':>5}")
    for point in POINTS:
        values = offsets[point]
        if values:
            print(f"{point:24} {percentile(values, 50) * MS_PER_S:7.1f} {percentile(values, 90) * MS_PER_S:7.1f} "
                  f"{len(values):5d}")
        else:
            print(f"{point:24} {'-':>7} {'-':>7} {0:5d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
