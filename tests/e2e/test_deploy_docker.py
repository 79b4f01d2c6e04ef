"""Docker end-to-end: the topology of tests/e2e/docker-compose.yaml (the
production nats.conf, a hub and two runners on a 100.64.0.0/10 network) built
with the docker SDK, then the happy path (§3-§5, §9 exit 0) and a cancel
(§6, §9 exit 4) run through `mam-orch` inside the hub container.

Skips, saying why, when the `docker` package (extra `docker`) is not
importable, when no Docker engine answers, or while `mam-orch dispatch` /
`mam-runner run` do not exist yet in this checkout. The CLI flags used here
(`dispatch --session S --brief-file F`, `cancel JOB_ID`, `run --session S
--exec CMD`) follow PROTOCOL §5/§6/§11 and examples/agents/README.md.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MAM_ORCH = REPO / ".venv" / "bin" / "mam-orch"
MAM_RUNNER = REPO / ".venv" / "bin" / "mam-runner"
NETWORK = "mam-e2e-tailnet"
SUBNET = "100.64.0.0/10"
IMAGE = "mam-fleet:e2e"

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]


def _has_command(binary: Path, command: str) -> bool:
    result = subprocess.run([str(binary), command, "--help"], capture_output=True, timeout=30)
    return result.returncode == 0


@pytest.fixture(scope="module")
def engine():
    docker = pytest.importorskip("docker", reason="the `docker` package (extra `docker`) is not installed")
    if not os.environ.get("DOCKER_HOST") and not os.path.exists("/var/run/docker.sock"):
        pytest.skip("no Docker engine reachable: no DOCKER_HOST and no /var/run/docker.sock (docker client only)")
    client = None
    try:
        client = docker.from_env(timeout=10)
        client.ping()
    except Exception as exc:  # DockerException, ConnectionError, FileNotFoundError of the socket
        if client is not None:
            client.close()
        pytest.skip(f"no Docker engine reachable ({type(exc).__name__}): docker client only here")
    if not (_has_command(MAM_ORCH, "dispatch") and _has_command(MAM_RUNNER, "run")):
        pytest.skip("`mam-orch dispatch` / `mam-runner run` do not exist yet in this checkout")
    yield client
    client.close()


@pytest.fixture(scope="module")
def fleet(engine, tmp_path_factory) -> Iterator[dict]:
    """broker + orchestrator + runner-a (shell-agent) + runner-b (sleep-agent)."""
    from docker.types import IPAMConfig, IPAMPool

    engine.images.build(path=str(REPO), dockerfile="deploy/docker/Dockerfile", tag=IMAGE, rm=True)
    from mam.orchestrator.init import BROKER_SECRET_VARS, broker_password

    secrets_env = {name: broker_password() for name in BROKER_SECRET_VARS}
    assert list(secrets_env) == ["MAM_BROKER_PASS", "MAM_OBSERVER_PASS", "MAM_HOME_PASS", "MAM_SYS_PASS"]
    dispatch_secret = secrets.token_urlsafe(32)
    network = engine.networks.create(NETWORK + "-" + secrets.token_hex(3), driver="bridge",
                                      ipam=IPAMConfig(pool_configs=[IPAMPool(subnet=SUBNET)]))
    containers = []
    try:
        def run(name: str, image: str, ip: str, command: list[str], env: dict[str, str], volumes: dict):
            container = engine.containers.create(image, command=command, environment=env, volumes=volumes,
                                                 name=f"{network.name}-{name}", detach=True)
            network.connect(container, ipv4_address=ip, aliases=[name])
            container.start()
            containers.append(container)
            return container

        run("broker", "nats:2.12-alpine", "100.64.0.10", ["-c", "/etc/nats/nats.conf"], secrets_env,
            {str(REPO / "deploy" / "nats" / "nats.conf"): {"bind": "/etc/nats/nats.conf", "mode": "ro"}})
        fleet_env = {"MQTT_BROKER": "broker", "MQTT_PORT": "1883", "MQTT_USERNAME": "mam_agent",
                     "MQTT_PASSWORD": secrets_env["MAM_BROKER_PASS"], "MAM_DISPATCH_SECRET": dispatch_secret,
                     "MAM_REAL_ROOT": "/tmp/ws", "MAM_HEARTBEAT_SEC": "2"}
        agents = {str(REPO / "examples" / "agents"): {"bind": "/agents", "mode": "ro"}}
        hub = run("orchestrator", IMAGE, "100.64.0.20", ["sleep", "infinity"], fleet_env, {})
        for name, ip, agent in (("runner-a", "100.64.0.31", "shell-agent"),
                                ("runner-b", "100.64.0.32", "sleep-agent")):
            run(name, IMAGE, ip, ["mam-runner", "run", "--session", name, "--exec", f"/agents/{agent}"],
                fleet_env, agents)
        _wait_online(hub, ["runner-a", "runner-b"])
        yield {"hub": hub, "containers": containers}
    finally:
        for container in containers:
            container.remove(force=True)
        network.remove()


def _wait_online(hub, sessions: list[str], timeout_s: float = 60) -> None:
    """Poll `mam-orch runners` (or the retained presence) until every session is online (§7)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        code, out = hub.exec_run(["mam-orch", "runners", "--json"])
        if code == 0:
            online = {json.loads(line).get("session") for line in out.decode().splitlines() if line.strip()}
            if set(sessions) <= online:
                return
        time.sleep(0.5)
    raise AssertionError(f"runners {sessions} not online within {timeout_s} s")


def _dispatch(hub, session: str, brief: str) -> tuple[int, list[dict]]:
    hub.exec_run(["sh", "-c", f"mkdir -p /tmp/ws && printf '%s' {json.dumps(brief)} > /tmp/ws/brief.txt"])
    code, out = hub.exec_run(["mam-orch", "dispatch", "--session", session, "--brief-file", "/tmp/ws/brief.txt"])
    events = [json.loads(line) for line in out.decode().splitlines() if line.startswith("{")]
    return code, events


def test_happy_path_completes_across_containers(fleet):
    """§5 dispatch → §11 runner → §3 events → hub exits 0 with `completed`."""
    code, events = _dispatch(fleet["hub"], "runner-a", "echo hello from the e2e fleet\n")
    assert code == 0, events
    assert events[0]["event"] == "started" and events[-1]["event"] == "completed"


def test_cancel_stops_the_remote_agent(fleet):
    """§6: the hub's cancel reaches runner-b, which kills the agent and reports `error`/cancelled."""
    hub = fleet["hub"]
    hub.exec_run(["sh", "-c", "printf 3600 > /tmp/brief-sleep.txt"])
    exec_id = hub.client.api.exec_create(hub.id, ["mam-orch", "dispatch", "--session", "runner-b",
                                                  "--brief-file", "/tmp/brief-sleep.txt"])["Id"]
    hub.client.api.exec_start(exec_id, detach=True)
    deadline = time.monotonic() + 60
    job_id = None
    while job_id is None and time.monotonic() < deadline:
        code, out = hub.exec_run(["mam-orch", "jobs", "--status", "running", "--json"])
        rows = [json.loads(line) for line in out.decode().splitlines() if line.startswith("{")]
        job_id = rows[0]["job_id"] if rows else None
        if job_id is None:
            time.sleep(0.5)
    assert job_id, "the sleep job never reached running"
    code, _ = hub.exec_run(["mam-orch", "cancel", job_id])
    assert code == 0
    while time.monotonic() < deadline:
        info = hub.client.api.exec_inspect(exec_id)
        if not info["Running"]:
            assert info["ExitCode"] == 4  # §9: cancelled
            return
        time.sleep(0.5)
    raise AssertionError("dispatch did not end after the cancel")
