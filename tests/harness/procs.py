"""Processes seen from a test: is one gone (a zombie counts as gone) or stopped, kill a list, count beats."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterable
from pathlib import Path

import psutil


def gone(pid: int, create_time: float | None = None) -> bool:
    """True when process `pid` no longer runs: it does not exist, is a zombie, or (with
    `create_time`, from psutil) the pid now belongs to a newer process."""
    try:
        proc = psutil.Process(pid)
        if create_time is not None and proc.create_time() != create_time:
            return True
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def processes_under(folder: Path) -> list[str]:
    """Live processes whose command line names `folder` (brokers, runners, timers, agents),
    as `pid cmdline` lines: what a test that started them there must have stopped."""
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            cmdline = " ".join(proc.info["cmdline"] or [])
            if str(folder) in cmdline and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(f"{proc.info['pid']} {cmdline[:200]}")
        except psutil.Error:
            continue
    return found


def all_gone(pids: Iterable[int]) -> bool:
    """True when every pid of `pids` is gone (see `gone`)."""
    return all(gone(pid) for pid in pids)


def stopped(pid: int) -> bool:
    """True when every thread of process `pid` is stopped (SIGSTOP took effect).

    A stop signal stops the threads one after the other (the first to handle it
    stops the rest), so a thread of a busy process may still run for a while after
    kill() returned: wait for this before relying on the process being frozen."""
    tasks = list(Path(f"/proc/{pid}/task").glob("*/stat"))
    try:
        # the state follows "(comm)", whose text may hold spaces and parentheses
        return bool(tasks) and all(task.read_text().rpartition(")")[2].split()[0] in ("T", "t") for task in tasks)
    except (FileNotFoundError, ProcessLookupError):
        return False


def kill_all(pids: Iterable[int]) -> None:
    """SIGKILL every pid of `pids` that still exists (cleanup; never raises for a gone one)."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def heartbeat_beats(audit: Iterable[dict]) -> list[dict]:
    """The heartbeat beats (PROTOCOL §12: `progress` with data.heartbeat true) of a job's audit lines."""
    return [line for line in audit
            if line.get("event") == "progress" and line.get("data", {}).get("heartbeat") is True]
