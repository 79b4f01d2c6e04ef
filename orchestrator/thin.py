"""`mam-orch dispatch` over a running hub service (PROTOCOL §14, issue 11 item 5).

When `mam-orch serve` holds the registry's `.mam/hub.lock`, a dispatch checks
what a dispatch checks (session, brief, contract, MAM_DISPATCH_SECRET), then
registers the job `queued` with its brief and lets the service publish,
judge and mirror it: this process opens no broker connection and follows the
job's audit log (`follow.follow_service`), with the same output and exit codes.
Without a service, `dispatch.dispatch_cli` does everything itself (v1).
"""

from __future__ import annotations

import sys
from typing import BinaryIO

from mam.orchestrator.dispatch import hub_contract, print_started, queue_terms, read_brief, save_brief
from mam.orchestrator.follow import follow_service
from mam.orchestrator.hints import command, detach_hint, reattach_hint
from mam.orchestrator.hub import Workspace, open_hub
from mam.orchestrator.hublock import service_pid
from mam.orchestrator.watch import Detached
from mam.shared.cli.render import print_summary
from mam.shared.protocol import wire
from mam.shared.protocol.errors import ExitCode
from mam.shared.store.records import JobRecord, QueueTerms, describe_target
from mam.shared.store.registry import Registry


def service_runs(workspace: Workspace) -> bool:
    """True when a hub service holds the lock of the registry `workspace` resolves to."""
    return service_pid(open_hub(workspace).root) is not None


def register_queued(registry: Registry, *, brief: str, contract: wire.Contract, terms: QueueTerms) -> JobRecord:
    """Register a checked job `queued` with its brief, for the service to publish (§14):
    the one way `dispatch` over a service and `POST /api/jobs` queue a job."""
    record = registry.register(session=terms.target_session, contract=contract, queue=terms)
    save_brief(registry, record["job_id"], brief)
    return record


def dispatch_via_service(registry: Registry, *, brief: str, contract: wire.Contract, terms: QueueTerms,
                         detach: bool, as_json: bool, workspace: Workspace) -> int:
    """Register the job `queued` with its brief; the service publishes it when a runner
    has a free slot and mirrors it; follow its audit log until it ends.

    Returns:
        the exit code of §9 (0 at once with `detach`; 3 when the service stopped
        before the job ended, with how to go on).
    """
    record = register_queued(registry, brief=brief, contract=contract, terms=terms)
    job_id = record["job_id"]
    print(f"queued job {job_id} for {describe_target(record)} (the hub service publishes it)",
          file=sys.stderr, flush=True)
    if detach:
        print_started(registry.get(job_id), as_json, "dispatched")
        return 0
    try:
        code = follow_service(registry, job_id, human=False if as_json else None, announce=True)
    except Detached:
        print(detach_hint(job_id, workspace), file=sys.stderr)
        return ExitCode.DETACHED
    if code is not None:
        if not as_json and sys.stdout.isatty():
            print_summary(registry, job_id)
        return code
    hint = reattach_hint(registry, job_id, workspace) or ""
    print(f"job {job_id}: the service stopped; start `{command('serve', workspace)}` again. {hint}", file=sys.stderr)
    return ExitCode.BROKER


def thin_dispatch_cli(*, session: str | None, brief: str | None, brief_file: str | None, heartbeat_s: int | None,
                      heartbeat_misses: int | None, ack_timeout_s: int | None, idle_timeout_s: int | None,
                      timeout_s: int | None, detach: bool, as_json: bool, workspace: Workspace,
                      stdin: BinaryIO | None = None, labels: str | None = None, priority: int = 0,
                      queue_timeout_s: int | None = None, retries: int = 0, retry_on: str | None = None) -> int:
    """`mam-orch dispatch` through the running service: the checks of `dispatch_cli`
    (nothing written when one fails), then `dispatch_via_service`.

    Raises:
        UsageError / ConfigError (exit 64), EnvFileError (exit 1).
    """
    terms = queue_terms(session, labels, priority=priority, queue_timeout_s=queue_timeout_s, retries=retries,
                        retry_on=retry_on)._replace(owner_pid=None)  # the service publishes it
    text = read_brief(brief, brief_file, stdin)
    hub = open_hub(workspace)
    contract = hub_contract(hub.root, heartbeat_s=heartbeat_s, heartbeat_misses=heartbeat_misses,
                            ack_timeout_s=ack_timeout_s, idle_timeout_s=idle_timeout_s, timeout_s=timeout_s)
    hub.keys()  # MAM_DISPATCH_SECRET must be usable here too (exit 64 before anything is written)
    return dispatch_via_service(hub.registry, brief=text, contract=contract, terms=terms, detach=detach,
                                as_json=as_json, workspace=workspace)
