"""One hub engine (§14 "One hub process"): `mam-orch dispatch` says the same one line, and
exits with the same code, about a job that cannot run, whether `mam-orch serve` runs or
the dispatch runs the engine itself. Real nats-server, a real `mam-runner run`.

The three cases a new user met: a wrong MAM_DISPATCH_SECRET on the hub (the runner's
presence does not verify), a label no runner has, a typo in the session name. A job
that never ran names no runner in what `dispatch` says of its end.
"""

from __future__ import annotations

import json
import logging
import re
import subprocess
import threading
from pathlib import Path

import pytest
from harness import runnersim
from harness.runnersim import MAM_ORCH, SimRunner, hub_env, hub_workspace, orch
from harness.waiting import PATIENCE_S, wait_until

from mam.orchestrator.api import Hub as ApiHub
from mam.orchestrator.hub import open_hub
from mam.orchestrator.hublock import service_pid
from mam.orchestrator.service import EmbeddedService
from mam.shared.store.registry import Registry

pytestmark = [pytest.mark.broker, pytest.mark.e2e, pytest.mark.timeout(6 * PATIENCE_S)]

WRONG_SECRET = "w" * 40  # not the runner's (harness.workspace.TEST_SECRET)
CASES = {
    "wrong-secret": (("--session", "box-x"), {"MAM_DISPATCH_SECRET": WRONG_SECRET},
                     "job JOB: runner box-x is online but its presence signature does not verify with this "
                     "hub's key", 2),
    "unknown-label": (("--labels", "nowhere"), {},
                      "WARNING: job JOB: no runner has ever announced labels=nowhere (job JOB waits for "
                      "labels=nowhere)", 2),
    "unknown-session": (("--session", "box-typo"), {},
                        "job JOB: session box-typo has announced no presence: dispatching now (v1)", 1),
}


def _dispatch(hub: Path, target: tuple[str, ...], *, serve: bool) -> tuple[int, str]:
    server = None
    if serve:
        server = subprocess.Popen([*MAM_ORCH, "serve", "--workspace", str(hub)], env=hub_env(),
                                  stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_until(lambda: service_pid(hub) is not None or server.poll() is not None, PATIENCE_S,
                   "mam-orch serve to hold the hub lock")
        assert server.poll() is None, "mam-orch serve exited"
    try:
        result = orch(hub, "dispatch", *target, "--brief", "true", "--queue-timeout", "4", "--ack-timeout", "3",
                      "--json")
    finally:
        if server is not None:
            server.terminate()
            server.wait(PATIENCE_S)
    return result.returncode, result.stderr


@pytest.mark.parametrize("case", list(CASES))
def test_the_same_reason_line_and_exit_code_with_and_without_serve(nats_broker, tmp_path, case):
    target, hub_settings, expected, exit_code = CASES[case]
    runner = runnersim.start_runner(nats_broker, tmp_path / "box-x", "box-x")
    try:
        said = {}
        for serve in (False, True):
            hub = hub_workspace(nats_broker, tmp_path / ("served" if serve else "alone"), **hub_settings)
            code, err = _dispatch(hub, target, serve=serve)
            (job_id,) = re.findall(r"queued job ([0-9a-f]{8})", err)
            lines = [line.replace(job_id, "JOB") for line in err.splitlines()]
            assert code == exit_code, err
            reason = [line for line in lines if line.startswith(expected)]
            assert len(reason) == 1, err
            said[serve] = reason[0]
            assert "on runner" not in err, err  # it never ran
        assert said[False] == said[True]
    finally:
        runner.terminate()
        runner.wait(PATIENCE_S)


def test_two_dispatches_without_serve_share_one_engine_and_each_sees_its_whole_job(nats_broker, tmp_path):
    """One runner slot, two `dispatch` processes and no `serve`: the first runs the engine, the
    second follows it and takes it over when the first exits. Each job runs once, in order,
    and each dispatch prints its own job's `started` and `completed` (none lost in the handover)."""
    runner = runnersim.start_runner(nats_broker, tmp_path / "one", "one", "--max-jobs", "1")
    hub = hub_workspace(nats_broker, tmp_path)
    argv = [*MAM_ORCH, "dispatch", "--session", "one", "--brief", "sleep 1", "--json", "--workspace", str(hub)]
    try:
        runs = []
        for _ in range(2):
            runs.append(subprocess.Popen(argv, env=hub_env(), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                         stderr=subprocess.PIPE, text=True))
            wait_until(lambda: service_pid(hub) is not None, PATIENCE_S, "the first dispatch's engine")
        outs = [run.communicate(timeout=3 * PATIENCE_S) for run in runs]
    finally:
        runner.terminate()
        runner.wait(PATIENCE_S)
    for run, (out, err) in zip(runs, outs, strict=True):
        assert run.returncode == 0, err
        events = [json.loads(line)["event"] for line in out.splitlines()]
        assert events[0] == "started" and events[-1] == "completed", (events, err)


def test_a_stopping_engine_hands_over_once_the_job_it_published_started(nats_broker, tmp_path, caplog):
    """`started` is not retained (§3): an embedded engine that stopped while a runner was
    still taking the job it had just published left that `started` to no engine (the test
    above failed so under load, when the stop waited at most 5 s). The stopping engine now
    waits for the start, says which job it waits for, and publishes nothing new meanwhile:
    a job queued then waits for the next engine."""
    caplog.set_level(logging.WARNING, logger="mam")
    taker, other = SimRunner(nats_broker, tmp_path / "taker", "box"), SimRunner(nats_broker, tmp_path / "o", "o")
    root = hub_workspace(nats_broker, tmp_path)
    engine = EmbeddedService(open_hub(root))
    try:
        assert engine.ensure() is True
        taker.presence()
        with ApiHub(root, embedded=False) as api:
            first = api.dispatch("true", session="box").id
            taken = taker.take()  # published by this engine; its `started` not sent yet
            assert taken.dispatch.job_id == first
            other.presence()
            service = engine.service
            assert service is not None
            wait_until(lambda: service.fleet.view("o") is not None, what="the engine to know the other runner")
            stopping = threading.Thread(target=engine.stop, kwargs={"handover": True})  # its own job ended
            stopping.start()
            wait_until(lambda: f"once job {first}, just published, has started" in caplog.text,
                       what="the stopping engine to say what it waits for")
            queued = api.dispatch("true", session="o").id  # wakes the engine, which scans it at once
            wait_until(lambda: queued in service.queued, what="the stopping engine to see the queued job")
            assert stopping.is_alive()  # still waiting for the start
            taker.publish(first, "started")
            stopping.join(PATIENCE_S)
            assert not stopping.is_alive()
            events = [line["event"] for line in api.registry.audit(first) if "seq" in line]
            assert events == ["started"]
            assert api.registry.get(queued)["status"] == "queued"  # left to the next engine
    finally:
        engine.stop()
        taker.close()
        other.close()


def test_a_stopping_engine_waits_for_no_start_from_a_session_that_announced_nothing(nats_broker, tmp_path,
                                                                                   caplog):
    """A job published to a session with no presence (v1, §7) has no runner taking it: an
    engine stopping after its own job ended does not wait out that job's ack timeout."""
    caplog.set_level(logging.WARNING, logger="mam")
    root = hub_workspace(nats_broker, tmp_path)
    engine = EmbeddedService(open_hub(root))
    try:
        assert engine.ensure() is True
        with ApiHub(root, embedded=False) as api:
            ghost = api.dispatch("true", session="ghost").id
            wait_until(lambda: api.registry.get(ghost)["status"] == "pending", what="the job published")
            stopping = threading.Thread(target=engine.stop, kwargs={"handover": True})
            stopping.start()
            stopping.join(PATIENCE_S)  # its ack timeout is 180 s
            assert not stopping.is_alive()
            assert "just published, has started" not in caplog.text
            assert api.registry.get(ghost)["status"] == "pending"  # the next engine judges it
    finally:
        engine.stop()


def test_eight_detached_dispatches_without_serve_to_a_four_slot_runner_all_run(nats_broker, tmp_path):
    """Detached dispatches without `serve` (§14 "One hub process"): a detached job's record used
    to stay `pending` once its dispatch left, counting as in flight for its whole ack timeout,
    so the 5th job to a 4-slot runner waited queued for minutes. Each dispatch's engine reads
    the retained states first: every job is published at once, and each ends `completed`."""
    runner = runnersim.start_runner(nats_broker, tmp_path / "box", "box", "--max-jobs", "4")
    hub = hub_workspace(nats_broker, tmp_path)
    try:
        sent = [orch(hub, "dispatch", "--session", "box", "--detach", "--json", "--brief", "true")
                for _ in range(8)]
        for result in sent:
            assert result.returncode == 0, result.stderr
            assert json.loads(result.stdout)["action"] == "dispatched", result.stdout  # never left queued
        for result in sent:
            job_id = json.loads(result.stdout)["job_id"]
            watched = orch(hub, "watch", job_id, timeout_s=3 * PATIENCE_S)
            assert watched.returncode == 0, watched.stderr
            assert Registry(hub).get(job_id)["status"] == "completed"
    finally:
        runner.terminate()
        runner.wait(PATIENCE_S)
