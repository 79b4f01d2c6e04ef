"""Least privilege at the broker (PROTOCOL §16, docs/security.md): one broker user per
enrolled runner, named after its session (so mosquitto's `%u` is the session).

A runner's user may publish only `jobs/+/events`, `jobs/+/state`, `jobs/+/log`, `jobs/+/result`, its
own `runners/<session>` and its own `enrol/<session>/request`; it may subscribe only to
`jobs/+/dispatch`, `jobs/+/control`, `jobs/+/state` (the §17 `taken` check reads the
job's retained state), its own presence, the hub's notice `runners/<session>/revoked`
(§16.7) and its own `enrol/<session>/answer` (so an
enrolled runner can take a new invite: re-keying, new labels; the code's MAC guards both).
Not `jobs/+/dispatch` for publishing: a broker cannot tell a clear from a forged dispatch,
and the hub clears a taken dispatch itself (§17); the runner's own clear is acknowledged
and dropped. The hub keeps `mam_agent`.

In a nats config the users live on one line each between the `# BEGIN runner users`
and `# END runner users` markers of the shipped template (`natsconf.NATS_CONF`), so
`with_runner_user` / `without_runner_user` edit that block and nothing else; nats-server
picks a change up on SIGHUP (`nats-server --signal reload=<pid>`). A runner user's
password is written there as a bcrypt hash (nats-server verifies `$2…` passwords with
bcrypt), so the config never holds it: only the runner's `.mam.env` does.
"""

from __future__ import annotations

import json
import os
import signal

import bcrypt

from mam.orchestrator.broker.conf import AGENT_USER, OBSERVER_USER, topic_to_subject
from mam.shared.protocol import names
from mam.shared.protocol.crypto import invite
from mam.shared.protocol.errors import ConfigError, UsageError
from mam.shared.protocol.names import check_secret

BEGIN_MARK = "      # BEGIN runner users\n"
END_MARK = "      # END runner users\n"
ENTRY_TAG = "  # runner "
ENROL_TAG = "  # enrol "
"""Tags the one-time user of an invite (§16.5) in the same block: allowed its session's enrol topics only."""
PUBLISH_LEAVES = ("events", "state", "log", "result")
SUBSCRIBE_LEAVES = ("dispatch", "control", "state")
RESERVED_USERS = frozenset({AGENT_USER, OBSERVER_USER, "sys", "home"})
BCRYPT_ROUNDS = 11
"""bcrypt cost of a runner user's password hash: what `nats server passwd` uses (about 0.1 s per
check, paid by nats-server once per runner CONNECT)."""
BCRYPT_MAX_BYTES = 72
"""bcrypt reads at most this many bytes of a password (the `bcrypt` package refuses longer ones)."""

__all__ = ["BEGIN_MARK", "END_MARK", "enrol_users", "mosquitto_acl_block", "nats_enrol_entry", "nats_user_entry",
           "reload_nats", "runner_topics", "runner_user", "runner_users", "users_block", "with_enrol_user",
           "with_runner_user", "with_users_block", "without_enrol_users", "without_runner_user"]


def runner_user(session: str) -> str:
    """The broker user of runner `session`: the session name itself (mosquitto's `%u`).

    Raises:
        UsageError: a bad session, or one named like a shipped user (mam_agent, ...).
    """
    name = names.validate_session(session)
    if name in RESERVED_USERS or name.startswith(invite.ENROL_USER_PREFIX):
        raise UsageError(f"session {name!r} is the name of a shipped broker user: enrol it under another name")
    return name


def runner_topics(session: str, topic_root: str | None = None) -> tuple[list[str], list[str]]:
    """The MQTT topic filters runner `session` may (publish to, subscribe to)."""
    root = names.topic_root(topic_root)
    user = runner_user(session)
    own = names.presence_topic(user, root)
    answers = names.all_answers_filter(root)  # §19: read, and cleared once delivered
    publish = [f"{root}/jobs/+/{leaf}" for leaf in PUBLISH_LEAVES] + [answers, own,
                                                                     names.enrol_topic(user, "request", root)]
    subscribe = [f"{root}/jobs/+/{leaf}" for leaf in SUBSCRIBE_LEAVES] + [answers, own,
                                                                         names.revoked_topic(user, root),
                                                                         names.drain_topic(user, root),
                                                                         names.enrol_topic(user, "answer", root)]
    return publish, subscribe


def mosquitto_acl_block(session: str, topic_root: str | None = None) -> str:
    """The `user` block of deploy/mosquitto/acl for runner `session` (its presence comes from
    the file's `pattern readwrite <root>/runners/%u` line)."""
    root = names.topic_root(topic_root)
    user = runner_user(session)
    rights = (("write", "events"), ("readwrite", "state"), ("write", "log"), ("write", "result"), ("read", "dispatch"),
              ("read", "control"))
    return "".join([f"user {user}\n", *(f"topic {access} {root}/jobs/+/{leaf}\n" for access, leaf in rights),
                    f"topic readwrite {names.all_answers_filter(root)}\n",
                    f"topic read {names.revoked_topic(user, root)}\n",
                    f"topic read {names.drain_topic(user, root)}\n",
                    f"topic write {names.enrol_topic(user, 'request', root)}\n",
                    f"topic read {names.enrol_topic(user, 'answer', root)}\n"])


def _subjects(filters: list[str]) -> str:
    return json.dumps([topic_to_subject(f).replace("+", "*") for f in filters])


def nats_user_entry(session: str, password: str, topic_root: str | None = None) -> str:
    """One line of the nats `users` list for runner `session` (ends with "\\n"), with the bcrypt
    hash of `password`, never the password itself (§16).

    Raises:
        UsageError: a session that cannot be a broker user.
        ConfigError: a password `check_secret` refuses, or longer than bcrypt's 72 bytes.
    """
    user = runner_user(session)
    check_secret("the runner's broker password", password)
    if len(password.encode()) > BCRYPT_MAX_BYTES:
        raise ConfigError(f"the runner's broker password must be at most {BCRYPT_MAX_BYTES} bytes (bcrypt)")
    hashed = bcrypt.hashpw(password.encode(), bcrypt.gensalt(rounds=BCRYPT_ROUNDS)).decode("ascii")
    publish, subscribe = runner_topics(session, topic_root)
    return (f'      {{ user: "{user}", password: "{hashed}", allowed_connection_types: ["MQTT", "MQTT_WS"], '
            f"permissions: {{ publish: {{ allow: {_subjects(publish)} }}, "
            f"subscribe: {{ allow: {_subjects(subscribe)} }} }} }}{ENTRY_TAG}{user}\n")


def nats_enrol_entry(code: invite.InviteCode, topic_root: str | None = None) -> str:
    """One line of the nats `users` list for the one-time user of an invite (§16.5): it may
    publish only `enrol/<session>/request` and subscribe only `enrol/<session>/answer`;
    its password (derived from the code) as a bcrypt hash."""
    hashed = bcrypt.hashpw(code.enrol_password.encode(), bcrypt.gensalt(rounds=BCRYPT_ROUNDS)).decode("ascii")
    root = names.topic_root(topic_root)
    publish = [names.enrol_topic(code.session, "request", root)]
    subscribe = [names.enrol_topic(code.session, "answer", root)]
    return (f'      {{ user: "{code.enrol_username}", password: "{hashed}", allowed_connection_types: ["MQTT"], '
            f"permissions: {{ publish: {{ allow: {_subjects(publish)} }}, "
            f"subscribe: {{ allow: {_subjects(subscribe)} }} }} }}{ENROL_TAG}{code.enrol_username}\n")


def enrol_users(text: str) -> list[str]:
    """The invites' one-time users a config holds, in order."""
    return [line.rsplit(ENROL_TAG, 1)[1].strip() for line in _split(text)[1] if ENROL_TAG in line]


def with_enrol_user(text: str, code: invite.InviteCode, topic_root: str | None = None) -> str:
    """`text` with the one-time user of `code`'s invite."""
    head, lines, tail = _split(without_enrol_users(text, {code.enrol_username}))
    return head + "".join(lines) + nats_enrol_entry(code, topic_root) + tail


def without_enrol_users(text: str, users: set[str]) -> str:
    """`text` without the invites' one-time `users` (unchanged when it has none of them)."""
    head, lines, tail = _split(text)
    return head + "".join(line for line in lines
                          if not (ENROL_TAG in line and line.rsplit(ENROL_TAG, 1)[1].strip() in users)) + tail


def _split(text: str) -> tuple[str, list[str], str]:
    """(before and BEGIN, the block's lines, END and after) of a config with runner users."""
    if text.count(BEGIN_MARK) != 1 or text.count(END_MARK) != 1:
        raise ConfigError("the nats config has no single '# BEGIN runner users' ... '# END runner users' block "
                          "(it predates per-runner users: add the two marker lines of deploy/nats/nats.conf)")
    head, rest = text.split(BEGIN_MARK)
    block, tail = rest.split(END_MARK)
    return head + BEGIN_MARK, block.splitlines(keepends=True), END_MARK + tail


def users_block(text: str) -> str:
    """The runner-user lines of a config (to carry them into a regenerated one)."""
    return "".join(_split(text)[1])


def with_users_block(text: str, block: str) -> str:
    """`text` with its runner-user lines replaced by `block`."""
    head, _, tail = _split(text)
    return head + block + tail


def runner_users(text: str) -> list[str]:
    """The runner users a config holds, in order."""
    return [line.rsplit(ENTRY_TAG, 1)[1].strip() for line in _split(text)[1] if ENTRY_TAG in line]


def with_runner_user(text: str, session: str, password: str, topic_root: str | None = None) -> str:
    """`text` with runner `session`'s user (replacing an earlier one of that session)."""
    head, lines, tail = _split(without_runner_user(text, session))
    return head + "".join(lines) + nats_user_entry(session, password, topic_root) + tail


def without_runner_user(text: str, session: str) -> str:
    """`text` without runner `session`'s user (unchanged when it has none)."""
    user = runner_user(session)
    head, lines, tail = _split(text)
    return head + "".join(line for line in lines if not line.endswith(f"{ENTRY_TAG}{user}\n")) + tail


def reload_nats(pid: int) -> None:
    """Ask nats-server `pid` to re-read its config (SIGHUP, as `nats-server --signal reload=<pid>`).

    Raises:
        ConfigError: no such process, or not ours to signal.
    """
    try:
        os.kill(pid, signal.SIGHUP)
    except OSError as exc:
        raise ConfigError(f"cannot signal nats-server pid {pid} to reload ({exc.strerror or exc})") from None
