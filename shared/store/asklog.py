"""An agent's permission requests as a job's audit log records them (PROTOCOL §19): the
`permission_required` events, the hub's `permission_answered` lines and the runner's
timeout `progress` events, read into one `Ask` per request. Pure: the hub's answering
(`mam.orchestrator.asks`) and the views (`mam.shared.cli.render`) share it."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from mam.shared.protocol import names
from mam.shared.protocol.codes import EventName

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

    def to_dict(self) -> dict[str, Any]:
        return {"job_id": self.job_id, "attempt_id": self.attempt_id, "request_id": self.request_id,
                "tool": self.tool, "input": self.input, "asked_at": self.asked_at, "behavior": self.behavior,
                "answered_by": self.answered_by, "answered_at": self.answered_at, "message": self.message}


def asks_in(job_id: str, trail: Iterable[Mapping[str, Any]]) -> list[Ask]:
    """Every permission request in a job's audit `trail`, oldest first, with its answer: the
    hub's `permission_answered` line, or the runner's timeout `progress` event (§19)."""
    asked: dict[str, Ask] = {}
    for line in trail:
        data = line.get("data")
        if line.get("event") == EventName.PERMISSION_REQUIRED and isinstance(data, dict):
            request_id = data.get("request_id")
            if isinstance(request_id, str) and names.REQUEST_ID_RE.fullmatch(request_id) and request_id not in asked:
                attempt = data.get("attempt_id")
                asked[request_id] = Ask(job_id, attempt if isinstance(attempt, int) else 0, request_id,
                                        str(data.get("tool") or "?"), str(data.get("input") or ""),
                                        str(line.get("timestamp") or ""))
        elif line.get("event") == ANSWERED and line.get("request_id") in asked:
            old = asked[line["request_id"]]
            asked[old.request_id] = Ask(old.job_id, old.attempt_id, old.request_id, old.tool, old.input,
                                        old.asked_at, str(line.get("behavior")), str(line.get("by") or ""),
                                        str(line.get("timestamp") or ""), str(line.get("message") or ""))
        elif line.get("event") == EventName.PROGRESS and isinstance(data, dict) and data.get("by") == "timeout" \
                and data.get("request_id") in asked:  # the runner denied it: nobody answered in time
            old = asked[data["request_id"]]
            asked[old.request_id] = Ask(old.job_id, old.attempt_id, old.request_id, old.tool, old.input,
                                        old.asked_at, "deny", "timeout", str(line.get("timestamp") or ""),
                                        str(line.get("detail") or ""))
    return list(asked.values())


def waiting_in(record: Mapping[str, Any], trail: Iterable[Mapping[str, Any]]) -> list[Ask]:
    """The requests of `record`'s current attempt that nobody answered (any status: the
    caller decides whether an ended job can still wait)."""
    return [ask for ask in asks_in(str(record["job_id"]), trail)
            if ask.behavior is None and ask.attempt_id == record.get("attempt_id")]
