"""PROTOCOL §10 "Leases" end to end, on nats-server and Mosquitto: two runners in network
namespaces, a real broker, real `mam-orch dispatch` following a `--retries 1` label job. The
agent appends a timestamped marker line every 0.2 s to one file shared by both hosts, so an
overlap of two attempts is measured, not guessed.

- The runner of attempt 1 cut off from the broker (iptables DROP) for 3 × L: its deadman helper
  stops the agent at about L − margin, the hub retries after L on the other runner, the two
  attempts never overlap; once the cut heals the runner reports `lease_lost` and the hub keeps
  attempt 2 as the job's.
- The runner of attempt 1 frozen (SIGSTOP) for 2 × L, then SIGCONT: the same, fenced by the helper
  of a daemon that runs no code.
- The runner of attempt 1 killed (kill -9 of the daemon, not its group): its helper stops the
  agent at once, the hub retries after its Last Will and L on the other runner; no overlap.
- A cut shorter than L − margin, and a broker restart, stop nothing: one attempt, completed.
- The hub cut off from the broker for 3 × L (its connection not yet known lost): it closes
  nothing, since its own link is not proven alive past the job's deadline; one attempt, completed.

Needs root (namespaces, iptables): skips with the reason otherwise.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
from harness.closes import idle_close_reason
from harness.fleet import AGENTS, Dispatch, Fleet
from harness.waiting import PATIENCE_S, wait_until
from test_fault_matrix import netns_fleet  # noqa: F401 - a fixture

from mam.runner.lease import margin_for
from mam.shared.protocol.codes import TERMINAL_STATUSES

pytestmark = [pytest.mark.broker, pytest.mark.e2e,
              pytest.mark.parametrize("netns_fleet", ["nats", "mosquitto"], indirect=True)]

SHELL_AGENT = AGENTS / "shell-agent"
HEARTBEAT_S = 1
MISSES = 6
LEASE_S = HEARTBEAT_S * MISSES
"""L = K × N, seconds."""
MARGIN_S = margin_for(LEASE_S, None)
CONTRACT = ("--heartbeat", str(HEARTBEAT_S), "--heartbeat-misses", str(MISSES), "--ack-timeout", str(int(PATIENCE_S)),
            "--retries", "1")
SESSIONS = ("gpu-box", "cpu-box")
MARKS_PER_RUN = 50
"""The agent's marker lines (one every 0.2 s: a 10 s job)."""
BRIEF = ('for i in $(seq 1 ' + str(MARKS_PER_RUN) + '); do '
         'echo "$MAM_SESSION $MAM_JOB_ID $MAM_ATTEMPT_ID $(date +%s.%N)" >> "$MARKS"; sleep 0.2; done\n')
FAULT_AT_S = 2.0
"""How far into attempt 1 (after its first marker) the fault strikes, seconds."""
JOB_PATIENCE_S = PATIENCE_S + 6 * LEASE_S
SHORT_CUT_S = LEASE_S - MARGIN_S - 3 * HEARTBEAT_S
"""A cut that leaves, before the fence, the beat period before it and TCP's retransmission
backoff after it (its next retry can come over a second after the cut heals), seconds."""


@pytest.fixture
def fleet(netns_fleet: Fleet) -> Fleet:
    """The fault matrix's fleet in network namespaces, with iptables (it skips without them)."""
    return netns_fleet


def marks(path: Path, attempt: int) -> list[tuple[str, float]]:
    """(session, time) of each marker line of `attempt`."""
    if not path.exists():
        return []
    return [(line.split()[0], float(line.split()[3])) for line in path.read_text().splitlines()
            if len(line.split()) == 4 and line.split()[2] == str(attempt)]


def start(fleet: Fleet, tmp_path: Path) -> tuple[Dispatch, Path, str]:
    """Both runners up, the job dispatched; returns it, the marks file and attempt 1's session,
    once attempt 1 has run FAULT_AT_S."""
    marks_file = tmp_path / "marks"
    for session in SESSIONS:
        fleet.start_runner(session, SHELL_AGENT, "--labels", "x", env={"MARKS": str(marks_file)})
    run = fleet.dispatch(None, BRIEF, *CONTRACT, labels="x")
    wait_until(lambda: marks(marks_file, 1) or not run.alive(), PATIENCE_S, "attempt 1's first marker")
    assert marks(marks_file, 1), run.log()[-3000:]
    first_session, first_at = marks(marks_file, 1)[0]
    time.sleep(max(0.0, first_at + FAULT_AT_S - time.time()))  # the fault's own timing
    return run, marks_file, first_session


def matrix_line(capsys: pytest.CaptureFixture[str], fleet: Fleet, row: str, *, right: bool,
                overlap_s: float) -> None:
    """The fault matrix's line for this row (tests/e2e/test_fault_matrix.py), past pytest's capture."""
    with capsys.disabled():
        print(f"\nMATRIX {row} {fleet.broker_kind}: runs=1 right={int(right)} wrong={int(not right)} "
              f"overlap_s={overlap_s:.2f}")


def check_fenced(fleet: Fleet, run: Dispatch, marks_file: Path, first: str, fault_at: float, healed_at: float,
                 capsys: pytest.CaptureFixture[str], row: str) -> None:
    """Attempt 2 ran on the other runner and completed, after attempt 1's last marker; attempt 1
    stopped before the fault ended; its runner reports `lease_lost`; the hub keeps attempt 2."""
    code = run.wait(JOB_PATIENCE_S)
    one, two = marks(marks_file, 1), marks(marks_file, 2)
    overlap_s = max(0.0, max(t for _, t in one) - min(t for _, t in two)) if one and two else 0.0
    matrix_line(capsys, fleet, row, right=code == 0 and len(two) == MARKS_PER_RUN, overlap_s=overlap_s)
    assert code == 0, run.log()[-3000:]
    job_id = run.job_id()
    assert len(two) == MARKS_PER_RUN and {s for s, _ in two} == set(SESSIONS) - {first}, two
    assert len(one) < MARKS_PER_RUN, "attempt 1 ran to its end: it was not fenced"
    last_one = max(t for _, t in one)
    assert overlap_s == 0.0, f"the attempts overlapped by {overlap_s:.2f} s"
    assert last_one < healed_at, "attempt 1's agent ran until the fault ended"
    assert last_one - fault_at < LEASE_S, f"attempt 1 stopped {last_one - fault_at:.2f} s into the fault"
    wait_until(lambda: fleet.runner_record(first, job_id)["status"] in TERMINAL_STATUSES, JOB_PATIENCE_S,
               f"{first}'s record of attempt 1 to end")
    ended = [e for e in fleet.runner_registry(first).audit(job_id) if e.get("event") == "error"]
    assert ended and ended[-1]["detail"].startswith("lease_lost: "), ended
    assert ended[-1]["data"]["lease_lost"] is True
    wait_until(lambda: any(e.get("event") == "error" and e["data"].get("attempt_id") == 1
                           for e in fleet.events_on_wire(job_id)), JOB_PATIENCE_S, "attempt 1's lease_lost on the wire")
    hub = fleet.hub_record(job_id)
    assert (hub["attempt_id"], hub["status"]) == (2, "completed"), hub
    assert hub["attempt_history"][0]["close_reason"] in ("deadline_timeout", "runner_lost"), hub["attempt_history"]


def check_ran_once(fleet: Fleet, run: Dispatch, marks_file: Path, capsys: pytest.CaptureFixture[str],
                   row: str) -> None:
    """Nothing was stopped: attempt 1 ran to its end and completed, no attempt 2."""
    code = run.wait(JOB_PATIENCE_S)
    right = code == 0 and len(marks(marks_file, 1)) == MARKS_PER_RUN and not marks(marks_file, 2)
    matrix_line(capsys, fleet, row, right=right, overlap_s=0.0)
    assert code == 0, run.log()[-3000:]
    hub = fleet.hub_record(run.job_id())
    assert (hub["attempt_id"], hub["status"]) == (1, "completed"), hub
    assert len(marks(marks_file, 1)) == MARKS_PER_RUN and not marks(marks_file, 2)


@pytest.mark.timeout(300)
def test_s10_a_runner_cut_off_for_3L_fences_its_agent_before_the_hub_retries_elsewhere(
        fleet: Fleet, tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    run, marks_file, first = start(fleet, tmp_path)
    fault_at = time.time()
    fleet.net.blackhole(fleet.host_of(first))
    try:
        time.sleep(3 * LEASE_S)  # the fault's length (its definition)
    finally:
        fleet.net.unblackhole(fleet.host_of(first))
    check_fenced(fleet, run, marks_file, first, fault_at, time.time(), capsys, "lease-runner-cut[3L]")


@pytest.mark.timeout(300)
def test_s10_a_runner_frozen_for_2L_is_fenced_by_its_helper_before_the_hub_retries(
        fleet: Fleet, tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    run, marks_file, first = start(fleet, tmp_path)
    runner = fleet.runners[first]
    fault_at = time.time()
    runner.signal(signal.SIGSTOP)
    try:
        time.sleep(2 * LEASE_S)
    finally:
        runner.signal(signal.SIGCONT)
    check_fenced(fleet, run, marks_file, first, fault_at, time.time(), capsys, "lease-runner-sigstop[2L]")


@pytest.mark.timeout(300)
def test_s10_a_runner_killed_mid_job_takes_its_agent_with_it_and_the_job_runs_again_elsewhere(
        fleet: Fleet, tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    run, marks_file, first = start(fleet, tmp_path)
    killed_at = time.time()
    fleet.runners[first].kill9()
    code = run.wait(JOB_PATIENCE_S)
    one, two = marks(marks_file, 1), marks(marks_file, 2)
    overlap_s = max(0.0, max(t for _, t in one) - min(t for _, t in two)) if one and two else 0.0
    matrix_line(capsys, fleet, "lease-runner-kill9", right=code == 0 and len(two) == MARKS_PER_RUN,
                overlap_s=overlap_s)
    assert code == 0, run.log()[-3000:]
    assert len(two) == MARKS_PER_RUN and {s for s, _ in two} == set(SESSIONS) - {first}, two
    assert overlap_s == 0.0, f"the attempts overlapped by {overlap_s:.2f} s"
    assert max(t for _, t in one) - killed_at < LEASE_S - MARGIN_S, "attempt 1's agent outlived its runner"
    job_id = run.job_id()
    hub = fleet.hub_record(job_id)
    assert (hub["attempt_id"], hub["status"]) == (2, "completed"), hub
    expected = idle_close_reason(run.log(), first, job_id)  # runner_lost, unless its Will came late
    assert hub["attempt_history"][0]["close_reason"] == expected, (hub["attempt_history"], run.log()[-3000:])


@pytest.mark.timeout(300)
def test_s10_a_cut_shorter_than_the_lease_less_its_margin_stops_nothing(
        fleet: Fleet, tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    run, marks_file, first = start(fleet, tmp_path)
    fleet.net.blackhole(fleet.host_of(first))
    try:
        time.sleep(SHORT_CUT_S)
    finally:
        fleet.net.unblackhole(fleet.host_of(first))
    check_ran_once(fleet, run, marks_file, capsys, "lease-runner-cut[short]")


@pytest.mark.timeout(300)
def test_s10_a_broker_restart_mid_job_stops_nothing_and_retries_nothing(
        fleet: Fleet, tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    run, marks_file, _ = start(fleet, tmp_path)
    fleet.kill_broker()
    fleet.start_broker()
    check_ran_once(fleet, run, marks_file, capsys, "lease-broker-restart")


@pytest.mark.timeout(300)
def test_s10_a_hub_cut_off_for_3L_closes_nothing_and_the_job_runs_once(
        fleet: Fleet, tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    run, marks_file, _ = start(fleet, tmp_path)
    fleet.net.blackhole("orch")  # the hub's host: `dispatch` and its engine run there
    try:
        time.sleep(3 * LEASE_S)
    finally:
        fleet.net.unblackhole("orch")
    check_ran_once(fleet, run, marks_file, capsys, "lease-hub-cut[3L]")
