"""Docker end-to-end: tests/e2e/docker-compose.yaml on a real engine.

A broker (the production deploy/nats/nats.conf), a hub, three runners and a dashboard host
run in containers on one internal network inside 100.64.0.0/10 with MagicDNS-style aliases;
iptables rules generated from deploy/tailscale/policy.hujson enforce the tailnet policy.
`mam-orch` runs inside the hub container. Scenarios: the happy path on each runner (§3-§5,
§9 exit 0), cancel with the agent's tree gone (§6, exit 4), `docker kill` of a runner mid-job
then `redispatch` elsewhere (§8), a network cut longer than the MQTT keepalive (§7 Last Will,
§17 outbox: nothing runs twice), a broker restart mid-job, a hub restart then `watch`, and a
repository job (§18): runner-a fetches `demo` from the hub node's git server container over
the tailnet (tcp/9418, granted by the policy) and the change comes back to the hub.

Runs as root: harness.docker_env installs docker.io/docker-compose/debootstrap, starts dockerd
when none answers (and stops it after), and builds the images offline (the debootstrapped base
image is kept between runs). Skips, saying why, when not root. `make e2e-docker` runs this file.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import subprocess
from collections.abc import Iterator

import pytest
from harness import docker_env
from harness.docker_fleet import COMPOSE_FILE, DOMAIN, RUNNERS, STOP_TIMEOUT_S, DockerFleet, in_tailnet_range
from harness.gitserver import git
from harness.waiting import PATIENCE_S, wait_until

# The first run debootstraps the base image (about a minute) inside the first test's setup.
MODULE_TIMEOUT_S = 900
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(MODULE_TIMEOUT_S)]

BROKER = f"broker.{DOMAIN}"
MQTT_PORT = 1883
WS_PORT = 8080
MONITOR_PORT = 8222  # tests/e2e/nats-e2e.conf
NATS_PORT = 4222
PROBE_PORT = 9009  # a listener the test starts in the hub and in a runner
SHORT_JOB_S = 2
MID_JOB_S = 6
KILLED_JOB_S = 600  # never ends by itself: the kill or cancel always lands mid-job
LONG_IDLE_S = 120  # --idle-timeout of jobs that must outlive a network cut or a restart
CANCELLED = 4  # §9 exit code of a cancelled job


@pytest.fixture(scope="session")
def docker_engine() -> Iterator[docker_env.Engine]:
    """A Docker engine with the e2e images (started and stopped here when none answers)."""
    reason = docker_env.unavailable_reason()
    if reason:
        pytest.skip(reason)
    engine = docker_env.Engine().start()
    try:
        docker_env.build_images(engine.client)
        yield engine
    finally:
        engine.stop()


@pytest.fixture(scope="session")
def docker_client(docker_engine):
    return docker_engine.client


@pytest.fixture(scope="session")
def compose() -> list[str]:
    reason = docker_env.unavailable_reason()
    if reason:
        pytest.skip(reason)
    docker_env.install_packages()
    command = docker_env.compose_command()
    if command is None:
        pytest.skip("neither docker-compose nor `docker compose` is installed")
    return command


@pytest.fixture(scope="module")
def fleet(docker_client, compose) -> Iterator[DockerFleet]:
    handle = DockerFleet(docker_client, compose)
    try:
        yield handle.up()
    finally:
        handle.down()


def _dispatch_in_background(fleet: DockerFleet, session: str, brief: str, *extra: str) -> tuple[str, str]:
    """Start a blocking `mam-orch dispatch` in the hub; (exec id, job id) once the runner runs it."""
    before = fleet.job_ids()
    exec_id = fleet.start_orch("dispatch", "--session", session, "--brief", brief, *extra)
    job_id = fleet.new_job(before)
    fleet.wait_running(session, job_id)
    return exec_id, job_id


def _exit_code(fleet: DockerFleet, exec_id: str) -> int:
    return wait_until(lambda: (code := fleet.exec_result(exec_id)) is not None and (code,), PATIENCE_S,
                      "the hub's dispatch to end")[0]


def _runs(fleet: DockerFleet, session: str, job_id: str) -> int:
    """How many times the agent of `job_id` started on `session` (each run appends a line)."""
    code, out = fleet.sh(session, f"cat /tmp/runs-{job_id} 2>/dev/null || true")
    return len(out.split())


def _counted(seconds: int) -> str:
    """A brief that records each run of the agent, then sleeps."""
    return f'echo run >> "/tmp/runs-$MAM_JOB_ID"\nsleep {seconds}\n'


def test_compose_file_validates_with_the_installed_compose(compose):
    """One file for compose v1 (docker-compose 1.29) and v2: no top-level `name:`; `config` accepts it."""
    env = {name: "x" for name in ("MAM_BROKER_PASS", "MAM_OBSERVER_PASS", "MAM_HOME_PASS", "MAM_SYS_PASS",
                                  "MAM_DISPATCH_SECRET")}
    env["MAM_E2E_GIT"] = "/srv/repositories"  # a host folder: bind-mounted into the git server
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MAM_")}
    result = subprocess.run([*compose, "-p", "mam-e2e-config", "-f", str(COMPOSE_FILE), "config"],
                            capture_output=True, text=True, env={**clean, **env}, timeout=PATIENCE_S)
    assert result.returncode == 0, result.stderr
    assert "image: nats:2.12-alpine" in result.stdout  # MAM_BROKER_IMAGE's default
    assert not any(line.startswith("name:") for line in COMPOSE_FILE.read_text().splitlines())


def test_every_address_stays_inside_the_tailnet_range(fleet, docker_engine, docker_client):
    """Containers and network of the project, and the bridge of a dockerd started here, are
    inside 100.64.0.0/10 (an engine that was already running keeps its own settings)."""
    for container in fleet.containers():
        for settings in container.attrs["NetworkSettings"]["Networks"].values():
            assert in_tailnet_range(settings["IPAddress"]), (container.name, settings["IPAddress"])
    for name in (fleet.network_name, *(["bridge"] if docker_engine.proc is not None else [])):
        subnets = [c["Subnet"] for c in docker_client.networks.get(name).attrs["IPAM"]["Config"]]
        assert subnets and all(in_tailnet_range(s) for s in subnets), (name, subnets)
    assert ipaddress.ip_address(fleet.ip("broker")) in ipaddress.ip_network(fleet.subnet)


def test_tailnet_policy_holds_between_containers(fleet):
    """policy.hujson: runners reach only the broker's MQTT port, observers only its WebSocket port;
    refusals are the firewall's (EHOSTUNREACH), not closed ports (the same port is open locally)."""
    fleet.listen("hub", PROBE_PORT)
    fleet.listen("runner-b", PROBE_PORT)
    assert fleet.probe("runner-a", BROKER, MQTT_PORT) == 0
    for host, port in ((BROKER, WS_PORT), (BROKER, MONITOR_PORT), (BROKER, NATS_PORT),
                       (f"hub.{DOMAIN}", PROBE_PORT), (f"runner-b.{DOMAIN}", PROBE_PORT)):
        assert fleet.probe("runner-a", host, port) == errno.EHOSTUNREACH, (host, port)
    assert fleet.probe("observer", BROKER, WS_PORT) == 0
    assert fleet.observer_connects(BROKER, WS_PORT)  # a dashboard's MQTT-over-WebSocket session
    for host, port in ((BROKER, MQTT_PORT), (BROKER, MONITOR_PORT), (f"runner-b.{DOMAIN}", PROBE_PORT)):
        assert fleet.probe("observer", host, port) == errno.EHOSTUNREACH, (host, port)
    # the ports are really open: the broker's node (hub + broker) reaches the monitoring port
    assert fleet.probe("hub", BROKER, MONITOR_PORT) == 0
    assert fleet.probe("runner-b", "127.0.0.1", PROBE_PORT) == 0


def test_happy_path_on_each_runner(fleet):
    """§5 dispatch → §11 runner → §3 events: each runner completes its own job, hub exit 0."""
    jobs = {}
    for session in RUNNERS:
        code, rows, out = fleet.orch("dispatch", "--session", session, "--brief", f"sleep {SHORT_JOB_S}",
                                     "--detach")
        assert code == 0, out
        jobs[session] = rows[0]["job_id"]
    for session, job_id in jobs.items():
        code, _, out = fleet.orch("watch", job_id)  # follows it to its end, or finds it ended already
        assert code == 0, out
        record = fleet.record(job_id)
        completed = [line for line in record["audit"] if line.get("event") == "completed"]
        assert record["status"] == "completed" and record["session"] == session, out
        assert len(completed) == 1 and completed[0]["data"]["session"] == session, record["audit"]


def test_repository_job_fetches_from_the_git_server_and_the_change_comes_back(fleet):
    """§18 across hosts: runner-a fetches `demo@main` from git.mam-e2e.ts.net:9418 and runs the
    brief in a worktree; `result` at the hub shows both files and the base commit; runner-b may
    not reach the git server's other ports."""
    # a dispatch that follows the job to its end also takes its result in (§18)
    code, events, out = fleet.orch("dispatch", "--session", "runner-a", "--repo", "demo", "--ref", "main",
                                   "--brief", "echo notes > NOTES.md\nprintf 'print(2)\\n' > src/app.py")
    assert code == 0, out
    assert events[-1]["event"] == "completed" and events[-1]["data"]["session"] == "runner-a", out
    job_id = events[-1]["job_id"]

    def ready() -> dict | None:
        code, rows, _ = fleet.orch("result", job_id, "--json")
        return rows[0] if code == 0 and rows and rows[0].get("ready") else None

    result = wait_until(ready, PATIENCE_S, "the result at the hub")
    assert result["base_sha"] == git("rev-parse", "main", cwd=fleet.origin).strip()
    assert sorted(f["path"] for f in result["files"]) == ["NOTES.md", "src/app.py"]
    assert fleet.probe("runner-b", f"git.{DOMAIN}", 22) == errno.EHOSTUNREACH


def test_cancel_stops_the_agent_tree(fleet):
    """§6: the hub's cancel reaches runner-a, which kills the agent and its grandchild; exit 4."""
    pids = "/tmp/sleep-agent.pids"
    brief = f"SLEEP_AGENT_PIDFILE={pids} /agents/sleep-agent {KILLED_JOB_S}"
    exec_id, job_id = _dispatch_in_background(fleet, "runner-a", brief, "--idle-timeout", str(LONG_IDLE_S))
    wait_until(lambda: fleet.sh("runner-a", f"test -s {pids}")[0] == 0, PATIENCE_S, "the agent's pid file")
    tree = fleet.sh("runner-a", f"cat {pids}")[1].split()
    assert len(tree) == 2
    code, _, out = fleet.orch("cancel", job_id)
    assert code == 0, out
    assert _exit_code(fleet, exec_id) == CANCELLED
    alive = f"ps -o stat= -p {','.join(tree)} | grep -v '^Z' || true"
    wait_until(lambda: fleet.sh("runner-a", alive)[1].strip() == "", PATIENCE_S, "the agent's tree to be gone")
    assert fleet.record(job_id)["status"] == "cancelled"


def test_docker_kill_of_a_runner_then_redispatch_elsewhere(fleet):
    """`docker kill` mid-job: the hub closes the job (not completed); `redispatch --session
    runner-c` runs the next attempt there to completion (§8)."""
    exec_id, job_id = _dispatch_in_background(fleet, "runner-b", _counted(KILLED_JOB_S))
    fleet.container("runner-b").kill()
    try:
        verdict = _exit_code(fleet, exec_id)
        record = fleet.record(job_id)
        assert verdict != 0 and record["status"] == "error", record
        code, events, out = fleet.orch("redispatch", job_id, "--session", "runner-c",
                                       "--brief", _counted(SHORT_JOB_S))
        assert code == 0, out
        assert events[-1]["event"] == "completed" and events[-1]["data"]["session"] == "runner-c", out
        assert fleet.record(job_id)["attempt_id"] == 2
        assert _runs(fleet, "runner-c", job_id) == 1
    finally:
        fleet.container("runner-b").start()
        fleet.wait_online(["runner-b"])


def test_network_cut_longer_than_the_keepalive(fleet):
    """`docker network disconnect` of runner-a until the broker gives up on it (its Last Will
    says offline, §7), then reconnect: the job completes, its agent ran once, one terminal."""
    exec_id, job_id = _dispatch_in_background(fleet, "runner-a", _counted(MID_JOB_S),
                                              "--idle-timeout", str(LONG_IDLE_S))
    fleet.network.disconnect(fleet.container("runner-a"))
    try:
        wait_until(lambda: fleet.status("runner-a") == "lost", PATIENCE_S, "runner-a's Last Will (lost, §7)")
    finally:
        fleet.reconnect("runner-a")
    assert _exit_code(fleet, exec_id) == 0
    record = fleet.record(job_id)
    assert record["status"] == "completed" and record["attempt_id"] == 1
    terminals = [a for a in record["audit"] if a.get("event") in ("completed", "error")]
    assert len(terminals) == 1, record["audit"]
    assert _runs(fleet, "runner-a", job_id) == 1
    fleet.wait_online(["runner-a"])


def test_broker_restart_mid_job(fleet):
    """The broker container restarts while runner-c runs a job: the hub's dispatch still ends 0."""
    exec_id, job_id = _dispatch_in_background(fleet, "runner-c", _counted(MID_JOB_S),
                                              "--idle-timeout", str(LONG_IDLE_S))
    fleet.container("broker").restart(timeout=STOP_TIMEOUT_S)
    assert _exit_code(fleet, exec_id) == 0
    assert fleet.record(job_id)["status"] == "completed"
    assert _runs(fleet, "runner-c", job_id) == 1
    fleet.wait_online(RUNNERS)


def test_hub_restart_then_watch_resolves_the_job(fleet):
    """The hub container restarts mid-job (its dispatch dies with it); `mam-orch watch` then
    resolves the job from the retained state and events (§8, §14)."""
    _, job_id = _dispatch_in_background(fleet, "runner-b", _counted(MID_JOB_S), "--idle-timeout", str(LONG_IDLE_S))
    fleet.container("hub").restart(timeout=STOP_TIMEOUT_S)
    code, events, out = fleet.orch("watch", job_id)
    assert code == 0, out
    assert events[-1]["event"] == "completed", out
    assert fleet.record(job_id)["status"] == "completed"
    assert _runs(fleet, "runner-b", job_id) == 1
