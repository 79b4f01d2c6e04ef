"""The protocol's words, defined once: job statuses, event names, close
reasons, presence statuses and control actions (PROTOCOL §3, §4, §6, §7, §8, §10).

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
    """A job's `status`, in the retained state (§4) and in a registry record (§8)."""

    PENDING = "pending"
    RUNNING = "running"
    COMPLETED = "completed"
    ERROR = "error"
    CANCELLED = "cancelled"


class CloseReason(StrEnum):
    """Why the hub closed a job itself (§6, §10)."""

    DEADLINE_TIMEOUT = "deadline_timeout"
    AGENT_BLOCKED = "agent_blocked"
    CANCELLED = "cancelled"


class PresenceStatus(StrEnum):
    """A runner's presence `status` (§7)."""

    ONLINE = "online"
    DRAINING = "draining"
    OFFLINE = "offline"


class ControlAction(StrEnum):
    """A control message's `action` (§6)."""

    CANCEL = "cancel"


TERMINAL_EVENTS = frozenset({EventName.COMPLETED, EventName.ERROR})
TERMINAL_STATUSES = frozenset({JobStatus.COMPLETED, JobStatus.ERROR, JobStatus.CANCELLED})
OPEN_STATUSES = frozenset({JobStatus.PENDING, JobStatus.RUNNING})
# The status an accepted event moves a record to (§8); other events leave it.
EVENT_STATUS = {EventName.STARTED: JobStatus.RUNNING, EventName.COMPLETED: JobStatus.COMPLETED,
                EventName.ERROR: JobStatus.ERROR}
# The status a hub close gives a record (§10).
CLOSE_STATUS = {CloseReason.DEADLINE_TIMEOUT: JobStatus.ERROR, CloseReason.AGENT_BLOCKED: JobStatus.ERROR,
                CloseReason.CANCELLED: JobStatus.CANCELLED}
# Allowed values, in wire order, for validation and error messages.
EVENT_NAMES = tuple(EventName)
JOB_STATUSES = tuple(JobStatus)
PRESENCE_STATUSES = tuple(PresenceStatus)
CONTROL_ACTIONS = tuple(ControlAction)
