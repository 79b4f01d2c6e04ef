"""runner/admission.py without a broker: every §5 verdict of a dispatch, the §6
control checks and the cancel tombstones (PROTOCOL §2, §5, §6, §8)."""

from __future__ import annotations

import dataclasses
import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from mam.runner import admission
from mam.runner.admission import Ignore, Refuse, RefuseReason, RunnerState, Take, Tombstones, Wait
from mam.runner.trust import V1Trust
from mam.shared.protocol import crypto, names, wire

SECRET = "unit-test-dispatch-secret-0123456789abcdef"
KEYS = crypto.derive_keys(SECRET)
OTHER_KEYS = crypto.derive_keys("another-fleet-secret-0123456789abcdef")
SESSION = "gpu-box"
JOB = "918b0612"
ROOT = Path("/srv/runner")


def dispatch_payload(job_id: str = JOB, *, session: str = SESSION, attempt_id: int = 1, brief: str = "do it",
                     keys: crypto.DispatchKeys = KEYS, seal_keys: crypto.DispatchKeys | None = None,
                     issued_at: datetime | None = None, ack_timeout_sec: int = 180,
                     auth_token: str | None = None) -> bytes:
    """A signed dispatch as a hub publishes it (§5)."""
    token = names.new_dispatch_token()
    sealed = crypto.seal((seal_keys or keys).seal_key, job_id=job_id, attempt_id=attempt_id, dispatch_token=token,
                         auth_token=auth_token or names.new_auth_token(), brief=brief)
    dispatch = wire.Dispatch.build(job_id, session, attempt_id, token, origin="hub",
                                   contract=wire.Contract(ack_timeout_sec=ack_timeout_sec), sealed=sealed,
                                   issued_at=issued_at)
    return wire.encode(crypto.sign(dispatch.to_dict(), keys.sign_key))


def state(**changes: Any) -> RunnerState:
    records: dict[str, dict[str, Any]] = changes.pop("records", {})
    base = RunnerState(session=SESSION, trust=V1Trust(KEYS), clock_skew_s=30.0, record_of=records.get, root=ROOT,
                       busy=frozenset(), max_jobs=1, accepting=True, tombstones=Tombstones())
    return dataclasses.replace(base, **changes)


def refused(verdict: admission.Verdict, reason: RefuseReason) -> Refuse:
    assert isinstance(verdict, Refuse), verdict
    assert verdict.reason is reason
    return verdict


# ------------------------------------------------------------ Take / Wait / Ignore


def test_s5_a_valid_dispatch_with_a_free_slot_is_taken_with_its_opened_seal():
    auth_token = names.new_auth_token()
    verdict = admission.admit_dispatch(JOB, dispatch_payload(brief="fix the tests", auth_token=auth_token), state())
    assert isinstance(verdict, Take)
    assert verdict.dispatch.job_id == JOB and verdict.brief == "fix the tests"
    assert verdict.auth_token == auth_token


def test_s11_every_slot_busy_means_wait_and_the_same_job_twice_waits_too():
    assert isinstance(admission.admit_dispatch(JOB, dispatch_payload(), state(busy={"0000aaaa"})), Wait)
    assert isinstance(admission.admit_dispatch(JOB, dispatch_payload(), state(busy={JOB}, max_jobs=2)), Wait)
    assert isinstance(admission.admit_dispatch(JOB, dispatch_payload(), state(busy={"0000aaaa"}, max_jobs=2)), Take)


def test_s2_a_cleared_dispatch_is_ignored_silently_and_forgets_a_waiting_one():
    verdict = admission.admit_dispatch(JOB, b"", state())
    assert verdict == Ignore("", forget=True)


def test_s5_another_session_is_ignored_without_a_refusal_line():
    verdict = admission.admit_dispatch(JOB, dispatch_payload(session="cpu-box"), state())
    assert isinstance(verdict, Ignore) and not verdict.forget and not verdict.notice
    assert "cpu-box" in verdict.why


def test_s7_a_draining_runner_leaves_a_valid_dispatch_retained():
    verdict = admission.admit_dispatch(JOB, dispatch_payload(), state(accepting=False))
    assert isinstance(verdict, Ignore) and verdict.notice and not verdict.forget
    assert "draining" in verdict.why


def test_s7_a_runner_the_hub_drained_lets_a_valid_dispatch_wait_with_free_slots():
    assert isinstance(admission.admit_dispatch(JOB, dispatch_payload(), state(held=True)), Wait)
    assert isinstance(admission.admit_dispatch(JOB, dispatch_payload(), state(held=False)), Take)


# ------------------------------------------------------------ every refusal of §5


@pytest.mark.parametrize("payload", [b"not json", b"{}", json.dumps({"kind": "dispatch"}).encode(), b"\xff\xfe"])
def test_s5_an_undecodable_dispatch_is_refused_as_malformed(payload):
    verdict = refused(admission.admit_dispatch(JOB, payload, state()), RefuseReason.MALFORMED)
    assert verdict.job_id == JOB and verdict.text.startswith("malformed")
    assert not verdict.forget  # a forged payload never drops a kept authentic one


def test_s5_a_dispatch_naming_another_job_than_its_topic_is_malformed():
    verdict = refused(admission.admit_dispatch("0000aaaa", dispatch_payload(), state()), RefuseReason.MALFORMED)
    assert verdict.job_id == "0000aaaa"
    assert verdict.text == f"malformed: job_id {JOB} does not match the topic"


def test_s5_a_bad_signature_is_refused():
    verdict = refused(admission.admit_dispatch(JOB, dispatch_payload(keys=OTHER_KEYS), state()),
                      RefuseReason.SIGNATURE)
    assert verdict.job_id == JOB and not verdict.forget


def test_s5_a_tampered_but_well_formed_dispatch_fails_its_signature():
    obj = json.loads(dispatch_payload())
    obj["contract"]["timeout_sec"] = 1
    verdict = admission.admit_dispatch(JOB, json.dumps(obj).encode(), state())
    refused(verdict, RefuseReason.SIGNATURE)


def test_s8_a_job_id_held_here_by_a_hub_record_is_refused_and_forgotten():
    records = {JOB: {"job_id": JOB, "role": "hub", "attempt_id": 1, "status": "pending"}}
    verdict = refused(admission.admit_dispatch(JOB, dispatch_payload(), state(records=records)),
                      RefuseReason.HUB_RECORD)
    assert verdict.forget
    assert verdict.text == admission.hub_registry_message(ROOT, JOB)
    assert "mam-runner run --workspace DIR" in verdict.text


def test_s5_an_expired_dispatch_is_refused_beyond_the_clock_skew():
    old = datetime.now(UTC) - timedelta(seconds=200)
    verdict = refused(admission.admit_dispatch(JOB, dispatch_payload(issued_at=old, ack_timeout_sec=100),
                                               state(clock_skew_s=30.0)), RefuseReason.EXPIRED)
    assert verdict.forget and verdict.text.startswith("expired: expires_at ")
    assert "more than 30 s in the past" in verdict.text
    # within the skew it is still valid
    skewed = admission.admit_dispatch(JOB, dispatch_payload(issued_at=old, ack_timeout_sec=100),
                                      state(clock_skew_s=150.0))
    assert isinstance(skewed, Take)


@pytest.mark.parametrize("held", [1, 2])
def test_s5_an_attempt_this_host_already_took_is_refused_as_replayed(held):
    records = {JOB: {"job_id": JOB, "role": "runner", "attempt_id": held, "status": "completed"}}
    verdict = refused(admission.admit_dispatch(JOB, dispatch_payload(attempt_id=1), state(records=records)),
                      RefuseReason.REPLAYED)
    assert verdict.forget
    assert verdict.text == f"replayed: attempt 1 already taken by this host (holds attempt {held}, completed)"


def test_s5_a_newer_attempt_than_the_record_is_taken():
    records = {JOB: {"job_id": JOB, "role": "runner", "attempt_id": 1, "status": "error"}}
    assert isinstance(admission.admit_dispatch(JOB, dispatch_payload(attempt_id=2), state(records=records)), Take)


def test_s6_a_dispatch_of_a_cancelled_attempt_is_refused():
    tombstones = Tombstones()
    tombstones.remember(JOB, 2)
    for attempt in (1, 2):
        verdict = refused(admission.admit_dispatch(JOB, dispatch_payload(attempt_id=attempt),
                                                   state(tombstones=tombstones)), RefuseReason.CANCELLED)
        assert verdict.forget and verdict.text == "cancelled: attempt 2 was cancelled by the hub"
    assert isinstance(admission.admit_dispatch(JOB, dispatch_payload(attempt_id=3), state(tombstones=tombstones)),
                      Take)


def test_s5_a_seal_that_does_not_open_is_refused():
    verdict = refused(admission.admit_dispatch(JOB, dispatch_payload(seal_keys=OTHER_KEYS), state()),
                      RefuseReason.SEAL)
    assert not verdict.forget


def test_s5_checks_run_in_order_signature_before_session_before_expiry():
    old = datetime.now(UTC) - timedelta(days=1)
    forged_elsewhere = dispatch_payload(session="cpu-box", keys=OTHER_KEYS, issued_at=old)
    refused(admission.admit_dispatch(JOB, forged_elsewhere, state()), RefuseReason.SIGNATURE)
    expired_elsewhere = dispatch_payload(session="cpu-box", issued_at=old)
    assert isinstance(admission.admit_dispatch(JOB, expired_elsewhere, state()), Ignore)


def test_every_refuse_reason_is_covered_and_names_its_forgetting():
    forgetting = {r for r in RefuseReason if Refuse(JOB, r, "").forget}
    assert forgetting == {RefuseReason.HUB_RECORD, RefuseReason.EXPIRED, RefuseReason.REPLAYED,
                          RefuseReason.CANCELLED, RefuseReason.TAKEN, RefuseReason.GPUS}


def test_s14_a_gpu_job_waits_for_free_gpus_and_is_refused_where_there_are_too_few():
    needs_two = dispatch_payload()
    obj = json.loads(needs_two)
    obj.pop("sig")
    obj["work"] = {"gpus": 2}
    payload = wire.encode(crypto.sign(obj, KEYS.sign_key))
    assert isinstance(admission.admit_dispatch(JOB, payload, state(gpus_total=2, gpus_free=2)), Take)
    assert isinstance(admission.admit_dispatch(JOB, payload, state(gpus_total=4, gpus_free=1, max_jobs=4)), Wait)
    verdict = refused(admission.admit_dispatch(JOB, payload, state(gpus_total=1, gpus_free=1)), RefuseReason.GPUS)
    assert verdict.forget
    assert verdict.text == "gpus: the job needs 2 GPU(s), this runner serves 1 (start it with --gpus)"
    assert isinstance(admission.admit_dispatch(JOB, dispatch_payload(), state(gpus_total=2, gpus_free=0)), Take)


# ------------------------------------------------------------ §17: an attempt runs at most once


def taken_take(attempt_id: int = 1) -> tuple[Take, str]:
    auth_token = names.new_auth_token()
    verdict = admission.admit_dispatch(JOB, dispatch_payload(attempt_id=attempt_id, auth_token=auth_token), state())
    assert isinstance(verdict, Take)
    return verdict, auth_token


def state_payload(take: Take, auth_token: str, *, status: str = "running", attempt_id: int | None = None,
                  job_id: str = JOB, seq: int = 1) -> bytes:
    """A retained state as the runner that took the attempt published it (§4), signed with `auth_token`."""
    snapshot = wire.State.build(job_id, seq, status, "started",
                                attempt_id=take.dispatch.attempt_id if attempt_id is None else attempt_id,
                                dispatch_token=take.dispatch.dispatch_token)
    return wire.encode(crypto.sign_event(snapshot.to_dict(), auth_token))


@pytest.mark.parametrize("status", ["running", "pending", "completed", "error", "cancelled"])
def test_s17_a_retained_state_of_the_same_attempt_means_taken_whatever_its_status(status):
    take, auth_token = taken_take(attempt_id=2)
    verdict = refused(admission.check_taken(take, state_payload(take, auth_token, status=status, seq=3)),
                      RefuseReason.TAKEN)
    assert verdict.job_id == JOB and verdict.forget
    assert verdict.text.startswith("taken: attempt 2 was already started by another runner")
    assert f"retained state {status}, seq 3" in verdict.text


def test_s17_no_state_a_cleared_one_or_another_attempt_proves_nothing():
    take, auth_token = taken_take(attempt_id=2)
    assert admission.check_taken(take, None) is None
    assert admission.check_taken(take, b"") is None
    assert admission.check_taken(take, state_payload(take, auth_token, attempt_id=1)) is None  # an earlier attempt
    assert admission.check_taken(take, state_payload(take, auth_token, job_id="0000aaaa")) is None


def test_s17_a_state_not_signed_with_the_attempts_auth_token_or_unreadable_is_not_proof():
    take, _ = taken_take()
    forged = state_payload(take, names.new_auth_token())  # not the token sealed in this dispatch
    assert admission.check_taken(take, forged) is None
    assert admission.check_taken(take, b"not json") is None
    assert admission.check_taken(take, b'{"schema_version": 1}') is None


# ------------------------------------------------------------ controls (§6)


def control_payload(job_id: str = JOB, attempt_id: int = 1, keys: crypto.DispatchKeys = KEYS) -> bytes:
    control = wire.Control.cancel(job_id, attempt_id, "operator")
    return wire.encode(crypto.sign(control.to_dict(), keys.sign_key))


def test_s6_a_signed_cancel_is_verified():
    control = admission.check_control(JOB, control_payload(attempt_id=3), V1Trust(KEYS))
    assert isinstance(control, wire.Control) and control.attempt_id == 3 and control.reason == "operator"


def test_s6_bad_controls_are_refused_and_a_cleared_one_ignored():
    assert admission.check_control(JOB, b"", V1Trust(KEYS)) == Ignore("")
    refused(admission.check_control(JOB, b"{", V1Trust(KEYS)), RefuseReason.MALFORMED)
    mismatch = refused(admission.check_control("0000aaaa", control_payload(), V1Trust(KEYS)), RefuseReason.MALFORMED)
    assert "does not match the topic" in mismatch.text
    refused(admission.check_control(JOB, control_payload(keys=OTHER_KEYS), V1Trust(KEYS)), RefuseReason.SIGNATURE)


def test_waiting_attempt_reads_a_kept_dispatch():
    assert admission.waiting_attempt(dispatch_payload(attempt_id=4)) == 4
    assert admission.waiting_attempt(b"junk") is None


# ------------------------------------------------------------ tombstones (moved from tests/e2e/test_daemon.py)


def test_s6_cancel_tombstones_are_bounded_and_keep_the_highest_attempt():
    """At most MAX_CANCEL_TOMBSTONES job ids are remembered (oldest dropped); a cancel of an
    older attempt never lowers the tombstone (a replayed old cancel)."""
    tombstones = Tombstones()
    limit = admission.MAX_CANCEL_TOMBSTONES
    assert tombstones.limit == limit
    for n in range(limit + 5):
        tombstones.remember(f"{n:08x}", 1)
    tombstones.remember("00000010", 3)
    tombstones.remember("00000010", 2)
    assert len(tombstones) == limit
    assert "00000000" not in tombstones and "00000004" not in tombstones
    assert tombstones.get("00000005") == 1 and tombstones.get("00000010") == 3
