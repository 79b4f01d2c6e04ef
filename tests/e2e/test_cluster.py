"""A three-node NATS cluster the fleet fails over across (docs/deployment.md
"NATS cluster"; PROTOCOL §10 broker loss, §13 MQTT_BROKER fail-over list, §17).

The nodes are configured and started by what `mam-orch init --cluster` writes and prints
(harness/cluster.py), one per network namespace; hub, runners and the wire tap use the
fail-over list `nats-1,nats-2,nats-3`. Each node in turn is SIGKILLed while a job runs on
each runner, then restarted (same store), and the next dies only once every node reports
healthy again (a rolling restart's rule: a node that has not caught up leaves no quorum when
a second one goes; docs/deployment.md): every job completes once (0 lost,
0 run twice), and after all three were restarted and `mam-orch gc --reclear` ran (nats-server
may bring cleared retained messages back after a SIGKILL, also in a cluster: the count is
printed), no node hands a cleared dispatch to a new subscriber. The time from the kill to
the clients' reconnects is printed (`CLUSTER fail-over ...`): the target is 5 s; it is a
figure, not a timed assertion (JetStream's leader election alone takes 4-9 s).

Needs root (namespaces): skips with the reason otherwise.
"""

from __future__ import annotations

import re
import subprocess
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import pytest
from harness.cluster import NODES, ClusterFleet
from harness.fleet import AGENTS, Dispatch
from harness.netns import unavailable_reason
from harness.waiting import PATIENCE_S, wait_until

pytestmark = [pytest.mark.broker, pytest.mark.e2e]

SHELL_AGENT = AGENTS / "shell-agent"
SESSIONS = ("gpu-box", "cpu-box")
HEARTBEAT_S = 10
MISSES = 6
"""K × N = 60 s (the default is 120 s): longer than the 5-25 s a 3-node cluster on two shared
cores takes to elect new JetStream leaders after losing a node (PUBACKs stall, and nodes may
fail new connections meanwhile), so the hub's clock does not close a job whose runner is
between nodes (docs/deployment.md)."""
CONTRACT = ("--heartbeat", str(HEARTBEAT_S), "--heartbeat-misses", str(MISSES),
            "--ack-timeout", str(int(PATIENCE_S)))
JOB_S = 6
"""Length of each job, seconds (the agent sleeps that long after its marker line)."""
FAULT_AT_S = 2.0
"""How far into the jobs (after the hub saw both `started`) the node dies, seconds."""
JOB_PATIENCE_S = 3 * PATIENCE_S + JOB_S
"""How long each dispatch may take to end after its node was killed, seconds: the one deadline
the test waits on. A fresh-clone `make test` once saw the two remaining nodes refuse
subscriptions and PUBACKs for more than 70 s after a kill on two busy cores, so the bound
is generous; a dispatch ends as soon as its job is in (nothing waits this long otherwise)."""
BRIEF = 'echo "$MAM_SESSION $MAM_JOB_ID $MAM_ATTEMPT_ID $$" >> "$MARKS"\nsleep ' + str(JOB_S) + "\n"
RECONNECT_TARGET_S = 5.0
PROBE_INTERVAL_S = 1.0
"""Pause between two probes of the three nodes' retained dispatches (each probe is a client)."""
STAMP = r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) "
RECONNECTED = re.compile(STAMP + r"mam\.mqtt INFO reconnected to ", re.M)
LINK = re.compile(STAMP + r"mam\.\w+ \w+ (?:runner \S+ serving session \S+ \(.*?\) on (nats-\d):"
                  r"|reconnected to (nats-\d):|connection to (nats-\d):\d+ lost)", re.M)
"""A runner's log lines that change its link: its first connect, a reconnect (to node 2 or 3)
and a lost connection (node 4): the node it is connected to follows from the last of them."""


@pytest.fixture
def cluster_fleet(tmp_path: Path) -> Iterator[ClusterFleet]:
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"the cluster test needs network namespaces: {reason}")
    handle = ClusterFleet(tmp_path)
    try:
        yield handle
    finally:
        for session, runner in handle.runners.items():  # kept next to the nodes' logs
            (tmp_path / f"runner-{session}.log").write_text(runner.log())
        handle.close()
    assert not handle.tagged_pids(), "a process of the fleet outlived close()"


def epoch(stamp: str) -> float:
    return datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def reconnects_after(log: str, moment: float) -> list[float]:
    """Seconds from `moment` (epoch) to each "reconnected to" line of a client's log after it."""
    times = [epoch(stamp) for stamp in RECONNECTED.findall(log)]
    return [t - moment for t in times if t >= moment]


def node_at(log: str, moment: float | None = None) -> str | None:
    """The node a runner was connected to at `moment` (epoch; None: now) by its log, or None
    while it was between nodes: a node may drop its clients while the cluster re-elects, so
    the last "reconnected to" line alone may name a node the runner already left."""
    node = None
    for stamp, first, again, lost in LINK.findall(log):
        if moment is not None and epoch(stamp) > moment:
            break
        node = None if lost else (first or again)
    return node


def tails(runners: list) -> str:
    return "\n".join(f"--- {r.name}\n{r.log()[-3000:]}" for r in runners)


def started_on_hub(run: Dispatch, fleet: ClusterFleet, runners: list) -> None:
    """Wait until the dispatch saw its job's `started` event; on failure, say why with every log."""
    try:
        wait_until(lambda: run.events("started") or not run.alive(), PATIENCE_S, f"{run.name}: started on the hub")
        assert run.events("started"), f"{run.name} exited {run.proc.returncode}"
    except AssertionError as exc:
        nodes = "\n".join(f"--- {node}\n{fleet.node_log(node)[-1500:]}" for node in NODES)
        raise AssertionError(f"{exc}\n--- {run.name}\n{run.log()[-3000:]}\n{tails(runners)}\n{nodes}") from None


@pytest.mark.timeout(900)
def test_cluster_each_node_sigkilled_in_turn_nothing_lost_nothing_twice_cleared_stays_cleared(
        cluster_fleet: ClusterFleet, tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    fleet = cluster_fleet
    marks_file = tmp_path / "marks"
    runners = [fleet.start_runner(session, SHELL_AGENT, env={"MARKS": str(marks_file)}) for session in SESSIONS]
    jobs: list[tuple[str, str]] = []
    figures: dict[str, str] = {}
    healthy: dict[str, str] = {}
    fleet.wait_cluster_healthy(NODES[0])
    for _ in NODES:
        runs = {session: fleet.dispatch(session, BRIEF, *CONTRACT) for session in SESSIONS}
        for run in runs.values():
            started_on_hub(run, fleet, runners)
        time.sleep(FAULT_AT_S)  # the fault's own timing, not a wait for something observable
        # the next victim: a node not killed yet, preferring the one most runners are on now
        left = [node for node in NODES if node not in figures]
        node = max(left, key=lambda candidate: sum(node_at(r.log()) == candidate for r in runners))
        killed_at = time.time()
        fleet.kill_node(node)
        for session, run in runs.items():
            try:
                code = run.wait(JOB_PATIENCE_S)
            except subprocess.TimeoutExpired:
                code = None  # still running: the failure below carries its log and the runners'
            assert code == 0, (f"{node} killed; the dispatch {'still runs' if code is None else f'exited {code}'}: "
                               f"{run.log()[-3000:]}\n{tails(runners)}\n--- {node}\n{fleet.node_log(node)[-1500:]}")
            jobs.append((session, run.job_id()))
        # every runner connected to the node when it died reconnects to another one (by the
        # runners' own logs; a job may have ended before its runner's reconnect)
        on_it = [r for r in runners if node_at(r.log(), killed_at) == node]
        try:
            wait_until(lambda: all(reconnects_after(r.log(), killed_at) for r in on_it), PATIENCE_S,
                       f"every runner on {node} to reconnect to another node")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{tails(on_it)}") from None
        delays = [min(reconnects_after(r.log(), killed_at)) for r in on_it]
        figures[node] = f"{max(delays):.1f}s" if delays else "no runner on it"
        fleet.start_node(node)
        restarted_at = time.monotonic()
        fleet.wait_node_ready(node)
        # a rolling restart takes the next node down only once the cluster is healthy again
        fleet.wait_cluster_healthy(node)
        healthy[node] = f"{time.monotonic() - restarted_at:.1f}s"
    with capsys.disabled():
        shown = " ".join(f"{node}={figure}" for node, figure in figures.items())
        print(f"\nCLUSTER fail-over (SIGKILL of a node -> every runner reconnected): {shown} "
              f"(target {RECONNECT_TARGET_S:g} s); restart -> cluster healthy: "
              f"{' '.join(f'{node}={figure}' for node, figure in healthy.items())}")

    marks = [line.split() for line in marks_file.read_text().splitlines()]
    for session, job_id in jobs:
        assert fleet.runner_record(session, job_id)["status"] == "completed"
        assert fleet.hub_record(job_id)["status"] == "completed"
        assert [m for m in marks if m[1] == job_id] == [[session, job_id, "1", m[3]] for m in marks
                                                        if m[1] == job_id][:1], f"{job_id} ran more than once"
    assert len(marks) == len(jobs) == len(NODES) * len(SESSIONS)
    # every node was SIGKILLed and restarted once. nats-server (2.15) may bring cleared retained
    # dispatches back on some nodes (docs/deployment.md): runners refuse them (each job ran once,
    # above), and `mam-orch gc --reclear`, the documented step after an unclean restart, clears
    # them on every node (it publishes each clear through every node in turn)
    dispatches = f"{fleet.topic_root}/jobs/+/dispatch"
    stale = {node: len(fleet.retained_on(node, dispatches)) for node in NODES}
    reclear = fleet.orch("gc", "--reclear")
    assert reclear.returncode == 0, reclear.stderr
    # each node drops a cleared message from its cache when its stream consumer sees the clear
    after: dict[str, list[str]] = {}

    def all_cleared() -> bool:
        after.update({node: fleet.retained_on(node, dispatches) for node in NODES})
        return after == {node: [] for node in NODES}

    try:
        wait_until(all_cleared, PATIENCE_S, "every node to hand out no cleared dispatch",
                   interval_s=PROBE_INTERVAL_S)
    finally:
        with capsys.disabled():
            print(f"CLUSTER cleared dispatches back after the restarts: {stale}; after gc --reclear: "
                  f"{ {node: len(topics) for node, topics in after.items()} }")
