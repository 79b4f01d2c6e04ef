"""`mam-orch cancel`, `redispatch` and `runners` over a real broker, the runner
played by the test (PROTOCOL §5, §6, §7, §8, §9, §10)."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest
from harness.jobkit import WatchProcess
from harness.runnersim import MAM_ORCH, SimRunner, hub_env, hub_workspace, job_records, orch, retained
from harness.waiting import PATIENCE_S, wait_until

from mam.shared.protocol import crypto, names, wire
from mam.shared.store.registry import Registry

pytestmark = pytest.mark.broker


@pytest.fixture
def sim(nats_broker, tmp_path):
    runner = SimRunner(nats_broker, tmp_path / "runner")
    runner.broker = nats_broker
    yield runner
    runner.close()


def detached(hub, *args):
    result = orch(hub, "dispatch", "--session", "gpu-box", "--detach", "--json", *args)
    assert result.returncode == 0, result.stderr
    assert result.stdout, result.stderr
    return json.loads(result.stdout)["job_id"]


def test_s6_cancel_running_job_dispatch_exits_4_signed_retained_cancel(sim, tmp_path):
    hub = hub_workspace(sim.broker, tmp_path)
    proc = WatchProcess([*MAM_ORCH, "dispatch", "--workspace", str(hub), "--session", "gpu-box",
                         "--brief", "long job", "--ack-timeout", "20"], hub_env())
    try:
        job_id = sim.take().dispatch.job_id
        sim.publish(job_id, "started")
        wait_until(lambda: Registry(hub).get(job_id)["status"] == "running", what="the hub to mirror started")
        result = orch(hub, "cancel", job_id)
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout) == {"job_id": job_id, "status": "cancelled", "attempt_id": 1,
                                             "changed": True}
        assert proc.wait(PATIENCE_S) == 4, proc.log()
    finally:
        proc.kill()
    record = Registry(hub).get(job_id)
    assert record["status"] == "cancelled" and record["close_reason"] == "cancelled"
    control = sim.wait_control(job_id)  # verified with the fleet key by the runner side
    assert (control.action, control.attempt_id, control.reason) == ("cancel", 1, "operator")
    raw = retained(sim.broker, names.control_topic(job_id, sim.root), PATIENCE_S)
    crypto.verify(wire.decode(raw, "control").to_dict(), sim.keys.sign_key)  # retained for a reconnecting runner
    # §10: a closed job's cancel is sent again (the first may never have left the hub)
    again = orch(hub, "cancel", job_id)
    assert again.returncode == 0 and "already cancelled; sent the cancel to its runner again" in again.stderr
    assert json.loads(again.stdout)["changed"] is False


def test_s6_cancel_pending_job_clears_the_retained_dispatch(sim, tmp_path):
    hub = hub_workspace(sim.broker, tmp_path)
    sim.close()  # no runner is listening: the dispatch waits retained
    job_id = detached(hub, "--brief", "never run", "--ack-timeout", "60")
    assert retained(sim.broker, names.dispatch_topic(job_id, sim.root), PATIENCE_S) is not None
    assert orch(hub, "cancel", job_id).returncode == 0
    # a runner that connects now never sees the dispatch
    assert retained(sim.broker, names.dispatch_topic(job_id, sim.root)) is None
    assert Registry(hub).get(job_id)["status"] == "cancelled"


def test_s9_cancel_unknown_or_malformed_job_one_line(sim, tmp_path):
    hub = hub_workspace(sim.broker, tmp_path)
    unknown = orch(hub, "cancel", "0badcafe")
    assert unknown.returncode == 1 and len(unknown.stderr.strip().splitlines()) == 1
    assert "job 0badcafe: no record" in unknown.stderr
    malformed = orch(hub, "cancel", "../etc")
    assert malformed.returncode == 64 and "job id '../etc' is invalid" in malformed.stderr


def test_s8_redispatch_from_error_new_attempt_opens_with_new_identity(sim, tmp_path):
    hub = hub_workspace(sim.broker, tmp_path)
    result = orch(hub, "dispatch", "--session", "gpu-box", "--brief", "try twice", "--ack-timeout", "2")
    assert result.returncode == 1, result.stderr  # agent_blocked: the runner took nothing
    sim.take(mirror=False)  # the runner saw attempt 1 (late) but did not take it
    (path,) = job_records(hub)
    job_id = path.stem
    old = Registry(hub).get(job_id)
    redo = orch(hub, "redispatch", job_id, "--detach", "--json")
    assert redo.returncode == 0, redo.stderr
    assert json.loads(redo.stdout)["attempt_id"] == 2
    new = Registry(hub).get(job_id)
    assert new["attempt_id"] == 2 and new["status"] == "pending"
    assert new["dispatch_token"] != old["dispatch_token"] and new["auth_token"] != old["auth_token"]
    taken = sim.take()
    assert taken.dispatch.attempt_id == 2 and taken.dispatch.dispatch_token == new["dispatch_token"]
    # the old attempt was cancelled again first: its runner may have missed the hub's close (§6, §10)
    control = wire.decode(retained(sim.broker, names.control_topic(job_id, sim.root), PATIENCE_S), "control")
    crypto.verify(control.to_dict(), sim.keys.sign_key)
    assert (control.attempt_id, control.reason) == (1, "redispatch")
    assert taken.auth_token == new["auth_token"] and taken.brief == "try twice"
    # the new dispatch does not open as attempt 1 (the seal is bound to the attempt, §5)
    with pytest.raises(Exception, match="seal does not open"):
        crypto.open_sealed(sim.keys.seal_key, taken.dispatch.sealed, job_id=job_id, attempt_id=1,
                           dispatch_token=old["dispatch_token"])
    sim.publish(job_id, "started")
    sim.publish(job_id, "completed", exit_code=0)
    watch = orch(hub, "watch", job_id)
    assert watch.returncode == 0, watch.stderr
    assert Registry(hub).get(job_id)["status"] == "completed"
    # §8: never from completed; nothing published, record unchanged
    refused = orch(hub, "redispatch", job_id, "--detach")
    assert refused.returncode == 1 and "refused redispatch: the job completed" in refused.stderr
    assert Registry(hub).get(job_id)["attempt_id"] == 2


def test_s8_redispatch_refusals_before_any_network(nats_broker, tmp_path):
    hub = hub_workspace(nats_broker, tmp_path)
    job_id = detached(hub, "--brief", "x", "--ack-timeout", "60")
    nats_broker.stop()  # every refusal below is decided on the hub's disk
    running = orch(hub, "redispatch", job_id)
    assert running.returncode == 1 and "the job is pending; cancel it first" in running.stderr
    bad_session = orch(hub, "redispatch", job_id, "--session", "gpu.box")
    assert bad_session.returncode == 64 and "'.' is not allowed" in bad_session.stderr
    Registry(hub).close(job_id, "cancelled")
    (Registry(hub).logs_dir(job_id) / "brief.txt").unlink()
    no_brief = orch(hub, "redispatch", job_id)
    assert no_brief.returncode == 64 and "no stored brief" in no_brief.stderr
    offline = orch(hub, "redispatch", job_id, "--brief", "again")
    assert offline.returncode == 3, offline.stderr
    assert Registry(hub).get(job_id)["attempt_id"] == 1  # unreachable broker: record unchanged


def test_s7_runners_lists_signed_presence_and_refuses_forged(sim, tmp_path):
    hub = hub_workspace(sim.broker, tmp_path)
    sim.presence("online", running=("918b0612",))
    sim.presence("offline", session="old-box")
    sim.presence("offline", session="dead-box", will=True)  # §7: its Last Will: lost
    # §7: an online presence not refreshed for three periods (a dead host, or a replay) is lost
    sim.presence("online", session="replayed-box", timestamp=datetime.now(UTC) - timedelta(hours=1))
    sim.presence("online", session="evil-box", key=b"f" * 32)
    sim.client.publish(names.presence_topic("junk-box", sim.root), b'{"kind": "presence"}', retain=True)
    body = wire.Presence.build("elsewhere", names.new_runner_id(), "online", host="h", version="1", max_jobs=1)
    sim.client.publish(names.presence_topic("moved-box", sim.root),
                       wire.encode(crypto.sign(body.to_dict(), sim.keys.sign_key)), retain=True)
    result = orch(hub, "runners", "--json")
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert [(r["session"], r["status"], r["lost"], r["running"]) for r in rows] == [
        ("dead-box", "lost", "last_will", []), ("gpu-box", "online", None, ["918b0612"]),
        ("old-box", "offline", None, []), ("replayed-box", "lost", "not_refreshed", [])]
    stale = orch(hub, "dispatch", "--session", "replayed-box", "--brief", "x", "--require-online")
    assert stale.returncode == 5 and "replayed-box is lost" in stale.stderr
    assert "refused presence on python/mqtt/runners/evil-box: presence sig verify failed" in result.stderr
    assert "runners/junk-box" in result.stderr and "runners/moved-box" in result.stderr


def test_s2_gc_clears_retained_topics_of_old_terminal_jobs_only(sim, tmp_path):
    hub = hub_workspace(sim.broker, tmp_path)
    registry = Registry(hub)
    old = registry.register(session="gpu-box")["job_id"]
    recent = registry.register(session="gpu-box")["job_id"]
    unfinished = registry.register(session="gpu-box")["job_id"]
    for job_id in (old, recent):
        registry.close(job_id, "cancelled")
    path = registry.record_path(old)  # age the old job: terminal for ten days
    aged = json.loads(path.read_text())
    aged["updated_at"] = "2000-01-01T00:00:00Z"
    path.write_text(json.dumps(aged))
    path = registry.record_path(unfinished)
    aged = json.loads(path.read_text())
    aged["updated_at"] = "2000-01-01T00:00:00Z"
    path.write_text(json.dumps(aged))
    for job_id in (old, recent, unfinished):
        for leaf in ("dispatch", "state", "control"):
            sim.client.publish(names.job_topic(job_id, leaf, sim.root), b"{}", retain=True)
    bad = orch(hub, "gc", "--older-than-days", "-1")
    assert bad.returncode == 64 and "--older-than-days -1 is invalid" in bad.stderr
    dry = orch(hub, "gc", "--dry-run")
    assert dry.returncode == 0 and [json.loads(x)["job_id"] for x in dry.stdout.splitlines()] == [old]
    assert retained(sim.broker, names.state_topic(old, sim.root), PATIENCE_S) == b"{}"
    result = orch(hub, "gc")
    assert result.returncode == 0, result.stderr
    assert [json.loads(line)["job_id"] for line in result.stdout.splitlines()] == [old]
    for leaf in ("dispatch", "state", "control"):
        assert retained(sim.broker, names.job_topic(old, leaf, sim.root), 0.5) is None
    assert retained(sim.broker, names.state_topic(recent, sim.root), PATIENCE_S) == b"{}"
    assert retained(sim.broker, names.state_topic(unfinished, sim.root), PATIENCE_S) == b"{}"
    assert registry.get(old)["status"] == "cancelled"  # the record stays
    assert orch(hub, "gc").stdout == ""  # done once


def test_s10_cancel_resends_for_a_job_closed_while_the_broker_was_away(sim, tmp_path):
    """§10: a watcher that closed a job deadline_timeout with the broker down could not
    tell the runner; `cancel` afterwards publishes the signed cancel instead of saying
    there is nothing to do. A job that ended on its own gets nothing."""
    hub = hub_workspace(sim.broker, tmp_path)
    job_id = detached(hub, "--brief", "long", "--ack-timeout", "60")
    Registry(hub).close(job_id, "deadline_timeout", source="delegate_wrapper")  # as the offline watcher did
    result = orch(hub, "cancel", job_id)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"job_id": job_id, "status": "error", "attempt_id": 1, "changed": False}
    control = sim.wait_control(job_id)
    assert (control.action, control.attempt_id) == ("cancel", 1)
    assert Registry(hub).get(job_id)["close_reason"] == "deadline_timeout"  # the record keeps its reason
