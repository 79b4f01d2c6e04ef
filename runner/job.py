"""One taken job's life on its supervisor thread (PROTOCOL §11 steps 2-5, §5
`timeout_sec`, §6 cancel, §12 heartbeat).

Order: record `agent.pid` (orphans.py), clear the retained dispatch, publish
`started`, add the job to the daemon's heartbeats (`beats`), write the agent's
per-job `broker.env` (0600, MQTT_* and MAM_TOPIC_ROOT, never the dispatch
secret; MAM_ENV_FILE points to it, §13), run the agent, and wait until one
`StopReason`. Then stop what is left of its tree and only then publish the
terminal event, unless the agent published one itself. The job's files are
removed when it ends. An orphan (a dead runner's job) only has its agent tree
stopped and its end published. A job thread never dies with an exception and
ends every job with a terminal: when the disk refuses it (full, read-only) it
goes on the wire at once and to disk once the disk takes it (a full disk loses no terminal).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from mam.runner import gpus, lease, orphans, publish
from mam.runner.agent import AgentProcess, AgentStartError, ExitStatus, agent_env
from mam.runner.cgroups import JobCgroup, RunnerCgroups
from mam.runner.deadman import DeadmanSwitch
from mam.runner.fastpath import SOCKET_ENV
from mam.runner.heartbeat.beats import Beats
from mam.runner.lease import Leases
from mam.runner.limits import JobLimits, RunnerLimits
from mam.runner.logstream import LogStreams
from mam.runner.process_tree import AgentIdentity, stop_orphan
from mam.runner.repos import RepoError, Repos
from mam.runner.results import ResultSender
from mam.runner.settings import RunnerOptions
from mam.runner.work import AttemptWork
from mam.shared.config import BrokerConfig, write_env_file
from mam.shared.protocol import crypto, names, wire
from mam.shared.protocol.codes import EVENT_STATUS, TERMINAL_STATUSES, EventName, JobStatus
from mam.shared.protocol.errors import BrokerError, RegistryError, StaleAttemptError, TransitionRefused
from mam.shared.store.registry import Refusal, Registry
from mam.shared.transport import Transport

log = logging.getLogger("mam.daemon")

WAIT_POLL_S = 0.1
"""How often the supervisor looks at the agent, the cancel flag and the clock."""
RECORD_CHECK_S = 0.5
"""How often it reads the record to see whether the agent published its own terminal event."""
DISK_RETRY_S = 1.0
"""How often a terminal event the disk refused is written again (seconds)."""
BROKER_ENV_FILE = "broker.env"
DETAIL_CANCELLED = "cancelled"
DETAIL_SUPERVISOR_FAILED = "runner failed to supervise the agent"
DETAIL_NOT_STARTED = "agent could not be started"
EXIT_NOT_STARTED = 127
"""`data.exit_code` of an agent that could not be started (the shell's "command not found")."""


class StopReason(StrEnum):
    """Why the supervisor stopped waiting for the agent."""

    EXITED = "exited"  # the agent ended by itself
    CANCELLED = "cancelled"  # a verified cancel (§6) or the runner's shutdown
    TIMED_OUT = "timed_out"  # it ran the contract's `timeout_sec` (§5)
    LINGERED = "lingered"  # it published its own terminal event, then ran on past MAM_AGENT_LINGER_S
    OVER_BUDGET = "over_budget"  # its stream shows --max-turns / --max-cost-usd spent (§18)
    LEASE_LOST = "lease_lost"  # no beat acknowledged for its lease less the margin (§10 "Leases")


def final_reason(reason: StopReason, cancelled: bool) -> StopReason:
    """A cancel seen after the wait ended wins over an exit or a timeout (the job is cancelled);
    a lingering agent already reported its end, so nothing is published for it either way."""
    if cancelled and reason in (StopReason.EXITED, StopReason.TIMED_OUT):
        return StopReason.CANCELLED
    return reason


@dataclass(frozen=True)
class Terminal:
    """The terminal event the runner publishes (§11 step 5).

    Attributes:
        event: `completed` or `error`; detail: its detail; exit_code: `data.exit_code`;
        status: the record status to set (`cancelled`), None = the event's own.
        data: more terminal data: the agent's figures and the result's manifest (§18).
    """

    event: str
    detail: str
    exit_code: int | None
    status: str | None = None
    data: Mapping[str, Any] | None = None


def terminal_for(reason: StopReason, status: ExitStatus, timeout_s: int) -> Terminal | None:
    """The terminal event of a supervised job, from why it stopped and how the agent ended.

    Args:
        reason: the final `StopReason`; status: the agent's exit; timeout_s: the contract's `timeout_sec`.
    Returns:
        the event to publish, or None (LINGERED: the agent published its own).
    """
    event, detail, code = status.terminal()
    if reason is StopReason.LINGERED:
        return None
    if reason is StopReason.CANCELLED:
        return Terminal(EventName.ERROR, DETAIL_CANCELLED, code, JobStatus.CANCELLED)
    if reason is StopReason.TIMED_OUT:
        return Terminal(EventName.ERROR, f"timed out after {timeout_s} s", code)
    return Terminal(event, detail, code)


@dataclass
class Job:
    """One taken job (or adopted orphan) and its supervisor thread.

    `cancel` is set by a verified cancel or the shutdown, with `cancel_reason` for the log.
    """

    job_id: str
    attempt_id: int
    dispatch_token: str
    brief: str
    heartbeat_s: int
    timeout_s: int
    lease_s: float | None = None  # §10 "Leases": the contract's idle_timeout_sec; None: not fenced
    cancel: threading.Event = field(default_factory=threading.Event)
    cancel_reason: str = ""
    thread: threading.Thread | None = None
    orphan: bool = False  # left by a dead runner: stop its agent, publish, never run anything
    identity: AgentIdentity | None = None  # the orphan's agent, None when unknown
    work: wire.Work | None = None  # the dispatch's repository and agent policy (§18)
    tell: Callable[[str], bool] | None = None  # a person's message to the running agent's stdin (§18)
    gpus: tuple[str, ...] | None = None  # §14: the GPUs it holds on a runner that has any; None: it has none

    def request_cancel(self, reason: str) -> bool:
        """Ask the supervisor to stop the agent; False when already asked."""
        if self.cancel.is_set():
            return False
        self.cancel_reason = reason
        self.cancel.set()
        return True


class Supervisor:
    """Runs jobs on their threads (§11 steps 2-5) for one `Runner`.

    Args:
        options: the runner's options; runner_id: its id (§7).
        registry: this host's registry; client: the daemon's connection; config: its broker settings.
        environ: the environment agents inherit (None = os.environ).
        on_end: called with the job id when a supervisor thread ends (always, last).
        stopping: set when the runner stops now: a terminal event still waiting for
            disk space is then left to the restart's recovery (default: never set).

    `beats` beats for every running job (§12, one thread); the runner stops it last.
    """

    def __init__(self, *, options: RunnerOptions, runner_id: str, registry: Registry, client: Transport,
                 config: BrokerConfig, environ: Mapping[str, str] | None, on_end: Callable[[str], None],
                 stopping: threading.Event | None = None) -> None:
        self.options = options
        self.runner_id = runner_id
        self.registry = registry
        self.client = client
        self.config = config
        self.environ = environ
        self.on_end = on_end
        self.stopping = stopping or threading.Event()
        self.socket_path: Path | None = None  # the daemon's local publish socket (§17), set once it listens
        self.cgroups: RunnerCgroups | None = None  # §6: each agent in a cgroup of its own, where the host allows
        self.deadman = DeadmanSwitch()  # §6: the daemon's death stops its agents, §10: so does a lapsed lease
        self.leases = Leases(margin_s=options.lease_margin_s, on_renew=self.deadman.renew)
        self.limits: RunnerLimits | None = None  # §6 "Limits": where this host can limit a job
        # the tools a person at the hub denied a job (§19), from that socket: (job_id) -> names
        self.denied_tools: Callable[[str], set[str]] = lambda job_id: set()
        self.beats = Beats(registry, client, drain_s=options.heartbeat_drain_s,  # §12: one thread, every job
                           on_ack=lambda job_id, attempt_id, sent_at: self.leases.renew(f"{job_id}-{attempt_id}",
                                                                                         sent_at))
        self.logstreams = LogStreams(root=options.root, client=client, config=config,  # §15
                                     rate_bps=options.log_rate_bps, environ=environ)
        self.mirrors = Repos(options.root, options.repos)  # §18
        self.results = ResultSender(root=options.root, client=client)  # §18

    def start(self, job: Job) -> None:
        """Start the job's supervisor thread."""
        kind = "orphan" if job.orphan else "supervisor"
        job.thread = threading.Thread(target=self.supervise, args=(job,), name=f"{kind}-{job.job_id}",
                                      daemon=True)
        job.thread.start()

    def supervise(self, job: Job) -> None:
        """Steps 2-5 of §11 for one job; always ends by calling `on_end`."""
        try:
            if job.orphan:
                self._end_orphan(job)
            else:
                self._run(job)
        except Exception as exc:
            log.error("supervisor of job %s failed: %s: %s", job.job_id, type(exc).__name__, exc)
            log.debug("traceback", exc_info=True)
            try:
                self.publish_terminal(job, Terminal(EventName.ERROR, DETAIL_SUPERVISOR_FAILED, None))
            except Exception as again:  # a supervisor thread never dies with an exception
                log.error("job %s: no terminal event published: %s: %s", job.job_id, type(again).__name__, again)
        finally:
            self.beats.remove(job.job_id, job.attempt_id)
            try:
                self.logstreams.finish(job.job_id)  # §15: a stream no terminal event of ours ended (lingered)
                self._remove_job_files(job.job_id)
            finally:
                self.on_end(job.job_id)

    # ------------------------------------------------------------ one job

    def _run(self, job: Job) -> None:
        # before `started`: a restarted runner can tell this attempt is orphaned
        orphans.write_agent_file(self.registry, job.job_id, job.attempt_id, self.runner_id)
        # §11 step 2: the dispatch is taken; nobody else may take it. `started` is recorded on
        # disk while the broker acknowledges the clear, and goes out only after that PUBACK.
        dispatch_topic = names.dispatch_topic(job.job_id, self.config.topic_root)
        try:
            cleared: Callable[[], None] | None = self.client.publish_async(dispatch_topic, b"", retain=True)
        except BrokerError as exc:
            cleared = None
            log.warning("job %s: retained dispatch not cleared (%s); the registry refuses its replay", job.job_id,
                        exc)
        attempt, started_data, problem = self._prepare(job)  # §18: the worktree, before `started`
        limits = self._limits_of(job, started_data)
        agent = AgentProcess()
        env_file: Path | None = None
        try:
            if attempt is not None and problem is None:
                env_file = self._write_broker_env(job.job_id)
                if not job.cancel.is_set():  # held where it can be: it joins its groups while
                    # `started` goes out; its program runs only after that (§11 step 4)
                    self._start_agent(job, agent, env_file, attempt, limits, hold=True)
            started = publish.record(self.registry, publish.PublishRequest(
                job_id=job.job_id, event=EventName.STARTED, attempt_id=job.attempt_id,
                dispatch_token=job.dispatch_token, data=started_data, detail=session_note(started_data)),
                source="runner")
            try:
                if cleared is not None:
                    cleared()
            except BrokerError as exc:
                log.warning("job %s: retained dispatch not cleared (%s); the registry refuses its replay", job.job_id,
                            exc)
            if job.lease_s is not None:  # §10 "Leases": from before `started` goes out, as the hub counts from it
                self.leases.hold(f"{job.job_id}-{job.attempt_id}", lease_s=job.lease_s, heartbeat_s=job.heartbeat_s,
                                 since=lease.now())
            self._send(job.job_id, started)
            # §12 from the daemon: one thread beats for every job (no timer process per job, §17)
            self.beats.add(job.job_id, attempt_id=job.attempt_id, dispatch_token=job.dispatch_token,
                           interval_s=float(job.heartbeat_s), timeout_s=float(job.timeout_s))
            if attempt is None or problem is not None or env_file is None or job.cancel.is_set():
                if agent.started:  # held, never released: it ends without running the program
                    agent.cancel(grace_s=0.0)
                if attempt is None or problem is not None:
                    log.error("job %s: %s", job.job_id, problem)
                    self.publish_terminal(job, Terminal(EventName.ERROR, str(problem)[:wire.MAX_DETAIL_CHARS], None))
                else:  # cancelled before the agent started
                    self.publish_terminal(job, Terminal(EventName.ERROR, DETAIL_CANCELLED, None, JobStatus.CANCELLED))
                return
            self._run_agent(job, agent, env_file, attempt, limits)
        finally:
            if agent.started and agent.poll() is None:  # an unexpected error: never leave the agent behind
                agent.cancel(grace_s=self.options.cancel_grace_s)
            self.deadman.disarm(f"{job.job_id}-{job.attempt_id}")
            self.leases.release(f"{job.job_id}-{job.attempt_id}")
            agent.close()
            if limits is not None:
                limits.remove()
            if env_file is not None:
                env_file.unlink(missing_ok=True)

    def _prepare(self, job: Job) -> tuple[AttemptWork | None, dict[str, Any], str | None]:
        """The attempt's work (§18): (it, `started`'s data, why it cannot run or None)."""
        log_path = self.registry.logs_dir(job.job_id) / "agent.log"
        try:
            offset = os.stat(log_path).st_size if log_path.exists() else 0
            token = self.registry.get(job.job_id)["auth_token"]
            attempt = AttemptWork(job_id=job.job_id, attempt_id=job.attempt_id, work=job.work, root=self.options.root,
                                  mirrors=self.mirrors, exec_argv=self.options.argv,
                                  log_path=log_path, log_offset=offset, secrets=[*self.logstreams.secrets, token],
                                  session=self.options.session, agent=self.options.agent,
                                  ask_socket=self.socket_path is not None,
                                  workdir=self.options.workdir or (self.options.root / "work" / job.job_id),
                                  environ=self.environ, auth_token=token)
        except (ValueError, OSError, RegistryError) as exc:
            return None, {}, f"agent not started: {exc}"
        try:
            return attempt, attempt.prepare(), None
        except (RepoError, OSError) as exc:
            return attempt, {"agent": attempt.adapter.kind}, str(exc)

    def _start_agent(self, job: Job, agent: AgentProcess, env_file: Path, attempt: AttemptWork,
                     limits: JobLimits | None, *, hold: bool = False) -> bool:
        """`agent.start` with the attempt's command, environment and groups; with `hold`, only
        where it can be held (False: not started), and an error is left for the start after."""
        try:
            return agent.start(attempt.argv(), env={**self._agent_env(job, env_file), **attempt.env()},
                               cwd=attempt.cwd(), stdin_text=attempt.stdin(job.brief), log_path=attempt.log_path,
                               keep_stdin=attempt.takes_input, cgroup=self._cgroup_of(job),
                               join=limits.procs_files() if limits is not None else (), hold=hold)
        except (AgentStartError, RegistryError, OSError):
            if hold:
                return False  # the start after `started` meets it again and ends the job
            raise

    def _run_agent(self, job: Job, agent: AgentProcess, env_file: Path, attempt: AttemptWork,
                   limits: JobLimits | None) -> None:
        # §15: from the attempt's first byte (a held agent's stub may have written already)
        self.logstreams.start(self.registry, job.job_id, job.attempt_id, attempt.log_path, offset=attempt.log_offset)
        try:
            if agent.started:
                agent.release()
            else:
                self._start_agent(job, agent, env_file, attempt, limits)
        except (AgentStartError, RegistryError, OSError) as exc:
            log.error("job %s: agent not started: %s", job.job_id, exc)
            self.publish_terminal(job, Terminal(EventName.ERROR, DETAIL_NOT_STARTED, EXIT_NOT_STARTED))
            return
        log.info("job %s: agent pid %d started", job.job_id, agent.pid)
        key = f"{job.job_id}-{job.attempt_id}"
        self.deadman.arm(key, agent.identity, agent.cgroup.path if agent.cgroup is not None else None,
                         self.leases.until(key))
        if attempt.takes_input:
            job.tell = lambda text: agent.send_input(attempt.stdin(text).encode("utf-8", "surrogateescape"))
        try:
            orphans.write_agent_file(self.registry, job.job_id, job.attempt_id, self.runner_id, agent.identity)
        except RegistryError as exc:
            log.warning("job %s: agent identity not recorded (a restarted runner cannot stop it): %s",
                        job.job_id, exc)
        reason, status = self._wait(job, agent, attempt)
        reason = final_reason(reason, job.cancel.is_set())
        completed = reason is StopReason.EXITED and status is not None and status.terminal()[0] == EventName.COMPLETED
        if reason is not StopReason.LINGERED and not completed and self.leases.lapsed(key):
            reason = StopReason.LEASE_LOST  # fenced (§10 "Leases"), whatever the hub's cancel says after
        grace_s = self.options.cancel_grace_s
        if reason is StopReason.LEASE_LOST:
            status = agent.cancel(grace_s=0.0) if status is None else status
            log.warning("job %s: %s", job.job_id, self.leases.detail(key))
        elif reason is StopReason.EXITED and status is not None:
            log.info("job %s: agent ended (%s)", job.job_id, status.terminal()[1] or "exit 0")
            self._stop_leftovers(job, agent)  # before the terminal event: nothing of the job outlives it
        else:
            status = agent.cancel(grace_s=grace_s)
            if reason is StopReason.LINGERED:  # its terminal event is out; only its processes and our slot are left
                log.info("job %s: the agent reported its end but ran on for %g s: stopped", job.job_id,
                         self.options.agent_linger_s)
            elif reason is StopReason.OVER_BUDGET:
                log.info("job %s: agent stopped: %s spent", job.job_id, attempt.adapter.over_budget())
            elif reason is StopReason.TIMED_OUT:
                log.info("job %s: agent stopped: timed out after %d s (contract timeout_sec)", job.job_id,
                         job.timeout_s)
            else:
                log.info("job %s: agent cancelled (%s)", job.job_id, job.cancel_reason or "cancel")
        terminal = terminal_for(reason, status, job.timeout_s)
        oom_kills = limits.oom_kills() if limits is not None else 0
        lease_lost = reason is StopReason.LEASE_LOST
        if terminal is not None and lease_lost:
            terminal = Terminal(EventName.ERROR, self.leases.detail(key), terminal.exit_code)
        elif terminal is not None and reason is StopReason.OVER_BUDGET:
            terminal = Terminal(EventName.ERROR, f"budget_exceeded: {attempt.adapter.over_budget()}",
                                terminal.exit_code)
        elif (terminal is not None and reason is StopReason.EXITED and oom_kills
              and terminal.event != EventName.COMPLETED):
            terminal = Terminal(EventName.ERROR, oom_detail(job.work, oom_kills), terminal.exit_code)
        elif terminal is not None and reason is StopReason.EXITED:
            # §18: a denial no person decided (§19) or an API error is an `error`
            verdict = attempt.outcome(terminal.exit_code, self.denied_tools(job.job_id))
            if verdict is not None:
                terminal = Terminal(verdict[0], verdict[1], terminal.exit_code)
            elif terminal.event == EventName.COMPLETED and (summary := attempt.summary()):
                terminal = Terminal(terminal.event, summary, terminal.exit_code)
        data = {**attempt.agent_data(), **self._send_result(job, attempt)}
        usage = {**(limits.usage() if limits is not None else {}), **(agent.cgroup.usage() if agent.cgroup else {})}
        if usage:
            data["usage"] = usage  # §6: the job's whole process tree, from its cgroups
        if oom_kills:
            data["oom_kills"] = oom_kills
        if lease_lost:
            data["lease_lost"] = True  # §10 "Leases": the hub may retry it (retry_on lease_lost)
        if terminal is not None:
            self.publish_terminal(job, Terminal(terminal.event, terminal.detail, terminal.exit_code,
                                                terminal.status, data))

    def _limits_of(self, job: Job, started_data: dict[str, Any]) -> JobLimits | None:
        """The attempt's limit groups with the job's limits written (§6 "Limits"), or None where
        the host has none. What is enforced goes into `started`'s data as `limits`; a limit
        asked for that this host cannot enforce is said there (`limits_missing`) and logged,
        and the job runs without it (as docker does)."""
        if self.limits is None or not (self.limits.v1 or self.limits.v2_controllers):
            found = None
        else:
            group = self._cgroup_of(job) if self.limits.v2_controllers else None  # made now: limits first
            found = self.limits.job(f"{job.job_id}-{job.attempt_id}", v2=group.path if group else None)
        work = job.work
        if work is None or (work.memory_bytes, work.cpus, work.pids) == (None, None, None):
            return found
        applied: dict[str, float | int] = {}
        if found is None:
            missing = [f"{key} (no cgroup controllers here)" for key in ("memory_bytes", "cpus", "pids")
                       if getattr(work, key) is not None]
        else:
            applied, missing = found.apply(memory_bytes=work.memory_bytes, cpus=work.cpus, pids=work.pids)
        if applied:
            started_data["limits"] = applied
        if missing:
            started_data["limits_missing"] = missing
            log.warning("job %s: runs without %s", job.job_id, ", ".join(missing))
        return found

    def _cgroup_of(self, job: Job) -> JobCgroup | None:
        """The attempt's own cgroup (§6), or None in process-group mode or when it cannot be made."""
        if self.cgroups is None:
            return None
        try:
            return self.cgroups.job(f"{job.job_id}-{job.attempt_id}")
        except OSError as exc:
            log.warning("job %s: no cgroup of its own (%s): cancel stops its process group", job.job_id,
                        exc.strerror or exc)
            return None

    def _send_result(self, job: Job, attempt: AttemptWork) -> dict[str, Any]:
        """Collect and send the attempt's result before its terminal event (§18); its data."""
        try:
            collected = attempt.finish(session=self.options.session, max_result_bytes=self.options.max_result_bytes)
            if collected is None:
                return {}
            token = self.registry.get(job.job_id)["auth_token"]
            self.results.send(job_id=job.job_id, attempt_id=job.attempt_id, auth_token=token,
                              archive=collected.archive, manifest=collected.manifest)
        except (RepoError, OSError, RegistryError) as exc:  # the end is published even so
            log.error("job %s: no result sent: %s", job.job_id, exc)
            return {"result": {"note": f"result_failed: {str(exc)[:300]}"}}
        return {"result": collected.data}

    def _wait(self, job: Job, agent: AgentProcess, attempt: AttemptWork) -> tuple[StopReason, ExitStatus | None]:
        """Wait for the agent until one `StopReason`; the status is set when it exited."""
        deadline = time.monotonic() + job.timeout_s  # §5 timeout_sec, from the agent's start
        reported_at: float | None = None  # when the agent's own terminal event was seen
        next_check = 0.0
        session: str | None = None  # the agent session the hub was told of
        key = f"{job.job_id}-{job.attempt_id}"
        while True:
            if self.leases.lapsed(key):
                return StopReason.LEASE_LOST, None
            if job.cancel.wait(0):
                return StopReason.CANCELLED, None
            now = time.monotonic()
            if now >= deadline:
                return StopReason.TIMED_OUT, None
            if reported_at is None and now >= next_check:
                next_check = now + RECORD_CHECK_S
                if self._record_terminal(job.job_id):
                    reported_at = now
                elif attempt.poll() is not None:  # §18: a budget the CLI does not enforce itself
                    return StopReason.OVER_BUDGET, None
                elif attempt.takes_input and attempt.turn_over():
                    agent.close_input()  # §18: it answered; with stdin closed it ends
                if session is None and (session := attempt.session_id()) is not None:
                    self._session_known(job, attempt, session)
            if reported_at is not None and now - reported_at >= self.options.agent_linger_s:
                return StopReason.LINGERED, None
            status = agent.wait(timeout_s=WAIT_POLL_S)
            if status is not None:
                return StopReason.EXITED, status

    def _session_known(self, job: Job, attempt: AttemptWork, session_id: str) -> None:
        """The agent named its session (§18): its transcript streams to the hub (§15 "Transcript
        chunks") and a `progress` event says the session (`data.agent`), so that the hub can
        continue it elsewhere should this runner be lost before the terminal event."""
        self.logstreams.start_transcript(self.registry, job.job_id, job.attempt_id, session_id,
                                         attempt.transcript_path)
        try:
            published = publish.record(self.registry, publish.PublishRequest(
                job_id=job.job_id, event=EventName.PROGRESS, attempt_id=job.attempt_id,
                dispatch_token=job.dispatch_token, data=attempt.agent_data(), detail=f"agent session {session_id}"),
                source="runner")
        except (StaleAttemptError, RegistryError) as exc:  # the job ended meanwhile, or the disk refuses
            log.info("job %s: agent session %s not reported: %s", job.job_id, session_id, exc)
            return
        self._send(job.job_id, published)

    def _record_terminal(self, job_id: str) -> bool:
        """True when this runner's record of the job is terminal (the agent published its end)."""
        try:
            return self.registry.get(job_id)["status"] in TERMINAL_STATUSES
        except RegistryError:
            return False

    def _stop_leftovers(self, job: Job, agent: AgentProcess) -> None:
        """§11 step 5: the leader exited; stop what remains of its tree (a background
        child, the children of a killed leader) like a cancel, and log how many."""
        try:
            stopped = agent.stop_leftovers(self.options.cancel_grace_s)
        except Exception as exc:  # never skip the terminal event because of the cleanup
            log.warning("job %s: leftover processes of the agent not stopped: %s: %s", job.job_id,
                        type(exc).__name__, exc)
            return
        log.info("job %s: %d leftover process(es) of the agent stopped", job.job_id, stopped)

    def _agent_env(self, job: Job, env_file: Path) -> dict[str, str]:
        env = agent_env(os.environ if self.environ is None else self.environ, job_id=job.job_id,
                        attempt_id=job.attempt_id, dispatch_token=job.dispatch_token,
                        session=self.options.session, heartbeat_s=job.heartbeat_s,
                        publish_cmd=publish.publish_command(self.options.root, job.job_id), brief=job.brief)
        env.update(gpus.agent_env(job.gpus))  # §14: its own GPUs only
        env["MAM_ENV_FILE"] = str(env_file)
        env["MAM_REAL_ROOT"] = str(self.options.root)
        env.pop(SOCKET_ENV, None)  # never another daemon's socket
        if self.socket_path is not None:  # §17: `mam-runner publish` goes through this daemon
            env[SOCKET_ENV] = str(self.socket_path)
        return env

    def _write_broker_env(self, job_id: str) -> Path:
        """The agent's per-job broker settings, 0600, without the dispatch secret (§13). Not
        fsynced: the agent reads it at once, and a power loss that could lose it ends the agent."""
        cfg = self.config
        values = {"MQTT_BROKER": ",".join(cfg.hosts), "MQTT_PORT": str(cfg.port),
                  "MQTT_TLS": "true" if cfg.tls else "false", "MQTT_USERNAME": cfg.username,
                  "MQTT_PASSWORD": cfg.password, "MQTT_CA_CERTS": cfg.ca_certs,
                  "MQTT_CERTFILE": cfg.certfile, "MQTT_KEYFILE": cfg.keyfile,
                  "MQTT_CLIENT_ID_PREFIX": cfg.client_id_prefix, "MQTT_KEEPALIVE": str(cfg.keepalive_s),
                  "MAM_TOPIC_ROOT": cfg.topic_root}
        path = self.registry.logs_dir(job_id) / BROKER_ENV_FILE
        return write_env_file(path, values, header=f"broker settings for the agent of job {job_id}",
                              overwrite=True, durable=False)

    def _remove_job_files(self, job_id: str) -> None:
        """broker.env holds MQTT_PASSWORD: it must not outlive the job; agent.pid neither."""
        logs = self.registry.logs_dir(job_id)
        for name in (BROKER_ENV_FILE, orphans.AGENT_FILE):
            try:
                (logs / name).unlink(missing_ok=True)
            except OSError as exc:
                log.warning("job %s: %s not removed: %s", job_id, name, exc.strerror or exc)

    # ------------------------------------------------------------ orphans (§6)

    def _end_orphan(self, job: Job) -> None:
        """§6 for an orphan: stop its agent tree, THEN publish the terminal event."""
        found = job.identity is not None and stop_orphan(job.identity, self.options.cancel_grace_s)
        if job.cancel.is_set():
            terminal = Terminal(EventName.ERROR, DETAIL_CANCELLED, None, JobStatus.CANCELLED)
        else:
            terminal = Terminal(EventName.ERROR,
                                orphans.DETAIL_AGENT_STOPPED if found else orphans.DETAIL_AGENT_LOST, None)
        log.info("job %s: orphaned agent %s; publishing error (%s)", job.job_id,
                 "stopped" if found else "already gone", terminal.detail)
        self.publish_terminal(job, terminal)

    # ------------------------------------------------------------ publishing (§11 step 5)

    def publish_terminal(self, job: Job, terminal: Terminal) -> None:
        """Disk first, then the wire; an agent's own terminal event wins (§11 step 5).

        A disk that refuses the write (ENOSPC, EROFS) does not lose the end: the event is
        signed from the record as it stands (its next seq) and sent at once, then written
        every DISK_RETRY_S until the disk takes it (the same seq: the hub drops the resend
        as a duplicate, §3.2 rule 6) or the runner stops.
        """
        self.beats.remove(job.job_id, job.attempt_id)  # §12: no beat from here on, even if the barrier fails
        try:
            published = self._record_terminal_event(job, terminal)
        except TransitionRefused as exc:
            self._terminal_refused(job, exc)
            return
        except (RegistryError, OSError) as exc:
            log.error("job %s: terminal event %s not written to disk (%s); sent on the wire now, written "
                      "when the disk takes it", job.job_id, terminal.event, exc)
            self._send_unrecorded(job, terminal)
            self._record_when_disk_returns(job, terminal)
            return
        self._send(job.job_id, published)

    def _record_terminal_event(self, job: Job, terminal: Terminal) -> publish.Published:
        return publish.record(self.registry, publish.PublishRequest(
            job_id=job.job_id, event=terminal.event, detail=terminal.detail, attempt_id=job.attempt_id,
            dispatch_token=job.dispatch_token,
            data={**self.logstreams.finish(job.job_id), **(terminal.data or {})}),  # §15 barrier
            source="runner", exit_code=terminal.exit_code,
            status=terminal.status, drain_s=self.options.heartbeat_drain_s)

    @staticmethod
    def _terminal_refused(job: Job, exc: TransitionRefused) -> None:
        if isinstance(exc, Refusal) and exc.reason == "after_terminal":
            log.info("job %s already ended (the agent published its terminal event)", job.job_id)
        else:
            log.warning("job %s: terminal event refused: %s", job.job_id, exc)

    def _send_unrecorded(self, job: Job, terminal: Terminal) -> None:
        """The terminal event and state of `job`, signed from its record (read-only) with the
        next seq, on the wire only: the disk refused them (§4, §11 step 5)."""
        try:
            record = self.registry.get(job.job_id)
        except RegistryError as exc:
            log.error("job %s: record unreadable, terminal event not sent: %s", job.job_id, exc)
            return
        if (record["attempt_id"], record["dispatch_token"]) != (job.attempt_id, job.dispatch_token) \
                or record["status"] in TERMINAL_STATUSES:
            return
        seq = record["last_seq"] + 1
        data = {} if terminal.exit_code is None else {"exit_code": terminal.exit_code}
        event = wire.Event.build(job.job_id, seq, terminal.event, terminal.detail, attempt_id=job.attempt_id,
                                 dispatch_token=job.dispatch_token, session=record.get("session"), data=data)
        status = terminal.status or EVENT_STATUS[EventName(terminal.event)]
        state = wire.State.build(job.job_id, seq, status, terminal.event, attempt_id=job.attempt_id,
                                 dispatch_token=job.dispatch_token)
        token = record["auth_token"]
        self._send(job.job_id, publish.Published(seq, crypto.sign_event(event.to_dict(), token),
                                                 crypto.sign_event(state.to_dict(), token)))

    def _record_when_disk_returns(self, job: Job, terminal: Terminal) -> None:
        """Write the terminal event every DISK_RETRY_S until the disk takes it, then send it again."""
        while not self.stopping.wait(DISK_RETRY_S):
            try:
                published = self._record_terminal_event(job, terminal)
            except TransitionRefused as exc:
                self._terminal_refused(job, exc)
                return
            except (RegistryError, OSError) as exc:
                log.debug("job %s: disk still refuses the terminal event: %s", job.job_id, exc)
                continue
            log.info("job %s: terminal event %s written to disk (seq %d)", job.job_id, terminal.event,
                     published.seq)
            self._send(job.job_id, published)
            return
        log.error("job %s: runner stopping while the disk still refuses its terminal event; its record "
                  "stays open (a restart ends it)", job.job_id)

    def _send(self, job_id: str, published: publish.Published) -> None:
        try:
            publish.send_on(self.client, published)
        except BrokerError as exc:  # on disk already; paho still resends it after a reconnect
            log.warning("job %s seq %d is on disk but not acknowledged by the broker: %s", job_id,
                        published.seq, exc)


def oom_detail(work: wire.Work | None, kills: int) -> str:
    """The terminal detail of an attempt whose processes the OOM killer took (§6 "Limits")."""
    limit = f" of {work.memory_bytes >> 20} MiB" if work is not None and work.memory_bytes else ""
    return f"oom: the job reached its memory limit{limit}; {kills} process(es) killed"


def session_note(started_data: Mapping[str, Any]) -> str:
    """`started`'s detail for an attempt that was to continue a session (§18): `continues session
    S of attempt N` (`, from the hub's transcript` when the hub carried it, `, in a new worktree`
    when attempt N's is not on this runner), or `new session: <why not>`; "" otherwise."""
    continues = started_data.get("continues")
    if isinstance(continues, Mapping):
        how = ", from the hub's transcript" if continues.get("transcript") == "carried" else ""
        where = ", in a new worktree" if started_data.get("new_worktree") else ""
        return f"continues session {continues.get('session_id')} of attempt {continues.get('attempt')}{how}{where}"
    fresh = started_data.get("fresh")
    return wire.safe_line(f"new session: {fresh}", wire.MAX_DETAIL_CHARS) if fresh else ""


def orphan_job(record: Mapping[str, Any], identity: AgentIdentity | None, *,
               cancel_reason: str | None = None) -> Job:
    """The `Job` that holds a slot for an orphan while its agent tree is stopped (§6).

    Args:
        record: this host's registry record of the job; identity: its agent, None when unknown.
        cancel_reason: set when a verified cancel found it (the end is then `cancelled`).
    """
    job = Job(job_id=record["job_id"], attempt_id=record["attempt_id"], dispatch_token=record["dispatch_token"],
              brief="", heartbeat_s=int(record.get("heartbeat_sec") or wire.Contract.heartbeat_sec),
              timeout_s=int(record.get("timeout_sec") or 0), orphan=True, identity=identity)
    if cancel_reason is not None:
        job.request_cancel(cancel_reason)
    return job


__all__ = ["Job", "StopReason", "Supervisor", "Terminal", "final_reason", "orphan_job", "terminal_for"]
