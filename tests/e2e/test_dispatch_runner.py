"""The real pair: `mam-orch dispatch` and `mam-runner run`, both as processes,
over a real broker (PROTOCOL §5, §6, §7, §10, §11)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from harness.jobkit import WatchProcess
from harness.runnersim import MAM_ORCH, hub_env, hub_workspace, retained
from harness.waiting import PATIENCE_S, wait_until
from harness.workspace import clean_env, write_env_for

from mam.runner import limits
from mam.shared.protocol import names
from mam.shared.store.registry import Registry

pytestmark = [pytest.mark.broker, pytest.mark.e2e]

AGENTS = Path(__file__).resolve().parents[2] / "examples" / "agents"
MAM_RUNNER = [sys.executable, "-m", "mam.runner"]
ACK_TIMEOUT = str(int(PATIENCE_S))  # a real runner process takes the job: as long as a busy machine needs


def start_runner(broker, workspace: Path, agent: str, *args: str) -> subprocess.Popen:
    (workspace / ".git").mkdir(parents=True, exist_ok=True)
    write_env_for(broker, workspace)
    proc = subprocess.Popen([*MAM_RUNNER, "run", "--session", "gpu-box", "--exec", str(AGENTS / agent),
                             "--workspace", str(workspace), *args], env=clean_env(MAM_CANCEL_GRACE_S="1"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
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


@pytest.mark.parametrize("broker_name", ["nats_broker", "mosquitto_broker"])
def test_s11_dispatch_to_a_real_runner_completes(request, broker_name, tmp_path):
    broker = request.getfixturevalue(broker_name)
    hub = hub_workspace(broker, tmp_path)
    runner_ws = tmp_path / "runner"
    runner = start_runner(broker, runner_ws, "shell-agent", "--once")
    try:
        result = subprocess.run([*MAM_ORCH, "dispatch", "--session", "gpu-box", "--require-online",
                                 "--brief", "echo made-by-the-agent > out.txt", "--heartbeat", "1",
                                 "--heartbeat-misses", "10", "--ack-timeout", ACK_TIMEOUT, "--workspace", str(hub)],
                                env=hub_env(), capture_output=True, text=True, timeout=PATIENCE_S)
        assert result.returncode == 0, result.stderr
        assert runner.wait(PATIENCE_S) == 0  # --once: it exits after the job
    finally:
        stop(runner)
    events = [line for line in result.stdout.splitlines() if line.strip()]
    assert '"started"' in events[0] and '"completed"' in events[-1]
    (record,) = Registry(hub).list()[0]
    assert record["status"] == "completed" and record["exit_code"] == 0
    job_id = record["job_id"]
    assert Registry(runner_ws).get(job_id)["status"] == "completed"
    assert (runner_ws / "work" / job_id / "out.txt").read_text() == "made-by-the-agent\n"


def test_s6_cancel_reaches_a_real_runner(nats_broker, tmp_path):
    hub = hub_workspace(nats_broker, tmp_path)
    runner_ws = tmp_path / "runner"
    runner = start_runner(nats_broker, runner_ws, "sleep-agent")
    dispatch = WatchProcess([*MAM_ORCH, "dispatch", "--session", "gpu-box", "--brief", "600", "--heartbeat", "1",
                             "--heartbeat-misses", "10", "--ack-timeout", ACK_TIMEOUT, "--workspace", str(hub)],
                            hub_env())
    try:
        job_id = wait_until(lambda: (dispatch.events("started") or [None])[0], what="started")["job_id"]
        cancel = subprocess.run([*MAM_ORCH, "cancel", job_id, "--workspace", str(hub)], env=hub_env(),
                                capture_output=True, text=True, timeout=PATIENCE_S)
        assert cancel.returncode == 0, cancel.stderr
        assert dispatch.wait(PATIENCE_S) == 4, dispatch.log()
        wait_until(lambda: Registry(runner_ws).get(job_id)["status"] == "cancelled",
                   what="the runner to mark the job cancelled")
    finally:
        dispatch.kill()
        stop(runner)
    assert Registry(hub).get(job_id)["status"] == "cancelled"


def test_s6_a_job_over_its_memory_limit_ends_oom_and_the_runner_serves_on(nats_broker, tmp_path):
    """§6 "Limits": `dispatch --memory 64M --pids 64` to an agent that fills 200 MB: the job
    ends `error`, `oom: ...` (exit 1), `started` says which limits are in force and the
    terminal event what the job used; the runner is unharmed and runs the next job."""
    found, said = limits.detect("probe", v2=None)
    found.close()
    if "memory" not in found.controllers():
        pytest.skip(said)
    hub = hub_workspace(nats_broker, tmp_path)
    runner = start_runner(nats_broker, tmp_path / "runner", "shell-agent")
    common = ["--session", "gpu-box", "--heartbeat", "1", "--heartbeat-misses", "10", "--ack-timeout", ACK_TIMEOUT,
              "--json", "--workspace", str(hub)]
    try:
        greedy = subprocess.run([*MAM_ORCH, "dispatch", "--brief", "python3 -c \"b = b'x' * (200 << 20)\"",
                                 "--memory", "64M", "--pids", "64", *common],
                                env=hub_env(), capture_output=True, text=True, timeout=PATIENCE_S)
        assert greedy.returncode == 1, greedy.stderr
        events = [json.loads(line) for line in greedy.stdout.splitlines() if line.startswith("{")]
        started = next(e for e in events if e.get("event") == "started")
        assert started["data"]["limits"] == {"memory_bytes": 64 << 20, "pids": 64}, started
        terminal = events[-1]
        assert (terminal["event"], terminal["detail"]) == (
            "error", "oom: the job reached its memory limit of 64 MiB; 1 process(es) killed"), terminal
        assert terminal["data"]["oom_kills"] == 1
        assert 0 < terminal["data"]["usage"]["peak_memory_bytes"] <= 64 << 20, terminal["data"]
        fine = subprocess.run([*MAM_ORCH, "dispatch", "--brief", "echo fine", "--memory", "64M", *common],
                              env=hub_env(), capture_output=True, text=True, timeout=PATIENCE_S)
        assert fine.returncode == 0, fine.stderr
        assert runner.poll() is None
        runner.terminate()  # a drain: nothing runs, so it stops at once
        assert runner.wait(PATIENCE_S) == 0
        log = runner.stderr.read()
        assert "limits: memory (cgroup v" in log and "Traceback" not in log
        assert not (found.v1["memory"].parent / f"mam-gpu-box-{runner.pid}").exists()  # its groups went with it
    finally:
        stop(runner)
