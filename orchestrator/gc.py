"""`mam-orch gc`: retention of the retained topics of ended jobs (PROTOCOL §2),
and `--reclear`: clear again what a broker crash may have brought back.

nats-server 2.15 brings cleared retained messages back after it is SIGKILLed
(issue 10 fault 7: 100 retained dispatches, 90 cleared, kill -9, restart: 100).
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
from mam.shared import names
from mam.shared.clikit import human_view
from mam.shared.codes import TERMINAL_STATUSES, JobStatus
from mam.shared.config import BrokerConfig, apply_job_overrides, existing_root
from mam.shared.errors import BrokerError, BrokerUnavailable, ConfigError, UsageError
from mam.shared.mqtt import UNREACHABLE, MqttClient
from mam.shared.records import JobRecord, utc_now
from mam.shared.render import table
from mam.shared.wire import parse_ts

RETAINED_LEAVES = ("dispatch", "events", "state", "control")
RETENTION_DAYS = 7
MAX_RETENTION_DAYS = 36500
GC_AUDIT_EVENT = "retained_cleared"
# What a terminal job must not have retained once ended (its final events and state stay until gc).
ENDED_LEAVES = ("dispatch", "control")
STARTED_LEAVES = ("dispatch",)
# Clears in flight at once: paho sends 20 before the first PUBACK, and a batch of 100 is
# acknowledged well inside the PUBACK timeout even over a slow tailnet link.
CLEAR_BATCH = 100
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
        UsageError (64), EnvFileError (1), BrokerError (3).
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
    groups, refused = _by_broker(hub, [(record, RETAINED_LEAVES) for record in due])
    kept = {record["job_id"] for group in groups.values() for record, _ in group}
    due = [record for record in due if record["job_id"] in kept]
    if not dry_run:
        for cfg, group in groups.items():
            client = connect(cfg, "gc")
            try:
                for item in group:
                    _clear_leaves(client, [item])
                    registry.append_audit(item[0]["job_id"], {"event": GC_AUDIT_EVENT, "timestamp": utc_now(),
                                                              "topics": list(RETAINED_LEAVES)})
            finally:
                client.close()
    rows = [{"job_id": record["job_id"], "status": record["status"], "updated_at": record["updated_at"],
             "cleared": not dry_run} for record in due]
    if human_view(as_json):
        print(_gc_text(rows, dry_run, older_than_days, len(records)), end="")
    else:
        for row in rows:
            print(json.dumps(row))
    for exc in errors:
        print(f"ERROR: {exc}", file=sys.stderr)
    return 1 if errors or refused else 0


def reclear_leaves(record: JobRecord, collected: bool) -> tuple[str, ...]:
    """The retained leaves of `record`'s job that must stay cleared (issue 10 fault 7).

    Args:
        record: a hub record; collected: `gc` cleared its retained topics already.
    """
    if record["status"] in TERMINAL_STATUSES:
        return RETAINED_LEAVES if collected else ENDED_LEAVES
    if record["status"] == JobStatus.RUNNING:
        return STARTED_LEAVES
    return ()


def reclear(workspace: Workspace = None) -> tuple[list[dict[str, object]], int]:
    """Clear again the retained topics that must stay cleared, for every hub job (fault 7),
    through each host of the fail-over list of its broker in turn (`_clear_on_every_node`; the
    record's per-job overrides, §13, else the workspace's).

    Args:
        workspace: the hub workspace.
    Returns:
        (one summary per job re-cleared, number of records reported on stderr: corrupt, or refused overrides).
    Raises:
        EnvFileError (1), BrokerError (3): no host of the list took every clear.
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
    groups, refused = _by_broker(hub, due)
    for cfg, group in groups.items():
        _clear_on_every_node(cfg, group, workspace)
    return [{"job_id": record["job_id"], "status": record["status"], "recleared": list(leaves)}
            for group in groups.values() for record, leaves in group], len(errors) + refused


def _by_broker(hub: Hub, due: Due) -> tuple[dict[BrokerConfig, Due], int]:
    """`due` grouped by the broker each job lives on: the workspace's, or the record's
    per-job overrides (§13: another host list, port or topic root), in registry order.
    A record whose overrides are refused (edited by hand: a password, a bad host) is one
    ERROR line on stderr naming its job, and is left out.

    Returns:
        (the groups, the number of records left out).
    Raises:
        ConfigError, EnvFileError: the workspace's own settings are refused.
    """
    if not due:
        return {}, 0
    base = hub.broker_config()
    groups: dict[BrokerConfig, Due] = {}
    refused = 0
    for item in due:
        overrides = item[0].get("broker")
        try:
            cfg = apply_job_overrides(base, overrides) if overrides else base
        except ConfigError as exc:
            print(f"ERROR: job {item[0]['job_id']} left alone: {exc}", file=sys.stderr)
            refused += 1
            continue
        groups.setdefault(cfg, []).append(item)
    return groups, refused


def _clear_leaves(client: MqttClient, due: Due) -> None:
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
            missed.append(f"{node.endpoint} ({exc})")
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
        EnvFileError (1), BrokerError (3).
    """
    done, errors = reclear(workspace)
    for line in done:
        print(json.dumps(line, sort_keys=True))
    return 1 if errors else 0
