"""What the hub's watch stores beyond accepted events, and how it sees its own
broker connection (issue 10): a §4 state that moves a `pending` record to
`running` (a detached dispatch's watch may never see `started`) and records its
seq so one gap is logged once (§3.2 rule 6); a terminal that comes after the hub
closed the job, kept as `late_outcome` (§14 "Late terminals"); `BrokerLink`, the
connection as the idle clocks see it (§14 "Broker outages are nobody's silence").
"""

from __future__ import annotations

import logging

from mam.shared import wire
from mam.shared.codes import TERMINAL_STATUSES, JobStatus
from mam.shared.mqtt import MqttClient
from mam.shared.records import Transaction, late_terminal, moved, touched, utc_now

log = logging.getLogger("mam.watch")

# §14: a watch gives up (exit 3, record left open) after the broker was unreachable this
# long, and never before a job's idle window (K × N); MAM_HUB_OUTAGE_GIVE_UP_S overrides.
OUTAGE_GIVE_UP_S = 60.0


class BrokerLink:
    """The hub's own broker connection as the clocks see it (§14 "Broker outages
    are nobody's silence"): `look(now)` notices a loss and the reconnect after it,
    even one that happened between two looks (`MqttClient.disconnect_count`)."""

    def __init__(self, client: MqttClient) -> None:
        self.client = client
        self.down_since: float | None = None
        self._losses = getattr(client, "disconnect_count", 0)

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
