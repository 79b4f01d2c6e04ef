"""Queue a job at the hub (PROTOCOL §14): the one way `dispatch`, `POST /api/jobs`, `mam.Hub`
and a schedule's tick register a job `queued` for the engine to publish."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mam.orchestrator.dependencies import check as check_dependencies
from mam.orchestrator.dispatch import job_title, save_brief
from mam.orchestrator.identity import roster
from mam.orchestrator.wake import wake_engine
from mam.shared.protocol import wire
from mam.shared.protocol.errors import UsageError
from mam.shared.store.records import JobRecord, QueueTerms
from mam.shared.store.registry import Registry


def refuse_revoked(registry: Registry, session: str | None) -> None:
    """A job for a revoked session could only wait out its queue timeout: refused (§16.7).

    Raises:
        UsageError: the session's roster entry is revoked (one line: when, and what to do).
    """
    entry = roster.get(registry.root, session) if session else None
    if entry is not None and entry.revoked_at is not None:
        raise UsageError(f"session {session} was revoked at {entry.revoked_at} (`mam-orch runner revoke`): no "
                         f"runner of it may take a job; enrol it again, or dispatch to another session")


def register_queued(registry: Registry, *, brief: str, contract: wire.Contract, terms: QueueTerms,
                    work: wire.Work | None = None, title: str | None = None,
                    schedule: Mapping[str, Any] | None = None) -> JobRecord:
    """Register a checked job `queued` with its brief (and its repository and agent policy,
    §18), for the engine to publish (§14): the one way `dispatch`, `POST /api/jobs` and
    `mam.Hub` queue a job (and a schedule fires one, with its `schedule` tick). Its `title` is
    `title`, else the brief's first line (`job_title`). The brief is on disk before the record
    exists, so a process killed in between leaves no record an engine could not publish.

    Raises:
        UsageError: the target session is revoked (`refuse_revoked`); a bad title; `--after`
            names an unknown job or makes a cycle, `--from-result` another repository (`dependencies.check`).
    """
    name = job_title(brief, title)
    refuse_revoked(registry, terms.target_session)
    check_dependencies(registry, terms, work)
    record = registry.register(session=terms.target_session, contract=contract, queue=terms, work=work,
                               title=name, schedule=schedule,
                               prepare=lambda job_id: save_brief(registry, job_id, brief))  # brief first: §14
    wake_engine(registry.root)  # the engine publishes it now, not at its next scan (§14)
    return record


__all__ = ["refuse_revoked", "register_queued"]
