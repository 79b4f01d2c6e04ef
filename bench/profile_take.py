"""Where the runner's time goes from a dispatch's arrival to `started` on the wire
(docs/benchmarks.md). Not a test: run it by hand,

    .venv/bin/python bench/profile_take.py [--jobs 40] [--cprofile FILE]

It starts a real nats-server, the runner daemon IN this process (a `Runner` on a
thread, `exit-agent`) and a hub-side client that dispatches jobs one at a time
and stamps dispatch and `started` arrivals (`benchkit.WireClock`). Each step of
the take (`admit_dispatch`, the §17 state read, `Registry.mirror`, the agent
file, `publish.record`, the PUBACK waits, every fsync) is wrapped with a timer;
the table prints wall milliseconds per job for each. `--cprofile` also writes a
cProfile of the main loop and the supervisor threads (pstats format).
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import os
import pstats
import statistics
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "tests")]

from benchkit import WireClock, percentile  # noqa: E402
from harness.brokers import NatsBroker  # noqa: E402
from harness.fleet import AGENTS  # noqa: E402
from harness.workspace import TEST_SECRET, write_env_for  # noqa: E402

from mam.orchestrator.dispatch import build_dispatch, publish_dispatch  # noqa: E402
from mam.runner import job, orphans, outbox, publish, service  # noqa: E402
from mam.runner.service import Runner  # noqa: E402
from mam.runner.settings import options_from_cli  # noqa: E402
from mam.runner.trust import V1Trust  # noqa: E402
from mam.shared import config  # noqa: E402
from mam.shared.protocol import crypto  # noqa: E402
from mam.shared.store import fsio, registry  # noqa: E402
from mam.shared.store.registry import Contract, Registry  # noqa: E402
from mam.shared.transport import mqtt  # noqa: E402

DEFAULT_JOBS = 40
STARTED_WAIT_S = 30.0
POLL_S = 0.001
MS_PER_S = 1000.0

totals: dict[str, list[float]] = defaultdict(list)
profilers: list[cProfile.Profile] = []


def timed(owner: Any, attr: str, label: str) -> None:
    """Replace `owner.attr` with a wrapper that adds each call's wall time to `totals[label]`."""
    real = getattr(owner, attr)

    @functools.wraps(real)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            totals[label].append(time.perf_counter() - start)
    setattr(owner, attr, wrapper)


def profiled(owner: Any, attr: str) -> None:
    """Run `owner.attr` under its own cProfile (one per call; merged at the end)."""
    real = getattr(owner, attr)

    @functools.wraps(real)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        prof = cProfile.Profile()
        profilers.append(prof)
        return prof.runcall(real, *args, **kwargs)
    setattr(owner, attr, wrapper)


def instrument(with_cprofile: bool) -> None:
    timed(service, "admit_dispatch", "admit_dispatch (verify, open seal)")
    timed(Runner, "_retained_state", "taken check: state read (SUBACK+UNSUBACK)")
    timed(Registry, "mirror", "Registry.mirror")
    timed(Runner, "_publish_presence", "presence publish (main thread)")
    timed(orphans, "write_agent_file", "orphans.write_agent_file")
    timed(publish, "record", "publish.record")
    timed(publish, "send_on", "publish.send_on (event+state PUBACKs)")
    timed(mqtt.MqttClient, "publish_async", "MqttClient.publish_async (queue)")
    timed(mqtt.MqttClient, "subscribe", "MqttClient.subscribe (SUBACK)")
    timed(mqtt.MqttClient, "unsubscribe", "MqttClient.unsubscribe (UNSUBACK)")
    timed(mqtt.MqttClient, "publish", "MqttClient.publish (PUBACK)")
    timed(outbox, "put", "outbox.put")
    timed(outbox, "acknowledge", "outbox.acknowledge")
    timed(os, "fsync", "os.fsync (all)")
    timed(config, "broker_config", "config.broker_config")
    for module in (registry, outbox, orphans):
        if hasattr(module, "atomic_write"):
            timed(module, "atomic_write", f"atomic_write ({module.__name__.rsplit('.', 1)[-1]})")
    timed(registry, "append_line", "append_line (registry)")
    timed(fsio, "_fsync_dir", "folder fsync")
    if with_cprofile:
        profiled(Runner, "_on_dispatch")
        profiled(job.Supervisor, "_run")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=DEFAULT_JOBS)
    parser.add_argument("--cprofile", metavar="FILE", help="write the merged cProfile stats here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="mam-profile-") as tmp:
        base = Path(tmp)
        broker = NatsBroker(base / "nats").start()
        runner_ws, hub_ws = base / "runner", base / "hub"
        for ws in (runner_ws, hub_ws):
            (ws / ".git").mkdir(parents=True)
            write_env_for(broker, ws)
        values = config.read_env_file(runner_ws / ".mam.env")
        instrument(args.cprofile is not None)
        options = options_from_cli(session="gpu-box", exec_cmd=str(AGENTS / "exit-agent"), workspace=str(runner_ws),
                                   workdir=None, max_jobs=4, once=False, replace=True)
        runner = Runner(options, config=config.broker_config(workspace=runner_ws),
                        trust=V1Trust(crypto.derive_keys(TEST_SECRET)), environ={"PATH": os.environ["PATH"]})
        serving = threading.Thread(target=runner.serve, name="runner", daemon=True)
        serving.start()
        hub = Registry(hub_ws)
        keys = crypto.derive_keys(TEST_SECRET)
        client = mqtt.MqttClient(broker.config(), "hub").connect()
        clock = WireClock(values)
        try:
            _wait(lambda: runner.presence.announced, "the runner to announce itself")
            latencies = []
            for i in range(args.jobs + 1):
                record = hub.register(session="gpu-box", contract=Contract())
                publish_dispatch(client, build_dispatch(record, "0", keys))
                latency = _wait(lambda: clock.latency_s(record["job_id"]), "started")  # noqa: B023
                _wait(lambda: not runner.running, "the job to end")
                if i == 0:  # the first job warms caches and imports: not counted
                    totals.clear()
                    continue
                latencies.append(latency)
        finally:
            clock.close()
            client.close()
            runner.shutdown(STARTED_WAIT_S)
            broker.stop()
    _report(latencies, args.jobs)
    if args.cprofile:
        merged = profilers[0]
        merged.create_stats()
        stats = pstats.Stats(merged)
        for prof in profilers[1:]:
            prof.create_stats()
            stats.add(prof)
        stats.dump_stats(args.cprofile)
        stats.sort_stats("cumulative").print_stats(40)
    return 0


def _wait(predicate: Callable[[], Any], what: str) -> Any:
    deadline = time.monotonic() + STARTED_WAIT_S
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(POLL_S)
    return value


def _report(latencies: list[float], jobs: int) -> None:
    print(f"dispatch -> started over {jobs} jobs: p50 {percentile(latencies, 50) * MS_PER_S:.1f} ms, "
          f"p99 {percentile(latencies, 99) * MS_PER_S:.1f} ms, mean {statistics.mean(latencies) * MS_PER_S:.1f} ms; "
          f"load {os.getloadavg()[0]:.2f}")
    print(f"{'step (whole job, all threads)':58} {'calls/job':>9} {'ms/job':>8}")
    for label, values in sorted(totals.items(), key=lambda item: -sum(item[1])):
        print(f"{label:58} {len(values) / jobs:9.1f} {sum(values) / jobs * MS_PER_S:8.2f}")


if __name__ == "__main__":
    sys.exit(main())
