"""The hub's fleet operations: cancel, redispatch, the runners view, and the
retained-topic housekeeping they share (PROTOCOL §2, §5, §6, §7, §10).

`publish_cancel` and `clear_dispatch` take an already connected client so
the watcher and the CLI commands share one connection per process.
"""

from __future__ import annotations

import json
import logging
import sys
from typing import Any

from mam.shared import names

log = logging.getLogger("mam.fleet")

EXIT_CANCELLED = 4


def signing_keys(workspace: Any = None) -> Any:
    """The dispatch keys from MAM_DISPATCH_SECRET (§5).

    Raises:
        ConfigError: the secret is unset or shorter than 32 characters.
    """
    from mam.shared import config, crypto

    return crypto.derive_keys(config.dispatch_secret(workspace=workspace))


def publish_cancel(client: Any, record: dict[str, Any], keys: Any, reason: str) -> None:
    """Publish the signed, retained cancel of §6 for the record's current attempt.

    Args:
        client: a connected `MqttClient`.
        record: the hub record (job_id, attempt_id).
        keys: `DispatchKeys`.
        reason: short text, e.g. "operator", "deadline_timeout".
    Raises:
        BrokerError: no PUBACK.
    """
    from mam.shared import crypto, wire

    control = wire.Control.cancel(record["job_id"], record["attempt_id"], reason)
    payload = wire.encode(crypto.sign(control.to_dict(), keys.sign_key))
    client.publish(names.control_topic(record["job_id"], client.config.topic_root), payload, retain=True)


def clear_retained(client: Any, topic: str) -> None:
    """Clear a retained topic: a zero-length retained publish (§2)."""
    client.publish(topic, b"", retain=True)


def clear_dispatch(client: Any, job_id: str) -> None:
    """Clear the job's retained dispatch (§2, §10 agent_blocked)."""
    clear_retained(client, names.dispatch_topic(job_id, client.config.topic_root))


def close_remote(registry: Any, client: Any, keys: Any, job_id: str, close_reason: str) -> dict[str, Any]:
    """Close an unfinished job on the hub and tell its runner (§10): the
    record goes terminal first (so no job stays pending/running whatever
    happens next), then the retained dispatch is cleared for `agent_blocked`
    and a cancel is published so the agent never outlives the decision.

    Args:
        close_reason: deadline_timeout, agent_blocked or cancelled.
    Returns:
        the record after the close (unchanged if it was already terminal).
    """
    from mam.shared.errors import BrokerError, TransitionRefused

    try:
        record = registry.close(job_id, close_reason, source="delegate_wrapper")
    except TransitionRefused:
        return registry.get(job_id)
    if client is None or keys is None:
        log.warning("job %s closed %s on the hub only: no %s to tell the runner", job_id, close_reason,
                    "broker connection" if client is None else "MAM_DISPATCH_SECRET")
        return record
    try:
        if close_reason == "agent_blocked":
            clear_dispatch(client, job_id)
        publish_cancel(client, record, keys, close_reason)
    except BrokerError as exc:
        log.warning("job %s closed %s on the hub; the cancel was not published: %s", job_id, close_reason, exc)
    return record


def cancel(job_id: str, *, workspace: Any = None, reason: str = "operator") -> int:
    """`mam-orch cancel`: mark the hub record cancelled, then publish the
    signed retained cancel (§6). Returns the exit code (4 = cancelled).

    Raises:
        UsageError, ConfigError, RegistryError, BrokerError.
    """
    from mam.shared import config, mqtt
    from mam.shared.registry import TERMINAL, Registry

    names.validate_job_id(job_id)
    registry = Registry(config.resolve_root(workspace))
    record = registry.get(job_id)
    if record["status"] in TERMINAL:
        print(f"job {job_id} is already {record['status']}; nothing to cancel", file=sys.stderr)
        return 0
    keys = signing_keys(registry.root)
    cfg = config.broker_config(record.get("broker") or None, workspace=registry.root)
    record = registry.close(job_id, "cancelled", source="operator", reason=reason)
    with mqtt.MqttClient(cfg, "cancel") as client:
        client.connect()
        publish_cancel(client, record, keys, reason)
    print(json.dumps({"job_id": job_id, "status": "cancelled", "attempt_id": record["attempt_id"]}))
    return 0


def runners_view(messages: list[Any], now_s: float | None = None) -> list[dict[str, Any]]:
    """Turn retained presence messages into rows (session, status, running, last seen)."""
    from mam.shared import wire

    rows = []
    for message in messages:
        try:
            presence = wire.decode(message.payload, "presence")
        except Exception:  # noqa: BLE001 - a bad retained presence is shown as unreadable
            continue
        rows.append({"session": presence.session, "status": presence.status, "host": presence.host,
                     "running": list(presence.running), "max_jobs": presence.max_jobs,
                     "last_seen": presence.timestamp, "runner_id": presence.runner_id})
    rows.sort(key=lambda row: row["session"])
    return rows
