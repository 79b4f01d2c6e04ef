"""The registry's record model (PROTOCOL §8): the `JobRecord` shape, the
sources that may change a record, the refusals, and the pure helpers that
build, check, transition and redact records. `mam.shared.store.registry` stores
them; docs/registry.md lists the fields and guarantees.

Sources (§8): worker sources (`publisher`, `runner`, `remote_mirror`) hold an
attempt and name its `attempt_id` and `dispatch_token`; operator sources
(`operator`, `registry_cli`, `delegate_wrapper`) may cancel, close and
redispatch. Every refusal is a `Refusal` with a §3.2-style `reason`; messages
name the job and never carry a token.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any, NamedTuple, NotRequired, TypedDict, cast

from mam.shared.protocol import names, wire
from mam.shared.protocol.codes import (
    DEFAULT_RETRY_ON,
    EVENT_NAMES,
    EVENT_STATUS,
    PUBLISHED_STATUSES,
    RECORD_STATUSES,
    RETRY_ON_CHOICES,
    TERMINAL_STATUSES,
    CloseReason,
    EventName,
    JobStatus,
)
from mam.shared.protocol.errors import ExitCode, RegistryError, StaleAttemptError, TransitionRefused, UsageError

RECORD_VERSION = 1
WORKER_SOURCES = frozenset({"publisher", "runner", "remote_mirror"})
OPERATOR_SOURCES = frozenset({"operator", "registry_cli", "delegate_wrapper"})
# worker edges of the state machine; redispatch is its own operation
# (a queued attempt was never published: no worker holds its tokens, §14)
WORKER_EDGES = frozenset({(JobStatus.PENDING, JobStatus.RUNNING)} | {
    (old, new) for old in PUBLISHED_STATUSES for new in TERMINAL_STATUSES})
SECRET_FIELDS = ("auth_token", "dispatch_token")
# Redacted like the secrets: earlier attempts' auth tokens (kept to tell a stale attempt from a forgery, §3.2).
EARLIER_TOKENS = "earlier_auth_tokens"
MAX_EARLIER_TOKENS = 16  # attempts older than this many redispatches are judged as forgeries
# The close reasons of the hub's own decisions: a terminal after them is a late terminal (§14).
HUB_DECISIONS = frozenset({CloseReason.DEADLINE_TIMEOUT, CloseReason.AGENT_BLOCKED, CloseReason.RUNNER_LOST})
RECORD_MAX_BYTES = 1 << 20  # a record is a few hundred bytes; anything this big is hostile
RECORD_NAME_RE = re.compile(r"^[0-9a-f]{8}\.json$")

# The §5 contract is one type, the wire's; records store its five fields.
Contract = wire.Contract


class JobRecord(TypedDict):
    """One job's record on one host (§8); docs/registry.md describes each field."""

    record_version: int
    job_id: str
    status: str
    role: str  # "hub" | "runner"
    session: str
    agent_session: str  # "remote:<session>"
    transport: str
    attempt_id: int
    dispatch_token: str
    auth_token: str
    last_seq: int  # highest seq of the current attempt
    transition_seq: int
    created_at: str
    updated_at: str
    close_reason: str | None
    exit_code: int | None
    broker: dict[str, Any] | None  # per-job overrides, never a password
    origin: str | None
    cancel_requested_at: str | None
    heartbeat_sec: int
    heartbeat_misses: int
    ack_timeout_sec: int
    idle_timeout_sec: int
    timeout_sec: int
    attempt_created_at: NotRequired[str]  # set by a redispatch (§10: a new wall-clock budget)
    earlier_auth_tokens: NotRequired[list[str]]  # earlier attempts' tokens, newest last (§3.2 rule 4)
    seen_seq: NotRequired[int]  # highest seq of any event or state accepted of this attempt (gap lines)
    missing_seqs: NotRequired[list[int]]  # event seqs of this attempt skipped and not yet arrived (§3.2 rule 6)
    late_outcome: NotRequired[str]  # the runner's terminal after the hub closed the job (§14)
    target: NotRequired[dict[str, Any]]  # {"session": NAME} or {"labels": [..]} (§14)
    priority: NotRequired[int]  # §14: higher leaves the queue first
    queue_timeout_sec: NotRequired[int]  # §14: queued longer than this closes `queue_timeout`
    retries: NotRequired[int]  # §14: attempts after the first, 0-10
    retry_on: NotRequired[list[str]]  # §14: the close reasons that retry
    queued_at: NotRequired[str]  # when the current attempt was queued (§14)
    avoid_session: NotRequired[str]  # the previous attempt's runner, chosen last for a label target
    prefer_session: NotRequired[str]  # §18: the previous runner, chosen first: a retry continues its session
    attempt_history: NotRequired[list[dict[str, Any]]]  # earlier attempts: attempt_id, session, status, reason
    retried: NotRequired[int]  # §14: retries made so far
    queue_owner_pid: NotRequired[int]  # written by releases before one hub engine; read by nothing
    work: NotRequired[dict[str, Any]]  # §18: repo, ref and agent policy (`wire.Work.to_dict()`)
    repo_sha: NotRequired[str]  # §18: the commit the current attempt's worktree started from (`started` data)
    agent: NotRequired[dict[str, Any]]  # §18: the agent's figures from the terminal event (`agent_figures`)
    fresh: NotRequired[bool]  # §18: retries start a new agent session (`dispatch --fresh`)
    on_limit: NotRequired[str]  # §14 Pauses: `fail` or `move` (absent: pause)
    group: NotRequired[str]  # §14 Groups: the job's concurrency group
    group_limit: NotRequired[int]  # §14 Groups: at most this many of the group's jobs out at once
    cancel_in_progress: NotRequired[bool]  # §14 Groups: it cancels the group's earlier jobs
    usage_limit: NotRequired[dict[str, Any]]  # §14 Pauses: {"attempt_id", "reset_at"} of an attempt that hit one
    pauses: NotRequired[int]  # §14 Pauses: how often the job paused
    lease_lost: NotRequired[bool]  # §10 Leases: its runner fenced the current attempt (an `error` saying so)
    paused_until: NotRequired[str]  # §14 Pauses: a queued job is not published before this (§3 timestamp)
    limited: NotRequired[dict[str, str]]  # §14 Moves: {"session", "until"}: not published there before `until`
    title: NotRequired[str]  # a person's name for the job: `dispatch --title`, else the brief's first line
    schedule: NotRequired[dict[str, Any]]  # §14 Schedules: {"name", "tick", "catch_up"} of a fired job
    after: NotRequired[list[str]]  # §14 Dependencies: the jobs it stays `blocked` for
    after_if: NotRequired[str]  # §14 Dependencies: `completed` (each must complete) or `ended`
    unblocked_at: NotRequired[str]  # §14 Dependencies: when the last of them ended and it was queued
    from_result: NotRequired[str]  # §18: the job whose result its worktree starts from (also in `after`)


NOTE = "hub_note"
"""An audit line of what the hub engine says about a job ({"event", "line"}); every follower prints it."""
MAX_RETRIES = 10
MAX_QUEUE_TIMEOUT_SEC = 366 * 86400  # a year: anything longer is a mistake
DEFAULT_QUEUE_TIMEOUT_SEC = 86400
MAX_PRIORITY = 1_000_000


GROUP_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,63}$")
"""A concurrency group's name (§14 Groups)."""
MAX_GROUP_LIMIT = 1000
ON_LIMIT_CHOICES = ("pause", "fail", "move")
"""`dispatch --on-limit` (§14 Pauses): the first is the default."""
AFTER_IF_CHOICES = ("completed", "ended")
"""`dispatch --if` (§14 Dependencies): the first is the default."""
MAX_AFTER = 32
"""At most this many jobs in one `--after` (§14 Dependencies)."""


class QueueTerms(NamedTuple):
    """A hub job's §14 terms, stored in its record (not on the wire: the §5 contract
    a v1 runner checks keeps its five fields).

    Attributes:
        target_session: the one runner, or None for a label target.
        target_labels: the labels a runner must carry (sorted; empty with a session).
        priority: higher first; queue_timeout_sec: seconds queued before `queue_timeout`.
        retries: 0-10; retry_on: subset of `RETRY_ON_CHOICES`.
        fresh: a retried attempt starts a new agent session, never continues the last one (§18).
        on_limit: what an attempt that stopped on a usage limit does: `pause` until the
            limit resets, then continue (§14 Pauses), `move` to another runner at once (a
            label target only, §14 Moves), or `fail` (it stays `error`).
        group: a concurrency group (§14 Groups): at most `group_limit` of its jobs are
            published or running at once, fleet-wide; None: no group.
        cancel_in_progress: with a group: this job cancels the group's jobs queued or out
            before it (GitHub Actions' `cancel-in-progress`).
        after: the job ids it runs after (§14 Dependencies): it is `blocked` until each ended;
            empty: it is queued at once.
        after_if: `completed` (each must complete, else it ends `dependency_failed`) or `ended`.
        from_result: the job whose result its worktree starts from (§18 "Handing a change
            on"); `checked` adds it to `after`.
    """

    target_session: str | None = None
    target_labels: tuple[str, ...] = ()
    priority: int = 0
    queue_timeout_sec: int = DEFAULT_QUEUE_TIMEOUT_SEC
    retries: int = 0
    retry_on: tuple[str, ...] = tuple(DEFAULT_RETRY_ON)
    fresh: bool = False
    on_limit: str = "pause"
    group: str | None = None
    group_limit: int = 1
    cancel_in_progress: bool = False
    after: tuple[str, ...] = ()
    after_if: str = AFTER_IF_CHOICES[0]
    from_result: str | None = None

    def checked(self) -> QueueTerms:
        """These terms, validated (labels sorted).

        Raises:
            UsageError: one line naming the bad value.
        """
        if self.target_session is None and not self.target_labels:
            raise UsageError("a job needs a target: give --session NAME or --labels a,b")
        if self.target_session is not None and self.target_labels:
            raise UsageError("give either --session or --labels, not both (§14)")
        if self.target_session is not None:
            names.validate_session(self.target_session)
        labels = names.validate_labels(list(self.target_labels))
        _check_int("--priority", self.priority, -MAX_PRIORITY, MAX_PRIORITY)
        _check_int("--queue-timeout", self.queue_timeout_sec, 1, MAX_QUEUE_TIMEOUT_SEC)
        _check_int("--retries", self.retries, 0, MAX_RETRIES)
        if self.on_limit not in ON_LIMIT_CHOICES:
            raise UsageError(f"--on-limit {str(self.on_limit)[:40]!r} is invalid: expected one of "
                             f"{', '.join(ON_LIMIT_CHOICES)}")
        if self.on_limit == "move" and self.target_session is not None:
            raise UsageError("--on-limit move needs a label target (--labels): a --session job has one runner "
                             "to run on")
        if self.group is not None and not GROUP_RE.fullmatch(str(self.group)):
            raise UsageError(f"--group {str(self.group)[:40]!r} is invalid: expected 1-64 characters of "
                             "letters, digits, '.', '_', ':' or '-', starting with a letter or digit")
        _check_int("--group-limit", self.group_limit, 1, MAX_GROUP_LIMIT)
        if self.group is None and self.group_limit != 1:
            raise UsageError("--group-limit goes with --group NAME")
        if self.group is None and self.cancel_in_progress:
            raise UsageError("--cancel-in-progress goes with --group NAME")
        if self.from_result is not None:
            if not isinstance(self.from_result, str) or not names.JOB_ID_RE.fullmatch(self.from_result):
                raise UsageError(f"--from-result {str(self.from_result)[:40]!r} is invalid: expected a job id of "
                                 "8 hex characters")
            if isinstance(self.after, tuple) and self.from_result not in self.after:
                return self._replace(after=(*self.after, self.from_result)).checked()
        self._check_after()
        bad = [reason for reason in self.retry_on if reason not in RETRY_ON_CHOICES]
        if bad or not self.retry_on or len(set(self.retry_on)) != len(self.retry_on):
            raise UsageError(f"--retry-on {','.join(map(str, self.retry_on))!r} is invalid: expected "
                             f"a subset of {','.join(RETRY_ON_CHOICES)}, each once")
        return self._replace(target_labels=labels, retry_on=tuple(str(r) for r in self.retry_on))

    def _check_after(self) -> None:
        """§14 Dependencies: `after` holds 1..MAX_AFTER distinct job ids, `after_if` a choice."""
        if not isinstance(self.after, tuple) or len(self.after) > MAX_AFTER:
            raise UsageError(f"--after names {len(self.after) if isinstance(self.after, tuple) else '?'} jobs: "
                             f"expected at most {MAX_AFTER}")
        for job_id in self.after:
            if not isinstance(job_id, str) or not names.JOB_ID_RE.fullmatch(job_id):
                raise UsageError(f"--after {str(job_id)[:40]!r} is invalid: expected job ids of 8 hex characters")
        if len(set(self.after)) != len(self.after):
            raise UsageError("--after names a job twice")
        if self.after_if not in AFTER_IF_CHOICES:
            raise UsageError(f"--if {str(self.after_if)[:40]!r} is invalid: expected one of "
                             f"{', '.join(AFTER_IF_CHOICES)}")
        if not self.after and self.after_if != AFTER_IF_CHOICES[0]:
            raise UsageError("--if goes with --after ID")

    def fields(self) -> dict[str, Any]:
        """The record fields of these terms."""
        target: dict[str, Any] = ({"session": self.target_session} if self.target_session is not None
                                  else {"labels": list(self.target_labels)})
        fields = {"target": target, "priority": self.priority, "queue_timeout_sec": self.queue_timeout_sec,
                  "retries": self.retries, "retry_on": list(self.retry_on), "retried": 0}
        if self.fresh:
            fields["fresh"] = True
        if self.on_limit != "pause":
            fields["on_limit"] = self.on_limit
        if self.group is not None:
            fields["group"], fields["group_limit"] = self.group, self.group_limit
        if self.cancel_in_progress:
            fields["cancel_in_progress"] = True
        if self.after:
            fields["after"], fields["after_if"] = list(self.after), self.after_if
        if self.from_result is not None:
            fields["from_result"] = self.from_result
        return fields


def _check_int(name: str, value: object, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise UsageError(f"{name} {value!r} is invalid: expected an integer {low}..{high}")


def target_of(record: Mapping[str, Any]) -> tuple[str | None, tuple[str, ...]]:
    """A record's target (session, labels); a v1 record's is its session."""
    target = record.get("target")
    if isinstance(target, Mapping) and isinstance(target.get("labels"), list):
        return None, tuple(str(label) for label in target["labels"])
    if isinstance(target, Mapping) and isinstance(target.get("session"), str):
        return target["session"], ()
    return record.get("session") or None, ()


def describe_target(record: Mapping[str, Any]) -> str:
    """`labels=a,b` or `session=NAME`, for messages and `show`."""
    session, labels = target_of(record)
    return f"labels={','.join(labels)}" if labels else f"session={session}"


def utc_now() -> str:
    """UTC time as `YYYY-MM-DDTHH:MM:SSZ` (the §3 form)."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def utc_now_us() -> str:
    """UTC time to the microsecond, `YYYY-MM-DDTHH:MM:SS.ffffffZ` (§3 accepts the fraction): a
    record's `queued_at`, so that jobs queued within one second leave in their order (§14)."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


# ------------------------------------------------------------------ errors

class Refusal(TransitionRefused):
    """A refused request (§8), with `job_id` and a §3.2-style `reason`:
    `stale_attempt`, `duplicate`, `after_terminal`, `not_allowed`, `replayed`."""

    def __init__(self, job_id: str, reason: str, message: str) -> None:
        self.job_id = job_id
        self.reason = reason
        super().__init__(f"job {job_id}: {message}")


class StaleTransition(Refusal, StaleAttemptError):
    """A worker request naming an attempt or dispatch token that is not current.
    Catchable as both `TransitionRefused` and `StaleAttemptError`."""

    def __init__(self, job_id: str, message: str) -> None:
        super().__init__(job_id, "stale_attempt", message)


class JobNotFound(RegistryError):
    """No record for that job id on this host."""


def require_source(source: str, allowed: frozenset[str], what: str) -> None:
    """Refuse a `source` not in `allowed` (§8).

    Raises:
        UsageError: naming the allowed sources.
    """
    if source not in allowed:
        raise UsageError(f"source {source!r} may not {what}: expected one of {', '.join(sorted(allowed))}")


# ----------------------------------------------------------------- records

def dumps(obj: object) -> bytes:
    """A record or side file as stored: indented, sorted JSON plus a newline."""
    return (json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode("utf-8")


def check_record(obj: object, job_id: str) -> str | None:
    """Why `obj` (parsed JSON) is not a usable record of `job_id`, or None."""
    if not isinstance(obj, dict):
        return "not a JSON object"
    if obj.get("job_id") != job_id:
        return "job_id does not match the file name"
    if obj.get("status") not in RECORD_STATUSES:
        return f"unknown status {obj.get('status')!r}"
    for key in ("attempt_id", "last_seq", "transition_seq"):
        value = obj.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < (1 if key == "attempt_id" else 0):
            return f"bad {key} {value!r}"
    for key in SECRET_FIELDS:
        if not isinstance(obj.get(key), str) or not obj.get(key):
            return f"missing {key}"
    return None


def as_record(obj: object, job_id: str) -> JobRecord | str:
    """`obj` as a record when `check_record` passes, else the reason it does not."""
    why = check_record(obj, job_id)
    return why if why is not None else cast(JobRecord, obj)  # checked just above


STATUS_EXIT: dict[str, ExitCode] = {JobStatus.COMPLETED: ExitCode.COMPLETED, JobStatus.ERROR: ExitCode.ERROR,
                                    JobStatus.CANCELLED: ExitCode.CANCELLED}
# The hub's own closes that §9 reports as a timeout (exit 2); agent_blocked is an error (exit 1).
TIMEOUT_CLOSES = frozenset({CloseReason.DEADLINE_TIMEOUT, CloseReason.QUEUE_TIMEOUT, CloseReason.RUNNER_LOST})


def exit_code_of(record: Mapping[str, Any]) -> int:
    """The §9 exit code of a terminal record, the one mapping every command and the API use:
    0 completed, 1 error (a runner's error or `agent_blocked`), 2 a timeout close
    (`deadline_timeout`, `queue_timeout`, `runner_lost`), 4 cancelled."""
    if record.get("close_reason") in TIMEOUT_CLOSES:
        return ExitCode.TIMEOUT
    return STATUS_EXIT.get(str(record.get("status")), ExitCode.ERROR)


def validate_broker(broker: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """A record's per-job broker overrides (§8, §13) as a plain JSON copy (hosts as a
    list). The store refuses only what must never be written, a password; which keys
    and values work is `config.apply_job_overrides`'s to say when they are used.

    Returns:
        the copy, or None.
    Raises:
        UsageError: not an object, or a key that names a password.
    """
    if broker is None:
        return None
    if not isinstance(broker, Mapping):
        raise UsageError("broker overrides must be a JSON object")
    if any("pass" in str(key).lower() for key in broker):
        raise UsageError("job broker overrides must not hold a password: passwords never enter a job record (§13)")
    out = dict(broker)
    if isinstance(out.get("hosts"), tuple):
        out["hosts"] = list(out["hosts"])
    return out


def new_record(*, job_id: str, session: str | None, role: str, attempt_id: int, dispatch_token: str,
               auth_token: str, contract: wire.Contract, broker: dict[str, Any] | None,
               origin: str | None, queue: QueueTerms | None = None, work: wire.Work | None = None,
               title: str | None = None, schedule: Mapping[str, Any] | None = None) -> JobRecord:
    """A fresh record of `contract` (§8), created and updated now: `pending`, or
    `queued` with `queue`'s terms (§14; `session` "" until a label target is placed), or
    `blocked` when they name jobs to run after (§14 Dependencies); `work` (§18) and
    `title` are stored when set."""
    now = utc_now()
    terms = contract.to_dict()  # the five §5 fields, idle resolved
    status = JobStatus.PENDING if queue is None else JobStatus.BLOCKED if queue.after else JobStatus.QUEUED
    record: JobRecord = {
        "record_version": RECORD_VERSION, "job_id": job_id, "status": status,
        "role": role, "session": session or "",
        "agent_session": names.agent_session_label(session) if session else "", "transport": "remote",
        "attempt_id": attempt_id, "dispatch_token": dispatch_token, "auth_token": auth_token,
        "last_seq": 0, "transition_seq": 0, "created_at": now, "updated_at": now,
        "close_reason": None, "exit_code": None, "broker": broker, "origin": origin,
        "cancel_requested_at": None, "heartbeat_sec": terms["heartbeat_sec"],
        "heartbeat_misses": terms["heartbeat_misses"], "ack_timeout_sec": terms["ack_timeout_sec"],
        "idle_timeout_sec": terms["idle_timeout_sec"], "timeout_sec": terms["timeout_sec"],
    }
    if queue is not None:
        record.update(queue.fields())  # type: ignore[typeddict-item]  # the NotRequired §14 fields
        if status == JobStatus.QUEUED:  # a blocked job's queue time starts when it is `unblocked`
            record["queued_at"] = utc_now_us()
    if work:
        record["work"] = work.to_dict()
    if title:
        record["title"] = title
    if schedule:
        record["schedule"] = dict(schedule)
    return record


def touched(record: JobRecord) -> JobRecord:
    """A copy of `record` with `updated_at` now (no transition)."""
    new = record.copy()
    new["updated_at"] = utc_now()
    return new


def moved(record: JobRecord, to_status: str, *, close_reason: str | None = None,
          exit_code: int | None = None) -> JobRecord:
    """A copy of `record` moved to `to_status`: `transition_seq` + 1, `updated_at`
    now, and the close reason / exit code when given. No edge check here (§8)."""
    new = touched(record)
    new["status"] = to_status
    new["transition_seq"] = record["transition_seq"] + 1
    if close_reason is not None:
        new["close_reason"] = close_reason
    if exit_code is not None:
        new["exit_code"] = exit_code
    return new


def check_event_request(event: str, status: str | None, source: str) -> None:
    """Refuse a publish-path request that no record could take (§3, §6, §8).

    Raises:
        UsageError: an unknown event, a status other than `cancelled` with `error`,
            or a source that is not a worker source.
    """
    if event not in EVENT_NAMES:
        raise UsageError(f"event {event!r} is invalid: expected one of {', '.join(EVENT_NAMES)}")
    if status is not None and not (status == "cancelled" and event == "error"):
        raise UsageError("status override is only 'cancelled' with event 'error'")
    require_source(source, WORKER_SOURCES, "record an event")


def check_worker(record: JobRecord, source: str, attempt_id: object, dispatch_token: object) -> None:
    """The §8 compare-and-swap guard of a worker request: the current attempt and
    dispatch token, and a record that is not terminal.

    Raises:
        StaleTransition: another attempt or token. Refusal(`after_terminal`): the job ended.
    """
    job_id = record["job_id"]
    if attempt_id != record["attempt_id"] or not isinstance(dispatch_token, str) \
            or dispatch_token != record["dispatch_token"]:
        what = (f"attempt {attempt_id!r} is not the current attempt {record['attempt_id']}"
                if attempt_id != record["attempt_id"] else "the dispatch token is not the current one")
        raise StaleTransition(job_id, f"refused {source} request: {what}")
    if record["status"] in TERMINAL_STATUSES:
        raise Refusal(job_id, "after_terminal",
                      f"refused {source} request: the job is already {record['status']}")


# ------------------------------------------------------------ transaction

class Transaction:
    """One read-modify-write of one record under the registry lock (§8), made by
    `Registry.transaction`. `record` is the record as read under the lock; set
    the new one with `update` (or `take_seq` / `store_event`) and queue audit
    lines with `log`. Leaving the `with` block normally commits: the lines
    (fsynced), a `status_changed` line when the status or attempt changed, then
    the record (atomic, 0600). Leaving it by an exception writes nothing.
    """

    def __init__(self, record: JobRecord) -> None:
        self.record = record
        self.new: JobRecord | None = None
        self.lines: list[Mapping[str, Any]] = []
        self.source = ""
        self.reason: str | None = None

    @property
    def job_id(self) -> str:
        """The record's job id."""
        return self.record["job_id"]

    def log(self, line: Mapping[str, Any]) -> None:
        """Queue one audit line (a JSON object), appended before the record on commit."""
        self.lines.append(line)

    def update(self, new: JobRecord, *, source: str, reason: str | None) -> None:
        """Replace the record on commit; `source`/`reason` go into a `status_changed` line."""
        self.new, self.source, self.reason = new, source, reason

    def take_seq(self, event: str, *, attempt_id: int, dispatch_token: str, source: str = "publisher",
                 status: str | None = None, exit_code: int | None = None) -> int:
        """The publish path's disk side (§3, §8, §9): check the worker identity,
        refuse a terminal record, take the next seq and apply the transition the
        event implies (`started`: pending → running; `completed`/`error`: →
        terminal; `status="cancelled"` with `error`: → cancelled, §6). Queue the
        signed payload with `log` and publish it only after the `with` block.

        Args:
            event: one of §3's events; exit_code: stored on a terminal record.
        Returns:
            the seq (stored as `last_seq` on commit).
        Raises:
            UsageError: unknown event or bad `status`.
            StaleTransition, Refusal(`after_terminal`).
        """
        check_event_request(event, status, source)
        record = self.record
        check_worker(record, source, attempt_id, dispatch_token)
        seq = record["last_seq"] + 1
        self._advance(event, seq, source, status, exit_code)
        return seq

    def store_event(self, payload: Mapping[str, Any], *, source: str = "remote_mirror",
                    gap: tuple[int, int] | None = None, missing: Sequence[int] | None = None) -> JobRecord:
        """Store an event the hub accepted (§3.2, judged by `mam.orchestrator.acceptance`):
        a `seq_gap` line when `gap` is (expected, got), the event itself, the
        `started`/terminal transition it implies (§10), and `missing` as the
        attempt's `missing_seqs` when given (§3.2 rule 6). No rule is checked here.

        Returns:
            the record to be committed.
        Raises:
            UsageError: a source that is not a worker source.
        """
        require_source(source, WORKER_SOURCES, "accept an event")
        if gap is not None:
            self.log({"event": "seq_gap", "timestamp": utc_now(), "expected": gap[0], "got": gap[1],
                      "attempt_id": self.record["attempt_id"]})
        self.log(dict(payload))
        data = payload.get("data")
        code = data.get("exit_code") if isinstance(data, Mapping) else None
        code = code if isinstance(code, int) and not isinstance(code, bool) else None
        new = self._advance(str(payload["event"]), int(payload["seq"]), source, None, code)
        new["seen_seq"] = max(self.record.get("seen_seq", 0), new["last_seq"])
        if missing is not None:
            new["missing_seqs"] = list(missing)
        if payload["event"] == EventName.ERROR and isinstance(data, Mapping) and data.get("lease_lost") is True:
            new["lease_lost"] = True  # §10 "Leases": the runner fenced the attempt itself; retry_on lease_lost
        sha = data.get("sha") if isinstance(data, Mapping) and payload["event"] == EventName.STARTED else None
        if isinstance(sha, str) and re.fullmatch(r"[0-9a-f]{40}", sha):  # §18: the worktree's base commit
            new["repo_sha"] = sha
        figures = agent_figures(data.get("agent")) if isinstance(data, Mapping) else None
        if figures is not None:  # §18: what the agent spent, for `jobs` and /metrics; its attempt (resume)
            new["agent"] = {**figures, "attempt_id": self.record["attempt_id"]}
            limit = usage_limit_of(data.get("agent") if isinstance(data, Mapping) else None,
                                   self.record["attempt_id"]) if payload["event"] == EventName.ERROR else None
            if limit is not None:  # §14 Pauses: the hub may pause the job until the limit resets
                new["usage_limit"] = limit
        return new

    def _advance(self, event: str, seq: int, source: str, status: str | None, exit_code: int | None) -> JobRecord:
        record = self.record
        target: str = status if status is not None else EVENT_STATUS.get(EventName(event), record["status"])
        if target != record["status"]:
            new = moved(record, target, exit_code=exit_code if target in TERMINAL_STATUSES else None)
        else:
            new = touched(record)
        new["last_seq"] = max(record["last_seq"], seq)  # a late event (§3.2 rule 6) lowers nothing
        self.update(new, source=source, reason=f"event {event}")
        return new


def _count(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**53 else 0


def agent_figures(value: object) -> dict[str, Any] | None:
    """The agent's figures of a terminal event's `data.agent` (§18), checked: kind, session id,
    turns, tokens {input, output, cached} and cost in USD (a bad value counts 0, a session id over
    128 characters is dropped); None when absent."""
    if not isinstance(value, Mapping):
        return None
    raw_tokens = value.get("tokens")
    tokens: Mapping[str, Any] = raw_tokens if isinstance(raw_tokens, Mapping) else {}
    cost = value.get("cost_usd")
    ok_cost = isinstance(cost, (int, float)) and not isinstance(cost, bool) and 0 <= cost < 1e9
    session = value.get("session_id")
    if not isinstance(session, str) or len(session) > 128:
        session = None
    return {"kind": str(value.get("kind", ""))[:16], "session_id": session,
            "turns": _count(value.get("turns")), "cost_usd": float(cost) if ok_cost else None,  # type: ignore[arg-type]
            "tokens": {key: _count(tokens.get(key)) for key in ("input", "output", "cached")}}


def usage_limit_of(agent: object, attempt_id: int) -> dict[str, Any] | None:
    """`{"attempt_id", "reset_at"}` when a terminal event's `data.agent` says the agent stopped on
    a usage limit (`usage_limit`, §18); `reset_at` is a §3 timestamp or None (not said, or bad)."""
    if not isinstance(agent, Mapping) or not isinstance(agent.get("usage_limit"), Mapping):
        return None
    reset = agent["usage_limit"].get("reset_at")
    try:
        reset = wire.format_ts(wire.parse_ts(reset)) if isinstance(reset, str) else None
    except ValueError:
        reset = None
    return {"attempt_id": attempt_id, "reset_at": reset}


def next_attempt(record: JobRecord, status: str = JobStatus.PENDING) -> JobRecord:
    """A copy of `record` as its next attempt (§8 redispatch, §14 retry): `status`
    (`pending`, or `queued` for a retry), attempt + 1, fresh tokens, seq restarted;
    the old auth token joins `earlier_auth_tokens` (so the hub can still tell that
    attempt's late messages from forgeries, §3.2) and the old attempt's runner
    and outcome join `attempt_history` (`show`)."""
    new = moved(record, status)
    ended = {"attempt_id": record["attempt_id"], "session": record["session"], "status": record["status"],
             "close_reason": record.get("close_reason"), "exit_code": record.get("exit_code")}
    if record.get("lease_lost"):
        ended["lease_lost"] = True
    agent = record.get("agent")
    if isinstance(agent, Mapping) and agent.get("attempt_id") == record["attempt_id"] and agent.get("session_id"):
        ended["agent_session_id"] = agent["session_id"]
    history = [*record.get("attempt_history", []), ended]
    new["attempt_history"] = history[-MAX_EARLIER_TOKENS:]
    if status == JobStatus.QUEUED:
        new["queued_at"] = utc_now_us()
    earlier = [*record.get("earlier_auth_tokens", []), record["auth_token"]][-MAX_EARLIER_TOKENS:]
    new.update({"attempt_id": record["attempt_id"] + 1, "dispatch_token": names.new_dispatch_token(),
                "auth_token": names.new_auth_token(), "last_seq": 0, "close_reason": None,
                "exit_code": None, "cancel_requested_at": None, "attempt_created_at": new["updated_at"],
                "earlier_auth_tokens": earlier, "seen_seq": 0})
    new.pop("late_outcome", None)
    new.pop("lease_lost", None)
    new.pop("missing_seqs", None)
    work = continued_work(record)
    if work:
        new["work"] = work
    else:
        new.pop("work", None)
    return new


def continued_work(record: Mapping[str, Any], *, fresh: bool | None = None) -> dict[str, Any]:
    """The next attempt's `work` (§18 "Continued sessions"): the record's own, with `resume`
    naming the last agent session the job's attempts reported and the attempt it came from,
    unless `fresh` (None: the job's `--fresh`), or no session is known; `base_sha` (the
    job's base commit, `repo_sha`) for a repository job."""
    work = {key: value for key, value in (record.get("work") or {}).items() if key != "resume"}
    agent = record.get("agent")
    if (record.get("fresh") if fresh is None else fresh) or not isinstance(agent, Mapping):
        return work
    session_id, attempt = agent.get("session_id"), agent.get("attempt_id")
    if not isinstance(session_id, str) or not names.AGENT_SESSION_RE.fullmatch(session_id) \
            or not isinstance(attempt, int) or isinstance(attempt, bool) or attempt < 1:
        return work
    resume: dict[str, Any] = {"session_id": session_id, "attempt": attempt}
    sha = record.get("repo_sha")
    if work.get("repo") and isinstance(sha, str) and names.SHA_RE.fullmatch(sha):
        resume["base_sha"] = sha
    return {**work, "resume": resume}


def published(record: JobRecord, session: str, published_at: str) -> JobRecord:
    """A copy of a `queued` record moved to `pending` for `session` (§14: the hub
    published its dispatch); its wall clock (§10) starts at `published_at`.

    Raises:
        Refusal(`not_allowed`): the record is not queued. UsageError: a bad session.
    """
    if record["status"] != JobStatus.QUEUED:
        raise Refusal(record["job_id"], "not_allowed",
                      f"refused queue publish: the job is {record['status']}, not queued")
    new = moved(record, JobStatus.PENDING)
    new.update({"session": session, "agent_session": names.agent_session_label(session),
                "attempt_created_at": published_at})
    new.pop("paused_until", None)  # §14 Pauses: it is published, so no longer paused
    new.pop("limited", None)  # §14 Moves: nor kept off the runner it left
    return new


def unblocked(record: JobRecord) -> JobRecord:
    """A copy of a `blocked` record moved to `queued` (§14 Dependencies: every job it runs
    after ended as its `after_if` allows); its queue time (and queue timeout) starts now.

    Raises:
        Refusal(`not_allowed`): the record is not blocked.
    """
    if record["status"] != JobStatus.BLOCKED:
        raise Refusal(record["job_id"], "not_allowed",
                      f"refused release: the job is {record['status']}, not blocked")
    new = moved(record, JobStatus.QUEUED)
    new["queued_at"] = new["unblocked_at"] = utc_now_us()
    return new


def late_terminal(record: JobRecord, event: str, seq: int, exit_code: object, detail: str,
                  timestamp: str) -> tuple[JobRecord, dict[str, Any]] | None:
    """§14 "Late terminals": the record (status unchanged, `late_outcome` set) and its
    `late_terminal` audit line, when a verified terminal of the current attempt comes
    after the hub closed the job itself; None when it is no late terminal or one was
    already recorded."""
    if record["status"] not in TERMINAL_STATUSES or record.get("close_reason") not in HUB_DECISIONS \
            or record.get("late_outcome"):
        return None
    outcome = JobStatus.COMPLETED if event == EventName.COMPLETED else JobStatus.ERROR
    new = touched(record)
    new["late_outcome"] = outcome
    line = {"event": "late_terminal", "timestamp": utc_now(), "terminal": event, "seq": seq,
            "exit_code": exit_code, "detail": detail, "sent_at": timestamp, "attempt_id": record["attempt_id"],
            "late_outcome": outcome}
    return new, line


def redact(obj: Any) -> Any:
    """A copy of `obj` with every `auth_token`/`dispatch_token` value (and the
    earlier attempts' tokens) replaced by `"<set>"` (or `"<unset>"`), at any depth."""
    if isinstance(obj, Mapping):
        return {k: (("<set>" if v else "<unset>") if k in SECRET_FIELDS or k == EARLIER_TOKENS else redact(v))
                for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [redact(v) for v in obj]
    return obj
