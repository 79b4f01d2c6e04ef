"""The v2 keys of PROTOCOL §16 on disk: the hub's Ed25519 key, a runner's
Ed25519 and X25519 keys, and the hub public keys a runner trusts.

File format (one for every key file): one line, the raw 32-byte key as
base64url with padding (§16), then a newline. Private key files are mode 0600
in `.mam/keys/` (0700); a private key file readable by group or others is
refused, as ssh does. Paths come from `names` (`hub_key_path`, ...).

The hub key is made by `mam-orch init` or on first use (`hub_key`);
`stage_hub_key` makes the next one for runners to trust first, `rotate_hub_key`
switches to it and keeps the old public key as `previous`. A runner's keys are
made by `mam-runner enroll`; its trusted hub keys (`hub-trusted.pub`, one key a
line: the current one, and the previous one during a rotation) by
`mam-runner trust-hub`. No function here logs or puts a private key in an
error message or a repr.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey

from mam.shared.protocol import names
from mam.shared.protocol.errors import ConfigError, UsageError
from mam.shared.protocol.wire.canonical import canonical_json
from mam.shared.protocol.wire.fields import b64url_decode, b64url_encode
from mam.shared.store.fsio import atomic_write, read_capped

KEY_BYTES = 32
"""Raw Ed25519 seeds, X25519 private keys and both public keys are 32 bytes (§16)."""
MAX_KEY_FILE_BYTES = 4096
"""A key file is one short line; anything bigger is not ours."""
MAX_TRUSTED_HUB_KEYS = 2
"""A runner trusts the hub's current key and, during a rotation, its previous one (§16)."""
KEYS_DIR_MODE = 0o700
_OPEN_TO_OTHERS = stat.S_IRWXG | stat.S_IRWXO


def b64(raw: bytes) -> str:
    """base64url with padding, as every §16 key and signature is written."""
    return b64url_encode(raw)


def _raw32(text: object, what: str) -> bytes:
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
    return Ed25519PublicKey.from_public_bytes(_raw32(text, what))


def x25519_public(text: object, what: str = "X25519 public key") -> X25519PublicKey:
    """An X25519 public key from its base64url text (§16); a low-order point (all zeros, ...),
    with which no shared secret can be made, is refused. Raises `UsageError`."""
    key = X25519PublicKey.from_public_bytes(_raw32(text, what))
    try:
        X25519PrivateKey.generate().exchange(key)
    except ValueError:
        raise UsageError(f"{what} is invalid: a low-order point") from None
    return key


def public_text(key: Ed25519PrivateKey | X25519PrivateKey | Ed25519PublicKey | X25519PublicKey) -> str:
    """The base64url text of a key's raw public bytes (§16)."""
    public = key.public_key() if isinstance(key, (Ed25519PrivateKey, X25519PrivateKey)) else key
    return b64(public.public_bytes_raw())


# ------------------------------------------------------------------ files

def _ensure_keys_dir(root: Path) -> Path:
    folder = names.keys_dir(root)
    try:
        folder.mkdir(mode=KEYS_DIR_MODE, parents=True, exist_ok=True)
        os.chmod(folder, KEYS_DIR_MODE)
    except OSError as exc:
        raise ConfigError(f"{folder}: cannot create the keys folder ({exc.strerror or exc})") from None
    return folder


def _write_key(root: Path, path: Path, raw: bytes) -> None:
    _ensure_keys_dir(root)
    atomic_write(path, (b64(raw) + "\n").encode("ascii"), what=str(path), error=ConfigError)


def _read_text(path: Path, *, private: bool) -> str:
    """A key file's text; `ConfigError` (one line, no content) when missing, open to others, or unreadable."""
    try:
        if private and os.stat(path).st_mode & _OPEN_TO_OTHERS:
            raise ConfigError(f"{path}: a private key readable by group or others is refused; chmod 600 it")
        return read_capped(path, MAX_KEY_FILE_BYTES).decode("ascii")
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such key file") from None
    except (OSError, OverflowError, UnicodeError) as exc:
        raise ConfigError(f"{path}: cannot read ({type(exc).__name__})") from None


def _read_key(path: Path) -> bytes:
    try:
        return _raw32(_read_text(path, private=True), str(path))
    except UsageError as exc:
        raise ConfigError(str(exc)) from None


# ------------------------------------------------------------------- hub

def hub_key(root: Path, *, create: bool = True) -> Ed25519PrivateKey:
    """The hub's Ed25519 private key (`.mam/keys/hub.ed25519`, §16), made on first use.

    Raises:
        ConfigError: the file is unreadable, open to others, or not a key; missing and not `create`.
    """
    path = names.hub_key_path(root)
    if create and not path.exists():
        key = Ed25519PrivateKey.generate()
        _write_key(root, path, key.private_bytes_raw())
        return key
    return Ed25519PrivateKey.from_private_bytes(_read_key(path))


def hub_previous_public(root: Path) -> str | None:
    """The hub's public key before its last rotation (base64url), or None (§16)."""
    path = names.hub_previous_public_path(root)
    if not path.exists():
        return None
    text = _read_text(path, private=False).strip()
    try:
        _raw32(text, str(path))
    except UsageError as exc:
        raise ConfigError(str(exc)) from None
    return text


def stage_hub_key(root: Path) -> str:
    """Make the next hub key (`hub.next.ed25519`) without using it yet, so runners can trust it
    before the hub signs with it (§16: rotation without downtime). Staging again keeps the staged key.

    Returns:
        the staged public key, base64url.
    Raises:
        ConfigError: there is no hub key yet, or a file cannot be read or written.
    """
    hub_key(root, create=False)
    path = names.hub_next_key_path(root)
    if path.exists():
        return public_text(Ed25519PrivateKey.from_private_bytes(_read_key(path)))
    staged = Ed25519PrivateKey.generate()
    _write_key(root, path, staged.private_bytes_raw())
    return public_text(staged)


def staged_hub_public(root: Path) -> str | None:
    """The staged next hub public key (base64url), or None."""
    path = names.hub_next_key_path(root)
    return public_text(Ed25519PrivateKey.from_private_bytes(_read_key(path))) if path.exists() else None


def rotate_hub_key(root: Path) -> tuple[Ed25519PrivateKey, str]:
    """Switch to a new hub key: the staged one (`stage_hub_key`) if any, else a fresh one; the
    current public key is kept as `previous` (§16).

    Returns:
        (the new private key, the previous public key as base64url).
    Raises:
        ConfigError: there is no hub key yet (nothing to rotate), or a file cannot be written.
    """
    old = hub_key(root, create=False)
    previous = public_text(old)
    staged_path = names.hub_next_key_path(root)
    new = Ed25519PrivateKey.from_private_bytes(_read_key(staged_path)) if staged_path.exists() \
        else Ed25519PrivateKey.generate()
    atomic_write(names.hub_previous_public_path(root), (previous + "\n").encode("ascii"),
                 what="previous hub public key", error=ConfigError)
    _write_key(root, names.hub_key_path(root), new.private_bytes_raw())
    staged_path.unlink(missing_ok=True)
    return new, previous


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


def create_runner_keys(root: Path, *, force: bool = False) -> RunnerKeys:
    """Make and store a runner's Ed25519 and X25519 keys (0600, §16).

    Raises:
        ConfigError: keys exist and not `force` (nothing written), or a write failed.
    """
    paths = [names.runner_key_path(root, kind) for kind in ("ed25519", "x25519")]
    existing = [str(p) for p in paths if p.exists()]
    if existing and not force:
        raise ConfigError(f"{', '.join(existing)}: already exists; use --force to make new keys "
                          "(the hub must then enrol the new public keys)")
    keys = RunnerKeys(Ed25519PrivateKey.generate(), X25519PrivateKey.generate())
    _write_key(root, paths[0], keys.ed25519.private_bytes_raw())
    _write_key(root, paths[1], keys.x25519.private_bytes_raw())
    return keys


def load_runner_keys(root: Path) -> RunnerKeys | None:
    """A runner's keys, or None when it was never enrolled (neither file exists).

    Raises:
        ConfigError: one of the two is missing, open to others, or not a key.
    """
    ed_path, x_path = (names.runner_key_path(root, kind) for kind in ("ed25519", "x25519"))
    if not ed_path.exists() and not x_path.exists():
        return None
    return RunnerKeys(Ed25519PrivateKey.from_private_bytes(_read_key(ed_path)),
                      X25519PrivateKey.from_private_bytes(_read_key(x_path)))


def write_trusted_hub_keys(root: Path, texts: Sequence[str]) -> list[str]:
    """Store the hub public keys this runner verifies dispatches and controls with (§16).

    Args:
        texts: base64url Ed25519 public keys: the current one, then the previous one during a rotation.
    Returns:
        the keys written, normalised and without duplicates.
    Raises:
        UsageError: none, more than two, or one that is not a key (nothing written).
    """
    keys: list[str] = []
    for index, text in enumerate(texts, 1):
        public = public_text(ed25519_public(text, f"hub public key {index}"))
        if public not in keys:
            keys.append(public)
    if not 1 <= len(keys) <= MAX_TRUSTED_HUB_KEYS:
        raise UsageError(f"give 1 or {MAX_TRUSTED_HUB_KEYS} hub public keys (current, then previous), "
                         f"got {len(keys)}")
    _ensure_keys_dir(root)
    atomic_write(names.trusted_hub_keys_path(root), "".join(k + "\n" for k in keys).encode("ascii"),
                 what="trusted hub keys", error=ConfigError)
    return keys


def trusted_hub_keys(root: Path) -> tuple[Ed25519PublicKey, ...]:
    """The hub public keys this runner trusts (§16); empty when none were stored.

    Raises:
        ConfigError: the file is unreadable or holds something that is not a key.
    """
    path = names.trusted_hub_keys_path(root)
    if not path.exists():
        return ()
    lines = [line.strip() for line in _read_text(path, private=False).splitlines() if line.strip()]
    try:
        return tuple(ed25519_public(line, f"{path} line {n}") for n, line in enumerate(lines, 1))
    except UsageError as exc:
        raise ConfigError(str(exc)) from None


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


__all__ = ["ENROL_KIND", "KEY_BYTES", "MAX_TRUSTED_HUB_KEYS", "EnrolRequest", "RunnerKeys", "b64",
           "create_runner_keys", "ed25519_public", "hub_key", "hub_previous_public", "load_runner_keys",
           "public_text", "rotate_hub_key", "stage_hub_key",
           "staged_hub_public", "texts", "trusted_hub_keys", "write_trusted_hub_keys", "x25519_public"]
