"""The hub service's parts without a broker (PROTOCOL §14 "One hub process"):
the lock (a second service is refused naming the first's pid), the audit-log
follower of the thin CLI, and one `Watcher` driven by `handle` + `tick` as the
service drives it (the same §10 clocks as a watch's own loop)."""

from __future__ import annotations

import io
import json
import os
import time

import pytest
from harness.fake_mqtt import FakeBroker
from harness.hubclient import RecordingClient, event, started
from harness.workspace import TEST_SECRET

from mam.orchestrator.follow import AuditTail
from mam.orchestrator.hub import Hub, open_hub
from mam.orchestrator.hublock import HubLock, service_pid
from mam.orchestrator.queue import RunnerView
from mam.orchestrator.queuewait import close_queue_timeout, mark_published, settled
from mam.orchestrator.service import FULL_SCAN_S, HubService
from mam.orchestrator.watch import Watcher, WatchOptions
from mam.shared.config import write_env_file
from mam.shared.protocol import crypto, names, wire
from mam.shared.protocol.errors import ExitCode, UsageError
from mam.shared.store.changes import JobsWatch
from mam.shared.store.records import QueueTerms
from mam.shared.store.registry import Contract, Registry

KEYS = crypto.derive_keys(TEST_SECRET)


def test_s14_a_second_hub_lock_is_refused_naming_the_holders_pid(tmp_path):
    assert service_pid(tmp_path) is None  # nothing made, nothing held
    first = HubLock(tmp_path)
    first.acquire()
    try:
        assert service_pid(tmp_path) == os.getpid()
        with pytest.raises(UsageError, match=f"pid {os.getpid()}"):
            HubLock(tmp_path).acquire()
    finally:
        first.release()
    assert service_pid(tmp_path) is None
    again = HubLock(tmp_path)
    again.acquire()  # released: the next service takes it
    again.release()


def test_s14_the_audit_tail_returns_whole_lines_only(tmp_path):
    path = tmp_path / "events.ndjson"
    tail = AuditTail(path)
    assert tail.read() == []  # no file yet
    path.write_bytes(b'{"a": 1}\n{"b"')
    assert tail.read() == [{"a": 1}]
    with open(path, "ab") as file:
        file.write(b': 2}\nnot json\n[1]\n')
    assert tail.read() == [{"b": 2}]


def test_s14_an_attempt_about_to_be_retried_is_not_settled(tmp_path):
    record = {"status": "error", "close_reason": "runner_lost", "retries": 1, "retried": 0,
              "retry_on": ["runner_lost"]}
    assert not settled(record)  # type: ignore[arg-type]
    assert settled({**record, "retried": 1})  # type: ignore[arg-type]


def test_s10_handle_and_tick_drive_one_job_as_the_service_does(tmp_path):
    reg = Registry(tmp_path)
    record = reg.register(session="gpu-box", contract=Contract(heartbeat_sec=1, heartbeat_misses=2))
    client = RecordingClient()
    watcher = Watcher(reg, record["job_id"], client=client, keys=KEYS, out=io.StringIO(),
                      options=WatchOptions(remote=True, ack_only_before_first=True))
    start = time.monotonic()
    watcher.start_clocks(start, record)
    assert watcher.tick(start, poll=False) is None
    assert watcher.handle(names.events_topic(record["job_id"], client.config.topic_root), started(record))
    assert reg.get(record["job_id"])["status"] == "running"
    assert watcher.tick(time.monotonic() + 1.0, poll=False) is None  # inside the idle window (2 s)
    assert watcher.tick(time.monotonic() + 60.0, poll=False) == ExitCode.TIMEOUT  # silence: closed
    assert reg.get(record["job_id"])["close_reason"] == "deadline_timeout"


def test_s14_the_service_survives_hostile_messages_on_every_topic(tmp_path):
    reg = Registry(tmp_path)
    record = reg.register(session="gpu-box", contract=Contract(heartbeat_sec=1, heartbeat_misses=2))
    write_env_file(tmp_path / ".mam.env", {"MAM_DISPATCH_SECRET": TEST_SECRET}, overwrite=True)
    service = HubService(open_hub(tmp_path))
    service.client = RecordingClient()  # type: ignore[assignment]
    now = time.monotonic()
    service.scan(now)
    assert record["job_id"] in service.watchers
    root = service.config.topic_root
    hostile = [b"", b"\xff\x00", b"{", b"[]", b"null", json.dumps({"seq": -1}).encode(), b"x" * 100_000]
    topics = [names.events_topic(record["job_id"], root), names.state_topic(record["job_id"], root),
              names.events_topic("0badf00d", root), names.presence_topic("evil", root), f"{root}/jobs/x/events",
              f"{root}/elsewhere", names.dispatch_topic(record["job_id"], root)]
    for topic in topics:
        for payload in hostile:
            service.on_message(topic, payload, now)
    service.tick(now, None)
    assert reg.get(record["job_id"])["status"] == "pending"  # nothing forged got in
    service.on_message(names.events_topic(record["job_id"], root), started(record), now)
    assert reg.get(record["job_id"])["status"] == "running"  # and it still works



def test_s14_the_service_records_a_late_outcome_of_a_job_it_closed_itself(tmp_path):
    """serve's half of §14 Late terminals: after its own `deadline_timeout` close, the
    service keeps judging the job, so the runner's later `completed` is `late_outcome`
    (the same in-memory fake broker the runner's unit tests use)."""
    reg = Registry(tmp_path)
    record = reg.register(session="gpu-box", contract=Contract(heartbeat_sec=1, heartbeat_misses=2))
    write_env_file(tmp_path / ".mam.env", {"MAM_DISPATCH_SECRET": TEST_SECRET}, overwrite=True)
    broker = FakeBroker()
    service = HubService(Hub(reg, transport=broker.client))
    service.client = service.hub.connect("serve")
    now = time.monotonic()
    service.scan(now)
    topic = names.events_topic(record["job_id"], service.config.topic_root)
    service.on_message(topic, started(record), now)
    service.tick(now + 60.0, None)  # silence past K x N: the service closes it
    closed = reg.get(record["job_id"])
    assert (closed["status"], closed["close_reason"]) == ("error", "deadline_timeout")
    assert record["job_id"] not in service.watchers and record["job_id"] in service.late
    service.on_message(topic, event(record, 2, "completed", exit_code=0), now + 61.0)
    after = reg.get(record["job_id"])
    assert (after["status"], after["late_outcome"]) == ("error", "completed")  # the status stays (§8)
    assert record["job_id"] not in service.late  # judged once: no longer followed
    assert [line["terminal"] for line in reg.audit(record["job_id"]) if line["event"] == "late_terminal"] == [
        "completed"]


def test_s14_a_runner_going_offline_is_said_at_once_with_when_its_job_is_lost_and_what_then(tmp_path):
    reg = Registry(tmp_path)
    terms = QueueTerms(target_session="gpu-box", retries=1)
    record = reg.register(session=None, contract=Contract(heartbeat_sec=2, heartbeat_misses=5), queue=terms)
    write_env_file(tmp_path / ".mam.env", {"MAM_DISPATCH_SECRET": TEST_SECRET}, overwrite=True)
    service = HubService(open_hub(tmp_path))
    service.client = RecordingClient()  # type: ignore[assignment]
    root = service.config.topic_root

    def presence(status: str) -> bytes:
        body = wire.Presence.build("gpu-box", "a" * 32, status, host="h", version="1", max_jobs=1,
                                   running=[record["job_id"]] if status == "online" else [])
        return wire.encode(crypto.sign(body.to_dict(), KEYS.sign_key))

    now = time.monotonic()
    service.on_presence("gpu-box", presence("online"), now)
    mark_published(reg, record["job_id"], "gpu-box")
    service.scan(now)
    service.on_message(names.events_topic(record["job_id"], root), started(reg.get(record["job_id"])), now)
    service.on_presence("gpu-box", presence("offline"), now + 1.0)
    notes = [line["line"] for line in reg.audit(record["job_id"]) if line["event"] == "hub_note"]
    said = [line for line in notes if "went offline" in line]
    assert len(said) == 1, notes
    assert said[0].startswith("WARNING: job ") and "runner gpu-box went offline" in said[0]
    assert "attempt 1 is lost in 9 s unless it returns; then retry 1 of 1" in said[0], said[0]
    service.on_presence("gpu-box", presence("offline"), now + 2.0)  # said once, not on every presence
    assert len([n for n in (line.get("line", "") for line in reg.audit(record["job_id"])) if "went offline" in n]) == 1


def test_s14_a_runner_going_offline_is_said_for_its_own_jobs_and_a_moved_attempts_new_runner(tmp_path):
    """Only the lost runner's jobs are said (the others are not even looked at), and a job
    another process moved to another runner (a new attempt) is said when THAT runner goes."""
    reg = Registry(tmp_path)
    contract = Contract(heartbeat_sec=2, heartbeat_misses=5)
    mine = [reg.register(session=None, contract=contract, queue=QueueTerms(target_session="gpu-box"))
            for _ in range(2)]
    others = [reg.register(session=None, contract=contract, queue=QueueTerms(target_session=f"box-{n}"))
              for n in range(5)]
    write_env_file(tmp_path / ".mam.env", {"MAM_DISPATCH_SECRET": TEST_SECRET}, overwrite=True)
    service = HubService(open_hub(tmp_path))
    service.client = RecordingClient()  # type: ignore[assignment]
    root = service.config.topic_root

    def presence(session: str, status: str, running: list[str]) -> bytes:
        body = wire.Presence.build(session, "a" * 32, status, host="h", version="1", max_jobs=4,
                                   running=running if status == "online" else [])
        return wire.encode(crypto.sign(body.to_dict(), KEYS.sign_key))

    def said(job_id: str) -> list[str]:
        return [line["line"] for line in reg.audit(job_id) if "went offline" in line.get("line", "")]

    now = time.monotonic()
    for record, session in [*((record, "gpu-box") for record in mine),
                            *((record, f"box-{n}") for n, record in enumerate(others))]:
        service.on_presence(session, presence(session, "online", [record["job_id"]]), now)
        mark_published(reg, record["job_id"], session)
    service.scan(now)
    for record in [*mine, *others]:
        service.on_message(names.events_topic(record["job_id"], root), started(reg.get(record["job_id"])), now)
    service.on_presence("gpu-box", presence("gpu-box", "offline", []), now + 1.0)
    assert [len(said(record["job_id"])) for record in mine] == [1, 1]
    assert [said(record["job_id"]) for record in others] == [[]] * 5
    moved = others[0]["job_id"]  # `mam-orch redispatch --session cpu-box` from another shell
    reg.request_cancel(moved, reason="moved")
    reg.redispatch(moved, session="cpu-box")  # attempt 2, pending on cpu-box
    service.on_presence("cpu-box", presence("cpu-box", "online", [moved]), now + 2.0)
    service.consider(moved, now + 2.0)
    service.on_message(names.events_topic(moved, root), started(reg.get(moved)), now + 2.0)
    service.on_presence("cpu-box", presence("cpu-box", "offline", []), now + 3.0)
    assert len(said(moved)) == 1 and "runner cpu-box went offline" in said(moved)[0]


def test_s14_a_record_changed_twice_within_one_timestamp_tick_is_looked_at_again(tmp_path):
    """A file system stamps with a coarse clock: a second write within the same tick keeps
    the record's mtime, and the service's scan must still see it (here: a queued job closed
    by another process)."""
    reg = Registry(tmp_path)
    record = reg.register(session=None, queue=QueueTerms(target_session="gpu-box"))
    write_env_file(tmp_path / ".mam.env", {"MAM_DISPATCH_SECRET": TEST_SECRET}, overwrite=True)
    service = HubService(open_hub(tmp_path))
    service.client = RecordingClient()  # type: ignore[assignment]
    path = names.jobs_dir(tmp_path) / f"{record['job_id']}.json"
    seen = path.stat()
    service.scan(time.monotonic())
    assert record["job_id"] in service.queued
    close_queue_timeout(reg, record["job_id"])
    os.utime(path, ns=(seen.st_atime_ns, seen.st_mtime_ns))  # the same tick as the first write
    service.scan(time.monotonic())
    assert record["job_id"] not in service.queued


def watched_service(root, watch) -> HubService:
    """A service holding a records watch, as `_serve` does, past its first (full) scan."""
    write_env_file(root / ".mam.env", {"MAM_DISPATCH_SECRET": TEST_SECRET}, overwrite=True)
    service = HubService(open_hub(root))
    service.client = RecordingClient()  # type: ignore[assignment]
    service._records = watch
    service.scan(time.monotonic())
    return service


def test_s14_the_service_reads_the_records_its_watch_names_and_lists_the_folder_seldom(tmp_path, monkeypatch):
    watch = JobsWatch(tmp_path, logs=False)
    try:
        service = watched_service(tmp_path, watch)
        listed, real_scandir = [], os.scandir
        monkeypatch.setattr(os, "scandir", lambda path: listed.append(path) or real_scandir(path))
        reg = Registry(tmp_path)
        record = reg.register(session=None, queue=QueueTerms(target_session="gpu-box"))
        service.scan(time.monotonic())
        assert record["job_id"] in service.queued
        close_queue_timeout(reg, record["job_id"])  # another process closes it
        service.scan(time.monotonic())
        assert record["job_id"] not in service.queued
        assert names.jobs_dir(tmp_path) not in listed  # told by the watch, not by a listing
        service.scan(time.monotonic() + FULL_SCAN_S)  # what no watch shows: the folder, now and then
        assert listed.count(names.jobs_dir(tmp_path)) == 1
    finally:
        watch.close()


class ScriptedWatch:
    """A records watch that answers `changed` from a script (a set of job ids, or None)."""

    def __init__(self, *answers):
        self.answers = list(answers)

    def changed(self, timeout_s):
        return self.answers.pop(0)

    def close(self):
        pass


def test_s14_a_watch_that_lost_events_makes_the_next_scan_look_at_every_record(tmp_path):
    service = watched_service(tmp_path, ScriptedWatch(set(), set(), None))
    record = Registry(tmp_path).register(session=None, queue=QueueTerms(target_session="gpu-box"))
    service.scan(time.monotonic())  # its event was lost (the kernel's queue overflowed)
    assert record["job_id"] not in service.queued
    service.scan(time.monotonic())  # the watch says so: the whole folder is read
    assert record["job_id"] in service.queued


def test_s14_a_record_named_by_the_watch_and_removed_since_is_skipped_quietly(tmp_path, caplog):
    watch = JobsWatch(tmp_path, logs=False)
    try:
        service = watched_service(tmp_path, watch)
        reg = Registry(tmp_path)
        gone = reg.register(session=None, queue=QueueTerms(target_session="gpu-box"))
        reg.record_path(gone["job_id"]).unlink()
        (names.jobs_dir(tmp_path) / "0badf00d.json").write_bytes(b"\x00not json")  # hostile: a broken record
        with caplog.at_level("WARNING", logger="mam.serve"):
            service.scan(time.monotonic())
        assert gone["job_id"] not in service.queued and gone["job_id"] not in caplog.text
        assert "job 0badf00d: cannot read its record" in caplog.text  # said in one line; the service goes on
        kept = reg.register(session=None, queue=QueueTerms(target_session="gpu-box"))
        service.scan(time.monotonic())
        assert kept["job_id"] in service.queued
    finally:
        watch.close()


def test_s14_a_pending_attempt_no_runner_spoke_for_is_published_again_by_the_next_engine(tmp_path):
    """An engine killed between marking a job published and publishing its dispatch leaves it
    `pending` with no dispatch: the next engine, once the retained states are in, publishes
    that attempt's dispatch again (same attempt, same tokens) and says so; a pending attempt
    whose runner spoke, or a newer attempt, is left alone."""
    from mam.orchestrator.dispatch import save_brief

    reg = Registry(tmp_path)
    write_env_file(tmp_path / ".mam.env", {"MAM_DISPATCH_SECRET": TEST_SECRET}, overwrite=True)
    silent, spoke = (reg.register(session=None, queue=QueueTerms(target_session="gpu-box"))["job_id"]
                     for _ in range(2))
    for job_id in (silent, spoke):
        save_brief(reg, job_id, "echo hi")
        mark_published(reg, job_id, "gpu-box")  # ... and the engine was killed here
    service = HubService(open_hub(tmp_path))
    service.client = RecordingClient()  # type: ignore[assignment]
    service.scan(time.monotonic())
    assert service.unheard == {silent, spoke}
    root = service.config.topic_root
    service.on_message(names.events_topic(spoke, root), started(reg.get(spoke)), time.monotonic())  # it spoke
    service.republish_unheard()
    sent = [(topic, retain) for topic, _payload, retain in service.client.published]  # type: ignore[attr-defined]
    assert sent == [(names.dispatch_topic(silent, root), True)]
    payload = json.loads(service.client.published[0][1])  # type: ignore[attr-defined]
    assert (payload["job_id"], payload["attempt_id"]) == (silent, 1)
    assert reg.get(silent)["status"] == "pending"  # the record is unchanged
    notes = [line["line"] for line in reg.audit(silent) if line["event"] == "hub_note"]
    assert any("its dispatch is published again" in note for note in notes), notes
    assert not service.unheard


def test_s14_an_attempt_closed_but_not_yet_retried_is_retried_by_the_next_engine(tmp_path):
    """An engine killed between closing an attempt (`runner_lost`, a retry left) and queueing
    its retry: the next engine queues attempt 2 when it finds the record, and says so."""
    reg = Registry(tmp_path)
    write_env_file(tmp_path / ".mam.env", {"MAM_DISPATCH_SECRET": TEST_SECRET}, overwrite=True)
    terms = QueueTerms(target_labels=("gpu",), retries=1, retry_on=("runner_lost",))
    job_id = reg.register(session=None, queue=terms)["job_id"]
    mark_published(reg, job_id, "gpu-box")
    reg.close(job_id, "runner_lost", source="delegate_wrapper")  # ... and the engine was killed here
    done = reg.register(session=None, queue=QueueTerms(target_labels=("gpu",)))["job_id"]
    mark_published(reg, done, "gpu-box")
    reg.close(done, "runner_lost", source="delegate_wrapper")  # no retry left: it stays ended
    service = HubService(open_hub(tmp_path))
    service.client = RecordingClient()  # type: ignore[assignment]
    service.scan(time.monotonic())
    retried = reg.get(job_id)
    assert (retried["status"], retried["attempt_id"], retried["retried"]) == ("queued", 2, 1)
    assert retried["avoid_session"] == "gpu-box" and job_id in service.queued
    assert any("retry 1 of 1: attempt 2 queued" in line.get("line", "") for line in reg.audit(job_id))
    assert (reg.get(done)["status"], reg.get(done)["attempt_id"]) == ("error", 1)


@pytest.mark.parametrize(("status", "verified", "refused", "waits"), [
    ("online", True, None, True),
    ("online", False, None, False),  # a forged presence holds no stop
    ("draining", True, None, False),
    ("offline", True, None, False),
    ("online", True, "JOB", False),  # its runner refused it
    ("online", True, "0badf00d", True),  # another job's refusal
    (None, None, None, False),  # the session announced nothing (v1)
], ids=["online", "forged", "draining", "offline", "refused-it", "refused-another", "no-presence"])
def test_s14_a_stopping_engine_waits_only_for_a_start_its_runner_may_send(tmp_path, status, verified, refused, waits):
    """§14: an embedded engine whose own job ended hands over once each job it published
    has spoken, while that job's runner may be taking it; the wait is said by job id."""
    reg = Registry(tmp_path)
    record = reg.register(session="gpu-box", contract=Contract(heartbeat_sec=1, heartbeat_misses=2))
    job_id = record["job_id"]
    write_env_file(tmp_path / ".mam.env", {"MAM_DISPATCH_SECRET": TEST_SECRET}, overwrite=True)
    service = HubService(open_hub(tmp_path))
    service.client = RecordingClient()  # type: ignore[assignment]
    if status is not None:
        service.fleet.update(RunnerView(session="gpu-box", runner_id="a" * 32, status=status, labels=frozenset(),
                                        max_jobs=1, running=frozenset(), verified=verified, seen_at=0.0,
                                        last_refusal=None if refused is None else
                                        (job_id if refused == "JOB" else refused, "taken: x")))
    service.scan(time.monotonic())
    service.finish(handover=True)
    assert service._confirmations_left(None) is waits
    assert service.handing_over == ((job_id,) if waits else ())
    if waits:
        service.on_message(names.events_topic(job_id, service.config.topic_root), started(record), time.monotonic())
        assert service._confirmations_left(None) is False  # it spoke: hand over
