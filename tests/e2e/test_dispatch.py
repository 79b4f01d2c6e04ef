"""`mam-orch dispatch` over a real broker, with the runner played by the test
(PROTOCOL §1, §5, §7, §9, §10, §13). The hub is always the real CLI process."""

from __future__ import annotations

import json
import os
import secrets
import signal
import stat

import pytest
from harness.jobkit import WatchProcess
from harness.runnersim import MAM_ORCH, SimRunner, Wire, hub_env, hub_workspace, job_records, orch, retained
from harness.waiting import PATIENCE_S, wait_until

from mam.shared.protocol import crypto, names, wire
from mam.shared.store.registry import Registry

pytestmark = pytest.mark.broker


def dispatch_bg(workspace, *args, env=None) -> WatchProcess:
    return WatchProcess([*MAM_ORCH, "dispatch", "--workspace", str(workspace), *args], env or hub_env())


@pytest.fixture
def sim(request, tmp_path):
    broker = request.getfixturevalue(getattr(request, "param", "nats_broker"))
    runner = SimRunner(broker, tmp_path / "runner")
    runner.broker = broker
    yield runner
    runner.close()


@pytest.mark.parametrize("sim", ["nats_broker", "mosquitto_broker"], indirect=True)
def test_s5_s10_dispatch_completed_and_brief_never_in_clear(sim, tmp_path):
    hub = hub_workspace(sim.broker, tmp_path)
    eavesdropper = Wire(sim.broker)
    brief = "refactor the parser; codeword " + secrets.token_hex(16)
    proc = dispatch_bg(hub, "--session", "gpu-box", "--brief", brief, "--ack-timeout", "20", "--heartbeat", "5")
    try:
        taken = sim.take()
        job_id = taken.dispatch.job_id
        record = Registry(hub).get(job_id)
        # the seal carried the brief and this job's auth_token (§5)
        assert taken.brief == brief and taken.auth_token == record["auth_token"]
        assert taken.dispatch.attempt_id == 1 and taken.dispatch.dispatch_token == record["dispatch_token"]
        assert taken.dispatch.contract.heartbeat_sec == 5 and taken.dispatch.contract.ack_timeout_sec == 20
        sim.publish(job_id, "started")
        sim.publish(job_id, "progress", "half way")
        sim.publish(job_id, "completed", "done", exit_code=0)
        assert proc.wait(PATIENCE_S) == 0, proc.log()
    finally:
        proc.kill()
    assert [e["event"] for e in proc.events()] == ["started", "progress", "completed"]
    assert f"dispatched job {job_id} to gpu-box" in proc.log()
    record = Registry(hub).get(job_id)
    assert record["status"] == "completed" and record["transport"] == "remote"
    assert record["agent_session"] == "remote:gpu-box" and record["last_seq"] == 3
    # the hub's copy of the brief, for redispatch: 0600, next to the audit log
    copy = Registry(hub).logs_dir(job_id) / "brief.txt"
    assert copy.read_text() == brief and stat.S_IMODE(copy.stat().st_mode) == 0o600
    # nothing on the wire held the brief or the auth_token in clear (§5)
    eavesdropper.wait_for(lambda m: m.topic.endswith("/state") and b'"completed"' in m.payload,
                          what="the terminal state on the wire")
    payloads = [m.payload for m in eavesdropper.drain()]
    eavesdropper.close()
    assert any(taken.raw == p for p in payloads)
    for secret in (brief.encode(), brief.split()[-1].encode(), record["auth_token"].encode()):
        assert not any(secret in p for p in payloads)
    assert retained(sim.broker, names.dispatch_topic(job_id, sim.root)) is None  # the runner cleared it


def _one_line_64(result, needle):
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 64, (result.returncode, result.stderr)
    assert len(lines) == 1 and lines[0].startswith("ERROR: ") and needle in lines[0], result.stderr
    assert result.stdout == ""


def test_s1_s5_s9_bad_inputs_exit_64_nothing_registered_nothing_published(nats_broker, tmp_path):
    hub = hub_workspace(nats_broker, tmp_path)
    eavesdropper = Wire(nats_broker)
    big = tmp_path / "big.txt"
    big.write_bytes(b"a" * (600 * 1024))
    binary = tmp_path / "binary.bin"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe\x00\x00")
    nul = tmp_path / "nul.txt"
    nul.write_bytes(b"run\x00this")
    ok = ("--brief", "do it")
    cases = [
        (("--session", "gpu.box", *ok), "'.' is not allowed"),
        (("--session", "a/b", *ok), "'/' is not allowed"),
        (("--session", "+", *ok), "'+' is not allowed"),
        (("--session", "#", *ok), "'#' is not allowed"),
        (("--session", "gpu box", *ok), "a space is not allowed"),
        (("--session", "g" * 64, *ok), "64 characters"),
        (("--session", "gpu", "--brief", "x", "--brief-file", str(big)), "exactly one of"),
        (("--session", "gpu"), "exactly one of"),
        (("--session", "gpu", "--brief", "  \n"), "the brief is empty"),
        (("--session", "gpu", "--brief-file", str(big)), "larger than the 524288-byte limit"),
        (("--session", "gpu", "--brief-file", str(tmp_path / "missing.txt")), "cannot read"),
        (("--session", "gpu", "--brief-file", str(tmp_path)), "cannot read"),
        (("--session", "gpu", "--brief-file", str(binary)), "not UTF-8"),
        (("--session", "gpu", "--brief-file", str(nul)), "NUL"),
        (("--session", "gpu", *ok, "--heartbeat", "0"), "--heartbeat 0 is invalid"),
        (("--session", "gpu", *ok, "--ack-timeout", "-5"), "--ack-timeout -5 is invalid"),
        (("--session", "gpu", *ok, "--timeout", "0"), "--timeout 0 is invalid"),
        (("--session", "gpu", *ok, "--heartbeat-misses", "0"), "--heartbeat-misses 0 is invalid"),
        (("--session", "gpu", *ok, "--idle-timeout", "0"), "--idle-timeout 0 is invalid"),
        (("--session", "gpu", *ok, "--heartbeat", "ten"), "Invalid value for '--heartbeat'"),
    ]
    for args, needle in cases:
        result = orch(hub, "dispatch", *args)
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 64, (args, result.stderr)
        assert needle in result.stderr, (args, result.stderr)
        assert len(lines) == 1 or args[-1] == "ten", (args, result.stderr)  # typer's own errors add usage
    empty_stdin = orch(hub, "dispatch", "--session", "gpu", "--brief-file", "-", stdin="")
    _one_line_64(empty_stdin, "the brief is empty")
    for env, needle in ((hub_env(MAM_DISPATCH_SECRET=""), "MAM_DISPATCH_SECRET is not set"),
                        (hub_env(MAM_DISPATCH_SECRET="short"), "MAM_DISPATCH_SECRET is too short"),
                        (hub_env(MAM_HEARTBEAT_SEC="0"), "MAM_HEARTBEAT_SEC='0' is invalid"),
                        (hub_env(MAM_ACK_TIMEOUT_S="soon"), "MAM_ACK_TIMEOUT_S='soon' is invalid"),
                        (hub_env(MQTT_PORT="99999"), "MQTT_PORT")):
        _one_line_64(orch(hub, "dispatch", "--session", "gpu", *ok, env=env), needle)
    bad_env_file = tmp_path / "bad.env"
    bad_env_file.write_bytes(b"MQTT_BROKER=\xff\xfe\n")
    unreadable = orch(hub, "dispatch", "--session", "gpu", *ok, env=hub_env(MAM_ENV_FILE=str(bad_env_file)))
    assert unreadable.returncode == 1 and unreadable.stderr.strip() == \
        f"ERROR: {bad_env_file}: cannot read (UnicodeDecodeError)"
    assert job_records(hub) == []
    # nothing was published: the first message the eavesdropper sees is our own sentinel
    sentinel = names.presence_topic("sentinel", nats_broker.topic_root)
    eavesdropper.client.publish(sentinel, b"x")
    eavesdropper.wait_for(lambda m: m.topic == sentinel, what="the sentinel")
    assert [m.topic for m in eavesdropper.drain()] == [sentinel]
    eavesdropper.close()


def test_s9_broker_unreachable_exit_3_nothing_registered(nats_broker, tmp_path):
    hub = hub_workspace(nats_broker, tmp_path)
    nats_broker.stop()
    result = orch(hub, "dispatch", "--session", "gpu-box", "--brief", "x")
    assert result.returncode == 3, result.stderr
    assert "cannot connect to the MQTT broker" in result.stderr
    assert job_records(hub) == []


def test_s10_ack_timeout_agent_blocked_clears_dispatch_and_cancels(sim, tmp_path):
    hub = hub_workspace(sim.broker, tmp_path)
    result = orch(hub, "dispatch", "--session", "nobody-home", "--brief", "x", "--ack-timeout", "2")
    assert result.returncode == 1, result.stderr
    (path,) = job_records(hub)
    record = Registry(hub).get(path.stem)
    assert record["status"] == "error" and record["close_reason"] == "agent_blocked"
    root = sim.broker.topic_root
    assert retained(sim.broker, names.dispatch_topic(record["job_id"], root)) is None
    raw = retained(sim.broker, names.control_topic(record["job_id"], root), PATIENCE_S)
    control = wire.decode(raw, "control")
    crypto.verify(control.to_dict(), sim.keys.sign_key)
    assert (control.action, control.attempt_id, control.reason) == ("cancel", 1, "agent_blocked")


def test_s7_require_online_refuses_absent_forged_and_draining_presence(sim, tmp_path):
    hub = hub_workspace(sim.broker, tmp_path)
    args = ("dispatch", "--session", "gpu-box", "--brief", "x", "--require-online", "--detach", "--json")
    absent = orch(hub, *args)
    assert absent.returncode == 5, absent.stderr
    assert "session gpu-box has no signed presence; nothing dispatched" in absent.stderr
    sim.presence("online", key=b"k" * 32)  # forged: signed with another key
    forged = orch(hub, *args)
    assert forged.returncode == 5 and "presence sig verify failed" in forged.stderr, forged.stderr
    sim.presence("draining")
    draining = orch(hub, *args)
    assert draining.returncode == 5 and "session gpu-box is draining" in draining.stderr
    assert job_records(hub) == []
    sim.presence("online")
    online = orch(hub, *args)
    assert online.returncode == 0, online.stderr
    answer = json.loads(online.stdout)
    assert answer["session"] == "gpu-box" and answer["attempt_id"] == 1 and answer["status"] == "pending"
    assert sim.take().dispatch.job_id == answer["job_id"]


def test_s10_detach_then_watch_reattaches(sim, tmp_path):
    hub = hub_workspace(sim.broker, tmp_path)
    brief = "from stdin: " + secrets.token_hex(8) + "\nsecond line\n"
    result = orch(hub, "dispatch", "--session", "gpu-box", "--brief-file", "-", "--detach", "--ack-timeout", "30",
                  stdin=brief)
    assert result.returncode == 0, result.stderr
    job_id = json.loads(result.stdout)["job_id"]
    assert f"dispatched job {job_id} to gpu-box" in result.stderr
    assert Registry(hub).get(job_id)["status"] == "pending"
    taken = sim.take()
    assert taken.dispatch.job_id == job_id and taken.brief == brief
    sim.publish(job_id, "started")
    watcher = WatchProcess([*MAM_ORCH, "watch", job_id, "--workspace", str(hub)], hub_env())
    try:
        wait_until(lambda: any("subscribed" in line for line in watcher.stderr), what="the watcher to subscribe")
        sim.publish(job_id, "completed", exit_code=0)
        assert watcher.wait(PATIENCE_S) == 0, watcher.log()
    finally:
        watcher.kill()
    assert Registry(hub).get(job_id)["status"] == "completed"


def test_s10_env_contract_reaches_the_dispatch(sim, tmp_path):
    hub = hub_workspace(sim.broker, tmp_path, MAM_HEARTBEAT_SEC="7", MAM_HEARTBEAT_MISSES="3")
    result = orch(hub, "dispatch", "--session", "gpu-box", "--brief", "x", "--detach",
                  env=hub_env(MAM_ACK_TIMEOUT_S="40"))
    assert result.returncode == 0, result.stderr
    contract = sim.take().dispatch.contract
    assert (contract.heartbeat_sec, contract.heartbeat_misses, contract.ack_timeout_sec,
            contract.idle_timeout_sec) == (7, 3, 40, 21)
    assert os.environ.get("MAM_HEARTBEAT_SEC") is None


def test_s10_ctrl_c_detaches_and_the_job_keeps_its_state(sim, tmp_path):
    hub = hub_workspace(sim.broker, tmp_path)
    proc = dispatch_bg(hub, "--session", "gpu-box", "--brief", "x", "--ack-timeout", "60")
    try:
        job_id = sim.take().dispatch.job_id
        wait_until(lambda: any("dispatched job" in line for line in proc.stderr), what="the dispatch line")
        proc.proc.send_signal(signal.SIGINT)
        assert proc.wait(PATIENCE_S) == 130, proc.log()
    finally:
        proc.kill()
    assert f"Re-attach: mam-orch watch {job_id}" in proc.log() and f"mam-orch cancel {job_id}" in proc.log()
    assert Registry(hub).get(job_id)["status"] == "pending"  # detached, not closed (§10)
