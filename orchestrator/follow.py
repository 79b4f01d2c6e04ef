"""Following a job: `mam-orch watch`, and the thin CLI over the hub service
(PROTOCOL §14 "One hub process", issue 11 item 5).

When `mam-orch serve` runs for the registry (`hublock.service_pid`), `dispatch`
and `watch` open no broker connection: the service judges and mirrors every
message into the job's audit log (`.mam/logs/<job>/events.ndjson`), and
`follow_service` tails that file: the same lines on stdout as a watch prints,
the same exit codes (§9) from the record once it is terminal. If the service
stops meanwhile, the follower says so and the caller watches on its own
connection (v1), so no job is left unwatched.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from mam.orchestrator.hints import detach_hint, reattach_hint
from mam.orchestrator.hub import DAY_S, Workspace, open_hub
from mam.orchestrator.hublock import service_pid
from mam.orchestrator.queuewait import retry_reason
from mam.orchestrator.watch import Detached, Watcher, WatchOptions, render_event
from mam.shared.cli.render import print_summary
from mam.shared.protocol import names
from mam.shared.protocol.codes import TERMINAL_STATUSES, CloseReason, JobStatus
from mam.shared.protocol.errors import ConfigError, ExitCode, UsageError
from mam.shared.store.records import JobRecord
from mam.shared.store.registry import Registry

log = logging.getLogger("mam.watch")

FOLLOW_POLL_S = 0.1  # how often the follower reads the audit log and the record
MAX_OPTION_S = 366 * DAY_S  # a watch option beyond a year is a mistake
# The hub's own closes that §9 reports as a timeout (exit 2); agent_blocked is an error (exit 1).
TIMEOUT_CLOSES = frozenset({CloseReason.DEADLINE_TIMEOUT, "queue_timeout", "runner_lost"})
EXIT_OF_STATUS: dict[str, ExitCode] = {JobStatus.COMPLETED: ExitCode.COMPLETED, JobStatus.CANCELLED: ExitCode.CANCELLED}


def exit_code_of(record: JobRecord) -> int:
    """The exit code of §9 a watch gives for a terminal record."""
    if record.get("close_reason") in TIMEOUT_CLOSES:
        return ExitCode.TIMEOUT
    return EXIT_OF_STATUS.get(record["status"], ExitCode.ERROR)


def settled(record: JobRecord) -> bool:
    """The job is over for good: terminal, and not an attempt the service is about to retry (§14)."""
    return record["status"] in TERMINAL_STATUSES and retry_reason(record) is None


def is_event_line(line: dict[str, Any], job_id: str) -> bool:
    """An accepted wire event (§3) as the hub stored it in the audit log."""
    return "schema_version" in line and line.get("job_id") == job_id and isinstance(line.get("seq"), int)


class AuditTail:
    """The new complete lines of one job's audit log, from the start of the file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self._partial = b""

    def read(self) -> list[dict[str, Any]]:
        """Every complete line appended since the last read, as JSON objects (others skipped)."""
        try:
            with open(self.path, "rb") as file:
                file.seek(self.offset)
                chunk = file.read()
        except FileNotFoundError:
            return []
        self.offset += len(chunk)
        data = self._partial + chunk
        *lines, self._partial = data.split(b"\n")
        out: list[dict[str, Any]] = []
        for raw in lines:
            try:
                obj = json.loads(raw)
            except ValueError:
                continue
            if isinstance(obj, dict):
                out.append(obj)
        return out


def follow_service(registry: Registry, job_id: str, *, out: TextIO | None = None, human: bool | None = None,
                   announce: bool = False) -> int | None:
    """Follow `job_id` through the running service until its record is terminal.

    Args:
        out: where events go (stdout); human: human lines (default: out is a TTY).
        announce: print `dispatched job … to SESSION` on stderr when the service publishes it.
    Returns:
        the exit code of §9, or None when the service stopped before the job ended.
    Raises:
        Detached: Ctrl-C (the job keeps running).
    """
    out = out if out is not None else sys.stdout
    human = (hasattr(out, "isatty") and out.isatty()) if human is None else human
    tail = AuditTail(registry.audit_path(job_id))
    try:
        while True:
            record = registry.get(job_id)  # before the lines: a terminal record's lines are all written
            for line in tail.read():
                if is_event_line(line, job_id):
                    out.write(render_event(line, human))
                    out.flush()
                elif announce and line.get("event") == "status_changed" and line.get("to") == JobStatus.PENDING:
                    print(f"dispatched job {job_id} to {registry.get(job_id)['session']} "
                          f"(attempt {line.get('attempt_id')})", file=sys.stderr, flush=True)
            if settled(record):
                return exit_code_of(record)
            if service_pid(registry.root) is None:
                print(f"job {job_id}: the hub service stopped; watching it here", file=sys.stderr, flush=True)
                return None
            time.sleep(FOLLOW_POLL_S)
    except KeyboardInterrupt:
        raise Detached(job_id) from None


def watch_cli(job_id: str, *, workspace: Workspace, remote: bool, idle_timeout_s: float | None,
              ack_timeout_s: float | None, timeout_s: float | None) -> int:
    """`mam-orch watch`: returns the exit code of §9 (130 when detached with Ctrl-C).
    With a running service and no clock options, it follows the job through the service.

    Raises:
        UsageError, EnvFileError, ConfigError, RegistryError.
    """
    names.validate_job_id(job_id)
    for name, value in (("--idle-timeout", idle_timeout_s), ("--ack-timeout", ack_timeout_s),
                        ("--timeout", timeout_s)):
        if value is not None and not 0 < value <= MAX_OPTION_S:
            raise UsageError(f"{name} {value:g} is invalid: expected seconds > 0")
    hub = open_hub(workspace)
    record = hub.registry.get(job_id)
    own_clocks = idle_timeout_s is not None or ack_timeout_s is not None or timeout_s is not None
    if record["status"] not in TERMINAL_STATUSES and not own_clocks and service_pid(hub.root) is not None:
        try:
            code = follow_service(hub.registry, job_id)
        except Detached:
            print(detach_hint(job_id, workspace), file=sys.stderr)
            return ExitCode.DETACHED
        if code is not None:
            if sys.stdout.isatty():
                print_summary(hub.registry, job_id)
            return code
        record = hub.registry.get(job_id)
    remote = remote or record.get("transport") == "remote" and record.get("role") == "hub"
    cfg = hub.broker_config(record)
    keys = None
    if remote:
        try:
            keys = hub.keys()
        except ConfigError as exc:
            log.warning("%s; a close will not publish a cancel", exc)
    watcher = Watcher(hub.registry, job_id, config=cfg, keys=keys,
                      options=WatchOptions(remote=remote, ack_timeout_s=ack_timeout_s,
                                           idle_timeout_s=idle_timeout_s, timeout_s=timeout_s))
    try:
        code = watcher.run()
    except Detached:
        print(detach_hint(job_id, workspace), file=sys.stderr)
        return ExitCode.DETACHED
    hint = reattach_hint(hub.registry, job_id, workspace) if code == ExitCode.BROKER else None
    if hint is not None:
        print(hint, file=sys.stderr)
    if watcher.human:
        print_summary(hub.registry, job_id, watcher.out)
    return code

