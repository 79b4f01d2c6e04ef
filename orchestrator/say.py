"""A person's message to a running agent (PROTOCOL §18 "Input while it runs").

An agent whose runner reads it input while it works (Claude Code in stream-json input; its
`started` event says `takes_input`) can be told more mid-run: `mam-orch say JOB TEXT` on a
running job publishes a signed control with action `say`, the words sealed to the attempt
like an answer (§19), retained on `ROOT/jobs/<job_id>/answers/<message_id>`. The runner
writes them to the agent's stdin and records a `progress` event saying whether they were
delivered (`data.message_id`, `delivered`); this module waits for that event in the job's
audit log. The words never enter the audit log: a `told` line records who, when and how many
bytes.

    say_running(hub, "918b0612", "Also add a test.")   # (delivered, the runner's detail)
"""

from __future__ import annotations

import secrets
import time

from mam.orchestrator.asks import operator
from mam.orchestrator.control import control_payload
from mam.orchestrator.follow import AuditTail
from mam.orchestrator.hub import Hub
from mam.orchestrator.service import EmbeddedService
from mam.shared.protocol import crypto, names, wire
from mam.shared.protocol.codes import ControlAction, EventName, JobStatus
from mam.shared.protocol.errors import MamError, UsageError
from mam.shared.store.records import JobRecord, Refusal, utc_now
from mam.shared.store.registry import Registry

TOLD = "told"
"""The audit line of a message sent to a running agent (never its words; `said` is a
follow-up that continued an ended job)."""
DELIVERY_WAIT_S = 30.0
"""How long `say` waits for the runner to say whether the agent got the message, seconds."""
POLL_S = 0.05


class NoWord(MamError):
    """The runner said nothing of the message in time (it may still deliver it: it stays retained)."""


def takes_input(registry: Registry, job_id: str, attempt_id: int) -> bool:
    """True when the attempt's `started` event says its agent reads input while it runs."""
    for line in registry.audit(job_id):
        data = line.get("data")
        if line.get("event") == EventName.STARTED and isinstance(data, dict) \
                and data.get("attempt_id") == attempt_id and data.get("takes_input") is True:
            return True
    return False


def check_running(registry: Registry, job_id: str, words: str) -> JobRecord:
    """The job's record when `words` may go to its running agent.

    Raises:
        UsageError: the words are over `wire.MAX_SAID_BYTES`.
        Refusal: the job does not run, or its agent takes no input while it runs.
    """
    size = len(words.encode("utf-8", "surrogatepass"))
    if size > wire.MAX_SAID_BYTES:
        raise UsageError(f"TEXT is {size} bytes: a running agent is told at most {wire.MAX_SAID_BYTES} at once")
    record = registry.get(job_id)
    if record["status"] != JobStatus.RUNNING:
        raise Refusal(job_id, "not_allowed", f"refused say: the job is {record['status']}, not running")
    if not takes_input(registry, job_id, record["attempt_id"]):
        raise Refusal(job_id, "not_allowed", "refused say: its agent takes no input while it runs (Claude Code "
                                             "with --input-format stream-json does); say it again once the job "
                                             "ended, to continue its session")
    return record


def say_running(hub: Hub, job_id: str, words: str, *, wait_s: float = DELIVERY_WAIT_S) -> tuple[bool, str]:
    """Send `words` to the job's running agent and wait for the runner's word on them.

    Returns:
        (delivered, the runner's detail), e.g. (False, "message … not delivered: the agent
        finished its turn").
    Raises:
        UsageError (64), Refusal (1: not running, no input), BrokerError (3: nothing sent),
        NoWord (2: sent, no word within `wait_s`).
    """
    registry = hub.registry
    record = check_running(registry, job_id, words)
    keys = hub.keys()
    engine = EmbeddedService(hub)  # some engine mirrors the runner's event into the audit log
    try:
        engine.ensure()
        tail = AuditTail(registry.audit_path(job_id))
        tail.skip()
        message_id = secrets.token_hex(8)
        attempt = record["attempt_id"]
        sealed = crypto.seal_answer(record["auth_token"], job_id=job_id, attempt_id=attempt, request_id=message_id,
                                    action=str(ControlAction.SAY), message=words)
        control = wire.Control.say(job_id, attempt, message_id, sealed=sealed)
        payload = control_payload(control, record.get("session"), keys, registry.root)
        client = hub.connect("say", record)
        try:
            client.publish(names.answer_topic(job_id, message_id, client.config.topic_root), payload, retain=True)
        finally:
            client.close()
        registry.append_audit(job_id, {"event": TOLD, "timestamp": utc_now(), "message_id": message_id,
                                       "attempt_id": attempt,
                                       "by": operator(), "bytes": len(words.encode("utf-8", "surrogatepass"))})
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            for line in tail.read():
                data = line.get("data")
                if line.get("event") == EventName.PROGRESS and isinstance(data, dict) \
                        and data.get("message_id") == message_id:
                    return data.get("delivered") is True, str(line.get("detail") or "")
            time.sleep(POLL_S)
        raise NoWord(f"job {job_id}: no word from its runner on message {message_id} within {wait_s:g} s; "
                     "it stays retained for the runner")
    finally:
        engine.stop()


__all__ = ["DELIVERY_WAIT_S", "TOLD", "NoWord", "check_running", "say_running", "takes_input"]
