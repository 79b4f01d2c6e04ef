"""The hub queue without a service (PROTOCOL §14): a dispatch process waits for
its own `queued` job, and when `queue.plan` picks a runner marks it `pending`
(the caller then publishes the dispatch, `dispatch.publish_queued`); and the
retry of a failed attempt (§14 Retries).

Every dispatch process of a registry plans over ALL the registry's queued jobs,
under the registry lock, with the in-flight dispatches read from the records
(`pending`, published less than ack_timeout_sec + clock skew ago): two processes
never over-commit a runner, and jobs leave in §14 order whoever queued them. A
queued job whose dispatch process is gone (`queue_owner_pid`) is left out.
"""

from __future__ import annotations

import logging
import os
import queue
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple, TextIO

from mam.orchestrator.control import publish_cancel
from mam.orchestrator.identity.roster import Revocations
from mam.orchestrator.queue import Fleet, QueuedJob, matches, plan, why_waiting
from mam.orchestrator.runners import CLOCK_SKEW_S, PRESENCE_STALE_S, presence_view
from mam.shared.protocol import names, wire
from mam.shared.protocol.codes import DEFAULT_RETRY_ON, OPEN_STATUSES, PresenceStatus, QueueSource, RetryOn
from mam.shared.protocol.codes import JobStatus as Status
from mam.shared.protocol.crypto import DispatchKeys
from mam.shared.protocol.errors import BrokerError, ProtocolError
from mam.shared.store.records import JobRecord, Refusal, moved, next_attempt, published, target_of, utc_now
from mam.shared.store.registry import Registry
from mam.shared.transport.mqtt import QOS_AT_LEAST_ONCE, QOS_AT_MOST_ONCE, MqttClient

log = logging.getLogger("mam.queue")

QUEUE_POLL_S = 1.0
"""Plan again at least this often: another process's job left, one's owner died, the queue timeout."""
PRESENCE_SETTLE_S = 0.5
"""The retained presence burst is in once no retained presence came for this long (s)."""
PRESENCE_SETTLE_MAX_S = 5.0
"""...or this long after the subscription, whichever comes first (s)."""
WHY_EVERY_S = 5.0
"""A changed `why_waiting` line is printed at most this often (s)."""
MIN_WAIT_S = 0.01
HUB_QUEUE = QueueSource.HUB_QUEUE


def _epoch(stamp: object) -> float:
    """A §3 timestamp as epoch seconds (now when it is missing or bad)."""
    try:
        return wire.parse_ts(str(stamp)).timestamp()
    except (ValueError, TypeError):
        return time.time()


def queued_job(record: JobRecord) -> QueuedJob:
    """A `queued` record as the queue sees it (§14); `queued_at` in epoch seconds."""
    session, labels = target_of(record)
    return QueuedJob(job_id=record["job_id"], target_session=session, target_labels=frozenset(labels),
                     priority=int(record.get("priority", 0)),
                     queued_at=_epoch(record.get("queued_at") or record["created_at"]),
                     avoid_session=record.get("avoid_session"))


def owner_alive(record: JobRecord) -> bool:
    """The process that waits for this queued job is alive (or none is named: a service's)."""
    pid = record.get("queue_owner_pid")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # alive, another user's
    return True


def in_flight(record: JobRecord, now_wall: float) -> bool:
    """A `pending` record whose dispatch a runner may still take (§5 expiry + skew)."""
    if record["status"] != Status.PENDING or not record.get("session"):
        return False
    sent = _epoch(record.get("attempt_created_at") or record["created_at"])
    return now_wall < sent + record["ack_timeout_sec"] + CLOCK_SKEW_S


def snapshot(fleet: Fleet, records: Sequence[JobRecord], now_wall: float) -> Fleet:
    """A copy of `fleet` with the registry's hand-offs (publish order) and in-flight dispatches."""
    view = Fleet()
    for runner in fleet.views():
        view.update(runner)
    sent = sorted((r for r in records if r.get("attempt_created_at") and r.get("session")),
                  key=lambda r: (str(r.get("attempt_created_at")), r["job_id"]))
    for record in sent:
        if in_flight(record, now_wall):
            view.inflight(record["session"], record["job_id"])
        else:
            view.handed(record["session"])
    return view


def mark_published(registry: Registry, job_id: str, session: str) -> JobRecord:
    """`queued` → `pending` for `session` (§14, source `hub_queue`); publish the dispatch next.

    Raises:
        Refusal(`not_allowed`): the job is no longer queued. JobNotFound, RegistryError.
    """
    with registry.transaction(job_id) as txn:
        new = published(txn.record, session, utc_now())
        txn.update(new, source=HUB_QUEUE, reason=f"published to {session}")
    return new


class Placement(NamedTuple):
    """What one `place` found: the record, whether this call marked it published, the queue."""

    record: JobRecord
    placed: bool
    waiting: list[QueuedJob]


def place(registry: Registry, job_id: str, fleet: Fleet, *, stale_after_s: float = PRESENCE_STALE_S) -> Placement:
    """Plan the registry's queue (§14) and, when it picks `job_id`, mark it published
    (under the registry lock, so no other process plans meanwhile).

    Returns:
        the record (`pending` when placed now, still `queued`, or whatever it became),
        `placed`, and the queued jobs planned over.
    """
    with registry.lock():
        records, _errors = registry.list()
        mine = next((r for r in records if r["job_id"] == job_id), None) or registry.get(job_id)
        if mine["status"] != Status.QUEUED:
            return Placement(mine, False, [])
        waiting = [queued_job(r) for r in records
                   if r["status"] == Status.QUEUED and (r["job_id"] == job_id or owner_alive(r))]
        picks = plan(waiting, snapshot(fleet, records, time.time()), time.monotonic(), stale_after_s)
        session = next((s for j, s in picks if j == job_id), None)
        if session is None:
            return Placement(mine, False, waiting)
        return Placement(mark_published(registry, job_id, session), True, waiting)


def close_queue_timeout(registry: Registry, job_id: str) -> JobRecord:
    """`queued` → `error`, `close_reason: queue_timeout` (§14); anything else is left as is."""
    with registry.transaction(job_id) as txn:
        if txn.record["status"] != Status.QUEUED:
            return txn.record
        new = moved(txn.record, Status.ERROR, close_reason="queue_timeout")
        txn.update(new, source=HUB_QUEUE, reason=f"queued longer than {txn.record.get('queue_timeout_sec')} s")
    return new


class PresenceFeed:
    """Every runner's presence (§7) into a `Fleet`; a bad presence is logged, never raised.

    Args:
        keys: the hub's keys (a presence that does not verify is kept as unverified).
        topic_root: MAM_TOPIC_ROOT.
        roster_root: the hub registry's root: enrolled sessions are verified against its roster (§16).
    """

    def __init__(self, keys: DispatchKeys, topic_root: str, roster_root: Path | None = None) -> None:
        self.keys = keys
        self.topic_root = topic_root
        self.roster_root = roster_root
        self._told: set[str] = set()  # job ids whose refusal was said
        self.fleet = Fleet()
        self.revocations = Revocations(roster_root) if roster_root is not None else None

    def drop_revoked(self) -> None:
        """Forget the presence of every revoked runner (§16): nothing is placed on it any more
        (its new presence is refused by the roster check)."""
        if self.revocations is None:
            return
        for view in self.fleet.views():
            if self.revocations.revoked_at(view.session) is not None:
                log.info("runner %s is revoked: no longer a candidate", view.session)
                self.fleet.forget(view.session)

    def refusal(self, session: str, job_id: str) -> str | None:
        """The line saying that runner `session` refused `job_id`'s dispatch, from its verified
        presence (`last_refusal`, issue 11 item 6), the first time only; else None."""
        view = self.fleet.view(session)
        if view is None or view.last_refusal is None or view.last_refusal[0] != job_id or job_id in self._told:
            return None
        self._told.add(job_id)
        return f"runner {session} refused the dispatch of job {job_id}: {view.last_refusal[1]}"

    def subscribe(self, client: MqttClient) -> None:
        """Subscribe to `ROOT/runners/+`.

        Raises:
            BrokerError: no SUBACK.
        """
        client.subscribe([(names.all_presence_filter(self.topic_root), QOS_AT_LEAST_ONCE)])

    def handle(self, topic: str, raw: bytes) -> bool:
        """Take one message: True when it was a presence topic (stored, or refused and logged)."""
        session = names.parse_presence_topic(topic, self.topic_root)
        if session is None:
            return False
        if not raw:
            return True
        try:
            self.fleet.update(presence_view(topic, raw, self.keys, self.topic_root, time.monotonic(), self.roster_root))
        except (ProtocolError, ValueError) as exc:
            log.warning("refused presence on %s: %s", topic, exc)
        return True

    def read_one(self, client: MqttClient, session: str, other: Callable[[str, bytes], object]) -> bool:
        """Read `session`'s retained presence now (subscribe, unsubscribe: it arrives before
        the UNSUBACK); other messages read meanwhile go to `other`.

        Returns:
            True when the session has any presence (verified or not).
        Raises:
            BrokerError: no SUBACK/UNSUBACK.
        """
        topic = names.presence_topic(session, self.topic_root)
        client.subscribe([(topic, QOS_AT_MOST_ONCE)])
        client.unsubscribe([topic])
        while True:
            try:
                message = client.messages.get_nowait()
            except queue.Empty:
                return self.fleet.view(session) is not None
            if not self.handle(message.topic, message.payload):
                other(message.topic, message.payload)

    def lost(self, session: str, runner_id: str | None) -> bool:
        """§14 `runner_lost`: `session`'s presence went offline, or another runner id holds it."""
        view = self.fleet.view(session)
        if view is None or runner_id is None:
            return False
        return view.status == PresenceStatus.OFFLINE or view.runner_id != runner_id

    def runner_id(self, session: str) -> str | None:
        """The runner id of `session`'s last presence, or None."""
        view = self.fleet.view(session)
        return view.runner_id if view is not None else None

    def could_fit(self, job: QueuedJob) -> bool:
        """Some matching runner shows a free slot (before in-flight dispatches): worth a plan."""
        now = time.monotonic()
        return any(matches(view, job) and self.fleet.free_slots(view.session, now, PRESENCE_STALE_S) > 0
                   for view in self.fleet.views())


def wait_queued(registry: Registry, job_id: str, client: MqttClient, feed: PresenceFeed,
                other: Callable[[str, bytes], object], err: TextIO | None = None) -> Placement:
    """Wait until `job_id` leaves `queued` (§14): placed here (then `pending`, the caller
    publishes its dispatch), closed `queue_timeout`, cancelled, or placed by another
    process. Prints one human line on `err` when the reason it waits changes.

    Args:
        feed: the presence feed (already subscribed); other: gets every non-presence message.
    Returns:
        the record as it left the queue, and whether this call placed it.
    Raises:
        RegistryError; KeyboardInterrupt (the job stays queued).
    """
    out = err if err is not None else sys.stderr
    record = registry.get(job_id)
    if record["status"] != Status.QUEUED:
        return Placement(record, False, [])
    job = queued_job(record)
    start = time.monotonic()
    deadline = start + max(0.0, job.queued_at + record.get("queue_timeout_sec", 0) - time.time())
    settle_at, settled = start + PRESENCE_SETTLE_S, False
    next_plan, last_line, printed_at = start, "", -WHY_EVERY_S
    while True:
        now = time.monotonic()
        if not settled and now >= min(settle_at, start + PRESENCE_SETTLE_MAX_S):
            settled, next_plan = True, now
        if now >= next_plan:
            next_plan = now + QUEUE_POLL_S
            feed.drop_revoked()
            placement = place(registry, job_id, feed.fleet)
            if placement.record["status"] != Status.QUEUED:
                return placement
            if now >= deadline:
                return Placement(close_queue_timeout(registry, job_id), False, [])
            waiting = placement.waiting or [job]
            line = why_waiting(job, feed.fleet, waiting, now, PRESENCE_STALE_S) if settled else ""
            if line and line != last_line and now >= printed_at + WHY_EVERY_S:
                warn = "WARNING: " if line.startswith("no runner has ever") else ""
                print(f"{warn}job {job_id}: {line}", file=out, flush=True)
                last_line, printed_at = line, now
        try:
            wake = min(next_plan, deadline) if settled else min(next_plan, deadline, settle_at)
            message = client.messages.get(timeout=max(MIN_WAIT_S, wake - now))
        except queue.Empty:
            continue
        if feed.handle(message.topic, message.payload):
            if message.retain and not settled:
                settle_at = time.monotonic() + PRESENCE_SETTLE_S
            if feed.could_fit(job):
                next_plan = time.monotonic()  # §14: publish within 250 ms of the presence
        else:
            other(message.topic, message.payload)


# ------------------------------------------------------------------ retries

def requeue(registry: Registry, job_id: str, *, session: str | None = None, reason: str = "operator redispatch"
            ) -> JobRecord:
    """An operator's redispatch (§8) through the queue (§14): from `error` or `cancelled`,
    or from an open status after a cancel, never from `completed`: attempt + 1 `queued`
    with fresh tokens, for `session` when given (the target becomes that runner).

    Raises:
        Refusal(`not_allowed`), UsageError (bad session), JobNotFound, RegistryError.
    """
    if session is not None:
        names.validate_session(session)
    with registry.transaction(job_id) as txn:
        record = txn.record
        if record["status"] == Status.COMPLETED:
            raise Refusal(job_id, "not_allowed", "refused redispatch: the job completed")
        if record["status"] in OPEN_STATUSES and not record.get("cancel_requested_at"):
            raise Refusal(job_id, "not_allowed", f"refused redispatch: the job is {record['status']}; cancel it first")
        new = next_attempt(record, Status.QUEUED)
        new["queue_owner_pid"] = os.getpid()
        new.pop("avoid_session", None)
        if session is not None:
            new["target"] = {"session": session}
        elif "target" not in new:  # a v1 record: its session is its target
            new["target"] = {"session": record["session"]}
        txn.update(new, source="operator", reason=reason)
    return new


def retry_reason(record: JobRecord) -> str | None:
    """Why this ended attempt may be retried (§14), or None: `error` ended by the hub
    (its close reason) or by the runner (`error`), and that reason in `retry_on`,
    with fewer than `retries` retries made."""
    if record["status"] != Status.ERROR or record.get("retried", 0) >= record.get("retries", 0):
        return None
    reason = record.get("close_reason") or RetryOn.ERROR
    return reason if reason in record.get("retry_on", list(DEFAULT_RETRY_ON)) else None


def retry_attempt(registry: Registry, job_id: str, reason: str, client: MqttClient | None,
                  keys: DispatchKeys | None) -> JobRecord | None:
    """§14 Retries: cancel the ended attempt (§6), then attempt + 1 `queued` with fresh
    tokens (same target; a label target avoids the previous runner), and a `retry` audit line.

    Returns:
        the new attempt's record, or None when the record changed meanwhile (nothing done).
    Raises:
        RegistryError.
    """
    old = registry.get(job_id)
    if client is not None and keys is not None and client.connected.is_set():
        try:
            publish_cancel(client, old, keys, f"retry after {reason}")
        except BrokerError as exc:
            log.warning("job %s: the cancel of attempt %d was not published: %s", job_id, old["attempt_id"], exc)
    with registry.transaction(job_id) as txn:
        record = txn.record
        if record["status"] != Status.ERROR or record["attempt_id"] != old["attempt_id"]:
            return None
        new = next_attempt(record, Status.QUEUED)
        new["retried"] = record.get("retried", 0) + 1
        new["queue_owner_pid"] = os.getpid()
        if target_of(record)[1] and record.get("session"):
            new["avoid_session"] = record["session"]  # §14: the previous runner only when no other fits
        txn.log({"event": "retry", "timestamp": new["updated_at"], "attempt_id": record["attempt_id"],
                 "reason": reason, "session": record["session"], "next_attempt": new["attempt_id"]})
        txn.update(new, source=HUB_QUEUE, reason=f"retry after {reason}")
    return new
