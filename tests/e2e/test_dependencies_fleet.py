"""Jobs that run after jobs end to end (PROTOCOL §14 "Dependencies"): `dispatch --after`
with a real `mam-orch serve`, a real runner and a real broker. A job after a running one
stays `blocked` (shown, cancellable) and runs once it completed; a job after a failed one
ends `dependency_failed` naming it; bad `--after`/`--if` are one line, exit 64, nothing
registered."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from harness.runnersim import hub_workspace, job_records, orch, start_runner, start_serve
from harness.waiting import PATIENCE_S, wait_until

from mam.shared.protocol import wire
from mam.shared.store.registry import Registry

pytestmark = [pytest.mark.broker, pytest.mark.e2e]



def detach(hub: Path, *args: str) -> dict:
    done = orch(hub, "dispatch", "--session", "gpu-box", "--heartbeat", "1", "--detach", "--json", *args)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.timeout(240)
def test_s14_a_job_after_another_waits_blocked_then_runs_or_fails_naming_it(nats_broker, tmp_path):
    hub = hub_workspace(nats_broker, tmp_path)
    runner = start_runner(nats_broker, tmp_path / "runner", "gpu-box", "--max-jobs", "4")
    serve = start_serve(hub)
    gate = tmp_path / "gate"
    registry = Registry(hub)
    try:
        first = detach(hub, "--brief", f"bash -c 'while [ ! -e {gate} ]; do sleep 0.1; done'")["job_id"]
        after = detach(hub, "--after", first, "--brief", "echo reviewed")
        assert after["action"] == "blocked" and after["status"] == "blocked"
        doomed = detach(hub, "--after", first, "--brief", "echo never")["job_id"]
        wait_until(lambda: registry.get(first)["status"] == "running", PATIENCE_S, "the first job running")
        shown = orch(hub, "show", after["job_id"])
        assert shown.returncode == 0 and "blocked" in shown.stdout, shown.stdout
        assert f"blocked until job {first} (running) ends" in shown.stdout, shown.stdout
        listed = orch(hub, "jobs", "--status", "blocked", "--json")
        assert {row["job_id"] for row in map(json.loads, listed.stdout.splitlines())} == {
            after["job_id"], doomed}, listed.stdout
        cancel = orch(hub, "cancel", doomed)
        assert cancel.returncode == 0 and "cancelled while blocked" in cancel.stderr, cancel.stderr
        gate.touch()
        wait_until(lambda: registry.get(after["job_id"])["status"] == "completed", PATIENCE_S, "the job after it")
        ended = wire.parse_ts(registry.get(first)["updated_at"])
        assert wire.parse_ts(registry.get(after["job_id"])["attempt_created_at"]) >= ended  # published after
        assert registry.get(doomed)["status"] == "cancelled"

        failing = detach(hub, "--brief", "bash -c 'exit 3'")["job_id"]
        follow = orch(hub, "dispatch", "--session", "gpu-box", "--after", failing, "--brief", "echo never")
        assert follow.returncode == 1, follow.stderr  # §9: it ended error
        assert f"dependency_failed (job {failing} ended error (exit 3); --if completed needs it completed)" \
            in follow.stderr, follow.stderr
        lenient = detach(hub, "--after", failing, "--if", "ended", "--brief", "echo anyway")["job_id"]
        wait_until(lambda: registry.get(lenient)["status"] == "completed", PATIENCE_S, "the --if ended job")
    finally:
        for proc in (serve, runner):
            proc.kill()
            proc.wait(PATIENCE_S)


@pytest.mark.timeout(120)
def test_s14_bad_after_and_if_are_one_line_exit_64_and_register_nothing(nats_broker, tmp_path):
    hub = hub_workspace(nats_broker, tmp_path)
    for args, said in ((["--after", "0badf00d"], "no job 0badf00d in this registry"),
                       (["--after", "../../etc"], "--after '../../etc' is invalid"),
                       (["--after", ",".join(["0badf00d"] * 40)], "expected at most 32"),
                       (["--if", "ended"], "--if goes with --after ID"),
                       (["--after", "0badf00d", "--if", "always"], "--if 'always' is invalid")):
        done = orch(hub, "dispatch", "--session", "gpu-box", "--brief", "x", *args)
        assert done.returncode == 64, (args, done.stderr)
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and said in lines[0], (args, done.stderr)
    assert job_records(hub) == []
