"""Jobs that run after jobs end to end (PROTOCOL §14 "Dependencies"): `dispatch --after`
with a real `mam-orch serve`, a real runner and a real broker. A job after a running one
stays `blocked` (shown, cancellable) and runs once it completed; a job after a failed one
ends `dependency_failed` naming it; bad `--after`/`--if` are one line, exit 64, nothing
registered."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from harness.runnersim import MAM_ORCH, hub_env, hub_workspace, job_records, kill_all, orch, start_runner, start_serve
from harness.waiting import PATIENCE_S, wait_until

from mam.shared.protocol import names, wire
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
        (refused,) = [r["job_id"] for r in registry.list("error")[0] if r.get("after") == [failing]]
        again = orch(hub, "redispatch", refused)  # waits for its dependency again: still failed
        assert again.returncode == 1 and f"dependency_failed (job {failing} ended error" in again.stderr, again.stderr
        assert [e["to"] for e in registry.audit(refused) if e["event"] == "status_changed"][-2:] == [
            "blocked", "error"]
        lenient = detach(hub, "--after", failing, "--if", "ended", "--brief", "echo anyway")["job_id"]
        wait_until(lambda: registry.get(lenient)["status"] == "completed", PATIENCE_S, "the --if ended job")
    finally:
        kill_all(serve, runner)


@pytest.mark.timeout(120)
def test_s14_bad_after_if_group_cron_and_tz_are_one_line_exit_64_and_register_nothing(nats_broker, tmp_path):
    """Bad input for dependencies, groups and schedules, each one line on stderr, exit 64,
    nothing registered: unknown, malformed and too many `--after` ids, `--if` alone or unknown,
    a job that (through a hand-edited record) waits on itself and a cycle A -> B -> A, a group
    name with '/' or a space, a cron expression of 7 fields, an unknown time zone."""
    hub = hub_workspace(nats_broker, tmp_path)
    first = orch(hub, "dispatch", "--session", "nobody", "--brief", "x", "--detach", "--json")
    second = orch(hub, "dispatch", "--session", "nobody", "--brief", "x", "--detach", "--json")
    a, b = (json.loads(done.stdout)["job_id"] for done in (first, second))
    for job_id, after in ((a, [b]), (b, [a])):  # hostile hand edits: A waits on B, B on A
        path = names.jobs_dir(hub) / f"{job_id}.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "after": after}))
    itself = orch(hub, "dispatch", "--session", "nobody", "--brief", "x", "--detach", "--json")
    c = json.loads(itself.stdout)["job_id"]
    path = names.jobs_dir(hub) / f"{c}.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "after": [c]}))
    before = sorted(p.name for p in job_records(hub))
    cases = [
        (["dispatch", "--session", "gpu-box", "--brief", "x", "--after", "0badf00d"], "no job 0badf00d"),
        (["dispatch", "--session", "gpu-box", "--brief", "x", "--after", "../../etc"], "--after '../../etc' is"),
        (["dispatch", "--session", "gpu-box", "--brief", "x", "--after", ",".join(["0badf00d"] * 40)],
         "expected at most 32"),
        (["dispatch", "--session", "gpu-box", "--brief", "x", "--if", "ended"], "--if goes with --after ID"),
        (["dispatch", "--session", "gpu-box", "--brief", "x", "--after", a, "--if", "always"], "--if 'always'"),
        (["dispatch", "--session", "gpu-box", "--brief", "x", "--after", a], f"cycle: {a} -> {b} -> {a}"),
        (["dispatch", "--session", "gpu-box", "--brief", "x", "--after", c], f"cycle: {c} -> {c}"),
        (["dispatch", "--session", "gpu-box", "--brief", "x", "--group", "rel/1"], "--group 'rel/1' is invalid"),
        (["dispatch", "--session", "gpu-box", "--brief", "x", "--group", "rel 1"], "--group 'rel 1' is invalid"),
        (["schedule", "add", "n", "--workspace", str(hub), "--cron", "* * * * * * *", "--", "--session", "gpu-box",
          "--brief", "x"], "--cron '* * * * * * *' is invalid"),
        (["schedule", "add", "n", "--workspace", str(hub), "--cron", "0 3 * * *", "--tz", "Mars/Olympus", "--",
          "--session", "gpu-box", "--brief", "x"], "--tz 'Mars/Olympus' is not a known time zone"),
    ]
    for args, said in cases:
        done = (subprocess.run([*MAM_ORCH, *args], env=hub_env(), capture_output=True, text=True, timeout=PATIENCE_S)
                if args[0] == "schedule" else orch(hub, *args))
        assert done.returncode == 64, (args, done.stderr)
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and said in lines[0], (args, done.stderr)
    assert sorted(p.name for p in job_records(hub)) == before
    assert not (hub / ".mam" / "schedules").exists() or not list((hub / ".mam" / "schedules").iterdir())
