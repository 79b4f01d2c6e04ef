"""`JobChanges` (docs/registry.md "Followers"): a follower of one job is told of writes to its
record and logs by inotify, and falls back to polling where it cannot be."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
from harness.waiting import wait_until

from mam.shared.protocol import names
from mam.shared.store import changes as changes_module
from mam.shared.store.changes import JobChanges, JobsWatch
from mam.shared.store.fsio import atomic_write
from mam.shared.store.registry import Registry

pytestmark = pytest.mark.timeout(60)

LONG_S = 30.0  # a wait that returns before this was woken by a write: no test waits it out


def test_an_audit_line_or_a_new_record_wakes_the_waiter_even_written_before_it_waits(tmp_path: Path) -> None:
    reg = Registry(tmp_path)
    job_id = reg.register(session="gpu-box")["job_id"]
    with JobChanges(tmp_path, job_id, poll_s=LONG_S) as changes:
        assert changes.told
        for write in (lambda: reg.append_audit(job_id, {"event": "note", "timestamp": "x"}),
                      lambda: atomic_write(reg.record_path(job_id), reg.record_path(job_id).read_bytes(), what="r")):
            write()
            started = time.monotonic()
            changes.wait(LONG_S)
            assert time.monotonic() - started < LONG_S / 2


def test_another_jobs_record_does_not_wake_it(tmp_path: Path) -> None:
    reg = Registry(tmp_path)
    job_id, other = (reg.register(session="gpu-box")["job_id"] for _ in range(2))
    with JobChanges(tmp_path, job_id, poll_s=LONG_S) as changes:
        path = reg.record_path(other)
        atomic_write(path, path.read_bytes(), what="r")
        started = time.monotonic()
        changes.wait(1.0)
        assert time.monotonic() - started >= 1.0  # only its own timeout ended it


def test_a_followers_inotify_is_closed_off_the_callers_thread_and_none_leaks(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Closing an inotify instance waits for a kernel grace period: `close()` hands it to the
    closer thread, which closes every one."""
    reg = Registry(tmp_path)
    job_id = reg.register(session="gpu-box")["job_id"]
    closed_by: list[str] = []
    real_close = changes_module.INotify.close

    def recorded_close(self: changes_module.INotify) -> None:
        real_close(self)
        closed_by.append(threading.current_thread().name)  # once its fd is gone: counted below

    monkeypatch.setattr(changes_module.INotify, "close", recorded_close)
    fds = len(os.listdir("/proc/self/fd"))
    for _ in range(5):
        with JobChanges(tmp_path, job_id, poll_s=LONG_S) as changes:
            assert changes.told
        changes.close()  # idempotent
    wait_until(lambda: len(closed_by) == 5, what="the five instances to be closed")
    assert set(closed_by) == {"inotify-closer"}
    assert len(os.listdir("/proc/self/fd")) == fds


def test_a_forked_child_closes_its_followers_though_the_closer_lock_was_held_at_the_fork(tmp_path: Path) -> None:
    reg = Registry(tmp_path)
    job_id = reg.register(session="gpu-box")["job_id"]
    with changes_module._closing_lock:  # as another thread of the parent may hold it at the fork
        pid = os.fork()
        if pid == 0:  # the child: a follower, then exit 0 unless its close hangs
            with JobChanges(tmp_path, job_id, poll_s=LONG_S):
                pass
            os._exit(0)
    deadline = time.monotonic() + 10.0
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    if done[0] == 0:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
    assert done[0] == pid and os.waitstatus_to_exitcode(done[1]) == 0, "the child's close hung"


def test_without_inotify_or_before_its_logs_exist_it_polls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    reg = Registry(tmp_path)
    job_id = reg.register(session="gpu-box")["job_id"]
    unborn = JobChanges(tmp_path, "0badf00d", poll_s=0.05)
    assert not unborn.told  # no logs folder yet: polled until there is one
    unborn.wait(LONG_S)  # returns after poll_s
    unborn.close()

    def refused() -> None:
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(changes_module, "INotify", refused)
    with JobChanges(tmp_path, job_id, poll_s=0.05) as changes:
        assert not changes.told
        changes.wait(LONG_S)  # a poll interval, not the whole timeout


# ------------------------------------------------------------------ many jobs: the dashboard's feed

def test_the_jobs_watch_names_written_records_new_folders_and_followed_logs(tmp_path: Path) -> None:
    reg = Registry(tmp_path)
    first = reg.register(session="gpu-box")["job_id"]
    with JobsWatch(tmp_path) as watch:
        assert watch.changed(0) == set()
        second = reg.register(session="gpu-box")["job_id"]  # its record and its new logs folder
        assert watch.changed(LONG_S) == {second}
        reg.append_audit(first, {"event": "note", "timestamp": "x"})  # not followed: unseen
        assert watch.changed(0) == set()
        watch.follow(first)
        reg.append_audit(first, {"event": "note", "timestamp": "y"})
        assert watch.changed(LONG_S) == {first}
        watch.unfollow(first)
        reg.append_audit(first, {"event": "note", "timestamp": "z"})
        assert watch.changed(0) == set()
        (names.jobs_dir(tmp_path) / ".0badf00d.json.1.tmp").write_text("{}")  # a writer's temp file
        assert watch.changed(0) == set()


def test_the_jobs_watch_says_look_at_all_when_it_cannot_tell(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    reg = Registry(tmp_path)
    job_id = reg.register(session="gpu-box")["job_id"]
    with JobsWatch(tmp_path) as watch:
        monkeypatch.setattr(watch._inotify, "add_watch", lambda *_: (_ for _ in ()).throw(OSError(28, "limit")))
        watch.follow(job_id)  # the per-user watch limit: missed, so the next answer is "all"
        assert watch.changed(0) is None and watch.changed(0) == set()

    def refused() -> None:
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(changes_module, "INotify", refused)
    with JobsWatch(tmp_path) as watch:
        assert watch.changed(0.01) is None

