"""The three speed figures of a job's path, each printed next to its floor measured
in the same run (`make bench`; never in CI's `make test`). docs/benchmarks.md
explains them and where the time goes.

- `mam-runner publish` from inside a running job, with that job's real
  environment (`$MAM_PUBLISH_CMD`, whatever path it takes), median wall time
  vs a minimal paho script (one QoS 1 event + one retained state).
- dispatch → `started` on loopback (real nats-server, real runner daemon,
  trivial agent): p50 and p99, stamped by one hub-side subscriber (§5, §11).
- runner memory: daemon + 32 running jobs, RSS without the agents' trees, vs 100 MB.

Each prints figures and load; the asserts only guard that the runs happened.
"""

from __future__ import annotations

import shlex
import statistics
import subprocess
import time
from pathlib import Path

import psutil
import pytest
from benchkit import AGENTS, BYTES_PER_MB, WireClock, clear_floor_state, load_note, percentile, run_floor
from harness.fleet import AGENTS as EXAMPLE_AGENTS
from harness.fleet import Fleet
from harness.waiting import PATIENCE_S, wait_until

PUBLISH_ROUNDS = 20
DISPATCH_ROUNDS = 60
MEMORY_JOBS = 32
MEMORY_FLOOR_MB = 100.0
DISPATCH_WAIT_S = 30.0
BENCH_TIMEOUT_S = 300


@pytest.fixture
def fleet(tmp_path):
    handle = Fleet("loopback", tmp_path)
    yield handle
    handle.close()


def job_environment(path: Path) -> dict[str, str]:
    """The NUL-separated environment env-agent wrote."""
    entries = [item for item in path.read_bytes().decode().split("\0") if item]
    return dict(item.split("=", 1) for item in entries)


@pytest.mark.timeout(BENCH_TIMEOUT_S)
def test_publish_from_inside_a_job_vs_paho_floor(fleet, tmp_path):
    fleet.start_runner("gpu-box", AGENTS / "env-agent")
    env_file = tmp_path / "job.env"
    run = fleet.dispatch("gpu-box", str(env_file), "--detach")
    wait_until(env_file.exists, PATIENCE_S, "the agent to write its environment")
    job_env = job_environment(env_file)
    argv = shlex.split(job_env["MAM_PUBLISH_CMD"])
    values = fleet.broker_values()
    ours, floor = [], []
    for i in range(PUBLISH_ROUNDS):  # interleaved, so both see the same load
        start = time.perf_counter()
        result = subprocess.run([*argv, "--event", "progress", "--detail", f"bench {i}"], env=job_env,
                                capture_output=True, text=True, timeout=PATIENCE_S)
        ours.append(time.perf_counter() - start)
        assert result.returncode == 0, result.stderr
        floor.append(run_floor(values))
    clear_floor_state(values)
    med, med_floor = statistics.median(ours), statistics.median(floor)
    print(f"\nmam-runner publish inside job {run.job_id()}: median {med * 1000:.0f} ms "
          f"(max {max(ours) * 1000:.0f}) vs paho floor median {med_floor * 1000:.0f} ms "
          f"(max {max(floor) * 1000:.0f}): {med / med_floor:.2f} x; {PUBLISH_ROUNDS} rounds; {load_note()}")


@pytest.mark.timeout(BENCH_TIMEOUT_S)
def test_dispatch_to_started_latency(fleet):
    fleet.start_runner("gpu-box", EXAMPLE_AGENTS / "exit-agent", "--max-jobs", "4")
    clock = WireClock(fleet.broker_values())
    try:
        latencies = []
        for _ in range(DISPATCH_ROUNDS):
            run = fleet.dispatch("gpu-box", "0", "--detach")
            job_id = run.job_id()
            latencies.append(wait_until(lambda: clock.latency_s(job_id), DISPATCH_WAIT_S, f"{job_id} started"))
            run.wait()
    finally:
        clock.close()
    p50, p99 = percentile(latencies, 50), percentile(latencies, 99)
    print(f"\ndispatch -> started (loopback, nats, exit-agent): p50 {p50 * 1000:.1f} ms, "
          f"p99 {p99 * 1000:.1f} ms, max {max(latencies) * 1000:.1f} ms; targets p50 <= 20 ms, p99 <= 50 ms; "
          f"{DISPATCH_ROUNDS} jobs; {load_note()}")


def runner_memory(runner_pid: int, agent_path: str) -> tuple[float, float, int, int]:
    """RSS and PSS (MB) summed over the runner and every descendant outside an agent's tree;
    (RSS, PSS, processes counted, agents seen). RSS counts shared pages once per process."""
    daemon = psutil.Process(runner_pid)
    agents, skipped = 0, set()
    for child in daemon.children():
        try:
            if agent_path in " ".join(child.cmdline()):
                agents += 1
                skipped.add(child.pid)
                skipped.update(p.pid for p in child.children(recursive=True))
        except psutil.Error:
            continue
    counted = [daemon, *(p for p in daemon.children(recursive=True) if p.pid not in skipped)]
    rss = pss = 0
    for proc in counted:
        try:
            info = proc.memory_full_info()
        except psutil.Error:
            continue
        rss += info.rss
        pss += info.pss
    return rss / BYTES_PER_MB, pss / BYTES_PER_MB, len(counted), agents


@pytest.mark.timeout(BENCH_TIMEOUT_S)
def test_runner_memory_with_32_jobs(fleet):
    agent = EXAMPLE_AGENTS / "sleep-agent"
    runner = fleet.start_runner("gpu-box", agent, "--max-jobs", str(MEMORY_JOBS))
    clock = WireClock(fleet.broker_values())
    try:
        idle_mb, idle_pss, _, _ = runner_memory(runner.pid, str(agent))
        for _ in range(MEMORY_JOBS):
            fleet.dispatch("gpu-box", "600", "--detach").job_id()
        wait_until(lambda: clock.count_started() >= MEMORY_JOBS, PATIENCE_S, f"{MEMORY_JOBS} jobs to start")
        # `started` goes out before the agent is spawned (§11 step 3): wait for every agent too
        wait_until(lambda: runner_memory(runner.pid, str(agent))[3] >= MEMORY_JOBS, PATIENCE_S,
                   f"{MEMORY_JOBS} agents to run")
    finally:
        clock.close()
    busy_mb, busy_pss, processes, agents = runner_memory(runner.pid, str(agent))
    assert agents == MEMORY_JOBS
    print(f"\nrunner RSS with {MEMORY_JOBS} running jobs: {busy_mb:.0f} MB (PSS {busy_pss:.0f} MB) over {processes} "
          f"processes, agents excluded, vs floor {MEMORY_FLOOR_MB:.0f} MB; idle daemon {idle_mb:.0f} MB "
          f"(PSS {idle_pss:.0f} MB); {load_note()}")
