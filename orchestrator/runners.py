"""The hub's view of its runners: their signed retained presence (PROTOCOL §7)
and `mam-orch runners`."""

from __future__ import annotations

import json
import queue
import sys
import time
from typing import Any

from mam.orchestrator.hub import Workspace, open_hub
from mam.shared import crypto, names, render, wire
from mam.shared.codes import PresenceStatus
from mam.shared.crypto import DispatchKeys
from mam.shared.errors import ProtocolError
from mam.shared.mqtt import MqttClient

PRESENCE_QUIET_S = 0.5
# A runner republishes its presence every PRESENCE_REFRESH_S (the runner's own constant);
# an online/draining presence older than three periods plus the clock skew is "stale".
PRESENCE_REFRESH_S = 60.0
STALE_PERIODS = 3
CLOCK_SKEW_S = 30.0
PRESENCE_STALE_S = STALE_PERIODS * PRESENCE_REFRESH_S + CLOCK_SKEW_S
PRESENCE_MAX_S = 3.0
READ_PRESENCE_QUIET_S = 1.0  # one session: its retained presence comes at once, or not at all
STALE = "stale"

Row = dict[str, Any]


def verify_presence(topic: str, raw: bytes, keys: DispatchKeys, topic_root: str) -> Row:
    """Decode and verify one retained presence (§7) into a row.

    Returns:
        {"session", "status", "host", "running", "max_jobs", "last_seen", "runner_id", "version"};
        status is "stale" for an online/draining presence not refreshed for PRESENCE_STALE_S.
    Raises:
        DecodeError: not a §7 presence; SignatureError: `sig` missing or wrong;
        ProtocolError: the presence names another session than its topic.
    """
    presence = wire.decode(raw, "presence")
    crypto.verify(presence.to_dict(), keys.sign_key)
    session = names.parse_presence_topic(topic, topic_root)
    if session != presence.session:
        raise ProtocolError(f"presence for session {presence.session!r} published on {topic}")
    status = presence.status
    if status != PresenceStatus.OFFLINE and _presence_age_s(presence.timestamp) > PRESENCE_STALE_S:
        status = STALE  # not refreshed: a dead host, or an old presence replayed
    return {"session": presence.session, "status": status, "host": presence.host,
            "running": list(presence.running), "max_jobs": presence.max_jobs,
            "last_seen": presence.timestamp, "runner_id": presence.runner_id, "version": presence.version}


def _presence_age_s(timestamp: str) -> float:
    return time.time() - wire.parse_ts(timestamp).timestamp()


def collect_presence(client: MqttClient, keys: DispatchKeys, session: str | None = None, *,
                     quiet_s: float = PRESENCE_QUIET_S, max_s: float = PRESENCE_MAX_S) -> tuple[list[Row], list[str]]:
    """Subscribe to the retained presence of one session (or all, `ROOT/runners/+`)
    and collect it until no message came for `quiet_s` seconds, at most `max_s` (§7).

    Unsigned, forged or malformed presence is refused (listed in the second
    value for the caller to print on stderr), never shown. Zero-length payloads (cleared) are ignored.

    Args:
        client: a connected `MqttClient` (its queue must hold nothing else).
        session: one session, or None for every runner.
    Returns:
        (rows sorted by session, refusal lines).
    Raises:
        BrokerError: the subscription failed.
    """
    root = client.config.topic_root
    topic_filter = names.presence_topic(session, root) if session else names.all_presence_filter(root)
    client.subscribe([(topic_filter, 1)])
    rows: dict[str, Row] = {}
    refused: list[str] = []
    end = time.monotonic() + max_s
    quiet_until = time.monotonic() + quiet_s
    while True:
        now = time.monotonic()
        wait_s = min(end, quiet_until) - now
        if wait_s <= 0:
            break
        try:
            message = client.messages.get(timeout=wait_s)
        except queue.Empty:
            break
        quiet_until = time.monotonic() + quiet_s
        if names.parse_presence_topic(message.topic, root) is None or not message.payload:
            continue
        try:
            row = verify_presence(message.topic, message.payload, keys, root)
        except ProtocolError as exc:
            refused.append(f"refused presence on {message.topic}: {exc}")
            continue
        rows[row["session"]] = row
        if session is not None:
            break  # the one retained presence of that session
    return sorted(rows.values(), key=lambda row: str(row["session"])), refused


def read_presence(client: MqttClient, keys: DispatchKeys, session: str, *,
                  quiet_s: float = READ_PRESENCE_QUIET_S) -> Row | None:
    """The verified retained presence of `session`, or None when it has none (§7);
    refusals are printed on stderr.

    Raises:
        BrokerError: the subscription failed.
    """
    rows, refused = collect_presence(client, keys, session, quiet_s=quiet_s)
    for line in refused:
        print(line, file=sys.stderr)
    return rows[0] if rows else None


def runners_cli(*, workspace: Workspace = None, as_json: bool = False) -> int:
    """`mam-orch runners`: every runner's verified retained presence (§7):
    session, online / draining / offline, running jobs, last seen. A table on
    a TTY, JSON lines otherwise (or with --json); refusals on stderr.

    Returns:
        0.
    Raises:
        ConfigError (64), EnvFileError (1), BrokerError (3).
    """
    hub = open_hub(workspace)
    keys = hub.keys()
    client = hub.connect("runners")
    try:
        rows, refused = collect_presence(client, keys)
    finally:
        client.close()
    for line in refused:
        print(line, file=sys.stderr)
    if as_json or not sys.stdout.isatty():
        for row in rows:
            print(json.dumps(row, sort_keys=True))
    elif not rows:
        print("(no runners)")
    else:
        print(render.table(["SESSION", "STATUS", "RUNNING", "MAX", "HOST", "LAST SEEN"],
                           [[r["session"], r["status"], ",".join(r["running"]) or "-", r["max_jobs"],
                             r["host"], r["last_seen"]] for r in rows]), end="")
    return 0
