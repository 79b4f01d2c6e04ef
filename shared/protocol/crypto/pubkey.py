"""Wire v2 of PROTOCOL §16: Ed25519 signatures and seals to a runner's X25519 key.

- `sign` / `verify`: dispatch, control (hub key) and presence (runner key) carry
  `"sig_alg": "ed25519"` and `sig` = base64url Ed25519 over `canonical(message
  without "sig")` (the §3.1 canonical form, `sig_alg` included). `verify` refuses
  a v1 (HMAC) message: a v2 verifier never falls back on its own.
- `seal` / `open_sealed`: `"alg": "X25519-A256GCM"`, a fresh ephemeral X25519 key
  per seal, `key = HKDF-SHA256(ECDH, salt = epk || runner_pub, info =
  b"mam-fleet/v2/seal")`; the AES-256-GCM core, its associated data and inner
  `{"auth_token", "brief"}` are v1's (`crypto.seal_inner`); the object adds `epk`.
- `build_dispatch` / `build_control` / `sign_presence`: whole signed v2 messages.

Events, states and log chunks keep the per-job HMAC of §3.1 (`crypto`). No error
message, repr or log line of this module holds a private key, a token or a brief.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from mam.shared.protocol import crypto, names
from mam.shared.protocol.crypto import MAX_BRIEF_BYTES, SEAL_FAILED, Payload
from mam.shared.protocol.errors import SignatureError
from mam.shared.protocol.wire import (
    GCM_TAG_BYTES,
    SEAL_NONCE_BYTES,
    Contract,
    Control,
    Dispatch,
    Presence,
    Sealed,
    Work,
    b64url_decode,
    b64url_encode,
    canonical,
)
from mam.shared.protocol.wire.fields import ED25519_SIG_BYTES, SEAL_ALG_V2, SIG_ALG_ED25519, X25519_KEY_BYTES

SEAL_INFO_V2 = b"mam-fleet/v2/seal"
SEAL_KEY_BYTES = 32
# Inner JSON overhead around the brief and the auth_token, generously: a seal bigger than this is hostile.
SEAL_OVERHEAD_BYTES = 64 * 1024
JSON_ESCAPE_BYTES = 6  # the most one brief byte can become in canonical JSON ("\u001f")
MAX_SEALED_CIPHERTEXT_BYTES = MAX_BRIEF_BYTES * JSON_ESCAPE_BYTES + SEAL_OVERHEAD_BYTES
SIGNED_KINDS = ("dispatch", "control", "presence", "revoked", "drain")
V1_REFUSED = ("is a v1 message (HMAC sig, no sig_alg); this host verifies v2 only (§16; "
              "MAM_ACCEPT_V1=true accepts v1 during a migration)")

__all__ = ["MAX_SEALED_CIPHERTEXT_BYTES", "SEAL_INFO_V2", "build_control", "build_dispatch", "is_v2",
           "open_sealed", "seal", "seal_key", "sign", "sign_presence", "verify"]


def _kind(body: Mapping[str, Any]) -> str:
    kind = body.get("kind")
    return kind if isinstance(kind, str) and kind in SIGNED_KINDS else "message"


def _plain(payload: Payload) -> dict[str, Any]:
    if isinstance(payload, Mapping):
        return dict(payload)
    return payload.to_dict()


def is_v2(payload: Payload) -> bool:
    """True when a dispatch, control or presence says it is v2 (`sig_alg` present, §16)."""
    return _plain(payload).get("sig_alg") is not None


# -------------------------------------------------------------- signatures

def sign(payload: Payload, key: Ed25519PrivateKey) -> dict[str, Any]:
    """A copy of a dispatch, control or presence signed v2 (§16).

    Args:
        payload: mapping or Dispatch/Control/Presence; any `sig` is replaced, `sig_alg` set to "ed25519".
        key: the hub's key (dispatch, control) or the runner's (presence).
    Returns:
        the signed wire dict: `sig` = base64url Ed25519(canonical(payload with sig_alg, without sig)).
    """
    body = _plain(payload)
    body.pop("sig", None)
    body["sig_alg"] = SIG_ALG_ED25519
    body["sig"] = b64url_encode(key.sign(canonical(body)))
    return body


def verify(payload: Payload, public_keys: Iterable[Ed25519PublicKey]) -> None:
    """Check the v2 `sig` of a dispatch, control or presence with any of `public_keys` (§16).

    Args:
        payload: mapping or decoded message.
        public_keys: the hub's current and previous keys (dispatch, control), or the
            enrolled runner's key (presence).
    Raises:
        SignatureError: `<kind> is a v1 message ...` without `sig_alg`; `<kind> sig verify
            failed` when the algorithm, the form or the signature is wrong.
    """
    body = _plain(payload)
    kind = _kind(body)
    if body.get("sig_alg") is None:
        raise SignatureError(f"{kind} {V1_REFUSED}")
    failed = SignatureError(f"{kind} sig verify failed")
    if body.get("sig_alg") != SIG_ALG_ED25519:
        raise failed
    try:
        sig = b64url_decode(body.pop("sig"))
    except (KeyError, ValueError):
        raise failed from None
    if len(sig) != ED25519_SIG_BYTES:
        raise failed
    message = canonical(body)
    for public in public_keys:
        try:
            public.verify(sig, message)
            return
        except InvalidSignature:
            continue
    raise failed


# -------------------------------------------------------------------- seal

def seal_key(shared_secret: bytes, epk: bytes, runner_public: bytes) -> bytes:
    """`HKDF-SHA256(ECDH output, salt = epk || runner_pub, info = b"mam-fleet/v2/seal")`, 32 bytes (§16)."""
    return HKDF(algorithm=hashes.SHA256(), length=SEAL_KEY_BYTES, salt=epk + runner_public,
                info=SEAL_INFO_V2).derive(shared_secret)


def seal(runner_public: X25519PublicKey, *, job_id: str, attempt_id: int, dispatch_token: str, auth_token: str,
         brief: str, ephemeral: X25519PrivateKey | None = None, nonce: bytes | None = None) -> dict[str, str]:
    """Seal a job's auth_token and brief to one runner's X25519 key (§16).

    Args:
        runner_public: the target runner's enrolled X25519 public key.
        job_id, attempt_id, dispatch_token: the attempt the seal is bound to (associated data, as §5).
        auth_token, brief: the secrets; callers enforce MAX_BRIEF_BYTES.
        ephemeral, nonce: None means fresh random ones (only the golden vectors pass them).
    Returns:
        {"alg": "X25519-A256GCM", "nonce", "ciphertext", "epk"}, all base64url.
    Raises:
        UsageError: a bad job id, attempt or token; ValueError: a nonce that is not 12 bytes.
    """
    names.validate_job_id(job_id)
    names.validate_attempt(attempt_id)
    names.validate_token(dispatch_token)
    eph = X25519PrivateKey.generate() if ephemeral is None else ephemeral
    nonce = os.urandom(SEAL_NONCE_BYTES) if nonce is None else nonce
    if len(nonce) != SEAL_NONCE_BYTES:
        raise ValueError(f"nonce must be {SEAL_NONCE_BYTES} bytes")
    epk = eph.public_key().public_bytes_raw()
    key = seal_key(eph.exchange(runner_public), epk, runner_public.public_bytes_raw())
    ciphertext = crypto.seal_inner(key, nonce, job_id=job_id, attempt_id=attempt_id,
                                   dispatch_token=dispatch_token, auth_token=auth_token, brief=brief)
    return {"alg": SEAL_ALG_V2, "nonce": b64url_encode(nonce), "ciphertext": b64url_encode(ciphertext),
            "epk": b64url_encode(epk)}


def open_sealed(private: X25519PrivateKey, sealed: Sealed | Mapping[str, Any], *, job_id: str, attempt_id: int,
                dispatch_token: str) -> tuple[str, str]:
    """Open a v2 seal with this runner's X25519 key (§16).

    Returns:
        (auth_token, brief).
    Raises:
        SignatureError: "seal does not open": a v1 seal, another runner's seal, a wrong or
            low-order `epk`, another attempt, tampering, bad base64, an oversized ciphertext.
    """
    try:
        parts = sealed.to_dict() if isinstance(sealed, Sealed) else dict(sealed)
        if parts.get("alg") != SEAL_ALG_V2 or set(parts) != {"alg", "nonce", "ciphertext", "epk"}:
            raise ValueError("alg")
        epk = b64url_decode(parts["epk"])
        nonce = b64url_decode(parts["nonce"])
        ciphertext = b64url_decode(parts["ciphertext"])
        if (len(epk) != X25519_KEY_BYTES or len(ciphertext) < GCM_TAG_BYTES
                or len(ciphertext) > MAX_SEALED_CIPHERTEXT_BYTES):
            raise ValueError("size")
        # exchange raises ValueError for a low-order epk (an all-zero shared secret)
        shared = private.exchange(X25519PublicKey.from_public_bytes(epk))
        key = seal_key(shared, epk, private.public_key().public_bytes_raw())
        return crypto.open_inner(key, nonce, ciphertext, job_id=job_id, attempt_id=attempt_id,
                                 dispatch_token=dispatch_token)
    except (ValueError, TypeError, KeyError, UnicodeError, RecursionError):
        raise SignatureError(SEAL_FAILED) from None


# ---------------------------------------------------------- whole messages

def build_dispatch(hub_key: Ed25519PrivateKey, runner_x25519: X25519PublicKey, *, job_id: str, session: str,
                   attempt_id: int, dispatch_token: str, auth_token: str, brief: str, origin: str,
                   contract: Contract, issued_at: datetime | None = None, work: Work | None = None
                   ) -> dict[str, Any]:
    """A signed v2 dispatch for an enrolled session (§5 fields, §16 seal and signature).

    The lead wires this into `orchestrator/dispatch.py` for sessions with a roster entry.

    Args:
        hub_key: `keyfiles.hub_key(root)`; runner_x25519: the roster entry's X25519 key.
        The rest as `wire.Dispatch.build` (`work`: §18) and `crypto.seal`.
    Returns:
        the signed wire dict (publish it with `wire.encode`).
    Raises:
        UsageError: a field breaks §5.
    """
    sealed = seal(runner_x25519, job_id=job_id, attempt_id=attempt_id, dispatch_token=dispatch_token,
                  auth_token=auth_token, brief=brief)
    unsigned = Dispatch.build(job_id, session, attempt_id, dispatch_token, origin=origin, contract=contract,
                              sealed=sealed, issued_at=issued_at, sig_alg=SIG_ALG_ED25519, work=work)
    return sign(unsigned, hub_key)


def build_control(hub_key: Ed25519PrivateKey, *, job_id: str, attempt_id: int, reason: str,
                  issued_at: datetime | str | None = None) -> dict[str, Any]:
    """A signed v2 cancel (§6, §16). Raises `UsageError` when a field breaks §6."""
    return sign(Control.cancel(job_id, attempt_id, reason, issued_at=issued_at), hub_key)


def sign_presence(presence: Presence | Mapping[str, Any], runner_key: Ed25519PrivateKey) -> dict[str, Any]:
    """A presence (§7) signed with the runner's own Ed25519 key (§16)."""
    return sign(presence, runner_key)
