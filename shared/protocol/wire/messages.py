"""The wire messages of PROTOCOL §3, §4, §6 and §7 as frozen dataclasses: Event,
State, Control and Presence (Dispatch is in `mam.shared.protocol.wire.dispatch`). Import
them through `mam.shared.protocol.wire`.

Constructing one applies the field rules of its section and raises
`DecodeError`; the `build`/`cancel` class methods raise `UsageError` instead,
so a publisher cannot put on the wire what a receiver refuses. `from_dict`
applies the rules to a parsed payload, in the §3.2 order.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from mam.shared.protocol import names
from mam.shared.protocol.codes import (
    CONTROL_ACTIONS,
    EVENT_NAMES,
    JOB_STATUSES,
    PRESENCE_STATUSES,
    TERMINAL_EVENTS,
    TERMINAL_STATUSES,
    ControlAction,
)
from mam.shared.protocol.errors import UsageError
from mam.shared.protocol.wire.fields import (
    MAX_DETAIL_CHARS,
    MAX_NAME_CHARS,
    MAX_REASON_CHARS,
    MAX_RUNNING,
    MAX_VERSION_CHARS,
    SCHEMA_VERSION,
    V2_SIGNED_FIELDS,
    Invalid,
    build,
    check_b64,
    check_choice,
    check_data,
    check_fields,
    check_hex32,
    check_int,
    check_job_id,
    check_schema,
    check_sealed,
    check_session,
    check_sig,
    check_text,
    check_timestamp,
    decode_object,
    freeze,
    is_int,
    run_check,
    show,
    thaw,
    ts_arg,
    type_name,
)

EVENT_FIELDS = frozenset({"schema_version", "seq", "job_id", "event", "timestamp", "detail", "data"})
STATE_FIELDS = EVENT_FIELDS | {"status", "last_event"}
CONTROL_FIELDS = frozenset({"schema_version", "kind", "action", "job_id", "attempt_id", "reason", "issued_at",
                            "sig"})
PRESENCE_FIELDS = frozenset({"schema_version", "kind", "session", "runner_id", "status", "host", "version",
                             "max_jobs", "running", "timestamp", "sig"})
REVOCATION_FIELDS = frozenset({"schema_version", "kind", "session", "runner_key", "revoked_at", "sig_alg", "sig"})
DRAIN_FIELDS = frozenset({"schema_version", "kind", "session", "draining", "reason", "issued_at", "sig"})
RUNNER_KEY_BYTES = 32  # an Ed25519 public key


class _EventShaped:
    """What Event (§3) and State (§4) share: a deep read-only `data` holding the
    attempt identity and the HMAC, and the field rules run at construction."""

    data: Mapping[str, Any]

    def __post_init__(self) -> None:
        object.__setattr__(self, "data", freeze(self.data) if isinstance(self.data, Mapping) else self.data)
        run_check(self._check)

    def _check(self) -> None:
        raise NotImplementedError  # each message applies the rules of its section

    @property
    def attempt_id(self) -> int:
        """data.attempt_id (checked at construction)."""
        return int(self.data["attempt_id"])

    @property
    def dispatch_token(self) -> str:
        """data.dispatch_token (checked at construction)."""
        return str(self.data["dispatch_token"])

    @property
    def hmac_sig(self) -> str | None:
        """data.hmac_sig, or None while unsigned."""
        return _optional_str(self.data.get("hmac_sig"))


@dataclass(frozen=True)
class Event(_EventShaped):
    """An event of §3. Build with `Event.build`, parse with `decode(raw, "event")`.

    `data` is a deep read-only mapping; `to_dict()` returns a fresh mutable copy.
    Constructing one directly applies the §3 field rules and raises `DecodeError`.
    """

    job_id: str
    seq: int
    event: str
    timestamp: str
    detail: str
    data: Mapping[str, Any]
    schema_version: int = SCHEMA_VERSION

    def _check(self) -> None:
        check_schema(self.schema_version)
        check_int(self.seq, "seq")
        check_job_id(self.job_id)
        check_choice(self.event, "event", EVENT_NAMES)
        check_timestamp(self.timestamp, "timestamp")
        check_text(self.detail, "detail", MAX_DETAIL_CHARS, empty_ok=True)
        check_data(self.data, require=("attempt_id", "dispatch_token"))

    @classmethod
    def build(cls, job_id: str, seq: int, event: str, detail: str = "", *, attempt_id: int,
              dispatch_token: str, session: str | None = None, data: Mapping[str, Any] | None = None,
              timestamp: datetime | str | None = None) -> Event:
        """An unsigned event (sign with `crypto.sign_event`), §3.

        Args:
            job_id: 8 hex; seq: >= 1, per attempt; event: one of EVENT_NAMES;
            detail: <= 1024 characters, no control characters, no paths or secrets;
            attempt_id, dispatch_token, session: the attempt identity put into `data`;
            data: free metrics and reserved keys (`exit_code`, `heartbeat`);
            timestamp: aware datetime or §3 text; None means now.
        Raises:
            UsageError: a field breaks §3 (the message names it).
        """
        payload = dict(data or {})
        payload.update(attempt_id=attempt_id, dispatch_token=dispatch_token)
        if session is not None:
            payload["session"] = session
        return build(cls, job_id=job_id, seq=seq, event=event, detail=detail, data=payload,
                     timestamp=ts_arg(timestamp))

    @classmethod
    def from_dict(cls, obj: Mapping[str, Any]) -> Event:
        """Apply the §3 rules to a parsed payload; raises `DecodeError` (no raw attached)."""
        return decode_object(obj, _event_from)

    def to_dict(self) -> dict[str, Any]:
        """The wire object (fresh, mutable)."""
        return {"schema_version": self.schema_version, "seq": self.seq, "job_id": self.job_id,
                "event": self.event, "timestamp": self.timestamp, "detail": self.detail,
                "data": thaw(self.data)}

    @property
    def session(self) -> str | None:
        """data.session, or None."""
        return _optional_str(self.data.get("session"))

    @property
    def exit_code(self) -> int | None:
        """data.exit_code, or None."""
        code = self.data.get("exit_code")
        return code if is_int(code) else None

    @property
    def heartbeat(self) -> bool:
        """True on a timer beat (data.heartbeat, §3)."""
        return self.data.get("heartbeat") is True

    @property
    def terminal(self) -> bool:
        """True for completed or error (§3)."""
        return self.event in TERMINAL_EVENTS


@dataclass(frozen=True)
class State(_EventShaped):
    """A retained state snapshot of §4: an event-shaped message with `event == "state"`."""

    job_id: str
    seq: int
    status: str
    last_event: str
    timestamp: str
    detail: str
    data: Mapping[str, Any]
    event: str = "state"
    schema_version: int = SCHEMA_VERSION

    def _check(self) -> None:
        check_schema(self.schema_version)
        check_int(self.seq, "seq")
        check_job_id(self.job_id)
        check_choice(self.event, "event", ("state",))
        check_choice(self.status, "status", JOB_STATUSES)
        check_choice(self.last_event, "last_event", EVENT_NAMES)
        check_timestamp(self.timestamp, "timestamp")
        check_text(self.detail, "detail", MAX_DETAIL_CHARS, empty_ok=True)
        check_data(self.data, require=("attempt_id", "dispatch_token"))

    @classmethod
    def build(cls, job_id: str, seq: int, status: str, last_event: str, *, attempt_id: int,
              dispatch_token: str, detail: str = "", data: Mapping[str, Any] | None = None,
              timestamp: datetime | str | None = None) -> State:
        """An unsigned state (sign with `crypto.sign_event`), §4.

        Args:
            seq: the seq of the event it follows; status: one of JOB_STATUSES;
            last_event: one of EVENT_NAMES; the rest as `Event.build`.
        Raises:
            UsageError: a field breaks §4.
        """
        payload = dict(data or {})
        payload.update(attempt_id=attempt_id, dispatch_token=dispatch_token)
        return build(cls, job_id=job_id, seq=seq, status=status, last_event=last_event, detail=detail,
                     data=payload, timestamp=ts_arg(timestamp))

    @classmethod
    def from_dict(cls, obj: Mapping[str, Any]) -> State:
        """Apply the §4 rules to a parsed payload; raises `DecodeError`."""
        return decode_object(obj, _state_from)

    def to_dict(self) -> dict[str, Any]:
        """The wire object (fresh, mutable)."""
        return {"schema_version": self.schema_version, "seq": self.seq, "job_id": self.job_id,
                "event": self.event, "status": self.status, "last_event": self.last_event,
                "timestamp": self.timestamp, "detail": self.detail, "data": thaw(self.data)}

    @property
    def terminal(self) -> bool:
        """True for status completed, error or cancelled (§4)."""
        return self.status in TERMINAL_STATUSES


@dataclass(frozen=True)
class Control:
    """A cancel of §6. `sig` is None until signed by `crypto.sign`; `decode` requires it."""

    job_id: str
    attempt_id: int
    reason: str
    issued_at: str
    action: str = "cancel"
    sig: str | None = None
    kind: str = "control"
    schema_version: int = SCHEMA_VERSION
    sig_alg: str | None = None  # §16: "ed25519" on v2
    request_id: str | None = None  # §19: the permission request an allow/deny answers
    always: bool | None = None  # §19: an allow that also allows the same request again (true or absent)
    sealed: Mapping[str, str] | None = None  # §19: an answer's message, sealed to the attempt (`crypto.seal_answer`)

    def __post_init__(self) -> None:
        run_check(self._check)

    def _check(self) -> None:
        check_schema(self.schema_version)
        check_choice(self.kind, "kind", ("control",))
        check_choice(self.action, "action", CONTROL_ACTIONS)
        check_job_id(self.job_id)
        check_int(self.attempt_id, "attempt_id")
        check_text(self.reason, "reason", MAX_REASON_CHARS)
        check_timestamp(self.issued_at, "issued_at")
        if self.action == ControlAction.CANCEL:
            if self.request_id is not None or self.sealed is not None:
                raise Invalid("request_id and sealed are only for an allow, deny or say (§19)")
        else:
            if not isinstance(self.request_id, str) or not names.REQUEST_ID_RE.fullmatch(self.request_id):
                raise Invalid(f"request_id {show(self.request_id)} is invalid: expected 16 lowercase hex characters")
            check_sealed(self.sealed, MAX_SAID_SEALED_CHARS if self.action == ControlAction.SAY
                         else MAX_SEALED_CHARS, "§19: an answer's message is sealed")
        if self.always is not None and (self.always is not True or self.action != ControlAction.ALLOW):
            raise Invalid("always is only true, and only on an allow (§19)")
        if self.sig is not None:
            check_sig(self.sig, self.sig_alg)

    @classmethod
    def cancel(cls, job_id: str, attempt_id: int, reason: str, *,
               issued_at: datetime | str | None = None) -> Control:
        """An unsigned cancel (sign with `crypto.sign`), §6.

        Args:
            reason: short word such as `operator`, `deadline_timeout`, `agent_blocked` (<= 256 chars).
        Raises:
            UsageError: a field breaks §6.
        """
        return build(cls, job_id=job_id, attempt_id=attempt_id, reason=reason, issued_at=ts_arg(issued_at))

    @classmethod
    def answer(cls, job_id: str, attempt_id: int, request_id: str, *, allow: bool, sealed: Mapping[str, str],
               always: bool = False, issued_at: datetime | str | None = None) -> Control:
        """An unsigned answer to a permission request (§19): action `allow` or `deny`, `reason`
        `sealed`.

        Args:
            sealed: who answered and why (what the agent is told), sealed to the attempt by
                `crypto.seal_answer`.
            always: with `allow`: the same request (tool and input) is allowed again without asking.
        Raises:
            UsageError: a field breaks §19.
        """
        return build(cls, job_id=job_id, attempt_id=attempt_id, reason=ANSWER_REASON, request_id=request_id,
                     always=True if always else None, sealed=dict(sealed),
                     action=str(ControlAction.ALLOW if allow else ControlAction.DENY), issued_at=ts_arg(issued_at))

    @classmethod
    def say(cls, job_id: str, attempt_id: int, message_id: str, *, sealed: Mapping[str, str],
            issued_at: datetime | str | None = None) -> Control:
        """An unsigned message to the attempt's running agent (§18 "Input while it runs"):
        action `say`, `request_id` the message's id, `reason` `sealed`.

        Args:
            sealed: the person's words, sealed to the attempt by `crypto.seal_answer` (action `say`).
        Raises:
            UsageError: a field breaks §18.
        """
        return build(cls, job_id=job_id, attempt_id=attempt_id, reason=ANSWER_REASON, request_id=message_id,
                     sealed=dict(sealed), action=str(ControlAction.SAY), issued_at=ts_arg(issued_at))

    @classmethod
    def from_dict(cls, obj: Mapping[str, Any]) -> Control:
        """Apply the §6 rules to a parsed payload (sig required); raises `DecodeError`."""
        return decode_object(obj, _control_from)

    def to_dict(self) -> dict[str, Any]:
        """The wire object; without `sig` while unsigned."""
        out: dict[str, Any] = {"schema_version": self.schema_version, "kind": self.kind, "action": self.action,
                               "job_id": self.job_id, "attempt_id": self.attempt_id, "reason": self.reason,
                               "issued_at": self.issued_at}
        if self.request_id is not None:
            out["request_id"] = self.request_id
        if self.always is not None:
            out["always"] = self.always
        if self.sealed is not None:
            out["sealed"] = dict(self.sealed)
        if self.sig_alg is not None:
            out["sig_alg"] = self.sig_alg
        if self.sig is not None:
            out["sig"] = self.sig
        return out


@dataclass(frozen=True)
class Presence:
    """A runner presence of §7. `running` is a tuple of job ids; `sig` None until signed."""

    session: str
    runner_id: str
    status: str
    host: str
    version: str
    max_jobs: int
    running: tuple[str, ...]
    timestamp: str
    sig: str | None = None
    kind: str = "presence"
    schema_version: int = SCHEMA_VERSION
    sig_alg: str | None = None  # §16: "ed25519" on v2
    labels: tuple[str, ...] | None = None  # §14; None (absent on the wire): an older runner, no labels
    repos: tuple[str, ...] | None = None  # §18: the repositories it serves; None (absent): none
    gpus: int | None = None  # §14 "GPUs": how many it serves; None (absent): none
    gpus_free: int | None = None  # of those, how many no job holds; only with `gpus`
    # §7: receivers ignore unknown presence fields, but keep them: the signature covers them
    extras: Mapping[str, Any] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.running, list):
            object.__setattr__(self, "running", tuple(self.running))
        if isinstance(self.labels, list):
            object.__setattr__(self, "labels", tuple(self.labels))
        if isinstance(self.repos, list):
            object.__setattr__(self, "repos", tuple(self.repos))
        run_check(self._check)

    def _check(self) -> None:
        check_schema(self.schema_version)
        check_choice(self.kind, "kind", ("presence",))
        check_session(self.session)
        check_hex32(self.runner_id, "runner_id")
        check_choice(self.status, "status", PRESENCE_STATUSES)
        check_text(self.host, "host", MAX_NAME_CHARS)
        check_text(self.version, "version", MAX_VERSION_CHARS)
        check_int(self.max_jobs, "max_jobs", 1, MAX_RUNNING)
        if not isinstance(self.running, tuple):
            raise Invalid(f"running must be an array, got {type_name(self.running)} {show(self.running)}")
        if len(self.running) > MAX_RUNNING:
            raise Invalid(f"running has {len(self.running)} entries, at most {MAX_RUNNING} are allowed")
        for index, job_id in enumerate(self.running):
            check_job_id(job_id, f"running[{index}]")
        if len(set(self.running)) != len(self.running):
            raise Invalid("running lists a job id twice")
        if self.labels is not None:
            if not isinstance(self.labels, tuple):
                raise Invalid(f"labels must be an array, got {type_name(self.labels)} {show(self.labels)}")
            try:
                names.validate_labels(self.labels)
            except UsageError as exc:
                raise Invalid(str(exc)) from None
        if self.repos is not None:
            if not isinstance(self.repos, tuple):
                raise Invalid(f"repos must be an array, got {type_name(self.repos)} {show(self.repos)}")
            try:
                names.validate_repos(self.repos)
            except UsageError as exc:
                raise Invalid(str(exc)) from None
        if self.gpus is not None or self.gpus_free is not None:
            if self.gpus is None or self.gpus_free is None:
                raise Invalid("gpus and gpus_free go together")
            check_int(self.gpus, "gpus", 1, names.MAX_GPUS)
            check_int(self.gpus_free, "gpus_free", 0, self.gpus)
        check_timestamp(self.timestamp, "timestamp")
        if self.sig is not None:
            check_sig(self.sig, self.sig_alg)

    @classmethod
    def build(cls, session: str, runner_id: str, status: str, *, host: str, version: str, max_jobs: int,
              running: Iterable[str] = (), timestamp: datetime | str | None = None,
              labels: Iterable[str] = (), repos: Iterable[str] = (),
              gpus: tuple[int, int] | None = None) -> Presence:
        """An unsigned presence (sign with `crypto.sign`), §7.

        Args:
            status: online, draining or offline; running: job ids in progress.
            labels: §14 labels, sent sorted; none: the field is left out (a v1 hub refuses it).
            repos: §18 repository names, sent sorted; none: the field is left out.
            gpus: (how many GPUs it serves, how many are free), §14; None: both fields left out.
        Raises:
            UsageError: a field breaks §7.
        """
        sorted_labels = tuple(sorted(labels))
        return build(cls, session=session, runner_id=runner_id, status=status, host=host, version=version,
                     max_jobs=max_jobs, running=tuple(running), timestamp=ts_arg(timestamp),
                     labels=sorted_labels or None, repos=tuple(sorted(repos)) or None,
                     gpus=gpus[0] if gpus else None, gpus_free=gpus[1] if gpus else None)

    @classmethod
    def from_dict(cls, obj: Mapping[str, Any]) -> Presence:
        """Apply the §7 rules to a parsed payload (sig required); raises `DecodeError`."""
        return decode_object(obj, _presence_from)

    def to_dict(self) -> dict[str, Any]:
        """The wire object; without `sig` while unsigned."""
        out: dict[str, Any] = {"schema_version": self.schema_version, "kind": self.kind, "session": self.session,
                               "runner_id": self.runner_id, "status": self.status, "host": self.host,
                               "version": self.version, "max_jobs": self.max_jobs,
                               "running": list(self.running), "timestamp": self.timestamp}
        if self.sig_alg is not None:
            out["sig_alg"] = self.sig_alg
        if self.labels is not None:
            out["labels"] = list(self.labels)
        if self.repos is not None:
            out["repos"] = list(self.repos)
        if self.gpus is not None:
            out["gpus"], out["gpus_free"] = self.gpus, self.gpus_free
        if self.extras:
            out.update({key: value for key, value in self.extras.items() if key not in out and key != "sig"})
        if self.sig is not None:
            out["sig"] = self.sig
        return out


@dataclass(frozen=True)
class Revocation:
    """The hub's notice that a runner identity is revoked (§16.7), retained on
    `ROOT/runners/<session>/revoked`. `runner_key` (base64url) is the revoked Ed25519
    public key: a notice binds one enrolment, so a re-enrolled session (new keys) is not
    stopped by an old notice. Always v2: `sig_alg` "ed25519", signed by a hub key."""

    session: str
    runner_key: str
    revoked_at: str
    sig: str | None = None
    sig_alg: str | None = None
    kind: str = "revoked"
    schema_version: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        run_check(self._check)

    def _check(self) -> None:
        check_schema(self.schema_version)
        check_choice(self.kind, "kind", ("revoked",))
        check_session(self.session)
        check_b64(self.runner_key, "runner_key", exact=RUNNER_KEY_BYTES)
        check_timestamp(self.revoked_at, "revoked_at")
        if self.sig is not None:
            if self.sig_alg is None:
                raise Invalid("sig_alg is missing: a revocation is signed by a hub key (§16.7)")
            check_sig(self.sig, self.sig_alg)

    @classmethod
    def build(cls, session: str, runner_key: str, revoked_at: str) -> Revocation:
        """An unsigned notice (sign with `crypto.pubkey.sign`), §16.7. Raises `UsageError`."""
        return build(cls, session=session, runner_key=runner_key, revoked_at=revoked_at)

    @classmethod
    def from_dict(cls, obj: Mapping[str, Any]) -> Revocation:
        """Apply the §16.7 rules to a parsed payload (sig required); raises `DecodeError`."""
        return decode_object(obj, _revocation_from)

    def to_dict(self) -> dict[str, Any]:
        """The wire object; without `sig_alg` and `sig` while unsigned."""
        out: dict[str, Any] = {"schema_version": self.schema_version, "kind": self.kind, "session": self.session,
                               "runner_key": self.runner_key, "revoked_at": self.revoked_at}
        if self.sig_alg is not None:
            out["sig_alg"] = self.sig_alg
        if self.sig is not None:
            out["sig"] = self.sig
        return out


@dataclass(frozen=True)
class Drain:
    """The hub's order to one runner to take no new job (`draining` true) or to take jobs
    again (false), retained on `ROOT/runners/<session>/drain` (§7 "Drain from the hub").
    Signed like a control (§6, §16.2): v2 for an enrolled session, else v1. Jobs it runs go on."""

    session: str
    draining: bool
    reason: str
    issued_at: str
    sig: str | None = None
    sig_alg: str | None = None
    kind: str = "drain"
    schema_version: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        run_check(self._check)

    def _check(self) -> None:
        check_schema(self.schema_version)
        check_choice(self.kind, "kind", ("drain",))
        check_session(self.session)
        if not isinstance(self.draining, bool):
            raise Invalid(f"draining must be true or false, got {type_name(self.draining)} {show(self.draining)}")
        check_text(self.reason, "reason", MAX_REASON_CHARS, empty_ok=True)
        check_timestamp(self.issued_at, "issued_at")
        if self.sig is not None:
            check_sig(self.sig, self.sig_alg)

    @classmethod
    def build(cls, session: str, draining: bool, reason: str = "", *,
              issued_at: datetime | str | None = None) -> Drain:
        """An unsigned order (sign with `crypto.sign` or `crypto.pubkey.sign`). Raises `UsageError`."""
        return build(cls, session=session, draining=draining, reason=reason, issued_at=ts_arg(issued_at))

    @classmethod
    def from_dict(cls, obj: Mapping[str, Any]) -> Drain:
        """Apply the §7 rules to a parsed payload (sig required); raises `DecodeError`."""
        return decode_object(obj, _drain_from)

    def to_dict(self) -> dict[str, Any]:
        """The wire object; without `sig` while unsigned, `sig_alg` on v2 only."""
        out: dict[str, Any] = {"schema_version": self.schema_version, "kind": self.kind, "session": self.session,
                               "draining": self.draining, "reason": self.reason, "issued_at": self.issued_at}
        if self.sig_alg is not None:
            out["sig_alg"] = self.sig_alg
        if self.sig is not None:
            out["sig"] = self.sig
        return out


def _optional_str(value: object) -> str | None:
    return value if isinstance(value, str) else None


def _event_from(obj: dict[str, Any]) -> Event:
    check_fields(obj, EVENT_FIELDS)
    return Event(**obj)


def _state_from(obj: dict[str, Any]) -> State:
    check_fields(obj, STATE_FIELDS)
    return State(**obj)


ANSWER_REASON = "sealed"
"""An answer's `reason` (§19): what it says is in `sealed`."""
MAX_SEALED_CHARS = 2048
MAX_SAID_BYTES = 8 * 1024
"""Largest message to a running agent (`say`, §18), UTF-8 bytes."""
MAX_SAID_SEALED_CHARS = 4 * -(-(MAX_SAID_BYTES + 16) // 3)
"""A `say`'s sealed ciphertext at most (base64url of MAX_SAID_BYTES and the GCM tag)."""


def _control_from(obj: dict[str, Any]) -> Control:
    check_fields(obj, CONTROL_FIELDS, optional=V2_SIGNED_FIELDS | {"request_id", "always", "sealed"})
    if obj["sig"] is None:
        raise Invalid("sig must be a string, got null")
    return Control(**obj)


def _presence_from(obj: dict[str, Any]) -> Presence:
    # §7: `labels` is optional, and unknown fields are ignored (kept only for the signature);
    # §16: `sig_alg` is a known optional field, never an extra
    optional = frozenset({"labels", "repos", "gpus", "gpus_free"})  # §14, §18
    known = PRESENCE_FIELDS | V2_SIGNED_FIELDS | optional
    extras = {key: obj.pop(key) for key in list(obj) if key not in known}
    check_fields(obj, PRESENCE_FIELDS | (optional & obj.keys()), optional=V2_SIGNED_FIELDS)
    if obj["sig"] is None:
        raise Invalid("sig must be a string, got null")
    if not isinstance(obj["running"], list):
        raise Invalid(f"running must be an array, got {type_name(obj['running'])} {show(obj['running'])}")
    return Presence(**obj, extras=extras or None)


def _revocation_from(obj: dict[str, Any]) -> Revocation:
    check_fields(obj, REVOCATION_FIELDS)
    if obj["sig"] is None or obj["sig_alg"] is None:
        raise Invalid("sig and sig_alg must be strings, got null")
    return Revocation(**obj)


def _drain_from(obj: dict[str, Any]) -> Drain:
    check_fields(obj, DRAIN_FIELDS, optional=V2_SIGNED_FIELDS)
    if obj["sig"] is None:
        raise Invalid("sig must be a string, got null")
    return Drain(**obj)
