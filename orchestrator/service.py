"""The hub engine (PROTOCOL §14 "One hub process"): `mam-orch serve`, and the same
service embedded in `dispatch`, `redispatch` and `mam.Hub` (`EmbeddedService`).

`HubService` is the only code that places, publishes, judges (§3.2), clocks (§10),
mirrors and retries. One process per registry (`hublock.HubLock`, `.mam/hub.lock`),
one broker connection subscribed to `service_filters` (`jobs/+/events`, `jobs/+/state`,
`jobs/+/log`, `jobs/+/result` and `runners/+`). It owns every `queued`, `pending` and `running` hub record,
whichever command registered it: each open job is one `watch.Watcher` (fed by
`handle` and `tick`); queued jobs leave through `queue.plan` on every presence and
every new queued record; a job it closed itself stays judged for `LATE_JUDGE_S`
(late terminals). What it knows about a job (why it waits, a runner's refusal, a
retry) it writes as a `hub_note` line of the job's audit log, which every follower
prints. The records folder is watched (inotify): every `SCAN_S` the records written
since the last look are read, and the whole folder every `FULL_SCAN_S` (changed files
only) for what no watch shows; a job queued by another command wakes it at once.

Scale (docs/registry.md "Durability"): messages are handled in passes, each one
`Registry.group()` (one lock hold, its fsyncs together at its end); progress
lines are not fsynced; a job with a received, unjudged message is never closed.

Restart: open records are reloaded first (seqs from the audit log's tail), then
the subscription brings the retained states (§4); every clock starts with a full
window. While the connection is down only the wall clocks run (§14 "Broker
outages"). SIGTERM and SIGINT stop it cleanly: jobs go on, the lock is released.
"""
from __future__ import annotations

import heapq
import logging
import math
import os
import queue
import signal
import sys
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import Protocol, TextIO

from mam.orchestrator import dependencies, schedules
from mam.orchestrator import queue as hubqueue
from mam.orchestrator.control import cancel_open
from mam.orchestrator.dispatch import publish_queued, republish_dispatch
from mam.orchestrator.enqueue import register_queued
from mam.orchestrator.hub import DAY_S, Hub, Workspace, open_hub
from mam.orchestrator.hublock import HubLock, ServiceRunning, service_pid
from mam.orchestrator.mirror import BrokerLink, audit_seq
from mam.orchestrator.queuewait import (
    PRESENCE_SETTLE_MAX_S,
    PRESENCE_SETTLE_S,
    WHY_EVERY_S,
    PresenceFeed,
    close_queue_timeout,
    limit_pause,
    move_attempt,
    pause_attempt,
    queued_job,
    retry_attempt,
    retry_reason,
)
from mam.orchestrator.results import ResultInbox
from mam.orchestrator.runners import PRESENCE_STALE_S
from mam.orchestrator.wake import Waker
from mam.orchestrator.watch import Watcher, WatchOptions
from mam.shared.config import env_float
from mam.shared.protocol import names, wire
from mam.shared.protocol.codes import PUBLISHED_STATUSES, CloseReason, JobStatus, PresenceStatus, RetryOn
from mam.shared.protocol.errors import MamError
from mam.shared.store.changes import JobsWatch
from mam.shared.store.fsio import settled_mtime_ns
from mam.shared.store.records import HUB_DECISIONS, NOTE, RECORD_NAME_RE, JobRecord, describe_target, target_of
from mam.shared.transport import Received, Transport

log = logging.getLogger("mam.serve")

SCAN_S = 0.2
"""The records written since the last look are read this often (s; MAM_HUB_SCAN_S): the
safety net, since a job queued elsewhere wakes the engine at once (`wake`)."""
FULL_SCAN_S = 5.0
"""The whole registry folder is scanned this often, seconds (every scan where no inotify
watch can be held): what no watch shows, e.g. a lost event after the kernel's queue overflowed."""
MAX_SCAN_S = 60.0
LOCK_RACE_TRIES = 5
"""How often `EmbeddedService.ensure` starts an engine again when another process held the
lock at that instant and let go of it before it could be seen serving."""
TICK_S = 0.1  # the §10 clocks of every job are looked at this often
SERVICE_START_S = 30.0  # how long an embedded service may take to lock, connect and subscribe
ENGINE_SUBACK_S = 20.0
"""How long the engine waits for the SUBACK of its five filters, seconds. A NATS cluster
electing JetStream leaders after losing a node answers each filter's consumer request in up
to 5 s; an engine that gave up after the transport's usual 5 s and reconnected (same client
id) made the broker start that work again, and never got in while the cluster settled."""
LATE_JUDGE_S = DAY_S  # a job the hub closed itself is judged this long for a late terminal (§14)
HANDOVER_NOTE_S = 2.0  # a stopping embedded engine says which published job's start it waits for after this long
CLOSE_WHY: dict[str, str] = {  # the hub's own closes (§10, §14), said in words in their note
    CloseReason.AGENT_BLOCKED: "no runner took the dispatch within its ack timeout",
    CloseReason.DEADLINE_TIMEOUT: "no event within the idle window, or past the wall clock",
    CloseReason.RUNNER_LOST: "its runner went offline or was replaced, and stayed silent",
}


class _Discard:
    """Where the service's watchers print accepted events: nowhere (they are in the audit log)."""

    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        return None

    def isatty(self) -> bool:
        return False


@dataclass
class ServiceStats:
    """What the service did, for its log line at exit and the benchmark."""

    messages: int = 0
    refused_topics: int = 0
    handler_errors: int = 0
    published: int = 0
    closed: dict[str, int] = field(default_factory=dict)
    accepted: dict[str, int] = field(default_factory=dict)  # messages that renewed a job, by kind (events, state)
    refused: dict[str, int] = field(default_factory=dict)  # refused job messages by §3.2 reason (metrics)


@dataclass(frozen=True)
class _Wake:
    """The engine's own inbox item: look at the registry now (`HubService.wake`); no broker
    topic has a NUL."""

    topic: str = "\x00wake"
    payload: bytes = b""
    retain: bool = False


WAKE = _Wake()


def service_filters(root: str) -> list[tuple[str, int]]:
    """The hub service's subscriptions, (topic filter, QoS 1) each: every job's events,
    state, output and result chunks, and every runner's presence (§14). Five QoS 1
    subscriptions in one session: deploy/nats/nats.conf sizes nats-server's
    `max_ack_pending` for them."""
    return [(names.all_events_filter(root), 1), (names.all_states_filter(root), 1),
            (names.all_logs_filter(root), 1), (names.all_results_filter(root), 1),
            (names.all_presence_filter(root), 1)]


class HubService:
    """The hub service of one registry (§14).

    Args:
        hub: the `Hub` (registry, broker settings, keys).
        out: where accepted events go (default: nowhere; they are in the audit log).
        on_ready: called once, in the service's thread, when it holds the lock and
            subscribed (`serve --http` starts its server then).
        quiet: log its own bookkeeping lines (tracking, published, ended) at DEBUG: an
            engine embedded in `dispatch` or `mam.Hub`, whose follower prints the notes.

    Attributes:
        on_failed: called, in the service's thread, with the record of a job that ended
            `error` with no retry left (`serve --alert-webhook`); what it raises is logged.
    """

    def __init__(self, hub: Hub, *, out: TextIO | None = None, on_ready: Callable[[], None] | None = None,
                 quiet: bool = False) -> None:
        self.hub = hub
        self.registry = hub.registry
        self.keys = hub.keys()
        self.config = hub.broker_config()
        self.out: TextIO = out if out is not None else _Discard()  # type: ignore[assignment]
        self.lock = HubLock(self.registry.root)
        self.client: Transport | None = None
        self.watchers: dict[str, Watcher] = {}
        self.confirming: dict[str, float] = {}  # cancelled jobs waiting for the runner's end (§6): deadline
        self.confirm_watchers: dict[str, Watcher] = {}
        self.queued: dict[str, hubqueue.QueuedJob] = {}
        self.queue_deadlines: dict[str, float] = {}  # job id -> wall time of its queue_timeout (§14)
        self._why: dict[str, tuple[str, float]] = {}  # queued job -> its last waiting note, when (monotonic)
        self.late: dict[str, tuple[Watcher, float]] = {}  # closed by the hub: judged until (monotonic), §14
        self.settle_until = self.settle_max = 0.0  # the retained presence burst is in after this (monotonic)
        self.feed = PresenceFeed(self.keys, self.config.topic_root, self.registry.root)
        self.fleet = self.feed.fleet
        self.sessions: dict[str, str] = {}  # job id -> the session its dispatch went to
        self._jobs_on: dict[str, set[str]] = {}  # session -> the tracked jobs whose dispatch went there
        self.groups: dict[str, str] = {}  # job id -> its concurrency group (§14 Groups), for tracked jobs
        self.blocked: dict[str, tuple[str, ...]] = {}  # blocked job -> the jobs it runs after (§14 Dependencies)
        self.dependents: dict[str, set[str]] = {}  # job id -> the blocked jobs naming it
        self.unblock_due: set[str] = set()  # blocked jobs to look at again (`release_blocked`)
        self.blocked_why: dict[str, str] = {}  # blocked job -> what it waits for, as last noted
        self.unheard: set[str] = set()  # pending jobs taken over at start with no word yet (`republish_unheard`)
        self.stats = ServiceStats()
        self.results = ResultInbox(self.registry)  # §18: results land whether or not a watcher runs
        self._mtimes: dict[str, int] = {}
        self._records: JobsWatch | None = None  # the records folder's watch, while serving
        self._ticked_down_since: float | None = None  # `tick`'s last down_since
        self._revoked_seen: frozenset[str] | None = None  # `tick`'s last look at the revoked sessions
        # whom `tick` looks at: the jobs woken since (`Watcher.on_wake`), then the sleepers whose
        # `asleep_until` came (a heap; an entry whose watcher was woken since is stale, dropped)
        self._due: dict[str, None] = {}
        self._sleepers: list[tuple[float, str]] = []
        self._next_full_scan = 0.0  # monotonic
        self.backlog: deque[Received] = deque()  # received, not judged yet (`receive`)
        self.unjudged: Counter[str] = Counter()  # job id -> its messages in `backlog`
        self.clears: list[str] = []  # jobs whose retained dispatch goes after this batch (§17)
        self._stop = False
        self.ready = threading.Event()  # set once it holds the lock and subscribed
        self._wake_pending = threading.Event()  # a WAKE is in the inbox (`wake`)
        self.woken = False  # a WAKE was taken from the inbox: scan now
        self.scan_s = env_float("MAM_HUB_SCAN_S", SCAN_S, low=TICK_S, high=MAX_SCAN_S)
        self.schedules = schedules.Firing(self.registry, register=register_queued,  # §14 Schedules
                                          cancel=self.cancel_for_schedule)
        self.on_ready = on_ready
        self.on_failed: Callable[[JobRecord], None] | None = None
        self.quiet = quiet
        self._info = log.debug if quiet else log.info
        self._drain = False  # on stop, first finish the cancels awaiting their runner's confirmation
        self._drain_scanned = False
        self._handover_until = 0.0
        self._handover = True
        self.handing_over: tuple[str, ...] = ()  # while stopping: the published jobs whose start it waits for

    # ------------------------------------------------------------ records

    def _watcher(self, record: JobRecord, now: float, *, fresh: bool = False) -> Watcher:
        watcher = Watcher(self.registry, record["job_id"], client=self.client, keys=self.keys, out=self.out,
                          options=WatchOptions(remote=True, ack_only_before_first=True, lazy_progress=True),
                          show_log=False)
        watcher.on_wake = self._due.setdefault
        watcher.start_clocks(now, record)
        if record.get("group"):
            self.groups[record["job_id"]] = str(record["group"])
        if not fresh:  # taken over (a restart): its lazy progress seqs are in the audit log
            watcher.highest_event = watcher.highest_any = audit_seq(self.registry, record)
        watcher.on_clear = self.clears.append
        if self.feed.revocations is not None:
            watcher.revocations = self.feed.revocations  # one roster look for every job (§16)
        session, runner_id = record["session"], self.feed.runner_id(record["session"])
        watcher.runner_lost = lambda: self.feed.lost(session, runner_id)  # §14 runner_lost
        return watcher

    def consider(self, job_id: str, now: float) -> None:
        """Read one record and track it when it is an open hub job (§14 ownership)."""
        try:
            record = self.registry.get(job_id)
        except MamError as exc:
            log.warning("job %s: cannot read its record: %s", job_id, exc)
            return
        if record.get("role") != "hub":
            return
        status = record["status"]
        self.unblock_due.update(self.dependents.get(job_id, ()))  # §14 Dependencies: it may have ended
        if status == JobStatus.BLOCKED:
            self._block(record)
            return
        self._unblock_forget(job_id)
        late = self.late.get(job_id)
        if late is not None and (record.get("late_outcome") or record["attempt_id"] != late[0].attempt_id):
            del self.late[job_id]  # its late terminal came, or a new attempt replaced it
        watcher = self.watchers.get(job_id)
        if watcher is not None:
            if status == JobStatus.QUEUED:  # another process queued a retry: back to the queue
                del self.watchers[job_id]
                self._enqueue(record)
            elif status not in PUBLISHED_STATUSES:
                watcher.refresh()  # e.g. `mam-orch cancel` from another shell: the next tick ends it
            elif record["attempt_id"] != watcher.attempt_id:
                self.watchers[job_id] = self._watcher(record, now)  # a new attempt (redispatch, retry)
                self._sent_to(job_id, record["session"])
            return
        if status in PUBLISHED_STATUSES:
            self.watchers[job_id] = self._watcher(record, now)
            self._sent_to(job_id, record["session"])
            if status == JobStatus.PENDING and not self.ready.is_set() and self.watchers[job_id].highest_any == 0:
                self.unheard.add(job_id)  # its dispatch may never have left (a killed engine, §14)
            self._info("job %s: tracking (%s, attempt %s)", job_id, status, record["attempt_id"])
        elif status == JobStatus.QUEUED:
            self._enqueue(record)
        else:
            self.queued.pop(job_id, None)
            self.queue_deadlines.pop(job_id, None)
            self._why.pop(job_id, None)
            if job_id in self.confirm_watchers:
                return
            if retry_reason(record) is not None or limit_pause(record, time.time()) is not None:
                self.retry(job_id, now, record)  # an engine stopped between an attempt's end and its retry (§14)
                return
            if job_id not in self.late:
                self._judge_late(record, now)

    def _sent_to(self, job_id: str, session: str) -> None:
        """`job_id`'s current attempt was dispatched to `session` (`sessions`, and the jobs by session)."""
        self._gone(job_id)
        self.sessions[job_id] = session
        self._jobs_on.setdefault(session, set()).add(job_id)

    def _gone(self, job_id: str) -> str:
        """Forget where `job_id` was dispatched; returns that session ("" when unknown)."""
        session = self.sessions.pop(job_id, "")
        jobs = self._jobs_on.get(session)
        if jobs is not None:
            jobs.discard(job_id)
            if not jobs:
                del self._jobs_on[session]
        return session

    def _runner_offline(self, session: str, now: float) -> None:
        """§14: say for each job running on `session` when the idle rule closes it `runner_lost`
        unless the runner returns, and what comes then (a retry, or the end). Only that
        runner's jobs are looked at: many runners lost at once cost their jobs, not every job."""
        for job_id in sorted(self._jobs_on.get(session, ())):
            watcher = self.watchers.get(job_id)
            if watcher is None or watcher.runner_lost is None or not watcher.runner_lost():
                continue
            try:
                record = self.registry.get(job_id)
            except MamError:
                continue
            retried, retries = int(record.get("retried", 0)), int(record.get("retries", 0))
            then = (f"then retry {retried + 1} of {retries}" + (" elsewhere" if target_of(record)[1] else "")
                    if RetryOn.RUNNER_LOST in record.get("retry_on", []) and retried < retries
                    else "then it ends runner_lost")
            left_s = max(0.0, watcher.idle_close_at() - now)
            self.note(job_id, f"job {job_id}: runner {session} went offline (its presence says so, e.g. its Last "
                              f"Will); attempt {record['attempt_id']} is lost in {left_s:.0f} s unless it returns; "
                              f"{then}", warning=True)

    def _judge_late(self, record: JobRecord, now: float, watcher: Watcher | None = None) -> None:
        """§14 Late terminals: keep judging a job the hub closed itself (deadline_timeout,
        agent_blocked, runner_lost) for `LATE_JUDGE_S` after its close, so a runner that
        comes back records `late_outcome`; a restarted service reads the retained state."""
        if record.get("close_reason") not in HUB_DECISIONS or record.get("late_outcome"):
            return
        try:
            closed_at = wire.parse_ts(record["updated_at"]).timestamp()
        except (KeyError, ValueError, TypeError):
            return
        left_s = closed_at + LATE_JUDGE_S - time.time()
        if left_s > 0:
            self.late[record["job_id"]] = (watcher or self._watcher(record, now), now + left_s)

    def _block(self, record: JobRecord) -> None:
        """Keep a `blocked` job until `release_blocked` lets it into the queue (§14 Dependencies)."""
        job_id = record["job_id"]
        after = tuple(str(item) for item in record.get("after") or ())
        if self.blocked.get(job_id) != after:
            self._unblock_forget(job_id)
            self.blocked[job_id] = after
            for dep in after:
                self.dependents.setdefault(dep, set()).add(job_id)
            self._info("job %s: blocked until %s end", job_id, ", ".join(after))
        self.unblock_due.add(job_id)

    def _unblock_forget(self, job_id: str) -> None:
        for dep in self.blocked.pop(job_id, ()):
            waiting = self.dependents.get(dep)
            if waiting is not None:
                waiting.discard(job_id)
                if not waiting:
                    del self.dependents[dep]
        self.blocked_why.pop(job_id, None)

    def release_blocked(self) -> None:
        """§14 Dependencies: each blocked job one of whose named jobs changed is queued when
        all ended as its `--if` allows, closed `dependency_failed` when one did not (or is
        gone), else its note says what it still waits for."""
        due, self.unblock_due = self.unblock_due, set()
        for job_id in sorted(due):
            if job_id not in self.blocked:
                continue
            try:
                record = self.registry.get(job_id)
                if record["status"] != JobStatus.BLOCKED:
                    continue  # cancelled meanwhile: the scan takes it
                decision = dependencies.look(self.registry, record)
                if decision.failed is None and not decision.release:
                    self._say_blocked(job_id, dependencies.waiting_line(decision))
                    continue
                changed = (dependencies.fail(self.registry, job_id, decision.failed) if decision.failed
                           else dependencies.release(self.registry, job_id, decision.base))
            except MamError as exc:
                log.warning("job %s: dependencies not looked at: %s", job_id, exc)
                continue
            self._unblock_forget(job_id)
            if changed is None:
                continue  # cancelled meanwhile: the scan takes it
            if decision.failed:
                log.warning("%s", dependencies.failed_line(job_id, decision.failed))  # noted by `fail`
                self._failed(changed)
            else:
                start = (f", to start from the result of job {decision.base['job_id']} attempt "
                         f"{decision.base['attempt']}" if decision.base else "")
                self.note(job_id, f"job {job_id}: every job it runs after ended "
                                  f"({', '.join(changed.get('after') or ())}); queued for {describe_target(changed)}"
                                  f"{start}")
                self._enqueue(changed)

    def republish_unheard(self) -> None:
        """§14 "One hub process": once the retained states are in, publish again the dispatch of
        each `pending` attempt taken over at start that no runner has spoken for: an engine
        killed between marking it published and publishing it left it with no dispatch. A
        runner that took it refuses the copy as `replayed`: the attempt runs at most once."""
        unheard, self.unheard = self.unheard, set()
        client = self.client
        for job_id in sorted(unheard):
            watcher = self.watchers.get(job_id)
            if job_id in self.unjudged:  # it spoke: judge that first
                self.unheard.add(job_id)
                continue
            if client is None or watcher is None or watcher.highest_any or watcher.accepted_any:
                continue
            try:
                record = self.registry.get(job_id)
                if record["status"] != JobStatus.PENDING or record["attempt_id"] != watcher.attempt_id:
                    continue
                republish_dispatch(self.registry, record, self.keys, client)
            except MamError as exc:
                log.warning("job %s: its dispatch was not published again: %s", job_id, exc)
                continue
            self.note(job_id, f"job {job_id}: attempt {record['attempt_id']} was pending with no word from "
                              f"{record['session']} when this hub engine started: its dispatch is published again "
                              "(a runner that took it already refuses the copy)")

    def _say_blocked(self, job_id: str, why: str) -> None:
        if self.blocked_why.get(job_id) != why:
            self.blocked_why[job_id] = why
            self.note(job_id, f"job {job_id}: {why}")

    def _enqueue(self, record: JobRecord) -> None:
        job_id = record["job_id"]
        job = queued_job(record)
        if self.queued.get(job_id) == job:
            return
        self.queued[job_id] = job  # new, or changed (`mam-orch resume` ended its pause)
        start = max(job.queued_at, job.paused_until or 0.0)  # §14: a paused job's queue time starts at its resume
        self.queue_deadlines[job_id] = start + int(record.get("queue_timeout_sec", DAY_S))
        self._info("job %s: queued%s", job_id, " (paused)" if job.paused_until else "")

    def note(self, job_id: str, line: str, *, warning: bool = False) -> None:
        """Say one line about a job where every follower reads it: a `hub_note` line of its
        audit log (not fsynced; `dispatch`, `watch` and `mam.Hub` print it) and this log."""
        (log.warning if warning and not self.quiet else self._info)("%s", line)
        try:
            self.registry.append_audit(job_id, {"event": NOTE, "line": f"WARNING: {line}" if warning else line},
                                       durable=False)
        except MamError as exc:
            log.warning("job %s: note not written: %s", job_id, exc)

    def scan(self, now: float) -> None:
        """Look at the records the folder's watch names as written since the last scan; every
        FULL_SCAN_S, or with no watch, at every record file whose mtime changed since the last
        full scan, or is too recent to tell (`settled_mtime_ns`)."""
        written = self._records.changed(0.0) if self._records is not None else None
        if written is not None and now < self._next_full_scan:
            for job_id in sorted(written):
                if self.registry.record_path(job_id).exists():  # not one removed since
                    self.consider(job_id, now)
            return
        self._next_full_scan = now + FULL_SCAN_S
        folder = names.jobs_dir(self.registry.root)
        try:
            entries = list(os.scandir(folder))
        except OSError:
            return
        for entry in entries:
            if not RECORD_NAME_RE.match(entry.name):
                continue
            try:
                stat = entry.stat()
            except OSError:
                continue
            if self._mtimes.get(entry.name) == stat.st_mtime_ns:
                continue
            mtime = settled_mtime_ns(stat)  # a record changed twice within one tick keeps its mtime
            if mtime is not None:
                self._mtimes[entry.name] = mtime
            self.consider(entry.name[:-len(".json")], now)

    # ------------------------------------------------------------ messages

    def receive(self, client: Transport) -> None:
        """Move every message received so far into `backlog`, counting them per job.

        §14 "nobody's silence" on the service's side: a message that arrived but
        was not judged yet (the service is behind) keeps its job out of `tick`
        until it is judged, so a busy service never closes a job that spoke."""
        root = self.config.topic_root
        while True:
            try:
                message = client.messages.get_nowait()
            except queue.Empty:
                return
            self.backlog.append(message)
            parsed = names.parse_job_topic(message.topic, root)
            if parsed is not None:
                self.unjudged[parsed[0]] += 1

    def wake(self) -> None:
        """Another process queued a job (`wake.wake_engine`): one WAKE in the inbox (more are
        folded into it), so the loop scans at once."""
        client = self.client
        if client is not None and not self._wake_pending.is_set():
            self._wake_pending.set()
            client.messages.put(WAKE)

    def next_message(self, client: Transport, timeout_s: float) -> Received | None:
        """The oldest message: from `backlog` first, else from the client within `timeout_s`."""
        if not self.backlog:
            try:
                return client.messages.get(timeout=timeout_s)
            except queue.Empty:
                return None
        message = self.backlog.popleft()
        parsed = names.parse_job_topic(message.topic, self.config.topic_root)
        if parsed is not None:
            left = self.unjudged[parsed[0]] - 1
            if left > 0:
                self.unjudged[parsed[0]] = left
            else:
                del self.unjudged[parsed[0]]
        return message

    def on_message(self, topic: str, raw: bytes, now: float) -> None:
        """Route one message: a presence feeds the fleet, a job's event or state its watcher.
        Nothing a message holds may end the service: errors are logged in one line."""
        self.stats.messages += 1
        root = self.config.topic_root
        session = names.parse_presence_topic(topic, root)
        if session is not None:
            self.on_presence(session, raw, now)
            return
        parsed = names.parse_job_topic(topic, root)
        if parsed is not None and parsed[1] == "result":
            try:
                landed = self.results.handle(raw)
                if landed is not None:  # §18: a job started --from-result it may go now
                    self.unblock_due.update(self.dependents.get(landed, ()))
            except MamError as exc:
                self.stats.handler_errors += 1
                log.warning("job %s: result chunk not handled: %s", parsed[0], exc)
            return
        if parsed is None or parsed[1] not in ("events", "state", "log"):  # log: the hub's copy (§15)
            self.stats.refused_topics += 1
            return
        job_id = parsed[0]
        watcher = self.watchers.get(job_id) or self.confirm_watchers.get(job_id)
        if watcher is None and job_id not in self.late and self.registry.record_path(job_id).exists():
            self.consider(job_id, now)  # registered (or closed) a moment ago, before the next scan
            watcher = self.watchers.get(job_id)
        late = self.late.get(job_id) if watcher is None else None
        if late is not None:
            watcher = late[0]
        if watcher is None:
            return
        try:
            started_before, refused_before = watcher.accepted_any, len(watcher.refusals)
            if watcher.handle(topic, raw):
                self.stats.accepted[parsed[1]] = self.stats.accepted.get(parsed[1], 0) + 1
            for reason in watcher.refusals[refused_before:]:
                self.stats.refused[reason] = self.stats.refused.get(reason, 0) + 1
            if watcher.accepted_any and not started_before:
                self.fleet.started(self.sessions.get(job_id, ""), job_id)
            if late is not None and watcher is late[0] and watcher.refusals[refused_before:]:
                self.consider(job_id, now)  # a late terminal was recorded: stop judging it
        except MamError as exc:
            self.stats.handler_errors += 1
            log.warning("job %s: message on %s not handled: %s", job_id, topic, exc)

    def handle_batch(self, client: Transport, first: Received, until: float) -> None:
        """Handle `first` and every message already waiting, until the monotonic `until`,
        as ONE registry group: one lock hold and one group of fsyncs at its end, not
        three fsyncs per status change (docs/registry.md "Durability"). A presence ends
        the group first: the dispatches it lets out are published after durable writes (§8)."""
        message: Received | None = first
        root = self.config.topic_root
        try:
            with self.registry.group():
                while message is not None and names.parse_presence_topic(message.topic, root) is None:
                    if message is WAKE:
                        self.woken = True
                    else:
                        self.on_message(message.topic, message.payload, time.monotonic())
                    message = None
                    if time.monotonic() < until and (self.backlog or not client.messages.empty()):
                        message = self.next_message(client, 0.0)
        except MamError as exc:  # the group's fsyncs failed: said once, the service goes on
            self.stats.handler_errors += 1
            log.warning("the registry's group commit failed: %s", exc)
        if message is not None:
            now = time.monotonic()
            if message.retain and now < self.settle_max:  # the retained burst goes on (§7)
                self.settle_until = min(self.settle_max, max(self.settle_until, now + PRESENCE_SETTLE_S))
            self.on_message(message.topic, message.payload, now)
        self.flush_clears(client)

    def flush_clears(self, client: Transport) -> None:
        """§17: clear the retained dispatch of every job that started in the last batch,
        all published before any PUBACK is awaited (one round trip, not one per job)."""
        if not self.clears or not client.connected.is_set():
            self.clears.clear()  # reconnected, the retained state moves them anyway; gc clears leftovers
            return
        root = self.config.topic_root
        waiters = []
        for job_id in self.clears:
            try:
                waiters.append((job_id, client.publish_async(names.dispatch_topic(job_id, root), b"", retain=True)))
            except MamError as exc:
                log.warning("job %s: the retained dispatch was not cleared: %s", job_id, exc)
        self.clears.clear()
        for job_id, wait in waiters:
            try:
                wait()
            except MamError as exc:
                log.warning("job %s: the retained dispatch was not cleared: %s", job_id, exc)

    def on_presence(self, session: str, raw: bytes, now: float) -> None:
        """A runner's presence (§7): update the fleet, then publish what the queue allows (§14).
        A runner that went offline holding jobs (its Last Will) is said at once for each job."""
        before = self.fleet.view(session)
        was_online = before is not None and before.status != PresenceStatus.OFFLINE
        self.feed.handle(names.presence_topic(session, self.config.topic_root), raw)
        view = self.fleet.view(session)
        if was_online and view is not None and view.status == PresenceStatus.OFFLINE:
            self._runner_offline(session, now)
        refused = view.last_refusal[0] if view is not None and view.last_refusal is not None else None
        if refused in self.watchers:
            line = self.feed.refusal(session, refused)
            if line is not None:
                self.note(refused, line, warning=True)
        self.plan(now)

    # ------------------------------------------------------------ the queue

    def plan(self, now: float) -> None:
        """Publish every queued job `queue.plan` assigns now (§14 Matching)."""
        if not self.queued:
            return
        self.feed.drop_revoked()  # §16: a revoked runner gets nothing
        self._cancel_in_progress()
        waiting = list(self.queued.values())
        out = self.groups_out()
        picks = hubqueue.plan(waiting, self.fleet, now, PRESENCE_STALE_S, out=out)
        if now >= self.settle_until:  # §14: a session with no presence at all is dispatched at once (v1)
            picks += [(job.job_id, job.target_session) for job in waiting if job.target_session is not None
                      and self.fleet.view(job.target_session) is None and job.group is None]
        for job_id, session in picks:
            job = self.queued.pop(job_id, None)
            if job is None:
                continue
            self.queue_deadlines.pop(job_id, None)
            self._why.pop(job_id, None)
            if self.fleet.view(session) is None:
                self.note(job_id, f"job {job_id}: session {session} has announced no presence: dispatching now (v1)")
            self.publish(job_id, session, now)
        why: tuple[dict[str, int], dict[str, list[str]]] | None = None  # the queue's ranks and groups, once
        for job in self.queued.values():
            if self._why_due(job, now):
                why = why or (hubqueue.queue_ranks(waiting), self.groups_out())
                self._explain(job, waiting, now, *why)

    def _cancel_in_progress(self) -> None:
        """§14 Groups: a queued job dispatched `--cancel-in-progress` cancels its group's jobs
        that were queued before it or are out, and each of them says why. Looked at on every
        plan, after the scan, so a restarted hub finishes what an earlier one began."""
        for job in [job for job in self.queued.values() if job.cancel_in_progress and job.group is not None]:
            earlier = [other.job_id for other in self.queued.values()  # submitted before it, whatever the priority
                       if other.group == job.group and (other.queued_at, other.job_id) < (job.queued_at, job.job_id)]
            for job_id in self.groups_out().get(str(job.group), []) + earlier:
                reason = f"cancel-in-progress: job {job.job_id} of group {job.group}"
                try:
                    _, changed = cancel_open(self.registry, self.client, self.keys, job_id, reason)
                except MamError as exc:
                    log.warning("job %s: not cancelled for job %s of group %s: %s", job_id, job.job_id, job.group,
                                exc)
                    continue
                if changed:
                    self.note(job_id, f"job {job_id}: cancelled: job {job.job_id} of group {job.group} came with "
                                      "--cancel-in-progress")
                if job_id in self.queued:
                    self.consider(job_id, time.monotonic())  # it left the queue

    def cancel_for_schedule(self, job_id: str, reason: str) -> None:
        """§14 Schedules `--overlap cancel`: the schedule's previous job, still open, is cancelled."""
        try:
            _, changed = cancel_open(self.registry, self.client, self.keys, job_id, reason)
        except MamError as exc:
            log.warning("job %s: not cancelled (%s): %s", job_id, reason, exc)
            return
        if changed:
            self.note(job_id, f"job {job_id}: cancelled: {reason}")

    def groups_out(self) -> dict[str, list[str]]:
        """Each concurrency group's jobs published or running now (§14 Groups): the tracked
        jobs of the group. Derived from the records this engine tracks, so a restarted hub
        counts the same jobs."""
        out: dict[str, list[str]] = {}
        for job_id, group in self.groups.items():  # only the jobs of a group, not every tracked one
            if job_id in self.watchers:
                out.setdefault(group, []).append(job_id)
        return out

    def _why_due(self, job: hubqueue.QueuedJob, now: float) -> bool:
        """Whether `job`'s waiting note may be said now: once the presence burst is in, at
        most every `WHY_EVERY_S`."""
        last = self._why.get(job.job_id)
        return now >= self.settle_until and (last is None or now >= last[1] + WHY_EVERY_S)

    def _explain(self, job: hubqueue.QueuedJob, waiting: list[hubqueue.QueuedJob], now: float,
                 ranks: dict[str, int], out: dict[str, list[str]]) -> None:
        """Note why `job` waits (§14) when the reason changed; `ranks` and `out`: the
        queue's (`queue_ranks`, `groups_out`), taken once for every job of the pass."""
        last = self._why.get(job.job_id)
        why = hubqueue.why_waiting(job, self.fleet, waiting, now, PRESENCE_STALE_S, out=out, ranks=ranks)
        line = f"job {job.job_id}: {why}"
        if last is not None and last[0] == line:
            return
        self._why[job.job_id] = (line, now)
        self.note(job.job_id, line, warning="no runner has ever" in line)

    def expire_queued(self) -> None:
        """§14: a job queued longer than its queue_timeout_sec closes `queue_timeout`."""
        now_wall = time.time()
        for job_id, deadline in list(self.queue_deadlines.items()):
            if now_wall < deadline:
                continue
            self.queued.pop(job_id, None)
            del self.queue_deadlines[job_id]
            try:
                record = close_queue_timeout(self.registry, job_id)
            except MamError as exc:
                log.warning("job %s: queue timeout not recorded: %s", job_id, exc)
                continue
            self.note(job_id, f"job {job_id} left the queue {record['status']} ({record.get('close_reason')}); "
                              f"target {describe_target(record)}")
            self._failed(record)

    def retry(self, job_id: str, now: float, record: JobRecord | None = None) -> None:
        """§14 Retries: an attempt that ended for a reason in `retry_on` with retries left
        is cancelled and queued again as attempt + 1 (the dispatch process's own rule);
        §14 Pauses: one that stopped on a usage limit is queued again paused until its reset.
        `record`: the job's record as the caller just read it (None: read it now)."""
        try:
            record = record if record is not None else self.registry.get(job_id)
            until = limit_pause(record, time.time())
            if until is not None:
                self._pause(record, until, now)
                return
            reason = retry_reason(record)
            if reason is None:
                self._failed(record)
                return
            new = retry_attempt(self.registry, job_id, reason, self.client, self.keys)
        except MamError as exc:
            log.warning("job %s: not retried: %s", job_id, exc)
            return
        if new is not None:
            self._requeued(new, f"job {job_id}: attempt {record['attempt_id']} ended {reason} on "
                                f"{record.get('session') or '-'}; retry {new.get('retried')} of "
                                f"{new.get('retries')}: attempt {new['attempt_id']} queued", now)

    def _failed(self, record: JobRecord) -> None:
        """Tell `on_failed` of a job that ended `error` for good (no retry, no pause)."""
        if self.on_failed is None or record["status"] != JobStatus.ERROR:
            return
        try:
            self.on_failed(record)
        except Exception as exc:  # noqa: BLE001 - an observer never ends the engine
            log.warning("job %s: failure not reported: %s", record["job_id"], exc)

    def _pause(self, record: JobRecord, until: float, now: float) -> None:
        job_id = record["job_id"]
        if record.get("on_limit") == "move":
            new = move_attempt(self.registry, job_id, until, self.client, self.keys)
            if new is not None:
                self._requeued(new, f"job {job_id}: attempt {record['attempt_id']} stopped on a usage limit on "
                                    f"{record.get('session') or '-'}; attempt {new['attempt_id']} moves to another "
                                    f"runner of {describe_target(new)} (there again after "
                                    f"{new['limited']['until']})", now)
            return
        new = pause_attempt(self.registry, job_id, until, self.client, self.keys)
        if new is not None:
            self._requeued(new, f"job {job_id}: attempt {record['attempt_id']} stopped on a usage limit on "
                                f"{record.get('session') or '-'}; paused until {new['paused_until']}, then attempt "
                                f"{new['attempt_id']} continues there (`mam-orch resume {job_id}` goes on now)", now)

    def _requeued(self, new: JobRecord, line: str, now: float) -> None:
        """A retried or paused job's next attempt is queued: say `line`, stop judging the old
        attempt's late terminal, and plan the queue."""
        self.note(new["job_id"], line)
        self.late.pop(new["job_id"], None)
        self._enqueue(new)
        self.plan(now)

    def publish(self, job_id: str, session: str, now: float) -> None:
        """queued → pending: publish the job's dispatch to `session`; the ack clock starts now (§14)."""
        client = self.client
        if client is None:
            return
        try:
            record = publish_queued(self.registry, job_id, session, self.keys, client)
        except MamError as exc:
            log.warning("job %s: not published to %s: %s", job_id, session, exc)
            self.consider(job_id, now)  # still queued: it goes back to the queue
            return
        self.stats.published += 1
        self.fleet.inflight(session, job_id, gpus=int((record.get("work") or {}).get("gpus") or 0))
        self._sent_to(job_id, session)
        self.watchers[job_id] = self._watcher(record, time.monotonic(), fresh=True)
        self._info("job %s: published to %s (attempt %s)", job_id, session, record["attempt_id"])

    # ------------------------------------------------------------ clocks

    def tick(self, now: float, down_since: float | None, proven: Callable[[float], bool] | None = None) -> None:
        """Apply §10 to every tracked job; end the ones that ended.

        Args:
            down_since: when the connection went down (None: up).
            proven: moment -> whether the link is proven alive after it (`BrokerLink.proven`;
                None: always), read before the messages received by then were taken in.
        """
        for job_id in self._due_now(now, down_since):
            watcher = self.watchers.get(job_id)
            if watcher is None:
                continue  # ended, or not this loop's (a cancel's confirmation, a late judge)
            if job_id in self.unjudged:
                self._due.setdefault(job_id)  # it spoke: judge that first (`receive`), then look
                continue
            try:
                code = watcher.tick(now, down_since=down_since, poll=False, proven=proven)
            except MamError as exc:
                self.stats.handler_errors += 1
                log.warning("job %s: clocks not applied: %s", job_id, exc)
                continue
            if code is None:  # nothing to decide before its next deadline (`Watcher.next_wake`)
                wake = watcher.next_wake(down_since)
                if math.isnan(wake):  # no deadline to sleep until: looked at every tick, kept off the
                    self._due.setdefault(job_id)  # heap, where a NaN would hide every deadline behind it
                    continue
                watcher.asleep_until = wake
                heapq.heappush(self._sleepers, (wake, job_id))
                continue
            del self.watchers[job_id]
            self.groups.pop(job_id, None)
            self.fleet.started(self._gone(job_id), job_id)
            outcome = str(watcher.terminal or "closed")
            self.stats.closed[outcome] = self.stats.closed.get(outcome, 0) + 1
            self._info("job %s: ended (%s, exit %d)", job_id, outcome, code)
            if watcher.terminal == JobStatus.CANCELLED:
                self.confirming[job_id] = watcher.confirm_deadline(now)
                self.confirm_watchers[job_id] = watcher
            else:
                try:  # as the watcher's tick read it, once: not again here and in `retry`
                    record = watcher.ended_record or self.registry.get(job_id)
                except MamError as exc:
                    log.warning("job %s: cannot read its record: %s", job_id, exc)
                    self.retry(job_id, now)
                else:
                    if record.get("close_reason") in HUB_DECISIONS:
                        why = CLOSE_WHY.get(str(record["close_reason"]), "")
                        self.note(job_id, f"job {job_id} closed: {record['close_reason']} ({why})")
                    self._judge_late(record, now, watcher)
                    self.retry(job_id, now, record)
        for job_id, (_watcher, until) in list(self.late.items()):
            if now >= until:
                del self.late[job_id]
        for job_id, deadline in list(self.confirming.items()):
            watcher = self.confirm_watchers[job_id]
            if watcher.runner_ended or now >= deadline:
                del self.confirming[job_id], self.confirm_watchers[job_id]
                watcher.finish_confirm()

    def _due_now(self, now: float, down_since: float | None) -> list[str]:
        """The tracked jobs `tick` looks at now, taken off the schedule: every one when the
        clocks that run changed (the link went down or came back, §14), when a session was
        newly revoked or the roster cannot tell (§16); else those woken since the last tick
        and the sleepers whose `asleep_until` came. A tick costs what is due, not what is open."""
        revocations = self.feed.revocations
        revoked = frozenset(revocations.revoked()) if revocations is not None else None  # one roster look
        seen = self._revoked_seen
        if down_since != self._ticked_down_since or revoked is None or (seen is not None and not revoked <= seen):
            self._due.update(dict.fromkeys(self.watchers))
            self._sleepers.clear()
        self._ticked_down_since, self._revoked_seen = down_since, revoked
        sleepers = self._sleepers
        while sleepers and sleepers[0][0] <= now:
            until, job_id = heapq.heappop(sleepers)
            watcher = self.watchers.get(job_id)
            if watcher is not None and watcher.asleep_until == until:
                self._due.setdefault(job_id)
        due = list(self._due)
        self._due.clear()  # in place: every watcher's `on_wake` holds this dict's `setdefault`
        return due

    def broker_back(self, now: float, outage: float) -> None:
        """§14: every job gets a full idle window after the service's reconnect."""
        for watcher in self.watchers.values():
            watcher.broker_back(now, outage)

    # ------------------------------------------------------------ life

    def stop(self, signum: int = signal.SIGTERM, frame: FrameType | None = None) -> None:
        """Ask the loop to end (a signal handler): the jobs go on, the lock is released."""
        self._stop = True

    def _confirmations_left(self, down_since: float | None) -> bool:
        """On `finish`: the first time, one more scan and tick (a cancel recorded a moment ago
        by another process reaches `confirming`); then whether any cancel still waits, or, with
        `handover`, a job this engine published has no accepted event yet while its runner
        may be taking it (`_may_be_taking`): its `started` is not retained and would reach
        no engine while the next one starts. That wait lasts until the job starts or is
        closed (§10), and at most the longest ack timeout among them (the clocks stand
        still while the broker is away, §14)."""
        now = time.monotonic()
        unstarted = tuple(job_id for job_id, w in self.watchers.items()  # its state may come before its event
                          if not w.highest_event and w.started_status == JobStatus.PENDING
                          and self._may_be_taking(job_id, w.session)) if self._handover else ()
        if not self._drain_scanned:
            self._drain_scanned = True
            self._handover_until = now + max((self.watchers[job_id].ack_s for job_id in unstarted), default=0.0)
            self.scan(now)
            self.tick(now, down_since)
        self.handing_over = unstarted if now < self._handover_until else ()
        return bool(self.confirming) or bool(self.handing_over)

    def _may_be_taking(self, job_id: str, session: str) -> bool:
        """Whether `session`'s runner may be taking `job_id` now: its last presence is a
        verified `online` one that did not refuse that job (§7). A job dispatched to a
        session that announced nothing (v1), or to a runner gone or draining, has no start
        coming that a stopping engine should wait for."""
        view = self.fleet.view(session)
        return (view is not None and view.verified and view.status == PresenceStatus.ONLINE
                and (view.last_refusal is None or view.last_refusal[0] != job_id))

    def finish(self, *, handover: bool = True) -> None:
        """Ask the loop to end once every cancel waiting for its runner's confirmation (§6)
        is confirmed or past its deadline (an embedded engine whose job was cancelled) and,
        with `handover`, every job it published has started (`_confirmations_left`). It
        publishes nothing new meanwhile: the queue waits for the next engine."""
        self._handover = handover
        self._drain = True
        self._stop = True

    def run(self) -> int:
        """Lock, connect, reload, subscribe, serve until stopped; returns the exit code.

        Raises:
            UsageError: another service holds the lock (exit 64).
            BrokerUnavailable: the broker is unreachable at start (exit 3).
        """
        self.lock.acquire()
        try:
            client = self.client = self.hub.connect("serve")
            try:
                return self._serve(client)
            finally:
                client.close()
        finally:
            self.lock.release()

    def _serve(self, client: Transport) -> int:
        self._records = JobsWatch(self.registry.root, logs=False)  # before the first scan: no write falls between
        try:
            return self._serve_watched(client)
        finally:
            self._records.close()
            self._records = None

    def _serve_watched(self, client: Transport) -> int:
        try:
            swept = self.registry.sweep_temps()
        except MamError as exc:
            log.warning("left temp files not removed: %s", exc)
        else:
            if swept:
                self._info("removed %d temp files of records and views that a stopped writer left", swept)
        now = time.monotonic()
        self.scan(now)  # open records first: the retained states then find their watchers
        root = self.config.topic_root
        client.subscribe(service_filters(root), timeout_s=ENGINE_SUBACK_S)
        self._info("hub service pid %d serving %s: %d open jobs, %d queued", os.getpid(), self.registry.root,
                   len(self.watchers), len(self.queued))
        link = BrokerLink(client, names.hub_probe_topic(root))
        subscribed = time.monotonic()
        self.settle_until, self.settle_max = subscribed + PRESENCE_SETTLE_S, subscribed + PRESENCE_SETTLE_MAX_S
        waker = Waker(self.registry.root, self.wake)
        waker.start()
        try:
            if self.on_ready is not None:
                self.on_ready()
            self.ready.set()
            self._loop(client, link, now)
        finally:
            link.close()
            waker.stop()
        self._info("hub service stopping: %d jobs go on without it (%d messages handled)",
                   len(self.watchers), self.stats.messages)
        return 0

    def _loop(self, client: Transport, link: BrokerLink, now: float) -> None:
        next_scan = next_tick = now
        while not self._stop or (self._drain and self._confirmations_left(link.down_since)):
            now = time.monotonic()
            outage = link.look(now)
            if outage is not None:
                self.broker_back(now, outage)
            if self.woken:  # a job queued elsewhere: look now, not at the next scan
                self.woken = False
                self._wake_pending.clear()
                next_scan = now
            if self.schedules.look(now):  # a tick fired jobs: take them in now
                next_scan = now
            if self.unheard and now >= self.settle_max:  # the retained states are in by now
                self.republish_unheard()
            if now >= next_scan:
                next_scan = now + self.scan_s
                self.scan(now)
                self.release_blocked()
                self.expire_queued()
                if not self._stop:  # a stopping engine leaves the queue to the next one
                    self.plan(now)
            if now >= next_tick:
                next_tick = now + TICK_S
                proven_at = link.proven_at
                self.receive(client)  # §14: what was received before the clocks look counts
                self.tick(now, link.down_since, lambda moment: link.proven(moment, proven_at))  # §10
            message = self.next_message(client, max(0.0, min(next_scan, next_tick) - time.monotonic()))
            if message is WAKE:
                self.woken = True
            elif message is not None:
                self.handle_batch(client, message, min(next_scan, next_tick))


class EmbeddedService:
    """The hub service in a thread of this process, when no `mam-orch serve` runs for the
    registry (§14): what `dispatch`, `redispatch` and `mam.Hub` use, so every path runs one
    engine. The first process to start one serves every open job of the registry; the
    others follow it and start their own when it stops (the lock passes on).

    Args:
        hub: the `Hub`.
    """

    def __init__(self, hub: Hub) -> None:
        self.hub = hub
        self.service: HubService | None = None
        self.thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def ensure(self) -> bool:
        """Make sure some hub service serves the registry: a `mam-orch serve`, another
        process's embedded one, or one started here.

        Returns:
            True when this process runs it.
        Raises:
            BrokerUnavailable (exit 3), ConfigError, MamError: the service could not start.
        """
        with self._lock:
            if self.thread is not None and self.thread.is_alive():
                return True
            for _ in range(LOCK_RACE_TRIES):
                if service_pid(self.hub.registry.root) is not None:
                    return False
                service = HubService(self.hub, quiet=True)
                failure: list[BaseException] = []

                def serve(service: HubService = service, failure: list[BaseException] = failure) -> None:
                    try:
                        service.run()
                    except BaseException as exc:  # noqa: BLE001 - handed to the caller below
                        failure.append(exc)
                        service.ready.set()

                thread = threading.Thread(target=serve, name="mam-hub-service", daemon=True)
                thread.start()
                service.ready.wait(SERVICE_START_S)
                if not failure:
                    self.service, self.thread = service, thread
                    return True
                if not isinstance(failure[0], ServiceRunning):
                    raise failure[0]
                # another process took the lock first; it serves, unless it let go meanwhile
                # (its own job ended): then look again and start one here
            raise failure[0]

    def stop(self, *, handover: bool = False) -> None:
        """Stop the service started here, if any (its jobs go on; the next service takes them).
        `handover` (a dispatch whose job ended): first wait for the jobs it published to start
        (`HubService.finish`), and say which after `HANDOVER_NOTE_S`. Without it (Ctrl-C, an
        error, `--detach`, `mam.Hub.close`), a job's `started` may come while no engine
        listens; its retained state still moves it to `running` (§4)."""
        with self._lock:
            service, thread = self.service, self.thread
            self.service = self.thread = None
        if service is None or thread is None:
            return
        service.finish(handover=handover)
        thread.join(HANDOVER_NOTE_S)
        waits = service.handing_over
        if thread.is_alive() and waits:
            log.warning("the hub engine stops once job %s, just published, has started (at most its ack "
                        "timeout; Ctrl-C leaves it to the next engine, which may miss its `started`)",
                        ", ".join(waits))
        thread.join()  # the loop bounds its own drain: confirmations (§6), ack timeouts (§10)


class Companion(Protocol):
    """Something `mam-orch serve` runs beside the engine (the HTTP server, the alerter):
    started once the service holds the lock and subscribed, stopped when it ends."""

    def start(self) -> None: ...

    def stop(self) -> None: ...


def serve_cli(*, workspace: Workspace, companions: Sequence[Callable[[HubService], Companion]] = ()) -> int:
    """`mam-orch serve`: run the hub service until SIGTERM/SIGINT (§14).

    Args:
        companions: each makes, from the service, something run beside it (`Companion`).
    Raises:
        UsageError (exit 64: another service runs), ConfigError, BrokerUnavailable (exit 3).
    """
    service = HubService(open_hub(workspace))
    return run_service(service, [make(service) for make in companions])


def run_service(service: HubService, companions: Sequence[Companion] = ()) -> int:
    """Run `service` in this (main) thread until SIGTERM/SIGINT, `companions` beside it from
    its `on_ready` on; returns the exit code."""
    signal.signal(signal.SIGTERM, service.stop)
    signal.signal(signal.SIGINT, service.stop)
    print(f"mam-orch serve: pid {os.getpid()}, registry {service.registry.root}", file=sys.stderr, flush=True)
    started: list[Companion] = []
    first = service.on_ready

    def ready() -> None:
        if first is not None:
            first()
        for companion in companions:
            started.append(companion)  # stopped even if its start fails halfway
            companion.start()

    service.on_ready = ready
    try:
        return service.run()
    finally:
        for companion in reversed(started):
            companion.stop()
