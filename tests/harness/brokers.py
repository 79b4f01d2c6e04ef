"""Real broker processes for tests, and free ports.

The broker handles are what the `nats_broker`, `mosquitto_broker` and
`broker` fixtures of tests/conftest.py yield (see its docstring). Brokers
start with the suite's one deadline, `harness.waiting.PATIENCE_S`.
"""

from __future__ import annotations

import os
import pwd
import secrets
import shutil
import signal
import socket
import subprocess
from pathlib import Path

from harness.waiting import PATIENCE_S, wait_until
from mam.orchestrator.broker import conf
from mam.orchestrator.broker import embedded as broker
from mam.shared.config import BrokerConfig

MOSQUITTO = "/usr/sbin/mosquitto"
MOSQUITTO_PASSWD = "/usr/bin/mosquitto_passwd"
START_TIMEOUT_S = PATIENCE_S
STOP_TIMEOUT_S = 10.0
TEST_TOPIC_ROOT = "python/mqtt"


_HANDED_OUT: set[int] = set()
# Ports for test listeners: below the kernel's ephemeral range (32768-60999 by default), so no
# outgoing connection is given one while a broker is down before a restart on the same ports.
# pytest-xdist workers (make test) are separate processes: each draws from its own slice.
_PORT_RANGE = range(20000, 32768)
_WORKER_INDEX = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
_WORKER_COUNT = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free right now on `host`, from this worker's slice of `_PORT_RANGE`,
    never one this process handed out before (two listeners of one broker must not get the
    same one, and a stopped broker keeps its ports for its restart)."""
    span = len(_PORT_RANGE) // _WORKER_COUNT
    first = _PORT_RANGE.start + (_WORKER_INDEX % _WORKER_COUNT) * span
    for _ in range(1000):
        port = first + secrets.randbelow(span)
        if port in _HANDED_OUT:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue  # in use, or in TIME_WAIT
        _HANDED_OUT.add(port)
        return port
    raise RuntimeError(f"no free port in {first}..{first + span - 1} after 1000 tries")


def port_accepts(port: int, host: str = "127.0.0.1") -> bool:
    """True when a TCP connect to host:port succeeds."""
    try:
        with socket.create_connection((host, port), timeout=0.2):
            return True
    except OSError:
        return False


class BrokerProcess:
    """A real broker process on fixed ports with its own files; base of the handles."""

    name = "?"

    def __init__(self, workdir: Path, topic_root: str = TEST_TOPIC_ROOT) -> None:
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.host = "127.0.0.1"
        self.mqtt_port = free_port()
        self.topic_root = topic_root
        self.agent_user, self.agent_password = "mam_agent", "agent-" + os.urandom(12).hex()
        self.observer_user, self.observer_password = "mam_observer", "observer-" + os.urandom(12).hex()
        self.log_path = self.workdir / f"{self.name}.log"
        self.proc: subprocess.Popen | None = None

    def command(self) -> list[str]:
        raise NotImplementedError

    def config(self, user: str = "agent", **overrides) -> BrokerConfig:
        """A `BrokerConfig` for this broker as `user` ("agent" or "observer"); overrides are
        BrokerConfig fields (e.g. hosts=..., keepalive_s=...)."""
        if user not in ("agent", "observer"):
            raise ValueError(f"user must be 'agent' or 'observer', not {user!r}")
        name, password = ((self.agent_user, self.agent_password) if user == "agent"
                          else (self.observer_user, self.observer_password))
        values = dict(hosts=(self.host,), port=self.mqtt_port, username=name, password=password,
                      client_id_prefix="test", keepalive_s=5, topic_root=self.topic_root)
        values.update(overrides)
        return BrokerConfig(**values)

    def start(self) -> BrokerProcess:
        """Start the process and wait until the MQTT port accepts connections."""
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.command(), stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT)
        proc = self.proc
        wait_until(lambda: proc.poll() is not None or port_accepts(self.mqtt_port),
                   START_TIMEOUT_S, f"{self.name} to listen on {self.mqtt_port}")
        if proc.poll() is not None:
            raise RuntimeError(f"{self.name} exited with {proc.returncode}: "
                               f"{self.log_path.read_text(errors='replace')[-2000:]}")
        return self

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def kill(self) -> None:
        """SIGKILL the broker (a crash) and reap it."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(STOP_TIMEOUT_S)

    def stop(self) -> None:
        """SIGTERM the broker, SIGKILL after a deadline; safe to call twice."""
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(STOP_TIMEOUT_S)

    def restart(self) -> None:
        """Start again on the same ports with the same store (after kill() or stop())."""
        self.stop()
        self.start()

    def __repr__(self) -> str:
        return f"<{self.name} broker mqtt={self.host}:{self.mqtt_port} pid={self.pid}>"


class NatsBroker(BrokerProcess):
    """nats-server from the wheel with the config `mam.orchestrator.broker.embedded` renders."""

    name = "nats"

    def __init__(self, workdir: Path, topic_root: str = TEST_TOPIC_ROOT) -> None:
        super().__init__(workdir, topic_root)
        self._configure()

    def _configure(self) -> None:
        """Pick the native and websocket ports and write the config (0600)."""
        self.port = free_port()
        self.ws_port = free_port()
        self.settings = conf.NatsSettings(store_dir=self.workdir / "jetstream", host=self.host,
                                            port=self.port, mqtt_port=self.mqtt_port,
                                            ws_port=self.ws_port, server_name="mam-test",
                                            topic_root=self.topic_root)
        creds = conf.BrokerCredentials(agent_password=self.agent_password,
                                         observer_password=self.observer_password,
                                         agent_user=self.agent_user, observer_user=self.observer_user)
        self.config_path = conf.write_private(self.workdir / "nats.conf",
                                                conf.render_nats_config(self.settings, creds))

    def command(self) -> list[str]:
        return [str(broker.nats_server_binary()), "-c", str(self.config_path)]

    def start(self) -> NatsBroker:
        for attempt in range(3):
            try:
                super().start()
                break
            except RuntimeError as exc:
                # a free port can be taken (e.g. as a client's source port) before the server binds it
                if "address already in use" not in str(exc) or attempt == 2 or self.proc is None \
                        or self.proc.poll() is None:
                    raise
                self.mqtt_port = free_port()
                self._configure()
        # the MQTT listener opens before JetStream's MQTT streams exist: wait for a real CONNACK
        broker.wait_mqtt_ready(self.config(), timeout_s=START_TIMEOUT_S, proc=self.proc, log_path=self.log_path)
        return self


class MosquittoBroker(BrokerProcess):
    """A real mosquitto with a password file, an ACL (agent read/write under the topic
    root, observer read-only) and persistence in the work directory."""

    name = "mosquitto"

    @staticmethod
    def available() -> str | None:
        """None when mosquitto can run here, else the reason to skip."""
        if not os.access(MOSQUITTO, os.X_OK):
            return f"{MOSQUITTO} is not installed (apt-get install mosquitto)"
        if not (os.access(MOSQUITTO_PASSWD, os.X_OK) or shutil.which("mosquitto_passwd")):
            return "mosquitto_passwd is not installed"
        return None

    def __init__(self, workdir: Path, topic_root: str = TEST_TOPIC_ROOT) -> None:
        super().__init__(workdir, topic_root)
        passwd = self.workdir / "passwd"
        fd = os.open(passwd, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as handle:  # plain "user:password" lines, hashed in place by -U
            handle.write(f"{self.agent_user}:{self.agent_password}\n"
                         f"{self.observer_user}:{self.observer_password}\n")
        tool = MOSQUITTO_PASSWD if os.access(MOSQUITTO_PASSWD, os.X_OK) else shutil.which("mosquitto_passwd")
        subprocess.run([str(tool), "-U", str(passwd)], check=True, capture_output=True, timeout=30)
        acl = self.workdir / "acl"
        acl.write_text(f"user {self.agent_user}\ntopic readwrite {topic_root}/#\n\n"
                       f"user {self.observer_user}\ntopic read {topic_root}/#\n")
        os.chmod(acl, 0o600)
        store = self.workdir / "store"
        store.mkdir(exist_ok=True)
        self.config_path = self.workdir / "mosquitto.conf"
        self.config_path.write_text("\n".join([
            f"user {pwd.getpwuid(os.getuid()).pw_name}",  # as root, mosquitto would drop to 'mosquitto'
            "per_listener_settings false",
            "allow_anonymous false",
            f"password_file {passwd}",
            f"acl_file {acl}",
            "persistence true",
            f"persistence_location {store}/",
            "autosave_interval 1",
            "log_dest stderr",
            "log_type error",
            "log_type warning",
            "log_type notice",
            f"listener {self.mqtt_port} {self.host}",
            "",
        ]))

    def command(self) -> list[str]:
        return [MOSQUITTO, "-c", str(self.config_path)]
