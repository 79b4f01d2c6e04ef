"""Signatures, keys and the sealed brief of PROTOCOL §3.1 and §5-§7.

- Events and states carry `data.hmac_sig`, an HMAC-SHA256 keyed by the job's
  `auth_token` (`event_hmac`, `sign_event`, `verify_event`; §3.1, §4).
- Dispatch, control and presence carry `sig`, an HMAC-SHA256 keyed by the sign
  key derived from `MAM_DISPATCH_SECRET` (`derive_keys`, `sign`, `verify`; §5-§7).
- The dispatch's `sealed` part is AES-256-GCM over the job's `auth_token` and
  brief, bound to `job_id:attempt_id:dispatch_token` (`seal`, `open_sealed`; §5).
- Log chunks (§15) are sealed under `log_key(auth_token)` (`seal_bytes`,
  `open_bytes`) and signed like events over the message without `sig` (`log_sig`).

Every comparison uses `hmac.compare_digest`. No error message, repr or log line
of this module contains a key, a secret, an auth_token or a brief.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from mam.shared.protocol import names
from mam.shared.protocol.errors import ConfigError, SignatureError
from mam.shared.protocol.wire import (
    SCHEMA_VERSION,
    SEAL_ALG,
    SEAL_NONCE_BYTES,
    Message,
    Sealed,
    b64url_decode,
    b64url_encode,
    canonical,
    logchunk,
    resultchunk,
)
from mam.shared.protocol.wire.jsoncodec import canonical_json

MIN_SECRET_CHARS = 32  # MAM_DISPATCH_SECRET, at least (§5)
KEY_BYTES = 32
SEAL_INFO = b"mam-fleet/v1/seal"
SIGN_INFO = b"mam-fleet/v1/sign"
LOG_INFO = b"mam-fleet/v1/log"
RESULT_INFO = b"mam-fleet/v1/result"
ASK_INFO = b"mam-fleet/v1/ask"
ANSWER_INFO = b"mam-fleet/v1/answer"
TRANSCRIPT_INFO = b"mam-fleet/v1/transcript"
BUNDLE_INFO = b"mam-fleet/v1/bundle"
# §5: the brief is UTF-8 text of at most 512 KiB; dispatch refuses larger ones.
MAX_BRIEF_BYTES = 512 * 1024
HMAC_FAILED = "HMAC verify failed"
# What sign/verify take: a wire message, or its dict (as decoded or as signed).
Payload = Mapping[str, Any] | Message
SEAL_FAILED = "seal does not open"


def _plain(payload: Payload) -> dict[str, Any]:
    """A mutable top-level copy of a payload given as a mapping or a wire message."""
    if isinstance(payload, Mapping):
        return dict(payload)
    if hasattr(payload, "to_dict"):
        return payload.to_dict()
    raise TypeError(f"payload must be a mapping or a wire message, not {type(payload).__name__}")


def _hex_hmac(key: bytes, message: bytes) -> str:
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def _same(expected: str, got: object) -> bool:
    """Constant-time equality of a hex signature and an untrusted value."""
    if not isinstance(got, str):
        return False
    return hmac.compare_digest(expected.encode("ascii"), got.encode("utf-8", "replace"))


# --------------------------------------------------------- events, states

def _unsigned_event(payload: Payload) -> dict[str, Any]:
    body = _plain(payload)
    data = body.get("data")
    if isinstance(data, Mapping):
        body["data"] = {k: v for k, v in data.items() if k != "hmac_sig"}
    return body


def event_hmac(payload: Payload, auth_token: str) -> str:
    """`data.hmac_sig` of an event or state (§3.1, §4).

    Args:
        payload: the message (mapping or Event/State); any `data.hmac_sig` is ignored.
        auth_token: the job's `auth_token` (`secrets.token_urlsafe(32)`).
    Returns:
        64 lowercase hex: HMAC-SHA256(auth_token UTF-8, canonical(payload without data.hmac_sig)).
    Raises:
        ConfigError: `auth_token` is empty or not a string.
    """
    if not isinstance(auth_token, str) or not auth_token:
        raise ConfigError("auth_token is empty: the job record holds no HMAC key")
    return _hex_hmac(auth_token.encode("utf-8"), canonical(_unsigned_event(payload)))


def sign_event(payload: Payload, auth_token: str) -> dict[str, Any]:
    """A copy of an event or state with `data.hmac_sig` set (§3.1).

    Args:
        payload: mapping or Event/State with a `data` object.
        auth_token: the job's `auth_token`.
    Returns:
        the signed wire dict (publish it with `wire.encode`).
    Raises:
        ConfigError: empty `auth_token`; ValueError: the payload has no `data` object.
    """
    body = _unsigned_event(payload)
    if not isinstance(body.get("data"), dict):
        raise ValueError("an event or state needs a data object to carry hmac_sig")
    body["data"]["hmac_sig"] = event_hmac(body, auth_token)
    return body


def verify_event(payload: Payload, auth_token: str) -> None:
    """Check `data.hmac_sig` of an event or state (§3.1, §3.2 rule 4).

    Args:
        payload: mapping or Event/State as decoded.
        auth_token: the job's `auth_token` from the registry.
    Raises:
        SignatureError: "HMAC verify failed" when the signature is missing or wrong
            (or the job has no auth_token).
    """
    body = _plain(payload)
    data = body.get("data")
    got = data.get("hmac_sig") if isinstance(data, Mapping) else None
    if got is None or not isinstance(auth_token, str) or not auth_token:
        raise SignatureError(HMAC_FAILED)
    if not _same(event_hmac(body, auth_token), got):
        raise SignatureError(HMAC_FAILED)


# ------------------------------------------------------------------ keys

@dataclass(frozen=True)
class DispatchKeys:
    """The two 32-byte keys derived from `MAM_DISPATCH_SECRET` (§5). The repr hides them."""

    seal_key: bytes = field(repr=False)
    sign_key: bytes = field(repr=False)

    def __repr__(self) -> str:
        return "DispatchKeys(seal_key=<hidden>, sign_key=<hidden>)"


def _hkdf(secret: bytes, info: bytes) -> bytes:
    # Lazy: `mam-runner publish` needs only HMAC; cryptography adds ~6 ms to it (python -X importtime).
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    return HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=None, info=info).derive(secret)


def derive_keys(secret: str) -> DispatchKeys:
    """Derive the seal and sign keys from `MAM_DISPATCH_SECRET` (§5).

    HKDF-SHA256, no salt, info `b"mam-fleet/v1/seal"` and `b"mam-fleet/v1/sign"`,
    32 bytes each, over the secret's UTF-8 bytes.

    Args:
        secret: the shared secret, at least 32 characters.
    Returns:
        DispatchKeys.
    Raises:
        ConfigError: not a string or shorter than 32 characters (message never holds it).
    """
    if not isinstance(secret, str):
        raise ConfigError("MAM_DISPATCH_SECRET is not set: run `mam-orch init` or set it in .mam.env")
    if len(secret) < MIN_SECRET_CHARS:
        raise ConfigError(f"MAM_DISPATCH_SECRET is too short: at least {MIN_SECRET_CHARS} characters "
                          "are required (run `mam-orch init` to make one)")
    raw = secret.encode("utf-8", "surrogatepass")
    return DispatchKeys(seal_key=_hkdf(raw, SEAL_INFO), sign_key=_hkdf(raw, SIGN_INFO))


def _check_key(key: object, what: str) -> bytes:
    if not isinstance(key, (bytes, bytearray)) or len(key) != KEY_BYTES:
        raise TypeError(f"{what} must be {KEY_BYTES} bytes (from derive_keys)")
    return bytes(key)


# ----------------------------------------------- dispatch, control, presence

def _unsigned(payload: Payload) -> dict[str, Any]:
    body = _plain(payload)
    body.pop("sig", None)
    return body


def sign(payload: Payload, sign_key: bytes) -> dict[str, Any]:
    """A copy of a dispatch, control or presence with `sig` set (§5-§7).

    Args:
        payload: mapping or Dispatch/Control/Presence; any existing `sig` is replaced.
        sign_key: `DispatchKeys.sign_key`.
    Returns:
        the signed wire dict: `sig` = hex HMAC-SHA256(sign_key, canonical(payload without sig)).
    """
    key = _check_key(sign_key, "sign_key")
    body = _unsigned(payload)
    body["sig"] = _hex_hmac(key, canonical(body))
    return body


def verify(payload: Payload, sign_key: bytes) -> None:
    """Check `sig` of a dispatch, control or presence (§5-§7).

    Args:
        payload: mapping or Dispatch/Control/Presence as decoded.
        sign_key: `DispatchKeys.sign_key`.
    Raises:
        SignatureError: `<kind> sig verify failed` when missing or wrong.
    """
    key = _check_key(sign_key, "sign_key")
    body = _plain(payload)
    got = body.get("sig")
    kind = body.get("kind") if body.get("kind") in ("dispatch", "control", "presence", "drain") else "message"
    if got is None or not _same(_hex_hmac(key, canonical(_unsigned(body))), got):
        raise SignatureError(f"{kind} sig verify failed")


# ------------------------------------------------------------------ seal

def _associated_data(job_id: str, attempt_id: int, dispatch_token: str) -> bytes:
    return f"{job_id}:{attempt_id}:{dispatch_token}".encode()


def _encrypt(key: bytes, nonce: bytes, plaintext: bytes, associated: bytes) -> bytes:
    """AES-256-GCM: ciphertext followed by the 16-byte tag."""
    # Lazy: `mam-runner publish` needs only HMAC; cryptography adds ~6 ms to it (python -X importtime).
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    return AESGCM(key).encrypt(nonce, plaintext, associated)


def _decrypt(key: bytes, nonce: bytes, ciphertext: bytes, associated: bytes) -> bytes:
    """AES-256-GCM open. Raises ValueError when the tag does not verify."""
    # Lazy: `mam-runner publish` needs only HMAC; cryptography adds ~6 ms to it (python -X importtime).
    from cryptography.exceptions import InvalidTag
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    try:
        return AESGCM(key).decrypt(nonce, ciphertext, associated)
    except InvalidTag:
        raise ValueError("tag") from None


def seal(seal_key: bytes, *, job_id: str, attempt_id: int, dispatch_token: str, auth_token: str,
         brief: str, nonce: bytes | None = None) -> dict[str, str]:
    """Seal a job's auth_token and brief for its dispatch (§5).

    AES-256-GCM over `canonical({"auth_token": ..., "brief": ...})` with associated
    data `f"{job_id}:{attempt_id}:{dispatch_token}"`.

    Args:
        seal_key: `DispatchKeys.seal_key`.
        job_id, attempt_id, dispatch_token: the attempt the seal is bound to (§1 formats).
        auth_token: the job's HMAC key; brief: UTF-8 text (callers enforce MAX_BRIEF_BYTES).
        nonce: 12 bytes; None means a fresh random one (only tests pass one).
    Returns:
        {"alg": "A256GCM", "nonce": base64url, "ciphertext": base64url (ciphertext + 16-byte tag)}.
    Raises:
        UsageError: a bad job id, attempt or token; ValueError: a nonce that is not 12 bytes.
    """
    key = _check_key(seal_key, "seal_key")
    names.validate_job_id(job_id)
    names.validate_attempt(attempt_id)
    names.validate_token(dispatch_token)
    if nonce is None:
        nonce = os.urandom(SEAL_NONCE_BYTES)
    if len(nonce) != SEAL_NONCE_BYTES:
        raise ValueError(f"nonce must be {SEAL_NONCE_BYTES} bytes")
    ciphertext = seal_inner(key, nonce, job_id=job_id, attempt_id=attempt_id, dispatch_token=dispatch_token,
                            auth_token=auth_token, brief=brief)
    return {"alg": SEAL_ALG, "nonce": b64url_encode(nonce), "ciphertext": b64url_encode(ciphertext)}


def seal_inner(key: bytes, nonce: bytes, *, job_id: str, attempt_id: int, dispatch_token: str, auth_token: str,
               brief: str) -> bytes:
    """The AES-256-GCM core every seal shares (§5 v1, §16 v2): ciphertext + tag of
    `canonical({"auth_token", "brief"})`, associated data `job_id:attempt_id:dispatch_token`."""
    plaintext = canonical({"auth_token": auth_token, "brief": brief})
    return _encrypt(key, nonce, plaintext, _associated_data(job_id, attempt_id, dispatch_token))


def open_inner(key: bytes, nonce: bytes, ciphertext: bytes, *, job_id: str, attempt_id: int,
               dispatch_token: str) -> tuple[str, str]:
    """Inverse of `seal_inner`: (auth_token, brief).

    Raises:
        ValueError: the tag does not verify, or the plaintext is not {"auth_token", "brief"}.
    """
    if len(nonce) != SEAL_NONCE_BYTES:
        raise ValueError("nonce")
    plaintext = _decrypt(key, nonce, ciphertext, _associated_data(job_id, attempt_id, dispatch_token))
    try:
        inner = json.loads(plaintext.decode("utf-8"))
    except (UnicodeError, RecursionError):
        raise ValueError("inner") from None
    if (not isinstance(inner, dict) or set(inner) != {"auth_token", "brief"}
            or not isinstance(inner["auth_token"], str) or not inner["auth_token"]
            or not isinstance(inner["brief"], str)):
        raise ValueError("inner")
    return inner["auth_token"], inner["brief"]


def open_sealed(seal_key: bytes, sealed: Sealed | Mapping[str, Any], *, job_id: str, attempt_id: int,
                dispatch_token: str) -> tuple[str, str]:
    """Open a dispatch's sealed part (§5).

    Args:
        seal_key: `DispatchKeys.seal_key`.
        sealed: {"alg", "nonce", "ciphertext"} mapping or `wire.Sealed`; base64 with or without padding.
        job_id, attempt_id, dispatch_token: from the dispatch; they must be the ones sealed.
    Returns:
        (auth_token, brief).
    Raises:
        SignatureError: "seal does not open": wrong key, job id, attempt or token,
            tampering, bad base64, or a plaintext that is not {"auth_token", "brief"}.
    """
    key = _check_key(seal_key, "seal_key")
    try:
        parts = sealed.to_dict() if hasattr(sealed, "to_dict") else dict(sealed)
        if parts.get("alg") != SEAL_ALG:
            raise ValueError("alg")
        nonce = b64url_decode(parts["nonce"])
        ciphertext = b64url_decode(parts["ciphertext"])
        return open_inner(key, nonce, ciphertext, job_id=job_id, attempt_id=attempt_id,
                          dispatch_token=dispatch_token)
    except (ValueError, TypeError, KeyError, UnicodeError, RecursionError):
        raise SignatureError(SEAL_FAILED) from None


# ------------------------------------------------------------ log chunks (§15)

def log_key(auth_token: str) -> bytes:
    """The §15 chunk key: HKDF-SHA256(auth_token UTF-8, no salt, info `b"mam-fleet/v1/log"`), 32 bytes.

    Raises:
        ConfigError: `auth_token` is empty or not a string.
    """
    if not isinstance(auth_token, str) or not auth_token:
        raise ConfigError("auth_token is empty: the job record holds no log key")
    return _hkdf(auth_token.encode("utf-8"), LOG_INFO)


def seal_bytes(key: bytes, plaintext: bytes, associated: bytes, nonce: bytes | None = None) -> dict[str, str]:
    """AES-256-GCM of raw bytes (§15): {"alg": "A256GCM", "nonce", "ciphertext"} in base64url.

    Args:
        key: `log_key(...)`; plaintext: the bytes; associated: the bound associated data.
        nonce: 12 bytes; None means a fresh random one (only tests pass one).
    """
    checked = _check_key(key, "log key")
    if nonce is None:
        nonce = os.urandom(SEAL_NONCE_BYTES)
    if len(nonce) != SEAL_NONCE_BYTES:
        raise ValueError(f"nonce must be {SEAL_NONCE_BYTES} bytes")
    return {"alg": SEAL_ALG, "nonce": b64url_encode(nonce),
            "ciphertext": b64url_encode(_encrypt(checked, nonce, plaintext, associated))}


def open_bytes(key: bytes, sealed: Sealed | Mapping[str, Any], associated: bytes) -> bytes:
    """Open what `seal_bytes` sealed (§15).

    Raises:
        SignatureError: "seal does not open" (wrong key or associated data, tampering, bad base64).
    """
    checked = _check_key(key, "log key")
    try:
        parts = sealed.to_dict() if hasattr(sealed, "to_dict") else dict(sealed)
        if parts.get("alg") != SEAL_ALG:
            raise ValueError("alg")
        nonce = b64url_decode(parts["nonce"])
        if len(nonce) != SEAL_NONCE_BYTES:
            raise ValueError("nonce")
        return _decrypt(checked, nonce, b64url_decode(parts["ciphertext"]), associated)
    except (ValueError, TypeError, KeyError):
        raise SignatureError(SEAL_FAILED) from None


def log_sig(payload: Payload, auth_token: str) -> str:
    """`sig` of a log chunk (§15): the §3.1 event HMAC over the message without `sig`."""
    return event_hmac(_unsigned(payload), auth_token)


def verify_log_sig(payload: Payload, auth_token: str) -> None:
    """Check a log chunk's `sig` (§15). Raises SignatureError "HMAC verify failed"."""
    got = _plain(payload).get("sig")
    if got is None or not isinstance(auth_token, str) or not auth_token or not _same(log_sig(payload, auth_token), got):
        raise SignatureError(HMAC_FAILED)


def build_log_chunk(auth_token: str, key: bytes, *, job_id: str, attempt_id: int, chunk: int, dropped: int,
                    plaintext: bytes, nonce: bytes | None = None, session_id: str | None = None) -> bytes:
    """The wire bytes of one §15 chunk: `plaintext` sealed with `seal_bytes` under
    `log_key(auth_token)`, bound to `logchunk.associated_data` (`f"{job_id}:{attempt_id}:{chunk}"`,
    or its `transcript:` form with `session_id`), and signed with `log_sig` (the §3.1 event
    HMAC over the message without `sig`).

    Args:
        auth_token: the job's HMAC key; key: `log_key(auth_token)` (cached by the caller).
        job_id, attempt_id: the attempt; chunk: its number from 0; dropped: bytes not sent before it.
        plaintext: at most MAX_CHUNK_BYTES of (masked) output; nonce: tests only.
        session_id: makes it a transcript chunk of that agent session (§15 "Transcript chunks").
    Raises:
        ValueError: plaintext over MAX_CHUNK_BYTES; DecodeError: a field out of its range.
    """
    if len(plaintext) > logchunk.MAX_CHUNK_BYTES:
        raise ValueError(f"a log chunk holds at most {logchunk.MAX_CHUNK_BYTES} bytes, got {len(plaintext)}")
    associated = logchunk.associated_data(job_id, attempt_id, chunk, session_id)
    body: dict[str, Any] = {"schema_version": SCHEMA_VERSION, "job_id": job_id,
                            "kind": logchunk.KIND if session_id is None else logchunk.TRANSCRIPT_KIND,
                            "attempt_id": attempt_id, "chunk": chunk, "dropped": dropped,
                            "sealed": seal_bytes(key, plaintext, associated, nonce)}
    if session_id is not None:
        body["session_id"] = session_id
    body["sig"] = log_sig(body, auth_token)
    logchunk.check_chunk(body)
    return canonical_json(body)


def ask_key(auth_token: str) -> bytes:
    """The §19 key of a permission request's sealed input: HKDF-SHA256(auth_token UTF-8, no
    salt, info `b"mam-fleet/v1/ask"`), 32 bytes.

    Raises:
        ConfigError: `auth_token` is empty or not a string.
    """
    if not isinstance(auth_token, str) or not auth_token:
        raise ConfigError("auth_token is empty: the job record holds no key for its requests")
    return _hkdf(auth_token.encode("utf-8"), ASK_INFO)


def ask_associated(job_id: str, attempt_id: int, request_id: str) -> bytes:
    """The associated data a request's sealed input is bound to (§19): `<job>/<attempt>/<request>`."""
    return f"{job_id}/{attempt_id}/{request_id}".encode("ascii")


def answer_associated(job_id: str, attempt_id: int, request_id: str, action: str) -> bytes:
    """What an answer's sealed message is bound to (§19): `answer:<job>:<attempt>:<request>:<action>`."""
    return f"answer:{job_id}:{attempt_id}:{request_id}:{action}".encode("ascii")


def seal_answer(auth_token: str, *, job_id: str, attempt_id: int, request_id: str, action: str,
                message: str) -> dict[str, str]:
    """An answer's message sealed to its attempt (§19): AES-256-GCM under HKDF-SHA256(auth_token,
    no salt, info `b"mam-fleet/v1/answer"`), bound to `answer_associated`. Only the hub and the
    runner of that attempt hold the token: other runners, which may read every answer topic,
    cannot read it.

    Raises:
        ConfigError: `auth_token` is empty.
    """
    if not isinstance(auth_token, str) or not auth_token:
        raise ConfigError("auth_token is empty: the job record holds no key for its answers")
    return seal_bytes(_hkdf(auth_token.encode("utf-8"), ANSWER_INFO), message.encode("utf-8"),
                      answer_associated(job_id, attempt_id, request_id, action))


def open_answer(auth_token: str, control: Any) -> str:
    """The message of an answer `control` (a `wire.Control` allow or deny, §19) sealed by `seal_answer`.

    Raises:
        SignatureError: "seal does not open" (another attempt's token, a changed field, tampering).
    """
    if not isinstance(auth_token, str) or not auth_token or control.sealed is None:
        raise SignatureError(SEAL_FAILED)
    plain = open_bytes(_hkdf(auth_token.encode("utf-8"), ANSWER_INFO), control.sealed,
                       answer_associated(control.job_id, control.attempt_id, str(control.request_id), control.action))
    try:
        return plain.decode("utf-8")
    except UnicodeDecodeError:
        raise SignatureError(SEAL_FAILED) from None


def transcript_associated(job_id: str, attempt_id: int, session_id: str) -> bytes:
    """What a carried transcript is bound to (§18): `transcript:<job>:<attempt>:<session>`."""
    return f"transcript:{job_id}:{attempt_id}:{session_id}".encode("ascii")


def seal_transcript(auth_token: str, data: bytes, *, job_id: str, attempt_id: int,
                    session_id: str) -> dict[str, str]:
    """A session transcript the hub carries to `attempt_id` (§18 "Transcripts"), `data` as
    compressed: AES-256-GCM under HKDF-SHA256(auth_token, no salt, info
    `b"mam-fleet/v1/transcript"`), bound to `transcript_associated`.

    Raises:
        ConfigError: `auth_token` is empty.
    """
    if not isinstance(auth_token, str) or not auth_token:
        raise ConfigError("auth_token is empty: the job record holds no key for its transcript")
    return seal_bytes(_hkdf(auth_token.encode("utf-8"), TRANSCRIPT_INFO), data,
                      transcript_associated(job_id, attempt_id, session_id))


def open_transcript(auth_token: str, sealed: Mapping[str, Any], *, job_id: str, attempt_id: int,
                    session_id: str) -> bytes:
    """What `seal_transcript` sealed.

    Raises:
        SignatureError: "seal does not open" (another attempt's token, another session, tampering).
    """
    if not isinstance(auth_token, str) or not auth_token:
        raise SignatureError(SEAL_FAILED)
    return open_bytes(_hkdf(auth_token.encode("utf-8"), TRANSCRIPT_INFO), sealed,
                      transcript_associated(job_id, attempt_id, session_id))


def bundle_associated(job_id: str, attempt_id: int, from_job: str, head_sha: str) -> bytes:
    """What a carried bundle is bound to (§18): `bundle:<job>:<attempt>:<from job>:<head sha>`."""
    return f"bundle:{job_id}:{attempt_id}:{from_job}:{head_sha}".encode("ascii")


def seal_bundle(auth_token: str, data: bytes, *, job_id: str, attempt_id: int, from_job: str,
                head_sha: str) -> dict[str, str]:
    """Another job's `change.bundle` the hub carries to `attempt_id` (§18 "Handing a change
    on"): AES-256-GCM under HKDF-SHA256(auth_token, no salt, info `b"mam-fleet/v1/bundle"`),
    bound to `bundle_associated`.

    Raises:
        ConfigError: `auth_token` is empty.
    """
    if not isinstance(auth_token, str) or not auth_token:
        raise ConfigError("auth_token is empty: the job record holds no key for its bundle")
    return seal_bytes(_hkdf(auth_token.encode("utf-8"), BUNDLE_INFO), data,
                      bundle_associated(job_id, attempt_id, from_job, head_sha))


def open_bundle(auth_token: str, sealed: Mapping[str, Any], *, job_id: str, attempt_id: int, from_job: str,
                head_sha: str) -> bytes:
    """What `seal_bundle` sealed.

    Raises:
        SignatureError: "seal does not open" (another attempt's token or job, tampering).
    """
    if not isinstance(auth_token, str) or not auth_token:
        raise SignatureError(SEAL_FAILED)
    return open_bytes(_hkdf(auth_token.encode("utf-8"), BUNDLE_INFO), sealed,
                      bundle_associated(job_id, attempt_id, from_job, head_sha))


def result_key(auth_token: str) -> bytes:
    """The §18 result key: HKDF-SHA256(auth_token UTF-8, no salt, info `b"mam-fleet/v1/result"`), 32 bytes.

    Raises:
        ConfigError: `auth_token` is empty or not a string.
    """
    if not isinstance(auth_token, str) or not auth_token:
        raise ConfigError("auth_token is empty: the job record holds no result key")
    return _hkdf(auth_token.encode("utf-8"), RESULT_INFO)


def build_result_chunk(auth_token: str, key: bytes, *, job_id: str, attempt_id: int, chunk: int, size: int,
                       sha256: str, plaintext: bytes) -> bytes:
    """The wire bytes of one §18 chunk of a result archive of `size` bytes and hex digest
    `sha256`: `plaintext` sealed under `result_key(auth_token)`, bound to its place in that
    archive (`resultchunk.associated_data`), and signed like a log chunk (`log_sig`).

    Raises:
        ValueError: plaintext over MAX_CHUNK_BYTES; DecodeError: a field out of its range.
    """
    if len(plaintext) > resultchunk.MAX_CHUNK_BYTES:
        raise ValueError(f"a result chunk holds at most {resultchunk.MAX_CHUNK_BYTES} bytes, got {len(plaintext)}")
    chunks = resultchunk.chunk_count(size)
    body: dict[str, Any] = {"schema_version": SCHEMA_VERSION, "kind": resultchunk.KIND, "job_id": job_id,
                            "attempt_id": attempt_id, "chunk": chunk, "chunks": chunks, "size": size,
                            "sha256": sha256,
                            "sealed": seal_bytes(key, plaintext, resultchunk.associated_data(
                                job_id, attempt_id, chunk, chunks, sha256))}
    body["sig"] = log_sig(body, auth_token)
    resultchunk.check_chunk(body)
    return canonical_json(body)


def open_result_chunk(chunk: resultchunk.ResultChunk, auth_token: str, key: bytes | None = None) -> bytes:
    """Verify a result chunk's `sig` and open its seal (§18): its bytes of the archive.

    Raises:
        SignatureError: "HMAC verify failed" or "seal does not open".
    """
    verify_log_sig(chunk.to_dict(), auth_token)
    return open_bytes(key if key is not None else result_key(auth_token), chunk.sealed,
                      resultchunk.associated_data(chunk.job_id, chunk.attempt_id, chunk.chunk, chunk.chunks,
                                                  chunk.sha256))


def open_log_chunk(chunk: logchunk.LogChunk, auth_token: str, key: bytes | None = None) -> bytes:
    """Verify a chunk's `sig` and open its seal (§15): the output bytes.

    Args:
        chunk: from `logchunk.decode_chunk`; auth_token: the job's; key: `log_key(auth_token)` if cached.
    Raises:
        SignatureError: "HMAC verify failed" or "seal does not open".
    """
    verify_log_sig(chunk.to_dict(), auth_token)
    return open_bytes(key if key is not None else log_key(auth_token), chunk.sealed,
                      logchunk.associated_data(chunk.job_id, chunk.attempt_id, chunk.chunk, chunk.session_id))
