"""PROTOCOL §8: a write that fails (disk full, read-only folder) leaves the
previous record intact and raises RegistryError with a clear one-line message.

Root ignores permission bits, so the failures come from real mounts: a tiny
tmpfs (`size=64k`) for ENOSPC and read-only (re)mounts for EROFS. These tests
need root and mount rights; elsewhere they skip and say why.
"""

from __future__ import annotations

import errno
import os
import subprocess

import pytest

from mam.shared.protocol import names
from mam.shared.protocol.errors import RegistryError
from mam.shared.store.registry import Registry


def _mount(*args: str) -> None:
    subprocess.run(["mount", *args], check=True, capture_output=True, timeout=10)


@pytest.fixture
def tiny_fs(tmp_path):
    """A 64 KiB tmpfs mounted at tmp_path/mnt, unmounted afterwards."""
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a tiny tmpfs (root ignores permission bits, so no chmod fallback)")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    try:
        _mount("-t", "tmpfs", "-o", "size=64k,mode=0700", "tmpfs", str(mnt))
    except (OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"cannot mount a tmpfs here ({type(exc).__name__}); needs CAP_SYS_ADMIN")
    mounted = [mnt]
    yield mnt, mounted
    for path in reversed(mounted):
        subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=10)


def _ident(record):
    return {"attempt_id": record["attempt_id"], "dispatch_token": record["dispatch_token"]}


def _fill(folder):
    """Write a filler file until the file system is full."""
    filler = folder / "filler"
    with open(filler, "wb", buffering=0) as handle:
        try:
            while True:
                handle.write(b"\0" * 4096)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
    return filler


def _leftover_temps(root):
    return [p.name for p in names.jobs_dir(root).iterdir() if p.name.endswith(".tmp")]


def test_s8_disk_full_leaves_previous_record_intact(tiny_fs):
    mnt, _ = tiny_fs
    reg = Registry(mnt)
    record = reg.register(session="gpu-box")
    job_id = record["job_id"]
    assert reg.allocate_seq(job_id, **_ident(record)) == 1
    before = reg.record_path(job_id).read_bytes()
    filler = _fill(mnt)

    with pytest.raises(RegistryError) as info:
        reg.allocate_seq(job_id, **_ident(record))  # only the record is written: the atomic write fails
    message = str(info.value)
    assert "ENOSPC" in message and str(reg.record_path(job_id)) in message
    assert "previous file is unchanged" in message and "\n" not in message
    assert reg.record_path(job_id).read_bytes() == before
    assert _leftover_temps(mnt) == []

    with pytest.raises(RegistryError, match="ENOSPC"):
        reg.close(job_id, "cancelled")
    assert reg.record_path(job_id).read_bytes() == before
    assert reg.get(job_id)["status"] == "pending" and reg.get(job_id)["last_seq"] == 1

    with pytest.raises(RegistryError, match="ENOSPC"):
        reg.register(session="gpu-box", job_id="918b0612")
    assert not reg.record_path("918b0612").exists()  # no half-made record

    filler.unlink()  # space again: the registry carries on from the intact record
    assert reg.allocate_seq(job_id, **_ident(record)) == 2
    assert reg.close(job_id, "cancelled")["status"] == "cancelled"


def test_s8_read_only_folder_refuses_writes_and_keeps_record(tiny_fs):
    mnt, _ = tiny_fs
    reg = Registry(mnt)
    record = reg.register(session="gpu-box")
    job_id = record["job_id"]
    before = reg.record_path(job_id).read_bytes()
    _mount("-o", "remount,ro", str(mnt))

    assert reg.get(job_id) == record  # reading still works
    with pytest.raises(RegistryError) as info:
        reg.allocate_seq(job_id, **_ident(record))
    assert "EROFS" in str(info.value) and "\n" not in str(info.value)
    assert reg.record_path(job_id).read_bytes() == before
    assert reg.list() == ([record], [])


def test_s8_read_only_audit_folder_refuses_transition_before_the_record_changes(tiny_fs):
    mnt, mounted = tiny_fs
    reg = Registry(mnt)
    record = reg.register(session="gpu-box")
    job_id = record["job_id"]
    logs = reg.logs_dir(job_id)
    _mount("--bind", str(logs), str(logs))
    mounted.append(logs)
    _mount("-o", "remount,bind,ro", str(logs))
    before = reg.record_path(job_id).read_bytes()

    with pytest.raises(RegistryError) as info:
        reg.record_event(job_id, event="started", build=lambda seq: {"seq": seq}, **_ident(record))
    assert "EROFS" in str(info.value) and "events.ndjson" in str(info.value)
    assert reg.record_path(job_id).read_bytes() == before  # audit first: nothing committed
    assert reg.get(job_id)["status"] == "pending"
