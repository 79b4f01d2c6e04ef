"""The fault matrix as tests: real brokers, real `mam-orch` and
`mam-runner run` processes in a tailnet of network namespaces (harness/fleet.py,
mode "netns"), short contracts (heartbeat 1 s, 3 misses: K × N = 3 s).

Each trial asserts the three promises of §14 and §17: 0 lost terminals (both
records end terminal), 0 duplicate runs (the agent appends one marker line per run),
and the hub's verdict equals the runner's, or the hub records the runner's later
outcome as `late_outcome` (§14, read by `mam-orch watch` re-attaching). Each trial
set prints one summary line, `MATRIX <kind>: trials=… lost=… duplicates=… wrong=…`,
to compare run to run (also without `pytest -s`).

Kinds: broker SIGKILL + restart 3 s into a 10 s job (×20 nats-server, ×5 mosquitto);
a runner cut off (iptables DROP in its namespace) shorter than the keepalive and
longer than K × N; runner kill -9 → its agent stopped at once by its deadman helper (§6)
→ redispatch elsewhere completes, attempt-1 stragglers refused; hub kill -9 → `watch` resolves. The full-disk
and replacement-runner faults are tests/e2e/test_runner_faults.py (`test_fault9_*`, `test_fault8_*`),
the lease rows (§10 "Leases": a runner cut off for 3 × L or frozen for 2 × L, retried elsewhere
with no overlap; a short cut) tests/e2e/test_leases.py; none is repeated here.

Needs root (namespaces, iptables): skips with the reason otherwise.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from harness.brokers import MosquittoBroker
from harness.fleet import AGENTS, Dispatch, Fleet
from harness.netns import unavailable_reason
from harness.procs import gone
from harness.waiting import PATIENCE_S, wait_until

from mam.shared.protocol.codes import TERMINAL_STATUSES

pytestmark = [pytest.mark.broker, pytest.mark.e2e]

SHELL_AGENT = AGENTS / "shell-agent"
HEARTBEAT_S = 1
MISSES = 3
CONTRACT = ("--heartbeat", str(HEARTBEAT_S), "--heartbeat-misses", str(MISSES), "--ack-timeout", str(int(PATIENCE_S)))
JOB_S = 10
"""Length of a trial's job, seconds (the agent sleeps that long after its marker line)."""
FAULT_AT_S = 3.0
"""How far into the job (after the hub saw `started`) the fault strikes, seconds."""
KEEPALIVE_S = 5
"""MQTT_KEEPALIVE of every fleet host (harness/fleet.py)."""
SHORT_CUT_S = 1.0
"""A cut shorter than the keepalive and than K × N less one beat and TCP's retransmission
backoff (0.2 + 0.4 + 0.8 s), seconds: the MQTT connection and the job survive it."""
LONG_CUT_S = HEARTBEAT_S * MISSES + KEEPALIVE_S
"""A cut longer than K × N (and than the keepalive), seconds."""
BROKER_TRIALS = {"nats": 20, "mosquitto": 5}
"""Jobs that live through a broker crash; each crash hits one job on each of SESSIONS."""
SESSIONS = ("gpu-box", "cpu-box")
CUT_TRIALS = 2
KILL_TRIALS = 2
HUB_TRIALS = 2
JOB_PATIENCE_S = PATIENCE_S + JOB_S + LONG_CUT_S
"""Deadline for one trial's dispatch to end, seconds."""
BRIEF = 'echo "$MAM_SESSION $MAM_JOB_ID $MAM_ATTEMPT_ID $$" >> "$MARKS"\nsleep ' + str(JOB_S) + "\n"
"""One marker line per run (session, job, attempt, the agent's pid), then the job's sleep."""


@dataclass
class Tally:
    """Counts of one trial set, printed as one line and asserted zero."""

    kind: str
    trials: int = 0
    lost: int = 0
    duplicates: int = 0
    wrong: int = 0
    late: int = 0
    notes: list[str] = field(default_factory=list)

    def line(self) -> str:
        return (f"MATRIX {self.kind}: trials={self.trials} lost={self.lost} duplicates={self.duplicates} "
                f"wrong={self.wrong} late_outcome={self.late}")

    def check(self, capsys: pytest.CaptureFixture[str]) -> None:
        """Print the line past pytest's capture (seen in every run), then assert the zeros."""
        with capsys.disabled():
            print(f"\n{self.line()}")
        assert (self.lost, self.duplicates, self.wrong) == (0, 0, 0), "\n".join([self.line(), *self.notes])


@pytest.fixture
def netns_fleet(tmp_path: Path, request) -> Iterator[Fleet]:
    """A fleet in network namespaces with the broker named by the test's `broker_kind` param."""
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"the fault matrix needs network namespaces: {reason}")
    kind = getattr(request, "param", "nats")
    if kind == "mosquitto" and (missing := MosquittoBroker.available()):
        pytest.skip(missing)
    handle = Fleet("netns", tmp_path, broker_kind=kind)
    if not handle.net.has_iptables:
        handle.close()
        pytest.skip("the fault matrix needs iptables (runner cut-offs)")
    try:
        yield handle
    finally:
        handle.close()
    assert not handle.tagged_pids(), "a process of the fleet outlived close()"


def marks(path: Path) -> list[list[str]]:
    return [line.split() for line in path.read_text().splitlines()] if path.exists() else []


def started_on_hub(run: Dispatch) -> float:
    """Wait for the hub's `started`; returns the monotonic time it was seen."""
    wait_until(lambda: run.events("started") or not run.alive(), PATIENCE_S, f"{run.name}: started on the hub")
    assert run.events("started"), f"{run.name} exited {run.proc.returncode}: {run.log()[-3000:]}"
    return time.monotonic()


def sleep_until(moment: float) -> None:
    """The fault's own timing (its definition, not a wait for something observable)."""
    time.sleep(max(0.0, moment - time.monotonic()))


def judge(fleet: Fleet, tally: Tally, session: str, job_id: str, marks_file: Path, attempt: int = 1) -> None:
    """One trial's verdict: the runner's record ends terminal, the hub's equals it (or holds
    it as `late_outcome` once `mam-orch watch` re-attached), the attempt ran once."""
    tally.trials += 1
    runs = [m for m in marks(marks_file) if m[1:3] == [job_id, str(attempt)]]
    if len(runs) != 1:
        tally.duplicates += len(runs) > 1
        tally.notes.append(f"{job_id} attempt {attempt}: ran {len(runs)} times: {runs}")
    try:
        wait_until(lambda: fleet.runner_record(session, job_id)["status"] in TERMINAL_STATUSES,
                   JOB_PATIENCE_S, f"{session}'s record of {job_id} to be terminal")
    except AssertionError as exc:
        tally.lost += 1
        tally.notes.append(f"{job_id}: {exc}")
        return
    runner = fleet.runner_record(session, job_id)["status"]
    # §6, §14: a runner's `cancelled` goes on the wire as an `error` terminal: late_outcome says error
    outcome = "completed" if runner == "completed" else "error"
    hub = fleet.hub_record(job_id)
    if hub["status"] not in TERMINAL_STATUSES:
        tally.lost += 1
        tally.notes.append(f"{job_id}: hub {hub['status']}, runner {runner}")
    elif hub["status"] != runner:
        watched = fleet.orch("watch", job_id, timeout_s=JOB_PATIENCE_S)
        hub = fleet.hub_record(job_id)
        if hub.get("late_outcome") == outcome:
            tally.late += 1
        else:
            tally.wrong += 1
            tally.notes.append(f"{job_id}: hub {hub['status']} ({hub.get('close_reason')}, late "
                               f"{hub.get('late_outcome')}), runner {runner}; watch: {watched.stderr[-1500:]}")


# ------------------------------------------------------------------ broker SIGKILL + restart

@pytest.mark.timeout(540)
@pytest.mark.parametrize("netns_fleet", list(BROKER_TRIALS), indirect=True)
def test_broker_sigkill_restart_3s_into_a_10s_job(
        netns_fleet: Fleet, tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    """§14, §17: the broker crashes and comes back (same store) 3 s into
    each job; ×20 jobs on nats-server, ×5 on mosquitto (two jobs, one per runner, per crash)."""
    fleet = netns_fleet
    marks_file = tmp_path / "marks"
    for session in SESSIONS:
        fleet.start_runner(session, SHELL_AGENT, env={"MARKS": str(marks_file)})
    tally = Tally(f"broker-restart[{fleet.broker_kind}]")
    crashes = 0
    while tally.trials < BROKER_TRIALS[fleet.broker_kind]:
        runs = {session: fleet.dispatch(session, BRIEF, *CONTRACT) for session in SESSIONS}
        sleep_until(max(started_on_hub(run) for run in runs.values()) + FAULT_AT_S)
        fleet.kill_broker()
        fleet.start_broker()
        crashes += 1
        for session, run in runs.items():
            run.wait(JOB_PATIENCE_S)
            judge(fleet, tally, session, run.job_id(), marks_file)
    tally.kind += f" crashes={crashes}"
    tally.check(capsys)


# ------------------------------------------------------------------ runner cut off

@pytest.mark.timeout(300)
@pytest.mark.parametrize("cut_s", [SHORT_CUT_S, LONG_CUT_S], ids=["shorter-than-keepalive", "longer-than-KxN"])
def test_runner_cut_off_by_iptables_drop(
        netns_fleet: Fleet, tmp_path: Path, capsys: pytest.CaptureFixture[str], cut_s: float):
    """§10, §14, §17: every packet of the runner's host dropped for
    `cut_s` seconds, 3 s into the job; the terminal still reaches the hub."""
    fleet = netns_fleet
    marks_file = tmp_path / "marks"
    fleet.start_runner("gpu-box", SHELL_AGENT, env={"MARKS": str(marks_file)})
    tally = Tally(f"runner-cut[{cut_s:g}s]")
    for _ in range(CUT_TRIALS):
        run = fleet.dispatch("gpu-box", BRIEF, *CONTRACT)
        sleep_until(started_on_hub(run) + FAULT_AT_S)
        fleet.net.blackhole("gpu-box")
        time.sleep(cut_s)
        fleet.net.unblackhole("gpu-box")
        run.wait(JOB_PATIENCE_S)
        judge(fleet, tally, "gpu-box", run.job_id(), marks_file)
    tally.check(capsys)


@pytest.mark.timeout(300)
def test_serve_records_the_late_outcome_of_a_runner_cut_off_longer_than_KxN(netns_fleet: Fleet, tmp_path: Path):
    """§14 Late terminals with `mam-orch serve` running: the runner is cut off longer than
    K × N, so the service closes the job `deadline_timeout` (the dispatch following it exits
    2, as `watch` does); the runner's `completed` after the cut is recorded as `late_outcome`
    by the service itself, with nobody running `mam-orch watch`."""
    fleet = netns_fleet
    marks_file = tmp_path / "marks"
    fleet.serve()
    fleet.start_runner("gpu-box", SHELL_AGENT, env={"MARKS": str(marks_file)})
    run = fleet.dispatch("gpu-box", BRIEF, *CONTRACT)
    sleep_until(started_on_hub(run) + FAULT_AT_S)
    fleet.net.blackhole("gpu-box")
    try:
        assert run.wait(JOB_PATIENCE_S) == 2, run.log()[-3000:]
        job_id = run.job_id()
        assert fleet.hub_record(job_id)["close_reason"] == "deadline_timeout"
    finally:
        fleet.net.unblackhole("gpu-box")
    wait_until(lambda: fleet.runner_record("gpu-box", job_id)["status"] in TERMINAL_STATUSES, JOB_PATIENCE_S,
               "the runner's record to be terminal")
    wait_until(lambda: fleet.hub_record(job_id).get("late_outcome") is not None, JOB_PATIENCE_S,
               "the service to record the runner's late outcome")
    # completed, or the hub's cancel reached the runner first (§6: `cancelled` is an `error` terminal)
    runner = fleet.runner_record("gpu-box", job_id)["status"]
    record = fleet.hub_record(job_id)
    assert (record["status"], record["late_outcome"]) == ("error", "completed" if runner == "completed" else "error")
    assert len([m for m in marks(marks_file) if m[1] == job_id]) == 1


# ------------------------------------------------------------------ runner kill -9, redispatch

@pytest.mark.timeout(300)
def test_runner_kill9_agent_dies_with_it_redispatch_completes(
        netns_fleet: Fleet, tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    """§6, §8, §10, §17: the runner dies with kill -9 mid-job; its deadman helper stops the
    agent at once (§6 "The daemon's death"); the hub closes the job (deadline_timeout); the
    restarted runner reports the attempt; `redispatch` to another runner completes; an
    attempt-1 straggler is refused, not taken as a forgery."""
    fleet = netns_fleet
    marks_file = tmp_path / "marks"
    env = {"MARKS": str(marks_file)}
    fleet.start_runner("cpu-box", SHELL_AGENT, env=env)
    tally = Tally("runner-kill9-redispatch")
    for _ in range(KILL_TRIALS):
        gpu = fleet.start_runner("gpu-box", SHELL_AGENT, "--replace", env=env)
        run = fleet.dispatch("gpu-box", BRIEF, *CONTRACT)
        started_on_hub(run)
        job_id = run.job_id()
        wait_until(lambda: any(m[1] == job_id for m in marks(marks_file)), what="the attempt-1 marker")
        agent_pid = int(next(m[3] for m in marks(marks_file) if m[1] == job_id))
        gpu.kill9()
        wait_until(lambda: gone(agent_pid), what="the deadman helper to stop the agent with its runner")
        assert run.wait(JOB_PATIENCE_S) == 2, run.log()  # deadline_timeout (§10)
        # a straggler of attempt 1: gpu-box's registry still holds it running
        late = fleet.runner_cli("gpu-box", "publish", "--job", job_id, "--event", "progress", "--detail", "late")
        assert late.returncode == 0, late.stderr
        fleet.start_runner("gpu-box", SHELL_AGENT, "--replace", env=env)
        again = fleet.redispatch(job_id, "--session", "cpu-box")
        assert again.wait(JOB_PATIENCE_S) == 0, again.log()
        wait_until(lambda: any(e["data"]["attempt_id"] == 1 and e.get("detail") == "late"
                               for e in fleet.events_on_wire(job_id)), what="the attempt-1 straggler on the wire")
        # §3.2: attempt-1 messages (the straggler, the restarted runner's terminal of the
        # orphan) are stale_attempt, quietly refused, never a forgery (§3.2 rule 4)
        assert "HMAC verify failed" not in again.log(), again.log()
        hub = fleet.hub_record(job_id)
        assert hub["attempt_id"] == 2 and hub["status"] == "completed", hub
        judge(fleet, tally, "cpu-box", job_id, marks_file, attempt=2)
        if len([m for m in marks(marks_file) if m[1:3] == [job_id, "1"]]) != 1:
            tally.duplicates += 1
            tally.notes.append(f"{job_id}: attempt 1 ran {marks(marks_file)}")
        fleet.runners["gpu-box"].stop()
    tally.check(capsys)


# ------------------------------------------------------------------ hub kill -9

@pytest.mark.timeout(300)
def test_hub_kill9_then_watch_resolves(
        netns_fleet: Fleet, tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    """§10, §14: the hub's watching process (`mam-orch dispatch`) dies with kill -9
    3 s into the job; `mam-orch watch` re-attaches and resolves to the runner's verdict."""
    fleet = netns_fleet
    marks_file = tmp_path / "marks"
    fleet.start_runner("gpu-box", SHELL_AGENT, env={"MARKS": str(marks_file)})
    tally = Tally("hub-kill9-watch")
    for _ in range(HUB_TRIALS):
        run = fleet.dispatch("gpu-box", BRIEF, *CONTRACT)
        sleep_until(started_on_hub(run) + FAULT_AT_S)
        job_id = run.job_id()
        run.kill9()
        watched = fleet.orch("watch", job_id, timeout_s=JOB_PATIENCE_S)
        assert watched.returncode == 0, watched.stderr
        judge(fleet, tally, "gpu-box", job_id, marks_file)
    tally.check(capsys)
