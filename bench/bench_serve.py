"""One `mam-orch serve` tracking N concurrent jobs whose runners beat every 1 s
(run with `make bench`; `MAM_BENCH_SERVE_JOBS=10000 MAM_BENCH_SERVE_BEAT_S=30` for the
scale of 10,000 open jobs beating at the default contract's period).

The hub side is the real service process. The runners are `SIM_PROCESSES`
simulator processes (`serve_sim.py`), each publishing, for its share of the
jobs, signed events and states as a real runner does: `started`, a heartbeat
every `BEAT_S` for `BEAT_WINDOW_S`, then `completed`, the jobs one after another
over `END_SPREAD_S` (`MAM_BENCH_SERVE_SPREAD_S`, default 10; 0: all in the same second)
while the others beat on. Printed next to the floors:
RSS (≤ 200 MB), average CPU over the beating window (≤ 1 core), false
`deadline_timeout`s (0), and terminal mirror latency (≤ 1 s: from the
simulator's terminal publish to the hub's status.json in place, its ctime: a
service pass writes the file first and renames it at the pass's end).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from benchkit import load_note, percentile
from harness.brokers import NatsBroker
from harness.runnersim import MAM_ORCH, hub_env, hub_workspace
from harness.waiting import wait_until
from harness.workspace import clean_env

from mam.orchestrator.hublock import service_pid
from mam.shared.protocol import wire
from mam.shared.store.registry import Registry

JOBS = int(os.environ.get("MAM_BENCH_SERVE_JOBS", "1000"))
SIM_PROCESSES = 4
BEAT_S = float(os.environ.get("MAM_BENCH_SERVE_BEAT_S", "1"))  # 30 with 10,000 jobs: the default contract's beat
BEAT_WINDOW_S = max(20.0, 3 * BEAT_S)  # seconds every job beats; CPU is averaged over it and the ending spread
END_SPREAD_S = float(os.environ.get("MAM_BENCH_SERVE_SPREAD_S", "10"))  # the jobs end one after another over this long
HEARTBEAT_MISSES = 4  # the idle window K × N = 4 s: a service lagging that long closes jobs falsely
ACK_TIMEOUT_S = 600
FLOOR_RSS_MB = 200.0 if JOBS <= 1000 else 300.0  # 300 MB for 10,000 open jobs
FLOOR_CPU_CORES, FLOOR_FALSE_TIMEOUTS, FLOOR_MIRROR_S = 1.0, 0, 1.0
BYTES_PER_MB = 1024 * 1024
SIM_DONE_S = 300.0  # a simulator that has not finished by then failed
SIM_SCRIPT = Path(__file__).resolve().parent / "serve_sim.py"


@pytest.fixture
def nats(tmp_path):
    handle = NatsBroker(tmp_path / "nats").start()
    yield handle
    handle.stop()


def test_serve_tracks_1000_beating_jobs(nats, tmp_path):
    hub = hub_workspace(nats, tmp_path)
    registry = Registry(hub)
    contract = wire.Contract(heartbeat_sec=int(BEAT_S), heartbeat_misses=HEARTBEAT_MISSES,
                             ack_timeout_sec=ACK_TIMEOUT_S)
    jobs = [registry.register(session=f"sim-{n % SIM_PROCESSES}", contract=contract)["job_id"] for n in range(JOBS)]
    log_path = tmp_path / "serve.stderr"
    with open(log_path, "wb") as err:
        serve = subprocess.Popen([*MAM_ORCH, "serve", "--workspace", str(hub)], env=clean_env(MAM_LOG_LEVEL="WARNING"),
                                 stdout=subprocess.DEVNULL, stderr=err)
    sims: list[subprocess.Popen[bytes]] = []
    try:
        proc = psutil.Process(serve.pid)
        wait_until(lambda: serve.poll() is not None or service_pid(hub) == serve.pid, what="the service up")
        assert serve.poll() is None, log_path.read_text()
        sims = [subprocess.Popen([sys.executable, str(SIM_SCRIPT), str(hub), str(k), str(SIM_PROCESSES),
                                  str(tmp_path / f"sim{k}.json"), str(BEAT_S), str(BEAT_WINDOW_S), str(END_SPREAD_S)],
                                 env=hub_env())
                for k in range(SIM_PROCESSES)]
        cpu0, wall0 = proc.cpu_times(), time.monotonic()
        rss_peak = 0
        while any(sim.poll() is None for sim in sims) and time.monotonic() - wall0 < SIM_DONE_S:
            rss_peak = max(rss_peak, proc.memory_info().rss)
            time.sleep(BEAT_S)
        cpu1, wall1 = proc.cpu_times(), time.monotonic()
        assert all(sim.returncode == 0 for sim in sims)
        wait_until(lambda: all(registry.get(job)["status"] in ("completed", "error") for job in jobs),
                   SIM_DONE_S, "every job closed at the hub")
        sent: dict[str, float] = {}
        for k in range(SIM_PROCESSES):
            sent.update(json.loads((tmp_path / f"sim{k}.json").read_text()))
        latencies = [os.stat(registry.logs_dir(job) / "status.json").st_ctime - sent[job] for job in jobs
                     if registry.get(job)["status"] == "completed"]
        false_timeouts = sum(registry.get(job).get("close_reason") == "deadline_timeout" for job in jobs)
        cores = ((cpu1.user + cpu1.system) - (cpu0.user + cpu0.system)) / (wall1 - wall0)
        rss_mb = rss_peak / BYTES_PER_MB
        p99, worst = (percentile(latencies, 99), max(latencies)) if latencies else (math.inf, math.inf)
        print(f"\nserve with {JOBS} jobs beating every {BEAT_S:g} s, ending over {END_SPREAD_S:g} s ({load_note()}):\n"
              f"  RSS peak          {rss_mb:7.1f} MB   (floor <= {FLOOR_RSS_MB:g} MB)\n"
              f"  CPU average       {cores:7.2f} cores (floor <= {FLOOR_CPU_CORES:g})\n"
              f"  false timeouts    {false_timeouts:7d}      (floor {FLOOR_FALSE_TIMEOUTS})\n"
              f"  terminal mirrored p99 {p99:.3f} s, max {worst:.3f} s (floor <= {FLOOR_MIRROR_S:g} s)")
        assert false_timeouts == FLOOR_FALSE_TIMEOUTS
        assert rss_mb <= FLOOR_RSS_MB and cores <= FLOOR_CPU_CORES and worst <= FLOOR_MIRROR_S
    finally:
        for sim in sims:
            if sim.poll() is None:
                sim.kill()
        serve.terminate()
        serve.wait(SIM_DONE_S)


