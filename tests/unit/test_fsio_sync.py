"""`fsio.sync_paths`, the registry's group commit (§8, docs/registry.md "Durability"): every
file and folder fsynced once, a few by the caller, more by fsync threads kept between
commits, in a forked child too; a failed fsync is one `RegistryError`."""

from __future__ import annotations

import errno
import os
import signal
import threading
import time
from pathlib import Path

import pytest
from harness.waiting import PATIENCE_S

from mam.shared.protocol.errors import RegistryError
from mam.shared.store import fsio

pytestmark = pytest.mark.timeout(60)


def _files(tmp_path: Path, jobs: int) -> list[Path]:
    """Two files in each of `jobs` folders, written."""
    files = []
    for index in range(jobs):
        folder = tmp_path / f"job{index}"
        folder.mkdir()
        for name in ("record.json", "events.ndjson"):
            (folder / name).write_bytes(b"{}\n")
            files.append(folder / name)
    return files


def _fsynced(monkeypatch) -> list[str]:
    """The path of every fsync of this process from now on."""
    synced: list[str] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return synced


def _fsync_threads() -> set[int]:
    return {thread.ident for thread in threading.enumerate()
            if thread.name.startswith("mam-fsync") and thread.ident is not None}


@pytest.mark.parametrize("jobs", [1, 10], ids=["by-the-caller", "by-threads"])
def test_s8_a_group_commit_fsyncs_each_file_then_each_folder_once(tmp_path, monkeypatch, jobs):
    files = _files(tmp_path, jobs)
    synced = _fsynced(monkeypatch)
    fsio.sync_paths(files + files[:1], what="registry x")
    folders = {str(path.parent) for path in files}
    assert sorted(synced) == sorted([*map(str, files), *folders])
    assert set(synced[-len(folders):]) == folders  # the renames after the files' data


def test_s8_the_fsync_threads_are_kept_from_one_commit_to_the_next(tmp_path):
    files = _files(tmp_path, 10)
    fsio.sync_paths(files, what="registry x")
    first = _fsync_threads()
    fsio.sync_paths(files, what="registry x")
    assert first and first <= _fsync_threads()  # the same threads, and at most SYNC_THREADS
    assert len(_fsync_threads()) <= fsio.SYNC_THREADS


def test_s8_a_forked_child_commits_with_fsync_threads_of_its_own(tmp_path):
    files = _files(tmp_path, 10)
    fsio.sync_paths(files, what="registry x")  # the parent's threads are running
    pid = os.fork()
    if pid == 0:  # the child: its parent's threads, idle, did not come with it
        code = 1
        try:
            fsio.sync_paths(files[:fsio.INLINE_SYNCS + 2], what="registry x")  # fewer than those idle
            code = 0
        finally:
            os._exit(code)
    deadline = time.monotonic() + PATIENCE_S / 4
    while (waited := os.waitpid(pid, os.WNOHANG)) == (0, 0) and time.monotonic() < deadline:
        time.sleep(0.05)
    if waited == (0, 0):
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("the forked child's group commit never finished")
    assert os.waitstatus_to_exitcode(waited[1]) == 0


@pytest.mark.parametrize("jobs", [1, 10], ids=["by-the-caller", "by-threads"])
def test_s8_a_failed_fsync_is_one_registry_error_naming_the_registry(tmp_path, monkeypatch, jobs):
    files = _files(tmp_path, jobs)

    def fsync(fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(RegistryError, match=r"^registry x: cannot fsync \(EIO: Input/output error\)$"):
        fsio.sync_paths(files, what="registry x")
