"""PROTOCOL §8: the job registry — records, CAS state machine, seqs, audit log,
corrupt records, and the `jobs`/`show` commands."""

from __future__ import annotations

import io
import json
import os
import stat
import threading

import pytest
from harness.waiting import PATIENCE_S, wait_until

from mam.orchestrator.acceptance import mirror_event
from mam.orchestrator.cli import app as orch_app
from mam.runner.cli import app as runner_app
from mam.shared import cli, config
from mam.shared.cli.render import cli_jobs, cli_show
from mam.shared.config import contract_from_env
from mam.shared.protocol import names
from mam.shared.protocol.errors import (
    ConfigError,
    RegistryError,
    StaleAttemptError,
    TransitionRefused,
    UsageError,
    exit_code_for,
)
from mam.shared.store.registry import (
    Contract,
    JobNotFound,
    Refusal,
    Registry,
    StaleTransition,
    redact,
)


@pytest.fixture
def reg(tmp_path):
    return Registry(tmp_path)


def ident(record):
    return {"attempt_id": record["attempt_id"], "dispatch_token": record["dispatch_token"]}


def payload_for(job_id, record, event, **extra):
    def build(seq):
        return {"schema_version": 1, "seq": seq, "job_id": job_id, "event": event, "timestamp": "t",
                "detail": extra.get("detail", ""), "data": {**ident(record), "hmac_sig": "0" * 64}}
    return build


def started(reg, record):
    return reg.record_event(record["job_id"], event="started", build=payload_for(record["job_id"], record, "started"),
                            **ident(record))


def mode(path):
    return stat.S_IMODE(os.stat(path).st_mode)


def snapshot(reg, job_id):
    """Bytes of the record and audit log, to prove a refusal wrote nothing."""
    return reg.record_path(job_id).read_bytes(), reg.audit_path(job_id).read_bytes()


# ------------------------------------------------------------------ register

def test_s8_register_creates_pending_attempt_1_with_fresh_tokens_and_contract(reg, tmp_path):
    assert not (tmp_path / ".mam").exists()  # the constructor has no side effects
    rec = reg.register(session="gpu-box", contract=Contract(heartbeat_sec=10, heartbeat_misses=3))
    names.validate_job_id(rec["job_id"])
    names.validate_token(rec["dispatch_token"])
    assert len(rec["auth_token"]) >= 40
    assert rec["status"] == "pending" and rec["attempt_id"] == 1 and rec["last_seq"] == 0
    assert rec["transition_seq"] == 0 and rec["agent_session"] == "remote:gpu-box"
    assert rec["transport"] == "remote" and rec["role"] == "hub"
    assert (rec["heartbeat_sec"], rec["heartbeat_misses"], rec["idle_timeout_sec"]) == (10, 3, 30)
    assert (rec["ack_timeout_sec"], rec["timeout_sec"]) == (180, 7200)
    for key in ("created_at", "updated_at", "close_reason", "exit_code", "broker"):
        assert key in rec
    assert reg.get(rec["job_id"]) == rec
    other = reg.register(session="gpu-box")
    assert other["dispatch_token"] != rec["dispatch_token"] and other["auth_token"] != rec["auth_token"]


def test_s8_files_are_0600_and_folders_0700(reg, tmp_path):
    rec = reg.register(session="gpu-box")
    started(reg, rec)
    logs = reg.logs_dir(rec["job_id"])
    for path in (reg.record_path(rec["job_id"]), names.lock_path(tmp_path), logs / "events.ndjson",
                 logs / "meta.json", logs / "status.json"):
        assert mode(path) == 0o600, path
    for folder in (tmp_path / ".mam", names.jobs_dir(tmp_path), logs.parent, logs):
        assert mode(folder) == 0o700, folder


def test_s8_meta_and_status_json_carry_no_secrets(reg):
    rec = reg.register(session="gpu-box")
    started(reg, rec)
    logs = reg.logs_dir(rec["job_id"])
    meta = json.loads((logs / "meta.json").read_text())
    status = json.loads((logs / "status.json").read_text())
    assert meta["job_id"] == rec["job_id"] and meta["session"] == "gpu-box"
    assert meta["contract"]["idle_timeout_sec"] == 120
    assert status["status"] == "running" and status["attempt_id"] == 1
    for text in ((logs / "meta.json").read_text(), (logs / "status.json").read_text()):
        assert rec["auth_token"] not in text and rec["dispatch_token"] not in text


@pytest.mark.parametrize("kwargs,why", [
    ({"session": "gpu.box"}, "'.' is not allowed"),
    ({"session": "gpu-box", "job_id": "XYZ"}, "job id"),
    ({"session": "gpu-box", "broker": {"password": "x"}}, "passwords never enter"),
    ({"session": "gpu-box", "broker": {"db_passwd": "x"}}, "passwords never enter"),
    ({"session": "gpu-box", "broker": ["x"]}, "JSON object"),
    ({"session": "gpu-box", "source": "publisher"}, "may not register"),
])
def test_s8_register_refuses_bad_input_before_writing(reg, tmp_path, kwargs, why):
    with pytest.raises(UsageError, match=why):
        reg.register(**kwargs)
    assert not (tmp_path / ".mam").exists()


@pytest.mark.parametrize("broker,why", [
    ({"password": "x"}, "passwords never enter"),
    ({"nonsense": 1}, "unknown"),
    ({"port": {"a": 1}}, "expected an integer"),
    ({"topic_root": "a/#"}, "topic root"),
    ({"username": "a\nb"}, "one-line"),
    (["x"], "JSON object"),
    ({"hosts": ["a", 1]}, "a host name or a list of them"),
    ({"host": "a" * 5000}, "'host' host '" + "a" * 40 + "' is invalid"),
    ({"ca_certs": "/nonexistent/ca.pem"}, "'/nonexistent/ca.pem': no such file"),
])
def test_s13_a_records_broker_overrides_are_refused_where_they_are_used(broker, why):
    # The store keeps the block as written (minus passwords); config judges it when a
    # hub or runner connects with it (hub.py, publish.py, gc.py), one line each.
    with pytest.raises(ConfigError, match=why):
        config.apply_job_overrides(config.BrokerConfig(), broker)


def test_s8_register_keeps_broker_overrides_and_refuses_existing_id(reg):
    rec = reg.register(session="gpu-box", job_id="918b0612", broker={"hosts": ("a", "b"), "port": 8883})
    assert rec["broker"] == {"hosts": ["a", "b"], "port": 8883}
    with pytest.raises(Refusal, match="already exists"):
        reg.register(session="gpu-box", job_id="918b0612")
    assert reg.get("918b0612")["dispatch_token"] == rec["dispatch_token"]


# ------------------------------------------------------------------ contract

def test_s5_contract_defaults_and_idle_is_k_times_n():
    c = Contract()
    assert c.to_dict() == {"heartbeat_sec": 30, "heartbeat_misses": 4, "ack_timeout_sec": 180,
                           "idle_timeout_sec": 120, "timeout_sec": 7200}
    assert Contract(idle_timeout_sec=7).idle_timeout_s == 7
    assert Contract.of_record({**c.to_dict(), "job_id": "918b0612"}) == Contract(idle_timeout_sec=120)


@pytest.mark.parametrize("field,value", [
    ("heartbeat_sec", 0), ("heartbeat_sec", -1), ("heartbeat_sec", 1.5), ("heartbeat_sec", True),
    ("heartbeat_misses", "4"), ("timeout_sec", 10**9),
    ("idle_timeout_sec", 0), ("heartbeat_misses", 10**6),
])
def test_s5_contract_refuses_non_positive_or_huge_values(field, value):
    with pytest.raises(UsageError, match=field):
        Contract.build(**{field: value})


def test_s5_contract_from_env_overrides_and_refuses_garbage():
    env = {"MAM_HEARTBEAT_SEC": "5", "MAM_HEARTBEAT_MISSES": "2", "MAM_ACK_TIMEOUT_S": "9"}
    c = contract_from_env(env, timeout_sec=60)
    assert (c.heartbeat_sec, c.heartbeat_misses, c.ack_timeout_sec, c.timeout_sec, c.idle_timeout_s) == \
        (5, 2, 9, 60, 10)
    with pytest.raises(ConfigError, match="MAM_HEARTBEAT_SEC"):
        contract_from_env({"MAM_HEARTBEAT_SEC": "ten"})
    with pytest.raises(ConfigError, match="MAM_ACK_TIMEOUT_S"):
        contract_from_env({"MAM_ACK_TIMEOUT_S": "0"})


# ------------------------------------------------------ worker publish path

def test_s3_seq_per_attempt_started_is_1_and_every_publish_takes_the_next(reg):
    rec = reg.register(session="gpu-box")
    jid = rec["job_id"]
    seq, payload = started(reg, rec)
    assert seq == 1 and payload["seq"] == 1
    assert reg.allocate_seq(jid, **ident(rec)) == 2
    seq, _ = reg.record_event(jid, event="progress", build=payload_for(jid, rec, "progress"), **ident(rec))
    assert seq == 3
    after = reg.get(jid)
    assert after["status"] == "running" and after["last_seq"] == 3 and after["transition_seq"] == 1
    lines = reg.audit(jid)
    assert [line["event"] for line in lines] == ["registered", "started", "status_changed", "progress"]
    changed = lines[2]
    assert (changed["from"], changed["to"], changed["source"], changed["reason"]) == \
        ("pending", "running", "publisher", "event started")


def test_s8_terminal_event_ends_job_and_refuses_every_later_worker_request(reg):
    rec = reg.register(session="gpu-box")
    jid = rec["job_id"]
    started(reg, rec)
    seq, _ = reg.record_event(jid, event="completed", build=payload_for(jid, rec, "completed"), exit_code=0,
                              **ident(rec))
    done = reg.get(jid)
    assert seq == 2 and done["status"] == "completed" and done["exit_code"] == 0
    before = snapshot(reg, jid)
    attempts = [
        lambda: reg.allocate_seq(jid, **ident(rec)),
        lambda: reg.record_event(jid, event="progress", build=payload_for(jid, rec, "progress"), **ident(rec)),
        lambda: reg.record_event(jid, event="error", build=payload_for(jid, rec, "error"), **ident(rec)),
        lambda: reg.transition(jid, "error", source="runner", **ident(rec)),
        lambda: reg.transition(jid, "cancelled", source="remote_mirror", **ident(rec)),
    ]
    for attempt in attempts:
        with pytest.raises(Refusal) as info:
            attempt()
        assert info.value.reason == "after_terminal" and jid in str(info.value)
    assert snapshot(reg, jid) == before


def test_s8_stale_token_refused_after_redispatch_and_nothing_written(reg):
    rec = reg.register(session="gpu-box")
    jid = rec["job_id"]
    started(reg, rec)
    reg.record_event(jid, event="error", build=payload_for(jid, rec, "error"), exit_code=3, **ident(rec))
    new = reg.redispatch(jid)
    assert new["attempt_id"] == 2 and new["dispatch_token"] != rec["dispatch_token"]
    assert new["auth_token"] != rec["auth_token"]  # the old holder cannot sign for the new attempt
    before = snapshot(reg, jid)
    for call in (lambda: reg.allocate_seq(jid, **ident(rec)),
                 lambda: started(reg, rec),
                 lambda: reg.transition(jid, "running", source="runner", **ident(rec))):
        with pytest.raises(StaleTransition) as info:
            call()
        assert isinstance(info.value, StaleAttemptError) and isinstance(info.value, TransitionRefused)
        assert info.value.reason == "stale_attempt" and exit_code_for(info.value) == 1
        assert rec["dispatch_token"] not in str(info.value)  # tokens never in messages
    # the current attempt, but a wrong token
    with pytest.raises(StaleTransition, match="dispatch token is not the current one"):
        reg.allocate_seq(jid, attempt_id=2, dispatch_token=rec["dispatch_token"])
    with pytest.raises(StaleTransition):
        reg.allocate_seq(jid, attempt_id=2, dispatch_token=None)
    assert snapshot(reg, jid) == before


def test_s8_redispatch_from_error_gives_attempt_2_with_seq_restarting_at_1(reg):
    rec = reg.register(session="gpu-box")
    jid = rec["job_id"]
    started(reg, rec)
    reg.allocate_seq(jid, **ident(rec))
    reg.close(jid, "deadline_timeout")
    new = reg.redispatch(jid, session="other-box")
    assert (new["status"], new["attempt_id"], new["last_seq"]) == ("pending", 2, 0)
    assert new["close_reason"] is None and new["agent_session"] == "remote:other-box"
    seq, _ = started(reg, new)
    assert seq == 1
    assert reg.allocate_seq(jid, **ident(new)) == 2


def test_s8_late_completed_after_deadline_timeout_close_is_refused(reg):
    rec = reg.register(session="gpu-box")
    jid = rec["job_id"]
    started(reg, rec)
    closed = reg.close(jid, "deadline_timeout")
    assert closed["status"] == "error" and closed["close_reason"] == "deadline_timeout"
    with pytest.raises(Refusal) as info:
        reg.record_event(jid, event="completed", build=payload_for(jid, rec, "completed"), **ident(rec))
    assert info.value.reason == "after_terminal"
    with pytest.raises(Refusal):
        mirror_event(reg, jid, payload_for(jid, rec, "completed")(3))
    assert reg.get(jid)["status"] == "error"


def test_s8_redispatch_from_completed_is_refused(reg):
    rec = reg.register(session="gpu-box")
    jid = rec["job_id"]
    reg.transition(jid, "completed", source="runner", **ident(rec))
    with pytest.raises(Refusal, match="completed") as info:
        reg.redispatch(jid)
    assert info.value.reason == "not_allowed"
    assert reg.get(jid)["attempt_id"] == 1


def test_s8_redispatch_from_cancelled_and_from_running_only_after_a_cancel(reg):
    rec = reg.register(session="gpu-box")
    jid = rec["job_id"]
    started(reg, rec)
    with pytest.raises(Refusal, match="cancel it first"):
        reg.redispatch(jid)
    requested = reg.request_cancel(jid, reason="operator")
    assert requested["status"] == "running" and requested["cancel_requested_at"]
    assert reg.audit(jid)[-1]["event"] == "cancel_requested"
    again = reg.redispatch(jid)
    assert again["attempt_id"] == 2 and again["cancel_requested_at"] is None
    reg.close(jid, "cancelled")
    assert reg.redispatch(jid)["attempt_id"] == 3
    reg2 = reg.register(session="gpu-box")
    with pytest.raises(Refusal, match="cancel it first"):
        reg.redispatch(reg2["job_id"])  # pending without a cancel


@pytest.mark.parametrize("reason,status", [("deadline_timeout", "error"), ("agent_blocked", "error"),
                                           ("cancelled", "cancelled")])
@pytest.mark.parametrize("from_running", [False, True])
def test_s8_operator_close_from_pending_or_running(reg, reason, status, from_running):
    rec = reg.register(session="gpu-box")
    jid = rec["job_id"]
    if from_running:
        started(reg, rec)
    closed = reg.close(jid, reason, source="delegate_wrapper")
    assert closed["status"] == status and closed["close_reason"] == reason
    last = reg.audit(jid)[-1]
    assert last["event"] == "status_changed" and last["to"] == status and last["source"] == "delegate_wrapper"
    with pytest.raises(Refusal) as info:
        reg.close(jid, "cancelled")
    assert info.value.reason == "after_terminal"


@pytest.mark.parametrize("to_status,close_reason", [
    ("running", None), ("completed", None), ("pending", None), ("error", None), ("error", "cancelled"),
])
def test_s8_operator_may_not_move_work_forward(reg, to_status, close_reason):
    rec = reg.register(session="gpu-box")
    before = snapshot(reg, rec["job_id"])
    with pytest.raises(Refusal) as info:
        reg.transition(rec["job_id"], to_status, source="operator", close_reason=close_reason)
    assert info.value.reason == "not_allowed"
    assert snapshot(reg, rec["job_id"]) == before


ALLOWED_WORKER = [("pending", "running"), ("pending", "completed"), ("pending", "error"),
                  ("pending", "cancelled"), ("running", "completed"), ("running", "error"),
                  ("running", "cancelled")]


@pytest.mark.parametrize("start,to", ALLOWED_WORKER)
def test_s8_worker_edges_allowed(reg, start, to):
    rec = reg.register(session="gpu-box")
    jid = rec["job_id"]
    if start == "running":
        reg.transition(jid, "running", source="runner", **ident(rec))
    out = reg.transition(jid, to, source="remote_mirror", reason="test", last_seq=4, **ident(rec))
    assert out["status"] == to and out["last_seq"] == 4
    assert out["transition_seq"] == (2 if start == "running" else 1)


@pytest.mark.parametrize("start,to", [("running", "pending"), ("pending", "pending")])
def test_s8_worker_edges_refused(reg, start, to):
    rec = reg.register(session="gpu-box")
    jid = rec["job_id"]
    if start == "running":
        started(reg, rec)
    with pytest.raises(Refusal) as info:
        reg.transition(jid, to, source="publisher", **ident(rec))
    assert info.value.reason == "not_allowed"


def test_s8_running_to_running_is_a_no_op_and_last_seq_never_goes_back(reg):
    rec = reg.register(session="gpu-box")
    jid = rec["job_id"]
    started(reg, rec)
    reg.allocate_seq(jid, **ident(rec))
    before = snapshot(reg, jid)
    assert reg.transition(jid, "running", source="runner", **ident(rec))["transition_seq"] == 1
    assert snapshot(reg, jid) == before
    done = reg.transition(jid, "completed", source="remote_mirror", last_seq=1, **ident(rec))
    assert done["last_seq"] == 2


def test_s6_runner_error_event_with_cancelled_status(reg):
    rec = reg.register(session="gpu-box")
    jid = rec["job_id"]
    started(reg, rec)
    seq, payload = reg.record_event(jid, event="error", status="cancelled", source="runner",
                                    build=payload_for(jid, rec, "error", detail="cancelled"), **ident(rec))
    assert seq == 2 and payload["detail"] == "cancelled"
    assert reg.get(jid)["status"] == "cancelled"
    with pytest.raises(UsageError):
        reg.record_event(jid, event="progress", status="cancelled", build=dict, **ident(rec))


def test_s8_transition_seq_counts_status_changed_lines(reg):
    rec = reg.register(session="gpu-box")
    jid = rec["job_id"]
    started(reg, rec)
    reg.allocate_seq(jid, **ident(rec))
    reg.close(jid, "agent_blocked")
    new = reg.redispatch(jid)
    started(reg, new)
    final = reg.transition(jid, "completed", source="runner", exit_code=0, **ident(new))
    changes = [line for line in reg.audit(jid) if line["event"] == "status_changed"]
    assert final["transition_seq"] == len(changes) == 5
    assert [c["transition_seq"] for c in changes] == [1, 2, 3, 4, 5]
    assert all({"from", "to", "source", "reason"} <= set(c) for c in changes)


def test_s8_build_failure_writes_nothing(reg):
    rec = reg.register(session="gpu-box")
    jid = rec["job_id"]
    before = snapshot(reg, jid)

    def boom(seq):
        raise ValueError("no payload")

    with pytest.raises(ValueError):
        reg.record_event(jid, event="started", build=boom, **ident(rec))
    assert snapshot(reg, jid) == before


@pytest.mark.parametrize("call,why", [
    (lambda r, j, i: r.record_event(j, event="finished", build=dict, **i), "event 'finished'"),
    (lambda r, j, i: r.allocate_seq(j, source="operator", **i), "source 'operator' may not"),
    (lambda r, j, i: r.transition(j, "done", source="runner", **i), "status 'done'"),
    (lambda r, j, i: r.transition(j, "error", source="hacker"), "source 'hacker'"),
    (lambda r, j, i: r.close(j, "bored"), "close reason 'bored'"),
    (lambda r, j, i: r.close(j, "cancelled", source="publisher"), "may not close"),
    (lambda r, j, i: r.redispatch(j, source="runner"), "may not redispatch"),
    (lambda r, j, i: r.get("../../etc"), "job id"),
])
def test_s8_bad_requests_are_usage_errors(reg, call, why):
    rec = reg.register(session="gpu-box")
    with pytest.raises(UsageError, match=why):
        call(reg, rec["job_id"], ident(rec))


def test_s8_unknown_job_is_a_registry_error(reg):
    with pytest.raises(JobNotFound, match="12345678"):
        reg.get("12345678")
    with pytest.raises(JobNotFound):
        reg.close("12345678", "cancelled")


# ------------------------------------------------------------ runner mirror

def test_s11_mirror_takes_hub_identity_and_refuses_replayed_attempt(tmp_path):
    hub = Registry(tmp_path / "hub")
    runner = Registry(tmp_path / "runner")
    rec = hub.register(session="gpu-box", contract=Contract(heartbeat_sec=5))
    kwargs = dict(job_id=rec["job_id"], session="gpu-box", attempt_id=1, dispatch_token=rec["dispatch_token"],
                  auth_token=rec["auth_token"], contract=Contract(heartbeat_sec=5), origin="hub-host")
    mirrored = runner.mirror(**kwargs)
    assert mirrored["role"] == "runner" and mirrored["status"] == "pending"
    assert mirrored["heartbeat_sec"] == 5 and mirrored["origin"] == "hub-host"
    assert {k: mirrored[k] for k in ("job_id", "attempt_id", "dispatch_token", "auth_token")} == \
        {k: rec[k] for k in ("job_id", "attempt_id", "dispatch_token", "auth_token")}
    started(runner, mirrored)
    with pytest.raises(Refusal) as info:
        runner.mirror(**kwargs)
    assert info.value.reason == "replayed"
    assert runner.get(rec["job_id"])["status"] == "running"
    # a redispatch reaching this runner replaces the identity; the old one is stale
    hub.close(rec["job_id"], "cancelled")
    new = hub.redispatch(rec["job_id"])
    again = runner.mirror(**dict(kwargs, attempt_id=2, dispatch_token=new["dispatch_token"],
                                 auth_token=new["auth_token"]))
    assert again["attempt_id"] == 2 and again["last_seq"] == 0 and again["status"] == "pending"
    with pytest.raises(StaleTransition):
        runner.allocate_seq(rec["job_id"], **ident(mirrored))
    with pytest.raises(Refusal):
        runner.mirror(**kwargs)  # attempt 1 < 2


@pytest.mark.parametrize("change,why", [
    ({"attempt_id": 0}, "attempt"), ({"dispatch_token": "xyz"}, "dispatch token"),
    ({"auth_token": "short"}, "auth token"), ({"session": "a/b"}, "session"), ({"job_id": "1"}, "job id"),
    ({"source": "operator"}, "may not mirror"),
])
def test_s11_mirror_refuses_malformed_identity(reg, tmp_path, change, why):
    kwargs = dict(job_id="918b0612", session="gpu-box", attempt_id=1, dispatch_token="a" * 32,
                  auth_token="b" * 43, contract=Contract())
    with pytest.raises(UsageError, match=why):
        reg.mirror(**{**kwargs, **change})
    assert not (tmp_path / ".mam").exists()


# ------------------------------------------------------------ corrupt files

@pytest.mark.parametrize("content,why", [
    (b'{"job_id": "918b06', "not JSON"),
    (b"", "not JSON"),
    (b"\xff\xfe", "not UTF-8"),
    (b"[1, 2]", "not a JSON object"),
    (b'{"job_id": "00000000"}', "job_id does not match"),
    (b'{"job_id": "918b0612", "status": "weird"}', "unknown status"),
    (b"{" + b" " * (1 << 20) + b"}", "larger than"),
])
def test_s8_corrupt_record_raises_registry_error_and_is_kept_aside(reg, content, why):
    good = reg.register(session="gpu-box")
    reg.register(session="gpu-box", job_id="918b0612")
    path = reg.record_path("918b0612")
    path.write_bytes(content)
    with pytest.raises(RegistryError) as info:
        reg.get("918b0612")
    message = str(info.value)
    assert why in message and str(path) in message and "\n" not in message
    assert not path.exists()
    aside = list(path.parent.glob("918b0612.json.corrupt-*"))
    assert len(aside) == 1 and aside[0].read_bytes() == content and aside[0].name in message
    # listing goes on past it (and would report a second corrupt copy without overwriting the first)
    path.write_bytes(content)
    records, errors = reg.list()
    assert [r["job_id"] for r in records] == [good["job_id"]]
    assert len(errors) == 1 and isinstance(errors[0], RegistryError)
    assert len(list(path.parent.glob("918b0612.json.corrupt-*"))) == 2
    # later reads name the copy kept aside instead of a bare "no record"
    with pytest.raises(JobNotFound, match="kept aside as 918b0612.json.corrupt-"):
        reg.get("918b0612")


def test_s8_find_answers_none_for_a_missing_record_without_listing_the_folder(reg, monkeypatch):
    """A runner asks for every new dispatch's record: the answer "none" must not cost a
    listing of a folder that holds every job the host ever ran."""
    held = reg.register(session="gpu-box")
    assert reg.find(held["job_id"]) == reg.get(held["job_id"])

    def listed(*_args, **_kwargs):
        raise AssertionError("the jobs folder was listed")

    monkeypatch.setattr(type(reg.record_path(held["job_id"])), "glob", listed)
    monkeypatch.setattr(os, "scandir", listed)
    monkeypatch.setattr(os, "listdir", listed)
    assert reg.find("918b0612") is None
    with pytest.raises(UsageError):
        reg.find("../etc")


def test_s8_find_still_quarantines_a_corrupt_record(reg):
    reg.register(session="gpu-box", job_id="918b0612")
    path = reg.record_path("918b0612")
    path.write_text("{")
    with pytest.raises(RegistryError, match="corrupt"):
        reg.find("918b0612")
    assert not path.exists() and list(path.parent.glob("918b0612.json.corrupt-*"))
    assert reg.find("918b0612") is None


def test_s8_transition_on_corrupt_record_raises_registry_error(reg):
    reg.register(session="gpu-box", job_id="918b0612")
    reg.record_path("918b0612").write_text("{")
    with pytest.raises(RegistryError, match="corrupt"):
        reg.close("918b0612", "cancelled")


def test_s8_audit_survives_a_torn_line(reg):
    rec = reg.register(session="gpu-box")
    jid = rec["job_id"]
    with open(reg.audit_path(jid), "ab") as handle:
        handle.write(b'{"event": "progr')  # a writer died mid-line
    started(reg, rec)
    lines = reg.audit(jid)
    assert lines[1] == {"event": "unreadable_line", "line": 2}
    assert [line["event"] for line in lines[2:]] == ["started", "status_changed"]


def test_s8_list_filters_by_status_and_refuses_unknown_status(reg, tmp_path):
    assert Registry(tmp_path / "empty").list() == ([], [])
    a = reg.register(session="gpu-box")
    b = reg.register(session="gpu-box")
    reg.close(b["job_id"], "cancelled")
    assert [r["job_id"] for r in reg.list("pending")[0]] == [a["job_id"]]
    assert [r["job_id"] for r in reg.list("cancelled")[0]] == [b["job_id"]]
    with pytest.raises(UsageError, match="status 'done'"):
        reg.list("done")


def test_s8_lock_is_reentrant_so_callers_can_group_calls(reg):
    rec = reg.register(session="gpu-box")
    with reg.lock():
        with reg.lock():
            assert reg.allocate_seq(rec["job_id"], **ident(rec)) == 1
        reg.append_audit(rec["job_id"], {"event": "barrier"})
    assert reg.audit(rec["job_id"])[-1]["event"] == "barrier"
    assert "timestamp" in reg.audit(rec["job_id"])[-1]


def _blocked_fsyncs(monkeypatch) -> tuple[list[int], threading.Event]:
    """Every fsync of this process waits until the returned event is set; the list names them."""
    waiting: list[int] = []
    free = threading.Event()
    real = os.fsync

    def fsync(fd: int) -> None:
        waiting.append(fd)
        free.wait(PATIENCE_S)
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return waiting, free


def test_s8_a_group_flushed_after_releases_the_lock_before_its_flush(reg, monkeypatch):
    """`group(flush="after")` holds the lock for the writes only: another holder gets the
    lock (and reads the write) while the group's flush is still under way; the group
    returns only once its files are flushed (§8, §12)."""
    rec = reg.register(session="gpu-box")
    waiting, free = _blocked_fsyncs(monkeypatch)
    done = threading.Event()

    def write() -> None:
        with reg.group(flush="after"), reg.transaction(rec["job_id"]) as txn:
            txn.log({"event": "note"})
        done.set()

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    try:
        wait_until(lambda: waiting, PATIENCE_S, "the group's flush under way")
        with reg.lock():  # free, though the flush is not done
            assert reg.audit(rec["job_id"])[-1]["event"] == "note"
        assert not done.is_set()
    finally:
        free.set()
    writer.join(PATIENCE_S)
    assert done.is_set() and len(waiting) == 2  # the audit log, then its folder


def test_s8_a_group_flushing_none_leaves_its_writes_to_the_page_cache(reg, monkeypatch):
    rec = reg.register(session="gpu-box")
    waiting, free = _blocked_fsyncs(monkeypatch)
    free.set()
    with reg.group(flush="none"):
        assert reg.allocate_seq(rec["job_id"], **ident(rec)) == 1
    assert waiting == [] and reg.get(rec["job_id"])["last_seq"] == 1
    with pytest.raises(ValueError, match="flush must be one of locked, after, none"):
        with reg.group(flush="later"):  # type: ignore[arg-type]
            pass


def test_s8_sweep_removes_only_the_record_temp_files_a_killed_writer_left(tmp_path, caplog):
    """A service killed inside a pass leaves its staged records' and views' temp files; the
    next one removes them under the lock, and nothing else (records, views, the lock, other
    files, other writers' temp files)."""
    assert Registry(tmp_path).sweep_temps() == 0 and not (tmp_path / ".mam").exists()  # no folder: made by no one
    reg = Registry(tmp_path)
    rec = reg.register(session="gpu-box")
    jobs = reg.record_path(rec["job_id"]).parent
    left = [jobs / f".{rec['job_id']}.json.k3_x9qz1.tmp", jobs / ".0a1b2c3d.json.abcdefgh.tmp"]
    kept = [jobs / "notes.tmp", jobs / ".0a1b2c3d.json.tmp", jobs / ".unrelated.json.abcdefgh.tmp"]
    for path in left + kept:
        path.write_bytes(b'{"half": ')
    views = names.job_logs_dir(tmp_path, rec["job_id"])
    left += [views / ".status.json.k3_x9qz1.tmp", views / ".meta.json.abcdefgh.tmp"]
    kept += [views / ".agent.1.log.abcdefgh.tmp", views / ".status.json.tmp",  # another writer's; no random part
             tmp_path / ".mam" / "logs" / "notajob" / ".status.json.abcdefgh.tmp"]
    kept[-1].parent.mkdir()
    for path in left[2:] + kept[3:]:
        path.write_bytes(b'{"half": ')
    hostile = jobs / ".0e0e0e0e.json.folder1.tmp"
    hostile.mkdir()  # a folder with a temp file's name: said and left, the sweep goes on
    (tmp_path / ".mam" / "logs" / "0f0f0f0f").write_bytes(b"a file where a job's folder would be")
    assert reg.sweep_temps() == 4
    assert [path.exists() for path in left] == [False, False, False, False]
    assert all(path.exists() for path in kept) and hostile.is_dir()
    assert f"cannot remove {hostile} (EISDIR" in caplog.text
    assert reg.get(rec["job_id"])["status"] == "pending" and (jobs / ".lock").exists()
    assert (views / "status.json").exists() and (views / "meta.json").exists()


# ---------------------------------------------------------------- commands

class Tty(io.StringIO):
    def isatty(self):
        return True


def _secrets(reg):
    out = []
    for record in reg.list()[0]:
        out += [record["auth_token"], record["dispatch_token"]]
    return out


def _populated(reg):
    rec = reg.register(session="gpu-box")
    started(reg, rec)
    reg.close(rec["job_id"], "deadline_timeout")
    reg.register(session="cpu-box")
    return rec


def test_s8_jobs_and_show_json_redact_tokens(reg, tmp_path):
    rec = _populated(reg)
    out = io.StringIO()
    assert cli_jobs(workspace=tmp_path, status=None, as_json=False, stream=out) == 0
    rows = [json.loads(line) for line in out.getvalue().splitlines()]
    assert len(rows) == 2 and all(r["auth_token"] == "<set>" and r["dispatch_token"] == "<set>" for r in rows)
    out = io.StringIO()
    assert cli_jobs(workspace=tmp_path, status="error", as_json=True, stream=out) == 0
    assert [json.loads(line)["job_id"] for line in out.getvalue().splitlines()] == [rec["job_id"]]
    out = io.StringIO()
    assert cli_show(workspace=tmp_path, job_id=rec["job_id"], as_json=False, stream=out) == 0
    shown = json.loads(out.getvalue())
    assert shown["record"]["status"] == "error"
    assert [line["event"] for line in shown["audit"]] == ["registered", "started", "status_changed",
                                                          "status_changed"]
    assert shown["audit"][1]["data"]["dispatch_token"] == "<set>"
    text = out.getvalue()
    for secret in _secrets(reg):
        assert secret not in text


def test_s8_jobs_and_show_tty_tables_redact_tokens(reg, tmp_path):
    rec = _populated(reg)
    out = Tty()
    cli_jobs(workspace=tmp_path, status=None, as_json=False, stream=out)
    table = out.getvalue()
    assert table.splitlines()[0].split()[:3] == ["JOB", "STATUS", "RUNNER"]
    assert rec["job_id"] in table and "deadline_timeout" in table
    out2 = Tty()
    cli_show(workspace=tmp_path, job_id=rec["job_id"], as_json=False, stream=out2)
    assert "running -> error by operator" in out2.getvalue()
    for secret in _secrets(reg):
        assert secret not in table and secret not in out2.getvalue()
    empty = Tty()
    (tmp_path / "none").mkdir()  # an empty workspace (one that does not exist is exit 64: test_cli_views.py)
    cli_jobs(workspace=tmp_path / "none", status=None, as_json=False, stream=empty)
    assert empty.getvalue() == "(no jobs)\n"


def test_s8_jobs_reports_corrupt_records_and_exits_1(reg, tmp_path, capsys):
    rec = reg.register(session="gpu-box")
    reg.register(session="gpu-box", job_id="918b0612")
    reg.record_path("918b0612").write_text("garbage")
    out = io.StringIO()
    assert cli_jobs(workspace=tmp_path, status=None, as_json=True, stream=out) == 1
    assert json.loads(out.getvalue())["job_id"] == rec["job_id"]
    assert "ERROR: job 918b0612: record" in capsys.readouterr().err


@pytest.mark.parametrize("prog", ["mam-orch", "mam-runner"])
def test_s9_jobs_show_commands_exit_codes_and_no_secrets(reg, tmp_path, capsys, prog):
    app = orch_app if prog == "mam-orch" else runner_app
    rec = _populated(reg)

    def run(*argv):
        with pytest.raises(SystemExit) as info:
            cli.run(app, prog, list(argv))
        return info.value.code, capsys.readouterr()

    code, io_ = run("jobs", "--workspace", str(tmp_path))
    assert code == 0 and len(io_.out.splitlines()) == 2
    code, io_ = run("show", rec["job_id"], "--json", "--workspace", str(tmp_path))
    assert code == 0 and json.loads(io_.out)["record"]["job_id"] == rec["job_id"]
    for secret in _secrets(reg):
        assert secret not in io_.out and secret not in io_.err
    assert run("jobs", "--status", "bogus", "--workspace", str(tmp_path))[0] == 64
    assert run("show", "NOTANID", "--workspace", str(tmp_path))[0] == 64
    code, io_ = run("show", "12345678", "--workspace", str(tmp_path))
    assert code == 1 and "no record" in io_.err and io_.out == ""
    code, io_ = run("jobs", "--help")
    assert code == 0 and "--status" in io_.out


def test_redact_masks_tokens_at_any_depth():
    obj = {"auth_token": "s", "a": [{"dispatch_token": ""}], "b": {"c": {"dispatch_token": "x"}}}
    assert redact(obj) == {"auth_token": "<set>", "a": [{"dispatch_token": "<unset>"}],
                           "b": {"c": {"dispatch_token": "<set>"}}}


# ------------------------------------------------------------- transaction

def test_s8_transaction_commits_at_the_end_and_writes_nothing_on_an_exception(reg):
    rec = reg.register(session="gpu-box")
    jid = rec["job_id"]
    before = snapshot(reg, jid)
    with pytest.raises(RuntimeError), reg.transaction(jid) as txn:
        seq = txn.take_seq("started", **ident(rec))
        txn.log(payload_for(jid, rec, "started")(seq))
        raise RuntimeError("signing failed")
    assert snapshot(reg, jid) == before
    with reg.transaction(jid) as txn:
        seq = txn.take_seq("started", **ident(rec))
        txn.log(payload_for(jid, rec, "started")(seq))
        assert reg.get(jid)["status"] == "pending"  # nothing is written before the block ends
    after = reg.get(jid)
    assert seq == 1 and after["status"] == "running" and after["last_seq"] == 1
    events = [line["event"] for line in reg.audit(jid)]
    assert events[-2:] == ["started", "status_changed"]


def test_s8_transaction_refuses_a_stale_worker_before_anything_is_queued(reg):
    rec = reg.register(session="gpu-box")
    jid = rec["job_id"]
    before = snapshot(reg, jid)
    with pytest.raises(StaleTransition), reg.transaction(jid) as txn:
        txn.take_seq("started", attempt_id=2, dispatch_token=rec["dispatch_token"])
    with pytest.raises(UsageError, match="event"), reg.transaction(jid) as txn:
        txn.take_seq("state", **ident(rec))
    assert snapshot(reg, jid) == before


def test_s8_speed_an_event_with_a_status_change_costs_three_fsyncs(reg, monkeypatch):
    """`started` on a runner = one audit write for the event line and its
    `status_changed` line (ONE fsync) + the record (file + folder fsync); the `status.json`
    view is replaced without fsync. Both lines are on disk, in order."""
    rec = reg.mirror(job_id="918b0612", session="gpu-box", attempt_id=1, dispatch_token="0" * 32,
                     auth_token="a" * 43, contract=Contract(), origin="hub", source="runner")
    real_fsync, calls = os.fsync, []
    monkeypatch.setattr(os, "fsync", lambda fd: (calls.append(fd), real_fsync(fd))[1])
    reg.record_event("918b0612", attempt_id=1, dispatch_token="0" * 32, event="started",
                     build=payload_for("918b0612", rec, "started"), source="runner")
    assert len(calls) == 3
    lines = reg.audit("918b0612")
    assert [line["event"] for line in lines[-2:]] == ["started", "status_changed"]
    assert json.loads((reg.logs_dir("918b0612") / "status.json").read_text())["status"] == "running"
