"""PROTOCOL §14 Matching, pure: `Fleet`, `plan` and `why_waiting` of
orchestrator/queue.py. No broker, no clock (every `now` is given)."""

from __future__ import annotations

from dataclasses import replace

from mam.orchestrator.http import views
from mam.orchestrator.queue import Fleet, QueuedJob, RunnerView, plan, queue_ranks, why_waiting

STALE_S = 100.0
NOW = 1000.0


def runner(session: str, *, labels: tuple[str, ...] = ("x",), max_jobs: int = 2, running: tuple[str, ...] = (),
           status: str = "online", verified: bool = True, seen_at: float = NOW) -> RunnerView:
    return RunnerView(session=session, runner_id="a" * 32, status=status, labels=frozenset(labels),
                      max_jobs=max_jobs, running=frozenset(running), verified=verified, seen_at=seen_at)


def job(job_id: str, *, labels: tuple[str, ...] = ("x",), session: str | None = None, priority: int = 0,
        queued_at: float = 0.0, avoid: str | None = None) -> QueuedJob:
    return QueuedJob(job_id=job_id, target_session=session, target_labels=frozenset(labels),
                     priority=priority, queued_at=queued_at, avoid_session=avoid)


def fleet_of(*views: RunnerView) -> Fleet:
    fleet = Fleet()
    for view in views:
        fleet.update(view)
    return fleet


def test_s14_free_slots_counts_running_and_inflight_once() -> None:
    fleet = fleet_of(runner("a", max_jobs=3, running=("j1",)))
    assert fleet.free_slots("a", NOW, STALE_S) == 2
    fleet.inflight("a", "j2")
    assert fleet.free_slots("a", NOW, STALE_S) == 1
    # the presence now lists j2 running: it is not counted twice
    fleet.update(runner("a", max_jobs=3, running=("j1", "j2")))
    assert fleet.free_slots("a", NOW, STALE_S) == 1
    fleet.started("a", "j2")
    fleet.started("a", "unknown")  # harmless
    assert fleet.free_slots("a", NOW, STALE_S) == 1
    assert fleet.free_slots("nobody", NOW, STALE_S) == 0


def test_s14_only_verified_online_fresh_runners_have_free_slots() -> None:
    fleet = fleet_of(runner("bad", verified=False), runner("drain", status="draining"),
                     runner("off", status="offline"), runner("old", seen_at=NOW - STALE_S - 1),
                     runner("ok"))
    assert {view.session: fleet.free_slots(view.session, NOW, STALE_S) for view in fleet.views()} == {
        "bad": 0, "drain": 0, "off": 0, "old": 0, "ok": 2}
    assert plan([job("j1"), job("j2"), job("j3")], fleet, NOW, STALE_S) == [("j1", "ok"), ("j2", "ok")]


def test_s14_labels_must_be_a_superset_and_are_remembered() -> None:
    fleet = fleet_of(runner("cpu", labels=("x",)), runner("gpu", labels=("cuda12", "gpu", "x")))
    assert plan([job("j1", labels=("gpu", "cuda12"))], fleet, NOW, STALE_S) == [("j1", "gpu")]
    assert plan([job("j1", labels=("tpu",))], fleet, NOW, STALE_S) == []
    assert plan([job("j1", labels=())], fleet, NOW, STALE_S) == [("j1", "cpu")]  # no labels: any; tie by name
    fleet.update(runner("cpu", labels=(), status="offline"))
    assert fleet.known_labels() == frozenset({"x", "gpu", "cuda12"})


def test_s14_most_free_slots_then_least_recently_handed_then_name() -> None:
    fleet = fleet_of(runner("a", max_jobs=2), runner("b", max_jobs=3), runner("c", max_jobs=3))
    # b and c tie on 3 free, neither handed yet: name; then c (3 free) before b (2), then a/b/c tie at 2...
    assert plan([job("j1")], fleet, NOW, STALE_S) == [("j1", "b")]
    fleet.inflight("c", "old1")
    fleet.inflight("b", "old2")  # b handed most recently; all three now have 2 free
    assert plan([job("j1")], fleet, NOW, STALE_S) == [("j1", "a")]
    fleet.inflight("a", "old3")
    assert plan([job("j1")], fleet, NOW, STALE_S) == [("j1", "c")]  # c: 2 free, handed before b


def test_s14_one_plan_never_over_commits_and_spreads() -> None:
    fleet = fleet_of(runner("a"), runner("b"), runner("c"))
    picked = plan([job(f"j{n:02d}", queued_at=n) for n in range(30)], fleet, NOW, STALE_S)
    assert [job_id for job_id, _ in picked] == [f"j{n:02d}" for n in range(6)]
    per_runner = {name: sum(1 for _, session in picked if session == name) for name in "abc"}
    assert per_runner == {"a": 2, "b": 2, "c": 2}
    assert [session for _, session in picked[:3]] == ["a", "b", "c"]  # spread, not stacked


def test_s14_priority_desc_then_queued_at_asc() -> None:
    fleet = fleet_of(runner("a", max_jobs=2))
    queued = [job("late", queued_at=5), job("early", queued_at=1), job("urgent", queued_at=9, priority=5)]
    assert plan(queued, fleet, NOW, STALE_S) == [("urgent", "a"), ("early", "a")]


def test_s14_a_job_without_candidate_never_blocks_another_target() -> None:
    fleet = fleet_of(runner("cpu", labels=("x",)))
    queued = [job("gpu1", labels=("gpu",), priority=9), job("gpu2", labels=("gpu",)),
              job("busy", session="away", priority=9), job("cpu1", queued_at=3)]
    assert plan(queued, fleet, NOW, STALE_S) == [("cpu1", "cpu")]


def test_s14_session_target_needs_that_runner_with_a_free_slot() -> None:
    fleet = fleet_of(runner("a", max_jobs=1, running=("other",)), runner("b"))
    assert plan([job("j1", session="a", labels=())], fleet, NOW, STALE_S) == []
    fleet.update(runner("a", max_jobs=1))
    assert plan([job("j1", session="a", labels=())], fleet, NOW, STALE_S) == [("j1", "a")]


def test_s14_retry_avoids_the_previous_runner_unless_it_is_the_only_one() -> None:
    fleet = fleet_of(runner("a", max_jobs=4), runner("b", max_jobs=1))
    assert plan([job("j1", avoid="a")], fleet, NOW, STALE_S) == [("j1", "b")]
    fleet.inflight("b", "other")
    assert plan([job("j1", avoid="a")], fleet, NOW, STALE_S) == [("j1", "a")]


def test_s14_plan_does_not_change_the_fleet() -> None:
    fleet = fleet_of(runner("a", max_jobs=1))
    assert plan([job("j1")], fleet, NOW, STALE_S) == [("j1", "a")]
    assert plan([job("j1")], fleet, NOW, STALE_S) == [("j1", "a")]
    fleet.inflight("a", "j1")
    assert plan([job("j2")], fleet, NOW, STALE_S) == []


def test_s14_why_waiting_lines() -> None:
    fleet = fleet_of(runner("g1", labels=("gpu",), max_jobs=1, running=("r1",)),
                     runner("g2", labels=("gpu",), max_jobs=1, running=("r2",)))
    queued = [job("j1", labels=("gpu",), queued_at=1), job("j2", labels=("gpu",), queued_at=2)]
    assert why_waiting(queued[1], fleet, queued, NOW, STALE_S) == (
        "queued behind 1 job for labels=gpu (2 runners match, 0 free slots)")
    line = why_waiting(job("t", labels=("tpu",)), fleet, queued, NOW, STALE_S)
    assert line.startswith("no runner has ever announced labels=tpu")
    assert "has not announced" in why_waiting(job("s", session="nope", labels=()), fleet, [], NOW, STALE_S)
    fleet.update(runner("bad", labels=("sig",), verified=False))
    assert "MAM_DISPATCH_SECRET differs" in why_waiting(job("s", labels=("sig",)), fleet, [], NOW, STALE_S)
    fleet.update(runner("g1", labels=("gpu",), status="offline"))
    fleet.update(runner("g2", labels=("gpu",), seen_at=NOW - 2 * STALE_S))
    line = why_waiting(queued[0], fleet, queued, NOW, STALE_S)
    assert line == "queued behind 0 jobs for labels=gpu: no matching runner is online (g1 offline, g2 lost)"
    for text in (line, why_waiting(queued[1], fleet, queued, NOW, STALE_S)):
        assert "\n" not in text


def test_s14_a_whole_queue_is_ranked_in_one_sort_with_the_counts_asked_job_by_job() -> None:
    """`queue_ranks`: how many jobs of the same target leave before each (priority first,
    then age, then id), the same count `why_waiting` finds for one job alone."""
    fleet = fleet_of(runner("g1", labels=("gpu",), max_jobs=1, running=("r1",)),
                     runner("c1", labels=("x",), max_jobs=1, running=("r2",)))
    queued = [job(f"j{n:02d}", labels=("gpu",) if n % 3 else ("x",), priority=n % 2, queued_at=float(n % 5))
              for n in range(30)]
    ranks = queue_ranks(queued)
    assert sorted(ranks.values()) == sorted([*range(20), *range(10)])  # 20 gpu jobs, 10 x jobs
    assert ranks["j05"] == 0 and ranks["j25"] == 1 and ranks["j01"] == 2  # gpu, priority 1, by age, then id
    for waiting in queued:
        assert why_waiting(waiting, fleet, queued, NOW, STALE_S, ranks=ranks) == why_waiting(
            waiting, fleet, queued, NOW, STALE_S)
    assert queue_ranks([]) == {}


def grouped(job_id: str, group: str, *, limit: int = 1, queued_at: float = 0.0, labels: tuple[str, ...] = ("x",),
            priority: int = 0) -> QueuedJob:
    return QueuedJob(job_id=job_id, target_session=None, target_labels=frozenset(labels), priority=priority,
                     queued_at=queued_at, group=group, group_limit=limit)


def test_s14_a_group_has_at_most_its_limit_out_and_its_jobs_leave_in_order() -> None:
    fleet = fleet_of(runner("a", max_jobs=8))
    jobs = [grouped("j1", "rel", queued_at=1), grouped("j2", "rel", queued_at=2), grouped("j3", "rel", queued_at=3),
            job("free", queued_at=4)]
    assert plan(jobs, fleet, NOW, STALE_S) == [("j1", "a"), ("free", "a")]  # one of the group, and the others go on
    assert plan(jobs[1:], fleet, NOW, STALE_S, out={"rel": ["j1"]}) == [("free", "a")]
    assert plan(jobs[1:], fleet, NOW, STALE_S, out={"rel": []}) == [("j2", "a"), ("free", "a")]
    two = [grouped(f"k{n}", "ci", limit=2, queued_at=n) for n in range(4)]
    assert plan(two, fleet, NOW, STALE_S) == [("k0", "a"), ("k1", "a")]
    assert plan(two[2:], fleet, NOW, STALE_S, out={"ci": ["k0"], "rel": ["j1", "j2"]}) == [("k2", "a")]


def test_s14_why_a_grouped_job_waits_names_the_group_and_what_runs() -> None:
    fleet = fleet_of(runner("a", max_jobs=8))
    waiting = grouped("j2", "rel")
    assert why_waiting(waiting, fleet, [waiting], NOW, STALE_S, out={"rel": ["j1"]}) == (
        "waiting for group rel (1 running: j1)")
    many = grouped("j9", "rel", limit=4)
    assert why_waiting(many, fleet, [many], NOW, STALE_S, out={"rel": ["j1", "j2", "j3", "j4"]}) == (
        "waiting for group rel (4 running: j1, j2, j3 +1 more)")
    assert why_waiting(many, fleet, [many], NOW, STALE_S, out={"rel": ["j1"]}).startswith("queued behind 0 jobs")


def test_s14_a_gpu_job_goes_only_where_its_gpus_are_free_and_says_why_it_waits() -> None:
    """§14 "GPUs": 2 GPUs, 3 jobs needing 1: two leave (never to the runner without GPUs), the
    third waits "0 free GPUs"; a dispatch in flight holds its GPUs until the presence shows it."""
    box = replace(runner("gpu-box", max_jobs=4), gpus=2, gpus_free=2)
    cpu = runner("cpu-box", max_jobs=4)
    fleet = fleet_of(box, cpu)
    jobs = [replace(job(f"j{i}", queued_at=float(i)), gpus=1) for i in range(3)]
    picked = plan(jobs, fleet, NOW, STALE_S)
    assert picked == [("j0", "gpu-box"), ("j1", "gpu-box")]
    for job_id, session in picked:
        fleet.inflight(session, job_id, gpus=1)
    assert fleet.free_gpus("gpu-box") == 0 and fleet.free_slots("gpu-box", NOW, STALE_S) == 2
    assert plan(jobs[2:], fleet, NOW, STALE_S) == []
    assert why_waiting(jobs[2], fleet, jobs[2:], NOW, STALE_S) == (
        "queued behind 0 jobs for labels=x (1 runner match, 2 free slots, 0 free GPUs; it needs 1)")
    fleet.update(replace(box, running=frozenset({"j0", "j1"}), gpus_free=0))  # both started: counted once
    assert fleet.free_gpus("gpu-box") == 0
    fleet.update(replace(box, running=frozenset({"j1"}), gpus_free=1))  # j0 ended
    fleet.started("gpu-box", "j0")
    assert plan(jobs[2:], fleet, NOW, STALE_S) == [("j2", "gpu-box")]
    greedy = replace(job("big"), gpus=4)
    assert plan([greedy], fleet, NOW, STALE_S) == []
    assert why_waiting(greedy, fleet, [greedy], NOW, STALE_S) == (
        "no runner matching labels=x has 4 GPUs (at most 2); job big waits")


def test_s7_a_last_will_makes_a_runner_lost_since_it_last_spoke() -> None:
    fleet = Fleet()
    fleet.update(runner("g1", seen_at=NOW))
    fleet.update(replace(runner("g1", status="offline", seen_at=NOW - 500.0), will=True))  # pre-signed at connect
    (view,) = fleet.views()
    assert view.will and view.seen_at == NOW  # it went silent after its last presence, not at connect
    assert views.runner_status(view, NOW + 1) == "lost"
    fleet.update(runner("g1", status="offline", seen_at=NOW + 5))  # a clean stop: offline
    assert views.runner_status(fleet.views()[0], NOW + 6) == "offline"
    fleet.update(replace(runner("g2", status="offline", seen_at=NOW - 500.0), runner_id="b" * 32, will=True))
    assert [v.seen_at for v in fleet.views() if v.session == "g2"] == [NOW - 500.0]  # no earlier word of it
