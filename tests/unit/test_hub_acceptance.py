"""PROTOCOL §3.2 (and §4 for states): every acceptance rule through the one
pure function `acceptance.accept`, the registry side (`mirror_event`), and the
watcher acting on the verdicts. No broker."""

from __future__ import annotations

import io
import json
import logging

import pytest

from mam.orchestrator.acceptance import (
    MISSING_KEPT,
    Accepted,
    Refused,
    Seen,
    accept,
    mirror_event,
    missing_after,
)
from mam.orchestrator.watch import Watcher, WatchOptions
from mam.shared.config import BrokerConfig
from mam.shared.protocol import crypto, names, wire
from mam.shared.protocol.errors import UsageError
from mam.shared.store.registry import Refusal, Registry, StaleTransition

TS = "2026-06-20T14:49:30Z"


@pytest.fixture
def reg(tmp_path):
    return Registry(tmp_path)


@pytest.fixture
def rec(reg):
    return reg.register(session="gpu-box")


def event(record, seq, name="progress", *, token=None, attempt=None, job_id=None, exit_code=None, **fields):
    data = {"attempt_id": attempt or record["attempt_id"], "dispatch_token": record["dispatch_token"]}
    if exit_code is not None:
        data["exit_code"] = exit_code
    body = {"schema_version": 1, "seq": seq, "job_id": job_id or record["job_id"], "event": name,
            "timestamp": TS, "detail": "", "data": data, **fields}
    return wire.encode(crypto.sign_event(body, token or record["auth_token"]))


def state(record, seq, status="running", *, attempt=None, token=None):
    body = {"schema_version": 1, "seq": seq, "job_id": record["job_id"], "event": "state", "status": status,
            "last_event": "progress" if status == "running" else "completed", "timestamp": TS, "detail": "",
            "data": {"attempt_id": attempt or record["attempt_id"], "dispatch_token": record["dispatch_token"]}}
    return wire.encode(crypto.sign_event(body, token or record["auth_token"]))


def payload_for(job_id, record, event, **extra):
    """An unsigned §3 event as a dict (the registry side never checks the HMAC)."""
    def build(seq):
        return {"schema_version": 1, "seq": seq, "job_id": job_id, "event": event, "timestamp": "t",
                "detail": extra.get("detail", ""), "data": {"attempt_id": record["attempt_id"],
                                                            "dispatch_token": record["dispatch_token"],
                                                            "hmac_sig": "0" * 64}}
    return build


NOTHING_SEEN = Seen()


def judge(raw, record, seen=NOTHING_SEEN, kind="event"):
    return accept(raw, kind=kind, job_id=record["job_id"], record=record, seen=seen)


# ------------------------------------------------------------ rules 1-4

def test_s3_2_rule1_zero_length_is_ignored_silently(rec):
    verdict = judge(b"", rec)
    assert isinstance(verdict, Refused) and verdict.silent and verdict.message is None


@pytest.mark.parametrize("raw", [b"not json", b"[1, 2]", b"\xff\xfe{}", b'{"seq": 1}'])
def test_s3_2_rule1_not_a_utf8_json_event_is_malformed(rec, raw):
    verdict = judge(raw, rec)
    assert isinstance(verdict, Refused) and verdict.reason == "malformed" and not verdict.silent


@pytest.mark.parametrize("kind", ["event", "state"])
def test_s3_2_rule2_schema_version_is_schema_mismatch(rec, kind):
    raw = event(rec, 1, "started", schema_version=2) if kind == "event" else None
    if raw is None:
        body = json.loads(state(rec, 1))
        body["schema_version"] = 2
        raw = json.dumps(body).encode()
    verdict = judge(raw, rec, kind=kind)
    assert isinstance(verdict, Refused) and verdict.reason == "schema_mismatch"


def test_s3_2_rule3_other_job_is_unexpected_job(rec):
    verdict = judge(event(rec, 1, "started", job_id="0badcafe"), rec)
    assert isinstance(verdict, Refused) and verdict.reason == "unexpected_job" and "0badcafe" in verdict.detail


@pytest.mark.parametrize("kind", ["event", "state"])
def test_s3_2_rule4_missing_or_wrong_hmac(rec, kind):
    signed = event(rec, 1, "started", token="x" * 43) if kind == "event" else state(rec, 1, token="x" * 43)
    verdict = judge(signed, rec, kind=kind)
    assert isinstance(verdict, Refused) and verdict.reason == "HMAC verify failed"
    assert verdict.detail == f"{'events' if kind == 'event' else 'state'} seq 1"
    body = json.loads(signed)
    del body["data"]["hmac_sig"]
    verdict = judge(json.dumps(body).encode(), rec, kind=kind)
    assert isinstance(verdict, Refused) and verdict.reason == "HMAC verify failed"


# ------------------------------------------------------------ rules 5-7

@pytest.mark.parametrize("kind", ["event", "state"])
def test_s3_2_rule5_other_attempt_or_token_is_stale_attempt(rec, kind):
    raw = event(rec, 1, "started", attempt=2) if kind == "event" else state(rec, 1, attempt=2)
    verdict = judge(raw, rec, kind=kind)
    assert isinstance(verdict, Refused) and verdict.reason == "stale_attempt"
    assert verdict.message is not None and verdict.message.attempt_id == 2
    other = dict(rec, dispatch_token="f" * 32)
    raw = event(other, 1, "started", token=rec["auth_token"])
    verdict = judge(raw, rec)
    assert isinstance(verdict, Refused) and verdict.reason == "stale_attempt"
    assert verdict.detail == "the dispatch token is not the current one"


def test_s3_2_rule6_seq_not_above_highest_is_duplicate(rec):
    for seq in (1, 3):
        verdict = judge(event(rec, seq), rec, Seen(highest_seq=3))
        assert isinstance(verdict, Refused) and verdict.reason == "duplicate"


def test_s3_2_rule6_seq_jump_is_accepted_with_a_gap(rec):
    verdict = judge(event(rec, 4), rec, Seen(highest_seq=1))
    assert isinstance(verdict, Accepted) and verdict.gap == (2, 4) and verdict.message.seq == 4
    verdict = judge(event(rec, 2), rec, Seen(highest_seq=1))
    assert isinstance(verdict, Accepted) and verdict.gap is None


def test_s3_2_rule6_a_missing_seq_arriving_late_is_accepted_once(rec):
    verdict = judge(event(rec, 4), rec, Seen(highest_seq=1))
    assert isinstance(verdict, Accepted) and verdict.missing == (2, 3) and not verdict.late
    late = judge(event(rec, 2, "permission_required"), rec, Seen(highest_seq=4, missing=frozenset({2, 3})))
    assert isinstance(late, Accepted) and late.late and late.missing == (3,) and late.gap is None
    again = judge(event(rec, 2, "permission_required"), rec, Seen(highest_seq=4, missing=frozenset({3})))
    assert isinstance(again, Refused) and again.reason == "duplicate"  # arrived once: a replay now
    never_missing = judge(event(rec, 1), rec, Seen(highest_seq=4, missing=frozenset({2, 3})))
    assert isinstance(never_missing, Refused) and never_missing.reason == "duplicate"
    after_end = judge(event(rec, 3), rec, Seen(highest_seq=5, terminal="completed", missing=frozenset({3})))
    assert isinstance(after_end, Refused) and after_end.reason == "after_terminal"
    in_order = judge(event(rec, 5), rec, Seen(highest_seq=4, missing=frozenset({3})))
    assert isinstance(in_order, Accepted) and in_order.missing is None and not in_order.late


def test_s3_2_rule6_the_missing_seqs_kept_are_the_highest_few():
    assert missing_after(2, Seen(highest_seq=1)) is None
    assert missing_after(10 + 3 * MISSING_KEPT, Seen(highest_seq=1)) == tuple(
        range(10 + 2 * MISSING_KEPT, 10 + 3 * MISSING_KEPT))
    assert missing_after(9, Seen(highest_seq=7, missing=frozenset({2}))) == (2, 8)


def test_s3_2_rule6_a_record_with_hostile_missing_seqs_is_read_as_none_missing(reg, rec):
    for junk in ("2", [True, "3", None, 2.5], {"2": 1}):
        assert Seen.of_record(dict(rec, missing_seqs=junk)).missing == frozenset()
    assert Seen.of_record(dict(rec, missing_seqs=[True, 4])).missing == frozenset({4})


def test_s3_2_rule7_after_terminal_and_duplicate_comes_first(rec):
    verdict = judge(event(rec, 6), rec, Seen(highest_seq=5, terminal="error"))
    assert isinstance(verdict, Refused) and verdict.reason == "after_terminal"
    verdict = judge(event(rec, 5, "error", exit_code=1), rec, Seen(highest_seq=5, terminal="error"))
    assert isinstance(verdict, Refused) and verdict.reason == "duplicate" and verdict.message.terminal


def test_s4_states_are_never_duplicate_nor_after_terminal(rec):
    verdict = judge(state(rec, 1), rec, Seen(highest_seq=3, terminal="completed"), kind="state")
    assert isinstance(verdict, Accepted) and verdict.gap is None
    verdict = judge(state(rec, 4, "completed"), rec, Seen(highest_seq=3), kind="state")
    assert isinstance(verdict, Accepted) and verdict.message.terminal


def test_s3_2_decoded_messages_are_judged_from_rule3(rec):
    message = wire.decode(event(rec, 1, "started"), "event")
    assert isinstance(judge(message, rec), Accepted)
    unsigned = wire.Event.build(rec["job_id"], 1, "started", attempt_id=1, dispatch_token=rec["dispatch_token"])
    verdict = judge(unsigned, rec)
    assert isinstance(verdict, Refused) and verdict.reason == "HMAC verify failed"


def test_seen_of_record_and_merged(reg, rec):
    assert Seen.of_record(rec) == Seen(0, None)
    closed = reg.close(rec["job_id"], "cancelled")
    assert Seen.of_record(closed) == Seen(0, "cancelled")
    assert Seen(4, None).merged(Seen(2, "error")) == Seen(4, "error")


# ------------------------------------------- registry side (mirror_event)

def test_s3_2_accept_event_mirrors_started_and_terminal_logs_gaps_and_refuses(reg):
    rec = reg.register(session="gpu-box")
    jid = rec["job_id"]
    first = mirror_event(reg, jid, payload_for(jid, rec, "started")(1))
    assert first.gap is None and first.record["status"] == "running"
    with pytest.raises(Refusal) as info:
        mirror_event(reg, jid, payload_for(jid, rec, "progress")(1))
    assert info.value.reason == "duplicate"
    gap = mirror_event(reg, jid, payload_for(jid, rec, "progress")(4))
    assert gap.gap == (2, 4) and gap.record["last_seq"] == 4
    seq_gap = [line for line in reg.audit(jid) if line["event"] == "seq_gap"]
    assert seq_gap and (seq_gap[0]["expected"], seq_gap[0]["got"]) == (2, 4)
    terminal = payload_for(jid, rec, "error")(5)
    terminal["data"]["exit_code"] = 7
    end = mirror_event(reg, jid, terminal)
    assert end.record["status"] == "error" and end.record["exit_code"] == 7
    # a re-delivered retained terminal is a duplicate (step 6 comes before step 7)
    with pytest.raises(Refusal) as info:
        mirror_event(reg, jid, terminal)
    assert info.value.reason == "duplicate"
    with pytest.raises(Refusal) as info:
        mirror_event(reg, jid, payload_for(jid, rec, "progress")(6))
    assert info.value.reason == "after_terminal"


def test_s3_2_accept_event_refuses_stale_and_malformed(reg):
    rec = reg.register(session="gpu-box")
    jid = rec["job_id"]
    bad = payload_for(jid, rec, "started")(1)
    bad["data"]["dispatch_token"] = "f" * 32
    with pytest.raises(StaleTransition):
        mirror_event(reg, jid, bad)
    bad["data"] = "nope"
    with pytest.raises(StaleTransition):
        mirror_event(reg, jid, bad)
    for seq in (0, -1, "1", True, None):
        with pytest.raises(UsageError, match="seq"):
            mirror_event(reg, jid, dict(payload_for(jid, rec, "started")(1), seq=seq))
    with pytest.raises(UsageError, match="event"):
        mirror_event(reg, jid, dict(payload_for(jid, rec, "started")(1), event="state"))
    assert reg.get(jid)["status"] == "pending"




def test_s3_2_mirror_event_refuses_operator_sources(reg, rec):
    with pytest.raises(UsageError, match="source"):
        mirror_event(reg, rec["job_id"], payload_for(rec["job_id"], rec, "started")(1), source="operator")


# ------------------------------------------------------ the watcher's side

def watcher(reg, rec, *, remote):
    return Watcher(reg, rec["job_id"], config=BrokerConfig(), out=io.StringIO(),
                   options=WatchOptions(remote=remote))


def topic(rec, leaf):
    return names.job_topic(rec["job_id"], leaf, BrokerConfig().topic_root)


def test_s3_2_watcher_logs_refusals_by_reason_and_emits_accepted_events(reg, rec, caplog):
    w = watcher(reg, rec, remote=False)
    caplog.set_level(logging.WARNING, "mam.watch")
    assert w.handle(topic(rec, "events"), b"") is False
    assert w.handle(topic(rec, "events"), b"nope") is False
    assert w.handle(topic(rec, "events"), event(rec, 1, "started", attempt=2)) is False
    assert w.handle(topic(rec, "events"), event(rec, 1, "started")) is True
    assert w.handle(topic(rec, "events"), event(rec, 1, "started")) is False
    assert w.handle(topic(rec, "events"), event(rec, 3)) is True
    assert w.refusals == ["malformed", "stale_attempt", "duplicate"]
    assert "refused message: stale_attempt" in caplog.text and "zero" not in caplog.text
    assert [json.loads(line)["seq"] for line in w.out.getvalue().splitlines()] == [1, 3]
    gaps = [line for line in reg.audit(rec["job_id"]) if line["event"] == "seq_gap"]
    assert [(g["expected"], g["got"], g["source"]) for g in gaps] == [(2, 3, "watch")]
    assert reg.get(rec["job_id"])["status"] == "pending"  # a non-remote watch mirrors nothing


def test_s10_remote_watcher_mirrors_accepted_events_and_resolves_after_terminal(reg, rec):
    jid = rec["job_id"]
    w = watcher(reg, rec, remote=True)
    assert w.handle(topic(rec, "events"), event(rec, 1, "started")) is True
    assert reg.get(jid)["status"] == "running" and reg.get(jid)["last_seq"] == 1
    assert w.handle(topic(rec, "events"), event(rec, 3)) is True
    gaps = [line for line in reg.audit(jid) if line["event"] == "seq_gap"]
    assert [(g["expected"], g["got"]) for g in gaps] == [(2, 3)] and "source" not in gaps[0]
    reg.close(jid, "deadline_timeout")  # e.g. another shell closed it
    assert w.handle(topic(rec, "events"), event(rec, 4, "completed", exit_code=0)) is False
    assert w.refusals == ["after_terminal"] and w.terminal == "error"
    assert w.runner_ended is True  # refused, but the runner did report its end (§6 confirmation)
    assert reg.get(jid)["status"] == "error" and reg.get(jid)["last_seq"] == 3


def test_s3_2_remote_watcher_accepts_an_event_overtaken_on_the_wire_and_keeps_it_across_a_restart(reg, rec):
    """The runner records a permission request (seq 2) on one thread; its heartbeat (seq 3)
    reaches the wire first. The request still reaches the hub, once, even by a new service."""
    jid = rec["job_id"]
    w = watcher(reg, rec, remote=True)
    assert w.handle(topic(rec, "events"), event(rec, 1, "started")) is True
    assert w.handle(topic(rec, "events"), event(rec, 3)) is True
    assert reg.get(jid)["missing_seqs"] == [2] and reg.get(jid)["last_seq"] == 3
    restarted = watcher(reg, rec, remote=True)  # a service that started since: the record remembers
    restarted.highest_event = restarted.highest_any = 3
    assert restarted.handle(topic(rec, "events"), event(rec, 2, "permission_required")) is True
    assert [json.loads(line)["seq"] for line in restarted.out.getvalue().splitlines()] == [2]
    assert reg.get(jid)["missing_seqs"] == [] and reg.get(jid)["last_seq"] == 3
    assert restarted.highest_event == 3
    assert restarted.handle(topic(rec, "events"), event(rec, 2, "permission_required")) is False
    assert w.handle(topic(rec, "events"), event(rec, 2, "permission_required")) is False  # from the record
    assert restarted.refusals == ["duplicate"] and w.refusals == ["duplicate"]
    audit = [line.get("event") for line in reg.audit(jid)]
    assert audit.count("permission_required") == 1 and audit.count("seq_gap") == 1


def test_s3_2_a_watch_that_mirrors_nothing_accepts_a_late_event_once_from_its_memory(reg, rec):
    w = watcher(reg, rec, remote=False)
    assert w.handle(topic(rec, "events"), event(rec, 1, "started")) is True
    assert w.handle(topic(rec, "events"), event(rec, 3)) is True
    assert w.handle(topic(rec, "events"), event(rec, 2, "permission_required")) is True
    assert w.handle(topic(rec, "events"), event(rec, 2, "permission_required")) is False
    assert [json.loads(line)["seq"] for line in w.out.getvalue().splitlines()] == [1, 3, 2]
    assert w.refusals == ["duplicate"] and "missing_seqs" not in reg.get(rec["job_id"])


def test_s3_2_mirror_event_fills_a_missing_seq_and_a_new_attempt_forgets_them(reg):
    rec = reg.register(session="gpu-box")
    jid = rec["job_id"]
    mirror_event(reg, jid, payload_for(jid, rec, "started")(1))
    assert mirror_event(reg, jid, payload_for(jid, rec, "progress")(4)).record["missing_seqs"] == [2, 3]
    filled = mirror_event(reg, jid, payload_for(jid, rec, "progress")(3))
    assert filled.gap is None and filled.record["missing_seqs"] == [2] and filled.record["last_seq"] == 4
    with pytest.raises(Refusal) as info:
        mirror_event(reg, jid, payload_for(jid, rec, "progress")(3))
    assert info.value.reason == "duplicate"


def test_s10_remote_watcher_reads_the_record_once_per_message_it_mirrors(reg, rec, monkeypatch):
    jid = rec["job_id"]
    w = watcher(reg, rec, remote=True)
    assert w.handle(topic(rec, "events"), event(rec, 1, "started")) is True
    reads = []
    real_find = Registry.find
    monkeypatch.setattr(Registry, "find", lambda self, job_id: reads.append(job_id) or real_find(self, job_id))
    assert w.handle(topic(rec, "events"), event(rec, 2, "completed", exit_code=0)) is True
    assert w.handle(topic(rec, "state"), state(rec, 2, "completed")) is False  # not newer than its event
    assert w.terminal == "completed" and reads == [jid, jid]  # the terminal's status from its own transaction


def test_s4_watcher_state_renews_only_when_newer_and_holds_a_terminal_state(reg, rec):
    w = watcher(reg, rec, remote=False)
    assert w.handle(topic(rec, "events"), event(rec, 1, "started")) is True
    assert w.handle(topic(rec, "state"), state(rec, 1)) is False  # not newer than the event
    assert w.handle(topic(rec, "state"), state(rec, 2, "completed")) is True
    assert w.runner_ended is True and w.terminal is None  # waits STATE_GRACE_S for the event
