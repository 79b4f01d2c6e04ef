"""How fast one `mam-orch serve` mirrors a burst of terminals (docs/benchmarks.md
"A pass puts each record in place once"). Not a test: run it by hand,

    .venv/bin/python bench/probe_terminals.py [--jobs 2000] [--py-spy FILE]

It starts a real nats-server and a real `serve` over a hub registry of `--jobs`
jobs, and `SIM_PROCESSES` simulators (`bench/serve_sim.py`) that send each job's
signed `started`, then, all in the same second, its `completed` (no beats in
between). It prints how long `serve` took from the first terminal sent to the
last record in place (the record's ctime, which its rename sets), terminals a
second, the latency p50 / p99 and `serve`'s CPU (and its kernel share) while it
mirrored them. `--py-spy`
also records `serve` (`py-spy record --threads --idle`, raw format) meanwhile.
`bench/bench_serve.py` measures the same under beats, at the issue's scale, in
2-3 minutes; this takes about 20 s and varies with the machine by ±30 %: compare
two versions only alternated, several times.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "tests")]

import psutil  # noqa: E402
from benchkit import load_note, percentile  # noqa: E402
from harness.brokers import NatsBroker  # noqa: E402
from harness.runnersim import MAM_ORCH, hub_env, hub_workspace  # noqa: E402
from harness.waiting import wait_until  # noqa: E402
from harness.workspace import clean_env  # noqa: E402

from mam.orchestrator.hublock import service_pid  # noqa: E402
from mam.shared.protocol import wire  # noqa: E402
from mam.shared.store.registry import Registry  # noqa: E402

DEFAULT_JOBS = 2000
SIM_PROCESSES = 4
SIM_SCRIPT = HERE / "serve_sim.py"
NO_BEAT_S = 100_000.0  # the simulators' beat period: longer than the probe, so no job beats
STARTED_PER_S = 300.0  # how fast `serve` takes the `started` burst, roughly: the terminals wait for it
SETTLE_S = 6.0
CLOSED_WAIT_S = 300.0


def probe(jobs: int, spy_out: str | None) -> None:
    with tempfile.TemporaryDirectory(prefix="mam-probe-terminals-") as tmp:
        base = Path(tmp)
        broker = NatsBroker(base / "nats").start()
        serve: subprocess.Popen[bytes] | None = None
        try:
            hub = hub_workspace(broker, base)
            registry = Registry(hub)
            contract = wire.Contract(heartbeat_sec=30, heartbeat_misses=4, ack_timeout_sec=600)
            ids = [registry.register(session=f"sim-{n % SIM_PROCESSES}", contract=contract)["job_id"]
                   for n in range(jobs)]
            serve = subprocess.Popen([*MAM_ORCH, "serve", "--workspace", str(hub)],
                                     env=clean_env(MAM_LOG_LEVEL="ERROR"),
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            wait_until(lambda: service_pid(hub) == serve.pid, what="the service up")
            proc = psutil.Process(serve.pid)
            window_s = SETTLE_S + jobs / STARTED_PER_S  # the terminals go out this long after start
            sims = [subprocess.Popen([sys.executable, str(SIM_SCRIPT), str(hub), str(k), str(SIM_PROCESSES),
                                      str(base / f"sim{k}.json"), str(NO_BEAT_S), str(window_s), "0"],
                                     env=hub_env())
                    for k in range(SIM_PROCESSES)]
            time.sleep(max(0.0, window_s - 1.0))
            running = sum(registry.get(job)["status"] == "running" for job in ids)
            cpu0, wall0 = proc.cpu_times(), time.monotonic()
            spy = None
            if spy_out:
                spy = subprocess.Popen([shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy"),
                                        "record", "-r", "100", "-f", "raw", "-o", spy_out, "-p", str(serve.pid),
                                        "--threads", "--idle"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for sim in sims:
                sim.wait(CLOSED_WAIT_S)
            wait_until(lambda: all(registry.get(job)["status"] == "completed" for job in ids), CLOSED_WAIT_S,
                       "every job closed at the hub")
            cpu1, wall1 = proc.cpu_times(), time.monotonic()
            if spy is not None:
                spy.send_signal(signal.SIGINT)
                spy.wait(CLOSED_WAIT_S)
            sent: dict[str, float] = {}
            for k in range(SIM_PROCESSES):
                sent.update(json.loads((base / f"sim{k}.json").read_text()))
            written = {job: os.stat(registry.record_path(job)).st_ctime for job in ids}
            latencies = [written[job] - sent[job] for job in ids]
            span_s = max(written.values()) - min(sent.values())
            cores = ((cpu1.user + cpu1.system) - (cpu0.user + cpu0.system)) / (wall1 - wall0)
            kernel = (cpu1.system - cpu0.system) / (wall1 - wall0)
            print(f"{jobs} terminals ({running} jobs running when they were sent; {load_note()}):\n"
                  f"  mirrored in {span_s:.2f} s: {jobs / span_s:.0f} a second\n"
                  f"  latency p50 {percentile(latencies, 50):.2f} s, p99 {percentile(latencies, 99):.2f} s\n"
                  f"  serve's CPU {cores:.2f} cores, {kernel:.2f} of them in the kernel")
        finally:
            if serve is not None:
                serve.terminate()
                serve.wait(CLOSED_WAIT_S)
            broker.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=DEFAULT_JOBS, help="jobs that end at once (default %(default)s)")
    parser.add_argument("--py-spy", dest="spy", metavar="FILE", help="also record serve with py-spy (raw format)")
    args = parser.parse_args()
    if args.jobs < 1:
        parser.error("--jobs must be at least 1")
    for key in [k for k in os.environ if k.startswith(("MQTT_", "MAM_"))]:
        del os.environ[key]
    probe(args.jobs, args.spy)


if __name__ == "__main__":
    main()
