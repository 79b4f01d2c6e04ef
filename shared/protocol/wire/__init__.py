"""Wire messages of PROTOCOL §3-§7: frozen dataclasses, canonical JSON, one parser.

`decode(raw, expect)` is the only parser of wire payloads. It refuses, with one
`DecodeError(reason, raw)`, everything §1 and §3-§7 do not allow; the reason
starts with the word of the §3.2 acceptance order (`malformed: ...`,
`schema_mismatch: ...`) and names the offending field, e.g.
``malformed: data.attempt_id must be an integer >= 1, got 0``.

Zero-length payloads clear a retained topic (§2) and callers MUST ignore them
silently *before* calling `decode`; `decode` raises ``empty: zero-length
payload`` for them so that a forgotten check is still not a crash.

Signing, sealing and keys live in `mam.shared.protocol.crypto`; this module never sees a
key. The message types live in `messages` (§3, §4, §6, §7) and `dispatch`
(§5), their field rules in `fields`, JSON parsing in `jsoncodec`, log chunks
in `logchunk`; import all of them from here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, overload

from mam.shared.protocol.codes import EVENT_NAMES, JOB_STATUSES, PRESENCE_STATUSES, TERMINAL_EVENTS, TERMINAL_STATUSES
from mam.shared.protocol.errors import DecodeError, ProtocolError
from mam.shared.protocol.wire.dispatch import (
    CONTRACT_FIELDS,
    DEFAULT_ACK_TIMEOUT_SEC,
    DEFAULT_CLOCK_SKEW_S,
    DEFAULT_HEARTBEAT_MISSES,
    DEFAULT_HEARTBEAT_SEC,
    DEFAULT_TIMEOUT_SEC,
    DISPATCH_FIELDS,
    SEALED_FIELDS,
    Contract,
    Dispatch,
    Sealed,
)
from mam.shared.protocol.wire.fields import (
    GCM_TAG_BYTES,
    MAX_CONTRACT_SEC,
    MAX_DEPTH,
    MAX_DETAIL_CHARS,
    MAX_DISPATCH_BYTES,
    MAX_HEARTBEAT_MISSES,
    MAX_MESSAGE_BYTES,
    MAX_NAME_CHARS,
    MAX_REASON_CHARS,
    MAX_RUNNING,
    MAX_SAFE_INT,
    MAX_VERSION_CHARS,
    SCHEMA_VERSION,
    SEAL_ALG,
    SEAL_NONCE_BYTES,
    b64url_decode,
    b64url_encode,
    format_ts,
    parse_ts,
    run_check,
    safe_line,
)
from mam.shared.protocol.wire.jsoncodec import MAX_PAYLOAD_BYTES, canonical_json, parse_object
from mam.shared.protocol.wire.messages import (
    CONTROL_FIELDS,
    DRAIN_FIELDS,
    EVENT_FIELDS,
    MAX_SAID_BYTES,
    PRESENCE_FIELDS,
    REVOCATION_FIELDS,
    STATE_FIELDS,
    Control,
    Drain,
    Event,
    Presence,
    Revocation,
    State,
)
from mam.shared.protocol.wire.work import (
    MAX_BUNDLE_SEALED_CHARS,
    MAX_CARRIED_BUNDLE_BYTES,
    MAX_TRANSCRIPT_SEALED_CHARS,
    Base,
    Resume,
    Work,
)

__all__ = [
    "CONTRACT_FIELDS", "CONTROL_FIELDS", "DEFAULT_ACK_TIMEOUT_SEC", "DEFAULT_CLOCK_SKEW_S", "DEFAULT_HEARTBEAT_MISSES",
    "DRAIN_FIELDS",
    "DEFAULT_HEARTBEAT_SEC", "DEFAULT_TIMEOUT_SEC", "DISPATCH_FIELDS", "EVENT_FIELDS", "EVENT_NAMES", "EXPECTS",
    "GCM_TAG_BYTES", "JOB_STATUSES", "MAX_CONTRACT_SEC", "MAX_DEPTH", "MAX_DETAIL_CHARS", "MAX_DISPATCH_BYTES",
    "MAX_HEARTBEAT_MISSES", "MAX_MESSAGE_BYTES", "MAX_NAME_CHARS", "MAX_PAYLOAD_BYTES", "MAX_REASON_CHARS",
    "MAX_BUNDLE_SEALED_CHARS", "MAX_CARRIED_BUNDLE_BYTES",
    "MAX_RUNNING", "MAX_SAFE_INT", "MAX_SAID_BYTES", "MAX_TRANSCRIPT_SEALED_CHARS", "MAX_VERSION_CHARS",
    "PRESENCE_FIELDS", "PRESENCE_STATUSES",
    "REVOCATION_FIELDS", "SCHEMA_VERSION",
    "SEALED_FIELDS", "SEAL_ALG", "SEAL_NONCE_BYTES", "STATE_FIELDS", "TERMINAL_EVENTS", "TERMINAL_STATUSES",
    "WIRE_TYPES", "Contract", "Control", "Dispatch", "Event", "Expect", "Message", "Presence", "Sealed", "State",
    "Base", "Drain", "Resume", "Revocation", "Work",
    "b64url_decode", "b64url_encode", "canonical", "decode", "encode", "format_ts", "from_dict", "parse_ts",
    "safe_line",
]

EXPECTS = ("event", "state", "dispatch", "control", "presence", "revoked", "drain")
Expect = Literal["event", "state", "dispatch", "control", "presence", "revoked", "drain"]

Message = Event | State | Dispatch | Control | Presence | Revocation | Drain
MessageType = (type[Event] | type[State] | type[Dispatch] | type[Control] | type[Presence] | type[Revocation]
               | type[Drain])
# Every wire type: canonical() serializes them through their to_dict().
WIRE_TYPES = (Event, State, Dispatch, Control, Presence, Revocation, Drain, Contract, Sealed, Work)
_TYPES: Mapping[str, MessageType] = {"event": Event, "state": State, "dispatch": Dispatch, "control": Control,
                                     "presence": Presence, "revoked": Revocation, "drain": Drain}


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
    if isinstance(obj, WIRE_TYPES):
        obj = obj.to_dict()
    return canonical_json(obj)


def _type_of(expect: str) -> MessageType:
    if expect not in _TYPES:
        raise ValueError(f"expect must be one of {', '.join(EXPECTS)}, not {expect!r}")
    return _TYPES[expect]


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
def from_dict(obj: Mapping[str, Any], expect: Literal["revoked"]) -> Revocation: ...
@overload
def from_dict(obj: Mapping[str, Any], expect: Literal["drain"]) -> Drain: ...
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
        ValueError: `expect` is not one of the six kinds.
    """
    return _type_of(expect).from_dict(obj)


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
def decode(raw: bytes | str, expect: Literal["revoked"]) -> Revocation: ...
@overload
def decode(raw: bytes | str, expect: Literal["drain"]) -> Drain: ...
@overload
def decode(raw: bytes | str, expect: str) -> Message: ...


def decode(raw: bytes | str, expect: str) -> Message:
    """Parse and check one wire payload: the only parser of §3-§7 messages.

    Order: zero-length, size cap (before parsing), UTF-8, JSON object (no
    duplicate keys, NaN or infinities), `schema_version` (§3.2 rule 2), then
    every field rule of the expected type: exact field set, types (a boolean
    is never an integer), formats of §1, ranges and sizes.

    Callers ignore zero-length payloads (§2) before calling this.

    Args:
        raw: the payload as received (bytes, or str).
        expect: "event", "state", "dispatch", "control", "presence", "revoked" (§16.7) or "drain" (§7).
    Returns:
        Event, State, Dispatch, Control, Presence, Revocation or Drain. Signatures are NOT checked
        here (`crypto.verify_event` / `crypto.verify`).
    Raises:
        DecodeError: reason `empty: zero-length payload`, `schema_mismatch:
            schema_version is N, expected 1`, or `malformed: <field> ...`;
            `.raw` is the payload.
        ValueError: `expect` is not one of the six kinds (a programming error).
    """
    kind = _type_of(expect)
    try:
        return run_check(lambda: kind.from_dict(parse_object(raw, expect)))
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
