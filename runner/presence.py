"""A runner's presence on its session (PROTOCOL §7): signed and retained
`online` / `draining` / `offline`, the Last Will, the refresh, the session
check at start and the `--replace` take-over.

A runner that dies (crash, `kill -9`) has its Last Will (`offline`) published
by the broker at once; a host cut off stays `online` until the broker notices
(keepalive × 1.5), hence `--replace`. The replaced runner, still alive, sees
the new presence, drains and publishes no presence any more (§7).
"""

from __future__ import annotations

import logging
import queue
import socket
import time
from collections.abc import Sequence

from mam.runner.gpus import GpuSlots
from mam.runner.trust import HubTrust
from mam.shared import __version__
from mam.shared.protocol import names, wire
from mam.shared.protocol.codes import PresenceStatus
from mam.shared.protocol.errors import BrokerError, DecodeError, SignatureError, UsageError
from mam.shared.transport import Transport, Will
from mam.shared.transport.mqtt import QOS_AT_LEAST_ONCE

log = logging.getLogger("mam.daemon")
REFUSAL_DETAIL_CHARS = 200  # the refusal line carried in presence, cut to this length

HOST_MAX_CHARS = 255
"""Longest `host` in a presence (§7)."""


class SessionBusy(UsageError):
    """Another live runner holds this session (§7); exit 64 unless `--replace`."""


class Presence:
    """The presence of one runner on its session (§7).

    Args:
        session: the session (§1); runner_id: this runner's id.
        trust: signs every presence and checks our own (`trust.V1Trust`: the shared secret's
            sign key, §5; `V2Trust`: this runner's own Ed25519 key, §16).
        max_jobs: the slot count announced; topic_root: MAM_TOPIC_ROOT.
        labels: the labels announced (§14; none: the field is left out, as a v1 runner's).
        repos: the repository names it serves (§18; none: the field is left out).

    Attributes:
        announced: True once `online` was published (only then may `offline` be).
        published_at: monotonic time of the last presence published (s).
        replaced: another runner took the session over (`--replace`): publish nothing any more.
    """

    def __init__(self, *, session: str, runner_id: str, trust: HubTrust, max_jobs: int,
                 topic_root: str, labels: Sequence[str] = (), repos: Sequence[str] = ()) -> None:
        self.session = session
        self.runner_id = runner_id
        self.trust = trust
        self.max_jobs = max_jobs
        self.labels = tuple(sorted(labels))
        self.repos = tuple(sorted(repos))
        self.topic = names.presence_topic(session, topic_root)
        self.announced = False
        self.published_at = 0.0
        self.replaced = False
        self.status = ""
        self.last_refusal: dict[str, str] | None = None  # §7 last_refusal: the hub can say why
        self.gpus: GpuSlots | None = None  # §14 "GPUs": announced as gpus and gpus_free

    def note_refusal(self, job_id: str, reason: str, detail: str) -> None:
        """Remember the last dispatch refused (§5) so the next presence tells the hub
        (`last_refusal: {job_id, reason, detail}`, signed with the presence, §7)."""
        self.last_refusal = {"job_id": job_id, "reason": reason, "detail": detail[:REFUSAL_DETAIL_CHARS]}

    def payload(self, status: str, running: Sequence[str], *, will: bool = False) -> bytes:
        """The signed presence message (§7) with `running` (job ids, sorted); `will`: it is the
        Last Will (the extra field `will: true`, so the hub tells a lost runner from one stopped)."""
        gpus = (self.gpus.total, self.gpus.free) if self.gpus is not None and self.gpus.total else None
        presence = wire.Presence.build(self.session, self.runner_id, status,
                                       host=(socket.gethostname() or "unknown")[:HOST_MAX_CHARS],
                                       version=__version__, max_jobs=self.max_jobs, running=list(running),
                                       labels=self.labels, repos=self.repos,
                                       gpus=gpus)
        message = presence.to_dict()
        if self.last_refusal is not None:  # an extra field: hubs that do not know it ignore it (§7)
            message["last_refusal"] = self.last_refusal
        if will:
            message["will"] = True
        return wire.encode(self.trust.sign_presence(message))

    def will(self) -> Will:
        """The Last Will: a signed, retained `offline`, pre-signed at connect (§7)."""
        return (self.topic, self.payload(PresenceStatus.OFFLINE, [], will=True), QOS_AT_LEAST_ONCE, True)

    def publish(self, client: Transport, status: str, running: Sequence[str]) -> None:
        """Publish the retained presence `status`; nothing once replaced, nor while disconnected
        (it is republished on reconnect). A broker error is logged, never raised."""
        if self.replaced:
            return
        if not client.connected.is_set():
            # no PUBACK wait while the broker is away: presence is republished on reconnect
            log.info("presence %s not published: not connected", status)
            return
        try:
            client.publish(self.topic, self.payload(status, running), retain=True)
            self.status = status
            self.announced = True
            self.published_at = time.monotonic()
        except BrokerError as exc:
            log.warning("presence %s not published: %s", status, exc)

    def refresh_due(self, refresh_s: float, now: float | None = None) -> bool:
        """True when `online` was announced and the last presence is `refresh_s` old (§7)."""
        now = time.monotonic() if now is None else now
        return self.announced and now - self.published_at >= refresh_s

    def check_session_free(self, client: Transport, *, wait_s: float, replace: bool) -> None:
        """§7 at start: refuse when another live runner id holds the session.

        Subscribes to the session's presence and waits up to `wait_s` seconds for its
        retained message (none: nobody ever announced the session, or it was cleared).

        Raises:
            SessionBusy: another runner is `online`/`draining` there and `replace` is False.
        """
        client.subscribe([(self.topic, QOS_AT_LEAST_ONCE)])
        deadline = time.monotonic() + wait_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            try:
                message = client.messages.get(timeout=remaining)
            except queue.Empty:
                return
            if message.topic != self.topic:
                continue  # nothing else is subscribed yet
            if not message.payload:
                return
            try:
                presence = wire.decode(message.payload, "presence")
                self.trust.verify_own_presence(presence)
            except (DecodeError, SignatureError) as exc:
                log.warning("ignoring the retained presence of session %s: %s", self.session, exc)
                return
            if presence.runner_id == self.runner_id or presence.status == PresenceStatus.OFFLINE:
                return
            if replace:
                log.warning("session %s: replacing runner %s on %s (%s; --replace)", self.session,
                            presence.runner_id, presence.host, presence.status)
                return
            raise SessionBusy(
                f"session {self.session!r} is held by another live runner ({presence.runner_id} on "
                f"{presence.host}, {presence.status} since {presence.timestamp}); stop it first, or start "
                "with --replace if it is gone (a killed runner stays 'online' until the broker notices, "
                "keepalive x 1.5)")

    def on_message(self, payload: bytes, retained: bool) -> bool:
        """A presence on our session: another runner announcing itself live replaced us
        (its `--replace`, §7). Retained copies are re-deliveries, not news.

        Returns:
            True when this message replaced us (drain, and publish no presence, not even
            `offline`, which would hide the new runner).
        """
        if not payload:
            return False
        try:
            presence = wire.decode(payload, "presence")
            self.trust.verify_own_presence(presence)
        except (DecodeError, SignatureError) as exc:
            log.warning("refused presence on session %s: %s", self.session, exc)
            return False
        if presence.runner_id == self.runner_id or presence.status == PresenceStatus.OFFLINE or retained:
            return False
        if not self.replaced:
            log.warning("session %s: another runner %s on %s took over this session (--replace): draining, "
                        "presence left to it", self.session, presence.runner_id, presence.host)
        self.replaced = True
        return True


__all__ = ["Presence", "SessionBusy"]
