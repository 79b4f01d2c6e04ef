"""`mam-orch broker up|status|down` through the real CLI in a temporary
workspace (PROTOCOL §1.2-§1.3, §9, §13): the detached nats-server,
the written `.mam.env`, native status checks, clean shutdown, refusals, and the
re-clear of retained topics after an unclean stop (§2)."""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import stat
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from dotenv import dotenv_values
from harness.brokers import free_port
from harness.waiting import PATIENCE_S, QUIET_S

from mam.orchestrator.broker import embedded as broker_mod
from mam.shared.config import BrokerConfig, broker_config
from mam.shared.protocol import names
from mam.shared.protocol.errors import BrokerError
from mam.shared.store.registry import Registry
from mam.shared.transport import mqtt

pytestmark = [pytest.mark.broker, pytest.mark.e2e]


def orch(*args: str, timeout_s: float = PATIENCE_S) -> subprocess.CompletedProcess:
    """Run `mam-orch` as a real process."""
    return subprocess.run([sys.executable, "-m", "mam.orchestrator.cli", *args],
                          capture_output=True, text=True, timeout=timeout_s)


def nats_processes_in(workspace: Path) -> list[psutil.Process]:
    """nats-server processes started for `workspace` (matched by their config path)."""
    found = []
    for proc in psutil.process_iter(["name", "cmdline"]):
        try:
            if "nats-server" in (proc.info["name"] or "") and \
                    any(str(workspace) in part for part in proc.info["cmdline"] or []):
                found.append(proc)
        except psutil.Error:
            continue
    return found


@pytest.fixture
def workspace(tmp_path):
    """A workspace whose broker is always taken down after the test."""
    yield tmp_path
    orch("broker", "down", "--workspace", str(tmp_path))
    for proc in nats_processes_in(tmp_path):  # never leave a server behind, even on failure
        proc.kill()


def ports() -> list[str]:
    return ["--mqtt-port", str(free_port()), "--port", str(free_port()), "--ws-port", str(free_port())]


def test_up_status_down_round_trip(workspace):
    """up starts a detached server and writes a 0600 .mam.env whose credentials work
    over MQTT; status reports version, JetStream and the MQTT streams; down stops it
    and leaves no process; status then exits 3."""
    up = orch("broker", "up", "--workspace", str(workspace), *ports())
    assert up.returncode == 0, up.stderr
    info = json.loads(up.stdout)
    assert info["status"] == "started"

    env_path = workspace / ".mam.env"
    conf_path = workspace / ".mam" / "broker" / "nats.conf"
    for path in (env_path, conf_path):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    env = dotenv_values(env_path)
    assert env["MQTT_PORT"] == str(info["mqtt_port"]) and env["MQTT_USERNAME"] == "mam_agent"
    assert len(env["MAM_DISPATCH_SECRET"]) >= 32 and env["MAM_OBSERVER_USERNAME"] == "mam_observer"
    secrets_ = [env["MQTT_PASSWORD"], env["MAM_OBSERVER_PASSWORD"], env["MAM_DISPATCH_SECRET"]]
    log_text = (workspace / ".mam" / "broker" / "nats-server.log").read_text()
    for secret in secrets_:
        assert secret not in up.stdout + up.stderr + log_text

    # a client configured from the written .mam.env publishes and subscribes
    agent = BrokerConfig(hosts=(env["MQTT_BROKER"],), port=int(env["MQTT_PORT"]),
                         username=env["MQTT_USERNAME"], password=env["MQTT_PASSWORD"])
    observer = agent.with_overrides(username=env["MAM_OBSERVER_USERNAME"],
                                    password=env["MAM_OBSERVER_PASSWORD"])
    topic = names.state_topic("0123abcd", env["MAM_TOPIC_ROOT"])
    with mqtt.MqttClient(agent, "hub") as sub:
        sub.subscribe([(topic, 1)])
        mqtt.publish_with_retry(agent, "runner", [(topic, b"state", True)])
        assert sub.messages.get(timeout=PATIENCE_S).payload == b"state"
    with mqtt.MqttClient(observer, "observer") as obs:
        obs.subscribe([(names.all_jobs_filter(env["MAM_TOPIC_ROOT"]), 1)])
        assert obs.messages.get(timeout=PATIENCE_S).retain

    status = orch("broker", "status", "--workspace", str(workspace))
    assert status.returncode == 0, status.stderr
    report = json.loads(status.stdout)
    assert report["healthy"] and report["jetstream"] and report["version"]
    assert {"$MQTT_msgs", "$MQTT_rmsgs", "$MQTT_sess"} <= set(report["mqtt_streams"])
    assert report["pid"] == info["pid"]

    again = orch("broker", "up", "--workspace", str(workspace))
    assert again.returncode == 0 and json.loads(again.stdout)["status"] == "already running"
    assert json.loads(again.stdout)["pid"] == info["pid"]

    down = orch("broker", "down", "--workspace", str(workspace))
    assert down.returncode == 0 and json.loads(down.stdout)["status"] == "stopped"
    assert not psutil.pid_exists(info["pid"]) or psutil.Process(info["pid"]).status() == psutil.STATUS_ZOMBIE
    assert nats_processes_in(workspace) == []

    after = orch("broker", "status", "--workspace", str(workspace))
    assert after.returncode == 3 and "not running" in after.stderr
    assert len(after.stderr.strip().splitlines()) == 1
    assert orch("broker", "down", "--workspace", str(workspace)).returncode == 0  # idempotent


def test_up_again_reuses_the_passwords_of_the_existing_env(workspace):
    """An existing .mam.env is kept and its passwords configure the broker, so clients match."""
    first = orch("broker", "up", "--workspace", str(workspace), *ports())
    assert first.returncode == 0, first.stderr
    before = (workspace / ".mam.env").read_bytes()
    assert orch("broker", "down", "--workspace", str(workspace)).returncode == 0
    second = orch("broker", "up", "--workspace", str(workspace), "--port", str(free_port()),
                  "--ws-port", "0")
    assert second.returncode == 0, second.stderr
    assert (workspace / ".mam.env").read_bytes() == before
    env = dotenv_values(workspace / ".mam.env")
    assert json.loads(second.stdout)["mqtt_port"] == int(env["MQTT_PORT"])  # port taken from the env
    config = BrokerConfig(hosts=("127.0.0.1",), port=int(env["MQTT_PORT"]),
                          username=env["MQTT_USERNAME"], password=env["MQTT_PASSWORD"])
    with mqtt.MqttClient(config, "hub"):
        pass


def test_up_on_another_port_than_the_existing_env_says_so(workspace):
    """`init` wrote MQTT_PORT=1883; `broker up --mqtt-port P` runs, and one WARNING line says the
    hub's and runners' settings point elsewhere (the env file is left as it is)."""
    (workspace / ".mam.env").write_text("MQTT_USERNAME=mam_agent\nMQTT_PASSWORD=Agent-password-0123456789\n"
                                        "MQTT_PORT=1883\n")
    mqtt_port = free_port()
    up = orch("broker", "up", "--workspace", str(workspace), "--mqtt-port", str(mqtt_port), "--port",
              str(free_port()), "--ws-port", "0")
    try:
        assert up.returncode == 0, up.stderr
        warnings = [line for line in up.stderr.splitlines() if line.startswith("WARNING")]
        assert warnings == [f"WARNING: {workspace / '.mam.env'} has MQTT_PORT=1883 but this broker listens on "
                            f"{mqtt_port}: set MQTT_PORT={mqtt_port} there and in the runners' .mam.env, or "
                            "they will not find it"]
        assert "Agent-password" not in up.stdout + up.stderr
    finally:
        orch("broker", "down", "--workspace", str(workspace))


def test_port_in_use_is_one_line_error_and_leaves_no_process(workspace):
    """A taken MQTT port: one-line error naming the port and the option, exit 1; nothing started."""
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", 0))
        blocker.listen()
        busy = blocker.getsockname()[1]
        result = orch("broker", "up", "--workspace", str(workspace), "--mqtt-port", str(busy),
                      "--port", str(free_port()), "--ws-port", str(free_port()))
    assert result.returncode == 1  # §9: 3 means "broker unreachable", not "could not start"
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and f"port {busy}" in lines[0] and "--mqtt-port" in lines[0]
    assert "Traceback" not in result.stderr
    assert nats_processes_in(workspace) == []
    assert not (workspace / ".mam.env").exists()


def test_port_taken_after_the_check_is_read_from_the_server_log(tmp_path):
    """A port lost between check and start: nats-server exits and its log gives the reason."""
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", 0))
        blocker.listen()
        busy = blocker.getsockname()[1]
        creds = broker_mod.BrokerCredentials.fresh()
        settings = broker_mod.NatsSettings(store_dir=tmp_path / "js", port=free_port(),
                                           mqtt_port=busy, ws_port=None)
        conf = broker_mod.write_private(tmp_path / "nats.conf", broker_mod.render_nats_config(settings, creds))
        log = tmp_path / "nats.log"
        proc = broker_mod.start_nats_server(conf, log, detach=False)
        try:
            config = BrokerConfig(hosts=("127.0.0.1",), port=busy, username=creds.agent_user,
                                  password=creds.agent_password)
            with pytest.raises(BrokerError, match="already in use") as info:
                broker_mod.wait_mqtt_ready(config, timeout_s=PATIENCE_S, proc=proc, log_path=log)
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)
    assert "\n" not in str(info.value) and creds.agent_password not in str(info.value)


@pytest.mark.parametrize("line, problem", [
    ('MQTT_PASSWORD="has space"', "printable"),
    ('MQTT_PASSWORD="quote\\"inside-long"', "printable"),
    ("MQTT_PASSWORD=short", "8-256"),
    ("MQTT_PASSWORD=dollar$ign-long-enough", "printable"),
])
def test_hostile_existing_env_is_refused_before_anything_starts(workspace, line, problem):
    """A .mam.env password that could break or inject into nats.conf is refused (exit 64)."""
    (workspace / ".mam.env").write_text(f"MQTT_USERNAME=mam_agent\n{line}\n")
    result = orch("broker", "up", "--workspace", str(workspace), *ports())
    assert result.returncode == 64, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and problem in result.stderr
    assert nats_processes_in(workspace) == [] and not (workspace / ".mam" / "broker" / "nats.conf").exists()


def test_env_without_credentials_is_refused(workspace):
    (workspace / ".mam.env").write_text("MQTT_BROKER=localhost\n")
    result = orch("broker", "up", "--workspace", str(workspace), *ports())
    assert result.returncode == 64 and "MQTT_PASSWORD" in result.stderr
    assert nats_processes_in(workspace) == []


def test_undecodable_env_is_a_read_error(workspace):
    """§9: a .mam.env that exists but cannot be decoded → `ERROR: <path>: cannot read (…)`, exit 1."""
    (workspace / ".mam.env").write_bytes(b"MQTT_PASSWORD=\xff\xfe\n")
    result = orch("broker", "up", "--workspace", str(workspace), *ports())
    assert result.returncode == 1
    assert result.stderr.strip() == f"ERROR: {workspace / '.mam.env'}: cannot read (UnicodeDecodeError)"


@pytest.mark.parametrize("args", [["--mqtt-port", "abc"], ["--bogus"], ["--port"]])
def test_bad_arguments_exit_64(workspace, args):
    result = orch("broker", "up", "--workspace", str(workspace), *args)
    assert result.returncode == 64
    assert nats_processes_in(workspace) == []


def test_status_with_stale_pid_file_reports_down(workspace):
    """A state file naming a dead or foreign pid is not a running broker."""
    bdir = workspace / ".mam" / "broker"
    bdir.mkdir(parents=True)
    (bdir / "state.json").write_text(json.dumps({"pid": os.getpid(), "create_time": 0, "port": 1}))
    result = orch("broker", "status", "--workspace", str(workspace))
    assert result.returncode == 3 and "not running" in result.stderr
    assert json.loads(orch("broker", "down", "--workspace", str(workspace)).stdout)["status"] == "not running"
    assert psutil.pid_exists(os.getpid())  # down never signalled the foreign pid


def test_rendered_config_is_the_shipped_template_with_its_variables_filled():
    """The embedded config is deploy/nats/nats.conf itself (one source):
    observer subscribes to the root subject AND the bare root (MQTT `#`), publishes
    nothing, and connects over MQTT and MQTT-over-WebSocket (MQTT_WS, not WEBSOCKET)."""
    settings = broker_mod.NatsSettings(store_dir=Path("/x"), topic_root="fleet/v1.2")
    text = broker_mod.render_nats_config(settings, broker_mod.BrokerCredentials.fresh())
    shipped = (Path(__file__).resolve().parents[2] / "deploy" / "nats" / "nats.conf").read_text()
    assert text.endswith(shipped.split("MAM_SUBJECTS:")[1].split("\n", 1)[1])  # everything below the variables
    assert 'MAM_SUBJECTS: ["fleet.v1//2", "fleet.v1//2.>"]' in text and 'deny:  [">"]' in text
    assert '"MQTT_WS"' in text and '"WEBSOCKET"' not in text
    assert "websocket {" in text and "jetstream: enabled" in text
    with pytest.raises(Exception, match="MQTT_USERNAME"):
        broker_mod.render_nats_config(settings, broker_mod.BrokerCredentials(
            agent_password="x" * 20, agent_user="bad user"))


def assert_refused_untouched(result: subprocess.CompletedProcess, workspace: Path, code: int,
                             *words: str) -> None:
    """One ERROR line holding `words`, exit `code`, no server, nothing written in `workspace`."""
    assert result.returncode == code, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ERROR: "), result.stderr
    for word in words:
        assert word in lines[0]
    assert result.stdout == ""
    assert nats_processes_in(workspace) == []
    assert not (workspace / ".mam.env").exists() and not (workspace / ".mam").exists()


@pytest.mark.parametrize("option, value", [
    ("--mqtt-port", "70000"), ("--port", "70000"), ("--ws-port", "70000"), ("--monitor-port", "70000"),
    ("--mqtt-port", "-1"), ("--mqtt-port", "0"), ("--port", "0"), ("--monitor-port", "0"),
    ("--ws-port", "-1"), ("--mqtt-port", "65536"), ("--port", str(2**64)),
])
def test_s9_port_out_of_range_is_usage_error(workspace, option, value):
    """A listener port outside 1..65535 (0 only turns --ws-port off) is refused at once:
    one line naming the option and the range, exit 64, nothing started or written."""
    args = ports() + [option, value]  # the last occurrence of an option wins
    result = orch("broker", "up", "--workspace", str(workspace), *args)
    assert_refused_untouched(result, workspace, 64, option, "1..65535")


@pytest.mark.parametrize("listen, problem", [
    ("bad host!", "is invalid"),
    ("", "is invalid"),
    ("host.invalid", "is invalid"),  # RFC 6761: never resolves
    ("a" * 300, "is invalid"),
    ('x"}\nhttp: 9', "is invalid"),  # hostile: would break out of the nats.conf string
    ("192.0.2.1", "not an address of this host"),  # RFC 5737 TEST-NET-1: valid, not local
])
def test_s9_bad_listen_address_is_usage_error(workspace, listen, problem):
    """--listen must be an IP address or resolvable host name of this machine (exit 64);
    a bad one is never reported as a port in use."""
    result = orch("broker", "up", "--workspace", str(workspace), *ports(), "--listen", listen)
    assert_refused_untouched(result, workspace, 64, "--listen", problem)
    assert "in use" not in result.stderr


@pytest.mark.parametrize("pair", [
    ("--mqtt-port", "--port"), ("--mqtt-port", "--ws-port"), ("--port", "--monitor-port"),
])
def test_s9_two_listeners_on_one_port_is_usage_error(workspace, pair):
    """Two options naming the same port: one line naming both options, exit 64."""
    same = str(free_port())
    given = dict(zip(["--mqtt-port", "--port", "--ws-port"], ports()[1::2], strict=False))
    given.update({pair[0]: same, pair[1]: same})
    args = [part for option, value in given.items() for part in (option, value)]
    result = orch("broker", "up", "--workspace", str(workspace), *args)
    assert_refused_untouched(result, workspace, 64, pair[0], pair[1], f"both {same}")


def test_s9_explicit_port_equal_to_a_default_is_usage_error(workspace):
    """--port 1883 collides with the default MQTT port: the message says it is the default."""
    result = orch("broker", "up", "--workspace", str(workspace), "--port", "1883",
                  "--ws-port", str(free_port()))
    assert_refused_untouched(result, workspace, 64, "--mqtt-port (default)", "--port", "1883")


def test_s13_env_mqtt_port_out_of_range_is_refused(workspace):
    """MQTT_PORT of an existing .mam.env is range-checked like the option (exit 64)."""
    (workspace / ".mam.env").write_text("MQTT_USERNAME=mam_agent\nMQTT_PASSWORD=long-enough-pw\n"
                                        "MQTT_PORT=99999\n")
    result = orch("broker", "up", "--workspace", str(workspace), "--port", str(free_port()),
                  "--ws-port", "0")
    assert result.returncode == 64 and "MQTT_PORT 99999 is out of range" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert nats_processes_in(workspace) == [] and not (workspace / ".mam").exists()


def test_s9_server_that_does_not_start_exits_1_and_writes_no_env(workspace):
    """nats-server exits at start (its JetStream store path is a file): one line with the
    reason, exit 1 (not 3, which means "broker unreachable"), no process, no .mam.env."""
    bdir = workspace / ".mam" / "broker"
    bdir.mkdir(parents=True)
    (bdir / "jetstream").write_text("not a directory\n")
    result = orch("broker", "up", "--workspace", str(workspace), *ports())
    assert result.returncode == 1, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "nats-server did not start" in lines[0]
    assert nats_processes_in(workspace) == []
    assert not (workspace / ".mam.env").exists() and not (bdir / "state.json").exists()


# ----------------------------------------------------------------- cleared retained topics after a restart

JOBS, ENDED, STARTED = 100, 85, 5  # 85 terminal + 5 started = the 90 dispatches the hub and runners cleared


def _retained_dispatches(config: BrokerConfig, job_ids: list[str]) -> set[str]:
    """The jobs among `job_ids` whose dispatch the broker holds retained (§2)."""
    wanted = {names.dispatch_topic(j, config.topic_root): j for j in job_ids}
    found: set[str] = set()
    with mqtt.MqttClient(config, "probe") as probe:
        probe.subscribe([(names.all_dispatches_filter(config.topic_root), 1)])
        while True:
            try:
                message = probe.messages.get(timeout=QUIET_S)
            except queue.Empty:
                return found
            if message.retain and message.payload and message.topic in wanted:
                found.add(wanted[message.topic])


def _hub_jobs_with_dispatches(workspace: Path, config: BrokerConfig) -> tuple[list[str], list[str]]:
    """JOBS hub jobs with a retained dispatch each; ENDED closed and STARTED running in the
    registry, their dispatches cleared. Returns (cleared job ids, pending job ids)."""
    registry = Registry(workspace)
    job_ids = [registry.register(session="box")["job_id"] for _ in range(JOBS)]
    mqtt.publish_with_retry(config, "hub", [(names.dispatch_topic(j, config.topic_root), b"dispatch " + j.encode(),
                                             True) for j in job_ids])
    for job_id in job_ids[:ENDED]:
        registry.close(job_id, "cancelled")
    for job_id in job_ids[ENDED:ENDED + STARTED]:
        with registry.transaction(job_id) as tx:
            tx.update({**tx.record, "status": "running"}, source="watch", reason="started")
    cleared = job_ids[:ENDED + STARTED]
    mqtt.publish_with_retry(config, "hub", [(names.dispatch_topic(j, config.topic_root), b"", True) for j in cleared])
    return cleared, job_ids[ENDED + STARTED:]


def test_fault7_broker_up_after_a_sigkill_keeps_cleared_dispatches_cleared(workspace):
    """100 retained dispatches, 90 cleared, nats-server SIGKILLed, `broker up` again: its
    stale pid file says the stop was unclean, so it re-clears what the registry says must
    stay cleared (nats-server 2.15 brought all 100 back); the 10 pending stay retained."""
    up = orch("broker", "up", "--workspace", str(workspace), *ports())
    assert up.returncode == 0, up.stderr
    info = json.loads(up.stdout)
    assert info["unclean_stop"] is False and "recleared_jobs" not in info
    config = broker_config(environ={"MAM_ENV_FILE": str(workspace / ".mam.env")}, warn=False)
    cleared, pending = _hub_jobs_with_dispatches(workspace, config)
    assert _retained_dispatches(config, cleared + pending) == set(pending)

    os.kill(info["pid"], signal.SIGKILL)
    psutil.wait_procs([psutil.Process(info["pid"])], timeout=PATIENCE_S)
    again = orch("broker", "up", "--workspace", str(workspace), "--port", str(info["port"]),
                 "--ws-port", str(info["ws_port"]))
    assert again.returncode == 0, again.stderr
    report = json.loads(again.stdout)
    assert report["status"] == "started" and report["unclean_stop"] is True
    assert report["recleared_jobs"] == len(cleared)
    assert _retained_dispatches(config, cleared + pending) == set(pending)


def test_fault7_gc_reclear_clears_dispatches_that_came_back(workspace):
    """`mam-orch gc --reclear` on demand: resurrected dispatches of ended and started jobs
    are cleared again, one JSON line per job; pending dispatches are left alone."""
    up = orch("broker", "up", "--workspace", str(workspace), *ports())
    assert up.returncode == 0, up.stderr
    config = broker_config(environ={"MAM_ENV_FILE": str(workspace / ".mam.env")}, warn=False)
    cleared, pending = _hub_jobs_with_dispatches(workspace, config)
    mqtt.publish_with_retry(config, "crash", [(names.dispatch_topic(j, config.topic_root), b"back", True)
                                              for j in cleared])  # what the crash brought back
    result = orch("gc", "--reclear", "--workspace", str(workspace))
    assert result.returncode == 0, result.stderr
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert sorted(line["job_id"] for line in lines) == sorted(cleared)
    assert {tuple(line["recleared"]) for line in lines if line["status"] == "running"} == {("dispatch",)}
    assert {tuple(line["recleared"]) for line in lines if line["status"] == "cancelled"} == {("dispatch", "control")}
    assert _retained_dispatches(config, cleared + pending) == set(pending)


def test_fault7_gc_reclear_goes_through_every_host_of_the_failover_list(workspace):
    """§13 fail-over list: `gc --reclear` clears through each host in turn (a cluster node
    clears its own cache of retained messages). Hosts that do not answer (127.0.0.2 and .3:
    the broker listens on 127.0.0.1 only) are one WARNING line each, before and after the one
    that answers, which is still cleared; when no host answers it exits 3."""
    up = orch("broker", "up", "--workspace", str(workspace), *ports())
    assert up.returncode == 0, up.stderr
    env_file = workspace / ".mam.env"
    config = broker_config(environ={"MAM_ENV_FILE": str(env_file)}, warn=False)
    cleared, pending = _hub_jobs_with_dispatches(workspace, config)
    mqtt.publish_with_retry(config, "crash", [(names.dispatch_topic(j, config.topic_root), b"back", True)
                                              for j in cleared])
    kept = env_file.read_text()
    env_file.write_text(kept.replace("MQTT_BROKER=127.0.0.1", "MQTT_BROKER=127.0.0.2,127.0.0.1,127.0.0.3"))
    result = orch("gc", "--reclear", "--workspace", str(workspace))
    assert result.returncode == 0, result.stderr
    warnings = result.stderr.strip().splitlines()
    assert [w.split(":", 2)[1].strip() for w in warnings] == [f"re-clearing through 127.0.0.{n}" for n in (2, 3)]
    assert all(f"gc --reclear --workspace {workspace}" in w for w in warnings)
    assert config.password not in result.stderr
    assert _retained_dispatches(config, cleared + pending) == set(pending)

    env_file.write_text(kept.replace("MQTT_BROKER=127.0.0.1", "MQTT_BROKER=127.0.0.2"))
    nowhere = orch("gc", "--reclear", "--workspace", str(workspace))
    assert nowhere.returncode == 3, nowhere.stderr
    assert len(nowhere.stderr.strip().splitlines()) == 1 and "127.0.0.2" in nowhere.stderr
