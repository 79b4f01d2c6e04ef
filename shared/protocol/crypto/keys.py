"""The v2 keys of §16 as values: their base64url text, a runner's key pair, and
the enrolment request that carries a runner's public keys to the hub. The key
files under `.mam/keys/` are `mam.shared.store.keyfiles`'s.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey

from mam.shared.protocol import names
from mam.shared.protocol.errors import UsageError
from mam.shared.protocol.wire.fields import b64url_decode, b64url_encode
from mam.shared.protocol.wire.jsoncodec import canonical_json

KEY_BYTES = 32
"""Raw Ed25519 seeds, X25519 private keys and both public keys are 32 bytes (§16)."""


def b64(raw: bytes) -> str:
    """base64url with padding, as every §16 key and signature is written."""
    return b64url_encode(raw)


def raw_key(text: object, what: str) -> bytes:
    """The 32 bytes of a base64url key; `UsageError` naming `what` otherwise (never echoing the value)."""
    if not isinstance(text, str):
        raise UsageError(f"{what} is invalid: expected {KEY_BYTES} bytes as base64url text")
    try:
        raw = b64url_decode(text.strip())
    except ValueError:
        raise UsageError(f"{what} is invalid: expected {KEY_BYTES} bytes as base64url") from None
    if len(raw) != KEY_BYTES:
        raise UsageError(f"{what} is invalid: it decodes to {len(raw)} bytes, expected {KEY_BYTES}")
    return raw


def ed25519_public(text: object, what: str = "Ed25519 public key") -> Ed25519PublicKey:
    """An Ed25519 public key from its base64url text (§16). Raises `UsageError`."""
    return Ed25519PublicKey.from_public_bytes(raw_key(text, what))


def x25519_public(text: object, what: str = "X25519 public key") -> X25519PublicKey:
    """An X25519 public key from its base64url text (§16); a low-order point (all zeros, ...),
    with which no shared secret can be made, is refused. Raises `UsageError`."""
    key = X25519PublicKey.from_public_bytes(raw_key(text, what))
    try:
        X25519PrivateKey.generate().exchange(key)
    except ValueError:
        raise UsageError(f"{what} is invalid: a low-order point") from None
    return key


def public_text(key: Ed25519PrivateKey | X25519PrivateKey | Ed25519PublicKey | X25519PublicKey) -> str:
    """The base64url text of a key's raw public bytes (§16)."""
    public = key.public_key() if isinstance(key, (Ed25519PrivateKey, X25519PrivateKey)) else key
    return b64(public.public_bytes_raw())


# ---------------------------------------------------------------- runner

@dataclass(frozen=True)
class RunnerKeys:
    """A runner's private keys (§16): Ed25519 signs its presence, X25519 opens its seals. The repr hides them."""

    ed25519: Ed25519PrivateKey = field(repr=False)
    x25519: X25519PrivateKey = field(repr=False)

    def __repr__(self) -> str:
        return f"RunnerKeys(ed25519_public={self.ed25519_public!r}, x25519_public={self.x25519_public!r})"

    @property
    def ed25519_public(self) -> str:
        """The Ed25519 public key, base64url."""
        return public_text(self.ed25519)

    @property
    def x25519_public(self) -> str:
        """The X25519 public key, base64url."""
        return public_text(self.x25519)


# ------------------------------------------------------------ enrolment

ENROL_KIND = "enrol_request"
ENROL_FIELDS = frozenset({"kind", "session", "labels", "ed25519_public", "x25519_public"})
MAX_ENROL_REQUEST_CHARS = 4096


def labels_of(value: object) -> tuple[str, ...]:
    """Labels (§14) from a comma-separated string (empty: none) or a JSON list.

    Raises:
        UsageError: a bad label, more than 16, a label twice.
    """
    if isinstance(value, str):
        return names.parse_labels(value) if value.strip() else ()
    return names.validate_labels(value)


@dataclass(frozen=True)
class EnrolRequest:
    """What `mam-runner enroll` prints and `mam-orch runner add` reads (§16): public parts only."""

    session: str
    labels: tuple[str, ...]
    ed25519_public: str
    x25519_public: str

    @classmethod
    def build(cls, session: object, labels: object, ed25519_text: object, x25519_text: object) -> EnrolRequest:
        """Validated and normalised. Raises `UsageError` naming the bad part."""
        return cls(session=names.validate_session(session), labels=labels_of(labels),
                   ed25519_public=public_text(ed25519_public(ed25519_text, "ed25519_public")),
                   x25519_public=public_text(x25519_public(x25519_text, "x25519_public")))

    @classmethod
    def parse(cls, text: str) -> EnrolRequest:
        """Read the one-line request (a JSON object). Raises `UsageError` with one line."""
        if not isinstance(text, str) or len(text) > MAX_ENROL_REQUEST_CHARS:
            raise UsageError(f"enrolment request is invalid: expected one JSON line of at most "
                             f"{MAX_ENROL_REQUEST_CHARS} characters from `mam-runner enroll`")
        try:
            obj = json.loads(text)
        except ValueError:
            raise UsageError("enrolment request is invalid: not JSON (paste the line `mam-runner enroll` printed, "
                             "quoted)") from None
        if not isinstance(obj, dict) or obj.get("kind") != ENROL_KIND or set(obj) != ENROL_FIELDS:
            raise UsageError(f"enrolment request is invalid: expected a JSON object with exactly "
                             f"{', '.join(sorted(ENROL_FIELDS))} and kind {ENROL_KIND!r}")
        if not isinstance(obj["labels"], list):
            raise UsageError("enrolment request is invalid: labels must be a JSON array of strings")
        return cls.build(obj["session"], obj["labels"], obj["ed25519_public"], obj["x25519_public"])

    def to_dict(self) -> dict[str, object]:
        """The request as a JSON object."""
        return {"kind": ENROL_KIND, "session": self.session, "labels": list(self.labels),
                "ed25519_public": self.ed25519_public, "x25519_public": self.x25519_public}

    def line(self) -> str:
        """The one-line form printed by `mam-runner enroll` (canonical JSON, §3.1)."""
        return canonical_json(self.to_dict()).decode("utf-8")


def texts(keys: Iterable[Ed25519PublicKey | X25519PublicKey]) -> list[str]:
    """The base64url texts of public keys."""
    return [public_text(key) for key in keys]
