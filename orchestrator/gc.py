"""`mam-orch gc`: retention of the retained topics of ended jobs (PROTOCOL §2),
and `--reclear`: clear again what a broker crash may have brought back.

nats-server 2.15 brings cleared retained messages back after it is SIGKILLed
(killed and restarted, it brought back all 100 retained dispatches, 90 of them
cleared before: docs/deployment.md).
Runners refuse such a dispatch (replayed/expired), and `reclear` takes it off
the broker: the dispatch and control of every job terminal in this hub's
registry (all four retained topics of a job `gc` cleared already), and the
dispatch of every job already started. `mam-orch broker up` runs it after an
unclean stop (docs/deployment.md).
"""

from __future__ import annotations

import json
import sys
import time

from mam.orchestrator.hints import command
from mam.orchestrator.hub import DAY_S, Hub, Workspace, connect, open_hub
from mam.shared.cli import human_view
from mam.shared.cli.render import table
from mam.shared.config import BrokerConfig, apply_job_overrides
from mam.shared.protocol import names
from mam.shared.protocol.codes import TERMINAL_STATUSES, JobStatus
from mam.shared.protocol.errors import BrokerError, BrokerUnavailable, ConfigError, UsageError
from mam.shared.protocol.wire import parse_ts
from mam.shared.store.records import JobRecord, utc_now
from mam.shared.store.root import existing_root
from mam.shared.transport import Transport, sockets
from mam.shared.transport.mqtt import UNREACHABLE

RETAINED_LEAVES = ("dispatch", "events", "state", "control")
RETENTION_DAYS = 7
MAX_RETENTION_DAYS = 36500
GC_AUDIT_EVENT = "retained_cleared"
# What a terminal job must not have retained once ended (its final events and state stay until gc).
ENDED_LEAVES = ("dispatch", "control")
STARTED_LEAVES = ("dispatch",)
# Clears queued before their PUBACKs are awaited: paho's in-flight window (20, its default),
# so each clear is on the wire when its PUBACK timeout starts, as with one at a time.
CLEAR_BATCH = 20
Due = list[tuple[JobRecord, tuple[str, ...]]]  # (a hub record, the retained leaves of its job to clear)


def _gc_text(rows: list[dict[str, object]], dry_run: bool, older_than_days: float, checked: int) -> str:
    """The human view of `gc`: what was (or would be) cleared, or that there is nothing to clear."""
    if not rows:
        return (f"nothing to clear: no job of this hub ended more than {older_than_days:g} days ago and still "
                f"has retained topics ({checked} records checked)\n")
    verb = "would clear" if dry_run else "cleared"
    head = f"{verb} the retained topics of {len(rows)} job{'s' if len(rows) != 1 else ''}:\n"
    return head + table(["JOB", "STATUS", "ENDED"], [[r["job_id"], r["status"], r["updated_at"]] for r in rows])


def gc_cli(*, older_than_days: float = RETENTION_DAYS, workspace: Workspace = None, dry_run: bool = False,
           as_json: bool = False) -> int:
    """`mam-orch gc`: clear the retained dispatch, terminal event, state and
    control of this hub's jobs terminal for longer than `older_than_days` (§2).

    Each job's topics are cleared on its own broker (the record's per-job
    overrides, §13, else the workspace's). Records and audit logs stay on disk; each cleared job gets a
    `retained_cleared` audit line and is skipped by later runs. Jobs still
    pending/running are never touched. Prints one JSON line per job cleared (a
    human view on a terminal without `as_json`; it says when there is nothing to clear).

    Args:
        older_than_days: retention in days, >= 0 (0: every terminal job).
        dry_run: list what would be cleared, publish nothing.
    Returns:
        0, or 1 when some record was corrupt or had refused broker overrides (reported on stderr).
    Raises:
        UsageError (64), EnvFileError (1), BrokerError (3): a broker took no clear (the jobs of
        the other brokers are cleared and printed first).
    """
    if not 0 <= older_than_days <= MAX_RETENTION_DAYS:
        raise UsageError(f"--older-than-days {older_than_days:g} is invalid: expected 0..{MAX_RETENTION_DAYS}")
    existing_root(workspace)
    hub = open_hub(workspace)
    registry = hub.registry
    records, errors = registry.list()
    cutoff_s = time.time() - older_than_days * DAY_S
    due: list[JobRecord] = []
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
    groups, kept = _by_broker(hub, [(record, RETAINED_LEAVES) for record in due], dry_run=dry_run)
    cleared = {record["job_id"] for record, _ in kept} if dry_run else set()
    failed: list[str] = []
    if not dry_run:
        for cfg, group in groups:
            try:
                client = connect(cfg, "gc")
                try:
                    for record, leaves in group:
                        _clear_leaves(client, [(record, leaves)])
                        registry.append_audit(record["job_id"], {"event": GC_AUDIT_EVENT, "timestamp": utc_now(),
                                                                 "topics": list(leaves)})
                        cleared.add(record["job_id"])
                finally:
                    client.close()
            except BrokerError as exc:  # the next broker's jobs are still cleared
                failed.append(str(exc))
    rows = [{"job_id": record["job_id"], "status": record["status"], "updated_at": record["updated_at"],
             "cleared": not dry_run} for record, _ in kept if record["job_id"] in cleared]
    if human_view(as_json):
        if rows or not failed:
            print(_gc_text(rows, dry_run, older_than_days, len(records)), end="")
    else:
        for row in rows:
            print(json.dumps(row))
    for corrupt in errors:
        print(f"ERROR: {corrupt}", file=sys.stderr)
    if failed:
        raise BrokerError(f"clearing failed: {'; '.join(failed)}; run `{command('gc', workspace)}` again once "
                          "the broker is back")
    return 1 if errors or len(kept) < len(due) else 0


def reclear_leaves(record: JobRecord, collected: bool) -> tuple[str, ...]:
    """The retained leaves of `record`'s job that must stay cleared (a broker restart may bring them back).

    Args:
        record: a hub record; collected: `gc` cleared its retained topics already.
    """
    if record["status"] in TERMINAL_STATUSES:
        return RETAINED_LEAVES if collected else ENDED_LEAVES
    if record["status"] == JobStatus.RUNNING:
        return STARTED_LEAVES
    return ()


def reclear(workspace: Workspace = None, *, local_only: bool = False) -> tuple[list[dict[str, object]], int, list[str]]:
    """Clear again the retained topics that must stay cleared, for every hub job (a killed
    nats-server may bring back retained messages it had cleared, §1.3),
    through each host of the fail-over list of its broker in turn (`_clear_on_every_node`; the
    record's per-job overrides, §13, else the workspace's). A broker that takes no clear
    does not stop the others.

    Args:
        workspace: the hub workspace.
        local_only: only the jobs on the workspace's own hosts and port (`broker up` after an
            unclean stop: the broker that crashed), not those dispatched to another broker.
    Returns:
        (one summary per job re-cleared; the number of records reported on stderr, corrupt
        or with refused overrides; one message per broker that took no clear, naming its hosts).
    Raises:
        EnvFileError (1), ConfigError: the workspace's own settings.
    """
    hub = open_hub(workspace)
    records, errors = hub.registry.list()
    for exc in errors:
        print(f"ERROR: {exc}", file=sys.stderr)
    due = []
    for record in records:
        if record.get("role") != "hub":
            continue
        collected = record["status"] in TERMINAL_STATUSES and any(
            line.get("event") == GC_AUDIT_EVENT for line in hub.registry.audit(record["job_id"]))
        leaves = reclear_leaves(record, collected)
        if leaves:
            due.append((record, leaves))
    groups, kept = _by_broker(hub, due)
    if local_only and groups:
        home = hub.broker_config()
        groups = [(cfg, group) for cfg, group in groups if (cfg.hosts, cfg.port) == (home.hosts, home.port)]
    done: set[str] = set()
    failed: list[str] = []
    for cfg, group in groups:
        try:
            _clear_on_every_node(cfg, group, workspace)
            done.update(record["job_id"] for record, _ in group)
        except BrokerError as exc:
            failed.append(str(exc))
    return ([{"job_id": record["job_id"], "status": record["status"], "recleared": list(leaves)}
             for record, leaves in kept if record["job_id"] in done], len(errors) + len(due) - len(kept), failed)


def _by_broker(hub: Hub, due: Due, *, dry_run: bool = False) -> tuple[list[tuple[BrokerConfig, Due]], Due]:
    """`due` grouped by the broker each job lives on: the workspace's (first), or the record's
    per-job overrides (§13: another host list, port or topic root; the others in registry
    order). A record whose overrides are refused (edited by hand: a password, a bad host) is
    one ERROR line on stderr naming its job, and is left out. A dry run only checks the
    overrides (the workspace's settings are not read).

    Returns:
        (the groups, the items kept, in registry order).
    Raises:
        ConfigError, EnvFileError: the workspace's own settings are refused.
    """
    if not due:
        return [], []
    home = BrokerConfig() if dry_run else hub.broker_config()  # read once, not once per record
    groups: dict[BrokerConfig, Due] = {home: []}
    kept: Due = []
    for record, leaves in due:
        overrides = record.get("broker")
        try:
            cfg = apply_job_overrides(home, overrides) if overrides else home
        except ConfigError as exc:
            print(f"ERROR: job {record['job_id']} left alone: {exc}", file=sys.stderr)
            continue
        groups.setdefault(cfg, []).append((record, leaves))
        kept.append((record, leaves))
    return [(cfg, group) for cfg, group in groups.items() if group], kept


def _clear_leaves(client: Transport, due: Due) -> None:
    """Clear the retained `leaves` of each job in `due` (§2): `CLEAR_BATCH` clears queued
    before their PUBACKs are awaited, so a large registry costs a round trip per batch, not per topic.

    Raises:
        BrokerError: a clear was not queued or not acknowledged (PublishTimeout).
    """
    topics = [names.job_topic(record["job_id"], leaf, client.config.topic_root) for record, leaves in due
              for leaf in leaves]
    for start in range(0, len(topics), CLEAR_BATCH):
        waiters = [client.publish_async(topic, b"", retain=True) for topic in topics[start:start + CLEAR_BATCH]]
        for wait in waiters:
            wait()


def _clear_on_every_node(cfg: BrokerConfig, due: Due, workspace: Workspace) -> None:
    """Clear `due` through each host of the fail-over list in turn (§13 `MQTT_BROKER`).

    Each nats-server node of a cluster keeps its own cache of retained messages and drops an
    entry when its stream consumer sees the clear; a node that missed it (restarted, or still
    catching up) keeps handing the stale message out, but a clear published through that node
    itself reaches its cache. A host that cannot be reached, or does not acknowledge a clear
    (a node electing leaders), is one WARNING line on stderr and the walk goes on.

    Raises:
        BrokerError: no host of the list took every clear (exit 3); the message names each.
    """
    missed: list[str] = []
    for host in cfg.hosts:
        try:
            node = connect(cfg.with_overrides(hosts=(host,)), "gc")
        except BrokerUnavailable as exc:
            missed.append(str(exc).removeprefix(UNREACHABLE))
            continue
        try:
            _clear_leaves(node, due)
        except BrokerError as exc:  # PublishTimeout: connected, but no PUBACK
            missed.append(f"{sockets.endpoint(host, cfg.port)} ({exc})")
        finally:
            node.close()
    if len(missed) == len(cfg.hosts):
        raise BrokerError("re-clearing failed on every host: " + "; ".join(missed))
    for reason in missed:
        print(f"WARNING: re-clearing through {reason} failed; run `{command('gc --reclear', workspace)}` "
              "again once it is back", file=sys.stderr)


def reclear_cli(*, workspace: Workspace = None) -> int:
    """`mam-orch gc --reclear`: `reclear`, one JSON line per job re-cleared.

    Returns:
        0, or 1 when some record was corrupt or had refused broker overrides (reported on stderr).
    Raises:
        EnvFileError (1), BrokerError (3): a broker took no clear (the others' jobs are printed first).
    """
    done, errors, failed = reclear(workspace)
    for line in done:
        print(json.dumps(line, sort_keys=True))
    if failed:
        raise BrokerError("; ".join(failed))
    return 1 if errors else 0
