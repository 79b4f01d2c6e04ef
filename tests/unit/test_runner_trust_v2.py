"""PROTOCOL §16 on the runner, without a broker: a v2 runner takes only dispatches and
cancels signed by the hub's Ed25519 keys and sealed to its own X25519 key, refuses
v1 unless MAM_ACCEPT_V1=true, signs its presence with its own key, and loads its keys."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from mam.runner import admission, trust
from mam.runner.admission import Refuse, RefuseReason, RunnerState, Take, Tombstones
from mam.runner.presence import Presence
from mam.runner.trust import V1Trust, V2Trust
from mam.shared.protocol import crypto, names, wire
from mam.shared.protocol.crypto import keys, pubkey
from mam.shared.protocol.crypto.keys import RunnerKeys
from mam.shared.protocol.errors import ConfigError, SignatureError
from mam.shared.store import keyfiles

pytestmark = pytest.mark.timeout(60)

SESSION = "gpu-box"
JOB = "918b0612"
HUB = Ed25519PrivateKey.generate()
V1 = crypto.derive_keys("unit-test-dispatch-secret-0123456789abcdef")
RUNNER_A = RunnerKeys(Ed25519PrivateKey.generate(), X25519PrivateKey.generate())
RUNNER_B = RunnerKeys(Ed25519PrivateKey.generate(), X25519PrivateKey.generate())
B_TRUST = V2Trust(runner=RUNNER_B, hub_keys=(HUB.public_key(),))


def v2_dispatch(*, signer: Ed25519PrivateKey = HUB, sealed_to: RunnerKeys = RUNNER_B, session: str = SESSION,
                attempt_id: int = 1, auth_token: str = "auth-token", brief: str = "do it") -> bytes:
    signed = pubkey.build_dispatch(signer, sealed_to.x25519.public_key(), job_id=JOB, session=session,
                                   attempt_id=attempt_id, dispatch_token=names.new_dispatch_token(),
                                   auth_token=auth_token, brief=brief, origin="hub", contract=wire.Contract())
    return wire.encode(signed)


def v1_dispatch() -> bytes:
    token = names.new_dispatch_token()
    sealed = crypto.seal(V1.seal_key, job_id=JOB, attempt_id=1, dispatch_token=token, auth_token="a", brief="b")
    dispatch = wire.Dispatch.build(JOB, SESSION, 1, token, origin="hub", contract=wire.Contract(), sealed=sealed)
    return wire.encode(crypto.sign(dispatch.to_dict(), V1.sign_key))


def state(**changes: Any) -> RunnerState:
    base = RunnerState(session=SESSION, trust=B_TRUST, clock_skew_s=30.0, record_of={}.get,
                       root=Path("/srv/runner"), busy=frozenset(), max_jobs=1, accepting=True, tombstones=Tombstones())
    return dataclasses.replace(base, **changes)


def refused(verdict: admission.Verdict, reason: RefuseReason) -> Refuse:
    assert isinstance(verdict, Refuse), verdict
    assert verdict.reason is reason
    return verdict


def test_s16_v2_runner_takes_a_hub_signed_dispatch_sealed_to_it():
    verdict = admission.admit_dispatch(JOB, v2_dispatch(auth_token="tok-b", brief="brief b"), state())
    assert isinstance(verdict, Take) and (verdict.auth_token, verdict.brief) == ("tok-b", "brief b")


def test_s16_dispatch_signed_with_runner_a_keys_refused_by_b():
    for signer in (RUNNER_A.ed25519, RUNNER_B.ed25519):  # a runner's keys, even B's own, never sign
        verdict = admission.admit_dispatch(JOB, v2_dispatch(signer=signer, sealed_to=RUNNER_B), state())
        assert refused(verdict, RefuseReason.SIGNATURE).text == "dispatch sig verify failed"


def test_s16_dispatch_sealed_to_a_does_not_open_on_b():
    verdict = admission.admit_dispatch(JOB, v2_dispatch(sealed_to=RUNNER_A), state())
    assert refused(verdict, RefuseReason.SEAL).text == "seal does not open"


def test_s16_v1_dispatch_refused_by_a_v2_runner_unless_accept_v1():
    verdict = admission.admit_dispatch(JOB, v1_dispatch(), state(trust=dataclasses.replace(B_TRUST, v1=V1)))
    assert "MAM_ACCEPT_V1=true" in refused(verdict, RefuseReason.SIGNATURE).text
    verdict = admission.admit_dispatch(JOB, v1_dispatch(), state())
    refused(verdict, RefuseReason.SIGNATURE)
    accepting = dataclasses.replace(B_TRUST, accept_v1=True)
    with_secret = dataclasses.replace(accepting, v1=V1)
    assert isinstance(admission.admit_dispatch(JOB, v1_dispatch(), state(trust=with_secret)), Take)
    verdict = admission.admit_dispatch(JOB, v1_dispatch(), state(trust=accepting))
    assert "no MAM_DISPATCH_SECRET" in refused(verdict, RefuseReason.SIGNATURE).text


def test_s16_v2_dispatch_refused_by_a_v1_runner():
    verdict = admission.admit_dispatch(JOB, v2_dispatch(), state(trust=V1Trust(V1)))
    assert "no v2 keys" in refused(verdict, RefuseReason.SIGNATURE).text


def test_s16_previous_hub_key_accepted_during_rotation():
    new_hub = Ed25519PrivateKey.generate()
    rotating = dataclasses.replace(B_TRUST, hub_keys=(new_hub.public_key(), HUB.public_key()))
    assert isinstance(admission.admit_dispatch(JOB, v2_dispatch(), state(trust=rotating)), Take)
    assert isinstance(admission.admit_dispatch(JOB, v2_dispatch(signer=new_hub), state(trust=rotating)), Take)
    told = dataclasses.replace(B_TRUST, hub_keys=(new_hub.public_key(),))
    refused(admission.admit_dispatch(JOB, v2_dispatch(), state(trust=told)), RefuseReason.SIGNATURE)


def test_s16_replayed_v2_dispatch_refused_after_take_and_after_cancel():
    payload = v2_dispatch(attempt_id=1)
    taken = {JOB: {"role": "runner", "attempt_id": 1, "status": "running"}}
    refused(admission.admit_dispatch(JOB, payload, state(record_of=taken.get)), RefuseReason.REPLAYED)
    tombstones = Tombstones()
    tombstones.remember(JOB, 1)
    refused(admission.admit_dispatch(JOB, payload, state(tombstones=tombstones)), RefuseReason.CANCELLED)


def test_s16_control_verified_with_hub_keys_only():
    good = wire.encode(pubkey.build_control(HUB, job_id=JOB, attempt_id=1, reason="operator"))
    assert isinstance(admission.check_control(JOB, good, B_TRUST), wire.Control)
    forged = wire.encode(pubkey.build_control(RUNNER_A.ed25519, job_id=JOB, attempt_id=1, reason="operator"))
    verdict = admission.check_control(JOB, forged, B_TRUST)
    assert isinstance(verdict, Refuse) and verdict.reason is RefuseReason.SIGNATURE
    v1 = wire.encode(crypto.sign(wire.Control.cancel(JOB, 1, "operator").to_dict(), V1.sign_key))
    verdict = admission.check_control(JOB, v1, dataclasses.replace(B_TRUST, v1=V1))
    assert isinstance(verdict, Refuse) and "v1 message" in verdict.text


def test_s19_a_v2_signed_answer_keeps_its_sealed_message():
    sealed = crypto.seal_answer("auth-token-0123456789", job_id=JOB, attempt_id=1, request_id="0" * 16,
                                action="deny", message="not on main")
    answer = wire.Control.answer(JOB, 1, "0" * 16, allow=False, sealed=sealed)
    verdict = admission.check_control(JOB, wire.encode(pubkey.sign(answer, HUB)), B_TRUST)
    assert isinstance(verdict, wire.Control) and crypto.open_answer("auth-token-0123456789", verdict) == "not on main"
    tampered = {**pubkey.sign(answer, HUB), "sealed": crypto.seal_answer(
        "auth-token-0123456789", job_id=JOB, attempt_id=1, request_id="0" * 16, action="deny", message="allowed")}
    refused_answer = admission.check_control(JOB, wire.encode(tampered), B_TRUST)
    assert isinstance(refused_answer, Refuse) and refused_answer.reason is RefuseReason.SIGNATURE


def test_s16_presence_signed_with_the_runner_key():
    presence = Presence(session=SESSION, runner_id="f" * 32, trust=B_TRUST, max_jobs=1, topic_root="t")
    decoded = wire.decode(presence.payload("online", []), "presence")
    assert decoded.sig_alg == "ed25519"
    pubkey.verify(decoded, [RUNNER_B.ed25519.public_key()])
    with pytest.raises(SignatureError):
        pubkey.verify(decoded, [RUNNER_A.ed25519.public_key()])
    B_TRUST.verify_own_presence(decoded)
    with pytest.raises(SignatureError):
        dataclasses.replace(B_TRUST, runner=RUNNER_A).verify_own_presence(decoded)


def test_s16_load_trust(tmp_path, monkeypatch):
    for name in ("MAM_DISPATCH_SECRET", "MAM_ACCEPT_V1", "MAM_ENV_FILE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ConfigError, match="MAM_DISPATCH_SECRET"):
        trust.load(tmp_path)  # a v1 runner needs the secret
    keyfiles.create_runner_keys(tmp_path)
    with pytest.raises(ConfigError, match="trusts no hub key"):
        trust.load(tmp_path)
    keyfiles.write_trusted_hub_keys(tmp_path, [keys.public_text(HUB)])
    v2 = trust.load(tmp_path)
    assert isinstance(v2, V2Trust) and v2.v1 is None and not v2.accept_v1
    private = names.runner_key_path(tmp_path, "ed25519").read_text().strip()
    assert private not in repr(v2)
    monkeypatch.setenv("MAM_ACCEPT_V1", "true")
    monkeypatch.setenv("MAM_DISPATCH_SECRET", "x" * 40)
    v2 = trust.load(tmp_path)
    assert isinstance(v2, V2Trust) and v2.v1 is not None and v2.accept_v1
    monkeypatch.setenv("MAM_ACCEPT_V1", "maybe")
    with pytest.raises(ConfigError, match="MAM_ACCEPT_V1"):
        trust.load(tmp_path)
