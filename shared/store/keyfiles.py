"""The v2 key files of §16 under `.mam/keys/` (0700): the hub's Ed25519 key, a
runner's Ed25519 and X25519 keys, and the hub public keys a runner trusts.

File format (one for every key file): one line, the raw 32-byte key as
base64url with padding (§16), then a newline. Private key files are mode 0600;
a private key file readable by group or others is refused, as ssh does. Paths
come from `names` (`hub_key_path`, ...).

The hub key is made by `mam-orch init` or on first use (`hub_key`);
`stage_hub_key` makes the next one for runners to trust first, `rotate_hub_key`
switches to it and keeps the old public key as `previous`. A runner's keys are
made by `mam-runner enroll`; its trusted hub keys (`hub-trusted.pub`, one key a
line: the current one, and the previous one during a rotation) by
`mam-runner trust-hub`. No function here logs or puts a private key in an
error message or a repr.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from mam.shared.protocol import names
from mam.shared.protocol.crypto.keys import RunnerKeys, b64, ed25519_public, public_text, raw_key
from mam.shared.protocol.errors import ConfigError, UsageError
from mam.shared.store.fsio import atomic_write, read_capped

MAX_KEY_FILE_BYTES = 4096
"""A key file is one short line; anything bigger is not ours."""
MAX_TRUSTED_HUB_KEYS = 2
"""A runner trusts the hub's current key and, during a rotation, its previous one (§16)."""
KEYS_DIR_MODE = 0o700
_OPEN_TO_OTHERS = stat.S_IRWXG | stat.S_IRWXO


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
        return raw_key(_read_text(path, private=True), str(path))
    except UsageError as exc:
        raise ConfigError(str(exc)) from None


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
        raw_key(text, str(path))
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
