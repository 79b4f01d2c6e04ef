"""Pauses at usage limits (PROTOCOL §14 Pauses, §18): the runner's adapters tell a usage or
rate limit from other errors and read its reset; the hub pauses such a job (attempt + 1
queued for the same runner, not published before the reset), `mam-orch resume` ends the
pause early, and `--on-limit fail` keeps the old `error`. The real CLI hitting a 429 is in
tests/e2e/test_claude_agent.py."""

from __future__ import annotations

import dataclasses
import json
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from test_hub_queue_registry import fleet_of

from mam.orchestrator.queue import Fleet, RunnerView, plan, why_waiting
from mam.orchestrator.queuewait import (
    DEFAULT_LIMIT_PAUSE_S,
    MAX_PAUSES,
    limit_pause,
    mark_published,
    move_attempt,
    pause_attempt,
    queued_job,
    resume_paused,
    settled,
)
from mam.runner.agents import ClaudeAdapter
from mam.runner.agents.base import AgentReport, is_usage_limit, reset_time
from mam.shared.cli import render
from mam.shared.protocol import wire
from mam.shared.protocol.errors import UsageError
from mam.shared.store.records import QueueTerms, Refusal
from mam.shared.store.registry import Registry

pytestmark = pytest.mark.timeout(60)

NOW = datetime(2026, 12, 4, 21, 0, 0, tzinfo=UTC).timestamp()
SESSION = "8d99b0b5-6eb4-42d6-86de-f6ab1a4fe0ee"


# ------------------------------------------------------------------ the runner's adapters

@pytest.mark.parametrize("text", [
    'API Error: 429 {"type":"error","error":{"type":"rate_limit_error","message":"usage limit reached"}}',
    "Claude AI usage limit reached|1764882000",
    "You've hit your usage limit. Try again at 3:05 PM.",
    "stream error: rate limit exceeded (HTTP 429)",
    "API Error: Request rejected (429) · try later",  # what Claude Code 2.1 printed here
])
def test_s18_usage_and_rate_limits_are_told_apart(text: str) -> None:
    assert is_usage_limit(text)


@pytest.mark.parametrize("text", [
    'API Error: 529 {"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}',
    "read 429 bytes then the connection closed",
    "API Error: 500 internal",
])
def test_s18_other_errors_are_not_limits(text: str) -> None:
    assert not is_usage_limit(text)


@pytest.mark.parametrize(("text", "expected"), [
    ("Claude AI usage limit reached|1796419800", NOW + 1800),
    ("usage limit reached; resets at 2026-12-04T21:30:05Z", NOW + 1805),
    ("usage limit reached; resets at 2026-12-04 22:00", NOW + 3600),  # no zone: UTC
    ("usage limit reached; resets at 2026-12-04T23:00:00+02:00", NOW),  # 21:00 UTC: now
    ("rate limited, retry after 90 seconds", NOW + 90),
    ("limit reached, try again in 2 hours", NOW + 7200),
    ("usage limit reached; resets at 2026-11-04T21:00:00Z", None),  # a month ago: not believed
    ("usage limit reached; resets at 2027-12-04T21:00:00Z", None),  # a year ahead: not believed
    ("usage limit reached; resets at 2026-13-45T99:00:00Z", None),  # no such time
    ("usage limit reached", None),
])
def test_s18_the_reset_time_is_read_from_the_agents_words(text: str, expected: float | None) -> None:
    assert reset_time(text, NOW) == expected


AHEAD = wire.format_ts(datetime.now(UTC) + timedelta(days=1))
"""A reset the runner believes whenever the test runs (it reads the text against the real clock)."""


def test_s18_a_limit_is_its_own_outcome_with_the_reset_in_the_terminal_data() -> None:
    report = AgentReport(kind="claude", error=f"usage limit reached; resets at {AHEAD} (HTTP 429)")
    assert report.outcome(1) == ("error", f"usage_limit: usage limit reached; resets at {AHEAD} (HTTP 429)")
    assert report.data()["usage_limit"] == {"reset_at": AHEAD}
    unknown = AgentReport(kind="claude", error="usage limit reached")
    assert unknown.data()["usage_limit"] == {}
    assert "usage_limit" not in AgentReport(kind="claude", error="API Error: 500").data()
    assert AgentReport(kind="claude", error="API Error: 500").outcome(1) == ("error", "agent_error: API Error: 500")


def test_s18_claude_code_s_429_result_is_a_usage_limit() -> None:
    adapter = ClaudeAdapter()
    adapter.feed(json.dumps({"type": "result", "subtype": "success", "is_error": True, "api_error_status": 429,
                             "result": 'API Error: 429 {"error":{"message":"usage limit reached; resets at '
                                       f'{AHEAD}"}}}}', "session_id": SESSION, "num_turns": 1}))
    event, detail = adapter.report().outcome(0) or ("", "")
    assert event == "error" and detail.startswith("usage_limit: API Error: 429"), detail
    assert adapter.report().data()["usage_limit"] == {"reset_at": AHEAD}


# ------------------------------------------------------------------ the hub

def limited(reg: Registry, *, on_limit: str = "pause", reset_at: str | None = "2026-12-04T21:30:05Z",
            labels: bool = True) -> str:
    """A job of label x whose attempt 1 ran on r1 and ended `error` on a usage limit."""
    terms = QueueTerms(target_labels=("x",)) if labels else QueueTerms(target_session="r1")
    record = reg.register(session=None, queue=terms._replace(on_limit=on_limit),
                          work=wire.Work(repo="demo"))
    job_id = record["job_id"]
    mark_published(reg, job_id, "r1")
    limit = {"reset_at": reset_at} if reset_at else {}
    agent = {"kind": "claude", "session_id": SESSION, "turns": 1, "tokens": {}, "usage_limit": limit}
    with reg.transaction(job_id) as txn:
        txn.store_event({"event": "started", "seq": 1, "data": {"sha": "a" * 40}})
    with reg.transaction(job_id) as txn:
        txn.store_event({"event": "error", "seq": 2, "detail": "usage_limit: usage limit reached",
                         "data": {"exit_code": 1, "agent": agent}})
    return job_id


def test_s14_a_limited_attempt_pauses_for_the_same_runner_until_the_reset(tmp_path: Path) -> None:
    reg = Registry(tmp_path)
    job_id = limited(reg)
    record = reg.get(job_id)
    assert record["usage_limit"] == {"attempt_id": 1, "reset_at": "2026-12-04T21:30:05Z"}
    assert not settled(record)  # a follower waits: the job goes on after the pause
    until = limit_pause(record, NOW)
    assert until == NOW + 1805
    new = pause_attempt(reg, job_id, until, None, None)
    assert new is not None and (new["status"], new["attempt_id"], new["pauses"]) == ("queued", 2, 1)
    assert new["paused_until"] == "2026-12-04T21:30:05Z" and new["target"] == {"session": "r1"}
    assert new.get("retried", 0) == 0 and new["work"]["resume"]["session_id"] == SESSION
    assert [(r["attempt_id"], r["outcome"]) for r in render.attempts(new)] == [
        (1, "paused (usage_limit)"), (2, "queued")]
    (line,) = [a for a in reg.audit(job_id) if a["event"] == "paused"]
    assert (line["attempt_id"], line["until"], line["next_attempt"]) == (1, "2026-12-04T21:30:05Z", 2)
    assert pause_attempt(reg, job_id, until, None, None) is None  # already done: nothing twice

    job = queued_job(new)
    assert job.paused(NOW) and not job.paused(NOW + 1806)
    fleet = Fleet()
    fleet.update(RunnerView(session="r1", runner_id="a" * 32, status="online", labels=frozenset({"x"}), max_jobs=1,
                            running=frozenset(), verified=True, seen_at=time.monotonic(), repos=frozenset({"demo"})))
    assert plan([job], fleet, time.monotonic(), 60, wall_now=NOW) == []
    assert plan([job], fleet, time.monotonic(), 60, wall_now=NOW + 1806) == [(job_id, "r1")]


def test_s14_a_paused_job_does_not_hold_up_the_jobs_behind_it(tmp_path: Path) -> None:
    reg = Registry(tmp_path)
    paused = pause_attempt(reg, limited(reg, labels=False), time.time() + 3600, None, None)
    assert paused is not None
    later = reg.register(session=None, queue=QueueTerms(target_session="r1"))
    jobs = [queued_job(paused), queued_job(later)]
    assert plan(jobs, fleet_of("r1", labels=()), time.monotonic(), 60) == [(later["job_id"], "r1")]
    why = why_waiting(jobs[0], fleet_of("r1", labels=()), jobs, time.monotonic(), 60)
    assert why.startswith("paused until ") and "(usage limit)" in why and f"mam-orch resume {paused['job_id']}" in why


def test_s14_resume_ends_the_pause_now_and_refuses_a_job_that_is_not_paused(tmp_path: Path) -> None:
    reg = Registry(tmp_path)
    job_id = limited(reg)
    with pytest.raises(Refusal, match="refused resume: the job is error, not paused"):
        resume_paused(reg, job_id)
    pause_attempt(reg, job_id, time.time() + 3600, None, None)
    resumed = resume_paused(reg, job_id)
    assert "paused_until" not in resumed and resumed["status"] == "queued"
    assert not queued_job(resumed).paused(time.time())
    assert any(a["event"] == "resumed" for a in reg.audit(job_id))
    with pytest.raises(Refusal, match="not paused"):
        resume_paused(reg, job_id)
    mark_published(reg, job_id, "r1")
    assert "paused_until" not in reg.get(job_id)


def test_s14_on_limit_fail_no_reset_said_and_too_many_pauses(tmp_path: Path) -> None:
    reg = Registry(tmp_path)
    failed = reg.get(limited(reg, on_limit="fail"))
    assert limit_pause(failed, NOW) is None and settled(failed)
    unsaid = reg.get(limited(reg, reset_at=None))
    assert limit_pause(unsaid, NOW) == NOW + DEFAULT_LIMIT_PAUSE_S
    assert limit_pause({**unsaid, "pauses": MAX_PAUSES}, NOW) is None  # type: ignore[typeddict-item]
    hostile = limited(reg, reset_at="tomorrow; rm -rf /")
    assert reg.get(hostile)["usage_limit"]["reset_at"] is None
    with pytest.raises(UsageError, match="--on-limit 'later' is invalid"):
        QueueTerms(target_labels=("x",), on_limit="later").checked()


# ------------------------------------------------------------------ --on-limit move

def repo_fleet(*sessions: str) -> Fleet:
    """Runners of label x serving repo demo, one free slot each."""
    return fleet_of(*sessions, repos=("demo",))


def test_s14_a_moved_attempt_goes_to_another_runner_at_once_and_back_only_after_the_reset(tmp_path: Path) -> None:
    reg = Registry(tmp_path)
    job_id = limited(reg, on_limit="move")
    record = reg.get(job_id)
    assert not settled(record) and limit_pause(record, NOW) == NOW + 1805
    new = move_attempt(reg, job_id, NOW + 1805, None, None)
    assert new is not None and (new["status"], new["attempt_id"], new["pauses"]) == ("queued", 2, 1)
    assert new["limited"] == {"session": "r1", "until": "2026-12-04T21:30:05Z"} and "paused_until" not in new
    assert new["target"] == {"labels": ["x"]} and new["work"]["resume"]["session_id"] == SESSION
    assert [(r["attempt_id"], r["outcome"]) for r in render.attempts(new)] == [
        (1, "moved (usage_limit)"), (2, "queued")]
    (line,) = [a for a in reg.audit(job_id) if a["event"] == "moved"]
    assert (line["session"], line["until"], line["next_attempt"]) == ("r1", "2026-12-04T21:30:05Z", 2)
    assert move_attempt(reg, job_id, NOW + 1805, None, None) is None  # already done: nothing twice

    job = queued_job(new)
    mono = time.monotonic()
    assert plan([job], repo_fleet("r1", "r2"), mono, 60, wall_now=NOW) == [(job_id, "r2")]
    assert plan([job], repo_fleet("r1"), mono, 60, wall_now=NOW) == []  # only the limited runner: it waits
    assert plan([job], repo_fleet("r1"), mono, 60, wall_now=NOW + 1806) == [(job_id, "r1")]
    ahead = dataclasses.replace(job, limited_until=time.time() + 3600)  # why_waiting reads the wall clock
    why = why_waiting(ahead, repo_fleet("r1"), [ahead], mono, 60)
    assert why.startswith("moved off r1 (usage limit until ") and "no other runner matches labels=x" in why
    later = reg.register(session=None, queue=QueueTerms(target_labels=("x",)), work=wire.Work(repo="demo"))
    assert plan([job, queued_job(later)], repo_fleet("r1"), mono, 60, wall_now=NOW) == [(later["job_id"], "r1")]
    assert "limited" not in mark_published(reg, job_id, "r2")


def test_s14_on_limit_move_needs_a_label_target() -> None:
    with pytest.raises(UsageError, match="--on-limit move needs a label target"):
        QueueTerms(target_session="r1", on_limit="move").checked()
    assert QueueTerms(target_labels=("x",), on_limit="move").checked().fields()["on_limit"] == "move"
