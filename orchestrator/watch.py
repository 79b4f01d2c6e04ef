"""The hub's watcher: liveness clocks (PROTOCOL §10), mirroring accepted events
into the hub registry, and the exit codes of §9. Whether a message is accepted
is `mam.orchestrator.acceptance` (§3.2): refusals are logged on stderr as
`refused message: <reason>`; accepted events go to stdout as JSON lines (a
human view on a TTY).

Clocks (§10): before the first accepted event the ack clock runs, after it the
idle clock (K × N), renewed by every accepted event and by a state only when
its seq is newer than everything accepted (§4); the wall clock runs from the
attempt's creation. While the hub's own broker connection is down the ack and
idle clocks stand still (§14): after the reconnect the retained state is read
and every clock gets a full idle window; only the wall clock runs on (passing
while the broker is unreachable, it closes the job `deadline_timeout`, exit 3).
A watch that cannot reach the broker, at start or for `MAM_HUB_OUTAGE_GIVE_UP_S`,
decides nothing: the record stays open and it exits 3 with a re-attach hint.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import shlex
import sys
import time
from dataclasses import dataclass
from typing import Any, TextIO

from mam.orchestrator.acceptance import (
    AFTER_TERMINAL,
    OF_CURRENT_ATTEMPT,
    Accepted,
    Kind,
    Refused,
    Seen,
    Verdict,
    accept,
)
from mam.orchestrator.control import clear_dispatch, clear_retained, close_remote
from mam.orchestrator.hub import DAY_S, Workspace, open_hub
from mam.orchestrator.logs import LogRouter, OutputView, await_chunks
from mam.orchestrator.mirror import OUTAGE_GIVE_UP_S, BrokerLink, mirror_state, note_late_terminal
from mam.shared import names, wire
from mam.shared.codes import TERMINAL_STATUSES, CloseReason, JobStatus
from mam.shared.config import BrokerConfig, env_float
from mam.shared.crypto import DispatchKeys
from mam.shared.errors import BrokerError, BrokerUnavailable, ConfigError, ExitCode, TransitionRefused, UsageError
from mam.shared.mqtt import MqttClient
from mam.shared.records import HUB_DECISIONS, JobRecord, utc_now
from mam.shared.registry import Registry

log = logging.getLogger("mam.watch")

STATUS_EXIT: dict[str, ExitCode] = {JobStatus.COMPLETED: ExitCode.COMPLETED, JobStatus.ERROR: ExitCode.ERROR,
               JobStatus.CANCELLED: ExitCode.CANCELLED}
REGISTRY_POLL_S = 0.5
# A terminal state waits this long for its terminal event before it resolves the job:
# brokers do not order messages across topics (nats-server delivers each subscription
# on its own), and the event carries what the state lacks (detail, data.exit_code).
STATE_GRACE_S = 1.0
# §6 confirmation: the runner's SIGTERM→SIGKILL grace (MAM_CANCEL_GRACE_S; the runner's
# default, runner.daemon.DEFAULT_CANCEL_GRACE_S) plus a margin for its terminal publish.
CANCEL_GRACE_S = 10.0
CONFIRM_MARGIN_S = 5.0
MIN_WAIT_S = 0.01
# A re-attached watch of a job the hub closed reads the retained messages this long (§14).
LATE_READ_S = 2.0
MAX_OPTION_S = 366 * DAY_S  # a watch option beyond a year is a mistake
CLOCK_CHARS = slice(11, 19)  # HH:MM:SS of a §3 timestamp, for the human view
TOPIC_KINDS: dict[str, Kind] = {"events": "event", "state": "state"}


@dataclass(frozen=True)
class WatchOptions:
    """How long to wait, in seconds; None means the record's contract.

    Args:
        remote: mirror accepted started/terminal events into the hub registry (§10).
        ack_timeout_s: the `started` deadline; idle_timeout_s: K × N; timeout_s: wall clock.
        ack_only_before_first: the dispatch's rule (ack alone before the first event);
            a standalone watch allows ack + idle (it did not publish the dispatch).
    """

    remote: bool = False
    ack_timeout_s: float | None = None
    idle_timeout_s: float | None = None
    timeout_s: float | None = None
    ack_only_before_first: bool = False


class Detached(Exception):
    """Ctrl-C: the job keeps running."""


def _wall_deadline(record: JobRecord, timeout_s: float) -> float:
    """The wall-clock deadline of §10 on the monotonic clock, from the record's creation."""
    try:  # a redispatched attempt gets its own budget (§10: "timeout_sec after the dispatch")
        created = wire.parse_ts(record.get("attempt_created_at") or record["created_at"]).timestamp()
    except (KeyError, ValueError, TypeError):
        created = time.time()
    return time.monotonic() + max(0.0, created + timeout_s - time.time())


class Watcher:
    """Watch one job until it ends (§3.2, §4, §10).

    Args:
        registry: the hub `Registry` holding the job (for its auth_token).
        job_id: the job.
        client: a connected `MqttClient`, or None to connect here.
        config: the BrokerConfig used when `client` is None (default: the client's).
        options: `WatchOptions`.
        keys: `DispatchKeys` to publish a cancel on close (None: hub-only close).
        out: where accepted events go (stdout).
    Raises:
        UsageError: a bad job id. TypeError: neither `client` nor `config`.
    """

    def __init__(self, registry: Registry, job_id: str, *, client: MqttClient | None = None,
                 config: BrokerConfig | None = None, options: WatchOptions = WatchOptions(),
                 keys: DispatchKeys | None = None, out: TextIO | None = None, show_log: bool = True) -> None:
        self.registry = registry
        self.job_id = names.validate_job_id(job_id)
        self.client = client
        if config is None:
            if client is None:
                raise TypeError("Watcher needs a connected client or a broker config")
            config = client.config
        self.config = config
        self.options = options
        self.keys = keys
        self.out = out if out is not None else sys.stdout
        self.human = hasattr(self.out, "isatty") and self.out.isatty()
        self.highest_event = 0
        self.highest_any = 0
        self.accepted_any = False
        self.terminal: str | None = None
        self.refusals: list[str] = []
        self._terminal_state: wire.State | None = None  # a terminal §4 state waiting for its event
        self.runner_ended = False  # a verified terminal event or state of the current attempt
        self._terminal_state_at = 0.0
        self._owns_client = False
        self._subscribed = False
        self.logs = LogRouter(registry, job_id=self.job_id)  # §15: the hub's copy of the output
        self.output = OutputView(self.out) if show_log else None  # ... shown under the events (human view)
        self.log_chunks: object = None  # `data.log_chunks` of the terminal event

    # ---------------------------------------------------------------- output

    def _show(self, parts: list[bytes]) -> None:
        if parts and self.output is not None and self.human:
            self.output.show(parts)

    def _emit(self, payload: dict[str, Any]) -> None:
        if self.human:
            data = payload.get("data", {})
            stamp = str(payload.get("timestamp", ""))[CLOCK_CHARS]
            extra = f" (exit {data['exit_code']})" if "exit_code" in data else ""
            self.out.write(f"{stamp} {payload['job_id']} #{payload['seq']:<4} {payload['event']:<20} "
                           f"{payload.get('detail', '')}{extra}\n")
        else:
            self.out.write(json.dumps(payload, sort_keys=True) + "\n")
        self.out.flush()

    def _refuse(self, reason: str, detail: str = "", *, quiet: bool = False) -> None:
        self.refusals.append(reason)
        # an earlier attempt's straggler is expected after a redispatch: quiet (§3.2 rule 5)
        log.log(logging.DEBUG if quiet else logging.WARNING, "job %s: refused message: %s%s",
                self.job_id, reason, f" ({detail})" if detail else "")

    # ------------------------------------------------------------ acceptance

    def handle(self, topic: str, raw: bytes) -> bool:
        """Judge one message by §3.2 (`acceptance.accept`) and act on the verdict.

        Returns:
            True when it renewed liveness (§10).
        Raises:
            RegistryError: the hub record cannot be read or written.
        """
        if len(raw) == 0:
            return False  # §3.2 rule 1, before anything is read
        parsed = names.parse_job_topic(topic, self.config.topic_root)
        if parsed is not None and parsed[1] == "log":  # §15: output, not liveness
            self._show(self.logs.handle(raw))
            return False
        kind = TOPIC_KINDS.get(parsed[1] if parsed else "")
        if kind is None:
            return False
        if self.options.remote:
            verdict = self._accept_and_mirror(raw, kind)
        else:
            verdict = accept(raw, kind=kind, job_id=self.job_id, record=self.registry.get(self.job_id),
                             seen=Seen(self.highest_event, self.terminal, self.highest_any))
        if isinstance(verdict, Refused):
            if verdict.silent:
                return False
            if verdict.reason in OF_CURRENT_ATTEMPT and verdict.message is not None and verdict.message.terminal:
                self.runner_ended = True  # the runner reported its end of this attempt (§6 confirmation)
            self._refuse(verdict.reason, verdict.detail, quiet=verdict.earlier)
            if self.options.remote and verdict.reason == AFTER_TERMINAL:
                self._resolve_from_record()
            return False
        message = verdict.message
        if message.terminal:
            self.runner_ended = True
        if verdict.gap is not None and not self.options.remote:
            self._audit_gap(*verdict.gap)  # the registry logged it with the message when mirroring
        if isinstance(message, wire.State):
            return self._handle_state(message)
        if message.event == "started" and self.options.remote:
            self._clear_dispatch()
        self.highest_event = message.seq
        self.highest_any = max(self.highest_any, message.seq)
        self.accepted_any = True
        self._emit(message.to_dict())
        if message.terminal:
            self.log_chunks = message.data.get("log_chunks")
            self.terminal = JobStatus.COMPLETED if message.event == "completed" else JobStatus.ERROR
            if self.options.remote:
                self._resolve_from_record()
        return True

    def _accept_and_mirror(self, raw: bytes, kind: Kind) -> Verdict:
        """§3.2 against the hub record under the registry lock, and store what it
        implies (§10): an accepted event; a newer state's seq (and `pending` →
        `running` when it says the attempt runs); a late terminal (§14)."""
        moved_to_running = False
        with self.registry.transaction(self.job_id) as txn:
            seen = Seen(self.highest_event, self.terminal, self.highest_any).merged(Seen.of_record(txn.record))
            verdict = accept(raw, kind=kind, job_id=self.job_id, record=txn.record, seen=seen)
            if isinstance(verdict, Accepted) and isinstance(verdict.message, wire.Event):
                txn.store_event(verdict.message.to_dict(), source="remote_mirror", gap=verdict.gap)
            elif isinstance(verdict, Accepted) and isinstance(verdict.message, wire.State):
                moved_to_running = mirror_state(txn, verdict.message, verdict.gap)
            elif isinstance(verdict, Refused) and verdict.reason == AFTER_TERMINAL and verdict.message is not None:
                note_late_terminal(txn, verdict.message)
        if moved_to_running:
            self._clear_dispatch()
        return verdict

    def _clear_dispatch(self) -> None:
        """§17: the attempt started, so its retained dispatch goes (a crashed broker
        may bring a cleared one back; the runners refuse it as `taken`)."""
        client = self.client
        if client is None or not client.connected.is_set():
            return
        try:
            clear_dispatch(client, self.job_id)
        except BrokerError as exc:
            log.warning("job %s: the retained dispatch was not cleared: %s", self.job_id, exc)

    def _handle_state(self, message: wire.State) -> bool:
        newer = message.seq > self.highest_any
        if newer:
            self.highest_any = message.seq
            self.accepted_any = True
        if message.terminal and self.terminal is None and self._terminal_state is None:
            self._terminal_state = message
            self._terminal_state_at = time.monotonic()
        return newer

    def _settle_state(self, message: wire.State) -> None:
        """Resolve the job from a terminal state whose event did not come (§4)."""
        status = message.status
        if self.options.remote:
            self._mirror_terminal_state(message)
            status = self.registry.get(self.job_id)["status"]
        self.terminal = status
        log.info("job %s resolved from the retained state: %s", self.job_id, status)

    def _mirror_terminal_state(self, message: wire.State) -> None:
        try:
            self.registry.transition(self.job_id, message.status if message.status != "cancelled" else "error",
                                     source="remote_mirror", reason="retained terminal state",
                                     attempt_id=message.attempt_id, dispatch_token=message.dispatch_token,
                                     last_seq=message.seq)
        except TransitionRefused as exc:
            log.info("job %s: terminal state not mirrored: %s", self.job_id, exc)

    def _confirm_cancel(self) -> None:
        """§6: the hub clears the retained cancel once the job is over on both
        sides. Wait up to the runner's cancel grace + 5 s for its terminal event
        or state, then clear the control; without a confirmation it stays
        retained for a runner that reconnects (and `mam-orch gc` clears it later)."""
        client = self.client
        if not self.options.remote or client is None:
            return
        deadline = time.monotonic() + env_float("MAM_CANCEL_GRACE_S", CANCEL_GRACE_S) + CONFIRM_MARGIN_S
        while not self.runner_ended and time.monotonic() < deadline:
            try:
                message = client.messages.get(timeout=max(MIN_WAIT_S, deadline - time.monotonic()))
            except queue.Empty:
                break
            self.handle(message.topic, message.payload)
        if not self.runner_ended:
            log.info("job %s: no confirmation from the runner yet; the cancel stays retained", self.job_id)
            return
        try:
            clear_retained(client, names.control_topic(self.job_id, self.config.topic_root))
        except BrokerError as exc:
            log.warning("job %s: the retained cancel was not cleared: %s", self.job_id, exc)

    def _resolve_from_record(self) -> None:
        status = self.registry.get(self.job_id)["status"]
        if status in TERMINAL_STATUSES:
            self.terminal = status

    def _audit_gap(self, expected: int, got: int) -> None:
        self.registry.append_audit(self.job_id, {"event": "seq_gap", "timestamp": utc_now(),
                                                 "expected": expected, "got": got, "source": "watch"})

    # ---------------------------------------------------------------- loop

    def _connect(self) -> bool:
        if self.client is None:
            client = MqttClient(self.config, "watch")
            try:
                client.connect()
            except BrokerUnavailable as exc:
                client.close()
                log.error("broker unreachable: %s", exc)
                return False
            self.client = client
            self._owns_client = True
        try:
            self.client.subscribe([(names.events_topic(self.job_id, self.config.topic_root), 1),
                                   (names.state_topic(self.job_id, self.config.topic_root), 1),
                                   (names.log_topic(self.job_id, self.config.topic_root), 1)])
        except Exception as exc:  # noqa: BLE001 - any broker failure here is "unreachable"
            log.error("cannot subscribe: %s", exc)
            return False
        log.info("job %s: subscribed to its events and state", self.job_id)
        return True

    def subscribe(self) -> bool:
        """Connect (when no client was given) and subscribe to the job's events
        and state. `mam-orch dispatch` calls it BEFORE publishing the dispatch,
        so no event can slip between the publish and the subscription; `run()`
        then does not subscribe again.

        Returns:
            False when the broker is unreachable or refused the subscription.
        """
        self._subscribed = self._connect()
        return self._subscribed

    def _read_late_terminal(self) -> None:
        """§14 "Late terminals": re-attached to a job the hub closed itself, read the
        job's retained state (and any event) for `LATE_READ_S`; a terminal of the
        attempt is recorded as `late_outcome` (the status stays, §8)."""
        try:
            if not self.subscribe() or self.client is None:
                return
            deadline = time.monotonic() + LATE_READ_S
            while time.monotonic() < deadline:
                try:
                    message = self.client.messages.get(timeout=max(MIN_WAIT_S, deadline - time.monotonic()))
                except queue.Empty:
                    break
                self.handle(message.topic, message.payload)
        finally:
            if self._owns_client and self.client is not None:
                self.client.close()
                self.client, self._owns_client, self._subscribed = None, False, False
        late = self.registry.get(self.job_id).get("late_outcome")
        if late:
            print(f"job {self.job_id}: the hub closed it, but its runner later reported {late} "
                  f"(late_outcome; the record keeps its status)", file=sys.stderr)

    def _finish_from_disk(self, why: str) -> int:
        """Disk fallback (§10): the hub's own record decides; else exit 3."""
        status = self.registry.get(self.job_id)["status"]
        if status in TERMINAL_STATUSES:
            log.info("job %s is %s on disk (%s)", self.job_id, status, why)
            return _exit_of(status)
        log.error("job %s: %s; the hub record says %s", self.job_id, why, status)
        return ExitCode.BROKER

    def _close(self, close_reason: str) -> int:
        connected = self.client is not None and self.client.connected.is_set()
        record = close_remote(self.registry, self.client if connected else None, self.keys,
                              self.job_id, close_reason)
        if record.get("close_reason") != close_reason:
            return _exit_of(record["status"])  # it ended some other way first
        log.error("job %s closed: %s", self.job_id, close_reason)
        if not connected:
            return ExitCode.BROKER
        return ExitCode.ERROR if close_reason == CloseReason.AGENT_BLOCKED else ExitCode.TIMEOUT

    def run(self) -> int:
        """Watch until the job ends; returns the exit code of §9.

        Raises:
            Detached: on KeyboardInterrupt (the job keeps running).
            RegistryError: the hub record cannot be read.
        """
        record = self.registry.get(self.job_id)
        if record["status"] in TERMINAL_STATUSES:
            if self.options.remote and record.get("close_reason") in HUB_DECISIONS and not record.get("late_outcome"):
                self._read_late_terminal()
            return self._finish_from_disk("already terminal")
        opts = self.options
        ack_s = float(opts.ack_timeout_s if opts.ack_timeout_s is not None else record["ack_timeout_sec"])
        idle_s = float(opts.idle_timeout_s if opts.idle_timeout_s is not None else record["idle_timeout_sec"])
        wall_s = float(opts.timeout_s if opts.timeout_s is not None else record["timeout_sec"])
        try:
            if not self._subscribed and not self.subscribe():
                return self._finish_from_disk("broker unreachable")
            client = self.client
            if client is None:  # subscribe() connected one
                return self._finish_from_disk("broker unreachable")
            start = time.monotonic()
            wall_deadline = _wall_deadline(record, wall_s)
            first_deadline = start + (ack_s if opts.ack_only_before_first else ack_s + idle_s)
            if record["status"] == JobStatus.RUNNING:
                first_deadline = start + idle_s  # re-attached to a running job: no ack phase
            last_alive = start
            next_poll = start
            link = BrokerLink(client)
            give_up_s = max(idle_s, env_float("MAM_HUB_OUTAGE_GIVE_UP_S", OUTAGE_GIVE_UP_S))
            while self.terminal is None:
                now = time.monotonic()
                outage = link.look(now)
                if outage is not None:  # §14: the clocks stood still; a full idle window from now
                    first_deadline = max(first_deadline + outage, now + idle_s)
                    last_alive = now
                    log.info("job %s: broker connection back after %.1f s; the idle clock restarts",
                             self.job_id, outage)
                if link.down_since is not None:
                    if now >= wall_deadline:
                        return self._close(CloseReason.DEADLINE_TIMEOUT)
                    if now >= link.down_since + give_up_s:
                        log.error("job %s: the broker was unreachable for %.0f s; giving up, the job "
                                  "stays %s", self.job_id, now - link.down_since,
                                  self.registry.get(self.job_id)["status"])
                        return ExitCode.BROKER
                if now >= next_poll:
                    next_poll = now + REGISTRY_POLL_S
                    self._resolve_from_record()  # e.g. `mam-orch cancel` from another shell
                    if self.terminal is not None:
                        break
                pending_state = self._terminal_state
                if pending_state is not None and now >= self._terminal_state_at + STATE_GRACE_S:
                    self._settle_state(pending_state)
                    break
                deadline = min(wall_deadline, (last_alive + idle_s) if self.accepted_any else first_deadline)
                if pending_state is not None:
                    deadline = min(deadline, self._terminal_state_at + STATE_GRACE_S)
                if link.down_since is not None:  # only the wall clock runs while the broker is away
                    deadline = min(wall_deadline, link.down_since + give_up_s)
                if now >= deadline and pending_state is None and link.down_since is None:
                    if now >= wall_deadline:
                        return self._close(CloseReason.DEADLINE_TIMEOUT)
                    if not self.accepted_any and record["status"] == JobStatus.PENDING and \
                            self.registry.get(self.job_id)["status"] == JobStatus.PENDING:
                        return self._close(CloseReason.AGENT_BLOCKED)
                    return self._close(CloseReason.DEADLINE_TIMEOUT)
                try:
                    message = client.messages.get(timeout=max(MIN_WAIT_S, min(deadline, next_poll) - now))
                except queue.Empty:
                    continue
                if self.handle(message.topic, message.payload):
                    last_alive = time.monotonic()
            self._show(await_chunks(self.logs, self.job_id, self.log_chunks, client.messages, self.handle))
            if self.output is not None and self.human:
                self.output.flush()
            if self.terminal == JobStatus.CANCELLED:
                self._confirm_cancel()
            return _exit_of(self.terminal)
        except KeyboardInterrupt:
            raise Detached(self.job_id) from None
        finally:
            if self._owns_client and self.client is not None:
                self.client.close()


def _exit_of(status: str | None) -> int:
    """The §9 exit code of a terminal status (1 for anything else)."""
    return STATUS_EXIT.get(status or "", ExitCode.ERROR)


def _where(workspace: Workspace) -> str:
    return f" --workspace {shlex.quote(os.fspath(workspace))}" if workspace is not None else ""


def detach_hint(job_id: str, workspace: Workspace = None) -> str:
    """What Ctrl-C prints (§10): how to re-attach or cancel."""
    return (f"detached from job {job_id}; it keeps running. Re-attach: mam-orch watch {job_id}{_where(workspace)}  "
            f"Cancel: mam-orch cancel {job_id}{_where(workspace)}")


def reattach_hint(registry: Registry, job_id: str, workspace: Workspace = None) -> str | None:
    """What a watch that gave up on the broker (exit 3) prints when the job is
    still open (§14): its status and how to re-attach; None when it is closed."""
    status = registry.get(job_id)["status"]
    if status in TERMINAL_STATUSES:
        return None
    return (f"job {job_id} is still {status} (the broker is unreachable; nothing was decided). "
            f"Re-attach: mam-orch watch {job_id}{_where(workspace)}")


def watch_cli(job_id: str, *, workspace: Workspace, remote: bool, idle_timeout_s: float | None,
              ack_timeout_s: float | None, timeout_s: float | None) -> int:
    """`mam-orch watch`: returns the exit code of §9 (130 when detached with Ctrl-C).

    Raises:
        UsageError, EnvFileError, ConfigError, RegistryError.
    """
    names.validate_job_id(job_id)
    for name, value in (("--idle-timeout", idle_timeout_s), ("--ack-timeout", ack_timeout_s),
                        ("--timeout", timeout_s)):
        if value is not None and not 0 < value <= MAX_OPTION_S:
            raise UsageError(f"{name} {value:g} is invalid: expected seconds > 0")
    hub = open_hub(workspace)
    record = hub.registry.get(job_id)
    remote = remote or record.get("transport") == "remote" and record.get("role") == "hub"
    cfg = hub.broker_config(record)
    keys = None
    if remote:
        try:
            keys = hub.keys()
        except ConfigError as exc:
            log.warning("%s; a close will not publish a cancel", exc)
    watcher = Watcher(hub.registry, job_id, config=cfg, keys=keys,
                      options=WatchOptions(remote=remote, ack_timeout_s=ack_timeout_s,
                                           idle_timeout_s=idle_timeout_s, timeout_s=timeout_s))
    try:
        code = watcher.run()
    except Detached:
        print(detach_hint(job_id, workspace), file=sys.stderr)
        return ExitCode.DETACHED
    hint = reattach_hint(hub.registry, job_id, workspace) if code == ExitCode.BROKER else None
    if hint is not None:
        print(hint, file=sys.stderr)
    return code
