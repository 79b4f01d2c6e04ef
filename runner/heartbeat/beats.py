"""The runner daemon's own heartbeats (PROTOCOL §12, §17 last bullet): ONE
thread beats for every job the daemon runs, on the daemon's connection, instead
of a detached timer process per job (`timer` stays for `publish --heartbeat`).

A beat is what the timer process sends: `progress`, detail `heartbeat`,
`data.heartbeat: true`, the attempt identity the job was taken with, written
to disk and the outbox first (`publish.record`). It is made holding the job's
`<job>.heartbeat.lock`, the lock a terminal publish takes before it raises the
barrier (`barrier.stop_for_terminal`): under it the barrier is checked under
the registry lock, the beat recorded, handed to the connection (the wire order
is the call order) and its PUBACKs awaited up to the drain time (the bound of
the timer's drain), then the lock is released. A terminal publish (the
supervisor, an agent through the socket, a `mam-runner publish` process)
therefore raises its barrier after the beat in flight, and no beat follows it.

A beat the broker acknowledged renews the attempt's lease (§10 "Leases"): `on_ack` is told
the job, the attempt and when the beat was sent (CLOCK_BOOTTIME, `lease.now`).

A job's beats stop on: its removal (its supervisor ended), a terminal record
or barrier, a newer attempt, its `timeout_sec`; all of them with the daemon's
process, kill -9 included: the thread that beats is gone with it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from mam.runner import barrier, lease, publish
from mam.shared.protocol.codes import EventName
from mam.shared.protocol.errors import BrokerError, RegistryError, TransitionRefused
from mam.shared.store.registry import Registry
from mam.shared.transport import Transport

log = logging.getLogger("mam.heartbeat")

ACK_WAIT_MIN_S = 0.5
"""A beat waits for its PUBACKs at least this long, seconds, even with a shorter drain time:
an acknowledged beat renews the lease (§10 "Leases"), and one never waited for would not."""
STOP_WAIT_S = 10.0
"""How long `Beats.stop` waits for a beat in flight (its drain and more), seconds."""


@dataclass
class _Beating:
    """One job the daemon beats for; times on the monotonic clock, seconds."""

    job_id: str
    attempt_id: int
    dispatch_token: str
    interval_s: float
    deadline: float
    due: float


class Beats:
    """The heartbeats of every job of one runner daemon (§12)::

        beats = Beats(registry, client, drain_s=1.0)
        beats.add(job_id, attempt_id=1, dispatch_token=token, interval_s=30, timeout_s=3600)
        beats.remove(job_id, 1)    # its supervisor ended
        beats.stop()               # the daemon stops (joins the thread)

    No side effects in the constructor; the thread starts with the first `add`.

    Args:
        registry: this host's registry; client: the daemon's connection.
        drain_s: how long a beat waits for its PUBACKs while holding the job's
            heartbeat lock (MAM_HEARTBEAT_DRAIN_S, §12), seconds.
        on_ack: told `(job_id, attempt_id, sent_at)` of each beat acknowledged within
            `drain_s` (§10 "Leases"); sent_at on CLOCK_BOOTTIME.
        clock: the monotonic clock (tests pass their own).
    """

    def __init__(self, registry: Registry, client: Transport, *, drain_s: float,
                 on_ack: Callable[[str, int, float], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.registry = registry
        self.client = client
        self.drain_s = drain_s
        self.on_ack = on_ack
        self.clock = clock
        self._jobs: dict[str, _Beating] = {}
        self._cond = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None

    @property
    def jobs(self) -> list[str]:
        """The job ids beaten for now (sorted)."""
        with self._cond:
            return sorted(self._jobs)

    def add(self, job_id: str, *, attempt_id: int, dispatch_token: str, interval_s: float,
            timeout_s: float) -> None:
        """Beat for `job_id` every `interval_s` from now, for at most `timeout_s` (§12); replaces
        an earlier attempt's entry. An attempt that has ended gets no beat (the first one stops)."""
        now = self.clock()
        with self._cond:
            if self._stopping:
                return
            self._jobs[job_id] = _Beating(job_id, attempt_id, dispatch_token, interval_s, now + timeout_s,
                                          now + interval_s)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="mam-beats", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def remove(self, job_id: str, attempt_id: int | None = None) -> None:
        """Beat no more for `job_id` (only for `attempt_id` when given): a beat in flight
        finishes under the job's heartbeat lock, a later one is not made. The supervisor
        calls it before its terminal, so no beat takes a seq the terminal meant to take."""
        with self._cond:
            job = self._jobs.get(job_id)
            if job is not None and attempt_id in (None, job.attempt_id):
                del self._jobs[job_id]
                self._cond.notify_all()

    def stop(self) -> None:
        """Stop beating for every job and join the thread (idempotent)."""
        with self._cond:
            self._stopping = True
            self._jobs.clear()
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(STOP_WAIT_S)

    # ------------------------------------------------------------ the thread

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._stopping and not self._due():
                    nearest = min((job.due for job in self._jobs.values()), default=None)
                    self._cond.wait(None if nearest is None else max(0.0, nearest - self.clock()))
                if self._stopping:
                    return
                due = self._due()
            for job in due:
                try:
                    reason = self.beat(job)
                except Exception as exc:  # the daemon's beats never die on one job's failure
                    log.error("job %s: heartbeat failed: %s: %s", job.job_id, type(exc).__name__, exc)
                    reason = None
                now = self.clock()
                with self._cond:
                    if self._jobs.get(job.job_id) is not job:
                        continue  # removed or replaced meanwhile
                    if reason is not None:
                        log.info("heartbeat for job %s stops: %s", job.job_id, reason)
                        del self._jobs[job.job_id]
                        continue
                    job.due += job.interval_s
                    if job.due <= now:  # fell behind (a slow disk or broker): the next one a period from now
                        job.due = now + job.interval_s

    def _due(self) -> list[_Beating]:
        now = self.clock()
        return sorted((job for job in self._jobs.values() if job.due <= now), key=lambda job: job.due)

    def stop_reason(self, job: _Beating) -> str | None:
        """Why `job` gets no more beats (§12), or None."""
        if self.clock() >= job.deadline:
            return "timeout_sec reached"
        return barrier.record_stop_reason(self.registry, job.job_id, job.attempt_id, job.dispatch_token)

    def beat(self, job: _Beating) -> str | None:
        """One beat of `job`, disk first then the wire, under its heartbeat lock (§12).

        Returns:
            why its beats stop, or None (a beat that the disk refused is skipped: the next one tries again).
        """
        reason = self.stop_reason(job)
        if reason is not None:
            return reason
        root = self.registry.root
        with barrier.lifecycle_lock(root, job.job_id):
            with self._cond:  # removed while this beat waited for the lock: its terminal may be under way
                if self._jobs.get(job.job_id) is not job:
                    return "removed"
            try:
                with self.registry.lock():
                    # under the seq lock: a beat takes its seq before a terminal's barrier or not at all
                    if barrier.barrier_attempt(root, job.job_id) >= job.attempt_id:
                        return "terminal barrier raised"
                    published = publish.record(self.registry, publish.PublishRequest(
                        job_id=job.job_id, event=EventName.PROGRESS, detail=barrier.HEARTBEAT_DETAIL,
                        attempt_id=job.attempt_id, dispatch_token=job.dispatch_token),
                        source="runner", extra_data={"heartbeat": True}, stop_heartbeat=False,
                        durable=False)
            except TransitionRefused as exc:
                return str(exc)
            except RegistryError as exc:
                log.warning("job %s: beat not written (%s); the next one tries again", job.job_id, exc)
                return None
            self._send(job, published)
        return None

    def _send(self, job: _Beating, published: publish.Published) -> None:
        """Hand event and state to the connection; wait for their PUBACKs up to `drain_s` while
        it is up, then renew the lease (`on_ack`). Unacknowledged, the beat stays in the outbox
        for the Resender (§17) and renews nothing."""
        sent_at = lease.now()
        try:
            wait_s = max(self.drain_s, ACK_WAIT_MIN_S)
            waiters = [self.client.publish_async(topic, payload, retain=retain, timeout_s=wait_s)
                       for topic, payload, retain in published.messages(self.client.config.topic_root)]
            if not self.client.connected.is_set():
                return  # queued in order on this connection; sent (or re-sent from the outbox) later
            for wait in waiters:
                wait()
        except BrokerError as exc:
            log.warning("job %s: beat seq %d kept in the outbox: %s", published.event["job_id"], published.seq, exc)
            return
        publish.acknowledge(published)
        if self.on_ack is not None:
            self.on_ack(job.job_id, job.attempt_id, sent_at)


__all__ = ["Beats"]
