"""`mam-orch config --check` and `broker status` against a broker this hub did not
start: connect to the configured broker (PROTOCOL §13) and report what was found,
host by host — TCP reachable, MQTT CONNECT accepted (credentials), the protocol
version — plus JetStream when the broker is this workspace's own nats-server."""

from __future__ import annotations

import dataclasses
import socket
from typing import Any

from mam.orchestrator.broker import embedded as broker
from mam.orchestrator.hub import Workspace, open_hub
from mam.shared.protocol.errors import BrokerUnavailable
from mam.shared.transport import sockets
from mam.shared.transport.mqtt import MqttClient

CHECK_TIMEOUT_S = 5.0  # per host: TCP connect, then the MQTT CONNACK
MQTT_PROTOCOL = "MQTT 3.1.1"  # what mam.shared.transport.mqtt speaks (paho's default)


def _probe_host(cfg: Any, host: str, timeout_s: float) -> dict[str, Any]:
    row: dict[str, Any] = {"host": sockets.endpoint(host, cfg.port), "reachable": False, "auth_ok": False}
    try:
        with socket.create_connection((host, cfg.port), timeout=timeout_s):
            row["reachable"] = True
    except OSError as exc:
        row["error"] = sockets.reason_of(exc)
        return row
    client = MqttClient(dataclasses.replace(cfg, hosts=(host,)), "check")
    try:
        client.connect(timeout_s)
        row.update(auth_ok=True, protocol=MQTT_PROTOCOL)
    except BrokerUnavailable as exc:
        row["error"] = str(exc).split(": ", 1)[-1]
    finally:
        client.close()
    return row


def check(workspace: Workspace = None, timeout_s: float = CHECK_TIMEOUT_S) -> dict[str, Any]:
    """Connect to every configured broker host and say what answered.

    Returns:
        {"hosts": [{"host", "reachable", "auth_ok", "protocol"?, "error"?}], "embedded": bool,
         "jetstream"?: bool, "version"?: str, "healthy": bool}; healthy = some host accepted us.
    Raises:
        ConfigError, EnvFileError: the settings cannot be resolved.
    """
    hub = open_hub(workspace)
    cfg = hub.broker_config()
    rows = [_probe_host(cfg, host, timeout_s) for host in cfg.hosts]
    info: dict[str, Any] = {"hosts": rows, "embedded": broker.running(str(hub.root)),
                            "healthy": any(row["auth_ok"] for row in rows)}
    if info["embedded"]:
        try:
            native = broker.status(str(hub.root))
            info.update(jetstream=native.get("jetstream"), version=native.get("version"))
        except BrokerUnavailable as exc:
            info["native_error"] = str(exc)
    return info


def check_lines(info: dict[str, Any]) -> list[str]:
    """The human view of `check`: one line a host, then JetStream when known."""
    lines = []
    for row in info["hosts"]:
        if not row["reachable"]:
            lines.append(f"{row['host']}: unreachable ({row.get('error')})")
        elif not row["auth_ok"]:
            lines.append(f"{row['host']}: reachable; MQTT connect refused ({row.get('error')})")
        else:
            lines.append(f"{row['host']}: reachable; auth ok; {row.get('protocol')}")
    if "jetstream" in info:
        lines.append(f"this workspace's nats-server {info.get('version')}: JetStream "
                     f"{'enabled' if info['jetstream'] else 'DISABLED'}")
    elif not info["embedded"]:
        lines.append("not this workspace's embedded broker: JetStream not checked")
    return lines
