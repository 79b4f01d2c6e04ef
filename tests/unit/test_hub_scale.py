"""The hub service at scale (PROTOCOL §14 "One hub process", §8, §10):
what the service makes durable and when (docs/registry.md
"Durability"), and that a message it received but has not judged yet keeps its
job from being closed (§14 "nobody's silence"). No broker: the service's parts
are driven directly."""

from __future__ import annotations

import errno
import io
import json
import os
import time
from typing import Any

import pytest
from harness.hubclient import TS, RecordingClient
from harness.workspace import TEST_SECRET

from mam.orchestrator.hub import open_hub
from mam.orchestrator.mirror import audit_seq
from mam.orchestrator.service import HubService
from mam.orchestrator.watch import Watcher, WatchOptions
from mam.shared.config import BrokerConfig, write_env_file
from mam.shared.protocol import crypto, names, wire
from mam.shared.protocol.errors import RegistryError
from mam.shared.store import fsio
from mam.shared.store import registry as registry_module
from mam.shared.store.registry import Contract, Registry
from mam.shared.transport.mqtt import Message

KEYS = crypto.derive_keys(TEST_SECRET)
SERVICE = WatchOptions(remote=True, ack_only_before_first=True, lazy_progress=True)
IDLE_PAST_S = 60.0  # far past any idle window of these tests


def signed(record: Any, kind: str, seq: int, event: str, status: str = "running",
           data: dict[str, Any] | None = None) -> bytes:
    """One signed event or state of `record`'s current attempt (§3.1, §4)."""
    ident = {"attempt_id": record["attempt_id"], "dispatch_token": record["dispatch_token"]}
    body: dict[str, Any] = {"schema_version": 1, "seq": seq, "job_id": record["job_id"], "timestamp": TS,
                            "detail": "", "data": {**ident, **(data or {})}}
    if kind == "event":
        body["event"] = event
    else:
        body.update({"event": "state", "status": status, "last_event": event})
    return wire.encode(crypto.sign_event(body, record["auth_token"]))


def topic(record: Any, kind: str) -> str:
    job_id, root = record["job_id"], BrokerConfig().topic_root
    return names.events_topic(job_id, root) if kind == "event" else names.state_topic(job_id, root)


def test_s14_service_progress_is_appended_without_fsync_and_status_changes_stay_durable(tmp_path, counted_fsyncs):
    reg = Registry(tmp_path)
    record = reg.register(session="gpu-box", contract=Contract(heartbeat_sec=1, heartbeat_misses=2))
    watcher = Watcher(reg, record["job_id"], client=RecordingClient(), keys=KEYS, out=io.StringIO(), options=SERVICE)
    watcher.start_clocks(time.monotonic(), record)
    assert watcher.handle(topic(record, "event"), signed(record, "event", 1, "started"))
    assert counted_fsyncs, "a status change (started) is fsynced"
    counted_fsyncs.clear()
    before = os.stat(reg.record_path(record["job_id"])).st_mtime_ns
    for seq in (2, 3):
        assert watcher.handle(topic(record, "event"), signed(record, "event", seq, "progress",
                                                               data={"heartbeat": True}))
        watcher.handle(topic(record, "state"), signed(record, "state", seq, "progress"))
    assert counted_fsyncs == []  # heartbeats: no fsync, no record rewrite
    assert os.stat(reg.record_path(record["job_id"])).st_mtime_ns == before
    assert [line["seq"] for line in reg.audit(record["job_id"]) if line.get("event") == "progress"] == [2, 3]
    assert not watcher.handle(topic(record, "event"), signed(record, "event", 3, "progress"))  # duplicate: memory
    assert watcher.refusals == ["duplicate"]
    assert watcher.handle(topic(record, "event"), signed(record, "event", 4, "completed", data={"exit_code": 0}))
    after = reg.get(record["job_id"])
    assert after["status"] == "completed" and after["last_seq"] == 4 and counted_fsyncs


def test_s14_a_restarted_service_takes_the_lazy_seqs_from_the_audit_log_no_false_gap(tmp_path):
    reg = Registry(tmp_path)
    record = reg.register(session="gpu-box", contract=Contract(heartbeat_sec=1, heartbeat_misses=2))
    first = Watcher(reg, record["job_id"], client=RecordingClient(), keys=KEYS, out=io.StringIO(), options=SERVICE)
    first.start_clocks(time.monotonic(), record)
    first.handle(topic(record, "event"), signed(record, "event", 1, "started"))
    for seq in range(2, 6):
        first.handle(topic(record, "event"), signed(record, "event", seq, "progress", data={"heartbeat": True}))
    assert reg.get(record["job_id"])["last_seq"] == 1  # the record still says started
    assert audit_seq(reg, reg.get(record["job_id"])) == 5
    write_env_file(tmp_path / ".mam.env", {"MAM_DISPATCH_SECRET": TEST_SECRET}, overwrite=True)
    service = HubService(open_hub(tmp_path))  # the restart: a new process, the same registry
    service.client = RecordingClient()  # type: ignore[assignment]
    service.scan(time.monotonic())
    service.on_message(topic(record, "state"), signed(record, "state", 5, "progress"), time.monotonic())
    service.on_message(topic(record, "event"), signed(record, "event", 5, "progress"), time.monotonic())
    audit = reg.audit(record["job_id"])
    assert not [line for line in audit if line.get("event") == "seq_gap"]  # no false gap after the restart
    assert [line["seq"] for line in audit if line.get("event") == "progress"] == [2, 3, 4, 5]  # 5 not twice


def test_s14_a_received_unjudged_message_keeps_its_job_open_while_the_service_is_behind(tmp_path):
    reg = Registry(tmp_path)
    record = reg.register(session="gpu-box", contract=Contract(heartbeat_sec=1, heartbeat_misses=2))
    write_env_file(tmp_path / ".mam.env", {"MAM_DISPATCH_SECRET": TEST_SECRET}, overwrite=True)
    service = HubService(open_hub(tmp_path))
    client = service.client = RecordingClient()  # type: ignore[assignment]
    now = time.monotonic()
    service.scan(now)
    service.on_message(topic(record, "event"), signed(record, "event", 1, "started"), now)
    client.messages.put(Message(topic(record, "event"), signed(record, "event", 2, "progress"), False))
    service.receive(client)  # the loop's tick: everything received so far is counted per job
    service.tick(now + IDLE_PAST_S, None)  # the service fell far behind: its clocks are late
    assert reg.get(record["job_id"])["status"] == "running"  # the job spoke: not closed
    message = service.next_message(client, 0.0)
    assert message is not None and not service.unjudged
    service.on_message(message.topic, message.payload, time.monotonic())
    service.tick(time.monotonic(), None)
    assert reg.get(record["job_id"])["status"] == "running"
    service.tick(time.monotonic() + IDLE_PAST_S, None)  # and real silence still closes it (§10)
    assert reg.get(record["job_id"])["close_reason"] == "deadline_timeout"


def test_s8_a_registry_group_fsyncs_its_files_together_at_its_end(tmp_path, counted_fsyncs):
    reg = Registry(tmp_path)
    records = [reg.register(session="gpu-box") for _ in range(3)]
    counted_fsyncs.clear()
    with reg.group():
        for record in records:
            with reg.transaction(record["job_id"]) as txn:
                txn.store_event({"event": "started", "seq": 1, "job_id": record["job_id"], "timestamp": TS,
                                 "data": {}}, source="remote_mirror")
            assert reg.get(record["job_id"])["status"] == "running"  # readers see it at once
        assert counted_fsyncs == []  # nothing fsynced inside the group
    # at its end: every record and audit log, then their folders (jobs/ and each logs/<id>/)
    assert len(counted_fsyncs) == 2 * len(records) + 1 + len(records)
    assert all(reg.get(record["job_id"])["status"] == "running" for record in records)


def test_s8_a_record_written_in_a_group_is_read_back_from_memory_until_the_group_ends(tmp_path, monkeypatch):
    """The group holds the lock, so what it wrote is what is on disk: the service's state
    after its event reads no file. Once the group ends, the disk is read again."""
    reg = Registry(tmp_path)
    record = reg.register(session="gpu-box")
    path = reg.record_path(record["job_id"])
    reads: list[str] = []
    real_read = registry_module.read_capped
    monkeypatch.setattr(registry_module, "read_capped", lambda p, cap: reads.append(str(p)) or real_read(p, cap))
    with reg.group():
        reg.transition(record["job_id"], "running", source="remote_mirror", attempt_id=record["attempt_id"],
                       dispatch_token=record["dispatch_token"])
        assert reads == [str(path)]  # the transaction's own read, before its write
        assert reg.get(record["job_id"])["status"] == "running"
        assert reads == [str(path)]  # the write, read back without the file
    on_disk = json.loads(path.read_text())
    path.write_text(json.dumps({**on_disk, "status": "completed"}))  # another writer, once the lock is free
    assert reg.get(record["job_id"])["status"] == "completed"
    assert reads == [str(path)] * 2



def _store(reg: Registry, record: dict[str, Any], event: str, seq: int, **data: Any) -> None:
    with reg.transaction(record["job_id"]) as txn:
        txn.store_event({"event": event, "seq": seq, "job_id": record["job_id"], "timestamp": TS, "data": data},
                        source="remote_mirror")


def test_s8_a_pass_puts_each_record_in_place_once_after_its_bytes_are_on_disk(tmp_path, monkeypatch):
    """A service pass writes a job's record twice (its event, then its state): the file is
    replaced once, with the newest bytes, only after those bytes and the audit lines are
    fsynced; until the pass ends another reader sees the record before it (§8)."""
    reg = Registry(tmp_path)
    record = reg.register(session="gpu-box")
    path, audit = reg.record_path(record["job_id"]), reg.audit_path(record["job_id"])
    steps: list[tuple[str, str]] = []

    def step(kind: str, name: str) -> None:
        if name.startswith(str(tmp_path)):  # not another test's thread still writing elsewhere
            steps.append((kind, name))

    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: step("fsync", os.readlink(f"/proc/self/fd/{fd}")) or real_fsync(fd))
    monkeypatch.setattr(os, "replace", lambda src, dst: step("replace", str(dst)) or real_replace(src, dst))
    with reg.group():
        _store(reg, record, "started", 1)
        _store(reg, record, "completed", 2, exit_code=0)
        assert reg.get(record["job_id"])["status"] == "completed"  # the pass reads its own write
        assert json.loads(path.read_bytes())["status"] == "pending"  # another reader: not in place yet
        assert steps == []
    assert json.loads(path.read_bytes())["status"] == "completed"
    replaced = [index for index, step in enumerate(steps) if step == ("replace", str(path))]
    assert len(replaced) == 1
    synced = [name for what, name in steps[:replaced[0]] if what == "fsync"]
    assert str(audit) in synced and any(name.startswith(f"{path.parent}/.{path.name}.") for name in synced)
    assert [p.name for p in path.parent.iterdir() if p.name.endswith(".tmp")] == []
    assert [p.name for p in audit.parent.iterdir() if p.name.endswith(".tmp")] == []
    assert json.loads((audit.parent / "status.json").read_bytes())["status"] == "completed"


def test_s8_a_write_refused_in_a_pass_fails_its_transaction_and_leaves_the_record(tmp_path, monkeypatch):
    """A disk that refuses a record's bytes (ENOSPC) fails that transaction at once, as
    outside a pass; the record stays as it was and the pass's other jobs still commit."""
    reg = Registry(tmp_path)
    refused, other = reg.register(session="gpu-box"), reg.register(session="gpu-box")
    real_mkstemp = fsio.tempfile.mkstemp

    def mkstemp(*, dir: Any, prefix: str, suffix: str) -> tuple[int, str]:
        if prefix == f".{refused['job_id']}.json.":
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_mkstemp(dir=dir, prefix=prefix, suffix=suffix)

    monkeypatch.setattr(fsio.tempfile, "mkstemp", mkstemp)
    with reg.group():
        with pytest.raises(RegistryError, match=rf"^job {refused['job_id']}: cannot write .*\(ENOSPC: No space"):
            _store(reg, refused, "started", 1)
        _store(reg, other, "started", 1)
    assert reg.get(refused["job_id"])["status"] == "pending"
    assert reg.get(other["job_id"])["status"] == "running"
    assert [p.name for p in reg.record_path(other["job_id"]).parent.iterdir() if p.name.endswith(".tmp")] == []


class Revoked:
    """A roster in which `session` is revoked (§16), for the service and its watchers."""

    def __init__(self) -> None:
        self.sessions: dict[str, str] = {}

    def revoked(self) -> dict[str, str]:
        return dict(self.sessions)

    def revoked_at(self, session: str, *, fresh: bool = False) -> str | None:
        return self.sessions.get(session)


def sleeping_service(tmp_path, monkeypatch) -> tuple[HubService, Any, list[str], Revoked]:
    """A service tracking one dispatched job (ack window 600 s, idle window 10 s), whose
    `Watcher.tick` calls are counted by job id."""
    reg = Registry(tmp_path)
    record = reg.register(session="gpu-box", contract=Contract(heartbeat_sec=5, heartbeat_misses=2,
                                                               ack_timeout_sec=600))
    write_env_file(tmp_path / ".mam.env", {"MAM_DISPATCH_SECRET": TEST_SECRET}, overwrite=True)
    service = HubService(open_hub(tmp_path))
    service.client = RecordingClient()  # type: ignore[assignment]
    roster = Revoked()
    service.feed.revocations = roster  # type: ignore[assignment]
    ticked: list[str] = []
    real_tick = Watcher.tick
    monkeypatch.setattr(Watcher, "tick", lambda self, *a, **k: ticked.append(self.job_id) or real_tick(self, *a, **k))
    service.scan(time.monotonic())
    return service, record, ticked, roster


def test_s10_a_job_with_nothing_to_decide_is_not_judged_at_every_tick(tmp_path, monkeypatch):
    service, record, ticked, _ = sleeping_service(tmp_path, monkeypatch)
    now = time.monotonic()
    for step in range(100):  # ten seconds of the service's ticks inside the 600 s ack window
        service.tick(now + step * 0.1, None)
    assert ticked == [record["job_id"]]  # judged once; then asleep until its ack deadline


def test_s10_a_message_wakes_a_sleeping_job_whose_deadline_came_nearer(tmp_path, monkeypatch):
    service, record, ticked, _ = sleeping_service(tmp_path, monkeypatch)
    now = time.monotonic()
    service.tick(now, None)  # asleep until the ack deadline, 600 s away
    service.on_message(topic(record, "event"), signed(record, "event", 1, "started"), now)
    service.tick(time.monotonic() + 1.0, None)
    assert Registry(tmp_path).get(record["job_id"])["status"] == "running"  # inside the 10 s idle window
    service.tick(time.monotonic() + IDLE_PAST_S, None)  # silence: the idle clock, not the ack one (§10)
    assert Registry(tmp_path).get(record["job_id"])["close_reason"] == "deadline_timeout"


def test_s16_a_revoked_runners_sleeping_job_is_closed_at_the_next_tick(tmp_path, monkeypatch):
    service, record, ticked, roster = sleeping_service(tmp_path, monkeypatch)
    now = time.monotonic()
    service.tick(now, None)
    roster.sessions["gpu-box"] = TS  # `mam-orch runner revoke gpu-box` from another shell
    service.tick(now + 0.1, None)
    assert Registry(tmp_path).get(record["job_id"])["close_reason"] == "runner_lost"


def test_s14_a_link_going_down_makes_every_sleeping_job_look_again(tmp_path, monkeypatch):
    service, record, ticked, _ = sleeping_service(tmp_path, monkeypatch)
    now = time.monotonic()
    service.tick(now, None)
    service.tick(now + 0.1, down_since=now + 0.05)  # only the wall clock runs now (§14)
    assert ticked == [record["job_id"]] * 2


def test_s10_among_many_sleeping_jobs_a_tick_looks_only_at_what_is_due(tmp_path, monkeypatch):
    """The service's schedule: with many jobs asleep, a tick looks at the one that spoke
    and, once its deadline comes, at the one it closes; never at the others (§10, §16)."""
    service, first, ticked, roster = sleeping_service(tmp_path, monkeypatch)
    reg = Registry(tmp_path)
    others = [reg.register(session=f"box-{n}", contract=Contract(heartbeat_sec=5, heartbeat_misses=2,
                                                                 ack_timeout_sec=600)) for n in range(20)]
    service.scan(time.monotonic())
    now = time.monotonic()
    service.tick(now, None)  # each job looked at once, then asleep until its ack deadline
    assert sorted(ticked) == sorted([first["job_id"], *(other["job_id"] for other in others)])
    ticked.clear()
    service.on_message(topic(first, "event"), signed(first, "event", 1, "started"), now)
    for step in range(1, 30):  # three seconds of ticks
        service.tick(now + step * 0.1, None)
    assert ticked == [first["job_id"]]  # the one that spoke, once; then asleep for its idle window
    service.tick(now + IDLE_PAST_S, None)
    assert ticked == [first["job_id"]] * 2
    assert reg.get(first["job_id"])["close_reason"] == "deadline_timeout"
    roster.sessions["box-3"] = TS  # one runner revoked: its job is looked at, and closed
    service.tick(now + IDLE_PAST_S + 0.1, None)
    assert reg.get(others[3]["job_id"])["close_reason"] == "runner_lost"
    assert [reg.get(other["job_id"])["status"] for n, other in enumerate(others) if n != 3] == ["pending"] * 19


def test_s10_a_job_whose_next_deadline_is_nan_holds_up_no_other_jobs_deadline(tmp_path, monkeypatch):
    """The schedule is a heap: a NaN in it (a timeout read from a hostile record, `float("nan")`)
    compares false with everything and would hide every deadline behind it. Such a job is
    looked at every tick instead, and another job still closes when its deadline comes."""
    service, silent, ticked, _ = sleeping_service(tmp_path, monkeypatch)
    reg = Registry(tmp_path)
    odd = reg.register(session="other-box", contract=Contract(heartbeat_sec=5, heartbeat_misses=2,
                                                               ack_timeout_sec=600))
    service.scan(time.monotonic())
    real_next_wake = Watcher.next_wake
    monkeypatch.setattr(Watcher, "next_wake", lambda self, down_since: float("nan") if self.job_id == odd["job_id"]
                        else real_next_wake(self, down_since))
    now = time.monotonic()
    service.on_message(topic(odd, "event"), signed(odd, "event", 1, "started"), now)  # looked at first
    service.on_message(topic(silent, "event"), signed(silent, "event", 1, "started"), now)
    service.tick(now + 0.1, None)
    ticked.clear()
    service.tick(now + 0.2, None)
    assert ticked == [odd["job_id"]]  # the one without a deadline, every tick
    service.tick(now + IDLE_PAST_S, None)
    assert reg.get(silent["job_id"])["close_reason"] == "deadline_timeout"  # its idle clock ran out
