"""Lost runner → attempt 2 `started` elsewhere (PROTOCOL §10 "Leases", §14 Retries), on
loopback with a real nats-server, two real runner daemons serving label `x`, `mam-orch serve`
and a `--retries 1` label job (`make bench`; never in CI's `make test`).

Each round kills the runner that holds attempt 1 with SIGKILL (its deadman helper stops the
agent at once, §6), then times the kill → the hub's record of attempt 2 `running` on the other
runner, and starts the killed runner again for the next round. The hub may retry only once the
attempt's lease L = K × N has passed since the last message it accepted, so the figure is about
L less the time since the last beat, plus the retry's placement and take.

Contracts: `--heartbeat 2 --heartbeat-misses 3` (L = 6 s; goal ≤ 10 s) always; the default
contract (L = 120 s; goal ≤ 30 s, which it cannot meet) only with MAM_BENCH_DEFAULT_CONTRACT=1,
as each of its rounds takes two minutes. Prints p50 and p99 and the load; the asserts only
guard that the rounds happened.
"""

from __future__ import annotations

import os
import time

import pytest
from benchkit import load_note, percentile
from harness.fleet import AGENTS, Fleet
from harness.waiting import wait_until

ROUNDS = 10
SESSIONS = ("gpu-box", "cpu-box")
BRIEF = "sleep 600\n"
CONTRACTS = {"--heartbeat 2 --heartbeat-misses 3": ("--heartbeat", "2", "--heartbeat-misses", "3")}
if os.environ.get("MAM_BENCH_DEFAULT_CONTRACT") == "1":
    CONTRACTS["default (30 s x 4)"] = ()


@pytest.fixture
def fleet(tmp_path):
    handle = Fleet("loopback", tmp_path)
    yield handle
    handle.close()


@pytest.mark.parametrize("contract", list(CONTRACTS))
def test_lost_runner_to_attempt_2_started_elsewhere(fleet: Fleet, contract: str):
    for session in SESSIONS:
        fleet.start_runner(session, AGENTS / "shell-agent", "--labels", "x")
    fleet.serve()
    figures: list[float] = []
    for _ in range(ROUNDS):
        run = fleet.dispatch(None, BRIEF, *CONTRACTS[contract], "--retries", "1", labels="x")
        job_id = run.job_id()
        wait_until(lambda: fleet.hub_record(job_id)["status"] == "running", 120, "attempt 1 running")
        holder = fleet.hub_record(job_id)["session"]
        time.sleep(1.0)  # past the start: a beat or two accepted, as in a real run
        killed_at = time.monotonic()
        fleet.runners[holder].kill9()
        wait_until(lambda: (r := fleet.hub_record(job_id))["attempt_id"] == 2 and r["status"] == "running",
                   300, "attempt 2 running elsewhere")
        figures.append(time.monotonic() - killed_at)
        assert fleet.hub_record(job_id)["session"] != holder
        fleet.orch("cancel", job_id)
        run.wait(120)
        fleet.start_runner(holder, AGENTS / "shell-agent", "--labels", "x", "--replace")
    print(f"\nlost runner -> attempt 2 started elsewhere, {contract}: p50 {percentile(figures, 50):.1f} s, "
          f"p99 {percentile(figures, 99):.1f} s; {ROUNDS} kills; {load_note()}")
    assert len(figures) == ROUNDS
