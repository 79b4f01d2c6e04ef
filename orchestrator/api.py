"""The Python API of the hub, exported as `mam.Hub`:

    from mam import Hub
    hub = Hub(workspace="/srv/hub")
    job = hub.dispatch("make test", labels=["gpu"], retries=1)
    for event in job.events():
        print(event["event"], event["detail"])
    outcome = job.wait(timeout_s=3600)

A job is registered `queued` with its brief, exactly as `mam-orch dispatch`
does over a running service (`thin.dispatch_via_service`): the hub service
publishes it when a runner has a free slot (§14), judges and mirrors its
messages (§3.2, §10). When no `mam-orch serve` runs for the registry, the
`Hub` runs the same service in a background thread of this process (one
broker connection for every job it dispatches) until `close()`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from mam.orchestrator import schedules
from mam.orchestrator.asks import Ask, answer_from, asks_of, pending
from mam.orchestrator.control import close_remote
from mam.orchestrator.dependencies import check as check_dependencies
from mam.orchestrator.dispatch import check_brief, hub_contract, parse_after, work_terms
from mam.orchestrator.enqueue import register_queued
from mam.orchestrator.follow import FOLLOW_POLL_S, AuditTail, is_event_line
from mam.orchestrator.hub import Workspace, open_hub
from mam.orchestrator.hublock import service_pid
from mam.orchestrator.queuewait import settled
from mam.orchestrator.results import read_result
from mam.orchestrator.runners import receive_presence
from mam.orchestrator.service import EmbeddedService
from mam.shared.protocol import names
from mam.shared.protocol.codes import DEFAULT_RETRY_ON, TERMINAL_STATUSES
from mam.shared.protocol.errors import TransitionRefused, UsageError
from mam.shared.store.changes import SAFETY_S, JobChanges
from mam.shared.store.records import DEFAULT_QUEUE_TIMEOUT_SEC, JobRecord, QueueTerms, exit_code_of, redact


@dataclass(frozen=True)
class Outcome:
    """How a job ended.

    Attributes:
        status: `completed`, `error` or `cancelled` (§8).
        exit_code: what `mam-orch dispatch` exits with for it (§9: 0, 1, 2 or 4).
        close_reason: why the hub closed it (`deadline_timeout`, `agent_blocked`,
            `queue_timeout`, `runner_lost`, `cancelled`), None when the runner reported the end.
        detail: the terminal event's detail ("" when none came).
        agent_exit_code: the agent's own exit code when the runner reported one.
    """

    status: str
    exit_code: int
    close_reason: str | None
    detail: str
    agent_exit_code: int | None


class Job:
    """One job of a `Hub`; `id` is its job id (§1)."""

    def __init__(self, hub: Hub, job_id: str) -> None:
        self.hub = hub
        self.id = job_id

    def __repr__(self) -> str:
        return f"Job({self.id!r})"

    def record(self) -> dict[str, Any]:
        """The hub record, tokens redacted."""
        redacted: dict[str, Any] = redact(self.hub.registry.get(self.id))
        return redacted

    def status(self) -> str:
        """`queued`, `pending`, `running`, `completed`, `error` or `cancelled`."""
        return self.hub.registry.get(self.id)["status"]

    def events(self, timeout_s: float | None = None) -> Iterator[dict[str, Any]]:
        """Every accepted event (§3) of the job, oldest first, as the hub stored them,
        until the job ends.

        Raises:
            TimeoutError: `timeout_s` passed before the job ended.
        """
        self.hub.ensure_service()
        tail = AuditTail(self.hub.registry.audit_path(self.id))
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with JobChanges(self.hub.registry.root, self.id, FOLLOW_POLL_S) as changes:  # told of writes, not polling
            while True:
                record = self.hub.registry.get(self.id)
                for line in tail.read():
                    if is_event_line(line, self.id):
                        yield line
                if settled(record):
                    return
                left = SAFETY_S if deadline is None else min(SAFETY_S, deadline - time.monotonic())
                if left <= 0:
                    raise TimeoutError(f"job {self.id} is still {record['status']} after {timeout_s:g} s")
                changes.wait(left)

    def wait(self, timeout_s: float | None = None) -> Outcome:
        """Block until the job ends.

        Raises:
            TimeoutError: `timeout_s` passed first (the job goes on).
        """
        for _ in self.events(timeout_s):
            pass
        return outcome_of(self.hub.registry.get(self.id), self.hub.registry.audit(self.id))

    def cancel(self) -> None:
        """Cancel the job (§6); see `Hub.cancel`."""
        self.hub.cancel(self.id)

    def result(self, attempt: int | None = None) -> dict[str, Any] | None:
        """The change a repository job brought back (§18), as `mam-orch result --json`
        prints it: repo, ref, base_sha, head_sha, commits, files, insertions, deletions,
        note, artifacts, `ready` (False while its chunks still arrive).

        Args:
            attempt: which attempt (default: the latest one that sent a result).
        Returns:
            the result as a dict, or None when no attempt sent one (yet).
        """
        found = read_result(self.hub.registry, self.id, attempt)
        return None if found is None else found.to_dict()

    def patch(self, attempt: int | None = None) -> bytes | None:
        """The change as `git diff --binary` output (§18), or None when there is none
        (no result yet, no change, or a change over the runner's `--max-result-bytes`)."""
        found = read_result(self.hub.registry, self.id, attempt)
        path = None if found is None else found.patch_path
        return None if path is None else path.read_bytes()

    def transcript(self, attempt: int | None = None) -> bytes | None:
        """The agent's session transcript the result brought (§18 "Transcripts"): JSON lines,
        secrets masked; None when there is none (no result yet, or its agent kept none)."""
        found = read_result(self.hub.registry, self.id, attempt)
        path = None if found is None else found.transcript_path
        return None if path is None else path.read_bytes()

    def asks(self, *, waiting: bool = False) -> list[PermissionRequest]:
        """The agent's permission requests (§19), oldest first; `waiting`: only those a person
        must still answer."""
        found = pending(self.hub.registry, self.id) if waiting else asks_of(self.hub.registry, self.id)
        return [PermissionRequest(**ask.to_dict(), hub=self.hub) for ask in found]

    def artifacts(self, attempt: int | None = None) -> dict[str, Path]:
        """The files the agent left in `$MAM_ARTIFACTS_DIR` (§18), by name: their paths under
        `.mam/artifacts/<id>/<attempt>/` (empty: none, or no result yet)."""
        found = read_result(self.hub.registry, self.id, attempt)
        return {} if found is None else {name: found.artifact_path(name) for name in found.artifacts()}


@dataclass(frozen=True)
class PermissionRequest(Ask):
    """An agent's request for a person's permission (§19), answered with `approve()` or `deny()`.

    Attributes (those of `Ask`): job_id, attempt_id, request_id; tool, e.g. "Bash"; input: its
    one-line, masked summary; full_input: the whole input as JSON, sealed to the hub by the
    runner (None: too large); asked_at: UTC timestamp; behavior: "allow" | "deny" once
    answered, else None; answered_by, answered_at, message: who answered, when, and what the
    agent was told.
    """

    hub: Hub | None = field(default=None, repr=False, compare=False)

    def approve(self, *, always: bool = False) -> PermissionRequest:
        """Allow it: the runner hands the answer to the waiting agent (`always`: and allows the
        same tool with the same input again without asking). Returns it answered.

        Raises:
            AnswerRefused: unknown, answered already, of an older attempt, or the job ended.
            BrokerError: not sent (nothing recorded).
        """
        return self._answer(True, None, always)

    def deny(self, reason: str | None = None) -> PermissionRequest:
        """Deny it; the agent is told `reason` (1-256 characters) and goes on. Raises as `approve`."""
        return self._answer(False, reason)

    def _answer(self, allow: bool, reason: str | None, always: bool = False) -> PermissionRequest:
        if self.hub is None:
            raise UsageError("this request has no hub to answer it through (get it from Job.asks())")
        done = answer_from(self.hub._hub, self.job_id, self.request_id, allow=allow, message=reason, always=always)
        return PermissionRequest(**done.to_dict(), hub=self.hub)


def outcome_of(record: JobRecord, audit: Sequence[dict[str, Any]]) -> Outcome:
    """The `Outcome` of a terminal record and its audit log."""
    terminal = [line for line in audit if line.get("event") in ("completed", "error") and "schema_version" in line
                and line.get("data", {}).get("attempt_id") == record["attempt_id"]]
    detail = str(terminal[-1].get("detail", "")) if terminal else ""
    return Outcome(status=record["status"], exit_code=exit_code_of(record), close_reason=record.get("close_reason"),
                   detail=detail, agent_exit_code=record.get("exit_code"))


class Hub:
    """The hub of one registry (§8), for code.

    Args:
        workspace: the registry root (as `--workspace`; default: the current one, §8).
        embedded: run the hub service in this process when none runs (default True);
            False: `dispatch` needs a running `mam-orch serve`.
    """

    def __init__(self, workspace: Workspace = None, *, embedded: bool = True) -> None:
        self._hub = open_hub(workspace)
        self.registry = self._hub.registry
        self.embedded = embedded
        self._engine = EmbeddedService(self._hub)

    def __enter__(self) -> Hub:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def ensure_service(self) -> None:
        """Make sure a hub service runs for the registry: a `mam-orch serve`, or one in a thread here.

        Raises:
            UsageError: none runs and `embedded` is False. MamError: the embedded one failed to start.
        """
        if not self.embedded and service_pid(self.registry.root) is None:
            raise UsageError(f"no hub service runs for {self.registry.root}: start `mam-orch serve`")
        if self.embedded:
            self._engine.ensure()

    def dispatch(self, brief: str, *, labels: Sequence[str] | None = None, session: str | None = None,
                 priority: int = 0, retries: int = 0, retry_on: Sequence[str] = DEFAULT_RETRY_ON,
                 queue_timeout_s: int = DEFAULT_QUEUE_TIMEOUT_SEC, heartbeat_s: int | None = None,
                 heartbeat_misses: int | None = None, ack_timeout_s: int | None = None,
                 idle_timeout_s: int | None = None, timeout_s: int | None = None, repo: str | None = None,
                 ref: str | None = None, max_turns: int | None = None, max_cost_usd: float | None = None,
                 allow_tools: Sequence[str] | None = None, deny_tools: Sequence[str] | None = None,
                 permission_mode: str | None = None, ask_timeout_s: int | None = None,
                 on_ask_timeout: str | None = None, fresh: bool = False, on_limit: str = "pause",
                 title: str | None = None, group: str | None = None, group_limit: int = 1,
                 cancel_in_progress: bool = False, memory: str | int | None = None, cpus: float | None = None,
                 pids: int | None = None, gpus: int | None = None, after: Sequence[str] = (),
                 after_if: str = "completed", from_result: str | None = None) -> Job:
        """Queue a job for one runner `session` or any runner carrying all `labels` (§14);
        with `repo` (and `ref`), on a worktree of that repository; `max_turns`,
        `max_cost_usd`, `allow_tools` (e.g. ["Bash(git *)", "Edit"]), `deny_tools` (rules never
        allowed) and `permission_mode` are its agent's policy (§18); `ask_timeout_s` and `on_ask_timeout` ("deny" or
        "cancel") say how long its permission requests wait for a person, and what then (§19);
        `fresh`: a retry starts a new agent session instead of continuing the last one (§18);
        `on_limit`: "pause" (default) the job when its agent stops on a usage limit until the
        limit resets, then continue; "move": at once to another runner of its labels, which
        continues the session (§14 Moves); "fail": it ends `error` (§14 Pauses); `title`: its name in
        lists and the dashboard (default: the brief's first line); `group`: a concurrency group
        of which at most `group_limit` jobs run at once, and with `cancel_in_progress` this job
        cancels the group's earlier ones (§14 Groups); `memory` ("8G" or bytes), `cpus` and `pids`
        limit the job's processes where the runner's host gives the cgroup controllers (§6 "Limits");
        `gpus`: how many of a runner's GPUs it needs (§14 "GPUs"); `after`: job ids it stays
        `blocked` for until each ended, "completed" (default) or only "ended" as `after_if` says,
        else it ends `dependency_failed` (§14 Dependencies); `from_result`: a job of the same `repo`
        whose result the worktree starts from (it runs after it, §18 "Handing a change on").

        Returns:
            the `Job` (queued; the service publishes it when a runner has a free slot).
        Raises:
            UsageError: a bad brief, target or term (one line). ConfigError: no usable MAM_DISPATCH_SECRET.
        """
        check_brief(brief)
        session = names.strip_remote(session) if session is not None else None
        terms = QueueTerms(target_session=session, target_labels=tuple(labels or ()), priority=priority,
                           queue_timeout_sec=queue_timeout_s, retries=retries,
                           retry_on=tuple(retry_on), fresh=fresh, on_limit=on_limit, group=group,
                           group_limit=group_limit, cancel_in_progress=cancel_in_progress,
                           after=parse_after(after) if isinstance(after, str) else tuple(after),
                           after_if=after_if, from_result=from_result).checked()
        contract = hub_contract(self.registry.root, heartbeat_s=heartbeat_s, heartbeat_misses=heartbeat_misses,
                                ack_timeout_s=ack_timeout_s, idle_timeout_s=idle_timeout_s, timeout_s=timeout_s,
                                settings=self._hub.settings())
        work = work_terms(repo=repo, ref=ref, max_turns=max_turns, max_cost_usd=max_cost_usd,
                          allow_tools=allow_tools, deny_tools=deny_tools, permission_mode=permission_mode,
                          ask_timeout_s=ask_timeout_s, on_ask_timeout=on_ask_timeout, memory=memory, cpus=cpus,
                          pids=pids, gpus=gpus, cli=False)
        check_dependencies(self.registry, terms, work)
        self._hub.keys()
        self.ensure_service()
        record = register_queued(self.registry, brief=brief, contract=contract, terms=terms, work=work, title=title)
        return Job(self, record["job_id"])

    def job(self, job_id: str) -> Job:
        """A job of this registry by id.

        Raises:
            UsageError: not a job id. JobNotFound: no such job.
        """
        self.registry.get(job_id)
        return Job(self, job_id)

    def cancel(self, job_id: str) -> str:
        """Cancel a job (§6): the record goes `cancelled` and its runner is told; a job
        that already ended is left alone. Returns the job's status afterwards.

        Raises:
            JobNotFound, BrokerError (the record changed, the runner was not told).
        """
        record = self.registry.get(job_id)
        if record["status"] in TERMINAL_STATUSES:
            return record["status"]
        client = self._hub.connect("cancel", record)
        try:
            try:
                record = close_remote(self.registry, client, self._hub.keys(), job_id, "cancelled")
            except TransitionRefused:
                record = self.registry.get(job_id)
        finally:
            client.close()
        return record["status"]

    def runners(self) -> list[dict[str, Any]]:
        """Every runner's verified retained presence (§7): session, status, labels,
        running, max_jobs, host, last_seen, runner_id, version."""
        client = self._hub.connect("runners")
        try:
            return list(receive_presence(client, self._hub.keys()).sorted_rows())
        finally:
            client.close()

    def jobs(self, status: str | None = None) -> list[dict[str, Any]]:
        """Every job record of the registry (tokens redacted), oldest first."""
        records, _ = self.registry.list(status)
        return [redact(record) for record in records]

    def schedules(self) -> list[dict[str, Any]]:
        """Every schedule as `mam-orch schedule list --json` prints it: name, cron, tz, target,
        next_fire, last_job, last_fired_at, paused, ... (§14 Schedules; never the brief)."""
        return schedules.describe_all(self.registry.root)

    def close(self) -> None:
        """Stop the embedded service, if any (its jobs go on; the next service picks them up)."""
        self._engine.stop()


__all__ = ["Hub", "Job", "Outcome"]
