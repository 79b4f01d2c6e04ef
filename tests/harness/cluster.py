"""A fleet whose broker is a three-node NATS cluster (docs/deployment.md
"NATS cluster"): the tailnet of harness/fleet.py plus hosts nats-1, nats-2 and nats-3, each
running one node exactly as `mam-orch init --cluster` wrote and printed it (its "natively:"
command, run by bash inside the node's namespace). Every workspace's MQTT_BROKER is the
fail-over list `nats-1,nats-2,nats-3` that init wrote.

    fleet = ClusterFleet(tmp_path)
    fleet.kill_node("nats-2"); fleet.start_node("nats-2"); fleet.wait_node_ready("nats-2")
    fleet.retained_on("nats-1", "python/mqtt/jobs/+/dispatch")   # topics still retained there

Needs root (namespaces), like mode "netns" of `Fleet`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from harness.fleet import HOSTS, MAM_ORCH, START_TIMEOUT_S, Fleet
from harness.waiting import PATIENCE_S
from mam.shared.config import read_env_file

NODES = ("nats-1", "nats-2", "nats-3")
NATIVE_PREFIX = "  or natively: "
# Run as `python -c PROBE WORKSPACE NODE [FILTER]` on a fleet host: with FILTER, print the
# topics under FILTER that NODE still holds retained (a JSON list; subscribe, then unsubscribe:
# retained messages arrive before the UNSUBACK); without, wait until NODE accepts MQTT.
PROBE = """
import json, sys
from pathlib import Path
from mam.orchestrator.broker import embedded as broker
from mam.shared import config
from mam.shared.transport import mqtt
cfg = config.broker_config(workspace=Path(sys.argv[1])).with_overrides(hosts=(sys.argv[2],))
broker.wait_mqtt_ready(cfg, timeout_s=float(sys.argv[3]))
if len(sys.argv) > 4:
    with mqtt.MqttClient(cfg, "probe").connect() as client:
        client.subscribe([(sys.argv[4], 1)])
        client.unsubscribe([sys.argv[4]])
        found = []
        while not client.messages.empty():
            message = client.messages.get()
            if message.retain and message.payload:
                found.append(message.topic)
        print(json.dumps(sorted(found)))
"""

# Run as `python -c HEALTHZ DEADLINE_S` on a node's host, MAM_SYS_PASS in its environment: ask
# every node of the cluster for its health through the local node's native port, as the system
# user (`$SYS.REQ.SERVER.PING.HEALTHZ`, nats-server's /healthz: JetStream's meta leader known,
# every stream and consumer current), until all three answer "ok"; print the last answers.
HEALTHZ = """
import asyncio, json, os, sys, time
import nats

async def ask(nc):
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    await nc.publish("$SYS.REQ.SERVER.PING.HEALTHZ", b"", reply=inbox)
    answers, until = {}, time.monotonic() + 1.0
    while len(answers) < 3 and time.monotonic() < until:
        try:
            msg = await sub.next_msg(timeout=max(0.05, until - time.monotonic()))
        except (nats.errors.TimeoutError, asyncio.TimeoutError):
            break
        body = json.loads(msg.data)
        answers[body["server"]["name"]] = body.get("data", {}).get("status") or body.get("error")
    await sub.unsubscribe()
    return answers

async def main():
    deadline = time.monotonic() + float(sys.argv[1])
    answers = {}
    while time.monotonic() < deadline:
        try:
            nc = await nats.connect("nats://127.0.0.1:4222", user="sys", password=os.environ["MAM_SYS_PASS"],
                                    connect_timeout=2, allow_reconnect=False, max_reconnect_attempts=0)
        except Exception as exc:
            answers = {"connect": repr(exc)}
        else:
            try:
                answers = await ask(nc)
            finally:
                await nc.close()
            if len(answers) == 3 and all(status == "ok" for status in answers.values()):
                print(json.dumps(answers))
                return 0
        await asyncio.sleep(0.5)
    print(json.dumps(answers))
    return 1

sys.exit(asyncio.run(main()))
"""


class ClusterFleet(Fleet):
    """`Fleet` in mode "netns" with a three-node NATS cluster as its broker.

    Attributes:
        native: node -> the command `mam-orch init --cluster` printed to run it natively.
        nodes: node -> its running process (bash running nats-server, one process group).
    """

    hosts = (*HOSTS, *NODES)

    def __init__(self, base: Path, *, topic_root: str = "python/mqtt") -> None:
        self.native: dict[str, str] = {}
        self.nodes: dict[str, object] = {}
        super().__init__("netns", base, topic_root=topic_root)

    def _start_broker(self, listen: str, nats_port: int, ws_port: int) -> None:
        folder, init_ws = self.base / "cluster", self.base / "init-ws"
        folder.mkdir(parents=True, exist_ok=True)
        init_ws.mkdir(parents=True, exist_ok=True)
        argv = [*MAM_ORCH, "init", "--workspace", str(init_ws), "--cluster", "--broker", ",".join(NODES),
                "--broker-config", str(folder), "--store-dir", str(self.base / "store")]
        done = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=START_TIMEOUT_S)
        if done.returncode != 0:
            raise RuntimeError(f"mam-orch init --cluster failed: {done.stderr}")
        commands = [line[len(NATIVE_PREFIX):] for line in done.stdout.splitlines() if line.startswith(NATIVE_PREFIX)]
        self.native = dict(zip(NODES, commands, strict=True))
        values = read_env_file(init_ws / ".mam.env")
        self.agent_user, self.agent_password = values["MQTT_USERNAME"], values["MQTT_PASSWORD"]
        self.broker_host, self.mqtt_port = values["MQTT_BROKER"], int(values["MQTT_PORT"])
        self.broker_log = self.base / "nats-1.log"
        for node in NODES:
            self.start_node(node)

    def start_broker(self) -> None:
        raise NotImplementedError("a cluster has nodes: start_node(node)")

    def kill_broker(self) -> None:
        raise NotImplementedError("a cluster has nodes: kill_node(node)")

    def start_node(self, node: str) -> None:
        """Start `node` with the command init printed (again after `kill_node`: same store)."""
        self.nodes[node] = self._spawn(node, node, ["bash", "-c", self.native[node]],
                                       stdout_path=self.base / f"{node}.log")

    def kill_node(self, node: str) -> None:
        """SIGKILL the node's process group (bash and nats-server: a crash) and reap it."""
        proc = self.nodes[node].proc  # type: ignore[attr-defined]
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(PATIENCE_S)

    def node_log(self, node: str) -> str:
        return (self.base / f"{node}.log").read_text(errors="replace")

    def _probe(self, node: str, *extra: str) -> subprocess.CompletedProcess:
        argv = [sys.executable, "-c", PROBE, str(self.hub_ws), node, str(PATIENCE_S), *extra]
        return self.run_on("orch", argv, timeout_s=PATIENCE_S + START_TIMEOUT_S)

    def wait_node_ready(self, node: str) -> None:
        """Wait until `node` itself accepts an MQTT CONNECT (one deadline: PATIENCE_S)."""
        done = self._probe(node)
        if done.returncode != 0:
            raise AssertionError(f"{node} did not accept MQTT: {done.stderr[-1500:]}\n{self.node_log(node)[-3000:]}")

    def wait_cluster_healthy(self, node: str) -> None:
        """Wait until every node reports itself healthy to `node` (nats-server's healthz: JetStream
        current), the check before the next node of a rolling restart may go (docs/deployment.md
        "NATS cluster"). One deadline: PATIENCE_S.

        Raises:
            AssertionError: not healthy in time; the message has the nodes' last answers.
        """
        secret = read_env_file(self.base / "cluster" / "nats.env")["MAM_SYS_PASS"]
        done = self.run_on(node, [sys.executable, "-c", HEALTHZ, str(PATIENCE_S)],
                           timeout_s=PATIENCE_S + START_TIMEOUT_S, env={"MAM_SYS_PASS": secret})
        if done.returncode != 0:
            raise AssertionError(f"the cluster did not report healthy to {node}: {done.stdout.strip()[-500:]} "
                                 f"{done.stderr[-1000:]}")

    def retained_on(self, node: str, topic_filter: str) -> list[str]:
        """Topics under `topic_filter` that `node` hands a new subscriber as retained (non-empty)."""
        done = self._probe(node, topic_filter)
        if done.returncode != 0:
            raise AssertionError(f"probe of {node} failed: {done.stderr[-1500:]}")
        return json.loads(done.stdout.strip().splitlines()[-1])
