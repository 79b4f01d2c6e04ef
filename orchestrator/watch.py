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
import queue
import sys
import time
from collections.abc import Callable
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
from mam.orchestrator.hub import DAY_S
from mam.orchestrator.identity.roster import Revocations
from mam.orchestrator.logs import LogRouter, OutputView, await_chunks
from mam.orchestrator.mirror import OUTAGE_GIVE_UP_S, BrokerLink, mirror_state, note_late_terminal
from mam.orchestrator.results import RESULT_SETTLE_S, ResultInbox, result_arrived
from mam.shared.cli.render import printable
from mam.shared.config import BrokerConfig, env_float
from mam.shared.protocol import names, wire
from mam.shared.protocol.codes import (
    EVENT_STATUS,
    TERMINAL_STATUSES,
    UNPUBLISHED_STATUSES,
    CloseReason,
    EventName,
    JobStatus,
)
from mam.shared.protocol.crypto import DispatchKeys
from mam.shared.protocol.errors import BrokerError, BrokerUnavailable, ExitCode, TransitionRefused
from mam.shared.store.records import HUB_DECISIONS, STATUS_EXIT, JobRecord, exit_code_of, redact, utc_now
from mam.shared.store.registry import Registry
from mam.shared.transport import Transport, mqtt

log = logging.getLogger("mam.watch")

REGISTRY_POLL_S = 0.5
# A terminal state waits this long for its terminal event before it resolves the job: brokers do not order
# messages across topics (nats delivers each subscription on its own); the event has detail, data.exit_code.
STATE_GRACE_S = 1.0
# §6 confirmation: the runner's SIGTERM→SIGKILL grace (MAM_CANCEL_GRACE_S; runner default) + a publish margin.
CANCEL_GRACE_S = 10.0
CONFIRM_MARGIN_S = 5.0
MIN_WAIT_S = 0.01
PROOF_LOOK_S = 0.1
"""How often a watch past a deadline looks again while its link's proof is on the way (§10),
seconds: the service's tick; the clocks never close before the proof, so sooner buys nothing."""
# A re-attached watch of a job the hub closed reads the retained messages this long (§14).
LATE_READ_S = 2.0
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
        lazy_progress: the service's rule (docs/registry.md "Durability"): an accepted event that
            changes no status, skips no seq and names no agent session (`data.agent`, §18) is
            appended without fsync, its seq kept in memory.
    """

    remote: bool = False
    ack_timeout_s: float | None = None
    idle_timeout_s: float | None = None
    timeout_s: float | None = None
    ack_only_before_first: bool = False
    lazy_progress: bool = False


def render_event(payload: dict[str, Any], human: bool) -> str:
    """One accepted event as `watch` prints it: a JSON line, or a human line for a TTY."""
    if not human:  # tokens masked as `show` does (a dispatch token in clear helps a forger)
        return json.dumps(redact(payload), sort_keys=True) + "\n"
    data = payload.get("data", {})
    stamp = str(payload.get("timestamp", ""))[CLOCK_CHARS]
    extra = f" (exit {data['exit_code']})" if "exit_code" in data else ""
    if payload.get("event") == EventName.PERMISSION_REQUIRED and "request_id" in data:  # §19: how to answer
        extra = (f": {printable(str(data.get('input', '')))} (request {printable(str(data['request_id']))}; "
                 f"answer with mam-orch approve|deny {payload['job_id']})")
    return (f"{stamp} {payload['job_id']} #{payload['seq']:<4} {payload['event']:<20} "
            f"{payload.get('detail', '')}{extra}\n")


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
        client: a connected `Transport`, or None to connect here.
        config: the BrokerConfig used when `client` is None (default: the client's).
        options: `WatchOptions`.
        keys: `DispatchKeys` to publish a cancel on close (None: hub-only close).
        out: where accepted events go (stdout).
        results: where the job's result chunks go (§18) when this watch is the only hub
            process: it then subscribes to them and, after the end, waits for the result the
            terminal event announced (at most RESULT_SETTLE_S); None: another process takes them.
    Raises:
        UsageError: a bad job id. TypeError: neither `client` nor `config`.
    """

    def __init__(self, registry: Registry, job_id: str, *, client: Transport | None = None,
                 config: BrokerConfig | None = None, options: WatchOptions = WatchOptions(),
                 keys: DispatchKeys | None = None, out: TextIO | None = None, show_log: bool = True,
                 results: ResultInbox | None = None) -> None:
        self.registry = registry
        self.results = results
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
        self.highest_event = self.highest_any = 0
        self.missing: frozenset[int] = frozenset()  # event seqs skipped, not yet arrived (§3.2 rule 6)
        self._mirrored_status: str | None = None  # the record's status after the last mirroring transaction
        self.accepted_any = False
        self.terminal: str | None = None
        self.refusals: list[str] = []
        self._terminal_state: wire.State | None = None  # a terminal §4 state waiting for its event
        self.runner_ended = False  # a verified terminal event or state of the current attempt
        # the record as `tick` read or wrote it when it returned an exit code (the service uses it)
        self.ended_record: JobRecord | None = None
        self._terminal_state_at = 0.0
        self._owns_client = False
        self._subscribed = False
        self.ack_s = self.idle_s = 0.0  # the clocks (§10), set by start_clocks
        self.wall_deadline = self.first_deadline = self.last_alive = self.next_poll = 0.0
        # until when (monotonic) `tick` has nothing to decide: the service's cache of `next_wake`,
        # reset by every entry that can move a clock or end the job (a message, a refresh), which
        # also tells `on_wake` (the service's schedule of whom its tick looks at)
        self.asleep_until = 0.0
        self.on_wake: Callable[[str], object] | None = None
        self.started_status = self.session = ""  # session: whose revocation closes the job (§16)
        self.attempt_id = 0
        self.revocations = Revocations(registry.root)  # the service shares one among its watchers
        # §14 hooks of the dispatch process: messages on other topics (presence), and
        # whether the runner was lost (an idle close is then `runner_lost`)
        self.on_other: Callable[[str, bytes], object] | None = None
        self.runner_lost: Callable[[], bool] | None = None
        self.logs = LogRouter(registry, job_id=self.job_id)  # §15: the hub's copy of the output
        self.output = OutputView(self.out) if show_log else None  # ... shown under the events (human view)
        self.log_chunks: object = None  # `data.log_chunks` of the terminal event
        # the service clears retained dispatches in bulk after a pass (`HubService.flush_clears`)
        self.on_clear: Callable[[str], object] | None = None

    # ---------------------------------------------------------------- output

    def _show(self, parts: list[bytes]) -> None:
        if parts and self.output is not None and self.human:
            self.output.show(parts)

    def _emit(self, payload: dict[str, Any]) -> None:
        self.out.write(render_event(payload, self.human))
        self.out.flush()

    def _refuse(self, reason: str, detail: str = "", *, quiet: bool = False) -> None:
        self.refusals.append(reason)
        log.log(logging.DEBUG if quiet else logging.WARNING, "job %s: refused message: %s%s",
                self.job_id, reason, f" ({detail})" if detail else "")

    # ------------------------------------------------------------ acceptance

    def _wake(self) -> None:
        """Something may have moved a clock or ended the job: `tick` looks at it next time."""
        self.asleep_until = 0.0
        if self.on_wake is not None:
            self.on_wake(self.job_id)

    def handle(self, topic: str, raw: bytes) -> bool:
        """Judge one message by §3.2 (`acceptance.accept`) and act on the verdict;
        an accepted one renews the idle clock (§10).

        Returns:
            True when it renewed liveness (§10).
        Raises:
            RegistryError: the hub record cannot be read or written.
        """
        self._wake()
        renewed = self._judge(topic, raw)
        if renewed:
            self.last_alive = time.monotonic()
        return renewed

    def _judge(self, topic: str, raw: bytes) -> bool:
        if len(raw) == 0:
            return False  # §3.2 rule 1, before anything is read
        parsed = names.parse_job_topic(topic, self.config.topic_root)
        if parsed is not None and parsed[1] == "log":  # §15: output, not liveness
            self._show(self.logs.handle(raw))
            return False
        if parsed is not None and parsed[1] == "result" and self.results is not None:  # §18: not liveness
            self.results.handle(raw)
            return False
        kind = TOPIC_KINDS.get(parsed[1] if parsed else "")
        if kind is None:
            if self.on_other is not None:
                self.on_other(topic, raw)
            return False
        revoked_at = self.revocations.revoked_at(self.session, fresh=True)  # §16.7: its notice may have caused this
        if revoked_at is not None:  # §16: a revoked runner's events and states are refused
            self._refuse("runner revoked", f"{self.session} at {revoked_at}")
            return False
        if self.options.remote:
            verdict = self._accept_and_mirror(raw, kind)
        else:
            verdict = accept(raw, kind=kind, job_id=self.job_id, record=self.registry.get(self.job_id),
                             seen=Seen(self.highest_event, self.terminal, self.highest_any, self.missing))
        if isinstance(verdict, Refused):
            if verdict.silent:
                return False
            confirms = verdict.reason in OF_CURRENT_ATTEMPT and verdict.message is not None \
                and verdict.message.terminal
            if confirms:
                self.runner_ended = True  # the runner reported its end of this attempt (§6 confirmation)
            # an earlier attempt's straggler, or the runner's end after a cancel: expected, logged quietly
            self._refuse(verdict.reason, verdict.detail,
                         quiet=verdict.earlier or (confirms and self.terminal == JobStatus.CANCELLED))
            if self.options.remote and verdict.reason == AFTER_TERMINAL:
                self._resolve_from_record(self._mirrored_status)
            return False
        message = verdict.message
        if verdict.late:  # overtaken on the wire by a higher seq (§3.2 rule 6)
            log.info("job %s: event seq %d (%s) arrived after higher seqs: accepted late", self.job_id,
                     message.seq, message.event)
        if message.terminal:
            self.runner_ended = True
        if verdict.gap is not None and not self.options.remote:
            self._audit_gap(*verdict.gap)  # the registry logged it with the message when mirroring
        if isinstance(message, wire.State):
            return self._handle_state(message)
        if message.event == "started" and self.options.remote:
            self._clear_dispatch()
        self.highest_event = max(self.highest_event, message.seq)  # a late one (§3.2 rule 6) lowers nothing
        if verdict.missing is not None:
            self.missing = frozenset(verdict.missing)
        self.highest_any = max(self.highest_any, message.seq)
        self.accepted_any = True
        self._emit(message.to_dict())
        if message.terminal:
            self.log_chunks = message.data.get("log_chunks")
            self.terminal = JobStatus.COMPLETED if message.event == "completed" else JobStatus.ERROR
            if self.options.remote:
                self._resolve_from_record(self._mirrored_status)
        return True

    def _accept_and_mirror(self, raw: bytes, kind: Kind) -> Verdict:
        """§3.2 against the hub record under the registry lock, and store what it
        implies (§10): an accepted event; a newer state's seq (and `pending` →
        `running` when it says the attempt runs); a late terminal (§14)."""
        moved_to_running = False
        with self.registry.transaction(self.job_id) as txn:
            seen = Seen(self.highest_event, self.terminal, self.highest_any).merged(Seen.of_record(txn.record))
            verdict = accept(raw, kind=kind, job_id=self.job_id, record=txn.record, seen=seen)
            if isinstance(verdict, Accepted) and isinstance(verdict.message, wire.Event) \
                    and self.options.lazy_progress and verdict.gap is None and verdict.missing is None \
                    and verdict.message.event not in EVENT_STATUS and "agent" not in verdict.message.data:
                self.registry.append_audit(self.job_id, verdict.message.to_dict(), durable=False)
            elif isinstance(verdict, Accepted) and isinstance(verdict.message, wire.Event):
                txn.store_event(verdict.message.to_dict(), source="remote_mirror", gap=verdict.gap,
                                missing=verdict.missing)
            elif isinstance(verdict, Accepted) and isinstance(verdict.message, wire.State):
                moved_to_running = mirror_state(txn, verdict.message, verdict.gap)
            elif isinstance(verdict, Refused) and verdict.reason == AFTER_TERMINAL and verdict.message is not None:
                note_late_terminal(txn, verdict.message)
        self._mirrored_status = (txn.new if txn.new is not None else txn.record)["status"]
        if moved_to_running:
            self._clear_dispatch()
        return verdict

    def _clear_dispatch(self) -> None:
        """§17: the attempt started, so its retained dispatch goes (a crashed broker
        may bring a cleared one back; the runners refuse it as `taken`)."""
        if self.on_clear is not None:
            self.on_clear(self.job_id)
            return
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

    def confirm_deadline(self, now: float) -> float:
        """§6: how long the hub waits for the runner to confirm a cancel: its cancel
        grace (MAM_CANCEL_GRACE_S) + 5 s from `now` (monotonic)."""
        return now + env_float("MAM_CANCEL_GRACE_S", CANCEL_GRACE_S) + CONFIRM_MARGIN_S

    def finish_confirm(self) -> None:
        """§6: clear the retained cancel once the runner confirmed the end (its
        terminal event or state); without a confirmation it stays retained for a
        runner that reconnects (and `mam-orch gc` clears it later)."""
        client = self.client
        if not self.runner_ended or client is None:
            log.info("job %s: no confirmation from the runner yet; the cancel stays retained", self.job_id)
            return
        try:
            clear_retained(client, names.control_topic(self.job_id, self.config.topic_root))
        except BrokerError as exc:
            log.warning("job %s: the retained cancel was not cleared: %s", self.job_id, exc)

    def _confirm_cancel(self) -> None:
        """§6: wait up to `confirm_deadline` for the runner's terminal, then `finish_confirm`."""
        client = self.client
        if not self.options.remote or client is None:
            return
        deadline = self.confirm_deadline(time.monotonic())
        while not self.runner_ended and time.monotonic() < deadline:
            try:
                message = client.messages.get(timeout=max(MIN_WAIT_S, deadline - time.monotonic()))
            except queue.Empty:
                break
            self.handle(message.topic, message.payload)
        self.finish_confirm()

    def refresh(self) -> None:
        """Take the hub record's word when it is terminal (a cancel from another shell)."""
        self._wake()
        self._resolve_from_record()

    def _resolve_from_record(self, status: str | None = None) -> None:
        """Take a terminal status of the hub record; `status`: the record's as the last
        mirroring transaction left it (not read again), None: read it now."""
        status = status if status is not None else self.registry.get(self.job_id)["status"]
        if status in TERMINAL_STATUSES:
            self.terminal = status

    def _terminal_exit(self) -> int:
        """The §9 exit code once `terminal` is known: the record's (`exit_code_of`) when it
        is terminal on disk, else the terminal event's status (a watch that mirrors nothing)."""
        record = self.ended_record = self.registry.get(self.job_id)
        if record["status"] in TERMINAL_STATUSES:
            return exit_code_of(record)
        return STATUS_EXIT.get(self.terminal or "", ExitCode.ERROR)

    def _audit_gap(self, expected: int, got: int) -> None:
        self.registry.append_audit(self.job_id, {"event": "seq_gap", "timestamp": utc_now(),
                                                 "expected": expected, "got": got, "source": "watch"})

    # ---------------------------------------------------------------- loop

    def _connect(self) -> bool:
        if self.client is None:
            client = mqtt.new_client(self.config, "watch")
            try:
                client.connect()
            except BrokerUnavailable as exc:
                client.close()
                log.error("broker unreachable: %s", exc)
                return False
            self.client = client
            self._owns_client = True
        try:
            root = self.config.topic_root
            topics = [names.events_topic(self.job_id, root), names.state_topic(self.job_id, root),
                      names.log_topic(self.job_id, root)]
            if self.results is not None:
                topics.append(names.result_topic(self.job_id, root))
            self.client.subscribe([(topic, 1) for topic in topics])
        except Exception as exc:  # noqa: BLE001 - any broker failure here is "unreachable"
            log.error("cannot subscribe: %s", exc)
            return False
        # on a pipe tests wait on this line; a human view (a TTY) logs WARNING and up only
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

    def _await_result(self, messages: Any) -> None:
        """After the end (§18): handle messages until the result the terminal event announced
        is in, at most RESULT_SETTLE_S (then `mam-orch serve` receives it later)."""
        deadline = time.monotonic() + RESULT_SETTLE_S
        while not result_arrived(self.registry, self.job_id):
            left = deadline - time.monotonic()
            if left <= 0:
                log.warning("job %s: its result has not arrived in %g s; `mam-orch serve` receives it later",
                            self.job_id, RESULT_SETTLE_S)
                return
            try:
                message = messages.get(timeout=min(left, REGISTRY_POLL_S))  # or another process wrote it
            except queue.Empty:
                continue
            self.handle(message.topic, message.payload)

    def _wait_unqueued(self) -> JobRecord:
        """§14: a blocked or queued job has no clock yet; wait until whoever queued it publishes
        (or closes) it.

        Raises:
            Detached: on KeyboardInterrupt.
        """
        log.info("job %s is not published yet; waiting for its dispatch", self.job_id)
        try:
            while True:
                record = self.registry.get(self.job_id)
                if record["status"] not in UNPUBLISHED_STATUSES:
                    return record
                time.sleep(REGISTRY_POLL_S)
        except KeyboardInterrupt:
            raise Detached(self.job_id) from None

    def _finish_from_disk(self, why: str) -> int:
        """Disk fallback (§10): the hub's own record decides; else exit 3."""
        record = self.registry.get(self.job_id)
        status = record["status"]
        if status in TERMINAL_STATUSES:
            log.info("job %s is %s on disk (%s)", self.job_id, status, why)
            return exit_code_of(record)
        log.error("job %s: %s; the hub record says %s", self.job_id, why, status)
        return ExitCode.BROKER

    def _close(self, close_reason: str) -> int:
        connected = self.client is not None and self.client.connected.is_set()
        record = self.ended_record = close_remote(self.registry, self.client if connected else None, self.keys,
                                                  self.job_id, close_reason)
        if record.get("close_reason") != close_reason:
            return exit_code_of(record)  # it ended some other way first
        if not self.options.lazy_progress:  # the hub engine notes it for every follower instead
            log.error("job %s closed: %s", self.job_id, close_reason)
        if not connected:
            return ExitCode.BROKER
        return ExitCode.ERROR if close_reason == CloseReason.AGENT_BLOCKED else ExitCode.TIMEOUT

    # ---------------------------------------------------------------- clocks

    def start_clocks(self, now: float, record: JobRecord | None = None) -> None:
        """Start the §10 clocks at `now` (monotonic): the ack window (plus idle for a
        standalone watch), an idle window for a job already running, and the wall
        clock from the attempt's creation. The service calls it when it takes a job
        over or publishes its dispatch (§14: ack_timeout starts at that publish)."""
        record = record if record is not None else self.registry.get(self.job_id)
        opts = self.options
        self._wake()
        self.ack_s = float(opts.ack_timeout_s if opts.ack_timeout_s is not None else record["ack_timeout_sec"])
        self.idle_s = float(opts.idle_timeout_s if opts.idle_timeout_s is not None else record["idle_timeout_sec"])
        wall_s = float(opts.timeout_s if opts.timeout_s is not None else record["timeout_sec"])
        self.wall_deadline = _wall_deadline(record, wall_s)
        self.first_deadline = now + (self.ack_s if opts.ack_only_before_first else self.ack_s + self.idle_s)
        self.started_status, self.session = record["status"], record.get("session") or ""
        self.attempt_id = int(record["attempt_id"])
        if self.started_status == JobStatus.RUNNING:
            self.first_deadline = now + self.idle_s  # re-attached to a running job: no ack phase
        self.last_alive = now
        self.next_poll = now

    def broker_back(self, now: float, outage: float) -> None:
        """§14: the hub's connection is back after `outage` s; the clocks stood
        still, and every job gets a full idle window from now."""
        self._wake()
        self.first_deadline = max(self.first_deadline + outage, now + self.idle_s)
        self.last_alive = now
        log.info("job %s: broker connection back after %.1f s; the idle clock restarts", self.job_id, outage)

    def idle_close_at(self) -> float:
        """When (monotonic) §10 closes the job unless it speaks again: the idle window from the last
        accepted message (before the first: the ack window), or the wall clock if sooner."""
        return min(self.wall_deadline, (self.last_alive + self.idle_s) if self.accepted_any else self.first_deadline)

    def next_wake(self, down_since: float | None) -> float:
        """The monotonic time at which `tick` may next decide something."""
        if down_since is not None:  # only the wall clock runs while the broker is away
            return min(self.wall_deadline, self.next_poll)
        deadline = self.idle_close_at()
        if self._terminal_state is not None:
            deadline = min(deadline, self._terminal_state_at + STATE_GRACE_S)
        return min(deadline, self.next_poll)

    def tick(self, now: float, *, down_since: float | None = None, poll: bool = True,
             proven: Callable[[float], bool] | None = None) -> int | None:
        """Apply §10 at `now` (monotonic): the exit code of §9 once the job is over
        (its terminal seen or the hub closed it), else None.

        Args:
            down_since: when the hub's connection went down (None: up); only the
                wall clock runs meanwhile (§14).
            proven: moment -> whether the hub's own link is proven alive after it
                (`BrokerLink.proven`); a silence is judged only then (§10 "Leases").
            poll: re-read the hub record every `REGISTRY_POLL_S` (a cancel from
                another shell); the service watches the registry itself.
        """
        if self.terminal is not None:
            return self._terminal_exit()
        if self.revocations.revoked_at(self.session) is not None:  # §16: closed and cancelled at once
            return self._close(CloseReason.RUNNER_LOST)
        if down_since is not None and now >= self.wall_deadline:
            return self._close(CloseReason.DEADLINE_TIMEOUT)
        if poll and now >= self.next_poll:
            self.next_poll = now + REGISTRY_POLL_S
            self._resolve_from_record()  # e.g. `mam-orch cancel` from another shell
            if self.terminal is not None:
                return self._terminal_exit()
        elif not poll:
            self.next_poll = now + DAY_S
        pending_state = self._terminal_state
        if pending_state is not None:
            if now < self._terminal_state_at + STATE_GRACE_S:
                return None
            self._settle_state(pending_state)
            return self._terminal_exit()
        if down_since is not None:
            return None
        deadline = min(self.wall_deadline, (self.last_alive + self.idle_s) if self.accepted_any
                       else self.first_deadline)
        if now < deadline:
            return None
        if now >= self.wall_deadline:
            return self._close(CloseReason.DEADLINE_TIMEOUT)
        if proven is not None and not proven(deadline):
            return None  # silent, or the hub cut off from the broker with its loss not yet noticed
        if not self.accepted_any and self.started_status == JobStatus.PENDING and \
                self.registry.get(self.job_id)["status"] == JobStatus.PENDING:
            return self._close(CloseReason.AGENT_BLOCKED)
        lost = self.runner_lost is not None and self.runner_lost()
        return self._close(CloseReason.RUNNER_LOST if lost else CloseReason.DEADLINE_TIMEOUT)

    # ---------------------------------------------------------------- loop

    def _take_received(self, client: Transport) -> None:
        """Handle every message received so far (a proof of the hub's link read before this
        covers them, §10), until the job's terminal."""
        while self.terminal is None:
            try:
                message = client.messages.get_nowait()
            except queue.Empty:
                return
            self.handle(message.topic, message.payload)

    def run(self) -> int:
        """Watch until the job ends on this watch's own connection; returns the exit code of §9.

        Raises:
            Detached: on KeyboardInterrupt (the job keeps running).
            RegistryError: the hub record cannot be read.
        """
        record = self.registry.get(self.job_id)
        if record["status"] in UNPUBLISHED_STATUSES:
            record = self._wait_unqueued()
        if record.get("close_reason") == CloseReason.QUEUE_TIMEOUT:
            return ExitCode.TIMEOUT
        if record["status"] in TERMINAL_STATUSES:
            if self.options.remote and record.get("close_reason") in HUB_DECISIONS and not record.get("late_outcome"):
                self._read_late_terminal()
            return self._finish_from_disk("already terminal")
        link: BrokerLink | None = None
        try:
            if not self._subscribed and not self.subscribe():
                return self._finish_from_disk("broker unreachable")
            client = self.client
            if client is None:  # subscribe() connected one
                return self._finish_from_disk("broker unreachable")
            self.start_clocks(time.monotonic(), record)
            link = BrokerLink(client, names.hub_probe_topic(self.config.topic_root))
            give_up_s = max(self.idle_s, env_float("MAM_HUB_OUTAGE_GIVE_UP_S", OUTAGE_GIVE_UP_S))
            while True:
                now = time.monotonic()
                outage = link.look(now)
                if outage is not None:  # §14: the clocks stood still; a full idle window from now
                    self.broker_back(now, outage)
                proven_at = link.proven_at
                self._take_received(client)  # what came before that proof counts before the clocks look
                code = self.tick(now, down_since=link.down_since,
                                 proven=lambda moment: link.proven(moment, proven_at))
                if code is not None:
                    break
                wake = self.next_wake(link.down_since)
                if link.down_since is not None:
                    if now >= link.down_since + give_up_s:
                        log.error("job %s: the broker was unreachable for %.0f s; giving up, the job "
                                  "stays %s", self.job_id, now - link.down_since,
                                  self.registry.get(self.job_id)["status"])
                        return ExitCode.BROKER
                    wake = min(wake, link.down_since + give_up_s)
                wait_s = wake - now
                if wait_s <= 0 and link.proving:  # a silence waits for the link's proof (§10)
                    wait_s = PROOF_LOOK_S
                try:
                    message = client.messages.get(timeout=max(MIN_WAIT_S, wait_s))
                except queue.Empty:
                    continue
                self.handle(message.topic, message.payload)
            self._show(await_chunks(self.logs, self.job_id, self.log_chunks, client.messages, self.handle))
            if self.results is not None:
                self._await_result(client.messages)
            if self.output is not None and self.human:
                self.output.flush()
            if self.terminal == JobStatus.CANCELLED:
                self._confirm_cancel()
            return code
        except KeyboardInterrupt:
            raise Detached(self.job_id) from None
        finally:
            if link is not None:
                link.close()
            if self._owns_client and self.client is not None:
                self.client.close()
