"""What the HTTP API and the dashboard show of a running hub service (§14, §15),
read from the service's own state (`Fleet`, queue) and the registry, never from
the broker: runner rows, queue rows with why each job waits, job rows, and
`LiveFeed`, which turns what changed since its last poll into the messages of
the `GET /api/events` stream (job rows, accepted events, runners, queue, log text).

The service loop owns its dicts; this module only reads them from another
thread, through copies (`list(d.values())`, atomic in CPython) taken once.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from mam.orchestrator import queue as hubqueue
from mam.orchestrator import schedules
from mam.orchestrator.follow import AuditTail, is_event_line
from mam.orchestrator.results import Result, read_result
from mam.orchestrator.runners import LOST, PRESENCE_STALE_S, REVOKED
from mam.orchestrator.service import HubService
from mam.shared.cli import render
from mam.shared.protocol import names
from mam.shared.protocol.codes import TERMINAL_STATUSES, JobStatus, PresenceStatus
from mam.shared.protocol.errors import MamError, UsageError
from mam.shared.store.changes import JobsWatch
from mam.shared.store.fsio import settled_mtime_ns
from mam.shared.store.records import RECORD_NAME_RE, JobNotFound, JobRecord, describe_target, redact, target_of

Row = dict[str, Any]

LOG_CHUNK_MAX_BYTES = 64 * 1024  # the most log text one job contributes to one poll of the live feed
LOG_TAIL_BYTES = 256 * 1024  # what GET /api/jobs/{id}/log returns without an offset: the end of the log
LOG_READ_MAX_BYTES = 1024 * 1024  # the most one GET /api/jobs/{id}/log returns
UNVERIFIED = "unverified"


def iso_epoch(stamp: object) -> float | None:
    """A record timestamp (`2026-06-20T14:49:30Z`, ISO 8601) as epoch seconds, None when absent or bad."""
    if not isinstance(stamp, str) or not stamp:
        return None
    try:
        return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def runner_status(view: hubqueue.RunnerView, now: float) -> str:
    """online, draining, offline, lost (its Last Will came, or not refreshed for
    PRESENCE_STALE_S) or unverified (§7)."""
    if not view.verified:
        return UNVERIFIED
    if view.will or (view.status != PresenceStatus.OFFLINE and now - view.seen_at > PRESENCE_STALE_S):
        return LOST
    return view.status


def runner_rows(service: HubService, now: float | None = None) -> list[Row]:
    """Every runner the service has seen a presence of (§7, §14 free slots), then the revoked
    ones of the roster (§16.7: status `revoked`, `revoked_at`), by session."""
    now = time.monotonic() if now is None else now
    wall_offset = time.time() - now
    fleet = service.fleet
    rows = []
    revoked = service.feed.revocations.revoked() if service.feed.revocations is not None else {}
    for view in fleet.views():
        if view.session in revoked:
            continue
        used = len(view.running) + fleet.inflight_count(view.session)
        rows.append({"session": view.session, "status": runner_status(view, now), "labels": sorted(view.labels),
                     "max_jobs": view.max_jobs, "running": sorted(view.running), "slots_used": used,
                     "slots_free": fleet.free_slots(view.session, now, PRESENCE_STALE_S),
                     "host": view.host, "version": view.version, "runner_id": view.runner_id,
                     "last_seen": round(view.seen_at + wall_offset, 1), "revoked_at": None, "will": view.will})
    for session, revoked_at in revoked.items():
        rows.append({"session": session, "status": REVOKED, "labels": [], "max_jobs": 0, "running": [],
                     "slots_used": 0, "slots_free": 0, "host": "", "version": "", "runner_id": "",
                     "last_seen": None, "revoked_at": revoked_at})
    return sorted(rows, key=lambda row: str(row["session"]))


def queue_rows(service: HubService, now: float | None = None) -> list[Row]:
    """The queued jobs in the order they leave the queue, then the blocked ones (§14
    Dependencies), each with its status and why it still waits (§14)."""
    now = time.monotonic() if now is None else now
    queued = list(service.queued.values())
    ranks, out = hubqueue.queue_ranks(queued), service.groups_out()  # once for the whole queue
    rows: list[Row] = [{"job_id": job.job_id, "status": JobStatus.QUEUED, "target": hubqueue.describe_target(job),
                        "priority": job.priority, "queued_at": job.queued_at, "group": job.group,
                        "why_waiting": hubqueue.why_waiting(job, service.fleet, queued, now, PRESENCE_STALE_S,
                                                            out=out, ranks=ranks)}
                       for job in sorted(queued, key=hubqueue.queue_order)]
    for job_id in sorted(service.blocked):
        try:
            record = service.registry.get(job_id)
        except MamError:
            continue
        rows.append({"job_id": job_id, "status": JobStatus.BLOCKED, "target": describe_target(record),
                     "priority": record.get("priority", 0), "queued_at": None, "group": record.get("group"),
                     "why_waiting": service.blocked_why.get(job_id)
                     or f"blocked until job {', '.join(service.blocked.get(job_id, ()))} ended"})
    return rows


def schedule_rows(service: HubService) -> list[Row]:
    """`GET /api/schedules`: every schedule as `schedule list --json` prints it (no brief, §14)."""
    return schedules.describe_all(service.registry.root)


def schedules_version(service: HubService) -> tuple[tuple[str, int], ...]:
    """The schedule files' names and mtimes: a schedule's rows change only when its file does
    (a fired or skipped tick is written to it)."""
    try:
        entries = list(os.scandir(schedules.schedules_dir(service.registry.root)))
    except OSError:
        return ()
    found = []
    for entry in entries:
        try:
            found.append((entry.name, entry.stat().st_mtime_ns))
        except OSError:
            continue
    return tuple(sorted(found))


def job_row(record: JobRecord, last_event: str | None = None, now_wall: float | None = None) -> Row:
    """One job as a table row: status, target (and its labels, repository, concurrency group), runner,
    attempt, duration (s), close reason, and what its agent spent (`agent`: kind, session_id, turns,
    tokens, cost_usd; §18) or None."""
    now_wall = time.time() if now_wall is None else now_wall
    start = iso_epoch(record.get("attempt_created_at") or record["created_at"])
    end = iso_epoch(record["updated_at"]) if record["status"] in TERMINAL_STATUSES else now_wall
    duration = round(max(0.0, end - start), 1) if start is not None and end is not None else None
    _session, labels = target_of(record)
    repo = (record.get("work") or {}).get("repo")
    return {"job_id": record["job_id"], "title": record.get("title", ""), "status": record["status"],
            "target": describe_target(record), "labels": list(labels), "repo": repo if isinstance(repo, str) else None,
            "session": record.get("session") or "", "attempt_id": record["attempt_id"],
            "created_at": record["created_at"], "updated_at": record["updated_at"], "duration_s": duration,
            "close_reason": record.get("close_reason"), "exit_code": record.get("exit_code"),
            "late_outcome": record.get("late_outcome"), "retried": record.get("retried", 0),
            "last_event": last_event, "agent": record.get("agent"), "group": record.get("group")}


def job_detail(service: HubService, job_id: str) -> Row:
    """GET /api/jobs/{id}: the record (tokens redacted), its attempts (each with `reason`, its close
    reason) and its audit log.

    Raises:
        UsageError: not a job id. JobNotFound: no such job.
    """
    registry = service.registry
    record = registry.get(job_id)
    audit = registry.audit(job_id)
    attempts = [{**item, "reason": render.end_reason(item)} for item in record.get("attempt_history", [])]
    attempts.append({"attempt_id": record["attempt_id"], "session": record.get("session") or "",
                     "status": record["status"], "reason": render.end_reason(record),
                     "close_reason": record.get("close_reason"),
                     "log": str(names.hub_log_path(registry.root, job_id, record["attempt_id"]))})
    events = [line.get("event") for line in audit if is_event_line(line, job_id)]
    result = read_result(registry, job_id)
    return {"record": redact(record), "job": job_row(record, events[-1] if events else None),
            "attempts": attempts, "audit": redact(audit), "result": None if result is None else result.to_dict()}


def job_result(service: HubService, job_id: str, attempt: int | None) -> Result:
    """The result `GET /api/jobs/{id}/result` and `.../result/patch` show (§18): of
    `attempt` (1..the job's attempt), default the latest attempt that sent one.

    Raises:
        UsageError: a bad id or attempt (400). JobNotFound: no such job, or no result (404).
    """
    record = service.registry.get(job_id)
    if attempt is not None and not 1 <= attempt <= record["attempt_id"]:
        raise UsageError(f"attempt must be 1..{record['attempt_id']}")
    result = read_result(service.registry, job_id, attempt)
    if result is None:
        raise JobNotFound(f"job {job_id} has no result (yet): only a repository job sends one (§18)")
    return result


def read_log(root: Path, job_id: str, attempt: int, offset: int | None) -> Row:
    """A piece of the hub's copy of one attempt's agent output (§15): from `offset`
    (at most LOG_READ_MAX_BYTES), or its last LOG_TAIL_BYTES; an absent file reads as empty."""
    path = names.hub_log_path(root, job_id, attempt)
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return {"job_id": job_id, "attempt": attempt, "exists": False, "offset": 0, "size": 0, "text": ""}
    start = max(0, size - LOG_TAIL_BYTES) if offset is None else min(offset, size)
    with open(path, "rb") as file:
        file.seek(start)
        data = file.read(LOG_READ_MAX_BYTES)
    return {"job_id": job_id, "attempt": attempt, "exists": True, "offset": start, "size": size,
            "next_offset": start + len(data), "text": data.decode("utf-8", errors="replace")}


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


@dataclass
class _Tracked:
    """One job as the feed last saw it."""

    mtime: int | None  # of its record, once settled (`settled_mtime_ns`)
    row: Row
    audit: AuditTail
    log_offset: int = 0
    attempt: int = 1
    unqueued: int = 0  # the last attempt seen out of the queue


@dataclass
class LiveFeed:
    """Turns what changed in a hub service since the last `poll` into stream messages.

    Jobs present at the first poll are shown from then on (their past is in the
    REST views); jobs seen later from their start. `on_finish(row)` is called
    once per job seen going terminal, `on_event(line, record)` per accepted event and
    `on_unqueued(record)` per attempt seen leaving the queue (metrics).
    """

    service: HubService
    on_finish: Callable[[Row], None] | None = None
    on_event: Callable[[Row, JobRecord], None] | None = None
    on_unqueued: Callable[[JobRecord], None] | None = None
    jobs: dict[str, _Tracked] = field(default_factory=dict)
    watch: JobsWatch | None = None  # told which jobs changed (the caller passes `changed` to `poll`)
    log_bytes: int = 0  # agent output read by the feed since it started (metrics)
    _runners_key: object = None
    _queue_key: object = None
    _schedules_key: object = None
    _started: bool = False

    def poll(self, changed: set[str] | None = None) -> list[Row]:
        """Everything new since the last call, as `{"type": ..., ...}` messages: of every job,
        or (`changed`, from `JobsWatch`) of these jobs only."""
        out: list[Row] = []
        now = time.monotonic()
        runners = runner_rows(self.service, now)
        runners_key = [(row["session"], row["status"], row["slots_used"], row["running"], row["labels"])
                       for row in runners]
        if runners_key != self._runners_key:
            self._runners_key = runners_key
            out.append({"type": "runners", "runners": runners})
        waiting = queue_rows(self.service, now)
        key = [(row["job_id"], row["why_waiting"]) for row in waiting]
        if key != self._queue_key:
            self._queue_key = key
            out.append({"type": "queue", "queue": waiting})
        version = schedules_version(self.service)
        if version != self._schedules_key:
            self._schedules_key = version
            out.append({"type": "schedules", "schedules": schedule_rows(self.service)})
        if changed is None:
            self._poll_jobs(out)
        else:
            folder = names.jobs_dir(self.service.registry.root)
            for job_id in sorted(changed):
                try:
                    self._consider(job_id, (folder / f"{job_id}.json").stat(), out)
                except OSError:
                    continue
        self._started = True
        return out

    def _poll_jobs(self, out: list[Row]) -> None:
        registry = self.service.registry
        try:
            entries = list(os.scandir(names.jobs_dir(registry.root)))
        except OSError:
            return
        for entry in entries:
            if not RECORD_NAME_RE.match(entry.name):
                continue
            try:
                self._consider(entry.name[:-len(".json")], entry.stat(), out)
            except OSError:
                continue

    def _consider(self, job_id: str, info: os.stat_result, out: list[Row]) -> None:
        """Poll `job_id` unless it ended and its record (`info`) did not change since."""
        mtime = settled_mtime_ns(info)  # None: too recent to skip on
        tracked = self.jobs.get(job_id)
        if tracked is not None and tracked.row["status"] in TERMINAL_STATUSES and \
                mtime is not None and tracked.mtime == mtime:
            return
        self._poll_job(job_id, mtime, tracked, out)

    def _poll_job(self, job_id: str, mtime: int | None, tracked: _Tracked | None, out: list[Row]) -> None:
        registry = self.service.registry
        try:
            record = registry.get(job_id)
        except MamError:
            return
        if record.get("role") != "hub":
            return
        if tracked is None:
            tail = AuditTail(registry.audit_path(job_id))
            tracked = _Tracked(mtime=-1, row={}, audit=tail, attempt=record["attempt_id"])
            if not self._started:  # present at start: from now on (whole lines are appended)
                tail.offset = _size(tail.path)
                tracked.log_offset = self._log_size(job_id, record["attempt_id"])
                tracked.unqueued = record["attempt_id"]
            self.jobs[job_id] = tracked
        last_event = tracked.row.get("last_event")
        for line in tracked.audit.read():
            if is_event_line(line, job_id):
                last_event = str(line.get("event"))
                if self.on_event is not None:
                    self.on_event(line, record)
                out.append({"type": "event", "job_id": job_id, "event": redact(line)})
        new_attempt = record["attempt_id"] != tracked.attempt  # a retry: its end is a new finish
        if new_attempt:
            tracked.attempt, tracked.log_offset = record["attempt_id"], 0
        self._poll_log(job_id, tracked, out, final=record["status"] in TERMINAL_STATUSES)
        row = job_row(record, last_event)
        changed = {k: v for k, v in row.items() if k != "duration_s"} != {
            k: v for k, v in tracked.row.items() if k != "duration_s"}
        was_open = new_attempt or tracked.row.get("status") not in TERMINAL_STATUSES
        tracked.mtime, tracked.row = mtime, row
        if self.watch is not None:  # told of its audit lines and output while it is open
            if row["status"] in TERMINAL_STATUSES:
                self.watch.unfollow(job_id)
            else:
                self.watch.follow(job_id)
        if changed:
            out.append({"type": "job", "job": row})
            if tracked.unqueued != record["attempt_id"] and row["status"] != JobStatus.QUEUED:
                tracked.unqueued = record["attempt_id"]
                if self.on_unqueued is not None:
                    self.on_unqueued(record)
            if self._started and was_open and row["status"] in TERMINAL_STATUSES and self.on_finish is not None:
                self.on_finish(row)

    def _log_size(self, job_id: str, attempt: int) -> int:
        return _size(names.hub_log_path(self.service.registry.root, job_id, attempt))

    def _poll_log(self, job_id: str, tracked: _Tracked, out: list[Row], *, final: bool) -> None:
        path = names.hub_log_path(self.service.registry.root, job_id, tracked.attempt)
        try:
            with open(path, "rb") as file:
                file.seek(tracked.log_offset)
                data = file.read(LOG_CHUNK_MAX_BYTES)
        except OSError:
            return
        if not data:
            return
        cut = data.rfind(b"\n") + 1 if len(data) < LOG_CHUNK_MAX_BYTES and not final else len(data)
        if cut == 0:
            return  # a partial line: wait for its end (or for LOG_CHUNK_MAX_BYTES of it)
        data = data[:cut]
        out.append({"type": "log", "job_id": job_id, "attempt": tracked.attempt, "offset": tracked.log_offset,
                    "size": len(data), "text": data.decode("utf-8", errors="replace")})
        tracked.log_offset += len(data)
        self.log_bytes += len(data)
