"""The hub queue's record steps (PROTOCOL §14) the hub engine (`service.HubService`)
takes: a queued record as the queue sees it, `queued` → `pending` when it is
published, `queue_timeout`, the operator's redispatch, the retry of a failed
attempt and the pause of one that stopped on a usage limit (and its early resume);
and `PresenceFeed`, every runner's presence (§7) as a `queue.Fleet`.
"""

from __future__ import annotations

import logging
import time
from datetime import UTC, datetime
from pathlib import Path

from mam.orchestrator.control import publish_cancel
from mam.orchestrator.identity.roster import Revocations
from mam.orchestrator.queue import Fleet, QueuedJob
from mam.orchestrator.runners import presence_view
from mam.shared.protocol import names, wire
from mam.shared.protocol.codes import (
    DEFAULT_RETRY_ON,
    OPEN_STATUSES,
    TERMINAL_STATUSES,
    PresenceStatus,
    QueueSource,
    RetryOn,
)
from mam.shared.protocol.codes import JobStatus as Status
from mam.shared.protocol.crypto import DispatchKeys
from mam.shared.protocol.errors import BrokerError, ProtocolError
from mam.shared.store.records import (
    JobRecord,
    Refusal,
    continued_work,
    moved,
    next_attempt,
    published,
    target_of,
    utc_now,
)
from mam.shared.store.registry import Registry
from mam.shared.transport import Transport
from mam.shared.transport.mqtt import QOS_AT_LEAST_ONCE

log = logging.getLogger("mam.queue")

PRESENCE_SETTLE_S = 0.5
"""The retained presence burst is in once no retained presence came for this long (s)."""
PRESENCE_SETTLE_MAX_S = 5.0
"""...or this long after the subscription, whichever comes first (s)."""
WHY_EVERY_S = 5.0
"""A changed `why_waiting` line is printed at most this often (s)."""
MIN_WAIT_S = 0.01
HUB_QUEUE = QueueSource.HUB_QUEUE
DEFAULT_LIMIT_PAUSE_S = 900
"""A usage limit whose reset the agent did not say pauses the job this long (s, §14 Pauses)."""
MAX_PAUSES = 20
"""Pauses of one job at most; the next usage limit leaves it `error` (§14 Pauses)."""


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
                     avoid_session=record.get("avoid_session"), prefer_session=record.get("prefer_session"),
                     repo=(record.get("work") or {}).get("repo"),
                     paused_until=_epoch(record["paused_until"]) if record.get("paused_until") else None,
                     limited_session=(record.get("limited") or {}).get("session"),
                     limited_until=_epoch(record["limited"]["until"]) if record.get("limited") else None,
                     group=record.get("group"), group_limit=int(record.get("group_limit", 1)),
                     cancel_in_progress=record.get("cancel_in_progress") is True,
                     gpus=int((record.get("work") or {}).get("gpus") or 0))


def mark_published(registry: Registry, job_id: str, session: str) -> JobRecord:
    """`queued` → `pending` for `session` (§14, source `hub_queue`); publish the dispatch next.

    Raises:
        Refusal(`not_allowed`): the job is no longer queued. JobNotFound, RegistryError.
    """
    with registry.transaction(job_id) as txn:
        new = published(txn.record, session, utc_now())
        txn.update(new, source=HUB_QUEUE, reason=f"published to {session}")
    return new


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
        presence (`last_refusal`, §7), the first time only; else None."""
        view = self.fleet.view(session)
        if view is None or view.last_refusal is None or view.last_refusal[0] != job_id or job_id in self._told:
            return None
        self._told.add(job_id)
        return f"runner {session} refused the dispatch of job {job_id}: {view.last_refusal[1]}"

    def subscribe(self, client: Transport) -> None:
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

# ------------------------------------------------------------------ retries

def refuse_redispatch(record: JobRecord) -> None:
    """Only an ended job, or an open one after a cancel, gets a new attempt; never a completed one (§8).

    Raises:
        Refusal(`not_allowed`): one line, naming `mam-orch cancel` when that is what is missing.
    """
    job_id = record["job_id"]
    if record["status"] == Status.COMPLETED:
        raise Refusal(job_id, "not_allowed", "refused redispatch: the job completed")
    if record["status"] in OPEN_STATUSES and not record.get("cancel_requested_at"):
        raise Refusal(job_id, "not_allowed", f"refused redispatch: the job is {record['status']}; "
                                             f"cancel it first (mam-orch cancel {job_id})")


def requeue(registry: Registry, job_id: str, *, session: str | None = None, reason: str = "operator redispatch",
            fresh: bool = False) -> JobRecord:
    """An operator's redispatch (§8) through the queue (§14): from `error` or `cancelled`,
    or from an open status after a cancel, never from `completed`: attempt + 1 `queued`
    (`blocked` for a job that runs after others, §14 Dependencies: the engine looks at
    them again) with fresh tokens, for `session` when given (the target becomes that runner). It
    continues the last agent session (§18 `work.resume`) unless `fresh`.

    Raises:
        Refusal(`not_allowed`), UsageError (bad session), JobNotFound, RegistryError.
    """
    if session is not None:
        names.validate_session(session)
    with registry.transaction(job_id) as txn:
        record = txn.record
        refuse_redispatch(record)
        # §14 Dependencies: a job that runs after others waits for them again (they may be redispatched too)
        new = next_attempt(record, Status.BLOCKED if record.get("after") else Status.QUEUED)
        new.pop("unblocked_at", None)
        new.pop("avoid_session", None)
        new.pop("prefer_session", None)
        if fresh and new.get("work", {}).pop("resume", None) is not None and not new["work"]:
            del new["work"]
        if session is not None:
            new["target"] = {"session": session}
        elif "target" not in new:  # a v1 record: its session is its target
            new["target"] = {"session": record["session"]}
        txn.update(new, source="operator", reason=reason)
    return new


def say_requeue(registry: Registry, job_id: str) -> JobRecord:
    """`mam-orch say` (§18 "Continued sessions"): a job that ended (completed too) goes on as
    attempt + 1 `queued` on the runner of its last attempt, continuing the agent's last
    session (`work.resume`, `--fresh` or not) with the person's words as its brief; a
    `said` audit line.

    Raises:
        Refusal(`not_allowed`): the job has not ended, or its agent reported no session.
        JobNotFound, RegistryError.
    """
    with registry.transaction(job_id) as txn:
        record = txn.record
        if record["status"] not in TERMINAL_STATUSES:
            raise Refusal(job_id, "not_allowed", f"refused say: the job is {record['status']}; `say` continues a "
                                                 "job after it ended (wait for it, or cancel it first)")
        work = continued_work(record, fresh=False)
        if "resume" not in work:
            raise Refusal(job_id, "not_allowed", "refused say: the job's agent reported no session to continue "
                                                 "(dispatch a new job instead)")
        new = next_attempt(record, Status.QUEUED)
        new["work"] = work
        new.pop("avoid_session", None)
        new.pop("prefer_session", None)
        new["target"] = {"session": record["session"]}  # its worktree and the session are there
        txn.log({"event": "said", "timestamp": new["updated_at"], "attempt_id": record["attempt_id"],
                 "session_id": work["resume"]["session_id"], "next_attempt": new["attempt_id"]})
        txn.update(new, source="operator", reason="a person continues the agent's session")
    return new


def retry_reason(record: JobRecord) -> str | None:
    """Why this ended attempt may be retried (§14), or None: `error` ended by the hub
    (its close reason) or by the runner (`error`, or `lease_lost` when it fenced the attempt,
    §10 "Leases"), and that reason in `retry_on`, with fewer than `retries` retries made."""
    if record["status"] != Status.ERROR or record.get("retried", 0) >= record.get("retries", 0):
        return None
    reason = record.get("close_reason") or (RetryOn.LEASE_LOST if record.get("lease_lost") else RetryOn.ERROR)
    return reason if reason in record.get("retry_on", list(DEFAULT_RETRY_ON)) else None


def cancel_ended(registry: Registry, job_id: str, client: Transport | None, keys: DispatchKeys | None,
                 reason: str) -> JobRecord:
    """The job's record, after a cancel of its ended attempt (§6) with `reason` went out where the
    client is connected (its runner may still hold it); a failed publish is only logged."""
    old = registry.get(job_id)
    if client is not None and keys is not None and client.connected.is_set():
        try:
            publish_cancel(client, old, keys, reason)
        except BrokerError as exc:
            log.warning("job %s: the cancel of attempt %d was not published: %s", job_id, old["attempt_id"], exc)
    return old


def limit_pause(record: JobRecord, now: float) -> float | None:
    """Until when (epoch s) this ended attempt's runner is limited (§14 Pauses), or None: it
    ended `error` on a usage limit (`usage_limit` of this attempt, §18), the job is not
    `--on-limit fail`, and it paused or moved fewer than MAX_PAUSES times. The reset the agent
    said, else now + DEFAULT_LIMIT_PAUSE_S. The job then pauses, or moves (`on_limit` `move`)."""
    limit = record.get("usage_limit")
    if record["status"] != Status.ERROR or record.get("on_limit", "pause") == "fail" \
            or not isinstance(limit, dict) or limit.get("attempt_id") != record["attempt_id"] \
            or int(record.get("pauses", 0)) >= MAX_PAUSES:
        return None
    return _epoch(limit["reset_at"]) if limit.get("reset_at") else now + DEFAULT_LIMIT_PAUSE_S



def settled(record: JobRecord) -> bool:
    """The job is over for good: terminal, and not an attempt the service is about to retry
    or pause (§14)."""
    return record["status"] in TERMINAL_STATUSES and retry_reason(record) is None \
        and limit_pause(record, time.time()) is None


def pause_attempt(registry: Registry, job_id: str, until: float, client: Transport | None,
                  keys: DispatchKeys | None) -> JobRecord | None:
    """§14 Pauses: cancel the ended attempt (§6), then attempt + 1 `queued` with fresh tokens
    for the same runner (its worktree and the agent's session are there, §18), published no
    sooner than `until` (`paused_until`); the ended attempt is `paused (usage_limit)` in the
    history and a `paused` audit line says until when. Not a retry (`retried` unchanged).

    Returns:
        the new attempt's record, or None when the record changed meanwhile (nothing done).
    Raises:
        RegistryError.
    """
    return _limited_attempt(registry, job_id, until, client, keys, move=False)


def move_attempt(registry: Registry, job_id: str, until: float, client: Transport | None,
                 keys: DispatchKeys | None) -> JobRecord | None:
    """§14 Moves: as `pause_attempt`, but attempt + 1 is `queued` at once for its label target,
    never to the limited runner before `until` (`limited`); it continues the agent's session
    (§18 "Transcripts": the hub carries the transcript). The ended attempt is `moved
    (usage_limit)` in the history and a `moved` audit line says from where."""
    return _limited_attempt(registry, job_id, until, client, keys, move=True)


def _limited_attempt(registry: Registry, job_id: str, until: float, client: Transport | None,
                     keys: DispatchKeys | None, *, move: bool) -> JobRecord | None:
    word = "moved" if move else "paused"
    old = cancel_ended(registry, job_id, client, keys, f"{word} on a usage limit")
    stamp = wire.format_ts(datetime.fromtimestamp(until, UTC))
    with registry.transaction(job_id) as txn:
        record = txn.record
        if record["status"] != Status.ERROR or record["attempt_id"] != old["attempt_id"]:
            return None
        new = next_attempt(record, Status.QUEUED)
        new["attempt_history"][-1].update(status=word, close_reason="usage_limit")
        new["pauses"] = int(record.get("pauses", 0)) + 1
        if move:
            new["limited"] = {"session": record["session"], "until": stamp}
        else:
            new["paused_until"] = stamp
            new["target"] = {"session": record["session"]}
        new.pop("avoid_session", None)
        new.pop("prefer_session", None)
        txn.log({"event": word, "timestamp": new["updated_at"], "attempt_id": record["attempt_id"],
                 "session": record["session"], "until": stamp, "next_attempt": new["attempt_id"]})
        where = f"of {record['session']} " if move else ""
        txn.update(new, source=HUB_QUEUE, reason=f"{word} on a usage limit {where}until {stamp}")
    return new


def refuse_unpaused(record: JobRecord) -> None:
    """Raise Refusal(`not_allowed`) unless the job is paused (§14 Pauses)."""
    if record["status"] != Status.QUEUED or not record.get("paused_until"):
        raise Refusal(record["job_id"], "not_allowed", f"refused resume: the job is {record['status']}, not paused")


def resume_paused(registry: Registry, job_id: str) -> JobRecord:
    """`mam-orch resume`: a paused job (§14 Pauses) goes back to the queue now.

    Raises:
        Refusal(`not_allowed`): the job is not paused. JobNotFound, RegistryError.
    """
    with registry.transaction(job_id) as txn:
        record = txn.record
        refuse_unpaused(record)
        new = moved(record, Status.QUEUED)
        new.pop("paused_until")
        txn.log({"event": "resumed", "timestamp": new["updated_at"], "attempt_id": record["attempt_id"],
                 "was_paused_until": record["paused_until"]})
        txn.update(new, source="operator", reason="resumed before the usage limit's reset")
    return new


def retry_attempt(registry: Registry, job_id: str, reason: str, client: Transport | None,
                  keys: DispatchKeys | None) -> JobRecord | None:
    """§14 Retries: cancel the ended attempt (§6), then attempt + 1 `queued` with fresh
    tokens (same target; a label target avoids the previous runner, or prefers it when the
    runner reported the error and the attempt continues the agent's session, §18), and a
    `retry` audit line.

    Returns:
        the new attempt's record, or None when the record changed meanwhile (nothing done).
    Raises:
        RegistryError.
    """
    old = cancel_ended(registry, job_id, client, keys, f"retry after {reason}")
    with registry.transaction(job_id) as txn:
        record = txn.record
        if record["status"] != Status.ERROR or record["attempt_id"] != old["attempt_id"]:
            return None
        new = next_attempt(record, Status.QUEUED)
        new["retried"] = record.get("retried", 0) + 1
        new.pop("avoid_session", None)
        new.pop("prefer_session", None)
        if target_of(record)[1] and record.get("session"):
            if reason == RetryOn.ERROR and "resume" in new.get("work", {}):
                new["prefer_session"] = record["session"]  # §18: its worktree and the agent's session are there
            else:
                new["avoid_session"] = record["session"]  # §14: the previous runner only when no other fits
        txn.log({"event": "retry", "timestamp": new["updated_at"], "attempt_id": record["attempt_id"],
                 "reason": reason, "session": record["session"], "next_attempt": new["attempt_id"]})
        txn.update(new, source=HUB_QUEUE, reason=f"retry after {reason}")
    return new
