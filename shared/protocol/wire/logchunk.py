"""The `kind: log` message of PROTOCOL §15: one sealed, signed, numbered chunk of
an agent's output on `ROOT/jobs/<job_id>/log` (QoS 1, not retained).

`build_chunk` seals raw output bytes (at most MAX_CHUNK_BYTES) with
`crypto.seal_bytes` under `crypto.log_key(auth_token)`, bound to
`f"{job_id}:{attempt_id}:{chunk}"`, and signs the message with `crypto.log_sig`
(the §3.1 event HMAC over the message without `sig`). `decode_chunk` is the
parser (size cap first, exact field set, types, ranges), raising `DecodeError`
with the §3.2 words (`malformed: ...`, `schema_mismatch: ...`); `open_chunk`
verifies the signature and opens the seal. No key or plaintext is ever logged.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mam.shared.protocol import crypto
from mam.shared.protocol.errors import DecodeError
from mam.shared.protocol.wire.canonical import canonical_json, parse_object
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

KIND = "log"
MAX_CHUNK_BYTES = 64 * 1024
"""Largest plaintext of one chunk, bytes (§15)."""
MAX_CIPHERTEXT_CHARS = (MAX_CHUNK_BYTES + GCM_TAG_BYTES + 2) // 3 * 4
"""base64url length (with padding) of the largest chunk's ciphertext and tag, characters."""
LOG_FIELDS = frozenset({"schema_version", "kind", "job_id", "attempt_id", "chunk", "dropped", "sealed", "sig"})


@dataclass(frozen=True)
class LogChunk:
    """One decoded §15 chunk; `sealed` is still closed (`open_chunk`)."""

    job_id: str
    attempt_id: int
    chunk: int
    dropped: int
    sealed: Sealed
    sig: str

    def to_dict(self) -> dict[str, Any]:
        """The wire object."""
        return {"schema_version": SCHEMA_VERSION, "kind": KIND, "job_id": self.job_id,
                "attempt_id": self.attempt_id, "chunk": self.chunk, "dropped": self.dropped,
                "sealed": self.sealed.to_dict(), "sig": self.sig}


def associated_data(job_id: str, attempt_id: int, chunk: int) -> bytes:
    """The AES-GCM associated data of a chunk: `f"{job_id}:{attempt_id}:{chunk}"` (§15)."""
    return f"{job_id}:{attempt_id}:{chunk}".encode()


def build_chunk(auth_token: str, key: bytes, *, job_id: str, attempt_id: int, chunk: int, dropped: int,
                plaintext: bytes, nonce: bytes | None = None) -> bytes:
    """The wire bytes of one chunk (§15).

    Args:
        auth_token: the job's HMAC key; key: `crypto.log_key(auth_token)` (cached by the caller).
        job_id, attempt_id: the attempt; chunk: its number from 0; dropped: bytes not sent before it.
        plaintext: at most MAX_CHUNK_BYTES of (masked) output; nonce: tests only.
    Raises:
        ValueError: plaintext over MAX_CHUNK_BYTES; DecodeError: a field out of its range.
    """
    if len(plaintext) > MAX_CHUNK_BYTES:
        raise ValueError(f"a log chunk holds at most {MAX_CHUNK_BYTES} bytes, got {len(plaintext)}")
    body: dict[str, Any] = {"schema_version": SCHEMA_VERSION, "kind": KIND, "job_id": job_id,
                            "attempt_id": attempt_id, "chunk": chunk, "dropped": dropped,
                            "sealed": crypto.seal_bytes(key, plaintext, associated_data(job_id, attempt_id, chunk),
                                                        nonce)}
    body["sig"] = crypto.log_sig(body, auth_token)
    run_check(lambda: _from(body))
    return canonical_json(body)


def _from(obj: Mapping[str, Any]) -> LogChunk:
    check_schema(obj.get("schema_version"))
    check_fields(obj, LOG_FIELDS)
    check_choice(obj["kind"], "kind", (KIND,))
    sealed = obj["sealed"]
    if not isinstance(sealed, Mapping):
        raise Invalid("sealed must be an object")
    opened = Sealed.from_dict(sealed)
    # a chunk's ciphertext is its plaintext plus the tag: nothing larger is ever sent
    if len(opened.ciphertext) > MAX_CIPHERTEXT_CHARS:
        raise Invalid(f"sealed.ciphertext holds more than {MAX_CHUNK_BYTES} bytes of output")
    return LogChunk(job_id=check_job_id(obj["job_id"]), attempt_id=check_int(obj["attempt_id"], "attempt_id"),
                    chunk=check_int(obj["chunk"], "chunk", low=0, high=MAX_SAFE_INT),
                    dropped=check_int(obj["dropped"], "dropped", low=0, high=MAX_SAFE_INT),
                    sealed=opened, sig=check_hex64(obj["sig"], "sig"))


def decode_chunk(raw: bytes | str) -> LogChunk:
    """Parse and check one §15 message (size cap of MAX_LOG_MESSAGE_BYTES first).

    Raises:
        DecodeError: `empty: ...`, `schema_mismatch: ...` or `malformed: <field> ...`; `.raw` is the payload.
    """
    try:
        return run_check(lambda: _from(parse_object(raw, KIND)))
    except DecodeError as exc:
        raise DecodeError(exc.reason, raw) from None


def open_chunk(chunk: LogChunk, auth_token: str, key: bytes | None = None) -> bytes:
    """Verify a chunk's `sig` and open its seal (§15): the output bytes.

    Args:
        chunk: from `decode_chunk`; auth_token: the job's; key: `crypto.log_key(auth_token)` if cached.
    Raises:
        SignatureError: "HMAC verify failed" or "seal does not open".
    """
    crypto.verify_log_sig(chunk.to_dict(), auth_token)
    return crypto.open_bytes(key if key is not None else crypto.log_key(auth_token), chunk.sealed,
                             associated_data(chunk.job_id, chunk.attempt_id, chunk.chunk))


__all__ = ["KIND", "LOG_FIELDS", "MAX_CHUNK_BYTES", "MAX_LOG_MESSAGE_BYTES", "LogChunk", "associated_data",
           "build_chunk", "decode_chunk", "open_chunk"]
