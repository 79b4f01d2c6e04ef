"""The `kind: result` message of PROTOCOL §18: one sealed, signed, numbered chunk of an
attempt's result archive on `ROOT/jobs/<job_id>/result` (QoS 1, not retained).

Every chunk names the whole archive (`chunks`, `size`, `sha256`), so the hub can place a
chunk without any other message and knows when the archive is whole. `decode_chunk` is
the parser (size cap first, exact field set, types, ranges); sealing, signing and opening
are `crypto.build_result_chunk` and `crypto.open_result_chunk`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mam.shared.protocol.errors import DecodeError
from mam.shared.protocol.wire.dispatch import Sealed
from mam.shared.protocol.wire.fields import (
    SCHEMA_VERSION,
    Invalid,
    check_hex64,
    check_int,
    check_job_id,
    run_check,
)
from mam.shared.protocol.wire.jsoncodec import parse_object
from mam.shared.protocol.wire.logchunk import sealed_envelope

KIND = "result"
MAX_CHUNK_BYTES = 256 * 1024
"""Largest plaintext of one result chunk, bytes (§18)."""
MAX_ARCHIVE_BYTES = 1 << 30
"""Largest archive any chunk may announce, bytes (the runner's own cap is lower, §18)."""
MAX_CHUNKS = -(-MAX_ARCHIVE_BYTES // MAX_CHUNK_BYTES)
RESULT_FIELDS = frozenset({"schema_version", "kind", "job_id", "attempt_id", "chunk", "chunks", "size", "sha256",
                           "sealed", "sig"})


@dataclass(frozen=True)
class ResultChunk:
    """One decoded §18 chunk; `sealed` is still closed.

    Attributes:
        chunk: its number, 0..chunks-1; chunks: how many make the archive (>= 1);
        size: the archive's length in bytes; sha256: its hex SHA-256.
    """

    job_id: str
    attempt_id: int
    chunk: int
    chunks: int
    size: int
    sha256: str
    sealed: Sealed
    sig: str

    def to_dict(self) -> dict[str, Any]:
        """The wire object."""
        return {"schema_version": SCHEMA_VERSION, "kind": KIND, "job_id": self.job_id,
                "attempt_id": self.attempt_id, "chunk": self.chunk, "chunks": self.chunks, "size": self.size,
                "sha256": self.sha256, "sealed": self.sealed.to_dict(), "sig": self.sig}


def associated_data(job_id: str, attempt_id: int, chunk: int, chunks: int, sha256: str) -> bytes:
    """The AES-GCM associated data of a chunk: `result:<job_id>:<attempt_id>:<chunk>:<chunks>:<sha256>`
    (§18): a chunk cannot be moved to another attempt, place or archive."""
    return f"result:{job_id}:{attempt_id}:{chunk}:{chunks}:{sha256}".encode()


def chunk_count(size: int) -> int:
    """How many chunks carry an archive of `size` bytes (an empty archive is one empty chunk)."""
    return max(1, -(-size // MAX_CHUNK_BYTES))


def _from(obj: Mapping[str, Any]) -> ResultChunk:
    opened = sealed_envelope(obj, RESULT_FIELDS, KIND, MAX_CHUNK_BYTES)
    size = check_int(obj["size"], "size", low=0, high=MAX_ARCHIVE_BYTES)
    chunks = check_int(obj["chunks"], "chunks", low=1, high=MAX_CHUNKS)
    if chunks != chunk_count(size):
        raise Invalid(f"chunks {chunks} does not fit size {size} ({chunk_count(size)} expected)")
    return ResultChunk(job_id=check_job_id(obj["job_id"]), attempt_id=check_int(obj["attempt_id"], "attempt_id"),
                       chunk=check_int(obj["chunk"], "chunk", low=0, high=chunks - 1), chunks=chunks, size=size,
                       sha256=check_hex64(obj["sha256"], "sha256"), sealed=opened,
                       sig=check_hex64(obj["sig"], "sig"))


def check_chunk(obj: Mapping[str, Any]) -> ResultChunk:
    """Check a chunk's wire object as `decode_chunk` does (for the sender).

    Raises:
        DecodeError: `schema_mismatch: ...` or `malformed: <field> ...`.
    """
    return run_check(lambda: _from(obj))


def decode_chunk(raw: bytes | str) -> ResultChunk:
    """Parse and check one §18 message (size cap of MAX_RESULT_MESSAGE_BYTES first).

    Raises:
        DecodeError: `empty: ...`, `schema_mismatch: ...` or `malformed: <field> ...`.
    """
    try:
        return run_check(lambda: _from(parse_object(raw, KIND)))
    except DecodeError as exc:
        raise DecodeError(exc.reason, raw) from None


__all__ = ["KIND", "MAX_CHUNK_BYTES", "RESULT_FIELDS", "ResultChunk", "associated_data", "check_chunk",
           "chunk_count", "decode_chunk"]
