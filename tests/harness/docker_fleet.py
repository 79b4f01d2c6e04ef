"""The compose project of tests/e2e/docker-compose.yaml, driven from a test.

`DockerFleet(client, compose)` picks a free /24 inside 100.96.0.0/11 and a project name,
`up()` runs `<compose> -p PROJECT up -d --no-build` on the images of harness.docker_env,
applies the iptables chain generated from deploy/tailscale/policy.hujson
(harness.tailnet_policy) and waits until the three runners are online; `down()` removes the
containers, the network and the chain. Helpers run `mam-orch` in the hub container
(`orch`, `start_orch`), read a job's record, and probe TCP ports from one container to
another (`probe`: 0 open, ECONNREFUSED closed, EHOSTUNREACH refused by the policy).
"""

from __future__ import annotations

import ipaddress
import json
import os
import secrets
import shutil
import subprocess

from harness import docker_env, tailnet_policy
from harness.gitserver import make_origin
from harness.waiting import PATIENCE_S, wait_until
from mam.orchestrator.init import broker_password

COMPOSE_FILE = docker_env.REPO / "tests" / "e2e" / "docker-compose.yaml"
POLICY_FILE = docker_env.REPO / "deploy" / "tailscale" / "policy.hujson"
DOMAIN = "mam-e2e.ts.net"
TAILNET = ipaddress.ip_network("100.64.0.0/10")
PREFIX_POOL = ipaddress.ip_network("100.96.0.0/11")
FIRST_PREFIX_OCTET = 10  # 100.96.0.0/24 is dockerd's own bridge (DOCKERD_BIP)
RUNNERS = ("runner-a", "runner-b", "runner-c")
BROKER_NODE = frozenset({"tag:mam-broker"})
RUNNER_NODE = frozenset({"tag:mam-runner"})
OBSERVER_NODE = frozenset({"group:mam-observers"})
# service -> (last octet, tailnet identities, tailnet node): the hub and its git server share the
# broker's node (deploy/tailscale/docker-compose.hub.yaml puts the hub and broker behind one sidecar).
HOSTS = {"broker": (10, BROKER_NODE, "hub"), "hub": (20, BROKER_NODE, "hub"), "git": (50, BROKER_NODE, "hub"),
         "runner-a": (31, RUNNER_NODE, ""), "runner-b": (32, RUNNER_NODE, ""), "runner-c": (33, RUNNER_NODE, ""),
         "observer": (40, OBSERVER_NODE, "")}
SECRET_VARS = ("MAM_BROKER_PASS", "MAM_OBSERVER_PASS", "MAM_HOME_PASS", "MAM_SYS_PASS", "MAM_DISPATCH_SECRET")
COMPOSE_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 1
PROBE_TIMEOUT_S = 5
LOG_TAIL_LINES = 15


OBSERVER_CONNECT = """
import os, threading
import paho.mqtt.client as mqtt
done, ok = threading.Event(), []
client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, transport="websockets")
client.ws_set_options(path="/mqtt")
client.username_pw_set("mam_observer", os.environ["PW"])
client.on_connect = lambda c, u, flags, rc, props: (ok.append(not rc.is_failure), done.set())
client.connect(os.environ["HOST"], int(os.environ["PORT"]))
client.loop_start()
done.wait(float(os.environ["WAIT"]))
client.loop_stop()
print("connected" if ok and ok[0] else "refused")
"""


def free_prefix(client) -> str:
    """The first three octets of a /24 of 100.96.0.0/11 that no docker network uses."""
    used = []
    for network in client.networks.list():
        for config in (network.attrs.get("IPAM") or {}).get("Config") or []:
            if config.get("Subnet"):
                used.append(ipaddress.ip_network(config["Subnet"], strict=False))
    for subnet in list(PREFIX_POOL.subnets(new_prefix=24))[FIRST_PREFIX_OCTET:]:
        if not any(subnet.overlaps(u) for u in used):
            return str(subnet.network_address).rsplit(".", 1)[0]
    raise RuntimeError("no free /24 left in 100.96.0.0/11")


class DockerFleet:
    """One compose project: broker, hub, git, runner-a/b/c and observer on the tailnet-like network;
    `origin` is the bare repository `demo.git` the git server serves."""

    def __init__(self, client, compose: list[str]) -> None:
        self.client = client
        self.compose = compose
        self.project = "mam-e2e-" + secrets.token_hex(3)
        self.prefix = free_prefix(client)
        self.subnet = self.prefix + ".0/24"
        self.chain = self.project.upper()  # iptables chain names: at most 28 characters
        # broker_password(): nats-server reads an environment value like a config value, and a
        # random one that starts with a digit ('5Vx…') stops it (a CI run: no runner came online)
        self.git_dir = docker_env.BUILD_DIR / f"git-{self.project}"  # the git server's repositories
        shutil.rmtree(self.git_dir, ignore_errors=True)
        self.origin = make_origin(self.git_dir)
        self.env = {**os.environ, **{name: broker_password() for name in SECRET_VARS},
                    "MAM_FLEET_IMAGE": docker_env.FLEET_IMAGE, "MAM_BROKER_IMAGE": docker_env.BROKER_IMAGE,
                    "MAM_BASE_IMAGE": docker_env.BASE_IMAGE, "MAM_E2E_NET": self.prefix,
                    "MAM_E2E_GIT": str(self.git_dir)}
        self.hosts = [tailnet_policy.Host(name, f"{self.prefix}.{octet}", ids, node)
                      for name, (octet, ids, node) in HOSTS.items()]

    # -- life

    def run_compose(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([*self.compose, "-p", self.project, "-f", str(COMPOSE_FILE), *args], env=self.env,
                              capture_output=True, text=True, timeout=COMPOSE_TIMEOUT_S)

    def up(self) -> DockerFleet:
        result = self.run_compose("up", "-d", "--no-build")
        if result.returncode != 0:
            raise RuntimeError(f"compose up failed: {result.stderr[-2000:]}")
        rules = tailnet_policy.iptables_rules(tailnet_policy.load_policy(POLICY_FILE), self.hosts, self.subnet,
                                              self.chain)
        docker_env.apply_policy(rules, self.chain, self.subnet)
        self.wait_online(RUNNERS)
        return self

    def down(self) -> None:
        self.run_compose("down", "-v", "--remove-orphans", "-t", str(STOP_TIMEOUT_S))
        docker_env.remove_policy(self.chain, self.subnet)
        shutil.rmtree(self.git_dir, ignore_errors=True)

    # -- containers

    def container(self, service: str):
        found = self.client.containers.list(all=True, filters={"label": [
            f"com.docker.compose.project={self.project}", f"com.docker.compose.service={service}"]})
        if len(found) != 1:
            raise LookupError(f"{len(found)} containers for service {service} of {self.project}")
        return found[0]

    def containers(self) -> list:
        return self.client.containers.list(all=True, filters={"label": f"com.docker.compose.project={self.project}"})

    @property
    def network(self):
        return self.client.networks.get(self.network_name)

    @property
    def network_name(self) -> str:
        return next(iter(self.container("broker").attrs["NetworkSettings"]["Networks"]))

    def ip(self, service: str) -> str:
        return f"{self.prefix}.{HOSTS[service][0]}"

    def reconnect(self, service: str) -> None:
        """Connect `service` again with its address and MagicDNS-style alias."""
        self.network.connect(self.container(service), ipv4_address=self.ip(service),
                             aliases=[f"{service}.{DOMAIN}"])

    def sh(self, service: str, script: str, user: str = "") -> tuple[int, str]:
        code, out = self.container(service).exec_run(["sh", "-c", script], user=user)
        return code, out.decode(errors="replace")

    # -- the hub's mam-orch

    def orch(self, *args: str) -> tuple[int, list[dict], str]:
        """Run `mam-orch ARGS` in the hub; (exit code, JSON lines of stdout, all output)."""
        code, out = self.container("hub").exec_run(["mam-orch", *args], demux=True)
        stdout, stderr = ((out[0] or b"").decode(errors="replace"), (out[1] or b"").decode(errors="replace"))
        rows = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
        return code, rows, stdout + stderr

    def start_orch(self, *args: str) -> str:
        """Start `mam-orch ARGS` in the hub in the background; returns the exec id (`exec_result`)."""
        api = self.client.api
        exec_id = api.exec_create(self.container("hub").id, ["mam-orch", *args])["Id"]
        api.exec_start(exec_id, detach=True)
        return exec_id

    def exec_result(self, exec_id: str) -> int | None:
        """The exit code of a `start_orch` exec, or None while it runs."""
        info = self.client.api.exec_inspect(exec_id)
        return None if info["Running"] else int(info["ExitCode"])

    def record(self, job_id: str) -> dict:
        """The hub's record of `job_id` (`mam-orch show --json`), with its audit trail under "audit"."""
        code, rows, out = self.orch("show", job_id, "--json")
        assert code == 0 and rows, out
        return {**rows[0]["record"], "audit": rows[0]["audit"]}

    def job_ids(self) -> set[str]:
        code, rows, out = self.orch("jobs", "--json")
        assert code == 0, out
        return {row["job_id"] for row in rows}

    def new_job(self, before: set[str]) -> str:
        """The one job id the hub registered since `before` (`job_ids()` taken earlier)."""
        return wait_until(lambda: len(new := self.job_ids() - before) == 1 and new.pop(), PATIENCE_S,
                          "the hub to register the job")

    def presence(self) -> dict[str, dict]:
        """Each session's signed retained presence (`mam-orch runners --json`), §7."""
        code, rows, _ = self.orch("runners", "--json")
        return {row["session"]: row for row in rows} if code == 0 else {}

    def status(self, session: str) -> str:
        return self.presence().get(session, {}).get("status", "absent")

    def wait_online(self, sessions) -> None:
        try:
            wait_until(lambda: all(self.status(s) == "online" for s in sessions), PATIENCE_S,
                       f"runners {list(sessions)} online")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.describe(['broker', *sessions])}") from None

    def describe(self, services) -> str:
        """Each service's container state, restart count and last log lines (for a failure message)."""
        lines = []
        for service in services:
            try:
                box = self.container(service)
                box.reload()
                state = box.attrs["State"]
                tail = box.logs(tail=LOG_TAIL_LINES).decode(errors="replace").rstrip()
            except Exception as exc:  # noqa: BLE001 (a failure message must not fail)
                lines.append(f"--- {service}: {exc}")
                continue
            lines.append(f"--- {service}: {state.get('Status')} exit={state.get('ExitCode')} "
                         f"restarts={box.attrs.get('RestartCount')}\n{tail}")
        return "\n".join(lines)

    def wait_running(self, session: str, job_id: str) -> None:
        """Until `session`'s presence lists `job_id` as running (the runner started its agent)."""
        wait_until(lambda: job_id in self.presence().get(session, {}).get("running", []), PATIENCE_S,
                   f"{session} to run job {job_id}")

    # -- network probes

    def probe(self, service: str, host: str, port: int) -> int:
        """connect_ex() from `service` to `host:port`: 0 open, 111 refused (closed), 113 the policy."""
        code, out = self.container(service).exec_run(["python3", "-c", (
            "import socket,sys; s=socket.socket(); s.settimeout(float(sys.argv[3]));"
            " print(s.connect_ex((sys.argv[1], int(sys.argv[2]))))"), host, str(port), str(PROBE_TIMEOUT_S)])
        assert code == 0, out
        return int(out.decode().strip())

    def observer_connects(self, host: str, port: int) -> bool:
        """True when the observer container completes an MQTT-over-WebSocket CONNECT (path /mqtt)
        to `host:port` as mam_observer, like a dashboard (the password travels in the environment)."""
        code, out = self.container("observer").exec_run(["python3", "-c", OBSERVER_CONNECT], environment={
            "HOST": host, "PORT": str(port), "PW": self.env["MAM_OBSERVER_PASS"], "WAIT": str(PROBE_TIMEOUT_S)})
        return code == 0 and out.decode().strip() == "connected"

    def listen(self, service: str, port: int) -> None:
        """A TCP listener on every address of `service` (until the container stops)."""
        self.container(service).exec_run(["python3", "-c", (
            "import socket,sys,time; s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1);"
            " s.bind(('0.0.0.0', int(sys.argv[1]))); s.listen(); time.sleep(86400)"), str(port)], detach=True)
        wait_until(lambda: self.probe(service, "127.0.0.1", port) == 0, PATIENCE_S, f"{service} to listen on {port}")


def in_tailnet_range(address: str) -> bool:
    return ipaddress.ip_network(address, strict=False).subnet_of(TAILNET)

