"""`mam-runner publish`: one event of a job, disk first, then the wire
(PROTOCOL §3, §4, §9, §12).

Order: validate everything (nothing written on bad input); for a terminal
event raise the heartbeat barrier and stop the timer (§12); then, under the
registry lock, check the attempt identity, take the seq, apply the status
transition, append the signed event to `events.ndjson` (§8) and put the
event and its state in the outbox (§17); only then publish the event and,
on the same connection, the retained state (§4), and acknowledge the outbox
entry. Terminal events are retained. Exit codes (§9): 0 published, 1 refused
(stale attempt, terminal job, invalid), 2 transport failure with the local
record, audit log and outbox entry written (the runner daemon re-sends it).

Agents call this often: paho is imported only when a message is sent. The
command line (`mam-runner publish`) is in `mam.runner.cli`; inside a job it goes
through the runner daemon's socket (`fastpath` → `localsock`, §17), which
calls `record` and sends on the daemon's connection.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mam.runner import outbox
from mam.shared.config import BrokerConfig, broker_config
from mam.shared.protocol import crypto, names, wire
from mam.shared.protocol.codes import EVENT_NAMES, TERMINAL_EVENTS, EventName
from mam.shared.protocol.errors import UsageError
from mam.shared.store.files import Flush
from mam.shared.store.registry import Registry

if TYPE_CHECKING:  # the Protocol only types `send_on`; nothing to load on the publish path
    from mam.shared.transport import Transport

log = logging.getLogger("mam.publish")

RESERVED_DATA_KEYS = frozenset({"hmac_sig", "attempt_id", "dispatch_token", "session", "exit_code", "heartbeat"})
MAX_DATA_BYTES = 16 * 1024
TURN_WAIT_S = 30.0
"""Longest a send waits for the job's lower seqs recorded in this process to go out first,
seconds: past it, they are taken for never sent (a path that dropped its publish), and the
send goes on."""

OrderKey = tuple[str, str]
"""(registry root, job id): whose seqs one `WireOrder` line keeps in order."""


class WireOrder:
    """One job's events reach the wire in seq order when one thread records them and another
    sends them (§3.2 rule 6: the hub takes an event below the highest it accepted only as a
    missing seq arriving late). `record(..., handed_on=True)` notes the seq it takes, under the
    registry lock, for a send on another thread (the local socket's queue); every `send_on` of
    the job waits for its turn: no lower noted seq unsent, and no other send of the job under
    way. The daemon's beats do not wait (one thread beats for every job, and a noted seq may
    wait on a slow disk's flush): a beat that overtakes a noted seq makes that event late at
    the hub, which still takes it."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._unsent: dict[OrderKey, set[int]] = {}
        self._sending: set[OrderKey] = set()

    def noted(self, key: OrderKey, seq: int) -> None:
        """`seq` of the job was recorded; it goes out before any higher one."""
        with self._cond:
            self._unsent.setdefault(key, set()).add(seq)

    @contextmanager
    def turn(self, key: OrderKey | None, seq: int) -> Iterator[None]:
        """Hold the job's turn to put `seq` on the wire, waiting at most `TURN_WAIT_S`; released
        (and `seq` no longer unsent) when the block ends, raised or not. `key` None: a publish
        that keeps no order (no seq of `record`)."""
        if key is None:
            yield
            return
        deadline = time.monotonic() + TURN_WAIT_S
        with self._cond:
            while key in self._sending or any(other < seq for other in self._unsent.get(key, ())):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    dropped = sorted(other for other in self._unsent.get(key, ()) if other < seq)
                    log.warning("job %s: seq %d goes out without waiting any longer for seq %s, recorded "
                                "but not sent", key[1], seq, ", ".join(map(str, dropped)) or "-")
                    self._unsent[key] -= set(dropped)
                    break
                self._cond.wait(remaining)
            self._sending.add(key)
        try:
            yield
        finally:
            with self._cond:
                self._sending.discard(key)
                unsent = self._unsent.get(key)
                if unsent is not None:
                    unsent.discard(seq)
                    if not unsent:
                        del self._unsent[key]
                self._cond.notify_all()


WIRE_ORDER = WireOrder()
"""This process's order of sends (the daemon's threads share it)."""


@dataclass(frozen=True)
class PublishRequest:
    """What to publish for one job (§3).

    `attempt_id`/`dispatch_token` are the identity the publisher holds
    (MAM_ATTEMPT_ID / MAM_DISPATCH_TOKEN for an agent); None means "the
    record's current attempt" (an operator on the runner host).
    """

    job_id: str
    event: str
    detail: str = ""
    data: Mapping[str, Any] = field(default_factory=dict)
    attempt_id: int | None = None
    dispatch_token: str | None = None


@dataclass(frozen=True)
class Published:
    """The signed event and state of one publish, already on disk; `entry` is its
    outbox entry (§17), None when it was not kept."""

    seq: int
    event: dict[str, Any]
    state: dict[str, Any]
    entry: Path | None = None
    order: OrderKey | None = None  # its line in `WIRE_ORDER`; None: recorded by no `record`

    @property
    def terminal(self) -> bool:
        return self.event["event"] in TERMINAL_EVENTS

    def messages(self, topic_root: str) -> list[tuple[str, bytes, bool]]:
        """(topic, payload, retain) in publish order: event, then the retained state (§4)."""
        job_id = self.event["job_id"]
        return [(names.events_topic(job_id, topic_root), wire.encode(self.event), self.terminal),
                (names.state_topic(job_id, topic_root), wire.encode(self.state), True)]


def parse_data(text: str | None) -> dict[str, Any]:
    """Parse `--data JSON`: an object of free metrics, at most 16 KiB,
    without the reserved keys of §3.

    Raises:
        UsageError: not JSON, not an object, too large, or a reserved key.
    """
    if text is None or text == "":
        return {}
    if len(text.encode("utf-8", "surrogatepass")) > MAX_DATA_BYTES:
        raise UsageError(f"--data is larger than {MAX_DATA_BYTES} bytes")
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UsageError(f"--data is not valid JSON ({exc.msg} at position {exc.pos})") from None
    if not isinstance(value, dict):
        raise UsageError("--data must be a JSON object, e.g. '{\"tests\": 12}'")
    reserved = sorted(RESERVED_DATA_KEYS & value.keys())
    if reserved:
        raise UsageError(f"--data must not set the reserved key(s) {', '.join(reserved)} (§3)")
    return value


def make_request(job_id: str, event: str, detail: str = "", data: str | None = None,
                 attempt_id: str | int | None = None, dispatch_token: str | None = None) -> PublishRequest:
    """Validate CLI/env input into a `PublishRequest` (§1, §3).

    Raises:
        UsageError: a bad job id, event, detail, data, attempt or token.
    """
    names.validate_job_id(job_id)
    if event not in EVENT_NAMES:
        raise UsageError(f"event {event!r} is invalid: expected one of {', '.join(EVENT_NAMES)}")
    attempt: int | None = None
    if attempt_id not in (None, ""):
        try:
            attempt = int(attempt_id)
        except (TypeError, ValueError):
            raise UsageError(f"attempt id {attempt_id!r} is invalid: expected an integer >= 1") from None
        names.validate_attempt(attempt)
    token = dispatch_token or None
    if token is not None:
        names.validate_token(token)
    payload = parse_data(data)
    # Let the wire rules judge detail and data once (length, control characters, depth).
    wire.Event.build(job_id, 1, event, detail, attempt_id=attempt or 1,
                     dispatch_token=token or "0" * 32, data=payload)
    return PublishRequest(job_id, event, detail, payload, attempt, token)


def record(registry: Registry, request: PublishRequest, *, source: str = "publisher",
           extra_data: Mapping[str, Any] | None = None, exit_code: int | None = None,
           status: str | None = None, stop_heartbeat: bool = True, drain_s: float | None = None,
           durable: bool = True, handed_on: bool = False) -> Published:
    """The disk side of a publish (§3, §4, §8, §12): for a terminal event stop
    the heartbeat first, then take the seq, apply the transition and append
    the signed event to the audit log, under the registry lock. `started` and
    terminals are flushed under the lock, write by write (a refused flush leaves
    the record as it was); any other event once the lock is released, before this
    returns, so no beat waits behind its flush (docs/registry.md "Durability on a runner").

    Args:
        registry: this host's `Registry`.
        request: what to publish.
        source: a worker source of §8 (`publisher`, `runner`).
        extra_data: reserved keys set by the runner/timer (`exit_code`, `heartbeat`).
        exit_code: stored on a terminal record.
        status: `"cancelled"` with an `error` event (§6).
        stop_heartbeat: run the §12 barrier + drain before a terminal event.
        drain_s: how long the timer may take to exit, seconds (None = MAM_HEARTBEAT_DRAIN_S).
        durable: False leaves the audit line, the record and the outbox entry to the page
            cache (a daemon's beat, §12: it never waits on a flush).
        handed_on: another thread sends it (`send_on`): until then no higher seq of the job
            goes on the wire (`WIRE_ORDER`). It must be sent, or later sends wait TURN_WAIT_S.
    Returns:
        the signed event and state.
    Raises:
        StaleAttemptError / TransitionRefused: not the current attempt, or the job is terminal.
        RegistryError: the record cannot be read or written.
    """
    current = registry.get(request.job_id)
    attempt_id = request.attempt_id or current["attempt_id"]
    token = request.dispatch_token or current["dispatch_token"]
    if request.event in TERMINAL_EVENTS and stop_heartbeat:
        from mam.runner import barrier  # lazy: only a terminal event stops the timer (publish fast path)

        if attempt_id == current["attempt_id"] and token == current["dispatch_token"]:
            barrier.stop_for_terminal(registry, request.job_id, attempt_id, drain_s=drain_s)
    data = {**request.data, **(extra_data or {})}
    if exit_code is not None:
        data["exit_code"] = exit_code
    signed: dict[str, Any] = {}

    def build(seq: int) -> dict[str, Any]:
        rec = registry.get(request.job_id)  # under the lock: the auth_token of this attempt
        event = wire.Event.build(request.job_id, seq, request.event, request.detail,
                                 attempt_id=attempt_id, dispatch_token=token,
                                 session=rec.get("session"), data=data)
        signed["token"] = rec["auth_token"]
        return crypto.sign_event(event.to_dict(), rec["auth_token"])

    changes_status = request.event in (EventName.STARTED, *TERMINAL_EVENTS) or status is not None
    flush: Flush = "after" if durable else "none"
    # one hold: the outbox gets a job's entries in seq order (§17)
    with registry.lock() if durable and changes_status else registry.group(flush=flush):
        seq, payload = registry.record_event(request.job_id, attempt_id=attempt_id, dispatch_token=token,
                                             event=request.event, build=build, source=source,
                                             status=status, exit_code=exit_code)
        after = registry.get(request.job_id)
        state = crypto.sign_event(wire.State.build(request.job_id, seq, after["status"], request.event,
                                                   attempt_id=attempt_id, dispatch_token=token).to_dict(),
                                  signed["token"])
        entry = outbox.put(registry.root, payload, state, deferred=registry.deferred)
        order = (str(registry.root), request.job_id)
        if handed_on:
            WIRE_ORDER.noted(order, seq)  # under the lock that took the seq: a higher one waits for it
    return Published(seq, payload, state, entry, order)


def broker_for(registry: Registry, job_id: str, *, warn: bool = True) -> BrokerConfig:
    """The BrokerConfig for a job: §13 resolution from the registry's root,
    then the record's `broker` overrides."""
    block = registry.get(job_id).get("broker")
    return broker_config(block or None, workspace=registry.root, warn=warn)


def send(published: Published, config: BrokerConfig, *, attempts: int | None = None) -> None:
    """Publish event then state over one fresh connection with the §13 retries
    (`attempts` tries; None = `mqtt.DEFAULT_ATTEMPTS`), then acknowledge the
    outbox entry (§17); on failure it stays for the runner daemon to re-send.

    Raises:
        BrokerUnavailable, PublishTimeout, BrokerError.
    """
    from mam.shared.transport import mqtt  # lazy: paho only when a message is sent (publish fast path)

    tries = mqtt.DEFAULT_ATTEMPTS if attempts is None else attempts
    mqtt.publish_with_retry(config, "publish", published.messages(config.topic_root), attempts=tries)
    acknowledge(published)


def send_on(client: Transport, published: Published) -> None:
    """Publish event then state on an already connected, persistent client (§4),
    then acknowledge the outbox entry (§17).

    Both are queued on the connection before either PUBACK is awaited: one round trip,
    in wire order, as a daemon's beat sends. Brokers do not order topics, so the hub
    already takes a state before its event (§4). Another thread's send of the same
    job's lower seq goes first (`WIRE_ORDER`).

    Raises:
        PublishTimeout, BrokerError: the entry stays for the re-send (§17).
    """
    with WIRE_ORDER.turn(published.order, published.seq):
        waiters = [client.publish_async(topic, payload, retain=retain)
                   for topic, payload, retain in published.messages(client.config.topic_root)]
        for wait in waiters:
            wait()
    acknowledge(published)


def acknowledge(published: Published) -> None:
    """The broker acknowledged both messages: release the outbox entry (§17)."""
    if published.entry is not None:
        outbox.acknowledge(published.entry, terminal=published.terminal)


def publish_command(workspace: str | os.PathLike[str], job_id: str) -> str:
    """The MAM_PUBLISH_CMD of §11: a shell-quoted command line an agent runs
    with `--event E [--detail D] [--data JSON]` to publish for its job."""
    script = Path(sys.executable).with_name("mam-runner")
    argv = [str(script)] if script.exists() else [sys.executable, "-m", "mam.runner"]
    return shlex.join([*argv, "publish", "--job", job_id, "--workspace", str(workspace)])
