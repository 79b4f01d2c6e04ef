"""The heartbeat timer over a real broker (PROTOCOL §12, §10)."""

from __future__ import annotations

import queue
import subprocess
import sys
import time

import psutil
import pytest
from harness.jobkit import JobPair
from harness.procs import gone, heartbeat_beats
from harness.waiting import PATIENCE_S, wait_until

from mam.runner import barrier, publish
from mam.runner.heartbeat import timer
from mam.shared.protocol import names, wire
from mam.shared.store.registry import Contract
from mam.shared.transport import mqtt

pytestmark = pytest.mark.broker

BEAT_S = 0.5
IDLE_TIMEOUT_S = 3
KEEPALIVE_BEATS = int(2 * IDLE_TIMEOUT_S / BEAT_S)
REPETITIONS = 200
AGENT_LIFETIME_S = 3600  # outlives every test here (killed in `finally`): a watched agent that exits stops the timer


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({AGENT_LIFETIME_S})"])


def _beats(pair: JobPair) -> list[dict]:
    return heartbeat_beats(pair.runner.audit(pair.job_id))


def _timer_pid(pair: JobPair) -> int | None:
    info = barrier.read_json(names.heartbeat_path(pair.runner.root, pair.job_id, "pid"))
    return info["pid"] if info else None


@pytest.fixture
def pair(broker, tmp_path):
    job = JobPair(broker, tmp_path, contract=Contract(heartbeat_sec=1, heartbeat_misses=3))
    yield job
    job.close()


def test_s12_beats_keep_job_alive_then_stop_when_watched_process_dies(pair):
    agent = _sleeper()
    try:
        watcher = pair.watch("--idle-timeout", str(IDLE_TIMEOUT_S))
        pair.wait_subscribed(watcher)
        started = pair.publish("started", "--heartbeat", str(BEAT_S), "--watch-pid", str(agent.pid))
        assert started.returncode == 0, started.stderr
        # the beats span twice the idle timeout, so only beats kept it alive (6x margin for a late beat)
        wait_until(lambda: len(watcher.events("progress")) >= KEEPALIVE_BEATS or watcher.proc.poll() is not None,
                   what=f"{KEEPALIVE_BEATS} heartbeats")
        assert watcher.proc.poll() is None, watcher.log()
        beat = watcher.events("progress")[0]
        assert beat["detail"] == "heartbeat" and beat["data"]["heartbeat"] is True
        timer = _timer_pid(pair)
        assert timer is not None and psutil.pid_exists(timer)
        agent.kill()
        agent.wait()
        at_death = len(_beats(pair))
        wait_until(lambda: gone(timer), what="the timer to stop after the watched process died")
        count = len(_beats(pair))
        # §12 "within one period": the timer checks the watched process before every beat, so at
        # most the beat whose check came before the death follows it (an ordering, not a stopwatch)
        assert count <= at_death + 1, f"{count - at_death} beats after the watched process died"
        assert watcher.wait(PATIENCE_S) == 2, watcher.log()  # silence now: the hub closes it
        assert len(_beats(pair)) == count
        assert pair.record["close_reason"] == "deadline_timeout"
    finally:
        agent.kill()
        agent.wait()


def test_s12_second_started_replaces_timer(pair):
    agent = _sleeper()
    try:
        assert pair.publish("started", "--heartbeat", "5", "--watch-pid", str(agent.pid)).returncode == 0
        first = _timer_pid(pair)
        record = pair.runner.get(pair.job_id)
        second = timer.start_timer(pair.runner, pair.job_id, attempt_id=record["attempt_id"],
                                       dispatch_token=record["dispatch_token"], interval_s=5,
                                       watch=barrier.WatchedProcess.of(agent.pid), timeout_s=60)
        assert second is not None and second != first
        wait_until(lambda: gone(first), what="the first timer to be replaced")
        assert pair.publish("completed").returncode == 0
        wait_until(lambda: gone(second), what="the timer to stop on the terminal")
        # a start that finds the attempt ended arms nothing
        assert timer.start_timer(pair.runner, pair.job_id, attempt_id=record["attempt_id"],
                                     dispatch_token=record["dispatch_token"], interval_s=5,
                                     watch=barrier.WatchedProcess.of(agent.pid), timeout_s=60) is None
    finally:
        agent.kill()
        agent.wait()


def test_s12_heartbeat_flag_refused_without_started(pair):
    result = pair.publish("progress", "--heartbeat", "1")
    assert result.returncode == 64 and "--heartbeat" in result.stderr
    assert pair.runner.get(pair.job_id)["last_seq"] == 0


@pytest.mark.timeout(REPETITIONS * 5)
def test_s12_no_beat_follows_a_terminal_200_times(nats_broker, tmp_path):
    """§12: terminal-while-beating, 200 times: the terminal always has the highest seq,
    on disk and on the wire, and nothing of that job arrives after it."""
    agent = _sleeper()
    observer = mqtt.MqttClient(nats_broker.config(), "observer")
    observer.connect()
    observer.subscribe([(names.all_jobs_filter(nats_broker.topic_root), 1)])
    try:
        watch = barrier.WatchedProcess.of(agent.pid)
        terminal_seq: dict[str, int] = {}
        for i in range(REPETITIONS):
            pair = JobPair(nats_broker, tmp_path / f"r{i}")
            cfg = publish.broker_for(pair.runner, pair.job_id, warn=False)
            publish.send(publish.record(pair.runner, publish.PublishRequest(pair.job_id, "started")), cfg)
            record = pair.runner.get(pair.job_id)
            timer.start_timer(pair.runner, pair.job_id, attempt_id=1,
                                  dispatch_token=record["dispatch_token"], interval_s=0.01,
                                  watch=watch, timeout_s=60, drain_s=0.2)
            wait_until(lambda: pair.runner.get(pair.job_id)["last_seq"] >= 2, what="a first beat")
            done = publish.record(pair.runner, publish.PublishRequest(pair.job_id, "completed"))
            publish.send(done, cfg)
            terminal_seq[pair.job_id] = done.seq
            lines = [line for line in pair.runner.audit(pair.job_id) if "seq" in line]
            assert lines[-1]["event"] == "completed" and lines[-1]["seq"] == done.seq
            assert max(line["seq"] for line in lines) == done.seq
        # the wire, in arrival order: after a job's terminal event nothing of that job arrives
        deadline = time.monotonic() + PATIENCE_S
        seen_terminal: set[str] = set()
        while len(seen_terminal) < REPETITIONS and (remaining := deadline - time.monotonic()) > 0:
            try:
                message = observer.messages.get(timeout=remaining)
            except queue.Empty:
                break
            parsed = names.parse_job_topic(message.topic, nats_broker.topic_root)
            if not parsed or parsed[1] != "events" or not message.payload:
                continue
            event = wire.decode(message.payload, "event")
            assert event.job_id not in seen_terminal, f"a message of {event.job_id} after its terminal"
            assert event.seq <= terminal_seq[event.job_id]
            if event.terminal:
                seen_terminal.add(event.job_id)
        assert len(seen_terminal) == REPETITIONS
    finally:
        observer.close()
        agent.kill()
        agent.wait()
