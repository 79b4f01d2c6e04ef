"""The runner daemon of `mam-runner run`: its lifecycle (PROTOCOL §5-§7, §11).

One process per worker host and session, ONE persistent MQTT connection
whose Last Will is the signed `offline` presence. `Runner` is assembled from
parts: `presence` (§7), `admission` (the §5 checks, cancel tombstones),
`job` (one job's life, §11), `orphans` (restart recovery, §6) and `settings`.
It reads as its life: `serve()` = startup, main loop (`on_tick`, then one
message), shutdown. The first SIGTERM/SIGINT drains (presence `draining`,
nothing new taken, running jobs finish); the second cancels them (§6) and
exits. Controls are subscribed before dispatches, each with its own SUBACK,
so retained cancels normally arrive before retained dispatches.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import queue
import signal
import threading
import time
from collections.abc import Callable, Mapping
from types import FrameType, TracebackType
from typing import Any

from mam.runner import cgroups, gpus, limits, orphans, publish, trust
from mam.runner.admission import (
    TOLD_REFUSALS,
    Refuse,
    RefuseReason,
    RunnerState,
    Take,
    Tombstones,
    Wait,
    admit_dispatch,
    check_control,
    check_taken,
    waiting_attempt,
)
from mam.runner.job import Job, Supervisor, orphan_job
from mam.runner.localsock import PublishServer
from mam.runner.outbox import Outbox, Resender
from mam.runner.presence import Presence
from mam.runner.settings import DEFAULT_MAX_RESULT_BYTES, RunnerOptions, options_from_cli
from mam.runner.trust import HubTrust
from mam.shared import config as shared_config
from mam.shared.config import BrokerConfig
from mam.shared.protocol import crypto, names, wire
from mam.shared.protocol.codes import TERMINAL_STATUSES, ControlAction, PresenceStatus
from mam.shared.protocol.errors import BrokerError, DecodeError, ExitCode, MamError, SignatureError
from mam.shared.store.records import JobRecord
from mam.shared.store.registry import Refusal, Registry
from mam.shared.transport import Received, Transport, TransportFactory, mqtt

log = logging.getLogger("mam.daemon")

KEY_SHOWN_CHARS = 12  # of a hub key in the revocation line, as `mam-orch runner list` shows keys
MESSAGE_WAIT_S = 0.1  # longest wait for a message before the next `on_tick`
SHUTDOWN_REASON = "runner_shutdown"
REVOKED_REASON = "runner_revoked"
TAKEN_CHECK_WAIT_S = 2.0
"""Longest wait for each SUBACK/UNSUBACK of the state read before a take (§17); only a broker that
does not answer makes a take wait this (the dispatch then stays retained)."""
FLUSH_S = 30.0
"""How long a runner ending cleanly (`--once`, drained) waits for the broker to acknowledge the
events still in its outbox (a terminal sent during an outage) before it exits, seconds (§17)."""
FLUSH_LOOK_S = 0.5
"""How often that wait looks again (paho reconnects on its own thread), seconds."""
PRESENCE_COALESCE_S = 0.2
"""Longest a changed `running` list waits for the inbox to empty before its presence goes out
anyway, seconds (§7): a burst of takes and ends is said in one presence, not one each."""

SignalHandler = Callable[[int, FrameType | None], Any] | int | None


class Runner:
    """The runner daemon (§7, §11). Lifecycle like Temporal's worker / uvicorn::

        runner = Runner(options, config=broker_config, trust=trust.load(root))
        code = runner.serve()      # blocks; refuses to run twice
        runner.drain()             # = first SIGTERM: take nothing new, finish, exit
        runner.shutdown()          # stop now: cancel running jobs, exit (idempotent)

    Also a context manager: leaving `with Runner(...) as runner:` calls `shutdown()`.
    The constructor has no side effects: no connection, no files, no signal
    handlers. `serve()` installs SIGTERM/SIGINT handlers when it runs on the
    main thread and restores the previous ones when it returns.

    Args:
        options: validated `RunnerOptions`.
        config: the BrokerConfig of this host (§13).
        trust: how it verifies the hub (`trust.V1Trust` or `trust.V2Trust`, chosen at start by
            `trust.load`, §16.1).
        environ: the environment agents inherit (default os.environ).
        transport: makes the connection (default `mqtt.new_client`; tests pass a fake).
    """

    def __init__(self, options: RunnerOptions, *, config: BrokerConfig, trust: HubTrust,
                 environ: Mapping[str, str] | None = None, transport: TransportFactory = mqtt.new_client) -> None:
        self.options = options
        self.config = config
        self.trust = trust
        self.environ = environ
        self.transport = transport
        self.runner_id = names.new_runner_id()
        self.client: Transport | None = None
        self.presence = Presence(session=options.session, runner_id=self.runner_id, trust=trust,
                                 max_jobs=options.max_jobs, topic_root=config.topic_root, labels=options.labels,
                                 repos=[spec.name for spec in options.repos])
        self.tombstones = Tombstones()
        self.gpus: gpus.GpuSlots | None = None  # §14 "GPUs": set at start when it serves any
        self._registry: Registry | None = None
        self._supervisor: Supervisor | None = None
        self._resender: Resender | None = None  # re-sends the outbox (§17)
        self._socket: PublishServer | None = None  # agents' local publish socket (§17)
        self._jobs: dict[str, Job] = {}
        self._jobs_lock = threading.Lock()
        self._said: set[tuple[str, str]] = set()  # (job_id, message_id) handled, §18: each message once
        self._pending: dict[str, bytes] = {}  # dispatch topic -> payload waiting for a slot
        self._deferred: collections.deque[Received] = collections.deque()  # read during a take check
        self._ended: queue.Queue[str] = queue.Queue()  # job ids whose supervisor finished
        self._taken = 0
        self._draining = threading.Event()
        self._stop = threading.Event()  # second signal / shutdown(): cancel jobs and exit
        self._stopped = threading.Event()
        self._served = False
        self._serve_lock = threading.Lock()
        self._signals = 0
        self._drain_announced = False
        self._shutdown_done = False
        self._presence_due_at: float | None = None  # monotonic s: `running` changed, not yet published
        self._serve_thread: threading.Thread | None = None
        self._stop_reason = SHUTDOWN_REASON
        self._revoked_topic = names.revoked_topic(options.session, config.topic_root)
        self.revoked: wire.Revocation | None = None  # the hub's verified notice (§16.7): exit 77
        self._drain_topic = names.drain_topic(options.session, config.topic_root)
        self.drain_order: wire.Drain | None = None  # the hub's last verified drain order (§7)

    # ------------------------------------------------------------ public API

    @property
    def held(self) -> bool:
        """The hub drained this runner (§7 "Drain from the hub"): it takes nothing new until undrained."""
        return self.drain_order is not None and self.drain_order.draining

    @property
    def running(self) -> list[str]:
        """Job ids of the jobs in progress (sorted)."""
        with self._jobs_lock:
            return sorted(self._jobs)

    @property
    def draining(self) -> bool:
        """True once `drain()`, a first signal, a take-over (§7) or `shutdown()` happened."""
        return self._draining.is_set()

    def drain(self) -> None:
        """Take nothing new, let running jobs finish (heartbeating), then exit 0
        (§7 `draining`; the first SIGTERM/SIGINT). Safe from any thread."""
        self._draining.set()

    def shutdown(self, timeout_s: float | None = None) -> None:
        """Stop now: idempotent and safe from any thread (the second SIGTERM/SIGINT).

        Order: 1. stop taking dispatches; 2. cancel every running job (§6:
        SIGTERM, grace, SIGKILL of the tree; each publishes `error`/`cancelled`)
        and join the supervisor threads; 3. publish presence `offline`
        (retained); 4. close the MQTT connection (a clean DISCONNECT, so the
        broker drops the Last Will); 5. restore the signal handlers. Steps 2-5
        run in `serve()`'s thread; this call waits up to `timeout_s` (None =
        forever) for them when `serve()` is running elsewhere. Before `serve()`
        it does nothing (there is nothing to stop).
        """
        if not self._served:
            return
        self._draining.set()
        self._stop.set()
        if threading.current_thread() is not self._serve_thread:
            self._stopped.wait(timeout_s)

    def __enter__(self) -> Runner:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.shutdown()

    def on_signal(self, signum: int, frame: FrameType | None = None) -> None:
        """The SIGTERM/SIGINT handler: the first drains, the second cancels running jobs and exits."""
        self._signals += 1
        if self._signals == 1:
            log.info("signal %d: draining (running jobs finish, nothing new is taken; "
                     "signal again to cancel them)", signum)
            self._draining.set()
        else:
            log.info("signal %d again: cancelling running jobs and exiting", signum)
            self._stop.set()

    def serve(self) -> int:
        """Connect, check the session, announce presence, take and run jobs
        until drained, stopped or (`once`) one job ended.

        Returns:
            0 on a clean exit; 77 (`ExitCode.REVOKED`) once the hub revoked this runner (§16.7).
        Raises:
            SessionBusy: another live runner holds the session (exit 64; §7).
            HubRegistry: the registry root holds hub records (exit 64; §8).
            RegistryError: the workspace's `.mam/` is not writable (exit 1; §9).
            BrokerUnavailable: no broker accepted the connection (exit 3).
            MamError: `serve()` was already called on this Runner.
        """
        with self._serve_lock:
            if self._served:
                raise MamError("Runner.serve() was already called: a Runner serves once")
            self._served = True
        self._serve_thread = threading.current_thread()
        self._registry = Registry(self.options.root)
        try:
            orphans.check_not_hub_registry(self._registry)  # before any connection, handler or log line
            orphans.check_workspace_writable(self._registry)  # before any presence (an unwritable one announces none)
        except BaseException:  # HubRegistry, a registry that cannot be listed or written
            self._shutdown_done = True
            self._stopped.set()
            raise
        previous = self._install_signal_handlers()
        try:
            self._startup(self._registry)
            self._main_loop()
            return ExitCode.REVOKED if self.revoked is not None else ExitCode.OK
        finally:
            try:
                self._shutdown()
            finally:
                self._restore_signal_handlers(previous)
                self._stopped.set()

    # ------------------------------------------------------------ startup

    def _startup(self, registry: Registry) -> None:
        inventory, said = gpus.detect(self.options.gpus, self.environ or os.environ)  # §14 "GPUs", said once
        log.info("runner %s: %s", self.runner_id, said)
        if inventory.indices:
            self.gpus = gpus.GpuSlots(inventory.indices)
            self.presence.gpus = self.gpus
            self.presence.labels = tuple(sorted({*self.presence.labels, *inventory.labels()}))
        self.client = client = self.transport(self.config, "runner", self.presence.will())
        client.connect()
        self.presence.check_session_free(client, wait_s=self.options.presence_wait_s, replace=self.options.replace)
        self._supervisor = Supervisor(options=self.options, runner_id=self.runner_id, registry=registry,
                                      client=client, config=self.config, environ=self.environ,
                                      on_end=self._ended.put, stopping=self._stop)
        self._supervisor.cgroups, mode = cgroups.detect(self.options.session)  # §6: said once, at start
        log.info("runner %s: %s", self.runner_id, mode)
        v2 = self._supervisor.cgroups.path if self._supervisor.cgroups is not None else None
        self._supervisor.limits, said = limits.detect(self.options.session, v2=v2)  # §6 "Limits"
        log.info("runner %s: %s", self.runner_id, said)
        self._supervisor.logstreams.resend_leftovers()  # §15, §17: output chunks a stopped runner left
        self._supervisor.results.resend_leftovers(registry)  # §18, §17: results a stopped runner left
        self._supervisor.mirrors.remove_leftovers(keep=self.options.keep_worktrees)  # §18: a crash's worktrees
        self._supervisor.mirrors.gc()
        # Before subscribing: a retained cancel for an orphan then finds it adopted (in `_jobs`).
        for record, orphan in orphans.orphans_at_start(registry, runner_id=self.runner_id,
                                                       session=self.options.session):
            self._adopt_orphan(record, orphan)
        # Subscribe before announcing `online` (a dispatch sent once the hub sees us must reach us live);
        # controls first, each with its own SUBACK: a replayed dispatch of a cancelled attempt is refused.
        client.subscribe([(names.all_controls_filter(self.config.topic_root), mqtt.QOS_AT_LEAST_ONCE)])
        client.subscribe([(names.all_dispatches_filter(self.config.topic_root), mqtt.QOS_AT_LEAST_ONCE)])
        try:
            client.subscribe([(names.all_answers_filter(self.config.topic_root), mqtt.QOS_AT_LEAST_ONCE)])  # §19
        except BrokerError as exc:  # a runner user from before §19: jobs run, their agents' asks get no answer
            log.warning("answers to permission requests cannot reach this runner: %s; give its broker user the "
                        "rights of `mam-orch runner add` again (docs/security.md)", exc)
        try:
            client.subscribe([(self._revoked_topic, mqtt.QOS_AT_LEAST_ONCE)])  # §16.7
        except BrokerError as exc:  # a runner user from before §16.7: a revocation is not heard here
            log.warning("a revocation by the hub cannot reach this runner: %s; give its broker user the "
                        "rights of `mam-orch runner add` again (docs/security.md)", exc)
        logstreams = self._supervisor.logstreams
        self._socket = PublishServer(registry, held=lambda job_id: job_id in self.running, send=self._send,
                                     before_terminal=logstreams.finish,  # §15
                                     mask=lambda job_id, text: logstreams.mask(registry, job_id, text),
                                     ask_terms=self._ask_terms, cancel=self._cancel_one,  # §19
                                     tool_rules=self._tool_rules)
        self._supervisor.socket_path = self._socket.start()  # listening before `online` (§17)
        self._supervisor.denied_tools = self._socket.denied_tools  # §19
        self._hear_drain()
        self._publish_presence()
        self._resender = Resender(Outbox(self.options.root), client, self._record)
        self._resender.start()  # §17: what an earlier run or a failed `publish` left is sent now
        log.info("runner %s serving session %s (max %d job(s)) on %s:%d", self.runner_id,
                 self.options.session, self.options.max_jobs, client.host, self.config.port)

    # ------------------------------------------------------------ main loop

    def _main_loop(self) -> None:
        assert self.client is not None
        while not self.on_tick():
            try:
                message = (self._deferred.popleft() if self._deferred
                           else self.client.messages.get(timeout=MESSAGE_WAIT_S))
            except queue.Empty:
                continue
            try:
                self._handle(message)
            except Exception as exc:  # a daemon never dies on a bad message
                log.error("message on %s could not be handled: %s: %s", message.topic, type(exc).__name__, exc)
                log.debug("traceback", exc_info=True)

    def on_tick(self) -> bool:
        """The periodic work between messages: stop, drain, presence (§7), ended jobs.

        Returns:
            True when the main loop must end (stopped, or drained with no job left).
        """
        assert self.client is not None
        if self._stop.is_set():
            self._cancel_all(self._stop_reason)
            if not self.running:
                return True
        if self._draining.is_set() and not self._drain_announced:
            self._drain_announced = True
            self._pending.clear()
            self._publish_presence(PresenceStatus.DRAINING)
        if (self._draining.is_set() or self._closing_once()) and not self.running:
            return True
        if self.client.reconnected.is_set():  # the broker may have published our Last Will
            self.client.reconnected.clear()
            self._publish_presence()
            if self._resender is not None:
                self._resender.wake()  # §17: re-send the outbox, kept terminal states included
        elif self.presence.refresh_due(self.options.presence_refresh_s):
            self._publish_presence()  # refresh: a fresh timestamp says we are alive (§7)
        self._reap_ended()
        if self._presence_due_at is not None and (
                (not self._deferred and self.client.messages.empty())
                or time.monotonic() - self._presence_due_at >= PRESENCE_COALESCE_S):
            self._publish_presence()
        return False

    # ------------------------------------------------------------ shutdown

    def _shutdown(self) -> None:
        """Steps 2-4 of `shutdown()`, once."""
        if self._shutdown_done:
            return
        self._shutdown_done = True
        self._draining.set()
        self._cancel_all(SHUTDOWN_REASON)
        for job in list(self._jobs.values()):
            if job.thread is not None:
                job.thread.join()
        self._reap_ended()
        if self._supervisor is not None:
            self._supervisor.beats.stop()
            self._supervisor.results.stop()  # unsent results stay in the outbox for the next start
            self._supervisor.deadman.close()  # every job ended: nothing is armed
            if self._supervisor.cgroups is not None:
                self._supervisor.cgroups.close()
            if self._supervisor.limits is not None:
                self._supervisor.limits.close()
        if self._socket is not None:
            self._socket.stop()
        if self._resender is not None:
            self._resender.stop()
            self._flush_outbox()
        if self.client is not None:
            if self.presence.announced and self.client.connected.is_set():
                self._publish_presence(PresenceStatus.OFFLINE)
            self.client.close()
        log.info("runner %s stopped", self.runner_id)

    def _flush_outbox(self) -> None:
        """§17: before a clean exit, send what the broker has not acknowledged (a terminal
        published during an outage), waiting up to FLUSH_S for the broker; a second signal or
        `shutdown()` cuts the wait. What stays is said: the next start in this workspace sends it."""
        box, client = Outbox(self.options.root), self.client
        deadline = time.monotonic() + FLUSH_S
        said = False
        while pending := [slot for slot in box.scan() if not slot.kept]:
            if self._stop.is_set() or client is None or time.monotonic() >= deadline:
                log.warning("%d event(s) of job(s) %s not acknowledged by the broker stay in %s; the next "
                            "`mam-runner run` in this workspace sends them", len(pending),
                            ", ".join(sorted({slot.job_id for slot in pending})), box.folder)
                return
            if not said:
                said = True
                log.info("waiting up to %g s for the broker to acknowledge %d unsent event(s) before exiting "
                         "(signal again to exit at once)", FLUSH_S, len(pending))
            if client.connected.is_set():
                box.resend(client, self._record, with_kept=False, stop=self._stop)
            self._stop.wait(FLUSH_LOOK_S)  # a pass that left entries (broker down) waits before the next

    # ------------------------------------------------------------ signals

    def _install_signal_handlers(self) -> dict[int, SignalHandler]:
        if threading.current_thread() is not threading.main_thread():
            return {}
        previous: dict[int, SignalHandler] = {}
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, self.on_signal)
        return previous

    @staticmethod
    def _restore_signal_handlers(previous: dict[int, SignalHandler]) -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    # ------------------------------------------------------------ presence (§7)

    def _closing_once(self) -> bool:
        return self.options.once and self._taken > 0

    def _refused(self, job_id: str, reason: str, text: str, *, tell: bool, level: int = logging.WARNING) -> None:
        """Log a refused dispatch (§5); with `tell`, carry it in a presence published now (§7)."""
        log.log(level, "refused dispatch %s: %s", job_id, text)
        if tell:
            self.presence.note_refusal(job_id, reason, text)
            self._publish_presence()

    def _publish_presence(self, status: str | None = None) -> None:
        """Publish the retained presence; status None = what the daemon is now."""
        assert self.client is not None
        if status is None:
            draining = self._draining.is_set() or self._closing_once() or self.held
            status = PresenceStatus.DRAINING if draining else PresenceStatus.ONLINE
        self._presence_due_at = None
        self.presence.publish(self.client, status, self.running)

    def _running_changed(self) -> None:
        """A job was taken or ended: its presence goes out once the inbox is empty (a burst
        of dispatches is taken first, then said once), at most PRESENCE_COALESCE_S later."""
        if self._presence_due_at is None:
            self._presence_due_at = time.monotonic()

    # ------------------------------------------------------------ jobs

    def _ask_terms(self, job_id: str) -> tuple[int, str]:
        """How long the job's permission requests wait for a person, and what then (§19)."""
        with self._jobs_lock:
            job = self._jobs.get(job_id)
        work = job.work if job is not None else None
        return work.ask_terms() if work is not None else (names.DEFAULT_ASK_TIMEOUT_S, "deny")

    def _tool_rules(self, job_id: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The job's (allow, deny) tool rules, which answer its agent's requests asking nobody (§19)."""
        with self._jobs_lock:
            job = self._jobs.get(job_id)
        work = job.work if job is not None else None
        return (work.allow_tools, work.deny_tools) if work is not None else ((), ())

    def _cancel_one(self, job_id: str, reason: str) -> None:
        with self._jobs_lock:
            job = self._jobs.get(job_id)
        if job is not None and job.request_cancel(reason):
            log.info("job %s: cancelled here: %s", job_id, reason)

    def _cancel_all(self, reason: str) -> None:
        with self._jobs_lock:
            jobs = list(self._jobs.values())
        for job in jobs:
            job.request_cancel(reason)

    def _reap_ended(self) -> None:
        changed = False
        while True:
            try:
                job_id = self._ended.get_nowait()
            except queue.Empty:
                break
            with self._jobs_lock:
                job = self._jobs.pop(job_id, None)
                self._said = {said for said in self._said if said[0] != job_id}
            if self.gpus is not None:
                self.gpus.release(job_id)
            if job is not None and job.thread is not None:
                job.thread.join()
            if self._socket is not None:
                self._socket.drop_asks(job_id, "the job ended before an answer came")
            changed = True
        if changed and self.client is not None and not self._shutdown_done:
            self._running_changed()
            self._retry_pending()

    def _send(self, published: publish.Published) -> None:
        """An agent's event from the local socket, on this daemon's connection (§17)."""
        assert self.client is not None
        if self._shutdown_done and not self.client.connected.is_set():
            return  # stopping without a broker: it stays in the outbox, sent at the next start
        publish.send_on(self.client, published)

    def _record(self, job_id: str) -> JobRecord | None:
        """This host's record of `job_id`, or None."""
        assert self._registry is not None
        return self._registry.find(job_id)

    def _take(self, take: Take) -> None:
        """§11 step 1 here (the slot is taken synchronously); steps 2-5 on the supervisor thread."""
        assert self._registry is not None and self._supervisor is not None
        dispatch, contract = take.dispatch, take.dispatch.contract
        repo = dispatch.work.repo if dispatch.work is not None else None
        if repo is not None and repo not in self._supervisor.mirrors.names:  # §18: the hub matched elsewhere
            self._refused(dispatch.job_id, "repo_not_served", f"repo_not_served: this runner does not serve repo "
                          f"{repo} (start it with --repo {repo}=URL)", tell=True)
            return
        try:
            self._registry.mirror(job_id=dispatch.job_id, session=dispatch.session,
                                  attempt_id=dispatch.attempt_id, dispatch_token=dispatch.dispatch_token,
                                  auth_token=take.auth_token, contract=contract, origin=dispatch.origin,
                                  source="runner")
        except Refusal as exc:  # the registry's §8 rules: the dispatch itself verified
            self._refused(dispatch.job_id, str(exc.reason), f"{exc.reason}: {exc}", tell=True)
            return
        job = Job(job_id=dispatch.job_id, attempt_id=dispatch.attempt_id, dispatch_token=dispatch.dispatch_token,
                  brief=take.brief, heartbeat_s=contract.heartbeat_sec, timeout_s=contract.timeout_sec,
                  lease_s=float(contract.idle_timeout_s), work=dispatch.work)
        if self.gpus is not None:  # §14: admission saw them free, and only this thread takes GPUs
            job.gpus = self.gpus.allocate(job.job_id, dispatch.work.gpus or 0 if dispatch.work else 0) or ()
        with self._jobs_lock:
            self._jobs[job.job_id] = job
        self._taken += 1
        log.info("took job %s attempt %d from %s", job.job_id, job.attempt_id, dispatch.origin)
        self._supervisor.start(job)
        self._running_changed()

    def _adopt_orphan(self, record: JobRecord, orphan: orphans.Orphan, *,
                      cancel_reason: str | None = None) -> None:
        """Hold a slot for the orphan while a thread stops its agent and publishes its end (§6)."""
        assert self._supervisor is not None
        with self._jobs_lock:
            if record["job_id"] in self._jobs:
                return
            job = orphan_job(record, orphan.identity, cancel_reason=cancel_reason)
            self._jobs[job.job_id] = job
        identity = orphan.identity
        where = f"stopping its agent (pid {identity.pid})" if identity is not None else "its agent is unknown"
        log.warning("job %s attempt %d has no supervisor (%s): %s", job.job_id, job.attempt_id, orphan.found_by,
                    where)
        self._supervisor.start(job)
        self._running_changed()  # before the first announce, that `online` says it

    # ------------------------------------------------------------ messages

    def _handle(self, message: Received) -> None:
        parsed = names.parse_job_topic(message.topic, self.config.topic_root)
        if parsed is not None:
            job_id, leaf = parsed
            if leaf == "dispatch":
                self._on_dispatch(job_id, message.topic, message.payload)
            elif leaf == "control":
                self._on_control(job_id, message.payload)
            return
        if message.topic == self._revoked_topic:
            self._on_revoked(message.payload)
            return
        if message.topic == self._drain_topic:
            self._on_drain(message.payload)
            return
        answered = names.parse_answer_topic(message.topic, self.config.topic_root)
        if answered is not None:
            self._on_answer(*answered, message.topic, message.payload)
            return
        if message.topic == self.presence.topic and self.presence.on_message(message.payload, message.retain):
            self._draining.set()

    def _on_revoked(self, payload: bytes) -> None:
        """The hub's revocation notice (§16.7): once verified, take nothing new, stop or let
        finish (`--on-revoke`) the running jobs, and exit 77."""
        if not payload or self.revoked is not None:
            return
        try:
            notice = wire.decode(payload, "revoked")
            hub_key = self.trust.verify_revocation(notice)
        except (DecodeError, SignatureError) as exc:
            log.warning("refused revocation notice for session %s: %s", self.options.session, exc)
            return
        if notice.session != self.options.session:
            log.warning("refused revocation notice: it names session %s, not %s", notice.session,
                        self.options.session)
            return
        self.revoked = notice
        finish = self.options.on_revoke == "finish"
        running = self.running
        what = ("nothing new is taken; running jobs finish, then it exits 77" if finish and running
                else "stopping its running jobs and exiting 77" if running else "exiting 77")
        log.error("runner %s revoked by the hub (key %s) at %s: %s", self.options.session,
                  hub_key[:KEY_SHOWN_CHARS], notice.revoked_at, what)
        self._draining.set()
        if not finish:
            self._stop_reason = REVOKED_REASON
            self._stop.set()

    def _hear_drain(self) -> None:
        """Before the first presence: apply the hub's retained drain order, then subscribe to
        it, so a drained runner that restarts never announces itself `online` (§7)."""
        assert self.client is not None
        try:
            retained = self._retained(self._drain_topic)
            self.client.subscribe([(self._drain_topic, mqtt.QOS_AT_LEAST_ONCE)])
        except BrokerError as exc:  # a runner user from before drains: it serves, undrainable from the hub
            log.warning("a drain by the hub cannot reach this runner: %s; give its broker user the rights of "
                        "`mam-orch runner add` again (docs/security.md)", exc)
            return
        if retained:
            self._on_drain(retained, announce=False)

    def _on_drain(self, payload: bytes, *, announce: bool = True) -> None:
        """The hub's drain order (§7): once verified, hold new dispatches (they wait, like ones
        for a full runner) or take them again; running jobs go on. An order older than the
        one applied is ignored."""
        if not payload:
            return
        try:
            order = wire.decode(payload, "drain")
            self.trust.verify_from_hub(order)
        except (DecodeError, SignatureError) as exc:
            log.warning("refused drain order for session %s: %s", self.options.session, exc)
            return
        if order.session != self.options.session:
            log.warning("refused drain order: it names session %s, not %s", order.session, self.options.session)
            return
        last = self.drain_order
        if last is not None and wire.parse_ts(order.issued_at) < wire.parse_ts(last.issued_at):
            log.warning("ignored drain order of %s: older than the one of %s", order.issued_at, last.issued_at)
            return
        changed = order.draining != self.held
        self.drain_order = order
        if not changed:
            return
        why = f" ({order.reason})" if order.reason else ""
        if order.draining:
            log.warning("runner %s drained by the hub at %s%s: it takes no new job; running jobs go on "
                        "(mam-orch runner undrain %s)", self.options.session, order.issued_at, why,
                        self.options.session)
        else:
            log.info("runner %s undrained by the hub at %s%s: it takes jobs again", self.options.session,
                     order.issued_at, why)
        if announce and self.presence.announced:
            self._publish_presence()
        if not order.draining:
            self._retry_pending()

    def admission_state(self) -> RunnerState:
        """What the §5 checks need to know about this runner now."""
        assert self._registry is not None
        with self._jobs_lock:
            busy = frozenset(self._jobs)
        accepting = not (self._draining.is_set() or self._stop.is_set() or self._closing_once())
        return RunnerState(session=self.options.session, trust=self.trust, clock_skew_s=self.options.clock_skew_s,
                           record_of=self._record, root=self.options.root, busy=busy,
                           max_jobs=self.options.max_jobs, accepting=accepting, tombstones=self.tombstones,
                           gpus_total=self.gpus.total if self.gpus else 0, gpus_free=self.gpus.free if self.gpus else 0,
                           held=self.held)

    def _on_dispatch(self, topic_job_id: str, topic: str, payload: bytes) -> None:
        """§5 checks, then take the job or remember it for a free slot (§11)."""
        verdict = admit_dispatch(topic_job_id, payload, self.admission_state())
        if isinstance(verdict, Take):
            try:  # §17: an attempt runs at most once, whatever the broker forgot
                verdict = check_taken(verdict, self._retained_state(verdict.dispatch.job_id)) or verdict
            except BrokerError as exc:
                log.warning("dispatch %s not taken now: its retained state could not be read (%s); "
                            "it stays retained and comes back after a reconnect", topic_job_id, exc)
                return
        if isinstance(verdict, Take):
            self._pending.pop(topic, None)
            self._take(verdict)
        elif isinstance(verdict, Wait):
            if self.held:
                log.info("dispatch %s waits: the hub drained this runner", verdict.dispatch.job_id)
            else:
                log.info("dispatch %s waits for a free slot (%d/%d busy)", verdict.dispatch.job_id,
                         len(self.running), self.options.max_jobs)
            self._pending[topic] = payload
        elif isinstance(verdict, Refuse):
            self._refused(verdict.job_id, verdict.reason, verdict.text, tell=verdict.reason in TOLD_REFUSALS,
                          level=logging.ERROR if verdict.reason is RefuseReason.HUB_RECORD else logging.WARNING)
            if verdict.forget:
                self._pending.pop(topic, None)
        else:
            if verdict.why:
                log.log(logging.INFO if verdict.notice else logging.DEBUG, "%s", verdict.why)
            if verdict.forget:
                self._pending.pop(topic, None)

    def _retained_state(self, job_id: str) -> bytes | None:
        """The job's retained `state` as the broker holds it now (§17), None when there is none.

        Raises:
            BrokerError: no SUBACK/UNSUBACK within TAKEN_CHECK_WAIT_S.
        """
        return self._retained(names.state_topic(job_id, self.config.topic_root))

    def _retained(self, topic: str) -> bytes | None:
        """The message retained on `topic` as the broker holds it now, None when there is none.

        Subscribe, then unsubscribe, each acknowledged: the broker sends a retained message
        right after the SUBACK, so it is in the inbox once the UNSUBACK arrived. Other
        messages read meanwhile are kept, in order, for the main loop.

        Raises:
            BrokerError: no SUBACK/UNSUBACK within TAKEN_CHECK_WAIT_S.
        """
        assert self.client is not None
        # QoS 0: a read, no session state; nats-server makes a JetStream consumer for every QoS 1
        # subscription (~30 ms a take), QoS 0 answers in well under 1 ms on both brokers
        try:
            self.client.subscribe([(topic, mqtt.QOS_AT_MOST_ONCE)], timeout_s=TAKEN_CHECK_WAIT_S)
            self.client.unsubscribe([topic], timeout_s=TAKEN_CHECK_WAIT_S)
        except BrokerError:
            with contextlib.suppress(BrokerError):  # never left subscribed (nor re-subscribed at reconnect)
                self.client.unsubscribe([topic], timeout_s=TAKEN_CHECK_WAIT_S)
            raise
        found: bytes | None = None
        while True:
            try:
                message = self.client.messages.get_nowait()
            except queue.Empty:
                return found
            if message.topic == topic:
                found = message.payload or None
            else:
                self._deferred.append(message)

    def _retry_pending(self) -> None:
        """A slot freed: re-evaluate the remembered dispatches in arrival order (§11); none while
        the hub holds this runner drained (§7)."""
        if self.held:
            return
        for topic, payload in list(self._pending.items()):
            if len(self.running) >= self.options.max_jobs:
                return
            self._pending.pop(topic, None)
            parsed = names.parse_job_topic(topic, self.config.topic_root)
            if parsed is not None:
                try:
                    self._on_dispatch(parsed[0], topic, payload)
                except Exception as exc:
                    log.error("pending dispatch on %s could not be handled: %s: %s", topic, type(exc).__name__, exc)

    def _verified(self, what: str, job_id: str, payload: bytes) -> wire.Control | None:
        """The hub's verified control on a job's `what` topic (control, answer), else None: a
        cleared topic silently, anything else with `refused <what> <job_id>: <reason>` (§6, §19)."""
        control = check_control(job_id, payload, self.trust)
        if isinstance(control, Refuse):
            log.warning("refused %s %s: %s", what, job_id, control.text)
        return control if isinstance(control, wire.Control) else None

    def _on_control(self, job_id: str, payload: bytes) -> None:
        """§6: a signed cancel for the attempt held here stops its agent."""
        control = self._verified("control", job_id, payload)
        if control is None:
            return
        if control.action != ControlAction.CANCEL:
            log.warning("refused control %s: %s on the control topic (answers have their own, §19)",
                        job_id, control.action)
            return
        self.tombstones.remember(job_id, control.attempt_id)
        with self._jobs_lock:
            job = self._jobs.get(job_id)
        if job is not None:
            if control.attempt_id != job.attempt_id:
                log.info("ignored cancel of job %s attempt %d: this runner holds attempt %d", job_id,
                         control.attempt_id, job.attempt_id)
            elif not job.cancel.is_set():
                log.info("cancel of job %s attempt %d (%s)", job_id, control.attempt_id, control.reason)
                job.request_cancel(control.reason)
            return
        self._drop_pending_for(job_id, control.attempt_id)
        self._cancel_unsupervised(job_id, control.attempt_id)

    def _on_answer(self, job_id: str, request_id: str, topic: str, payload: bytes) -> None:
        """§19: the hub's signed allow or deny of a permission request goes to the agent waiting
        for it; the retained answer is then cleared. Anything else is refused with a reason."""
        control = self._verified("answer", job_id, payload)
        if control is None:
            return
        if control.action == ControlAction.SAY and control.request_id == request_id:
            self._on_say(job_id, request_id, topic, control)
            return
        if control.action == ControlAction.CANCEL or control.request_id != request_id:
            log.warning("refused answer %s: %s", job_id, "a cancel is no answer" if control.action ==
                        ControlAction.CANCEL else f"request {control.request_id} does not match the topic")
            return
        if self._socket is None:
            return
        waiting = self._socket.waiting(job_id)
        if request_id not in waiting:
            # a retained answer this runner delivered before, or another runner's: nothing to do
            log.debug("answer %s of job %s: no such request waits here", request_id, job_id)
            return
        message = self._opened("answer", job_id, control)
        if message is None:
            return
        refused = self._socket.answer(job_id, control.attempt_id, request_id,
                                      allow=control.action == ControlAction.ALLOW, message=message,
                                      always=control.always is True)
        if refused is not None:
            log.warning("refused answer %s: %s", job_id, refused)
            return
        log.info("job %s request %s: %s", job_id, request_id,
                 "allowed" if control.action == ControlAction.ALLOW else "denied")
        try:
            assert self.client is not None
            self.client.publish(topic, b"", retain=True)  # delivered: clear it (§2)
        except BrokerError as exc:
            log.info("answer %s of job %s not cleared: %s", request_id, job_id, exc)

    def _opened(self, what: str, job_id: str, control: wire.Control) -> str | None:
        """The message of the hub's answer or say `control`, opened with the key of the attempt
        this runner holds (§19: sealed to it); None, logged `refused <what> ...`, when it is
        another attempt's or does not open."""
        record = self._record(job_id)
        try:
            if record is None or record["attempt_id"] != control.attempt_id:
                raise SignatureError("not this runner's attempt")
            return crypto.open_answer(record["auth_token"], control)
        except SignatureError as exc:
            log.warning("refused %s %s: its message does not open with attempt %d's key (%s)", what, job_id,
                        control.attempt_id, exc)
            return None

    def _on_say(self, job_id: str, message_id: str, topic: str, control: wire.Control) -> None:
        """§18 "Input while it runs": a person's verified message to the attempt held here goes
        to its running agent's stdin, once; a `progress` event tells the hub whether it was
        delivered, and the retained message is cleared. Another runner's is ignored."""
        with self._jobs_lock:
            job = self._jobs.get(job_id)
            handled = (job_id, message_id) in self._said
        if job is None or job.orphan or handled:
            log.debug("message %s of job %s: no agent of it runs here, or it was delivered", message_id, job_id)
            return
        words = self._opened("say", job_id, control)
        if words is None:
            return
        with self._jobs_lock:
            self._said.add((job_id, message_id))
        tell = job.tell
        delivered = tell is not None and tell(words)
        detail = f"message {message_id} " + ("delivered to the agent" if delivered else "not delivered: " + (
            "the agent takes no input while it runs" if tell is None else "the agent finished its turn"))
        log.info("job %s: %s", job_id, detail)
        try:
            assert self._registry is not None and self.client is not None
            event = publish.make_request(job_id, "progress", detail,
                                         json.dumps({"message_id": message_id, "delivered": delivered}),
                                         job.attempt_id, job.dispatch_token)
            self._send(publish.record(self._registry, event))
            self.client.publish(topic, b"", retain=True)  # handled: clear it (§2)
        except (MamError, OSError) as exc:  # the job ended meanwhile: the hub learns no more of it
            log.info("job %s: message %s: %s", job_id, message_id, exc)

    def _drop_pending_for(self, job_id: str, attempt_id: int) -> None:
        topic = names.dispatch_topic(job_id, self.config.topic_root)
        payload = self._pending.get(topic)
        if payload is None:
            return
        waiting = waiting_attempt(payload)
        if waiting is None:
            self._pending.pop(topic, None)
        elif waiting <= attempt_id:
            self._pending.pop(topic, None)
            log.info("dropped waiting dispatch %s: cancelled", job_id)

    def _cancel_unsupervised(self, job_id: str, attempt_id: int) -> None:
        """A cancel for a job this process does not supervise (§6): unknown and
        finished jobs, other attempts, hub records and jobs of another live runner
        are ignored; a non-terminal record of that attempt left by a runner that
        died is adopted as an orphan: its agent tree is stopped, then
        `error`/`cancelled` is published and the record marked `cancelled`."""
        assert self._registry is not None
        record = self._record(job_id)
        if record is None:
            log.debug("ignored cancel of unknown job %s", job_id)
            return
        if (record["attempt_id"] != attempt_id or record["status"] in TERMINAL_STATUSES
                or record.get("role") != "runner"):
            log.debug("ignored cancel of job %s attempt %d (record: attempt %d, %s, role %s)", job_id, attempt_id,
                      record["attempt_id"], record["status"], record.get("role"))
            return
        orphan = orphans.find_orphan(self._registry, record, runner_id=self.runner_id,
                                     session=self.options.session, any_session=True)
        if orphan is not None:
            self._adopt_orphan(record, orphan, cancel_reason="cancel")


def run_cli(*, session: str | None, exec_cmd: str, workspace: str | None, workdir: str | None, max_jobs: int,
            once: bool, replace: bool, labels: str | None = None, repos: list[str] | None = None,
            max_result_bytes: int = DEFAULT_MAX_RESULT_BYTES,
            keep_worktrees: bool = False, agent: str | None = None, on_revoke: str = "stop",
            gpus: str | None = None) -> int:
    """`mam-runner run`: validate, resolve config and keys, serve; returns the exit code (0 clean exit).

    Raises:
        UsageError / ConfigError (exit 64), EnvFileError (1), RegistryError (1: the workspace's
        `.mam/` cannot be written), BrokerUnavailable (3).
    """
    options = options_from_cli(session=session, exec_cmd=exec_cmd, workspace=workspace, workdir=workdir,
                               max_jobs=max_jobs, once=once, replace=replace, labels=labels, repos=repos,
                               max_result_bytes=max_result_bytes, keep_worktrees=keep_worktrees, agent=agent,
                               on_revoke=on_revoke, gpus=gpus)
    hub_trust = trust.load(options.root)  # before anything talks to the network (§5, §16.1)
    cfg = shared_config.broker_config(workspace=options.root)
    return Runner(options, config=cfg, trust=hub_trust).serve()


__all__ = ["Runner", "run_cli"]
