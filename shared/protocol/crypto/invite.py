"""Enrolment by invite (PROTOCOL §16): the single-use code, its hub-side file, and the two
messages of the exchange over the broker, each authenticated by the code.

- Code: `mam1.<session>.<128 random bits, base64url without padding>`, printed once by
  `mam-orch runner invite`, then `.<broker part>`: where a fresh runner host finds the
  broker (hosts, port, TLS, topic root and the CA certificate when TLS is on), base64url
  of canonical JSON with a `mac` under the code's key, so a changed copy is refused.
  The core (without the broker part) is the secret: the id and the key come from it.
  The hub stores only its id (a hash of the core), the session, labels, expiry and use
  in `.mam/invites/<id>.json` (0600): never the code.
- `key = HKDF-SHA256(code, info = "mam-fleet/v2/invite")`. The runner's request
  (`kind: enrol_invite`: session, its public keys, the invite id, a nonce) and the hub's
  answer (`kind: enrol_answer`: the labels and the hub's public keys, the same nonce)
  carry `mac` = HMAC-SHA256(key, canonical JSON without `mac`), hex. So the code
  authenticates the runner's public keys to the hub and the hub's key to the runner.
- A refusal (`kind: enrol_refused`) carries no MAC: the hub may not know the code
  (a wrong one); the runner writes nothing on a refusal, it only reports it.
- Where the hub manages the broker config, the answer also carries the runner's own
  broker user (`broker`: `username` and `password`, the password sealed to the
  runner's X25519 key: X25519 + HKDF-SHA256 (info "mam-fleet/v2/invite-broker") +
  AES-256-GCM, associated data the canonical JSON of invite id, nonce and username), so
  the runner stops connecting as the shared `mam_agent` (docs/security.md).

Topics: `names.enrol_topic(session, "request" | "answer")`, never retained. Nothing here
logs or puts the code or the key in an error message.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any

from cryptography import x509
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from mam.shared.protocol import names
from mam.shared.protocol.crypto import keys
from mam.shared.protocol.errors import ProtocolError, SignatureError, UsageError
from mam.shared.protocol.names import check_secret, is_user_name
from mam.shared.protocol.wire.fields import b64url_decode, b64url_encode
from mam.shared.protocol.wire.jsoncodec import canonical_json

CODE_PREFIX = "mam1"
CODE_RANDOM_BYTES = 16
"""128 random bits per code."""
CODE_RANDOM_CHARS = 22
"""16 bytes as base64url without padding."""
INVITE_INFO = b"mam-fleet/v2/invite"
INVITE_ID_INFO = b"mam-fleet/v2/invite-id\x00"
INVITE_ID_HEX_CHARS = 32
NONCE_BYTES = 16
KEY_BYTES = 32
MAX_MESSAGE_BYTES = 8192
"""An enrolment message is a few hundred bytes; a bigger one is refused unread."""
MIN_TTL_S = 1.0
MAX_TTL_S = 7 * 24 * 3600.0
"""An invite lives at most a week (s)."""
REQUEST_KIND = "enrol_invite"
ANSWER_KIND = "enrol_answer"
REFUSED_KIND = "enrol_refused"
REQUEST_FIELDS = frozenset({"kind", "session", "invite_id", "nonce", "ed25519_public", "x25519_public", "mac"})
ANSWER_FIELDS = frozenset({"kind", "session", "invite_id", "nonce", "labels", "hub_ed25519_public", "mac"})
REFUSED_FIELDS = frozenset({"kind", "session", "invite_id", "nonce", "reason"})
BROKER_FIELD = "broker"
"""The answer's optional field: the runner's own broker user, its password sealed (§16)."""
BROKER_FIELDS = frozenset({"username", "password"})
SEALED_FIELDS = frozenset({"alg", "epk", "nonce", "ciphertext"})
BROKER_SEAL_ALG = "X25519-A256GCM"
BROKER_SEAL_INFO = b"mam-fleet/v2/invite-broker"
GCM_NONCE_BYTES = 12
MAX_SEALED_PASSWORD_BYTES = 512
"""A sealed broker password is its length plus 16 bytes of tag; a bigger one is refused."""
_BAD_SEAL = "the broker password in the hub's answer does not open with this host's X25519 key"
MAX_REASON_CHARS = 200
MAX_BROKER_PART_CHARS = 12_000
"""The broker part of a code: an address and at most a CA certificate (MAX_CA_PEM_CHARS)."""
MAX_CA_PEM_CHARS = 8192
MAX_HINT_HOSTS = 8
BROKER_HINT_FIELDS = frozenset({"hosts", "port", "tls", "topic_root", "ca_pem", "enrol_user", "mac"})
ENROL_USER_PREFIX = "mam_enrol_"
"""The one-time broker user of an invite: this prefix and 16 hex characters of its id."""
ENROL_PASSWORD_INFO = b"mam-fleet/v2/invite-enrol-broker"
ENROL_PASSWORD_BYTES = 24
_HOST_RE = re.compile(r"^[A-Za-z0-9._:\[\]-]{1,253}$")
_CODE_RE = re.compile(r"^(mam1\.([A-Za-z0-9][A-Za-z0-9_-]{0,62})\.[A-Za-z0-9_-]{22})"
                      rf"(?:\.([A-Za-z0-9_-]{{1,{MAX_BROKER_PART_CHARS}}}))?$")
_TTL_RE = re.compile(r"^([0-9]+(?:\.[0-9]+)?)([smhd]?)$")
_TTL_UNIT_S = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_BAD_CODE = (f"invite code is invalid: expected {CODE_PREFIX}.<session>.<{CODE_RANDOM_CHARS} characters>"
             "[.<broker part>] as `mam-orch runner invite` printed it")

__all__ = ["Answer", "BrokerHint", "InviteCode", "answer", "check_answer", "check_request", "matches", "open_password",
           "parse_message", "parse_ttl", "refusal", "request", "seal_password"]


@dataclass(frozen=True)
class BrokerHint:
    """Where a fresh runner host finds the broker, as a code carries it (not secret; MAC'd).

    Attributes:
        hosts: the fail-over list (§13); port; tls; topic_root (§2); ca_pem: the CA
            certificate(s) that verify the broker with TLS ("" none: the system's).
        enrol_user: the hub made the code's one-time broker user (`InviteCode.enrol_username`,
            password derived from the code), allowed only the session's enrol topics.
    """

    hosts: tuple[str, ...]
    port: int
    tls: bool
    topic_root: str
    ca_pem: str = ""
    enrol_user: bool = False

    def __post_init__(self) -> None:
        if not 1 <= len(self.hosts) <= MAX_HINT_HOSTS or not all(
                isinstance(h, str) and _HOST_RE.fullmatch(h) for h in self.hosts):
            raise UsageError(f"broker hosts are invalid: 1 to {MAX_HINT_HOSTS} host names or addresses")
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 1 <= self.port <= 65535:
            raise UsageError("broker port is invalid: expected 1..65535")
        if not isinstance(self.tls, bool) or not isinstance(self.enrol_user, bool):
            raise UsageError("broker tls and enrol_user are invalid: expected true or false")
        if not isinstance(self.topic_root, str):
            raise UsageError("broker topic root is invalid")
        names.topic_root(self.topic_root)
        bad_ca = UsageError(f"broker CA is invalid: expected PEM certificates, at most {MAX_CA_PEM_CHARS} "
                            "characters")
        if not isinstance(self.ca_pem, str) or len(self.ca_pem) > MAX_CA_PEM_CHARS:
            raise bad_ca
        if self.ca_pem:
            try:
                x509.load_pem_x509_certificates(self.ca_pem.encode("ascii"))
            except (ValueError, UnicodeError):
                raise bad_ca from None

    def _body(self) -> dict[str, Any]:
        return {"hosts": list(self.hosts), "port": self.port, "tls": self.tls, "topic_root": self.topic_root,
                "ca_pem": self.ca_pem, "enrol_user": self.enrol_user}

    def encode(self, key: bytes) -> str:
        """The code's broker part: base64url (no padding) of canonical JSON with its `mac`."""
        body = self._body()
        body["mac"] = _mac(key, body)
        return b64url_encode(canonical_json(body)).rstrip("=")

    @classmethod
    def decode(cls, part: str, key: bytes) -> BrokerHint:
        """Raises `UsageError` (one line, never echoing the part): not ours, changed, or malformed."""
        try:
            obj = json.loads(b64url_decode(part + "=" * (-len(part) % 4)))
        except ValueError:
            raise UsageError("invite code is invalid: its broker part is not readable (a cut copy?)") from None
        if not isinstance(obj, dict) or set(obj) != BROKER_HINT_FIELDS:
            raise UsageError("invite code is invalid: its broker part has other fields than an invite's")
        try:
            _check_mac(key, obj, "the invite code's broker part")
        except SignatureError:
            raise UsageError("invite code is invalid: its broker part does not match the code (a changed copy?)"
                             ) from None
        hosts = obj["hosts"]
        if not isinstance(hosts, list):
            raise UsageError("broker hosts are invalid: 1 to 8 host names or addresses")
        return cls(tuple(hosts), obj["port"], obj["tls"], obj["topic_root"], obj["ca_pem"], obj["enrol_user"])


@dataclass(frozen=True)
class InviteCode:
    """A parsed code: its session, the derived key and id, and where the broker is (`broker`,
    None for a code without a broker part). The repr hides the code and key.

    Attributes:
        code: the secret core `mam1.<session>.<random>`; `text` is the whole code to print.
    """

    session: str
    code: str
    broker: BrokerHint | None = field(default=None, compare=False)

    def __repr__(self) -> str:
        return f"InviteCode(session={self.session!r}, invite_id={self.invite_id!r})"

    @property
    def text(self) -> str:
        """The code as printed: the core, then its broker part when it has one."""
        return self.code if self.broker is None else f"{self.code}.{self.broker.encode(self.key)}"

    def with_broker(self, broker: BrokerHint | None) -> InviteCode:
        """This code carrying `broker`."""
        return InviteCode(self.session, self.code, broker)

    @property
    def enrol_username(self) -> str:
        """The code's one-time broker user (§16.5): `mam_enrol_` and 16 hex characters of its id."""
        return ENROL_USER_PREFIX + self.invite_id[:16]

    @property
    def enrol_password(self) -> str:
        """Its password: HKDF-SHA256(core, info "mam-fleet/v2/invite-enrol-broker"), 24 bytes as
        base64url; only a holder of the code knows it."""
        raw = HKDF(algorithm=hashes.SHA256(), length=ENROL_PASSWORD_BYTES, salt=None,
                   info=ENROL_PASSWORD_INFO).derive(self.code.encode("ascii"))
        return b64url_encode(raw).rstrip("=")

    @classmethod
    def new(cls, session: str) -> InviteCode:
        """A fresh code for `session` (128 random bits)."""
        random = keys.b64(secrets.token_bytes(CODE_RANDOM_BYTES)).rstrip("=")
        return cls(names.validate_session(session), f"{CODE_PREFIX}.{session}.{random}")

    @classmethod
    def parse(cls, text: object) -> InviteCode:
        """Raises `UsageError` with one line (never echoing the text: it may be a real code mistyped)."""
        match = _CODE_RE.fullmatch(text.strip()) if isinstance(text, str) else None
        if match is None:
            raise UsageError(_BAD_CODE)
        code = cls(match.group(2), match.group(1))
        return code if match.group(3) is None else code.with_broker(BrokerHint.decode(match.group(3), code.key))

    @property
    def invite_id(self) -> str:
        """What the hub stores and the request names: a hash of the code (32 hex characters)."""
        return hashlib.sha256(INVITE_ID_INFO + self.code.encode("ascii")).hexdigest()[:INVITE_ID_HEX_CHARS]

    @property
    def key(self) -> bytes:
        """HKDF-SHA256(code, info "mam-fleet/v2/invite"): the MAC key of both messages."""
        return HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=None,
                    info=INVITE_INFO).derive(self.code.encode("ascii"))


def parse_ttl(text: str) -> float:
    """`15m`, `90s`, `2h`, `1d` or plain seconds, in seconds. Raises `UsageError`."""
    match = _TTL_RE.fullmatch(text.strip()) if isinstance(text, str) else None
    if match is None:
        raise UsageError(f"--ttl {text!r} is invalid: expected a number with s, m, h or d, e.g. 15m")
    seconds = float(match.group(1)) * _TTL_UNIT_S[match.group(2)]
    if not MIN_TTL_S <= seconds <= MAX_TTL_S:
        raise UsageError(f"--ttl {text!r} is invalid: expected {MIN_TTL_S:g} s to {MAX_TTL_S / 86400:g} days")
    return seconds


def _mac(key: bytes, obj: dict[str, Any]) -> str:
    unsigned = {k: v for k, v in obj.items() if k != "mac"}
    return hmac.new(key, canonical_json(unsigned), hashlib.sha256).hexdigest()


def _check_mac(key: bytes, obj: dict[str, Any], what: str) -> None:
    got = obj.get("mac")
    if not isinstance(got, str) or not hmac.compare_digest(_mac(key, obj), got):
        raise SignatureError(f"{what} MAC does not verify: wrong invite code")


# ----------------------------------------------------------------- messages

def parse_message(raw: bytes) -> dict[str, Any]:
    """One enrolment message as a JSON object with a known kind and exactly its fields.

    Raises:
        UsageError: too big, not JSON, or not one of the three kinds (one line).
    """
    if len(raw) > MAX_MESSAGE_BYTES:
        raise UsageError(f"enrolment message refused: over {MAX_MESSAGE_BYTES} bytes")
    try:
        obj = json.loads(raw)
    except ValueError:
        raise UsageError("enrolment message refused: not JSON") from None
    expected = {REQUEST_KIND: REQUEST_FIELDS, ANSWER_KIND: ANSWER_FIELDS, REFUSED_KIND: REFUSED_FIELDS}
    if not isinstance(obj, dict) or obj.get("kind") not in expected or \
            set(obj) - ({BROKER_FIELD} if obj["kind"] == ANSWER_KIND else set()) != expected[obj["kind"]]:
        raise UsageError("enrolment message refused: not an enrol_invite, enrol_answer or enrol_refused object")
    names.validate_token(obj["invite_id"], "invite id")
    names.validate_session(obj["session"])
    return obj


def request(code: InviteCode, runner: keys.RunnerKeys) -> dict[str, Any]:
    """The runner's request: its public keys under the code's MAC, with a fresh nonce."""
    obj: dict[str, Any] = {"kind": REQUEST_KIND, "session": code.session, "invite_id": code.invite_id,
                           "nonce": secrets.token_hex(NONCE_BYTES), "ed25519_public": runner.ed25519_public,
                           "x25519_public": runner.x25519_public}
    obj["mac"] = _mac(code.key, obj)
    return obj


def check_request(code: InviteCode, obj: dict[str, Any]) -> keys.EnrolRequest:
    """The enrolment a request asks for, once its MAC verifies with `code` (labels come from the invite).

    Raises:
        SignatureError: wrong code; UsageError: another session, or a bad key.
    """
    if obj.get("kind") != REQUEST_KIND or obj.get("invite_id") != code.invite_id:
        raise UsageError("enrolment request refused: not a request for this invite")
    _check_mac(code.key, obj, "enrolment request")
    if obj["session"] != code.session:
        raise UsageError(f"enrolment request refused: session {obj['session']!r} is not the invite's")
    return keys.EnrolRequest.build(code.session, "", obj["ed25519_public"], obj["x25519_public"])


def answer(code: InviteCode, req: dict[str, Any], labels: tuple[str, ...], hub_publics: list[str],
           broker: tuple[str, str] | None = None) -> dict[str, Any]:
    """The hub's answer to a verified request: the labels and the hub's public keys, MAC'd.

    Args:
        broker: the runner's own broker (username, password), or None; the password is
            sealed to the request's X25519 key (`seal_password`), never sent in clear.
    """
    obj: dict[str, Any] = {"kind": ANSWER_KIND, "session": code.session, "invite_id": code.invite_id,
                           "nonce": req["nonce"], "labels": list(labels), "hub_ed25519_public": list(hub_publics)}
    if broker is not None:
        username, password = broker
        obj[BROKER_FIELD] = {"username": username, "password": seal_password(
            keys.x25519_public(req["x25519_public"]).public_bytes_raw(), password, invite_id=code.invite_id,
            nonce=req["nonce"], username=username)}
    obj["mac"] = _mac(code.key, obj)
    return obj


def _broker_key(shared_secret: bytes, epk: bytes, runner_public: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=epk + runner_public,
                info=BROKER_SEAL_INFO).derive(shared_secret)


def _broker_aad(invite_id: str, nonce: str, username: str) -> bytes:
    return canonical_json({"invite_id": invite_id, "nonce": nonce, "username": username})


def seal_password(runner_x25519: bytes, password: str, *, invite_id: str, nonce: str,
                  username: str) -> dict[str, str]:
    """Seal a broker password to a runner's raw X25519 public key (32 bytes), bound to one
    answer (invite id, nonce) and user. Returns {"alg", "epk", "nonce", "ciphertext"}, base64url."""
    ephemeral = X25519PrivateKey.generate()
    epk = ephemeral.public_key().public_bytes_raw()
    key = _broker_key(ephemeral.exchange(X25519PublicKey.from_public_bytes(runner_x25519)), epk, runner_x25519)
    gcm_nonce = secrets.token_bytes(GCM_NONCE_BYTES)
    ciphertext = AESGCM(key).encrypt(gcm_nonce, password.encode("utf-8"), _broker_aad(invite_id, nonce, username))
    return {"alg": BROKER_SEAL_ALG, "epk": b64url_encode(epk), "nonce": b64url_encode(gcm_nonce),
            "ciphertext": b64url_encode(ciphertext)}


def open_password(private: X25519PrivateKey, sealed: object, *, invite_id: str, nonce: str, username: str) -> str:
    """The broker password `seal_password` sealed to this runner.

    Raises:
        SignatureError: one line: not a seal, another runner's, another answer's, tampered, oversized.
        ConfigError: it opens, but is no password a config can hold (a newline, a quote, ...).
    """
    try:
        if not isinstance(sealed, dict) or set(sealed) != SEALED_FIELDS or sealed["alg"] != BROKER_SEAL_ALG:
            raise ValueError("shape")
        epk, gcm_nonce = b64url_decode(sealed["epk"]), b64url_decode(sealed["nonce"])
        ciphertext = b64url_decode(sealed["ciphertext"])
        if len(epk) != KEY_BYTES or len(gcm_nonce) != GCM_NONCE_BYTES or len(ciphertext) > MAX_SEALED_PASSWORD_BYTES:
            raise ValueError("size")
        shared = private.exchange(X25519PublicKey.from_public_bytes(epk))
        key = _broker_key(shared, epk, private.public_key().public_bytes_raw())
        password = AESGCM(key).decrypt(gcm_nonce, ciphertext, _broker_aad(invite_id, nonce, username))
        return check_secret("the broker password in the hub's answer", password.decode("utf-8"))
    except (ValueError, TypeError, KeyError, UnicodeError, InvalidTag):
        raise SignatureError(_BAD_SEAL) from None


def refusal(req: dict[str, Any], reason: str) -> dict[str, Any]:
    """The hub's refusal of a request (no MAC: the hub may not know the code)."""
    return {"kind": REFUSED_KIND, "session": req["session"], "invite_id": req["invite_id"], "nonce": req["nonce"],
            "reason": reason[:MAX_REASON_CHARS]}


@dataclass(frozen=True)
class Answer:
    """What a verified answer gives the runner: its labels, the hub's public keys, and its own
    broker user (username and the still sealed password), or None. The repr hides the seal."""

    labels: tuple[str, ...]
    hub_publics: list[str]
    broker_user: str | None = None
    sealed_password: dict[str, Any] | None = field(default=None, repr=False)


def check_answer(code: InviteCode, req: dict[str, Any], obj: dict[str, Any]) -> Answer:
    """The labels, hub public keys and broker user of an answer to `req`.

    Raises:
        ProtocolError: the hub refused (its reason); SignatureError: the MAC does not verify
            (not from the hub holding this code); UsageError: a bad label, key or broker user.
    """
    if obj.get("kind") == REFUSED_KIND:
        reason = obj["reason"] if isinstance(obj["reason"], str) else "no reason"
        raise ProtocolError(f"the hub refused the invite: {reason[:MAX_REASON_CHARS]}")
    _check_mac(code.key, obj, "the hub's answer")
    hub = obj["hub_ed25519_public"]
    if not isinstance(hub, list) or not isinstance(obj["labels"], list):
        raise UsageError("the hub's answer is invalid: labels and hub_ed25519_public must be arrays")
    publics = [keys.public_text(keys.ed25519_public(text, "hub public key")) for text in hub]
    broker = obj.get(BROKER_FIELD)
    if broker is None:
        return Answer(keys.labels_of(obj["labels"]), publics)
    if not isinstance(broker, dict) or set(broker) != BROKER_FIELDS or not isinstance(broker["password"], dict) \
            or not is_user_name(broker["username"]):
        raise UsageError("the hub's answer is invalid: broker must be an object with a username (1-64 letters, "
                         "digits, '_' or '-') and a sealed password")
    return Answer(keys.labels_of(obj["labels"]), publics, broker["username"], broker["password"])


def matches(req: dict[str, Any], obj: dict[str, Any]) -> bool:
    """True when `obj` is an answer or refusal to `req` (same invite id and nonce)."""
    return (obj.get("kind") in (ANSWER_KIND, REFUSED_KIND) and obj.get("invite_id") == req["invite_id"]
            and obj.get("nonce") == req["nonce"])
