"""PROTOCOL §16 enrolment by invite over real brokers (nats-server and mosquitto): `mam-orch runner invite`
prints a code and waits, `mam-runner enroll --invite CODE` on a fresh host completes
the exchange (the roster entry on the hub, the hub's key trusted on the runner), and a
v2 dispatch then runs on that runner. A code used twice, a code past its TTL and a
wrong code are refused with one line on both sides; with nobody waiting, the runner
says so after its `--timeout`."""

from __future__ import annotations

import subprocess

import pytest
from harness.invitesim import Invite, enroll, runner_host
from harness.runnersim import AGENTS, MAM_RUNNER, hub_workspace, orch, retained, runner_log
from harness.waiting import PATIENCE_S, wait_until
from harness.workspace import clean_env

from mam.orchestrator.identity import roster
from mam.shared.config import read_env_file
from mam.shared.protocol import names
from mam.shared.protocol.crypto import keys
from mam.shared.protocol.crypto.invite import InviteCode
from mam.shared.store import keyfiles

pytestmark = [pytest.mark.broker, pytest.mark.e2e, pytest.mark.timeout(6 * PATIENCE_S)]

NO_ANSWER_TIMEOUT_S = 1.0
"""The runner's `--timeout` where nobody answers: absence is all it shows, so short is safe (s)."""


def test_s16_invite_enrols_runner_then_v2_dispatch_runs_there(broker, tmp_path):
    hub = hub_workspace(broker, tmp_path)
    # a host that knows its broker credentials and nothing else: the code says where the broker is
    host = runner_host(broker, tmp_path / "gpu-box", MQTT_BROKER="", MQTT_PORT="", MAM_TOPIC_ROOT="")
    waiting = Invite(hub, "gpu-box", "--labels", "x", "--ttl", "2m")
    try:
        done = enroll(host, waiting.code, "--timeout", str(PATIENCE_S))
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith("enrolled as gpu-box (labels: x)"), done.stdout
        assert "MQTT_BROKER, MQTT_PORT, MQTT_TLS, MAM_TOPIC_ROOT set in" in done.stdout, done.stdout
        assert waiting.proc.wait(PATIENCE_S) == 0, waiting.stderr()
    finally:
        waiting.stop()
    cfg = broker.config()
    written = read_env_file(host / ".mam.env")
    assert (written["MQTT_BROKER"], written["MQTT_PORT"], written["MAM_TOPIC_ROOT"]) == (
        cfg.host, str(cfg.port), cfg.topic_root)
    assert "is this host's loopback" in waiting.stderr()  # the test's broker is on 127.0.0.1
    assert "enrolled runner gpu-box (labels: x) by invite" in waiting.stderr()
    entry, made = roster.get(hub, "gpu-box"), keyfiles.load_runner_keys(host)
    assert entry is not None and made is not None and entry.labels == ("x",)
    assert (entry.ed25519_public, entry.x25519_public) == (made.ed25519_public, made.x25519_public)
    assert [keys.public_text(k) for k in keyfiles.trusted_hub_keys(host)] == [keys.public_text(keyfiles.hub_key(hub))]
    for text in (waiting.stderr(), done.stdout, done.stderr):  # the code is shown once, on the hub's stdout
        assert waiting.code not in text
    assert waiting.code not in "".join(p.read_text() for p in names.invites_dir(hub).iterdir())

    with open(tmp_path / "gpu-box.stderr", "wb") as err:
        # no --session, no --labels: the enrolled ones (keys/runner.json) are run's defaults
        runner = subprocess.Popen([*MAM_RUNNER, "run", "--exec", str(AGENTS / "shell-agent"), "--workspace",
                                   str(host)], env=clean_env(),
                                  stdout=subprocess.DEVNULL, stderr=err)
    try:
        topic = names.presence_topic("gpu-box", broker.topic_root)
        wait_until(lambda: runner.poll() is not None or b'"online"' in (retained(broker, topic, 0.3) or b""),
                   what="the invited runner's online presence")
        marker = tmp_path / "ran-on-invited-runner"
        job = orch(hub, "dispatch", "--labels", "x", "--brief", f"touch {marker}\n", "--json",
                   timeout_s=2 * PATIENCE_S)
        assert job.returncode == 0, job.stderr + runner_log(host)
        assert marker.exists()
        assert "v1 (shared secret)" not in job.stderr  # the hub dispatched v2 to the enrolled session
    finally:
        runner.terminate()
        runner.wait(PATIENCE_S)


def test_s16_invite_reused_expired_or_wrong_refused_with_one_line(broker, tmp_path):
    hub = hub_workspace(broker, tmp_path)
    cfg = broker.config()
    flags = ("--hub", cfg.host, "--port", str(cfg.port), "--timeout", str(PATIENCE_S))
    # runner hosts whose .mam.env points at a closed port: --hub/--port take precedence
    hosts = [runner_host(broker, tmp_path / f"host-{n}", MQTT_PORT="1") for n in range(4)]

    expiring = Invite(hub, "short", "--ttl", "1s")
    assert expiring.proc.wait(PATIENCE_S) == 1
    assert expiring.stderr().splitlines()[-1].startswith("invite for short expired at")
    expiring.stop()
    alone = enroll(hosts[0], expiring.code, *flags[:4], "--timeout", str(NO_ANSWER_TIMEOUT_S))
    assert alone.returncode == 1 and "no answer from the hub within 1 s" in alone.stderr, alone.stderr

    first = Invite(hub, "first", "--ttl", "2m")
    assert enroll(hosts[0], first.code, *flags).returncode == 0
    assert first.proc.wait(PATIENCE_S) == 0
    first.stop()

    waiting = Invite(hub, "other", "--ttl", "2m")  # a hub that listens: it refuses the others' codes
    try:
        cases = {"already used": first.code, "expired at": expiring.code,
                 "unknown invite code": InviteCode.new("other").code}
        for n, (why, code) in enumerate(cases.items(), 1):
            refused = enroll(hosts[n], code, *flags)
            assert refused.returncode == 1, refused.stderr
            lines = [line for line in refused.stderr.splitlines() if line.strip()]
            assert len(lines) == 1 and lines[0].startswith("ERROR: the hub refused the invite: ") and why in lines[0]
            wait_until(lambda why=why: why in waiting.stderr(), what=f"the hub's refusal line ({why})")
            assert not keyfiles.trusted_hub_keys(hosts[n])
        refusals = [line for line in waiting.stderr().splitlines() if line.startswith("refused enrolment request")]
        assert len(refusals) == len(cases), waiting.stderr()
        assert waiting.proc.poll() is None  # still waiting for its own runner
        assert roster.get(hub, "other") is None and roster.get(hub, "short") is None
    finally:
        waiting.stop()
    for code in (first.code, expiring.code):
        assert code not in waiting.stderr()
