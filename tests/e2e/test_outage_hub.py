"""On the hub, with a real `mam-runner run` over both brokers.

Fault 2 (PROTOCOL §14 "Broker outages are nobody's silence", §10 "Leases"):
`mam-orch dispatch --heartbeat 3` (K × N = 12 s), the broker SIGKILLed for ~11 s
mid-job and restarted on the same ports: the hub's idle clock stands still while
its own connection is down, so the hub closes nothing (no `deadline_timeout`);
the runner, with no beat acknowledged for the lease less its margin (9 s), has
stopped its agent and reports `lease_lost` once the broker is back: the
dispatch ends with that `error` (exit 1). A restart shorter than L − margin
stops nothing: tests/e2e/test_leases.py.

Fault 3 (§4, §3.2 rule 6): after `dispatch --detach`, `mam-orch watch` moves the
`pending` hub record to `running` from the retained state, and a gap in the
seqs it never saw is logged once, however often it is re-attached.

§10: a watch that gives up on an unreachable broker leaves the job open and
says how to re-attach; a terminal after the hub's own close is a `late_outcome`.

Fault 8, the hub's part (§17): the hub clears the retained dispatch as soon as
it accepts that attempt's `started`, whether or not the runner did.

Fault 11 (§3.2 rules 4-5): after `redispatch`, the first attempt's stragglers
are `stale_attempt` (logged at debug), not forgeries; a forgery still is.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from harness.jobkit import JobPair, WatchProcess
from harness.runnersim import MAM_ORCH, SimRunner, hub_env, hub_workspace, orch, retained
from harness.waiting import PATIENCE_S, wait_until
from harness.workspace import clean_env, write_env_for

from mam.runner.publish import PublishRequest, record, send_on
from mam.shared.protocol import crypto, names, wire
from mam.shared.protocol.errors import ExitCode
from mam.shared.store.registry import Registry

pytestmark = [pytest.mark.broker, pytest.mark.e2e, pytest.mark.timeout(4 * PATIENCE_S)]

AGENTS = Path(__file__).resolve().parents[2] / "examples" / "agents"
MAM_RUNNER = [sys.executable, "-m", "mam.runner"]
ACK_TIMEOUT = str(int(PATIENCE_S))  # a real runner process takes the job: as long as a busy machine needs
HEARTBEAT_S = 3
MISSES = 4  # K × N = 12 s, as in the issue
OUTAGE_S = 11.0  # the broker is down this long: just under K × N
JOB_S = 25  # the agent's sleep: it ends well after the broker is back
DETACHED_JOB_S = 12  # long enough to re-attach twice while it runs
STRAGGLERS = 15  # late messages of attempt 1, as in the issue


def start_runner(broker, workspace: Path, *, once: bool = True) -> subprocess.Popen:
    (workspace / ".git").mkdir(parents=True, exist_ok=True)
    write_env_for(broker, workspace)
    proc = subprocess.Popen([*MAM_RUNNER, "run", "--session", "gpu-box", "--exec", str(AGENTS / "sleep-agent"),
                             "--workspace", str(workspace), *(["--once"] if once else [])],
                            env=clean_env(MAM_CANCEL_GRACE_S="1"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    topic = names.presence_topic("gpu-box", broker.topic_root)
    wait_until(lambda: proc.poll() is not None or b'"online"' in (retained(broker, topic, 0.3) or b""),
               what="the runner's online presence")
    assert proc.poll() is None, proc.stderr.read()
    return proc


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait(PATIENCE_S)
    proc.stderr.close()


def test_fault2_s14_a_short_broker_outage_is_nobodys_silence(broker, tmp_path):
    hub = hub_workspace(broker, tmp_path)
    runner_ws = tmp_path / "runner"
    runner = start_runner(broker, runner_ws, once=False)  # it stays to send the end it kept in its outbox (§17)
    dispatch = WatchProcess([*MAM_ORCH, "dispatch", "--session", "gpu-box", "--brief", str(JOB_S),
                             "--heartbeat", str(HEARTBEAT_S), "--heartbeat-misses", str(MISSES),
                             "--ack-timeout", ACK_TIMEOUT, "--workspace", str(hub)], hub_env())
    try:
        job_id = wait_until(lambda: (dispatch.events("started") or [None])[0], what="started")["job_id"]
        wait_until(lambda: any(e.get("detail") == "heartbeat" for e in dispatch.events("progress")),
                   what="a first heartbeat to reach the hub")
        broker.kill()
        back_at = time.monotonic() + OUTAGE_S
        wait_until(lambda: time.monotonic() >= back_at, what=f"the {OUTAGE_S:g} s outage")
        broker.restart()
        code = dispatch.wait(PATIENCE_S + JOB_S)
    finally:
        dispatch.kill()
        stop(runner)
    assert code == ExitCode.ERROR, dispatch.log()
    record = Registry(hub).get(job_id)
    assert (record["status"], record.get("close_reason"), record.get("lease_lost")) == ("error", None, True), record
    assert Registry(runner_ws).get(job_id)["status"] == "error"
    assert dispatch.events("error")[-1]["detail"].startswith("lease_lost: "), dispatch.events("error")
    assert "deadline_timeout" not in dispatch.log()


def gap_mirrored(registry: Registry, job_id: str) -> bool:
    """The job is `running` and a `seq_gap` is logged and committed with it: the record covers
    the gap's seq (`seen_seq`). The line is appended before the record is written (§8), so a
    watch stopped between the two would leave the gap for the next one to log again."""
    record = registry.get(job_id)
    gaps = [line["got"] for line in registry.audit(job_id) if line["event"] == "seq_gap"]
    return record["status"] == "running" and bool(gaps) and record.get("seen_seq", 0) >= max(gaps)


def test_fault3_s4_watch_mirrors_a_detached_running_job_and_logs_a_gap_once(broker, tmp_path):
    hub = hub_workspace(broker, tmp_path)
    runner_ws = tmp_path / "runner"
    runner = start_runner(broker, runner_ws)
    watchers: list[WatchProcess] = []
    try:
        sent = orch(hub, "dispatch", "--session", "gpu-box", "--detach", "--json", "--brief", str(DETACHED_JOB_S),
                    "--heartbeat", "1", "--heartbeat-misses", "10", "--ack-timeout", ACK_TIMEOUT)
        assert sent.returncode == 0, sent.stderr
        job_id = json.loads(sent.stdout)["job_id"]
        wait_until(lambda: Registry(runner_ws).record_path(job_id).exists()
                   and Registry(runner_ws).get(job_id)["last_seq"] >= 3,
                   what="the runner to run the job past its third seq")
        # nobody mirrored past `started`: the detaching dispatch's engine may take that one before it lets go
        assert Registry(hub).get(job_id)["status"] in ("pending", "running")
        for _ in range(2):  # attach, detach, attach again: the same gap is not logged twice
            watchers.append(WatchProcess([*MAM_ORCH, "watch", job_id, "--workspace", str(hub)], hub_env()))
            wait_until(lambda: gap_mirrored(Registry(hub), job_id),
                       what="the watch to mirror the retained running state, past a gap")
            if len(watchers) == 1:
                watchers[0].stop()
        assert watchers[-1].wait(PATIENCE_S + DETACHED_JOB_S) == 0, watchers[-1].log()
        assert runner.wait(PATIENCE_S) == 0
    finally:
        for watcher in watchers:
            watcher.kill()
        stop(runner)
    assert Registry(hub).get(job_id)["status"] == "completed"
    gaps = [(g["expected"], g["got"]) for g in Registry(hub).audit(job_id) if g["event"] == "seq_gap"]
    assert gaps and len(gaps) == len(set(gaps)), gaps
    covered = [got for _expected, got in gaps]
    assert covered == sorted(covered) and all(e > prev for (e, _), prev in zip(gaps[1:], covered, strict=False))


def test_fault11_s3_2_an_earlier_attempts_stragglers_are_no_forgeries(broker, tmp_path):
    hub = hub_workspace(broker, tmp_path)
    first = SimRunner(broker, tmp_path / "first")
    second = None
    watcher = None
    try:
        sent = orch(hub, "dispatch", "--session", "gpu-box", "--detach", "--json", "--brief", "x",
                    "--ack-timeout", ACK_TIMEOUT)
        assert sent.returncode == 0, sent.stderr
        job_id = json.loads(sent.stdout)["job_id"]
        first.take()
        first.publish(job_id, "started")
        assert orch(hub, "cancel", job_id).returncode in (0, 4)
        redo = orch(hub, "redispatch", job_id, "--detach", "--json")
        assert redo.returncode == 0, redo.stderr
        second = SimRunner(broker, tmp_path / "second")  # subscribes now: the retained attempt 2 only
        assert second.take().dispatch.attempt_id == 2
        watcher = WatchProcess([*MAM_ORCH, "watch", job_id, "--workspace", str(hub)], hub_env())
        wait_until(lambda: watcher.proc.poll() is not None or "subscribed" in watcher.log(),
                   what="the watch to subscribe")
        second.publish(job_id, "started")
        for _ in range(STRAGGLERS):  # attempt 1 never heard of the redispatch: its runner goes on
            first.publish(job_id, "progress")
        ident = {"attempt_id": 2, "dispatch_token": Registry(hub).get(job_id)["dispatch_token"]}
        forged = crypto.sign_event({"schema_version": 1, "seq": 99, "job_id": job_id, "event": "progress",
                                    "timestamp": "2026-06-20T14:49:30Z", "detail": "", "data": ident}, "f" * 43)
        first.client.publish(names.events_topic(job_id, broker.topic_root), wire.encode(forged))
        wait_until(lambda: "HMAC verify failed" in watcher.log(), what="the forgery to be refused")
        second.publish(job_id, "completed", exit_code=0)
        assert watcher.wait(PATIENCE_S) == 0, watcher.log()
    finally:
        if watcher is not None:
            watcher.kill()
        first.close()
        if second is not None:
            second.close()
    log = watcher.log()
    assert log.count("HMAC verify failed") == 1, log  # the forgery only
    assert "stale_attempt" not in log  # the stragglers: debug, below the CLI's log level
    assert Registry(hub).get(job_id)["status"] == "completed"


def test_s14_a_watch_that_gives_up_leaves_the_job_open_and_says_how_to_reattach(broker, tmp_path):
    pair = JobPair(broker, tmp_path)
    try:
        pair.env = clean_env(MAM_HUB_OUTAGE_GIVE_UP_S="1")
        watcher = pair.watch("--idle-timeout", "1")
        pair.wait_subscribed(watcher)
        assert pair.publish("started").returncode == 0
        wait_until(lambda: pair.record["status"] == "running", what="started to be mirrored")
        broker.kill()
        assert watcher.wait() == ExitCode.BROKER, watcher.log()
    finally:
        pair.close()
    assert pair.record["status"] == "running" and pair.record["close_reason"] is None
    assert f"Re-attach: mam-orch watch {pair.job_id} --workspace {pair.hub_ws}" in watcher.log()
    assert "deadline_timeout" not in watcher.log()


def test_s14_a_terminal_after_the_hubs_close_is_recorded_as_late_outcome(broker, tmp_path):
    pair = JobPair(broker, tmp_path)
    try:
        watcher = pair.watch("--idle-timeout", "1")
        pair.wait_subscribed(watcher)
        assert pair.publish("started").returncode == 0
        assert watcher.wait() == ExitCode.TIMEOUT, watcher.log()
        assert pair.publish("completed").returncode == 0  # the runner finishes after all
        again = pair.watch()
        assert again.wait() == ExitCode.TIMEOUT, again.log()  # the hub's verdict stands (§8, §9)
        jobs = orch(pair.hub_ws, "jobs", "--json")
    finally:
        pair.close()
    record = pair.record
    assert record["status"] == "error" and record["close_reason"] == "deadline_timeout"
    assert record["late_outcome"] == "completed" and "later reported completed" in again.log()
    assert [json.loads(line)["late_outcome"] for line in jobs.stdout.splitlines()] == ["completed"]
    late = [line for line in pair.hub.audit(pair.job_id) if line["event"] == "late_terminal"]
    assert len(late) == 1 and late[0]["terminal"] == "completed"


def test_s3_2_an_event_a_higher_seq_overtook_on_the_wire_still_reaches_the_hub_once(broker, tmp_path):
    """A runner records an agent's event (seq 2) on one thread and its heartbeat (seq 3) on another;
    the beat reaches the wire first. The hub takes the late event instead of refusing it as a duplicate."""
    hub = hub_workspace(broker, tmp_path)
    sim = SimRunner(broker, tmp_path / "runner")
    dispatch = WatchProcess([*MAM_ORCH, "dispatch", "--session", "gpu-box", "--brief", "x",
                             "--ack-timeout", ACK_TIMEOUT, "--workspace", str(hub)], hub_env())
    try:
        job_id = sim.take().dispatch.job_id
        sim.publish(job_id, "started")
        asked = record(sim.registry, PublishRequest(job_id, "progress", "the agent asks"), source="runner")
        beat = record(sim.registry, PublishRequest(job_id, "progress", "beat"), source="runner")
        assert (asked.seq, beat.seq) == (2, 3)
        send_on(sim.client, beat)
        wait_until(lambda: [e for e in dispatch.events("progress") if e["seq"] == 3], what="seq 3 at the hub")
        send_on(sim.client, asked)  # again, as the outbox re-sends after a reconnect
        send_on(sim.client, asked)
        wait_until(lambda: [e for e in dispatch.events("progress") if e["seq"] == 2], what="the late seq 2")
        sim.publish(job_id, "completed", exit_code=0)
        assert dispatch.wait(PATIENCE_S) == 0, dispatch.log()
    finally:
        dispatch.kill()
        sim.close()
    assert [e["seq"] for e in dispatch.events()] == [1, 3, 2, 4], dispatch.log()
    assert "refused message: duplicate" in dispatch.log()  # the second copy of seq 2 only
    audit = Registry(hub).audit(job_id)
    assert [line["detail"] for line in audit if line.get("event") == "progress"] == ["beat", "the agent asks"]
    assert [(line["expected"], line["got"]) for line in audit if line.get("event") == "seq_gap"] == [(2, 3)]


def test_fault8_s17_the_hub_clears_the_retained_dispatch_when_it_accepts_started(broker, tmp_path):
    hub = hub_workspace(broker, tmp_path)
    sim = SimRunner(broker, tmp_path / "runner")
    dispatch = WatchProcess([*MAM_ORCH, "dispatch", "--session", "gpu-box", "--brief", "x",
                             "--ack-timeout", ACK_TIMEOUT, "--workspace", str(hub)], hub_env())
    try:
        taken = sim.take(mirror=False)  # a runner that does not clear it (one that crashed just after `started`)
        job_id = taken.dispatch.job_id
        sim.registry.mirror(job_id=job_id, session="gpu-box", attempt_id=1,
                            dispatch_token=taken.dispatch.dispatch_token, auth_token=taken.auth_token,
                            contract=taken.dispatch.contract, origin=taken.dispatch.origin)
        topic = names.dispatch_topic(job_id, broker.topic_root)
        assert retained(broker, topic) is not None
        sim.publish(job_id, "started")
        wait_until(lambda: dispatch.events("started"), what="the hub to accept started")
        wait_until(lambda: retained(broker, topic) is None, what="the hub to clear the retained dispatch")
        sim.publish(job_id, "completed", exit_code=0)
        assert dispatch.wait(PATIENCE_S) == 0, dispatch.log()
    finally:
        dispatch.kill()
        sim.close()
