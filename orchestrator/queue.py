"""The hub queue of PROTOCOL §14 as pure code: no I/O, no broker, no clock.

`Fleet` is the hub's view of every runner, fed by presence (§7): its last
`RunnerView`, the dispatches the hub published to it that have no accepted
`started` yet (in flight), and the order in which runners were handed jobs.
`plan(queued, fleet, now, stale_after_s)` says which queued jobs to publish
now and to whom (§14 Matching); `why_waiting` says in one line why a job
still waits (one line, §14). Callers pass monotonic seconds as `now`.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime

from mam.shared.protocol.codes import PresenceStatus

NEVER_HANDED = 0
"""The hand-off rank of a runner never handed a job: before every other (§14)."""

NO_SIGNATURE_HINT = ("the runner's MAM_DISPATCH_SECRET differs from the hub's; copy the hub's .mam.env")
"""What to do when a presence does not verify with this hub's key."""


@dataclass(frozen=True)
class RunnerView:
    """One runner as its last presence shows it (§7, §14).

    Attributes:
        session: the runner's session name (§1); runner_id: its id (32 hex).
        status: `online`, `draining` or `offline` (§7).
        labels: the labels it announced (§14; empty for older runners).
        repos: the repository names it serves (§18).
        max_jobs: its slot count; running: the job ids it runs.
        verified: the presence signature verifies (§7): v1 with this hub's sign key, v2 with the
            roster's key (§16.4).
        seen_at: when the hub received that presence (monotonic s).
        last_refusal: (job_id, "reason: detail") of the last dispatch it refused, from its
            presence (`last_refusal`, §7), or None.
        host, version: what the presence says of the runner's machine and software (for views).
        gpus, gpus_free: the GPUs it serves and how many no job holds (§14 "GPUs"; 0 without).
        will: the presence is its Last Will (`offline` with `will: true`, §7): the runner was lost.
    """

    session: str
    runner_id: str
    status: str
    labels: frozenset[str]
    max_jobs: int
    running: frozenset[str]
    verified: bool
    seen_at: float
    last_refusal: tuple[str, str] | None = None
    host: str = ""
    version: str = ""
    repos: frozenset[str] = frozenset()
    gpus: int = 0
    gpus_free: int = 0
    will: bool = False


@dataclass(frozen=True)
class QueuedJob:
    """One `queued` job (§14).

    Attributes:
        job_id: the job (§1); target_session: the one runner it names, or None.
        target_labels: the labels a runner must all carry (empty: any runner).
        priority: higher leaves the queue first; queued_at: seconds on any one clock
            shared by the jobs compared (e.g. the record's `queued_at`), earlier first.
        avoid_session: the previous attempt's runner (retries): chosen only
            when no other candidate exists.
        prefer_session: the previous attempt's runner when the retry continues its agent's
            session there (§18): chosen first when it has a free slot.
        repo: the repository a runner must serve (§18), or None.
        paused_until: a paused job (§14 Pauses) is not published before this wall time
            (epoch s), nor does it hold up the jobs queued behind it; None: not paused.
        group, group_limit: its concurrency group (§14 Groups): it waits while `group_limit`
            jobs of the group are out (published or running); None: no group.
        cancel_in_progress: it cancels its group's jobs queued or out before it.
        limited_session, limited_until: a moved job (§14 Moves) is not published to the
            runner it left on a usage limit before that limit's reset (epoch s); it waits for
            another runner without holding up the jobs queued behind it.
        gpus: how many GPUs it needs (§14 "GPUs"): only a runner with that many free takes it.
    """

    job_id: str
    target_session: str | None
    target_labels: frozenset[str]
    priority: int
    queued_at: float
    avoid_session: str | None = None
    prefer_session: str | None = None
    limited_session: str | None = None
    limited_until: float | None = None
    repo: str | None = None
    paused_until: float | None = None
    group: str | None = None
    group_limit: int = 1
    cancel_in_progress: bool = False
    gpus: int = 0

    def paused(self, wall_now: float) -> bool:
        """Whether it is still paused at `wall_now` (epoch s)."""
        return self.paused_until is not None and wall_now < self.paused_until

    def limited_on(self, session: str, wall_now: float) -> bool:
        """Whether `session` is the runner this moved job left on a usage limit (§14 Moves)
        and its limit has not reset at `wall_now` (epoch s)."""
        return session == self.limited_session and (self.limited_until is None or wall_now < self.limited_until)

    @property
    def target(self) -> tuple[str | None, frozenset[str], str | None]:
        """The job's target as one comparable key (jobs leave in order per target)."""
        return (self.target_session, self.target_labels, self.repo)


def queue_order(job: QueuedJob) -> tuple[int, float, str]:
    """The order jobs leave the queue in: priority descending, then queued_at ascending (§14)."""
    return (-job.priority, job.queued_at, job.job_id)


def describe_target(job: QueuedJob) -> str:
    """`session=NAME`, `labels=a,b` or `any runner` for messages."""
    if job.target_session is not None:
        return f"session={job.target_session}"
    if job.target_labels:
        return "labels=" + ",".join(sorted(job.target_labels))
    return "any runner"


class Fleet:
    """The hub's view of all runners, fed by presence (§7, §14).

    Nothing here reads a clock: every time is the caller's monotonic `now`.
    """

    def __init__(self) -> None:
        self._views: dict[str, RunnerView] = {}
        self._inflight: dict[str, set[str]] = {}
        self._inflight_gpus: dict[str, int] = {}  # job id -> the GPUs it needs, while in flight
        self._handed: dict[str, int] = {}
        self._hand_count = NEVER_HANDED
        self._labels: set[str] = set()
        self._repos: set[str] = set()

    def update(self, view: RunnerView) -> None:
        """Store a runner's latest presence; its labels and repositories join `known_labels`
        and `known_repos` (verified or not). A runner's Last Will keeps the time of the presence
        before it from the same runner, when it last spoke (§7 `lost`)."""
        before = self._views.get(view.session)
        if view.will and before is not None and before.runner_id == view.runner_id and not before.will:
            view = replace(view, seen_at=max(before.seen_at, view.seen_at))
        self._views[view.session] = view
        self._labels.update(view.labels)
        self._repos.update(view.repos)

    def forget(self, session: str) -> None:
        """Drop `session`'s presence (a revoked runner, §16): it is no candidate until it speaks again."""
        self._views.pop(session, None)

    def inflight(self, session: str, job_id: str, gpus: int = 0) -> None:
        """The hub published a dispatch for `job_id` to `session` (no `started` yet):
        it takes a slot (and `gpus` GPUs), and `session` becomes the most recently handed runner."""
        self._inflight.setdefault(session, set()).add(job_id)
        if gpus:
            self._inflight_gpus[job_id] = gpus
        self.handed(session)

    def handed(self, session: str) -> None:
        """`session` was handed a job now (the most recently handed, §14), in flight or not
        (a hub rebuilding its view from its records replays their publish order)."""
        self._hand_count += 1
        self._handed[session] = self._hand_count

    def started(self, session: str, job_id: str) -> None:
        """The hub accepted `started` (or a terminal, or gave up) for `job_id`: no longer in flight."""
        pending = self._inflight.get(session)
        self._inflight_gpus.pop(job_id, None)
        if pending is not None:
            pending.discard(job_id)
            if not pending:
                del self._inflight[session]

    def view(self, session: str) -> RunnerView | None:
        """The runner's last presence, or None when none was seen."""
        return self._views.get(session)

    def views(self) -> list[RunnerView]:
        """Every runner seen, by session name."""
        return [self._views[name] for name in sorted(self._views)]

    def inflight_count(self, session: str) -> int:
        """Dispatches published to `session` with no accepted `started`, not already in its `running`."""
        view = self._views.get(session)
        pending = self._inflight.get(session, set())
        return len(pending - view.running) if view is not None else len(pending)

    def handed_rank(self, session: str) -> int:
        """When `session` was last handed a job, as a rank (0: never; larger: more recently)."""
        return self._handed.get(session, NEVER_HANDED)

    def available(self, session: str, now: float, stale_after_s: float) -> bool:
        """The runner's last presence is verified, `online` and not stale (§14 Matching)."""
        view = self._views.get(session)
        return (view is not None and view.verified and view.status == PresenceStatus.ONLINE
                and now - view.seen_at <= stale_after_s)

    def free_slots(self, session: str, now: float, stale_after_s: float) -> int:
        """`max_jobs − |running| − in flight`, or 0 when the runner is not available (§14).

        Args:
            session: the runner; now: monotonic s; stale_after_s: a presence
                older than this (s) is stale (its runner is not a candidate).
        """
        if not self.available(session, now, stale_after_s):
            return 0
        view = self._views[session]
        return max(0, view.max_jobs - len(view.running) - self.inflight_count(session))

    def free_gpus(self, session: str) -> int:
        """`gpus_free` of the runner's presence less the GPUs of dispatches in flight to it (§14)."""
        view = self._views.get(session)
        if view is None:
            return 0
        pending = self._inflight.get(session, set()) - view.running
        return max(0, view.gpus_free - sum(self._inflight_gpus.get(job_id, 0) for job_id in pending))

    def known_labels(self) -> frozenset[str]:
        """The union of every label any presence ever announced."""
        return frozenset(self._labels)

    def known_repos(self) -> frozenset[str]:
        """The union of every repository name any presence ever announced (§18)."""
        return frozenset(self._repos)


def matches(view: RunnerView, job: QueuedJob) -> bool:
    """The runner fits the job's target: its session, labels ⊇ the job's (§14), and it
    serves the job's repository (§18)."""
    if job.target_session is not None and view.session != job.target_session:
        return False
    if job.repo is not None and job.repo not in view.repos:
        return False
    return job.gpus <= view.gpus and job.target_labels <= view.labels


def plan(queued: Sequence[QueuedJob], fleet: Fleet, now: float, stale_after_s: float,
         wall_now: float | None = None, out: Mapping[str, Sequence[str]] | None = None) -> list[tuple[str, str]]:
    """The queued jobs to publish now, each with its runner (§14 Matching).

    Candidates are verified, online, fresh runners whose labels ⊇ the job's and
    with free slots left after the jobs this call already assigned (no runner
    is ever over-committed). Among them: not the job's `avoid_session` unless it
    is the only one, its `prefer_session` first, then most free slots, then least recently handed a job,
    then session name. Jobs go in (priority desc, queued_at asc) order; once a
    job of a target finds no candidate, later jobs of that target wait too,
    while other targets go on. `fleet` is not changed: call `fleet.inflight`
    for each pair actually published.

    Args:
        queued: the `queued` jobs, any order; fleet: the runners; now: monotonic s;
        stale_after_s: the presence age (s) past which a runner is no candidate;
        wall_now: epoch s for `paused_until` (default: now), a paused job is left out.
        out: each concurrency group's jobs published or running now (§14 Groups): a job
            whose group has `group_limit` out (these and the ones this call picks) waits,
            without holding up other jobs of its target.

    Returns:
        `[(job_id, session)]` in the order to publish.
    """
    free = {view.session: fleet.free_slots(view.session, now, stale_after_s) for view in fleet.views()}
    gpus = {view.session: fleet.free_gpus(view.session) for view in fleet.views()}
    handed = {view.session: fleet.handed_rank(view.session) for view in fleet.views()}
    rank = max(handed.values(), default=NEVER_HANDED)
    blocked: set[tuple[str | None, frozenset[str], str | None]] = set()
    picked: list[tuple[str, str]] = []
    wall = time.time() if wall_now is None else wall_now
    taken = {group: len(jobs) for group, jobs in (out or {}).items()}
    for job in sorted(queued, key=queue_order):
        if job.target in blocked or job.paused(wall):
            continue
        if job.group is not None and taken.get(job.group, 0) >= job.group_limit:
            continue
        candidates = [view.session for view in fleet.views() if free[view.session] > 0 and matches(view, job)
                      and gpus[view.session] >= job.gpus and not job.limited_on(view.session, wall)]
        if not candidates:
            if job.limited_session is None:  # a moved job waits for another runner without holding others up
                blocked.add(job.target)
            continue
        session = min(candidates, key=lambda name: (name == job.avoid_session, name != job.prefer_session,
                                                    -free[name], handed[name], name))
        free[session] -= 1
        gpus[session] -= job.gpus
        rank += 1
        handed[session] = rank
        picked.append((job.job_id, session))
        if job.group is not None:
            taken[job.group] = taken.get(job.group, 0) + 1
    return picked


def queue_ranks(queued: Iterable[QueuedJob]) -> dict[str, int]:
    """For each job of `queued`, how many of them of the same target leave before it (§14):
    the "queued behind N jobs" of `why_waiting`, for a whole queue in one sort, where asking
    `why_waiting` job by job would compare every pair."""
    ranks: dict[str, int] = {}
    before: dict[tuple[str | None, frozenset[str], str | None], int] = {}
    for job in sorted(queued, key=queue_order):
        ranks[job.job_id] = before.get(job.target, 0)
        before[job.target] = ranks[job.job_id] + 1
    return ranks


def _ahead(job: QueuedJob, queued: Iterable[QueuedJob]) -> int:
    """How many other queued jobs of the same target leave before `job`."""
    mine = queue_order(job)
    return sum(1 for other in queued
               if other.job_id != job.job_id and other.target == job.target and queue_order(other) < mine)


def _plural(count: int, word: str) -> str:
    return f"{count} {word}" if count == 1 else f"{count} {word}s"


def unserved(job: QueuedJob, fleet: Fleet) -> bool:
    """True when no runner the hub has seen could take `job`: it needs labels nobody announced, or
    a repository no runner serves (§14, §18). Such a job waits until its queue timeout."""
    if job.target_labels - fleet.known_labels():
        return True
    if job.gpus and not any(view.gpus >= job.gpus for view in fleet.views()):
        return True
    return job.repo is not None and not any(job.repo in view.repos for view in fleet.views())


def why_waiting(job: QueuedJob, fleet: Fleet, queued: Sequence[QueuedJob], now: float,
                stale_after_s: float, out: Mapping[str, Sequence[str]] | None = None,
                ranks: Mapping[str, int] | None = None) -> str:
    """One human line saying why `job` is still queued (§14).

    Args:
        job: the waiting job; fleet: the runners; queued: every queued job (for
        the count ahead); now: monotonic s; stale_after_s, out: as for `plan`;
        ranks: `queue_ranks(queued)`, given by a caller asking for many jobs of one queue.

    Returns:
        e.g. "queued behind 3 jobs for labels=gpu (2 runners match, 0 free slots)".
    """
    target = describe_target(job)
    if job.paused(time.time()) and job.paused_until is not None:
        until = datetime.fromtimestamp(job.paused_until, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
        return (f"paused until {until} (usage limit); then it continues on {target} "
                f"(`mam-orch resume {job.job_id}` goes on now)")
    wall = time.time()
    if job.limited_session is not None and job.limited_until is not None and wall < job.limited_until \
            and not [view for view in fleet.views() if matches(view, job) and not job.limited_on(view.session, wall)]:
        until = datetime.fromtimestamp(job.limited_until, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
        return (f"moved off {job.limited_session} (usage limit until {until}): no other runner matches {target}; "
                f"it waits for one, or for {job.limited_session} after that")
    running = sorted((out or {}).get(job.group, ())) if job.group is not None else []
    if job.group is not None and len(running) >= job.group_limit:
        shown = ", ".join(running[:3]) + (f" +{len(running) - 3} more" if len(running) > 3 else "")
        return f"waiting for group {job.group} ({len(running)} running: {shown})"
    missing = job.target_labels - fleet.known_labels()
    if missing:
        return (f"no runner has ever announced labels={','.join(sorted(missing))} "
                f"(job {job.job_id} waits for {target})")
    matching = [view for view in fleet.views() if matches(view, job)]
    if job.repo is not None and not matching:
        return _no_repo(job, fleet)
    if job.gpus and not matching and [view for view in fleet.views() if matches(view, replace(job, gpus=0))]:
        most = max((view.gpus for view in fleet.views() if matches(view, replace(job, gpus=0))), default=0)
        return (f"no runner matching {target} has {_plural(job.gpus, 'GPU')} (at most {most}); "
                f"job {job.job_id} waits")
    if job.target_session is not None and not matching:
        return f"runner {job.target_session} has not announced itself (no presence seen); job {job.job_id} waits"
    unverified = [view.session for view in matching if not view.verified]
    if unverified and len(unverified) == len(matching):
        return (f"runner {', '.join(unverified)} is online but its presence signature does not verify "
                f"with this hub's key ({NO_SIGNATURE_HINT})")
    if not matching:
        return f"no runner matches {target} (job {job.job_id} waits)"
    available = [view for view in matching if fleet.available(view.session, now, stale_after_s)]
    free = sum(fleet.free_slots(view.session, now, stale_after_s) for view in available)
    ahead = ranks[job.job_id] if ranks is not None and job.job_id in ranks else _ahead(job, queued)
    if not available:
        states = ", ".join(f"{view.session} {_state(view, now, stale_after_s)}" for view in matching)
        return f"queued behind {_plural(ahead, 'job')} for {target}: no matching runner is online ({states})"
    gpus = ""
    if job.gpus:
        free_gpus = max(fleet.free_gpus(view.session) for view in available)
        gpus = f", {_plural(free_gpus, 'free GPU')}; it needs {job.gpus}"
    return (f"queued behind {_plural(ahead, 'job')} for {target} "
            f"({_plural(len(available), 'runner')} match, {_plural(free, 'free slot')}{gpus})")


def _no_repo(job: QueuedJob, fleet: Fleet) -> str:
    """Why a repository job (§18) has no matching runner: nobody serves the repo, or not
    the runner (or labels) it names."""
    hint = f"start one with `mam-runner run --repo {job.repo}=URL ...`"
    if job.repo not in fleet.known_repos():
        return f"no runner serves repo {job.repo} ({hint}); job {job.job_id} waits"
    serving = sorted(view.session for view in fleet.views() if job.repo in view.repos)
    return (f"no runner matching {describe_target(job)} serves repo {job.repo} (served by "
            f"{', '.join(serving) or 'none online'}; {hint}); job {job.job_id} waits")


def _state(view: RunnerView, now: float, stale_after_s: float) -> str:
    if not view.verified:
        return "unverified"
    if view.will or (view.status == PresenceStatus.ONLINE and now - view.seen_at > stale_after_s):
        return "lost"
    return view.status
