"""Which dispatch a runner takes: the §5 checks as pure functions, and the
cancel tombstones of §6. No I/O: the caller passes what it knows (its record
of the job, its busy slots, whether it drains) and acts on the verdict.

`admit_dispatch` returns `Take` (run it now), `Wait` (valid, every slot busy:
keep it for a free slot), `Refuse` (one line on stderr, PROTOCOL §5 reasons)
or `Ignore` (silently, or at debug level). `Refuse.forget` and `Ignore.forget`
say whether a dispatch kept for a free slot is dropped. `check_taken` judges
the job's retained state read just before a take (§17: an attempt runs at most
once); `check_control` does the same for the signed cancel of §6.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from mam.runner.trust import HubTrust
from mam.shared.protocol import crypto, wire
from mam.shared.protocol.errors import DecodeError, SignatureError

MAX_CANCEL_TOMBSTONES = 100_000
"""Verified cancels remembered per job id (highest attempt), oldest dropped first."""


class RefuseReason(StrEnum):
    """Why a dispatch is refused (§5); the first word of the refusal line."""

    MALFORMED = "malformed"
    SIGNATURE = "signature"
    HUB_RECORD = "hub_record"
    EXPIRED = "expired"
    REPLAYED = "replayed"
    CANCELLED = "cancelled"
    SEAL = "seal"
    TAKEN = "taken"  # §17: a state of this attempt is retained, another runner started it
    GPUS = "gpus"  # §14: the job needs more GPUs than this runner serves


# A refusal for these reasons also drops a dispatch kept for a free slot: the dispatch is
# authentic, and will never become takeable. A forged or broken one leaves the kept one alone.
_FORGETTING = frozenset({RefuseReason.HUB_RECORD, RefuseReason.EXPIRED, RefuseReason.REPLAYED,
                         RefuseReason.CANCELLED, RefuseReason.TAKEN, RefuseReason.GPUS})
# Refusals of a dispatch whose signature verified go into presence (`last_refusal`, §7): a
# forged or malformed one does not, so nobody can make a runner republish at will.
TOLD_REFUSALS = _FORGETTING | {RefuseReason.SEAL}


@dataclass(frozen=True)
class Take:
    """A valid dispatch with a free slot (§11 step 1): mirror it and run it."""

    dispatch: wire.Dispatch
    auth_token: str
    brief: str


@dataclass(frozen=True)
class Wait:
    """A valid dispatch while every slot is busy: keep it, re-check it when a slot frees (§11)."""

    dispatch: wire.Dispatch


@dataclass(frozen=True)
class Refuse:
    """A refused dispatch (§5).

    Attributes:
        job_id: the job the refusal names (the topic's when the payload cannot be read).
        reason: the `RefuseReason`.
        text: the refusal line after `refused dispatch <job_id>: `.
    """

    job_id: str
    reason: RefuseReason
    text: str

    @property
    def forget(self) -> bool:
        """True when a dispatch of this topic kept for a free slot is dropped as well."""
        return self.reason in _FORGETTING


@dataclass(frozen=True)
class Ignore:
    """Nothing to do and nothing to say on stderr (a cleared topic, another session, draining).

    Attributes:
        why: the log text ("" = none); forget: drop a dispatch of this topic kept for a free slot;
        notice: log `why` at info level (else debug).
    """

    why: str
    forget: bool = False
    notice: bool = False


Verdict = Take | Wait | Refuse | Ignore


@dataclass(frozen=True)
class RunnerState:
    """What `admit_dispatch` needs to know about the runner.

    Attributes:
        session: this runner's session (§1).
        trust: how this runner verifies the hub and opens seals (`trust.V1Trust` or `V2Trust`, §16.1).
        clock_skew_s: tolerance on `expires_at`, seconds.
        record_of: this host's record of a job id (a registry dict), or None; read-only.
        root: the registry root (named in the hub-record refusal, §8).
        busy: job ids holding a slot; max_jobs: the slot count (§11).
        accepting: False while draining, stopping, or after the one job of `--once`.
        tombstones: the verified cancels (§6).
        held: the hub ordered a drain (§7): a dispatch waits, like one for a full runner, until
            the hub's undrain.
        gpus_total, gpus_free: the GPUs it serves and how many no job holds (§14 "GPUs").
    """

    session: str
    trust: HubTrust
    clock_skew_s: float
    record_of: Callable[[str], Mapping[str, Any] | None]
    root: Path
    busy: Collection[str]
    max_jobs: int
    accepting: bool
    tombstones: Tombstones
    held: bool = False
    gpus_total: int = 0
    gpus_free: int = 0


def hub_registry_message(root: Path, job_id: str) -> str:
    """The one line saying that `root` is a hub's registry, not a runner's (§8)."""
    return (f"{root} is the hub's registry (it holds jobs dispatched from here, e.g. {job_id}); "
            "give the runner its own workspace: mam-runner run --workspace DIR ...")


def admit_dispatch(topic_job_id: str, payload: bytes, state: RunnerState) -> Verdict:
    """The §5 checks of one dispatch message, in the protocol's order.

    Args:
        topic_job_id: the job id of the dispatch topic; payload: the raw MQTT payload.
        state: what the runner knows now.
    Returns:
        `Take`, `Wait`, `Refuse` or `Ignore` (see the module docstring).
    """
    if not payload:  # a cleared dispatch (§2)
        return Ignore("", forget=True)
    try:
        dispatch = wire.decode(payload, "dispatch")
    except DecodeError as exc:
        text = exc.reason if exc.reason.startswith("malformed") else f"malformed: {exc.reason}"
        return Refuse(topic_job_id, RefuseReason.MALFORMED, text)
    job_id = dispatch.job_id
    if job_id != topic_job_id:
        return Refuse(topic_job_id, RefuseReason.MALFORMED, f"malformed: job_id {job_id} does not match the topic")
    try:
        state.trust.verify_from_hub(dispatch)  # §16: v2 with the hub's keys only
    except SignatureError as exc:
        return Refuse(job_id, RefuseReason.SIGNATURE, str(exc))
    if dispatch.session != state.session:
        return Ignore(f"dispatch {job_id} is for session {dispatch.session}, not ours")
    local = state.record_of(job_id)
    if local is not None and local.get("role") != "runner":
        return Refuse(job_id, RefuseReason.HUB_RECORD, hub_registry_message(state.root, job_id))
    if dispatch.expired(skew_s=state.clock_skew_s):
        return Refuse(job_id, RefuseReason.EXPIRED, f"expired: expires_at {dispatch.expires_at} is more than "
                                                    f"{state.clock_skew_s:g} s in the past")
    if local is not None and dispatch.attempt_id <= local["attempt_id"]:
        return Refuse(job_id, RefuseReason.REPLAYED, f"replayed: attempt {dispatch.attempt_id} already taken by "
                                                     f"this host (holds attempt {local['attempt_id']}, "
                                                     f"{local['status']})")
    cancelled = state.tombstones.get(job_id)
    if cancelled is not None and dispatch.attempt_id <= cancelled:
        return Refuse(job_id, RefuseReason.CANCELLED, f"cancelled: attempt {cancelled} was cancelled by the hub")
    try:
        auth_token, brief = state.trust.open_dispatch(dispatch)
    except SignatureError as exc:
        return Refuse(job_id, RefuseReason.SEAL, str(exc))
    if not state.accepting:
        return Ignore(f"dispatch {job_id} left retained: this runner is draining", notice=True)
    need = dispatch.work.gpus or 0 if dispatch.work is not None else 0
    if need > state.gpus_total:
        return Refuse(job_id, RefuseReason.GPUS, f"gpus: the job needs {need} GPU(s), this runner serves "
                                                 f"{state.gpus_total} (start it with --gpus)")
    if state.held or len(state.busy) >= state.max_jobs or job_id in state.busy or need > state.gpus_free:
        return Wait(dispatch)
    return Take(dispatch, auth_token, brief)


def check_taken(take: Take, state_payload: bytes | None) -> Refuse | None:
    """§17 "An attempt runs at most once": the job's retained `state`, read just
    before taking `take`, proves another runner started this attempt when it is
    a state of the same `attempt_id` (any status) signed with the attempt's
    `auth_token` (from the opened seal). A crashed broker can bring back a
    cleared dispatch; a replacement runner has no registry record of it.

    Args:
        take: the `Take` verdict of `admit_dispatch`.
        state_payload: the retained state as received; None or b"" = none.
    Returns:
        `Refuse(TAKEN)`, or None when the state proves nothing (none, another
        attempt, unreadable, or not signed with this attempt's token).
    """
    if not state_payload:
        return None
    dispatch = take.dispatch
    try:
        state = wire.decode(state_payload, "state")
        crypto.verify_event(state, take.auth_token)
    except (DecodeError, SignatureError):
        return None
    if state.job_id != dispatch.job_id or state.data.get("attempt_id") != dispatch.attempt_id:
        return None
    return Refuse(dispatch.job_id, RefuseReason.TAKEN,
                  f"taken: attempt {dispatch.attempt_id} was already started by another runner "
                  f"(retained state {state.status}, seq {state.seq}); not run again (§17)")


def check_control(topic_job_id: str, payload: bytes, trust: HubTrust) -> wire.Control | Refuse | Ignore:
    """Decode and verify a control message (§6; v2 with the hub's keys, §16).

    Returns:
        the verified `Control`; `Ignore` for a cleared topic; `Refuse` (reason
        MALFORMED or SIGNATURE, logged as `refused control <job_id>: <text>`).
    """
    if not payload:
        return Ignore("")
    try:
        control = wire.decode(payload, "control")
        if control.job_id != topic_job_id:
            raise DecodeError(f"malformed: job_id {control.job_id} does not match the topic")
        trust.verify_from_hub(control)
    except DecodeError as exc:
        return Refuse(topic_job_id, RefuseReason.MALFORMED, exc.reason or str(exc))
    except SignatureError as exc:
        return Refuse(topic_job_id, RefuseReason.SIGNATURE, getattr(exc, "reason", None) or str(exc))
    return control


def waiting_attempt(payload: bytes) -> int | None:
    """The attempt of a dispatch kept for a free slot, or None when it cannot be read."""
    try:
        return wire.decode(payload, "dispatch").attempt_id
    except DecodeError:
        return None


class Tombstones:
    """Verified cancels (§5, §6): job id → highest cancelled attempt, known job or not,
    at most `limit` job ids (the oldest dropped first). A dispatch of a cancelled
    attempt, or an earlier one, is refused: a captured dispatch re-published
    after the hub's cancel never runs."""

    def __init__(self, limit: int = MAX_CANCEL_TOMBSTONES) -> None:
        self.limit = limit
        self._attempts: OrderedDict[str, int] = OrderedDict()

    def remember(self, job_id: str, attempt_id: int) -> None:
        """Keep the cancel of `attempt_id`; an older attempt never lowers the tombstone."""
        if self._attempts.get(job_id, 0) >= attempt_id:
            return
        self._attempts[job_id] = attempt_id
        self._attempts.move_to_end(job_id)
        while len(self._attempts) > self.limit:
            self._attempts.popitem(last=False)

    def get(self, job_id: str) -> int | None:
        """The highest cancelled attempt of `job_id`, or None."""
        return self._attempts.get(job_id)

    def __contains__(self, job_id: object) -> bool:
        return job_id in self._attempts

    def __len__(self) -> int:
        return len(self._attempts)


__all__ = ["MAX_CANCEL_TOMBSTONES", "TOLD_REFUSALS", "Ignore", "Refuse", "RefuseReason", "RunnerState", "Take",
           "Tombstones", "Verdict", "Wait", "admit_dispatch", "check_control", "check_taken", "hub_registry_message",
           "waiting_attempt"]
