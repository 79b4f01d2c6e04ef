"""Speed targets (run with `make bench`, never by CI).

- `mam-runner publish` end to end (process start, disk, one connection, event
  + state) stays under 0.5 s at the median: agents call it often.
- decode + HMAC verify of an event: at least 5,000 per second on one core.
"""

from __future__ import annotations

import statistics
import subprocess
import time

import pytest
from harness.brokers import NatsBroker
from harness.jobkit import MAM_RUNNER, JobPair

from mam.shared.protocol import crypto, wire


@pytest.fixture
def nats(tmp_path):
    handle = NatsBroker(tmp_path / "nats").start()
    yield handle
    handle.stop()


def test_publish_cli_median_under_half_a_second(nats, tmp_path):
    pair = JobPair(nats, tmp_path / "job")
    assert pair.publish("started").returncode == 0
    timings = []
    for i in range(20):
        start = time.perf_counter()
        result = pair.publish("progress", "--detail", f"step {i}")
        timings.append(time.perf_counter() - start)
        assert result.returncode == 0, result.stderr
    median = statistics.median(timings)
    print(f"\npublish CLI: median {median * 1000:.0f} ms, max {max(timings) * 1000:.0f} ms")
    assert median < 0.5


def test_publish_cli_import_time(tmp_path):
    result = subprocess.run([*MAM_RUNNER, "--version"], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0
    start = time.perf_counter()
    for _ in range(5):
        subprocess.run([*MAM_RUNNER, "--version"], capture_output=True, timeout=30)
    per_call = (time.perf_counter() - start) / 5
    print(f"\nmam-runner --version: {per_call * 1000:.0f} ms per call")
    assert per_call < 0.4


def test_decode_and_verify_rate():
    token = "k" * 43
    event = crypto.sign_event(wire.Event.build("918b0612", 7, "progress", "tests pass", attempt_id=1,
                                               dispatch_token="0" * 32, data={"n": 1}).to_dict(), token)
    raw = wire.encode(event)
    count = 5000
    start = time.perf_counter()
    for _ in range(count):
        crypto.verify_event(wire.decode(raw, "event").to_dict(), token)
    rate = count / (time.perf_counter() - start)
    print(f"\ndecode+verify: {rate:,.0f} events/s")
    assert rate > 5000
