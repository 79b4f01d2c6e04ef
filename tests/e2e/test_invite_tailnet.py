"""§16.5 across hosts: the hub and a fresh runner host are network namespaces joined by one
bridge (harness/netns.py, addresses in 100.64.0.0/10). The hub's embedded broker listens on
the hub's tailnet address; `mam-orch runner invite` prints a code there; on the fresh host,
whose workspace is empty, `mam-runner enroll --invite CODE` reaches the broker by the address
the code carries, writes its own `.mam.env` (0600), and `mam-runner run` with no flags takes a
job dispatched on the hub for its enrolled label; `runner revoke` on the hub then makes it
exit with its documented code (77)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from harness.netns import Tailnet, unavailable_reason
from harness.runnersim import AGENTS, MAM_ORCH, MAM_RUNNER, hub_env
from harness.waiting import PATIENCE_S
from harness.workspace import clean_env

from mam.orchestrator.broker import embedded
from mam.shared.config import read_env_file
from mam.shared.protocol.crypto.invite import InviteCode
from mam.shared.protocol.errors import ExitCode

pytestmark = [pytest.mark.broker, pytest.mark.e2e, pytest.mark.timeout(6 * PATIENCE_S)]

SESSION = "fresh-box"


def test_s16_5_a_host_on_the_tailnet_enrols_with_the_code_alone_and_runs_a_hub_job(tmp_path: Path) -> None:
    if (reason := unavailable_reason()) is not None:
        pytest.skip(f"the tailnet invite e2e needs network namespaces: {reason}")
    root, host = tmp_path / "hub", tmp_path / "fresh"
    (root / ".git").mkdir(parents=True)
    host.mkdir()  # nothing: no .mam.env, no keys
    with Tailnet(("hub", "fresh")) as net:
        hub_addr = net.address("hub")
        up = net.run("hub", [*MAM_ORCH, "broker", "up", "--listen", hub_addr, "--workspace", str(root)],
                     env=hub_env(), timeout_s=2 * PATIENCE_S)
        assert up.returncode == 0, up.stderr
        try:
            with open(tmp_path / "invite.stderr", "wb") as err:
                invite = net.spawn("hub", [*MAM_ORCH, "runner", "invite", "--session", SESSION, "--labels", "x",
                                           "--ttl", "2m", "--workspace", str(root)], env=hub_env(),
                                   stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err, text=True)
            assert invite.stdout is not None
            code = invite.stdout.readline().strip()
            assert code.startswith(f"mam1.{SESSION}."), (tmp_path / "invite.stderr").read_text()
            parsed = InviteCode.parse(code)
            assert parsed.broker is not None and hub_addr in parsed.broker.hosts
            done = net.run("fresh", [*MAM_RUNNER, "enroll", "--invite", code, "--workspace", str(host),
                                     "--timeout", str(PATIENCE_S)], env=clean_env(), timeout_s=2 * PATIENCE_S)
            assert done.returncode == 0, done.stderr
            assert invite.wait(PATIENCE_S) == 0, (tmp_path / "invite.stderr").read_text()
            settings = read_env_file(host / ".mam.env")
            assert (settings["MQTT_USERNAME"], settings["MQTT_BROKER"]) == (SESSION, hub_addr)
            assert os.stat(host / ".mam.env").st_mode & 0o777 == 0o600
            with open(tmp_path / "runner.stderr", "wb") as err:
                runner = net.spawn("fresh", [*MAM_RUNNER, "run", "--exec", str(AGENTS / "shell-agent"), "--workspace",
                                    str(host)], env=clean_env(), stdout=subprocess.DEVNULL, stderr=err)
            job = net.run("hub", [*MAM_ORCH, "dispatch", "--labels", "x", "--brief", "echo across-the-tailnet\n",
                                  "--json", "--workspace", str(root)], env=hub_env(), timeout_s=2 * PATIENCE_S)
            assert job.returncode == 0, job.stderr + (tmp_path / "runner.stderr").read_text()
            events = [json.loads(line) for line in job.stdout.splitlines()]
            assert [e["event"] for e in events] == ["started", "progress", "completed"], job.stdout
            assert {e["data"]["session"] for e in events} == {SESSION}
            assert f"dispatched job {events[0]['job_id']} to {SESSION} (attempt 1)" in job.stderr, job.stderr
            revoked = net.run("hub", [*MAM_ORCH, "runner", "revoke", SESSION, "--workspace", str(root)],
                              env=hub_env(), timeout_s=2 * PATIENCE_S)
            assert revoked.returncode == 0, revoked.stderr
            assert runner.wait(PATIENCE_S) == ExitCode.REVOKED, (tmp_path / "runner.stderr").read_text()
            assert f"runner {SESSION} revoked by the hub (key " in (tmp_path / "runner.stderr").read_text()
        finally:
            embedded.down(str(root))
