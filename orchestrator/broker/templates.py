"""The nats-server configurations shipped in deploy/nats/, embedded as the ONE
source of every nats config mam-fleet writes (PROTOCOL §2, §13; docs/deployment.md):
`mam-orch init` fills them for a production broker (`cluster_node` turns one into
a node of a three-node cluster: routes, `mqtt { stream_replicas: 3 }`), `mam-orch
broker up` and the test brokers render the embedded broker from `NATS_CONF`.

An installed wheel has no deploy/ folder, hence the copies below; a test asserts
they are byte-identical to deploy/nats/nats.conf and nats-tls.conf. Everything a
deployment may change lives in a block of `MAM_*: value` variable lines at the top
of those files; `set_conf_variables` rewrites those lines and nothing else.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence

from mam.shared.protocol.errors import ConfigError, UsageError

ConfValue = str | int | bool | list[str] | tuple[str, ...]

#: A cluster (deploy/nats/cluster, `mam-orch init --cluster`): three nodes, one per host.
CLUSTER_SIZE = 3
CLUSTER_NAME = "mam"
CLUSTER_PORT = 6222  # route listener (TCP), on every node
ROUTE_USER = "mam_route"
#: Replicas of the MQTT streams (sessions, retained messages, QoS 1 queues) in a cluster.
CLUSTER_STREAM_REPLICAS = 3
#: Environment variables a node reads: the route password and one route URL per node
#: (the URLs carry that password, so they live in nats.env, never in the config).
ROUTE_PASS_VAR = "MAM_ROUTE_PASS"
ROUTE_URL_VARS = tuple(f"MAM_ROUTE_{n}" for n in range(1, CLUSTER_SIZE + 1))

_VAR_LINE = re.compile(r"^(?P<name>MAM_[A-Z_]+):[ \t]*(?P<value>.*)$", re.M)


def _conf_value(value: ConfValue) -> str:
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


def set_conf_variables(text: str, values: Mapping[str, ConfValue]) -> str:
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


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def route_urls(hosts: Sequence[str], password: str, port: int = CLUSTER_PORT) -> dict[str, str]:
    """The route URL variables of nats.env (`MAM_ROUTE_1..3`), one per cluster node.

    Args:
        hosts: the nodes' host names, as the other nodes reach them.
        password: the route password (URL-safe characters only: `broker_password()`).
        port: the route port of every node.
    Raises:
        UsageError: not exactly CLUSTER_SIZE hosts, or a password that needs URL quoting.
    """
    if len(hosts) != CLUSTER_SIZE:
        raise UsageError(f"a cluster needs {CLUSTER_SIZE} hosts, got {len(hosts)}: {','.join(hosts)}")
    if not re.fullmatch(r"[A-Za-z0-9_-]+", password):
        raise UsageError("a route password must be URL-safe (letters, digits, '-', '_')")
    return {var: f"nats-route://{ROUTE_USER}:{password}@{_host_port(host, port)}"
            for var, host in zip(ROUTE_URL_VARS, hosts, strict=True)}


def cluster_node(text: str, *, host: str, port: int = CLUSTER_PORT) -> str:
    """A rendered single-node config (`NATS_CONF`/`NATS_TLS_CONF` with its variables set)
    made a node of the cluster: MQTT streams replicated `CLUSTER_STREAM_REPLICAS` times, and
    a `cluster` block that routes to every node (`$MAM_ROUTE_1..3`, route user `mam_route`
    with `$MAM_ROUTE_PASS`) and advertises `host:port`. Accounts and users stay the template's.

    Raises:
        ConfigError: the template has no single top-level `mqtt {` block.
    """
    lines = text.splitlines(keepends=True)
    starts = [n for n, line in enumerate(lines) if line == "mqtt {\n"]
    if len(starts) != 1:
        raise ConfigError(f"the nats template has {len(starts)} 'mqtt {{' blocks (expected 1)")
    lines.insert(starts[0] + 1, "  # every MQTT stream (sessions, retained, QoS 1) on all three nodes\n"
                                f"  stream_replicas: {CLUSTER_STREAM_REPLICAS}\n")
    routes = ", ".join(f"${var}" for var in ROUTE_URL_VARS)
    block = f"""
# Cluster (mam-orch init --cluster): routes between the {CLUSTER_SIZE} nodes, plain TCP inside the
# tailnet. The route URLs carry the route password, so they come from nats.env.
cluster {{
  name: {json.dumps(CLUSTER_NAME)}
  host: $MAM_LISTEN
  port: {int(port)}
  advertise: {json.dumps(_host_port(host, port))}
  authorization {{ user: {json.dumps(ROUTE_USER)}, password: ${ROUTE_PASS_VAR} }}
  routes: [{routes}]
}}
"""
    return "".join(lines) + block


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
# Address of the MQTT and WebSocket listeners (all interfaces in the container).
MAM_LISTEN: "0.0.0.0"
# Address of the native NATS port (admin tools only).
MAM_NATS_HOST: "127.0.0.1"
MAM_SERVER_NAME: "mam-broker"
# The two users (MQTT_USERNAME of .mam.env; the dashboards' user).
MAM_AGENT_USER: "mam_agent"
MAM_OBSERVER_USER: "mam_observer"
# Native NATS client port (loopback only, see below).
MAM_NATS_PORT: 4222
# The subjects of MAM_TOPIC_ROOT (python/mqtt): NATS maps MQTT '/' to '.'.
# MQTT '#' also matches the parent level, hence the bare root.
MAM_SUBJECTS: ["python.mqtt", "python.mqtt.>"]

server_name: $MAM_SERVER_NAME

# Native NATS port: mam-fleet does not use it; loopback only (admin tools).
host: $MAM_NATS_HOST
port: $MAM_NATS_PORT

# MQTT needs JetStream: QoS 1 sessions and retained messages live in streams.
jetstream {
  store_dir: $MAM_STORE_DIR
  max_memory_store: 256MB
  max_file_store: 8GB
}

# MQTT 3.1.1 over TCP: the hub (mam-orch) and the runners (mam-runner).
mqtt {
  host: $MAM_LISTEN
  port: $MAM_MQTT_PORT
  # PUBACK wait before JetStream redelivers a QoS 1 message to a subscriber.
  ack_wait: "30s"
  # Unacknowledged QoS 1 deliveries a session may hold. nats-server gives each
  # QoS 1 subscription a window of this size but also caps the whole session at
  # it, and a delivery over the session's cap is not sent: it comes only after
  # ack_wait. The hub holds five QoS 1 subscriptions: at the default (1,024) a
  # hub behind a burst got some events and states 30 s late. A session's
  # windows may add up to 65,535 ('#' filters count twice): 8,192 leaves room
  # for seven subscriptions (a runner holds six).
  max_ack_pending: 8192
}

# WebSocket listener. It serves BOTH protocols: NATS-over-WebSocket at any
# path, and MQTT-over-WebSocket when the client asks for the path /mqtt
# (nats-server >= 2.8, PR nats-io/nats-server#2735). Dashboards connect to
# ws://<broker>:8080/mqtt as mam_observer. no_tls is acceptable only inside
# a tailnet; nats-tls.conf adds TLS here.
websocket {
  host: $MAM_LISTEN
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
      { user: $MAM_AGENT_USER, password: $MAM_BROKER_PASS,
        allowed_connection_types: ["MQTT", "MQTT_WS"],
        permissions: {
          publish:   { allow: $MAM_SUBJECTS }
          subscribe: { allow: $MAM_SUBJECTS }
        } }
      # Dashboards: read every job and runner topic, publish nothing. A denied
      # MQTT PUBLISH is dropped by the server (logged as a Publish Violation).
      { user: $MAM_OBSERVER_USER, password: $MAM_OBSERVER_PASS,
        allowed_connection_types: ["MQTT", "MQTT_WS"],
        permissions: {
          publish:   { deny:  [">"] }
          subscribe: { allow: $MAM_SUBJECTS }
        } }
      # Runners with their own user (docs/security.md): `mam-orch runner add|revoke`
      # keep one line per runner between these two markers.
      # BEGIN runner users
      # END runner users
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
# Address of the MQTT and WebSocket listeners (all interfaces in the container).
MAM_LISTEN: "0.0.0.0"
# Address of the native NATS port (admin tools only).
MAM_NATS_HOST: "127.0.0.1"
MAM_SERVER_NAME: "mam-broker"
# The two users (MQTT_USERNAME of .mam.env; the dashboards' user).
MAM_AGENT_USER: "mam_agent"
MAM_OBSERVER_USER: "mam_observer"
# Native NATS client port (loopback only, see below).
MAM_NATS_PORT: 4222
# The subjects of MAM_TOPIC_ROOT (python/mqtt): NATS maps MQTT '/' to '.'.
# MQTT '#' also matches the parent level, hence the bare root.
MAM_SUBJECTS: ["python.mqtt", "python.mqtt.>"]

server_name: $MAM_SERVER_NAME

# Native NATS port: mam-fleet does not use it; loopback only (admin tools).
host: $MAM_NATS_HOST
port: $MAM_NATS_PORT

# MQTT needs JetStream: QoS 1 sessions and retained messages live in streams.
jetstream {
  store_dir: $MAM_STORE_DIR
  max_memory_store: 256MB
  max_file_store: 8GB
}

# MQTT 3.1.1 over TLS (mqtts://<broker>:8883): the hub and the runners.
mqtt {
  host: $MAM_LISTEN
  port: $MAM_MQTT_PORT
  # PUBACK wait before JetStream redelivers a QoS 1 message to a subscriber.
  ack_wait: "30s"
  # Unacknowledged QoS 1 deliveries a session may hold. nats-server gives each
  # QoS 1 subscription a window of this size but also caps the whole session at
  # it, and a delivery over the session's cap is not sent: it comes only after
  # ack_wait. The hub holds five QoS 1 subscriptions: at the default (1,024) a
  # hub behind a burst got some events and states 30 s late. A session's
  # windows may add up to 65,535 ('#' filters count twice): 8,192 leaves room
  # for seven subscriptions (a runner holds six).
  max_ack_pending: 8192
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
  host: $MAM_LISTEN
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
      { user: $MAM_AGENT_USER, password: $MAM_BROKER_PASS,
        allowed_connection_types: ["MQTT", "MQTT_WS"],
        permissions: {
          publish:   { allow: $MAM_SUBJECTS }
          subscribe: { allow: $MAM_SUBJECTS }
        } }
      # Dashboards: read every job and runner topic, publish nothing. A denied
      # MQTT PUBLISH is dropped by the server (logged as a Publish Violation).
      { user: $MAM_OBSERVER_USER, password: $MAM_OBSERVER_PASS,
        allowed_connection_types: ["MQTT", "MQTT_WS"],
        permissions: {
          publish:   { deny:  [">"] }
          subscribe: { allow: $MAM_SUBJECTS }
        } }
      # Runners with their own user (docs/security.md): `mam-orch runner add|revoke`
      # keep one line per runner between these two markers.
      # BEGIN runner users
      # END runner users
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
