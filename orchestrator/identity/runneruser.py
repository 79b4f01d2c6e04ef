"""A runner's own broker user on the hub (PROTOCOL §16, docs/security.md): `grant`
(`mam-orch runner add`) makes a password, writes the user and password once into a
0600 file for the operator to hand over, and adds the user to the nats config the hub
manages; `withdraw` (`mam-orch runner revoke`) removes it. Both reload the server.

The managed config is the one `mam-orch init --broker-config` recorded in
`.mam/broker-config.json` (its pid is unknown here: the reload command is printed), else
the embedded broker's `.mam/broker/nats.conf` (`mam-orch broker up`; reloaded with SIGHUP
to the pid of its state file). Without either, the lines say what to add by hand.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from mam.orchestrator.broker import embedded as broker
from mam.orchestrator.broker import users
from mam.orchestrator.init import broker_password
from mam.shared.config import broker_config, write_env_file
from mam.shared.protocol import names
from mam.shared.protocol.crypto.invite import InviteCode
from mam.shared.protocol.errors import ConfigError
from mam.shared.store.fsio import atomic_write, read_json_object

CREDENTIALS_DIR_MODE = 0o700
MAX_RECORD_BYTES = 4096
"""`.mam/broker-config.json` is one short JSON object."""

__all__ = ["AddedUser", "Grant", "add_enrol_user", "add_user", "check_session", "grant", "remove_enrol_user",
           "withdraw"]


@dataclass(frozen=True)
class Managed:
    """The nats config whose runner users the hub edits, and the server's pid if known."""

    config: Path
    pid: int | None


@dataclass(frozen=True)
class AddedUser:
    """A runner's broker user as `add_user` made it: the password (hidden from the repr) and the
    lines for the operator; `applied`: a managed config holds the user now; `reloaded`: and the
    broker was told to re-read it (else the operator reloads it)."""

    user: str
    password: str = field(repr=False)
    lines: tuple[str, ...] = ()
    applied: bool = False
    reloaded: bool = False


@dataclass(frozen=True)
class Grant:
    """What `grant` did: the user, the credentials file, and lines for the operator."""

    user: str
    credentials: Path
    lines: tuple[str, ...]


def _managed(root: Path) -> Managed | None:
    record_path = names.broker_record_path(root)
    if record_path.exists():
        try:
            record = read_json_object(record_path, MAX_RECORD_BYTES)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"{record_path}: unreadable broker record ({exc})") from None
        config = record.get("config")
        if not isinstance(config, str) or not config:
            raise ConfigError(f"{record_path}: no \"config\" path (run `mam-orch init --broker-config` again)")
        return Managed(Path(config), None)
    embedded = broker.BrokerPaths(root).config
    if embedded.exists():
        return Managed(embedded, broker.running_pid(str(root)))
    return None


def _apply(managed: Managed, text: str) -> list[str]:
    """Write the new config and reload the server; the lines to print."""
    atomic_write(managed.config, text.encode("utf-8"), what=managed.config.name, error=ConfigError)
    if managed.pid is None:
        return [f"updated {managed.config}; reload the broker: nats-server --signal reload=<pid> "
                "(with docker compose, restart the service: the config is a bind-mounted file)"]
    users.reload_nats(managed.pid)
    return [f"updated {managed.config} and reloaded nats-server (pid {managed.pid})"]


def check_session(session: str) -> str:
    """The broker user of `session`; UsageError for one that cannot be a broker user."""
    return users.runner_user(session)


def add_user(root: Path, session: str, password: str | None = None) -> AddedUser:
    """Make runner `session` a broker user in the managed config (replacing an earlier one) and
    reload the broker; without a managed config, only say what to add.

    Args:
        password: the user's password (default: a fresh one).
    Returns:
        the user, its password (never printed) and the lines for the operator; `applied` is
        False when no managed config took the user, `reloaded` when the broker was signalled.
    Raises:
        UsageError: a session that cannot be a broker user; ConfigError: the config cannot be
        read or written.
    """
    user = users.runner_user(session)
    password = password or broker_password()
    managed = _managed(root)
    current = None
    if managed is not None:
        try:
            current = managed.config.read_text(encoding="utf-8")
        except (OSError, UnicodeError) as exc:
            raise ConfigError(f"{managed.config}: cannot read the broker config ({exc})") from None
    if managed is not None and current is not None and users.BEGIN_MARK in current:
        cfg = broker_config(workspace=root, warn=False)
        text = users.with_runner_user(current, session, password, cfg.topic_root)
        return AddedUser(user, password, tuple(_apply(managed, text)), applied=True,
                         reloaded=managed.pid is not None)
    where = (f"{managed.config} predates per-runner users (no '# BEGIN runner users' line)" if managed
             else "no broker config managed here (mam-orch init --broker-config or broker up)")
    return AddedUser(user, password, (f"{where}: add the user to your broker as docs/security.md shows (nats "
                                      "users entry, or mosquitto_passwd and acl)",))


def grant(root: Path, session: str) -> Grant:
    """Give runner `session` its own broker user (`add_user`), its user and password written
    first, once, into `.mam/runner-credentials/<session>.env` (0600) for the operator to hand over.

    Returns:
        a `Grant`; its lines say what to do by hand when no managed config took the user.
    Raises:
        UsageError: a session that cannot be a broker user; ConfigError: a file cannot be read or written.
    """
    user = users.runner_user(session)
    password = broker_password()
    path = names.runner_credentials_path(root, session)
    path.parent.mkdir(mode=CREDENTIALS_DIR_MODE, parents=True, exist_ok=True)
    write_env_file(path, {"MQTT_USERNAME": user, "MQTT_PASSWORD": password},
                   header=f"Broker user of runner {session} (mam-orch runner add): put these two lines in its "
                          ".mam.env, then delete this file.", overwrite=True)
    added = add_user(root, session, password)
    return Grant(user, path, (f"broker user {user}: its password is in {path} (mode 0600): put both lines in "
                              "the runner's .mam.env, then delete the file", *added.lines))


def withdraw(root: Path, session: str) -> list[str]:
    """Remove runner `session`'s broker user and reload; the lines to print."""
    user = users.runner_user(session)
    names.runner_credentials_path(root, session).unlink(missing_ok=True)
    managed = _managed(root)
    if managed is None:
        return [f"no broker config managed here: remove the broker user {user} from your broker and reload it"]
    text = managed.config.read_text(encoding="utf-8")
    if users.BEGIN_MARK not in text or user not in users.runner_users(text):
        return [f"broker user {user} is not in {managed.config}"]
    return [f"removed broker user {user}", *_apply(managed, users.without_runner_user(text, session))]


def _managed_text(root: Path) -> tuple[Managed, str] | None:
    """The managed config and its text, when it has the runner users block; else None."""
    managed = _managed(root)
    if managed is None:
        return None
    try:
        text = managed.config.read_text(encoding="utf-8")
    except (OSError, UnicodeError) as exc:
        raise ConfigError(f"{managed.config}: cannot read the broker config ({exc})") from None
    return (managed, text) if users.BEGIN_MARK in text else None


def add_enrol_user(root: Path, code: InviteCode, stale: set[str]) -> bool:
    """Give `code`'s invite its one-time broker user (§16.5) in the managed config, dropping the
    `stale` ones (invites used or expired), and reload the broker.

    Returns:
        True when the broker took the user (a managed config and a known pid to signal);
        False: a fresh host needs broker credentials of its own to enrol.
    Raises:
        ConfigError: the config cannot be read or written.
    """
    found = _managed_text(root)
    if found is None or found[0].pid is None:
        return False
    managed, text = found
    text = users.without_enrol_users(text, stale)
    _apply(managed, users.with_enrol_user(text, code, broker_config(workspace=root, warn=False).topic_root))
    return True


def remove_enrol_user(root: Path, code: InviteCode) -> None:
    """Remove `code`'s one-time broker user and reload (the invite was used, or expired)."""
    found = _managed_text(root)
    if found is None or code.enrol_username not in users.enrol_users(found[1]):
        return
    managed, text = found
    _apply(managed, users.without_enrol_users(text, {code.enrol_username}))
