"""The hub's copy of the agents' output (PROTOCOL §15) and `mam-orch logs`.

`LogRouter.handle(raw) -> list[bytes]` takes one message of `ROOT/jobs/<id>/log`,
and returns the new output in order: chunks of the job's current attempt are
verified and opened (`wirelog`), written to `.mam/logs/<id>/agent.<attempt>.log`
in chunk order (`JobLog`: out-of-order chunks wait, MAX_BUFFERED_CHUNKS at most;
duplicates are ignored; a missing chunk becomes a `log_gap` audit line); other
attempts' chunks are refused quietly (debug), malformed or forged ones with a
warning; nothing raises on bad input. Transcript chunks (§15 "Transcript chunks")
go the same way to `logs/<id>/transcript.<attempt>.jsonl`, never into the output,
and `streamed_transcript` reads that copy back for a resumed attempt (§18). `watch`/`dispatch` and the hub service use
it. `OutputView` prints output lines under the event lines of a terminal view;
`logs_cli` prints the copy (and follows it until the job ends).
"""

from __future__ import annotations

import json
import logging
import os
import queue
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from mam.orchestrator.hub import Workspace, open_hub
from mam.shared.protocol import crypto, names
from mam.shared.protocol.codes import TERMINAL_STATUSES
from mam.shared.protocol.errors import DecodeError, ExitCode, MamError, RegistryError, SignatureError, UsageError
from mam.shared.protocol.wire import logchunk
from mam.shared.store.changes import SAFETY_S, JobChanges
from mam.shared.store.fsio import atomic_write, read_json_object
from mam.shared.store.records import exit_code_of, utc_now
from mam.shared.store.registry import Registry
from mam.shared.transport import Inbox

log = logging.getLogger("mam.logs")

MAX_BUFFERED_CHUNKS = 64
"""Out-of-order chunks held at most (4 MiB of output); beyond, the oldest gap is recorded and skipped."""
MAX_AHEAD_CHUNKS = 4096
"""A chunk further than this ahead of the next expected one is refused (a hostile number)."""
STATE_MAX_BYTES = 4096
FOLLOW_POLL_S = 0.2  # without inotify: how often `logs --follow` looks for new output
"""How often `logs --follow` looks at the copy and the record, seconds."""
READ_BYTES = 1 << 20
SETTLE_S = 2.0
"""After the terminal event, how long a watch waits for the output chunks it announced, seconds
(brokers do not order messages across topics)."""

def transcript_state_path(root: Path, job_id: str, attempt_id: int) -> Path:
    """The state of the hub's transcript copy (§15): `transcript.<attempt>.jsonl.json`."""
    path = names.hub_transcript_path(root, job_id, attempt_id)
    return path.with_name(path.name + ".json")


@dataclass
class JobLog:
    """One attempt's copy on the hub (§15): the next chunk expected and what waits for it.
    With `session_id`, the copy of that agent session's transcript; `gap` once a chunk of it
    was skipped (the copy then resumes nothing)."""

    registry: Registry
    job_id: str
    attempt_id: int
    auth_token: str
    session_id: str | None = None
    next: int = 0
    dropped: int = 0
    gap: bool = False
    _waiting: dict[int, tuple[bytes, int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        root = self.registry.root
        if self.session_id is None:
            self.path = names.hub_log_path(root, self.job_id, self.attempt_id)
            self._state = names.hub_log_state_path(root, self.job_id, self.attempt_id)
        else:
            self.path = names.hub_transcript_path(root, self.job_id, self.attempt_id)
            self._state = transcript_state_path(root, self.job_id, self.attempt_id)
        self._key = crypto.log_key(self.auth_token)
        try:
            saved = read_json_object(self._state, STATE_MAX_BYTES)
            self.next, self.dropped, self.gap = int(saved["next"]), int(saved["dropped"]), bool(saved.get("gap"))
            self.session_id = saved.get("session_id", self.session_id)
        except (OSError, MamError, KeyError, TypeError, ValueError):
            pass  # a first chunk, or a copy started by an older hub

    def accept(self, chunk: logchunk.LogChunk) -> list[bytes]:
        """Verify, open and place one chunk; the output now in order (maybe none).

        Raises:
            SignatureError: a forged or tampered chunk; UsageError: a chunk number far ahead.
        """
        number = chunk.chunk
        if chunk.session_id != self.session_id:
            raise UsageError(f"it is of session {chunk.session_id}, the copy of session {self.session_id}")
        if number < self.next or number in self._waiting:
            return []  # a duplicate (QoS 1 redelivery, a runner's re-send)
        if number > self.next + MAX_AHEAD_CHUNKS:
            raise UsageError(f"chunk {number} is more than {MAX_AHEAD_CHUNKS} ahead of chunk {self.next}")
        self._waiting[number] = (crypto.open_log_chunk(chunk, self.auth_token, self._key), chunk.dropped)
        if len(self._waiting) > MAX_BUFFERED_CHUNKS:
            self._skip_gap()
        return self._drain()

    def close(self) -> list[bytes]:
        """The job ended: every chunk still waiting is written after its gap is recorded."""
        out = []
        while self._waiting:
            self._skip_gap()
            out += self._drain()
        return out

    def _skip_gap(self) -> None:
        first = min(self._waiting)
        line = {"event": "log_gap", "timestamp": utc_now(), "attempt_id": self.attempt_id, "expected": self.next,
                "got": first, "source": "hub"}
        if self.session_id is not None:
            line["stream"] = "transcript"
        self.registry.append_audit(self.job_id, line)
        log.warning("job %s: %s chunks %d..%d missing (log_gap)", self.job_id,
                    "output" if self.session_id is None else "transcript", self.next, first - 1)
        self.next, self.gap = first, True

    def _drain(self) -> list[bytes]:
        out = []
        while self.next in self._waiting:
            data, dropped = self._waiting.pop(self.next)
            out.append(data)
            self.next += 1
            self.dropped = max(self.dropped, dropped)
        if out:
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            with open(self.path, "ab") as handle:
                handle.write(b"".join(out))
            self.path.chmod(0o600)
            state: dict[str, object] = {"next": self.next, "dropped": self.dropped}
            if self.session_id is not None:
                state.update({"session_id": self.session_id, "gap": self.gap})
            atomic_write(self._state, json.dumps(state).encode(), what=f"job {self.job_id} log state")
        return out


class LogRouter:
    """Routes §15 chunks to each job's current-attempt `JobLog`.

    Args:
        registry: the hub registry (records hold the auth_token and attempt).
        job_id: accept only this job's chunks (a watch); None accepts every job (the service).
    """

    def __init__(self, registry: Registry, *, job_id: str | None = None) -> None:
        self.registry = registry
        self.job_id = job_id
        self._logs: dict[str, JobLog] = {}
        self._transcripts: dict[str, JobLog] = {}

    def handle(self, raw: bytes) -> list[bytes]:
        """One message of a log topic: the new output of its job, in order. Never raises on bad input.

        Raises:
            RegistryError: the hub's own disk fails (writing the copy or the audit line).
        """
        if len(raw) == 0:
            return []
        try:
            chunk = logchunk.decode_chunk(raw)
        except DecodeError as exc:
            log.warning("refused log chunk: %s", exc.reason)
            return []
        if self.job_id is not None and chunk.job_id != self.job_id:
            log.debug("refused log chunk: unexpected_job %s", chunk.job_id)
            return []
        job = self._current(chunk.job_id, chunk.attempt_id, chunk.session_id)
        if job is None:
            return []
        try:
            out = job.accept(chunk)
            return out if chunk.session_id is None else []  # a transcript is not output
        except (SignatureError, UsageError) as exc:
            log.warning("job %s: refused %s chunk %d: %s", chunk.job_id, chunk.kind, chunk.chunk, exc)
            return []
        except OSError as exc:
            raise RegistryError(f"job {chunk.job_id}: output copy {job.path} not written: "
                                f"{exc.strerror or exc}") from None

    def _current(self, job_id: str, attempt_id: int, session_id: str | None) -> JobLog | None:
        try:
            record = self.registry.get(job_id)
        except RegistryError:
            log.debug("refused log chunk: no record of job %s", job_id)
            return None
        if attempt_id != record.get("attempt_id"):
            log.debug("job %s: refused log chunk of attempt %d (stale_attempt)", job_id, attempt_id)
            return None
        copies = self._logs if session_id is None else self._transcripts
        job = copies.get(job_id)
        if job is None or job.attempt_id != attempt_id:
            token = record.get("auth_token")
            if not isinstance(token, str) or not token:
                return None
            job = copies[job_id] = JobLog(self.registry, job_id, attempt_id, token, session_id)
        return job

    def received(self, job_id: str) -> int:
        """How many chunks of the job's current attempt are written (the next one expected)."""
        job = self._logs.get(job_id)
        return job.next if job is not None else 0

    def dropped(self, job_id: str) -> int:
        job = self._logs.get(job_id)
        return job.dropped if job is not None else 0

    def close(self, job_id: str) -> list[bytes]:
        """The job ended: write what waits behind a gap (the output's returned); forget the job."""
        transcript = self._transcripts.pop(job_id, None)
        if transcript is not None:
            transcript.close()
        job = self._logs.pop(job_id, None)
        return job.close() if job is not None else []


class OutputView:
    """The agent's output lines under the event lines of a terminal view: whole lines only
    (a partial line waits for its end or `flush`), control characters shown escaped."""

    PREFIX = "  | "

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self._partial = b""

    def show(self, parts: list[bytes]) -> None:
        data = self._partial + b"".join(parts)
        lines = data.split(b"\n")
        self._partial = lines.pop()
        self._write(lines)

    def flush(self) -> None:
        if self._partial:
            self._write([self._partial])
        self._partial = b""

    def _write(self, lines: list[bytes]) -> None:
        if not lines:
            return
        for line in lines:
            text = line.decode("utf-8", "replace").rstrip("\r")
            shown = "".join(ch if ch.isprintable() or ch == "\t" else f"\\x{ord(ch):02x}" for ch in text)
            self.out.write(f"{self.PREFIX}{shown}\n")
        self.out.flush()


def streamed_transcript(root: Path, job_id: str, attempt_id: int, session_id: str, max_bytes: int) -> bytes | None:
    """The hub's copy of session `session_id`'s transcript as attempt `attempt_id` streamed it
    (§15 "Transcript chunks"), cut after its last whole line; None when there is none of that
    session, a chunk of it is missing or was dropped, or it is over `max_bytes`."""
    try:
        state = read_json_object(transcript_state_path(root, job_id, attempt_id), STATE_MAX_BYTES)
        if state.get("session_id") != session_id or state.get("gap") or state.get("dropped"):
            return None
        path = names.hub_transcript_path(root, job_id, attempt_id)
        with open(path, "rb", opener=lambda name, flags: os.open(name, flags | os.O_NOFOLLOW)) as handle:
            data = handle.read(max_bytes + 1)
    except (OSError, MamError):
        return None
    if len(data) > max_bytes:
        return None
    return data[:data.rfind(b"\n") + 1] or None


def await_chunks(router: LogRouter, job_id: str, announced: object, messages: Inbox,
                 handle: Callable[[str, bytes], object], settle_s: float = SETTLE_S) -> list[bytes]:
    """After the terminal event: handle messages until the `data.log_chunks` it announced are
    written (at most `settle_s`), then close the job's copy; the output that waited behind a gap."""
    want = announced if isinstance(announced, int) and not isinstance(announced, bool) else 0
    deadline = time.monotonic() + settle_s
    while router.received(job_id) < want and (left := deadline - time.monotonic()) > 0:
        try:
            message = messages.get(timeout=left)
        except queue.Empty:
            break
        handle(message.topic, message.payload)
    return router.close(job_id)


class JsonLines:
    """`logs --json`: each whole output line as `{"job_id", "attempt_id", "line"}` (a partial
    line waits for its end, or `flush` at the end of the job)."""

    def __init__(self, out: TextIO, job_id: str, attempt_id: int) -> None:
        self.out, self.job_id, self.attempt_id = out, job_id, attempt_id
        self._partial = b""

    def write(self, data: bytes) -> None:
        *lines, self._partial = (self._partial + data).split(b"\n")
        for line in lines:
            self._emit(line)

    def flush(self) -> None:
        if self._partial:
            self._emit(self._partial)
        self._partial = b""
        self.out.flush()

    def _emit(self, line: bytes) -> None:
        self.out.write(json.dumps({"job_id": self.job_id, "attempt_id": self.attempt_id,
                                   "line": line.decode("utf-8", "replace")}) + "\n")


def _print_new(path: Path, offset: int, out: TextIO, as_json: JsonLines | None = None) -> int:
    """Copy the file's bytes from `offset` to `out` (or as JSON lines); the new offset."""
    try:
        with open(path, "rb") as handle:
            handle.seek(offset)
            while data := handle.read(READ_BYTES):
                if as_json is not None:
                    as_json.write(data)
                elif hasattr(out, "buffer"):
                    out.buffer.write(data)
                else:
                    out.write(data.decode("utf-8", "replace"))
                offset += len(data)
    except FileNotFoundError:
        return offset
    out.flush()
    return offset


def logs_cli(job_id: str, *, workspace: Workspace, follow: bool, attempt: int | None,
             out: TextIO | None = None, as_json: bool = False) -> int:
    """`mam-orch logs`: print the hub's copy of a job's output (§15); with `follow`, keep
    printing until the job ends, then exit as `watch` does (§9).

    Raises:
        UsageError: a bad job id or attempt; RegistryError: no record.
    """
    names.validate_job_id(job_id)
    stream = out if out is not None else sys.stdout
    hub = open_hub(workspace)
    record = hub.registry.get(job_id)
    current = int(record["attempt_id"])
    chosen = current if attempt is None else names.validate_attempt(attempt)
    if chosen > current:
        raise UsageError(f"job {job_id} has no attempt {chosen} (its current attempt is {current})")
    path = names.hub_log_path(hub.registry.root, job_id, chosen)
    if not path.exists() and not follow:
        print(f"job {job_id}: no output of attempt {chosen} on the hub yet ({path}); the runner keeps the "
              f"whole output in its own .mam/logs/{job_id}/agent.log", file=sys.stderr)
    lines = JsonLines(stream, job_id, chosen) if as_json else None
    offset = _print_new(path, 0, stream, lines)
    if not follow:
        if lines is not None:
            lines.flush()
        return ExitCode.COMPLETED
    with JobChanges(hub.registry.root, job_id, FOLLOW_POLL_S) as changes:  # told of new output, not polling
        while True:
            record = hub.registry.get(job_id)
            status = record["status"]
            offset = _print_new(path, offset, stream, lines)
            if status in TERMINAL_STATUSES or chosen != current:
                if lines is not None:
                    lines.flush()
                return exit_code_of(record) if chosen == current else ExitCode.COMPLETED
            changes.wait(SAFETY_S)


__all__ = ["JobLog", "await_chunks", "streamed_transcript",
           "LogRouter", "MAX_AHEAD_CHUNKS", "MAX_BUFFERED_CHUNKS", "OutputView", "logs_cli"]
