"""Schedules end to end (PROTOCOL §14 Schedules): `mam-orch schedule add`, a real `mam-orch
serve` firing ticks to a real runner over a real broker; the hub stopped across ticks catches
up once at its start; `--overlap skip` skips a tick while the last job runs, and says so.
Cron expressions with seconds (6 fields, seconds last) keep the ticks seconds apart."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest
from harness.runnersim import MAM_ORCH, hub_env, hub_workspace, job_records, kill_all, orch, start_runner, start_serve
from harness.waiting import PATIENCE_S, wait_until

from mam.shared.protocol import wire
from mam.shared.store.registry import Registry

pytestmark = [pytest.mark.broker, pytest.mark.e2e]

OUTAGE_S = 20.0
"""How long the hub stays down: more than LATE_S (15 s), so the ticks meanwhile are missed ones."""



def add_schedule(hub: Path, name: str, *args: str) -> dict:
    done = subprocess.run([*MAM_ORCH, "schedule", "add", name, "--workspace", str(hub), "--json", *args],
                          env=hub_env(), capture_output=True, text=True, timeout=PATIENCE_S)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def fired(hub: Path, name: str) -> list[dict]:
    registry = Registry(hub)
    records = [registry.get(path.stem) for path in job_records(hub)]
    return sorted((r for r in records if (r.get("schedule") or {}).get("name") == name),
                  key=lambda r: r["schedule"]["tick"])


@pytest.mark.timeout(240)
def test_s14_a_schedule_fires_on_its_ticks_and_catches_up_once_after_the_hub_was_down(nats_broker, tmp_path):
    hub = hub_workspace(nats_broker, tmp_path)
    runner = start_runner(nats_broker, tmp_path / "runner", "gpu-box", "--max-jobs", "4")
    serve = start_serve(hub)
    try:
        shown = add_schedule(hub, "often", "--cron", "* * * * * */3", "--overlap", "queue", "--",
                             "--session", "gpu-box", "--brief", "echo scheduled", "--heartbeat", "1")
        assert shown["next_fire"] is not None and shown["target"] == "session=gpu-box"
        wait_until(lambda: sum(r["status"] == "completed" for r in fired(hub, "often")) >= 2, PATIENCE_S,
                   "two ticks run to completion")
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(PATIENCE_S) == 0
        down_at = datetime.now(UTC)
        before = {r["job_id"] for r in fired(hub, "often")}
        time.sleep(OUTAGE_S)  # the scenario itself: the hub stays down across several ticks
        serve = start_serve(hub)
        wait_until(lambda: any(r["job_id"] not in before and not r["schedule"]["catch_up"]
                               for r in fired(hub, "often")), PATIENCE_S, "a tick on time after the restart")
        after = [r for r in fired(hub, "often") if r["job_id"] not in before]
        caught_up = [r for r in after if r["schedule"]["catch_up"]]
        assert len(caught_up) == 1, [r["schedule"] for r in after]  # --catch-up 1: the latest missed tick only
        assert wire.parse_ts(caught_up[0]["schedule"]["tick"]) > down_at
        ticks = [r["schedule"]["tick"] for r in fired(hub, "often")]
        assert len(ticks) == len(set(ticks))  # no tick fired twice
        wait_until(lambda: all(r["status"] == "completed" for r in fired(hub, "often")[:len(before) + 2]),
                   PATIENCE_S, "the jobs after the restart to complete")
        listed = orch(hub, "schedule", "list", "--json")
        assert listed.returncode == 0 and json.loads(listed.stdout)["last_job"] is not None
    finally:
        kill_all(serve, runner)


@pytest.mark.timeout(240)
def test_s14_overlap_skip_skips_a_tick_while_the_last_job_runs_and_says_so(nats_broker, tmp_path):
    hub = hub_workspace(nats_broker, tmp_path)
    runner = start_runner(nats_broker, tmp_path / "runner", "gpu-box", "--max-jobs", "4")
    serve = start_serve(hub)
    gate = tmp_path / "gate"
    try:
        add_schedule(hub, "slow", "--cron", "* * * * * */2", "--", "--session", "gpu-box", "--heartbeat", "1",
                     "--brief", f"bash -c 'while [ ! -e {gate} ]; do sleep 0.1; done'")
        wait_until(lambda: fired(hub, "slow") and fired(hub, "slow")[0]["status"] == "running", PATIENCE_S,
                   "the first job running")

        def show() -> dict:
            return json.loads(orch(hub, "schedule", "show", "slow", "--json").stdout)

        skipped = wait_until(lambda: show()["last_skipped"], PATIENCE_S, "a skipped tick")
        assert f"job {fired(hub, 'slow')[0]['job_id']} still running" in skipped
        assert len(fired(hub, "slow")) == 1
        assert "skipped: its job" in (tmp_path / "serve.stderr").read_text()
        paused = orch(hub, "schedule", "pause", "slow")
        assert paused.returncode == 0, paused.stderr
        gate.touch()
        wait_until(lambda: fired(hub, "slow")[0]["status"] == "completed", PATIENCE_S, "the first job to end")
        now = orch(hub, "schedule", "run-now", "slow")
        assert now.returncode == 0, now.stderr
        job_id = json.loads(now.stdout)["job_id"]
        wait_until(lambda: Registry(hub).get(job_id)["status"] == "completed", PATIENCE_S, "the run-now job")
        assert len(fired(hub, "slow")) == 2  # paused: no tick fired meanwhile
    finally:
        kill_all(serve, runner)


@pytest.mark.timeout(300)
def test_s14_a_hub_killed_right_after_ticks_never_fires_a_tick_twice_nor_loses_its_job(nats_broker, tmp_path):
    """§14 Schedules across hub crashes: a schedule firing every second; `serve` is SIGKILLed
    as soon as a tick fired (a job registered, maybe not yet published) and started again,
    four times. No tick fires twice, and every fired job still runs to completion."""
    hub = hub_workspace(nats_broker, tmp_path)
    runner = start_runner(nats_broker, tmp_path / "runner", "gpu-box", "--max-jobs", "4")
    serve = start_serve(hub)
    try:
        add_schedule(hub, "every", "--cron", "* * * * * *", "--overlap", "queue", "--", "--session", "gpu-box",
                     "--brief", "true", "--heartbeat", "1")
        for _ in range(4):
            seen = len(fired(hub, "every"))
            wait_until(lambda: len(fired(hub, "every")) > seen, PATIENCE_S, "a tick to fire")
            serve.kill()
            serve.wait(PATIENCE_S)
            serve = start_serve(hub)
        seen = len(fired(hub, "every"))
        wait_until(lambda: len(fired(hub, "every")) > seen, PATIENCE_S, "a tick after the last restart")
        removed = orch(hub, "schedule", "remove", "every")
        assert removed.returncode == 0, removed.stderr
        ticks = [r["schedule"]["tick"] for r in fired(hub, "every")]
        assert len(ticks) == len(set(ticks)), ticks
        wait_until(lambda: all(r["status"] == "completed" for r in fired(hub, "every")), PATIENCE_S,
                   "every fired job to complete")
    finally:
        kill_all(serve, runner)
