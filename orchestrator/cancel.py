"""`mam-orch cancel` (PROTOCOL §6, §8, §10): the hub's record goes `cancelled`,
the retained dispatch is cleared and a signed retained cancel is published."""

from __future__ import annotations

import json
import sys

from mam.orchestrator.control import cancel_owed, cancel_queued, tell_runner
from mam.orchestrator.hints import command
from mam.orchestrator.hub import Workspace, open_hub
from mam.shared.cli import human_view
from mam.shared.protocol import names
from mam.shared.protocol.codes import TERMINAL_STATUSES, UNPUBLISHED_STATUSES, JobStatus
from mam.shared.protocol.errors import TransitionRefused
from mam.shared.store.records import JobRecord


def _print_result(record: JobRecord, changed: bool, as_json: bool = False) -> None:
    if human_view(as_json):  # the one line on stderr already said what happened
        return
    print(json.dumps({"job_id": record["job_id"], "status": record["status"], "attempt_id": record["attempt_id"],
                      "changed": changed}), flush=True)


def cancel(job_id: str, *, workspace: Workspace = None, reason: str = "operator", as_json: bool = False) -> int:
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

    Prints one line on stderr; on a pipe (or `as_json`) also one JSON line on stdout:
    {"job_id", "status", "attempt_id", "changed"}.

    Returns:
        0.
    Raises:
        UsageError (64), ConfigError (64), JobNotFound / RegistryError (1),
        BrokerError (3; after the record changed, the message says the runner was not told).
    """
    names.validate_job_id(job_id)
    hub = open_hub(workspace)
    registry = hub.registry
    before = registry.get(job_id)["status"]
    record, changed = cancel_queued(registry, job_id, reason)  # §14: a queued job is cancelled on the hub only
    if changed:
        print(f"job {job_id} (attempt {record['attempt_id']}): cancelled while "
              f"{before if before in UNPUBLISHED_STATUSES else JobStatus.QUEUED}", file=sys.stderr)
        _print_result(record, True, as_json)
        return 0
    if record["status"] not in TERMINAL_STATUSES or cancel_owed(record):
        keys = hub.keys()
        client = hub.connect("cancel", record)
        try:
            if record["status"] not in TERMINAL_STATUSES:
                try:
                    record = registry.close(job_id, "cancelled", source="operator", reason=reason)
                    changed = True
                except TransitionRefused:
                    record = registry.get(job_id)  # it ended while we connected
            if changed or cancel_owed(record):
                tell_runner(client, record, keys, reason, hub.root,
                            f"run `{command(f'cancel {job_id}', workspace)}` again")
                what = "cancelled" if changed else f"already {record['status']}; sent the cancel to its runner again"
                print(f"job {job_id} (attempt {record['attempt_id']}): {what}", file=sys.stderr)
                _print_result(record, changed, as_json)
                return 0
        finally:
            client.close()
    print(f"job {job_id} is already {record['status']}; nothing to cancel", file=sys.stderr)
    _print_result(record, False, as_json)
    return 0
