"""The configuration of the embedded nats-server (reference design MESSAGING
§1.2-§1.3; PROTOCOL §2, §9, §13): its users and listeners, the rendered
`nats.conf`, and the checks run before anything is started or written.

One account `MAM` (JetStream enabled) holds two users: `mam_agent` (hub and
runners; full rights inside the account) and `mam_observer` (MQTT only; may
subscribe under the topic root, may publish nothing). MQTT-over-WebSocket:
nats-server's `websocket` listener speaks MQTT to clients that use the URL
path `/mqtt` (nats-server PR #2735); other paths speak the NATS protocol.

`render_nats_config()` is shared with the test fixtures; `mam.shared.broker`
starts and stops the server and re-exports every name of this module.
"""

from __future__ import annotations

import errno
import ipaddress
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from mam.shared import names
from mam.shared.config import DEFAULT_MQTT_PORT, MAX_HOST_CHARS, MAX_PORT, MIN_PORT, new_secret
from mam.shared.errors import ConfigError, MamError, UsageError
from mam.shared.fsio import atomic_write

AGENT_USER = "mam_agent"
OBSERVER_USER = "mam_observer"
ACCOUNT = "MAM"
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 4222  # native NATS (status checks, operators)
DEFAULT_WS_PORT = 8080
DEFAULT_SERVER_NAME = "mam-hub"


# Passwords go into a quoted nats.conf string: printable ASCII without quote, backslash or '$'.
MIN_PASSWORD_CHARS, MAX_PASSWORD_CHARS = 8, 256
MAX_USER_CHARS = 64
_SAFE_SECRET = re.compile(rf"^[!#%-\[\]-~]{{{MIN_PASSWORD_CHARS},{MAX_PASSWORD_CHARS}}}$")
_USER_NAME = re.compile(rf"[A-Za-z0-9_-]{{1,{MAX_USER_CHARS}}}")


class BrokerStartError(MamError):
    """The workspace broker could not start: a port is taken or cannot be bound, or
    nats-server exited or did not accept MQTT in time.

    Exit 1 (PROTOCOL §9 keeps 3 for "broker unreachable" as seen by a client), which is
    why this is not a BrokerError.
    """


@dataclass(frozen=True)
class BrokerCredentials:
    """Passwords of the two broker users; repr hides them."""

    agent_password: str = field(repr=False)
    observer_password: str = field(default="", repr=False)
    agent_user: str = AGENT_USER
    observer_user: str = OBSERVER_USER

    @classmethod
    def fresh(cls) -> BrokerCredentials:
        """New random passwords for both users."""
        return cls(agent_password=new_secret(), observer_password=new_secret())


@dataclass(frozen=True)
class NatsSettings:
    """Where the generated nats-server listens and stores.

    Attributes:
        store_dir: JetStream store directory.
        host: listen address for every listener.
        port: native NATS port (nats-py status checks).
        mqtt_port: MQTT listener port.
        ws_port: MQTT-over-WebSocket port (path /mqtt), or None for no listener.
        monitor_port: HTTP monitoring port, or None (default: off).
        server_name: the server name (JetStream needs a stable one).
        topic_root: MQTT topic root the observer may read (§2).
    """

    store_dir: Path
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    mqtt_port: int = DEFAULT_MQTT_PORT
    ws_port: int | None = DEFAULT_WS_PORT
    monitor_port: int | None = None
    server_name: str = DEFAULT_SERVER_NAME
    topic_root: str = names.DEFAULT_TOPIC_ROOT


def topic_to_subject(topic: str) -> str:
    """The NATS subject of an MQTT topic: '.' → '//' then '/' → '.' (nats-server MQTT mapping)."""
    return "".join("//" if c == "." else "." if c == "/" else c for c in topic)


def _quote(value: str) -> str:
    """A nats.conf double-quoted string (values are validated: no quote or backslash)."""
    if any(c in value for c in '"\\\n\r'):
        raise ConfigError("a nats.conf value must not contain quotes, backslashes or line breaks")
    return f'"{value}"'


def check_secret(name: str, value: str) -> str:
    """Refuse a password that cannot go into nats.conf safely.

    Raises:
        ConfigError: shorter than 8, longer than 256, or with spaces, quotes, '\\' or '$'.
    """
    if not _SAFE_SECRET.match(value or ""):
        raise ConfigError(f"{name} must be {MIN_PASSWORD_CHARS}-{MAX_PASSWORD_CHARS} printable characters "
                          "without spaces, quotes, "
                          "'\\' or '$' (generate one with `python -c 'import secrets; "
                          "print(secrets.token_urlsafe(32))'`)")
    return value


def check_user(name: str, value: str) -> str:
    """Refuse a user name that is not 1-64 letters, digits, '_' or '-'.

    Raises:
        ConfigError: naming the variable and the rule.
    """
    if not _USER_NAME.fullmatch(value or ""):
        raise ConfigError(f"{name} {value!r} is invalid: use 1-{MAX_USER_CHARS} letters, digits, '_' or '-'")
    return value


def render_nats_config(settings: NatsSettings, creds: BrokerCredentials) -> str:
    """The nats-server configuration text (MESSAGING §1.2-§1.3).

    Args:
        settings: listeners and store.
        creds: user passwords; an empty observer password leaves the observer out.
    Returns:
        the config text; it holds passwords, so write it with mode 0600.
    Raises:
        ConfigError: a password or path that cannot be written safely.
    """
    check_user("MQTT_USERNAME", creds.agent_user)
    check_secret("MQTT_PASSWORD", creds.agent_password)
    root_subject = topic_to_subject(names.topic_root(settings.topic_root))
    users = [f"      {{ user: {_quote(creds.agent_user)}, password: {_quote(creds.agent_password)} }}"]
    if creds.observer_password:
        check_user("MAM_OBSERVER_USERNAME", creds.observer_user)
        check_secret("MAM_OBSERVER_PASSWORD", creds.observer_password)
        # Read-only: subscribe under the root, plus $MQTT.sub.> which nats-server uses to
        # deliver QoS 1 subscriptions; publish nothing. MQTT connections only.
        users.append(
            f"      {{ user: {_quote(creds.observer_user)}, password: {_quote(creds.observer_password)},\n"
            f"        permissions: {{\n"
            f"          publish: {{ deny: [\">\"] }}\n"
            f"          subscribe: {{ allow: [{_quote(root_subject + '.>')}, \"$MQTT.sub.>\"] }}\n"
            f"        }}\n"
            f"        allowed_connection_types: [\"MQTT\", \"WEBSOCKET\"] }}")
    lines = [
        "# Generated by mam-orch broker; holds passwords (mode 0600). Do not edit: regenerated on `up`.",
        f"server_name: {_quote(settings.server_name)}",
        f"host: {_quote(settings.host)}",
        f"port: {int(settings.port)}",
    ]
    if settings.monitor_port:
        lines.append(f"http: {_quote(f'{settings.host}:{int(settings.monitor_port)}')}")
    lines += [
        "jetstream {",
        f"  store_dir: {_quote(str(settings.store_dir))}",
        "}",
        "accounts {",
        f"  {ACCOUNT}: {{",
        "    jetstream: enabled",
        "    users: [",
        *users,
        "    ]",
        "  }",
        "}",
        "mqtt {",
        f"  host: {_quote(settings.host)}",
        f"  port: {int(settings.mqtt_port)}",
        "}",
    ]
    if settings.ws_port:
        # MQTT clients use ws://host:port/mqtt; plain ws because TLS is terminated elsewhere (§1.3)
        lines += [
            "websocket {",
            f"  host: {_quote(settings.host)}",
            f"  port: {int(settings.ws_port)}",
            "  no_tls: true",
            "  same_origin: false",
            "}",
        ]
    return "\n".join(lines) + "\n"


def write_private(path: Path, text: str) -> Path:
    """Write `text` atomically with mode 0600.

    Raises:
        ConfigError: the file cannot be written; the previous one is unchanged.
    """
    atomic_write(path, text.encode("utf-8"), what=path.name, error=ConfigError)
    return path


def check_port(option: str, value: int | None, *, zero_is_off: bool = False) -> int | None:
    """Refuse a listener port outside 1..65535 before anything is bound (§9: exit 64).

    Args:
        option: the CLI option named in the error ("--mqtt-port").
        value: the port, or None (not given).
        zero_is_off: 0 is accepted and means "no listener" (--ws-port).
    Returns:
        `value` unchanged.
    Raises:
        UsageError: one line naming the option, the value and the range.
    """
    if value is None or (zero_is_off and value == 0):
        return value
    if not MIN_PORT <= value <= MAX_PORT:
        off = "; 0 turns the listener off" if zero_is_off else ""
        raise UsageError(f"{option} {value} is out of range: use a port {MIN_PORT}..{MAX_PORT}{off}")
    return value


def check_distinct_ports(ports: Mapping[str, int | None]) -> None:
    """Refuse two listeners on one port (§9: exit 64).

    Args:
        ports: a label per listener ("--port", "--mqtt-port (MQTT_PORT of .mam.env)") to
            its port; None and 0 (off) are skipped.
    Raises:
        UsageError: one line naming both labels and the port.
    """
    seen: dict[int, str] = {}
    for label, port in ports.items():
        if not port:
            continue
        if port in seen:
            raise UsageError(f"{seen[port]} and {label} are both {port}: give each listener its own port")
        seen[port] = label


def _bind_error(host: str, port: int) -> OSError | None:
    """The error of resolving host and binding a TCP socket to host:port, or None when the
    bind works (nothing listens there)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as nats-server does: TIME_WAIT is free
            sock.bind(address)
    except OSError as exc:
        return exc
    return None


def check_listen(host: str) -> str:
    """Refuse a listen address that is not an IP address or host name of this machine (§9: exit 64).

    Args:
        host: the --listen value: an IPv4/IPv6 address or a resolvable host name.
    Returns:
        `host` unchanged.
    Raises:
        UsageError: not an IP address and not resolvable (getaddrinfo), resolvable but
            not an address of a local interface (the bind fails with EADDRNOTAVAIL), or
            not bindable for another reason (named in the message).
    """
    invalid = f"--listen {host[:80]!r} is invalid: give an IP address or a resolvable host name"
    if not host or len(host) > MAX_HOST_CHARS or any(c.isspace() or c in '"\\' or not c.isprintable() for c in host):
        raise UsageError(invalid)
    try:
        ipaddress.ip_address(host)
    except ValueError:
        try:
            socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError, ValueError):
            raise UsageError(invalid) from None
    try:
        failure = _bind_error(host, 0)
    except (UnicodeError, ValueError):
        raise UsageError(invalid) from None
    if failure is not None and failure.errno == errno.EADDRNOTAVAIL:
        raise UsageError(f"--listen {host!r} is not an address of this host")
    if failure is not None:
        raise UsageError(f"--listen {host!r}: cannot listen there ({failure.strerror or type(failure).__name__})")
    return host


def port_in_use(host: str, port: int) -> bool:
    """True when something already listens on host:port (bind test, no connection made)."""
    failure = _bind_error(host, port)
    return failure is not None and failure.errno == errno.EADDRINUSE


def check_ports_free(host: str, ports: Mapping[str, int | None]) -> None:
    """Refuse to start when a port is taken or cannot be bound.

    Args:
        host: listen address (validated by `check_listen`).
        ports: option name (e.g. "--mqtt-port") to port; None and 0 (off) are skipped.
    Raises:
        BrokerStartError: one line naming the first port that cannot be bound, why, and
            the option to change it.
    """
    for option, port in ports.items():
        if not port:
            continue
        failure = _bind_error(host, int(port))
        if failure is None:
            continue
        if failure.errno == errno.EADDRINUSE:
            raise BrokerStartError(f"port {port} on {host} is already in use; choose another with {option}")
        raise BrokerStartError(f"cannot listen on port {port} of {host} "
                               f"({failure.strerror or type(failure).__name__}); "
                               f"choose another with {option}")
