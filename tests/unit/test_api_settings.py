"""`mam.Hub` reads its settings (§13: the environment over `.mam.env`, the contract's
defaults of §5) once, as one `mam-orch` command does, not at every dispatch; an env
file it cannot read is refused in one line at each try, never kept."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness.workspace import TEST_SECRET

from mam import Hub
from mam.orchestrator.hublock import HubLock
from mam.shared.config import MAX_ENV_FILE_BYTES, write_env_file
from mam.shared.protocol.errors import EnvFileError

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def served(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A hub root whose service lock is held, as by a running `mam-orch serve`: a dispatch
    only registers the job (and nothing here publishes it)."""
    monkeypatch.delenv("MAM_HEARTBEAT_SEC", raising=False)
    monkeypatch.delenv("MAM_ENV_FILE", raising=False)
    write_env_file(tmp_path / ".mam.env", {"MAM_DISPATCH_SECRET": TEST_SECRET, "MAM_HEARTBEAT_SEC": "7"},
                   overwrite=True)
    lock = HubLock(tmp_path)
    lock.acquire()
    try:
        yield tmp_path
    finally:
        lock.release()


def test_s13_a_hub_reads_its_settings_once_and_a_new_hub_reads_them_again(served: Path) -> None:
    with Hub(served, embedded=False) as hub:
        first = hub.dispatch("true", session="gpu-box")
        write_env_file(served / ".mam.env", {"MAM_DISPATCH_SECRET": TEST_SECRET, "MAM_HEARTBEAT_SEC": "9"},
                       overwrite=True)
        second = hub.dispatch("true", session="gpu-box")
    with Hub(served, embedded=False) as hub:
        third = hub.dispatch("true", session="gpu-box")
    assert [job.record()["heartbeat_sec"] for job in (first, second, third)] == [7, 7, 9]


@pytest.mark.parametrize("broken", ["a folder", "oversized"])
def test_s13_an_unreadable_env_file_refuses_each_dispatch_and_is_not_kept(served: Path, broken: str) -> None:
    env_file = served / ".mam.env"
    good = env_file.read_bytes()
    env_file.unlink()
    if broken == "a folder":
        env_file.mkdir()
    else:
        env_file.write_bytes(b"MAM_HEARTBEAT_SEC=5\n" + b"#" * MAX_ENV_FILE_BYTES)
    with Hub(served, embedded=False) as hub:
        with pytest.raises(EnvFileError) as refused:
            hub.dispatch("true", session="gpu-box")
        assert "\n" not in str(refused.value) and ".mam.env" in str(refused.value)
        assert hub.jobs() == []  # nothing registered
        shutil.rmtree(env_file) if env_file.is_dir() else env_file.unlink()
        env_file.write_bytes(good)
        assert hub.dispatch("true", session="gpu-box").record()["heartbeat_sec"] == 7
