"""An agent's permission requests as a job's audit log records them (PROTOCOL §19): the
`permission_required` events, the hub's `permission_answered` lines and the runner's
timeout `progress` events, read into one `Ask` per request. Pure: the hub's answering
(`mam.orchestrator.asks`) and the views (`mam.shared.cli.render`) share it."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from mam.shared.protocol import crypto, names
from mam.shared.protocol.codes import EventName
from mam.shared.protocol.errors import MamError

ANSWERED = "permission_answered"
"""The audit line of an answer the hub sent (§19)."""


@dataclass(frozen=True)
class Ask:
    """One permission request of a job, with its answer when there is one (§19)."""

    job_id: str
    attempt_id: int
    request_id: str
    tool: str
    input: str
    asked_at: str
    behavior: str | None = None  # "allow" | "deny" once answered
    answered_by: str | None = None
    answered_at: str | None = None
    message: str | None = None
    full_input: str | None = None  # the whole input as JSON, opened from its seal (None: none, or no key)

    def to_dict(self) -> dict[str, Any]:
        return {"job_id": self.job_id, "attempt_id": self.attempt_id, "request_id": self.request_id,
                "tool": self.tool, "input": self.input, "asked_at": self.asked_at, "behavior": self.behavior,
                "answered_by": self.answered_by, "answered_at": self.answered_at, "message": self.message,
                "full_input": self.full_input}


def sealed_input(auth_token: str | None, job_id: str, attempt_id: int, request_id: str, sealed: object) -> str | None:
    """The whole input a request sealed to the hub (§19), or None (no seal, no key, or it
    does not open: a request that was tampered with shows only its summary)."""
    if not auth_token or not isinstance(sealed, Mapping):
        return None
    try:
        plain = crypto.open_bytes(crypto.ask_key(auth_token), sealed,
                                  crypto.ask_associated(job_id, attempt_id, request_id))
    except MamError:
        return None
    return plain.decode("utf-8", "replace")


def asks_in(job_id: str, trail: Iterable[Mapping[str, Any]], auth_token: str | None = None) -> list[Ask]:
    """Every permission request in a job's audit `trail`, oldest first, with its answer: the
    hub's `permission_answered` line, or the runner's timeout `progress` event (§19). With the
    job's `auth_token`, each request's sealed whole input is opened (`full_input`)."""
    asked: dict[str, Ask] = {}
    for line in trail:
        data = line.get("data")
        if line.get("event") == EventName.PERMISSION_REQUIRED and isinstance(data, dict):
            request_id = data.get("request_id")
            if isinstance(request_id, str) and names.REQUEST_ID_RE.fullmatch(request_id) and request_id not in asked:
                given = data.get("attempt_id")
                attempt = given if isinstance(given, int) else 0
                asked[request_id] = Ask(job_id, attempt, request_id, str(data.get("tool") or "?"),
                                        str(data.get("input") or ""), str(line.get("timestamp") or ""),
                                        full_input=sealed_input(auth_token, job_id, attempt, request_id,
                                                                data.get("input_sealed")))
        elif line.get("event") == ANSWERED and line.get("request_id") in asked:
            old = asked[line["request_id"]]
            asked[old.request_id] = replace(old, behavior=str(line.get("behavior")),
                                            answered_by=str(line.get("by") or ""),
                                            answered_at=str(line.get("timestamp") or ""),
                                            message=str(line.get("message") or ""))
        elif line.get("event") == EventName.PROGRESS and isinstance(data, dict) and data.get("by") == "timeout" \
                and data.get("request_id") in asked:  # the runner denied it: nobody answered in time
            old = asked[data["request_id"]]
            asked[old.request_id] = replace(old, behavior="deny", answered_by="timeout",
                                            answered_at=str(line.get("timestamp") or ""),
                                            message=str(line.get("detail") or ""))
    return list(asked.values())


def waiting_in(record: Mapping[str, Any], trail: Iterable[Mapping[str, Any]]) -> list[Ask]:
    """The requests of `record`'s current attempt that nobody answered (any status: the
    caller decides whether an ended job can still wait)."""
    return [ask for ask in asks_in(str(record["job_id"]), trail)
            if ask.behavior is None and ask.attempt_id == record.get("attempt_id")]
