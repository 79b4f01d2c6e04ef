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

import io
import os
import secrets
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, TextIO

from dotenv import dotenv_values

from mam.shared.protocol.crypto import MIN_SECRET_CHARS
from mam.shared.protocol.errors import ConfigError, EnvFileError, UsageError
from mam.shared.protocol.names import DEFAULT_TOPIC_ROOT, topic_root
from mam.shared.protocol.wire import Contract
from mam.shared.store.fsio import atomic_write, read_capped
from mam.shared.store.root import resolve_root, root_candidates

PUBLIC_BROKER = "broker.hivemq.com"
NO_BROKER_HOST = "(no broker configured)"
"""What `BrokerConfig.host` says when MQTT_BROKER is unset (§13: there is no default broker)."""
NO_BROKER = ("no broker configured: set MQTT_BROKER in .mam.env (`mam-orch broker up` runs one on this host, "
             "`mam-orch init` writes the file); the public test broker broker.hivemq.com is used only when named "
             "there")
ENV_FILE_NAME = ".mam.env"

# new_secret(): 32 random bytes, 43 URL-safe characters.
SECRET_BYTES = 32
MIN_PORT, MAX_PORT = 1, 65535
DEFAULT_MQTT_PORT = 1883
DEFAULT_CLIENT_ID_PREFIX = "hermes"
MAX_CLIENT_ID_PREFIX_CHARS = 32
DEFAULT_KEEPALIVE_S = 60
MIN_KEEPALIVE_S = 5
MAX_KEEPALIVE_S = 65535  # MQTT's 16-bit keep-alive field
DEFAULT_TRANSPORT = "tcp"
TRANSPORTS = ("tcp", "websockets")
DEFAULT_WS_PATH = "/mqtt"
# Bounds of env_int / env_float settings such as MAM_HEARTBEAT_SEC and MAM_CANCEL_GRACE_S.
MAX_ENV_INT = 10**7
MAX_ENV_SECONDS = 86400.0
MAX_HOST_CHARS = 253  # a DNS name
MAX_HOSTS = 16  # a fail-over list (§13): clients and `gc --reclear` walk every host


@dataclass(frozen=True)
class BrokerConfig:
    """Where and how to connect to the MQTT broker (§13).

    `hosts` is the fail-over list (in order) parsed from a comma-separated
    MQTT_BROKER. The repr never shows the password.
    """

    hosts: tuple[str, ...] = (PUBLIC_BROKER,)
    port: int = DEFAULT_MQTT_PORT
    tls: bool = False
    username: str = ""
    password: str = field(default="", repr=False)
    ca_certs: str = ""
    certfile: str = ""
    keyfile: str = ""
    client_id_prefix: str = DEFAULT_CLIENT_ID_PREFIX
    keepalive_s: int = DEFAULT_KEEPALIVE_S
    topic_root: str = DEFAULT_TOPIC_ROOT
    transport: str = DEFAULT_TRANSPORT  # one of TRANSPORTS
    ws_path: str = DEFAULT_WS_PATH

    @property
    def host(self) -> str:
        """The first broker of the list (NO_BROKER_HOST when none is configured)."""
        return self.hosts[0] if self.hosts else NO_BROKER_HOST

    @property
    def configured(self) -> bool:
        """False when MQTT_BROKER was unset: connecting refuses with NO_BROKER (§13)."""
        return bool(self.hosts)

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

    def with_overrides(self, **changes: Any) -> BrokerConfig:
        """A copy with `changes` applied (field names as above)."""
        return replace(self, **changes)


def new_secret() -> str:
    """A fresh random secret for passwords and MAM_DISPATCH_SECRET (43 URL-safe chars)."""
    return secrets.token_urlsafe(SECRET_BYTES)


def _quote_env_value(value: str) -> str:
    if value == "" or any(c in value for c in " #'\"\\$`\t"):
        escaped = value.replace("\\", "\\\\").replace('"', '\\"')
        return f'"{escaped}"'
    return value


def write_env_file(path: str | os.PathLike[str], values: Mapping[str, str], *,
                   header: str = "", overwrite: bool = False, durable: bool = True) -> Path:
    """Write a `.mam.env` file atomically with mode 0600 (it holds secrets).

    Args:
        path: the file to write.
        values: variable names to values, written in the given order.
        header: comment lines put first (without the leading '# ').
        overwrite: replace an existing file; otherwise refuse.
        durable: fsync the file and its folder before returning; False for a file that
            is read at once and means nothing after a power loss (an agent's broker.env).
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
    atomic_write(target, data, what=target.name, error=ConfigError, durable=durable)
    return target


# ------------------------------------------------------------- resolution (§13)

_TRUE = {"true": True, "1": True, "false": False, "0": False}
MAX_ENV_FILE_BYTES = 64 * 1024


def read_env_file(path: str | os.PathLike[str]) -> dict[str, str]:
    """Parse one `.mam.env` file with python-dotenv (comments, `export `, quotes, CRLF).

    Interpolation is off: a `$` in a password stays a `$`.

    Returns:
        the variables it sets (names without a value are dropped).
    Raises:
        EnvFileError: the file exists but cannot be read (a directory, no
        permission, larger than 64 KiB) or is not UTF-8.
    """
    target = Path(path)
    try:
        text = read_capped(target, MAX_ENV_FILE_BYTES).decode("utf-8")
    except (OSError, UnicodeDecodeError, OverflowError) as exc:
        raise EnvFileError(str(target), exc) from exc
    parsed = dotenv_values(stream=io.StringIO(text), interpolate=False)
    return {name: value for name, value in parsed.items() if value is not None}


def find_env_file(environ: Mapping[str, str] | None = None, cwd: Path | None = None,
                  workspace: str | os.PathLike[str] | None = None) -> Path | None:
    """The `.mam.env` file that §13 says to read, or None.

    With MAM_ENV_FILE set, that file alone (None when it does not exist: no
    other file is searched). Otherwise the first `.mam.env` in `workspace`
    (a CLI's `--workspace`, searched first when given), MAM_REAL_ROOT,
    WORKSPACE_ROOT, the nearest parent holding `.agents`/`.git`, then the
    current directory.
    """
    env = os.environ if environ is None else environ
    explicit = env.get("MAM_ENV_FILE")
    if explicit:
        path = Path(explicit).expanduser()
        return path if path.exists() else None
    for root in root_candidates(workspace, env, cwd):
        candidate = root / ENV_FILE_NAME
        if candidate.exists():
            return candidate
    return None


def load_env(environ: Mapping[str, str] | None = None, cwd: Path | None = None,
             workspace: str | os.PathLike[str] | None = None) -> dict[str, str]:
    """The effective settings of §13: the env file's values under the process
    environment (the environment always wins).

    Args:
        environ: the process environment (default os.environ).
        cwd: where the `.agents`/`.git` walk starts (default the current directory).
        workspace: a `--workspace` directory searched first for `.mam.env`.
    Returns:
        a new dict; os.environ is not modified.
    Raises:
        EnvFileError: the chosen file exists but cannot be read or decoded.
    """
    env = dict(os.environ if environ is None else environ)
    path = find_env_file(env, cwd, workspace)
    merged = read_env_file(path) if path is not None else {}
    merged.update(env)
    return merged


def _parse_bool(name: str, value: str) -> bool:
    try:
        return _TRUE[value.strip().lower()]
    except KeyError:
        raise ConfigError(f"{name}={value!r} is invalid: expected true, false, 1 or 0") from None


def _parse_int(name: str, value: str, low: int, high: int) -> int:
    try:
        number = int(value.strip())
    except ValueError:
        raise ConfigError(f"{name}={value!r} is invalid: expected an integer") from None
    if not low <= number <= high:
        raise ConfigError(f"{name}={number} is out of range {low}..{high}")
    return number


def _parse_hosts(value: str, name: str = "MQTT_BROKER") -> tuple[str, ...]:
    """`value` split at commas into 1..MAX_HOSTS host names (§13 fail-over list).

    Raises:
        ConfigError: naming `name` (the variable or the override key); values shown escaped, cut at 40.
    """
    hosts = tuple(part.strip() for part in value.split(",") if part.strip())
    if not hosts:
        raise ConfigError(f"{name}={value[:40]!r} is invalid: no host given")
    if len(hosts) > MAX_HOSTS:
        raise ConfigError(f"{name} lists {len(hosts)} hosts; at most {MAX_HOSTS}")
    for host in hosts:
        if any(c.isspace() for c in host) or "/" in host or len(host) > MAX_HOST_CHARS:
            raise ConfigError(f"{name} host {host[:40]!r} is invalid: expected a host name or address")
    return hosts


def _check_file(name: str, value: str) -> str:
    if value and not Path(value).expanduser().is_file():
        raise ConfigError(f"{name}={value!r}: no such file")
    return str(Path(value).expanduser()) if value else ""


# Record `broker` block keys (§13 per-job overrides) -> BrokerConfig fields.
_JOB_OVERRIDES = {"host": "hosts", "hosts": "hosts", "port": "port", "tls": "tls",
                  "username": "username", "ca_certs": "ca_certs", "certfile": "certfile",
                  "keyfile": "keyfile", "client_id_prefix": "client_id_prefix",
                  "keepalive": "keepalive_s", "keepalive_s": "keepalive_s", "topic_root": "topic_root",
                  "transport": "transport", "ws_path": "ws_path"}


_CLIENT_ID_PREFIX_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")


def _check_client_id_prefix(value: str) -> str:
    """Refuse an MQTT_CLIENT_ID_PREFIX that is not 1-32 letters, digits, '-' or '_' (§13):
    client ids are `<prefix>-<role>-<random>`, and MQTT 3.1.1 section 3.1.3.1 only guarantees
    letters and digits, so a bad prefix would otherwise fail late, at connect time.

    Raises:
        ConfigError: naming the variable and the rule (the value is shown escaped).
    """
    if not (1 <= len(value) <= MAX_CLIENT_ID_PREFIX_CHARS and set(value) <= _CLIENT_ID_PREFIX_CHARS):
        raise ConfigError(f"MQTT_CLIENT_ID_PREFIX={value[:40]!r} is invalid: "
                          f"use 1-{MAX_CLIENT_ID_PREFIX_CHARS} letters, digits, '-' or '_'")
    return value


def broker_config(job_broker: Mapping[str, Any] | None = None, *,
                  environ: Mapping[str, str] | None = None, cwd: Path | None = None,
                  workspace: str | os.PathLike[str] | None = None,
                  warn: bool = True) -> BrokerConfig:
    """Resolve the broker settings of §13.

    Args:
        job_broker: a record's `broker` block (per-job overrides; never a password).
        environ: the process environment (default os.environ).
        cwd: start of the `.agents`/`.git` walk (default the current directory).
        workspace: a `--workspace` directory searched first for `.mam.env`.
        warn: print the public-broker warning on stderr when it applies.
    Returns:
        the BrokerConfig.
    Raises:
        EnvFileError: the env file exists but cannot be read.
        ConfigError: a variable or override has a bad value.
    """
    env = load_env(environ, cwd, workspace)
    try:
        root = topic_root(env.get("MAM_TOPIC_ROOT") or None)
    except UsageError as exc:
        raise ConfigError(f"MAM_TOPIC_ROOT: {exc}") from None
    cfg = BrokerConfig(
        hosts=_parse_hosts(env["MQTT_BROKER"]) if env.get("MQTT_BROKER") else (),  # §13: no default broker
        port=_parse_int("MQTT_PORT", env.get("MQTT_PORT") or str(DEFAULT_MQTT_PORT), MIN_PORT, MAX_PORT),
        tls=_parse_bool("MQTT_TLS", env.get("MQTT_TLS") or "false"),
        username=env.get("MQTT_USERNAME", ""),
        password=env.get("MQTT_PASSWORD", ""),
        ca_certs=_check_file("MQTT_CA_CERTS", env.get("MQTT_CA_CERTS", "")),
        certfile=_check_file("MQTT_CERTFILE", env.get("MQTT_CERTFILE", "")),
        keyfile=_check_file("MQTT_KEYFILE", env.get("MQTT_KEYFILE", "")),
        client_id_prefix=_check_client_id_prefix(env.get("MQTT_CLIENT_ID_PREFIX") or DEFAULT_CLIENT_ID_PREFIX),
        keepalive_s=_parse_int("MQTT_KEEPALIVE", env.get("MQTT_KEEPALIVE") or str(DEFAULT_KEEPALIVE_S),
                               MIN_KEEPALIVE_S, MAX_KEEPALIVE_S),
        topic_root=root,
    )
    if job_broker:
        cfg = apply_job_overrides(cfg, job_broker)
    if warn:
        warn_if_public(cfg)
    return cfg


def apply_job_overrides(cfg: BrokerConfig, job_broker: Mapping[str, Any]) -> BrokerConfig:
    """Overlay a record's `broker` block on `cfg` (§13). A password is refused:
    passwords never enter a job record.

    Raises:
        ConfigError: not an object, an unknown key, a password, a bad value, or a
            certificate file (ca_certs, certfile, keyfile) that does not exist.
    """
    if not isinstance(job_broker, Mapping):
        raise ConfigError("job broker overrides must be a JSON object")
    changes: dict[str, Any] = {}
    for key, value in job_broker.items():
        if key == "password" or "pass" in key.lower():
            raise ConfigError("job broker overrides must not hold a password: passwords never enter a job record (§13)")
        field_name = _JOB_OVERRIDES.get(key)
        if field_name is None:
            raise ConfigError(f"job broker override {key!r} is unknown; allowed: {', '.join(sorted(_JOB_OVERRIDES))}")
        if field_name == "hosts":
            if isinstance(value, (list, tuple)) and all(isinstance(host, str) for host in value):
                value = ",".join(value)
            elif not isinstance(value, str):
                raise ConfigError(f"job broker override {key!r} must be a host name or a list of them")
            value = _parse_hosts(value, f"job broker override {key!r}")
        elif field_name == "port":
            value = _parse_int(key, str(value), MIN_PORT, MAX_PORT)
        elif field_name == "keepalive_s":
            value = _parse_int(key, str(value), 1, MAX_KEEPALIVE_S)
        elif field_name == "tls":
            value = value if isinstance(value, bool) else _parse_bool(key, str(value))
        elif field_name == "transport" and value not in TRANSPORTS:
            raise ConfigError(f"job broker override transport={value!r} is invalid: expected tcp or websockets")
        elif not isinstance(value, str) or any(c in value for c in "\r\n\x00"):
            raise ConfigError(f"job broker override {key!r} must be a one-line string")
        elif field_name == "topic_root":
            try:
                value = topic_root(value)
            except UsageError as exc:
                raise ConfigError(str(exc)) from None
        elif field_name == "client_id_prefix":
            value = _check_client_id_prefix(value)
        elif field_name in ("ca_certs", "certfile", "keyfile"):
            value = _check_file(f"job broker override {key!r}", value)
        changes[field_name] = value
    return cfg.with_overrides(**changes)


def warn_if_public(cfg: BrokerConfig, stream: TextIO | None = None) -> bool:
    """Print the loud public-broker warning of §13 on stderr when it applies.

    Returns:
        True when the warning was printed.
    """
    if not cfg.is_public:
        return False
    out = stream if stream is not None else sys.stderr
    print(
        f"WARNING: using the PUBLIC broker {PUBLIC_BROKER}: anyone on the internet can read "
        "topics, job ids and event details and publish to them. Set MQTT_BROKER to a private "
        "broker (see `mam-orch broker up` or deploy/).",
        file=out,
    )
    return True


def dispatch_secret(environ: Mapping[str, str] | None = None, cwd: Path | None = None,
                    workspace: str | os.PathLike[str] | None = None) -> str:
    """MAM_DISPATCH_SECRET (§5, §13), required by dispatch, run and cancel.

    Raises:
        ConfigError: unset, or shorter than 32 characters (the value is never shown).
    """
    value = load_env(environ, cwd, workspace).get("MAM_DISPATCH_SECRET", "")
    if not value:
        raise ConfigError("MAM_DISPATCH_SECRET is not set: put it in .mam.env or the environment "
                          "(the same value on the hub and every runner; `mam-orch init` makes one)")
    if len(value) < MIN_SECRET_CHARS:
        raise ConfigError(f"MAM_DISPATCH_SECRET is too short ({len(value)} characters): "
                          f"at least {MIN_SECRET_CHARS} are required")
    return value


def contract_from_env(environ: Mapping[str, str] | None = None, **overrides: int | None) -> Contract:
    """The hub's contract for a new job (§5): defaults, then MAM_HEARTBEAT_SEC,
    MAM_HEARTBEAT_MISSES, MAM_ACK_TIMEOUT_S from `environ` (default: the
    resolved settings, environment over `.mam.env`), then the non-None
    `overrides` (wire names: heartbeat_sec, heartbeat_misses, ack_timeout_sec,
    idle_timeout_sec, timeout_sec).

    Returns:
        a `wire.Contract`.
    Raises:
        ConfigError: a variable that is not a positive integer.
        UsageError: a bad override.
    """
    env = load_env() if environ is None else environ
    values: dict[str, int] = {}
    for var, key in (("MAM_HEARTBEAT_SEC", "heartbeat_sec"), ("MAM_HEARTBEAT_MISSES", "heartbeat_misses"),
                     ("MAM_ACK_TIMEOUT_S", "ack_timeout_sec")):
        raw = env.get(var)
        if raw not in (None, ""):
            try:
                values[key] = int(raw.strip())
            except ValueError:
                values[key] = 0
            if values[key] < 1:
                raise ConfigError(f"{var}={raw!r} is invalid: expected a positive integer")
    values.update({key: value for key, value in overrides.items() if value is not None})
    return Contract.build(**values)


def env_int(name: str, default: int, *, environ: Mapping[str, str] | None = None,
            low: int = 1, high: int = MAX_ENV_INT) -> int:
    """An integer setting such as MAM_HEARTBEAT_SEC from the resolved settings.

    Raises:
        ConfigError: not an integer or out of range.
    """
    value = load_env(environ).get(name)
    return default if value in (None, "") else _parse_int(name, value, low, high)


def env_float(name: str, default: float, *, environ: Mapping[str, str] | None = None,
              low: float = 0.0, high: float = MAX_ENV_SECONDS) -> float:
    """A float setting in seconds such as MAM_CANCEL_GRACE_S.

    Raises:
        ConfigError: not a number or out of range.
    """
    value = load_env(environ).get(name)
    if value in (None, ""):
        return default
    try:
        number = float(value)
    except ValueError:
        raise ConfigError(f"{name}={value!r} is invalid: expected a number of seconds") from None
    if not low <= number <= high:
        raise ConfigError(f"{name}={number} is out of range {low}..{high}")
    return number


def describe(workspace: str | os.PathLike[str] | None = None,
             environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The resolved settings for `mam-orch config`, secrets shown only as set/unset.

    Raises:
        EnvFileError, ConfigError: as `broker_config`.
    """
    env = dict(os.environ if environ is None else environ)
    cfg = broker_config(environ=env, workspace=workspace, warn=False)
    path = find_env_file(env, None, workspace)
    settings = load_env(env, None, workspace)
    shown = {f.name: getattr(cfg, f.name) for f in fields(cfg) if f.name != "password"}
    shown["hosts"] = list(cfg.hosts)
    shown["password_set"] = bool(cfg.password)
    return {
        "env_file": str(path) if path else None,
        "registry_root": str(resolve_root(workspace, env)),
        "broker": shown,
        "dispatch_secret_set": bool(settings.get("MAM_DISPATCH_SECRET")),
        "public_broker": cfg.is_public,
    }
