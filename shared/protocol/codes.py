"""The protocol's words, defined once: job statuses, event names, close
reasons, presence statuses and control actions (PROTOCOL §3, §4, §6, §7, §8, §10, §14).

Each is a `StrEnum`, so a member equals its wire string (`JobStatus.RUNNING
== "running"`) and JSON-encodes as that string. This module imports nothing
of the project: the `publish` fast path may load it.
"""

from __future__ import annotations

from enum import StrEnum


class EventName(StrEnum):
    """The `event` field of an event (§3)."""

    STARTED = "started"
    PROGRESS = "progress"
    PERMISSION_REQUIRED = "permission_required"
    COMPLETED = "completed"
    ERROR = "error"


class JobStatus(StrEnum):
    """A job's `status`, in the retained state (§4) and in a registry record (§8);
    `blocked` and `queued` are a hub record's only (§14), never on the wire."""

    BLOCKED = "blocked"  # §14 Dependencies: waits for the jobs it runs after
    QUEUED = "queued"
    PENDING = "pending"
    RUNNING = "running"
    COMPLETED = "completed"
    ERROR = "error"
    CANCELLED = "cancelled"


class CloseReason(StrEnum):
    """Why the hub closed a job itself (§6, §10, §14)."""

    DEADLINE_TIMEOUT = "deadline_timeout"
    AGENT_BLOCKED = "agent_blocked"
    CANCELLED = "cancelled"
    QUEUE_TIMEOUT = "queue_timeout"  # §14: queued for queue_timeout_sec, never published
    RUNNER_LOST = "runner_lost"  # §14: the idle rule, while the runner's presence went offline or changed id
    DEPENDENCY_FAILED = "dependency_failed"  # §14 Dependencies: a job it runs after ended otherwise than --if allows


class RetryOn(StrEnum):
    """What `retry_on` may name (§14): hub close reasons, the runner's own `error`, or its
    `error` that says it fenced itself (`data.lease_lost`, §10 "Leases")."""

    AGENT_BLOCKED = "agent_blocked"
    DEADLINE_TIMEOUT = "deadline_timeout"
    RUNNER_LOST = "runner_lost"
    LEASE_LOST = "lease_lost"
    ERROR = "error"


class QueueSource(StrEnum):
    """The registry source of the hub queue's own transitions (§14)."""

    HUB_QUEUE = "hub_queue"


class PresenceStatus(StrEnum):
    """A runner's presence `status` (§7)."""

    ONLINE = "online"
    DRAINING = "draining"
    OFFLINE = "offline"


class ControlAction(StrEnum):
    """A control message's `action`: a cancel (§6), a person's answer to an agent's
    permission request (§19), or a person's message to a running agent (§18 "Input while
    it runs")."""

    CANCEL = "cancel"
    ALLOW = "allow"
    DENY = "deny"
    SAY = "say"


TERMINAL_EVENTS = frozenset({EventName.COMPLETED, EventName.ERROR})
TERMINAL_STATUSES = frozenset({JobStatus.COMPLETED, JobStatus.ERROR, JobStatus.CANCELLED})
OPEN_STATUSES = frozenset({JobStatus.BLOCKED, JobStatus.QUEUED, JobStatus.PENDING, JobStatus.RUNNING})
# The open statuses of a hub job never published: no runner holds it, a cancel closes it on the hub (§14).
UNPUBLISHED_STATUSES = frozenset({JobStatus.BLOCKED, JobStatus.QUEUED})
# The open statuses in which a dispatch was published (a runner may hold the attempt).
PUBLISHED_STATUSES = frozenset({JobStatus.PENDING, JobStatus.RUNNING})
# The status an accepted event moves a record to (§8); other events leave it.
EVENT_STATUS = {EventName.STARTED: JobStatus.RUNNING, EventName.COMPLETED: JobStatus.COMPLETED,
                EventName.ERROR: JobStatus.ERROR}
# The status a hub close gives a record (§10).
CLOSE_STATUS = {CloseReason.DEADLINE_TIMEOUT: JobStatus.ERROR, CloseReason.AGENT_BLOCKED: JobStatus.ERROR,
                CloseReason.CANCELLED: JobStatus.CANCELLED, CloseReason.QUEUE_TIMEOUT: JobStatus.ERROR,
                CloseReason.RUNNER_LOST: JobStatus.ERROR, CloseReason.DEPENDENCY_FAILED: JobStatus.ERROR}
# The close reasons that end a job `error` (an operator-source close may name them, §8).
ERROR_CLOSES = frozenset(reason for reason, status in CLOSE_STATUS.items() if status == JobStatus.ERROR)
DEFAULT_RETRY_ON = (RetryOn.AGENT_BLOCKED, RetryOn.DEADLINE_TIMEOUT, RetryOn.RUNNER_LOST, RetryOn.LEASE_LOST)
# Allowed values, in wire order, for validation and error messages.
EVENT_NAMES = tuple(EventName)
JOB_STATUSES = tuple(status for status in JobStatus if status not in UNPUBLISHED_STATUSES)  # the wire's (§4)
RECORD_STATUSES = tuple(JobStatus)  # a hub record's (§8, §14)
RETRY_ON_CHOICES = tuple(RetryOn)
PRESENCE_STATUSES = tuple(PresenceStatus)
CONTROL_ACTIONS = tuple(ControlAction)
