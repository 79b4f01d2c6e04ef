"""Wire messages of PROTOCOL §3-§7: frozen dataclasses, canonical JSON, one parser.

`decode(raw, expect)` is the only parser of wire payloads. It refuses, with one
`DecodeError(reason, raw)`, everything §1 and §3-§7 do not allow; the reason
starts with the word of the §3.2 acceptance order (`malformed: ...`,
`schema_mismatch: ...`) and names the offending field, e.g.
``malformed: data.attempt_id must be an integer >= 1, got 0``.

Zero-length payloads clear a retained topic (§2) and callers MUST ignore them
silently *before* calling `decode`; `decode` raises ``empty: zero-length
payload`` for them so that a forgotten check is still not a crash.

Signing, sealing and keys live in `mam.shared.crypto`; this module never sees a
key. The constructors (`Event.build`, `State.build`, `Dispatch.build`,
`Control.cancel`, `Presence.build`) apply the same rules as `decode` and raise
`UsageError` so a publisher cannot put on the wire what a receiver refuses.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
import unicodedata
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from types import MappingProxyType
from typing import Any, Literal, overload

from mam.shared import names
from mam.shared.codes import (
    CONTROL_ACTIONS,
    EVENT_NAMES,
    JOB_STATUSES,
    PRESENCE_STATUSES,
    TERMINAL_EVENTS,
    TERMINAL_STATUSES,
)
from mam.shared.errors import DecodeError, ProtocolError, UsageError

SCHEMA_VERSION = 1

SEAL_ALG = "A256GCM"
SEAL_NONCE_BYTES = 12
GCM_TAG_BYTES = 16

MAX_DETAIL_CHARS = 1024
# Dispatch carries the sealed brief (<= 512 KiB, §5) and must fit NATS's default 1 MiB cap.
MAX_DISPATCH_BYTES = 1024 * 1024
# Events, states, controls and presence are small; 64 KiB leaves room for free metrics.
MAX_MESSAGE_BYTES = 64 * 1024
MAX_PAYLOAD_BYTES: Mapping[str, int] = MappingProxyType({
    "event": MAX_MESSAGE_BYTES,
    "state": MAX_MESSAGE_BYTES,
    "dispatch": MAX_DISPATCH_BYTES,
    "control": MAX_MESSAGE_BYTES,
    "presence": MAX_MESSAGE_BYTES,
})
# Nesting bound of a whole payload (top object = 1, data = 2): free metrics may nest a little.
MAX_DEPTH = 10
# Integers a JSON peer in any language reads exactly (2**53 - 1).
MAX_SAFE_INT = 2**53 - 1
# Contract durations beyond a year are mistakes, and huge ones overflow monotonic-clock arithmetic.
MAX_CONTRACT_SEC = 366 * 24 * 3600
MAX_HEARTBEAT_MISSES = 10_000
MAX_RUNNING = 1024
MAX_NAME_CHARS = 255  # origin, host
MAX_VERSION_CHARS = 64
MAX_REASON_CHARS = 256

EXPECTS = ("event", "state", "dispatch", "control", "presence")
Expect = Literal["event", "state", "dispatch", "control", "presence"]

EVENT_FIELDS = frozenset({"schema_version", "seq", "job_id", "event", "timestamp", "detail", "data"})
STATE_FIELDS = EVENT_FIELDS | {"status", "last_event"}
DISPATCH_FIELDS = frozenset({"schema_version", "kind", "job_id", "session", "attempt_id", "dispatch_token",
                             "origin", "issued_at", "expires_at", "contract", "sealed", "sig"})
CONTRACT_FIELDS = frozenset({"heartbeat_sec", "heartbeat_misses", "ack_timeout_sec", "idle_timeout_sec",
                             "timeout_sec"})
SEALED_FIELDS = frozenset({"alg", "nonce", "ciphertext"})
CONTROL_FIELDS = frozenset({"schema_version", "kind", "action", "job_id", "attempt_id", "reason", "issued_at",
                            "sig"})
PRESENCE_FIELDS = frozenset({"schema_version", "kind", "session", "runner_id", "status", "host", "version",
                             "max_jobs", "running", "timestamp", "sig"})

_HEX64_RE = re.compile(r"[0-9a-f]{64}")
_B64URL_RE = re.compile(r"[A-Za-z0-9_-]*={0,2}")
_TS_RE = re.compile(
    r"([0-9]{4})-([0-9]{2})-([0-9]{2})T([0-9]{2}):([0-9]{2}):([0-9]{2})(?:\.([0-9]{1,9}))?Z")
_TS_FORMAT = "%Y-%m-%dT%H:%M:%SZ"
_SURROGATE_RE = re.compile("[\ud800-\udfff]")


class _Invalid(Exception):
    """Internal: one rule broken; the text is the reason without its `malformed:` word."""


# ------------------------------------------------------------------ helpers

def _show(value: object, limit: int = 40) -> str:
    """A short one-line repr of a wire value (never the whole of a big payload)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _type_name(value: object) -> str:
    if value is None:
        return "null"
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
            list: "an array", dict: "an object"}.get(type(value), type(value).__name__)


def _int(value: object, where: str, low: int = 1, high: int = MAX_SAFE_INT) -> int:
    # bool is an int subclass in Python but never an integer on the wire.
    if isinstance(value, bool) or not isinstance(value, int):
        raise _Invalid(f"{where} must be an integer, got {_type_name(value)} {_show(value)}")
    if value < low or value > high:
        bound = f">= {low}" if high == MAX_SAFE_INT else f"between {low} and {high}"
        raise _Invalid(f"{where} must be an integer {bound}, got {value}")
    return value


def _bad_char(text: str) -> str | None:
    """The first control character (Unicode Cc, lone surrogate, line or paragraph separator) of `text`."""
    for ch in text:
        if unicodedata.category(ch) in ("Cc", "Cs", "Zl", "Zp"):
            return ch
    return None


def _text(value: object, where: str, max_chars: int, *, empty_ok: bool = False) -> str:
    if not isinstance(value, str):
        raise _Invalid(f"{where} must be a string, got {_type_name(value)} {_show(value)}")
    if not value and not empty_ok:
        raise _Invalid(f"{where} must not be empty")
    if len(value) > max_chars:
        raise _Invalid(f"{where} is {len(value)} characters, at most {max_chars} are allowed")
    bad = _bad_char(value)
    if bad is not None:
        raise _Invalid(f"{where} holds control character {bad!r}, which is not allowed")
    return value


def _choice(value: object, where: str, allowed: Iterable[str]) -> str:
    allowed = tuple(allowed)
    if not isinstance(value, str) or value not in allowed:
        raise _Invalid(f"{where} is {_show(value)}, expected one of {', '.join(allowed)}")
    return value


def _job_id(value: object, where: str = "job_id") -> str:
    if not isinstance(value, str) or not names.JOB_ID_RE.fullmatch(value):
        raise _Invalid(f"{where} {_show(value)} is invalid: expected 8 lowercase hex characters")
    return value


def _hex32(value: object, where: str) -> str:
    if not isinstance(value, str) or not names.TOKEN_RE.fullmatch(value):
        raise _Invalid(f"{where} {_show(value)} is invalid: expected 32 lowercase hex characters")
    return value


def _hex64(value: object, where: str) -> str:
    if not isinstance(value, str) or not _HEX64_RE.fullmatch(value):
        raise _Invalid(f"{where} {_show(value)} is invalid: expected 64 lowercase hex characters")
    return value


def _session(value: object, where: str = "session") -> str:
    problem = names.session_problem(value)
    # fullmatch as well: a `$` anchor alone lets a trailing newline through.
    if problem is None and not names.SESSION_RE.fullmatch(value):  # type: ignore[arg-type]
        problem = "a line break is not allowed"
    if problem is not None:
        raise _Invalid(f"{where} {_show(value)} is invalid: {problem}")
    return value  # type: ignore[return-value]


def _timestamp(value: object, where: str) -> str:
    if not isinstance(value, str):
        raise _Invalid(f"{where} must be a string, got {_type_name(value)} {_show(value)}")
    try:
        parse_ts(value)
    except ValueError:
        raise _Invalid(f"{where} {_show(value)} is invalid: expected UTC YYYY-MM-DDTHH:MM:SSZ") from None
    return value


def b64url_decode(value: str) -> bytes:
    """Decode base64url text with or without `=` padding (§5).

    Args:
        value: base64url text (alphabet `A-Z a-z 0-9 - _`, optional padding).
    Returns:
        the decoded bytes.
    Raises:
        ValueError: not base64url.
    """
    if not isinstance(value, str) or not _B64URL_RE.fullmatch(value):
        raise ValueError("not base64url text")
    bare = value.rstrip("=")
    if len(bare) % 4 == 1:
        raise ValueError("base64url text has an impossible length")
    try:
        return base64.urlsafe_b64decode(bare + "=" * (-len(bare) % 4))
    except (binascii.Error, ValueError):
        raise ValueError("not base64url text") from None


def b64url_encode(data: bytes) -> str:
    """`base64.urlsafe_b64encode` with padding kept, as text (§5)."""
    return base64.urlsafe_b64encode(data).decode("ascii")


def _b64(value: object, where: str, *, exact: int | None = None, minimum: int = 0) -> str:
    if not isinstance(value, str):
        raise _Invalid(f"{where} must be a string, got {_type_name(value)} {_show(value)}")
    try:
        data = b64url_decode(value)
    except ValueError as exc:
        raise _Invalid(f"{where} is invalid: {exc}") from None
    if exact is not None and len(data) != exact:
        raise _Invalid(f"{where} decodes to {len(data)} bytes, expected {exact}")
    if len(data) < minimum:
        raise _Invalid(f"{where} decodes to {len(data)} bytes, expected at least {minimum}")
    return value


def _fields(obj: Mapping[str, Any], expected: frozenset[str], prefix: str = "") -> None:
    missing = sorted(expected - obj.keys())
    if missing:
        raise _Invalid(f"missing field {', '.join(repr(prefix + m) for m in missing)}")
    unknown = sorted(str(u) for u in obj.keys() - expected)
    if unknown:
        more = f" and {len(unknown) - 3} more" if len(unknown) > 3 else ""
        raise _Invalid(f"unknown field {', '.join(_show(prefix + u) for u in unknown[:3])}{more}")


def _freeze(value: Any) -> Any:
    """Deep read-only copy: dicts become mappingproxies, lists become tuples."""
    if isinstance(value, Mapping):
        return MappingProxyType({k: _freeze(v) for k, v in value.items()})
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    return value


def _thaw(value: Any) -> Any:
    """Deep mutable copy of a frozen value: mappings become dicts, tuples become lists."""
    if isinstance(value, Mapping):
        return {k: _thaw(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_thaw(v) for v in value]
    return value


def _depth_problem(obj: Any, limit: int = MAX_DEPTH, path: str = "") -> str | None:
    """Iteratively check nesting depth (no recursion on hostile input); names the deepest field."""
    stack: list[tuple[Any, int, str]] = [(obj, 1, path)]
    while stack:
        value, depth, where = stack.pop()
        if isinstance(value, Mapping):
            children: Iterable[tuple[str, Any]] = (
                (f"{where}.{key}" if where else str(key), child) for key, child in value.items())
        elif isinstance(value, (list, tuple)):
            children = ((f"{where}[{index}]", child) for index, child in enumerate(value))
        else:
            continue
        if depth > limit:
            return f"{_show(where or 'payload', 60)} nests deeper than {limit} levels"
        stack.extend((child, depth + 1, child_path) for child_path, child in children)
    return None


def _surrogate_path(value: Any, path: str = "") -> str | None:
    """Where a lone surrogate (not encodable as UTF-8) sits, as a field path."""
    if isinstance(value, str):
        return (path or "payload") if _SURROGATE_RE.search(value) else None
    if isinstance(value, Mapping):
        for key, child in value.items():
            where = f"{path}.{key}" if path else str(key)
            if isinstance(key, str) and _SURROGATE_RE.search(key):
                return f"a key of {path or 'the payload'}"
            found = _surrogate_path(child, where)
            if found:
                return found
    if isinstance(value, (list, tuple)):
        for index, child in enumerate(value):
            found = _surrogate_path(child, f"{path}[{index}]")
            if found:
                return found
    return None


def _data(value: object, *, require: Iterable[str]) -> Mapping[str, Any]:
    """Check an event's or state's `data` object and its reserved keys (§3, §4)."""
    if not isinstance(value, Mapping):
        raise _Invalid(f"data must be an object, got {_type_name(value)} {_show(value)}")
    for key in require:
        if key not in value:
            raise _Invalid(f"missing field 'data.{key}'")
    for key in value:
        if not isinstance(key, str):
            raise _Invalid(f"data keys must be strings, got {_show(key)}")
    if "attempt_id" in value:
        _int(value["attempt_id"], "data.attempt_id")
    if "dispatch_token" in value:
        _hex32(value["dispatch_token"], "data.dispatch_token")
    if "session" in value:
        _session(value["session"], "data.session")
    if "hmac_sig" in value:
        _hex64(value["hmac_sig"], "data.hmac_sig")
    if "exit_code" in value:
        _int(value["exit_code"], "data.exit_code", -(2**31), 2**31 - 1)
    if "heartbeat" in value and not isinstance(value["heartbeat"], bool):
        raise _Invalid(f"data.heartbeat must be a boolean, got {_type_name(value['heartbeat'])} "
                       f"{_show(value['heartbeat'])}")
    problem = _depth_problem(value, MAX_DEPTH - 1, "data")
    if problem:
        raise _Invalid(problem)
    where = _surrogate_path(value, "data")
    if where:
        raise _Invalid(f"{where} holds a lone surrogate, which is not UTF-8")
    return value


def _to_utc(dt: datetime) -> datetime:
    if dt.tzinfo is None or dt.utcoffset() is None:
        raise ValueError("naive datetime: pass an aware one, e.g. datetime.now(timezone.utc)")
    return dt.astimezone(UTC)


# --------------------------------------------------------------- timestamps

def format_ts(dt: datetime | None = None) -> str:
    """A §3 timestamp: UTC, `YYYY-MM-DDTHH:MM:SSZ`, fraction dropped.

    Args:
        dt: an aware datetime; None means now.
    Returns:
        e.g. "2026-06-20T14:48:58Z".
    Raises:
        ValueError: `dt` is naive (its zone would be a guess).
    """
    moment = datetime.now(UTC) if dt is None else _to_utc(dt)
    return moment.strftime(_TS_FORMAT)


def parse_ts(text: str) -> datetime:
    """Parse a §3 timestamp (`YYYY-MM-DDTHH:MM:SS[.fraction]Z`) into an aware UTC datetime.

    Args:
        text: the timestamp; a fraction of 1-9 digits is accepted (truncated to microseconds).
    Returns:
        an aware datetime in UTC.
    Raises:
        ValueError: any other form, or an impossible date or time.
    """
    match = _TS_RE.fullmatch(text) if isinstance(text, str) else None
    if match is None:
        raise ValueError(f"timestamp {_show(text)} is not YYYY-MM-DDTHH:MM:SS[.fraction]Z")
    year, month, day, hour, minute, second, fraction = match.groups()
    micro = int((fraction or "0")[:6].ljust(6, "0"))
    return datetime(int(year), int(month), int(day), int(hour), int(minute), int(second), micro,
                    tzinfo=UTC)


# ----------------------------------------------------------- canonical form

def _json_default(value: Any) -> Any:
    # Frozen message parts (mappingproxy) serialize as the dicts they wrap.
    if isinstance(value, Mapping):
        return dict(value)
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def canonical(obj: Any) -> bytes:
    """The canonical bytes of §3.1, over which every HMAC and signature is computed.

    `json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")`.

    Args:
        obj: a JSON-able value, or a wire message (its `to_dict()` is used).
    Returns:
        UTF-8 bytes.
    Raises:
        ValueError: NaN or infinity inside (not JSON); UnicodeEncodeError: a lone surrogate.
    """
    if isinstance(obj, _MESSAGE_TYPES):
        obj = obj.to_dict()
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=False, default=_json_default).encode("utf-8")


# ------------------------------------------------------------------ messages

class _EventShaped:
    """What Event (§3) and State (§4) share: a deep read-only `data` holding the
    attempt identity and the HMAC, and the field rules run at construction."""

    data: Mapping[str, Any]

    def __post_init__(self) -> None:
        object.__setattr__(self, "data", _freeze(self.data) if isinstance(self.data, Mapping) else self.data)
        _run(self._check)  # type: ignore[attr-defined]

    attempt_id = property(lambda self: self.data["attempt_id"], doc="data.attempt_id")
    dispatch_token = property(lambda self: self.data["dispatch_token"], doc="data.dispatch_token")
    hmac_sig = property(lambda self: self.data.get("hmac_sig"), doc="data.hmac_sig or None (unsigned)")


@dataclass(frozen=True)
class Event(_EventShaped):
    """An event of §3. Build with `Event.build`, parse with `decode(raw, "event")`.

    `data` is a deep read-only mapping; `to_dict()` returns a fresh mutable copy.
    Constructing one directly applies the §3 field rules and raises `DecodeError`.
    """

    job_id: str
    seq: int
    event: str
    timestamp: str
    detail: str
    data: Mapping[str, Any]
    schema_version: int = SCHEMA_VERSION

    def _check(self) -> None:
        _schema(self.schema_version)
        _int(self.seq, "seq")
        _job_id(self.job_id)
        _choice(self.event, "event", EVENT_NAMES)
        _timestamp(self.timestamp, "timestamp")
        _text(self.detail, "detail", MAX_DETAIL_CHARS, empty_ok=True)
        _data(self.data, require=("attempt_id", "dispatch_token"))

    @classmethod
    def build(cls, job_id: str, seq: int, event: str, detail: str = "", *, attempt_id: int,
              dispatch_token: str, session: str | None = None, data: Mapping[str, Any] | None = None,
              timestamp: datetime | str | None = None) -> Event:
        """An unsigned event (sign with `crypto.sign_event`), §3.

        Args:
            job_id: 8 hex; seq: >= 1, per attempt; event: one of EVENT_NAMES;
            detail: <= 1024 characters, no control characters, no paths or secrets;
            attempt_id, dispatch_token, session: the attempt identity put into `data`;
            data: free metrics and reserved keys (`exit_code`, `heartbeat`);
            timestamp: aware datetime or §3 text; None means now.
        Raises:
            UsageError: a field breaks §3 (the message names it).
        """
        payload = dict(data or {})
        payload.update(attempt_id=attempt_id, dispatch_token=dispatch_token)
        if session is not None:
            payload["session"] = session
        return _build(cls, job_id=job_id, seq=seq, event=event, detail=detail, data=payload,
                      timestamp=_ts_arg(timestamp))

    @classmethod
    def from_dict(cls, obj: Mapping[str, Any]) -> Event:
        """Apply the §3 rules to a parsed payload; raises `DecodeError` (no raw attached)."""
        return from_dict(obj, "event")  # type: ignore[return-value]

    def to_dict(self) -> dict[str, Any]:
        """The wire object (fresh, mutable)."""
        return {"schema_version": self.schema_version, "seq": self.seq, "job_id": self.job_id,
                "event": self.event, "timestamp": self.timestamp, "detail": self.detail,
                "data": _thaw(self.data)}

    session = property(lambda self: self.data.get("session"), doc="data.session or None")
    exit_code = property(lambda self: self.data.get("exit_code"), doc="data.exit_code or None")
    heartbeat = property(lambda self: self.data.get("heartbeat") is True, doc="True on a timer beat")
    terminal = property(lambda self: self.event in TERMINAL_EVENTS, doc="completed or error (§3)")


@dataclass(frozen=True)
class State(_EventShaped):
    """A retained state snapshot of §4: an event-shaped message with `event == "state"`."""

    job_id: str
    seq: int
    status: str
    last_event: str
    timestamp: str
    detail: str
    data: Mapping[str, Any]
    event: str = "state"
    schema_version: int = SCHEMA_VERSION

    def _check(self) -> None:
        _schema(self.schema_version)
        _int(self.seq, "seq")
        _job_id(self.job_id)
        _choice(self.event, "event", ("state",))
        _choice(self.status, "status", JOB_STATUSES)
        _choice(self.last_event, "last_event", EVENT_NAMES)
        _timestamp(self.timestamp, "timestamp")
        _text(self.detail, "detail", MAX_DETAIL_CHARS, empty_ok=True)
        _data(self.data, require=("attempt_id", "dispatch_token"))

    @classmethod
    def build(cls, job_id: str, seq: int, status: str, last_event: str, *, attempt_id: int,
              dispatch_token: str, detail: str = "", data: Mapping[str, Any] | None = None,
              timestamp: datetime | str | None = None) -> State:
        """An unsigned state (sign with `crypto.sign_event`), §4.

        Args:
            seq: the seq of the event it follows; status: one of JOB_STATUSES;
            last_event: one of EVENT_NAMES; the rest as `Event.build`.
        Raises:
            UsageError: a field breaks §4.
        """
        payload = dict(data or {})
        payload.update(attempt_id=attempt_id, dispatch_token=dispatch_token)
        return _build(cls, job_id=job_id, seq=seq, status=status, last_event=last_event, detail=detail,
                      data=payload, timestamp=_ts_arg(timestamp))

    @classmethod
    def from_dict(cls, obj: Mapping[str, Any]) -> State:
        """Apply the §4 rules to a parsed payload; raises `DecodeError`."""
        return from_dict(obj, "state")  # type: ignore[return-value]

    def to_dict(self) -> dict[str, Any]:
        """The wire object (fresh, mutable)."""
        return {"schema_version": self.schema_version, "seq": self.seq, "job_id": self.job_id,
                "event": self.event, "status": self.status, "last_event": self.last_event,
                "timestamp": self.timestamp, "detail": self.detail, "data": _thaw(self.data)}

    terminal = property(lambda self: self.status in TERMINAL_STATUSES, doc="status completed/error/cancelled")


@dataclass(frozen=True)
class Contract:
    """The liveness contract of a dispatch (§5); all values are positive integers.

    `idle_timeout_sec` defaults to `heartbeat_misses * heartbeat_sec`.
    """

    heartbeat_sec: int = 30
    heartbeat_misses: int = 4
    ack_timeout_sec: int = 180
    idle_timeout_sec: int | None = None
    timeout_sec: int = 7200

    def __post_init__(self) -> None:
        if self.idle_timeout_sec is None and _is_int(self.heartbeat_sec) and _is_int(self.heartbeat_misses):
            object.__setattr__(self, "idle_timeout_sec", self.heartbeat_sec * self.heartbeat_misses)
        _run(self._check)

    def _check(self) -> None:
        _int(self.heartbeat_sec, "contract.heartbeat_sec", 1, MAX_CONTRACT_SEC)
        _int(self.heartbeat_misses, "contract.heartbeat_misses", 1, MAX_HEARTBEAT_MISSES)
        _int(self.ack_timeout_sec, "contract.ack_timeout_sec", 1, MAX_CONTRACT_SEC)
        _int(self.idle_timeout_sec, "contract.idle_timeout_sec", 1, MAX_CONTRACT_SEC)
        _int(self.timeout_sec, "contract.timeout_sec", 1, MAX_CONTRACT_SEC)

    @classmethod
    def build(cls, **values: Any) -> Contract:
        """A contract from local input (CLI options, environment, a record's fields);
        None values take the defaults. Raises `UsageError` naming the field."""
        return _build(cls, **{key: value for key, value in values.items() if value is not None})

    @classmethod
    def of_record(cls, record: Mapping[str, Any]) -> Contract:
        """The contract stored in a registry record (its five §8 fields; other keys ignored).

        Raises:
            UsageError: a field breaks §5.
        """
        return cls.build(**{key: record.get(key) for key in CONTRACT_FIELDS})

    @classmethod
    def from_dict(cls, obj: Mapping[str, Any]) -> Contract:
        """Apply the §5 contract rules (exactly the five fields); raises `DecodeError`."""
        return _run(lambda: _contract_from(obj))

    @property
    def idle_timeout_s(self) -> int:
        """The idle timeout in seconds: explicit, else K × N (§5)."""
        return self.idle_timeout_sec  # type: ignore[return-value]  # resolved in __post_init__

    def to_dict(self) -> dict[str, int]:
        """The wire object."""
        return {"heartbeat_sec": self.heartbeat_sec, "heartbeat_misses": self.heartbeat_misses,
                "ack_timeout_sec": self.ack_timeout_sec, "idle_timeout_sec": self.idle_timeout_sec,  # type: ignore[dict-item]
                "timeout_sec": self.timeout_sec}


@dataclass(frozen=True)
class Sealed:
    """The sealed part of a dispatch (§5): AES-256-GCM, base64url nonce and ciphertext+tag."""

    nonce: str
    ciphertext: str
    alg: str = SEAL_ALG

    def __post_init__(self) -> None:
        _run(self._check)

    def _check(self) -> None:
        _choice(self.alg, "sealed.alg", (SEAL_ALG,))
        _b64(self.nonce, "sealed.nonce", exact=SEAL_NONCE_BYTES)
        _b64(self.ciphertext, "sealed.ciphertext", minimum=GCM_TAG_BYTES)

    @classmethod
    def from_dict(cls, obj: Mapping[str, Any]) -> Sealed:
        """Apply the §5 sealed rules (exactly alg, nonce, ciphertext); raises `DecodeError`."""
        return _run(lambda: _sealed_from(obj))

    def to_dict(self) -> dict[str, str]:
        """The wire object."""
        return {"alg": self.alg, "nonce": self.nonce, "ciphertext": self.ciphertext}


@dataclass(frozen=True)
class Dispatch:
    """A dispatch of §5. `sig` is None until signed by `crypto.sign`; `decode` requires it."""

    job_id: str
    session: str
    attempt_id: int
    dispatch_token: str
    origin: str
    issued_at: str
    expires_at: str
    contract: Contract
    sealed: Sealed
    sig: str | None = None
    kind: str = "dispatch"
    schema_version: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        _run(self._check)

    def _check(self) -> None:
        _schema(self.schema_version)
        _choice(self.kind, "kind", ("dispatch",))
        _job_id(self.job_id)
        _session(self.session)
        _int(self.attempt_id, "attempt_id")
        _hex32(self.dispatch_token, "dispatch_token")
        _text(self.origin, "origin", MAX_NAME_CHARS)
        _timestamp(self.issued_at, "issued_at")
        _timestamp(self.expires_at, "expires_at")
        if parse_ts(self.expires_at) < parse_ts(self.issued_at):
            raise _Invalid(f"expires_at {self.expires_at} is before issued_at {self.issued_at}")
        if not isinstance(self.contract, Contract):
            raise _Invalid(f"contract must be an object, got {_type_name(self.contract)}")
        if not isinstance(self.sealed, Sealed):
            raise _Invalid(f"sealed must be an object, got {_type_name(self.sealed)}")
        if self.sig is not None:
            _hex64(self.sig, "sig")

    @classmethod
    def build(cls, job_id: str, session: str, attempt_id: int, dispatch_token: str, *, origin: str,
              contract: Contract, sealed: Sealed | Mapping[str, Any],
              issued_at: datetime | None = None) -> Dispatch:
        """An unsigned dispatch (sign with `crypto.sign`), §5.

        Args:
            session: the bare runner name (no `remote:`); origin: the hub's name;
            contract: the liveness contract; sealed: `crypto.seal(...)` output;
            issued_at: aware datetime, None means now. `expires_at` is
            `issued_at + contract.ack_timeout_sec`.
        Raises:
            UsageError: a field breaks §5.
        """
        issued = datetime.now(UTC) if issued_at is None else _to_utc(issued_at)
        issued = issued.replace(microsecond=0)
        try:
            expires = issued + timedelta(seconds=contract.ack_timeout_sec) if isinstance(contract, Contract) \
                else issued
            seal_obj = sealed if isinstance(sealed, Sealed) else Sealed.from_dict(sealed)
        except DecodeError as exc:
            raise UsageError(f"dispatch not built: {_strip(exc.reason)}") from None
        return _build(cls, job_id=job_id, session=session, attempt_id=attempt_id,
                      dispatch_token=dispatch_token, origin=origin, issued_at=format_ts(issued),
                      expires_at=format_ts(expires), contract=contract, sealed=seal_obj)

    @classmethod
    def from_dict(cls, obj: Mapping[str, Any]) -> Dispatch:
        """Apply the §5 rules to a parsed payload (sig required); raises `DecodeError`."""
        return from_dict(obj, "dispatch")  # type: ignore[return-value]

    def to_dict(self) -> dict[str, Any]:
        """The wire object; without `sig` while unsigned."""
        out: dict[str, Any] = {
            "schema_version": self.schema_version, "kind": self.kind, "job_id": self.job_id,
            "session": self.session, "attempt_id": self.attempt_id, "dispatch_token": self.dispatch_token,
            "origin": self.origin, "issued_at": self.issued_at, "expires_at": self.expires_at,
            "contract": self.contract.to_dict(), "sealed": self.sealed.to_dict()}
        if self.sig is not None:
            out["sig"] = self.sig
        return out

    def expired(self, now: datetime | None = None, skew_s: float = 30.0) -> bool:
        """True if `expires_at` is more than `skew_s` seconds before `now` (§5: refuse it).

        Args:
            now: aware datetime, None means now; skew_s: MAM_CLOCK_SKEW_S, seconds.
        """
        moment = datetime.now(UTC) if now is None else _to_utc(now)
        return parse_ts(self.expires_at) + timedelta(seconds=skew_s) < moment


@dataclass(frozen=True)
class Control:
    """A cancel of §6. `sig` is None until signed by `crypto.sign`; `decode` requires it."""

    job_id: str
    attempt_id: int
    reason: str
    issued_at: str
    action: str = "cancel"
    sig: str | None = None
    kind: str = "control"
    schema_version: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        _run(self._check)

    def _check(self) -> None:
        _schema(self.schema_version)
        _choice(self.kind, "kind", ("control",))
        _choice(self.action, "action", CONTROL_ACTIONS)
        _job_id(self.job_id)
        _int(self.attempt_id, "attempt_id")
        _text(self.reason, "reason", MAX_REASON_CHARS)
        _timestamp(self.issued_at, "issued_at")
        if self.sig is not None:
            _hex64(self.sig, "sig")

    @classmethod
    def cancel(cls, job_id: str, attempt_id: int, reason: str, *,
               issued_at: datetime | str | None = None) -> Control:
        """An unsigned cancel (sign with `crypto.sign`), §6.

        Args:
            reason: short word such as `operator`, `deadline_timeout`, `agent_blocked` (<= 256 chars).
        Raises:
            UsageError: a field breaks §6.
        """
        return _build(cls, job_id=job_id, attempt_id=attempt_id, reason=reason, issued_at=_ts_arg(issued_at))

    @classmethod
    def from_dict(cls, obj: Mapping[str, Any]) -> Control:
        """Apply the §6 rules to a parsed payload (sig required); raises `DecodeError`."""
        return from_dict(obj, "control")  # type: ignore[return-value]

    def to_dict(self) -> dict[str, Any]:
        """The wire object; without `sig` while unsigned."""
        out: dict[str, Any] = {"schema_version": self.schema_version, "kind": self.kind, "action": self.action,
                               "job_id": self.job_id, "attempt_id": self.attempt_id, "reason": self.reason,
                               "issued_at": self.issued_at}
        if self.sig is not None:
            out["sig"] = self.sig
        return out


@dataclass(frozen=True)
class Presence:
    """A runner presence of §7. `running` is a tuple of job ids; `sig` None until signed."""

    session: str
    runner_id: str
    status: str
    host: str
    version: str
    max_jobs: int
    running: tuple[str, ...]
    timestamp: str
    sig: str | None = None
    kind: str = "presence"
    schema_version: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        if isinstance(self.running, list):
            object.__setattr__(self, "running", tuple(self.running))
        _run(self._check)

    def _check(self) -> None:
        _schema(self.schema_version)
        _choice(self.kind, "kind", ("presence",))
        _session(self.session)
        _hex32(self.runner_id, "runner_id")
        _choice(self.status, "status", PRESENCE_STATUSES)
        _text(self.host, "host", MAX_NAME_CHARS)
        _text(self.version, "version", MAX_VERSION_CHARS)
        _int(self.max_jobs, "max_jobs", 1, MAX_RUNNING)
        if not isinstance(self.running, tuple):
            raise _Invalid(f"running must be an array, got {_type_name(self.running)} {_show(self.running)}")
        if len(self.running) > MAX_RUNNING:
            raise _Invalid(f"running has {len(self.running)} entries, at most {MAX_RUNNING} are allowed")
        for index, job_id in enumerate(self.running):
            _job_id(job_id, f"running[{index}]")
        if len(set(self.running)) != len(self.running):
            raise _Invalid("running lists a job id twice")
        _timestamp(self.timestamp, "timestamp")
        if self.sig is not None:
            _hex64(self.sig, "sig")

    @classmethod
    def build(cls, session: str, runner_id: str, status: str, *, host: str, version: str, max_jobs: int,
              running: Iterable[str] = (), timestamp: datetime | str | None = None) -> Presence:
        """An unsigned presence (sign with `crypto.sign`), §7.

        Args:
            status: online, draining or offline; running: job ids in progress.
        Raises:
            UsageError: a field breaks §7.
        """
        return _build(cls, session=session, runner_id=runner_id, status=status, host=host, version=version,
                      max_jobs=max_jobs, running=tuple(running), timestamp=_ts_arg(timestamp))

    @classmethod
    def from_dict(cls, obj: Mapping[str, Any]) -> Presence:
        """Apply the §7 rules to a parsed payload (sig required); raises `DecodeError`."""
        return from_dict(obj, "presence")  # type: ignore[return-value]

    def to_dict(self) -> dict[str, Any]:
        """The wire object; without `sig` while unsigned."""
        out: dict[str, Any] = {"schema_version": self.schema_version, "kind": self.kind, "session": self.session,
                               "runner_id": self.runner_id, "status": self.status, "host": self.host,
                               "version": self.version, "max_jobs": self.max_jobs,
                               "running": list(self.running), "timestamp": self.timestamp}
        if self.sig is not None:
            out["sig"] = self.sig
        return out


Message = Event | State | Dispatch | Control | Presence
_MESSAGE_TYPES = (Event, State, Dispatch, Control, Presence, Contract, Sealed)


# ------------------------------------------------------- construction glue

def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _schema(value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _Invalid(f"schema_version must be an integer, got {_type_name(value)} {_show(value)}")
    if value != SCHEMA_VERSION:
        raise _SchemaMismatch(f"schema_version is {value}, expected {SCHEMA_VERSION}")


class _SchemaMismatch(_Invalid):
    """Internal: §3.2 step 2."""


def _run(check: Any) -> Any:
    """Run a rule check; turn the internal failure into the public `DecodeError` (raw attached later)."""
    try:
        return check()
    except _SchemaMismatch as exc:
        raise DecodeError(f"schema_mismatch: {exc}") from None
    except _Invalid as exc:
        raise DecodeError(f"malformed: {exc}") from None


def _strip(reason: str) -> str:
    return reason.split(": ", 1)[1] if ": " in reason else reason


def _build(cls: Any, **kwargs: Any) -> Any:
    """Construct for a publisher: rule failures become a one-line `UsageError`."""
    try:
        return cls(**kwargs)
    except DecodeError as exc:
        raise UsageError(f"{cls.__name__.lower()} not built: {_strip(exc.reason)}") from None


def _ts_arg(value: datetime | str | None) -> str:
    if isinstance(value, str):
        return value
    return format_ts(value)


def _event_from(obj: Mapping[str, Any]) -> Event:
    _fields(obj, EVENT_FIELDS)
    return Event(**obj)


def _state_from(obj: Mapping[str, Any]) -> State:
    _fields(obj, STATE_FIELDS)
    return State(**obj)


def _contract_from(obj: object) -> Contract:
    if not isinstance(obj, Mapping):
        raise _Invalid(f"contract must be an object, got {_type_name(obj)} {_show(obj)}")
    _fields(obj, CONTRACT_FIELDS, "contract.")
    if obj["idle_timeout_sec"] is None:  # the default applies to builders, never to the wire
        raise _Invalid("contract.idle_timeout_sec must be an integer, got null")
    return _run_inner(lambda: Contract(**obj))


def _sealed_from(obj: object) -> Sealed:
    if not isinstance(obj, Mapping):
        raise _Invalid(f"sealed must be an object, got {_type_name(obj)} {_show(obj)}")
    _fields(obj, SEALED_FIELDS, "sealed.")
    return _run_inner(lambda: Sealed(**obj))


def _run_inner(make: Any) -> Any:
    """Construct a nested part inside an outer check: keep one error path (`_Invalid`)."""
    try:
        return make()
    except DecodeError as exc:
        raise _Invalid(_strip(exc.reason)) from None


def _dispatch_from(obj: Mapping[str, Any]) -> Dispatch:
    _fields(obj, DISPATCH_FIELDS)
    if obj["sig"] is None:
        raise _Invalid("sig must be a string, got null")
    values = dict(obj)
    values["contract"] = _contract_from(obj["contract"])
    values["sealed"] = _sealed_from(obj["sealed"])
    return _run_inner(lambda: Dispatch(**values))


def _control_from(obj: Mapping[str, Any]) -> Control:
    _fields(obj, CONTROL_FIELDS)
    if obj["sig"] is None:
        raise _Invalid("sig must be a string, got null")
    return Control(**obj)


def _presence_from(obj: Mapping[str, Any]) -> Presence:
    _fields(obj, PRESENCE_FIELDS)
    if obj["sig"] is None:
        raise _Invalid("sig must be a string, got null")
    if not isinstance(obj["running"], list):
        raise _Invalid(f"running must be an array, got {_type_name(obj['running'])} {_show(obj['running'])}")
    return Presence(**obj)


_FROM = {"event": _event_from, "state": _state_from, "dispatch": _dispatch_from,
         "control": _control_from, "presence": _presence_from}


# ----------------------------------------------------------------- parsing

class _DuplicateKey(Exception):
    pass


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # A duplicated key would let two implementations read two different signed messages.
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def _reject_constant(name: str) -> Any:
    raise _Invalid(f"payload holds {name}, which is not JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise _Invalid(f"payload holds number {_show(text)}, too large for a float")
    return value


def _parse(raw: bytes | str, expect: str) -> Any:
    if isinstance(raw, (bytearray, memoryview)):
        raw = bytes(raw)
    if not isinstance(raw, (bytes, str)):
        raise TypeError(f"decode() takes bytes or str, not {type(raw).__name__}")
    if len(raw) == 0:
        raise DecodeError("empty: zero-length payload", raw)
    cap = MAX_PAYLOAD_BYTES[expect]
    if len(raw) > cap:  # chars <= bytes, so this is safe for str before encoding
        raise _Invalid(f"payload is {len(raw)} {'bytes' if isinstance(raw, bytes) else 'characters'}, "
                       f"at most {cap} bytes are allowed for {expect}")
    if isinstance(raw, str):
        try:
            raw_bytes = raw.encode("utf-8")
        except UnicodeEncodeError:
            raise _Invalid("payload is not UTF-8 (lone surrogate)") from None
        if len(raw_bytes) > cap:
            raise _Invalid(f"payload is {len(raw_bytes)} bytes, at most {cap} bytes are allowed for {expect}")
        text = raw
    else:
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise _Invalid(f"payload is not UTF-8 (bad byte at offset {exc.start})") from None
    try:
        obj = json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_reject_constant,
                         parse_float=_finite_float)
    except _DuplicateKey as exc:
        raise _Invalid(f"duplicate key {_show(exc.args[0])} in a JSON object") from None
    except json.JSONDecodeError as exc:
        raise _Invalid(f"payload is not JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None
    except RecursionError:
        raise _Invalid(f"payload nests deeper than {MAX_DEPTH} levels") from None
    except ValueError as exc:  # e.g. an integer of more than 4300 digits
        raise _Invalid(f"payload is not JSON ({_show(str(exc), 80)})") from None
    if not isinstance(obj, dict):
        raise _Invalid(f"payload is {_type_name(obj)}, expected a JSON object")
    return obj


def _check_decoded(obj: dict[str, Any], expect: str) -> Message:
    # §3.2: the schema version is judged before any other field.
    if "schema_version" not in obj:
        raise _Invalid("missing field 'schema_version'")
    _schema(obj["schema_version"])
    problem = _depth_problem(obj)
    if problem:
        raise _Invalid(problem)
    where = _surrogate_path(obj)
    if where:
        raise _Invalid(f"{where} holds a lone surrogate, which is not UTF-8")
    return _run_inner(lambda: _FROM[expect](obj))


@overload
def from_dict(obj: Mapping[str, Any], expect: Literal["event"]) -> Event: ...
@overload
def from_dict(obj: Mapping[str, Any], expect: Literal["state"]) -> State: ...
@overload
def from_dict(obj: Mapping[str, Any], expect: Literal["dispatch"]) -> Dispatch: ...
@overload
def from_dict(obj: Mapping[str, Any], expect: Literal["control"]) -> Control: ...
@overload
def from_dict(obj: Mapping[str, Any], expect: Literal["presence"]) -> Presence: ...
@overload
def from_dict(obj: Mapping[str, Any], expect: str) -> Message: ...


def from_dict(obj: Mapping[str, Any], expect: str) -> Message:
    """Apply the rules of `expect` (§3-§7) to an already parsed payload.

    Args:
        obj: the JSON object; expect: one of EXPECTS.
    Returns:
        the message dataclass.
    Raises:
        DecodeError: as `decode`, without the raw payload.
    """
    if expect not in _FROM:
        raise ValueError(f"expect must be one of {', '.join(EXPECTS)}, not {expect!r}")
    if not isinstance(obj, Mapping):
        raise DecodeError(f"malformed: payload is {_type_name(obj)}, expected a JSON object", None)
    return _run(lambda: _check_decoded(dict(obj), expect))


@overload
def decode(raw: bytes | str, expect: Literal["event"]) -> Event: ...
@overload
def decode(raw: bytes | str, expect: Literal["state"]) -> State: ...
@overload
def decode(raw: bytes | str, expect: Literal["dispatch"]) -> Dispatch: ...
@overload
def decode(raw: bytes | str, expect: Literal["control"]) -> Control: ...
@overload
def decode(raw: bytes | str, expect: Literal["presence"]) -> Presence: ...
@overload
def decode(raw: bytes | str, expect: str) -> Message: ...


def decode(raw: bytes | str, expect: str) -> Message:
    """Parse and check one wire payload: the only parser of §3-§7 messages.

    Order: zero-length, size cap (before parsing), UTF-8, JSON object (no
    duplicate keys, NaN or infinities), `schema_version` (§3.2 step 2), then
    every field rule of the expected type: exact field set, types (a boolean
    is never an integer), formats of §1, ranges and sizes.

    Callers ignore zero-length payloads (§2) before calling this.

    Args:
        raw: the payload as received (bytes, or str).
        expect: "event", "state", "dispatch", "control" or "presence".
    Returns:
        Event, State, Dispatch, Control or Presence. Signatures are NOT checked
        here (`crypto.verify_event` / `crypto.verify`).
    Raises:
        DecodeError: reason `empty: zero-length payload`, `schema_mismatch:
            schema_version is N, expected 1`, or `malformed: <field> ...`;
            `.raw` is the payload.
        ValueError: `expect` is not one of the five kinds (a programming error).
    """
    if expect not in _FROM:
        raise ValueError(f"expect must be one of {', '.join(EXPECTS)}, not {expect!r}")
    try:
        return _run(lambda: _check_decoded(_parse(raw, expect), expect))
    except DecodeError as exc:
        raise DecodeError(exc.reason, raw) from None


def encode(msg: Message | Mapping[str, Any]) -> bytes:
    """The canonical bytes (§3.1) to publish for a message or a signed message dict.

    Args:
        msg: a message dataclass, or the dict returned by `crypto.sign`/`sign_event`.
    Returns:
        UTF-8 JSON bytes.
    Raises:
        ProtocolError: the payload is over the cap `decode` applies to its kind
            (so nothing is published that receivers would refuse).
    """
    if isinstance(msg, Dispatch) or (isinstance(msg, Mapping) and msg.get("kind") == "dispatch"):
        kind, cap = "dispatch", MAX_DISPATCH_BYTES
    else:
        kind, cap = "message", MAX_MESSAGE_BYTES
    data = canonical(msg)
    if len(data) > cap:
        raise ProtocolError(f"{kind} payload is {len(data)} bytes, over the cap of {cap} bytes")
    return data
