"""The hub's fleet operations: cancel, redispatch, the runners view, and the
retained-topic housekeeping they share (PROTOCOL §2, §5, §6, §7, §10).

`publish_cancel` and `clear_dispatch` take an already connected client so
the watcher and the CLI commands share one connection per process.
"""

from __future__ import annotations

import json
import logging
import sys
from typing import Any

from mam.shared import names

log = logging.getLogger("mam.fleet")



def signing_keys(workspace: Any = None) -> Any:
    """The dispatch keys from MAM_DISPATCH_SECRET (§5).

    Raises:
        ConfigError: the secret is unset or shorter than 32 characters.
    """
    from mam.shared import config, crypto

    return crypto.derive_keys(config.dispatch_secret(workspace=workspace))


def publish_cancel(client: Any, record: dict[str, Any], keys: Any, reason: str) -> None:
    """Publish the signed, retained cancel of §6 for the record's current attempt.

    Args:
        client: a connected `MqttClient`.
        record: the hub record (job_id, attempt_id).
        keys: `DispatchKeys`.
        reason: short text, e.g. "operator", "deadline_timeout".
    Raises:
        BrokerError: no PUBACK.
    """
    from mam.shared import crypto, wire

    control = wire.Control.cancel(record["job_id"], record["attempt_id"], reason)
    payload = wire.encode(crypto.sign(control.to_dict(), keys.sign_key))
    client.publish(names.control_topic(record["job_id"], client.config.topic_root), payload, retain=True)


def clear_retained(client: Any, topic: str) -> None:
    """Clear a retained topic: a zero-length retained publish (§2)."""
    client.publish(topic, b"", retain=True)


def clear_dispatch(client: Any, job_id: str) -> None:
    """Clear the job's retained dispatch (§2, §10 agent_blocked)."""
    clear_retained(client, names.dispatch_topic(job_id, client.config.topic_root))


def close_remote(registry: Any, client: Any, keys: Any, job_id: str, close_reason: str) -> dict[str, Any]:
    """Close an unfinished job on the hub and tell its runner (§10): the
    record goes terminal first (so no job stays pending/running whatever
    happens next), then the retained dispatch is cleared for `agent_blocked`
    and a cancel is published so the agent never outlives the decision.

    Args:
        close_reason: deadline_timeout, agent_blocked or cancelled.
    Returns:
        the record after the close (unchanged if it was already terminal).
    """
    from mam.shared.errors import BrokerError, TransitionRefused

    try:
        record = registry.close(job_id, close_reason, source="delegate_wrapper")
    except TransitionRefused:
        return registry.get(job_id)
    if client is None or keys is None:
        log.warning("job %s closed %s on the hub only: no %s to tell the runner; once that is fixed, "
                    "`mam-orch cancel %s` sends the cancel", job_id, close_reason,
                    "broker connection" if client is None else "MAM_DISPATCH_SECRET", job_id)
        return record
    try:
        if close_reason == "agent_blocked":
            clear_dispatch(client, job_id)
        publish_cancel(client, record, keys, close_reason)
    except BrokerError as exc:
        log.warning("job %s closed %s on the hub; the cancel was not published: %s; `mam-orch cancel %s` "
                    "sends it again", job_id, close_reason, exc, job_id)
    return record


def _cancel_owed(record: dict[str, Any]) -> bool:
    """True when the hub decided this job's end but its runner may not know:
    cancelled, or closed unfinished (deadline_timeout, agent_blocked) — §10."""
    return record["status"] == "cancelled" or (
        record["status"] == "error" and record.get("close_reason") in ("deadline_timeout", "agent_blocked"))


def cancel(job_id: str, *, workspace: Any = None, reason: str = "operator") -> int:
    """`mam-orch cancel` (§6, §8, §10).

    Order: the job id and record first (unknown job: one line, exit 1); a job
    that ended on its own (completed, or an error its runner reported) is
    reported and nothing is sent (exit 0); then MAM_DISPATCH_SECRET and the
    broker settings, then the connection (unreachable: exit 3 and the record
    is unchanged); then an unfinished record goes `cancelled` (CAS, source
    operator), the retained dispatch is cleared (a runner that has not taken
    it never will) and the signed retained cancel is published (a runner
    holding the attempt stops the agent). A job the hub already closed
    (cancelled, deadline_timeout, agent_blocked) gets its cancel published
    again: the first one may never have reached the broker (§10: a remote
    agent never outlives the hub's decision). A dispatch or watch attached to
    the job sees the record and exits 4.

    Prints one JSON line on stdout: {"job_id", "status", "attempt_id", "changed"}.

    Returns:
        0.
    Raises:
        UsageError (64), ConfigError (64), JobNotFound / RegistryError (1),
        BrokerError (3; after the record changed, the message says the runner was not told).
    """
    from mam.orchestrator.dispatch import connect
    from mam.shared import config
    from mam.shared.codes import TERMINAL_STATUSES
    from mam.shared.errors import BrokerError, TransitionRefused
    from mam.shared.registry import Registry

    names.validate_job_id(job_id)
    registry = Registry(config.resolve_root(workspace))
    record = registry.get(job_id)
    changed = False
    if record["status"] not in TERMINAL_STATUSES or _cancel_owed(record):
        keys = signing_keys(registry.root)
        cfg = config.broker_config(record.get("broker") or None, workspace=registry.root)
        client = connect(cfg, "cancel")
        try:
            if record["status"] not in TERMINAL_STATUSES:
                try:
                    record = registry.close(job_id, "cancelled", source="operator", reason=reason)
                    changed = True
                except TransitionRefused:
                    record = registry.get(job_id)  # it ended while we connected
            if changed or _cancel_owed(record):
                try:
                    clear_dispatch(client, job_id)
                    publish_cancel(client, record, keys, reason)
                except BrokerError as exc:
                    raise BrokerError(f"job {job_id} is {record['status']} on the hub, but its runner was not "
                                      f"told: {exc}; run `mam-orch cancel {job_id}` again") from None
                what = "cancelled" if changed else f"already {record['status']}; sent the cancel to its runner again"
                print(f"job {job_id} (attempt {record['attempt_id']}): {what}", file=sys.stderr)
                print(json.dumps({"job_id": job_id, "status": record["status"], "attempt_id": record["attempt_id"],
                                  "changed": changed}), flush=True)
                return 0
        finally:
            client.close()
    print(f"job {job_id} is already {record['status']}; nothing to cancel", file=sys.stderr)
    print(json.dumps({"job_id": job_id, "status": record["status"], "attempt_id": record["attempt_id"],
                      "changed": False}), flush=True)
    return 0


# ------------------------------------------------------------------ presence (§7)

PRESENCE_QUIET_S = 0.5
# A runner republishes its presence every 60 s (runner.daemon.PRESENCE_REFRESH_S); an
# online/draining presence older than three periods plus the clock skew is "stale".
PRESENCE_STALE_S = 3 * 60.0 + 30.0
PRESENCE_MAX_S = 3.0


def verify_presence(topic: str, raw: bytes, keys: Any, topic_root: str) -> dict[str, Any]:
    """Decode and verify one retained presence (§7) into a row.

    Returns:
        {"session", "status", "host", "running", "max_jobs", "last_seen", "runner_id", "version"};
        status is "stale" for an online/draining presence not refreshed for PRESENCE_STALE_S.
    Raises:
        DecodeError: not a §7 presence; SignatureError: `sig` missing or wrong;
        ProtocolError: the presence names another session than its topic.
    """
    from mam.shared import crypto, wire
    from mam.shared.errors import ProtocolError

    presence = wire.decode(raw, "presence")
    crypto.verify(presence.to_dict(), keys.sign_key)
    session = names.parse_presence_topic(topic, topic_root)
    if session != presence.session:
        raise ProtocolError(f"presence for session {presence.session!r} published on {topic}")
    status = presence.status
    if status != "offline" and _presence_age_s(presence.timestamp) > PRESENCE_STALE_S:
        status = "stale"  # not refreshed: a dead host, or an old presence replayed
    return {"session": presence.session, "status": status, "host": presence.host,
            "running": list(presence.running), "max_jobs": presence.max_jobs,
            "last_seen": presence.timestamp, "runner_id": presence.runner_id, "version": presence.version}


def _presence_age_s(timestamp: str) -> float:
    import time

    from mam.shared.wire import parse_ts

    return time.time() - parse_ts(timestamp).timestamp()


def collect_presence(client: Any, keys: Any, session: str | None = None, *, quiet_s: float = PRESENCE_QUIET_S,
                     max_s: float = PRESENCE_MAX_S) -> tuple[list[dict[str, Any]], list[str]]:
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
    import queue
    import time

    from mam.shared.errors import ProtocolError

    root = client.config.topic_root
    topic_filter = names.presence_topic(session, root) if session else names.all_presence_filter(root)
    client.subscribe([(topic_filter, 1)])
    rows: dict[str, dict[str, Any]] = {}
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
            line = f"refused presence on {message.topic}: {exc}"
            refused.append(line)
            continue
        rows[row["session"]] = row
        if session is not None:
            break  # the one retained presence of that session
    return sorted(rows.values(), key=lambda row: row["session"]), refused


def read_presence(client: Any, keys: Any, session: str, *, quiet_s: float = 1.0) -> dict[str, Any] | None:
    """The verified retained presence of `session`, or None when it has none (§7).

    Raises:
        BrokerError: the subscription failed.
    """
    rows, refused = collect_presence(client, keys, session, quiet_s=quiet_s)
    for line in refused:
        print(line, file=sys.stderr)
    return rows[0] if rows else None


def runners_cli(*, workspace: Any = None, as_json: bool = False) -> int:
    """`mam-orch runners`: every runner's verified retained presence (§7):
    session, online / draining / offline, running jobs, last seen. A table on
    a TTY, JSON lines otherwise (or with --json); refusals on stderr.

    Returns:
        0.
    Raises:
        ConfigError (64), EnvFileError (1), BrokerError (3).
    """
    from mam.orchestrator.dispatch import connect
    from mam.shared import config, render

    root = config.resolve_root(workspace)
    keys = signing_keys(root)
    client = connect(config.broker_config(workspace=root), "runners")
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


# ------------------------------------------------------------------ redispatch (§8)

def redispatch_cli(job_id: str, *, session: str | None = None, brief: str | None = None,
                   brief_file: str | None = None, detach: bool = False, as_json: bool = False,
                   workspace: Any = None, stdin: Any = None) -> int:
    """`mam-orch redispatch` (§5, §8, §10): a new attempt of a job.

    Allowed from `error` or `cancelled`, or from `pending`/`running` after a
    cancel request; never from `completed`. Checked before any network use
    (and again, under the registry lock, by `Registry.redispatch`). The
    brief is the one stored at dispatch time (`dispatch.brief_path`) unless
    `--brief`/`--brief-file` gives a new one. Then: connect (unreachable:
    exit 3, record unchanged), publish a signed cancel for the old attempt
    (its runner may have missed the hub's close), attempt + 1 with a new dispatch_token and
    auth_token, status pending, and `publish_and_watch` as a dispatch does.

    Returns:
        the exit code of §9 (0 with --detach once the dispatch is published).
    Raises:
        UsageError/ConfigError (64), Refusal (1: completed, or unfinished
        without a cancel), JobNotFound (1), BrokerError (3).
    """
    from mam.orchestrator.dispatch import connect, load_brief, publish_and_watch, read_brief
    from mam.shared import config
    from mam.shared.registry import Refusal, Registry

    names.validate_job_id(job_id)
    if session is not None:
        names.validate_session(session)
    registry = Registry(config.resolve_root(workspace))
    record = registry.get(job_id)
    if record["status"] == "completed":
        raise Refusal(job_id, "not_allowed", "refused redispatch: the job completed")
    if record["status"] in ("pending", "running") and not record.get("cancel_requested_at"):
        raise Refusal(job_id, "not_allowed", f"refused redispatch: the job is {record['status']}; "
                                             f"cancel it first (mam-orch cancel {job_id})")
    if brief is not None or brief_file is not None:
        text = read_brief(brief, brief_file, stdin)
    else:
        text = load_brief(registry, job_id)
    keys = signing_keys(registry.root)
    cfg = config.broker_config(record.get("broker") or None, workspace=registry.root)
    client = connect(cfg)
    try:
        # The old attempt must not outlive the new one: its runner may never have heard the
        # hub's close (a broker outage), so cancel it again before attempt + 1 goes out (§6, §10).
        publish_cancel(client, record, keys, "redispatch")
        new = registry.redispatch(job_id, source="operator", session=session, reason="operator redispatch")
        return publish_and_watch(registry, new, text, keys, client, detach=detach, as_json=as_json,
                                 verb="redispatched")
    finally:
        client.close()


# ------------------------------------------------------------------ retention (§2)

RETAINED_LEAVES = ("dispatch", "events", "state", "control")
RETENTION_DAYS = 7
GC_AUDIT_EVENT = "retained_cleared"


def gc_cli(*, older_than_days: float = RETENTION_DAYS, workspace: Any = None, dry_run: bool = False) -> int:
    """`mam-orch gc`: clear the retained dispatch, terminal event, state and
    control of this hub's jobs terminal for longer than `older_than_days` (§2).

    Records and audit logs stay on disk; each cleared job gets a
    `retained_cleared` audit line and is skipped by later runs. Jobs still
    pending/running are never touched. Prints one JSON line per job cleared.

    Args:
        older_than_days: retention in days, >= 0 (0: every terminal job).
        dry_run: list what would be cleared, publish nothing.
    Returns:
        0, or 1 when some record was corrupt (reported on stderr).
    Raises:
        UsageError (64), EnvFileError (1), BrokerError (3).
    """
    import time

    from mam.orchestrator.dispatch import connect
    from mam.shared import config
    from mam.shared.codes import TERMINAL_STATUSES
    from mam.shared.errors import UsageError
    from mam.shared.registry import Registry, utc_now
    from mam.shared.wire import parse_ts

    if not 0 <= older_than_days <= 36500:
        raise UsageError(f"--older-than-days {older_than_days:g} is invalid: expected 0..36500")
    registry = Registry(config.resolve_root(workspace))
    records, errors = registry.list()
    cutoff_s = time.time() - older_than_days * 86400
    due = []
    for record in records:
        if record.get("role") != "hub" or record["status"] not in TERMINAL_STATUSES:
            continue
        try:
            ended_s = parse_ts(record["updated_at"]).timestamp()
        except (KeyError, ValueError, TypeError):
            continue
        if ended_s <= cutoff_s and not any(line.get("event") == GC_AUDIT_EVENT
                                           for line in registry.audit(record["job_id"])):
            due.append(record)
    if due and not dry_run:
        client = connect(config.broker_config(workspace=registry.root), "gc")
        try:
            for record in due:
                job_id = record["job_id"]
                for leaf in RETAINED_LEAVES:
                    clear_retained(client, names.job_topic(job_id, leaf, client.config.topic_root))
                registry.append_audit(job_id, {"event": GC_AUDIT_EVENT, "timestamp": utc_now(),
                                               "topics": list(RETAINED_LEAVES)})
        finally:
            client.close()
    for record in due:
        print(json.dumps({"job_id": record["job_id"], "status": record["status"],
                          "updated_at": record["updated_at"], "cleared": not dry_run}))
    for exc in errors:
        print(f"ERROR: {exc}", file=sys.stderr)
    return 1 if errors else 0
