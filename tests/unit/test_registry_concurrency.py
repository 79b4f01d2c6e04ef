"""PROTOCOL §8 under real processes: the flock serializes seq allocation and
registration across processes, and a writer killed with SIGKILL never leaves
a record that does not parse."""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import signal
import time

import pytest
from harness.waiting import PATIENCE_S

from mam.shared.protocol import names
from mam.shared.store.registry import Registry

CTX = multiprocessing.get_context("fork")  # fast start; the children only touch the registry
WRITER_LIFETIME_S = 2 * PATIENCE_S  # a writer outlives the wait for its progress; it is killed long before


def _ident(record):
    return {"attempt_id": record["attempt_id"], "dispatch_token": record["dispatch_token"]}


def _allocate(args):
    root, job_id, count = args
    reg = Registry(root)
    record = reg.get(job_id)
    return [reg.allocate_seq(job_id, **_ident(record)) for _ in range(count)]


def _register(args):
    root, count = args
    reg = Registry(root)
    return [reg.register(session="gpu-box")["job_id"] for _ in range(count)]


@pytest.mark.timeout(60)
def test_s8_seq_allocation_8_processes_x_200_gives_1_to_1600_exactly(tmp_path):
    reg = Registry(tmp_path)
    record = reg.register(session="gpu-box")
    with CTX.Pool(8) as pool:
        results = pool.map(_allocate, [(str(tmp_path), record["job_id"], 200)] * 8)
    seqs = [seq for chunk in results for seq in chunk]
    assert len(seqs) == 1600
    assert sorted(seqs) == list(range(1, 1601))  # no gaps, no repeats
    for chunk in results:  # each process saw its own seqs strictly increasing
        assert chunk == sorted(chunk)
    assert reg.get(record["job_id"])["last_seq"] == 1600


@pytest.mark.timeout(60)
def test_s8_registration_8_processes_x_100_gives_800_readable_records(tmp_path):
    with CTX.Pool(8) as pool:
        results = pool.map(_register, [(str(tmp_path), 100)] * 8)
    ids = [job_id for chunk in results for job_id in chunk]
    assert len(set(ids)) == 800
    records, errors = Registry(tmp_path).list()
    assert errors == [] and {r["job_id"] for r in records} == set(ids)
    assert all(r["status"] == "pending" and r["attempt_id"] == 1 for r in records)


def _writer(root, job_ids, seed):
    """Update the registry as fast as possible until killed (or WRITER_LIFETIME_S pass)."""
    rng = random.Random(seed)
    reg = Registry(root)
    deadline = time.monotonic() + WRITER_LIFETIME_S
    while time.monotonic() < deadline:
        job_id = rng.choice(job_ids)
        record = reg.get(job_id)
        if record["status"] in ("completed", "error", "cancelled"):
            reg.redispatch(job_id, reason="crash test")
            continue
        ident = _ident(record)
        choice = rng.random()
        if choice < 0.4:
            reg.allocate_seq(job_id, **ident)
        elif choice < 0.8:
            event = "started" if record["status"] == "pending" else "progress"
            reg.record_event(job_id, event=event, build=lambda seq: {"seq": seq, "event": event,
                                                                     "data": dict(ident)}, **ident)
        elif choice < 0.9:
            reg.close(job_id, rng.choice(["deadline_timeout", "agent_blocked", "cancelled"]))
        else:
            reg.append_audit(job_id, {"event": "note", "pad": "x" * rng.randint(0, 3000)})


def _progress(root, job_ids):
    """Sum of last_seq + transition_seq over the records, read without the lock:
    atomic replace means a reader always sees a whole record."""
    total = 0
    for job_id in job_ids:
        raw = names.record_path(root, job_id).read_bytes()
        record = json.loads(raw)  # raises (fails the test) on a torn record
        total += record["last_seq"] + record["transition_seq"] + record["attempt_id"]
    return total


@pytest.mark.timeout(90)
def test_s8_sigkill_inside_tight_update_loop_leaves_every_record_parseable(tmp_path):
    reg = Registry(tmp_path)
    job_ids = [reg.register(session="gpu-box")["job_id"] for _ in range(3)]
    rng = random.Random(8)
    kills = 0
    for round_no in range(60):
        start = _progress(tmp_path, job_ids)
        target = start + rng.randint(1, 25)
        child = CTX.Process(target=_writer, args=(str(tmp_path), job_ids, round_no))
        child.start()
        deadline = time.monotonic() + PATIENCE_S
        while _progress(tmp_path, job_ids) < target:  # kill at a random point of the loop
            assert child.is_alive(), f"writer died by itself with exit code {child.exitcode}"
            assert time.monotonic() < deadline, "writer made no progress"
        os.kill(child.pid, signal.SIGKILL)
        child.join(10)
        assert child.exitcode == -signal.SIGKILL
        kills += 1
        for job_id in job_ids:  # every record parses and passes the checks of get()
            json.loads(names.record_path(tmp_path, job_id).read_bytes())
            reg.get(job_id)
    assert kills >= 50
    records, errors = reg.list()
    assert errors == [] and len(records) == 3
    assert not list(names.jobs_dir(tmp_path).glob("*.corrupt-*"))
    for record in records:
        trail = reg.audit(record["job_id"])
        committed = {line["transition_seq"] for line in trail if line.get("event") == "status_changed"}
        # audit is written before the record: at most one line the record never reached
        assert set(range(1, record["transition_seq"] + 1)) <= committed
        assert max(committed | {0}) <= record["transition_seq"] + 1
        torn = [line for line in trail if line["event"] == "unreadable_line"]
        assert len(torn) <= kills
    # the lock was released by every killed holder: a fresh writer gets through
    record = reg.get(job_ids[0])
    if record["status"] in ("pending", "running"):
        reg.close(job_ids[0], "cancelled")
    assert reg.redispatch(job_ids[0])["status"] == "pending"
