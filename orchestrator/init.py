"""`mam-orch init`: write a workspace's `.mam.env` and, on request, a filled
production `nats.conf` with its `nats.env` and a compose file for it, or with
`--cluster` the three node configs of a NATS cluster (PROTOCOL §13,
docs/deployment.md). The printed hints are the commands that start them
(docker compose, or nats-server natively); tests/e2e runs them.

The nats-server configurations shipped in `deploy/nats/` live in
`mam.orchestrator.broker.templates` (`NATS_CONF`, `NATS_TLS_CONF`, re-exported here), the one
source the embedded broker of `mam-orch broker up` is rendered from too.
Everything a deployment may change lives in a block of `MAM_*: value`
variable lines at the top of those files; `set_conf_variables` rewrites those
lines and nothing else, so the tests run the shipped files themselves.

Secrets (passwords, MAM_DISPATCH_SECRET) are written only to 0600 files and
never printed.
"""

from __future__ import annotations

import json
import os
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from mam.orchestrator.broker.templates import (
    CLUSTER_PORT,
    CLUSTER_SIZE,
    NATS_CONF,
    NATS_TLS_CONF,
    ROUTE_PASS_VAR,
    ROUTE_URL_VARS,
    cluster_node,
    conf_variables,
    route_urls,
    set_conf_variables,
)
from mam.shared.config import ENV_FILE_NAME, new_secret, write_env_file
from mam.shared.protocol import names
from mam.shared.protocol.crypto import keys
from mam.shared.protocol.errors import ConfigError, UsageError
from mam.shared.store import keyfiles
from mam.shared.store.fsio import atomic_write
from mam.shared.store.root import resolve_root

#: Users of deploy/nats/nats.conf (account MAM) and what they are for.
AGENT_USER = "mam_agent"
OBSERVER_USER = "mam_observer"
#: Environment variables nats.conf reads its passwords from.
BROKER_SECRET_VARS = ("MAM_BROKER_PASS", "MAM_OBSERVER_PASS", "MAM_HOME_PASS", "MAM_SYS_PASS")
#: Name of the file holding the broker's secrets, next to the rendered nats.conf.
BROKER_ENV_NAME = "nats.env"
#: The compose file init writes next to the config(s); compose v1 (1.29) and v2 read it.
COMPOSE_NAME = "nats-compose.yaml"
#: The image the compose file runs unless MAM_BROKER_IMAGE says otherwise.
DEFAULT_NATS_IMAGE = "nats:2.12-alpine"
#: Project names given to compose with -p (its volumes are named after them).
COMPOSE_PROJECT, CLUSTER_COMPOSE_PROJECT = "mam-broker", "mam-nats"
#: The JetStream store in the container (a named volume), unless --store-dir says otherwise.
DEFAULT_STORE_DIR = "/data"
DEFAULT_MQTT_PORT, DEFAULT_MQTTS_PORT = 1883, 8883
DEFAULT_WS_PORT, DEFAULT_WSS_PORT = 8080, 8443
#: Cluster nodes: node-<n>.conf, server name mam-nats-<n>, compose service nats-<n>.
NODE_CONF = "node-{n}.conf"
NODE_NAME = "mam-nats-{n}"
NODE_SERVICE = "nats-{n}"
#: The hosts of the shipped deploy/nats/cluster files (tailnet machine names; init --cluster --broker sets yours).
CLUSTER_EXAMPLE_HOSTS = ("mam-nats-1", "mam-nats-2", "mam-nats-3")
MAM_DIR_MODE = 0o700  # the workspace's .mam/ (it holds the broker record and keys)

__all__ = ["AGENT_USER", "BROKER_ENV_NAME", "BROKER_SECRET_VARS", "COMPOSE_NAME", "NATS_CONF", "NATS_TLS_CONF",
           "OBSERVER_USER", "InitResult", "broker_password", "conf_variables", "init_workspace",
           "render_cluster", "render_compose", "render_nats_conf", "set_conf_variables", "topic_subjects"]


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
    written: tuple[Path, ...] = field(default=())


def _yaml(value: str) -> str:
    """A YAML double-quoted scalar (JSON strings are valid YAML)."""
    return json.dumps(value)


def render_compose(configs: Sequence[str], *, cluster: bool = False, tls: bool = False,
                   mqtt_port: int | None = None, store_dir: str = DEFAULT_STORE_DIR) -> str:
    """The compose file init writes next to the config(s): one nats-server service per config
    (`nats`, or `nats-1`..`nats-3` for a cluster), no top-level `name:` and no profiles, so
    docker-compose 1.29 and compose v2 both run it (project name by `-p`).

    Args:
        configs: config file names (next to the compose file), each mounted as /etc/nats/nats.conf.
        cluster: the services are cluster nodes (route port published, route variables passed).
        tls: mount ./certs on /certs; default ports 8883 and 8443.
        mqtt_port: the MQTT port, published as `P:P` like the WebSocket (and route) port.
        store_dir: the JetStream store in the container; each service's named volume sits there.
    """
    ws_port = DEFAULT_WSS_PORT if tls else DEFAULT_WS_PORT
    ports = [mqtt_port or (DEFAULT_MQTTS_PORT if tls else DEFAULT_MQTT_PORT), ws_port]
    secret_vars = [*BROKER_SECRET_VARS]
    if cluster:
        ports.append(CLUSTER_PORT)
        secret_vars += [ROUTE_PASS_VAR, *ROUTE_URL_VARS]
        services = {NODE_SERVICE.format(n=n): conf for n, conf in enumerate(configs, start=1)}
    else:
        services = {"nats": configs[0]}
    project = CLUSTER_COMPOSE_PROJECT if cluster else COMPOSE_PROJECT
    out = ["# Generated by `mam-orch init` (docs/deployment.md); start it with", f"#   {_compose(None, project)}"]
    if cluster:
        out.append("# followed by the service of this host (nats-1, nats-2 or nats-3): one node per host.")
    out += ["services:"]
    volumes = []
    for service, conf in services.items():
        volume = f"{service}-data"
        volumes.append(volume)
        out += [f"  {service}:", f"    image: {_yaml('${MAM_BROKER_IMAGE:-' + DEFAULT_NATS_IMAGE + '}')}",
                f"    hostname: {_yaml(service)}",
                '    command: ["-c", "/etc/nats/nats.conf"]', "    restart: unless-stopped", "    environment:"]
        out += [f"      {var}: {_yaml('${' + var + ':?set in ' + BROKER_ENV_NAME + '}')}" for var in secret_vars]
        out += ["    volumes:", f"      - {_yaml('./' + conf + ':/etc/nats/nats.conf:ro')}"]
        if tls:
            out += [f"      - {_yaml('./certs:/certs:ro')}"]
        out += [f"      - {_yaml(volume + ':' + store_dir)}", "    ports:"]
        out += [f"      - {_yaml(f'{port}:{port}')}" for port in ports]
    out += ["volumes:", *[f"  {volume}: {{}}" for volume in volumes]]
    return "\n".join(out) + "\n"


def render_cluster(hosts: Sequence[str], *, tls: bool = False, mqtt_port: int | None = None,
                   ws_port: int | None = None, store_dir: str = DEFAULT_STORE_DIR,
                   topic_root: str = names.DEFAULT_TOPIC_ROOT) -> dict[str, str]:
    """The node configs of a cluster: `node-<n>.conf` -> text, node n on `hosts[n-1]`.

    Each is the shipped nats.conf (or nats-tls.conf) with server name `mam-nats-<n>`, its
    own store folder `<store_dir>/mam-nats-<n>`, and `natsconf.cluster_node`'s routes.
    Raises:
        UsageError: not three hosts, a bad port or topic root.
    """
    if len(hosts) != CLUSTER_SIZE:
        raise UsageError(f"--cluster needs {CLUSTER_SIZE} hosts in --broker (h1,h2,h3), got {len(hosts)}")
    out = {}
    for n, host in enumerate(hosts, start=1):
        name = NODE_NAME.format(n=n)
        text = render_nats_conf(tls=tls, mqtt_port=mqtt_port, ws_port=ws_port, topic_root=topic_root,
                                store_dir=str(PurePosixPath(store_dir) / name))
        text = set_conf_variables(text, {"MAM_SERVER_NAME": name})
        out[NODE_CONF.format(n=n)] = cluster_node(text, host=host)
    return out


def _native(folder: Path, conf: str) -> str:
    """The command that runs nats-server on `conf` with nats.env's variables (a subshell: they
    do not stay in the user's shell)."""
    return f"cd {shlex.quote(str(folder))} && (set -a && . ./{BROKER_ENV_NAME} && nats-server -c {conf})"


def _compose(folder: Path | None, project: str, service: str = "") -> str:
    """The compose command that starts `service` (default: every service) from `folder`."""
    cd = f"cd {shlex.quote(str(folder))} && " if folder else ""
    return (f"{cd}docker compose -p {project} -f {COMPOSE_NAME} --env-file {BROKER_ENV_NAME} up -d"
            f"{' ' + service if service else ''}")


def init_workspace(workspace: str | os.PathLike[str] | None = None, *,
                   broker_config: str | os.PathLike[str] | None = None,
                   force: bool = False, broker_host: str = "localhost",
                   port: int | None = None, tls: bool = False,
                   environ: Mapping[str, str] | None = None, store_dir: str | None = None,
                   cluster: bool = False) -> InitResult:
    """Write `<root>/.mam.env` (0600) with fresh secrets; optionally a filled
    nats config plus its `nats.env` (0600) holding the broker passwords and a
    compose file (`nats-compose.yaml`) that runs it; with `cluster`, the three
    node configs `node-1.conf`..`node-3.conf` in the `broker_config` folder instead.

    `.mam.env` gets MQTT_BROKER, MQTT_PORT, MQTT_TLS, MQTT_USERNAME
    (mam_agent), MQTT_PASSWORD, MAM_TOPIC_ROOT and MAM_DISPATCH_SECRET (§13):
    copy it to every runner. `nats.env` gets MAM_BROKER_PASS (the same value
    as MQTT_PASSWORD), MAM_OBSERVER_PASS, MAM_HOME_PASS and MAM_SYS_PASS (a
    cluster also MAM_ROUTE_PASS and the route URLs MAM_ROUTE_1..3): it stays
    on the broker host(s).

    Args:
        workspace: the workspace root (default: resolve_root(), §8).
        broker_config: where to write nats.conf (None: do not write one); with
            `cluster`, the folder for the node configs.
        force: overwrite existing files.
        broker_host: MQTT_BROKER for the clients (a comma-separated list is the
            fail-over list; with `cluster`, the three nodes' hosts in order).
        port: MQTT_PORT (default 1883, 8883 with `tls`); also the broker's MQTT port.
        tls: clients use TLS and the TLS variant of nats.conf is rendered.
        environ: where MAM_TOPIC_ROOT is read from (default os.environ).
        store_dir: the JetStream store (default /data, the container volume; a
            relative path is taken from the current directory).
        cluster: write a three-node cluster (needs `broker_config` and three hosts).
    Returns:
        the paths written and the next steps (`notes`).
    Raises:
        ConfigError: a target exists and `force` is false (nothing is
            written), or a file cannot be written. Exit 64 on the CLI.
        UsageError: a bad host, port or topic root; `cluster` without three hosts
            or without `broker_config`.
    """
    env = os.environ if environ is None else environ
    root = resolve_root(workspace, environ=env)
    if not root.is_dir():
        raise ConfigError(f"workspace {str(root)!r} does not exist")
    hosts = [part.strip() for part in broker_host.split(",") if part.strip()]
    if not hosts or any(any(c.isspace() or c in "/#$\"'\\@" for c in h) or len(h) > 253 for h in hosts):
        raise UsageError(f"--broker {broker_host!r} is invalid: expected a host name or address")
    mqtt_port = port if port is not None else (DEFAULT_MQTTS_PORT if tls else DEFAULT_MQTT_PORT)
    if not 1 <= mqtt_port <= 65535:
        raise UsageError(f"--port {mqtt_port} is out of range 1..65535")
    root_topic = env.get("MAM_TOPIC_ROOT") or "python/mqtt"
    topic_subjects(root_topic)  # validates before anything is written
    store = str(Path(store_dir).expanduser().resolve()) if store_dir else DEFAULT_STORE_DIR
    if cluster and broker_config is None:
        raise UsageError("--cluster needs --broker-config DIR (the folder for the node configs)")

    env_path = root / ENV_FILE_NAME
    target = Path(broker_config).expanduser().resolve() if broker_config is not None else None
    configs: dict[str, str] = {}
    if target is not None and cluster:
        if not target.is_dir():
            raise ConfigError(f"{target}: no such directory (--cluster writes node configs into a folder)")
        folder = target
        configs = render_cluster(hosts, tls=tls, mqtt_port=mqtt_port, store_dir=store, topic_root=root_topic)
    elif target is not None:
        if not target.parent.is_dir():
            raise ConfigError(f"{target.parent}: no such directory")
        if target.is_dir():
            raise ConfigError(f"{target}: is a directory; give the file name of the nats config")
        folder = target.parent
        configs = {target.name: render_nats_conf(tls=tls, mqtt_port=mqtt_port, topic_root=root_topic,
                                                 store_dir=store)}
    broker_files = [folder / name for name in (*configs, BROKER_ENV_NAME, COMPOSE_NAME)] if configs else []
    targets = [env_path, *broker_files]
    if not force:
        existing = [str(p) for p in targets if p.exists()]
        if existing:
            raise ConfigError(f"{', '.join(existing)}: already exists; use --force to overwrite")

    agent_pass = broker_password()
    notes = [f"wrote {env_path} (mode 0600): copy it to every runner's workspace root"]
    if configs:
        secrets = {"MAM_BROKER_PASS": agent_pass, "MAM_OBSERVER_PASS": broker_password(),
                   "MAM_HOME_PASS": broker_password(), "MAM_SYS_PASS": broker_password()}
        if cluster:
            route_pass = broker_password()
            secrets |= {ROUTE_PASS_VAR: route_pass, **route_urls(hosts, route_pass)}
        project = CLUSTER_COMPOSE_PROJECT if cluster else COMPOSE_PROJECT
        write_env_file(folder / BROKER_ENV_NAME, secrets,
                       header="nats-server secrets (keep on the broker host(s); mode 0600), written by "
                              "`mam-orch init`.\nUsed by " + COMPOSE_NAME + " (--env-file) and native runs "
                              "(set -a; . ./nats.env).", overwrite=True)
        for name, text in configs.items():
            atomic_write(folder / name, text.encode("utf-8"), what=name, error=ConfigError)
        compose = render_compose(list(configs), cluster=cluster, tls=tls, mqtt_port=mqtt_port, store_dir=store)
        atomic_write(folder / COMPOSE_NAME, compose.encode("utf-8"), what=COMPOSE_NAME, error=ConfigError)
        notes.append(f"wrote {', '.join(str(p) for p in broker_files)} (mode 0600, broker host only)")
        if cluster:
            for n, (conf, host) in enumerate(zip(configs, hosts, strict=True), start=1):
                service = NODE_SERVICE.format(n=n)
                notes.append(f"node {service} on {host}: copy {folder} there, then start it: "
                             f"{_compose(folder, project, service)}")
                notes.append(f"  or natively: {_native(folder, conf)}")
        else:
            names.mam_dir(root).mkdir(mode=MAM_DIR_MODE, parents=True, exist_ok=True)
            record = {"config": str(folder / next(iter(configs))), "topic_root": root_topic}
            atomic_write(names.broker_record_path(root), (json.dumps(record) + "\n").encode("utf-8"),
                         what="broker record", error=ConfigError)  # `runner add|revoke` edit its runner users
            notes.append(f"start the broker: {_compose(folder, project)}")
            notes.append(f"  or natively: {_native(folder, next(iter(configs)))}")
        notes.append(f"JetStream store: {store}{'/<node>' if cluster else ''}"
                     f"{'' if store_dir else ' (a container volume; natively give --store-dir DIR)'}")
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
    hub_public = keys.public_text(keyfiles.hub_key(root))  # §16: made once, never overwritten (rotate instead)
    notes.append(f"hub key {names.hub_key_path(root)} (mode 0600); public key {hub_public}; enrol runners with "
                 "mam-orch runner add (docs/security.md)")
    if tls:
        notes.append("TLS: put ca.crt, server.crt and server.key in the broker's certs/ (mounted on /certs) "
                     "and set MQTT_CA_CERTS on every client (deploy/nats/README.md)")
    notes.append("check: mam-orch config")
    first = next(iter(configs), None)
    return InitResult(env_file=env_path, broker_config=folder / first if first and not cluster else None,
                      broker_env=folder / BROKER_ENV_NAME if configs else None,
                      notes=tuple(notes), written=tuple([env_path, *broker_files]))
