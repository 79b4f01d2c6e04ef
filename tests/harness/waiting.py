"""Waiting on observable conditions, with one generous deadline for the whole suite.

A test never sleeps for something it can observe: it polls the condition with
`wait_until` until `PATIENCE_S` passes. The deadline only bounds how long a
broken run hangs; a healthy run returns as soon as the condition holds, so a
busy machine (two cores, CPU hogs, parallel helpers) costs time, not failures.
Upper bounds that the protocol guarantees are asserted as orderings or against
the protocol's own bound, never with this deadline.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

PATIENCE_S = 60.0
"""Deadline in seconds for anything observable: a process start, a message, a file, an exit."""

QUIET_S = 1.0
"""How long to listen before concluding that nothing arrives (an absence check: a busy
machine can only make it pass wrongly, never fail; never use it to wait for a presence)."""

POLL_INTERVAL_S = 0.02
"""Pause between two polls of a condition."""


def wait_until(predicate: Callable[[], T], timeout_s: float = PATIENCE_S, what: str = "condition",
               interval_s: float = POLL_INTERVAL_S) -> T:
    """Poll `predicate` until it returns a truthy value, with one monotonic deadline.

    Args:
        predicate: called repeatedly; its first truthy result is returned.
        timeout_s: the deadline in seconds (default PATIENCE_S).
        what: words for the failure message ("the retained state to arrive").
        interval_s: pause between polls.
    Returns:
        the truthy value.
    Raises:
        AssertionError: `timeout_s` passed; the message names `what`.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(interval_s)
