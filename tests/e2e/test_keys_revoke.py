"""PROTOCOL §16 revocation over real brokers, real v2 runners and a real hub (the
service `mam-orch serve`, or a lone `mam-orch dispatch` process): two enrolled
runners with label x, a job with `--retries 1` running on one of them (A), then
`mam-orch runner revoke A`. Within `REVOKE_EFFECT_S` the hub closes attempt 1
`runner_lost`; A hears the hub's signed notice (§16.7), stops the agent and exits 77
within `RUNNER_EXIT_S`; attempt 2 goes to the other runner and completes, and the hub
refuses A's presence (`runners` lists A as `revoked` with `--all`)."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import psutil
import pytest
from harness.runnersim import AGENTS, MAM_ORCH, MAM_RUNNER, hub_env, hub_workspace, orch, retained, runner_log
from harness.waiting import PATIENCE_S, wait_until
from harness.workspace import clean_env, write_env_for

from mam.orchestrator.identity import roster
from mam.shared.protocol import names
from mam.shared.protocol.crypto import keys
from mam.shared.protocol.crypto.keys import EnrolRequest
from mam.shared.store import keyfiles
from mam.shared.store.registry import Registry

pytestmark = [pytest.mark.broker, pytest.mark.e2e, pytest.mark.timeout(6 * PATIENCE_S)]

SESSIONS = ("rev-a", "rev-b")
REVOKE_EFFECT_S = 20.0
"""From `runner revoke`'s return to the job closed, at most (s): "at once" (§16.7), far inside
the default idle window (30 s × 4) it would otherwise wait for, with room for a busy machine."""
RUNNER_EXIT_S = 10.0
"""From `runner revoke`'s return to the revoked runner's exit, at most (s): it has heard the
notice by then (the command waits for that), and stops its agent within MAM_CANCEL_GRACE_S."""


def start_enrolled(broker, hub: Path, workspace: Path, session: str) -> subprocess.Popen[bytes]:
    """A v2 runner with label x: its own keys in the roster, the hub's public key trusted, no v1 secret."""
    (workspace / ".git").mkdir(parents=True, exist_ok=True)
    write_env_for(broker, workspace, MAM_DISPATCH_SECRET="")
    made = keyfiles.create_runner_keys(workspace)
    keyfiles.write_trusted_hub_keys(workspace, [keys.public_text(keyfiles.hub_key(hub))])
    roster.add(hub, EnrolRequest.build(session, "x", made.ed25519_public, made.x25519_public))
    with open(workspace.parent / f"{workspace.name}.stderr", "wb") as err:
        proc = subprocess.Popen([*MAM_RUNNER, "run", "--session", session, "--labels", "x", "--exec",
                                 str(AGENTS / "shell-agent"), "--workspace", str(workspace)],
                                env=clean_env(MAM_CANCEL_GRACE_S="1"), stdout=subprocess.DEVNULL, stderr=err)
    topic = names.presence_topic(session, broker.topic_root)
    wait_until(lambda: proc.poll() is not None or b'"online"' in (retained(broker, topic, 0.3) or b""),
               what=f"{session}'s online presence")
    assert proc.poll() is None, runner_log(workspace)
    return proc


def start_service(hub: Path, log_path: Path) -> subprocess.Popen[bytes]:
    with open(log_path, "wb") as err:
        proc = subprocess.Popen([*MAM_ORCH, "serve", "--workspace", str(hub)], env=hub_env(),
                                stdout=subprocess.DEVNULL, stderr=err)
    wait_until(lambda: proc.poll() is not None or "serving" in log_path.read_text(errors="replace"),
               what="the hub service to serve")
    assert proc.poll() is None, log_path.read_text(errors="replace")
    return proc


def agents_of(job_id: str, attempt_id: int) -> list[int]:
    """The processes of one attempt's agent tree: they inherit MAM_JOB_ID and MAM_ATTEMPT_ID (§11.4)."""
    found = []
    for proc in psutil.process_iter():
        try:
            environ = proc.environ()
        except (psutil.Error, OSError):
            continue
        if environ.get("MAM_JOB_ID") == job_id and environ.get("MAM_ATTEMPT_ID") == str(attempt_id):
            found.append(proc.pid)
    return found


@pytest.mark.parametrize("hub_kind", ["serve", "dispatch"])
def test_s16_revoke_mid_job_closes_runner_lost_cancels_and_retries_elsewhere(broker, tmp_path, hub_kind):
    hub = hub_workspace(broker, tmp_path)
    procs = [start_enrolled(broker, hub, tmp_path / session, session) for session in SESSIONS]
    if hub_kind == "serve":
        procs.append(start_service(hub, tmp_path / "serve.stderr"))
    marker = tmp_path / "attempt-1-ran"  # attempt 1 sleeps until cancelled, attempt 2 ends at once
    brief = f"bash -c 'if [ -e {marker} ]; then exit 0; fi; touch {marker}; sleep {2 * PATIENCE_S:.0f}'\n"
    job = subprocess.Popen([*MAM_ORCH, "dispatch", "--labels", "x", "--retries", "1", "--brief", brief, "--json",
                            "--workspace", str(hub)], env=hub_env(), stdin=subprocess.DEVNULL,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    registry = Registry(hub)
    try:
        def running() -> list[dict]:
            found = [registry.get(path.stem) for path in names.jobs_dir(hub).glob("*.json")]
            return [r for r in found if r["status"] == "running" and r["attempt_id"] == 1]
        wait_until(lambda: running() and marker.exists(), what="attempt 1 running")
        (first,) = running()
        job_id, lost = first["job_id"], first["session"]
        assert agents_of(job_id, 1)
        other = next(session for session in SESSIONS if session != lost)
        revoke = orch(hub, "runner", "revoke", lost)
        assert revoke.returncode == 0, revoke.stderr
        revoked_at = time.monotonic()
        assert f"told runner {lost}: it heard and is " in revoke.stdout, revoke.stdout
        wait_until(lambda: registry.get(job_id).get("attempt_history"), what="attempt 1 closed")
        took_s = time.monotonic() - revoked_at
        (history,) = registry.get(job_id)["attempt_history"]
        assert (history["session"], history["close_reason"]) == (lost, "runner_lost")
        assert took_s <= REVOKE_EFFECT_S, f"revocation took {took_s:.1f} s"
        revoked_runner = procs[SESSIONS.index(lost)]
        assert revoked_runner.wait(RUNNER_EXIT_S) == 77, runner_log(tmp_path / lost)
        assert f"runner {lost} revoked by the hub (key " in runner_log(tmp_path / lost)
        assert not agents_of(job_id, 1), "attempt 1's agent outlived its revoked runner"
        _out, err = job.communicate(timeout=2 * PATIENCE_S)
        assert job.returncode == 0, err
        record = registry.get(job_id)
        assert (record["status"], record["attempt_id"], record["session"]) == ("completed", 2, other), err
        listed = orch(hub, "runners", "--json")  # its presence is refused, quietly: a known revocation
        assert "1 revoked runner not shown (--all shows them)" in listed.stderr, listed.stderr
        assert "refused" not in listed.stderr and "incomplete" not in listed.stderr, listed.stderr
        assert [json.loads(line)["session"] for line in listed.stdout.splitlines()] == [other]
        listed = orch(hub, "runners", "--all", "--json")
        rows = {row["session"]: row for row in map(json.loads, listed.stdout.splitlines())}
        assert rows[lost]["status"] == "revoked" and rows[lost]["revoked_at"] and rows[other]["status"] == "online"
    finally:
        if job.poll() is None:
            job.kill()
            job.communicate()
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(PATIENCE_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
