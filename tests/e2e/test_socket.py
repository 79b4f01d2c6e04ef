"""The runner daemon's local publish socket over real brokers and real processes (PROTOCOL §17).

- An agent's `progress` and `completed` go through `MAM_RUNNER_SOCKET` (exit 0, `"via":
  "runner"`) and reach the hub; the socket is 0600 in a 0700 folder and removed on a clean exit.
- `mam-runner publish` through the socket loads neither typer nor paho nor cryptography.
- A wrong dispatch token is refused with exit 1; without a reachable socket `publish` uses its
  own connection (v1).
- Malformed, oversized and unknown-job requests get one refusal line each; the daemon
  keeps serving; a stale socket file of a dead daemon is replaced.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from harness import runnersim
from harness.jobkit import WatchProcess
from harness.runnersim import MAM_ORCH, MAM_RUNNER, hub_env, hub_workspace, runner_log
from harness.waiting import PATIENCE_S, wait_until
from harness.workspace import clean_env

from mam.runner import localsock
from mam.shared.protocol import names
from mam.shared.store.registry import Registry

pytestmark = [pytest.mark.broker, pytest.mark.e2e, pytest.mark.timeout(4 * PATIENCE_S)]

ACK_TIMEOUT = str(int(PATIENCE_S))
SESSION = "gpu-box"
HEAVY_MODULES = ("typer", "click", "paho", "cryptography", "secrets", "uuid", "hmac")  # the last three: ~5 ms a call
WAIT_FOR_GATE = 'while [ ! -e "$GATE" ]; do sleep 0.05; done'
OTHER_TOKEN = "0123456789abcdef0123456789abcdef"


def start_runner(broker, workspace: Path, **env: str) -> subprocess.Popen:
    """`mam-runner run` for SESSION with the shell agent (harness.runnersim.start_runner)."""
    return runnersim.start_runner(broker, workspace, SESSION, **env)


def stop_cleanly(proc: subprocess.Popen) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    return proc.wait(PATIENCE_S)


def dispatch(hub: Path, brief: str) -> WatchProcess:
    return WatchProcess([*MAM_ORCH, "dispatch", "--session", SESSION, "--brief", brief, "--ack-timeout",
                         ACK_TIMEOUT, "--workspace", str(hub)], hub_env())


def request(path: Path, payload: bytes) -> dict:
    """Send raw bytes to the daemon's socket; its one-line answer."""
    address, fd = localsock.unix_address(path)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(PATIENCE_S)
            sock.connect(address)
            with_reply = sock.makefile("rb")
            try:
                sock.sendall(payload)
            except BrokenPipeError:  # an oversized line: the daemon answered and closed mid-send
                pass
            return json.loads(with_reply.readline())
    finally:
        if fd is not None:
            os.close(fd)


def publish_env(workspace: Path, job_id: str, **extra: str) -> dict[str, str]:
    """The publish environment of the job's agent, read from the runner's record."""
    rec = Registry(workspace).get(job_id)
    env = {"MAM_RUNNER_SOCKET": str(names.runner_socket_path(workspace)),
           "MAM_ATTEMPT_ID": str(rec["attempt_id"]), "MAM_DISPATCH_TOKEN": rec["dispatch_token"]}
    return clean_env(**{**env, **extra})


def test_s17_agent_progress_and_completed_go_through_the_runner_socket(broker, tmp_path):
    """§17 on both brokers: the agent's `progress` and `completed` are answered by the daemon
    (`"via": "runner"`, exit 0) and reach the hub; socket 0600, folder 0700, removed at exit."""
    hub = hub_workspace(broker, tmp_path)
    ws = tmp_path / "runner"
    out = tmp_path / "out"
    runner = start_runner(broker, ws, OUT=str(out))
    brief = ('{ eval "$MAM_PUBLISH_CMD --event progress --detail through-socket"; '
             'eval "$MAM_PUBLISH_CMD --event completed --detail by-the-agent"; '
             'echo "$MAM_RUNNER_SOCKET"; } > "$OUT.tmp"; mv "$OUT.tmp" "$OUT"')
    watch = dispatch(hub, brief)
    try:
        assert watch.wait(PATIENCE_S) == 0, watch.log() + runner_log(ws)
        sock = names.runner_socket_path(ws)
        assert stat.S_IMODE(sock.stat().st_mode) == 0o600 and stat.S_ISSOCK(sock.stat().st_mode)
        assert stat.S_IMODE(sock.parent.stat().st_mode) == 0o700
    finally:
        watch.kill()
        code = stop_cleanly(runner)
    assert code == 0, runner_log(ws)
    lines = out.read_text().splitlines()
    answers = [json.loads(line) for line in lines[:2]]
    assert [a["event"] for a in answers] == ["progress", "completed"] and all(a["via"] == "runner" for a in answers)
    assert lines[2] == str(names.runner_socket_path(ws))
    assert [e["detail"] for e in watch.events("progress")] == ["step 1/1", "through-socket"]  # shell-agent's own
    assert watch.events("completed")[0]["detail"] == "by-the-agent"
    assert Registry(hub).get(answers[0]["job_id"])["status"] == "completed"
    assert not names.runner_socket_path(ws).exists()  # removed on a clean shutdown


def test_s17_socket_publish_refuses_a_wrong_token_loads_no_heavy_module_and_falls_back(nats_broker, tmp_path):
    """§17/§8: through the socket a wrong dispatch token exits 1 with the reason, bad input exits 64
    with typer's message; a good publish
    imports neither typer nor paho nor cryptography (`-X importtime`, both entry points); a
    socket that does not exist falls back to the publisher's own connection (v1)."""
    hub = hub_workspace(nats_broker, tmp_path)
    ws = tmp_path / "runner"
    gate = tmp_path / "gate"
    runner = start_runner(nats_broker, ws, GATE=str(gate))
    watch = dispatch(hub, WAIT_FOR_GATE)
    try:
        job_id = wait_until(lambda: (watch.events("started") or [None])[0], what="started at the hub")["job_id"]
        argv = ["publish", "--job", job_id, "--event", "progress", "--workspace", str(ws)]
        wrong = subprocess.run([*MAM_RUNNER, *argv], env=publish_env(ws, job_id, MAM_DISPATCH_TOKEN=OTHER_TOKEN),
                               capture_output=True, text=True, timeout=PATIENCE_S)
        assert wrong.returncode == 1 and wrong.stderr.startswith("ERROR: refused: "), wrong.stderr
        bad = [*argv[:4], "bogus", *argv[5:], "--data", '{"hmac_sig": 1}']
        usage = [subprocess.run([*MAM_RUNNER, *bad], env=publish_env(ws, job_id, MAM_RUNNER_SOCKET=sock),
                                capture_output=True, text=True, timeout=PATIENCE_S)
                 for sock in (str(names.runner_socket_path(ws)), "")]
        assert [u.returncode for u in usage] == [64, 64] and usage[0].stderr == usage[1].stderr, usage
        timed = subprocess.run([sys.executable, "-X", "importtime", "-m", "mam.runner", *argv,
                                "--detail", "fast"], env=publish_env(ws, job_id), capture_output=True, text=True,
                               timeout=PATIENCE_S)
        assert timed.returncode == 0 and json.loads(timed.stdout)["via"] == "runner", timed.stderr
        loaded = {line.split("|")[-1].strip().split(".")[0] for line in timed.stderr.splitlines() if "|" in line}
        assert not loaded & set(HEAVY_MODULES), sorted(loaded & set(HEAVY_MODULES))
        script = subprocess.run([sys.executable, "-X", "importtime", str(Path(sys.executable).with_name("mam-runner")),
                                 *argv, "--detail", "script"], env=publish_env(ws, job_id), capture_output=True,
                                text=True, timeout=PATIENCE_S)
        assert script.returncode == 0 and json.loads(script.stdout)["via"] == "runner", script.stderr
        loaded = {line.split("|")[-1].strip().split(".")[0] for line in script.stderr.splitlines() if "|" in line}
        assert not loaded & set(HEAVY_MODULES), sorted(loaded & set(HEAVY_MODULES))
        absent = subprocess.run([*MAM_RUNNER, *argv, "--detail", "v1"],
                                env=publish_env(ws, job_id, MAM_RUNNER_SOCKET=str(tmp_path / "none.sock")),
                                capture_output=True, text=True, timeout=PATIENCE_S)
        assert absent.returncode == 0 and "via" not in json.loads(absent.stdout), absent.stderr
        assert json.loads(absent.stdout)["published"] is True
        gate.touch()
        assert watch.wait(PATIENCE_S) == 0, watch.log() + runner_log(ws)
    finally:
        gate.touch()
        watch.kill()
        stop_cleanly(runner)
    ours = [e["detail"] for e in watch.events("progress") if e["detail"] != "step 1/1"]  # not the shell-agent's
    assert ours == ["fast", "script", "v1"]


def test_s17_hostile_requests_are_refused_one_line_each_and_the_daemon_keeps_serving(nats_broker, tmp_path):
    """§17: a stale socket file is replaced at start; malformed JSON, a non-object, unknown fields,
    an unknown job, a bad event and an oversized line each get one refusal;
    the daemon then still runs a job whose agent publishes through the socket."""
    hub = hub_workspace(nats_broker, tmp_path)
    ws = tmp_path / "runner"
    sock_path = names.runner_socket_path(ws)
    sock_path.parent.mkdir(parents=True)
    address, fd = localsock.unix_address(sock_path)
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(address)  # a dead daemon's file: bound, never listening, never removed
    stale.close()
    if fd is not None:
        os.close(fd)
    runner = start_runner(nats_broker, ws)
    try:
        ok = {"job_id": "0badc0de", "attempt_id": 1, "dispatch_token": OTHER_TOKEN, "event": "progress"}
        cases = {
            b"{not json\n": "not one line of UTF-8 JSON",
            b"[1, 2]\n": "must be a JSON object",
            b"\xff\xfe\n": "not one line of UTF-8 JSON",
            json.dumps({**ok, "hmac_sig": "x"}).encode() + b"\n": "unknown request field",
            json.dumps({**ok, "attempt_id": "1"}).encode() + b"\n": "'attempt_id'",
            json.dumps({**ok, "event": "finished"}).encode() + b"\n": "event 'finished' is invalid",
            json.dumps(ok).encode() + b"\n": "not running under this runner",
            b"x" * (localsock.MAX_LINE_BYTES + 1): "longer than",
        }
        for payload, reason in cases.items():
            answer = request(sock_path, payload)
            assert answer["ok"] is False and reason in answer["reason"], (payload[:80], answer)
        out = tmp_path / "out"
        watch = dispatch(hub, f'eval "$MAM_PUBLISH_CMD --event completed --detail still-serving" > {out}')
        try:
            assert watch.wait(PATIENCE_S) == 0, watch.log() + runner_log(ws)
        finally:
            watch.kill()
        assert json.loads(out.read_text())["via"] == "runner"
        assert runner.poll() is None
    finally:
        stop_cleanly(runner)
    assert "replacing the stale socket" in runner_log(ws)


def test_s17_an_agents_terminal_event_through_the_socket_during_an_outage_exits_0_and_reaches_the_hub(
        broker, tmp_path):
    """§17 on both brokers: with the broker down the agent's `completed` through the socket still
    exits 0 (on disk and in the outbox is enough); the daemon sends it once the broker is back."""
    hub = hub_workspace(broker, tmp_path)
    ws = tmp_path / "runner"
    gate, rc_file = tmp_path / "gate", tmp_path / "publish.rc"
    runner = start_runner(broker, ws, GATE=str(gate), RC=str(rc_file))
    brief = (f'{WAIT_FOR_GATE}; {{ eval "$MAM_PUBLISH_CMD --event completed --detail in-the-outage"; '
             'echo $? > "$RC.tmp"; mv "$RC.tmp" "$RC"; } || true')
    watch = WatchProcess([*MAM_ORCH, "dispatch", "--session", SESSION, "--brief", brief, "--heartbeat", "10",
                          "--heartbeat-misses", "12", "--ack-timeout", ACK_TIMEOUT, "--workspace", str(hub)],
                         hub_env())
    try:
        wait_until(lambda: watch.events("started"), what="started at the hub")
        broker.kill()
        gate.touch()
        wait_until(rc_file.exists, what="the agent's publish")
        assert rc_file.read_text().strip() == "0", runner_log(ws)
        broker.restart()
        assert watch.wait(PATIENCE_S) == 0, watch.log() + runner_log(ws)
    finally:
        gate.touch()
        watch.kill()
        stop_cleanly(runner)
    assert watch.events("completed")[0]["detail"] == "in-the-outage"


def test_s17_listener_caps_clients_drops_idle_ones_leaves_a_live_socket_and_cleans_up(tmp_path, monkeypatch):
    """§17, the listener alone (no broker): one client over MAX_CLIENTS and a client that sends no
    line get one refusal line each; a second daemon leaves a live socket alone; `stop()` removes it."""
    monkeypatch.setattr(localsock, "MAX_CLIENTS", 2)
    monkeypatch.setattr(localsock, "CLIENT_IDLE_S", 0.5)  # the idle cap itself, not a wait of the test
    registry = Registry(tmp_path)
    server = localsock.PublishServer(registry, held=lambda job_id: False, send=lambda published: None)
    path = server.start()
    assert path == names.runner_socket_path(tmp_path)
    try:
        assert localsock.PublishServer(registry, held=lambda job_id: False, send=lambda p: None).start() is None
        address, fd = localsock.unix_address(path)
        silent = [socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(3)]
        try:
            for sock in silent:
                sock.settimeout(PATIENCE_S)
                sock.connect(address)
            answers = [json.loads(sock.makefile("rb").readline()) for sock in silent]
        finally:
            for sock in silent:
                sock.close()
            if fd is not None:
                os.close(fd)
        reasons = sorted(a["reason"] for a in answers)
        assert reasons == ["no request line in time"] * 2 + ["too many clients (at most 2)"], reasons
        assert request(path, json.dumps({"job_id": "0badc0de"}).encode() + b"\n")["ok"] is False  # still serving
    finally:
        server.stop()
    assert path.exists() is False
