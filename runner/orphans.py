"""Jobs left by a runner that died, found again at restart (PROTOCOL §6, §8, §11).

A runner killed with `kill -9` has its agents stopped by its deadman helper (deadman.py);
when the helper died too, they run on. So each job's log
folder holds `agent.pid` (0600, atomic, removed when the job ends): the
attempt, the runner's pid, create time and id, and the agent's
`AgentIdentity`. A `pending`/`running` record of role `runner` whose runner
process is gone is an orphan: `mam.runner.job` stops its agent tree like a
cancel, then publishes `error`. A record without `agent.pid` is an orphan only
for this runner's session (§7) or when a cancel names it. Limits: a runner
killed between starting the agent and recording it leaves an agent nobody
finds; a descendant that escapes the group AND scrubs `MAM_AGENT_TAG` is not
found.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from mam.runner.admission import hub_registry_message
from mam.runner.barrier import WatchedProcess
from mam.runner.process_tree import AgentIdentity
from mam.shared.protocol import names
from mam.shared.protocol.codes import OPEN_STATUSES
from mam.shared.protocol.errors import UsageError
from mam.shared.store.fsio import atomic_write, check_writable
from mam.shared.store.records import JobRecord
from mam.shared.store.registry import Registry

log = logging.getLogger("mam.daemon")

AGENT_FILE = "agent.pid"
"""Per-job file (in the job's log folder) naming the runner and agent of the attempt."""
AGENT_FILE_MAX_BYTES = 4096
"""Largest accepted agent file; an agent could have written it."""
DETAIL_AGENT_STOPPED = "runner restarted; agent stopped"
DETAIL_AGENT_LOST = "runner restarted; agent lost"


class HubRegistry(UsageError):
    """The runner's registry root is a hub's (§8: each host keeps its own); exit 64."""


def check_not_hub_registry(registry: Registry) -> None:
    """§8: refuse a root holding hub records: the runner would find the hub's record of
    every job it is sent and refuse it, and the hub would wait out its ack timeout.

    Raises:
        HubRegistry: one line naming a hub job (exit 64).
    """
    records, _ = registry.list()
    hub = [r["job_id"] for r in records if r.get("role") == "hub"]
    if hub:
        raise HubRegistry(hub_registry_message(registry.root, hub[0]))


def check_workspace_writable(registry: Registry) -> None:
    """Refuse to serve from a workspace whose `.mam/` cannot be written (a read-only mount,
    a folder of another user, a full disk): every dispatch would fail inside while the
    presence said `online`. Runs before any connection or presence.

    Raises:
        RegistryError: one line naming the folder and the errno (exit 1, like a
            configuration file that exists but cannot be read, §9).
    """
    root = registry.root
    for folder in (names.mam_dir(root), names.jobs_dir(root), names.logs_dir(root)):
        check_writable(folder, what="the runner's workspace (§8)")


def agent_file(registry: Registry, job_id: str) -> Path:
    """`<root>/.mam/logs/<job_id>/agent.pid`."""
    return registry.logs_dir(job_id) / AGENT_FILE


def write_agent_file(registry: Registry, job_id: str, attempt_id: int, runner_id: str,
                     identity: AgentIdentity | None = None) -> None:
    """Record who runs this attempt (this runner, and its agent once started), 0600, atomically.

    Raises:
        RegistryError: the file cannot be written.
    """
    me = psutil.Process()
    obj: dict[str, Any] = {"job_id": job_id, "attempt_id": attempt_id, "runner_id": runner_id,
                           "runner_pid": me.pid, "runner_create_time": me.create_time(),
                           "pid": None, "create_time": None, "pgid": None, "tag": None}
    if identity is not None:
        obj.update(identity.to_dict())
    path = agent_file(registry, job_id)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    # not fsynced: it names live processes, read after a runner's death (kill -9 keeps the page
    # cache); a power loss, which could lose it, leaves no runner and no agent to find
    atomic_write(path, json.dumps(obj, sort_keys=True).encode("utf-8") + b"\n", what=f"job {job_id}",
                 durable=False)


def read_agent_file(path: Path) -> dict[str, Any] | None:
    """The agent file as an object; None if absent. Symlinks are refused.

    Raises:
        ValueError: unreadable, too large, not a JSON object (an agent could have written it).
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ValueError(f"cannot open ({exc.strerror or type(exc).__name__})") from None
    with os.fdopen(fd, "rb") as handle:
        raw = handle.read(AGENT_FILE_MAX_BYTES + 1)
    if len(raw) > AGENT_FILE_MAX_BYTES:
        raise ValueError(f"larger than {AGENT_FILE_MAX_BYTES} bytes")
    try:
        obj = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise ValueError("not UTF-8 JSON") from None
    if not isinstance(obj, dict):
        raise ValueError("not a JSON object")
    return obj


@dataclass(frozen=True)
class Orphan:
    """A non-terminal runner record without a live supervisor.

    Attributes:
        identity: its agent's `AgentIdentity`, None when unknown.
        found_by: why it is an orphan, for the log line.
    """

    identity: AgentIdentity | None
    found_by: str


def find_orphan(registry: Registry, record: Mapping[str, Any], *, runner_id: str, session: str,
                any_session: bool) -> Orphan | None:
    """Whether a non-terminal runner record has no live supervisor, and how to find its agent.

    Args:
        record: this host's record; runner_id/session: this runner's.
        any_session: also judge records of other sessions without an agent file (a cancel names it).
    Returns:
        None when its runner still lives, is this one, or (without an agent file) the
        record is another session's and `any_session` is False; else an `Orphan`.
    """
    job_id = record["job_id"]
    try:
        info = read_agent_file(agent_file(registry, job_id))
    except ValueError as exc:
        log.warning("job %s: %s is unreadable (%s): its agent cannot be found", job_id, AGENT_FILE, exc)
        info = None
    if info is not None and info.get("attempt_id") != record["attempt_id"]:
        info = None  # left by an older attempt
    if info is None:
        if not any_session and record.get("session") != session:
            return None  # another session's runner may be alive: not ours to judge
        return Orphan(None, "no agent identity recorded")
    runner_pid, runner_created = info.get("runner_pid"), info.get("runner_create_time")
    if info.get("runner_id") == runner_id:
        return None  # ours: a supervisor thread of this process owns it
    if (isinstance(runner_pid, int) and not isinstance(runner_pid, bool)
            and isinstance(runner_created, (int, float)) and not isinstance(runner_created, bool)
            and WatchedProcess(runner_pid, float(runner_created)).alive()):
        log.info("job %s attempt %d is supervised by another live runner (pid %d): left to it", job_id,
                 record["attempt_id"], runner_pid)
        return None
    if info.get("pid") is None:
        return Orphan(None, f"its runner (pid {runner_pid}) died before starting the agent")
    try:
        return Orphan(AgentIdentity.from_dict(info), f"its runner (pid {runner_pid}) died")
    except ValueError as exc:
        log.warning("job %s: %s is invalid (%s): its agent cannot be found", job_id, AGENT_FILE, exc)
        return Orphan(None, f"its runner (pid {runner_pid}) died")


def orphans_at_start(registry: Registry, *, runner_id: str, session: str) -> list[tuple[JobRecord, Orphan]]:
    """Every pending/running runner record of this host whose runner died (§6, §11).

    A record that cannot be judged is logged and skipped: one bad record never stops the daemon.
    """
    found: list[tuple[JobRecord, Orphan]] = []
    records, _ = registry.list()
    for record in records:
        if record["status"] not in OPEN_STATUSES or record.get("role") != "runner":
            continue
        try:
            orphan = find_orphan(registry, record, runner_id=runner_id, session=session, any_session=False)
        except Exception as exc:  # one bad record never stops the daemon
            log.error("job %s: orphan check failed: %s: %s", record["job_id"], type(exc).__name__, exc)
            continue
        if orphan is not None:
            found.append((record, orphan))
    return found


__all__ = ["AGENT_FILE", "DETAIL_AGENT_LOST", "DETAIL_AGENT_STOPPED", "HubRegistry", "Orphan", "agent_file",
           "check_not_hub_registry", "find_orphan", "orphans_at_start", "read_agent_file", "write_agent_file"]
