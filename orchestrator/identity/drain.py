"""Drain a runner from the hub (PROTOCOL §7 "Drain from the hub"): `mam-orch runner drain`,
`runner undrain`, the dashboard's buttons and `POST /api/runners/{session}/drain|undrain`.

The hub publishes a signed order, retained on `ROOT/runners/<session>/drain`: v2 (the hub key)
for an enrolled session, v1 (the dispatch secret) otherwise, like a cancel (§6, §16.2). The
runner then announces `draining` and takes no new job (a dispatch already sent to it waits,
as for a full runner) until the hub's undrain; its running jobs go on. Being retained, the
order holds across the runner's restarts.

    line = order_drain(hub, "gpu-box", draining=True, reason="disk full")
"""

from __future__ import annotations

from mam.orchestrator.hub import Hub
from mam.orchestrator.identity import roster
from mam.shared.protocol import crypto, names, wire
from mam.shared.protocol.errors import UsageError
from mam.shared.protocol.wire import MAX_REASON_CHARS
from mam.shared.transport import Transport

__all__ = ["drain_order", "order_drain"]


def drain_order(hub: Hub, session: str, *, draining: bool, reason: str = "") -> bytes:
    """The signed order (§7) as published.

    Raises:
        UsageError: a bad session name or reason (longer than MAX_REASON_CHARS, control
            characters), or a revoked session (it is told by its revocation, §16.7).
        ConfigError: no key to sign with (the hub key, or MAM_DISPATCH_SECRET for v1).
    """
    names.validate_session(session)
    if len(reason) > MAX_REASON_CHARS:
        raise UsageError(f"--reason: at most {MAX_REASON_CHARS} characters, got {len(reason)}")
    root = hub.root
    entry = roster.get(root, session)
    if entry is not None and not entry.active:
        raise UsageError(f"runner {session!r} was revoked at {entry.revoked_at}: it takes nothing from this hub "
                         "already (mam-orch runner add to enrol it again)")
    order = wire.Drain.build(session, draining, reason)
    signed = roster.sign_control_v2(root, session, order)
    return wire.encode(signed or crypto.sign(order.to_dict(), hub.keys().sign_key))


def order_drain(hub: Hub, session: str, *, draining: bool, reason: str = "",
                client: Transport | None = None) -> str:
    """Publish the drain (or undrain) order of `session`, retained.

    Args:
        client: the connection to publish on (the hub service's); None: a connection of its own.
    Returns:
        one line for the operator.
    Raises:
        UsageError, ConfigError: as `drain_order`, before any connection. BrokerError: the
            broker is unreachable or did not acknowledge the order.
    """
    payload = drain_order(hub, session, draining=draining, reason=reason)
    own = hub.connect("drain") if client is None else None
    try:
        publisher = own or client
        assert publisher is not None
        publisher.publish(names.drain_topic(session, publisher.config.topic_root), payload, retain=True)
    finally:
        if own is not None:
            own.close()
    if draining:
        return (f"runner {session} drained: it takes no new job and shows `draining` once it hears; "
                f"its running jobs go on (mam-orch runner undrain {session} takes it back)")
    return f"runner {session} undrained: it takes jobs again once it hears"
