"""The SHIPPED broker configurations (deploy/nats, deploy/mosquitto) run by
real servers, for tests/e2e/test_deploy_brokers.py and test_deploy_job.py.

Each broker is started from the file in deploy/ with only ports, store and
certificate paths changed (for nats through the `MAM_*` variable lines of the
file, for mosquitto by replacing the listener and path lines, each of which
must match exactly once). `start_embedded` runs the hub's embedded broker through
`mam.orchestrator.broker.embedded.up` (rendered from the same deploy/nats/nats.conf,
so the embedded broker and the shipped file cannot drift apart). Module-scoped fixtures
`pki`, `nats_plain`, `nats_embedded` and `mosquitto_pair`: import them into a test module
to use them.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import pwd
import queue
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from harness.brokers import free_port
from harness.waiting import PATIENCE_S, wait_until
from mam.orchestrator import init as mam_init
from mam.orchestrator.broker import embedded as embedded
from mam.shared.config import BrokerConfig, read_env_file
from mam.shared.transport.mqtt import Message, MqttClient

REPO = Path(__file__).resolve().parents[2]  # tests/harness/shipped.py
DEPLOY = REPO / "deploy"
NATS_BIN = Path(REPO / ".venv" / "bin" / "nats-server")
MOSQUITTO_BIN = Path("/usr/sbin/mosquitto")
MOSQUITTO_PASSWD = shutil.which("mosquitto_passwd") or "/usr/bin/mosquitto_passwd"
ROOT = "python/mqtt"

# ----------------------------------------------------------------- helpers

def port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


def replace_once(text: str, old: str, new: str) -> str:
    """Replace a line of a shipped file that must occur exactly once (drift guard)."""
    count = text.count(old)
    assert count == 1, f"{old!r} occurs {count} times in the shipped file"
    return text.replace(old, new)


def receive(client: MqttClient, predicate: Callable[[Message], bool], timeout_s: float = PATIENCE_S,
            seen: list[Message] | None = None) -> Message:
    """The first queued message matching `predicate` (others are kept in `seen`)."""
    deadline = time.monotonic() + timeout_s
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise AssertionError("message not received in time; got "
                                 f"{[(m.topic, m.payload[:40]) for m in (seen or [])]}")
        try:
            message = client.messages.get(timeout=remaining)
        except queue.Empty:
            continue
        if seen is not None:
            seen.append(message)
        if predicate(message):
            return message


@dataclass
class Pki:
    """A private CA, a server certificate for 127.0.0.1/localhost, a client
    certificate signed by the CA, and a second CA nobody trusts."""

    dir: Path
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    rogue_ca: Path


def _make_pki(folder: Path) -> Pki:
    now = dt.datetime.now(dt.UTC)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def write_key(key, path: Path) -> None:
        path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
        path.chmod(0o600)

    def make_ca(cn: str):
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (x509.CertificateBuilder().subject_name(name(cn)).issuer_name(name(cn))
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - dt.timedelta(minutes=5))
                .not_valid_after(now + dt.timedelta(days=1))
                .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                             content_commitment=False, key_encipherment=False,
                                             data_encipherment=False, key_agreement=False,
                                             encipher_only=False, decipher_only=False), critical=True)
                .sign(key, hashes.SHA256()))
        return key, cert

    def leaf(ca_key, ca_cert, cn: str, usage, san=None):
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (x509.CertificateBuilder().subject_name(name(cn)).issuer_name(ca_cert.subject)
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - dt.timedelta(minutes=5))
                   .not_valid_after(now + dt.timedelta(days=1))
                   .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                   .add_extension(x509.ExtendedKeyUsage([usage]), critical=False))
        if san:
            builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
        return key, builder.sign(ca_key, hashes.SHA256())

    folder.mkdir(parents=True, exist_ok=True)
    pem = serialization.Encoding.PEM
    ca_key, ca_cert = make_ca("mam-fleet test CA")
    _, rogue_cert = make_ca("somebody else's CA")
    srv_key, srv_cert = leaf(ca_key, ca_cert, "mam-broker", ExtendedKeyUsageOID.SERVER_AUTH,
                             [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
    cli_key, cli_cert = leaf(ca_key, ca_cert, "gpu-box", ExtendedKeyUsageOID.CLIENT_AUTH)
    pki = Pki(folder, folder / "ca.crt", folder / "server.crt", folder / "server.key",
              folder / "client.crt", folder / "client.key", folder / "rogue-ca.crt")
    pki.ca.write_bytes(ca_cert.public_bytes(pem))
    pki.rogue_ca.write_bytes(rogue_cert.public_bytes(pem))
    pki.server_cert.write_bytes(srv_cert.public_bytes(pem))
    write_key(srv_key, pki.server_key)
    pki.client_cert.write_bytes(cli_cert.public_bytes(pem))
    write_key(cli_key, pki.client_key)
    return pki


@dataclass
class Broker:
    """A running broker started from a shipped config."""

    kind: str
    mqtt_port: int
    ws_port: int
    agent_password: str
    observer_password: str
    tls: bool = False
    pki: Pki | None = None
    proc: subprocess.Popen | None = field(default=None, repr=False)
    log: Path | None = None
    folder: Path | None = None

    def config(self, user: str = "mam_agent", password: str | None = None, **changes) -> BrokerConfig:
        if password is None:
            password = self.agent_password if user == "mam_agent" else self.observer_password
        cfg = BrokerConfig(hosts=("127.0.0.1",), port=self.mqtt_port, username=user,
                           password=password, tls=self.tls, topic_root=ROOT,
                           ca_certs=str(self.pki.ca) if (self.tls and self.pki) else "",
                           client_id_prefix="deploytest")
        return cfg.with_overrides(**changes)

    def client(self, user: str = "mam_agent", role: str = "test", **changes) -> MqttClient:
        return MqttClient(self.config(user, **changes), role).connect(timeout_s=PATIENCE_S)


def stop_broker(proc: subprocess.Popen, remove: Path | None = None) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
    if remove is not None and remove.name.startswith("mam-deploy-mosq-"):
        shutil.rmtree(remove, ignore_errors=True)


def start_broker(kind: str, argv: list[str], env: dict[str, str], log: Path, ports: list[int]) -> subprocess.Popen:
    handle = open(log, "wb")
    proc = subprocess.Popen(argv, env=env, stdout=handle, stderr=subprocess.STDOUT)
    handle.close()

    def ready() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"{kind} exited with {proc.returncode}: {log.read_text()[-2000:]}")
        return all(port_open(p) for p in ports)

    wait_until(ready, what=f"{kind} to listen on {ports}")
    return proc


def start_nats(folder: Path, *, tls: bool = False, pki: Pki | None = None,
               verify_clients: bool = False) -> Broker:
    """nats-server running deploy/nats/nats.conf (or nats-tls.conf) with free ports."""
    folder.mkdir(parents=True, exist_ok=True)
    shipped = (DEPLOY / "nats" / ("nats-tls.conf" if tls else "nats.conf")).read_text()
    mqtt_port, ws_port, nats_port = free_port(), free_port(), free_port()
    values: dict = {"MAM_MQTT_PORT": mqtt_port, "MAM_WS_PORT": ws_port, "MAM_NATS_PORT": nats_port,
                    "MAM_STORE_DIR": str(folder / "js")}
    if tls:
        assert pki is not None
        values.update(MAM_CA_FILE=str(pki.ca), MAM_CERT_FILE=str(pki.server_cert),
                      MAM_KEY_FILE=str(pki.server_key), MAM_VERIFY_CLIENTS=verify_clients)
    conf = folder / "nats.conf"
    conf.write_text(mam_init.set_conf_variables(shipped, values))
    agent, observer = mam_init.broker_password(), mam_init.broker_password()
    env = {"PATH": os.environ.get("PATH", ""), "MAM_BROKER_PASS": agent, "MAM_OBSERVER_PASS": observer,
           "MAM_HOME_PASS": mam_init.broker_password(), "MAM_SYS_PASS": mam_init.broker_password()}
    proc = start_broker("nats-server", [str(NATS_BIN), "-c", str(conf)], env, folder / "nats.log",
                  [mqtt_port, ws_port])
    return Broker("nats", mqtt_port, ws_port, agent, observer, tls, pki, proc, folder / "nats.log")


def start_embedded(workspace: Path) -> Broker:
    """The hub's embedded broker (`mam-orch broker up`) in `workspace`, on free ports;
    stop it with `embedded.down(workspace)`."""
    info = embedded.up(str(workspace), mqtt_port=free_port(), port=free_port(), ws_port=free_port(),
                       ready_timeout_s=PATIENCE_S)
    env = read_env_file(workspace / ".mam.env")
    return Broker("nats", info["mqtt_port"], info["ws_port"], env["MQTT_PASSWORD"], env["MAM_OBSERVER_PASSWORD"],
                  folder=workspace, log=Path(info["log"]))


def start_mosquitto(folder: Path, pki: Pki, *, require_certificate: bool = False,
                    changes: Mapping[str, str] | None = None) -> tuple[Broker, Broker]:
    """mosquitto running deploy/mosquitto/mosquitto.conf + acl; returns views of
    its plain listener (with the WebSocket one) and of its TLS listener. `changes`
    replaces further lines of the shipped file (each must occur once), e.g. to run
    it with an earlier setting and show the fault that setting caused.

    Started as root, mosquitto drops to the mosquitto user (as in production),
    which cannot traverse pytest's 0700 tmp folders: use a folder under /tmp
    owned by that user instead (the caller removes it).
    """
    if os.geteuid() == 0:
        folder = Path(tempfile.mkdtemp(prefix="mam-deploy-mosq-"))
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "auth").mkdir()
    (folder / "data").mkdir()
    certs = folder / "certs"
    shutil.copytree(pki.dir, certs)
    text = (DEPLOY / "mosquitto" / "mosquitto.conf").read_text()
    plain, tls_port, ws_port = free_port(), free_port(), free_port()
    text = replace_once(text, "persistence_location /var/lib/mosquitto/\n",
                        f"persistence_location {folder}/data/\n")
    text = replace_once(text, "password_file /etc/mosquitto/auth/passwd\n", f"password_file {folder}/auth/passwd\n")
    text = replace_once(text, "acl_file /etc/mosquitto/auth/acl\n", f"acl_file {folder}/auth/acl\n")
    for name in ("ca.crt", "server.crt", "server.key"):
        text = replace_once(text, f"/etc/mosquitto/certs/{name}\n", f"{certs}/{name}\n")
    text = replace_once(text, "listener 1883\n", f"listener {plain} 127.0.0.1\n")
    text = replace_once(text, "listener 8883\n", f"listener {tls_port} 127.0.0.1\n")
    text = replace_once(text, "listener 8080\n", f"listener {ws_port} 127.0.0.1\n")
    if require_certificate:
        text = replace_once(text, "require_certificate false\n", "require_certificate true\n")
    for line, replacement in (changes or {}).items():
        text = replace_once(text, line, replacement)
    conf = folder / "mosquitto.conf"
    conf.write_text(text)
    shutil.copy(DEPLOY / "mosquitto" / "acl", folder / "auth" / "acl")
    agent, observer = mam_init.broker_password(), mam_init.broker_password()
    passwd = folder / "auth" / "passwd"
    for user, password in (("mam_agent", agent), ("mam_observer", observer)):
        subprocess.run([MOSQUITTO_PASSWD, *([] if passwd.exists() else ["-c"]), "-b", str(passwd), user, password],
                       check=True, capture_output=True, timeout=10)
    passwd.chmod(0o600)
    if os.geteuid() == 0:  # mosquitto started as root drops to the mosquitto user, as in production
        entry = pwd.getpwnam("mosquitto")
        for path in [folder, *folder.rglob("*")]:
            os.chown(path, entry.pw_uid, entry.pw_gid)
    proc = start_broker("mosquitto", [str(MOSQUITTO_BIN), "-c", str(conf)], dict(os.environ),
                  folder / "mosquitto.log", [plain, tls_port, ws_port])
    base = Broker("mosquitto", plain, ws_port, agent, observer, False, pki, proc, folder / "mosquitto.log",
                  folder)
    secured = Broker("mosquitto", tls_port, ws_port, agent, observer, True, pki, proc, folder / "mosquitto.log",
                     folder)
    return base, secured


# ----------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    return _make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def nats_plain(tmp_path_factory) -> Iterator[Broker]:
    if not NATS_BIN.exists():
        pytest.skip(f"nats-server not found at {NATS_BIN}")
    broker = start_nats(tmp_path_factory.mktemp("nats"))
    yield broker
    stop_broker(broker.proc)


@pytest.fixture(scope="module")
def nats_embedded(tmp_path_factory) -> Iterator[Broker]:
    """The embedded broker of `mam-orch broker up` (its own config renderer)."""
    workspace = tmp_path_factory.mktemp("embedded")
    broker = start_embedded(workspace)
    yield broker
    embedded.down(str(workspace))


@pytest.fixture(scope="module")
def mosquitto_pair(tmp_path_factory, pki) -> Iterator[tuple[Broker, Broker]]:
    if not MOSQUITTO_BIN.exists():
        pytest.skip("mosquitto is not installed (/usr/sbin/mosquitto)")
    pair = start_mosquitto(tmp_path_factory.mktemp("mosq"), pki)
    yield pair
    stop_broker(pair[0].proc, pair[0].folder)
