"""The runner daemon of `mam-runner run` (PROTOCOL §5, §6, §7, §11, §12).

One process per worker host and session. It keeps ONE persistent MQTT
connection (`mam.shared.mqtt.MqttClient`) whose Last Will is a signed,
retained `offline` presence (pre-signed at connect, §7), and on it:

- reads the retained presence of its own session first and refuses to start
  (exit 64) when another live runner id is `online`/`draining` there, unless
  `--replace` (§7). It waits up to `presence_wait_s` (default 1 s) for that
  retained message. When a runner dies (crash, `kill -9`) its kernel closes
  the TCP connection and the broker publishes the Last Will (`offline`) at
  once; when its host dies or is cut off the network, the presence stays
  `online` until the broker notices the dead connection, i.e. after
  keepalive × 1.5 (MQTT_KEEPALIVE, default 60 s → 90 s). Until then start the
  new runner with `--replace`; the replaced runner, if it is still alive,
  sees the new presence, drains and stops publishing presence;
- publishes presence `online` (retained) and republishes it whenever its
  running set changes, `draining` on the first SIGTERM/SIGINT, `offline` on
  a clean exit (a clean DISCONNECT discards the Last Will, so it is published
  explicitly first);
- subscribes to `ROOT/jobs/+/dispatch` and `ROOT/jobs/+/control`; paho's
  thread only fills `client.messages`, which the main loop consumes.

Dispatch checks (§5), each refusal one line on stderr, never fatal:
zero-length → ignored silently; undecodable or a topic that names another
job → `malformed`; bad `sig`; another `session` → ignored silently (debug);
`expires_at` more than MAM_CLOCK_SKEW_S (default 30 s) in the past →
`expired`; an attempt this host already took, or a terminal record of that
attempt → `replayed` (retained dispatches come back on every re-subscribe and
reconnect: a job never runs twice); an attempt a verified cancel named
(a tombstone, see Cancel below) → `cancelled`; a seal that does not open.

A valid dispatch with a free slot is taken (§11): mirrored into this host's
registry (status `pending`), the retained dispatch cleared, `started` (seq 1)
published on the daemon's connection, the §12 heartbeat timer started
watching the daemon's pid (the supervisor lives in the daemon: a `kill -9` of
the runner stops the beats within one period), and the agent run by
`runner.supervisor.AgentProcess` on a supervisor thread. When the agent ends
the thread stops whatever remains of its tree (a background child, the
children of a leader killed by a signal: `AgentProcess.stop_leftovers`,
SIGTERM then SIGKILL after MAM_CANCEL_GRACE_S, only processes proven the
agent's, as for an orphan), logs how many, and only then publishes
`completed` or `error` (`data.exit_code`) unless the agent already published
a terminal event itself. With every slot busy a
dispatch stays retained (neither mirrored nor cleared) and is re-evaluated,
expiry included, when a slot frees.

Wall clock (§5 `timeout_sec`): the runner enforces the contract's budget
itself, so an agent never outlives it while the hub is away: once the agent
has run `timeout_sec` seconds (measured from its start on this host), its
tree is stopped like a cancel and `error` with detail `timed out after N s`
is published (record `error`; `data.exit_code` is the stopped agent's, e.g.
143 after SIGTERM or 137 after SIGKILL, as for a cancel).

Cancel (§6): a signed control for the attempt a supervisor holds makes that
thread stop the agent (`AgentProcess.cancel(grace_s=MAM_CANCEL_GRACE_S)`,
default 10 s) and publish `error` with detail `cancelled`, marking the record
`cancelled`; the main loop never blocks on it. Controls for unknown or
finished jobs stop nothing (they are retained and come back after reconnects),
but every verified cancel is kept as a tombstone (job id → highest cancelled
attempt, at most MAX_CANCEL_TOMBSTONES = 100,000, oldest dropped): a dispatch
of that attempt or an earlier one is refused (`refused dispatch <id>:
cancelled: attempt N was cancelled by the hub`), so a captured dispatch
re-published after the hub's cancel never runs. The control filter is
subscribed first (its own SUBACK), then the dispatch filter, so retained
cancels normally arrive before retained dispatches; a cancel that still
arrives after its dispatch was taken stops the job as usual.

How the agent's `$MAM_PUBLISH_CMD` finds the broker: `agent_env` strips
MQTT_PASSWORD and MAM_DISPATCH_SECRET from the agent's environment, so the
daemon writes a per-job env file (0600) `<root>/.mam/logs/<job_id>/broker.env`
holding the resolved MQTT_* settings and MAM_TOPIC_ROOT — never the
dispatch secret — and sets MAM_ENV_FILE to it for the agent (§13: that file
alone is read). The file is removed when the job ends. This is defence in
depth, not a sandbox: an agent running under the runner's uid can read the
runner's own files.

Orphans of a dead runner (§6, §11): a runner killed with `kill -9` leaves
its agent running (own session, reparented to init). So the supervisor
thread records, before `started` and again once the agent runs,
`<root>/.mam/logs/<job_id>/agent.pid` (0600, atomic): the attempt, the
runner's pid, create time and id, and the agent's `AgentIdentity` (pid,
create time, process group, `MAM_AGENT_TAG`); it is removed when the job
ends. At start (after the §7 session check, before subscribing) the daemon
looks at every `pending`/`running` record of role `runner`: one whose
runner process is gone (pid + create time) is an orphan. Its agent tree is
stopped like a cancel (`supervisor.stop_orphan`: SIGTERM to the group,
SIGKILL of the survivors after MAM_CANCEL_GRACE_S) on a thread that holds a
slot, and only then is the terminal event published: `error`/`cancelled`
(record `cancelled`) if a cancel for that attempt arrived meanwhile (the
hub's retained cancel is delivered right after the subscription), else
`error` with detail `runner restarted; agent stopped` (or `...; agent
lost` when nothing of it ran any more, or no identity was recorded; record
`error`, `data.exit_code` absent). broker.env and agent.pid are removed. A
record whose runner still lives (another runner sharing the workspace, or
one draining after `--replace`) is left to it. A record without agent.pid
is an orphan only for this runner's session (§7: no other live runner holds
it) or when a cancel names it. Limits: a runner killed in the instant between
starting the agent and recording its identity leaves an agent nobody finds;
a descendant that escapes the group AND scrubs `MAM_AGENT_TAG` is not found.
PR_SET_PDEATHSIG is not used: it needs `preexec_fn`, unsafe in this
multi-threaded process, it fires when the forking supervisor *thread* exits,
and reaches only the agent, not its tree.

The hub's registry is not a runner's (§8: each host keeps its own): a runner
whose root holds records of role `hub` (hub and runner started in the same
repository without `--workspace`) refuses to start (exit 64, one line);
a dispatch whose job id is a hub record here is refused with one error line
(never mirrored over the hub's record).
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mam.shared import names
from mam.shared.errors import (
    BrokerError,
    DecodeError,
    ExitCode,
    MamError,
    RegistryError,
    SignatureError,
    TransitionRefused,
    UsageError,
)

log = logging.getLogger("mam.daemon")

MAX_JOBS_LIMIT = 64
DEFAULT_CANCEL_GRACE_S = 10.0
DEFAULT_CLOCK_SKEW_S = 30.0
DEFAULT_PRESENCE_WAIT_S = 1.0
LOOP_POLL_S = 0.1
# Presence is republished at least this often, so the hub can tell a live runner from a
# replayed or long-dead `online` (§7); the hub calls presence older than 3 periods stale.
PRESENCE_REFRESH_S = 60.0
# An agent that published its own terminal event (§11 step 5) may take this long to exit
# before the runner stops it: the job is over, and its slot must come back.
DEFAULT_AGENT_LINGER_S = 30.0
RECORD_CHECK_S = 0.5
AGENT_FILE = "agent.pid"
"""Per-job file (in the job's log folder) naming the runner and agent of the attempt."""
AGENT_FILE_MAX_BYTES = 4096
MAX_CANCEL_TOMBSTONES = 100_000
"""Verified cancels remembered per job id (highest attempt), oldest dropped first."""
DETAIL_AGENT_STOPPED = "runner restarted; agent stopped"
DETAIL_AGENT_LOST = "runner restarted; agent lost"


class SessionBusy(UsageError):
    """Another live runner holds this session (§7); exit 64 unless `--replace`."""


class HubRegistry(UsageError):
    """The runner's registry root is a hub's (§8: each host keeps its own); exit 64."""


@dataclass(frozen=True)
class RunnerOptions:
    """What `mam-runner run` was asked to do (validated by `options_from_cli`).

    Attributes:
        session: the runner's session name (§1).
        argv: the agent command (`split_exec` output).
        root: the registry root (§8).
        workdir: the agents' working directory; None = `<root>/work/<job_id>/`.
        max_jobs: concurrent jobs, 1..64 (§11).
        once: exit after one job.
        replace: start even if another runner is live under the session (§7).
        cancel_grace_s: seconds between SIGTERM and SIGKILL on cancel (§6).
        clock_skew_s: tolerance on `expires_at`, seconds (§5).
        presence_wait_s: how long to wait for the session's retained presence at start.
        presence_refresh_s: republish presence at least this often (§7; hub: stale after 3 periods).
        agent_linger_s: how long an agent may run on after publishing its own terminal event.
    """

    session: str
    argv: tuple[str, ...]
    root: Path
    workdir: Path | None = None
    max_jobs: int = 1
    once: bool = False
    replace: bool = False
    cancel_grace_s: float = DEFAULT_CANCEL_GRACE_S
    clock_skew_s: float = DEFAULT_CLOCK_SKEW_S
    presence_wait_s: float = DEFAULT_PRESENCE_WAIT_S
    presence_refresh_s: float = PRESENCE_REFRESH_S
    agent_linger_s: float = DEFAULT_AGENT_LINGER_S


def options_from_cli(*, session: str, exec_cmd: str, workspace: str | None, workdir: str | None,
                     max_jobs: int, once: bool, replace: bool,
                     environ: Mapping[str, str] | None = None) -> RunnerOptions:
    """Validate `mam-runner run` arguments before any network or registry write.

    Args:
        session: session name; exec_cmd: the `--exec` string; workspace: `--workspace`;
        workdir: `--workdir` (created if missing); max_jobs: 1..64.
        environ: the process environment (default os.environ).
    Returns:
        RunnerOptions.
    Raises:
        UsageError: one line naming the bad argument (exit 64).
        ConfigError: MAM_CANCEL_GRACE_S / MAM_CLOCK_SKEW_S out of range.
    """
    from mam.runner.supervisor import resolve_executable, split_exec
    from mam.shared import config

    env = os.environ if environ is None else environ
    names.validate_session(session)
    argv = split_exec(exec_cmd)
    resolve_executable(argv[0], env.get("PATH"))
    if isinstance(max_jobs, bool) or not isinstance(max_jobs, int) or not 1 <= max_jobs <= MAX_JOBS_LIMIT:
        raise UsageError(f"--max-jobs {max_jobs!r} is invalid: expected 1..{MAX_JOBS_LIMIT}")
    root = config.resolve_root(workspace, env)
    work: Path | None = None
    if workdir is not None:
        if not workdir.strip():
            raise UsageError("--workdir is empty: give a directory")
        work = Path(workdir).expanduser().absolute()
        try:
            work.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UsageError(f"--workdir {workdir!r} cannot be created: {exc.strerror or exc}") from None
        if not work.is_dir():
            raise UsageError(f"--workdir {workdir!r} is not a directory")
    grace = config.env_float("MAM_CANCEL_GRACE_S", DEFAULT_CANCEL_GRACE_S, environ=env, high=3600.0)
    skew = config.env_float("MAM_CLOCK_SKEW_S", DEFAULT_CLOCK_SKEW_S, environ=env, high=86400.0)
    wait = config.env_float("MAM_PRESENCE_WAIT_S", DEFAULT_PRESENCE_WAIT_S, environ=env, high=60.0)
    refresh = config.env_float("MAM_PRESENCE_REFRESH_S", PRESENCE_REFRESH_S, environ=env, low=1.0, high=60.0)
    linger = config.env_float("MAM_AGENT_LINGER_S", DEFAULT_AGENT_LINGER_S, environ=env, high=86400.0)
    return RunnerOptions(session=session, argv=tuple(argv), root=root, workdir=work, max_jobs=max_jobs,
                         once=once, replace=replace, cancel_grace_s=grace, clock_skew_s=skew,
                         presence_wait_s=wait, presence_refresh_s=refresh, agent_linger_s=linger)


@dataclass
class _Job:
    """One taken job and its supervisor thread."""

    job_id: str
    attempt_id: int
    dispatch_token: str
    brief: str
    heartbeat_s: int
    timeout_s: int
    cancel: threading.Event = field(default_factory=threading.Event)
    cancel_reason: str = ""
    thread: threading.Thread | None = None
    orphan: bool = False  # left by a dead runner: stop its agent, publish, never run anything
    identity: Any = None  # the orphan's AgentIdentity, None when unknown


class Runner:
    """The runner daemon (§7, §11). Lifecycle like Temporal's worker / arq:

        runner = Runner(options, config=broker_config, keys=dispatch_keys)
        code = runner.serve()      # blocks; refuses to run twice
        runner.drain()             # = first SIGTERM: take nothing new, finish, exit
        runner.shutdown()          # stop now: cancel running jobs, exit (idempotent)

    The constructor has no side effects: no connection, no files, no signal
    handlers. `serve()` installs SIGTERM/SIGINT handlers when it runs on the
    main thread and restores the previous ones when it returns.

    Args:
        options: validated `RunnerOptions`.
        config: the BrokerConfig of this host (§13).
        keys: `DispatchKeys` from MAM_DISPATCH_SECRET (§5).
        environ: the environment agents inherit (default os.environ).
    """

    def __init__(self, options: RunnerOptions, *, config: Any, keys: Any,
                 environ: Mapping[str, str] | None = None) -> None:
        self.options = options
        self.config = config
        self.keys = keys
        self.environ = environ
        self.runner_id = names.new_runner_id()
        self.client: Any = None
        self._registry: Any = None
        self._jobs: dict[str, _Job] = {}
        self._jobs_lock = threading.Lock()
        self._pending: dict[str, bytes] = {}  # dispatch topic -> payload waiting for a slot
        # job id -> highest attempt a verified cancel named, known job or not (replay defence)
        self._cancelled: OrderedDict[str, int] = OrderedDict()
        self._ended: queue.Queue[str] = queue.Queue()  # job ids whose supervisor finished
        self._taken = 0
        self._draining = threading.Event()
        self._stop = threading.Event()  # second signal / shutdown(): cancel jobs and exit
        self._stopped = threading.Event()
        self._served = False
        self._serve_lock = threading.Lock()
        self._signals = 0
        self._presence_status = ""
        self._shutdown_done = False
        self._announced = False  # published `online`: only then may we publish `offline`
        self._presence_at = 0.0  # monotonic time of the last presence published
        self._replaced = False  # another runner took the session over (§7 --replace)
        self._serve_thread: threading.Thread | None = None

    # ------------------------------------------------------------ public API

    @property
    def running(self) -> list[str]:
        """Job ids of the jobs in progress (sorted)."""
        with self._jobs_lock:
            return sorted(self._jobs)

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
        if self._served and threading.current_thread() is not self._serve_thread:
            self._stopped.wait(timeout_s)

    def serve(self) -> int:
        """Connect, check the session, announce presence, take and run jobs
        until drained, stopped or (`once`) one job ended.

        Returns:
            0 on a clean exit.
        Raises:
            SessionBusy: another live runner holds the session (exit 64; §7).
            HubRegistry: the registry root holds hub records (exit 64; §8).
            BrokerUnavailable: no broker accepted the connection (exit 3).
            MamError: `serve()` was already called on this Runner.
        """
        from mam.shared.registry import Registry

        with self._serve_lock:
            if self._served:
                raise MamError("Runner.serve() was already called: a Runner serves once")
            self._served = True
        self._serve_thread = threading.current_thread()
        self._registry = Registry(self.options.root)
        try:
            self._check_not_hub_registry()  # before any connection, handler or log line
        except BaseException:  # HubRegistry, or a registry that cannot be listed
            self._shutdown_done = True
            self._stopped.set()
            raise
        previous = self._install_signal_handlers()
        try:
            self._start()
            self._loop()
            return ExitCode.OK
        finally:
            try:
                self._finish()
            finally:
                self._restore_signal_handlers(previous)
                self._stopped.set()

    # ------------------------------------------------------------ signals

    def _on_signal(self, signum: int, frame: Any) -> None:
        self._signals += 1
        if self._signals == 1:
            log.info("signal %d: draining (running jobs finish, nothing new is taken; "
                     "signal again to cancel them)", signum)
            self._draining.set()
        else:
            log.info("signal %d again: cancelling running jobs and exiting", signum)
            self._stop.set()

    def _install_signal_handlers(self) -> dict[int, Any]:
        if threading.current_thread() is not threading.main_thread():
            return {}
        previous = {}
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, self._on_signal)
        return previous

    @staticmethod
    def _restore_signal_handlers(previous: dict[int, Any]) -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    # ------------------------------------------------------------ presence (§7)

    def _presence(self, status: str) -> bytes:
        from mam.shared import __version__, crypto, wire

        presence = wire.Presence.build(self.options.session, self.runner_id, status,
                                       host=(socket.gethostname() or "unknown")[:255], version=__version__,
                                       max_jobs=self.options.max_jobs, running=self.running)
        return wire.encode(crypto.sign(presence.to_dict(), self.keys.sign_key))

    def _presence_topic(self) -> str:
        return names.presence_topic(self.options.session, self.config.topic_root)

    def _publish_presence(self, status: str | None = None) -> None:
        """Publish the retained presence; status None = what the daemon is now."""
        if self._replaced:
            return
        if status is None:
            status = "draining" if self._draining.is_set() or self._closing_once() else "online"
        if not self.client.connected.is_set():
            # no PUBACK wait while the broker is away: presence is republished on reconnect
            log.info("presence %s not published: not connected", status)
            return
        try:
            self.client.publish(self._presence_topic(), self._presence(status), retain=True)
            self._presence_status = status
            self._announced = True
            self._presence_at = time.monotonic()
        except BrokerError as exc:
            log.warning("presence %s not published: %s", status, exc)

    def _closing_once(self) -> bool:
        return self.options.once and self._taken > 0

    def _check_session_free(self) -> None:
        """§7: refuse to start when another live runner id holds the session."""
        from mam.shared import crypto, wire

        topic = self._presence_topic()
        self.client.subscribe([(topic, 1)])
        # Brokers send a topic's retained message right after the SUBACK; none within
        # the wait means nobody ever announced this session (or its presence was cleared).
        deadline = time.monotonic() + self.options.presence_wait_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            try:
                message = self.client.messages.get(timeout=remaining)
            except queue.Empty:
                return
            if message.topic != topic:
                continue  # nothing else is subscribed yet
            if not message.payload:
                return
            try:
                presence = wire.decode(message.payload, "presence")
                crypto.verify(presence, self.keys.sign_key)
            except (DecodeError, SignatureError) as exc:
                log.warning("ignoring the retained presence of session %s: %s", self.options.session, exc)
                return
            if presence.runner_id == self.runner_id or presence.status == "offline":
                return
            if self.options.replace:
                log.warning("session %s: replacing runner %s on %s (%s; --replace)", self.options.session,
                            presence.runner_id, presence.host, presence.status)
                return
            raise SessionBusy(
                f"session {self.options.session!r} is held by another live runner ({presence.runner_id} on "
                f"{presence.host}, {presence.status} since {presence.timestamp}); stop it first, or start "
                "with --replace if it is gone (a killed runner stays 'online' until the broker notices, "
                "keepalive x 1.5)")

    # ------------------------------------------------------------ lifecycle internals

    def _start(self) -> None:
        from mam.shared import mqtt
        will = (self._presence_topic(), self._presence("offline"), mqtt.QOS_AT_LEAST_ONCE, True)
        self.client = mqtt.MqttClient(self.config, "runner", will=will)
        self.client.connect()
        self._check_session_free()
        # Before subscribing: a retained cancel for an orphan then finds it adopted (in `_jobs`).
        self._recover_orphans()
        # Subscribe before announcing `online`: a hub that sees us online may publish at once,
        # and a dispatch published then must reach us live, not only through the retained copy.
        # Controls first, each filter with its own SUBACK: retained cancels are then normally
        # queued before retained dispatches, so a replayed dispatch of a cancelled attempt is refused.
        self.client.subscribe([(names.all_controls_filter(self.config.topic_root), 1)])
        self.client.subscribe([(names.all_dispatches_filter(self.config.topic_root), 1)])
        self._publish_presence("online")
        log.info("runner %s serving session %s (max %d job(s)) on %s:%d", self.runner_id,
                 self.options.session, self.options.max_jobs, self.client.host, self.config.port)

    def _loop(self) -> None:
        announced_drain = False
        while True:
            if self._stop.is_set():
                self._cancel_all("runner_shutdown")
                if not self.running:
                    return
            if self._draining.is_set() and not announced_drain:
                announced_drain = True
                self._pending.clear()
                self._publish_presence("draining")
            if (self._draining.is_set() or self._closing_once()) and not self.running:
                return
            if self.client.reconnected.is_set():  # the broker may have published our Last Will
                self.client.reconnected.clear()
                self._publish_presence()
            elif self._announced and time.monotonic() - self._presence_at >= self.options.presence_refresh_s:
                self._publish_presence()  # refresh: a fresh timestamp says we are alive (§7)
            self._reap_ended()
            try:
                message = self.client.messages.get(timeout=LOOP_POLL_S)
            except queue.Empty:
                continue
            try:
                self._handle(message)
            except Exception as exc:  # a daemon never dies on a bad message
                log.error("message on %s could not be handled: %s: %s", message.topic, type(exc).__name__, exc)
                log.debug("traceback", exc_info=True)

    def _finish(self) -> None:
        if self._shutdown_done:
            return
        self._shutdown_done = True
        self._draining.set()
        self._cancel_all("runner_shutdown")
        for job in list(self._jobs.values()):
            if job.thread is not None:
                job.thread.join()
        self._reap_ended()
        if self.client is not None:
            if self._announced and self.client.connected.is_set():
                self._publish_presence("offline")
            self.client.close()
        log.info("runner %s stopped", self.runner_id)

    def _cancel_all(self, reason: str) -> None:
        with self._jobs_lock:
            jobs = list(self._jobs.values())
        for job in jobs:
            if not job.cancel.is_set():
                job.cancel_reason = reason
                job.cancel.set()

    def _reap_ended(self) -> None:
        changed = False
        while True:
            try:
                job_id = self._ended.get_nowait()
            except queue.Empty:
                break
            with self._jobs_lock:
                job = self._jobs.pop(job_id, None)
            if job is not None and job.thread is not None:
                job.thread.join()
            changed = True
        if changed and self.client is not None and not self._shutdown_done:
            self._publish_presence()
            self._retry_pending()

    # ------------------------------------------------------------ messages

    def _handle(self, message: Any) -> None:
        parsed = names.parse_job_topic(message.topic, self.config.topic_root)
        if parsed is not None:
            job_id, leaf = parsed
            if leaf == "dispatch":
                self._on_dispatch(job_id, message.topic, message.payload)
            elif leaf == "control":
                self._on_control(job_id, message.payload)
            return
        if message.topic == self._presence_topic():
            self._on_presence(message.payload, message.retain)

    def _on_presence(self, payload: bytes, retained: bool) -> None:
        """Another runner announcing itself live under our session replaced us (its
        `--replace`, §7): drain, and publish no presence any more (not even `offline`,
        which would hide the new runner). Retained copies are re-deliveries, not news."""
        from mam.shared import crypto, wire

        if not payload:
            return
        try:
            presence = wire.decode(payload, "presence")
            crypto.verify(presence, self.keys.sign_key)
        except (DecodeError, SignatureError) as exc:
            log.warning("refused presence on session %s: %s", self.options.session, exc)
            return
        if presence.runner_id == self.runner_id or presence.status == "offline" or retained:
            return
        if not self._replaced:
            log.warning("session %s: another runner %s on %s took over this session (--replace): draining, "
                        "presence left to it", self.options.session, presence.runner_id, presence.host)
        self._replaced = True
        self._draining.set()

    def _refuse(self, what: str, reason: str) -> None:
        log.warning("refused dispatch %s: %s", what, reason)

    def _on_dispatch(self, topic_job_id: str, topic: str, payload: bytes) -> None:
        """§5 checks, then take the job or remember it for a free slot (§11)."""
        from mam.shared import crypto, wire

        if not payload:  # a cleared dispatch (§2)
            self._pending.pop(topic, None)
            return
        try:
            dispatch = wire.decode(payload, "dispatch")
        except DecodeError as exc:
            self._refuse(topic_job_id, exc.reason if exc.reason.startswith("malformed")
                         else f"malformed: {exc.reason}")
            return
        job_id = dispatch.job_id
        if job_id != topic_job_id:
            self._refuse(topic_job_id, f"malformed: job_id {job_id} does not match the topic")
            return
        try:
            crypto.verify(dispatch, self.keys.sign_key)
        except SignatureError as exc:
            self._refuse(job_id, str(exc))
            return
        if dispatch.session != self.options.session:
            log.debug("dispatch %s is for session %s, not ours", job_id, dispatch.session)
            return
        local = self._record(job_id)
        if local is not None and local.get("role") != "runner":
            log.error("refused dispatch %s: %s", job_id, self._hub_registry_message(job_id))
            self._pending.pop(topic, None)
            return
        if dispatch.expired(skew_s=self.options.clock_skew_s):
            self._refuse(job_id, f"expired: expires_at {dispatch.expires_at} is more than "
                                 f"{self.options.clock_skew_s:g} s in the past")
            self._pending.pop(topic, None)
            return
        held = self._held_attempt(job_id)
        if held is not None and dispatch.attempt_id <= held[0]:
            self._refuse(job_id, f"replayed: attempt {dispatch.attempt_id} already taken by this host "
                                 f"(holds attempt {held[0]}, {held[1]})")
            self._pending.pop(topic, None)
            return
        cancelled = self._cancelled.get(job_id)
        if cancelled is not None and dispatch.attempt_id <= cancelled:
            self._refuse(job_id, f"cancelled: attempt {cancelled} was cancelled by the hub")
            self._pending.pop(topic, None)
            return
        try:
            auth_token, brief = crypto.open_sealed(self.keys.seal_key, dispatch.sealed, job_id=job_id,
                                                   attempt_id=dispatch.attempt_id,
                                                   dispatch_token=dispatch.dispatch_token)
        except SignatureError as exc:
            self._refuse(job_id, str(exc))
            return
        if self._draining.is_set() or self._stop.is_set() or self._closing_once():
            log.info("dispatch %s left retained: this runner is draining", job_id)
            return
        with self._jobs_lock:
            full = len(self._jobs) >= self.options.max_jobs or job_id in self._jobs
        if full:
            log.info("dispatch %s waits for a free slot (%d/%d busy)", job_id, len(self._jobs),
                     self.options.max_jobs)
            self._pending[topic] = payload
            return
        self._pending.pop(topic, None)
        self._take(dispatch, auth_token, brief)

    def _record(self, job_id: str) -> dict[str, Any] | None:
        """This host's record of `job_id`, or None."""
        from mam.shared.registry import JobNotFound

        try:
            return self._registry.get(job_id)
        except JobNotFound:
            return None

    def _held_attempt(self, job_id: str) -> tuple[int, str] | None:
        """(attempt, status) of this host's record of `job_id`, or None."""
        record = self._record(job_id)
        return None if record is None else (record["attempt_id"], record["status"])

    def _retry_pending(self) -> None:
        """A slot freed: re-evaluate the remembered dispatches in arrival order (§11)."""
        for topic, payload in list(self._pending.items()):
            with self._jobs_lock:
                if len(self._jobs) >= self.options.max_jobs:
                    return
            self._pending.pop(topic, None)
            parsed = names.parse_job_topic(topic, self.config.topic_root)
            if parsed is not None:
                try:
                    self._on_dispatch(parsed[0], topic, payload)
                except Exception as exc:
                    log.error("pending dispatch on %s could not be handled: %s: %s", topic, type(exc).__name__, exc)

    def _take(self, dispatch: Any, auth_token: str, brief: str) -> None:
        """§11 step 1 here (the slot is taken synchronously); steps 2-5 on the supervisor thread."""
        from mam.shared.registry import Refusal

        contract = dispatch.contract
        try:
            self._registry.mirror(job_id=dispatch.job_id, session=dispatch.session,
                                  attempt_id=dispatch.attempt_id, dispatch_token=dispatch.dispatch_token,
                                  auth_token=auth_token, contract=contract, origin=dispatch.origin,
                                  source="runner")
        except Refusal as exc:
            self._refuse(dispatch.job_id, f"{exc.reason}: {exc}")
            return
        job = _Job(job_id=dispatch.job_id, attempt_id=dispatch.attempt_id,
                   dispatch_token=dispatch.dispatch_token, brief=brief,
                   heartbeat_s=contract.heartbeat_sec, timeout_s=contract.timeout_sec)
        job.thread = threading.Thread(target=self._supervise, args=(job,), name=f"supervisor-{job.job_id}",
                                      daemon=True)
        with self._jobs_lock:
            self._jobs[job.job_id] = job
        self._taken += 1
        log.info("took job %s attempt %d from %s", job.job_id, job.attempt_id, dispatch.origin)
        job.thread.start()
        self._publish_presence()

    def _on_control(self, job_id: str, payload: bytes) -> None:
        """§6: a signed cancel for the attempt held here stops its agent."""
        from mam.shared import crypto, wire

        if not payload:
            return
        try:
            control = wire.decode(payload, "control")
            if control.job_id != job_id:
                raise DecodeError(f"malformed: job_id {control.job_id} does not match the topic")
            crypto.verify(control, self.keys.sign_key)
        except (DecodeError, SignatureError) as exc:
            log.warning("refused control %s: %s", job_id, getattr(exc, "reason", None) or exc)
            return
        self._remember_cancel(job_id, control.attempt_id)
        with self._jobs_lock:
            job = self._jobs.get(job_id)
        if job is not None:
            if control.attempt_id != job.attempt_id:
                log.info("ignored cancel of job %s attempt %d: this runner holds attempt %d", job_id,
                         control.attempt_id, job.attempt_id)
            elif not job.cancel.is_set():
                log.info("cancel of job %s attempt %d (%s)", job_id, control.attempt_id, control.reason)
                job.cancel_reason = control.reason
                job.cancel.set()
            return
        self._drop_pending_for(job_id, control.attempt_id)
        self._cancel_unsupervised(job_id, control.attempt_id)

    def _remember_cancel(self, job_id: str, attempt_id: int) -> None:
        """Keep a tombstone of a verified cancel, even for a job unknown here: a captured
        dispatch of that attempt re-published later (a replay) is then refused (§5, §6)."""
        if self._cancelled.get(job_id, 0) >= attempt_id:
            return
        self._cancelled[job_id] = attempt_id
        self._cancelled.move_to_end(job_id)
        while len(self._cancelled) > MAX_CANCEL_TOMBSTONES:
            self._cancelled.popitem(last=False)

    def _drop_pending_for(self, job_id: str, attempt_id: int) -> None:
        topic = names.dispatch_topic(job_id, self.config.topic_root)
        payload = self._pending.get(topic)
        if payload is None:
            return
        from mam.shared import wire

        try:
            if wire.decode(payload, "dispatch").attempt_id <= attempt_id:
                self._pending.pop(topic, None)
                log.info("dropped waiting dispatch %s: cancelled", job_id)
        except DecodeError:
            self._pending.pop(topic, None)

    def _cancel_unsupervised(self, job_id: str, attempt_id: int) -> None:
        """A cancel for a job this process does not supervise (§6): unknown and
        finished jobs, other attempts, hub records and jobs of another live runner
        are ignored; a non-terminal record of that attempt left by a runner that
        died is adopted as an orphan: its agent tree is stopped, then
        `error`/`cancelled` is published and the record marked `cancelled`."""
        from mam.shared.codes import TERMINAL_STATUSES

        record = self._record(job_id)
        if record is None:
            log.debug("ignored cancel of unknown job %s", job_id)
            return
        if (record["attempt_id"] != attempt_id or record["status"] in TERMINAL_STATUSES
                or record.get("role") != "runner"):
            log.debug("ignored cancel of job %s attempt %d (record: attempt %d, %s, role %s)", job_id, attempt_id,
                      record["attempt_id"], record["status"], record.get("role"))
            return
        orphan = self._orphan_identity(record, any_session=True)
        if orphan is None:
            return
        self._adopt_orphan(record, orphan[0], found_by=orphan[1], cancel_reason="cancel")

    # ------------------------------------------------------------ orphans of a dead runner (§6)

    def _hub_registry_message(self, job_id: str) -> str:
        return (f"{self.options.root} is the hub's registry (it holds jobs dispatched from here, e.g. {job_id}); "
                "give the runner its own workspace: mam-runner run --workspace DIR ...")

    def _check_not_hub_registry(self) -> None:
        """§8: refuse a root holding hub records (exit 64): the runner would find the hub's
        record of every job it is sent and refuse it, and the hub would wait out its ack timeout."""
        records, _ = self._registry.list()
        hub = [r["job_id"] for r in records if r.get("role") == "hub"]
        if hub:
            raise HubRegistry(self._hub_registry_message(hub[0]))

    def _agent_file(self, job_id: str) -> Path:
        return self._registry.logs_dir(job_id) / AGENT_FILE

    def _write_agent_file(self, job: _Job, identity: Any = None) -> None:
        """Record who runs this attempt (this runner, and its agent once started), 0600, atomically."""
        import json

        import psutil

        from mam.shared.fsio import atomic_write

        me = psutil.Process()
        obj: dict[str, Any] = {"job_id": job.job_id, "attempt_id": job.attempt_id, "runner_id": self.runner_id,
                               "runner_pid": me.pid, "runner_create_time": me.create_time(),
                               "pid": None, "create_time": None, "pgid": None, "tag": None}
        if identity is not None:
            obj.update(identity.to_dict())
        path = self._agent_file(job.job_id)
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        atomic_write(path, json.dumps(obj, sort_keys=True).encode("utf-8") + b"\n", what=f"job {job.job_id}")

    def _read_agent_file(self, job_id: str) -> dict[str, Any] | None:
        """The job's agent file as an object; None if absent.

        Raises:
            ValueError: unreadable, too large, not a JSON object (an agent could have written it).
        """
        import json

        path = self._agent_file(job_id)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise ValueError(f"cannot open ({exc.strerror or type(exc).__name__})") from None
        with os.fdopen(fd, "rb") as handle:
            raw = handle.read(AGENT_FILE_MAX_BYTES + 1)
        if len(raw) > AGENT_FILE_MAX_BYTES:
            raise ValueError(f"larger than {AGENT_FILE_MAX_BYTES} bytes")
        try:
            obj = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            raise ValueError("not UTF-8 JSON") from None
        if not isinstance(obj, dict):
            raise ValueError("not a JSON object")
        return obj

    def _orphan_identity(self, record: dict[str, Any], *, any_session: bool) -> tuple[Any, str] | None:
        """Whether a non-terminal runner record has no live supervisor, and how to find its agent.

        Returns:
            None when its runner still lives (or, without an agent file, when the record
            is another session's and `any_session` is False); else `(identity, why)`
            where identity is the agent's `AgentIdentity` or None (unknown).
        """
        from mam.runner.heartbeat import WatchedProcess
        from mam.runner.supervisor import AgentIdentity

        job_id = record["job_id"]
        try:
            info = self._read_agent_file(job_id)
        except ValueError as exc:
            log.warning("job %s: %s is unreadable (%s): its agent cannot be found", job_id, AGENT_FILE, exc)
            info = None
        if info is not None and info.get("attempt_id") != record["attempt_id"]:
            info = None  # left by an older attempt
        if info is None:
            if not any_session and record.get("session") != self.options.session:
                return None  # another session's runner may be alive: not ours to judge
            return None, "no agent identity recorded"
        runner_pid, runner_created = info.get("runner_pid"), info.get("runner_create_time")
        if info.get("runner_id") == self.runner_id:
            return None  # ours: a supervisor thread of this process owns it
        if (isinstance(runner_pid, int) and not isinstance(runner_pid, bool)
                and isinstance(runner_created, (int, float)) and not isinstance(runner_created, bool)
                and WatchedProcess(runner_pid, float(runner_created)).alive()):
            log.info("job %s attempt %d is supervised by another live runner (pid %d): left to it", job_id,
                     record["attempt_id"], runner_pid)
            return None
        if info.get("pid") is None:
            return None, f"its runner (pid {runner_pid}) died before starting the agent"
        try:
            return AgentIdentity.from_dict(info), f"its runner (pid {runner_pid}) died"
        except ValueError as exc:
            log.warning("job %s: %s is invalid (%s): its agent cannot be found", job_id, AGENT_FILE, exc)
            return None, f"its runner (pid {runner_pid}) died"

    def _recover_orphans(self) -> None:
        """At start: adopt every pending/running runner record whose runner died (see module doc)."""
        records, _ = self._registry.list()
        for record in records:
            if record["status"] not in ("pending", "running") or record.get("role") != "runner":
                continue
            try:
                orphan = self._orphan_identity(record, any_session=False)
            except Exception as exc:  # one bad record never stops the daemon
                log.error("job %s: orphan check failed: %s: %s", record["job_id"], type(exc).__name__, exc)
                continue
            if orphan is not None:
                self._adopt_orphan(record, orphan[0], found_by=orphan[1])

    def _adopt_orphan(self, record: dict[str, Any], identity: Any, *, found_by: str,
                      cancel_reason: str | None = None) -> None:
        """Hold a slot for the orphan while a thread stops its agent and publishes its end."""
        job_id = record["job_id"]
        with self._jobs_lock:
            if job_id in self._jobs:
                return
            job = _Job(job_id=job_id, attempt_id=record["attempt_id"], dispatch_token=record["dispatch_token"],
                       brief="", heartbeat_s=int(record.get("heartbeat_sec") or 30),
                       timeout_s=int(record.get("timeout_sec") or 0), orphan=True, identity=identity)
            if cancel_reason is not None:
                job.cancel_reason = cancel_reason
                job.cancel.set()
            job.thread = threading.Thread(target=self._supervise, args=(job,), name=f"orphan-{job_id}",
                                          daemon=True)
            self._jobs[job_id] = job
        where = f"stopping its agent (pid {identity.pid})" if identity is not None else "its agent is unknown"
        log.warning("job %s attempt %d has no supervisor (%s): %s", job_id, job.attempt_id, found_by, where)
        job.thread.start()
        if self._announced:
            self._publish_presence()

    def _end_orphan(self, job: _Job) -> None:
        """§6 for an orphan: stop its agent tree, THEN publish the terminal event."""
        from mam.runner.supervisor import stop_orphan

        found = job.identity is not None and stop_orphan(job.identity, self.options.cancel_grace_s)
        if job.cancel.is_set():
            detail, status = "cancelled", "cancelled"
        else:
            detail, status = (DETAIL_AGENT_STOPPED if found else DETAIL_AGENT_LOST), None
        log.info("job %s: orphaned agent %s; publishing error (%s)", job.job_id,
                 "stopped" if found else "already gone", detail)
        self._publish_terminal(job.job_id, job.attempt_id, job.dispatch_token, "error", detail, None,
                               status=status)

    def _remove_job_files(self, job_id: str) -> None:
        """broker.env holds MQTT_PASSWORD: it must not outlive the job; agent.pid neither."""
        logs = self._registry.logs_dir(job_id)
        for name in ("broker.env", AGENT_FILE):
            try:
                (logs / name).unlink(missing_ok=True)
            except OSError as exc:
                log.warning("job %s: %s not removed: %s", job_id, name, exc.strerror or exc)

    # ------------------------------------------------------------ the supervisor thread (§11)

    def _agent_env(self, job: _Job, env_file: Path) -> dict[str, str]:
        from mam.runner.publish import publish_command
        from mam.runner.supervisor import agent_env

        env = agent_env(os.environ if self.environ is None else self.environ, job_id=job.job_id,
                        attempt_id=job.attempt_id, dispatch_token=job.dispatch_token,
                        session=self.options.session, heartbeat_s=job.heartbeat_s,
                        publish_cmd=publish_command(self.options.root, job.job_id), brief=job.brief)
        env["MAM_ENV_FILE"] = str(env_file)
        env["MAM_REAL_ROOT"] = str(self.options.root)
        return env

    def _write_broker_env(self, job_id: str) -> Path:
        """The agent's per-job broker settings, 0600, without the dispatch secret (see module doc)."""
        from mam.shared.config import write_env_file

        cfg = self.config
        values = {"MQTT_BROKER": ",".join(cfg.hosts), "MQTT_PORT": str(cfg.port),
                  "MQTT_TLS": "true" if cfg.tls else "false", "MQTT_USERNAME": cfg.username,
                  "MQTT_PASSWORD": cfg.password, "MQTT_CA_CERTS": cfg.ca_certs,
                  "MQTT_CERTFILE": cfg.certfile, "MQTT_KEYFILE": cfg.keyfile,
                  "MQTT_CLIENT_ID_PREFIX": cfg.client_id_prefix, "MQTT_KEEPALIVE": str(cfg.keepalive_s),
                  "MAM_TOPIC_ROOT": cfg.topic_root}
        path = self._registry.logs_dir(job_id) / "broker.env"
        return write_env_file(path, values, header=f"broker settings for the agent of job {job_id}",
                              overwrite=True)

    def _supervise(self, job: _Job) -> None:
        """Steps 2-5 of §11 for one job; always ends by telling the main loop."""
        try:
            if job.orphan:
                self._end_orphan(job)
            else:
                self._run_job(job)
        except Exception as exc:
            log.error("supervisor of job %s failed: %s: %s", job.job_id, type(exc).__name__, exc)
            log.debug("traceback", exc_info=True)
            self._publish_terminal(job.job_id, job.attempt_id, job.dispatch_token, "error",
                                   "runner failed to supervise the agent", None)
        finally:
            try:
                self._remove_job_files(job.job_id)
            finally:
                self._ended.put(job.job_id)

    def _run_job(self, job: _Job) -> None:
        from mam.runner import heartbeat, publish
        from mam.runner.supervisor import AgentProcess, AgentStartError

        self._write_agent_file(job)  # before `started`: a restarted runner can tell this attempt is orphaned
        try:  # §11 step 2: the dispatch is taken; nobody else may take it
            self.client.publish(names.dispatch_topic(job.job_id, self.config.topic_root), b"", retain=True)
        except BrokerError as exc:
            log.warning("job %s: retained dispatch not cleared (%s); the registry refuses its replay", job.job_id,
                        exc)
        started = publish.record(self._registry, publish.PublishRequest(
            job_id=job.job_id, event="started", attempt_id=job.attempt_id, dispatch_token=job.dispatch_token),
            source="runner")
        self._send(job.job_id, started)
        try:
            heartbeat.start_timer(self._registry, job.job_id, attempt_id=job.attempt_id,
                                  dispatch_token=job.dispatch_token, interval_s=float(job.heartbeat_s),
                                  watch=heartbeat.WatchedProcess.of(os.getpid()), timeout_s=float(job.timeout_s))
        except (RegistryError, MamError) as exc:
            log.warning("job %s: heartbeat timer not started: %s", job.job_id, exc)
        if job.cancel.is_set():  # cancelled before the agent started
            self._publish_terminal(job.job_id, job.attempt_id, job.dispatch_token, "error", "cancelled", None,
                                   status="cancelled")
            return
        env_file = self._write_broker_env(job.job_id)
        agent = AgentProcess()
        workdir = self.options.workdir or (self.options.root / "work" / job.job_id)
        try:
            try:
                agent.start(list(self.options.argv), env=self._agent_env(job, env_file), cwd=workdir,
                            stdin_text=job.brief, log_path=self._registry.logs_dir(job.job_id) / "agent.log")
            except (AgentStartError, RegistryError, OSError) as exc:
                log.error("job %s: agent not started: %s", job.job_id, exc)
                self._publish_terminal(job.job_id, job.attempt_id, job.dispatch_token, "error",
                                       "agent could not be started", 127)
                return
            log.info("job %s: agent pid %d started", job.job_id, agent.pid)
            try:
                self._write_agent_file(job, agent.identity)
            except RegistryError as exc:
                log.warning("job %s: agent identity not recorded (a restarted runner cannot stop it): %s",
                            job.job_id, exc)
            status = None
            deadline = time.monotonic() + job.timeout_s  # §5 timeout_sec, from the agent's start
            timed_out = lingered = False
            reported_at: float | None = None  # when the agent's own terminal event was seen
            next_check = 0.0
            while status is None:
                if job.cancel.wait(0):
                    break
                now = time.monotonic()
                if now >= deadline:
                    timed_out = True
                    break
                if reported_at is None and now >= next_check:
                    next_check = now + RECORD_CHECK_S
                    if self._record_terminal(job.job_id):
                        reported_at = now
                if reported_at is not None and now - reported_at >= self.options.agent_linger_s:
                    lingered = True
                    break
                status = agent.wait(timeout_s=LOOP_POLL_S)
            if lingered:  # its terminal event is out; only its processes and our slot are left
                agent.cancel(grace_s=self.options.cancel_grace_s)
                log.info("job %s: the agent reported its end but ran on for %g s: stopped", job.job_id,
                         self.options.agent_linger_s)
                return
            if timed_out and not job.cancel.is_set():
                status = agent.cancel(grace_s=self.options.cancel_grace_s)
                log.info("job %s: agent stopped: timed out after %d s (contract timeout_sec)", job.job_id,
                         job.timeout_s)
                _, _, code = status.terminal()
                self._publish_terminal(job.job_id, job.attempt_id, job.dispatch_token, "error",
                                       f"timed out after {job.timeout_s} s", code)
                return
            if status is None or job.cancel.is_set():
                status = agent.cancel(grace_s=self.options.cancel_grace_s)
                log.info("job %s: agent cancelled (%s)", job.job_id, job.cancel_reason or "cancel")
                _, _, code = status.terminal()
                self._publish_terminal(job.job_id, job.attempt_id, job.dispatch_token, "error", "cancelled",
                                       code, status="cancelled")
                return
            event, detail, code = status.terminal()
            log.info("job %s: agent ended (%s)", job.job_id, detail or "exit 0")
            self._stop_leftovers(job, agent)  # before the terminal event: nothing of the job outlives it
            self._publish_terminal(job.job_id, job.attempt_id, job.dispatch_token, event, detail, code)
        finally:
            if agent.started and agent.poll() is None:  # an unexpected error: never leave the agent behind
                agent.cancel(grace_s=self.options.cancel_grace_s)
            agent.close()
            env_file.unlink(missing_ok=True)

    def _record_terminal(self, job_id: str) -> bool:
        """True when this runner's record of the job is terminal (the agent published its end)."""
        from mam.shared.codes import TERMINAL_STATUSES

        try:
            return self._registry.get(job_id)["status"] in TERMINAL_STATUSES
        except RegistryError:
            return False

    def _stop_leftovers(self, job: _Job, agent: Any) -> None:
        """§11 step 5: the leader exited; stop what remains of its tree (a background
        child, the children of a killed leader) like a cancel, and log how many."""
        try:
            stopped = agent.stop_leftovers(self.options.cancel_grace_s)
        except Exception as exc:  # never skip the terminal event because of the cleanup
            log.warning("job %s: leftover processes of the agent not stopped: %s: %s", job.job_id,
                        type(exc).__name__, exc)
            return
        log.info("job %s: %d leftover process(es) of the agent stopped", job.job_id, stopped)

    def _publish_terminal(self, job_id: str, attempt_id: int, dispatch_token: str, event: str, detail: str,
                          exit_code: int | None, *, status: str | None = None) -> None:
        """§11 step 5: disk first, then the wire; an agent's own terminal event wins."""
        from mam.runner import publish
        from mam.shared.registry import Refusal

        try:
            published = publish.record(self._registry, publish.PublishRequest(
                job_id=job_id, event=event, detail=detail, attempt_id=attempt_id, dispatch_token=dispatch_token),
                source="runner", exit_code=exit_code, status=status)
        except Refusal as exc:
            if exc.reason == "after_terminal":
                log.info("job %s already ended (the agent published its terminal event)", job_id)
            else:
                log.warning("job %s: terminal event refused: %s", job_id, exc)
            return
        except TransitionRefused as exc:
            log.warning("job %s: terminal event refused: %s", job_id, exc)
            return
        self._send(job_id, published)

    def _send(self, job_id: str, published: Any) -> None:
        from mam.runner import publish

        try:
            publish.send_on(self.client, published)
        except BrokerError as exc:  # on disk already; paho still resends it after a reconnect
            log.warning("job %s seq %d is on disk but not acknowledged by the broker: %s", job_id,
                        published.seq, exc)


def run_cli(*, session: str, exec_cmd: str, workspace: str | None, workdir: str | None, max_jobs: int,
            once: bool, replace: bool) -> int:
    """`mam-runner run`: validate, resolve config and keys, serve.

    Returns:
        the exit code (0 clean exit).
    Raises:
        UsageError / ConfigError (exit 64), EnvFileError (1), BrokerUnavailable (3).
    """
    from mam.shared import config, crypto

    options = options_from_cli(session=session, exec_cmd=exec_cmd, workspace=workspace, workdir=workdir,
                               max_jobs=max_jobs, once=once, replace=replace)
    secret = config.dispatch_secret(workspace=options.root)  # before anything talks to the network
    cfg = config.broker_config(workspace=options.root)
    runner = Runner(options, config=cfg, keys=crypto.derive_keys(secret))
    return runner.serve()


__all__ = ["HubRegistry", "Runner", "RunnerOptions", "SessionBusy", "options_from_cli", "run_cli"]
