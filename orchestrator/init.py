"""`mam-orch init`: write a workspace's `.mam.env` and, on request, a filled
production `nats.conf` (PROTOCOL §13, docs/deployment.md).

The nats-server configurations shipped in `deploy/nats/` live in
`mam.shared.natsconf` (`NATS_CONF`, `NATS_TLS_CONF`, re-exported here), the one
source the embedded broker of `mam-orch broker up` is rendered from too.
Everything a deployment may change lives in a block of `MAM_*: value`
variable lines at the top of those files; `set_conf_variables` rewrites those
lines and nothing else, so the tests run the shipped files themselves.

Secrets (passwords, MAM_DISPATCH_SECRET) are written only to 0600 files and
never printed.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from mam.shared import keys, names
from mam.shared.config import ENV_FILE_NAME, new_secret, resolve_root, write_env_file
from mam.shared.errors import ConfigError, UsageError
from mam.shared.fsio import atomic_write
from mam.shared.natsconf import NATS_CONF, NATS_TLS_CONF, conf_variables, set_conf_variables

#: Users of deploy/nats/nats.conf (account MAM) and what they are for.
AGENT_USER = "mam_agent"
OBSERVER_USER = "mam_observer"
#: Environment variables nats.conf reads its passwords from.
BROKER_SECRET_VARS = ("MAM_BROKER_PASS", "MAM_OBSERVER_PASS", "MAM_HOME_PASS", "MAM_SYS_PASS")
#: Name of the file holding the broker's secrets, next to the rendered nats.conf.
BROKER_ENV_NAME = "nats.env"

__all__ = ["AGENT_USER", "BROKER_ENV_NAME", "BROKER_SECRET_VARS", "NATS_CONF", "NATS_TLS_CONF", "OBSERVER_USER",
           "InitResult", "broker_password", "conf_variables", "init_workspace", "render_nats_conf",
           "set_conf_variables", "topic_subjects"]


def topic_subjects(topic_root: str) -> list[str]:
    """The NATS subjects that cover MQTT `<topic_root>/#` (§2: '/' -> '.').

    MQTT '#' also matches the parent level itself, hence the bare root.
    """
    if "." in topic_root:
        raise UsageError(f"topic root {topic_root!r} is invalid on NATS: '.' separates subject levels")
    subject = names.topic_root(topic_root).replace("/", ".")
    return [subject, f"{subject}.>"]


def render_nats_conf(*, tls: bool = False, mqtt_port: int | None = None,
                     ws_port: int | None = None, store_dir: str | None = None,
                     topic_root: str = names.DEFAULT_TOPIC_ROOT, cert_dir: str | None = None,
                     verify_clients: bool | None = None, nats_port: int | None = None) -> str:
    """The shipped nats config with deployment settings filled in.

    Args:
        tls: render nats-tls.conf (TLS 1.3 listeners) instead of nats.conf.
        mqtt_port: MQTT listener port (default 1883, 8883 with TLS).
        ws_port: WebSocket listener port (default 8080, 8443 with TLS).
        store_dir: JetStream store directory (default /data, the container volume).
        topic_root: MAM_TOPIC_ROOT; becomes the permission subjects.
        cert_dir: folder holding ca.crt, server.crt, server.key (TLS only; default /certs).
        verify_clients: require client certificates (TLS only; default false).
        nats_port: the loopback-only native NATS port (default 4222).
    Returns:
        the configuration text.
    Raises:
        UsageError: a bad topic root or port.
    """
    values: dict[str, str | int | bool | list[str]] = {"MAM_SUBJECTS": topic_subjects(topic_root)}
    for name, port in (("MAM_MQTT_PORT", mqtt_port), ("MAM_WS_PORT", ws_port),
                       ("MAM_NATS_PORT", nats_port)):
        if port is not None:
            if not 1 <= int(port) <= 65535:
                raise UsageError(f"port {port} is out of range 1..65535")
            values[name] = int(port)
    if store_dir is not None:
        values["MAM_STORE_DIR"] = str(store_dir)
    if tls:
        if cert_dir is not None:
            values["MAM_CA_FILE"] = str(Path(cert_dir) / "ca.crt")
            values["MAM_CERT_FILE"] = str(Path(cert_dir) / "server.crt")
            values["MAM_KEY_FILE"] = str(Path(cert_dir) / "server.key")
        if verify_clients is not None:
            values["MAM_VERIFY_CLIENTS"] = bool(verify_clients)
    elif cert_dir is not None or verify_clients is not None:
        raise UsageError("cert_dir and verify_clients need tls=True")
    return set_conf_variables(NATS_TLS_CONF if tls else NATS_CONF, values)


def broker_password() -> str:
    """A fresh broker password that nats-server reads back as a string.

    nats-server parses an environment value like a config value, so a value
    that starts with a digit could be read as a number or a size (`12k`);
    we draw until the first character is a letter.
    """
    while True:
        value = new_secret()
        if value[0].isalpha():
            return value


@dataclass(frozen=True)
class InitResult:
    """What `init_workspace` wrote (paths only: never the secrets)."""

    env_file: Path
    broker_config: Path | None = None
    broker_env: Path | None = None
    notes: tuple[str, ...] = field(default=())


def init_workspace(workspace: str | os.PathLike[str] | None = None, *,
                   broker_config: str | os.PathLike[str] | None = None,
                   force: bool = False, broker_host: str = "localhost",
                   port: int | None = None, tls: bool = False,
                   environ: Mapping[str, str] | None = None) -> InitResult:
    """Write `<root>/.mam.env` (0600) with fresh secrets; optionally a filled
    nats config plus its `nats.env` (0600) holding the broker passwords.

    `.mam.env` gets MQTT_BROKER, MQTT_PORT, MQTT_TLS, MQTT_USERNAME
    (mam_agent), MQTT_PASSWORD, MAM_TOPIC_ROOT and MAM_DISPATCH_SECRET (§13):
    copy it to every runner. `nats.env` gets MAM_BROKER_PASS (the same value
    as MQTT_PASSWORD), MAM_OBSERVER_PASS, MAM_HOME_PASS and MAM_SYS_PASS: it
    stays on the broker host.

    Args:
        workspace: the workspace root (default: resolve_root(), §8).
        broker_config: where to write nats.conf (None: do not write one).
        force: overwrite existing files.
        broker_host: MQTT_BROKER for the clients (a comma-separated list is allowed).
        port: MQTT_PORT (default 1883, 8883 with `tls`); also the broker's MQTT port.
        tls: clients use TLS and the TLS variant of nats.conf is rendered.
        environ: where MAM_TOPIC_ROOT is read from (default os.environ).
    Returns:
        the paths written.
    Raises:
        ConfigError: a target exists and `force` is false (nothing is
            written), or a file cannot be written. Exit 64 on the CLI.
        UsageError: a bad host, port or topic root.
    """
    env = os.environ if environ is None else environ
    root = resolve_root(workspace, environ=env)
    if not root.is_dir():
        raise ConfigError(f"workspace {str(root)!r} does not exist")
    hosts = [part.strip() for part in broker_host.split(",") if part.strip()]
    if not hosts or any(any(c.isspace() or c in "/#$\"'\\" for c in h) or len(h) > 253 for h in hosts):
        raise UsageError(f"--broker {broker_host!r} is invalid: expected a host name or address")
    mqtt_port = port if port is not None else (8883 if tls else 1883)
    if not 1 <= mqtt_port <= 65535:
        raise UsageError(f"--port {mqtt_port} is out of range 1..65535")
    root_topic = env.get("MAM_TOPIC_ROOT") or "python/mqtt"
    topic_subjects(root_topic)  # validates before anything is written

    env_path = root / ENV_FILE_NAME
    conf_path = Path(broker_config).expanduser().resolve() if broker_config is not None else None
    secrets_path = conf_path.with_name(BROKER_ENV_NAME) if conf_path is not None else None
    targets = [p for p in (env_path, conf_path, secrets_path) if p is not None]
    if not force:
        existing = [str(p) for p in targets if p.exists()]
        if existing:
            raise ConfigError(f"{', '.join(existing)}: already exists; use --force to overwrite")
    if conf_path is not None and not conf_path.parent.is_dir():
        raise ConfigError(f"{conf_path.parent}: no such directory")
    if conf_path is not None and conf_path.is_dir():
        raise ConfigError(f"{conf_path}: is a directory; give the file name of the nats config")

    agent_pass = broker_password()
    if conf_path is not None and secrets_path is not None:
        text = render_nats_conf(tls=tls, mqtt_port=mqtt_port, topic_root=root_topic)
        write_env_file(secrets_path, {
            "MAM_BROKER_PASS": agent_pass,
            "MAM_OBSERVER_PASS": broker_password(),
            "MAM_HOME_PASS": broker_password(),
            "MAM_SYS_PASS": broker_password(),
        }, header="nats-server secrets for nats.conf (keep on the broker host; mode 0600)\n"
                  "docker compose --env-file nats.env up -d   (see deploy/nats/README.md)",
            overwrite=True)
        atomic_write(conf_path, text.encode("utf-8"), what=conf_path.name, error=ConfigError)
    write_env_file(env_path, {
        "MQTT_BROKER": ",".join(hosts),
        "MQTT_PORT": str(mqtt_port),
        "MQTT_TLS": "true" if tls else "false",
        "MQTT_USERNAME": AGENT_USER,
        "MQTT_PASSWORD": agent_pass,
        "MAM_TOPIC_ROOT": root_topic,
        "MAM_DISPATCH_SECRET": new_secret(),
    }, header="mam-fleet settings (PROTOCOL §13), written by `mam-orch init`.\n"
              "Copy this file to every runner's workspace; keep it mode 0600.",
        overwrite=True)
    notes = [f"wrote {env_path} (mode 0600): copy it to every runner's workspace root"]
    hub_public = keys.public_text(keys.hub_key(root))  # §16: made once, never overwritten (rotate instead)
    notes.append(f"hub key {names.hub_key_path(root)} (mode 0600); public key {hub_public}; enrol runners with "
                 "mam-orch runner add (docs/security.md)")
    if conf_path is not None:
        notes.append(f"wrote {conf_path} and {secrets_path} (mode 0600, broker host only)")
        notes.append(f"start the broker: cd {conf_path.parent} && docker compose --env-file "
                     f"{BROKER_ENV_NAME} up -d   (compose file: deploy/nats/docker-compose.yaml)")
    if tls:
        notes.append("TLS: put ca.crt, server.crt and server.key in the broker's /certs and set "
                     "MQTT_CA_CERTS on every client (deploy/nats/README.md)")
    notes.append("check: mam-orch config")
    return InitResult(env_file=env_path, broker_config=conf_path, broker_env=secrets_path,
                      notes=tuple(notes))
