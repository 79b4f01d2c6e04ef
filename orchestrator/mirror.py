"""What the hub's watch stores beyond accepted events, and how it sees its own
broker connection (§14 outages): a §4 state that moves a `pending` record to
`running` (a detached dispatch's watch may never see `started`) and records its
seq so one gap is logged once (§3.2 rule 6); a terminal that comes after the hub
closed the job, kept as `late_outcome` (§14 "Late terminals"); `BrokerLink`, the
connection as the idle clocks see it (§14 "Broker outages are nobody's silence").
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time

from mam.shared.protocol import wire
from mam.shared.protocol.codes import EVENT_NAMES, TERMINAL_STATUSES, JobStatus
from mam.shared.protocol.errors import MamError
from mam.shared.store.records import JobRecord, Transaction, late_terminal, moved, touched, utc_now
from mam.shared.store.registry import Registry
from mam.shared.transport import Transport

log = logging.getLogger("mam.watch")

# §10: a watch gives up (exit 3, record left open) after the broker was unreachable this
# long, and never before a job's idle window (K × N); MAM_HUB_OUTAGE_GIVE_UP_S overrides.
OUTAGE_GIVE_UP_S = 60.0
# How much of an audit log's end `audit_seq` reads: far more than the lines a job
# writes between two status changes of a restart window (a heartbeat line is ~300 bytes).
AUDIT_TAIL_BYTES = 16 * 1024


PROBE_WAIT_S = 10.0
"""How long the hub waits for one link probe's PUBACK before it may send the next, seconds."""


class BrokerLink:
    """The hub's own broker connection as the clocks see it (§14 "Broker outages
    are nobody's silence"): `look(now)` notices a loss and the reconnect after it,
    even one that happened between two looks (`Transport.disconnect_count`);
    `proven(moment, proven_at)` tells whether the link was proven alive after `moment`,
    so a silent partition (no loss noticed yet) never passes for a runner's silence
    (§10 "Leases").

    Args:
        client: the hub's connection.
        probe_topic: where link probes go (`names.hub_probe_topic`); None, or a client that
            cannot publish, proves nothing and counts the link as always proven.
    """

    def __init__(self, client: Transport, probe_topic: str | None = None) -> None:
        self.client = client
        self.down_since: float | None = None
        self._losses = getattr(client, "disconnect_count", 0)
        self._probe_topic = probe_topic if callable(getattr(client, "publish_async", None)) else None
        self.proven_at = -math.inf if self._probe_topic is not None else math.inf
        """When (monotonic, seconds) the newest probe the broker acknowledged was sent."""
        self._wanted = threading.Event()
        self._asked = False  # a probe was asked for and has not ended yet
        self._closed = False
        self._prober: threading.Thread | None = None

    @property
    def proving(self) -> bool:
        """True while a probe asked for by `proven` has not ended (acknowledged or not)."""
        return self._asked

    @property
    def down(self) -> bool:
        """True from the first look that found the connection down until it is back."""
        return self.down_since is not None

    def look(self, now: float) -> float | None:
        """The outage's length in seconds when the connection came back since the
        last look (0.0 when it was lost and regained in between), else None."""
        if not self.client.connected.is_set():
            if self.down_since is None:
                self.down_since = now
            return None
        losses = getattr(self.client, "disconnect_count", 0)
        if self.down_since is None and losses == self._losses:
            return None
        outage = now - self.down_since if self.down_since is not None else 0.0
        self.down_since, self._losses = None, losses
        return outage

    def proven(self, moment: float, proven_at: float) -> bool:
        """True when `proven_at` (this link's `proven_at`, read before the messages received
        by then were taken in) is at or after `moment` (monotonic); else a probe is asked
        for and False. A probe is a zero-length QoS 1 publish; its PUBACK comes after every
        message the broker delivered to the hub before it took the probe, so a job still
        silent with that proof was silent, not cut off from the hub (§10)."""
        if proven_at >= moment:
            return True
        if self._probe_topic is not None and not self._closed:
            if self._prober is None:
                self._prober = threading.Thread(target=self._probe, args=(self._probe_topic,),
                                                name="mam-hub-probe", daemon=True)
                self._prober.start()
            self._wanted.set()
            self._asked = True  # after `_wanted`: the prober's end reads it
        return False

    def close(self) -> None:
        """Stop probing; a probe in flight is left to its PUBACK wait."""
        self._closed = True
        self._wanted.set()

    def _probe(self, topic: str) -> None:
        while True:
            self._wanted.wait()
            if self._closed:
                return
            self._wanted.clear()
            sent_at = time.monotonic()
            try:
                self.client.publish_async(topic, b"", timeout_s=PROBE_WAIT_S)()
            except MamError as exc:
                log.debug("hub link probe not acknowledged: %s", exc)
            else:
                self.proven_at = max(self.proven_at, sent_at)
            self._asked = self._wanted.is_set()  # asked again meanwhile: still proving


def mirror_state(txn: Transaction, state: wire.State, gap: tuple[int, int] | None) -> bool:
    """Store what an accepted §4 state of the current attempt tells the hub record:
    its seq (so a gap is logged once), `pending` → `running` for a running job
    (a detached dispatch's watch may never see `started`), or a late terminal (§14).

    Returns:
        True when the record moved to `running`.
    """
    record = txn.record
    if record["status"] in TERMINAL_STATUSES:
        note_late_terminal(txn, state)
        return False
    running = record["status"] == JobStatus.PENDING and state.status == JobStatus.RUNNING
    if state.seq <= record.get("seen_seq", 0) or (gap is None and not running):
        return False  # nothing to store: a record write per heartbeat state buys nothing
    if gap is not None:
        txn.log({"event": "seq_gap", "timestamp": utc_now(), "expected": gap[0], "got": gap[1],
                 "attempt_id": record["attempt_id"], "source": "state"})
    new = moved(record, JobStatus.RUNNING) if running else touched(record)
    new["seen_seq"] = state.seq
    txn.update(new, source="remote_mirror", reason="retained state running" if running else None)
    return running


def note_late_terminal(txn: Transaction, message: wire.Event | wire.State) -> None:
    """§14: a verified terminal of the current attempt after the hub closed the job:
    a `late_terminal` audit line and `late_outcome`; the status stays (§8)."""
    if not message.terminal:
        return
    event = message.last_event if isinstance(message, wire.State) else message.event
    late = late_terminal(txn.record, event, message.seq, message.data.get("exit_code"), message.detail,
                         message.timestamp)
    if late is None:
        return
    new, line = late
    txn.log(line)
    txn.update(new, source="remote_mirror", reason="late terminal")
    log.warning("job %s: the runner reported %s after the hub closed it %s (late_outcome)",
                txn.job_id, new.get("late_outcome"), txn.record.get("close_reason"))


def audit_seq(registry: Registry, record: JobRecord) -> int:
    """The highest seq of an event of the record's current attempt in the last
    `AUDIT_TAIL_BYTES` of its audit log, or the record's `last_seq` if higher.

    The service appends progress lines without rewriting the record (docs/registry.md
    "Durability"); a restarted service starts from here, so the first retained
    state after its restart (§4) is not taken for a `seq_gap` (§3.2 rule 6).
    """
    best = int(record.get("last_seq", 0))
    try:
        with open(registry.audit_path(record["job_id"]), "rb") as handle:
            size = handle.seek(0, os.SEEK_END)
            handle.seek(max(0, size - AUDIT_TAIL_BYTES))
            tail = handle.read(AUDIT_TAIL_BYTES)
    except OSError:
        return best
    for raw in reversed(tail.split(b"\n")):  # accepted event seqs only grow: the last one is the highest
        try:
            line = json.loads(raw)
        except ValueError:
            continue  # the cut first line, a torn one, or an empty one
        if not isinstance(line, dict) or line.get("event") not in EVENT_NAMES:
            continue
        data, seq = line.get("data"), line.get("seq")
        if isinstance(data, dict) and data.get("attempt_id") == record["attempt_id"] \
                and isinstance(seq, int) and not isinstance(seq, bool):
            return max(best, seq)
    return best
