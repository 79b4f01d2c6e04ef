"""The hub's watcher: acceptance order (§3.2), liveness (§10), mirroring,
exit codes (§9).

Paho's thread only fills the client's queue; this loop takes each message
and applies, in order: zero-length → ignored; not a UTF-8 JSON object →
`malformed`; schema → `schema_mismatch`; job → `unexpected_job`; HMAC →
`HMAC verify failed`; attempt/token → `stale_attempt`; seq →
`duplicate` (with a `seq_gap` audit line on a jump); a job terminal on
the hub → `after_terminal`. Refusals are logged on stderr; accepted events
go to stdout as JSON lines (a human view on a TTY).

Liveness (§10): before the first accepted event the ack clock runs; after
it the idle clock (K × N), renewed by every accepted event and by a state
only when its seq is newer than everything accepted; the wall clock runs
from the record's creation. Whatever ends a wait that has begun (other than
Ctrl-C), the hub record is left terminal: a liveness deadline that passes
while the broker is unreachable closes the job `deadline_timeout` and exits 3.
A watch that cannot reach the broker at all when it starts decides nothing
about the job: it reports the record's own status (disk fallback) and exits
3 without closing it, so a later watch or publish can still finish it.
"""

from __future__ import annotations

import json
import logging
import queue
import sys
import time
from dataclasses import dataclass
from typing import Any, TextIO

from mam.shared import names
from mam.shared.errors import ExitCode

log = logging.getLogger("mam.watch")

STATUS_EXIT = {"completed": ExitCode.COMPLETED, "error": ExitCode.ERROR, "cancelled": ExitCode.CANCELLED}
REGISTRY_POLL_S = 0.5
# A terminal state waits this long for its terminal event before it resolves the job:
# brokers do not order messages across topics (nats-server delivers each subscription
# on its own), and the event carries what the state lacks (detail, data.exit_code).
STATE_GRACE_S = 1.0


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


def _wall_deadline(record: dict[str, Any], timeout_s: float) -> float:
    """The wall-clock deadline of §10 on the monotonic clock, from the record's creation."""
    from mam.shared.wire import parse_ts

    try:  # a redispatched attempt gets its own budget (§10: "timeout_sec after the dispatch")
        created = parse_ts(record.get("attempt_created_at") or record["created_at"]).timestamp()
    except (KeyError, ValueError, TypeError):
        created = time.time()
    return time.monotonic() + max(0.0, created + timeout_s - time.time())


class Watcher:
    """Watch one job until it ends (§3.2, §4, §10).

    Args:
        registry: the hub `Registry` holding the job (for its auth_token).
        job_id: the job.
        client: a connected `MqttClient`, or None to connect here.
        config: the BrokerConfig used when `client` is None.
        options: `WatchOptions`.
        keys: `DispatchKeys` to publish a cancel on close (None: hub-only close).
        out: where accepted events go (stdout).
    """

    def __init__(self, registry: Any, job_id: str, *, client: Any = None, config: Any = None,
                 options: WatchOptions = WatchOptions(), keys: Any = None, out: TextIO | None = None) -> None:
        self.registry = registry
        self.job_id = names.validate_job_id(job_id)
        self.client = client
        self.config = config if config is not None else getattr(client, "config", None)
        self.options = options
        self.keys = keys
        self.out = out if out is not None else sys.stdout
        self.human = hasattr(self.out, "isatty") and self.out.isatty()
        self.highest_event = 0
        self.highest_any = 0
        self.accepted_any = False
        self.terminal: str | None = None
        self.refusals: list[str] = []
        self._terminal_state: Any = None  # a terminal §4 state waiting for its event
        self.runner_ended = False  # a verified terminal event or state of the current attempt
        self._terminal_state_at = 0.0
        self._owns_client = False
        self._subscribed = False

    # ---------------------------------------------------------------- output

    def _emit(self, payload: dict[str, Any]) -> None:
        if self.human:
            data = payload.get("data", {})
            stamp = str(payload.get("timestamp", ""))[11:19]
            extra = f" (exit {data['exit_code']})" if "exit_code" in data else ""
            self.out.write(f"{stamp} {payload['job_id']} #{payload['seq']:<4} {payload['event']:<20} "
                           f"{payload.get('detail', '')}{extra}\n")
        else:
            self.out.write(json.dumps(payload, sort_keys=True) + "\n")
        self.out.flush()

    def _refuse(self, reason: str, detail: str = "") -> None:
        self.refusals.append(reason)
        log.warning("job %s: refused message: %s%s", self.job_id, reason, f" ({detail})" if detail else "")

    # ------------------------------------------------------------ acceptance

    def handle(self, topic: str, raw: bytes) -> bool:
        """Apply §3.2 to one message. Returns True when it renewed liveness."""
        from mam.shared import crypto, wire
        from mam.shared.errors import DecodeError, SignatureError, TransitionRefused

        if len(raw) == 0:
            return False
        parsed = names.parse_job_topic(topic, self.config.topic_root)
        leaf = parsed[1] if parsed else ""
        if leaf not in ("events", "state"):
            return False
        try:
            message = wire.decode(raw, "event" if leaf == "events" else "state")
        except DecodeError as exc:
            code, _, why = exc.reason.partition(":")
            self._refuse(code, why.strip())
            return False
        if message.job_id != self.job_id:
            self._refuse("unexpected_job", f"job_id {message.job_id}")
            return False
        record = self.registry.get(self.job_id)
        payload = message.to_dict()
        try:
            crypto.verify_event(payload, record["auth_token"])
        except SignatureError:
            self._refuse("HMAC verify failed", f"{leaf} seq {message.seq}")
            return False
        if message.attempt_id != record["attempt_id"] or message.dispatch_token != record["dispatch_token"]:
            self._refuse("stale_attempt", f"attempt {message.attempt_id}, current {record['attempt_id']}")
            return False
        if message.terminal:
            self.runner_ended = True  # the runner reported its end of this attempt (§6 confirmation)
        if leaf == "state":
            return self._handle_state(message, record)
        if message.seq <= self.highest_event:
            self._refuse("duplicate", f"seq {message.seq} <= {self.highest_event}")
            return False
        if self.terminal is not None:
            self._refuse("after_terminal", f"{message.event} seq {message.seq} after {self.terminal}")
            return False
        if self.options.remote:
            try:
                self.registry.accept_event(self.job_id, payload, source="remote_mirror")
            except TransitionRefused as exc:
                reason = getattr(exc, "reason", "after_terminal")
                self._refuse(reason, str(exc))
                if reason == "after_terminal":
                    self._resolve_from_record()
                return False
        elif message.seq > self.highest_event + 1:
            self._audit_gap(self.highest_event + 1, message.seq)
        self.highest_event = message.seq
        self.highest_any = max(self.highest_any, message.seq)
        self.accepted_any = True
        self._emit(payload)
        if message.event in wire.TERMINAL_EVENTS:
            self.terminal = "completed" if message.event == "completed" else "error"
            if self.options.remote:
                self._resolve_from_record()
        return True

    def _handle_state(self, message: Any, record: dict[str, Any]) -> bool:
        newer = message.seq > self.highest_any
        if newer and message.seq > self.highest_any + 1 and message.seq > self.highest_event + 1:
            self._audit_gap(self.highest_any + 1, message.seq)
        if newer:
            self.highest_any = message.seq
            self.accepted_any = True
        if message.terminal and self.terminal is None and self._terminal_state is None:
            self._terminal_state = message
            self._terminal_state_at = time.monotonic()
        return newer

    def _settle_state(self) -> None:
        """Resolve the job from a terminal state whose event did not come (§4)."""
        message = self._terminal_state
        status = message.status
        if self.options.remote:
            self._mirror_terminal_state(message)
            status = self.registry.get(self.job_id)["status"]
        self.terminal = status
        log.info("job %s resolved from the retained state: %s", self.job_id, status)

    def _mirror_terminal_state(self, message: Any) -> None:
        from mam.shared.errors import TransitionRefused

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
        from mam.orchestrator.fleet import clear_retained
        from mam.shared.config import env_float
        from mam.shared.errors import BrokerError

        if not self.options.remote or self.client is None:
            return
        deadline = time.monotonic() + env_float("MAM_CANCEL_GRACE_S", 10.0) + 5.0
        while not self.runner_ended and time.monotonic() < deadline:
            try:
                message = self.client.messages.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                break
            self.handle(message.topic, message.payload)
        if not self.runner_ended:
            log.info("job %s: no confirmation from the runner yet; the cancel stays retained", self.job_id)
            return
        try:
            clear_retained(self.client, names.control_topic(self.job_id, self.config.topic_root))
        except BrokerError as exc:
            log.warning("job %s: the retained cancel was not cleared: %s", self.job_id, exc)

    def _resolve_from_record(self) -> None:
        from mam.shared.codes import TERMINAL_STATUSES

        status = self.registry.get(self.job_id)["status"]
        if status in TERMINAL_STATUSES:
            self.terminal = status

    def _audit_gap(self, expected: int, got: int) -> None:
        from mam.shared.registry import utc_now

        self.registry.append_audit(self.job_id, {"event": "seq_gap", "timestamp": utc_now(),
                                                 "expected": expected, "got": got, "source": "watch"})

    # ---------------------------------------------------------------- loop

    def _connect(self) -> bool:
        from mam.shared import mqtt
        from mam.shared.errors import BrokerUnavailable

        if self.client is None:
            client = mqtt.MqttClient(self.config, "watch")
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
                                   (names.state_topic(self.job_id, self.config.topic_root), 1)])
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

    def _finish_from_disk(self, why: str) -> int:
        """Disk fallback (§10): the hub's own record decides; else exit 3."""
        from mam.shared.codes import TERMINAL_STATUSES

        status = self.registry.get(self.job_id)["status"]
        if status in TERMINAL_STATUSES:
            log.info("job %s is %s on disk (%s)", self.job_id, status, why)
            return STATUS_EXIT[status]
        log.error("job %s: %s; the hub record says %s", self.job_id, why, status)
        return ExitCode.BROKER

    def _close(self, close_reason: str) -> int:
        from mam.orchestrator.fleet import close_remote

        connected = self.client is not None and self.client.connected.is_set()
        record = close_remote(self.registry, self.client if connected else None, self.keys,
                              self.job_id, close_reason)
        if record.get("close_reason") != close_reason:
            return STATUS_EXIT.get(record["status"], ExitCode.ERROR)  # it ended some other way first
        log.error("job %s closed: %s", self.job_id, close_reason)
        if not connected:
            return ExitCode.BROKER
        return ExitCode.ERROR if close_reason == "agent_blocked" else ExitCode.TIMEOUT

    def run(self) -> int:
        """Watch until the job ends; returns the exit code of §9.

        Raises:
            Detached: on KeyboardInterrupt (the job keeps running).
            RegistryError: the hub record cannot be read.
        """
        from mam.shared.codes import TERMINAL_STATUSES

        record = self.registry.get(self.job_id)
        if record["status"] in TERMINAL_STATUSES:
            return self._finish_from_disk("already terminal")
        opts = self.options
        ack_s = float(opts.ack_timeout_s if opts.ack_timeout_s is not None else record["ack_timeout_sec"])
        idle_s = float(opts.idle_timeout_s if opts.idle_timeout_s is not None else record["idle_timeout_sec"])
        wall_s = float(opts.timeout_s if opts.timeout_s is not None else record["timeout_sec"])
        try:
            if not self._subscribed and not self.subscribe():
                return self._finish_from_disk("broker unreachable")
            start = time.monotonic()
            wall_deadline = _wall_deadline(record, wall_s)
            first_deadline = start + (ack_s if opts.ack_only_before_first else ack_s + idle_s)
            if record["status"] == "running":
                first_deadline = start + idle_s  # re-attached to a running job: no ack phase
            last_alive = start
            next_poll = start
            while self.terminal is None:
                now = time.monotonic()
                if now >= next_poll:
                    next_poll = now + REGISTRY_POLL_S
                    self._resolve_from_record()  # e.g. `mam-orch cancel` from another shell
                    if self.terminal is not None:
                        break
                if self._terminal_state is not None and now >= self._terminal_state_at + STATE_GRACE_S:
                    self._settle_state()
                    break
                deadline = min(wall_deadline, (last_alive + idle_s) if self.accepted_any else first_deadline)
                if self._terminal_state is not None:
                    deadline = min(deadline, self._terminal_state_at + STATE_GRACE_S)
                if now >= deadline and self._terminal_state is None:
                    if now >= wall_deadline:
                        return self._close("deadline_timeout")
                    if not self.accepted_any and record["status"] == "pending" and \
                            self.registry.get(self.job_id)["status"] == "pending":
                        return self._close("agent_blocked")
                    return self._close("deadline_timeout")
                try:
                    message = self.client.messages.get(timeout=max(0.01, min(deadline, next_poll) - now))
                except queue.Empty:
                    continue
                if self.handle(message.topic, message.payload):
                    last_alive = time.monotonic()
            if self.terminal == "cancelled":
                self._confirm_cancel()
            return STATUS_EXIT.get(self.terminal, ExitCode.ERROR)
        except KeyboardInterrupt:
            raise Detached(self.job_id) from None
        finally:
            if self._owns_client and self.client is not None:
                self.client.close()


def detach_hint(job_id: str) -> str:
    """What Ctrl-C prints (§10): how to re-attach or cancel."""
    return (f"detached from job {job_id}; it keeps running. Re-attach: mam-orch watch {job_id}  "
            f"Cancel: mam-orch cancel {job_id}")


def watch_cli(job_id: str, *, workspace: str | None, remote: bool, idle_timeout_s: float | None,
              ack_timeout_s: float | None, timeout_s: float | None) -> int:
    """`mam-orch watch`: returns the exit code of §9 (130 when detached with Ctrl-C).

    Raises:
        UsageError, EnvFileError, ConfigError, RegistryError.
    """
    from mam.shared import config
    from mam.shared.errors import ConfigError, UsageError
    from mam.shared.registry import Registry

    names.validate_job_id(job_id)
    for name, value in (("--idle-timeout", idle_timeout_s), ("--ack-timeout", ack_timeout_s),
                        ("--timeout", timeout_s)):
        if value is not None and not 0 < value <= 366 * 86400:
            raise UsageError(f"{name} {value:g} is invalid: expected seconds > 0")
    registry = Registry(config.resolve_root(workspace))
    record = registry.get(job_id)
    remote = remote or record.get("transport") == "remote" and record.get("role") == "hub"
    cfg = config.broker_config(record.get("broker") or None, workspace=registry.root)
    keys = None
    if remote:
        try:
            from mam.orchestrator.fleet import signing_keys

            keys = signing_keys(registry.root)
        except ConfigError as exc:
            log.warning("%s; a close will not publish a cancel", exc)
    watcher = Watcher(registry, job_id, config=cfg, keys=keys,
                      options=WatchOptions(remote=remote, ack_timeout_s=ack_timeout_s,
                                           idle_timeout_s=idle_timeout_s, timeout_s=timeout_s))
    try:
        return watcher.run()
    except Detached:
        print(detach_hint(job_id), file=sys.stderr)
        return ExitCode.DETACHED
