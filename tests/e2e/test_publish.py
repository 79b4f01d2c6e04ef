"""`mam-runner publish` exit codes and refusals (PROTOCOL §3, §9), and Ctrl-C on watch (§10)."""

from __future__ import annotations

import signal
import subprocess

import pytest
from harness.jobkit import MAM_RUNNER, JobPair
from harness.waiting import PATIENCE_S, wait_until

from mam.shared.protocol import names
from mam.shared.transport import mqtt

pytestmark = pytest.mark.broker


@pytest.fixture
def pair(nats_broker, tmp_path):
    job = JobPair(nats_broker, tmp_path)
    yield job
    job.close()


@pytest.fixture
def wire_log(nats_broker):
    """Everything published under the topic root, as a list filled by paho's thread."""
    client = mqtt.MqttClient(nats_broker.config(), "spy")
    client.connect()
    client.subscribe([(names.all_jobs_filter(nats_broker.topic_root), 1)])
    yield client
    client.close()


def _drain(client) -> list:
    out = []
    while not client.messages.empty():
        out.append(client.messages.get_nowait())
    return out


@pytest.mark.parametrize("args,why", [
    (("--data", "{not json"), "not valid JSON"),
    (("--data", "[1, 2]"), "must be a JSON object"),
    (("--data", '{"hmac_sig": "x"}'), "reserved key"),
    (("--data", '{"k": "' + "x" * 20000 + '"}'), "larger than"),
    (("--detail", "x" * 1025), "detail"),
    (("--detail", "bad\x1b[31mred"), "detail"),
    (("--attempt-id", "zero"), "attempt id"),
    (("--attempt-id", "0"), "attempt id"),
    (("--dispatch-token", "../../etc/passwd"), "dispatch token"),
    (("--attempts", "0"), "--attempts"),
])
def test_s9_bad_arguments_exit_64_nothing_written(pair, wire_log, args, why):
    before = pair.runner.audit(pair.job_id)
    result = pair.publish("progress", *args)
    assert result.returncode == 64, result.stderr
    assert why in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert pair.runner.audit(pair.job_id) == before
    assert _drain(wire_log) == []


@pytest.mark.parametrize("job,event,why", [("nothex!!", "progress", "job id"), ("918b0612", "finished", "event")])
def test_s9_bad_job_or_event_exit_64(pair, job, event, why):
    result = subprocess.run([*MAM_RUNNER, "publish", "--job", job, "--event", event,
                             "--workspace", str(pair.runner_ws)], env=pair.env, capture_output=True,
                            text=True, timeout=PATIENCE_S)
    assert result.returncode == 64 and why in result.stderr


def test_s9_stale_attempt_refused_exit_1_nothing_published(pair, wire_log):
    assert pair.publish("started").returncode == 0
    wait_until(lambda: len(wire_log.messages.queue) >= 2, what="started and its state")
    _drain(wire_log)
    stale = pair.publish("progress", "--attempt-id", "2")
    assert stale.returncode == 1 and "refused" in stale.stderr
    token = pair.publish("progress", "--dispatch-token", "0" * 32)
    assert token.returncode == 1
    assert pair.runner.get(pair.job_id)["last_seq"] == 1
    assert _drain(wire_log) == []


def test_s9_terminal_job_refused_exit_1(pair, wire_log):
    assert pair.publish("started").returncode == 0
    assert pair.publish("error", "--detail", "tests failed").returncode == 0
    wait_until(lambda: len(wire_log.messages.queue) >= 4, what="four messages")
    _drain(wire_log)
    late = pair.publish("progress")
    assert late.returncode == 1 and "already error" in late.stderr
    assert _drain(wire_log) == []


def test_s9_unknown_job_refused_exit_1(pair):
    result = subprocess.run([*MAM_RUNNER, "publish", "--job", "0badf00d", "--event", "progress",
                             "--workspace", str(pair.runner_ws)], env=pair.env, capture_output=True,
                            text=True, timeout=PATIENCE_S)
    assert result.returncode == 1 and "no record" in result.stderr


def test_s3_terminal_event_is_retained(nats_broker, pair):
    assert pair.publish("started").returncode == 0
    assert pair.publish("completed").returncode == 0
    late = mqtt.MqttClient(nats_broker.config(), "late")
    try:
        late.connect()
        late.subscribe([(names.events_topic(pair.job_id, nats_broker.topic_root), 1)])
        message = late.messages.get(timeout=PATIENCE_S)
        assert message.retain and b'"completed"' in message.payload
    finally:
        late.close()


def test_s10_ctrl_c_detaches_and_leaves_the_job_running(pair):
    watcher = pair.watch()
    pair.wait_subscribed(watcher)
    watcher.proc.send_signal(signal.SIGINT)
    assert watcher.wait() == 130
    assert f"mam-orch watch {pair.job_id}" in watcher.log()
    assert f"mam-orch cancel {pair.job_id}" in watcher.log()
    assert pair.record["status"] == "pending"
