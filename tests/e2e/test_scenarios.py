"""The fleet end to end: real nats-server, real `mam-orch` and `mam-runner run`
processes, real agents and signals, over loopback and over a tailnet of
network namespaces (PROTOCOL §5-§12; DESIGN.md "Test strategy").

Every scenario runs in both modes of `fleet.Fleet`; "netns" skips with the
reason where namespaces are unavailable (not root, no iproute2).
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import psutil
import pytest
from harness.fleet import AGENTS, MODES, Fleet
from harness.netns import unavailable_reason
from harness.procs import gone
from harness.waiting import PATIENCE_S, wait_until

from mam.orchestrator.acceptance import mirror_event
from mam.orchestrator.dispatch import build_dispatch
from mam.shared.protocol import crypto, names, wire
from mam.shared.store.registry import Contract, Registry

pytestmark = [pytest.mark.e2e]

SHELL_AGENT = AGENTS / "shell-agent"
SLEEP_AGENT = AGENTS / "sleep-agent"
EXIT_AGENT = AGENTS / "exit-agent"
# short beats (every 1 s); the ack and idle deadlines a busy machine always meets (a test
# of those deadlines sets its own); ACK_TIMEOUT_S also bounds a dispatch's age (§5)
ACK_TIMEOUT_S = int(PATIENCE_S)
FAST = ("--heartbeat", "1", "--heartbeat-misses", "10", "--ack-timeout", str(ACK_TIMEOUT_S))
TERMINAL_EVENTS = ("completed", "error")


@pytest.fixture(params=MODES)
def fleet(request, tmp_path):
    """A running fleet in each mode; everything it started is stopped after the test."""
    if request.param == "netns":
        reason = unavailable_reason()
        if reason:
            pytest.skip(f"multi-host e2e needs network namespaces: {reason}")
    handle = Fleet(request.param, tmp_path)
    try:
        yield handle
    finally:
        handle.close()
    assert not handle.tagged_pids(), "a process of the fleet outlived close()"


def marks(path: Path) -> list[list[str]]:
    """Lines an agent appended to a marks file, split in words."""
    return [line.split() for line in path.read_text().splitlines()] if path.exists() else []


def wait_log(proc, text: str, what: str, timeout_s: float = PATIENCE_S) -> None:
    """Wait for `text` in a fleet process's stderr; the failure shows that stderr."""
    try:
        wait_until(lambda: text in proc.log(), timeout_s, what)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n--- {proc.name} stderr:\n{proc.log()[-4000:]}") from None


def terminal_on_wire(fleet: Fleet, job_id: str) -> list[dict]:
    return [e for e in fleet.events_on_wire(job_id) if e["event"] in TERMINAL_EVENTS]


# ------------------------------------------------------------------ happy path

@pytest.mark.timeout(90)
def test_s11_happy_path_orch_to_gpu_box_same_identity_on_both_records(fleet):
    fleet.start_runner("gpu-box", SHELL_AGENT)
    run = fleet.dispatch("gpu-box", "echo hello from the agent\nprintf ok > out.txt\n", *FAST)
    assert run.wait(PATIENCE_S) == 0, run.log()
    job_id = run.job_id()
    assert [e["event"] for e in run.events()][0] == "started"
    assert run.events()[-1]["event"] == "completed"
    hub, runner = fleet.hub_record(job_id), fleet.runner_record("gpu-box", job_id)
    assert hub["status"] == runner["status"] == "completed"
    assert hub["agent_session"] == "remote:gpu-box"
    assert hub["attempt_id"] == runner["attempt_id"] == 1
    assert hub["dispatch_token"] == runner["dispatch_token"]
    assert hub["last_seq"] == runner["last_seq"] == run.events()[-1]["seq"]
    # the events crossed the broker: a hub-side subscriber saw them, seq 1 first, the terminal last
    wait_until(lambda: terminal_on_wire(fleet, job_id), what="the terminal event on the wire")
    on_wire = fleet.events_on_wire(job_id)
    assert on_wire[0]["event"] == "started" and on_wire[0]["seq"] == 1
    assert [e["event"] for e in on_wire if e["event"] in TERMINAL_EVENTS] == ["completed"]
    assert all(e["data"]["session"] == "gpu-box" for e in on_wire)
    # the agent really ran in the runner's work folder, and its output is in agent.log
    assert (fleet.base / "ws" / "gpu-box" / "work" / job_id / "out.txt").read_text() == "ok"
    assert "hello from the agent" in fleet.agent_log("gpu-box", job_id).read_text()


# ------------------------------------------------------------------ routing

@pytest.mark.timeout(120)
def test_s5_s11_two_runners_four_jobs_each_runs_where_sent_and_once(fleet, tmp_path):
    marks_file = tmp_path / "marks"
    env = {"MARKS": str(marks_file)}
    for session in ("gpu-box", "cpu-box"):
        fleet.start_runner(session, SHELL_AGENT, "--max-jobs", "2", env=env)
    brief = 'echo "$MAM_SESSION $MAM_JOB_ID $MAM_ATTEMPT_ID" >> "$MARKS"\n'
    runs = [(session, fleet.dispatch(session, brief, *FAST))
            for session in ("gpu-box", "cpu-box", "gpu-box", "cpu-box")]
    sent: dict[str, str] = {}
    for session, run in runs:
        assert run.wait(PATIENCE_S) == 0, run.log()
        sent[run.job_id()] = session
    assert len(sent) == 4
    lines = marks(marks_file)
    assert sorted(lines) == sorted([session, job_id, "1"] for job_id, session in sent.items())
    for job_id, session in sent.items():
        other = "cpu-box" if session == "gpu-box" else "gpu-box"
        assert fleet.hub_record(job_id)["status"] == "completed"
        assert fleet.runner_record(session, job_id)["status"] == "completed"
        assert not fleet.has_runner_record(other, job_id)
        assert fleet.agent_log(session, job_id).exists()
        assert not fleet.agent_log(other, job_id).exists()
        assert len([e for e in fleet.events_on_wire(job_id) if e["event"] == "started"]) == 1


# ------------------------------------------------------------------ delivery (§10)

@pytest.mark.timeout(90)
def test_s10_no_runner_agent_blocked_and_a_late_runner_never_runs_it(fleet, tmp_path):
    marks_file = tmp_path / "marks"
    run = fleet.dispatch("tpu-box", 'echo "$MAM_JOB_ID" >> "$MARKS"\n', "--heartbeat", "1",
                         "--heartbeat-misses", "3", "--ack-timeout", "3")
    assert run.wait(PATIENCE_S) == 1, run.log()
    job_id = run.job_id()
    record = fleet.hub_record(job_id)
    assert record["status"] == "error" and record["close_reason"] == "agent_blocked"
    # a runner for that session started afterwards: its first job acts as a barrier (retained
    # messages are delivered on subscribe, before anything published later)
    fleet.start_runner("tpu-box", SHELL_AGENT, env={"MARKS": str(marks_file)})
    later = fleet.dispatch("tpu-box", 'echo "$MAM_JOB_ID" >> "$MARKS"\n', *FAST)
    assert later.wait(PATIENCE_S) == 0, later.log()
    assert marks(marks_file) == [[later.job_id()]]
    assert not fleet.has_runner_record("tpu-box", job_id)
    assert fleet.hub_record(job_id)["status"] == "error"


# ------------------------------------------------------------------ cancel (§6)

@pytest.mark.timeout(90)
def test_s6_cancel_mid_run_kills_agent_and_grandchild_hub_cancelled_dispatch_exits_4(fleet, tmp_path):
    pidfile = tmp_path / "sleep.pids"
    fleet.start_runner("gpu-box", SLEEP_AGENT, env={"SLEEP_AGENT_PIDFILE": str(pidfile)})
    run = fleet.dispatch("gpu-box", "3600\n", *FAST)
    wait_until(pidfile.exists, what="the sleep-agent to write its pids")
    agent_pid, grandchild_pid = (int(p) for p in pidfile.read_text().split())
    job_id = run.job_id()
    wait_until(lambda: run.events("started"), what="started on the hub")
    assert psutil.pid_exists(agent_pid) and psutil.pid_exists(grandchild_pid)
    cancelled = fleet.orch("cancel", job_id)
    assert cancelled.returncode == 0, cancelled.stderr
    assert json.loads(cancelled.stdout)["status"] == "cancelled"
    # the grandchild ignores SIGTERM: its end proves the SIGKILL of the tree after the grace
    # (MAM_CANCEL_GRACE_S in the fleet's runner env)
    wait_until(lambda: gone(agent_pid) and gone(grandchild_pid),
               what="the agent and its SIGTERM-ignoring grandchild to be gone")
    assert run.wait(PATIENCE_S) == 4, run.log()
    assert fleet.hub_record(job_id)["status"] == "cancelled"
    wait_until(lambda: fleet.runner_record("gpu-box", job_id)["status"] == "cancelled",
               what="the runner's record to be cancelled")
    assert fleet.runners["gpu-box"].alive()
    # §6: once the runner confirmed (its error/cancelled), the hub cleared the retained cancel
    control_topic = names.control_topic(job_id, fleet.topic_root)
    wait_until(lambda: [m for m in fleet.tap.messages() if m["topic"] == control_topic and not m["payload"]],
               what="the retained cancel to be cleared")
    control = [m["payload"] for m in fleet.tap.messages() if m["topic"] == control_topic]
    assert control[0] and control[-1] == b"", control


# ------------------------------------------------------------------ exit mapping (§11 step 5)

@pytest.mark.timeout(90)
def test_s11_agent_exit_3_is_error_with_exit_code_3(fleet):
    fleet.start_runner("gpu-box", EXIT_AGENT)
    run = fleet.dispatch("gpu-box", "3\n", *FAST)
    assert run.wait(PATIENCE_S) == 1, run.log()
    job_id = run.job_id()
    errors = run.events("error")
    assert len(errors) == 1 and errors[0]["data"]["exit_code"] == 3
    assert errors[0]["detail"] == "agent exited with code 3"
    record = fleet.hub_record(job_id)
    assert record["status"] == "error" and record["exit_code"] == 3
    assert "exiting with 3" in fleet.agent_log("gpu-box", job_id).read_text()


@pytest.mark.timeout(90)
def test_s11_agent_own_completed_then_exit_0_exactly_one_terminal_event(fleet):
    runner = fleet.start_runner("gpu-box", SHELL_AGENT)
    run = fleet.dispatch("gpu-box", 'eval "$MAM_PUBLISH_CMD --event completed --detail finished-by-agent"\n',
                         *FAST)
    assert run.wait(PATIENCE_S) == 0, run.log()
    job_id = run.job_id()
    wait_until(lambda: "already ended" in runner.log(), what="the runner to see the agent's own terminal event")
    # the runner republishes its presence (running []) on its connection after the job ends: once
    # the tap has it, anything the runner published for the job before it has arrived too
    wait_until(lambda: (fleet.presence("gpu-box") or {}).get("running") == [], what="presence with no job")
    terminal = terminal_on_wire(fleet, job_id)
    assert [(e["event"], e["detail"]) for e in terminal] == [("completed", "finished-by-agent")]
    assert [e["event"] for e in run.events() if e["event"] in TERMINAL_EVENTS] == ["completed"]
    assert fleet.runner_record("gpu-box", job_id)["status"] == "completed"


# ------------------------------------------------------------------ runner crash, redispatch (§8, §10)

HOLD_BRIEF = ('echo "$MAM_SESSION $MAM_JOB_ID $MAM_ATTEMPT_ID" >> "$MARKS"\n'
              'while [ ! -e "$HOLD" ]; do sleep 0.1; done\n')


@pytest.mark.timeout(150)
def test_s10_s8_runner_kill9_deadline_then_redispatch_elsewhere_and_stragglers_refused(fleet, tmp_path):
    marks_file = tmp_path / "marks"
    gpu_hold, cpu_hold = tmp_path / "gpu-hold", tmp_path / "cpu-hold"
    gpu_env = {"MARKS": str(marks_file), "HOLD": str(gpu_hold)}
    gpu = fleet.start_runner("gpu-box", SHELL_AGENT, env=gpu_env)
    fleet.start_runner("cpu-box", SHELL_AGENT, env={"MARKS": str(marks_file), "HOLD": str(cpu_hold)})
    heartbeat_s, misses = 1, 8
    run = fleet.dispatch("gpu-box", HOLD_BRIEF, "--heartbeat", str(heartbeat_s),
                         "--heartbeat-misses", str(misses), "--ack-timeout", "10")
    wait_until(lambda: marks(marks_file), what="the agent to start on gpu-box")
    job_id = run.job_id()
    assert marks(marks_file) == [["gpu-box", job_id, "1"]]
    wait_until(lambda: run.events("progress"), what="a progress event on the hub")
    gpu.kill9()
    killed_at = datetime.now(UTC).replace(microsecond=0)  # the registry's timestamps have whole seconds
    # §14: the hub says at once what the runner's Last Will means for the job
    wait_until(lambda: "runner gpu-box went offline" in run.log(), what="the hub to say the runner went offline")
    assert "attempt 1 is lost in " in run.log() and "then it ends runner_lost" in run.log(), run.log()
    assert run.wait(PATIENCE_S) == 2, run.log()
    record = fleet.hub_record(job_id)
    # §14: the idle close of an attempt whose runner's presence went offline (its Last Will) is runner_lost
    assert record["status"] == "error" and record["close_reason"] == "runner_lost"
    # §10: the hub closed it within the idle timeout (K × N) + 5 s of the death, by its own
    # clock (the close's audit timestamp), not counting how long a busy machine takes to exit
    closed = [line for line in Registry(fleet.hub_ws).audit(job_id) if line.get("close_reason")]
    closed_at = datetime.strptime(closed[-1]["timestamp"], "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC)
    assert closed_at - killed_at <= timedelta(seconds=heartbeat_s * misses + 5), (closed_at, killed_at)

    again = fleet.redispatch(job_id, "--session", "cpu-box")
    wait_until(lambda: ["cpu-box", job_id, "2"] in marks(marks_file), what="attempt 2 to start on cpu-box")
    wait_until(lambda: again.events("started"), what="attempt 2 started on the hub")
    # an attempt-1 straggler: gpu-box's registry still holds attempt 1 running; the hub refuses it
    late = fleet.runner_cli("gpu-box", "publish", "--job", job_id, "--event", "progress", "--detail", "late")
    assert late.returncode == 0, late.stderr
    wait_until(lambda: any(e["data"]["attempt_id"] == 1 and e.get("detail") == "late"
                           for e in fleet.events_on_wire(job_id)), what="the attempt-1 event on the wire")
    cpu_hold.touch()
    assert again.wait(PATIENCE_S) == 0, again.log()
    # §3.2: attempt 2 has a fresh auth_token, but the hub keeps attempt 1's, so the straggler
    # is `stale_attempt` (logged at debug), not a forgery (§3.2 rule 4)
    assert "HMAC verify failed" not in again.log()
    record = fleet.hub_record(job_id)
    assert record["status"] == "completed" and record["attempt_id"] == 2
    assert fleet.runner_record("cpu-box", job_id)["attempt_id"] == 2
    assert all(e["data"]["attempt_id"] == 2 for e in again.events())
    # the hub's registry refuses any attempt-1 event the wire holds (§3.2 rule 5)
    stale = [e for e in fleet.events_on_wire(job_id) if e["data"]["attempt_id"] == 1]
    assert stale
    with pytest.raises(Exception) as refused:
        mirror_event(Registry(fleet.hub_ws), job_id, stale[-1])
    assert getattr(refused.value, "reason", "") == "stale_attempt"

    # gpu-box's runner comes back: it does not run anything again
    gpu_hold.touch()  # lets the orphaned attempt-1 agent finish (its own publishes are refused)
    fleet.start_runner("gpu-box", SHELL_AGENT, "--replace", env=gpu_env)
    barrier = fleet.dispatch("gpu-box", 'echo "$MAM_SESSION $MAM_JOB_ID $MAM_ATTEMPT_ID" >> "$MARKS"\n', *FAST)
    assert barrier.wait(PATIENCE_S) == 0, barrier.log()
    runs_of_job = [m for m in marks(marks_file) if m[1] == job_id]
    assert runs_of_job == [["gpu-box", job_id, "1"], ["cpu-box", job_id, "2"]]
    record = fleet.hub_record(job_id)
    assert record["status"] == "completed" and record["attempt_id"] == 2


# ------------------------------------------------------------------ hostile dispatches (§5)

@pytest.mark.timeout(90)
def test_s5_bad_sig_expired_and_replayed_dispatches_refused_runner_keeps_serving(fleet, tmp_path):
    marks_file = tmp_path / "marks"
    runner = fleet.start_runner("gpu-box", SHELL_AGENT, env={"MARKS": str(marks_file)})
    keys = crypto.derive_keys(fleet.secret)
    forge = Registry(tmp_path / "forge")
    brief = 'echo "$MAM_JOB_ID" >> "$MARKS"\n'
    contract = Contract(heartbeat_sec=1, heartbeat_misses=10, ack_timeout_sec=ACK_TIMEOUT_S)

    def dispatch_of(record, **kwargs) -> dict:
        return _build(record, brief, keys, **kwargs)

    def send(signed: dict) -> bytes:
        raw = wire.encode(signed)
        fleet.tap.publish(names.dispatch_topic(signed["job_id"], fleet.topic_root), raw, retain=True)
        return raw

    # bad signature: one hex digit of sig flipped
    bad = dispatch_of(forge.register(session="gpu-box", contract=contract))
    bad["sig"] = ("0" if bad["sig"][0] != "0" else "1") + bad["sig"][1:]
    send(bad)
    wait_log(runner, f"refused dispatch {bad['job_id']}", "the bad sig to be refused")
    # expired: issued an hour ago with a one-minute ack timeout
    expired = dispatch_of(forge.register(session="gpu-box", contract=contract),
                          issued_at=datetime.now(UTC) - timedelta(hours=1))
    send(expired)
    wait_log(runner, f"refused dispatch {expired['job_id']}: expired", "the expired dispatch to be refused")
    # replay: a valid dispatch runs once; the same bytes again are refused
    good = dispatch_of(forge.register(session="gpu-box", contract=contract))
    raw = send(good)
    wait_until(lambda: fleet.has_runner_record("gpu-box", good["job_id"]) and
               fleet.runner_record("gpu-box", good["job_id"])["status"] == "completed",
               what="the valid dispatch to complete")
    fleet.tap.publish(names.dispatch_topic(good["job_id"], fleet.topic_root), raw, retain=True)
    wait_log(runner, f"refused dispatch {good['job_id']}: replayed", "the replay to be refused")
    assert "sig" in runner.log().split(f"refused dispatch {bad['job_id']}")[1].splitlines()[0]
    for refused in (bad, expired):
        assert not fleet.has_runner_record("gpu-box", refused["job_id"])
    assert marks(marks_file) == [[good["job_id"]]]
    # and it keeps serving
    assert runner.alive()
    run = fleet.dispatch("gpu-box", brief, *FAST)
    assert run.wait(PATIENCE_S) == 0, run.log()
    assert marks(marks_file) == [[good["job_id"]], [run.job_id()]]


def _build(record: dict, brief: str, keys, **kwargs) -> dict:
    return build_dispatch(record, brief, keys, origin="forge", **kwargs)


# ------------------------------------------------------------------ capacity (§11)

@pytest.mark.timeout(90)
def test_s11_max_jobs_1_runs_two_jobs_one_after_the_other(fleet, tmp_path):
    marks_file = tmp_path / "marks"
    fleet.start_runner("gpu-box", SHELL_AGENT, "--max-jobs", "1", env={"MARKS": str(marks_file)})
    brief = ('echo "start $MAM_JOB_ID" >> "$MARKS"\n'
             'sleep 1\n'
             'echo "end $MAM_JOB_ID" >> "$MARKS"\n')
    first = fleet.dispatch("gpu-box", brief, *FAST)
    second = fleet.dispatch("gpu-box", brief, *FAST)
    assert first.wait(PATIENCE_S) == 0, first.log()
    assert second.wait(PATIENCE_S) == 0, second.log()
    lines = marks(marks_file)
    assert len(lines) == 4
    assert lines[0][0] == "start" and lines[1] == ["end", lines[0][1]]
    assert lines[2][0] == "start" and lines[3] == ["end", lines[2][1]]
    assert {lines[0][1], lines[2][1]} == {first.job_id(), second.job_id()}
    for run in (first, second):
        assert fleet.hub_record(run.job_id())["status"] == "completed"
