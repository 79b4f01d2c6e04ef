"""`mam-runner enroll` and `mam-runner trust-hub` (PROTOCOL §16): make this
host's Ed25519 and X25519 keys (0600, `.mam/keys/`), print the one-line
enrolment request for `mam-orch runner add` (session, labels, public keys: no
secret), and store the hub public keys this runner verifies dispatches and
controls with. `identity` reads back what `enroll` recorded.
"""

from __future__ import annotations

import io
import os
from collections.abc import Mapping
from pathlib import Path

from dotenv.parser import parse_stream

from mam.shared import config
from mam.shared.protocol import names
from mam.shared.protocol.crypto import keys
from mam.shared.protocol.crypto.keys import EnrolRequest
from mam.shared.protocol.errors import ConfigError, UsageError
from mam.shared.store import keyfiles
from mam.shared.store.fsio import atomic_write, json_line, read_json_object
from mam.shared.store.root import resolve_root

MAX_IDENTITY_BYTES = 8 * 1024

__all__ = ["enroll", "identity", "trust_hub"]

Workspace = str | os.PathLike[str] | None


def _root(workspace: Workspace) -> Path:
    root = resolve_root(workspace)
    if not root.is_dir():
        raise UsageError(f"workspace {str(root)!r} does not exist")
    return root


def enroll(*, session: str, labels: str | None, workspace: Workspace, force: bool = False) -> EnrolRequest:
    """Make this runner's keys and return its enrolment request (§16).

    Args:
        session: the session it will serve (§1); labels: comma-separated (§14) or None.
        force: make new keys even if some exist (the hub must then enrol them again).
    Raises:
        UsageError: a bad session or label (nothing written); ConfigError: keys exist without
            `force`, or a file cannot be written.
    """
    names.validate_session(session)
    keys.labels_of(labels or "")  # refused before any key is written
    root = _root(workspace)
    made = keyfiles.create_runner_keys(root, force=force)
    request = EnrolRequest.build(session, labels or "", made.ed25519_public, made.x25519_public)
    atomic_write(names.runner_identity_path(root), json_line(request.to_dict()), what="runner identity",
                 error=ConfigError)
    return request


def identity(root: Path) -> EnrolRequest | None:
    """What `enroll` recorded on this host (session, labels, public keys), or None before it ran.

    Raises:
        ConfigError: the file is unreadable or not a request.
    """
    path = names.runner_identity_path(root)
    try:
        obj = read_json_object(path, MAX_IDENTITY_BYTES)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: cannot read ({type(exc).__name__})") from None
    try:
        return EnrolRequest.build(obj.get("session"), obj.get("labels"), obj.get("ed25519_public"),
                                  obj.get("x25519_public"))
    except UsageError as exc:
        raise ConfigError(f"{path}: {exc}") from None


def trust_hub(public_keys: list[str], *, workspace: Workspace) -> list[str]:
    """Store the hub public keys this runner accepts dispatches and controls from (§16):
    the current one, and the previous or next one during a rotation.

    Raises:
        UsageError: none, more than two, or not a key (nothing written).
    """
    return keyfiles.write_trusted_hub_keys(_root(workspace), public_keys)


def write_env(root: Path, values: Mapping[str, str]) -> Path:
    """Set `values` in the env file this runner reads (§13: MAM_ENV_FILE, even when it does not
    exist yet; else the `.mam.env` found, else the workspace's), in one atomic write of mode
    0600 that keeps every other line (python-dotenv's parser). Raises `ConfigError`."""
    explicit = os.environ.get("MAM_ENV_FILE")
    path = Path(explicit).expanduser() if explicit else \
        config.find_env_file(workspace=root) or root / config.ENV_FILE_NAME
    try:
        text = path.read_text(encoding="utf-8") if path.exists() else ""
    except (OSError, UnicodeError) as exc:
        raise ConfigError(f"{path}: cannot read it to set the broker settings ({exc})") from None
    kept = [binding.original.string for binding in parse_stream(io.StringIO(text)) if binding.key not in values]
    if kept and not kept[-1].endswith("\n"):
        kept[-1] += "\n"
    lines = [*kept, *(f"{key}={value}\n" for key, value in values.items())]
    atomic_write(path, "".join(lines).encode("utf-8"), what=str(path), error=ConfigError)
    return path
