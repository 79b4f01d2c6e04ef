"""The hub's view of its runners: their signed retained presence (PROTOCOL §7)
and `mam-orch runners`.

A broker may deliver only part of a large retained burst (mosquitto's
`max_queued_messages` defaulted to 1,000: 2,000 presences were listed as 1,020,
with exit 0 and no warning), so `runners` says on stderr when what it received may be incomplete:
the count equals a known broker queue limit, the burst was cut by the time limit,
or it is below the count of the previous run (kept in `.mam/runners-seen.json`).
"""

from __future__ import annotations

import json
import logging
import queue
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mam.orchestrator.control import clear_retained
from mam.orchestrator.hub import DAY_S, Workspace, open_hub
from mam.orchestrator.identity import roster
from mam.orchestrator.queue import RunnerView
from mam.shared.cli import render
from mam.shared.protocol import crypto, names, wire
from mam.shared.protocol.codes import PresenceStatus
from mam.shared.protocol.crypto import DispatchKeys
from mam.shared.protocol.errors import ProtocolError, RegistryError, SignatureError, UsageError
from mam.shared.store.fsio import atomic_write, read_json_object
from mam.shared.store.records import utc_now
from mam.shared.transport import Transport

PRESENCE_QUIET_S = 0.5
# A runner republishes its presence every PRESENCE_REFRESH_S (the runner's own constant);
# an online/draining presence older than three periods plus the clock skew is "lost", as is a Last Will.
PRESENCE_REFRESH_S = 60.0
STALE_PERIODS = 3
CLOCK_SKEW_S = 30.0
PRESENCE_STALE_S = STALE_PERIODS * PRESENCE_REFRESH_S + CLOCK_SKEW_S
# Collection ends after PRESENCE_QUIET_S without a message; this caps a burst that never pauses
# (10,000 retained presences of a large fleet arrive within a few seconds).
PRESENCE_MAX_S = 30.0
# Counts at which a broker's per-client queue cuts a retained burst: mosquitto 2.x's default
# max_queued_messages and 1.x's, each alone and plus the default max_inflight_messages.
MOSQUITTO_DEFAULT_QUEUED, MOSQUITTO_1X_DEFAULT_QUEUED, MOSQUITTO_DEFAULT_INFLIGHT = 1000, 100, 20
QUEUE_LIMIT_COUNTS = frozenset({MOSQUITTO_DEFAULT_QUEUED, MOSQUITTO_DEFAULT_QUEUED + MOSQUITTO_DEFAULT_INFLIGHT,
                                MOSQUITTO_1X_DEFAULT_QUEUED, MOSQUITTO_1X_DEFAULT_QUEUED + MOSQUITTO_DEFAULT_INFLIGHT})
SEEN_MAX_BYTES = 4096
READ_PRESENCE_QUIET_S = 1.0  # one session: its retained presence comes at once, or not at all
LOST = "lost"  # §7: its Last Will came, or its online/draining presence was not refreshed
REVOKED = "revoked"  # a roster entry's `revoked_at` is set (§16.7): shown with `--all`
OFFLINE_HIDDEN_DAYS = 7  # `runners` hides offline sessions last seen longer ago (`--all` shows them)

log = logging.getLogger("mam.runners")
REFUSAL_SHOWN_CHARS = 240  # a runner's refusal line, as the hub shows it

Row = dict[str, Any]


def verify_presence(topic: str, raw: bytes, keys: DispatchKeys, topic_root: str,
                    roster_root: Path | None = None) -> Row:
    """Decode and verify one retained presence (§7; against the roster of `roster_root`, §16) into a row.

    Returns:
        {"session", "status", "host", "running", "max_jobs", "labels", "repos", "last_seen", "runner_id",
        "version", "gpus", "gpus_free"} (GPUs 0 when it serves none, §14);
        status is "lost" for a Last Will (`offline` with `will: true`; `lost` is then
        "last_will") and for an online/draining presence not refreshed for PRESENCE_STALE_S
        (`lost` "not_refreshed"; `last_seen` is when it went silent).
    Raises:
        DecodeError: not a §7 presence; SignatureError: `sig` missing or wrong;
        ProtocolError: the presence names another session than its topic.
    """
    presence = wire.decode(raw, "presence")
    if roster_root is None:
        crypto.verify(presence.to_dict(), keys.sign_key)
    else:
        roster.check_presence(roster_root, presence, keys)
    session = names.parse_presence_topic(topic, topic_root)
    if session != presence.session:
        raise ProtocolError(f"presence for session {presence.session!r} published on {topic}")
    status, lost = presence.status, None
    if status == PresenceStatus.OFFLINE and is_will(presence):
        status, lost = LOST, "last_will"  # the broker published it for a runner gone without a word
    elif status != PresenceStatus.OFFLINE and _presence_age_s(presence.timestamp) > PRESENCE_STALE_S:
        status, lost = LOST, "not_refreshed"  # a dead or cut-off host, or an old presence replayed
    return {"session": presence.session, "status": status, "lost": lost, "host": presence.host,
            "running": list(presence.running), "max_jobs": presence.max_jobs,
            "labels": list(presence.labels or ()), "repos": list(presence.repos or ()),
            "last_seen": presence.timestamp, "runner_id": presence.runner_id, "version": presence.version,
            "gpus": presence.gpus or 0, "gpus_free": presence.gpus_free or 0}


def presence_view(topic: str, raw: bytes, keys: DispatchKeys, topic_root: str, received_at: float,
                  roster_root: Path | None = None) -> RunnerView:
    """One presence message as the queue's `RunnerView` (§7, §14): a presence whose
    signature does not verify is kept with `verified=False` (so the hub can say why a
    job waits), never matched.

    Args:
        received_at: when it was received (monotonic s); `seen_at` is that minus the
            presence's age by its `timestamp` (a retained presence may be old).
        roster_root: verify against this hub registry's roster (§16); None: v1 only.
    Raises:
        DecodeError: not a §7 presence (hostile labels included); ProtocolError: another session than its topic.
    """
    presence = wire.decode(raw, "presence")
    if names.parse_presence_topic(topic, topic_root) != presence.session:
        raise ProtocolError(f"presence for session {presence.session!r} published on {topic}")
    try:
        if roster_root is None:
            crypto.verify(presence.to_dict(), keys.sign_key)
        else:
            roster.check_presence(roster_root, presence, keys)
        verified = True
    except SignatureError as exc:
        log.debug("presence of %s does not verify: %s", presence.session, exc)
        verified = False
    return RunnerView(session=presence.session, runner_id=presence.runner_id, status=presence.status,
                      labels=frozenset(presence.labels or ()), repos=frozenset(presence.repos or ()),
                      max_jobs=presence.max_jobs, gpus=presence.gpus or 0, gpus_free=presence.gpus_free or 0,
                      running=frozenset(presence.running), verified=verified,
                      seen_at=received_at - max(0.0, _presence_age_s(presence.timestamp)),
                      host=presence.host, version=presence.version, will=is_will(presence),
                      last_refusal=last_refusal(presence) if verified else None)


def is_will(presence: wire.Presence) -> bool:
    """The presence is a runner's Last Will (§7): `offline` with the extra field `will: true`."""
    return presence.status == PresenceStatus.OFFLINE and (presence.extras or {}).get("will") is True


def last_refusal(presence: wire.Presence) -> tuple[str, str] | None:
    """The runner's `last_refusal` extra field (§7: unknown presence fields are ignored by
    hubs that do not know it) as (job_id, "reason: detail"); None when absent or malformed."""
    value = (presence.extras or {}).get("last_refusal")
    if not isinstance(value, dict):
        return None
    job_id, reason, detail = value.get("job_id"), value.get("reason"), value.get("detail", "")
    if not (isinstance(job_id, str) and names.JOB_ID_RE.fullmatch(job_id) and isinstance(reason, str)
            and isinstance(detail, str)):
        return None
    return job_id, render.printable(f"{reason}: {detail}"[:REFUSAL_SHOWN_CHARS])


def _presence_age_s(timestamp: str) -> float:
    return time.time() - wire.parse_ts(timestamp).timestamp()


@dataclass
class PresenceBurst:
    """What one subscription to retained presence received (§7).

    Attributes:
        rows: verified presences by session; refused: one line per refused presence.
        received: non-empty retained presences received (verified or refused).
        cut_off: the collection ended at its time limit while retained ones still came.
    """

    rows: dict[str, Row] = field(default_factory=dict)
    refused: list[str] = field(default_factory=list)
    received: int = 0
    cut_off: bool = False

    def sorted_rows(self) -> list[Row]:
        return sorted(self.rows.values(), key=lambda row: str(row["session"]))


def receive_presence(client: Transport, keys: DispatchKeys, session: str | None = None, *,
                     quiet_s: float = PRESENCE_QUIET_S, max_s: float = PRESENCE_MAX_S,
                     roster_root: Path | None = None) -> PresenceBurst:
    """Subscribe to the retained presence of one session (or all, `ROOT/runners/+`)
    and collect it until no retained message came for `quiet_s` seconds, at most `max_s` (§7).

    Unsigned, forged or malformed presence is refused (listed in `refused` for the
    caller to print on stderr), never shown; a revoked runner's is left out silently
    (§16.7). Zero-length payloads (cleared) are ignored.

    Args:
        client: a connected `Transport` (its queue must hold nothing else).
        session: one session, or None for every runner.
        roster_root: the hub's root: verify against its roster (§16); None: v1 only.
    Raises:
        BrokerError: the subscription failed.
    """
    root = client.config.topic_root
    topic_filter = names.presence_topic(session, root) if session else names.all_presence_filter(root)
    client.subscribe([(topic_filter, 1)])
    burst = PresenceBurst()
    end = time.monotonic() + max_s
    quiet_until = time.monotonic() + quiet_s
    while True:
        now = time.monotonic()
        if now >= end and quiet_until > end:
            burst.cut_off = True
        wait_s = min(end, quiet_until) - now
        if wait_s <= 0:
            break
        try:
            message = client.messages.get(timeout=wait_s)
        except queue.Empty:
            break
        if message.retain:  # live refreshes of a large fleet never pause: only the retained burst counts
            quiet_until = time.monotonic() + quiet_s
        if names.parse_presence_topic(message.topic, root) is None or not message.payload:
            continue
        burst.received += message.retain
        try:
            row = verify_presence(message.topic, message.payload, keys, root, roster_root)
        except roster.RevokedPresence:
            continue  # known and expected: `runners --all` lists it from the roster as `revoked`
        except ProtocolError as exc:
            burst.refused.append(f"refused presence on {message.topic}: {exc}")
            continue
        burst.rows[row["session"]] = row
        if session is not None:
            break  # the one retained presence of that session
    return burst


def collect_presence(client: Transport, keys: DispatchKeys, session: str | None = None, *,
                     quiet_s: float = PRESENCE_QUIET_S, max_s: float = PRESENCE_MAX_S,
                     roster_root: Path | None = None) -> tuple[list[Row], list[str]]:
    """`receive_presence` as (rows sorted by session, refusal lines).

    Raises:
        BrokerError: the subscription failed.
    """
    burst = receive_presence(client, keys, session, quiet_s=quiet_s, max_s=max_s, roster_root=roster_root)
    return burst.sorted_rows(), burst.refused


def incomplete_reasons(received: int, *, cut_off: bool, last_count: int | None) -> list[str]:
    """Why a list of `received` presences may miss runners (empty: no sign of it), e.g. a
    broker that lost retained presences.

    Args:
        received: presence messages received in this run.
        cut_off: the burst was still arriving when the time limit ended it.
        last_count: presences received by the previous run, or None.
    """
    reasons = []
    if received in QUEUE_LIMIT_COUNTS:
        reasons.append(f"exactly {received} is a broker queue limit (mosquitto max_queued_messages "
                       f"+ max_inflight_messages; see deploy/mosquitto/mosquitto.conf)")
    if cut_off:
        reasons.append(f"presences were still arriving after {PRESENCE_MAX_S:g} s")
    if last_count is not None and received < last_count:
        reasons.append(f"the previous `runners` received {last_count}")
    return reasons


def _last_count(root: Path) -> int | None:
    """The count kept by the previous run, or None (none kept, or unreadable)."""
    try:
        count = read_json_object(names.runners_seen_path(root), SEEN_MAX_BYTES).get("received")
    except (OSError, ValueError):
        return None
    return count if isinstance(count, int) and not isinstance(count, bool) else None


def _keep_count(root: Path, received: int) -> None:
    """Keep this run's count for the next one; a hub that cannot write it still lists its runners."""
    data = json.dumps({"received": received, "timestamp": utc_now()}).encode("utf-8")
    path = names.runners_seen_path(root)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, data, what=path.name)
    except (OSError, RegistryError) as exc:
        print(f"WARNING: cannot keep the presence count in {path}: {exc}", file=sys.stderr)


def read_presence(client: Transport, keys: DispatchKeys, session: str, *,
                  quiet_s: float = READ_PRESENCE_QUIET_S, roster_root: Path | None = None) -> Row | None:
    """The verified retained presence of `session`, or None when it has none (§7);
    refusals are printed on stderr.

    Raises:
        BrokerError: the subscription failed.
    """
    rows, refused = collect_presence(client, keys, session, quiet_s=quiet_s, roster_root=roster_root)
    for line in refused:
        print(line, file=sys.stderr)
    return rows[0] if rows else None


def gone(row: Row) -> bool:
    """The row's retained presence says its runner is gone: a clean `offline`, or its Last Will."""
    return row["status"] == PresenceStatus.OFFLINE or row.get("lost") == "last_will"


def old_offline(row: Row, older_than_days: float = OFFLINE_HIDDEN_DAYS, now: float | None = None) -> bool:
    """An offline presence (or a Last Will) last seen more than `older_than_days` ago (a session long gone)."""
    if not gone(row):
        return False
    try:
        seen = wire.parse_ts(str(row["last_seen"])).timestamp()
    except (ValueError, TypeError):
        return False
    return (time.time() if now is None else now) - seen > older_than_days * DAY_S


def prune_cli(sessions: list[str], *, workspace: Workspace = None, older_than_days: float = OFFLINE_HIDDEN_DAYS,
              as_json: bool = False) -> int:
    """`mam-orch runners prune`: clear the retained presence (§7) of offline sessions last seen
    more than `older_than_days` ago, or of the named `sessions` (offline ones, any age).

    Returns:
        0, or 1 when a named session is online, draining or lost without its Last Will (refused,
        not cleared) or has no presence.
    Raises:
        UsageError (64), ConfigError (64), EnvFileError (1), BrokerError (3).
    """
    if older_than_days < 0:
        raise UsageError(f"--older-than-days {older_than_days:g} is invalid: expected >= 0")
    for session in sessions:
        names.validate_session(session)
    hub = open_hub(workspace)
    keys = hub.keys()
    client = hub.connect("runners")
    refused = 0
    try:
        burst = receive_presence(client, keys, roster_root=hub.root)
        rows = burst.sorted_rows()
        if sessions:
            by_session = {row["session"]: row for row in rows}
            due = []
            for session in sessions:
                row = by_session.get(session)
                if row is None or not gone(row):
                    what = "has no presence" if row is None else f"is {row['status']}"
                    print(f"ERROR: runner {session} {what}; only an offline presence is cleared", file=sys.stderr)
                    refused += 1
                else:
                    due.append(row)
        else:
            due = [row for row in rows if old_offline(row, older_than_days)]
        for row in due:
            clear_retained(client, names.presence_topic(row["session"], client.config.topic_root))
    finally:
        client.close()
    if as_json or not sys.stdout.isatty():
        for row in due:
            print(json.dumps({"session": row["session"], "last_seen": row["last_seen"], "cleared": True},
                             sort_keys=True))
    elif due:
        print(f"cleared the presence of {len(due)} offline runner{'s' if len(due) != 1 else ''}: "
              f"{', '.join(row['session'] for row in due)}")
    else:
        print(f"nothing to prune: no offline runner last seen more than {older_than_days:g} days ago")
    return 1 if refused else 0


def runners_cli(*, workspace: Workspace = None, as_json: bool = False, show_all: bool = False) -> int:
    """`mam-orch runners`: every runner's verified retained presence (§7):
    session, online / draining / offline, labels (§14), running jobs, last seen. A table on
    a TTY, JSON lines otherwise (or with --json); refusals on stderr, and one
    WARNING line when the list may be incomplete (`incomplete_reasons`). Offline sessions
    last seen more than OFFLINE_HIDDEN_DAYS ago, and revoked runners (§16.7, from the
    roster), are left out unless `show_all` (a count of them is said on stderr).

    Returns:
        0.
    Raises:
        ConfigError (64), EnvFileError (1), BrokerError (3).
    """
    hub = open_hub(workspace)
    keys = hub.keys()
    client = hub.connect("runners")
    try:
        burst = receive_presence(client, keys, roster_root=hub.root)  # §16: enrolled sessions are v2
    finally:
        client.close()
    rows = burst.sorted_rows()
    for line in burst.refused:
        print(line, file=sys.stderr)
    reasons = incomplete_reasons(burst.received, cut_off=burst.cut_off, last_count=_last_count(hub.root))
    if reasons:
        print(f"WARNING: received {burst.received} runner presences; the list may be incomplete: "
              f"{'; '.join(reasons)}", file=sys.stderr)
    _keep_count(hub.root, burst.received)
    hidden = 0 if show_all else sum(old_offline(row) for row in rows)
    if hidden:
        rows = [row for row in rows if not old_offline(row)]
        print(f"{hidden} offline runner{'s' if hidden != 1 else ''} last seen more than {OFFLINE_HIDDEN_DAYS} days "
              f"ago not shown (--all shows them; `mam-orch runners prune` clears them)", file=sys.stderr)
    revoked = revoked_rows(hub.root)
    if show_all:
        rows = sorted(rows + revoked, key=lambda row: str(row["session"]))
    elif revoked:
        print(f"{len(revoked)} revoked runner{'s' if len(revoked) != 1 else ''} not shown (--all shows them)",
              file=sys.stderr)
    if as_json or not sys.stdout.isatty():
        for row in rows:
            print(json.dumps(row, sort_keys=True))
    elif not rows:
        print("(no runners)")
    else:
        print(render.table(["SESSION", "STATUS", "LABELS", "REPOS", "RUNNING", "MAX", "GPUS FREE", "HOST",
                            "LAST SEEN"],
                           [[r["session"], r["status"], ",".join(r["labels"]) or "-", ",".join(r["repos"]) or "-",
                             ",".join(r["running"]) or "-", r["max_jobs"] or "-",
                             f"{r['gpus_free']}/{r['gpus']}" if r.get("gpus") else "-", r["host"] or "-",
                             last_seen_cell(r)]
                            for r in rows]),
              end="")
    return 0


def last_seen_cell(row: Row) -> str:
    """The LAST SEEN cell of a `runners` row: a Last Will's time is when the runner connected,
    so it went silent some time after it (§7)."""
    if row["status"] == REVOKED:
        return f"revoked {row['revoked_at']}"
    if row.get("lost") == "last_will":
        return f"after {row['last_seen']} (Last Will)"
    return str(row["last_seen"])


def revoked_rows(root: Path) -> list[Row]:
    """The revoked runners of the roster as `runners` rows (§16.7): status `revoked`, `revoked_at`,
    their enrolled labels; nothing of a presence (the hub refuses theirs). An unreadable roster
    is said on stderr and lists none."""
    try:
        found = roster.entries(root)
    except RegistryError as exc:
        print(f"WARNING: revoked runners not listed: {exc}", file=sys.stderr)
        return []
    return [{"session": entry.session, "status": REVOKED, "revoked_at": entry.revoked_at,
             "labels": list(entry.labels), "repos": [], "running": [], "max_jobs": 0, "host": "",
             "last_seen": None, "lost": None, "runner_id": "", "version": "", "gpus": 0, "gpus_free": 0}
            for entry in found if entry.revoked_at is not None]
