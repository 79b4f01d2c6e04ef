"""The hub's roster of enrolled runners (PROTOCOL §16): one 0600 JSON file per
session, `.mam/runners/<session>.json`, holding `session`, `labels`,
`ed25519_public`, `x25519_public`, `enrolled_at` and `revoked_at` (null while
enrolled). Public keys only: no private key ever leaves its host.

`add` enrols (or re-enrols a revoked session with its new keys), `revoke`
stamps `revoked_at` (the hub refuses the session from its next message on),
`get`/`entries` read. A file that cannot be read is a `RegistryError` naming it,
never a crash, and never taken for an enrolment.

The hub's v2 hooks: `check_presence` (presence against the roster),
`build_dispatch_v2` and `sign_control_v2` (v2 for enrolled sessions, None: v1);
`Revocations` (the revoked sessions, re-read when the roster folder changes).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PublicKey

from mam.shared.protocol import crypto, names, wire
from mam.shared.protocol.crypto import DispatchKeys, keys, pubkey
from mam.shared.protocol.crypto.keys import EnrolRequest
from mam.shared.protocol.errors import RegistryError, SignatureError, UsageError
from mam.shared.protocol.wire import format_ts, parse_ts
from mam.shared.store import keyfiles
from mam.shared.store.fsio import atomic_write, json_line, read_json_object, settled_mtime_ns

MAX_ROSTER_FILE_BYTES = 16 * 1024
"""A roster entry is a few hundred bytes; a bigger file is not ours."""
ROSTER_DIR_MODE = 0o700
REVOCATION_STAT_S = 0.1
"""`Revocations` looks at the roster folder's mtime at most this often (s) for the clocks and
the queue: revocation takes effect within it, and a service with a thousand jobs does not stat
the folder per tick of each. A runner's message looks at once (`revoked_at(fresh=True)`)."""
NO_ROSTER = -1  # the roster folder's "mtime" while it does not exist
ENTRY_FIELDS = frozenset({"session", "labels", "ed25519_public", "x25519_public", "enrolled_at", "revoked_at"})

__all__ = ["RevokedPresence", "Revocations", "RosterEntry", "add", "build_dispatch_v2", "check_presence", "entries",
           "get", "revocation_notice", "revoke", "sign_control_v2"]

log = logging.getLogger("mam.roster")
_WARNED_V1: set[str] = set()  # sessions already warned about (once per session and process, §16)


@dataclass(frozen=True)
class RosterEntry:
    """One enrolled runner (§16)."""

    session: str
    labels: tuple[str, ...]
    ed25519_public: str
    x25519_public: str
    enrolled_at: str
    revoked_at: str | None = None

    @property
    def active(self) -> bool:
        """True while not revoked: the hub uses v2 for it and accepts its presence."""
        return self.revoked_at is None

    def ed25519_key(self) -> Ed25519PublicKey:
        """The key its presence is verified with (§16)."""
        return keys.ed25519_public(self.ed25519_public)

    def x25519_key(self) -> X25519PublicKey:
        """The key its dispatches are sealed to (§16)."""
        return keys.x25519_public(self.x25519_public)

    def to_dict(self) -> dict[str, Any]:
        """The file's JSON object."""
        return {"session": self.session, "labels": list(self.labels), "ed25519_public": self.ed25519_public,
                "x25519_public": self.x25519_public, "enrolled_at": self.enrolled_at,
                "revoked_at": self.revoked_at}

    @classmethod
    def from_dict(cls, obj: dict[str, Any]) -> RosterEntry:
        """Check a file's object. Raises `UsageError` naming the bad field."""
        if set(obj) != ENTRY_FIELDS:
            raise UsageError(f"expected exactly the fields {', '.join(sorted(ENTRY_FIELDS))}")
        if not isinstance(obj["labels"], list):
            raise UsageError("labels must be an array")
        request = EnrolRequest.build(obj["session"], obj["labels"], obj["ed25519_public"], obj["x25519_public"])
        for name in ("enrolled_at", "revoked_at"):
            value = obj[name]
            if value is None and name == "revoked_at":
                continue
            try:
                parse_ts(value)
            except ValueError:
                raise UsageError(f"{name} {value!r} is not a UTC timestamp") from None
        return cls(session=request.session, labels=request.labels, ed25519_public=request.ed25519_public,
                   x25519_public=request.x25519_public, enrolled_at=obj["enrolled_at"], revoked_at=obj["revoked_at"])


def _now() -> str:
    return format_ts(datetime.now(UTC))


def _write(root: Path, entry: RosterEntry) -> None:
    folder = names.roster_dir(root)
    try:
        folder.mkdir(mode=ROSTER_DIR_MODE, parents=True, exist_ok=True)
    except OSError as exc:
        raise RegistryError(f"{folder}: cannot create the roster folder ({exc.strerror or exc})") from None
    atomic_write(names.roster_path(root, entry.session), json_line(entry.to_dict()),
                 what=f"roster entry {entry.session}")


def get(root: Path, session: str) -> RosterEntry | None:
    """The roster entry of `session` (revoked or not), or None when it was never enrolled.

    Raises:
        UsageError: a bad session name; RegistryError: the file exists but is unreadable or not an entry.
    """
    path = names.roster_path(root, session)
    try:
        obj = read_json_object(path, MAX_ROSTER_FILE_BYTES)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise RegistryError(f"{path}: cannot read ({type(exc).__name__})") from None
    try:
        entry = RosterEntry.from_dict(obj)
    except UsageError as exc:
        raise RegistryError(f"{path}: not a roster entry: {exc}") from None
    if entry.session != session:
        raise RegistryError(f"{path}: holds session {entry.session!r}, not {session!r}")
    return entry


def entries(root: Path) -> list[RosterEntry]:
    """Every roster entry, by session name.

    Raises:
        RegistryError: an entry file is unreadable (named).
    """
    folder = names.roster_dir(root)
    if not folder.is_dir():
        return []
    found = []
    for path in sorted(folder.glob("*.json")):
        session = path.name[: -len(".json")]
        if names.session_problem(session) is None:
            entry = get(root, session)
            if entry is not None:
                found.append(entry)
    return found


def add(root: Path, request: EnrolRequest, *, replace_keys: bool = False) -> tuple[RosterEntry, str]:
    """Enrol a runner's public keys (§16).

    Adding the same keys again is a no-op; a revoked session may be enrolled again with new keys;
    an enrolled session with other keys needs `replace_keys` (its old keys stop working at once);
    the same keys with other labels update the labels.

    Returns:
        (the entry, what happened: "enrolled", "unchanged", "updated", "replaced" or "re-enrolled").
    Raises:
        UsageError: other keys for an enrolled session without `replace_keys`, or the revoked keys again.
        RegistryError: the roster cannot be read or written.
    """
    current = get(root, request.session)
    same_keys = current is not None and (current.ed25519_public, current.x25519_public) == \
        (request.ed25519_public, request.x25519_public)
    if current is not None and current.active and same_keys and current.labels == request.labels:
        return current, "unchanged"
    if current is not None and not current.active and same_keys:
        raise UsageError(f"runner {request.session!r} was revoked with these keys at {current.revoked_at}; "
                         "make new ones on its host (mam-runner enroll --force) and add those")
    if current is not None and current.active and not same_keys and not replace_keys:
        raise UsageError(f"runner {request.session!r} is enrolled with other keys; use --replace to replace "
                         "them (the old keys stop working at once)")
    entry = RosterEntry(session=request.session, labels=request.labels, ed25519_public=request.ed25519_public,
                        x25519_public=request.x25519_public,
                        enrolled_at=current.enrolled_at if current is not None and same_keys else _now())
    _write(root, entry)
    if current is None:
        return entry, "enrolled"
    return entry, ("re-enrolled" if not current.active else "replaced" if not same_keys else "updated")


def revoke(root: Path, session: str) -> RosterEntry:
    """Revoke an enrolled runner (§16): from the hub's next message on, its presence is refused
    and nothing is dispatched to it. Revoking twice keeps the first `revoked_at`.

    Raises:
        RegistryError: the session is not enrolled, or the roster cannot be written.
    """
    current = get(root, names.validate_session(session))
    if current is None:
        raise RegistryError(f"runner {session!r} is not enrolled (see: mam-orch runner list)")
    if not current.active:
        return current
    entry = replace(current, revoked_at=_now())
    _write(root, entry)
    return entry


# ------------------------------------------------------------ hub hooks (§16)

def _active_or_refuse(root: Path, session: str) -> RosterEntry | None:
    entry = get(root, session)
    if entry is not None and not entry.active:
        raise UsageError(f"runner {session!r} was revoked at {entry.revoked_at}; nothing is dispatched to it "
                         "(mam-orch runner add to enrol it again)")
    return entry


class RevokedPresence(SignatureError):
    """The presence of a revoked runner (§16.7): refused, and known to be, so `runners` shows
    the session as `revoked` rather than as a refusal.

    Attributes:
        session, revoked_at: the roster entry's.
    """

    def __init__(self, message: str, session: str, revoked_at: str) -> None:
        super().__init__(message)
        self.session = session
        self.revoked_at = revoked_at


def check_presence(root: Path, presence: wire.Presence, v1: DispatchKeys | None) -> None:
    """Verify a presence against the roster (§16): an enrolled session's presence must be v2 and
    signed with its enrolled key, a revoked one is refused, and an unenrolled session is v1 (§7).

    Raises:
        SignatureError: one line naming why (logged by the caller and shown by `runners`);
            RevokedPresence for a revoked session.
    """
    session = presence.session
    try:
        entry = get(root, session)
    except RegistryError as exc:
        raise SignatureError(f"presence of {session} refused: {exc}") from None
    if entry is None:
        if presence.sig_alg is not None:
            raise SignatureError(f"presence of {session} is v2 but the session is not enrolled (mam-orch runner add)")
        if v1 is None:
            raise SignatureError(f"presence of {session} is v1 and this hub has no MAM_DISPATCH_SECRET")
        crypto.verify(presence, v1.sign_key)
        return
    if entry.revoked_at is not None:
        raise RevokedPresence(f"presence of {session} refused: runner revoked at {entry.revoked_at}",
                              session, entry.revoked_at)
    if presence.sig_alg is None:
        raise SignatureError(f"presence of {session} is v1 but the session is enrolled: v2 only (§16)")
    try:
        pubkey.verify(presence, [entry.ed25519_key()])
    except SignatureError:
        raise SignatureError(f"presence of {session}: sig does not verify with its enrolled key") from None


def build_dispatch_v2(root: Path, record: Mapping[str, Any], brief: str, *, origin: str,
                      issued_at: datetime | None = None, hub_key: Ed25519PrivateKey | None = None
                      ) -> dict[str, Any] | None:
    """The signed v2 dispatch of the record's attempt when its session is enrolled (§16), else None
    (the caller builds v1 and this logs a warning once per session).

    Hook: `orchestrator/dispatch.py` `build_dispatch` calls this first (after `check_brief`).

    Args:
        record: the hub record (job_id, session, attempt_id, dispatch_token, auth_token, contract fields).
        hub_key: default `keyfiles.hub_key(root)`, read only for an enrolled session.
    Raises:
        UsageError: the session is revoked (nothing is dispatched to it), or a bad record field.
        ConfigError: the hub key cannot be read.
    """
    session = record["session"]
    entry = _active_or_refuse(root, session)
    if entry is None:
        if session not in _WARNED_V1:
            _WARNED_V1.add(session)
            log.warning("session %s is not enrolled: dispatching with v1 (shared secret); enrol it with "
                        "mam-orch runner add (docs/security.md)", session)
        return None
    signer = hub_key if hub_key is not None else keyfiles.hub_key(root)
    return pubkey.build_dispatch(signer, entry.x25519_key(), job_id=record["job_id"], session=session,
                                 attempt_id=record["attempt_id"], dispatch_token=record["dispatch_token"],
                                 auth_token=record["auth_token"], brief=brief, origin=origin,
                                 contract=wire.Contract.of_record(record), issued_at=issued_at,
                                 work=wire.Work.of_record(record))


def sign_control_v2(root: Path, session: str, control: wire.Control | wire.Drain, *,
                    hub_key: Ed25519PrivateKey | None = None) -> dict[str, Any] | None:
    """A cancel (or answer, or drain order, §7) signed v2 when the session is enrolled, revoked
    ones included (a revoked runner's jobs are still cancelled, §16); None: sign it v1.

    Hook: `orchestrator/control.py` `publish_cancel`, before `crypto.sign`.

    Raises:
        ConfigError: the hub key cannot be read.
    """
    try:
        entry = get(root, session)
    except RegistryError as exc:  # a close must not crash the watch: the v1 cancel is logged as the fallback
        log.warning("cancel for session %s signed v1: %s", session, exc)
        return None
    if entry is None:
        return None
    return pubkey.sign(control, hub_key if hub_key is not None else keyfiles.hub_key(root))


def revocation_notice(root: Path, entry: RosterEntry, *, hub_key: Ed25519PrivateKey | None = None) -> bytes:
    """The signed, retained notice that tells a revoked runner so (§16.7): its session, its
    revoked Ed25519 key and when, signed with the hub key.

    Raises:
        UsageError: the entry is not revoked. ConfigError: the hub key cannot be read.
    """
    if entry.revoked_at is None:
        raise UsageError(f"runner {entry.session!r} is not revoked")
    notice = wire.Revocation.build(entry.session, entry.ed25519_public, entry.revoked_at)
    return wire.encode(pubkey.sign(notice, hub_key if hub_key is not None else keyfiles.hub_key(root)))


class Revocations:
    """The revoked sessions of a hub's roster (§16), re-read when the roster folder's mtime
    changes (`add`/`revoke` replace a file in it): a running hub needs no restart.

    Args:
        root: the hub registry's root.
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self._mtime: int | None = None  # of the folder when last read; None: read at the next look
        self._looked_at = float("-inf")
        self._revoked: dict[str, str] = {}

    def revoked_at(self, session: str, *, fresh: bool = False) -> str | None:
        """When `session` was revoked, or None (enrolled, never enrolled, or no roster).

        Args:
            fresh: look at the roster now, not up to REVOCATION_STAT_S ago: for a runner's
                message, which its revocation notice may have caused (§16.7: the roster is
                written before the notice is published).
        """
        if not session:
            return None
        self._refresh(force=fresh)
        return self._revoked.get(session)

    def revoked(self) -> dict[str, str]:
        """Every revoked session and when (ISO 8601)."""
        self._refresh()
        return dict(self._revoked)

    def _refresh(self, *, force: bool = False) -> None:
        """Re-read the roster at most every REVOCATION_STAT_S (unless `force`), and only when its
        folder changed; a folder changed too recently to trust its mtime is read again at the
        next look. A roster that cannot be read keeps what was known."""
        now = time.monotonic()
        if force or now - self._looked_at >= REVOCATION_STAT_S:
            self._looked_at = now
            try:
                stat = names.roster_dir(self.root).stat()
            except OSError:
                mtime: int | None = NO_ROSTER
            else:
                mtime = settled_mtime_ns(stat)
            if mtime is None or mtime != self._mtime:
                try:
                    self._revoked = {entry.session: entry.revoked_at for entry in entries(self.root)
                                     if entry.revoked_at is not None}
                    self._mtime = mtime
                except RegistryError as exc:  # keep what was known; retried at the next look
                    log.warning("roster not re-read: %s", exc)
