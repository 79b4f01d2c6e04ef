"""An attempt's lease, the runner's side (PROTOCOL §10 "Leases"): self-fencing.

The runner holds each running attempt under a lease of L = the contract's `idle_timeout_sec`
(K × N unless given), the silence after which the hub may close the attempt and retry it
elsewhere. A beat renews the lease when the broker acknowledges it (its PUBACK), from the
moment the beat was *sent*: the hub cannot have accepted a beat before it was sent, so the
runner's lease never ends later than the hub's view of it. The runner fences itself at L −
margin after the last acknowledged beat: the attempt's agent is stopped (SIGKILL of its
cgroup or process group, by the deadman helper, `deadman.py`, so a frozen or partitioned
daemon fences too) and the attempt ends `error` with `data.lease_lost`, reported when the
connection returns. The hub waits the whole L from the last message it accepted, so the two
agents of one job never run at once: the margin covers stopping the agent and the two
clocks' rate drift over L.

Times are on CLOCK_BOOTTIME (seconds): one clock for the daemon and its helper, and a host
that sleeps counts the sleep, as the hub does.

    leases = Leases(margin_s=None, on_renew=switch.renew)
    until = leases.hold("918b0612-1", lease_s=120.0, since=now())  # None: too short to fence
    leases.renew("918b0612-1", sent_at)   # a beat sent at `sent_at` was acknowledged
    leases.lapsed("918b0612-1")           # True once `until` has passed
    leases.release("918b0612-1")          # the attempt ended
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger("mam.daemon")

MARGIN_SHARE = 0.25
"""The default margin's share of the lease."""
MARGIN_CAP_S = 10.0
"""The default margin at most, seconds: stopping an agent's tree takes well under it."""
MARGIN_FLOOR_S = 0.5
"""The default margin at least, seconds."""
DETAIL_LEASE_LOST = "lease_lost"
"""The first word of a fenced attempt's terminal detail (§10 "Leases")."""


def now() -> float:
    """CLOCK_BOOTTIME, seconds: monotonic, shared by every process of the host, counts sleep."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


def margin_for(lease_s: float, margin_s: float | None) -> float:
    """The fencing margin of a lease of `lease_s` seconds: `margin_s` (MAM_LEASE_MARGIN_S) when
    set, else a quarter of the lease between MARGIN_FLOOR_S and MARGIN_CAP_S; never over half
    the lease."""
    chosen = margin_s if margin_s is not None else min(MARGIN_CAP_S, max(MARGIN_FLOOR_S, lease_s * MARGIN_SHARE))
    return min(chosen, lease_s / 2)


def renewable(lease_s: float, margin_s: float, heartbeat_s: float) -> bool:
    """Whether beats every `heartbeat_s` can renew the lease before it ends (L − margin > N):
    a shorter one would fence every attempt, so it is not enforced (§10 "Leases")."""
    return lease_s - margin_s > heartbeat_s


def lease_detail(lease_s: float, margin_s: float) -> str:
    """The terminal detail of a fenced attempt."""
    return (f"{DETAIL_LEASE_LOST}: no beat acknowledged by the broker for {lease_s - margin_s:g} s "
            f"(lease {lease_s:g} s less a {margin_s:g} s margin); the agent was stopped so the hub "
            "can run the job elsewhere")


@dataclass
class _Held:
    lease_s: float
    margin_s: float
    until: float


class Leases:
    """The leases of one runner daemon's attempts, keyed `<job_id>-<attempt>` (thread-safe).

    Args:
        margin_s: MAM_LEASE_MARGIN_S, None for the default (`margin_for`).
        on_renew: told `(key, until)` of each renewal (the deadman helper enforces it).
        clock: CLOCK_BOOTTIME (tests pass their own).
    """

    def __init__(self, *, margin_s: float | None, on_renew: Callable[[str, float], None],
                 clock: Callable[[], float] = now) -> None:
        self.margin_s = margin_s
        self.on_renew = on_renew
        self.clock = clock
        self._held: dict[str, _Held] = {}
        self._lock = threading.Lock()

    def hold(self, key: str, *, lease_s: float, heartbeat_s: float, since: float) -> float | None:
        """Hold `key` under a lease of `lease_s` from `since` (before its `started` went out).

        Returns:
            the moment it fences (CLOCK_BOOTTIME), or None when beats every `heartbeat_s`
            cannot renew it in time (`renewable`): said once, and the attempt is not fenced.
        """
        margin = margin_for(lease_s, self.margin_s)
        if not renewable(lease_s, margin, heartbeat_s):
            log.warning("job %s: its lease (idle_timeout_sec %g s, less a %g s margin) is not longer than a "
                        "beat period (%g s): the runner does not fence it", key, lease_s, margin, heartbeat_s)
            return None
        held = _Held(lease_s, margin, since + lease_s - margin)
        with self._lock:
            self._held[key] = held
        return held.until

    def renew(self, key: str, sent_at: float) -> None:
        """A beat of `key` sent at `sent_at` was acknowledged: the lease runs L − margin from then."""
        with self._lock:
            held = self._held.get(key)
            if held is None or not math.isfinite(sent_at):
                return
            until = sent_at + held.lease_s - held.margin_s
            if until <= held.until:
                return
            held.until = until
        self.on_renew(key, until)

    def until(self, key: str) -> float | None:
        """When the lease of `key` ends unless renewed (CLOCK_BOOTTIME), or None (not held)."""
        with self._lock:
            held = self._held.get(key)
        return held.until if held else None

    def lapsed(self, key: str) -> bool:
        """True once the lease of `key` has ended unrenewed (the attempt is fenced)."""
        with self._lock:
            held = self._held.get(key)
        return held is not None and self.clock() >= held.until

    def detail(self, key: str) -> str:
        """The terminal detail of `key` fenced (`lease_detail`)."""
        with self._lock:
            held = self._held.get(key)
        return lease_detail(held.lease_s, held.margin_s) if held else DETAIL_LEASE_LOST

    def release(self, key: str) -> None:
        """The attempt of `key` ended: its lease no longer matters."""
        with self._lock:
            self._held.pop(key, None)


__all__ = ["DETAIL_LEASE_LOST", "Leases", "lease_detail", "margin_for", "now", "renewable"]
