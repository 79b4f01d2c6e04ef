"""mam-fleet beside Celery + Redis, the same work on both sides, in one interleaved run
(`make bench`; Celery needs the `bench` extra and Debian's `redis-server`, else it skips).

The work: every job spawns `bash -s` reading `true` (mam: `mam-runner run --exec "bash -s"`,
which writes the brief, `true`, to the agent's stdin; Celery: a task that runs the same
command). The same number of slots, N = 8: one runner `--max-jobs 8` against one prefork
worker `--concurrency 8` (`acks_late`, prefetch 1). Both submitted in this process, from one
client each: `mam.Hub.dispatch` with `job.wait()` (a real `mam-orch serve`, nats-server), and
`apply_async` with `.get()`.

- Latency: job by job, alternating sides: submit -> started (mam: the `started` event's
  arrival on the broker, stamped by one subscriber; Celery: the task's first line), and
  submit -> done (`job.wait()` / `.get()` returns). One clock, CLOCK_MONOTONIC.
- Throughput: rep by rep, alternating sides, THROUGHPUT_JOBS submitted at once: jobs/s, lost,
  run twice; CPU per job of every process of the side (mam: serve, the runner and its agents,
  nats-server, this client; Celery: the worker and its children, redis-server, this client),
  and the same split by process (each with its descendants) for the side's cheapest rep.
- Worker memory: PSS of the runner's processes against the worker's, idle after the run.
- Floors measured in the same run: one MQTT QoS 1 hop (publish -> delivery back through
  nats-server), one Redis round trip (PING), one spawn of `bash -s` reading `true`.

The machine's load is printed before and after each phase; a phase that began or ended with
a load over HIGH_LOAD_PER_CORE per core runs again once. `MAM_BENCH_WRITE_README=1` writes
the table, its date and load into README.md between its `side-by-side` markers: that table
is never edited by hand. Goals (issue text, "Performance"): submit -> started and -> done
p50 <= 3x Celery's, throughput >= 0.5x, CPU per job <= 3x, worker PSS <= 0.5x; the bench
prints which are met and asserts only what must always hold: nothing lost, nothing run twice.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psutil
import pytest
from bench_queue import nats, start_serve, stop  # noqa: F401 - a fixture
from benchkit import CONNECT_TIMEOUT_S, KEEPALIVE_S, WireClock, percentile
from harness.runnersim import MAM_RUNNER, hub_workspace, retained
from harness.waiting import PATIENCE_S, wait_until
from harness.workspace import clean_env, write_env_for
from paho.mqtt import client as paho
from paho.mqtt.enums import CallbackAPIVersion

from mam import Hub
from mam.shared.config import read_env_file
from mam.shared.protocol import names

SLOTS = 8
LABEL = "side"
LATENCY_JOBS = int(os.environ.get("MAM_BENCH_LATENCY_JOBS", "40"))
"""Jobs per side in the latency phase (alternating one by one)."""
THROUGHPUT_JOBS = int(os.environ.get("MAM_BENCH_THROUGHPUT_JOBS", "300"))
THROUGHPUT_REPS = 2
"""Reps per side in the throughput phase (alternating)."""
HIGH_LOAD_PER_CORE = 0.75
SETTLE_S = 120.0
"""How long a phase waits for the load of the phase before it to decay, seconds."""
SETTLE_LOOK_S = 2.0
FLOOR_SAMPLES = 50
JOB_TIMEOUT_S = 120.0
BENCH_TIMEOUT_S = 1800
ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MARK_START, MARK_END = "<!-- side-by-side:start -->", "<!-- side-by-side:end -->"

CELERY_APP = '''
import subprocess, time
from celery import Celery
app = Celery("side", broker="redis://127.0.0.1:{port}/0", backend="redis://127.0.0.1:{port}/1")
app.conf.update(task_acks_late=True, worker_prefetch_multiplier=1)

@app.task
def spawn():
    started = time.monotonic()
    subprocess.run(["bash", "-s"], input=b"true", check=True)
    return started
'''


# ------------------------------------------------------------------ the two sides

@dataclass
class Side:
    """One side's processes (CPU and memory are read from them) and its submit-and-wait calls."""

    name: str
    procs: list[psutil.Process]
    worker: psutil.Process
    run_one: Callable[[], tuple[float, float, float]]
    """Submit one job and wait for it: (submitted, started, done), CLOCK_MONOTONIC seconds."""
    run_many: Callable[[int], tuple[int, int]]
    """Submit n jobs at once, wait for all: (ended right, run twice)."""
    latency: list[tuple[float, float]] = field(default_factory=list)
    rates: list[float] = field(default_factory=list)
    cpu_per_job_s: list[float] = field(default_factory=list)
    cpu_split_s: dict[str, float] = field(default_factory=dict)
    """CPU per job of each process of `procs` (with its descendants) in the best rep, seconds."""


def tree_cpu_s(procs: list[psutil.Process]) -> float:
    """CPU seconds used so far by `procs`, their live descendants and their reaped children."""
    total = 0.0
    seen: set[int] = set()
    for root in procs:
        for proc in [root, *_children(root)]:
            if proc.pid in seen:
                continue
            seen.add(proc.pid)
            try:
                times = proc.cpu_times()
            except psutil.Error:
                continue
            total += times.user + times.system + times.children_user + times.children_system
    return total


def proc_name(proc: psutil.Process) -> str:
    """A short name for a side's process in the CPU split: its command's first words."""
    try:
        words = [os.path.basename(word) for word in proc.cmdline()[:4]]
    except psutil.Error:
        return str(proc.pid)
    name = " ".join(word for word in words if not word.startswith("-") and "python" not in word)
    return " ".join(name.split())[:40]  # a process title may be padded with spaces


def _children(proc: psutil.Process) -> list[psutil.Process]:
    try:
        return proc.children(recursive=True)
    except psutil.Error:
        return []


def tree_pss_mb(proc: psutil.Process) -> float:
    """PSS of `proc` and its descendants, MB."""
    total = 0
    for each in [proc, *_children(proc)]:
        try:
            total += each.memory_full_info().pss
        except psutil.Error:
            continue
    return total / (1024 * 1024)


def start_runner(broker: Any, workspace: Path) -> subprocess.Popen[bytes]:
    """`mam-runner run --exec "bash -s" --max-jobs SLOTS`, once its presence is online."""
    (workspace / ".git").mkdir(parents=True, exist_ok=True)
    write_env_for(broker, workspace)
    with open(workspace.parent / "runner.stderr", "wb") as err:
        proc = subprocess.Popen([*MAM_RUNNER, "run", "--session", "side-box", "--exec", "bash -s", "--max-jobs",
                                 str(SLOTS), "--labels", LABEL, "--workspace", str(workspace)],
                                env=clean_env(MAM_LOG_LEVEL="WARNING"), stdout=subprocess.DEVNULL, stderr=err)
    topic = names.presence_topic("side-box", broker.topic_root)
    wait_until(lambda: proc.poll() is not None or b'"online"' in (retained(broker, topic, 0.3) or b""),
               what="the runner online")
    assert proc.poll() is None, (workspace.parent / "runner.stderr").read_text()
    return proc


def mam_side(api: Hub, clock: WireClock, procs: list[psutil.Process], worker: psutil.Process) -> Side:
    def run_one() -> tuple[float, float, float]:
        submitted = time.monotonic()
        job = api.dispatch("true", labels=[LABEL])
        job.wait(JOB_TIMEOUT_S)
        done = time.monotonic()
        wait_until(lambda: job.id in clock.started, PATIENCE_S, "the started stamp")
        return submitted, clock.started[job.id], done

    def run_many(n: int) -> tuple[int, int]:
        jobs = [api.dispatch("true", labels=[LABEL]) for _ in range(n)]
        outcomes = [job.wait(JOB_TIMEOUT_S) for job in jobs]
        records = [api.registry.get(job.id) for job in jobs]
        right = sum(o.status == "completed" for o in outcomes)
        return right, sum(r["attempt_id"] != 1 for r in records)

    return Side("mam-fleet", procs, worker, run_one, run_many)


@pytest.fixture
def celery(tmp_path: Path) -> Iterator[Side | str]:
    """The Celery + Redis side, or why it cannot run here."""
    redis_server = shutil.which("redis-server")
    try:
        __import__("celery")
        __import__("redis")
    except ImportError:
        yield "skipped (celery[redis] not installed: pip install -e '.[bench]')"
        return
    if redis_server is None:
        yield "skipped (no redis-server: apt-get install redis-server)"
        return
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    folder = tmp_path / "celery"
    folder.mkdir()
    (folder / "sideapp.py").write_text(CELERY_APP.format(port=port))
    redis = subprocess.Popen([redis_server, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                              "--appendonly", "no", "--dir", str(folder)], stdout=subprocess.DEVNULL)
    env = {**clean_env(), "PYTHONPATH": str(folder)}
    with open(folder / "worker.stderr", "wb") as err:
        worker = subprocess.Popen([sys.executable, "-m", "celery", "-A", "sideapp", "worker", "--concurrency",
                                   str(SLOTS), "--pool", "prefork", "-O", "fair", "--loglevel", "WARNING",
                                   "--without-gossip", "--without-mingle", "--without-heartbeat"],
                                  cwd=folder, env=env, stdout=subprocess.DEVNULL, stderr=err)
    sys.path.insert(0, str(folder))
    try:
        import sideapp  # type: ignore[import-not-found]

        sideapp.spawn.apply_async().get(timeout=JOB_TIMEOUT_S)  # the worker is up

        def run_one() -> tuple[float, float, float]:
            submitted = time.monotonic()
            started = sideapp.spawn.apply_async().get(timeout=JOB_TIMEOUT_S)
            return submitted, started, time.monotonic()

        def run_many(n: int) -> tuple[int, int]:
            results = [sideapp.spawn.apply_async() for _ in range(n)]
            return sum(isinstance(r.get(timeout=JOB_TIMEOUT_S), float) for r in results), 0

        yield Side("Celery + Redis", [psutil.Process(worker.pid), psutil.Process(redis.pid)],
                   psutil.Process(worker.pid), run_one, run_many)
    finally:
        sys.path.remove(str(folder))
        sys.modules.pop("sideapp", None)
        stop(worker, redis)


# ------------------------------------------------------------------ floors and load

def _floor_client(values: dict[str, str], name: str) -> paho.Client:
    client = paho.Client(CallbackAPIVersion.VERSION2, client_id=f"side-floor-{name}-{os.getpid()}")
    client.username_pw_set(values["MQTT_USERNAME"], values["MQTT_PASSWORD"])
    client.connect(values["MQTT_BROKER"], int(values["MQTT_PORT"]), KEEPALIVE_S)
    client.loop_start()
    return client


def mqtt_hop_s(values: dict[str, str]) -> float:
    """Median of FLOOR_SAMPLES QoS 1 messages from one paho client to another through the broker."""
    arrived, subscribed = threading.Event(), threading.Event()
    receiver, sender = _floor_client(values, "in"), _floor_client(values, "out")
    receiver.on_message = lambda *_args: arrived.set()
    receiver.on_subscribe = lambda *_args: subscribed.set()
    topic = f"{values['MAM_TOPIC_ROOT']}/bench/floor"
    try:
        receiver.subscribe(topic, qos=1)
        assert subscribed.wait(CONNECT_TIMEOUT_S), "the floor client did not subscribe"
        hops = []
        for _ in range(FLOOR_SAMPLES):
            arrived.clear()
            start = time.monotonic()
            sender.publish(topic, b"x", qos=1)
            assert arrived.wait(CONNECT_TIMEOUT_S), "the floor message did not arrive"
            hops.append(time.monotonic() - start)
        return statistics.median(hops)
    finally:
        for client in (receiver, sender):
            client.disconnect()
            client.loop_stop()


def redis_hop_s(port_url: str) -> float:
    import redis  # the bench extra

    client = redis.Redis.from_url(port_url)
    hops = []
    for _ in range(FLOOR_SAMPLES):
        start = time.monotonic()
        client.ping()
        hops.append(time.monotonic() - start)
    client.close()
    return statistics.median(hops)


def spawn_s() -> float:
    spawns = []
    for _ in range(FLOOR_SAMPLES):
        start = time.monotonic()
        subprocess.run(["bash", "-s"], input=b"true", check=True)
        spawns.append(time.monotonic() - start)
    return statistics.median(spawns)


def load_1m() -> float:
    return os.getloadavg()[0]


def settled_load(high: float) -> float:
    """Wait (at most SETTLE_S) for the 1-minute load to drop to `high`; the load then."""
    deadline = time.monotonic() + SETTLE_S
    while load_1m() > high and time.monotonic() < deadline:
        time.sleep(SETTLE_LOOK_S)  # the load average's own pace: nothing to be told by
    return load_1m()


def phase(name: str, run: Callable[[], None], notes: list[str]) -> None:
    """Run a phase once the machine's load (1 min) settled under HIGH_LOAD_PER_CORE a core;
    again, once, when it had not (other work ran beside it). The load after a phase is
    mostly the phase's own."""
    high = HIGH_LOAD_PER_CORE * (os.cpu_count() or 1)
    for attempt in (1, 2):
        before = settled_load(high)
        run()
        notes.append(f"{name}{' (again)' if attempt == 2 else ''}: load {before:.2f} -> {load_1m():.2f}")
        if before <= high:
            return


# ------------------------------------------------------------------ the bench

def ratio_line(figure: str, ours: float, theirs: float, unit: str, goal: str | None = None,
               met: bool = False) -> str:
    """One row: both figures, ours / theirs, and the goal (None: none) and whether it is met."""
    ratio = ours / theirs if theirs else float("inf")
    verdict = "" if goal is None else f"{goal}: {'met' if met else 'not met'}"
    return f"| {figure} | {ours:.{1 if unit != 'ms' else 0}f} {unit} | {theirs:.1f} {unit} | {ratio:.2f}x | {verdict} |"


@pytest.mark.timeout(BENCH_TIMEOUT_S)
def test_side_by_side_with_celery_and_redis(nats, tmp_path, celery, monkeypatch):  # noqa: F811 - the fixture
    if isinstance(celery, str):
        pytest.skip(celery)
    for key in [k for k in os.environ if k.startswith(("MQTT_", "MAM_")) and not k.startswith("MAM_BENCH")]:
        monkeypatch.delenv(key)
    hub = hub_workspace(nats, tmp_path)
    values = read_env_file(hub / ".mam.env")
    runner = start_runner(nats, tmp_path / "runner")
    serve = start_serve(hub)
    clock = WireClock(values)
    notes: list[str] = []
    try:
        with Hub(workspace=hub, embedded=False) as api:
            mam = mam_side(api, clock, [psutil.Process(serve.pid), psutil.Process(runner.pid),
                                        psutil.Process(nats.proc.pid), psutil.Process()],
                           psutil.Process(runner.pid))
            celery.procs.append(psutil.Process())
            mam.run_one()  # warm both sides up: imports, connections, first spawns
            celery.run_one()
            sides = (mam, celery)

            def latency() -> None:
                for side in sides:
                    side.latency.clear()
                for _ in range(LATENCY_JOBS):
                    for side in sides:
                        submitted, started, done = side.run_one()
                        side.latency.append((started - submitted, done - submitted))

            def throughput() -> None:
                for side in sides:
                    side.rates.clear()
                    side.cpu_per_job_s.clear()
                for _ in range(THROUGHPUT_REPS):
                    for side in sides:
                        split_before = [tree_cpu_s([proc]) for proc in side.procs]
                        cpu_before, start = tree_cpu_s(side.procs), time.monotonic()
                        right, twice = side.run_many(THROUGHPUT_JOBS)
                        elapsed, cpu = time.monotonic() - start, tree_cpu_s(side.procs) - cpu_before
                        if not side.cpu_per_job_s or cpu / THROUGHPUT_JOBS < min(side.cpu_per_job_s):
                            split = {proc_name(proc): (tree_cpu_s([proc]) - before) / THROUGHPUT_JOBS
                                     for proc, before in zip(side.procs, split_before, strict=True)
                                     if proc.pid != os.getpid()}
                            # this client's tree holds the side's other processes: its own share is the rest
                            side.cpu_split_s = {**split, "client": cpu / THROUGHPUT_JOBS - sum(split.values())}
                        assert (right, twice) == (THROUGHPUT_JOBS, 0), f"{side.name}: {right} right, {twice} twice"
                        side.rates.append(THROUGHPUT_JOBS / elapsed)
                        side.cpu_per_job_s.append(cpu / THROUGHPUT_JOBS)

            phase("latency", latency, notes)
            phase("throughput", throughput, notes)
            floors = (mqtt_hop_s(values), redis_hop_s(celery_url(tmp_path)), spawn_s())
            pss = (tree_pss_mb(mam.worker), tree_pss_mb(celery.worker))
    finally:
        clock.close()
        stop(serve, runner)
    table = render(mam, celery, floors, pss, notes)
    print("\n" + table)
    if os.environ.get("MAM_BENCH_WRITE_README") == "1":
        write_readme(table)


def celery_url(tmp_path: Path) -> str:
    app = (tmp_path / "celery" / "sideapp.py").read_text()
    found = re.search(r"redis://127\.0\.0\.1:(\d+)/", app)
    assert found is not None
    return f"redis://127.0.0.1:{found.group(1)}/2"


def render(mam: Side, celery: Side, floors: tuple[float, float, float], pss: tuple[float, float],
           notes: list[str]) -> str:
    """The side-by-side table (markdown) with its date, load notes and floors."""
    def p(side: Side, which: int, pct: float) -> float:
        return percentile([pair[which] for pair in side.latency], pct) * 1000

    rows = [
        "| figure | mam-fleet | Celery + Redis | ratio | goal |",
        "|---|---|---|---|---|",
        ratio_line("submit -> started, p50", p(mam, 0, 50), p(celery, 0, 50), "ms", "<= 3x",
                   p(mam, 0, 50) <= 3 * p(celery, 0, 50)),
        ratio_line("submit -> started, p99", p(mam, 0, 99), p(celery, 0, 99), "ms"),
        ratio_line("submit -> done, p50", p(mam, 1, 50), p(celery, 1, 50), "ms", "<= 3x",
                   p(mam, 1, 50) <= 3 * p(celery, 1, 50)),
        ratio_line(f"throughput, {THROUGHPUT_JOBS} jobs, best of {THROUGHPUT_REPS}", max(mam.rates),
                   max(celery.rates), "jobs/s", ">= 0.5x", max(mam.rates) >= 0.5 * max(celery.rates)),
        ratio_line("CPU per job, every process of the side", min(mam.cpu_per_job_s) * 1000,
                   min(celery.cpu_per_job_s) * 1000, "ms", "<= 3x",
                   min(mam.cpu_per_job_s) <= 3 * min(celery.cpu_per_job_s)),
        ratio_line(f"worker memory (PSS), {SLOTS} slots", pss[0], pss[1], "MB", "<= 0.5x", pss[0] <= 0.5 * pss[1]),
    ]
    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    return "\n".join([
        f"Measured {when} by `make bench` (bench/bench_side_by_side.py), {os.cpu_count()} cores; "
        f"{LATENCY_JOBS} jobs a side for latency, job by job alternating; N = {SLOTS}; each job spawns "
        f"`bash -s` reading `true`.",
        "",
        *rows,
        "",
        f"Floors in the same run: one MQTT QoS 1 hop {floors[0] * 1000:.2f} ms, one Redis round trip "
        f"{floors[1] * 1000:.2f} ms, one spawn of `bash -s` {floors[2] * 1000:.2f} ms. "
        f"Load (1 min): {'; '.join(notes)}.",
        "",
        *[f"CPU per job by process, {side.name}: "
          + ", ".join(f"{name} {cpu * 1000:.1f} ms" for name, cpu in side.cpu_split_s.items()) + "."
          for side in (mam, celery)],
    ])


def write_readme(table: str) -> None:
    """Replace what is between README's side-by-side markers with `table`."""
    text = README.read_text()
    start, end = text.index(MARK_START) + len(MARK_START), text.index(MARK_END)
    README.write_text(text[:start] + "\n" + table + "\n" + text[end:])
