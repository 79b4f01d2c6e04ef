"""Configuration of PROTOCOL §13: `BrokerConfig`, environment and `.mam.env`
resolution, the dispatch secret, and the workspace root search of §8.

Resolution (§13): the process environment always wins; then, if
`MAM_ENV_FILE` is set, that file alone (missing: skipped and no other file is
searched; exists but unreadable or undecodable: `EnvFileError`); else the
first `.mam.env` found in `MAM_REAL_ROOT`, `WORKSPACE_ROOT`, the nearest
parent holding `.agents` or `.git`, then the current directory. Then the
per-job overrides from a record's `broker` block. `.mam.env` is parsed with
python-dotenv (comments, `export `, quotes, CRLF).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Mapping

from mam.shared.errors import ConfigError, EnvFileError

PUBLIC_BROKER = "broker.hivemq.com"
ENV_FILE_NAME = ".mam.env"
MIN_SECRET_LEN = 32
ROOT_MARKERS = (".agents", ".git")


def _marker_parent(start: Path) -> Path | None:
    """The nearest directory at or above `start` holding `.agents` or `.git`."""
    start = start.resolve()
    for candidate in (start, *start.parents):
        if any((candidate / marker).exists() for marker in ROOT_MARKERS):
            return candidate
    return None


def root_candidates(workspace: str | os.PathLike[str] | None = None,
                    environ: Mapping[str, str] | None = None,
                    cwd: Path | None = None) -> list[Path]:
    """The workspace root candidates of §8/§13, in order, without duplicates.

    Args:
        workspace: an explicit `--workspace` directory (first when given).
        environ: variables to read MAM_REAL_ROOT and WORKSPACE_ROOT from (default os.environ).
        cwd: the directory to start the `.agents`/`.git` walk from (default os.getcwd()).
    Returns:
        candidate directories: workspace, MAM_REAL_ROOT, WORKSPACE_ROOT, the
        nearest marker parent, the current directory.
    """
    env = os.environ if environ is None else environ
    here = Path(cwd) if cwd is not None else Path.cwd()
    found: list[Path] = []
    for value in (workspace, env.get("MAM_REAL_ROOT"), env.get("WORKSPACE_ROOT")):
        if value:
            found.append(Path(value).expanduser())
    marker = _marker_parent(here)
    if marker is not None:
        found.append(marker)
    found.append(here)
    unique: list[Path] = []
    for path in found:
        if path not in unique:
            unique.append(path)
    return unique


def resolve_root(workspace: str | os.PathLike[str] | None = None,
                 environ: Mapping[str, str] | None = None,
                 cwd: Path | None = None) -> Path:
    """The registry root of §8: `--workspace`, else MAM_REAL_ROOT, else
    WORKSPACE_ROOT, else the nearest parent holding `.agents` or `.git`,
    else the current directory.

    Raises:
        ConfigError: an explicitly named root that exists but is not a directory.
    """
    root = root_candidates(workspace, environ, cwd)[0]
    if root.exists() and not root.is_dir():
        raise ConfigError(f"workspace {str(root)!r} is not a directory")
    return root.resolve()


@dataclass(frozen=True)
class BrokerConfig:
    """Where and how to connect to the MQTT broker (§13).

    `hosts` is the fail-over list (in order) parsed from a comma-separated
    MQTT_BROKER. The repr never shows the password.
    """

    hosts: tuple[str, ...] = (PUBLIC_BROKER,)
    port: int = 1883
    tls: bool = False
    username: str = ""
    password: str = field(default="", repr=False)
    ca_certs: str = ""
    certfile: str = ""
    keyfile: str = ""
    client_id_prefix: str = "hermes"
    keepalive_s: int = 60
    topic_root: str = "python/mqtt"
    transport: str = "tcp"  # "tcp" or "websockets"
    ws_path: str = "/mqtt"

    @property
    def host(self) -> str:
        """The first broker of the list."""
        return self.hosts[0]

    @property
    def is_public(self) -> bool:
        """True when any broker of the list is the public sandbox broker."""
        return PUBLIC_BROKER in self.hosts

    def __repr__(self) -> str:  # explicit, so no future field leaks the secret
        shown = ", ".join(
            f"{f.name}={getattr(self, f.name)!r}" for f in fields(self) if f.name != "password"
        )
        return f"BrokerConfig({shown}, password={'***' if self.password else ''!r})"

    __str__ = __repr__

    def with_overrides(self, **changes: Any) -> "BrokerConfig":
        """A copy with `changes` applied (field names as above)."""
        return replace(self, **changes)


def new_secret() -> str:
    """A fresh random secret for passwords and MAM_DISPATCH_SECRET (43 URL-safe chars)."""
    import secrets

    return secrets.token_urlsafe(32)


def _quote_env_value(value: str) -> str:
    if value == "" or any(c in value for c in " #'\"\\$`\t") :
        escaped = value.replace("\\", "\\\\").replace('"', '\\"')
        return f'"{escaped}"'
    return value


def write_env_file(path: str | os.PathLike[str], values: Mapping[str, str], *,
                   header: str = "", overwrite: bool = False) -> Path:
    """Write a `.mam.env` file atomically with mode 0600 (it holds secrets).

    Args:
        path: the file to write.
        values: variable names to values, written in the given order.
        header: comment lines put first (without the leading '# ').
        overwrite: replace an existing file; otherwise refuse.
    Returns:
        the path written.
    Raises:
        ConfigError: the file exists and `overwrite` is false, or it cannot be written.
    """
    target = Path(path)
    if target.exists() and not overwrite:
        raise ConfigError(f"{target}: already exists; use --force to overwrite it")
    lines = [f"# {line}" for line in header.splitlines()] if header else []
    for name, value in values.items():
        if "\n" in str(value) or "\r" in str(value):
            raise ConfigError(f"{name}: a value must not contain a line break")
        lines.append(f"{name}={_quote_env_value(str(value))}")
    data = ("\n".join(lines) + "\n").encode("utf-8")
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, 0o600)
        os.replace(tmp, target)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise ConfigError(f"{target}: cannot write ({type(exc).__name__}: {exc.strerror})") from exc
    return target
