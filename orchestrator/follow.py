"""Following a job: `mam-orch watch`, and the thin CLI over the hub service
(PROTOCOL §14 "One hub process").

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
from pathlib import Path
from typing import Any, TextIO

from mam.orchestrator.hints import detach_hint, reattach_hint
from mam.orchestrator.hub import DAY_S, Workspace, open_hub
from mam.orchestrator.hublock import service_pid
from mam.orchestrator.logs import OutputView
from mam.orchestrator.queuewait import settled
from mam.orchestrator.results import ResultInbox
from mam.orchestrator.watch import Detached, Watcher, WatchOptions, render_event
from mam.shared.cli.render import print_summary, printable
from mam.shared.protocol import names
from mam.shared.protocol.codes import TERMINAL_STATUSES, UNPUBLISHED_STATUSES, JobStatus
from mam.shared.protocol.errors import ConfigError, ExitCode, UsageError
from mam.shared.store.changes import SAFETY_S, JobChanges
from mam.shared.store.records import NOTE, JobRecord, exit_code_of
from mam.shared.store.registry import Registry

log = logging.getLogger("mam.watch")

FOLLOW_POLL_S = 0.1  # without inotify: how often the follower reads the audit log and the record
MAX_OPTION_S = 366 * DAY_S  # a watch option beyond a year is a mistake


def is_event_line(line: dict[str, Any], job_id: str) -> bool:
    """An accepted wire event (§3) as the hub stored it in the audit log."""
    return "schema_version" in line and line.get("job_id") == job_id and isinstance(line.get("seq"), int)


class AuditTail:
    """The new complete lines of one job's audit log, from the start of the file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self._partial = b""

    def skip(self) -> None:
        """Start after what the file holds now."""
        try:
            self.offset = self.path.stat().st_size
        except OSError:
            self.offset = 0

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


class Follower:
    """Print what the hub engine records about one job, from its audit log (§14 "One hub
    process"): the accepted events on `out` (JSON lines, or human lines on a TTY), the
    engine's notes (why it waits, a runner's refusal, a retry) and `VERB job … to SESSION`
    on stderr, and, in the human view, the agent's output under the events (§15).

    Args:
        out: where events go (stdout); human: human lines (default: out is a TTY).
        announce: print `VERB job … to SESSION (attempt N)` each time an attempt is published.
        show_log: show the hub's copy of the agent's output in the human view (`--no-log`).
        offset: the byte of the audit log to start at (a redispatch: its new attempt only).
    """

    def __init__(self, registry: Registry, job_id: str, *, out: TextIO | None = None, human: bool | None = None,
                 announce: bool = False, verb: str = "dispatched", show_log: bool = True,
                 offset: int = 0) -> None:
        self.registry = registry
        self.job_id = job_id
        self.out = out if out is not None else sys.stdout
        self.human = (hasattr(self.out, "isatty") and self.out.isatty()) if human is None else human
        self.announce = announce
        self.verb = verb
        self.tail = AuditTail(registry.audit_path(job_id))
        self.tail.offset = offset
        self.published = False  # an attempt was published while followed
        self.waits: str | None = None  # the hub engine's latest line on why the job waits in the queue
        self.events_shown = True  # False for `--detach`: its stdout is the job id line only
        self.output = OutputView(self.out) if self.human and show_log else None
        self._log_at: tuple[int, int] = (0, 0)  # (attempt, offset) of the hub's output copy shown so far

    def step(self) -> JobRecord:
        """Print every line recorded since the last step; returns the record read first
        (a terminal record's lines are all written before it)."""
        record = self.registry.get(self.job_id)
        for line in self.tail.read():
            if is_event_line(line, self.job_id):
                if self.events_shown:
                    self.out.write(render_event(line, self.human))
                    self.out.flush()
            elif line.get("event") == NOTE and isinstance(line.get("line"), str):
                print(printable(line["line"]), file=sys.stderr, flush=True)
                self.waits = line["line"]
            elif line.get("event") == "status_changed" and line.get("to") == JobStatus.PENDING:
                self.published = True
                if self.announce:  # the line names the runner: the record may not be written yet
                    session = line.get("session") or self.registry.get(self.job_id)["session"]
                    print(f"{self.verb} job {self.job_id} to {session} (attempt {line.get('attempt_id')})",
                          file=sys.stderr, flush=True)
        self._show_output(record)
        return record

    def _show_output(self, record: JobRecord) -> None:
        if self.output is None:
            return
        attempt, offset = self._log_at
        if attempt != record["attempt_id"]:
            self.output.flush()
            attempt, offset = record["attempt_id"], 0
        try:
            with open(names.hub_log_path(self.registry.root, self.job_id, attempt), "rb") as handle:
                handle.seek(offset)
                data = handle.read()
        except OSError:
            data = b""
        self._log_at = (attempt, offset + len(data))
        if data:
            self.output.show([data])
        if record["status"] in TERMINAL_STATUSES:
            self.output.flush()

    def follow(self, *, until_published: bool = False) -> int | None:
        """Print until the job is settled (`settled`), or with `until_published` until it
        left the queue or the hub engine said why it stays there (`waits`).

        Returns:
            the exit code of §9 (0 once published, `published`, or once it waits, with
            `until_published`), or None when no hub service serves the registry any more.
        Raises:
            Detached: Ctrl-C (the job goes on).
        """
        self.events_shown = not until_published  # a fast job's events may be in before the publish is seen
        try:
            with JobChanges(self.registry.root, self.job_id, FOLLOW_POLL_S) as changes:
                while True:
                    record = self.step()
                    if until_published and (self.published or (self.waits is not None
                                                               and record["status"] in UNPUBLISHED_STATUSES)):
                        return 0
                    if settled(record):
                        return exit_code_of(record)
                    if service_pid(self.registry.root) is None:
                        return None
                    changes.wait(SAFETY_S)
        except KeyboardInterrupt:
            raise Detached(self.job_id) from None


def follow_service(registry: Registry, job_id: str, *, out: TextIO | None = None, human: bool | None = None,
                   announce: bool = False) -> int | None:
    """Follow `job_id` through the running service until it is settled (`Follower.follow`).

    Returns:
        the exit code of §9, or None when the service stopped before the job ended.
    Raises:
        Detached: Ctrl-C (the job keeps running).
    """
    return Follower(registry, job_id, out=out, human=human, announce=announce).follow()


def print_events(registry: Registry, job_id: str, out: TextIO | None = None) -> None:
    """Every accepted event of the job's audit log (all attempts), one JSON line each, as a
    follower prints them (tokens masked, `render_event`); on stdout by default."""
    out = out if out is not None else sys.stdout
    for line in AuditTail(registry.audit_path(job_id)).read():
        if is_event_line(line, job_id):
            out.write(render_event(line, False))
    out.flush()


def watch_cli(job_id: str, *, workspace: Workspace, remote: bool, idle_timeout_s: float | None,
              ack_timeout_s: float | None, timeout_s: float | None, as_json: bool = False) -> int:
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
    if record["status"] in TERMINAL_STATUSES and (as_json or not sys.stdout.isatty()):
        print_events(hub.registry, job_id)  # ended already: what a watch printed while it ran
    own_clocks = idle_timeout_s is not None or ack_timeout_s is not None or timeout_s is not None
    if record["status"] not in TERMINAL_STATUSES and not own_clocks and service_pid(hub.root) is not None:
        try:
            code = follow_service(hub.registry, job_id, human=False if as_json else None)
        except Detached:
            print(detach_hint(job_id, workspace), file=sys.stderr)
            return ExitCode.DETACHED
        if code is not None:
            if sys.stdout.isatty() and not as_json:
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
                                           idle_timeout_s=idle_timeout_s, timeout_s=timeout_s),
                      results=ResultInbox(hub.registry) if remote else None)  # §18: no service takes them
    watcher.human = watcher.human and not as_json
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

