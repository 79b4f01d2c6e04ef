"""Jobs that run after jobs (PROTOCOL §14 "Dependencies"): `dispatch --after ID[,ID...]
[--if completed|ended]`.

A job dispatched `--after` is registered `blocked` (a hub record's status, never on the
wire). The engine (`service.HubService`) looks at it whenever it or a job it names
changes: `decide` is the pure rule, `look` reads the records it needs. When every job it
names ended as `--if` allows, it is `unblocked` (queued, its queue time starting then);
when one ended otherwise, or is gone, it is closed `dependency_failed` naming that job.
A job dispatched `--from-result A` (§18 "Handing a change on") also waits for A's result
to land, and is queued with `work.base` naming it (`result_base`); a result that cannot be
handed on fails it. `check` refuses unknown ids, the job itself, cycles and a
`--from-result` job of another repository at dispatch (exit 64).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mam.orchestrator.queuewait import settled
from mam.orchestrator.results import read_result, result_arrived
from mam.shared.protocol import names, wire
from mam.shared.protocol.codes import CloseReason, JobStatus, QueueSource
from mam.shared.protocol.errors import MamError, UsageError
from mam.shared.store.records import AFTER_IF_CHOICES, NOTE, JobNotFound, JobRecord, QueueTerms, moved, unblocked
from mam.shared.store.registry import Registry

GONE = "gone"
"""The outcome of a named job whose record is no longer in the registry (removed by `gc`)."""
MAX_WALK = 10_000
"""The cycle walk reads at most this many records; a longer chain is refused as one."""


@dataclass(frozen=True)
class Decision:
    """What a blocked job does now (§14 Dependencies).

    Attributes:
        waiting: (job id, status) of each named job that may still run, in `after` order.
        failed: why it ends `dependency_failed` (one line naming the job), or None.
        base: with `--from-result`, the `work.base` it is queued with (§18), once released.
    """

    waiting: tuple[tuple[str, str], ...] = ()
    failed: str | None = None
    base: dict[str, Any] | None = None

    @property
    def release(self) -> bool:
        """Every named job ended as `--if` allows: it is queued now."""
        return not self.waiting and self.failed is None


def outcome(record: Mapping[str, Any] | None) -> str | None:
    """How a named job ended, in words (`completed`, `error (exit 1)`, `cancelled`,
    `error (queue_timeout)`, `gone`), or None while it may still run: open, or ended and
    about to be retried or paused (§14), as `queuewait.settled` says."""
    if record is None:
        return GONE
    if not settled(record):  # type: ignore[arg-type]
        return None
    status = str(record["status"])
    if status == JobStatus.COMPLETED:
        return status
    why = record.get("close_reason") or (f"exit {record['exit_code']}" if record.get("exit_code") is not None
                                         else None)
    return f"{status} ({why})" if why else status


def decide(after: Sequence[str], after_if: str, outcomes: Mapping[str, str | None],
           statuses: Mapping[str, str] | None = None) -> Decision:
    """The rule of §14 Dependencies, pure.

    Args:
        after: the job ids it runs after; after_if: `completed` or `ended`.
        outcomes: each id's `outcome` (None: it may still run).
        statuses: each id's record status, for `waiting` (default: `open`).
    Returns:
        failed as soon as one named job is gone, or (with `completed`) ended otherwise than
        completed, even while others still run; else the ones still waited for.
    """
    for job_id in after:
        ended = outcomes.get(job_id)
        if ended == GONE:
            return Decision(failed=f"job {job_id} it runs after is gone from the registry")
        if ended is not None and after_if == AFTER_IF_CHOICES[0] and ended != JobStatus.COMPLETED:
            return Decision(failed=f"job {job_id} ended {ended}; --if completed needs it completed")
    shown = statuses or {}
    return Decision(waiting=tuple((job_id, shown.get(job_id, "open")) for job_id in after
                                  if outcomes.get(job_id) is None))


def find_cycle(job_id: str | None, after: Sequence[str],
               after_of: Callable[[str], Sequence[str]]) -> list[str] | None:
    """A chain of `after` edges that comes back to a job it passed, or None.

    Args:
        job_id: the job whose `after` is given (None: a job not registered yet, which no
            other job can name).
        after: its `after`; after_of: another job's `after` (empty when it has none or is gone).
    Returns:
        the chain, its first job repeated at its end (e.g. [A, B, A]); a chain longer than
        MAX_WALK records is returned as it stands.
    """
    start = job_id if job_id is not None else ""
    path: list[str] = [start]
    on_path = {start}
    done: set[str] = set()
    stack: list[tuple[str, list[str]]] = [(start, list(after))]
    while stack:
        node, todo = stack[-1]
        if not todo:
            stack.pop()
            path.pop()
            on_path.discard(node)
            done.add(node)
            continue
        nxt = todo.pop()
        if nxt in on_path:
            return [*path[path.index(nxt):], nxt]
        if nxt in done:
            continue
        if len(done) + len(on_path) >= MAX_WALK:
            return [*path, nxt]
        path.append(nxt)
        on_path.add(nxt)
        stack.append((nxt, list(after_of(nxt))))
    return None


def _after_of(registry: Registry) -> Callable[[str], Sequence[str]]:
    def after_of(job_id: str) -> Sequence[str]:
        try:
            after = registry.get(job_id).get("after")
        except MamError:
            return ()
        return [str(item) for item in after] if isinstance(after, list) else ()
    return after_of


def check(registry: Registry, terms: QueueTerms, work: wire.Work | None) -> None:
    """Refuse at dispatch what could never be released (§14 Dependencies, §18 "Handing a
    change on"): `check_after`, and a `--from-result` job that worked on another repository
    (or none) than this job's `--repo`.

    Raises:
        UsageError: one line, before anything is written.
    """
    check_after(registry, terms.after)
    if terms.from_result is None:
        return
    repo = work.repo if work is not None else None
    if repo is None:
        raise UsageError("--from-result goes with --repo NAME: the job starts from that job's change to the repo")
    theirs = (registry.get(terms.from_result).get("work") or {}).get("repo")
    if theirs != repo:
        raise UsageError(f"--from-result {terms.from_result}: that job worked on "
                         f"{f'repo {theirs}' if theirs else 'no repository'}, this one on repo {repo}")


def result_base(registry: Registry, job_id: str) -> tuple[dict[str, Any] | None, str | None]:
    """The `work.base` a job dispatched `--from-result job_id` starts from (§18): that job's
    latest result's attempt, base and head (its bundle is sealed into each dispatch).

    Returns:
        (base, None); (None, None) while the result its terminal announced has not landed;
        (None, why) when it cannot be handed on: no result, no commits named, no bundle, or a
        bundle over `wire.MAX_CARRIED_BUNDLE_BYTES`.
    """
    if not result_arrived(registry, job_id):
        return None, None
    result = read_result(registry, job_id)
    summary = result.summary if result is not None else None
    if result is None or summary is None:
        return None, f"job {job_id} sent no result to start from"
    base_sha, head_sha = summary.get("base_sha"), summary.get("head_sha")
    if not all(isinstance(sha, str) and names.SHA_RE.fullmatch(sha) for sha in (base_sha, head_sha)):
        return None, f"job {job_id}'s result names no commit to start from"
    if head_sha != base_sha:
        bundle = result.bundle_path
        if bundle is None:
            return None, f"job {job_id}'s result has no bundle to start from ({summary.get('note') or 'none sent'})"
        size = bundle.stat().st_size
        if size > wire.MAX_CARRIED_BUNDLE_BYTES:
            return None, (f"job {job_id}'s change is {size} bytes as a bundle, over the "
                          f"{wire.MAX_CARRIED_BUNDLE_BYTES} a dispatch carries")
    return {"job_id": job_id, "attempt": result.attempt_id, "base_sha": base_sha, "head_sha": head_sha}, None


def check_after(registry: Registry, after: Sequence[str], job_id: str | None = None) -> None:
    """Refuse what could never be released (§14 Dependencies), before anything is written.

    Raises:
        UsageError: one line: an id with no record here, the job itself, or a cycle.
    """
    for dep in after:
        if dep == job_id:
            raise UsageError(f"--after {dep} is the job itself")
        try:
            registry.get(dep)
        except JobNotFound:
            raise UsageError(f"--after {dep}: no job {dep} in this registry (`mam-orch jobs` lists them)") from None
    cycle = find_cycle(job_id, after, _after_of(registry))
    if cycle is not None:
        shown = " -> ".join(item or "this job" for item in cycle)
        raise UsageError(f"--after makes a cycle: {shown}; nothing registered")


def look(registry: Registry, record: JobRecord) -> Decision:
    """What the blocked `record` does now: its named jobs' records read, `decide` applied;
    a cycle among them (a record edited by hand) fails it too."""
    after = [str(item) for item in record.get("after") or ()]
    outcomes: dict[str, str | None] = {}
    statuses: dict[str, str] = {}
    for dep in after:
        named = registry.find(dep)
        if named is None:
            outcomes[dep] = GONE
            continue
        outcomes[dep], statuses[dep] = outcome(named), str(named["status"])
    decision = decide(after, str(record.get("after_if") or AFTER_IF_CHOICES[0]), outcomes, statuses)
    if decision.failed is None:
        cycle = find_cycle(record["job_id"], after, _after_of(registry))
        if cycle is not None:
            return Decision(failed="its jobs wait on each other: " + " -> ".join(cycle))
    source = record.get("from_result")
    if decision.release and isinstance(source, str):
        base, why = result_base(registry, source)
        if base is None:
            return Decision(failed=why) if why else Decision(waiting=((source, "ended; its result is not in yet"),))
        return Decision(base=base)
    return decision


def release(registry: Registry, job_id: str, base: Mapping[str, Any] | None = None) -> JobRecord | None:
    """`blocked` → `queued` (`records.unblocked`), with `work.base` when given (§18); None
    when it is not blocked any more."""
    with registry.transaction(job_id) as txn:
        if txn.record["status"] != JobStatus.BLOCKED:
            return None
        new = unblocked(txn.record)
        if base is not None:
            new["work"] = {**(new.get("work") or {}), "base": dict(base)}
        txn.update(new, source=QueueSource.HUB_QUEUE, reason="every job it runs after ended")
    return new


def fail(registry: Registry, job_id: str, why: str) -> JobRecord | None:
    """`blocked` → `error`, `close_reason: dependency_failed`, with `failed_line(why)` as a
    hub note written with the change (a follower that sees the record ended has read it);
    None when it is not blocked any more."""
    with registry.transaction(job_id) as txn:
        if txn.record["status"] != JobStatus.BLOCKED:
            return None
        new = moved(txn.record, JobStatus.ERROR, close_reason=CloseReason.DEPENDENCY_FAILED)
        txn.log({"event": NOTE, "line": f"WARNING: {failed_line(job_id, why)}"})
        txn.update(new, source=QueueSource.HUB_QUEUE, reason=why)
    return new


def failed_line(job_id: str, why: str) -> str:
    """What the hub says of a job closed `dependency_failed` (its note is a warning)."""
    return f"job {job_id} closed: dependency_failed ({why})"


def waiting_line(decision: Decision) -> str:
    """`blocked until job A (running) ends` (§14 Dependencies), one line."""
    shown = ", ".join(f"job {dep} ({status})" for dep, status in decision.waiting)
    return f"blocked until {shown} {'ends' if len(decision.waiting) == 1 else 'end'}"


__all__ = ["GONE", "Decision", "check", "check_after", "decide", "fail", "failed_line", "find_cycle", "look",
           "outcome", "release", "result_base", "waiting_line"]
