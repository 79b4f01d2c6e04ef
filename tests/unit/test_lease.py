"""runner/lease.py (PROTOCOL §10 "Leases"): the runner's side of an attempt's lease. A lease
runs L − margin from the last acknowledged beat's *send*, moves only forward, tells the
deadman helper of each renewal, and a lease no beat can renew in time is not enforced."""

from __future__ import annotations

import math
import time

import pytest

from mam.runner import lease
from mam.runner.lease import Leases

pytestmark = pytest.mark.timeout(30)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.mark.parametrize(("lease_s", "margin_s", "expected"), [
    (120.0, None, 10.0),  # a quarter, capped at 10 s
    (6.0, None, 1.5),
    (1.0, None, 0.5),  # the floor
    (3.0, 2.0, 1.5),  # never over half the lease
    (120.0, 30.0, 30.0),  # MAM_LEASE_MARGIN_S
])
def test_margin(lease_s, margin_s, expected):
    assert lease.margin_for(lease_s, margin_s) == expected


def test_a_lease_runs_from_the_send_of_the_last_acknowledged_beat_and_only_forward():
    clock, renewed = Clock(), []
    leases = Leases(margin_s=None, on_renew=lambda key, until: renewed.append((key, until)), clock=clock)
    assert leases.hold("job-1", lease_s=6.0, heartbeat_s=2, since=1000.0) == 1004.5
    leases.renew("job-1", 1002.0)
    assert leases.until("job-1") == 1006.5 and renewed == [("job-1", 1006.5)]
    leases.renew("job-1", 1001.0)  # an older beat acknowledged late moves nothing back
    leases.renew("job-1", math.nan)
    leases.renew("other-1", 1003.0)  # not held: nothing
    assert leases.until("job-1") == 1006.5 and renewed == [("job-1", 1006.5)]
    clock.t = 1006.4
    assert not leases.lapsed("job-1")
    clock.t = 1006.5
    assert leases.lapsed("job-1")
    assert leases.detail("job-1").startswith("lease_lost: no beat acknowledged by the broker for 4.5 s")
    leases.release("job-1")
    assert not leases.lapsed("job-1") and leases.until("job-1") is None


def test_a_lease_beats_cannot_renew_in_time_is_not_enforced(caplog):
    leases = Leases(margin_s=None, on_renew=lambda key, until: None, clock=Clock())
    assert leases.hold("job-1", lease_s=2.0, heartbeat_s=2, since=0.0) is None  # K = 1: L − margin < N
    assert not leases.lapsed("job-1")
    assert "does not fence it" in caplog.text


def test_the_clock_is_boottime_which_counts_a_suspended_host():
    monotonic = time.monotonic()
    assert lease.now() >= monotonic  # CLOCK_BOOTTIME = CLOCK_MONOTONIC + time suspended
