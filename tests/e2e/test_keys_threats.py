"""PROTOCOL §16 threat tests over real brokers: the attacker holds everything runner
A's host holds (its Ed25519 and X25519 keys, the broker password; no v1 secret on
v2 runner hosts). It forges a dispatch for runner B: B, a real `mam-runner run`
with v2 keys, refuses it and runs nothing, while a dispatch the hub signs, sealed
to B, runs (so the refusals are the signature's doing, not a deaf runner). It
publishes presence as B: the hub's `runners` refuses it (logged), and B neither
believes it nor drains. A revoked B's own presence is refused by the hub. A reads
B's dispatch and cannot open its seal; its replay after the hub's cancel is refused."""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from harness.runnersim import AGENTS, MAM_RUNNER, hub_workspace, orch, retained, runner_log
from harness.waiting import PATIENCE_S, wait_until
from harness.workspace import clean_env, write_env_for

from mam.orchestrator.identity import roster
from mam.shared.protocol import crypto, names, wire
from mam.shared.protocol.crypto import keys, pubkey
from mam.shared.protocol.crypto.keys import EnrolRequest
from mam.shared.protocol.errors import SignatureError
from mam.shared.store import keyfiles
from mam.shared.transport import mqtt

pytestmark = [pytest.mark.broker, pytest.mark.e2e, pytest.mark.timeout(4 * PATIENCE_S)]

SESSION_B = "runner-b"


def enrol_b(broker, workspace: Path, hub_public: str) -> keys.RunnerKeys:
    """Runner B's host after enrolment: v2 keys, the hub's public key, and no MAM_DISPATCH_SECRET."""
    (workspace / ".git").mkdir(parents=True, exist_ok=True)
    write_env_for(broker, workspace, MAM_DISPATCH_SECRET="")
    made = keyfiles.create_runner_keys(workspace)
    keyfiles.write_trusted_hub_keys(workspace, [hub_public])
    return made


def start_v2_runner(broker, workspace: Path) -> subprocess.Popen[bytes]:
    """`mam-runner run` for B in its enrolled workspace, once its signed `online` presence is retained."""
    with open(workspace.parent / f"{workspace.name}.stderr", "wb") as err:
        proc = subprocess.Popen([*MAM_RUNNER, "run", "--session", SESSION_B, "--exec", str(AGENTS / "shell-agent"),
                                 "--workspace", str(workspace)], env=clean_env(MAM_CANCEL_GRACE_S="1"),
                                stdout=subprocess.DEVNULL, stderr=err)
    topic = names.presence_topic(SESSION_B, broker.topic_root)
    wait_until(lambda: proc.poll() is not None or b'"online"' in (retained(broker, topic, 0.3) or b""),
               what="runner B's online presence")
    assert proc.poll() is None, runner_log(workspace)
    return proc


def dispatch_for_b(signer: Ed25519PrivateKey, b_x25519: str, job_id: str, brief: str) -> bytes:
    """A v2 dispatch for B, sealed to B's public X25519 key, signed by `signer`."""
    signed = pubkey.build_dispatch(signer, keys.x25519_public(b_x25519), job_id=job_id, session=SESSION_B,
                                   attempt_id=1, dispatch_token=names.new_dispatch_token(),
                                   auth_token=names.new_auth_token(), brief=brief, origin="attacker",
                                   contract=wire.Contract())
    return wire.encode(signed)


def v1_dispatch_for_b(secret: str, job_id: str, brief: str) -> bytes:
    """A v1 dispatch for B, HMAC'd with a key A holds (its broker password as the v1 secret)."""
    derived = crypto.derive_keys(secret.ljust(crypto.MIN_SECRET_CHARS, "x"))
    token = names.new_dispatch_token()
    sealed = crypto.seal(derived.seal_key, job_id=job_id, attempt_id=1, dispatch_token=token,
                         auth_token=names.new_auth_token(), brief=brief)
    dispatch = wire.Dispatch.build(job_id, SESSION_B, 1, token, origin="attacker", contract=wire.Contract(),
                                   sealed=sealed)
    return wire.encode(crypto.sign(dispatch.to_dict(), derived.sign_key))


def test_s16_runner_a_keys_cannot_sign_a_dispatch_b_accepts(broker, tmp_path):
    hub_root = tmp_path / "hub"
    hub_key = keyfiles.hub_key(hub_root)
    b_identity = enrol_b(broker, tmp_path / "runner-b", keys.public_text(hub_key))
    runner_b = start_v2_runner(broker, tmp_path / "runner-b")
    a_keys = keyfiles.create_runner_keys(tmp_path / "runner-a")  # everything runner A's host holds
    forged = {"0000f001": tmp_path / "forged-with-a-ed25519", "0000f002": tmp_path / "forged-with-a-as-hmac",
              "0000f003": tmp_path / "forged-with-b-own-key"}
    legit_job, legit_marker = "0000600d", tmp_path / "hub-signed"
    try:
        with mqtt.MqttClient(broker.config(), "attacker") as attacker:  # A's broker user and password
            root = broker.topic_root
            attacker.publish(names.dispatch_topic("0000f001", root),
                             dispatch_for_b(a_keys.ed25519, b_identity.x25519_public, "0000f001",
                                            f"touch {forged['0000f001']}"), retain=True)
            attacker.publish(names.dispatch_topic("0000f002", root),
                             v1_dispatch_for_b(broker.config().password, "0000f002",
                                               f"touch {forged['0000f002']}"), retain=True)
            # even B's own Ed25519 key (stolen) signs nothing B accepts: runners only verify
            attacker.publish(names.dispatch_topic("0000f003", root),
                             dispatch_for_b(b_identity.ed25519, b_identity.x25519_public, "0000f003",
                                            f"touch {forged['0000f003']}"), retain=True)
            for job_id in forged:
                wait_until(lambda job_id=job_id: f"refused dispatch {job_id}: " in runner_log(tmp_path / "runner-b"),
                           what=f"B's refusal of forged dispatch {job_id}")
            captured = dispatch_for_b(hub_key, b_identity.x25519_public, legit_job, f"touch {legit_marker}")
            attacker.publish(names.dispatch_topic(legit_job, root), captured, retain=True)
            wait_until(legit_marker.exists, what="the hub-signed dispatch to run on B")
            legit_marker.unlink()
            attacker.publish(names.dispatch_topic(legit_job, root), captured, retain=True)  # replayed after the take
            wait_until(lambda: f"refused dispatch {legit_job}: replayed" in runner_log(tmp_path / "runner-b"),
                       what="B's refusal of the replayed dispatch")
    finally:
        runner_b.send_signal(signal.SIGTERM)
        code = runner_b.wait(PATIENCE_S)
    log = runner_log(tmp_path / "runner-b")
    assert code == 0, log
    assert not any(marker.exists() for marker in forged.values()) and not legit_marker.exists(), log
    assert "refused dispatch 0000f001: dispatch sig verify failed" in log
    assert "refused dispatch 0000f002: dispatch is a v1 message" in log
    assert "refused dispatch 0000f003: dispatch sig verify failed" in log
    for kind in ("ed25519", "x25519"):  # B's private keys never reach its log
        assert names.runner_key_path(tmp_path / "runner-b", kind).read_text().strip() not in log


def runners_json(hub: Path) -> subprocess.CompletedProcess[str]:
    return orch(hub, "runners", "--json")


def test_s16_presence_forged_as_b_refused_by_hub_and_b(broker, tmp_path):
    hub = hub_workspace(broker, tmp_path)
    hub_key = keyfiles.hub_key(hub)
    b_ws = tmp_path / "runner-b"
    b_identity = enrol_b(broker, b_ws, keys.public_text(hub_key))
    roster.add(hub, EnrolRequest.build(SESSION_B, "", b_identity.ed25519_public, b_identity.x25519_public))
    runner_b = start_v2_runner(broker, b_ws)
    a_keys = keyfiles.create_runner_keys(tmp_path / "runner-a")
    marker = tmp_path / "ran-after-forgery"
    try:
        listed = runners_json(hub)
        rows = [json.loads(line) for line in listed.stdout.splitlines()]
        assert [(r["session"], r["status"]) for r in rows] == [(SESSION_B, "online")], listed.stderr
        real_runner_id = rows[0]["runner_id"]
        forged = wire.Presence.build(SESSION_B, names.new_runner_id(), "online", host="attacker", version="0.1.0",
                                     max_jobs=1)
        with mqtt.MqttClient(broker.config(), "attacker") as attacker:
            attacker.publish(names.presence_topic(SESSION_B, broker.topic_root),
                             wire.encode(pubkey.sign_presence(forged, a_keys.ed25519)), retain=True)
            # B is not fooled into draining (a v1 runner that sees a takeover presence drains)
            wait_until(lambda: f"refused presence on session {SESSION_B}" in runner_log(b_ws),
                       what="B's refusal of the forged presence")
            listed = runners_json(hub)
            assert "sig does not verify with its enrolled key" in listed.stderr, listed.stderr
            assert "attacker" not in listed.stdout
            attacker.publish(names.dispatch_topic("0000600d", broker.topic_root),
                             dispatch_for_b(hub_key, b_identity.x25519_public, "0000600d", f"touch {marker}"),
                             retain=True)
            wait_until(marker.exists, what="B, not drained, to run a hub-signed dispatch")
        roster.revoke(hub, SESSION_B)  # revoked: the hub refuses B's own presence from now on
        wait_until(lambda: b'"online"' in (retained(broker, names.presence_topic(SESSION_B, broker.topic_root),
                                                    0.3) or b"") and real_runner_id.encode() in
                   (retained(broker, names.presence_topic(SESSION_B, broker.topic_root), 0.3) or b""),
                   what="B's own presence retained again (republished when its job ended)")
        listed = runners_json(hub)
        assert "1 revoked runner not shown" in listed.stderr and listed.stdout == "", listed.stderr
    finally:
        runner_b.send_signal(signal.SIGTERM)
        code = runner_b.wait(PATIENCE_S)
    assert code == 0, runner_log(b_ws)


def test_s16_runner_a_reads_b_dispatch_cannot_open_seal_and_replay_after_cancel_refused(broker, tmp_path):
    """A subscribes to every dispatch: B's seal opens with none of A's keys (no brief, no auth
    token in the clear); after the hub cancelled the job, A's replay of the captured dispatch is refused."""
    hub_root = tmp_path / "hub"
    hub_key = keyfiles.hub_key(hub_root)
    b_ws = tmp_path / "runner-b"
    b_identity = enrol_b(broker, b_ws, keys.public_text(hub_key))
    runner_b = start_v2_runner(broker, b_ws)
    a_keys = keyfiles.create_runner_keys(tmp_path / "runner-a")
    job_id, runs = "0000ca11", tmp_path / "runs"
    brief = f"echo ran >> {runs}\nsleep {4 * PATIENCE_S:.0f}\n"
    root = broker.topic_root
    try:
        with mqtt.MqttClient(broker.config(), "attacker") as attacker, mqtt.MqttClient(broker.config(), "hub") as hub:
            attacker.subscribe([(names.all_dispatches_filter(root), 1)])
            hub.publish(names.dispatch_topic(job_id, root),
                        dispatch_for_b(hub_key, b_identity.x25519_public, job_id, brief), retain=True)
            captured = attacker.messages.get(timeout=PATIENCE_S).payload
            dispatch = wire.decode(captured, "dispatch")
            assert str(runs).encode() not in captured  # the brief is not in the clear
            for private in (a_keys.x25519, X25519PrivateKey.generate()):
                with pytest.raises(SignatureError, match="seal does not open"):
                    pubkey.open_sealed(private, dispatch.sealed, job_id=job_id, attempt_id=1,
                                       dispatch_token=dispatch.dispatch_token)
            wait_until(lambda: runs.exists(), what="B to run the hub's dispatch")
            cancel = pubkey.sign(wire.Control.cancel(job_id, 1, "operator"), hub_key)
            hub.publish(names.control_topic(job_id, root), wire.encode(cancel), retain=True)
            wait_until(lambda: f"cancel of job {job_id} attempt 1" in runner_log(b_ws), what="B to take the cancel")
            attacker.publish(names.dispatch_topic(job_id, root), captured, retain=True)  # replayed after the cancel
            wait_until(lambda: f"refused dispatch {job_id}: " in runner_log(b_ws), what="B's refusal of the replay")
    finally:
        runner_b.send_signal(signal.SIGTERM)
        code = runner_b.wait(PATIENCE_S)
    assert code == 0, runner_log(b_ws)
    assert runs.read_text() == "ran\n", runner_log(b_ws)  # run once, never again
