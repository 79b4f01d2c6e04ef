"""The agent output's delay (PROTOCOL §15): from an agent writing a line to
`mam-orch dispatch` on the hub showing it on a terminal, p95 ≤ 1 s (`make bench`).

A real nats-server, a real runner daemon and a `dispatch` whose stdout is a
pseudo-terminal (its human view, output lines under the events). The agent
writes `tick <CLOCK_MONOTONIC ns>` lines at irregular intervals (the clock is
system-wide on Linux, so the hub side reads the same clock); the bench stamps
each line when the dispatch prints it.
"""

from __future__ import annotations

import os
import pty
import select
import subprocess
import sys
import time

import pytest
from benchkit import load_note, percentile
from harness import runnersim
from harness.brokers import NatsBroker
from harness.runnersim import MAM_ORCH, hub_env, hub_workspace

LINES = 60
BENCH_TIMEOUT_S = 300
TARGET_P95_S = 1.0
READ_BYTES = 65536
POLL_S = 0.5
"""select() timeout while reading the dispatch's terminal, seconds."""
TEARDOWN_S = 30
"""Part of the test's timeout kept for stopping the processes, seconds."""
AGENT = """
import random, sys, time
rng = random.Random(12)
for _ in range({lines}):
    time.sleep(rng.uniform(0.05, 0.7))
    sys.stdout.write("tick %d\\n" % time.monotonic_ns())
    sys.stdout.flush()
"""


@pytest.mark.timeout(BENCH_TIMEOUT_S)
def test_output_delay_agent_line_to_dispatch_terminal(tmp_path):
    broker = NatsBroker(tmp_path / "nats")
    broker.start()
    agent = tmp_path / "ticks.py"
    agent.write_text(AGENT.format(lines=LINES))
    hub = hub_workspace(broker, tmp_path)
    runner = runnersim.start_runner(broker, tmp_path / "runner", "gpu-box")
    master, slave = pty.openpty()
    dispatch = subprocess.Popen([*MAM_ORCH, "dispatch", "--session", "gpu-box", "--brief",
                                 f"{sys.executable} {agent}", "--workspace", str(hub)],
                                env={**hub_env(), "MAM_LOG_LEVEL": "WARNING"}, stdout=slave, stderr=subprocess.DEVNULL)
    os.close(slave)
    delays: list[float] = []
    pending = b""
    try:
        deadline = time.monotonic() + BENCH_TIMEOUT_S - TEARDOWN_S
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], POLL_S)
            if not ready:
                if dispatch.poll() is not None:
                    break
                continue
            try:
                data = os.read(master, READ_BYTES)
            except OSError:  # the dispatch closed its terminal
                break
            seen = time.monotonic_ns()
            pending += data
            *lines, pending = pending.split(b"\n")
            for line in lines:
                words = line.split()
                if len(words) == 3 and words[1] == b"tick":
                    delays.append((seen - int(words[2])) / 1e9)
    finally:
        os.close(master)
        if dispatch.poll() is None:
            dispatch.kill()
        dispatch.wait()
        runner.kill()
        runner.wait()
        broker.stop()
    assert len(delays) == LINES, f"saw {len(delays)} of {LINES} lines"
    p50, p95 = percentile(delays, 50), percentile(delays, 95)
    print(f"\nagent line -> dispatch terminal (loopback, nats): p50 {p50 * 1000:.0f} ms, p95 {p95 * 1000:.0f} ms, "
          f"max {max(delays) * 1000:.0f} ms; target p95 <= {TARGET_P95_S * 1000:.0f} ms; {LINES} lines; "
          f"{load_note()}")
    assert p95 <= TARGET_P95_S
