"""A person answers an agent's permission request from the hub (PROTOCOL §19).

The hub learns a request from the runner's signed `permission_required` event (kept in the
job's audit log with the other accepted events, §3.2); it answers with a signed `control`
whose action is `allow` or `deny`, retained on `ROOT/jobs/<job_id>/answers/<request_id>`
(the runner clears it once the agent has it), and a `permission_answered` audit line saying
who answered and when. A request is pending while its attempt is the job's current one, the
job has not ended and no answer is on record.

    asks_of(registry, "918b0612")                     # every request of the job, answered or not
    answer_from(hub, "918b0612", None, allow=True)    # the one pending request, its own connection
"""

from __future__ import annotations

import getpass
import socket
from dataclasses import replace

from mam.orchestrator.control import control_payload
from mam.orchestrator.hub import Hub
from mam.shared.protocol import crypto, names, wire
from mam.shared.protocol.codes import TERMINAL_STATUSES
from mam.shared.protocol.crypto import DispatchKeys
from mam.shared.protocol.errors import MamError, UsageError
from mam.shared.store.asklog import ANSWERED, Ask, asks_in, waiting_in
from mam.shared.store.registry import Registry
from mam.shared.transport import Transport

MAX_MESSAGE_CHARS = 256
"""Longest `deny --reason` (the control's `reason`, §6)."""


class AnswerRefused(MamError):
    """The request cannot be answered: unknown, answered already, of an older attempt, or the job ended."""


def asks_of(registry: Registry, job_id: str) -> list[Ask]:
    """Every permission request of the job, oldest first, with its answer if any (§19).

    Raises:
        UsageError: bad job id. RegistryError: the audit log cannot be read.
    """
    names.validate_job_id(job_id)
    return asks_in(job_id, registry.audit(job_id), registry.get(job_id).get("auth_token"))


def pending(registry: Registry, job_id: str) -> list[Ask]:
    """The job's requests that wait for a person: unanswered, of its current attempt, job not ended."""
    record = registry.get(job_id)
    if record["status"] in TERMINAL_STATUSES:
        return []
    return waiting_in(record, registry.audit(job_id))


def operator() -> str:
    """Who answers from this process: `user@host`."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


def choose(registry: Registry, job_id: str, request_id: str | None) -> Ask:
    """The request to answer: `request_id`, or the job's only pending one.

    Raises:
        AnswerRefused: unknown, answered already, of an older attempt, or the job ended; no pending one.
        UsageError: several pending and none named (the ids are listed).
    """
    record = registry.get(job_id)
    if request_id is None:
        waiting = pending(registry, job_id)
        if not waiting:
            raise AnswerRefused(f"job {job_id} has no permission request waiting for an answer")
        if len(waiting) > 1:
            listed = ", ".join(f"{ask.request_id} ({ask.tool})" for ask in waiting)
            raise UsageError(f"job {job_id} has {len(waiting)} requests waiting: {listed}; name one")
        return waiting[0]
    names.validate_request_id(request_id)
    found = {ask.request_id: ask for ask in asks_of(registry, job_id)}.get(request_id)
    if found is None:
        raise AnswerRefused(f"job {job_id} never asked request {request_id}")
    if found.behavior is not None:
        raise AnswerRefused(f"request {request_id} of job {job_id} was answered already "
                            f"({found.behavior} by {found.answered_by} at {found.answered_at})")
    if record["status"] in TERMINAL_STATUSES:
        raise AnswerRefused(f"job {job_id} is {record['status']}; nothing waits for an answer")
    if found.attempt_id != record["attempt_id"]:
        raise AnswerRefused(f"request {request_id} is of attempt {found.attempt_id}; job {job_id} is on "
                            f"attempt {record['attempt_id']}")
    return found


def told(allow: bool, message: str | None, who: str) -> str:
    """What the agent is told: `message` on one line, or "approved/denied by <who>".

    Raises:
        UsageError: not 1-256 characters.
    """
    text = " ".join((message or f"{'approved' if allow else 'denied'} by {who}").split())
    if not text or len(text) > MAX_MESSAGE_CHARS:
        raise UsageError(f"the reason must be 1-{MAX_MESSAGE_CHARS} characters")
    return text


def answer(registry: Registry, client: Transport, keys: DispatchKeys, job_id: str, request_id: str | None, *,
           allow: bool, message: str | None = None, by: str | None = None, always: bool = False) -> Ask:
    """Answer one permission request (§19) on a connected `client`: a signed control (v2 for
    an enrolled session, §16) retained on the request's answer topic, then a
    `permission_answered` audit line.

    Args:
        registry: the hub registry; keys: the dispatch keys (v1 signature).
        request_id: the request; None: the job's only pending one.
        allow: allow or deny.
        message: what the agent is told (a deny's reason); default "approved/denied by <by>".
        by: who answers (default `operator()`).
        always: with `allow`: the runner allows the same tool with the same input again
            without asking, for the rest of the attempt.
    Returns:
        the request with its answer.
    Raises:
        AnswerRefused (1), UsageError (64), BrokerError (3: nothing recorded).
    """
    if always and not allow:
        raise UsageError("--always goes with approve only")
    who = by or operator()
    text = told(allow, message, who)
    ask = choose(registry, job_id, request_id)
    record = registry.get(job_id)
    session = record.get("session")
    action = "allow" if allow else "deny"
    sealed = crypto.seal_answer(record["auth_token"], job_id=job_id, attempt_id=ask.attempt_id,
                                request_id=ask.request_id, action=action, message=text)
    control = wire.Control.answer(job_id, ask.attempt_id, ask.request_id, allow=allow, sealed=sealed, always=always)
    client.publish(names.answer_topic(job_id, ask.request_id, client.config.topic_root),
                   control_payload(control, session, keys, registry.root), retain=True)
    behavior = action
    line = {"event": ANSWERED, "request_id": ask.request_id, "attempt_id": ask.attempt_id, "behavior": behavior,
            "by": who, "message": text}
    registry.append_audit(job_id, {**line, "always": True} if always else line)
    return replace(ask, behavior=behavior, answered_by=who, message=text)


def answer_from(hub: Hub, job_id: str, request_id: str | None, *, allow: bool, message: str | None = None,
                always: bool = False) -> Ask:
    """`answer` on a connection of its own (`mam-orch approve|deny`).

    Raises:
        as `answer`; ConfigError (64) for the keys or broker settings.
    """
    told(allow, message, operator())  # bad input, then a refusal, before any connection is made
    choose(hub.registry, job_id, request_id)
    keys = hub.keys()
    client = hub.connect("answer", hub.registry.get(job_id))
    try:
        return answer(hub.registry, client, keys, job_id, request_id, allow=allow, message=message, always=always)
    finally:
        client.close()


def pending_everywhere(registry: Registry) -> list[Ask]:
    """Every request that waits for a person, of every unfinished hub job, oldest first."""
    records, _ = registry.list()
    found = [ask for record in records if record.get("role") == "hub" and record["status"] not in TERMINAL_STATUSES
             for ask in pending(registry, record["job_id"])]
    return sorted(found, key=lambda ask: ask.asked_at)


__all__ = ["ANSWERED", "Ask", "AnswerRefused", "answer", "answer_from", "asks_of", "choose", "operator", "pending",
           "pending_everywhere", "told"]
