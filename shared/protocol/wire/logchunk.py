"""The `kind: log` message of PROTOCOL §15: one sealed, signed, numbered chunk of
an agent's output on `ROOT/jobs/<job_id>/log` (QoS 1, not retained); and its
`kind: transcript` variant, a chunk of the agent session's transcript as it grows
(§15 "Transcript chunks"), with a `session_id` field and its own numbering.

`decode_chunk` is the parser (size cap first, exact field set, types, ranges),
raising `DecodeError` with the §3.2 words (`malformed: ...`, `schema_mismatch:
...`). Sealing and signing a chunk, and opening one, are `crypto.build_log_chunk`
and `crypto.open_log_chunk`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mam.shared.protocol.errors import DecodeError
from mam.shared.protocol.names import AGENT_SESSION_RE
from mam.shared.protocol.wire.dispatch import Sealed
from mam.shared.protocol.wire.fields import (
    GCM_TAG_BYTES,
    MAX_LOG_MESSAGE_BYTES,
    MAX_SAFE_INT,
    SCHEMA_VERSION,
    Invalid,
    check_choice,
    check_fields,
    check_hex64,
    check_int,
    check_job_id,
    check_schema,
    run_check,
)
from mam.shared.protocol.wire.jsoncodec import parse_object

KIND = "log"
TRANSCRIPT_KIND = "transcript"
MAX_CHUNK_BYTES = 64 * 1024
"""Largest plaintext of one chunk, bytes (§15)."""
LOG_FIELDS = frozenset({"schema_version", "kind", "job_id", "attempt_id", "chunk", "dropped", "sealed", "sig"})
TRANSCRIPT_FIELDS = LOG_FIELDS | {"session_id"}


@dataclass(frozen=True)
class LogChunk:
    """One decoded §15 chunk; `sealed` is still closed (`crypto.open_log_chunk`).
    `session_id` is set on a transcript chunk (`kind` TRANSCRIPT_KIND) only."""

    job_id: str
    attempt_id: int
    chunk: int
    dropped: int
    sealed: Sealed
    sig: str
    session_id: str | None = None

    @property
    def kind(self) -> str:
        return KIND if self.session_id is None else TRANSCRIPT_KIND

    def to_dict(self) -> dict[str, Any]:
        """The wire object."""
        out = {"schema_version": SCHEMA_VERSION, "kind": self.kind, "job_id": self.job_id,
               "attempt_id": self.attempt_id, "chunk": self.chunk, "dropped": self.dropped,
               "sealed": self.sealed.to_dict(), "sig": self.sig}
        if self.session_id is not None:
            out["session_id"] = self.session_id
        return out


def associated_data(job_id: str, attempt_id: int, chunk: int, session_id: str | None = None) -> bytes:
    """The AES-GCM associated data of a chunk: `f"{job_id}:{attempt_id}:{chunk}"` (§15), or
    `f"transcript:{job_id}:{attempt_id}:{session_id}:{chunk}"` for a transcript chunk."""
    if session_id is not None:
        return f"transcript:{job_id}:{attempt_id}:{session_id}:{chunk}".encode()
    return f"{job_id}:{attempt_id}:{chunk}".encode()


def ciphertext_chars(plaintext_bytes: int) -> int:
    """base64url length (with padding) of the ciphertext and tag of `plaintext_bytes`, characters."""
    return (plaintext_bytes + GCM_TAG_BYTES + 2) // 3 * 4


def sealed_envelope(obj: Mapping[str, Any], fields: frozenset[str], kind: str, max_bytes: int) -> Sealed:
    """Check a chunk's envelope (§15, §18): schema, exactly `fields`, `kind`, and a `sealed`
    object whose ciphertext holds at most `max_bytes` of plaintext (a chunk's ciphertext is
    its plaintext plus the tag: nothing larger is ever sent). Returns the `Sealed`.

    Raises:
        Invalid: the first field that breaks it.
    """
    check_schema(obj.get("schema_version"))
    check_fields(obj, fields)
    check_choice(obj["kind"], "kind", (kind,))
    sealed = obj["sealed"]
    if not isinstance(sealed, Mapping):
        raise Invalid("sealed must be an object")
    opened = Sealed.from_dict(sealed)
    if len(opened.ciphertext) > ciphertext_chars(max_bytes):
        raise Invalid(f"sealed.ciphertext holds more than {max_bytes} bytes")
    return opened


def _from(obj: Mapping[str, Any]) -> LogChunk:
    transcript = obj.get("kind") == TRANSCRIPT_KIND
    opened = sealed_envelope(obj, TRANSCRIPT_FIELDS if transcript else LOG_FIELDS,
                             TRANSCRIPT_KIND if transcript else KIND, MAX_CHUNK_BYTES)
    session = obj["session_id"] if transcript else None
    if transcript and (not isinstance(session, str) or not AGENT_SESSION_RE.fullmatch(session)):
        raise Invalid("session_id must be 1-128 letters, digits, '.', '_' or '-', starting with a letter or digit")
    return LogChunk(job_id=check_job_id(obj["job_id"]), attempt_id=check_int(obj["attempt_id"], "attempt_id"),
                    chunk=check_int(obj["chunk"], "chunk", low=0, high=MAX_SAFE_INT),
                    dropped=check_int(obj["dropped"], "dropped", low=0, high=MAX_SAFE_INT),
                    sealed=opened, sig=check_hex64(obj["sig"], "sig"), session_id=session)


def check_chunk(obj: Mapping[str, Any]) -> LogChunk:
    """Check a chunk's wire object as `decode_chunk` does (for the sender, before it seals it on).

    Raises:
        DecodeError: `schema_mismatch: ...` or `malformed: <field> ...`.
    """
    return run_check(lambda: _from(obj))


def decode_chunk(raw: bytes | str) -> LogChunk:
    """Parse and check one §15 message (size cap of MAX_LOG_MESSAGE_BYTES first).

    Raises:
        DecodeError: `empty: ...`, `schema_mismatch: ...` or `malformed: <field> ...`; `.raw` is the payload.
    """
    try:
        return run_check(lambda: _from(parse_object(raw, KIND)))
    except DecodeError as exc:
        raise DecodeError(exc.reason, raw) from None


__all__ = ["KIND", "LOG_FIELDS", "TRANSCRIPT_FIELDS", "TRANSCRIPT_KIND",
           "MAX_CHUNK_BYTES", "MAX_LOG_MESSAGE_BYTES", "LogChunk", "associated_data",
           "check_chunk", "decode_chunk"]
