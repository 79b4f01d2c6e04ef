"""Telling a revoked runner (PROTOCOL §16.7): `mam-orch runner revoke` publishes the hub's
signed, retained notice on `ROOT/runners/<session>/revoked` and waits a little for the
runner to show it heard (its presence leaves `online`), before its broker user goes.

The notice is retained, so a runner that is offline now hears it at its next start and
exits 77 instead of serving; revoking again publishes it again.
"""

from __future__ import annotations

import queue
import time
from pathlib import Path

from mam.orchestrator.hub import Hub
from mam.orchestrator.identity import roster
from mam.orchestrator.identity.roster import RosterEntry
from mam.shared import config
from mam.shared.protocol import names, wire
from mam.shared.protocol.codes import PresenceStatus
from mam.shared.protocol.crypto import pubkey
from mam.shared.protocol.errors import BrokerError, ConfigError, DecodeError, EnvFileError, SignatureError
from mam.shared.store.registry import Registry
from mam.shared.transport import Transport, TransportFactory, mqtt

HEARD_WAIT_S = 10.0
"""Longest wait for a live runner's presence to leave `online` after the notice (s)."""
RETAINED_QUIET_S = 0.5
"""How long the retained presence may take to arrive after the SUBACK (s)."""

__all__ = ["HEARD_WAIT_S", "tell_revoked"]


def _live(client: Transport, topic: str, entry: RosterEntry, until: float, *, retained: bool) -> str | None:
    """The status of the first presence on `topic` signed by `entry`'s key, retained or live
    as asked, that arrives before `until` (monotonic s); None if none does."""
    while (left := until - time.monotonic()) > 0:
        try:
            message = client.messages.get(timeout=left)
        except queue.Empty:
            return None
        if message.topic != topic or not message.payload or message.retain != retained:
            continue
        try:
            presence = wire.decode(message.payload, "presence")
            pubkey.verify(presence, [entry.ed25519_key()])
        except (DecodeError, SignatureError):
            continue  # not its presence: nothing to learn from it
        return presence.status
    return None


def tell_revoked(root: Path, entry: RosterEntry, *, transport: TransportFactory = mqtt.new_client,
                 heard_wait_s: float = HEARD_WAIT_S) -> list[str]:
    """Publish the revocation notice of `entry` (§16.7) and wait up to `heard_wait_s` for a
    runner that is live now to leave `online`.

    Returns:
        lines for the operator: told and heard, told while offline, or not told and why
        (no broker configured, the broker unreachable). Never raises for the broker: the
        revocation itself is already in the roster.
    Raises:
        ConfigError: the hub key cannot be read.
    """
    again = f"`mam-orch runner revoke {entry.session}` again sends it (keeping {entry.revoked_at})"
    try:
        if not config.load_env(workspace=root).get("MQTT_BROKER"):
            return [f"runner {entry.session} was not told: no broker is configured (MQTT_BROKER); {again}"]
        client = Hub(Registry(root), transport=transport).connect("revoke")
    except (BrokerError, ConfigError, EnvFileError) as exc:
        return [f"runner {entry.session} was not told: {exc}; {again}"]
    try:
        payload = roster.revocation_notice(root, entry)
        presence = names.presence_topic(entry.session, client.config.topic_root)
        client.subscribe([(presence, mqtt.QOS_AT_LEAST_ONCE)])
        before = _live(client, presence, entry, time.monotonic() + RETAINED_QUIET_S, retained=True)
        client.publish(names.revoked_topic(entry.session, client.config.topic_root), payload, retain=True)
        if before not in (PresenceStatus.ONLINE, PresenceStatus.DRAINING):
            return [f"told runner {entry.session} (it is not online: it hears it at its next start and exits)"]
        deadline = time.monotonic() + heard_wait_s
        while (status := _live(client, presence, entry, deadline, retained=False)) is not None:
            if status != PresenceStatus.ONLINE:
                return [f"told runner {entry.session}: it heard and is {status}"]
        return [f"told runner {entry.session}, which did not show it heard within {heard_wait_s:g} s (an older "
                "runner, or cut off); the hub refuses it all the same"]
    except BrokerError as exc:
        return [f"runner {entry.session} was not told: {exc}; {again}"]
    finally:
        client.close()
