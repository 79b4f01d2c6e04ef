"""PROTOCOL §14 on the hub registry, no broker: `queued` records and their terms,
the queue plan of a record (avoid_session, a redispatch's target), `queue_timeout`, retries
(`retry_reason`, `retry_attempt`), `requeue` and `show`'s attempts."""

from __future__ import annotations

import io
import time

import pytest
from harness.workspace import TEST_SECRET
from test_hub_watch import RecordingClient, deliver

from mam.orchestrator import queuewait
from mam.orchestrator.queue import Fleet, RunnerView, plan, queue_order
from mam.orchestrator.queuewait import (
    PresenceFeed,
    close_queue_timeout,
    queued_job,
    requeue,
    retry_attempt,
    retry_reason,
)
from mam.orchestrator.watch import Watcher, WatchOptions
from mam.shared.cli import render
from mam.shared.config import BrokerConfig
from mam.shared.protocol import crypto, names, wire
from mam.shared.protocol.codes import JobStatus
from mam.shared.protocol.errors import ExitCode, UsageError
from mam.shared.store.records import QueueTerms, Refusal, moved
from mam.shared.store.registry import Registry
from mam.shared.transport.mqtt import Message

KEYS = crypto.derive_keys("k" * 40)
KEYS_W = crypto.derive_keys(TEST_SECRET)


@pytest.fixture
def reg(tmp_path) -> Registry:
    return Registry(tmp_path)


def fleet_of(*sessions: str, max_jobs: int = 1, labels: tuple[str, ...] = ("x",),
             repos: tuple[str, ...] = ()) -> Fleet:
    fleet = Fleet()
    for session in sessions:
        fleet.update(RunnerView(session=session, runner_id="a" * 32, status="online", labels=frozenset(labels),
                                max_jobs=max_jobs, running=frozenset(), verified=True, seen_at=time.monotonic(),
                                repos=frozenset(repos)))
    return fleet


def labelled(reg: Registry, *, priority: int = 0, retries: int = 0, retry_on: tuple[str, ...] | None = None) -> dict:
    terms = QueueTerms(target_labels=("x",), priority=priority, retries=retries)
    if retry_on is not None:
        terms = terms._replace(retry_on=retry_on)
    return reg.register(session=None, queue=terms)


def test_s14_register_queued_with_terms_and_a_registered_line(reg) -> None:
    record = labelled(reg, priority=3, retries=2)
    assert (record["status"], record["session"], record["agent_session"]) == ("queued", "", "")
    assert record["target"] == {"labels": ["x"]} and record["priority"] == 3 and record["retries"] == 2
    assert record["retry_on"] == ["agent_blocked", "deadline_timeout", "runner_lost", "lease_lost"]
    assert record["queue_timeout_sec"] == 86400 and reg.get(record["job_id"])["status"] == "queued"
    (line,) = reg.audit(record["job_id"])
    assert (line["event"], line["status"]) == ("registered", "queued")
    assert reg.list("queued")[0] == [reg.get(record["job_id"])]


@pytest.mark.parametrize("terms, message", [
    (QueueTerms(), "give --session NAME or --labels"),
    (QueueTerms(target_session="a", target_labels=("x",)), "not both"),
    (QueueTerms(target_labels=("X",)), "label 'X' is invalid"),
    (QueueTerms(target_labels=("x",), retries=11), "--retries 11"),
    (QueueTerms(target_labels=("x",), retry_on=("error", "bogus")), "--retry-on"),
    (QueueTerms(target_labels=("x",), retry_on=()), "--retry-on"),
    (QueueTerms(target_labels=("x",), queue_timeout_sec=0), "--queue-timeout 0"),
    (QueueTerms(target_labels=("x",), group="../etc"), "--group '../etc' is invalid"),
    (QueueTerms(target_labels=("x",), group="a\nb"), "--group 'a.nb' is invalid"),
    (QueueTerms(target_labels=("x",), group="g" * 65), "is invalid: expected 1-64 characters"),
    (QueueTerms(target_labels=("x",), group="rel", group_limit=0), "--group-limit 0"),
    (QueueTerms(target_labels=("x",), group="rel", group_limit=1001), "--group-limit 1001"),
    (QueueTerms(target_labels=("x",), group_limit=2), "--group-limit goes with --group NAME"),
])
def test_s14_bad_terms_are_refused_before_anything_is_written(reg, terms, message) -> None:
    with pytest.raises(UsageError, match=message):
        reg.register(session=terms.target_session, queue=terms)
    assert reg.list()[0] == []


def test_s14_a_groups_terms_are_kept_in_the_record_and_read_by_the_queue(reg) -> None:
    record = reg.register(session=None, queue=QueueTerms(target_labels=("x",), group="release-1.2", group_limit=2))
    assert (record["group"], record["group_limit"]) == ("release-1.2", 2)
    job = queued_job(reg.get(record["job_id"]))
    assert (job.group, job.group_limit) == ("release-1.2", 2)
    plain = queued_job(labelled(reg))
    assert (plain.group, plain.group_limit) == (None, 1) and "group" not in reg.get(plain.job_id)


def test_s14_jobs_queued_within_one_second_leave_first_in_first_out(reg) -> None:
    ids = [labelled(reg)["job_id"] for _ in range(50)]  # fast: many of them queued in one second
    queued = [queued_job(reg.get(job_id)) for job_id in sorted(ids)]  # job-id order is random order
    slots = fleet_of("gpu-box", max_jobs=50)
    assert [job_id for job_id, _ in plan(queued, slots, time.monotonic(), 210.0)] == ids
    assert [job.job_id for job in sorted(queued, key=queue_order)] == ids


def pick(reg: Registry, job_id: str, fleet: Fleet) -> str | None:
    """The session the hub engine's queue plan (§14 Matching) gives this queued record now."""
    picks = dict(plan([queued_job(reg.get(job_id))], fleet, time.monotonic(), 60.0))
    return picks.get(job_id)


def test_s14_a_job_that_left_the_queue_is_never_published(reg) -> None:
    record = labelled(reg)
    reg.close(record["job_id"], "cancelled", source="operator")
    with pytest.raises(Refusal):
        queuewait.mark_published(reg, record["job_id"], "r1")


def test_s14_queue_timeout_closes_only_a_queued_job(reg) -> None:
    record = labelled(reg)
    closed = close_queue_timeout(reg, record["job_id"])
    assert (closed["status"], closed["close_reason"]) == ("error", "queue_timeout")
    assert close_queue_timeout(reg, record["job_id"]) == reg.get(record["job_id"])
    assert retry_reason(reg.get(record["job_id"])) is None  # never retried


def _ended(reg: Registry, job_id: str, close_reason: str | None) -> None:
    queuewait.mark_published(reg, job_id, "r1")
    with reg.transaction(job_id) as txn:
        txn.update(moved(txn.record, JobStatus.ERROR, close_reason=close_reason), source="operator", reason="t")


def test_s14_retry_reasons_follow_retry_on_and_the_count(reg) -> None:
    record = labelled(reg, retries=1)
    _ended(reg, record["job_id"], "runner_lost")
    assert retry_reason(reg.get(record["job_id"])) == "runner_lost"
    other = labelled(reg, retries=1)
    _ended(reg, other["job_id"], None)  # the runner's own error: not in the default retry_on
    assert retry_reason(reg.get(other["job_id"])) is None
    third = labelled(reg, retries=1, retry_on=("error",))
    _ended(reg, third["job_id"], None)
    assert retry_reason(reg.get(third["job_id"])) == "error"
    never = labelled(reg, retries=0)
    _ended(reg, never["job_id"], "agent_blocked")
    assert retry_reason(reg.get(never["job_id"])) is None


def _runner_error(reg: Registry, job_id: str, data: dict) -> None:
    queuewait.mark_published(reg, job_id, "r1")
    with reg.transaction(job_id) as txn:
        txn.store_event({"event": "error", "seq": 1, "detail": "lease_lost: ...", "data": data})


def test_s10_a_runners_lease_lost_error_is_retried_as_lease_lost_and_its_attempt_says_so(reg) -> None:
    record = labelled(reg, retries=1)
    job_id = record["job_id"]
    _runner_error(reg, job_id, {"exit_code": 137, "lease_lost": True})
    assert reg.get(job_id)["lease_lost"] is True and retry_reason(reg.get(job_id)) == "lease_lost"
    new = retry_attempt(reg, job_id, "lease_lost", None, None)
    assert new is not None and new["attempt_id"] == 2 and "lease_lost" not in new
    assert new["attempt_history"][-1]["lease_lost"] is True
    assert render.attempts(new)[0]["outcome"] == "error (lease_lost)"  # show, the dashboard's job page
    for data in ({"exit_code": 137, "lease_lost": "yes"}, {"exit_code": 1}):  # only `true` says it
        other = labelled(reg, retries=1)
        _runner_error(reg, other["job_id"], data)
        assert "lease_lost" not in reg.get(other["job_id"]) and retry_reason(reg.get(other["job_id"])) is None
    unwanted = labelled(reg, retries=1, retry_on=("runner_lost",))
    _runner_error(reg, unwanted["job_id"], {"exit_code": 137, "lease_lost": True})
    assert retry_reason(reg.get(unwanted["job_id"])) is None


def test_s14_retry_attempt_queues_attempt_2_with_fresh_tokens_avoiding_the_runner(reg) -> None:
    record = labelled(reg, retries=1)
    job_id = record["job_id"]
    _ended(reg, job_id, "deadline_timeout")
    old = reg.get(job_id)
    new = retry_attempt(reg, job_id, "deadline_timeout", None, None)
    assert new is not None and (new["status"], new["attempt_id"], new["retried"]) == ("queued", 2, 1)
    assert new["avoid_session"] == "r1" and new["auth_token"] != old["auth_token"]
    assert new["dispatch_token"] != old["dispatch_token"] and new["last_seq"] == 0
    assert old["auth_token"] in new["earlier_auth_tokens"]
    (retry,) = [line for line in reg.audit(job_id) if line["event"] == "retry"]
    assert (retry["attempt_id"], retry["reason"], retry["next_attempt"]) == (1, "deadline_timeout", 2)
    assert retry_reason(new) is None  # still queued
    assert retry_attempt(reg, job_id, "deadline_timeout", None, None) is None  # nothing to retry now
    # the next plan prefers another runner, and takes r1 only when it is the only one
    assert pick(reg, job_id, fleet_of("r1", "r2")) == "r2"
    queuewait.mark_published(reg, job_id, "r2")
    rows = render.attempts(reg.get(job_id))
    assert [(r["attempt_id"], r["session"], r["outcome"]) for r in rows] == [
        (1, "r1", "error (deadline_timeout)"), (2, "r2", "pending")]


def test_s8_s14_requeue_is_the_operators_redispatch_through_the_queue(reg) -> None:
    record = labelled(reg)
    job_id = record["job_id"]
    with pytest.raises(Refusal, match="cancel it first"):
        requeue(reg, job_id)
    reg.close(job_id, "cancelled", source="operator")
    new = requeue(reg, job_id, session="gpu-box")
    assert (new["status"], new["attempt_id"], new["target"]) == ("queued", 2, {"session": "gpu-box"})
    assert pick(reg, job_id, fleet_of("r1")) is None  # r1 is not gpu-box
    assert pick(reg, job_id, fleet_of("gpu-box", labels=())) == "gpu-box"


def test_s14_presence_feed_refuses_hostile_presence_and_tells_a_lost_runner() -> None:
    feed = PresenceFeed(KEYS, "python/mqtt")
    topic = names.presence_topic("r1", "python/mqtt")
    good = wire.Presence.build("r1", "a" * 32, "online", host="h", version="1", max_jobs=1, labels=["x"])
    assert feed.handle(topic, wire.encode(crypto.sign(good.to_dict(), KEYS.sign_key)))
    assert feed.fleet.known_labels() == frozenset({"x"}) and not feed.lost("r1", "a" * 32)
    for raw in (b"\xff", b"[]", b'{"kind": "presence", "labels": ["X"]}', b""):
        assert feed.handle(topic, raw)  # presence topic: taken (and refused), never raised
    assert feed.handle("python/mqtt/jobs/0badcafe/events", b"{}") is False
    offline = wire.Presence.build("r1", "a" * 32, "offline", host="h", version="1", max_jobs=1, labels=["x"])
    feed.handle(topic, wire.encode(crypto.sign(offline.to_dict(), KEYS.sign_key)))
    assert feed.lost("r1", "a" * 32)
    replaced = wire.Presence.build("r1", "b" * 32, "online", host="h", version="1", max_jobs=1)
    feed.handle(topic, wire.encode(crypto.sign(replaced.to_dict(), KEYS.sign_key)))
    assert feed.lost("r1", "a" * 32) and not feed.lost("r1", "b" * 32)


def test_s14_an_idle_close_of_a_lost_runner_is_runner_lost_and_presence_reaches_the_hook(reg) -> None:
    rec = reg.register(session="gpu-box")
    client = RecordingClient()
    deliver(client, rec, 1, "started")
    presence_topic = names.presence_topic("gpu-box", client.config.topic_root)
    client.messages.put(Message(presence_topic, b"{}", True))
    watcher = Watcher(reg, rec["job_id"], client=client, keys=KEYS_W,  # type: ignore[arg-type]
                      options=WatchOptions(remote=True, ack_timeout_s=5, idle_timeout_s=0.3), out=io.StringIO())
    seen: list[str] = []
    watcher.on_other = lambda topic, raw: seen.append(topic)
    watcher.runner_lost = lambda: True
    assert watcher.run() == ExitCode.TIMEOUT
    assert seen == [presence_topic]
    after = reg.get(rec["job_id"])
    assert (after["status"], after["close_reason"]) == ("error", "runner_lost")
    assert [topic.rsplit("/", 1)[1] for topic, _p, _r in client.published] == ["dispatch", "control"]


def test_s14_watch_of_a_job_that_timed_out_in_the_queue_exits_2(reg) -> None:
    record = labelled(reg)
    close_queue_timeout(reg, record["job_id"])
    watcher = Watcher(reg, record["job_id"], config=BrokerConfig(), out=io.StringIO())
    assert watcher.run() == ExitCode.TIMEOUT
