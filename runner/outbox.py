"""The runner's outbox (PROTOCOL §17): every event and state written to disk
stays in `<root>/.mam/outbox/` until the broker acknowledged it (PUBACK).

Layout: one file per publish, `<job_id>.<attempt_id>.<seq>.json` (names.py)
holding the signed event and its signed state, `{"event": {..}, "state": {..}}`:
nothing the two signed messages do not carry (no auth_token, no password).
`put` writes it with `fsio.atomic_write` (0600, folder 0700) under the
registry lock, right after the event took its seq. Whoever gets both PUBACKs
acknowledges it: a non-terminal entry is removed; a terminal one becomes
`<..>.kept.json` and is kept KEEP_TERMINAL_S, re-published after every
reconnect (a broker that crashed before saving retained messages gets them
back; same seq, so receivers drop the duplicate, §3.2 rule 6).

Re-send (`resend`, by the daemon's `Resender`: pending entries at start and
after every reconnect, kept ones after every reconnect and again KEPT_AGAIN_S
later, and every SWEEP_S the pending ones older than SETTLE_S): per job in (attempt, seq) order every
event; a state only when it is the newest of the job's current attempt
(terminal, or the record's `last_seq`), so a re-sent state never replaces a
newer retained one. The first broker failure ends the pass until the next.

Bounds: at OUTBOX_MAX_PENDING entries a new `progress`/`permission_required`
is not kept (a warning; it is in the audit log and sent once); `started` and
terminal entries always are (two per attempt). Kept entries beyond
OUTBOX_MAX_KEPT go oldest first. A file that does not parse becomes `*.bad`.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mam.shared.protocol import names, wire
from mam.shared.protocol.codes import TERMINAL_EVENTS, EventName
from mam.shared.protocol.errors import BrokerError, DecodeError, MamError
from mam.shared.store.fsio import atomic_write, errno_name, read_capped

if TYPE_CHECKING:  # the Protocol only types the daemon's connection; nothing to load on the publish path
    from mam.shared.transport import Transport

log = logging.getLogger("mam.outbox")

OUTBOX_MAX_PENDING = 10_000
"""Unacknowledged entries kept at most (files); beyond, only `started` and terminal entries are kept."""
OUTBOX_MAX_KEPT = 1_000
"""Acknowledged terminal entries kept at most for re-publishing (files); the oldest go first."""
KEEP_TERMINAL_S = 600.0
"""How long an acknowledged terminal entry is re-published after reconnects, seconds (10 × the
shipped mosquitto `autosave_interval` of 60 s: a crash within it loses retained messages)."""
SWEEP_S = 5.0
"""How often the daemon looks for entries a `publish` process could not send, seconds."""
SETTLE_S = 10.0
"""A pending entry younger than this is still its writer's to send; a sweep leaves it, seconds."""
KEPT_AGAIN_S = (5.0, 15.0, 45.0)
"""After a reconnect the kept terminal entries are re-published at once and again these many
seconds later. A NATS cluster electing JetStream leaders after losing a node PUBACKs a retained
message it could not store ("unable to store retained message", nats-server 2.15), while a hub
that reconnected with a clean session may not be subscribed yet: the event and its retained
state are then lost to it, and only a later re-publish reaches it (docs/deployment.md)."""
STOP_WAIT_S = 10.0
"""How long `Resender.stop` waits for a pass in flight (one PUBACK deadline and more), seconds."""
ENTRY_MAX_BYTES = 2 * wire.MAX_MESSAGE_BYTES + 1024
"""Largest entry file read: two messages at their cap plus the envelope, bytes."""
BAD_SUFFIX = ".bad"
ALWAYS_KEPT = frozenset({EventName.STARTED, *TERMINAL_EVENTS})

RecordOf = Callable[[str], Mapping[str, Any] | None]
"""job id -> this host's record of it, or None when there is none."""


@dataclass(frozen=True)
class Slot:
    """An outbox entry file as its name and mtime tell it, before it is read (§17).

    Attributes:
        path: its file; kept: acknowledged terminal entry kept for re-publishing;
        written_at: the file's mtime (acknowledgement time for a kept entry), epoch seconds.
    """

    path: Path
    job_id: str
    attempt_id: int
    seq: int
    kept: bool
    written_at: float


@dataclass(frozen=True)
class Entry:
    """One outbox entry, read and checked: a signed event and its signed state (§17)."""

    slot: Slot
    event: dict[str, Any]
    state: dict[str, Any]

    @property
    def path(self) -> Path:
        return self.slot.path

    @property
    def job_id(self) -> str:
        return self.slot.job_id

    @property
    def attempt_id(self) -> int:
        return self.slot.attempt_id

    @property
    def seq(self) -> int:
        return self.slot.seq

    @property
    def kept(self) -> bool:
        return self.slot.kept

    @property
    def terminal(self) -> bool:
        return self.event["event"] in TERMINAL_EVENTS

    def messages(self, topic_root: str, *, with_state: bool = True) -> list[tuple[str, bytes, bool]]:
        """(topic, payload, retain) in publish order: the event, then the retained state (§4)."""
        out = [(names.events_topic(self.job_id, topic_root), wire.encode(self.event), self.terminal)]
        if with_state:
            out.append((names.state_topic(self.job_id, topic_root), wire.encode(self.state), True))
        return out


@dataclass(frozen=True)
class Resent:
    """What one re-send pass did: entries sent, and whether a broker failure ended it early."""

    sent: int = 0
    jobs: int = 0
    failed: bool = False


def _count_pending(folder: Path) -> int:
    with os.scandir(folder) as found:
        return sum(1 for item in found
                   if item.name.endswith(names.OUTBOX_SUFFIX) and not item.name.endswith(names.OUTBOX_KEPT_SUFFIX))


def put(root: Path, event: Mapping[str, Any], state: Mapping[str, Any], *,
        deferred: Callable[[Path], bool] | None = None) -> Path | None:
    """Keep a signed event and its state until the broker acknowledges them (§17).

    Called under the registry lock, after the event took its seq. Never raises:
    a full outbox or a failed write is logged and the message is still sent once.
    `deferred(path)` True: the entry is written without fsync, the registry's group flushes
    it or leaves it to the page cache (`Registry.group`, §12).

    Returns:
        the entry's path, or None when it was not kept.
    """
    job_id, seq, attempt_id = event["job_id"], event["seq"], event["data"]["attempt_id"]
    path = names.outbox_entry_path(root, job_id, attempt_id, seq)
    try:
        path.parent.mkdir(mode=0o700, exist_ok=True)
        if event["event"] not in ALWAYS_KEPT and _count_pending(path.parent) >= OUTBOX_MAX_PENDING:
            log.warning("job %s seq %d not kept for re-sending: the outbox holds %d entries (the cap)",
                        job_id, seq, OUTBOX_MAX_PENDING)
            return None
        atomic_write(path, wire.canonical({"event": dict(event), "state": dict(state)}),
                     what=f"job {job_id} outbox entry", durable=not (deferred and deferred(path)))
    except (OSError, MamError) as exc:
        reason = f"{errno_name(exc)}: {exc.strerror or exc}" if isinstance(exc, OSError) else str(exc)
        log.warning("job %s seq %d not kept for re-sending (%s)", job_id, seq, reason)
        return None
    return path


def acknowledge(path: Path, *, terminal: bool, now: float | None = None) -> None:
    """Both PUBACKs came: remove the entry, or keep a terminal one as `.kept.json` (§17).

    Another sender may have acknowledged it first; that is not an error. Never raises.
    """
    try:
        if not terminal:
            path.unlink()
            return
        kept = path.with_name(path.name[:-len(names.OUTBOX_SUFFIX)] + names.OUTBOX_KEPT_SUFFIX)
        os.replace(path, kept)
        stamp = time.time() if now is None else now
        os.utime(kept, (stamp, stamp))  # the keep window starts at the acknowledgement
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("outbox entry %s not acknowledged on disk (%s); it will be sent again", path.name,
                    errno_name(exc))


class Outbox:
    """The outbox of one runner root (§17): read, prune and re-send its entries.

    Args:
        root: the runner's root (the workspace holding `.mam/`).
    """

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.folder = names.outbox_dir(self.root)

    def scan(self) -> list[Slot]:
        """Every entry file by name and mtime (nothing read), sorted by (job, attempt, seq)."""
        try:
            listing = os.listdir(self.folder)
        except FileNotFoundError:
            return []
        found = []
        for name in listing:
            parsed = names.parse_outbox_name(name)
            if parsed is None:
                continue
            try:
                written_at = (self.folder / name).stat().st_mtime
            except FileNotFoundError:
                continue  # acknowledged meanwhile
            found.append(Slot(self.folder / name, *parsed, written_at))
        found.sort(key=lambda f: (f.job_id, f.attempt_id, f.seq, f.kept))
        return found

    def entries(self) -> list[Entry]:
        """Every readable entry, sorted by (job, attempt, seq); bad files become `*.bad`."""
        return [entry for slot in self.scan() if (entry := self.load(slot)) is not None]

    def load(self, slot: Slot) -> Entry | None:
        """Read and check one entry (§3, §4 rules); None when gone or set aside as `*.bad`."""
        path = slot.path
        try:
            obj = json.loads(read_capped(path, ENTRY_MAX_BYTES).decode("utf-8"))
            if not isinstance(obj, dict) or set(obj) != {"event", "state"}:
                raise ValueError("expected an object with event and state")
            event, state = wire.from_dict(obj["event"], "event"), wire.from_dict(obj["state"], "state")
            named = (slot.job_id, slot.seq, slot.attempt_id, slot.seq)
            if (event.job_id, event.seq, event.data["attempt_id"], state.seq) != named:
                raise ValueError("its messages do not match its name")
        except FileNotFoundError:
            return None  # acknowledged meanwhile
        except (OSError, OverflowError, ValueError, DecodeError) as exc:
            log.warning("outbox entry %s is unreadable (%s): set aside as %s%s", path.name, exc, path.name,
                        BAD_SUFFIX)
            try:
                os.replace(path, path.with_name(path.name + BAD_SUFFIX))
            except OSError:
                pass
            return None
        return Entry(slot, obj["event"], obj["state"])

    def prune(self, slots: list[Slot], now: float) -> list[Slot]:
        """Remove kept entries older than KEEP_TERMINAL_S or beyond OUTBOX_MAX_KEPT; return the rest."""
        kept = sorted((f for f in slots if f.kept), key=lambda f: f.written_at)
        young = [f for f in kept if now - f.written_at <= KEEP_TERMINAL_S]
        gone = {f.path for f in kept if now - f.written_at > KEEP_TERMINAL_S}
        gone.update(f.path for f in young[:max(0, len(young) - OUTBOX_MAX_KEPT)])
        for path in gone:
            path.unlink(missing_ok=True)
        return [f for f in slots if f.path not in gone]

    def resend(self, client: Transport, record_of: RecordOf, *, settle_s: float = 0.0, with_kept: bool = True,
               now: float | None = None, stop: threading.Event | None = None) -> Resent:
        """Re-send entries per job in seq order; acknowledge each on its PUBACKs (§17).

        Args:
            client: a connected `Transport`; record_of: this host's record of a job, or None.
            settle_s: leave a job's pending entries from the first one younger than this, seconds.
            with_kept: also re-publish acknowledged terminal entries (after a reconnect).
            now: epoch seconds (tests); stop: set to end the pass between two entries.
        Returns:
            a `Resent`; a broker failure ends the pass (`failed`).
        """
        now = time.time() if now is None else now
        sent, jobs, last_job = 0, 0, ""
        settling = ""
        for slot in self.prune(self.scan(), now):
            if stop is not None and stop.is_set():
                break
            if slot.job_id == settling or (slot.kept and not with_kept):
                continue
            if not slot.kept and settle_s > 0 and now - slot.written_at < settle_s:
                settling = slot.job_id  # later seqs of this job wait behind it
                continue
            entry = self.load(slot)
            if entry is None:
                continue
            record = _safe_record(record_of, entry.job_id)
            current = record is None or record.get("attempt_id") == entry.attempt_id
            if entry.kept and not current:  # a newer attempt owns the retained topics now
                entry.path.unlink(missing_ok=True)
                continue
            newest = record is not None and record.get("last_seq") == entry.seq
            with_state = current and (entry.terminal or newest)
            try:
                for topic, payload, retain in entry.messages(client.config.topic_root, with_state=with_state):
                    client.publish(topic, payload, retain=retain)
            except BrokerError as exc:
                log.warning("outbox: re-send stopped at job %s seq %d: %s", entry.job_id, entry.seq, exc)
                return Resent(sent, jobs, failed=True)
            if not entry.kept:
                acknowledge(entry.path, terminal=entry.terminal)
            sent += 1
            if entry.job_id != last_job:
                jobs, last_job = jobs + 1, entry.job_id
        if sent:
            log.info("outbox: re-sent %d event(s) of %d job(s)", sent, jobs)
        return Resent(sent, jobs)


def _safe_record(record_of: RecordOf, job_id: str) -> Mapping[str, Any] | None:
    try:
        return record_of(job_id)
    except MamError:
        return None


class Resender:
    """The daemon's re-send loop on its own thread (§17): every pending entry at start; after
    every `wake()` (a reconnect) the kept terminal entries too, and the kept ones again
    `kept_again_s` later; and every SWEEP_S the pending entries older than SETTLE_S.

    Args:
        outbox: the runner's `Outbox`; client: the daemon's connection; record_of: as `Outbox.resend`.
        sweep_s, settle_s: SWEEP_S and SETTLE_S, seconds.
        kept_again_s: delays after a reconnect of the further kept passes (KEPT_AGAIN_S), seconds.
    """

    def __init__(self, outbox: Outbox, client: Transport, record_of: RecordOf, *, sweep_s: float = SWEEP_S,
                 settle_s: float = SETTLE_S, kept_again_s: tuple[float, ...] = KEPT_AGAIN_S) -> None:
        self.outbox = outbox
        self.client = client
        self.record_of = record_of
        self.sweep_s = sweep_s
        self.settle_s = settle_s
        self.kept_again_s = kept_again_s
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._now_due = True  # a pass over every pending entry, however young
        self._kept_due = False  # ... and the kept terminal entries (after a reconnect)
        self._kept_at: list[float] = []  # monotonic times of the further kept passes after the last reconnect
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the thread; its first pass sends every pending entry."""
        self._thread = threading.Thread(target=self._run, name="outbox", daemon=True)
        self._thread.start()

    def wake(self) -> None:
        """Ask for a full pass (kept terminal entries included) now: the connection came back."""
        with self._lock:
            self._now_due = self._kept_due = True
            now = time.monotonic()
            self._kept_at = [now + delay_s for delay_s in self.kept_again_s]
        self._wake.set()

    def stop(self) -> None:
        """End the loop (between two entries) and wait for the thread; idempotent."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(STOP_WAIT_S)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()
            with self._lock:
                clock = time.monotonic()
                again = [at for at in self._kept_at if at > clock]
                now, kept = self._now_due, self._kept_due or len(again) < len(self._kept_at)
                self._now_due = self._kept_due = False
                self._kept_at = again
            if not self._pass(now, kept):
                with self._lock:  # retried at the next sweep or wake
                    self._now_due, self._kept_due = self._now_due or now, self._kept_due or kept
            with self._lock:
                wait_s = min([self.sweep_s, *(at - time.monotonic() for at in self._kept_at)])
            self._wake.wait(max(0.0, wait_s))

    def _pass(self, now: bool, kept: bool) -> bool:
        """One pass; False when it could not finish (no connection, broker failure)."""
        if not self.client.connected.is_set():
            return False
        try:
            done = self.outbox.resend(self.client, self.record_of, settle_s=0.0 if now else self.settle_s,
                                      with_kept=kept, stop=self._stop)
        except Exception as exc:  # the loop never dies: a bad entry or a full disk waits for the next pass
            log.error("outbox: re-send failed: %s: %s", type(exc).__name__, exc)
            log.debug("traceback", exc_info=True)
            return False
        return not done.failed


__all__ = ["ALWAYS_KEPT", "Entry", "KEEP_TERMINAL_S", "OUTBOX_MAX_KEPT", "OUTBOX_MAX_PENDING", "Outbox", "Resender",
           "Resent", "Slot", "acknowledge", "put"]
