"""PROTOCOL §16, issue 13 item 5: least privilege at the broker. A real nats-server from the
venv runs the config `mam-orch init --broker-config` wrote; `mam-orch runner add` gives
runners A and B their own broker users (passwords in 0600 files, never on stdout) and
edits that config, `nats-server --signal reload` (the command `runner add|revoke` print)
applies it. With A's user: a dispatch or a control it publishes reaches no subscriber,
B's presence cannot be subscribed to (SUBACK 0x80), and a real v2 runner A completes a
hub job. After `runner revoke A` and the reload, A's user cannot connect; B's still can."""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
from harness.brokers import free_port
from harness.runnersim import AGENTS, MAM_ORCH, MAM_RUNNER, hub_env, orch, retained, runner_log
from harness.shipped import NATS_BIN, receive, start_broker, stop_broker
from harness.waiting import PATIENCE_S, wait_until
from harness.workspace import clean_env

from mam.orchestrator import init as mam_init
from mam.shared import keys, names, wire, wirev2
from mam.shared.config import BrokerConfig, broker_config, read_env_file, write_env_file
from mam.shared.errors import BrokerError, BrokerUnavailable, PublishTimeout
from mam.shared.mqtt import Message, MqttClient

pytestmark = [pytest.mark.broker, pytest.mark.e2e, pytest.mark.timeout(6 * PATIENCE_S)]

SESSION_A, SESSION_B = "box-a", "box-b"
PUBACK_WAIT_S = 3.0
"""A broker may refuse to acknowledge a forbidden PUBLISH: how long the test waits for the PUBACK (s)."""


@dataclass
class Hub:
    """The hub workspace and its broker, as `harness.runnersim.retained` wants it (`config()`, `topic_root`)."""

    root: Path
    cfg: BrokerConfig
    pid: int

    @property
    def topic_root(self) -> str:
        return self.cfg.topic_root

    def config(self) -> BrokerConfig:
        return self.cfg

    def reload(self) -> None:
        """What `runner add|revoke` told the operator to run."""
        subprocess.run([str(NATS_BIN), "--signal", f"reload={self.pid}"], check=True, capture_output=True,
                       timeout=PATIENCE_S)


def as_runner(hub: Hub, session: str) -> BrokerConfig:
    """The hub's settings with the runner's own user from its credentials file."""
    creds = read_env_file(names.runner_credentials_path(hub.root, session))
    return replace(hub.cfg, username=creds["MQTT_USERNAME"], password=creds["MQTT_PASSWORD"],
                   client_id_prefix=session)


def can_connect(cfg: BrokerConfig) -> bool:
    try:
        with MqttClient(cfg, "probe").connect(timeout_s=PATIENCE_S):
            return True
    except BrokerUnavailable:
        return False


def add_runner(hub: Hub, workspace: Path, session: str) -> None:
    """`mam-runner`'s keys on `workspace`, enrolled with `mam-orch runner add`."""
    made = keys.create_runner_keys(workspace)
    keys.write_trusted_hub_keys(workspace, [keys.public_text(keys.hub_key(hub.root))])
    added = orch(hub.root, "runner", "add", "--session", session, "--ed25519", made.ed25519_public,
                 "--x25519", made.x25519_public)
    assert added.returncode == 0, added.stderr
    creds = names.runner_credentials_path(hub.root, session)
    assert creds.stat().st_mode & 0o777 == 0o600
    assert read_env_file(creds)["MQTT_PASSWORD"] not in added.stdout + added.stderr
    assert f"broker user {session}: its password is in {creds}" in added.stdout
    assert "nats-server --signal reload=<pid>" in added.stdout, added.stdout


@pytest.fixture
def hub(tmp_path) -> Hub:
    root, folder = tmp_path / "hub", tmp_path / "broker"
    for path in (root / ".git", folder):
        path.mkdir(parents=True)
    port = free_port()
    mam_init.init_workspace(root, broker_config=folder / "nats.conf", broker_host="127.0.0.1", port=port,
                            environ={}, store_dir=str(tmp_path / "js"))
    conf = folder / "nats.conf"  # the generated config, on free loopback ports
    conf.write_text(mam_init.set_conf_variables(conf.read_text(), {
        "MAM_LISTEN": "127.0.0.1", "MAM_WS_PORT": free_port(), "MAM_NATS_PORT": free_port()}))
    env = {"PATH": os.environ.get("PATH", ""), **read_env_file(folder / mam_init.BROKER_ENV_NAME)}
    proc = start_broker("nats-server", [str(NATS_BIN), "-c", str(conf)], env, folder / "nats.log", [port])
    cfg = broker_config(workspace=root, warn=False)
    wait_until(lambda: can_connect(cfg), what="nats-server to accept the hub")
    try:
        yield Hub(root, cfg, proc.pid)
    finally:
        stop_broker(proc)


def test_s16_runner_broker_user_least_privilege_and_revocation(hub: Hub, tmp_path):
    ws_a, ws_b = tmp_path / "runner-a", tmp_path / "runner-b"
    add_runner(hub, ws_a, SESSION_A)
    add_runner(hub, ws_b, SESSION_B)
    hub.reload()
    a_cfg, b_cfg = as_runner(hub, SESSION_A), as_runner(hub, SESSION_B)
    wait_until(lambda: can_connect(a_cfg) and can_connect(b_cfg), what="both runner users after the reload")
    root, job = hub.topic_root, "0000d15b"
    with MqttClient(hub.cfg, "hub").connect() as watcher, MqttClient(a_cfg, "attacker").connect() as attacker:
        watcher.subscribe([(f"{root}/#", 1)])
        a_keys = keys.load_runner_keys(ws_a)
        assert a_keys is not None
        forged = wirev2.sign(wire.Control.cancel(job, 1, "operator"), a_keys.ed25519)
        for topic, payload in ((names.dispatch_topic(job, root), b"forged dispatch"),
                               (names.control_topic(job, root), wire.encode(forged))):
            try:
                attacker.publish(topic, payload, qos=1, retain=True, timeout_s=PUBACK_WAIT_S)
            except PublishTimeout:
                pass  # not acknowledged is refused too
        with pytest.raises(BrokerError, match="refused the subscription"):
            attacker.subscribe([(names.presence_topic(SESSION_B, root), 1)])
        attacker.publish(names.state_topic(job, root), b"marker", qos=1)  # what a runner may do arrives
        seen: list[Message] = []
        receive(watcher, lambda m: m.payload == b"marker", seen=seen)
        assert [m.topic for m in seen] == [names.state_topic(job, root)]
    assert retained(hub, names.dispatch_topic(job, root)) is None
    assert retained(hub, names.control_topic(job, root)) is None

    # A's user does everything a runner needs: a real v2 runner A completes a hub job
    (ws_a / ".git").mkdir()
    write_env_file(ws_a / ".mam.env", {"MQTT_BROKER": "127.0.0.1", "MQTT_PORT": str(hub.cfg.port),
                                       "MQTT_USERNAME": a_cfg.username, "MQTT_PASSWORD": a_cfg.password,
                                       "MQTT_KEEPALIVE": "5", "MAM_TOPIC_ROOT": root}, overwrite=True)
    with open(tmp_path / "runner-a.stderr", "wb") as err:
        runner = subprocess.Popen([*MAM_RUNNER, "run", "--session", SESSION_A, "--exec", str(AGENTS / "shell-agent"),
                                   "--workspace", str(ws_a)], env=clean_env(), stdout=subprocess.DEVNULL, stderr=err)
    try:
        wait_until(lambda: runner.poll() is not None
                   or b'"online"' in (retained(hub, names.presence_topic(SESSION_A, root), 0.3) or b""),
                   what="runner A's online presence")
        done = subprocess.run([*MAM_ORCH, "dispatch", "--session", SESSION_A, "--brief", "echo done-by-a", "--json",
                               "--workspace", str(hub.root)], env=hub_env(), capture_output=True, text=True,
                              timeout=2 * PATIENCE_S, stdin=subprocess.DEVNULL)
        assert done.returncode == 0, done.stderr + runner_log(ws_a)
        assert '"completed"' in done.stdout
    finally:
        runner.terminate()
        runner.wait(PATIENCE_S)

    revoked = orch(hub.root, "runner", "revoke", SESSION_A)
    assert revoked.returncode == 0, revoked.stderr
    assert f"removed broker user {SESSION_A}" in revoked.stdout
    assert "nats-server --signal reload=<pid>" in revoked.stdout
    assert not names.runner_credentials_path(hub.root, SESSION_A).exists()
    hub.reload()
    wait_until(lambda: not can_connect(a_cfg), what="A's broker user to be refused after the reload")
    assert can_connect(b_cfg)
