"""`mam-orch runner invite` (PROTOCOL §16, enrolment by invite): make a single-use code,
then wait on the broker until its TTL for the runner's request and answer it.

The waiting process is the only one that answers invites (the hub service does not):
it subscribes to every session's enrolment requests, enrols the runner whose request
carries its code's MAC (`roster.add`, the invite marked used first) and answers with the
hub's public keys under the same MAC; a request naming a used, expired or unknown code
is refused with one line on both sides; one naming another waiting invite is left to
its own process. The code is printed once by the caller and never logged. Where the hub
manages the broker config, the enrolled runner also gets its own broker user
(`runneruser.add_user`), its password sealed to the runner's X25519 key in the answer.
"""

from __future__ import annotations

import queue
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from mam.orchestrator import hub
from mam.orchestrator.identity import roster, runneruser
from mam.orchestrator.identity.roster import RosterEntry
from mam.shared import config
from mam.shared.protocol import names
from mam.shared.protocol.crypto import invite, keys
from mam.shared.protocol.crypto.invite import Invite, InviteCode
from mam.shared.protocol.crypto.keys import EnrolRequest
from mam.shared.protocol.errors import BrokerError, MamError, RegistryError, UsageError
from mam.shared.protocol.wire.canonical import canonical_json
from mam.shared.transport import mqtt

POLL_S = 0.2
"""How long one wait for a message lasts before the TTL is looked at again (s)."""

__all__ = ["hub_publics", "wait_for_enrolment"]


def hub_publics(root: Path) -> list[str]:
    """The hub keys a runner should trust: current (made on first use), then previous if any."""
    current = keys.public_text(keys.hub_key(root))
    previous = keys.hub_previous_public(root)
    return [current] + ([previous] if previous and previous != current else [])


def _say(err: TextIO, line: str) -> None:
    print(line, file=err, flush=True)


def _enrol(root: Path, code: InviteCode, req: dict[str, Any], replace_keys: bool) -> tuple[RosterEntry, str]:
    """Verify a request for our own code and enrol it. Raises `MamError` (one line) when refused."""
    asked = invite.check_request(code, req)
    stored = invite.load(root, code.invite_id)
    problem = invite.problem(stored)
    if problem is not None or stored is None:
        raise UsageError(problem or "invite not found")
    invite.consume(root, stored)  # before the roster: a code never enrols twice
    return roster.add(root, EnrolRequest.build(asked.session, stored.labels, asked.ed25519_public,
                                               asked.x25519_public), replace_keys=replace_keys)


def wait_for_enrolment(root: Path, code: InviteCode, stored: Invite, *, replace_keys: bool = False,
                       on_ready: Callable[[], None] = lambda: None, err: TextIO = sys.stderr) -> int:
    """Answer enrolment requests until `code` has enrolled its runner or its TTL passes.

    Args:
        on_ready: called once subscribed (the caller prints the code then: a runner started
            after that line is heard).
    Returns:
        0 enrolled; 1 the TTL passed unused.
    Raises:
        BrokerUnavailable: the broker is unreachable (exit 3).
    """
    cfg = config.broker_config(workspace=root, warn=False)
    publics = hub_publics(root)
    client = hub.connect(cfg, "invite")
    try:
        client.subscribe([(names.all_enrol_requests_filter(cfg.topic_root), mqtt.QOS_AT_LEAST_ONCE)])
        on_ready()
        while not stored.expired():
            try:
                message = client.messages.get(timeout=POLL_S)
            except queue.Empty:
                continue
            outcome = _handle(root, code, message.payload, publics, replace_keys, client, cfg.topic_root, err)
            if outcome is not None:
                return outcome
        _say(err, f"invite for {code.session} expired at {stored.expires_at} unused; make a new one "
                  "(mam-orch runner invite)")
        return 1
    finally:
        client.close()


def _handle(root: Path, code: InviteCode, raw: bytes, publics: list[str], replace_keys: bool,
            client: Any, topic_root: str, err: TextIO) -> int | None:
    """One request: enrol (returns 0), refuse, or ignore (None: keep waiting). Never raises on bad input."""
    try:
        req = invite.parse_message(raw)
    except UsageError as exc:
        _say(err, f"ignored: {exc}")
        return None
    if req["kind"] != invite.REQUEST_KIND:
        return None
    answer_topic = names.enrol_topic(req["session"], "answer", topic_root)
    if req["invite_id"] != code.invite_id:
        problem = invite.problem(invite.load(root, req["invite_id"]))
        if problem is None:  # another waiting invite's request: its own process answers
            return None
        _say(err, f"refused enrolment request for {req['session']}: {problem}")
        _send(client, answer_topic, invite.refusal(req, problem), err)
        return None
    try:
        entry, what = _enrol(root, code, req, replace_keys)
    except (MamError, RegistryError) as exc:
        _say(err, f"refused enrolment request for {req['session']}: {exc}")
        _send(client, answer_topic, invite.refusal(req, str(exc)), err)
        return None
    added = _broker_user(root, entry.session, err)
    broker = (added.user, added.password) if added is not None else None
    _send(client, answer_topic, invite.answer(code, req, entry.labels, publics, broker), err)
    _say(err, f"{what} runner {entry.session} (labels: {','.join(entry.labels) or 'none'}) by invite, "
              f"in .mam/runners/{entry.session}.json; it now trusts this hub's key"
              + (f" and connects as broker user {added.user}" if added else ""))
    if added is not None and not added.reloaded:
        _say(err, f"reload the broker (above) before runner {entry.session} starts: it cannot connect until then")
    return 0


def _broker_user(root: Path, session: str, err: TextIO) -> runneruser.AddedUser | None:
    """The enrolled runner's own broker user when a managed config took it, else None (it keeps
    the shared user; the lines say what to do). A config error is one line, never a crash."""
    try:
        added = runneruser.add_user(root, session)
    except MamError as exc:
        _say(err, f"no broker user for {session}: {exc}")
        return None
    for line in added.lines:
        _say(err, line)
    return added if added.applied else None


def _send(client: Any, topic: str, obj: dict[str, Any], err: TextIO) -> None:
    """Publish an answer or refusal (canonical JSON, not retained); a broker failure is one line, not a crash
    (a runner that gets no answer says so and can be run again)."""
    try:
        client.publish(topic, canonical_json(obj))
    except BrokerError as exc:
        _say(err, f"answer to {obj['session']} not sent: {exc}")
