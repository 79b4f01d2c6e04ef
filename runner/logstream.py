"""The agent's output to the hub (PROTOCOL §15): one `LogStream` per running job.

One reader thread per runner (`Pump`) follows every job's `agent.log` (the
agent's stdout and stderr, from where it stood when the job started), masks
secrets (`Masker`: the values of MQTT_PASSWORD, MAM_DISPATCH_SECRET, the job's
auth_token and any private key file the runner holds, in clear, base64 and
JSON-escaped; a tail that may start a secret is held back until more output or
the end), applies the rate cap
(`RateLimit`, MAM_LOG_RATE_BPS, excess counted in `dropped`), cuts chunks
(`Chunker`: 64 KiB, or 0.5 s after the first unsent byte), seals and signs them
(`crypto.build_log_chunk`) and writes each to the log outbox
`.mam/outbox-log/` (§17: kept until PUBACK). A sender thread, started with a
job's first chunk, publishes them in order on `ROOT/jobs/<id>/log` (QoS 1, not
retained), retrying through outages; a job that prints nothing starts no thread.
The outbox is capped (OUTBOX_MAX_BYTES per job, beyond: dropped), so no queue
grows without bound. `finish` (the §15 barrier, before `completed`/`error`)
reads to the end on the caller's thread, sends the rest and waits for the
PUBACKs (FINISH_WAIT_S at most while connected); the terminal event then
carries `data.log_chunks`.

A `LogStream` given a `session_id` streams the agent session's transcript instead
(§15 "Transcript chunks"): `kind: transcript` chunks of the file its `log_path`
callable names once the agent saved it, from byte 0, masked, without the rate cap
but at most MAX_TRANSCRIPT_STREAM_BYTES, through `.mam/outbox-transcript/`, so that
the hub holds the session even when this runner dies before its result.
"""

from __future__ import annotations

import base64
import errno
import json
import logging
import os
import re
import stat
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from mam.shared import config as shared_config
from mam.shared.config import BrokerConfig
from mam.shared.protocol import crypto, names
from mam.shared.protocol.errors import BrokerError, ConfigError, MamError
from mam.shared.protocol.wire import logchunk
from mam.shared.store.fsio import atomic_write, read_capped
from mam.shared.store.registry import Registry
from mam.shared.transport import Transport

log = logging.getLogger("mam.logstream")

RATE_ENV = "MAM_LOG_RATE_BPS"
DEFAULT_RATE_BPS = 262_144
"""Output sent per job at most, bytes per second (§15)."""
MIN_RATE_BPS = 1024
MAX_RATE_BPS = 1 << 30
RATE_BURST_S = 1.0
"""The rate cap's bucket holds this many seconds of output, seconds."""
FLUSH_AFTER_S = 0.5
"""A chunk goes out this long after its first unsent byte, seconds (§15)."""
READ_POLL_S = 0.05
"""How often the reader looks for new output, seconds."""
READ_BYTES = 1 << 20
"""Largest read of agent.log at once, bytes."""
READS_PER_PASS = 4
"""Reads of one stream per pass of the pump at most, so one loud job cannot hold up the others."""
PUMP_IDLE_S = 60.0
"""A runner's pump thread ends after this long without a stream, seconds (the next one starts it)."""
OUTBOX_MAX_BYTES = 64 << 20
"""Sealed chunks of one job waiting for their PUBACK at most, bytes; beyond, output is dropped."""
FINISH_WAIT_S = 10.0
"""How long the terminal event waits for the output's PUBACKs while the broker is up, seconds."""
RETRY_S = 0.5
"""Pause after a failed publish or while the connection is down, seconds."""
RECONNECT_SETTLE_S = 2.0
"""After the connection comes back, the sender waits this long before re-sending, seconds: the hub's
own client reconnects and subscribes again in the same moment (clean sessions keep nothing)."""
KEEP_SENDING_S = 600.0
"""After the job ended, unsent chunks are retried this long (the outbox's KEEP_TERMINAL_S), seconds."""
MASK = b"***"
MIN_SECRET_CHARS = 6
"""Shorter values are not masked (they would mask ordinary words)."""
KEY_FILE_MAX_BYTES = 64 * 1024
PEM_LINE_MIN_CHARS = 16
MAX_TRANSCRIPT_STREAM_BYTES = 32 << 20
"""A session transcript streamed at most, bytes (the result's MAX_TRANSCRIPT_BYTES); beyond, dropped."""
FINISHED_KEPT = 1024
"""Finished jobs whose terminal data is remembered (a terminal event written again after a disk error)."""


def rate_from_env(values: Mapping[str, str]) -> int:
    """MAM_LOG_RATE_BPS (bytes per second per job). Raises ConfigError on a bad value."""
    text = values.get(RATE_ENV, "").strip()
    if not text:
        return DEFAULT_RATE_BPS
    try:
        rate = int(text)
    except ValueError:
        raise ConfigError(f"{RATE_ENV}={text!r} is invalid: expected bytes per second (an integer)") from None
    if not MIN_RATE_BPS <= rate <= MAX_RATE_BPS:
        raise ConfigError(f"{RATE_ENV}={rate} is out of range {MIN_RATE_BPS}..{MAX_RATE_BPS}")
    return rate


def secret_forms(value: str) -> set[bytes]:
    """The byte forms of one secret masked in the output: clear, base64 (standard and URL-safe,
    with and without padding) and JSON-escaped (ASCII-only and not)."""
    if len(value) < MIN_SECRET_CHARS:
        return set()
    raw = value.encode("utf-8", "surrogateescape")
    forms = {raw}
    for encode in (base64.b64encode, base64.urlsafe_b64encode):
        coded = encode(raw)
        forms.update({coded, coded.rstrip(b"=")})
    for ascii_only in (True, False):
        forms.add(json.dumps(value, ensure_ascii=ascii_only)[1:-1].encode("utf-8", "surrogateescape"))
    return forms


def key_file_secrets(path: str) -> list[str]:
    """A private key file's text and each long line of its PEM body ([] when unreadable)."""
    if not path:
        return []
    try:
        text = read_capped(Path(path), KEY_FILE_MAX_BYTES).decode("utf-8", "replace").strip()
    except (OSError, MamError):
        return []
    lines = [line.strip() for line in text.splitlines() if not line.startswith("-----")]
    return [text, *(line for line in lines if len(line) >= PEM_LINE_MIN_CHARS)]


class Masker:
    """Replaces every form of every secret with `***`, across feeds (§15).

    A tail that is the start of some form is held back until the next feed or `final`.
    """

    def __init__(self, secrets: Iterable[str]) -> None:
        forms: set[bytes] = set()
        for value in secrets:
            if value:
                forms |= secret_forms(value)
        patterns = sorted(forms, key=len, reverse=True)  # the longest form wins at one position
        self._regex = re.compile(b"|".join(re.escape(p) for p in patterns)) if patterns else None
        self._prefixes = {p[:k] for p in patterns for k in range(1, len(p))}
        self._longest = len(patterns[0]) if patterns else 0
        self._pending = b""

    def feed(self, data: bytes, *, final: bool = False) -> bytes:
        """The masked output that is safe to send now."""
        buf = self._pending + data
        self._pending = b""
        if self._regex is None:
            return buf
        parts, pos = [], 0
        for match in self._regex.finditer(buf):
            if not final and buf[match.start():] in self._prefixes:
                break  # a longer form may go on in the next feed (base64 padding): held back below
            parts += [buf[pos:match.start()], MASK]
            pos = match.end()
        rest = buf[pos:]
        hold = 0
        if not final:
            for size in range(min(len(rest), self._longest - 1), 0, -1):
                if rest[-size:] in self._prefixes:
                    hold = size
                    break
        parts.append(rest[:len(rest) - hold])
        self._pending = rest[len(rest) - hold:]
        return b"".join(parts)


class RateLimit:
    """A token bucket of `rate_bps` bytes per second holding RATE_BURST_S of output (§15)."""

    def __init__(self, rate_bps: int, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate_bps = rate_bps
        self.capacity = rate_bps * RATE_BURST_S
        self.tokens = self.capacity
        self.clock = clock
        self._at = clock()

    def take(self, size: int) -> int:
        """How many of `size` bytes may be sent now (the rest is dropped)."""
        now = self.clock()
        self.tokens = min(self.capacity, self.tokens + (now - self._at) * self.rate_bps)
        self._at = now
        allowed = min(size, int(self.tokens))
        self.tokens -= allowed
        return allowed


class Chunker:
    """Cuts output into chunks of at most `max_bytes`, or sooner `flush_after_s` after the
    first unsent byte (§15); a rise of `dropped` alone is sent too (an empty chunk)."""

    def __init__(self, max_bytes: int = logchunk.MAX_CHUNK_BYTES, flush_after_s: float = FLUSH_AFTER_S) -> None:
        self.max_bytes = max_bytes
        self.flush_after_s = flush_after_s
        self.dropped = 0
        self._buf = bytearray()
        self._since: float | None = None
        self._dropped_sent = 0

    def add(self, data: bytes, now: float) -> None:
        if data:
            self._buf += data
            if self._since is None:
                self._since = now

    def drop(self, size: int, now: float) -> None:
        if size > 0:
            self.dropped += size
            if self._since is None:
                self._since = now

    def ready(self, now: float, *, final: bool = False) -> list[tuple[bytes, int]]:
        """(plaintext, dropped before it) of every chunk due now."""
        out = []
        while len(self._buf) >= self.max_bytes:
            out.append((bytes(self._buf[:self.max_bytes]), self.dropped))
            del self._buf[:self.max_bytes]
        pending = bool(self._buf) or (self.dropped != self._dropped_sent and not out)
        if not pending:
            self._since = None
        elif final or (self._since is not None and now - self._since >= self.flush_after_s):
            out.append((bytes(self._buf), self.dropped))
            self._buf.clear()
            self._since = None
        if out:
            self._dropped_sent = self.dropped
        return out


@dataclass
class _Pending:
    chunk: int
    path: Path | None  # None: the disk refused it, `raw` is the only copy
    raw: bytes | None
    size: int


class Pump:
    """One thread that reads the output of many streams (§15): a pass over every open stream
    each READ_POLL_S, so a running job costs no reader thread of its own. The thread starts
    with the first stream and ends `idle_s` seconds after the last one."""

    def __init__(self, name: str = "log-pump", *, idle_s: float = PUMP_IDLE_S) -> None:
        self.name, self.idle_s = name, idle_s
        self._streams: list[LogStream] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    def add(self, stream: LogStream) -> None:
        with self._lock:
            self._streams.append(stream)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
        self._wake.set()

    def _run(self) -> None:
        idle_since: float | None = None
        while True:
            with self._lock:
                self._streams = [stream for stream in self._streams if not stream.read_ended]
                streams = list(self._streams)
                if not streams and idle_since is not None and time.monotonic() - idle_since >= self.idle_s:
                    self._thread = None  # under the lock: `add` starts a new thread
                    return
            if streams:
                idle_since = None
            elif idle_since is None:
                idle_since = time.monotonic()
            for stream in streams:
                stream.pump()
            self._wake.wait(READ_POLL_S if streams else self.idle_s)
            self._wake.clear()


class LogStream:
    """One job's output stream (§15), or with `session_id` its agent's transcript stream: read
    by a `Pump`'s thread, sent by a thread of its own from its first chunk.

    Args:
        log_path: the file to follow, or a callable naming it once it exists (None before).
        offset: where to start in it, bytes; rate_bps: the rate cap (MAX_RATE_BPS: none).
        max_bytes: output taken at most, bytes (beyond: dropped); None: no limit.
        session_id: stream the transcript of this agent session (`kind: transcript` chunks).
    """

    def __init__(self, *, root: Path, client: Transport, job_id: str, attempt_id: int, auth_token: str,
                 log_path: Path | Callable[[], Path | None], secrets: Iterable[str], rate_bps: int, offset: int = 0,
                 max_bytes: int | None = None, session_id: str | None = None) -> None:
        self.root, self.client, self.job_id, self.attempt_id = root, client, job_id, attempt_id
        self.topic = names.log_topic(job_id, client.config.topic_root)
        self.log_path, self.offset = log_path, offset
        self.session_id, self._room = session_id, max_bytes
        self._token, self._key = auth_token, crypto.log_key(auth_token)
        self.masker, self.rate, self.chunker = Masker(secrets), RateLimit(rate_bps), Chunker()
        self.chunks = 0  # made so far
        self._queue: deque[_Pending] = deque()
        self._unsent = 0
        self._lock = threading.Lock()
        self._read_lock = threading.Lock()  # one reader at a time: the pump's pass or `finish`
        self._handle: BinaryIO | None = None
        self._sender: threading.Thread | None = None
        self._read_done, self._sent_all = threading.Event(), threading.Event()
        self._stop, self._wake = threading.Event(), threading.Event()
        self._give_up_at = float("inf")
        self._was_down = False

    def start(self, pump: Pump | None = None) -> None:
        """Follow the file on `pump`'s thread (None: a pump of its own, ended with the stream)."""
        (pump or Pump(f"log-read-{self.job_id}", idle_s=0.0)).add(self)

    @property
    def read_ended(self) -> bool:
        return self._read_done.is_set()

    def finish(self, wait_s: float = FINISH_WAIT_S) -> dict[str, int]:
        """The barrier before the terminal event: read to the end, send, wait for the PUBACKs
        (at most `wait_s` while the broker is up). Returns the terminal event's data."""
        deadline = time.monotonic() + wait_s
        if self._read_lock.acquire(timeout=wait_s):  # the pump's pass over this stream ends first
            try:
                while not self._read_done.is_set() and not self._read_step(final=True):
                    pass
            finally:
                self._read_lock.release()
        while not self._sent_all.is_set() and self.client.connected.is_set() and time.monotonic() < deadline:
            self._sent_all.wait(READ_POLL_S)
        if not self._sent_all.is_set():
            log.warning("job %s: %d output chunk(s) not acknowledged yet; sent after the terminal event",
                        self.job_id, len(self._queue))
        self._give_up_at = time.monotonic() + KEEP_SENDING_S
        return {"log_chunks": self.chunks, "log_dropped": self.chunker.dropped}

    def stop(self) -> None:
        """Stop reading and sending now (the runner stops); unsent chunks stay in the outbox."""
        self._stop.set()
        self._wake.set()

    # ------------------------------------------------------------ reader

    def pump(self) -> None:
        """One pass of the pump: read what the file gained (READS_PER_PASS reads at most), cut
        the chunks that are due; never raises. A pass `finish` is running is skipped."""
        if not self._read_lock.acquire(blocking=False):
            return
        try:
            for _ in range(READS_PER_PASS):
                if self._read_done.is_set() or self._read_step(final=False):
                    break
        finally:
            self._read_lock.release()

    def _read_step(self, *, final: bool) -> bool:
        """Read once and cut the chunks that are due (`final`: the file is read to its end
        now). True when there is nothing more to read for now: no new output, or reading
        is over (at the end with `final`, on `stop`, on an error, which is logged)."""
        try:
            if self._stop.is_set():
                self._end_reading()
                return True
            if self._handle is None:
                self._handle = self._open()
            data = self._handle.read(READ_BYTES) if self._handle is not None else b""
            if data:
                self._ingest(self.masker.feed(data))
            elif final:
                self._ingest(self.masker.feed(b"", final=True))
                self._emit(self.chunker.ready(time.monotonic(), final=True))
                self._end_reading()
                return True
            self._emit(self.chunker.ready(time.monotonic()))
            return not data
        except Exception as exc:  # the job never fails because of its output stream
            log.error("job %s: output stream stopped: %s: %s", self.job_id, type(exc).__name__, exc)
            self._end_reading()
            return True

    def _end_reading(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None
        self._read_done.set()
        with self._lock:
            if not self._queue:
                self._sent_all.set()
        self._wake.set()

    def _open(self) -> BinaryIO | None:
        """The followed file at `offset`, or None while it does not exist (never through a link).

        Raises:
            OSError: a link where the file should be (ELOOP), or not a regular file (a FIFO
                would block the pump, which reads every job's output).
        """
        path = self.log_path() if callable(self.log_path) else self.log_path
        if path is None:
            return None
        try:
            handle = open(path, "rb", opener=_no_follow)  # noqa: SIM115 - held across the pump's passes
        except FileNotFoundError:
            return None
        if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
            handle.close()
            raise OSError(errno.EINVAL, f"{path} is not a regular file")
        handle.seek(self.offset)
        return handle

    def _ingest(self, masked: bytes) -> None:
        now = time.monotonic()
        allowed = self.rate.take(len(masked)) if self._unsent < OUTBOX_MAX_BYTES else 0
        if self._room is not None:
            allowed = min(allowed, self._room)
            self._room -= allowed
        self.chunker.drop(len(masked) - allowed, now)
        self.chunker.add(masked[:allowed], now)

    def _emit(self, chunks: list[tuple[bytes, int]]) -> None:
        for plaintext, dropped in chunks:
            raw = crypto.build_log_chunk(self._token, self._key, job_id=self.job_id, attempt_id=self.attempt_id,
                                         chunk=self.chunks, dropped=dropped, plaintext=plaintext,
                                         session_id=self.session_id)
            path: Path | None = names.log_outbox_entry_path(self.root, self.job_id, self.attempt_id, self.chunks,
                                                            transcript=self.session_id is not None)
            try:
                assert path is not None
                path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
                # not fsynced (§15): a killed runner loses no chunk; a power loss may lose the
                # last ones, as it may lose the end of agent.log
                atomic_write(path, raw, what=f"job {self.job_id} log chunk", durable=False)
            except (OSError, MamError) as exc:
                log.warning("job %s: log chunk %d kept in memory only (%s)", self.job_id, self.chunks, exc)
                path = None
            with self._lock:
                self._queue.append(_Pending(self.chunks, path, raw if path is None else None, len(raw)))
                self._unsent += len(raw)
                self._sent_all.clear()
                if self._sender is None:
                    self._sender = threading.Thread(target=self._send, name=f"log-send-{self.job_id}",
                                                    daemon=True)
                    self._sender.start()
            self.chunks += 1
            self._wake.set()

    # ------------------------------------------------------------ sender

    def _send(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                item = self._queue[0] if self._queue else None
                if item is None and self._read_done.is_set():
                    self._sent_all.set()
                    return
            if item is None:
                self._wake.wait(READ_POLL_S)
                self._wake.clear()
                continue
            if time.monotonic() > self._give_up_at:
                log.error("job %s: %d output chunk(s) not acknowledged in %g s; they stay in %s", self.job_id,
                          len(self._queue), KEEP_SENDING_S, names.log_outbox_dir(self.root))
                return
            if not self.client.connected.is_set() or not self._publish(item):
                self._was_down = True
                self._stop.wait(RETRY_S)
                continue
            with self._lock:
                self._queue.popleft()
                self._unsent -= item.size
                if not self._queue and self._read_done.is_set():
                    self._sent_all.set()

    def _publish(self, item: _Pending) -> bool:
        if self._was_down:  # back after an outage: let the hub subscribe again first
            self._was_down = False
            self._stop.wait(RECONNECT_SETTLE_S)
        try:
            raw = item.raw if item.path is None else read_capped(item.path, logchunk.MAX_LOG_MESSAGE_BYTES)
            assert raw is not None
            self.client.publish(self.topic, raw, retain=False)
        except BrokerError as exc:
            log.debug("job %s: log chunk %d not sent yet: %s", self.job_id, item.chunk, exc)
            return False
        except (OSError, MamError) as exc:
            log.warning("job %s: log chunk %d unreadable, skipped: %s", self.job_id, item.chunk, exc)
        if item.path is not None:
            item.path.unlink(missing_ok=True)
        return True


def _no_follow(name: str, flags: int) -> int:
    """Open without following a link, and without waiting for a writer (a FIFO)."""
    return os.open(name, flags | os.O_NOFOLLOW | os.O_NONBLOCK)


def _leftover_key(path: Path) -> tuple[str, int, int] | None:
    """(job_id, attempt_id, chunk) of a log outbox file name, or None."""
    parts = path.name.split(".")
    if len(parts) != 4 or parts[3] != "json" or not names.JOB_ID_RE.fullmatch(parts[0]) \
            or not parts[1].isdigit() or not parts[2].isdigit():
        return None
    return parts[0], int(parts[1]), int(parts[2])


class LogStreams:
    """The output streams of one runner's jobs (§15), used by `job.Supervisor`.

    Args:
        root: the runner's root; client: the daemon's connection; config: its broker settings.
        rate_bps: MAM_LOG_RATE_BPS; environ: where MAM_DISPATCH_SECRET is read (None = the process's).
    """

    def __init__(self, *, root: Path, client: Transport, config: BrokerConfig, rate_bps: int = DEFAULT_RATE_BPS,
                 environ: Mapping[str, str] | None = None) -> None:
        self.root, self.client, self.rate_bps = Path(root), client, rate_bps
        try:
            dispatch_secret = shared_config.load_env(environ, workspace=self.root).get("MAM_DISPATCH_SECRET", "")
        except MamError:
            dispatch_secret = ""
        self.secrets = [config.password, dispatch_secret, *key_file_secrets(config.keyfile)]
        self._streams: dict[str, LogStream] = {}
        self._transcripts: dict[str, LogStream] = {}
        self._finished: dict[str, dict[str, int]] = {}
        self._lock = threading.Lock()
        self._pump = Pump()

    def start(self, registry: Registry, job_id: str, attempt_id: int, log_path: Path,
              offset: int | None = None) -> None:
        """Follow `log_path` for the job's attempt from byte `offset` (None: its current
        end); never raises."""
        try:
            token = registry.get(job_id)["auth_token"]
            if offset is None:
                offset = os.stat(log_path).st_size if log_path.exists() else 0
            stream = LogStream(root=self.root, client=self.client, job_id=job_id, attempt_id=attempt_id,
                               auth_token=token, log_path=log_path, secrets=[*self.secrets, token],
                               rate_bps=self.rate_bps, offset=offset)
        except (MamError, OSError, KeyError) as exc:
            log.warning("job %s: its output is not streamed to the hub: %s", job_id, exc)
            return
        with self._lock:
            self._streams[job_id] = stream
        stream.start(self._pump)

    def start_transcript(self, registry: Registry, job_id: str, attempt_id: int, session_id: str,
                         source: Callable[[], Path | None]) -> None:
        """Stream the transcript of agent session `session_id` (§15 "Transcript chunks"), the
        file `source` names once the agent saved it, from its first byte; never raises."""
        try:
            token = registry.get(job_id)["auth_token"]
            stream = LogStream(root=self.root, client=self.client, job_id=job_id, attempt_id=attempt_id,
                               auth_token=token, log_path=source, secrets=[*self.secrets, token],
                               rate_bps=MAX_RATE_BPS, max_bytes=MAX_TRANSCRIPT_STREAM_BYTES,
                               session_id=names.validate_agent_session_id(session_id))
        except (MamError, OSError, KeyError) as exc:
            log.warning("job %s: its agent's transcript is not streamed to the hub: %s", job_id, exc)
            return
        with self._lock:
            if job_id in self._transcripts:  # one session per attempt
                return
            self._transcripts[job_id] = stream
        stream.start(self._pump)

    def mask(self, registry: Registry, job_id: str, text: str) -> str:
        """`text` with every secret of the job's stream masked (§15): for what else the hub
        is shown of the agent's words, e.g. a permission request's input (§19)."""
        try:
            token = registry.get(job_id).get("auth_token") or ""
        except (MamError, OSError):
            token = ""
        return Masker([*self.secrets, token]).feed(text.encode("utf-8", "replace"), final=True).decode(
            "utf-8", "replace")

    def finish(self, job_id: str) -> dict[str, int]:
        """§15 barrier: all output sent before the terminal event. Returns the terminal event's
        data (`{}` without a stream); a second call returns the first one's answer at once."""
        with self._lock:
            stream = self._streams.pop(job_id, None)
            transcript = self._transcripts.pop(job_id, None)
        if transcript is not None:  # the hub's copy whole before the end, as far as it can be
            transcript.finish()
        if stream is None:
            return dict(self._finished.get(job_id, {}))
        done = stream.finish()
        with self._lock:
            if len(self._finished) >= FINISHED_KEPT:
                self._finished.pop(next(iter(self._finished)))
            self._finished[job_id] = done
        return dict(done)

    def resend_leftovers(self) -> None:
        """Chunks a stopped runner left in the log outbox: sent once the connection is up (in job,
        attempt, chunk order, on a daemon thread), or removed when older than KEEP_SENDING_S (§17)."""
        threading.Thread(target=self._resend_leftovers, name="log-leftovers", daemon=True).start()

    def _resend_leftovers(self) -> None:
        found = []
        for folder in (names.log_outbox_dir(self.root), names.transcript_outbox_dir(self.root)):
            try:
                found += sorted((key, p) for p in folder.iterdir() if (key := _leftover_key(p)) is not None)
            except OSError:
                continue
        if not found or not self.client.connected.wait(KEEP_SENDING_S):
            return
        sent = 0
        for key, path in found:
            try:
                if time.time() - path.stat().st_mtime > KEEP_SENDING_S:
                    path.unlink()
                    continue
                raw = read_capped(path, logchunk.MAX_LOG_MESSAGE_BYTES)
                if not raw:  # written just before a power loss, never flushed: nothing to send
                    path.unlink()
                    continue
                self.client.publish(names.log_topic(key[0], self.client.config.topic_root), raw, retain=False)
                path.unlink(missing_ok=True)
                sent += 1
            except (OSError, MamError) as exc:  # the next start tries again
                log.warning("log outbox: re-send stopped at %s: %s", path.name, exc)
                break
        if sent:
            log.info("log outbox: re-sent %d output chunk(s) left by a stopped runner", sent)

    def stop_all(self) -> None:
        with self._lock:
            streams = [*self._streams.values(), *self._transcripts.values()]
            self._streams, self._transcripts = {}, {}
        for stream in streams:
            stream.stop()


__all__ = ["Chunker", "DEFAULT_RATE_BPS", "LogStream", "LogStreams", "Masker", "Pump", "RATE_ENV", "RateLimit",
           "key_file_secrets", "rate_from_env", "secret_forms"]
