"""runner/job.py without processes: how a StopReason becomes the terminal event (PROTOCOL §5, §6, §11)."""

from __future__ import annotations

import signal

import pytest

from mam.runner.agent import ExitStatus
from mam.runner.job import Job, StopReason, Terminal, final_reason, orphan_job, terminal_for
from mam.runner.process_tree import AgentIdentity

EXIT_0 = ExitStatus(exit_code=0, signal=None)
EXIT_3 = ExitStatus(exit_code=3, signal=None)
KILLED_TERM = ExitStatus(exit_code=None, signal=signal.SIGTERM)
KILLED_KILL = ExitStatus(exit_code=None, signal=signal.SIGKILL)


@pytest.mark.parametrize("reason", list(StopReason))
def test_without_a_cancel_the_reason_stays(reason):
    assert final_reason(reason, cancelled=False) is reason


@pytest.mark.parametrize(("reason", "final"), [
    (StopReason.EXITED, StopReason.CANCELLED),  # a cancel that arrived as the agent exited wins
    (StopReason.TIMED_OUT, StopReason.CANCELLED),
    (StopReason.CANCELLED, StopReason.CANCELLED),
    (StopReason.LINGERED, StopReason.LINGERED),  # it already published its own end
])
def test_s6_a_cancel_seen_after_the_wait_wins_except_over_a_lingering_agent(reason, final):
    assert final_reason(reason, cancelled=True) is final


@pytest.mark.parametrize(("status", "terminal"), [
    (EXIT_0, Terminal("completed", "", 0)),
    (EXIT_3, Terminal("error", "agent exited with code 3", 3)),
    (KILLED_KILL, Terminal("error", "agent killed by signal 9", 137)),
])
def test_s11_an_exited_agent_publishes_its_own_exit(status, terminal):
    assert terminal_for(StopReason.EXITED, status, 60) == terminal


@pytest.mark.parametrize(("status", "code"), [(KILLED_TERM, 143), (KILLED_KILL, 137), (EXIT_0, 0)])
def test_s6_a_cancelled_agent_publishes_error_cancelled_with_the_stopped_agents_code(status, code):
    assert terminal_for(StopReason.CANCELLED, status, 60) == Terminal("error", "cancelled", code, "cancelled")


def test_s5_a_timed_out_agent_publishes_error_with_its_budget():
    assert terminal_for(StopReason.TIMED_OUT, KILLED_TERM, 60) == Terminal("error", "timed out after 60 s", 143)


def test_s11_a_lingering_agent_publishes_nothing_more():
    assert terminal_for(StopReason.LINGERED, KILLED_TERM, 60) is None


def test_request_cancel_is_set_once_with_the_first_reason():
    job = Job(job_id="918b0612", attempt_id=1, dispatch_token="0" * 32, brief="", heartbeat_s=30, timeout_s=60)
    assert job.request_cancel("operator") is True
    assert job.request_cancel("runner_shutdown") is False
    assert job.cancel.is_set() and job.cancel_reason == "operator"


def test_s6_an_orphan_job_comes_from_its_record():
    identity = AgentIdentity(pid=4242, create_time=1.5e9, pgid=4242, tag="ab" * 16)
    record = {"job_id": "918b0612", "attempt_id": 2, "dispatch_token": "1" * 32, "heartbeat_sec": None,
              "timeout_sec": 600}
    job = orphan_job(record, identity, cancel_reason="cancel")
    assert (job.orphan, job.identity, job.attempt_id, job.heartbeat_s, job.timeout_s) == (True, identity, 2, 30, 600)
    assert job.cancel.is_set() and job.brief == ""
    assert not orphan_job(record, None).cancel.is_set()
