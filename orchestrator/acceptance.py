"""The hub's acceptance order of PROTOCOL §3.2, for events (§3) and retained
states (§4), as one pure function: `accept(message, ...)` returns `Accepted`
or `Refused(reason)`. The watcher judges every message with it; the hub
registry only stores what it accepted (`Transaction.store_event`,
`mirror_event`). Reasons are §3.2's words, logged as is by the caller.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

from mam.shared.protocol import crypto, wire
from mam.shared.protocol.codes import EVENT_NAMES, TERMINAL_STATUSES
from mam.shared.protocol.errors import DecodeError, SignatureError, UsageError
from mam.shared.store.records import WORKER_SOURCES, JobRecord, Refusal, StaleTransition, require_source
from mam.shared.store.registry import Registry

IGNORED = "zero_length"  # §3.2 rule 1: ignored silently, never logged
UNEXPECTED_JOB = "unexpected_job"
HMAC_FAILED = "HMAC verify failed"
STALE_ATTEMPT = "stale_attempt"
DUPLICATE = "duplicate"
AFTER_TERMINAL = "after_terminal"
# Refusals that come after the attempt identity passed (§3.2 rules 6-7).
OF_CURRENT_ATTEMPT = frozenset({DUPLICATE, AFTER_TERMINAL})
MISSING_KEPT = 64
"""Event seqs an attempt skipped that the hub keeps waiting for, at most (the highest kept, §3.2 rule 6)."""

Kind = Literal["event", "state"]
Message = wire.Event | wire.State


def _seqs(value: object) -> frozenset[int]:
    """The integers of a stored list of seqs; anything else in it, or no list, counts nothing."""
    if not isinstance(value, list):
        return frozenset()
    return frozenset(seq for seq in value if isinstance(seq, int) and not isinstance(seq, bool))


@dataclass(frozen=True)
class Seen:
    """What the hub has accepted of the job's current attempt: the highest
    event seq (0: none), its terminal status on the hub (None while open),
    the highest seq of any accepted event or state (`covered`: a `seq_gap` is
    only owed past it, so one gap is logged once, §3.2 rule 6), and the event
    seqs below the highest that no accepted event had (`missing`: one of them
    arriving late is accepted, not a `duplicate`)."""

    highest_seq: int = 0
    terminal: str | None = None
    covered: int = 0
    missing: frozenset[int] = frozenset()

    @classmethod
    def of_record(cls, record: JobRecord) -> Seen:
        """The view of a hub record: `last_seq`, its status when terminal, `seen_seq`, `missing_seqs`."""
        status = record["status"]
        return cls(record["last_seq"], status if status in TERMINAL_STATUSES else None,
                   record.get("seen_seq", 0), _seqs(record.get("missing_seqs")))

    def merged(self, other: Seen) -> Seen:
        """The stricter of two views: a watcher's memory and `other`, the registry's record,
        whose missing seqs are the ones kept (every event that changes them is written)."""
        return Seen(max(self.highest_seq, other.highest_seq), self.terminal or other.terminal,
                    max(self.covered, other.covered), other.missing)


@dataclass(frozen=True)
class Accepted:
    """An accepted message; `gap` is (expected, got) when its seq jumped past
    every seq seen (§3.2 rule 6: accepted, and a `seq_gap` audit line is owed);
    `missing` is the attempt's missing event seqs after it when it changed them
    (it skipped some, or it is one of them arriving `late`), else None."""

    message: Message
    gap: tuple[int, int] | None = None
    missing: tuple[int, ...] | None = None
    late: bool = False  # one of the missing seqs, below the highest: accepted now (§3.2 rule 6)


@dataclass(frozen=True)
class Refused:
    """A refused message: `reason` is §3.2's word, `detail` a short note for the
    log (no secrets); `message` is the decoded message from rule 4 on, else None;
    `earlier` is True for a `stale_attempt` signed by an earlier attempt of the
    job (its expected straggler after a redispatch: logged quietly)."""

    reason: str
    detail: str = ""
    message: Message | None = None
    earlier: bool = False

    @property
    def silent(self) -> bool:
        """A zero-length payload: ignored without a log line (§3.2 rule 1)."""
        return self.reason == IGNORED


Verdict = Accepted | Refused


class Acceptance(NamedTuple):
    """What `mirror_event` stored: the record after it, and (expected, got)
    when a `seq_gap` line was logged, else None."""

    record: JobRecord
    gap: tuple[int, int] | None


def judge(kind: Kind, event: str, seq: int, attempt_id: object, dispatch_token: object, *,
          record: JobRecord, seen: Seen) -> Refused | None:
    """§3.2 rules 5-7 for a message that passed rules 1-4.

    Args:
        kind: "event" or "state" (states stop after rule 5: they follow §4).
        event, seq, attempt_id, dispatch_token: the message's fields.
        record: the hub record of the job (its current attempt).
        seen: what was accepted so far (`Seen`).
    Returns:
        the refusal (`stale_attempt`, `duplicate`, `after_terminal`), or None when accepted.
    """
    if attempt_id != record["attempt_id"] or not isinstance(dispatch_token, str) \
            or dispatch_token != record["dispatch_token"]:
        what = (f"attempt {attempt_id!r} is not the current attempt {record['attempt_id']}"
                if attempt_id != record["attempt_id"] else "the dispatch token is not the current one")
        return Refused(STALE_ATTEMPT, what)
    if kind == "state":
        return None
    if seq <= seen.highest_seq and seq not in seen.missing:
        return Refused(DUPLICATE, f"seq {seq} already accepted (highest {seen.highest_seq})")
    if seen.terminal is not None:
        return Refused(AFTER_TERMINAL, f"{event} seq {seq}: the job is already {seen.terminal}")
    return None


def seq_gap(seq: int, seen: Seen) -> tuple[int, int] | None:
    """(expected, got) when an accepted message's `seq` skips past everything `seen`
    (§3.2 rule 6), else None: a gap already covered by a newer state is not logged again."""
    highest = max(seen.highest_seq, seen.covered)
    return (highest + 1, seq) if seq > highest + 1 else None


def missing_after(seq: int, seen: Seen) -> tuple[int, ...] | None:
    """The attempt's missing event seqs once an event with `seq` is accepted, sorted, the
    highest MISSING_KEPT; None when it changes nothing (§3.2 rule 6): a late one leaves
    them, a jump past the highest adds those it skipped."""
    if seq in seen.missing:
        return tuple(sorted(seen.missing - {seq}))
    if seq > seen.highest_seq + 1:
        skipped = range(max(seen.highest_seq + 1, seq - MISSING_KEPT), seq)
        return tuple(sorted(seen.missing.union(skipped)))[-MISSING_KEPT:]
    return None


def earlier_attempt(message: Message, record: JobRecord) -> bool:
    """True when `message` is signed with an earlier attempt's auth token of the
    job (`earlier_auth_tokens`, kept by a redispatch): §3.2 rule 4, not a forgery."""
    for token in record.get("earlier_auth_tokens", []):
        try:
            crypto.verify_event(message, token)
        except SignatureError:
            continue
        return True
    return False


def accept(message: bytes | Message, *, kind: Kind, job_id: str, record: JobRecord, seen: Seen) -> Verdict:
    """Apply §3.2 rules 1-7, in order, to one message on `events` or `state`.

    Args:
        message: the raw payload, or a message `wire.decode` already parsed.
        kind: "event" for the `events` topic, "state" for `state` (§4).
        job_id: the job this watch expects.
        record: the job's hub record (its `auth_token` keys the HMAC, §3.1).
        seen: what was accepted so far of the current attempt.
    Returns:
        `Accepted(message, gap)` or `Refused(reason, detail, message)`; reasons:
        `zero_length` (silent), `malformed`, `schema_mismatch`, `unexpected_job`,
        `HMAC verify failed`, `stale_attempt`, `duplicate`, `after_terminal`.
    """
    if isinstance(message, bytes):
        if not message:
            return Refused(IGNORED)
        try:
            message = wire.decode(message, kind)
        except DecodeError as exc:
            code, _, why = exc.reason.partition(":")
            return Refused(code, why.strip())
    if message.job_id != job_id:
        return Refused(UNEXPECTED_JOB, f"job_id {message.job_id}")
    try:
        crypto.verify_event(message, record["auth_token"])
    except SignatureError:
        if earlier_attempt(message, record):  # a straggler of an attempt before a redispatch
            return Refused(STALE_ATTEMPT, f"attempt {message.attempt_id!r} is an earlier attempt", message,
                           earlier=True)
        return Refused(HMAC_FAILED, f"{'events' if kind == 'event' else 'state'} seq {message.seq}", message)
    refused = judge(kind, message.event, message.seq, message.attempt_id, message.dispatch_token,
                    record=record, seen=seen)
    if refused is not None:
        return Refused(refused.reason, refused.detail, message)
    gap = seq_gap(message.seq, seen)
    if kind == "state":
        return Accepted(message, gap)
    return Accepted(message, gap, missing_after(message.seq, seen), late=message.seq <= seen.highest_seq)


def mirror_event(registry: Registry, job_id: str, payload: Mapping[str, Any], *,
                 source: str = "remote_mirror") -> Acceptance:
    """Judge a decoded, HMAC-verified event by rules 5-7 against the hub record and
    store it, in one registry transaction (§3.2, §10): a `seq_gap` line if seq
    jumped, the event, and the `started`/terminal transition it implies.

    Args:
        payload: a §3 event as a mapping (`seq`, `event`, `data.attempt_id`, ...).
    Returns:
        Acceptance(record, gap).
    Raises:
        StaleTransition (`stale_attempt`), Refusal (`duplicate`, `after_terminal`),
        UsageError (unknown event, bad seq or source), JobNotFound, RegistryError.
    """
    require_source(source, WORKER_SOURCES, "accept an event")
    event, seq = payload.get("event"), payload.get("seq")
    data = payload.get("data")
    ident = data if isinstance(data, Mapping) else {}
    if not isinstance(event, str) or event not in EVENT_NAMES:
        raise UsageError(f"event {event!r} is invalid: expected one of {', '.join(EVENT_NAMES)}")
    if isinstance(seq, bool) or not isinstance(seq, int) or seq < 1:
        raise UsageError(f"seq {seq!r} is invalid: expected an integer >= 1")
    with registry.transaction(job_id) as txn:
        seen = Seen.of_record(txn.record)
        refused = judge("event", event, seq, ident.get("attempt_id"), ident.get("dispatch_token"),
                        record=txn.record, seen=seen)
        if refused is not None:
            raise refusal_error(job_id, refused, source)
        gap = seq_gap(seq, seen)
        new = txn.store_event(payload, source=source, gap=gap, missing=missing_after(seq, seen))
    return Acceptance(new, gap)


def refusal_error(job_id: str, refused: Refused, source: str) -> Refusal:
    """The registry exception of a rules 5-7 refusal: `StaleTransition` for
    `stale_attempt`, else `Refusal` carrying the reason."""
    if refused.reason == STALE_ATTEMPT:
        return StaleTransition(job_id, f"refused {source} request: {refused.detail}")
    return Refusal(job_id, refused.reason, refused.detail)
