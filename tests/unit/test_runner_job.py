"""runner/job.py without processes: how a StopReason becomes the terminal event (PROTOCOL §5, §6, §11),
and a terminal the disk refuses (§17)."""

from __future__ import annotations

import errno
import os
import signal
import tempfile
import threading
from pathlib import Path
from typing import Any

import pytest
from harness.fake_mqtt import FakeBroker
from harness.waiting import PATIENCE_S, wait_until

from mam.runner import publish
from mam.runner.agent import ExitStatus
from mam.runner.job import Job, StopReason, Supervisor, Terminal, final_reason, orphan_job, terminal_for
from mam.runner.process_tree import AgentIdentity
from mam.runner.settings import RunnerOptions
from mam.shared.config import BrokerConfig
from mam.shared.protocol import crypto, names, wire
from mam.shared.store.registry import Registry

JOB = "918b0612"
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


def started_job(tmp_path: Path) -> tuple[FakeBroker, BrokerConfig, Registry, Supervisor, Job]:
    """A job this runner took and published `started` for (seq 1), its Supervisor on a fake broker."""
    broker = FakeBroker()
    config = BrokerConfig(hosts=("fake-broker",), topic_root="unit/mam")
    client = broker.client(config).connect()
    registry = Registry(tmp_path / "ws")
    token = names.new_dispatch_token()
    registry.mirror(job_id=JOB, session="gpu-box", attempt_id=1, dispatch_token=token,
                    auth_token=names.new_auth_token(), contract=wire.Contract(), origin="hub", source="runner")
    publish.record(registry, publish.PublishRequest(JOB, "started", attempt_id=1, dispatch_token=token),
                   source="runner")
    options = RunnerOptions(session="gpu-box", argv=("true",), root=registry.root)
    supervisor = Supervisor(options=options, runner_id="0" * 32, registry=registry, client=client, config=config,
                            environ={}, on_end=lambda _job_id: None)
    return broker, config, registry, supervisor, Job(job_id=JOB, attempt_id=1, dispatch_token=token, brief="",
                                                     heartbeat_s=30, timeout_s=60)


# ------------------------------------------------------------ a disk that refuses the terminal


def test_fault9_a_terminal_the_disk_refuses_goes_on_the_wire_then_to_disk_with_the_same_seq(tmp_path, monkeypatch):
    """Every fsync fails with ENOSPC while `full` is set (a full disk, as the registry sees it):
    the terminal is sent on the wire at once, signed with the attempt's token; when the disk
    takes writes again the record ends `error` with that seq; nothing raises out of the thread."""
    broker, config, registry, supervisor, job = started_job(tmp_path)
    auth_token = registry.get(JOB)["auth_token"]
    full = threading.Event()
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        if full.is_set():
            raise OSError(errno.ENOSPC, "No space left on device")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    full.set()
    failures: list[BaseException] = []

    def end() -> None:
        try:
            supervisor.publish_terminal(job, Terminal("error", "agent exited with code 3", 3))
        except BaseException as exc:  # the thread must not die
            failures.append(exc)

    thread = threading.Thread(target=end, daemon=True)
    thread.start()
    events = names.events_topic(JOB, config.topic_root)
    sent = wait_until(lambda: broker.on_topic(events), PATIENCE_S, "the terminal on the wire")[0]
    terminal = wire.decode(sent.payload, "event")
    crypto.verify_event(terminal, auth_token)
    assert (terminal.event, terminal.seq, terminal.data["exit_code"]) == ("error", 2, 3)
    assert registry.get(JOB)["status"] == "running"  # the disk refused it
    full.clear()  # space returns
    thread.join(PATIENCE_S)
    assert not thread.is_alive() and failures == []
    record = registry.get(JOB)
    assert (record["status"], record["last_seq"], record["exit_code"]) == ("error", 2, 3)
    assert [wire.decode(p.payload, "event").seq for p in broker.on_topic(events)] == [2, 2]  # resent, same seq


def test_fault9_s12_no_beat_takes_the_seq_of_a_terminal_the_disk_refused(tmp_path, monkeypatch):
    """The daemon beats for the job every 20 ms (§12, `beats`) when the disk fills up: the
    terminal goes on the wire with the next seq; once space returns the record takes that same
    seq for the terminal, never for a beat (the supervisor stops the job's beats first)."""
    broker, config, registry, supervisor, job = started_job(tmp_path)
    token = job.dispatch_token
    supervisor.beats.add(JOB, attempt_id=1, dispatch_token=token, interval_s=0.02, timeout_s=60)
    wait_until(lambda: registry.get(JOB)["last_seq"] >= 2, PATIENCE_S, "a first beat")
    full = threading.Event()
    real_fsync, real_mkstemp = os.fsync, tempfile.mkstemp

    def fsync(fd: int) -> None:
        if full.is_set():
            raise OSError(errno.ENOSPC, "No space left on device")
        real_fsync(fd)

    def mkstemp(*args: Any, **kwargs: Any) -> Any:  # every atomic write, fsynced or not (the barrier)
        if full.is_set():
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_mkstemp(*args, **kwargs)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(tempfile, "mkstemp", mkstemp)
    full.set()
    thread = threading.Thread(target=supervisor.publish_terminal, args=(job, Terminal("error", "exit 3", 3)),
                              daemon=True)
    thread.start()
    events = names.events_topic(JOB, config.topic_root)
    sent = wait_until(lambda: [p for p in broker.on_topic(events) if b'"error"' in p.payload], PATIENCE_S,
                      "the terminal on the wire")[0]
    terminal = wire.decode(sent.payload, "event")
    full.clear()  # space returns; the beats of before would now take the terminal's seq
    thread.join(PATIENCE_S)
    supervisor.beats.stop()
    record = registry.get(JOB)
    assert (record["status"], record["last_seq"]) == ("error", terminal.seq)
    audit = [line for line in registry.audit(JOB) if "seq" in line]
    assert audit[-1]["event"] == "error" and audit[-1]["seq"] == terminal.seq  # no beat after the terminal
    # (a beat whose record write the full disk refused may have left its audit line: one step ahead, §8)
    assert all(wire.decode(p.payload, "event").seq < terminal.seq for p in broker.on_topic(events)
               if b'"heartbeat"' in p.payload)
