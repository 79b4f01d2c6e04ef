"""`mam_agent` runs a complete remote job through the SHIPPED broker configs
(deploy/nats/nats.conf, deploy/mosquitto/): hub and runner with their
own workspaces, a real `mam-runner run` and a real `mam-orch dispatch` (§5-§11)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from harness.shipped import Broker, mosquitto_pair, nats_plain, pki  # noqa: F401 - fixtures
from harness.waiting import PATIENCE_S, wait_until
from harness.workspace import clean_env

from mam.shared.config import write_env_file

pytestmark = [pytest.mark.broker, pytest.mark.e2e, pytest.mark.timeout(4 * PATIENCE_S)]

REPO = Path(__file__).resolve().parents[2]
SECRET = "deploy-test-dispatch-secret-0123456789"


@pytest.fixture(params=["nats", "mosquitto"])
def shipped(request) -> Broker:
    if request.param == "nats":
        return request.getfixturevalue("nats_plain")
    return request.getfixturevalue("mosquitto_pair")[0]


def _workspace(path: Path, broker: Broker) -> Path:
    (path / ".git").mkdir(parents=True)
    cfg = broker.config("mam_agent")
    write_env_file(path / ".mam.env", {
        "MQTT_BROKER": cfg.host, "MQTT_PORT": str(cfg.port), "MQTT_USERNAME": cfg.username,
        "MQTT_PASSWORD": cfg.password, "MAM_TOPIC_ROOT": cfg.topic_root, "MQTT_KEEPALIVE": "5",
        "MAM_DISPATCH_SECRET": SECRET})
    return path


def test_agent_user_runs_a_complete_remote_job(shipped: Broker, tmp_path: Path):
    hub = _workspace(tmp_path / "hub", shipped)
    box = _workspace(tmp_path / "box", shipped)
    session = "deploy-" + shipped.kind
    runner = subprocess.Popen([sys.executable, "-m", "mam.runner", "run", "--session", session,
                               "--exec", str(REPO / "examples" / "agents" / "shell-agent"),
                               "--workspace", str(box)],
                              env=clean_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        def online() -> bool:
            probe = subprocess.run([sys.executable, "-m", "mam.orchestrator.cli", "runners", "--json",
                                    "--workspace", str(hub)], env=clean_env(), capture_output=True,
                                   text=True, timeout=PATIENCE_S)
            return any(json.loads(line).get("session") == session and json.loads(line).get("status") == "online"
                       for line in probe.stdout.splitlines() if line.strip())

        wait_until(lambda: runner.poll() is not None or online(), what="the runner to be online")
        assert runner.poll() is None
        result = subprocess.run([sys.executable, "-m", "mam.orchestrator.cli", "dispatch", "--session", session,
                                 "--brief", "echo deployed > out.txt", "--ack-timeout", str(int(PATIENCE_S)), "--json",
                                 "--workspace", str(hub)], env=clean_env(), capture_output=True, text=True,
                                timeout=2 * PATIENCE_S)
        assert result.returncode == 0, result.stderr
        events = [json.loads(line) for line in result.stdout.splitlines()]
        assert events[0]["event"] == "started" and events[-1]["event"] == "completed"
        job_id = events[0]["job_id"]
        assert (box / "work" / job_id / "out.txt").read_text().strip() == "deployed"
    finally:
        runner.terminate()
        try:
            runner.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            runner.kill()
            runner.communicate(timeout=10)
