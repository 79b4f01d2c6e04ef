"""`mam-orch init`: write a workspace's `.mam.env` and, on request, a filled
production `nats.conf` (PROTOCOL §13, docs/deployment.md).

The nats-server configurations shipped in `deploy/nats/` are embedded below
(`NATS_CONF`, `NATS_TLS_CONF`) because an installed wheel has no `deploy/`
folder; a test asserts they are byte-identical to the files in `deploy/nats/`.
Everything a deployment may change lives in a block of `MAM_*: value`
variable lines at the top of those files; `set_conf_variables` rewrites those
lines and nothing else, so the tests run the shipped files themselves.

Secrets (passwords, MAM_DISPATCH_SECRET) are written only to 0600 files and
never printed.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from mam.shared import names
from mam.shared.config import ENV_FILE_NAME, new_secret, resolve_root, write_env_file
from mam.shared.errors import ConfigError, UsageError
from mam.shared.fsio import atomic_write

#: Users of deploy/nats/nats.conf (account MAM) and what they are for.
AGENT_USER = "mam_agent"
OBSERVER_USER = "mam_observer"
#: Environment variables nats.conf reads its passwords from.
BROKER_SECRET_VARS = ("MAM_BROKER_PASS", "MAM_OBSERVER_PASS", "MAM_HOME_PASS", "MAM_SYS_PASS")
#: Name of the file holding the broker's secrets, next to the rendered nats.conf.
BROKER_ENV_NAME = "nats.env"

_VAR_LINE = re.compile(r"^(?P<name>MAM_[A-Z_]+):[ \t]*(?P<value>.*)$", re.M)


def _conf_value(value: str | int | bool | list[str] | tuple[str, ...]) -> str:
    """A Python value in nats-server config syntax (strings JSON-quoted)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(json.dumps(str(item)) for item in value) + "]"
    text = str(value)
    if any(c in text for c in "\n\r\x00"):
        raise UsageError(f"config value {text!r} is invalid: no line breaks")
    return json.dumps(text)


def conf_variables(text: str) -> dict[str, str]:
    """The `MAM_*: value` variable lines of a shipped nats config, as raw text."""
    return {m.group("name"): m.group("value").strip() for m in _VAR_LINE.finditer(text)}


def set_conf_variables(text: str, values: Mapping[str, str | int | bool | list[str] | tuple[str, ...]]) -> str:
    """Rewrite the `MAM_*: value` variable lines at the top of a nats config.

    Args:
        text: a config from deploy/nats (or `NATS_CONF`/`NATS_TLS_CONF`).
        values: variable name -> new value (str is quoted, int/bool bare,
            list -> array of strings).
    Returns:
        the new text; every other line is unchanged.
    Raises:
        ConfigError: a variable is not defined exactly once in `text`
            (the template and this code have drifted apart).
    """
    out = text
    for name, value in values.items():
        pattern = re.compile(rf"^{re.escape(name)}:[ \t]*.*$", re.M)
        count = len(pattern.findall(out))
        if count != 1:
            raise ConfigError(f"nats config variable {name} is defined {count} times (expected 1)")
        rendered = f"{name}: {_conf_value(value)}"
        out = pattern.sub(lambda _m: rendered, out)
    return out


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


# ----------------------------------------------------------------- templates
# Byte-identical copies of deploy/nats/nats.conf and deploy/nats/nats-tls.conf
# (tests/e2e/test_deploy_init.py checks it).

NATS_CONF = r"""# mam-fleet production broker: nats-server >= 2.10 with its MQTT 3.1.1 engine.
#
# Plain-TCP variant, for use INSIDE a tailnet (WireGuard encrypts the link).
# For a broker exposed beyond a private network use nats-tls.conf instead.
#
# Secrets come from the environment; nats-server refuses to start when one is
# unset (no default): MAM_BROKER_PASS, MAM_OBSERVER_PASS, MAM_HOME_PASS,
# MAM_SYS_PASS. `mam-orch init` generates them (see deploy/nats/README.md).
# Keep the env references bare: a quoted "$VAR" is taken literally.
#
# Settings `mam-orch init` and the tests fill in. Names start with MAM_ on
# purpose: config keys are case-insensitive, so a variable called STORE_DIR
# would be read as the store_dir option itself.
MAM_MQTT_PORT: 1883
MAM_WS_PORT: 8080
MAM_STORE_DIR: "/data"
# Native NATS client port (loopback only, see below).
MAM_NATS_PORT: 4222
# The subjects of MAM_TOPIC_ROOT (python/mqtt): NATS maps MQTT '/' to '.'.
# MQTT '#' also matches the parent level, hence the bare root.
MAM_SUBJECTS: ["python.mqtt", "python.mqtt.>"]

server_name: mam-broker

# Native NATS port: mam-fleet does not use it; loopback only (admin tools).
host: 127.0.0.1
port: $MAM_NATS_PORT

# MQTT needs JetStream: QoS 1 sessions and retained messages live in streams.
jetstream {
  store_dir: $MAM_STORE_DIR
  max_memory_store: 256MB
  max_file_store: 8GB
}

# MQTT 3.1.1 over TCP: the hub (mam-orch) and the runners (mam-runner).
mqtt {
  port: $MAM_MQTT_PORT
  # PUBACK wait before JetStream redelivers a QoS 1 message to a subscriber.
  ack_wait: "30s"
}

# WebSocket listener. It serves BOTH protocols: NATS-over-WebSocket at any
# path, and MQTT-over-WebSocket when the client asks for the path /mqtt
# (nats-server >= 2.8, PR nats-io/nats-server#2735). Dashboards connect to
# ws://<broker>:8080/mqtt as mam_observer. no_tls is acceptable only inside
# a tailnet; nats-tls.conf adds TLS here.
websocket {
  port: $MAM_WS_PORT
  no_tls: true
  # Browsers send an Origin header; dashboards may be served from anywhere.
  same_origin: false
  compression: false
}

accounts {
  # Everything mam-fleet does happens inside this account.
  MAM: {
    jetstream: enabled
    users: [
      # Hub and runners: read and write under the topic root, nothing else.
      { user: mam_agent, password: $MAM_BROKER_PASS,
        allowed_connection_types: ["MQTT", "MQTT_WS"],
        permissions: {
          publish:   { allow: $MAM_SUBJECTS }
          subscribe: { allow: $MAM_SUBJECTS }
        } }
      # Dashboards: read every job and runner topic, publish nothing. A denied
      # MQTT PUBLISH is dropped by the server (logged as a Publish Violation).
      { user: mam_observer, password: $MAM_OBSERVER_PASS,
        allowed_connection_types: ["MQTT", "MQTT_WS"],
        permissions: {
          publish:   { deny:  [">"] }
          subscribe: { allow: $MAM_SUBJECTS }
        } }
    ]
  }
  # Other home services; accounts are isolated, so HOME sees nothing of MAM.
  HOME: {
    users: [ { user: home, password: $MAM_HOME_PASS } ]
  }
  # Server monitoring and events ($SYS.>); never give it to an agent.
  SYS: {
    users: [ { user: sys, password: $MAM_SYS_PASS } ]
  }
}
system_account: SYS
"""

NATS_TLS_CONF = r"""# mam-fleet production broker: nats-server >= 2.10 with its MQTT 3.1.1 engine.
#
# TLS variant (model P: a broker reachable beyond a private network).
# TLS 1.3 only, server certificate from a private CA; client certificates
# (mTLS) are optional: set MAM_VERIFY_CLIENTS to true to require them.
# Certificates: see deploy/nats/README.md.
#
# Secrets come from the environment; nats-server refuses to start when one is
# unset (no default): MAM_BROKER_PASS, MAM_OBSERVER_PASS, MAM_HOME_PASS,
# MAM_SYS_PASS. `mam-orch init` generates them (see deploy/nats/README.md).
# Keep the env references bare: a quoted "$VAR" is taken literally.
#
# Settings `mam-orch init` and the tests fill in. Names start with MAM_ on
# purpose: config keys are case-insensitive, so a variable called STORE_DIR
# would be read as the store_dir option itself.
MAM_MQTT_PORT: 8883
MAM_WS_PORT: 8443
MAM_CA_FILE: "/certs/ca.crt"
MAM_CERT_FILE: "/certs/server.crt"
MAM_KEY_FILE: "/certs/server.key"
# true: a client must present a certificate signed by the CA (mTLS), on top
# of its password.
MAM_VERIFY_CLIENTS: false
MAM_STORE_DIR: "/data"
# Native NATS client port (loopback only, see below).
MAM_NATS_PORT: 4222
# The subjects of MAM_TOPIC_ROOT (python/mqtt): NATS maps MQTT '/' to '.'.
# MQTT '#' also matches the parent level, hence the bare root.
MAM_SUBJECTS: ["python.mqtt", "python.mqtt.>"]

server_name: mam-broker

# Native NATS port: mam-fleet does not use it; loopback only (admin tools).
host: 127.0.0.1
port: $MAM_NATS_PORT

# MQTT needs JetStream: QoS 1 sessions and retained messages live in streams.
jetstream {
  store_dir: $MAM_STORE_DIR
  max_memory_store: 256MB
  max_file_store: 8GB
}

# MQTT 3.1.1 over TLS (mqtts://<broker>:8883): the hub and the runners.
mqtt {
  port: $MAM_MQTT_PORT
  # PUBACK wait before JetStream redelivers a QoS 1 message to a subscriber.
  ack_wait: "30s"
  tls {
    ca_file:   $MAM_CA_FILE
    cert_file: $MAM_CERT_FILE
    key_file:  $MAM_KEY_FILE
    min_version: "1.3"
    verify: $MAM_VERIFY_CLIENTS
    timeout: 5
  }
}

# WebSocket listener over TLS. It serves BOTH protocols: NATS-over-WebSocket
# at any path, and MQTT-over-WebSocket when the client asks for the path /mqtt
# (nats-server >= 2.8, PR nats-io/nats-server#2735). Dashboards connect to
# wss://<broker>:8443/mqtt as mam_observer.
websocket {
  port: $MAM_WS_PORT
  # Browsers send an Origin header; dashboards may be served from anywhere.
  same_origin: false
  compression: false
  tls {
    ca_file:   $MAM_CA_FILE
    cert_file: $MAM_CERT_FILE
    key_file:  $MAM_KEY_FILE
    min_version: "1.3"
    verify: $MAM_VERIFY_CLIENTS
    timeout: 5
  }
}

accounts {
  # Everything mam-fleet does happens inside this account.
  MAM: {
    jetstream: enabled
    users: [
      # Hub and runners: read and write under the topic root, nothing else.
      { user: mam_agent, password: $MAM_BROKER_PASS,
        allowed_connection_types: ["MQTT", "MQTT_WS"],
        permissions: {
          publish:   { allow: $MAM_SUBJECTS }
          subscribe: { allow: $MAM_SUBJECTS }
        } }
      # Dashboards: read every job and runner topic, publish nothing. A denied
      # MQTT PUBLISH is dropped by the server (logged as a Publish Violation).
      { user: mam_observer, password: $MAM_OBSERVER_PASS,
        allowed_connection_types: ["MQTT", "MQTT_WS"],
        permissions: {
          publish:   { deny:  [">"] }
          subscribe: { allow: $MAM_SUBJECTS }
        } }
    ]
  }
  # Other home services; accounts are isolated, so HOME sees nothing of MAM.
  HOME: {
    users: [ { user: home, password: $MAM_HOME_PASS } ]
  }
  # Server monitoring and events ($SYS.>); never give it to an agent.
  SYS: {
    users: [ { user: sys, password: $MAM_SYS_PASS } ]
  }
}
system_account: SYS
"""
