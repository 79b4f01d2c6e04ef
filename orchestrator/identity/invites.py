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

import ipaddress
import queue
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, TextIO

from mam.orchestrator import hub
from mam.orchestrator.identity import roster, runneruser
from mam.orchestrator.identity.roster import RosterEntry
from mam.shared import config
from mam.shared.protocol import names
from mam.shared.protocol.crypto import invite, keys
from mam.shared.protocol.crypto.invite import InviteCode
from mam.shared.protocol.crypto.keys import EnrolRequest
from mam.shared.protocol.errors import BrokerError, ConfigError, MamError, RegistryError, UsageError
from mam.shared.protocol.wire.jsoncodec import canonical_json
from mam.shared.store import keyfiles
from mam.shared.store.fsio import atomic_write, json_line, read_json_object
from mam.shared.transport import mqtt

POLL_S = 0.2
"""How long one wait for a message lasts before the TTL is looked at again (s)."""

__all__ = ["Invite", "await_enrol_login", "await_enrol_logout", "broker_hint", "consume", "create",
           "finished_enrol_users", "hub_publics", "is_loopback", "load", "wait_for_enrolment", "why_refused"]


def broker_hint(cfg: config.BrokerConfig, hosts: str | None = None) -> invite.BrokerHint:
    """Where the code tells a fresh runner host the broker is: `cfg` (the hub's `.mam.env`),
    with `hosts` (`--broker-host`, comma-separated) instead of its hosts, and the CA file's
    certificates when TLS is on.

    Raises:
        UsageError: bad hosts; ConfigError: no broker configured, or the CA file cannot be read
            or is too big.
    """
    ca_pem = ""
    if cfg.tls and cfg.ca_certs:
        try:
            ca_pem = Path(cfg.ca_certs).read_text(encoding="ascii")
        except (OSError, UnicodeError) as exc:
            raise ConfigError(f"MQTT_CA_CERTS {cfg.ca_certs}: cannot read it for the invite ({exc})") from None
        if len(ca_pem) > invite.MAX_CA_PEM_CHARS:
            raise ConfigError(f"MQTT_CA_CERTS {cfg.ca_certs}: over {invite.MAX_CA_PEM_CHARS} characters, too big "
                              "for an invite code")
    chosen = tuple(part.strip() for part in hosts.split(",") if part.strip()) if hosts is not None else cfg.hosts
    if hosts is None and not cfg.configured:
        raise ConfigError(config.NO_BROKER)
    try:
        return invite.BrokerHint(chosen, cfg.port, cfg.tls, cfg.topic_root, ca_pem)
    except UsageError as exc:
        raise UsageError(f"--broker-host: {exc}") from None


ENROL_LOGIN_WAIT_S = 10.0
"""Longest wait for the broker to take an invite's one-time user after its reload (s)."""
ENROL_LOGIN_RETRY_S = 0.2


def await_enrol_login(cfg: config.BrokerConfig, code: InviteCode, wait_s: float = ENROL_LOGIN_WAIT_S) -> None:
    """Return once the broker accepts `code`'s one-time user (a reload is applied asynchronously),
    so the printed code works at once.

    Raises:
        BrokerUnavailable: it was not accepted within `wait_s` (the line says why).
    """
    login = cfg.with_overrides(username=code.enrol_username, password=code.enrol_password,
                               client_id_prefix="mam-invite-check")
    deadline = time.monotonic() + wait_s
    while True:
        try:
            with mqtt.MqttClient(login, "invite-check") as client:
                client.connect(timeout_s=max(0.5, min(5.0, deadline - time.monotonic())))
            return
        except BrokerError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(ENROL_LOGIN_RETRY_S)


def await_enrol_logout(cfg: config.BrokerConfig, code: InviteCode, wait_s: float = ENROL_LOGIN_WAIT_S) -> bool:
    """Return once the broker refuses `code`'s one-time user, i.e. it applied the reload that
    removed it (so the command ends after it, not while it is under way); False when it still
    accepts the user after `wait_s` (the caller says so)."""
    login = cfg.with_overrides(username=code.enrol_username, password=code.enrol_password,
                               client_id_prefix="mam-invite-check")
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            with mqtt.MqttClient(login, "invite-check") as client:
                client.connect(timeout_s=max(0.5, min(5.0, deadline - time.monotonic())))
        except BrokerError:
            return True
        time.sleep(ENROL_LOGIN_RETRY_S)
    return False


def finished_enrol_users(root: Path) -> set[str]:
    """The one-time broker users of this hub's invites that were used or expired (to drop)."""
    folder = names.invites_dir(root)
    found = set()
    for path in folder.glob("*.json") if folder.is_dir() else ():
        stored = load(root, path.stem)
        if stored is not None and why_refused(stored) is not None:
            found.add(invite.ENROL_USER_PREFIX + stored.invite_id[:16])
    return found


def is_loopback(host: str) -> bool:
    """True for `localhost` and the loopback addresses (127.0.0.0/8, ::1)."""
    try:
        return host == "localhost" or ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def hub_publics(root: Path) -> list[str]:
    """The hub keys a runner should trust: current (made on first use), then previous if any."""
    current = keys.public_text(keyfiles.hub_key(root))
    previous = keyfiles.hub_previous_public(root)
    return [current] + ([previous] if previous and previous != current else [])


def _say(err: TextIO, line: str) -> None:
    print(line, file=err, flush=True)


def _enrol(root: Path, code: InviteCode, req: dict[str, Any], replace_keys: bool) -> tuple[RosterEntry, str]:
    """Verify a request for our own code and enrol it. Raises `MamError` (one line) when refused."""
    asked = invite.check_request(code, req)
    stored = load(root, code.invite_id)
    problem = why_refused(stored)
    if problem is not None or stored is None:
        raise UsageError(problem or "invite not found")
    consume(root, stored)  # before the roster: a code never enrols twice
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
        problem = why_refused(load(root, req["invite_id"]))
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


# -------------------------------------------------------------- the hub's files

MAX_INVITE_FILE_BYTES = 4096
INVITES_DIR_MODE = 0o700


@dataclass(frozen=True)
class Invite:
    """The hub's file of one invite: no code, only its id."""

    invite_id: str
    session: str
    labels: tuple[str, ...]
    expires_at: str
    used_at: str | None = None

    def expired(self, now: datetime | None = None) -> bool:
        """True once its TTL has passed."""
        return (now or datetime.now(UTC)) >= datetime.fromisoformat(self.expires_at)

    def to_dict(self) -> dict[str, Any]:
        """The file's JSON object."""
        return {"invite_id": self.invite_id, "session": self.session, "labels": list(self.labels),
                "expires_at": self.expires_at, "used_at": self.used_at}


def _now() -> datetime:
    return datetime.now(UTC)


def _write(root: Path, invite: Invite) -> None:
    folder = names.invites_dir(root)
    try:
        folder.mkdir(mode=INVITES_DIR_MODE, parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"{folder}: cannot create the invites folder ({exc.strerror or exc})") from None
    atomic_write(names.invite_path(root, invite.invite_id), json_line(invite.to_dict()),
                 what=f"invite {invite.invite_id}", error=ConfigError)


def create(root: Path, session: str, labels: tuple[str, ...], ttl_s: float) -> tuple[InviteCode, Invite]:
    """A new code for `session` and its stored file (the code itself is not stored).

    Raises:
        UsageError: a bad session; ConfigError: the file cannot be written.
    """
    code = InviteCode.new(session)
    invite = Invite(code.invite_id, code.session, labels, (_now() + timedelta(seconds=ttl_s)).isoformat())
    _write(root, invite)
    return code, invite


def load(root: Path, invite_id: str) -> Invite | None:
    """The stored invite of `invite_id`, or None (never made here, or unreadable: logged by the caller)."""
    try:
        obj = read_json_object(names.invite_path(root, invite_id), MAX_INVITE_FILE_BYTES)
        return Invite(obj["invite_id"], names.validate_session(obj["session"]), keys.labels_of(obj["labels"]),
                      datetime.fromisoformat(obj["expires_at"]).isoformat(), obj.get("used_at"))
    except (OSError, ValueError, KeyError, TypeError, UsageError):
        return None


def why_refused(invite: Invite | None, now: datetime | None = None) -> str | None:
    """Why a request naming this invite is refused, or None when it may be used."""
    if invite is None:
        return "unknown invite code (wrong code, or made by another hub)"
    if invite.used_at is not None:
        return f"invite code already used at {invite.used_at}: codes are single-use"
    if invite.expired(now):
        return f"invite code expired at {invite.expires_at}"
    return None


def consume(root: Path, invite: Invite) -> Invite:
    """Mark the invite used (before the roster is written: a code never enrols twice)."""
    used = Invite(invite.invite_id, invite.session, invite.labels, invite.expires_at, _now().isoformat())
    _write(root, used)
    return used
