"""§14's idle close of an attempt whose runner was killed, as the hub can judge it: `runner_lost`
when the runner's Last Will reached the hub before the close, `deadline_timeout` when it came
later (a broker slow to publish the Will, on a busy machine). The hub says both in its notes
("runner S went offline", "job J closed: ..."), in the order it saw them."""

from __future__ import annotations

from typing import Any

from mam.shared.store.records import NOTE


def idle_close_reason(notes: str, session: str, job_id: str) -> str:
    """The close reason §14 gives `job_id`'s attempt on `session`, read from the hub's notes
    (a follower's output, or `audit_notes`).

    Raises:
        AssertionError: the notes hold no close of the job.
    """
    offline_at, closed_at = notes.find(f"runner {session} went offline"), notes.find(f"job {job_id} closed: ")
    assert closed_at >= 0, f"no close of job {job_id} in the hub's notes: {notes[-3000:]}"
    return "runner_lost" if 0 <= offline_at < closed_at else "deadline_timeout"


def audit_notes(registry: Any, job_id: str) -> str:
    """The hub's notes on `job_id` in its audit log (`hub_note` lines), one per line, in order."""
    return "\n".join(str(line.get("line", "")) for line in registry.audit(job_id) if line.get("event") == NOTE)
