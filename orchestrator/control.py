"""What the hub publishes to a job's retained topics besides the dispatch:
the signed cancel of PROTOCOL §6, clearing retained topics (§2), and the
hub's close of an unfinished job (§10). Every function takes an already
connected client, so a command uses one connection.
"""

from __future__ import annotations

import logging
from pathlib import Path

from mam.orchestrator.identity import roster
from mam.shared.protocol import crypto, names, wire
from mam.shared.protocol.codes import TERMINAL_STATUSES, UNPUBLISHED_STATUSES, CloseReason, JobStatus
from mam.shared.protocol.crypto import DispatchKeys
from mam.shared.protocol.errors import BrokerError, TransitionRefused
from mam.shared.store.records import JobRecord, moved
from mam.shared.store.registry import Registry
from mam.shared.transport import Transport

log = logging.getLogger("mam.fleet")

# The hub's own closes: the runner may not know the job ended (§10).
HUB_CLOSES = frozenset({CloseReason.DEADLINE_TIMEOUT, CloseReason.AGENT_BLOCKED, CloseReason.RUNNER_LOST})


def publish_cancel(client: Transport, record: JobRecord, keys: DispatchKeys, reason: str,
                   root: Path | None = None) -> None:
    """Publish the signed, retained cancel of §6 for the record's current attempt (v2 for an
    enrolled session, §16).

    Args:
        client: a connected `Transport`.
        record: the hub record (job_id, attempt_id).
        keys: `DispatchKeys`.
        reason: short text, e.g. "operator", "deadline_timeout".
        root: the hub's root: a job of an enrolled session gets a v2 (Ed25519) cancel (§16);
            None: v1.
    Raises:
        BrokerError: no PUBACK.
    """
    control = wire.Control.cancel(record["job_id"], record["attempt_id"], reason)
    client.publish(names.control_topic(record["job_id"], client.config.topic_root),
                   control_payload(control, record.get("session"), keys, root), retain=True)


def control_payload(control: wire.Control, session: str | None, keys: DispatchKeys, root: Path | None) -> bytes:
    """The wire bytes of a hub control (a cancel §6, an answer §19, a say §18): signed v2 for
    a session with a roster entry under `root` (§16.2), else v1 with the dispatch key."""
    signed = roster.sign_control_v2(root, session, control) if root is not None and session else None
    return wire.encode(signed or crypto.sign(control.to_dict(), keys.sign_key))


def clear_retained(client: Transport, topic: str) -> None:
    """Clear a retained topic: a zero-length retained publish (§2).

    Raises:
        BrokerError: no PUBACK.
    """
    client.publish(topic, b"", retain=True)


def clear_dispatch(client: Transport, job_id: str) -> None:
    """Clear the job's retained dispatch (§2, §10 agent_blocked).

    Raises:
        BrokerError: no PUBACK.
    """
    clear_retained(client, names.dispatch_topic(job_id, client.config.topic_root))


def cancel_owed(record: JobRecord) -> bool:
    """True when the hub decided this job's end but its runner may not know:
    cancelled, or closed unfinished (deadline_timeout, agent_blocked) — §10."""
    return record["status"] == JobStatus.CANCELLED or (
        record["status"] == JobStatus.ERROR and record.get("close_reason") in HUB_CLOSES)


def close_remote(registry: Registry, client: Transport | None, keys: DispatchKeys | None, job_id: str,
                 close_reason: str) -> JobRecord:
    """Close an unfinished job on the hub and tell its runner (§10): the
    record goes terminal first (so no job stays pending/running whatever
    happens next), then the retained dispatch is cleared for `agent_blocked`
    and a cancel is published so the agent never outlives the decision.

    Args:
        client: a connected client, or None (hub-only close, logged).
        keys: the dispatch keys, or None (hub-only close, logged).
        close_reason: deadline_timeout, agent_blocked or cancelled.
    Returns:
        the record after the close (unchanged if it was already terminal).
    Raises:
        RegistryError: the record cannot be read or written.
    """
    try:
        record = registry.close(job_id, close_reason, source="delegate_wrapper")
    except TransitionRefused:
        return registry.get(job_id)
    if client is None or keys is None:
        log.warning("job %s closed %s on the hub only: no %s to tell the runner; once that is fixed, "
                    "`mam-orch cancel %s` sends the cancel", job_id, close_reason,
                    "broker connection" if client is None else "MAM_DISPATCH_SECRET", job_id)
        return record
    try:
        if close_reason == CloseReason.AGENT_BLOCKED:
            clear_dispatch(client, job_id)
        publish_cancel(client, record, keys, close_reason, registry.root)
    except BrokerError as exc:
        log.warning("job %s closed %s on the hub; the cancel was not published: %s; `mam-orch cancel %s` "
                    "sends it again", job_id, close_reason, exc, job_id)
    return record


def cancel_queued(registry: Registry, job_id: str, reason: str) -> tuple[JobRecord, bool]:
    """Cancel the job on the hub if it is still `blocked` or `queued` (§14: nothing was
    published, so no control either). Returns (its record now, whether this call cancelled
    it); a job that left the queue meanwhile is returned as it is, to be cancelled as published."""
    record = registry.get(job_id)
    if record["status"] not in UNPUBLISHED_STATUSES:
        return record, False
    with registry.transaction(job_id) as txn:
        if txn.record["status"] not in UNPUBLISHED_STATUSES:
            return txn.record, False
        record = moved(txn.record, JobStatus.CANCELLED, close_reason=CloseReason.CANCELLED)
        txn.update(record, source="operator", reason=reason)
    return registry.get(job_id), True


def cancel_open(registry: Registry, client: Transport | None, keys: DispatchKeys, job_id: str,
                reason: str) -> tuple[JobRecord, bool]:
    """An operator's cancel of an open job on an already connected client (§6, §14): a
    `queued` job is closed on the hub only (nothing was published); a published one is
    closed, its retained dispatch cleared and its runner sent a signed cancel. A job that
    already ended is left alone.

    Returns:
        (the record after it, whether this call changed it).
    Raises:
        JobNotFound, RegistryError; BrokerError: the record changed, the runner was not told.
    """
    record, changed = cancel_queued(registry, job_id, reason)
    if record["status"] not in TERMINAL_STATUSES:
        try:
            record = registry.close(job_id, "cancelled", source="operator", reason=reason)
            changed = True
        except TransitionRefused:
            record = registry.get(job_id)  # it ended meanwhile
        if changed and cancel_owed(record) and client is not None:
            tell_runner(client, record, keys, reason, registry.root, f"run `mam-orch cancel {job_id}`")
    return record, changed


def tell_runner(client: Transport, record: JobRecord, keys: DispatchKeys, reason: str, root: Path,
                hint: str) -> None:
    """Clear the job's retained dispatch and publish its signed cancel (§6) after the hub closed it.

    Raises:
        BrokerError: one line saying the hub closed the job but its runner was not told, then
            `hint` (what tells it).
    """
    try:
        clear_dispatch(client, record["job_id"])
        publish_cancel(client, record, keys, reason, root)
    except BrokerError as exc:
        raise BrokerError(f"job {record['job_id']} is {record['status']} on the hub, but its runner was not "
                          f"told: {exc}; {hint}") from None
