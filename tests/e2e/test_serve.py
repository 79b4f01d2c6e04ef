"""`mam-orch serve`, the hub service (PROTOCOL §14 "One hub process", §3.2, §10):
one lock per registry, jobs tracked whichever command registered them, restarts,
two hubs sharing one runner, the thin CLI and the Python API, hostile messages.
Real nats-server, real `mam-runner run` and `mam-orch serve` processes."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
from harness.closes import audit_notes, idle_close_reason
from harness.runnersim import (
    AGENTS,
    MAM_ORCH,
    MAM_RUNNER,
    hub_env,
    hub_workspace,
    orch,
    retained,
    runner_log,
    serve_log,
    start_runner,
    start_serve,
)
from harness.waiting import PATIENCE_S, wait_until
from harness.workspace import clean_env, write_env_for

from mam import Hub, Outcome  # the public import path (README "Python API")
from mam.orchestrator.hublock import service_pid
from mam.shared.protocol import names
from mam.shared.store.registry import Registry
from mam.shared.transport import mqtt

pytestmark = [pytest.mark.broker, pytest.mark.e2e, pytest.mark.timeout(180)]

FAST = ["--heartbeat", "1", "--heartbeat-misses", "5", "--ack-timeout", str(int(PATIENCE_S))]




def stop(*procs: subprocess.Popen[bytes]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait(PATIENCE_S)


def status_of(workspace: Path, job_id: str) -> str:
    return Registry(workspace).get(job_id)["status"]


def detach(workspace: Path, session: str, brief: str, *extra: str) -> str:
    target = ["--session", session] if session else []
    result = orch(workspace, "dispatch", *target, "--brief", brief, "--detach", "--json", *FAST, *extra)
    assert result.returncode == 0, result.stderr
    return str(json.loads(result.stdout.splitlines()[-1])["job_id"])


def jobs_status(workspace: Path, job_id: str) -> str:
    result = orch(workspace, "jobs", "--json")
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.strip()]
    return str(next(row["status"] for row in rows if row["job_id"] == job_id))


def test_s14_a_second_serve_exits_64_naming_the_first_pid(nats_broker, tmp_path):
    hub = hub_workspace(nats_broker, tmp_path)
    first = start_serve(hub)
    try:
        assert service_pid(hub) == first.pid
        second = orch(hub, "serve")
        assert second.returncode == 64, second.stderr
        assert f"pid {first.pid}" in second.stderr
        assert first.poll() is None
    finally:
        first.send_signal(signal.SIGTERM)
        assert first.wait(PATIENCE_S) == 0, serve_log(hub)
    assert service_pid(hub) is None  # SIGTERM released the lock


@dataclass
class HeldJob:
    """A hub workspace with its service, a runner on `box-a`, and a detached job there that
    runs until `release()` (`serve` may be replaced by a restart)."""

    hub: Path
    runner: subprocess.Popen[bytes]
    serve: subprocess.Popen[bytes]
    job_id: str
    marker: Path

    def release(self) -> None:
        self.marker.touch()


@contextlib.contextmanager
def held_job(nats_broker, tmp_path: Path) -> Iterator[HeldJob]:
    """`HeldJob` in `tmp_path`; stops the service and the runner on the way out."""
    hub = hub_workspace(nats_broker, tmp_path)
    runner = start_runner(nats_broker, tmp_path / "runner", "box-a")
    held = HeldJob(hub, runner, start_serve(hub), "", tmp_path / "go")
    try:
        held.job_id = detach(hub, "box-a", f"bash -c 'while [ ! -e {held.marker} ]; do sleep 0.1; done'")
        yield held
    finally:
        stop(held.serve, held.runner)


def test_s14_serve_tracks_a_detached_job_running_then_completed(nats_broker, tmp_path):
    with held_job(nats_broker, tmp_path) as held:
        hub, job_id = held.hub, held.job_id
        wait_until(lambda: jobs_status(hub, job_id) == "running", what="running in `jobs` without a watch")
        held.release()
        wait_until(lambda: status_of(hub, job_id) == "completed", what="completed, mirrored by the service")
        assert jobs_status(hub, job_id) == "completed"
    assert "Traceback" not in serve_log(hub), serve_log(hub)


def test_s14_sigterm_leaves_jobs_running_and_the_next_start_picks_them_up(nats_broker, tmp_path):
    with held_job(nats_broker, tmp_path) as held:
        hub, job_id = held.hub, held.job_id
        wait_until(lambda: status_of(hub, job_id) == "running", what="running")
        held.serve.send_signal(signal.SIGTERM)
        assert held.serve.wait(PATIENCE_S) == 0, serve_log(hub)
        assert service_pid(hub) is None
        held.release()  # the job ends while no service runs
        held.serve = start_serve(hub)
        wait_until(lambda: status_of(hub, job_id) == "completed", what="completed after the restart")
    assert runner_log(tmp_path / "runner")  # the runner kept running


HOSTILE = [b"", b"\x00\xff" * 10, b"{", b"[]", b'{"schema_version": 1, "seq": -1}', b"null",
           json.dumps({"event": "started", "job_id": "deadbeef", "seq": 1}).encode(), b"x" * 200_000]


def test_s14_hostile_messages_on_every_subscribed_topic_do_not_kill_serve(nats_broker, tmp_path):
    root = nats_broker.topic_root
    with held_job(nats_broker, tmp_path) as held:
        hub, job_id, serve = held.hub, held.job_id, held.serve
        wait_until(lambda: status_of(hub, job_id) == "running", what="running")
        topics = [names.events_topic(job_id, root), names.state_topic(job_id, root),
                  names.events_topic("0badf00d", root), names.state_topic("0badf00d", root),
                  f"{root}/jobs/not-a-job/events", names.presence_topic("evil", root),
                  names.presence_topic("box-a", root) + "x"]
        with mqtt.MqttClient(nats_broker.config(), "evil") as client:
            client.connect()
            for topic in topics:
                for payload in HOSTILE:
                    client.publish(topic, payload)
        held.release()
        wait_until(lambda: status_of(hub, job_id) == "completed", what="completed despite the noise")
        assert serve.poll() is None, serve_log(hub)
    assert "Traceback" not in serve_log(hub), serve_log(hub)


def test_s14_thin_dispatch_and_watch_follow_through_the_service_without_a_connection(nats_broker, tmp_path):
    hub = hub_workspace(nats_broker, tmp_path)
    runner = start_runner(nats_broker, tmp_path / "runner", "box-a")
    serve = start_serve(hub)
    no_broker = hub_env(MQTT_PORT="1")  # a connection of its own would fail: only the service's works
    try:
        ok = orch(hub, "dispatch", "--session", "box-a", "--brief", "echo thin", *FAST, env=no_broker)
        assert ok.returncode == 0, ok.stderr + serve_log(hub)
        events = [json.loads(line)["event"] for line in ok.stdout.splitlines()]
        assert events[0] == "started" and events[-1] == "completed", ok.stdout
        assert "dispatched job" in ok.stderr
        failed = orch(hub, "dispatch", "--session", "box-a", "--brief", "exit 7", *FAST, env=no_broker)
        assert failed.returncode == 1, failed.stderr
        assert json.loads(failed.stdout.splitlines()[-1])["event"] == "error"
        job_id = detach(hub, "box-a", "sleep 1")
        watched = orch(hub, "watch", job_id, env=no_broker)
        assert watched.returncode == 0, watched.stderr
        assert json.loads(watched.stdout.splitlines()[-1])["event"] == "completed"
        # ended already: the same JSON lines and exit code, read from the hub's audit log
        assert orch(hub, "watch", job_id, env=no_broker).stdout == watched.stdout
        failed_id = json.loads(failed.stdout.splitlines()[-1])["job_id"]
        again = orch(hub, "watch", failed_id, env=no_broker)
        assert again.returncode == 1 and again.stdout == failed.stdout, again.stderr
    finally:
        stop(serve, runner)


def test_s14_the_python_api_dispatches_waits_and_streams_events(nats_broker, tmp_path, monkeypatch):
    hub_ws = hub_workspace(nats_broker, tmp_path)
    for key in [k for k in os.environ if k.startswith(("MQTT_", "MAM_"))]:
        monkeypatch.delenv(key)
    runner = start_runner(nats_broker, tmp_path / "runner", "box-a", MAM_RUNNER_LABELS="gpu,x")
    try:
        with Hub(workspace=hub_ws) as hub:  # no `mam-orch serve`: the Hub runs the service in a thread
            job = hub.dispatch("echo from-the-api", labels=["gpu"], heartbeat_s=1, heartbeat_misses=5)
            assert service_pid(hub_ws) == os.getpid()
            events = [event["event"] for event in job.events(timeout_s=PATIENCE_S)]
            assert events[0] == "started" and events[-1] == "completed", events
            outcome = job.wait(timeout_s=PATIENCE_S)
            assert outcome == Outcome(status="completed", exit_code=0, close_reason=None, detail="",
                                      agent_exit_code=0)
            failing = hub.dispatch("exit 3", session="box-a", heartbeat_s=1, heartbeat_misses=5)
            assert failing.wait(timeout_s=PATIENCE_S).exit_code == 1
            assert [row["session"] for row in hub.runners()] == ["box-a"]
            assert hub.cancel(job.id) == "completed"  # ended: left alone
        assert service_pid(hub_ws) is None  # close() stopped the embedded service
    finally:
        stop(runner)


def start_runner_slots(broker, workspace: Path, session: str, max_jobs: int, *args: str) -> subprocess.Popen[bytes]:
    """`mam-runner run --max-jobs N` with the shell agent, once its online presence is retained."""
    (workspace / ".git").mkdir(parents=True, exist_ok=True)
    write_env_for(broker, workspace)
    with open(workspace.parent / f"{workspace.name}.stderr", "wb") as err:
        proc = subprocess.Popen([*MAM_RUNNER, "run", "--session", session, "--exec", str(AGENTS / "shell-agent"),
                                 "--max-jobs", str(max_jobs), "--workspace", str(workspace), *args],
                                env=clean_env(MAM_CANCEL_GRACE_S="1"), stdout=subprocess.DEVNULL, stderr=err)
    topic = names.presence_topic(session, broker.topic_root)
    wait_until(lambda: proc.poll() is not None or b'"online"' in (retained(broker, topic, 0.3) or b""),
               what="the runner's online presence")
    assert proc.poll() is None, runner_log(workspace)
    return proc


def gated(tmp_path: Path, n: int) -> str:
    """A brief that runs until the file `<tmp_path>/go-<n>` exists."""
    return f"bash -c 'while [ ! -e {tmp_path}/go-{n} ]; do sleep 0.1; done'"


def test_s14_serve_killed_while_10_jobs_run_restarted_all_end_correctly(nats_broker, tmp_path):
    hub = hub_workspace(nats_broker, tmp_path)
    runner = start_runner_slots(nats_broker, tmp_path / "runner", "box-a", 10)
    serve = start_serve(hub)
    try:
        jobs = [detach(hub, "box-a", gated(tmp_path, n)) for n in range(10)]
        wait_until(lambda: all(status_of(hub, job) == "running" for job in jobs), what="10 jobs running")
        serve.kill()  # SIGKILL: no clean stop, the kernel drops the lock
        serve.wait(PATIENCE_S)
        for n in range(5):  # half of them end while no service runs
            (tmp_path / f"go-{n}").touch()
        runner_registry = Registry(tmp_path / "runner")
        wait_until(lambda: all(runner_registry.get(job)["status"] == "completed" for job in jobs[:5]),
                   what="5 jobs completed on the runner")
        assert all(status_of(hub, job) == "running" for job in jobs)  # nobody mirrored them yet
        leftovers = [Registry(hub).record_path(jobs[0]).with_name(f".{jobs[0]}.json.k3x9qz1a.tmp"),
                     names.job_logs_dir(hub, jobs[0]) / ".status.json.k3x9qz1a.tmp"]
        for leftover in leftovers:
            leftover.write_bytes(b'{"status": "compl')  # what a pass killed before its renames leaves
        serve = start_serve(hub)
        wait_until(lambda: not any(path.exists() for path in leftovers), what="the killed pass's temp files removed")
        for n in range(5, 10):
            (tmp_path / f"go-{n}").touch()
        wait_until(lambda: all(status_of(hub, job) == "completed" for job in jobs), what="all 10 completed")
    finally:
        stop(serve, runner)
    assert "Traceback" not in serve_log(hub), serve_log(hub)


def test_s14_two_hubs_share_one_runner_each_completes_never_above_max_jobs(nats_broker, tmp_path):
    hubs = [hub_workspace(nats_broker, tmp_path / name) for name in ("one", "two")]
    runner = start_runner_slots(nats_broker, tmp_path / "runner", "box-a", 2)
    services = [start_serve(hub) for hub in hubs]
    seen_running: list[int] = []
    topic = names.presence_topic("box-a", nats_broker.topic_root)
    with mqtt.MqttClient(nats_broker.config(), "presence-tap") as tap:
        tap.connect()
        tap.subscribe([(topic, 1)])
        try:
            jobs = [(hub, detach(hub, "box-a", "sleep 1")) for hub in hubs for _ in range(3)]

            def all_done() -> bool:
                while not tap.messages.empty():
                    payload = tap.messages.get_nowait().payload
                    if payload:
                        seen_running.append(len(json.loads(payload)["running"]))
                return all(status_of(hub, job) == "completed" for hub, job in jobs)

            wait_until(all_done, what="the 6 jobs of both hubs completed")
        finally:
            stop(*services, runner)
    assert seen_running and max(seen_running) <= 2, seen_running
    assert max(seen_running) == 2  # it was full at some point: the test exercised the limit


def test_s14_serve_retries_a_job_whose_runner_died_on_another_matching_runner(nats_broker, tmp_path):
    hub = hub_workspace(nats_broker, tmp_path)
    first = start_runner_slots(nats_broker, tmp_path / "box-a", "box-a", 1, "--labels", "x")
    serve = start_serve(hub)
    second = None
    try:
        job_id = detach(hub, "", gated(tmp_path, 0), "--labels", "x", "--retries", "1")
        wait_until(lambda: status_of(hub, job_id) == "running", what="attempt 1 running")
        assert Registry(hub).get(job_id)["session"] == "box-a"
        second = start_runner_slots(nats_broker, tmp_path / "box-b", "box-b", 1, "--labels", "x")
        host = [first, *psutil.Process(first.pid).children(recursive=True)]
        for proc in host:  # the whole host dies: runner and agent, no goodbye (the broker sends the Last Will)
            with contextlib.suppress(psutil.NoSuchProcess):  # a short-lived child may have ended already
                proc.kill()
        wait_until(lambda: Registry(hub).get(job_id)["attempt_id"] == 2 and status_of(hub, job_id) == "running",
                   what="attempt 2 running elsewhere")
        record = Registry(hub).get(job_id)
        assert record["session"] == "box-b"
        reason = idle_close_reason(audit_notes(Registry(hub), job_id), "box-a", job_id)  # unless its Will came late
        assert record["attempt_history"][0]["close_reason"] == reason, record["attempt_history"]
        (tmp_path / "go-0").touch()
        wait_until(lambda: status_of(hub, job_id) == "completed", what="attempt 2 completed")
    finally:
        stop(serve, first, *([second] if second else []))
    assert "Traceback" not in serve_log(hub), serve_log(hub)


def test_s14_a_job_queued_elsewhere_wakes_the_service_not_its_next_scan(nats_broker, tmp_path):
    """The service scans the registry only every 60 s here (MAM_HUB_SCAN_S): a job queued by a
    `dispatch` process is still published at once, because the dispatch wakes it (§14)."""
    hub = hub_workspace(nats_broker, tmp_path)
    runner = start_runner(nats_broker, tmp_path / "gpu", "gpu-box")
    log_path = tmp_path / "serve.stderr"
    with open(log_path, "wb") as err:
        server = subprocess.Popen([*MAM_ORCH, "serve", "--workspace", str(hub)], env=hub_env(MAM_HUB_SCAN_S="60"),
                                  stdout=subprocess.DEVNULL, stderr=err)
    try:
        wait_until(lambda: server.poll() is not None or b"hub service pid" in log_path.read_bytes(),
                   what="the service serving")
        assert server.poll() is None, log_path.read_text(errors="replace")
        sent = orch(hub, "dispatch", "--session", "gpu-box", "--detach", "--json", "--brief", "true\n")
        assert sent.returncode == 0, sent.stderr
        job_id = json.loads(sent.stdout)["job_id"]
        # far inside the 60 s scan: only the wake can have published it
        wait_until(lambda: Registry(hub).get(job_id)["status"] == "completed", timeout_s=30.0,
                   what="the job published by the woken service and completed")
    finally:
        server.terminate()
        server.wait(PATIENCE_S)
        runner.terminate()
        runner.wait(PATIENCE_S)
