"""Submitting a job and following it to its end: `mam-orch dispatch` and `redispatch`
(PROTOCOL §5, §9, §14 "One hub process").

There is one hub engine, `service.HubService`: it places, publishes, judges (§3.2),
clocks (§10), mirrors and retries every open job of a registry. A dispatch checks
what it is given (nothing written when one check fails), registers the job `queued`
with its brief (`register_queued`, also the path of `POST /api/jobs` and `mam.Hub`),
and follows the job's audit log (`follow.Follower`). When `mam-orch serve` runs, this
process opens no broker connection; without one, it runs the same engine in a thread
(`service.EmbeddedService`) until the job ends, so both print the same lines and exit
with the same codes.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import BinaryIO

from mam.orchestrator.dependencies import check as check_dependencies
from mam.orchestrator.dispatch import hub_contract, job_title, print_started, queue_terms, read_brief
from mam.orchestrator.enqueue import refuse_revoked, register_queued
from mam.orchestrator.follow import Follower
from mam.orchestrator.hints import detach_hint, queued_hint, reattach_hint, unserved_hint
from mam.orchestrator.hub import Hub, Workspace, open_hub
from mam.orchestrator.hublock import service_pid
from mam.orchestrator.mirror import OUTAGE_GIVE_UP_S
from mam.orchestrator.results import await_result
from mam.orchestrator.runners import collect_presence, read_presence
from mam.orchestrator.service import EmbeddedService
from mam.orchestrator.watch import Detached
from mam.shared.cli.render import print_summary
from mam.shared.config import env_float
from mam.shared.protocol import wire
from mam.shared.protocol.codes import UNPUBLISHED_STATUSES, PresenceStatus
from mam.shared.protocol.errors import BrokerError, ExitCode
from mam.shared.store.records import QueueTerms, describe_target

log = logging.getLogger("mam.dispatch")

TAKE_OVER_RETRY_S = 1.0  # how often a follower tries to start the engine the broker refused


def follow_job(hub: Hub, engine: EmbeddedService, job_id: str, *, detach: bool, as_json: bool,
               workspace: Workspace, verb: str = "dispatched", show_log: bool = True, offset: int = 0) -> int:
    """Follow a registered job through the hub engine until it ends (with `detach`: until
    it is published); when the engine followed stops, run it here and go on. `offset`: where
    in the job's audit log to start (a redispatch shows its new attempt only).

    Returns:
        the exit code of §9 (0 with `detach` once published; 3 when the engine cannot
        reach the broker any more; 130 on Ctrl-C).
    """
    registry = hub.registry
    follower = Follower(registry, job_id, human=False if as_json else None, announce=True, verb=verb,
                        show_log=show_log, offset=offset)
    while True:
        try:
            code = follower.follow(until_published=detach)
            if code is not None:
                break
            print(f"job {job_id}: the hub service stopped; serving it here", file=sys.stderr, flush=True)
            _take_over(engine, time.monotonic() + env_float("MAM_HUB_OUTAGE_GIVE_UP_S", OUTAGE_GIVE_UP_S))
        except (Detached, KeyboardInterrupt):
            queued = registry.get(job_id)["status"] in UNPUBLISHED_STATUSES
            print(queued_hint(job_id, workspace) if queued else detach_hint(job_id, workspace), file=sys.stderr)
            return ExitCode.DETACHED
        except BrokerError as exc:
            print(f"job {job_id}: {exc}. {reattach_hint(registry, job_id, workspace) or ''}", file=sys.stderr)
            return ExitCode.BROKER
    if not detach:  # §18: the engine stops below; the result the terminal announced lands first
        await_result(registry, job_id)
    # a cancel's confirmation (§6) is awaited here, before the summary; a detached dispatch
    # leaves its own just-published job to whoever watches next, as it always did
    engine.stop(handover=not detach)
    if detach:
        # the follow may end on a note while the engine publishes the job: read the record, then
        # the lines up to it (the audit log is written first), so `published` matches the record
        record = follower.step()
        if follower.published:
            print_started(registry.get(job_id), as_json, verb)
            return 0
        if record["status"] in UNPUBLISHED_STATUSES:  # §14: it waits; say so, don't block
            print_started(record, as_json, str(record["status"]))
            if service_pid(registry.root) is None:
                print(unserved_hint(job_id, workspace), file=sys.stderr)
            return 0
    if not as_json and sys.stdout.isatty():
        print_summary(registry, job_id)
    return code


def _take_over(engine: EmbeddedService, give_up_at: float) -> None:
    """Start the hub engine here after the one followed stopped; while the broker refuses
    (a cluster electing leaders, an outage) try again every `TAKE_OVER_RETRY_S` until the
    monotonic `give_up_at`.

    Raises:
        KeyboardInterrupt: Ctrl-C. BrokerError: still no engine at `give_up_at` (nothing decided).
    """
    while True:
        try:
            engine.ensure()
            return
        except BrokerError as exc:
            left_s = give_up_at - time.monotonic()
            if left_s <= 0:
                raise
            log.info("the hub engine cannot start yet (%s); trying again", exc)
            time.sleep(min(TAKE_OVER_RETRY_S, left_s))


def _require_online(hub: Hub, terms: QueueTerms) -> str | None:
    """`--require-online`: why nothing may be dispatched (the target has no signed `online`
    presence, §7), or None."""
    client = hub.connect()
    try:
        keys, target = hub.keys(), terms.target_session
        if target is not None:
            presence = read_presence(client, keys, target)
            if presence is None or presence["status"] != PresenceStatus.ONLINE:
                state = "has no signed presence" if presence is None else f"is {presence['status']}"
                return (f"session {target} {state}; nothing dispatched (start `mam-runner run "
                        f"--session {target}` there, or drop --require-online)")
            return None
        rows, refused = collect_presence(client, keys)
    finally:
        client.close()
    for line in refused:
        print(line, file=sys.stderr)
    if any(row["status"] == PresenceStatus.ONLINE and set(terms.target_labels) <= set(row["labels"])
           for row in rows):
        return None
    return (f"no runner with labels={','.join(terms.target_labels)} is online; nothing dispatched "
            f"(start `mam-runner run --labels ...` there, or drop --require-online)")


def dispatch_cli(*, session: str | None, brief: str | None, brief_file: str | None, heartbeat_s: int | None,
                 heartbeat_misses: int | None, ack_timeout_s: int | None, idle_timeout_s: int | None,
                 timeout_s: int | None, require_online: bool, detach: bool, as_json: bool,
                 workspace: Workspace, stdin: BinaryIO | None = None, labels: str | None = None,
                 priority: int = 0, queue_timeout_s: int | None = None, retries: int = 0,
                 retry_on: str | None = None, show_log: bool = True, work: wire.Work | None = None,
                 fresh: bool = False, on_limit: str = "pause", title: str | None = None,
                 group: str | None = None, group_limit: int | None = None,
                 cancel_in_progress: bool = False, after: str | None = None, after_if: str | None = None,
                 from_result: str | None = None) -> int:
    """`mam-orch dispatch` (§5, §9, §10, §14).

    Order: validate everything (the target: `--session NAME` (or `remote:NAME`) or
    `--labels a,b`; one brief source, the brief, the contract, the §14 terms,
    MAM_DISPATCH_SECRET, the broker settings) with nothing written; with
    `require_online` read the target's presence and exit 5 unless it is a signed
    `online` one; make sure a hub engine runs (a `serve`, or one started here: broker
    unreachable is exit 3, nothing registered); register the job `queued` with its
    brief; then `follow_job`.

    Returns:
        the exit code of §9: 0 completed, 1 error/agent_blocked, 2 timeout or
        queue_timeout, 3 broker, 4 cancelled, 5 no online runner, 130 detached.
    Raises:
        UsageError / ConfigError (exit 64), EnvFileError (exit 1), BrokerError (exit 3).
    """
    terms = queue_terms(session, labels, priority=priority, queue_timeout_s=queue_timeout_s, retries=retries,
                        retry_on=retry_on, fresh=fresh, on_limit=on_limit, group=group, group_limit=group_limit,
                        cancel_in_progress=cancel_in_progress, after=after, after_if=after_if,
                        from_result=from_result)
    text = read_brief(brief, brief_file, stdin)
    job_title(text, title)  # a bad --title is refused before anything is written
    hub = open_hub(workspace)
    refuse_revoked(hub.registry, terms.target_session)  # before any connection (exit 64)
    contract = hub_contract(hub.root, heartbeat_s=heartbeat_s, heartbeat_misses=heartbeat_misses,
                            ack_timeout_s=ack_timeout_s, idle_timeout_s=idle_timeout_s, timeout_s=timeout_s)
    hub.keys()  # MAM_DISPATCH_SECRET must be usable (exit 64 before anything is written)
    check_dependencies(hub.registry, terms, work)  # unknown ids, cycles: exit 64, nothing written
    if require_online:
        why = _require_online(hub, terms)
        if why is not None:
            print(f"ERROR: {why}", file=sys.stderr)
            return ExitCode.NO_RUNNER
    engine = EmbeddedService(hub)
    try:
        engine.ensure()
        record = register_queued(hub.registry, brief=text, contract=contract, terms=terms, work=work, title=title)
        print(f"{record['status']} job {record['job_id']} for {describe_target(record)}"
              + (f" after {', '.join(terms.after)} (--if {terms.after_if})" if terms.after else ""),
              file=sys.stderr, flush=True)
        return follow_job(hub, engine, record["job_id"], detach=detach, as_json=as_json, workspace=workspace,
                          show_log=show_log)
    finally:
        engine.stop()
