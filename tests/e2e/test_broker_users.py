"""PROTOCOL §16.6: least privilege at the broker. nats: a real nats-server
from the venv runs the config `mam-orch init --broker-config` wrote; `mam-orch runner add`
gives runners A and B their own broker users (passwords in 0600 files, never on stdout)
and edits that config, `nats-server --signal reload` (the command `runner add|revoke`
print) applies it. mosquitto: the shipped deploy/mosquitto files, the operator adds each
runner's `user` block (`users.mosquitto_acl_block`) and password, then SIGHUP.
With A's user: a dispatch or a control it publishes reaches no subscriber, B's presence
cannot be subscribed to (nats: SUBACK 0x80; mosquitto: nothing delivered), and a real v2
runner A completes a hub job. After `runner revoke A` and the reload, A's user cannot
connect; B's still can. The embedded broker (`broker up`) is reloaded by `runner add|revoke`
themselves and keeps its runner users when `up` regenerates its config."""

from __future__ import annotations

import os
import signal
import subprocess
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
from harness.brokers import free_port
from harness.invitesim import Invite, enroll, runner_host
from harness.runnersim import AGENTS, MAM_ORCH, MAM_RUNNER, hub_env, orch, retained, runner_log
from harness.shipped import (
    MOSQUITTO_BIN,
    MOSQUITTO_PASSWD,
    NATS_BIN,
    Broker,
    receive,
    start_broker,
    start_mosquitto,
    stop_broker,
)
from harness.shipped import pki as pki  # noqa: F401 - fixture
from harness.waiting import PATIENCE_S, wait_until
from harness.workspace import TEST_SECRET, clean_env

from mam.orchestrator import init as mam_init
from mam.orchestrator.broker import embedded as embedded
from mam.orchestrator.broker import users
from mam.shared.config import BrokerConfig, broker_config, read_env_file, write_env_file
from mam.shared.protocol import names, wire
from mam.shared.protocol.crypto import keys, pubkey
from mam.shared.protocol.crypto.invite import InviteCode
from mam.shared.protocol.errors import BrokerError, BrokerUnavailable, PublishTimeout
from mam.shared.store import keyfiles
from mam.shared.transport.mqtt import Message, MqttClient

pytestmark = [pytest.mark.broker, pytest.mark.e2e, pytest.mark.timeout(6 * PATIENCE_S)]

SESSION_A, SESSION_B = "box-a", "box-b"
PUBACK_WAIT_S = 3.0
"""A broker may refuse to acknowledge a forbidden PUBLISH: how long the test waits for the PUBACK (s)."""


@dataclass
class Hub:
    """The hub workspace and its broker, as `harness.runnersim.retained` wants it (`config()`, `topic_root`)."""

    root: Path
    cfg: BrokerConfig
    proc: subprocess.Popen[bytes] | None
    kind: str
    mosquitto: Broker | None = None

    @property
    def topic_root(self) -> str:
        return self.cfg.topic_root

    def config(self) -> BrokerConfig:
        return self.cfg

    def reload(self) -> None:
        """nats: what `runner add|revoke` told the operator to run; mosquitto: SIGHUP."""
        assert self.proc is not None
        if self.kind == "nats":
            subprocess.run([str(NATS_BIN), "--signal", f"reload={self.proc.pid}"], check=True,
                           capture_output=True, timeout=PATIENCE_S)
        else:
            self.proc.send_signal(signal.SIGHUP)

    def by_hand(self, session: str, *, add: bool) -> None:
        """mosquitto: what docs/security.md tells the operator to do (nats: `runner add|revoke` did it)."""
        if self.mosquitto is None:
            return
        auth = self.mosquitto.folder / "auth"  # type: ignore[operator]
        acl, block = auth / "acl", users.mosquitto_acl_block(session, self.topic_root)
        if add:
            password = read_env_file(names.runner_credentials_path(self.root, session))["MQTT_PASSWORD"]
            acl.write_text(acl.read_text() + "\n" + block)
            subprocess.run([MOSQUITTO_PASSWD, "-b", str(auth / "passwd"), session, password], check=True,
                           capture_output=True, timeout=PATIENCE_S)
        else:
            acl.write_text(acl.read_text().replace("\n" + block, ""))
            subprocess.run([MOSQUITTO_PASSWD, "-D", str(auth / "passwd"), session], check=True,
                           capture_output=True, timeout=PATIENCE_S)
        if os.geteuid() == 0:  # mosquitto runs as the mosquitto user and reads them after the HUP
            for path in (acl, auth / "passwd"):
                os.chown(path, auth.stat().st_uid, auth.stat().st_gid)


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
    made = keyfiles.create_runner_keys(workspace)
    keyfiles.write_trusted_hub_keys(workspace, [keys.public_text(keyfiles.hub_key(hub.root))])
    added = orch(hub.root, "runner", "add", "--session", session, "--ed25519", made.ed25519_public,
                 "--x25519", made.x25519_public)
    assert added.returncode == 0, added.stderr
    creds = names.runner_credentials_path(hub.root, session)
    assert creds.stat().st_mode & 0o777 == 0o600
    assert read_env_file(creds)["MQTT_PASSWORD"] not in added.stdout + added.stderr
    assert f"broker user {session}: its password is in {creds}" in added.stdout
    expected = "nats-server --signal reload=<pid>" if hub.kind == "nats" else "no broker config managed here"
    assert expected in added.stdout, added.stdout
    hub.by_hand(session, add=True)


def nats_hub(tmp_path: Path) -> Hub:
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
    return Hub(root, broker_config(workspace=root, warn=False), proc, "nats")


def mosquitto_hub(tmp_path: Path, pki) -> Hub:
    plain, _tls = start_mosquitto(tmp_path / "mosq", pki)
    root = tmp_path / "hub"
    (root / ".git").mkdir(parents=True)
    cfg = plain.config()
    write_env_file(root / ".mam.env", {"MQTT_BROKER": "127.0.0.1", "MQTT_PORT": str(cfg.port),
                                       "MQTT_USERNAME": cfg.username, "MQTT_PASSWORD": cfg.password,
                                       "MQTT_KEEPALIVE": "5", "MAM_TOPIC_ROOT": cfg.topic_root,
                                       "MAM_DISPATCH_SECRET": TEST_SECRET})
    assert plain.proc is not None
    return Hub(root, broker_config(workspace=root, warn=False), plain.proc, "mosquitto", plain)


@pytest.fixture(params=["nats", "mosquitto"])
def hub(request, tmp_path) -> Hub:
    if request.param == "mosquitto" and not MOSQUITTO_BIN.exists():
        pytest.skip("mosquitto is not installed (/usr/sbin/mosquitto)")
    made = nats_hub(tmp_path) if request.param == "nats" else mosquitto_hub(tmp_path, request.getfixturevalue("pki"))
    try:
        wait_until(lambda: can_connect(made.cfg), what=f"{made.kind} to accept the hub")
        yield made
    finally:
        assert made.proc is not None
        stop_broker(made.proc, made.mosquitto.folder if made.mosquitto else None)


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
        a_keys = keyfiles.load_runner_keys(ws_a)
        assert a_keys is not None
        forged = pubkey.sign(wire.Control.cancel(job, 1, "operator"), a_keys.ed25519)
        for topic, payload in ((names.dispatch_topic(job, root), b"forged dispatch"),
                               (names.control_topic(job, root), wire.encode(forged))):
            try:
                attacker.publish(topic, payload, qos=1, retain=True, timeout_s=PUBACK_WAIT_S)
            except PublishTimeout:
                pass  # not acknowledged is refused too
        try:
            attacker.subscribe([(names.presence_topic(SESSION_B, root), 1)])
            assert hub.kind == "mosquitto"  # mosquitto grants it and then delivers nothing
        except BrokerError as exc:
            assert "refused the subscription" in str(exc)
            assert hub.kind == "nats"
        attacker.subscribe([(names.control_topic(job, root), 1)])
        watcher.publish(names.presence_topic(SESSION_B, root), b"b presence", qos=1, retain=True)
        watcher.publish(names.control_topic(job, root), b"hub control", qos=1)
        attacker.publish(names.state_topic(job, root), b"marker", qos=1)  # what a runner may do arrives
        seen: list[Message] = []
        receive(watcher, lambda m: m.payload == b"marker", seen=seen)
        assert b"forged dispatch" not in [m.payload for m in seen]
        assert [m for m in seen if m.topic == names.control_topic(job, root)][0].payload == b"hub control"
        got: list[Message] = []
        receive(attacker, lambda m: m.payload == b"hub control", seen=got)
        assert [m.payload for m in got] == [b"hub control"]  # never B's presence
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
    expected = ("nats-server --signal reload=<pid>" if hub.kind == "nats"
                else f"remove the broker user {SESSION_A} from your broker")
    assert expected in revoked.stdout, revoked.stdout
    assert hub.kind != "nats" or f"removed broker user {SESSION_A}" in revoked.stdout
    assert not names.runner_credentials_path(hub.root, SESSION_A).exists()
    hub.by_hand(SESSION_A, add=False)
    hub.reload()
    wait_until(lambda: not can_connect(a_cfg), what="A's broker user to be refused after the reload")
    assert can_connect(b_cfg)


def test_s16_embedded_broker_runner_user_added_kept_across_up_and_revoked_with_automatic_reload(tmp_path):
    """`mam-orch broker up`'s broker: `runner add|revoke` reload it themselves (SIGHUP to the pid of
    its state file), and a `down` + `up` (which regenerates nats.conf) keeps the runner users."""
    root = tmp_path / "hub"
    (root / ".git").mkdir(parents=True)
    info = embedded.up(str(root), mqtt_port=free_port(), port=free_port(), ws_port=free_port(),
                       ready_timeout_s=PATIENCE_S)
    try:
        hub = Hub(root, broker_config(workspace=root, warn=False), None, "embedded")
        made = keyfiles.create_runner_keys(tmp_path / "runner-a")
        added = orch(root, "runner", "add", "--session", SESSION_A, "--ed25519", made.ed25519_public,
                     "--x25519", made.x25519_public)
        assert f"reloaded nats-server (pid {info['pid']})" in added.stdout, added.stdout + added.stderr
        a_cfg = as_runner(hub, SESSION_A)
        wait_until(lambda: can_connect(a_cfg), what="A's user after the automatic reload")
        embedded.down(str(root))
        info = embedded.up(str(root), mqtt_port=info["mqtt_port"], port=info["port"], ws_port=info["ws_port"],
                           ready_timeout_s=PATIENCE_S)
        assert can_connect(a_cfg)  # the regenerated config kept A
        revoked = orch(root, "runner", "revoke", SESSION_A)
        assert f"reloaded nats-server (pid {info['pid']})" in revoked.stdout, revoked.stdout + revoked.stderr
        wait_until(lambda: not can_connect(a_cfg), what="A's user to be refused after the automatic reload")
    finally:
        embedded.down(str(root))


def test_s16_invited_runner_gets_its_own_broker_user_and_runs_a_job_with_it(tmp_path):
    """Enrolment by invite on a hub that manages its broker (`broker up`): the answer carries the
    runner's own user with its password sealed to the runner's key; `enroll` puts it in the
    runner's `.mam.env` (0600), and the runner then serves a job as that user, not `mam_agent`."""
    root = tmp_path / "hub"
    (root / ".git").mkdir(parents=True)
    info = embedded.up(str(root), mqtt_port=free_port(), port=free_port(), ws_port=free_port(),
                       ready_timeout_s=PATIENCE_S)
    runner = None
    try:
        hub = Hub(root, broker_config(workspace=root, warn=False), None, "embedded")
        host = runner_host(hub, tmp_path / SESSION_A)
        waiting = Invite(root, SESSION_A, "--labels", "x", "--ttl", "2m")
        try:
            done = enroll(host, waiting.code, "--timeout", str(PATIENCE_S))
            assert done.returncode == 0, done.stderr
            assert waiting.proc.wait(PATIENCE_S) == 0, waiting.stderr()
        finally:
            waiting.stop()
        assert f"reloaded nats-server (pid {info['pid']})" in waiting.stderr()
        env_file = host / ".mam.env"
        settings = read_env_file(env_file)
        assert settings["MQTT_USERNAME"] == SESSION_A and os.stat(env_file).st_mode & 0o777 == 0o600
        assert f"broker user {SESSION_A}: MQTT_USERNAME and MQTT_PASSWORD set in {env_file}" in done.stdout
        for text in (done.stdout, done.stderr, waiting.stderr(), embedded.BrokerPaths(str(root)).config.read_text()):
            assert settings["MQTT_PASSWORD"] not in text
        assert settings["MQTT_BROKER"] == hub.cfg.host  # the rest of the file is kept
        with open(tmp_path / "runner.stderr", "wb") as err:
            runner = subprocess.Popen([*MAM_RUNNER, "run", "--session", SESSION_A, "--labels", "x", "--exec",
                                       str(AGENTS / "shell-agent"), "--workspace", str(host)], env=clean_env(),
                                      stdout=subprocess.DEVNULL, stderr=err)
        topic = names.presence_topic(SESSION_A, hub.topic_root)
        wait_until(lambda: runner.poll() is not None or b'"online"' in (retained(hub, topic, 0.3) or b""),
                   what="the invited runner online as its own broker user")
        job = orch(root, "dispatch", "--labels", "x", "--brief", "echo on-my-own-user\n", "--json",
                   timeout_s=2 * PATIENCE_S)
        assert job.returncode == 0, job.stderr + runner_log(host)
        own = replace(hub.cfg, username=SESSION_A, password=settings["MQTT_PASSWORD"], client_id_prefix="probe")
        assert can_connect(own) and not can_connect(replace(own, password="Wrong-password-0123456789"))
        # a second invite (new keys) reaches the hub through the runner's own user: its enrol topics
        again = Invite(root, SESSION_A, "--replace", "--ttl", "2m")
        try:
            rekeyed = enroll(host, again.code, "--force", "--timeout", str(PATIENCE_S))
            assert rekeyed.returncode == 0, rekeyed.stderr
        finally:
            again.stop()
        renewed = read_env_file(env_file)["MQTT_PASSWORD"]
        assert renewed != settings["MQTT_PASSWORD"]
        wait_until(lambda: can_connect(replace(own, password=renewed)), what="the renewed password accepted")
    finally:
        if runner is not None:
            runner.terminate()
            runner.wait(PATIENCE_S)
        embedded.down(str(root))


def test_s16_5_a_fresh_host_enrols_with_the_code_alone_then_runs_with_no_flags(tmp_path):
    """The invite carries everything a fresh host needs (§16.5): where the broker is and a
    one-time broker user allowed only this session's enrol topics. A host with an empty
    workspace enrols (`--max-jobs 2`), gets its own broker user, the broker's address and its
    slot count in a `.mam.env` it writes (0600), and `mam-runner run` with no flag takes a job
    for its enrolled label with 2 slots; the one-time user is gone once the invite is used."""
    root = tmp_path / "hub"
    (root / ".git").mkdir(parents=True)
    embedded.up(str(root), mqtt_port=free_port(), port=free_port(), ws_port=free_port(), ready_timeout_s=PATIENCE_S)
    runner = None
    try:
        hub = Hub(root, broker_config(workspace=root, warn=False), None, "embedded")
        host = tmp_path / "fresh"
        host.mkdir()  # nothing: no .mam.env, no keys, not even .git
        waiting = Invite(root, SESSION_A, "--labels", "x", "--ttl", "2m")
        try:
            code = InviteCode.parse(waiting.code)
            assert code.broker is not None and code.broker.enrol_user
            one_time = replace(hub.cfg, username=code.enrol_username, password=code.enrol_password,
                               client_id_prefix="probe")
            assert can_connect(one_time)
            done = enroll(host, waiting.code, "--timeout", str(PATIENCE_S), "--max-jobs", "2")
            assert done.returncode == 0, done.stderr
            assert waiting.proc.wait(PATIENCE_S) == 0, waiting.stderr()
        finally:
            waiting.stop()
        settings = read_env_file(host / ".mam.env")
        assert (settings["MQTT_USERNAME"], settings["MQTT_BROKER"], settings["MQTT_PORT"]) == (
            SESSION_A, hub.cfg.host, str(hub.cfg.port))
        assert settings["MAM_RUNNER_MAX_JOBS"] == "2"  # given at enrolment: `run`'s default
        assert os.stat(host / ".mam.env").st_mode & 0o777 == 0o600
        config_text = embedded.BrokerPaths(str(root)).config.read_text()
        assert users.enrol_users(config_text) == [] and code.enrol_password not in done.stdout + done.stderr
        wait_until(lambda: not can_connect(one_time), what="the one-time user refused once the invite is used")
        with open(tmp_path / "fresh.stderr", "wb") as err:  # runner_log(host)
            runner = subprocess.Popen([*MAM_RUNNER, "run", "--exec", str(AGENTS / "shell-agent"), "--workspace",
                                       str(host)], env=clean_env(), stdout=subprocess.DEVNULL, stderr=err)
        topic = names.presence_topic(SESSION_A, hub.topic_root)
        wait_until(lambda: runner.poll() is not None or b'"online"' in (retained(hub, topic, 0.3) or b""),
                   what="the enrolled runner online with no flags")
        assert wire.decode(retained(hub, topic, 0.3) or b"", "presence").max_jobs == 2
        job = orch(root, "dispatch", "--labels", "x", "--brief", "echo from-a-fresh-host\n", "--json",
                   timeout_s=2 * PATIENCE_S)
        assert job.returncode == 0, job.stderr + runner_log(host)
    finally:
        if runner is not None:
            runner.terminate()
            runner.wait(PATIENCE_S)
        embedded.down(str(root))
