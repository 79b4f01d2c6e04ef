"""`mam-orch redispatch` (PROTOCOL §5, §8, §10): a new attempt of a job; `mam-orch resume`
(§14 Pauses): a job paused on a usage limit goes on now."""

from __future__ import annotations

import json
import sys
from typing import BinaryIO

from mam.orchestrator.control import publish_cancel
from mam.orchestrator.dispatch import load_brief, read_brief, save_brief
from mam.orchestrator.follow import AuditTail
from mam.orchestrator.hub import Hub, Workspace, open_hub
from mam.orchestrator.queuewait import refuse_redispatch, refuse_unpaused, requeue, resume_paused, say_requeue
from mam.orchestrator.say import NoWord, say_running
from mam.orchestrator.service import EmbeddedService
from mam.orchestrator.submit import follow_job
from mam.shared import cli
from mam.shared.protocol import names
from mam.shared.protocol.codes import OPEN_STATUSES, JobStatus
from mam.shared.protocol.errors import ExitCode
from mam.shared.store.records import Refusal


def redispatch_cli(job_id: str, *, session: str | None = None, brief: str | None = None,
                   brief_file: str | None = None, detach: bool = False, as_json: bool = False,
                   workspace: Workspace = None, stdin: BinaryIO | None = None, fresh: bool = False) -> int:
    """`mam-orch redispatch` (§5, §8, §10): a new attempt of a job.

    Allowed from `error` or `cancelled`, or from `pending`/`running` after a
    cancel request; never from `completed`. Checked before any network use
    (and again, under the registry lock, by `Registry.redispatch`). The
    brief is the one stored at dispatch time (`dispatch.brief_path`) unless
    `--brief`/`--brief-file` gives a new one. Then: connect (unreachable:
    exit 3, record unchanged), publish a signed cancel for the old attempt
    (its runner may have missed the hub's close), attempt + 1 with a new dispatch_token and
    auth_token, status `queued` (§14; `--session` makes that runner the target; `blocked`
    for a job that runs after others, until they end again), and
    `submit.follow_job` as a dispatch does (the hub engine publishes it). The new attempt
    continues the agent's last session (§18) unless `fresh`.

    Returns:
        the exit code of §9 (0 with --detach once the dispatch is published).
    Raises:
        UsageError/ConfigError (64), Refusal (1: completed, or unfinished
        without a cancel), JobNotFound (1), BrokerError (3).
    """
    names.validate_job_id(job_id)
    if session is not None:
        session = names.validate_session(names.strip_remote(session))
    hub = open_hub(workspace)
    registry = hub.registry
    record = registry.get(job_id)
    refuse_redispatch(record)
    if brief is not None or brief_file is not None:
        text = read_brief(brief, brief_file, stdin)
    else:
        text = load_brief(registry, job_id)
    keys = hub.keys()
    client = hub.connect("hub", record)
    try:
        # The old attempt must not outlive the new one: its runner may never have heard the
        # hub's close (a broker outage), so cancel it again before attempt + 1 goes out (§6, §10).
        if record["status"] != JobStatus.QUEUED:  # a queued attempt was never published
            publish_cancel(client, record, keys, "redispatch", hub.root)
    finally:
        client.close()
    engine = EmbeddedService(hub)
    try:
        engine.ensure()
        history = AuditTail(registry.audit_path(job_id))
        history.skip()  # what the job's audit log holds now: the follower shows the new attempt only
        save_brief(registry, job_id, text)
        requeue(registry, job_id, session=session, fresh=fresh)
        return follow_job(hub, engine, job_id, detach=detach, as_json=as_json, workspace=workspace,
                          verb="redispatched", offset=history.offset)
    finally:
        engine.stop()


def resume_cli(job_id: str, *, detach: bool = False, as_json: bool = False, workspace: Workspace = None) -> int:
    """`mam-orch resume` (§14 Pauses): a job paused on a usage limit goes back to the queue now,
    before the limit's reset; its next attempt continues the agent's session on the same runner
    (§18). Then `submit.follow_job`, as `redispatch` does.

    Returns:
        the exit code of §9 (0 with --detach once the dispatch is published).
    Raises:
        UsageError (64), Refusal (1: the job is not paused), JobNotFound (1).
    """
    names.validate_job_id(job_id)
    hub = open_hub(workspace)
    refuse_unpaused(hub.registry.get(job_id))  # before any connection
    engine = EmbeddedService(hub)
    try:
        engine.ensure()
        history = AuditTail(hub.registry.audit_path(job_id))
        history.skip()
        resume_paused(hub.registry, job_id)
        return follow_job(hub, engine, job_id, detach=detach, as_json=as_json, workspace=workspace,
                          verb="resumed", offset=history.offset)
    finally:
        engine.stop()


def say_cli(job_id: str, text: str | None, *, text_file: str | None = None, detach: bool = False,
            as_json: bool = False, workspace: Workspace = None, stdin: BinaryIO | None = None) -> int:
    """`mam-orch say` (§18): a person's follow-up to a job. To a running job whose agent reads
    input while it works, the words go to that agent now ("Input while it runs",
    `say.say_running`). To a job that ended, they become the brief of attempt + 1, which
    continues the agent's last session (`claude --resume`) in the worktree the last attempt
    left, on that runner; then `submit.follow_job`, as `redispatch` does ("Continued
    sessions"). The words are kept like a brief (0600), never in the audit log.

    Returns:
        the exit code of §9 (0 with --detach once the dispatch is published; for a running
        job, 0 once delivered, 1 when the runner could not deliver, 2 with no word from it).
    Raises:
        UsageError (64: bad job id or words), Refusal (1: queued, no input while it runs, or
        no session), JobNotFound (1), BrokerError (3).
    """
    names.validate_job_id(job_id)
    words = read_brief(text, text_file, stdin, flags=("TEXT", "--file"))
    hub = open_hub(workspace)
    registry = hub.registry
    record = registry.get(job_id)
    if record["status"] == JobStatus.RUNNING:
        return _say_running(hub, job_id, words, as_json=as_json)
    if record["status"] in OPEN_STATUSES:  # checked again under the lock by `say_requeue`
        raise Refusal(job_id, "not_allowed", f"refused say: the job is {record['status']}; `say` tells a "
                                             "running agent, or continues a job after it ended")
    hub.keys()
    engine = EmbeddedService(hub)
    try:
        engine.ensure()
        history = AuditTail(registry.audit_path(job_id))
        history.skip()
        previous = load_brief(registry, job_id)
        save_brief(registry, job_id, words)
        try:
            say_requeue(registry, job_id)
        except BaseException:
            save_brief(registry, job_id, previous)  # refused: the job's brief stays what it was
            raise
        return follow_job(hub, engine, job_id, detach=detach, as_json=as_json, workspace=workspace,
                          verb="continued", offset=history.offset)
    finally:
        engine.stop()


def _say_running(hub: Hub, job_id: str, words: str, *, as_json: bool) -> int:
    """`say` to a running agent: one line on stderr (and a JSON object on a pipe); the exit code."""
    try:
        delivered, detail = say_running(hub, job_id, words)
    except NoWord as exc:
        print(f"ERROR: {exc}", file=sys.stderr)
        return ExitCode.TIMEOUT
    shown = detail if delivered else f"{detail}; say it again once the job ended, to continue its session"
    print(f"job {job_id}: {shown}", file=sys.stderr)
    if not cli.human_view(as_json):
        print(json.dumps({"job_id": job_id, "delivered": delivered, "detail": detail}), flush=True)
    return ExitCode.COMPLETED if delivered else ExitCode.REFUSED
