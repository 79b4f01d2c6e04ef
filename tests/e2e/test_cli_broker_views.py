"""Over a real broker (each of nats and mosquitto): `runners` hides
offline sessions last seen over 7 days ago (`--all` shows them) and `runners prune`
clears their retained presence, refusing an online one (PROTOCOL §7); `broker
status` and `config --check` connect to a configured broker this hub did not start
(§13) and say what answered."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest
from harness.runnersim import SimRunner, hub_workspace, orch, retained
from harness.waiting import PATIENCE_S

from mam.shared.protocol import names

pytestmark = [pytest.mark.broker, pytest.mark.timeout(120)]
LONG_GONE = timedelta(days=8)  # past OFFLINE_HIDDEN_DAYS


@pytest.fixture
def sim(broker, tmp_path):
    runner = SimRunner(broker, tmp_path / "runner")
    runner.broker = broker
    yield runner
    runner.close()


def sessions_of(result):
    assert result.returncode == 0, result.stderr
    return [json.loads(line)["session"] for line in result.stdout.splitlines()]


def test_s7_runners_hide_long_offline_and_prune_clears_them_not_online_ones(sim, tmp_path):
    hub = hub_workspace(sim.broker, tmp_path)
    sim.presence("online")
    sim.presence("offline", session="recent-box")
    sim.presence("offline", session="gone-box", timestamp=datetime.now(UTC) - LONG_GONE)
    listed = orch(hub, "runners", "--json")
    assert sessions_of(listed) == ["gpu-box", "recent-box"]
    assert "1 offline runner last seen more than 7 days ago not shown" in listed.stderr
    assert sessions_of(orch(hub, "runners", "--all", "--json")) == ["gone-box", "gpu-box", "recent-box"]
    refused = orch(hub, "runners", "prune", "gpu-box")
    assert refused.returncode == 1 and "runner gpu-box is online" in refused.stderr
    pruned = orch(hub, "runners", "prune", "--json")
    assert pruned.returncode == 0, pruned.stderr
    assert [json.loads(line)["session"] for line in pruned.stdout.splitlines()] == ["gone-box"]
    assert retained(sim.broker, names.presence_topic("gone-box", sim.root)) is None
    assert sessions_of(orch(hub, "runners", "--all", "--json")) == ["gpu-box", "recent-box"]


def test_s13_broker_status_and_config_check_ask_the_configured_broker(sim, tmp_path):
    hub = hub_workspace(sim.broker, tmp_path)
    status = orch(hub, "broker", "status", "--json")
    assert status.returncode == 0, status.stderr
    info = json.loads(status.stdout)
    assert info["running"] is False and info["embedded"] is False and info["healthy"] is True
    assert [(h["reachable"], h["auth_ok"], h["protocol"]) for h in info["hosts"]] == [(True, True, "MQTT 3.1.1")]
    check = orch(hub, "config", "--check", "--json")
    assert check.returncode == 0 and json.loads(check.stdout)["check"]["healthy"] is True, check.stderr
    wrong = hub_workspace(sim.broker, tmp_path / "wrong", MQTT_PASSWORD="not-the-password")
    refused = orch(wrong, "config", "--check", "--json", timeout_s=PATIENCE_S)
    row = json.loads(refused.stdout)["check"]["hosts"][0]
    assert refused.returncode == 3 and row["reachable"] is True and row["auth_ok"] is False
    assert "not-the-password" not in refused.stdout + refused.stderr
