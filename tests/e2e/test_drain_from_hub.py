"""`mam-orch runner drain|undrain` (PROTOCOL §7 "Drain from the hub") over real brokers, a real
runner and a real hub service: a drained runner finishes the job it runs, takes no new one (it
stays queued, saying why), stays drained across its own restart (the order is retained), and
takes the queued job once undrained."""

from __future__ import annotations

import json
import subprocess

import pytest
from harness.runnersim import MAM_ORCH, hub_env, hub_workspace, orch, retained, runner_log, start_runner
from harness.waiting import PATIENCE_S, wait_until

from mam.shared.protocol import names
from mam.shared.store.registry import Registry

pytestmark = [pytest.mark.broker, pytest.mark.e2e, pytest.mark.timeout(4 * PATIENCE_S)]


def presence_status(broker, session: str) -> str | None:
    payload = retained(broker, names.presence_topic(session, broker.topic_root), 0.3)
    return json.loads(payload)["status"] if payload else None


def test_s7_drain_finishes_the_running_job_holds_new_ones_across_a_restart_then_undrain(broker, tmp_path):
    hub = hub_workspace(broker, tmp_path)
    workspace = tmp_path / "runner"
    runner = start_runner(broker, workspace, "gpu-box")
    log_path = tmp_path / "serve.stderr"
    with open(log_path, "wb") as err:
        serve = subprocess.Popen([*MAM_ORCH, "serve", "--workspace", str(hub)], env=hub_env(),
                                 stdout=subprocess.DEVNULL, stderr=err)
    gate = tmp_path / "go"
    try:  # serving before the first dispatch, or that dispatch's own engine holds the hub lock
        wait_until(lambda: serve.poll() is not None or b"hub service pid" in log_path.read_bytes(),
                   what="the service serving")
        assert serve.poll() is None, log_path.read_text(errors="replace")
        first = orch(hub, "dispatch", "--session", "gpu-box", "--detach", "--json", "--brief",
                     f"while [ ! -e {gate} ]; do sleep 0.1; done\n")
        assert first.returncode == 0, first.stderr
        running_id = json.loads(first.stdout)["job_id"]
        wait_until(lambda: Registry(hub).get(running_id)["status"] == "running", what="the first job running")

        drained = orch(hub, "runner", "drain", "gpu-box", "--reason", "disk full")
        assert drained.returncode == 0, drained.stderr
        assert "runner gpu-box drained" in drained.stdout
        wait_until(lambda: presence_status(broker, "gpu-box") == "draining", what="the runner draining")
        second = orch(hub, "dispatch", "--session", "gpu-box", "--detach", "--json", "--brief", "true\n")
        waiting_id = json.loads(second.stdout)["job_id"]
        gate.touch()  # the running job goes on and completes
        wait_until(lambda: Registry(hub).get(running_id)["status"] == "completed", what="the first job completed")
        assert Registry(hub).get(waiting_id)["status"] == "queued"
        assert runner.poll() is None, runner_log(workspace)  # a drain is no stop

        runner.terminate()
        assert runner.wait(PATIENCE_S) == 0
        runner = start_runner(broker, workspace, "gpu-box", wait_online=False)
        wait_until(lambda: "drained by the hub at" in runner_log(workspace), what="the restarted runner drained")
        assert presence_status(broker, "gpu-box") == "draining" and Registry(hub).get(waiting_id)["status"] == "queued"

        undrained = orch(hub, "runner", "undrain", "gpu-box")
        assert undrained.returncode == 0, undrained.stderr
        wait_until(lambda: Registry(hub).get(waiting_id)["status"] == "completed", what="the held job completed")
        assert "disk full" in runner_log(workspace) and "undrained by the hub" in runner_log(workspace)
    finally:
        gate.touch()
        serve.terminate()
        serve.wait(PATIENCE_S)
        runner.terminate()
        runner.wait(PATIENCE_S)
