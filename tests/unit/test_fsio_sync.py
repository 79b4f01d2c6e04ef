"""`fsio.sync_paths`, the registry's group commit (§8, docs/registry.md "Durability"): every
file and folder fsynced once, a few by the caller, more by fsync threads kept between
commits, in a forked child too; a failed fsync is one `RegistryError`. A staged commit
(`fsio.commit_staged`) puts files in place only once their new bytes are fsynced."""

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


def _fsynced(monkeypatch, under: Path) -> list[str]:
    """The path of every fsync of this process from now on of a file or folder `under`
    (not another test's thread still writing elsewhere)."""
    synced: list[str] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        path = os.readlink(f"/proc/self/fd/{fd}")
        if path.startswith(str(under)):
            synced.append(path)
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return synced


def _fsync_threads() -> set[int]:
    return {thread.ident for thread in threading.enumerate()
            if thread.name.startswith("mam-fsync") and thread.ident is not None}


@pytest.mark.parametrize("jobs", [1, 10], ids=["by-the-caller", "by-threads"])
def test_s8_a_group_commit_fsyncs_each_file_then_each_folder_once(tmp_path, monkeypatch, jobs):
    files = _files(tmp_path, jobs)
    synced = _fsynced(monkeypatch, tmp_path)
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


def _staged(tmp_path: Path, jobs: int) -> dict[Path, tuple[str, bool]]:
    """A record (durable) and a view (not) staged in each of `jobs` folders over old files."""
    staged = {}
    for index in range(jobs):
        folder = tmp_path / f"job{index}"
        folder.mkdir()
        for name, durable in (("record.json", True), ("status.json", False)):
            (folder / name).write_bytes(b"old\n")
            staged[folder / name] = (fsio.stage_write(folder / name, b"new\n", what="x"), durable)
    return staged


@pytest.mark.parametrize("jobs", [1, 10], ids=["by-the-caller", "by-threads"])
def test_s8_a_staged_commit_fsyncs_the_new_bytes_then_puts_them_in_place_then_the_folders(
        tmp_path, monkeypatch, jobs):
    staged = _staged(tmp_path, jobs)
    appended = tmp_path / "job0" / "events.ndjson"
    appended.write_bytes(b"{}\n")
    steps: list[tuple[str, str]] = []

    def step(kind: str, path: str) -> None:
        if path.startswith(str(tmp_path)):  # not another test's thread still writing elsewhere
            steps.append((kind, path))

    real_replace = os.replace
    monkeypatch.setattr(os, "replace", lambda src, dst: step("replace", str(dst)) or real_replace(src, dst))
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: step("fsync", os.readlink(f"/proc/self/fd/{fd}")) or real_fsync(fd))
    fsio.commit_staged([appended], staged, what="registry x")
    durable_temps = {tmp for tmp, durable in staged.values() if durable}
    folders = {str(path.parent) for path in staged}
    assert [kind for kind, _ in steps] == (["fsync"] * (1 + jobs) + ["replace"] * (2 * jobs)
                                          + ["fsync"] * len(folders))
    assert {name for _, name in steps[:1 + jobs]} == {str(appended), *durable_temps}  # views: not fsynced
    assert {name for _, name in steps[-len(folders):]} == folders
    assert all(path.read_bytes() == b"new\n" for path in staged)
    assert sorted(p.name for p in tmp_path.rglob("*.tmp")) == []


def test_s8_a_failed_fsync_in_a_staged_commit_still_puts_the_files_in_place_and_says_so(tmp_path, monkeypatch):
    """The service's memory already holds the pass's writes: the disk keeps up with it
    (as a write in place did), and the failure is one `RegistryError`."""
    staged = _staged(tmp_path, 3)

    def fsync(fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(RegistryError, match=r"^registry x: cannot commit \(EIO: Input/output error\)$"):
        fsio.commit_staged([], staged, what="registry x")
    assert all(path.read_bytes() == b"new\n" for path in staged)
    assert sorted(p.name for p in tmp_path.rglob("*.tmp")) == []
